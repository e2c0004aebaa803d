/* A model family as the engine sees it: what worker/arch/<family>.c fills
 * in and the engine reads. One table per family: the model_types it
 * serves, its tensor names (read by the loader, the checkpoint check and
 * `loom quantize`), the backend capabilities it needs, how a layer loads
 * and runs (composing the shared blocks of worker/engine/), and an
 * optional head hook. worker/arch/arch.c lists the families. */
#ifndef LOOM_ARCH_H
#define LOOM_ARCH_H

#include <stddef.h>
#include <stdint.h>

#include "common/model_config.h"
#include "common/shard.h"
#include "common/status.h"
#include "kernels/backend.h"

typedef struct loom_model loom_model_t;
typedef struct loom_layer loom_layer_t;
typedef struct loom_loader loom_loader_t;
typedef struct loom_step_ops loom_step_ops_t;

/* What a tensor is to the engine. Layer tensors are named after
 * "model.layers.N."; top-level ones (LOOM_TN_TOP) in full. */
typedef enum {
    LOOM_TN_EMBED,          /* model.embed_tokens.weight (vocab, dim) */
    LOOM_TN_FINAL_NORM,     /* (dim) */
    LOOM_TN_LM_HEAD,        /* linear (vocab, dim) */
    LOOM_TN_ATTN_NORM,      /* (dim) before attention */
    LOOM_TN_FFN_NORM,       /* (dim) before the feed-forward block */
    LOOM_TN_POST_ATTN_NORM, /* (dim) Gemma: on the attention output */
    LOOM_TN_POST_FFN_NORM,  /* (dim) Gemma: on the feed-forward output */
    LOOM_TN_Q, LOOM_TN_K, LOOM_TN_V, /* linears (heads*hd, dim) */
    LOOM_TN_QKV,            /* Phi-3: q, k, v rows in one linear */
    LOOM_TN_O,              /* linear (dim, heads*hd) */
    LOOM_TN_Q_BIAS, LOOM_TN_K_BIAS, LOOM_TN_V_BIAS, LOOM_TN_O_BIAS,
    LOOM_TN_Q_NORM, LOOM_TN_K_NORM, /* (hd) per-head RMSNorm gains */
    LOOM_TN_SINKS,          /* (heads) attention sinks */
    LOOM_TN_GATE, LOOM_TN_UP, LOOM_TN_DOWN, /* the dense MLP's linears */
    LOOM_TN_GATE_UP,        /* Phi-3: gate rows then up rows */
    LOOM_TN_ROUTER,         /* (n_experts, dim), read as floats */
    LOOM_TN_ROUTER_BIAS,    /* (n_experts) */
    LOOM_TN_EXPERT_GATE, LOOM_TN_EXPERT_UP, LOOM_TN_EXPERT_DOWN, /* expert %d's linears */
    LOOM_TN_SHARED_GATE_W,  /* (1, dim) Qwen2-MoE's shared-expert gate */
    LOOM_TN_SHARED_GATE, LOOM_TN_SHARED_UP, LOOM_TN_SHARED_DOWN,
    LOOM_TN_EXPERTS_GATE_UP, LOOM_TN_EXPERTS_DOWN,         /* GPT-OSS: all experts in one 3-D tensor */
    LOOM_TN_EXPERTS_GATE_UP_BIAS, LOOM_TN_EXPERTS_DOWN_BIAS,
    LOOM_TN_EXPERTS_GATE_UP_BLOCKS, LOOM_TN_EXPERTS_GATE_UP_SCALES, /* ... stored MXFP4 */
    LOOM_TN_EXPERTS_DOWN_BLOCKS, LOOM_TN_EXPERTS_DOWN_SCALES,
    /* DeepSeek's multi-head latent attention (worker/engine/attn_mla.c) and router */
    LOOM_TN_Q_A, LOOM_TN_Q_A_NORM, LOOM_TN_Q_B, /* q_a_proj (q_lora, dim), q_a_layernorm, q_b_proj */
    LOOM_TN_KV_A, LOOM_TN_KV_A_NORM,           /* kv_a_proj_with_mqa (kv_lora + rope, dim), kv_a_layernorm */
    LOOM_TN_KV_B,                              /* kv_b_proj (heads * (nope + v), kv_lora) */
    LOOM_TN_ROUTER_CORR,                       /* (n_experts) e_score_correction_bias: for the choice only */
} loom_tn_role_t;

/* When a name applies: every bit of an entry's `when` must hold for the
 * config and layer (loom_arch_conds). */
