/* The compute backend interface: device memory, weights, and the ops a
 * Llama layer needs. The CPU backend is always built and is the reference;
 * the CUDA backend plugs in behind the same calls. All pointers passed to
 * ops are device pointers obtained from loom_backend_alloc (host memory for
 * the CPU backend); activations are float32, row-major.
 *
 * Shapes use: n = tokens in the step, dim = hidden size, hd = head_dim,
 * nh / nkv = query / KV heads on this shard, B = KV block size. */
#ifndef LOOM_BACKEND_H
#define LOOM_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/quant.h"
#include "kernels/sampling.h"

#define LOOM_BACKEND_CONFIG_VERSION 1

typedef struct loom_backend loom_backend_t;

typedef enum { LOOM_DEVICE_CPU = 0, LOOM_DEVICE_CUDA = 1 } loom_device_kind_t;

typedef struct loom_backend_config {
    int version;             /* LOOM_BACKEND_CONFIG_VERSION */
    loom_device_kind_t kind;
    int device_index;        /* cuda:N */
    int n_threads;           /* CPU threads for ops; 0 = one per online core */
    loom_dtype_t weight_dtype; /* storage of matmul weights: F32 (CPU default), BF16, F16;
                                * CUDA stores F32 requests as BF16 unless exact_f32 */
    int exact_f32;             /* CUDA: keep F32 weights in F32 (exactness tests) */
} loom_backend_config_t;

/* Parses "cpu", "cuda", "cuda:N" into kind/index; 0 if malformed. */
int loom_device_parse(const char *s, loom_device_kind_t *kind, int *index);
/* Whether this build has a backend for `kind` and a device is present. */
int loom_backend_available(loom_device_kind_t kind, int device_index);

/* What a backend can run beyond a plain Llama layer, one bit each. A
 * backend declares its set in its table (kernels/backend_impl.h); a model
 * family computes the set a config needs (worker/engine/arch.h), and
 * loom_model_load refuses a family whose needs the backend lacks, naming
 * the capability. `loom info` prints both sides. */
typedef enum {
    LOOM_CAP_ATTN_WINDOW = 1u << 0,   /* sliding-window attention (loom_attn_args_t.window) */
    LOOM_CAP_ATTN_SOFTCAP = 1u << 1,  /* attention logit soft capping (.softcap) */
    LOOM_CAP_ATTN_SINKS = 1u << 2,    /* attention sinks (.sinks) */
    LOOM_CAP_LOGIT_SOFTCAP = 1u << 3, /* final logit soft capping (loom_op_softcap) */
    LOOM_CAP_ACT = 1u << 4,           /* MLP activations other than SiLU: GeGLU, ReLU, ... (act_mul) */
    LOOM_CAP_SWIGLU_CLAMP = 1u << 5,  /* GPT-OSS's clamped SwiGLU (loom_op_swiglu_clamp) */
    LOOM_CAP_MOE = 1u << 6,           /* Mixture-of-Experts blocks (loom_op_moe_combine) */
    LOOM_CAP_KV_BF16 = 1u << 7,       /* KV cache elements other than F32 (kv_supported) */
    LOOM_CAP_KV_I8 = 1u << 8,
    LOOM_CAP_KV_FP8 = 1u << 9,
    LOOM_CAP_ATTN_WIDE = 1u << 10,    /* attention heads wider than 256 (MLA's latent rows: 576 for DeepSeek-V3) */
    LOOM_CAP_ATTN_HUGE = 1u << 11,    /* attention heads wider than 768 (the CUDA kernels' limit) */
} loom_cap_t;
#define LOOM_CAP_COUNT 12
/* "sliding-window attention"; cap is one bit */
const char *loom_cap_name(uint32_t cap);
/* "attn_window": the key `loom info --json` prints */
const char *loom_cap_key(uint32_t cap);
/* The KV capability a KV element type needs (0 for F32, which every backend has). */
uint32_t loom_cap_kv(loom_dtype_t dtype);
/* The capabilities of this backend. */
uint32_t loom_backend_caps(const loom_backend_t *be);
/* Whether this build has a backend of `kind` (whatever devices are
 * present), and its capabilities (0 when not compiled in). */
