/* Start-up check of the CPU against the build's instruction sets (cpuid and
 * xgetbv). Compiled for the x86-64 baseline (common/CMakeLists.txt) so that it runs, and
 * can explain, on the CPUs it refuses. */
#include "common/cpu_check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

typedef struct {
    const char *name;
    unsigned leaf, subleaf;
    int reg; /* 0 eax, 1 ebx, 2 ecx, 3 edx */
    int bit;
    unsigned xcr0; /* register state the OS must save (AVX: ymm, AVX-512: zmm too) */
} feature_t;

#define XCR0_AVX 0x6u
#define XCR0_AVX512 0xe6u
static const feature_t k_features[] = {
    {"sse3", 1, 0, 2, 0, 0},          {"ssse3", 1, 0, 2, 9, 0},          {"sse4.1", 1, 0, 2, 19, 0},
    {"sse4.2", 1, 0, 2, 20, 0},       {"popcnt", 1, 0, 2, 23, 0},        {"movbe", 1, 0, 2, 22, 0},
    {"lzcnt", 0x80000001u, 0, 2, 5, 0}, {"bmi", 7, 0, 1, 3, 0},          {"bmi2", 7, 0, 1, 8, 0},
    {"avx", 1, 0, 2, 28, XCR0_AVX},   {"avx2", 7, 0, 1, 5, XCR0_AVX},    {"fma", 1, 0, 2, 12, XCR0_AVX},
    {"f16c", 1, 0, 2, 29, XCR0_AVX},  {"avxvnni", 7, 1, 0, 4, XCR0_AVX}, {"avx512f", 7, 0, 1, 16, XCR0_AVX512},
    {"avx512cd", 7, 0, 1, 28, XCR0_AVX512},   {"avx512dq", 7, 0, 1, 17, XCR0_AVX512},
    {"avx512bw", 7, 0, 1, 30, XCR0_AVX512},   {"avx512vl", 7, 0, 1, 31, XCR0_AVX512},
    {"avx512vnni", 7, 0, 2, 11, XCR0_AVX512}, {"avx512bf16", 7, 1, 0, 5, XCR0_AVX512},
    {"avx512ifma", 7, 0, 1, 21, XCR0_AVX512}, {"avx512vbmi", 7, 0, 2, 1, XCR0_AVX512},
    {"avx512vbmi2", 7, 0, 2, 6, XCR0_AVX512}, {"avx512bitalg", 7, 0, 2, 12, XCR0_AVX512},
    {"avx512vpopcntdq", 7, 0, 2, 14, XCR0_AVX512}, {"gfni", 7, 0, 2, 8, 0},
    {"vaes", 7, 0, 2, 9, XCR0_AVX},   {"vpclmulqdq", 7, 0, 2, 10, XCR0_AVX},
};

static unsigned xcr0(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* no OSXSAVE: no xgetbv */
    unsigned lo, hi;
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0)); /* xgetbv */
    (void)hi;
    return lo;
}

static int cpu_has(const feature_t *f, unsigned os_state) {
    unsigned r[4] = {0};
    unsigned max = __get_cpuid_max(f->leaf & 0x80000000u, NULL);
    if (max < f->leaf) return 0;
    __cpuid_count(f->leaf, f->subleaf, r[0], r[1], r[2], r[3]);
    if (!(r[f->reg] & (1u << f->bit))) return 0;
    return (os_state & f->xcr0) == f->xcr0;
}

static const feature_t *find(const char *name, size_t len) {
    for (size_t i = 0; i < sizeof k_features / sizeof k_features[0]; i++)
        if (strlen(k_features[i].name) == len && !strncmp(k_features[i].name, name, len)) return &k_features[i];
    return NULL;
}
#endif

/* Whether the comma- or space-separated list names the feature (or "all"). */
static int listed(const char *list, const char *name) {
    if (!list) return 0;
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ", ");
        if ((len == 3 && !strncmp(p, "all", 3)) || (len == n && !strncmp(p, name, n))) return 1;
        p += len;
        p += strspn(p, ", ");
    }
    return 0;
}

int loom_cpu_missing_features(char *missing, size_t n) {
    if (n) missing[0] = '\0';
    int count = 0;
#if defined(__x86_64__) || defined(__i386__)
    const char *pretend = getenv("LOOM_CPU_PRETEND_MISSING");
    unsigned os_state = xcr0();
    size_t o = 0;
    for (const char *p = loom_cpu_build_features(); *p;) {
        size_t len = strcspn(p, " ");
        const feature_t *f = find(p, len);
        char name[32];
        snprintf(name, sizeof name, "%.*s", (int)len, p);
        if (f && (!cpu_has(f, os_state) || listed(pretend, name))) {
            int w = snprintf(missing + o, n > o ? n - o : 0, "%s%s", count ? " " : "", name);
            if (w > 0 && o + (size_t)w < n) o += (size_t)w;
            count++;
        }
        p += len;
        p += strspn(p, " ");
    }
#endif
    return count;
}

void loom_cpu_check_or_exit(const char *prog) {
    char missing[512];
    if (loom_cpu_missing_features(missing, sizeof missing) == 0) return;
    fprintf(stderr,
            "error: %s was built for a CPU with %s; this CPU lacks %s. Run it on a CPU that has them, or "
            "rebuild on this machine (the default, -DLOOM_NATIVE=ON) or for a lower target "
            "(-DLOOM_NATIVE=OFF with CMAKE_C_FLAGS naming the instruction sets; see docs/operations.md)\n",
            prog, loom_cpu_build_features(), missing);
    exit(1);
}
