/* Launchers of the CUDA backend's kernels, callable from C. Each enqueues its
 * kernels on `s` and returns cudaGetLastError() after the launch, so the
 * caller checks every launch. All pointers are device pointers; activations
 * are float32 row-major as in kernels/backend.h. This header is shared by
 * the C sources and the .cu files, so it uses only plain C types. */
#ifndef LOOM_CUDA_KERNELS_H
#define LOOM_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Storage of half-precision buffers (weights, converted activations) and of
 * the KV cache (F32, BF16, FP8 = e4m3 without scale, I8 = int8 codes with a
 * float32 scale per token and KV head). */
enum { LOOM_CUDA_F32 = 0, LOOM_CUDA_BF16 = 1, LOOM_CUDA_F16 = 2, LOOM_CUDA_FP8 = 3, LOOM_CUDA_I8 = 4 };

/* dst(n) = src(n) narrowed to `kind` (round to nearest even). */
cudaError_t loom_cuda_convert(void *dst, int kind, const float *src, int64_t n, cudaStream_t s);
/* dst(n) = uniform in [lo, hi) from a hash of (seed, index), stored as kind. */
cudaError_t loom_cuda_fill_random(void *dst, int kind, int64_t n, uint64_t seed, float lo, float hi,
                                  cudaStream_t s);

/* Per row of n: when a != NULL, x += a first (x is written back); then
 * y = x / sqrt(mean(x^2) + eps) * g. y may equal x. When y16 != NULL the
 * result is also written there narrowed to kind16 (the next GEMM's input). */
cudaError_t loom_cuda_rmsnorm(float *y, float *x, const float *a, const float *g, void *y16,
                              int kind16, int n, int dim, float eps, cudaStream_t s);
/* y(n) += a(n) */
cudaError_t loom_cuda_add(float *y, const float *a, int64_t n, cudaStream_t s);
cudaError_t loom_cuda_add_bias(float *y, const float *bias, int n, int cols, cudaStream_t s);
/* out(n, hidden) = silu(gu[:, :hidden]) * gu[:, hidden:]; optional narrowed copy in out16. */
cudaError_t loom_cuda_silu_mul(float *out, void *out16, int kind16, const float *gu, int n,
                               int hidden, cudaStream_t s);
/* dst(n, dim) = src[idx[i]] */
cudaError_t loom_cuda_gather_rows(float *dst, const float *src, const int32_t *idx, int n, int dim,
                                  cudaStream_t s);
/* HF rotate-half RoPE in place on n_heads heads of each of n rows (row i at x + i*stride). */
cudaError_t loom_cuda_rope(float *x, int stride, int n, int n_heads, int hd, const int32_t *pos,
                           const float *inv_freq, cudaStream_t s);
/* Paged KV write into a cache of kv_kind (LOOM_CUDA_F32, _BF16, _FP8 or
 * _I8; rounded to nearest even; fp8 divided by its per-tensor scale
 * (fp8_scale: host floats {K, V}, NULL or 0 for 1) and clamped to +-448,
 * the number of clamped values added to *clamped when not NULL; int8 as
 * kernels/cuda/opmath.h, its scales (n_blocks * B, nkv) in k_scale /
 * v_scale, NULL for the other kinds); slots < 0 are skipped. V rows are
 * nkv heads of v_dim (0: hd; decompressed MLA's values are narrower). */
cudaError_t loom_cuda_kv_write(void *k_cache, void *v_cache, int kv_kind, float *k_scale,
                               float *v_scale, const float *fp8_scale, const float *k, const float *v, int stride,
                               const int32_t *slots, int n, int nkv, int hd, int v_dim,
                               unsigned long long *clamped, cudaStream_t s);
/* RoPE on q (nh heads) and k (nkv heads), then the paged write of k and v. */
cudaError_t loom_cuda_rope_kv_write(float *q, float *k, const float *v, int stride, int n, int nh,
                                    int nkv, int hd, const int32_t *pos, const float *inv_freq,
                                    void *k_cache, void *v_cache, int kv_kind, float *k_scale,
                                    float *v_scale, const float *fp8_scale, const int32_t *slots, int v_dim,
                                    unsigned long long *clamped, cudaStream_t s);
/* out(n, hidden) = act(gu[:, :hidden]) * gu[:, hidden:] for act a
 * loom_act_t value (opmath.h's loom_om_act); optional narrowed copy. */
cudaError_t loom_cuda_act_mul(float *out, void *out16, int kind16, const float *gu, int n, int hidden,
                              int act, cudaStream_t s);
