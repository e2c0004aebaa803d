/* Hyperparameters of a Llama-family model, read from a Hugging Face
 * config.json (and generation_config.json for extra EOS ids when present). */
#ifndef LOOM_MODEL_CONFIG_H
#define LOOM_MODEL_CONFIG_H

#include <stddef.h>

#include "common/dtype.h"
#include "common/status.h"

#define LOOM_MAX_EOS 8

typedef enum {
    LOOM_ROPE_NONE = 0,
    LOOM_ROPE_LLAMA3 = 1,
    LOOM_ROPE_LINEAR = 2, /* inv_freq / factor */
    LOOM_ROPE_YARN = 3,   /* NTK-by-parts blend + attention factor */
    LOOM_ROPE_LONGROPE = 4, /* Phi-3: per-frequency factors (the short ones) + attention factor */
} loom_rope_scaling_t;

#define LOOM_MAX_ROPE_PAIRS 512 /* head_dim / 2 */
#define LOOM_MAX_LAYER_TYPES 1024 /* layer_types entries kept (Gemma 3) */

/* hidden_act (config.json), the same order as kernels/backend.h's loom_act_t. */
typedef enum {
    LOOM_HIDDEN_SILU = 0,   /* silu, swish */
    LOOM_HIDDEN_GELU,       /* gelu (erf) */
    LOOM_HIDDEN_GELU_TANH,  /* gelu_new, gelu_pytorch_tanh, gelu_fast */
    LOOM_HIDDEN_QUICK_GELU, /* quick_gelu */
    LOOM_HIDDEN_RELU,       /* relu */
    LOOM_HIDDEN_RELU2,      /* relu2 */
} loom_hidden_act_t;

/* How the checkpoint stores its linear weights (config.json's
 * quantization_config.quant_method; docs/model-format.md). */
typedef enum {
    LOOM_CKPT_FLOAT = 0, /* no quantization_config */
    LOOM_CKPT_LOOM,      /* written by `loom quantize` */
    LOOM_CKPT_AWQ,       /* AutoAWQ GEMM layout, 4 bits */
    LOOM_CKPT_GPTQ,      /* AutoGPTQ / GPTQModel layout, 4 bits */
    LOOM_CKPT_MXFP4,     /* GPT-OSS: the experts in OCP MXFP4 (_blocks, _scales), the rest float */
    LOOM_CKPT_FP8,       /* DeepSeek-V3: float8_e4m3fn projections, a weight_scale_inv per block (common/fp8.h) */
} loom_ckpt_quant_t;

/* DeepSeekMoE's expert choice (topk_method). */
typedef enum {
    LOOM_DS_TOPK_GREEDY = 0,      /* V2: the top-k scores */
    LOOM_DS_TOPK_GROUP_LIMITED,   /* V2: top-k within the topk_group groups of highest maximum score */
    LOOM_DS_TOPK_NOAUX_TC,        /* V3: biased scores, groups ranked by the sum of their best two */
} loom_ds_topk_t;

