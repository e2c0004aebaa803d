/* LoRA deltas for a batch that mixes adapters (kernels/backend.h
 * loom_op_lora): a batched shrink t = scale A_s x (one block per row, a warp
 * per rank index, lanes over the input) and expand y += t Bt_s (a thread per
 * output column). The slots' pointers, ranks and scales travel by value in
 * the kernels' arguments and the row -> slot map is device memory, so the
 * launches need no host synchronisation and a graph can record them.
 *
 * Napkin math, rank 16 on a 4096 x 4096 projection: 2 x 16 x 8192 = 262k
 * FLOPs and 512 KiB of A and Bt per adapter, read once per block of rows
 * through L2; against W's 64 MiB (f32) a decode step reads <1% more. */
#include "kernels/cuda/kernels.h"

namespace {

constexpr int kShrinkThreads = 256, kExpandThreads = 256;

__global__ void lora_shrink_kernel(float *__restrict__ t, const float *__restrict__ x, int64_t ldx, int64_t in,
                                   const int32_t *__restrict__ row_slot, loom_cuda_lora_table_t tab, int max_r) {
    const int i = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int s = row_slot[i];
    if (s < 0 || s >= tab.n) return;
    const loom_cuda_lora_slot_t sl = tab.s[s];
    const float *xi = x + (int64_t)i * ldx;
    for (int k = warp; k < sl.r; k += kShrinkThreads / 32) {
        const float *ak = sl.a + (int64_t)k * in;
        float acc = 0.0f;
        for (int64_t c = lane; c < in; c += 32) acc += ak[c] * xi[c];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) t[(int64_t)i * max_r + k] = sl.scale * acc;
    }
}

__global__ void lora_expand_kernel(float *__restrict__ y, int64_t ldy, int64_t out, const float *__restrict__ t,
                                   const int32_t *__restrict__ row_slot, loom_cuda_lora_table_t tab, int max_r) {
    const int i = blockIdx.y;
    const int64_t o = (int64_t)blockIdx.x * kExpandThreads + threadIdx.x;
    if (o >= out) return;
    const int s = row_slot[i];
    if (s < 0 || s >= tab.n) return;
    const loom_cuda_lora_slot_t sl = tab.s[s];
    const float *ti = t + (int64_t)i * max_r;
    float acc = 0.0f;
    for (int k = 0; k < sl.r; k++) acc += ti[k] * sl.bt[(int64_t)k * out + o];
    y[(int64_t)i * ldy + o] += acc;
}

} /* namespace */

extern "C" cudaError_t loom_cuda_lora(float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in,
                                      int64_t out, const int32_t *row_slot, const loom_cuda_lora_table_t *tab,
                                      int max_r, float *t, cudaStream_t s) {
    if (n <= 0 || tab->n <= 0) return cudaSuccess;
    lora_shrink_kernel<<<n, kShrinkThreads, 0, s>>>(t, x, ldx, in, row_slot, *tab, max_r);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)((out + kExpandThreads - 1) / kExpandThreads), (unsigned)n);
    lora_expand_kernel<<<grid, kExpandThreads, 0, s>>>(y, ldy, out, t, row_slot, *tab, max_r);
    return cudaGetLastError();
}