int loom_backend_compiled(loom_device_kind_t kind);
uint32_t loom_backend_kind_caps(loom_device_kind_t kind);
/* CUDA devices visible to this process (0 in a build without CUDA). */
int loom_backend_device_count(void);

loom_status_t loom_backend_create(const loom_backend_config_t *cfg, loom_backend_t **out,
                                  loom_err_t *err);
void loom_backend_destroy(loom_backend_t **be_p); /* safe on NULL and twice */
const char *loom_backend_name(const loom_backend_t *be); /* "cpu", "cuda:0" */
loom_device_kind_t loom_backend_kind(const loom_backend_t *be);
int loom_backend_threads(const loom_backend_t *be);
int loom_backend_device_index(const loom_backend_t *be);
/* The backend's compute stream (cudaStream_t) for collectives ordered with
 * its ops; NULL for the CPU backend. */
void *loom_backend_stream(loom_backend_t *be);

/* --- memory ------------------------------------------------------------ */
void *loom_backend_alloc(loom_backend_t *be, size_t bytes); /* NULL when out of memory */
void loom_backend_free(loom_backend_t *be, void *p);
void loom_backend_upload(loom_backend_t *be, void *dst, const void *src, size_t bytes);
void loom_backend_download(loom_backend_t *be, void *dst, const void *src, size_t bytes);
void loom_backend_memset(loom_backend_t *be, void *dst, int value, size_t bytes);
/* Device-to-device copy (KV block copy-on-write). */
void loom_backend_copy(loom_backend_t *be, void *dst, const void *src, size_t bytes);
loom_status_t loom_backend_synchronize(loom_backend_t *be, loom_err_t *err);
/* Bytes of device memory still free (CPU: MemAvailable). */
size_t loom_backend_mem_free(loom_backend_t *be);

/* --- host transfers (the host-memory KV tier) ------------------------- */
/* Host memory that loom_backend_xfer copies to and from (CUDA: pinned,
 * cudaHostAlloc); NULL when out of memory. */
void *loom_backend_host_alloc(loom_backend_t *be, size_t bytes);
void loom_backend_host_free(loom_backend_t *be, void *p);
/* A batch of copies between device memory and loom_backend_host_alloc's
 * memory: begin orders them after the compute stream's work so far, the
 * copies run in order on a transfer stream (cudaMemcpyAsync), end orders
 * the compute stream's later work (attention reading a loaded block, a
 * kernel overwriting a saved one) after them; the host waits for none of
 * it. Backends without a transfer stream (CPU) copy at once. Not while a
 * graph is being captured. */
void loom_backend_xfer_begin(loom_backend_t *be);
void loom_backend_xfer(loom_backend_t *be, void *dst, const void *src, size_t bytes, int to_host);
void loom_backend_xfer_end(loom_backend_t *be);

/* --- weights ----------------------------------------------------------- */
/* A matrix W of shape (rows = out features, cols = in features). Float
 * weights (quant NONE) are row-major in the backend's weight dtype; quantized
 * weights (kernels/quant.h) keep codes in `data` and their scales and mins in
 * a layout private to the backend that uploaded them. */
typedef struct loom_weight {
    void *data;
    loom_dtype_t dtype; /* float weights: F32, BF16, F16; quantized: the code type */
    int64_t rows, cols;
    loom_quant_t quant; /* LOOM_QUANT_NONE for float weights */
    int group;          /* columns per scale (quantized) */
    void *scales, *mins; /* quantized: backend layout; mins only for Q4 with min */
} loom_weight_t;

