/* The instruction sets the rest of the build was compiled for, read from
 * the compiler's macros. This file gets the build's flags (unlike
 * cpu_check.c, which must run on any x86-64). */
#include "common/cpu_check.h"

const char *loom_cpu_build_features(void) {
    static const char k_features[] = ""
#ifdef __SSE3__
           " sse3"
#endif
#ifdef __SSSE3__
           " ssse3"
#endif
#ifdef __SSE4_1__
           " sse4.1"
#endif
#ifdef __SSE4_2__
           " sse4.2"
#endif
#ifdef __POPCNT__
           " popcnt"
#endif
#ifdef __MOVBE__
           " movbe"
#endif
#ifdef __LZCNT__
           " lzcnt"
#endif
#ifdef __BMI__
           " bmi"
#endif
#ifdef __BMI2__
           " bmi2"
#endif
#ifdef __AVX__
           " avx"
#endif
#ifdef __AVX2__
           " avx2"
#endif
#ifdef __FMA__
           " fma"
#endif
#ifdef __F16C__
           " f16c"
#endif
#ifdef __AVXVNNI__
           " avxvnni"
#endif
#ifdef __AVX512F__
           " avx512f"
#endif
#ifdef __AVX512CD__
           " avx512cd"
#endif
#ifdef __AVX512DQ__
           " avx512dq"
#endif
#ifdef __AVX512BW__
           " avx512bw"
#endif
#ifdef __AVX512VL__
           " avx512vl"
#endif
#ifdef __AVX512VNNI__
           " avx512vnni"
#endif
#ifdef __AVX512BF16__
           " avx512bf16"
#endif
#ifdef __AVX512IFMA__
           " avx512ifma"
#endif
#ifdef __AVX512VBMI__
           " avx512vbmi"
#endif
#ifdef __AVX512VBMI2__
           " avx512vbmi2"
#endif
#ifdef __AVX512BITALG__
           " avx512bitalg"
#endif
#ifdef __AVX512VPOPCNTDQ__
           " avx512vpopcntdq"
#endif
#ifdef __GFNI__
           " gfni"
#endif
#ifdef __VAES__
           " vaes"
#endif
#ifdef __VPCLMULQDQ__
           " vpclmulqdq"
#endif
        ;
    return k_features[0] ? k_features + 1 : k_features; /* without the leading space */
}
