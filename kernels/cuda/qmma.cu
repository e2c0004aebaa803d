/* The small-n tensor-core kernel for quantized weights (INT8, FP8, Q4 with
 * or without min): y(n, rows) = x(n, cols) . W^T for n above the GEMV's
 * crossover and up to LOOM_QM_MAX_N, without the full dequantize-to-bf16
 * pass of the prefill path. The index math and tile decoding are qmma.h's
 * (replayed on the CPU by tests/unit/test_cuda_math.c).
 *
 * A block of 4 warps owns LOOM_QM_BM = 64 rows of W and one k split; per
 * step of 64 columns every thread loads 16 bytes of codes (two loads for
 * 8-bit codes) and NT / 8 float4 of x for the next step while the warps
 * multiply the current one out of shared memory: the codes decoded into a
 * bf16 tile (64 x 64), x narrowed to bf16 (NT x 64), and per warp 4 x NT / 8
 * mma.sync.m16n8k16 with f32 accumulators. INT8 and e4m3 codes enter the
 * tile as they are (exact in bf16) and their row scale multiplies the f32
 * sums; 4-bit codes enter scaled (one rounding to bf16, as the dequantizing
 * path rounds them). With ksplit > 1 each split writes its partial sums to
 * part (ksplit, n, rows) and a second kernel adds them in split order, so
 * results do not depend on scheduling.
 *
 * Napkin math (H200, n = 32, 4096 x 14336 INT8): 58.7 MB of codes read once
 * (~14 us at 4.3 TB/s) against dequantize + cuBLAS's 58.7 MB read + 117 MB
 * written + 117 MB read (~68 us); the tensor work, 2 * 32 * 58.7 M = 3.8
 * GFLOP, is ~4 us of mma.sync at a quarter of the bf16 peak. */
#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/qformat.h"
#include "kernels/cuda/qmma.h"