/* Converts host float32 data (rows x cols) to the backend's storage and
 * uploads it. Returns LOOM_ERR_NOMEM when the device is full. */
loom_status_t loom_weight_upload(loom_backend_t *be, loom_weight_t *w, int64_t rows, int64_t cols,
                                 const float *host, loom_err_t *err);
/* Uploads a quantized matrix given in the canonical host layout (the backend
 * repacks it). LOOM_ERR_UNSUPPORTED when the backend has no kernel for the
 * scheme, LOOM_ERR_FORMAT when t fails loom_qtensor_check. */
loom_status_t loom_weight_upload_quant(loom_backend_t *be, loom_weight_t *w,
                                       const loom_qtensor_t *t, loom_err_t *err);
void loom_weight_free(loom_backend_t *be, loom_weight_t *w);
/* Bytes one matmul reads: the weight's codes or elements, plus scales and mins. */
size_t loom_weight_bytes(const loom_weight_t *w);

/* --- ops --------------------------------------------------------------- */
/* y(n, w.rows) = x(n, w.cols) · Wᵀ. Decode (small n) is a memory-bound GEMV,
 * prefill a GEMM. */
void loom_op_matmul(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w, int n);
/* y(n, dim) = x / sqrt(mean(x²) + eps) * g(dim). y may equal x. */
void loom_op_rmsnorm(loom_backend_t *be, float *y, const float *x, const float *g, int n, int dim,
                     float eps);
/* y(n) += a(n): the residual add. */
void loom_op_add(loom_backend_t *be, float *y, const float *a, int64_t n);
/* y(n, cols) += bias(cols) on every row (projection biases, Qwen2's q/k/v).
 * Backends without the op get one add per row. */
void loom_op_add_bias(loom_backend_t *be, float *y, const float *bias, int n, int cols);
/* loom_op_matmul then loom_op_add_bias(y, bias, n, w.rows), fused where the
 * backend can (CUDA: cuBLASLt's bias epilogue for prefill GEMMs). */
void loom_op_matmul_bias(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w, const float *bias,
                         int n);
/* out(n, hidden) = silu(gu[:, :hidden]) * gu[:, hidden:], gu is (n, 2*hidden). */
void loom_op_silu_mul(loom_backend_t *be, float *out, const float *gu, int n, int hidden);
/* The gated MLP's activations (Hugging Face's ACT2FN names in
 * docs/model-format.md): out = act(gate) * up as loom_op_silu_mul.
 *   SILU        x * sigmoid(x)                    (silu, swish)
 *   GELU        x * Phi(x), the erf form          (gelu)
 *   GELU_TANH   0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
 *                                   (gelu_new, gelu_pytorch_tanh, gelu_fast)
 *   QUICK_GELU  x * sigmoid(1.702x)
 *   RELU        max(x, 0)
 *   RELU2       max(x, 0)^2 */
typedef enum {
    LOOM_ACT_SILU = 0,
    LOOM_ACT_GELU,
    LOOM_ACT_GELU_TANH,
    LOOM_ACT_QUICK_GELU,
    LOOM_ACT_RELU,
    LOOM_ACT_RELU2,
} loom_act_t;
/* SILU runs loom_op_silu_mul; the others need the optional act_mul slot
 * (the CPU and CUDA backends have it): loom_backend_act_supported says which. */
void loom_op_act_mul(loom_backend_t *be, loom_act_t act, float *out, const float *gu, int n, int hidden);
int loom_backend_act_supported(const loom_backend_t *be, loom_act_t act);
/* GPT-OSS's expert activation on the same (n, 2*hidden) gate-then-up rows:
 * g = min(gate, limit), u = clamp(up, -limit, limit),
 * out = (u + 1) * g * sigmoid(alpha * g)   (alpha 1.702, limit swiglu_limit).
 * An optional slot: loom_backend_swiglu_clamp_supported says whether the
 * backend has it (the CPU and CUDA backends do). */