/* GPT-OSS's clamped SwiGLU (loom_om_swiglu_clamp) on the same rows. */
cudaError_t loom_cuda_swiglu_clamp(float *out, void *out16, int kind16, const float *gu, int n,
                                   int hidden, float alpha, float limit, cudaStream_t s);
/* x(n) = cap * tanh(x / cap), cap > 0 (Gemma 2's final logit soft cap). */
cudaError_t loom_cuda_softcap(float *x, int64_t n, float cap, cudaStream_t s);

/* Largest n served by the GEMV kernel; larger n go to cuBLAS. */
#define LOOM_CUDA_GEMV_MAX_N 4
/* y(n, rows) = x(n, cols) . W^T for a (rows, cols) row-major W of `kind`,
 * 1 <= n <= LOOM_CUDA_GEMV_MAX_N. Memory-bound: W is read once. variant:
 * rows per warp and loads in flight, 0 <= variant < LOOM_OM_GEMV_VARIANTS
 * (opmath.h's loom_om_gemv_plan; 0 the default), the same bits each. */
cudaError_t loom_cuda_gemv(float *y, const float *x, const void *w, int kind, int64_t rows,
                           int64_t cols, int n, int variant, cudaStream_t s);

/* Mixture of Experts (loom_op_moe_* in kernels/backend.h). route: sel, w
 * (n, k) = top-k of softmax(logits (n, E)), ties to the lower id,
 * renormalised when norm, in ascending expert order; E <= LOOM_CUDA_MOE_MAX_EXPERTS, k <= 32.
 * gemv: y(p, rows) = W_{sel[p]} x(p / xdiv) for n_pairs <= 65535 pairs, W
 * (rows, cols) of `kind` at table[sel[p]] (a device array of E pointers;
 * NULL: zeros). combine: out(t) = [accumulate ? out(t) : 0] + sum_j
 * w[t k + j] y(pos[t k + j]) over pos >= 0. */
#define LOOM_CUDA_MOE_MAX_EXPERTS 1024
cudaError_t loom_cuda_moe_route(const float *logits, int n, int n_experts, int k, int norm,
                                int32_t *sel, float *w, cudaStream_t s);
cudaError_t loom_cuda_moe_gemv(float *y, const float *x, int xdiv, const int32_t *sel, int n_pairs,
                               const void *const *table, int kind, int64_t rows, int64_t cols,
                               cudaStream_t s);
/* DeepSeekMoE's router (worker/moe_ds.h's loom_moe_route_deepseek on the
 * device): sigmoid (or softmax) scores, bias (n_experts, or NULL) added for
 * the choice only, method a loom_ds_topk_t (groups of n_experts / n_group,
 * topk_group kept), weights from the unbiased scores, renormalised when
 * renorm (sigmoid only), times scaling; sel, w (n, k) in ascending expert
 * order. _fits: whether the kernel takes that router (E <= 1024, k <= 32,
 * n_group <= 32, whole groups). */
cudaError_t loom_cuda_moe_route_ds(const float *logits, int n, int n_experts, int k, int sigmoid, int method,
                                   int n_group, int topk_group, int renorm, float scaling, const float *bias,
                                   int32_t *sel, float *w, cudaStream_t s);
int loom_cuda_moe_route_ds_fits(int n_experts, int k, int method, int n_group, int topk_group);
/* y(p, cols) += bias(sel[p], cols) for n_pairs rows (expert biases). */
cudaError_t loom_cuda_moe_add_bias(float *y, const int32_t *sel, int n_pairs, const float *bias, int cols,
                                   cudaStream_t s);
cudaError_t loom_cuda_moe_combine(float *out, const float *y, const int32_t *pos, const float *w,
                                  int n, int k, int dim, int accumulate, cudaStream_t s);

/* Quantized weights in the canonical layout of kernels/quant.h (codes, f32
 * scales and mins (rows, cols / group), mins NULL unless Q4 with min);
 * quant is a loom_quant_t value (LOOM_QD_* in qformat.h). */
/* Largest n the quantized GEMV kernel takes; the backend's crossover to
 * dequantize + cuBLAS is per scheme (measured by bench_gpu --quant-gemv). */