namespace {

constexpr int kXS = LOOM_QM_BK + LOOM_QM_PAD; /* bf16 per shared-memory row */

__device__ __forceinline__ void mma_bf16(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t word_of(const uint4 &v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

/* One word of e4m3 codes into two bf16 words: the hardware conversion on
 * sm_89+ (e4m3x2 -> f16x2, exact; then f16 -> f32 -> bf16, exact), else
 * qmma.h's software decode. */
__device__ __forceinline__ void fp8_word(uint32_t u, uint32_t *out) {
#if __CUDA_ARCH__ >= 890
    for (int k = 0; k < 2; k++) {
        const unsigned short v = (unsigned short)(u >> (16 * k));
        uint32_t h, r;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
        const float lo = __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
        const float hi = __half2float(__ushort_as_half((unsigned short)(h >> 16)));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        out[k] = r;
    }
#else
    loom_qm_decode_word(LOOM_QD_FP8, 0, u, 1.0f, 0.0f, out);
#endif
}

template <int QK, bool MIN, int NT>
__global__ void __launch_bounds__(LOOM_QM_THREADS)
    qmma_kernel(float *__restrict__ y, float *__restrict__ part, const float *__restrict__ x,
                const uint8_t *__restrict__ q, const float *__restrict__ scales, const float *__restrict__ mins,
                int64_t rows, int64_t cols, int group, int n, int ksplit) {
    constexpr bool Q4 = QK == LOOM_QD_Q4;
    constexpr int LPT = (Q4 ? LOOM_QM_BM * LOOM_QM_BK / 32 : LOOM_QM_BM * LOOM_QM_BK / 16) / LOOM_QM_THREADS;
    constexpr int XPT = NT * (LOOM_QM_BK / 4) / LOOM_QM_THREADS; /* float4 of x per thread */
    constexpr int WPW = Q4 ? 4 : 2;                               /* tile words per code word */
    __shared__ __align__(16) uint32_t ws[LOOM_QM_BM * kXS / 2];
    __shared__ __align__(16) uint32_t xs[NT * kXS / 2];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t row0 = (int64_t)blockIdx.x * LOOM_QM_BM;
    const int split = (int)blockIdx.y;
    const int64_t ksteps = (cols + LOOM_QM_BK - 1) / LOOM_QM_BK;
    int64_t k0, k1;
    loom_qm_split_range(ksteps, ksplit, split, &k0, &k1);
    const int64_t row_bytes = Q4 ? cols / 2 : cols;
    const int64_t gpr = cols / group;

    float acc[NT / 8][4];
#pragma unroll
    for (int j = 0; j < NT / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    uint4 wr[LPT];
    float sr[LPT], mr[LPT]; /* 4-bit: the load's group scale and min (0 past the edges) */
    float4 xr[XPT];
    auto load = [&](int64_t ks) {
#pragma unroll
        for (int l = 0; l < LPT; l++) {
            int r, c;
            loom_qm_load_rc(QK, tid + l * LOOM_QM_THREADS, &r, &c);
            const int64_t gr = row0 + r, gc = ks * LOOM_QM_BK + c;
            const bool in = gr < rows && gc < cols;
            wr[l] = in ? __ldcs(reinterpret_cast<const uint4 *>(q + gr * row_bytes + (Q4 ? gc / 2 : gc)))
                       : make_uint4(0, 0, 0, 0);
            sr[l] = mr[l] = 0.0f;
            if (Q4 && in) {
                sr[l] = __ldg(scales + gr * gpr + gc / group);
                if (MIN) mr[l] = __ldg(mins + gr * gpr + gc / group);
            }
        }
#pragma unroll
        for (int l = 0; l < XPT; l++) {
            const int i = tid + l * LOOM_QM_THREADS, t = i / (LOOM_QM_BK / 4), c = (i % (LOOM_QM_BK / 4)) * 4;
            const int64_t gc = ks * LOOM_QM_BK + c;
            xr[l] = t < n && gc < cols ? __ldg(reinterpret_cast<const float4 *>(x + (int64_t)t * cols + gc))
                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int l = 0; l < LPT; l++) {
            int r, c;
            loom_qm_load_rc(QK, tid + l * LOOM_QM_THREADS, &r, &c);
            const float s = sr[l], m = mr[l];
            uint32_t out[4 * WPW];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if constexpr (QK == LOOM_QD_FP8)
                    fp8_word(word_of(wr[l], j), out + j * WPW);
                else
                    loom_qm_decode_word(QK, MIN, word_of(wr[l], j), s, m, out + j * WPW);
            }
            uint4 *dst = reinterpret_cast<uint4 *>(ws + (r * kXS + c) / 2);
#pragma unroll
            for (int v = 0; v < WPW; v++) dst[v] = make_uint4(out[4 * v], out[4 * v + 1], out[4 * v + 2], out[4 * v + 3]);
        }
#pragma unroll
        for (int l = 0; l < XPT; l++) {
            const int i = tid + l * LOOM_QM_THREADS, t = i / (LOOM_QM_BK / 4), c = (i % (LOOM_QM_BK / 4)) * 4;
            *reinterpret_cast<uint2 *>(xs + (t * kXS + c) / 2) =
                make_uint2(loom_qm_pack(loom_qm_bf16(xr[l].x), loom_qm_bf16(xr[l].y)),
                           loom_qm_pack(loom_qm_bf16(xr[l].z), loom_qm_bf16(xr[l].w)));
        }
    };

    if (k0 < k1) load(k0);
    for (int64_t ks = k0; ks < k1; ks++) {
        store();
        __syncthreads();
        if (ks + 1 < k1) load(ks + 1);
#pragma unroll
        for (int kk = 0; kk < LOOM_QM_BK; kk += 16) {
            uint32_t a[4];
#pragma unroll
            for (int p = 0; p < 4; p++) {
                int r, c;
                loom_qm_a_rc(lane, 2 * p, &r, &c);
                a[p] = ws[((warp * 16 + r) * kXS + kk + c) / 2];
            }
#pragma unroll
            for (int j = 0; j < NT / 8; j++) {
                uint32_t b[2];
#pragma unroll
                for (int p = 0; p < 2; p++) {
                    int k, t;
                    loom_qm_b_kn(lane, 2 * p, &k, &t);
                    b[p] = xs[((j * 8 + t) * kXS + kk + k) / 2];
                }
                mma_bf16(acc[j], a, b);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int j = 0; j < NT / 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r, t;
            loom_qm_c_rn(lane, i, &r, &t);
            const int64_t gr = row0 + warp * 16 + r;
            t += j * 8;
            if (gr >= rows || t >= n) continue;
            if (ksplit > 1)
                part[((int64_t)split * n + t) * rows + gr] = acc[j][i];
            else
                y[(int64_t)t * rows + gr] = Q4 ? acc[j][i] : __ldg(scales + gr) * acc[j][i];
        }
}

/* y(n, rows) = the sum of the splits' partial sums, in split order, times
 * the row scale of 8-bit codes. */
__global__ void qmma_reduce_kernel(float *__restrict__ y, const float *__restrict__ part,
                                   const float *__restrict__ scales, int q4, int64_t rows, int64_t total,
                                   int ksplit) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        float sum = 0.0f;
        for (int s = 0; s < ksplit; s++) sum += part[(int64_t)s * total + i];
        y[i] = q4 ? sum : __ldg(scales + i % rows) * sum;
    }
}

template <int QK, bool MIN, int NT>
cudaError_t launch_nt(float *y, float *part, const float *x, const uint8_t *q, const float *scales, const float *mins,
                      int64_t rows, int64_t cols, int group, int n, int ksplit, cudaStream_t s) {
    const dim3 grid((unsigned)((rows + LOOM_QM_BM - 1) / LOOM_QM_BM), (unsigned)ksplit);
    qmma_kernel<QK, MIN, NT><<<grid, LOOM_QM_THREADS, 0, s>>>(y, part, x, q, scales, mins, rows, cols, group, n,
                                                             ksplit);
    return cudaGetLastError();
}

template <int QK, bool MIN>
cudaError_t launch_q(float *y, float *part, const float *x, const uint8_t *q, const float *scales, const float *mins,
                     int64_t rows, int64_t cols, int group, int n, int ksplit, cudaStream_t s) {
    switch (loom_qm_nt(n)) {
    case 8: return launch_nt<QK, MIN, 8>(y, part, x, q, scales, mins, rows, cols, group, n, ksplit, s);
    case 16: return launch_nt<QK, MIN, 16>(y, part, x, q, scales, mins, rows, cols, group, n, ksplit, s);
    case 32: return launch_nt<QK, MIN, 32>(y, part, x, q, scales, mins, rows, cols, group, n, ksplit, s);
    default: return launch_nt<QK, MIN, 64>(y, part, x, q, scales, mins, rows, cols, group, n, ksplit, s);
    }
}

} /* namespace */

extern "C" int loom_cuda_qmma_fits(int quant, int64_t rows, int64_t cols, int group, int n, const void *x,
                                   const void *q) {
    if (n < 1 || n > LOOM_QM_MAX_N || rows <= 0 || cols <= 0 || group <= 0 || cols % group) return 0;
    if (quant != LOOM_QD_INT8 && quant != LOOM_QD_FP8 && quant != LOOM_QD_Q4) return 0;
    if (cols % loom_qm_width(quant) || (quant == LOOM_QD_Q4 && group % 32)) return 0;
    if ((rows + LOOM_QM_BM - 1) / LOOM_QM_BM > 0x7fffffff) return 0;
    return ((uintptr_t)x & 15u) == 0 && ((uintptr_t)q & 15u) == 0;
}

extern "C" cudaError_t loom_cuda_qmma(float *y, const float *x, const void *q, const float *scales, const float *mins,
                                      int quant, int64_t rows, int64_t cols, int group, int n, int ksplit,
                                      float *part, cudaStream_t s) {
    if (n == 0 || rows == 0) return cudaSuccess;
    if (!loom_cuda_qmma_fits(quant, rows, cols, group, n, x, q)) return cudaErrorInvalidValue;
    if (ksplit < 1 || ksplit > LOOM_QM_MAX_SPLIT || (ksplit > 1 && !part)) return cudaErrorInvalidValue;
    const uint8_t *qb = static_cast<const uint8_t *>(q);
    cudaError_t e;
    switch (quant) {
    case LOOM_QD_INT8:
        e = launch_q<LOOM_QD_INT8, false>(y, part, x, qb, scales, mins, rows, cols, group, n, ksplit, s);
        break;
    case LOOM_QD_FP8:
        e = launch_q<LOOM_QD_FP8, false>(y, part, x, qb, scales, mins, rows, cols, group, n, ksplit, s);
        break;
    default:
        e = mins ? launch_q<LOOM_QD_Q4, true>(y, part, x, qb, scales, mins, rows, cols, group, n, ksplit, s)
                 : launch_q<LOOM_QD_Q4, false>(y, part, x, qb, scales, mins, rows, cols, group, n, ksplit, s);
        break;
    }
    if (e != cudaSuccess || ksplit == 1) return e;
    const int64_t total = (int64_t)n * rows, blocks = (total + 255) / 256;
    qmma_reduce_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, s>>>(y, part, scales,
                                                                                quant == LOOM_QD_Q4, rows, total,
                                                                                ksplit);
    return cudaGetLastError();
}