void loom_op_swiglu_clamp(loom_backend_t *be, float *out, const float *gu, int n, int hidden,
                          float alpha, float limit);
int loom_backend_swiglu_clamp_supported(const loom_backend_t *be);
/* Per-head RMSNorm (Qwen3's q_norm / k_norm): on each of n rows (row i at
 * x + i*stride) the n_heads consecutive heads of hd are normalised with the
 * one gain g(hd). Composed of loom_op_rmsnorm, one call per row, so every
 * backend has it. */
void loom_op_head_rmsnorm(loom_backend_t *be, float *x, int stride, int n, int n_heads, int hd, const float *g,
                          float eps);
/* x(n, dim) = table[ids[i]] for a (vocab, dim) float32 table (device). */
void loom_op_embed(loom_backend_t *be, float *x, const float *table, const int32_t *ids, int n,
                   int dim);
/* dst(n, dim) = src[rows[i]] (gather rows, e.g. the last token of each sequence). */
void loom_op_gather_rows(loom_backend_t *be, float *dst, const float *src, const int32_t *rows,
                         int n, int dim);

/* --- Mixture of Experts ------------------------------------------------ */
/* The weighted sum of the experts' outputs: for each token t of n,
 * out(t) = [accumulate ? out(t) : 0] + sum over j = 0..k-1, in that order,
 * of w[t k + j] * y(pos[t k + j]), skipping pos < 0 (an expert another rank
 * holds). y holds one row of dim per routed pair, in any order. */
void loom_op_moe_combine(loom_backend_t *be, float *out, const float *y, const int32_t *pos,
                         const float *w, int n, int k, int dim, int accumulate);
/* Routing of one token (the host's, and the CPU backend's moe_route):
 * probs(E) = softmax(logits) (probs may equal logits), then sel, w (k) =
 * the k largest probabilities, ties to the lower id, renormalised to sum 1
 * (summed largest first) when norm, and stored in ascending expert order. */
void loom_moe_route_row(const float *logits, int n_experts, int k, int norm, float *probs,
                        int32_t *sel, float *w);
/* Optional (CPU, CUDA): a decode MoE block with no host round trip.
 * loom_backend_moe_device: the most tokens a step may have for route and
 * gemv to run a block whose experts are `experts` (an array of n_experts
 * weights, data NULL where another rank holds the expert), k per token; 0
 * when they cannot. loom_backend_moe_table: the backend's table of those
 * experts for loom_op_moe_gemv (NULL: out of memory; loom_backend_free).
 * loom_op_moe_route: sel, w (n, k) on the device, loom_moe_route_row per
 * row (bit for bit up to expf). loom_op_moe_gemv: the batched expert GEMV,
 * y(p) = W_{sel[p]} x(p / xdiv) for the n_pairs pairs (rows of y), W
 * (rows, cols) of `dtype`; an expert this rank does not hold gives zeros.
 * xdiv = k reads each token's row for its k pairs (the gate/up matmul), 1
 * a row per pair (down). */
int loom_backend_moe_device(loom_backend_t *be, const loom_weight_t *experts, int n_experts, int k);
/* Optional (CUDA): y(p, cols) += bias(sel[p], cols) on the n_pairs rows of a
 * loom_op_moe_gemv, bias (n_experts, cols) on the device (GPT-OSS's expert
 * biases; zeros for experts another rank holds). Without it a block with
 * expert biases takes the grouped path. */
void loom_op_moe_add_bias(loom_backend_t *be, float *y, const int32_t *sel, int n_pairs, const float *bias,
                          int cols);
int loom_backend_moe_add_bias_supported(const loom_backend_t *be);
/* Optional (CUDA): DeepSeekMoE's router on the device, loom_moe_route_deepseek
 * (worker/moe_ds.h) per row up to expf: sel, w (n, top_k) in ascending
 * expert order. Without it (or when _supported says the backend cannot
 * take this router) a DeepSeek block routes on the host. */