enum {
    LOOM_TN_TOP = 1u << 0,      /* a top-level tensor (not under model.layers.N.) */
    LOOM_TN_SPLIT = 1u << 1,    /* q/k/v and gate/up stored apart */
    LOOM_TN_FUSED = 1u << 2,    /* ... stored fused (config fused_qkv) */
    LOOM_TN_QK_NORM = 1u << 3,  /* config qk_norm */
    LOOM_TN_BIAS = 1u << 4,     /* config attention_bias */
    LOOM_TN_DENSE = 1u << 5,    /* a layer with a dense MLP */
    LOOM_TN_MOE = 1u << 6,      /* a Mixture-of-Experts layer */
    LOOM_TN_MIXTRAL = 1u << 7,  /* experts named block_sparse_moe.experts.J.w1/w3/w2 */
    LOOM_TN_QWEN_MOE = 1u << 8, /* ... mlp.experts.J.gate_proj/up_proj/down_proj */
    LOOM_TN_SHARED = 1u << 9,   /* a shared expert (moe_shared_hidden) */
    LOOM_TN_MXFP4 = 1u << 10,   /* the checkpoint stores MXFP4 experts */
    LOOM_TN_FLOAT = 1u << 11,   /* ... float ones */
    LOOM_TN_Q_LORA = 1u << 12,  /* MLA: q through q_a_proj / q_b_proj (q_lora_rank > 0) */
    LOOM_TN_Q_FULL = 1u << 13,  /* ... through one q_proj */
    LOOM_TN_NOAUX = 1u << 14,   /* DeepSeek-V3's router: an e_score_correction_bias */
};

typedef enum {
    LOOM_TN_TENSOR, /* one tensor, read as floats */
    LOOM_TN_LINEAR, /* a matmul weight: <name>.weight, or stored quantized (.qweight, .scales,
                     * .mins, .qzeros, .g_idx; docs/model-format.md); `loom quantize` rewrites it */
} loom_tn_kind_t;

typedef struct loom_tensor_name {
    loom_tn_role_t role;
    const char *name; /* after "model.layers.N." (or whole, LOOM_TN_TOP); "%d": the expert */
    loom_tn_kind_t kind;
    uint32_t when;    /* LOOM_TN_* bits that must hold */
} loom_tensor_name_t;

/* A model_type a family serves, and the backend capabilities (LOOM_CAP_*)
 * its configs need: `always` every config, `maybe` some (a sliding_window,
 * a hidden_act other than SiLU), for `loom info`; loading computes the
 * config's own needs (loom_arch_t.needs). */
typedef struct loom_arch_type {
    const char *model_type;
    uint32_t always, maybe;
} loom_arch_type_t;

typedef struct loom_arch {
    const char *name;
    const loom_arch_type_t *types; /* ends with a NULL model_type */
    const loom_tensor_name_t *names;
    int n_names;
    /* The capabilities this config needs of the backend on this shard (its layers, its head). */
    uint32_t (*needs)(const loom_model_config_t *c, const loom_shard_spec_t *spec);
    /* Loads global layer gl's weights (this rank's slices). */
    loom_status_t (*load_layer)(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err);
    /* Runs the shard's layer l: on entry m->xb holds the normed input
     * (the layer's attention norm of the residual stream m->x); on return
     * m->x holds the layer's output and m->xb the next layer's normed input
     * (loom_blk_ffn_residual). */
    loom_status_t (*layer)(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err);
    /* optional: applied to the LM head's n_rows logit rows (Gemma 2's final soft cap) */
    void (*head)(loom_model_t *m, int n_rows);
} loom_arch_t;

/* The registry (worker/arch/arch.c). */
const loom_arch_t *loom_arch_find(const char *model_type); /* NULL: no family serves it */
int loom_arch_count(void);
const loom_arch_t *loom_arch_at(int i);

/* The LOOM_TN_* bits that hold for a config at global layer `layer` (-1: top-level). */
uint32_t loom_arch_conds(const loom_model_config_t *c, int layer);
/* The name of a role's tensor (or linear prefix) at global layer `layer`
 * (expert: for per-expert roles) into buf; NULL when the family has none
 * for this config. */
const char *loom_arch_tensor_name(const loom_arch_t *a, const loom_model_config_t *c, int layer,
                                  loom_tn_role_t role, int expert, char *buf, size_t size);
/* Whether `name` is a tensor the family reads under this config: 1, and
 * *linear set to whether it is (part of) a linear's weight; 0 if not. A
 * per-expert name counts for experts below n_experts. */
int loom_arch_tensor_used(const loom_arch_t *a, const loom_model_config_t *c, const char *name,
                          int *linear);
/* The capabilities every config needs: those of its layers (a window on
 * a layer of the shard, an attention soft cap, a hidden_act other than
 * SiLU, Mixture-of-Experts layers) and of its head (a final soft cap). */
uint32_t loom_arch_needs_common(const loom_model_config_t *c, const loom_shard_spec_t *spec);
/* Why a config needs capability `cap` (one bit), for the refusal: e.g.
 * "layer 0 has a window of 4096". "" when nothing more is to say. */
void loom_arch_need_detail(const loom_model_config_t *c, const loom_shard_spec_t *spec, uint32_t cap,
                           char *buf, size_t size);

#endif
