/* Decoding of quantized weight codes, shared by the CUDA kernels (qgemv.cu)
 * and plain C: every function here is __host__ __device__ under nvcc and a
 * static inline C function elsewhere, so tests/unit/test_qformat.c checks
 * the very code the GPU runs against loom_dequantize_rows on the CPU.
 *
 * The CUDA backend keeps the canonical layout of kernels/quant.h on the
 * device (codes row-major, float32 scales and mins (rows, cols / group)),
 * so the meaning of a code is the one written there. The word decoders take
 * 4 bytes of codes as one little-endian uint32 (byte k = the k-th byte of
 * the row in memory) and avoid integer-to-float conversions, which run at a
 * quarter of the FMA rate: a code c in the low mantissa bits of 2^23 is the
 * float 2^23 + c, and one subtraction gives c exactly. e4m3 bytes become
 * float32 by moving their exponent and mantissa bits into place (the float
 * then holds the value times 2^-120, a denormal for e4m3 subnormals) and
 * one multiplication by 2^120, exact for every finite code. This needs
 * denormals kept (no -ftz, no --use_fast_math). */
#ifndef LOOM_CUDA_QFORMAT_H
#define LOOM_CUDA_QFORMAT_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#ifdef __CUDACC__
#define LOOM_QD static __host__ __device__ __forceinline__
#else
#define LOOM_QD static inline
#endif

/* Quantization kinds as the kernels name them (the values of loom_quant_t). */
enum { LOOM_QD_INT8 = 1, LOOM_QD_Q4 = 2, LOOM_QD_FP8 = 3 };

LOOM_QD float loom_qd_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

#define LOOM_QD_MAGIC      0x4B000000u /* 2^23 */
#define LOOM_QD_MAGIC_F    8388608.0f
#define LOOM_QD_FP8_SCALE  0x1p120f /* 2^120 */

/* Four int8 codes: f[k] = (int8_t)byte k. Flipping the sign bit maps
 * -128..127 to 0..255, so f = (2^23 + code + 128) - (2^23 + 128). */
LOOM_QD void loom_qd_int8x4(uint32_t u, float *f) {
    const uint32_t v = u ^ 0x80808080u;
    for (int k = 0; k < 4; k++)
        f[k] = loom_qd_bits_f32(LOOM_QD_MAGIC | ((v >> (8 * k)) & 0xffu)) - (LOOM_QD_MAGIC_F + 128.0f);
}

/* Eight 4-bit codes, columns in memory order (byte k: column 2k in the low
 * nibble, 2k+1 in the high one): f[j] = nibble j - off (8 for symmetric
 * Q4, 0 with a min). */
LOOM_QD void loom_qd_q4x8(uint32_t u, float off, float *f) {
    const float base = LOOM_QD_MAGIC_F + off;
    for (int j = 0; j < 8; j++) f[j] = loom_qd_bits_f32(LOOM_QD_MAGIC | ((u >> (4 * j)) & 15u)) - base;
}

/* One e4m3 byte (finite codes; 0x7f/0xff, NaN in e4m3, decode as 480). */
LOOM_QD float loom_qd_fp8(uint32_t b) {
    const uint32_t bits = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
    return loom_qd_bits_f32(bits) * LOOM_QD_FP8_SCALE;
}

/* Four e4m3 codes: f[k] = e4m3(byte k). */
LOOM_QD void loom_qd_fp8x4(uint32_t u, float *f) {
    for (int k = 0; k < 4; k++) f[k] = loom_qd_fp8((u >> (8 * k)) & 0xffu);
}

/* The f16 bits of an e4m3 byte, as cvt.rn.f16x2.e4m3x2 (sm_89+) produces
 * them: every finite e4m3 value is exact in f16 (4 significant bits,
 * exponents 2^-9 .. 2^8), so the conversion never rounds. Normal codes
 * move their exponent from bias 7 to bias 15; subnormal ones (exponent
 * field 0, m * 2^-9) are normalised. 0x7f/0xff (NaN) give the f16 NaN
 * 0x7fff (the software decode above gives 480 instead; quantizers never
 * write those codes). */
LOOM_QD uint32_t loom_qd_fp8_f16bits(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 8, e = (b >> 3) & 15u, m = b & 7u;
    if (e == 15u && m == 7u) return 0x7fffu;
    if (e) return sign | (e + 8u) << 10 | m << 7;
    if (!m) return sign;
    /* m * 2^-9 = 2^(p - 9) * (m / 2^p), p the top bit of m */
    const uint32_t p = m >= 4u ? 2u : m >= 2u ? 1u : 0u;
    return sign | (p + 6u) << 10 | ((m << (10u - p)) & 0x3ffu);
}

/* Four e4m3 codes to float32 the fastest way the device has: the
 * hardware conversion on sm_89+ (two codes an instruction, exact: see
 * loom_qd_fp8_f16bits), the software decode elsewhere and on the host.
 * Both give the same floats for every finite code. */
LOOM_QD void loom_qd_fp8x4_fast(uint32_t u, float *f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    for (int k = 0; k < 2; k++) {
        const unsigned short v = (unsigned short)(u >> (16 * k));
        uint32_t h;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
        f[2 * k] = __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
        f[2 * k + 1] = __half2float(__ushort_as_half((unsigned short)(h >> 16)));
    }
#else
    loom_qd_fp8x4(u, f);
#endif
}

/* Element (r, c) of a matrix in the canonical layout, without its scale:
 * the integer code (minus 8 for symmetric Q4) or the e4m3 value. */
LOOM_QD float loom_qd_code(int quant, const uint8_t *q, int64_t cols, int with_min, int64_t r, int64_t c) {
    if (quant == LOOM_QD_Q4) {
        const uint32_t b = q[r * (cols / 2) + c / 2];
        const float code = (float)((b >> ((c & 1) * 4)) & 15u);
        return with_min ? code : code - 8.0f;
    }
    const uint8_t b = q[r * cols + c];
    if (quant == LOOM_QD_INT8) return (float)(int8_t)b;
    return loom_qd_fp8(b);
}

/* s * code + m rounded twice, as the reference computes it (nvcc would
 * otherwise contract it into one fma): dequantized weights are then
 * bit-identical to loom_dequantize_rows. */
LOOM_QD float loom_qd_affine(float s, float code, float m) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(__fmul_rn(s, code), m);
#else
    return s * code + m;
#endif
}

/* Element (r, c) dequantized: scale * code (+ min). */
LOOM_QD float loom_qd_value(int quant, const uint8_t *q, const float *scales, const float *mins, int64_t cols,
                            int group, int64_t r, int64_t c) {
    const int64_t g = r * (cols / group) + c / group;
    const float code = loom_qd_code(quant, q, cols, mins != 0, r, c);
    return mins ? loom_qd_affine(scales[g], code, mins[g]) : scales[g] * code;
}

#endif