typedef struct loom_moe_ds_args {
    int n_experts, top_k;
    int sigmoid;                 /* 1: sigmoid scores (V3), 0: softmax (V2) */
    int method;                  /* loom_ds_topk_t: greedy, group-limited (group max), noaux_tc (best two) */
    int n_group, topk_group;     /* grouped methods: n_group equal groups, topk_group kept */
    int norm_topk_prob;          /* sigmoid: the chosen weights divided by their sum */
    float routed_scaling_factor; /* then every weight times this */
    const float *bias;           /* (n_experts) e_score_correction_bias on the device, or NULL */
} loom_moe_ds_args_t;
void loom_op_moe_route_ds(loom_backend_t *be, const float *logits, int n, const loom_moe_ds_args_t *r,
                          int32_t *sel, float *w);
int loom_backend_moe_route_ds_supported(const loom_backend_t *be, const loom_moe_ds_args_t *r);
void *loom_backend_moe_table(loom_backend_t *be, const loom_weight_t *experts, int n_experts);
void loom_op_moe_route(loom_backend_t *be, const float *logits, int n, int n_experts, int k,
                       int norm, int32_t *sel, float *w);
void loom_op_moe_gemv(loom_backend_t *be, float *y, const float *x, int xdiv, const int32_t *sel,
                      int n_pairs, const void *table, loom_dtype_t dtype, int64_t rows,
                      int64_t cols);

/* Optional (CPU): low-rank adapter deltas for a batch that mixes adapters
 * (LoRA; worker/engine/linear.c). slots[s] is adapter slot s's matrices
 * for one projection on this shard: A (r, in) and Bt (r, out), device
 * memory. y[i, 0:out] += scale_s * (x[i] A_s^T) Bt_s for every row i whose
 * row_slot[i] (device) = s >= 0; rows with -1, and slots of rank 0, are
 * left alone. ldy / ldx are row strides. A backend without the op cannot
 * load a model with adapter slots (loom_backend_has_lora). */
#define LOOM_LORA_MAX_SLOTS 32 /* slots one op call may name (the CUDA kernels take them by value) */
typedef struct loom_lora_op_slot {
    const float *a;  /* (r, in) */
    const float *bt; /* (r, out): B transposed, so the expand streams rows of it */
    int r;           /* 0: this adapter does not adapt the projection */
    float scale;
} loom_lora_op_slot_t;
int loom_backend_has_lora(const loom_backend_t *be);
void loom_op_lora(loom_backend_t *be, float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in,
                  int64_t out, const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots, int max_r);

/* Rotary embedding, HF rotate-half convention, in place on `n_heads` heads of
 * each of n rows: row i starts at x + i*stride, head h at +h*hd; pair
 * (j, j+hd/2) is rotated by pos[i] * inv_freq[j]. inv_freq (hd/2) is a
 * device table that already includes any llama3 scaling. */
void loom_op_rope(loom_backend_t *be, float *x, int stride, int n, int n_heads, int hd,
                  const int32_t *pos, const float *inv_freq);

/* --- KV cache ---------------------------------------------------------- */
/* One layer's paged KV cache. k and v hold (n_blocks, B, nkv, hd) elements
 * of `dtype`:
 *   F32      the values as computed;
 *   BF16     rounded to nearest even;
 *   I8       codes with one float32 scale per token and KV head in k_scale /
 *            v_scale, (n_blocks, B, nkv): x = scale * code, scale = absmax/127;
 *   F8_E4M3  e4m3 bytes (CUDA only) with one per-tensor scale for the
 *            layer's K and one for its V in fp8_scale (x = scale * e4m3
 *            value; 0 counts as 1): stored as e4m3(x / scale), values
 *            beyond +-448 after the division clamped to +-448, never NaN,
 *            and counted (the CUDA backend logs the count when it is
 *            destroyed).
 * Which dtypes a backend has kernels for: loom_backend_kv_supported. */