#define LOOM_CUDA_QGEMV_MAX_N 8
#ifndef LOOM_CUDA_QGEMV_MAX_N_8BIT
#define LOOM_CUDA_QGEMV_MAX_N_8BIT 8 /* INT8, FP8 */
#endif
#ifndef LOOM_CUDA_QGEMV_MAX_N_Q4
#define LOOM_CUDA_QGEMV_MAX_N_Q4 8
#endif
/* y(n, rows) = x(n, cols) . W^T, 1 <= n <= LOOM_CUDA_QGEMV_MAX_N; variant:
 * rows per warp and loads in flight, 0 <= variant < LOOM_OM_QGEMV_VARIANTS
 * (opmath.h's loom_om_qgemv_plan; 0 the default), the same bits each. */
cudaError_t loom_cuda_qgemv(float *y, const float *x, const void *q, const float *scales, const float *mins,
                            int quant, int64_t rows, int64_t cols, int group, int n, int variant, cudaStream_t s);
/* The small-n tensor-core kernel (qmma.cu, index math in qmma.h): y(n,
 * rows) = x(n, cols) . W^T for 1 <= n <= LOOM_QM_MAX_N (64), the codes
 * decoded tile by tile into bf16 and multiplied with mma.sync against x
 * narrowed to bf16, f32 accumulation. The backend uses it above the
 * GEMV's crossover up to LOOM_CUDA_QMMA_MAX_N (the tuning table's
 * qmma_max_n), with bf16 weights. ksplit (1..16, qmma.h's loom_qm_ksplit)
 * splits the k range; ksplit > 1 needs part (ksplit * n * rows floats).
 * _fits: whether the kernel takes the shape (cols a multiple of 16, 32 for
 * Q4; x and q 16-byte aligned). */
#ifndef LOOM_CUDA_QMMA_MAX_N
#define LOOM_CUDA_QMMA_MAX_N 0 /* off until a device ran and timed it (tests/gpu/run.sh's tune writes qmma_max_n) */
#endif
int loom_cuda_qmma_fits(int quant, int64_t rows, int64_t cols, int group, int n, const void *x, const void *q);
cudaError_t loom_cuda_qmma(float *y, const float *x, const void *q, const float *scales, const float *mins, int quant,
                           int64_t rows, int64_t cols, int group, int n, int ksplit, float *part, cudaStream_t s);
/* The FP8 prefill GEMM's activations (fp8act.h): per row t of x (n, cols),
 * scales[t] = amax / 448 (1 for a zero row) and q (n, cols) = e4m3(x /
 * scales[t]), nearest even, saturating. */
cudaError_t loom_cuda_fp8_quant_rows(void *q, float *scales, const float *x, int n, int64_t cols, cudaStream_t s);
/* out(r1 - r0, cols) = rows [r0, r1) of W dequantized, stored as kind. */
cudaError_t loom_cuda_dequant(void *out, int kind, const void *q, const float *scales, const float *mins, int quant,
                              int64_t r0, int64_t r1, int64_t cols, int group, cudaStream_t s);
/* dst(bytes) = random codes for `quant` from (seed, index) (benchmarks). */
cudaError_t loom_cuda_fill_codes(void *dst, int quant, int64_t bytes, uint64_t seed, cudaStream_t s);

/* Paged attention (see loom_attn_args_t in kernels/backend.h for the
 * meaning of every field). */
typedef struct loom_cuda_attn {
    int n, n_heads, n_kv_heads, head_dim;
    float scale;
    const float *q;
    int q_stride;
    float *out;
    int out_stride;
    const void *k_cache, *v_cache; /* elements of kv_kind */
    int kv_kind;                   /* LOOM_CUDA_F32, _BF16, _FP8 or _I8 */
    int block_size;
    const int32_t *tok_seq, *tok_pos, *block_tables;
    int max_blocks;
    int window;                    /* > 0: sliding window */
    float softcap;                 /* > 0: logit soft cap */
    const float *sinks;            /* (n_heads) or NULL */
    const float *k_scale, *v_scale; /* I8: (n_blocks * B, n_kv_heads) */
    float fp8_scale[2];             /* FP8: K's and V's per-tensor scales (0: 1) */
    /* tuning (0: the compiled default): key splits are sized for
     * split_waves waves of blocks per SM (2); chunks of tile_min_n tokens
     * or more use the tile kernel (9) */
    int split_waves, tile_min_n;
    /* which kernel takes those chunks (flash.h's LOOM_FA_VARIANT_*): 0 the
     * tile kernel; 1 the FA2-style kernel (flash.cu) where it applies (bf16
     * cache, head_dim 64 or 128, sm_80+: the caller passes 0 below) */
    int prefill_variant;
    /* V's head dim where it is not K's (decompressed MLA: 128 against 192;
     * both at most 256, not with the wide kernel); 0: head_dim */
    int v_dim;
    /* (n, n_heads): max + log(sum) of each softmax's scaled scores, or
     * NULL; not with sinks */
    float *lse;
} loom_cuda_attn_t;