typedef struct loom_model_config {
    char model_type[32];   /* "llama", "mistral", "qwen2" ... */
    int dim;               /* hidden_size */
    int hidden_dim;        /* intermediate_size */
    int n_layers;          /* num_hidden_layers */
    int n_heads;           /* num_attention_heads */
    int n_kv_heads;        /* num_key_value_heads (defaults to n_heads) */
    int head_dim;          /* head_dim (defaults to dim / n_heads) */
    int rotary_dim;        /* dims of each head RoPE turns: head_dim, or partial_rotary_factor x head_dim
                            * (Phi-4-mini); the others pass through unrotated */
    int vocab_size;
    int max_seq_len;       /* max_position_embeddings */
    float norm_eps;        /* rms_norm_eps */
    float rope_theta;
    loom_rope_scaling_t rope_scaling;
    float rope_factor;           /* llama3: factor */
    float rope_low_freq_factor;  /* llama3: low_freq_factor */
    float rope_high_freq_factor; /* llama3: high_freq_factor */
    int rope_orig_max_pos;       /* llama3, yarn: original_max_position_embeddings */
    float rope_beta_fast, rope_beta_slow; /* yarn: beta_fast (32), beta_slow (1) */
    int rope_truncate;                    /* yarn: truncate (true) */
    float rope_attn_factor;      /* yarn, longrope: attention_factor; q and k are scaled by it (1 otherwise) */
    float rope_ext_factor[LOOM_MAX_ROPE_PAIRS]; /* longrope: short_factor, one per frequency */
    int rope_ctx_capped;         /* longrope: max_seq_len was cut to original_max_position_embeddings */
    int fused_qkv;               /* Phi-3: qkv_proj and gate_up_proj hold the stacked projections */
    int multimodal;              /* the text model of a multimodal checkpoint (gemma3 with text_config):
                                  * its tensors are renamed at load (loom_model_map_tensor_names), the
                                  * vision tower's left unread */
    /* Gemma 2 (gemma2) and Gemma 3 (gemma3_text) */
    int gemma;                   /* (1+w) RMSNorms; post-attention and pre/post-feed-forward norms */
    float query_scale;           /* 1/sqrt(query_pre_attn_scalar); 0: 1/sqrt(head_dim) */
    float embed_scale;           /* embeddings times sqrt(hidden_size); 0: none */
    float rope_local_theta;      /* Gemma 3: rope_local_base_freq of the sliding layers (no scaling there);
                                  * 0: the sliding layers use rope_theta too (Gemma 2) */
    int sliding_pattern;         /* sliding_window_pattern: layer i global when (i+1) % pattern == 0
                                  * (Gemma 2: 2, the odd layers) */
    float attn_softcap;          /* attn_logit_softcapping: scores s -> cap * tanh(s / cap); 0 = none */
    float final_softcap;         /* final_logit_softcapping: the same on the LM head's logits; 0 = none */
    int has_layer_types;         /* layer_sliding below comes from layer_types */
    unsigned char layer_sliding[LOOM_MAX_LAYER_TYPES];
    loom_hidden_act_t hidden_act; /* hidden_act: the MLP's gate activation */
    int qk_norm;                 /* Qwen3: per-head RMSNorm on q and k before RoPE */
    int sliding_window;          /* Mistral: every layer attends to the latest N positions; 0 = none */
    int tie_embeddings;          /* tie_word_embeddings */
    int attention_bias;          /* q/k/v biases (Qwen2; GPT-OSS: and o's) */
    int bos_id;                  /* -1 if none */
    int n_eos;
    int eos_ids[LOOM_MAX_EOS];   /* eos_token_id (int or list) */
    loom_dtype_t torch_dtype;    /* informational */
    loom_ckpt_quant_t ckpt_quant; /* quantization_config.quant_method */
    int ckpt_group;              /* AWQ/GPTQ, loom 4-bit: group_size (input columns per scale); else 0 */
    int ckpt_zeros_minus1;       /* GPTQ checkpoint_format "gptq" (v1): stored zeros are z - 1 */
    int ckpt_desc_act;           /* GPTQ desc_act (act-order: g_idx is checked on load) */
    /* Mixture of Experts (mixtral, qwen3_moe); n_experts 0 = every layer dense */
    int n_experts; /* num_local_experts (mixtral, gpt_oss) / num_experts (qwen3_moe) */
    int n_experts_per_tok;       /* num_experts_per_tok: experts each token is routed to */
    int moe_hidden_dim;          /* an expert's intermediate size (moe_intermediate_size; mixtral: intermediate_size) */
    int norm_topk_prob;          /* renormalise the chosen experts' router weights to sum 1 (mixtral: always) */
    int moe_sparse_step;         /* decoder_sparse_step: layer L sparse when (L+1) % step == 0 */
    int moe_mixtral_names;       /* block_sparse_moe.{gate,experts.J.w1/w3/w2} (else mlp.{gate,experts.J.*_proj}) */
    int moe_shared_hidden;       /* qwen2_moe: shared_expert_intermediate_size of the shared expert, gated by
                                  * sigmoid(shared_expert_gate . x); 0 = none */
    unsigned char mlp_only[LOOM_MAX_LAYER_TYPES]; /* mlp_only_layers: dense layers of a qwen3_moe */
    /* GPT-OSS (gpt_oss): q/k/v and o biases, a learned attention sink per
     * head, a router with a bias, and experts stored as 3-D tensors
     * (mlp.experts.gate_up_proj [E, dim, 2I] with gate and up interleaved,
     * down_proj [E, I, dim], and their biases) through a clamped SwiGLU */
    int gpt_oss;
    float swiglu_limit; /* swiglu_limit (7): gate <= limit, |up| <= limit */
    float swiglu_alpha; /* swiglu_alpha (1.702): the gate is sigmoid(alpha * gate) times gate */
    /* DeepSeek-V2 / V3 (deepseek_v2, deepseek_v3; common/model_config_deepseek.c): multi-head latent
     * attention and DeepSeekMoE. head_dim above is the latent cache row (kv_lora_rank + rope: the engine
     * attends absorbed, one KV head), n_kv_heads 1, rotary_dim the rope dims. */
    int deepseek;              /* 2 or 3 (the version); 0 for the other families */
    int q_lora_rank;           /* 0: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj */
    int kv_lora_rank;          /* the latent each token caches per layer (plus the rope key) */
    int qk_nope_head_dim;      /* the part of a q/k head without RoPE (from the latent) */
    int qk_rope_head_dim;      /* the part with RoPE (k's shared by every head) */
    int v_head_dim;
    int n_shared_experts;      /* one MLP of n_shared_experts x moe_intermediate_size; 0 = none */
    int first_k_dense_replace; /* layers below it are dense (intermediate_size) */
    int n_group, topk_group;   /* experts in n_group groups; the choice stays in topk_group of them */
    loom_ds_topk_t topk_method;
    int scoring_sigmoid;       /* scoring_func: 1 sigmoid (V3), 0 softmax (V2) */
    float routed_scaling_factor; /* the routed experts' weights times this */
    float rope_mscale, rope_mscale_all_dim; /* yarn: mscale, mscale_all_dim (0 = absent) */
    float attn_scale;          /* the softmax scale: qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2 */
    int rope_interleave;       /* RoPE turns pairs (2j, 2j+1) (V2 always); else (j, j + rope/2) */
    int n_nextn_layers;        /* num_nextn_predict_layers: MTP modules stored after the last layer */
    int ckpt_block[2];         /* fp8: weight_block_size (rows, columns) of one weight_scale_inv */
} loom_model_config_t;