typedef struct loom_kv_layer {
    void *k, *v;
    float *k_scale, *v_scale; /* I8 only; NULL otherwise */
    float fp8_scale[2];       /* F8_E4M3 only: K's and V's per-tensor scales (0: 1) */
    loom_dtype_t dtype;
    /* Where blocks lie. 0 (the layer-major layout): block b's rows at row
     * b * block_size of k and v, its scales at (b * block_size) * nkv.
     * Otherwise a pool with a block contiguous across layers (kv.c): block b
     * starts block_stride elements (of dtype) after block a-1's, and its
     * scales scale_block_stride floats after; within a block, rows and
     * scales as above. Backends without loom_backend_kv_block_strided
     * ignore these and must be given 0. */
    int64_t block_stride, scale_block_stride;
    int block_size;
    /* V's head dim where it is not K's: decompressed MLA (--disable-mla)
     * keeps keys of nope + rope dims and values of v_head_dim (192 and 128
     * for DeepSeek-V3). kv_write reads a token's V row as nkv heads of
     * v_dim, attention weighs them and writes nh heads of v_dim. 0: K's
     * head dim. Only backends with loom_backend_kv_v_dim may be given one. */
    int v_dim;
} loom_kv_layer_t;

/* Element offset of slot's row (block * block_size + token) in k or v. */
static inline int64_t loom_kv_row(const loom_kv_layer_t *kv, int64_t slot, int64_t kv_dim) {
    if (!kv->block_stride) return slot * kv_dim;
    return slot / kv->block_size * kv->block_stride + slot % kv->block_size * kv_dim;
}
/* Float offset of slot's first scale (its nkv heads) in k_scale or v_scale. */
static inline int64_t loom_kv_scale_row(const loom_kv_layer_t *kv, int64_t slot, int nkv) {
    if (!kv->block_stride) return slot * nkv;
    return slot / kv->block_size * kv->scale_block_stride + slot % kv->block_size * nkv;
}
/* Whether the backend's kv_write and attention follow block_stride (CPU). */
int loom_backend_kv_block_strided(const loom_backend_t *be);
/* Whether the backend's kv_write and attention honour loom_kv_layer_t.v_dim (CPU, CUDA). */
int loom_backend_kv_v_dim(const loom_backend_t *be);

/* Bytes one token of one KV head takes in K (or in V), its scale included. */
size_t loom_kv_head_bytes(loom_dtype_t dtype, int hd);
/* Names of the KV cache dtypes as flags spell them: "f32", "bf16", "int8",
 * "fp8" (e4m3). Parse returns 0 for anything else (including "auto"). */
int loom_kv_dtype_parse(const char *s, loom_dtype_t *out);
const char *loom_kv_dtype_name(loom_dtype_t dtype);
/* Whether the backend has kv_write and attention kernels for `dtype`:
 * CPU F32, BF16, I8; CUDA F32, BF16, I8, F8_E4M3. */
int loom_backend_kv_supported(const loom_backend_t *be, loom_dtype_t dtype);
/* Turns a --kv-cache-dtype value into the dtype this backend stores:
 * "auto" is F32 on the CPU (the reference) and BF16 on CUDA (half the
 * bytes, the precision of the default weights). Unknown names are
 * LOOM_ERR_INVALID_ARGUMENT, dtypes the backend lacks LOOM_ERR_UNSUPPORTED. */
loom_status_t loom_backend_kv_resolve(const loom_backend_t *be, const char *name, loom_dtype_t *out,
                                      loom_err_t *err);

/* Writes the new keys/values of n tokens into the paged cache of one layer:
 * token i goes to slot slots[i] = block*B + offset (a negative slot is
 * skipped: padding); its k and v rows (nkv heads of hd) start at
 * k + i*stride, v + i*stride. */
