/* What the CUDA backend offers beyond the vtable, for its tests and
 * benchmarks: weights generated on the device (an 8B-parameter random model
 * needs no checkpoint) and the device's shape. */
#ifndef LOOM_BACKEND_CUDA_H
#define LOOM_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

/* Allocates a (rows, cols) weight in the backend's storage dtype and fills
 * it with uniform values in [-scale, scale) drawn from a hash of (seed,
 * index). LOOM_ERR_NOMEM when the device is full. */
loom_status_t loom_cuda_weight_random(loom_backend_t *be, loom_weight_t *w, int64_t rows, int64_t cols,
                                      uint64_t seed, float scale, loom_err_t *err);
/* A (rows, cols) quantized weight (spec) with random codes and scales
 * drawn on the device (|w| about `scale` or less): the benchmarks' models.
 * LOOM_ERR_UNSUPPORTED for fp8 on a device older than 8.9. */
loom_status_t loom_cuda_weight_random_quant(loom_backend_t *be, loom_weight_t *w, const loom_quant_spec_t *spec,
                                            int64_t rows, int64_t cols, uint64_t seed, float scale,
                                            loom_err_t *err);
/* dst(n) float32 = uniform in [lo, hi) from (seed, index). */
void loom_cuda_fill_uniform(loom_backend_t *be, float *dst, size_t n, uint64_t seed, float lo, float hi);
/* Streaming multiprocessors of the backend's device. */
int loom_cuda_sm_count(loom_backend_t *be);
/* The quantized GEMV serves n <= this (at most LOOM_CUDA_QGEMV_MAX_N, 8);
 * above, rows are dequantized for cuBLAS. 0: always cuBLAS; -1: the
 * measured per-scheme defaults. For the benchmark's crossover table. */
void loom_cuda_set_qgemv_max_n(loom_backend_t *be, int n);
/* The decode GEMV's variant (the tuning table's gemv_variant; opmath.h's
 * loom_om_gemv_plan); out of range: the default, 0. For tests and benchmarks. */
void loom_cuda_set_gemv_variant(loom_backend_t *be, int variant);
/* The quantized GEMV's (qgemv_variant; loom_om_qgemv_plan). */
void loom_cuda_set_qgemv_variant(loom_backend_t *be, int variant);
/* The quantized small-n tensor-core kernel serves n up to this (at most 64)
 * above the GEMV's crossover; 0: never; -1: LOOM_CUDA_QMMA_MAX_N. */
void loom_cuda_set_qmma_max_n(loom_backend_t *be, int n);
/* FP8 prefill GEMMs through cuBLASLt with x quantized per token (the tuning
 * table's fp8_gemm; kernels/cuda/fp8act.h): 1 on, 0 off (the default).
 * Without cuBLASLt 12.9+ or below sm_89 the old path stays. */
void loom_cuda_set_fp8_gemm(loom_backend_t *be, int on);
/* How many GEMMs went through that path so far (tests). */
uint64_t loom_cuda_fp8_gemm_count(loom_backend_t *be);
/* cuBLASLt's bias epilogue for biased bf16/f16 prefill GEMMs (the tuning
 * table's lt_bias): 1 on, 0 off (the default); and how many GEMMs took it. */
void loom_cuda_set_lt_bias(loom_backend_t *be, int on);
uint64_t loom_cuda_lt_bias_count(loom_backend_t *be);
/* The kernel of prefill chunks (attn_prefill_variant; flash.h's
 * LOOM_FA_VARIANT_*): 0 the tile kernel, 1 the FA2-style kernel where it
 * applies. For tests and benchmarks. */
void loom_cuda_set_attn_prefill_variant(loom_backend_t *be, int variant);
/* Graph statistics: recordings made and replays launched so far. */
void loom_cuda_graph_stats(loom_backend_t *be, uint64_t *recorded, uint64_t *replayed);

#endif