/* Two attention outputs over disjoint keys merged by their log-sum-exp
 * (loom_op_attn_merge): out, lse_run (n * nh rows of vd, of 1) updated
 * with o, lse. */
cudaError_t loom_cuda_attn_merge(float *out, float *lse_run, const float *o, const float *lse, int n, int nh, int vd,
                                 cudaStream_t s);
/* rows(cn, nkv * hd) = K rows of positions [p0, p0 + cn) through the
 * block-table row bt (device), widened to f32: int8 codes times their
 * (slot, head) scales in k_scale, fp8 values times fp8_scale (0: 1)
 * (loom_op_kv_gather). */
cudaError_t loom_cuda_kv_gather(const void *k_cache, int kv_kind, const float *k_scale, float fp8_scale,
                                const int32_t *bt, int block_size, int p0, int cn, int nkv, int hd, float *rows,
                                cudaStream_t s);

/* The launch shape the attention kernels will use. */
typedef struct loom_cuda_attn_plan {
    int tq;             /* rows per query tile: 1 (every token alone) or 64 / group */
    int n_split;        /* key-range splits per unit (flash-decoding) */
    size_t smem;        /* dynamic shared memory of the one-row kernel, bytes */
    size_t smem_tile;   /* ... of the tile kernel (tq > 1) */
    size_t part_floats; /* split partials needed (0 when n_split == 1) */
    int fa2;            /* tq > 1: flash.cu's kernel takes the chunks (smem_tile is its) */
} loom_cuda_attn_plan_t;

/* Raises the kernels' dynamic shared memory limit to the device's opt-in
 * maximum; call once per device before the first launch. */
cudaError_t loom_cuda_attention_init(size_t max_smem_optin);
/* Picks the plan for a call: n_sms and max_smem describe the device,
 * part_cap is how many partial floats the caller can offer. */
loom_cuda_attn_plan_t loom_cuda_attention_plan(const loom_cuda_attn_t *a, int n_sms,
                                               size_t max_smem, size_t part_cap);
/* Runs the plan; `part` holds plan->part_floats floats when n_split > 1. */
cudaError_t loom_cuda_attention(const loom_cuda_attn_t *a, const loom_cuda_attn_plan_t *plan,
                                float *part, cudaStream_t s);

/* Device sampling. One row of parameters per logit row. */
typedef struct loom_cuda_sample_row {
    float inv_t;   /* 1 / temperature (1 for greedy) */
    int mode;      /* loom_sample_mode_t; -1 = nothing to do (k <= 0) */
    int k;         /* candidates to produce (filtered mode) */
    int out_off;   /* first candidate slot of this row in the output */
    uint64_t seed;
    uint64_t step;
} loom_cuda_sample_row_t;

/* Output layout (device): hdr (n_rows, 4) as {max_z, sum_exp, n (int bits),
 * unused}, then ids (total_k int32), then keys (total_k float). */
size_t loom_cuda_sample_scratch_floats(int n_rows, int vocab_shard);
cudaError_t loom_cuda_sample(const float *logits, int n_rows, int vocab_shard, int id_offset,
                             const loom_cuda_sample_row_t *rows, int any_filtered, int any_plain,
                             float *hdr, int32_t *ids, float *keys, float *scratch, cudaStream_t s);

/* LoRA deltas (lora.cu; kernels/backend.h loom_op_lora): y[i] += scale_s
 * (x[i] A_s^T) Bt_s for rows whose row_slot[i] (device) = s in [0, tab.n),
 * A (r, in) and Bt (r, out) device pointers; t is (n, max_r) device
 * workspace. The table is passed by value to the kernels (no host sync,
 * graph-capturable), so it holds at most LOOM_CUDA_LORA_MAX_SLOTS slots. */
#define LOOM_CUDA_LORA_MAX_SLOTS 32
typedef struct loom_cuda_lora_slot {
    const float *a, *bt;
    int r;
    float scale;
} loom_cuda_lora_slot_t;
typedef struct loom_cuda_lora_table {
    loom_cuda_lora_slot_t s[LOOM_CUDA_LORA_MAX_SLOTS];
    int n;
} loom_cuda_lora_table_t;
cudaError_t loom_cuda_lora(float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in, int64_t out,
                           const int32_t *row_slot, const loom_cuda_lora_table_t *tab, int max_r, float *t,
                           cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
