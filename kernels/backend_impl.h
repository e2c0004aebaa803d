/* The backend vtable, for backend implementations only. A backend fills its
 * table with designated initializers; optional slots may be NULL. */
#ifndef LOOM_BACKEND_IMPL_H
#define LOOM_BACKEND_IMPL_H

#include "kernels/backend.h"

typedef struct loom_backend_ops {
    const char *name;
    void (*destroy)(loom_backend_t *be);
    void *(*alloc)(loom_backend_t *be, size_t bytes);
    void (*free)(loom_backend_t *be, void *p);
    void (*upload)(loom_backend_t *be, void *dst, const void *src, size_t bytes);
    void (*download)(loom_backend_t *be, void *dst, const void *src, size_t bytes);
    void (*memset)(loom_backend_t *be, void *dst, int value, size_t bytes);
    void (*copy)(loom_backend_t *be, void *dst, const void *src, size_t bytes); /* optional */
    loom_status_t (*synchronize)(loom_backend_t *be, loom_err_t *err);
    size_t (*mem_free)(loom_backend_t *be);
    void *(*stream)(loom_backend_t *be); /* optional: CUDA stream */
    /* optional, for the host-memory KV tier (loom_backend_xfer_*): host
     * memory for transfers (CUDA: pinned) and copies on a transfer stream;
     * NULL: malloc, and upload/download */
    void *(*host_alloc)(loom_backend_t *be, size_t bytes);
    void (*host_free)(loom_backend_t *be, void *p);
    void (*xfer_begin)(loom_backend_t *be);
    void (*xfer)(loom_backend_t *be, void *dst, const void *src, size_t bytes, int to_host);
    void (*xfer_end)(loom_backend_t *be);
    loom_status_t (*weight_upload)(loom_backend_t *be, loom_weight_t *w, int64_t rows,
                                   int64_t cols, const float *host, loom_err_t *err);
    void (*weight_free)(loom_backend_t *be, loom_weight_t *w);
    loom_status_t (*weight_upload_quant)(loom_backend_t *be, loom_weight_t *w,
                                         const loom_qtensor_t *t, loom_err_t *err); /* optional */

    void (*matmul)(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w, int n);
    void (*rmsnorm)(loom_backend_t *be, float *y, const float *x, const float *g, int n, int dim,
                    float eps);
    void (*add)(loom_backend_t *be, float *y, const float *a, int64_t n);
    void (*silu_mul)(loom_backend_t *be, float *out, const float *gu, int n, int hidden);
    void (*embed)(loom_backend_t *be, float *x, const float *table, const int32_t *ids, int n,
                  int dim);
    void (*gather_rows)(loom_backend_t *be, float *dst, const float *src, const int32_t *rows,
                        int n, int dim);
    void (*rope)(loom_backend_t *be, float *x, int stride, int n, int n_heads, int hd,
                 const int32_t *pos, const float *inv_freq);
    /* kv_write and attention must handle every dtype kv_supported accepts */
    int (*kv_supported)(const loom_backend_t *be, loom_dtype_t dtype); /* optional: F32 only */
    int kv_block_strided; /* kv_write and attention follow loom_kv_layer_t.block_stride */
    int kv_v_dim;         /* kv_write and attention honour loom_kv_layer_t.v_dim */
    int attn_lse;         /* attention writes loom_attn_args_t.lse */
    void (*kv_write)(loom_backend_t *be, const loom_kv_layer_t *kv, const float *k, const float *v,
                     int stride, const int32_t *slots, int n, int nkv, int hd);
    void (*attention)(loom_backend_t *be, const loom_attn_args_t *a);
    /* optional (backend.h): the decompressed MLA prefill's cache reads and merges */
    void (*kv_gather)(loom_backend_t *be, const loom_kv_layer_t *kv, const int32_t *bt, int p0, int cn, int nkv,
                      int hd, float *rows);
    void (*attn_merge)(loom_backend_t *be, float *out, float *lse_run, const float *o, const float *lse, int n,
                       int nh, int vd);
    void (*sample_shard)(loom_backend_t *be, const float *logits, int n_rows, int vocab_shard,
                         int id_offset, int vocab_size, const loom_sampling_t *params,
                         const uint64_t *steps, const int *k, loom_sample_part_t *parts);

    /* optional fused ops and graphs (backend.h) */
    void (*add_rmsnorm)(loom_backend_t *be, float *x, const float *a, float *y, const float *g,
                        int n, int dim, float eps);
    void (*rope_kv_write)(loom_backend_t *be, float *q, float *k, const float *v, int stride, int n,
                          int nh, int nkv, int hd, const int32_t *pos, const float *inv_freq,
                          const loom_kv_layer_t *kv, const int32_t *slots);
    void (*add_bias)(loom_backend_t *be, float *y, const float *bias, int n, int cols);
    /* optional: matmul then add_bias in one (loom_op_matmul_bias) */
    void (*matmul_bias)(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w, const float *bias,
                        int n);
    /* optional: activations other than SiLU (loom_op_act_mul) */
    void (*act_mul)(loom_backend_t *be, loom_act_t act, float *out, const float *gu, int n, int hidden);
    /* optional: GPT-OSS's clamped SwiGLU (loom_op_swiglu_clamp) */
    void (*swiglu_clamp)(loom_backend_t *be, float *out, const float *gu, int n, int hidden,
                         float alpha, float limit);
    /* LOOM_CAP_* the backend has (kernels/backend.h): the attention bits
     * say which loom_attn_args_t fields attention honours; the others must
     * agree with the optional slots (softcap, act_mul, swiglu_clamp,
     * moe_combine) and kv_supported, which loom_backend_create checks */
    uint32_t caps;
    /* optional: x = cap * tanh(x / cap) (loom_op_softcap) */
    void (*softcap)(loom_backend_t *be, float *x, int64_t n, float cap);
    /* Mixture of Experts (backend.h): combine is required of a backend that
     * runs MoE models; device, table, route and gemv are optional (all or none) */
    void (*moe_combine)(loom_backend_t *be, float *out, const float *y, const int32_t *pos,
                        const float *w, int n, int k, int dim, int accumulate);
    void (*moe_route)(loom_backend_t *be, const float *logits, int n, int n_experts, int k,
                      int norm, int32_t *sel, float *w);
    void (*moe_gemv)(loom_backend_t *be, float *y, const float *x, int xdiv, const int32_t *sel,
                     int n_pairs, const void *table, loom_dtype_t dtype, int64_t rows,
                     int64_t cols);
    int (*moe_device)(loom_backend_t *be, const loom_weight_t *experts, int n_experts, int k);
    void *(*moe_table)(loom_backend_t *be, const loom_weight_t *experts, int n_experts);
    /* optional: expert biases on the rows of moe_gemv (loom_op_moe_add_bias) */
    void (*moe_add_bias)(loom_backend_t *be, float *y, const int32_t *sel, int n_pairs, const float *bias,
                         int cols);
    /* optional: DeepSeekMoE's router (loom_op_moe_route_ds); route_ds_fits says which routers it takes */
    void (*moe_route_ds)(loom_backend_t *be, const float *logits, int n, const loom_moe_ds_args_t *r,
                         int32_t *sel, float *w);
    int (*moe_route_ds_fits)(const loom_moe_ds_args_t *r);
    /* optional: LoRA deltas (loom_op_lora) */
    void (*lora)(loom_backend_t *be, float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in,
                 int64_t out, const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots, int max_r);
    int (*graph_begin)(loom_backend_t *be, uint64_t key);
    int (*graph_end)(loom_backend_t *be, uint64_t key);
    void (*graph_drop)(loom_backend_t *be);
} loom_backend_ops_t;

/* Every backend struct begins with this header. */
struct loom_backend {
    const loom_backend_ops_t *ops;
    loom_backend_config_t cfg;
    char name[32];
};

/* Constructors of the built-in backends. */
loom_status_t loom_backend_cpu_create(const loom_backend_config_t *cfg, loom_backend_t **out,
                                      loom_err_t *err);
uint32_t loom_backend_cpu_caps(void); /* its table's caps, without a backend */
#ifdef LOOM_HAVE_CUDA
loom_status_t loom_backend_cuda_create(const loom_backend_config_t *cfg, loom_backend_t **out,
                                       loom_err_t *err);
int loom_backend_cuda_device_count(void);
uint32_t loom_backend_cuda_caps(void);
#endif

#endif