void loom_op_kv_write(loom_backend_t *be, const loom_kv_layer_t *kv, const float *k, const float *v,
                      int stride, const int32_t *slots, int n, int nkv, int hd);

/* Paged attention with grouped-query heads over the cache of one layer.
 * Token i (query row q + i*q_stride, nh heads of hd) belongs to sequence
 * tok_seq[i] and sits at position tok_pos[i]; it attends causally to the
 * cached positions [0, tok_pos[i]] of that sequence, found through
 * block_tables[tok_seq[i] * max_blocks + p / B]. Query head h reads KV head
 * h / (nh / nkv). Output row i at out + i*out_stride (nh*hd, or nh heads of
 * kv.v_dim where that is set). */
typedef struct loom_attn_args {
    int n;                  /* query tokens */
    int n_heads, n_kv_heads, head_dim;
    float scale;            /* 1/sqrt(hd) */
    const float *q;
    int q_stride;
    float *out;
    int out_stride;
    loom_kv_layer_t kv;     /* the layer's cache */
    int block_size;
    const int32_t *tok_seq;      /* (n) device */
    const int32_t *tok_pos;      /* (n) device */
    const int32_t *block_tables; /* (n_seqs, max_blocks) device */
    int max_blocks;
    int max_ctx;                 /* host: max(tok_pos) + 1 */
    /* Sliding window (Mistral, Gemma's local layers): > 0 restricts token i
     * to the positions (tok_pos[i] - window, tok_pos[i]], the `window`
     * latest; block-table entries wholly before that are never read (they
     * may be -1). 0 attends to every position. Backends without window
     * support (loom_backend_attn_window_supported) must not be given one. */
    int window;
    /* Logit soft-capping (Gemma 2's attn_logit_softcapping): > 0 replaces
     * each scaled score s by softcap * tanh(s / softcap) before the mask and
     * the softmax. 0 leaves the scores as they are. Backends without it
     * (loom_backend_attn_softcap_supported) must not be given one. */
    float softcap;
    /* Attention sinks (GPT-OSS): one learned logit per query head (n_heads,
     * device) that joins each softmax's denominator with no value row, so a
     * head's weights may sum to less than 1. NULL: none. Backends without
     * them (loom_backend_attn_sinks_supported) must not be given any. */
    const float *sinks;
    /* The log-sum-exp of each softmax, (n, n_heads) device: max + log(sum)
     * of token i's scaled scores for head h at lse[i * n_heads + h], so that
     * outputs over disjoint ranges of keys merge (decompressed MLA prefill
     * over context chunks, attn_mla.c). NULL: none. Backends without it
     * (loom_backend_attn_lse_supported) must not be given one; not with
     * sinks. */
    float *lse;
} loom_attn_args_t;
void loom_op_attention(loom_backend_t *be, const loom_attn_args_t *a);
/* Whether the backend's attention honours loom_attn_args_t.window (both
 * built-in backends do; a backend without it refuses such a model at load). */
int loom_backend_attn_window_supported(const loom_backend_t *be);
/* Whether the backend's attention honours loom_attn_args_t.softcap (both
 * built-in backends do). */
int loom_backend_attn_softcap_supported(const loom_backend_t *be);
/* Whether the backend's attention honours loom_attn_args_t.sinks (both
 * built-in backends do). */
int loom_backend_attn_sinks_supported(const loom_backend_t *be);
/* Whether the backend's attention writes loom_attn_args_t.lse and has
 * loom_op_attn_merge, which merges such outputs (CPU, CUDA). */
int loom_backend_attn_lse_supported(const loom_backend_t *be);
/* Merges attention outputs over two disjoint ranges of keys by their
 * log-sum-exp: for each of n tokens and nh heads (rows of nh * vd floats,
 * lse rows of nh), with a = lse_run and b = lse, m = max(a, b),
 * wa = exp(a - m), wb = exp(b - m):
 *   out = (out wa + o wb) / (wa + wb),   lse_run = m + log(wa + wb).
 * Device memory; n may be 0. */