/* What a family's Transformers config class gives a key that config.json
 * leaves out: one row per model_type (common/model_config.c cites the class
 * beside each). docs/model-format.md's "Defaults by family" table is printed
 * from these rows and test_model_config fails when the two differ. Keys Loom
 * requires (hidden_size, intermediate_size, num_hidden_layers,
 * num_attention_heads, vocab_size) and the special token ids are not here. */
typedef struct loom_family_defaults {
    const char *model_type;
    const char *config_class;     /* the Transformers class the values are read from */
    int n_kv_heads;               /* num_key_value_heads; 0: num_attention_heads */
    int head_dim;                 /* 0: hidden_size / num_attention_heads */
    int max_position_embeddings;
    double rms_norm_eps;
    double rope_theta;            /* rope_theta (Transformers 5: the class's default_theta) */
    const char *hidden_act;       /* hidden_act (Gemma: hidden_activation) */
    int tie_word_embeddings;
    int attention_bias;           /* q/k/v (GPT-OSS: and o) biases; Qwen2's are implied */
    int sliding_window;           /* an absent key; 0: none */
    /* keys of some families only; 0 where a family has none */
    int query_pre_attn_scalar;    /* gemma2, gemma3_text */
    double rope_local_base_freq;  /* gemma3_text: the sliding layers' RoPE base */
    int sliding_window_pattern;   /* gemma3_text */
    double attn_logit_softcapping, final_logit_softcapping; /* gemma2 */
    int n_experts;                /* num_local_experts / num_experts */
    int n_experts_per_tok;        /* num_experts_per_tok */
    int moe_intermediate_size;    /* qwen3_moe, qwen2_moe */
    int shared_expert_intermediate_size; /* qwen2_moe */
    int decoder_sparse_step;      /* qwen3_moe, qwen2_moe */
    int original_max_position_embeddings; /* phi3 (longrope) */
    double swiglu_limit, swiglu_alpha;    /* gpt_oss */
    const char *rope_scaling;     /* the rope_scaling an absent key means, as JSON; NULL: none */
} loom_family_defaults_t;

/* The defaults of `model_type`; NULL for a family Loom does not run. */
const loom_family_defaults_t *loom_model_family_defaults(const char *model_type);
/* The i-th row of the table (in docs/model-format.md's order); NULL past the end. */
const loom_family_defaults_t *loom_model_family_defaults_at(size_t i);

/* Reads DIR/config.json; errors name the file and the offending field. */
loom_status_t loom_model_config_load(const char *dir, loom_model_config_t *cfg, loom_err_t *err);
/* Parses config.json text; `path` is used in error messages only. */
loom_status_t loom_model_config_parse(const char *json, size_t len, const char *path,
                                      loom_model_config_t *cfg, loom_err_t *err);
int loom_model_config_is_eos(const loom_model_config_t *cfg, int id);
/* The attention window of layer `layer` (0: full attention). */
int loom_model_config_layer_window(const loom_model_config_t *cfg, int layer);
/* Whether layer `layer`'s feed-forward block is a Mixture of Experts. */
int loom_model_config_layer_moe(const loom_model_config_t *cfg, int layer);
/* Whether every layer is windowed (blocks behind the window can be freed). */
int loom_model_config_all_windowed(const loom_model_config_t *cfg);

#endif
