/* Multi-head latent attention (DeepSeek-V2/V3) on the CPU, one layer, plain
 * float: the reference the engine's MLA block is checked against.
 *
 * Per token and layer the cache holds one row of kv_lora_rank + rope values:
 * the RMS-normed latent c and the roped key k_pe shared by every head
 * (DeepSeek-V3: 512 + 64 = 576 values; 61 layers x 576 x 2 B = 70,272 B per
 * token in bf16, against 61 x 128 heads x (192 + 128) x 2 B = 4,997,120 B for
 * the decompressed keys and values).
 *
 * Two ways to attend over it, equal in exact arithmetic:
 *  - decompressed (prefill): k_nope and v of every head from kv_b_proj x c,
 *    then MHA with a QK dim of nope + rope and a V dim of v_head_dim;
 *  - absorbed (decode): W_UK (kv_b_proj's k rows of head h) folded into q,
 *    q_lat = W_UK^T q_nope, and W_UV applied after the weighted sum, so each
 *    head is MQA over the cache rows themselves: a QK dim of kv_lora_rank +
 *    rope and a V dim of kv_lora_rank. */
#ifndef LOOM_MLA_H
#define LOOM_MLA_H

#include <stddef.h>

#include "common/model_config.h"

typedef struct {
    int dim, n_heads;
    int q_lora_rank;     /* 0: one q_proj */
    int kv_lora_rank, nope, rope, v;
    int interleave;      /* RoPE pairs (2j, 2j+1); else (j, j + rope/2) */
    float softmax_scale; /* qk_head_dim^-0.5, times mscale^2 under yarn */
    float rope_factor;   /* cos and sin times this (yarn's attention factor) */
    const double *inv_freq; /* rope / 2 frequencies */
    float latent_eps;    /* q_a_layernorm and kv_a_layernorm: 1e-6 (the modules are built without rms_norm_eps) */
} loom_mla_shape_t;

/* Row-major (out, in) float weights, as the checkpoint names them. */
typedef struct {
    const float *q_proj;      /* (H * (nope + rope), dim), when q_lora_rank == 0 */
    const float *q_a_proj;    /* (q_lora_rank, dim) */
    const float *q_a_norm;    /* (q_lora_rank) */
    const float *q_b_proj;    /* (H * (nope + rope), q_lora_rank) */
    const float *kv_a_proj;   /* (kv_lora_rank + rope, dim): kv_a_proj_with_mqa */
    const float *kv_a_norm;   /* (kv_lora_rank) */
    const float *kv_b_proj;   /* (H * (nope + v), kv_lora_rank): per head nope k rows, then v rows */
    const float *o_proj;      /* (dim, H * v) */
} loom_mla_weights_t;

/* The shape of a deepseek config's layers; inv_freq (rope / 2 doubles) is filled by loom_mla_rope_inv_freq. */
loom_mla_shape_t loom_mla_shape_of(const loom_model_config_t *cfg, const double *inv_freq);
/* RoPE frequencies over the rope dims: rope_theta^(-2j/rope), blended by yarn's ramp between
 * beta_fast and beta_slow turns over original_max_position_embeddings when cfg says yarn. */
void loom_mla_rope_inv_freq(const loom_model_config_t *cfg, double *inv_freq);

/* Values one token's cache row holds: kv_lora_rank + rope. */
static inline int loom_mla_cache_row(const loom_mla_shape_t *s) { return s->kv_lora_rank + s->rope; }
/* Floats of scratch the calls below need for a context of n_ctx tokens and T new ones. */
size_t loom_mla_scratch_floats(const loom_mla_shape_t *s, int n_ctx, int T);

/* T tokens x (T x dim, normed) at positions pos0.. : writes their cache rows at cache + pos0 rows, then
 * attends causally over rows [0, pos0 + t] decompressed; out (T x dim) is o_proj's output. */
void loom_mla_prefill(const loom_mla_shape_t *s, const loom_mla_weights_t *w, const float *x, int T, int pos0,
                      float *cache, float *out, float *scratch);
/* One token x (dim) at position pos: writes its cache row at row pos, then attends over rows [0, pos]
 * absorbed; out (dim). */
void loom_mla_decode(const loom_mla_shape_t *s, const loom_mla_weights_t *w, const float *x, int pos, float *cache,
                     float *out, float *scratch);

#endif