void loom_op_attn_merge(loom_backend_t *be, float *out, float *lse_run, const float *o, const float *lse, int n,
                        int nh, int vd);
/* rows(cn, nkv * hd) = the K rows of positions [p0, p0 + cn) of one
 * sequence (bt: its block-table row, device) as float32: widened, int8
 * codes times their scales, fp8 values times K's per-tensor scale. Every
 * block of the range must be in bt. Optional (CPU, CUDA):
 * loom_backend_kv_gather_supported. */
void loom_op_kv_gather(loom_backend_t *be, const loom_kv_layer_t *kv, const int32_t *bt, int p0, int cn, int nkv,
                       int hd, float *rows);
int loom_backend_kv_gather_supported(const loom_backend_t *be);
/* x(n) = cap * tanh(x / cap), element-wise (Gemma 2's final logit
 * soft-capping on the LM head's output); cap > 0. An optional slot:
 * loom_backend_softcap_supported says whether the backend has it. */
void loom_op_softcap(loom_backend_t *be, float *x, int64_t n, float cap);
int loom_backend_softcap_supported(const loom_backend_t *be);

/* Sampling reduction over rows of a vocabulary shard: logits (n_rows,
 * vocab_shard) whose global ids start at id_offset. params/steps/k are
 * host arrays (n_rows); parts are host structs with room for k[r]
 * candidates. See kernels/sampling.h for the semantics. */
void loom_op_sample_shard(loom_backend_t *be, const float *logits, int n_rows, int vocab_shard,
                          int id_offset, int vocab_size, const loom_sampling_t *params,
                          const uint64_t *steps, const int *k, loom_sample_part_t *parts);

/* --- fused ops (optional slots; the wrappers fall back to the plain ops) -- */
/* x(n, dim) += a, then y = rmsnorm(x) * g: a residual add and the norm that
 * follows it in one pass. y may equal x. */
void loom_op_add_rmsnorm(loom_backend_t *be, float *x, const float *a, float *y, const float *g,
                         int n, int dim, float eps);
/* RoPE on the nh query heads at q and the nkv key heads at k (rows of
 * `stride` floats, as loom_op_rope), then loom_op_kv_write of the rotated
 * keys and the values at v. */
void loom_op_rope_kv_write(loom_backend_t *be, float *q, float *k, const float *v, int stride, int n,
                           int nh, int nkv, int hd, const int32_t *pos, const float *inv_freq,
                           const loom_kv_layer_t *kv, const int32_t *slots);

/* --- graphs (optional; CUDA) ------------------------------------------- */
/* Records the ops issued between graph_begin and graph_end once per key and
 * replays them afterwards. The key must cover everything the ops bake in:
 * their scalar arguments (token counts, strides) and, through the caller's
 * own bookkeeping, which buffers they use; device data (metadata uploaded
 * before graph_begin, weights, caches) is read fresh on every replay. A
 * backend drops its graphs whenever device memory is freed through it.
 *   graph_begin: 1 = a graph for key exists; skip the ops (graph_end launches
 *                it). 0 = issue the ops (they may be being recorded).
 *   graph_end:   0 = the work is launched or done. 1 = recording failed and
 *                the ops did not run: issue them again (this key will not
 *                be recorded again).
 * Backends without graphs return 0 from both. */
int loom_backend_has_graphs(const loom_backend_t *be);
int loom_backend_graph_begin(loom_backend_t *be, uint64_t key);
int loom_backend_graph_end(loom_backend_t *be, uint64_t key);
/* Drops every recorded graph after the work on the stream is done: for the
 * caller whose ops bake in handles that are going away (a data plane's
 * communicators, whose collectives sit in TP decode graphs). No-op without
 * graphs. */
void loom_backend_graph_drop(loom_backend_t *be);

#endif
