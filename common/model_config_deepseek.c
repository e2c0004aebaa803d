/* DeepSeek-V2 / V3 config.json: multi-head latent attention (q_lora_rank,
 * kv_lora_rank, the nope / rope / v head dims), DeepSeekMoE (routed and
 * shared experts, groups, topk_method, scoring_func, routed_scaling_factor,
 * first_k_dense_replace), yarn with mscale / mscale_all_dim, rope_interleave,
 * MTP layers and FP8 block checkpoints. Absent keys take the config class's
 * default (one table per family below); keys whose meaning Loom would get
 * wrong are refused by name. */
#include "common/model_config_deepseek.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/fp8.h"
#include "common/util.h"

/* One family's defaults. -1 in an int: no default (the key is required). */
typedef struct {
    const char *model_type;
    int vocab_size, hidden_size, intermediate_size, moe_intermediate_size, num_hidden_layers,
        num_attention_heads, max_position_embeddings, bos_token_id, eos_token_id;
    int q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    int n_routed_experts, n_shared_experts, num_experts_per_tok, first_k_dense_replace, n_group, topk_group;
    int norm_topk_prob, rope_interleave;
    double routed_scaling_factor, rms_norm_eps, rope_theta;
    const char *topk_method, *scoring_func;
} ds_defaults_t;

static const ds_defaults_t k_defaults[] = {
    /* DeepseekV3Config (transformers src/transformers/models/deepseek_v3/configuration_deepseek_v3.py,
     * v4.57). topk_method and scoring_func are not keys of that class: DeepseekV3TopkRouter always
     * scores with a sigmoid and routes noaux_tc (DeepSeek's own config.json spells them so).
     * num_nextn_predict_layers is not a key of it either: absent means no MTP layers. */
    {"deepseek_v3", 129280, 7168, 18432, 2048, 61, 128, 4096, 0, 1,
     1536, 512, 128, 64, 128,
     256, 1, 8, 3, 8, 4,
     1, 1,
     2.5, 1e-6, 10000.0,
     "noaux_tc", "sigmoid"},
    /* DeepseekV2Config (transformers src/transformers/models/deepseek_v2/configuration_deepseek_v2.py,
     * v4.57): num_experts_per_tok, n_group and topk_group default to None there (required here when
     * used); scoring_func is DeepseekV2Moe's softmax; RoPE always turns interleaved pairs. */
    {"deepseek_v2", 32000, 4096, 11008, 1407, 32, 32, 2048, 1, 2,
     1536, 512, 128, 64, 128,
     64, 2, -1, 0, -1, -1,
     0, 1,
     1.0, 1e-6, 10000.0,
     "greedy", "softmax"},
};

int loom_model_config_is_deepseek(const char *model_type) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_defaults); i++)
        if (model_type && !strcmp(model_type, k_defaults[i].model_type)) return 1;
    return 0;
}

double loom_yarn_mscale(double scale, double mscale) {
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

size_t loom_deepseek_kv_bytes_per_token(const loom_model_config_t *cfg, size_t elem_size) {
    return (size_t)cfg->n_layers * (size_t)(cfg->kv_lora_rank + cfg->qk_rope_head_dim) * elem_size;
}

size_t loom_deepseek_mha_kv_bytes_per_token(const loom_model_config_t *cfg, size_t elem_size, int int8_scales) {
    const size_t qk = (size_t)(cfg->qk_nope_head_dim + cfg->qk_rope_head_dim), v = (size_t)cfg->v_head_dim;
    return (size_t)cfg->n_layers * (size_t)cfg->n_heads *
           ((qk + v) * elem_size + (int8_scales ? 2 * sizeof(float) : 0));
}

int loom_mla_disable_env(void) {
    const char *e = getenv("LOOM_MLA_DISABLE");
    if (!e || !*e) return 0;
    if (!strcasecmp(e, "true")) return 1;
    char *end;
    long v = strtol(e, &end, 10); /* vLLM: bool(int(value)) */
    return !*end && v != 0;
}

/* ---------------------------------------------------------------- key readers */

/* Absent and null both mean "the default" (q_lora_rank reads its null itself). */
static const cJSON *field(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNull(v) ? NULL : v;
}

/* An integer >= min; dflt -1 makes the key required. */
static loom_status_t get_int(const cJSON *o, const char *key, int dflt, int min, int *out, const char *path,
                             loom_err_t *err) {
    const cJSON *v = field(o, key);
    if (!v) {
        if (dflt < 0)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s is missing (the config class has no default)", path,
                                key);
        *out = dflt;
        return LOOM_OK;
    }
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d >= min && d <= INT_MAX) || d != floor(d))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be an integer >= %d", path, key, min);
    *out = (int)d;
    return LOOM_OK;
}

static loom_status_t get_num(const cJSON *o, const char *key, double dflt, double *out, const char *path,
                             loom_err_t *err) {
    const cJSON *v = field(o, key);
    if (!v) {
        *out = dflt;
        return LOOM_OK;
    }
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0 && v->valuedouble <= 1e30))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a positive number", path, key);
    *out = v->valuedouble;
    return LOOM_OK;
}

static loom_status_t get_bool(const cJSON *o, const char *key, int dflt, int *out, const char *path,
                              loom_err_t *err) {
    const cJSON *v = field(o, key);
    if (!v) {
        *out = dflt;
        return LOOM_OK;
    }
    if (!cJSON_IsBool(v)) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be true or false", path, key);
    *out = cJSON_IsTrue(v);
    return LOOM_OK;
}

static loom_status_t get_str(const cJSON *o, const char *key, const char *dflt, const char **out,
                             const char *path, loom_err_t *err) {
    const cJSON *v = field(o, key);
    if (v && !cJSON_IsString(v)) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a string", path, key);
    *out = v ? v->valuestring : dflt;
    return LOOM_OK;
}

/* ---------------------------------------------------------------- parts */

/* rope_scaling (or rope_parameters): none/default, or yarn with DeepSeek's mscale and mscale_all_dim.
 * cos and sin are multiplied by mscale(f, mscale) / mscale(f, mscale_all_dim) when both are given
 * (else mscale(f)), and the softmax scale by mscale(f, mscale_all_dim)^2 (DeepseekV3Attention). */
static loom_status_t parse_rope(loom_model_config_t *cfg, const cJSON *rs, const char *path, loom_err_t *err) {
    cfg->rope_scaling = LOOM_ROPE_NONE;
    cfg->rope_attn_factor = 1.0f;
    double qk = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim;
    cfg->attn_scale = (float)(1.0 / sqrt(qk));
    if (!rs) return LOOM_OK;
    if (!cJSON_IsObject(rs)) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling must be an object", path);
    const cJSON *t = field(rs, "rope_type");
    if (!t) t = field(rs, "type");
    if (!cJSON_IsString(t))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling needs a string \"rope_type\" (or \"type\")",
                            path);
    if (!strcmp(t->valuestring, "default")) return LOOM_OK;
    if (strcmp(t->valuestring, "yarn"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: rope_scaling type '%s' is not supported for %s (Loom reads yarn, or none)", path,
                            t->valuestring, cfg->model_type);
    double f = 0, bf = 0, bs = 0, ms = 0, msa = 0, af = 0;
    if (!field(rs, "factor")) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling.factor is missing", path);
    LOOM_CHECK(get_num(rs, "factor", 0, &f, path, err));
    LOOM_CHECK(get_int(rs, "original_max_position_embeddings", -1, 1, &cfg->rope_orig_max_pos, path, err));
    LOOM_CHECK(get_num(rs, "beta_fast", 32, &bf, path, err));
    LOOM_CHECK(get_num(rs, "beta_slow", 1, &bs, path, err));
    LOOM_CHECK(get_num(rs, "mscale", 0, &ms, path, err));
    LOOM_CHECK(get_num(rs, "mscale_all_dim", 0, &msa, path, err));
    LOOM_CHECK(get_bool(rs, "truncate", 1, &cfg->rope_truncate, path, err));
    if (field(rs, "attention_factor"))
        LOOM_CHECK(get_num(rs, "attention_factor", 0, &af, path, err));
    else
        af = ms > 0 && msa > 0 ? loom_yarn_mscale(f, ms) / loom_yarn_mscale(f, msa) : loom_yarn_mscale(f, 1.0);
    cfg->rope_scaling = LOOM_ROPE_YARN;
    cfg->rope_factor = (float)f;
    cfg->rope_beta_fast = (float)bf;
    cfg->rope_beta_slow = (float)bs;
    cfg->rope_mscale = (float)ms;
    cfg->rope_mscale_all_dim = (float)msa;
    cfg->rope_attn_factor = (float)af;
    if (msa > 0) {
        double m = loom_yarn_mscale(f, msa);
        cfg->attn_scale = (float)(m * m / sqrt(qk));
    }
    return LOOM_OK;
}

/* DeepSeekMoE: the router's scoring and choice, and what the config class allows of each family. */
static loom_status_t parse_moe(loom_model_config_t *cfg, const cJSON *root, const ds_defaults_t *d, const char *path,
                               loom_err_t *err) {
    const char *method = NULL, *scoring = NULL;
    LOOM_CHECK(get_int(root, "n_routed_experts", d->n_routed_experts, 1, &cfg->n_experts, path, err));
    LOOM_CHECK(get_int(root, "num_experts_per_tok", d->num_experts_per_tok, 1, &cfg->n_experts_per_tok, path, err));
    LOOM_CHECK(get_int(root, "n_shared_experts", d->n_shared_experts, 0, &cfg->n_shared_experts, path, err));
    LOOM_CHECK(get_int(root, "moe_intermediate_size", d->moe_intermediate_size, 1, &cfg->moe_hidden_dim, path, err));
    LOOM_CHECK(get_int(root, "first_k_dense_replace", d->first_k_dense_replace, 0, &cfg->first_k_dense_replace, path,
                       err));
    LOOM_CHECK(get_bool(root, "norm_topk_prob", d->norm_topk_prob, &cfg->norm_topk_prob, path, err));
    double rsf = 0;
    LOOM_CHECK(get_num(root, "routed_scaling_factor", d->routed_scaling_factor, &rsf, path, err));
    cfg->routed_scaling_factor = (float)rsf;
    LOOM_CHECK(get_str(root, "topk_method", d->topk_method, &method, path, err));
    LOOM_CHECK(get_str(root, "scoring_func", d->scoring_func, &scoring, path, err));
    int v3 = cfg->deepseek == 3, freq = 1;
    LOOM_CHECK(get_int(root, "moe_layer_freq", 1, 1, &freq, path, err));
    if (freq != 1)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: moe_layer_freq %d is not supported (every layer from "
                            "first_k_dense_replace on is a MoE layer)", path, freq);
    if (v3 ? strcmp(method, "noaux_tc") : strcmp(method, "greedy") && strcmp(method, "group_limited_greedy"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: topk_method '%s' is not supported for %s (%s)", path,
                            method, cfg->model_type, v3 ? "noaux_tc" : "greedy or group_limited_greedy");
    if (strcmp(scoring, v3 ? "sigmoid" : "softmax"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: scoring_func '%s' is not supported for %s (%s)", path,
                            scoring, cfg->model_type, v3 ? "sigmoid" : "softmax");
    cfg->scoring_sigmoid = v3;
    cfg->topk_method = v3 ? LOOM_DS_TOPK_NOAUX_TC
                          : !strcmp(method, "greedy") ? LOOM_DS_TOPK_GREEDY : LOOM_DS_TOPK_GROUP_LIMITED;
    /* DeepSeek's V2 code renormalises instead of scaling when norm_topk_prob is set; Transformers'
     * DeepseekV2Moe never renormalises. The released V2 configs say false; refuse the ambiguity. */
    if (!v3 && cfg->norm_topk_prob)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: norm_topk_prob true is not supported for deepseek_v2 (implementations disagree on "
                            "it)", path);
    int grouped = cfg->topk_method != LOOM_DS_TOPK_GREEDY;
    cfg->n_group = cfg->topk_group = 1;
    if (grouped) {
        LOOM_CHECK(get_int(root, "n_group", d->n_group, 1, &cfg->n_group, path, err));
        LOOM_CHECK(get_int(root, "topk_group", d->topk_group, 1, &cfg->topk_group, path, err));
        if (cfg->n_experts % cfg->n_group)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: n_routed_experts (%d) is not divisible by n_group (%d)",
                                path, cfg->n_experts, cfg->n_group);
        if (cfg->topk_group > cfg->n_group)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: topk_group (%d) exceeds n_group (%d)", path,
                                cfg->topk_group, cfg->n_group);
        if (cfg->topk_method == LOOM_DS_TOPK_NOAUX_TC && cfg->n_experts / cfg->n_group < 2)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: noaux_tc ranks a group by its best two experts; n_group (%d) leaves %d", path,
                                cfg->n_group, cfg->n_experts / cfg->n_group);
    }
    int reach = grouped ? cfg->n_experts / cfg->n_group * cfg->topk_group : cfg->n_experts;
    if (cfg->n_experts_per_tok > reach)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: num_experts_per_tok (%d) exceeds the %d experts its topk_group groups hold", path,
                            cfg->n_experts_per_tok, reach);
    if (cfg->first_k_dense_replace > cfg->n_layers) cfg->first_k_dense_replace = cfg->n_layers;
    for (int l = 0; l < cfg->first_k_dense_replace; l++) cfg->mlp_only[l] = 1;
    cfg->moe_sparse_step = 1;
    /* the shared experts: one MLP of n_shared_experts x moe_intermediate_size, added ungated */
    cfg->moe_shared_hidden = cfg->n_shared_experts * cfg->moe_hidden_dim;
    return LOOM_OK;
}

/* The latent attention's dims, and the head_dim / qk_head_dim keys a saved config may carry beside them. */
static loom_status_t parse_mla(loom_model_config_t *cfg, const cJSON *root, const ds_defaults_t *d, const char *path,
                               loom_err_t *err) {
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "q_lora_rank");
    cfg->q_lora_rank = d->q_lora_rank;
    if (q && cJSON_IsNull(q)) cfg->q_lora_rank = 0; /* null: one q_proj (V2-Lite) */
    else LOOM_CHECK(get_int(root, "q_lora_rank", d->q_lora_rank, 0, &cfg->q_lora_rank, path, err));
    LOOM_CHECK(get_int(root, "kv_lora_rank", d->kv_lora_rank, 1, &cfg->kv_lora_rank, path, err));
    LOOM_CHECK(get_int(root, "qk_nope_head_dim", d->qk_nope_head_dim, 1, &cfg->qk_nope_head_dim, path, err));
    LOOM_CHECK(get_int(root, "qk_rope_head_dim", d->qk_rope_head_dim, 2, &cfg->qk_rope_head_dim, path, err));
    LOOM_CHECK(get_int(root, "v_head_dim", d->v_head_dim, 1, &cfg->v_head_dim, path, err));
    int qk = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim, hd = 0;
    if (cfg->qk_rope_head_dim % 2 || cfg->qk_rope_head_dim / 2 > LOOM_MAX_ROPE_PAIRS)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: qk_rope_head_dim (%d) must be even and at most %d", path,
                            cfg->qk_rope_head_dim, 2 * LOOM_MAX_ROPE_PAIRS);
    if (field(root, "qk_head_dim")) {
        LOOM_CHECK(get_int(root, "qk_head_dim", 0, 1, &hd, path, err));
        if (hd != qk)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: inconsistent head dims: qk_head_dim %d is not qk_nope_head_dim + qk_rope_head_dim "
                                "(%d + %d)", path, hd, cfg->qk_nope_head_dim, cfg->qk_rope_head_dim);
    }
    if (field(root, "head_dim")) { /* the config classes set it to qk_rope_head_dim (the RoPE's dims) */
        LOOM_CHECK(get_int(root, "head_dim", 0, 1, &hd, path, err));
        if (hd != cfg->qk_rope_head_dim && hd != qk)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: inconsistent head dims: head_dim %d is neither qk_rope_head_dim (%d) nor "
                                "qk_nope_head_dim + qk_rope_head_dim (%d)", path, hd, cfg->qk_rope_head_dim, qk);
    }
    /* the engine attends over the latent cache (worker/engine/attn_mla.c): one KV head whose row is the
     * latent and the rope key, each query head as wide */
    cfg->head_dim = cfg->kv_lora_rank + cfg->qk_rope_head_dim;
    cfg->rotary_dim = cfg->qk_rope_head_dim;
    return LOOM_OK;
}

/* quantization_config: none, or fp8 blocks (DeepSeek-V3's: e4m3, dynamic activations, 128 x 128). */
static loom_status_t parse_quant(loom_model_config_t *cfg, const cJSON *root, const char *path, loom_err_t *err) {
    const cJSON *qc = field(root, "quantization_config");
    if (!qc) return LOOM_OK;
    const char *m = NULL, *fmt = NULL, *act = NULL;
    if (!cJSON_IsObject(qc)) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: quantization_config must be an object", path);
    LOOM_CHECK(get_str(qc, "quant_method", NULL, &m, path, err));
    if (!m || strcmp(m, "fp8"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: quantization_config.quant_method '%s' is not supported for %s (Loom reads fp8 "
                            "block checkpoints)", path, m ? m : "?", cfg->model_type);
    LOOM_CHECK(get_str(qc, "fmt", "e4m3", &fmt, path, err));
    LOOM_CHECK(get_str(qc, "activation_scheme", "dynamic", &act, path, err));
    if (strcmp(fmt, "e4m3"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: fp8 fmt '%s' is not supported (e4m3)", path, fmt);
    if (strcmp(act, "dynamic"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: fp8 activation_scheme '%s' is not supported (dynamic: weights only)", path, act);
    const cJSON *b = field(qc, "weight_block_size"), *e;
    if (!cJSON_IsArray(b) || cJSON_GetArraySize(b) != 2)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: quantization_config.weight_block_size must list two positive integers", path);
    int i = 0;
    cJSON_ArrayForEach(e, b) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 1 || e->valuedouble > 65536 || e->valuedouble != floor(e->valuedouble))
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: quantization_config.weight_block_size must list two positive integers", path);
        cfg->ckpt_block[i++] = (int)e->valuedouble;
    }
    cfg->ckpt_quant = LOOM_CKPT_FP8;
    return LOOM_OK;
}

static loom_status_t parse_eos(loom_model_config_t *cfg, const cJSON *root, int dflt, const char *path,
                               loom_err_t *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "eos_token_id"), *e;
    if (!v) {
        cfg->eos_ids[cfg->n_eos++] = dflt;
        return LOOM_OK;
    }
    if (cJSON_IsNull(v)) return LOOM_OK;
    if (cJSON_IsNumber(v)) {
        int id;
        LOOM_CHECK(get_int(root, "eos_token_id", 0, 0, &id, path, err));
        cfg->eos_ids[cfg->n_eos++] = id;
        return LOOM_OK;
    }
    if (!cJSON_IsArray(v))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: eos_token_id must be an integer or a list of them", path);
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > INT_MAX || e->valuedouble != floor(e->valuedouble))
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: eos_token_id entries must be non-negative integers", path);
        int id = (int)e->valuedouble;
        if (loom_model_config_is_eos(cfg, id)) continue;
        if (cfg->n_eos == LOOM_MAX_EOS)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: more than %d distinct eos_token_id values", path,
                                LOOM_MAX_EOS);
        cfg->eos_ids[cfg->n_eos++] = id;
    }
    return LOOM_OK;
}

loom_status_t loom_model_config_parse_deepseek(const void *root_v, const char *path, loom_model_config_t *cfg,
                                               loom_err_t *err) {
    const cJSON *root = root_v;
    const cJSON *mt = field(root, "model_type");
    const ds_defaults_t *d = NULL;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_defaults); i++)
        if (cJSON_IsString(mt) && !strcmp(mt->valuestring, k_defaults[i].model_type)) d = &k_defaults[i];
    LOOM_ASSERT(d);
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", d->model_type);
    cfg->deepseek = d->model_type[10] - '0'; /* "deepseek_v3" -> 3 */
    LOOM_CHECK(get_int(root, "vocab_size", d->vocab_size, 1, &cfg->vocab_size, path, err));
    LOOM_CHECK(get_int(root, "hidden_size", d->hidden_size, 1, &cfg->dim, path, err));
    LOOM_CHECK(get_int(root, "intermediate_size", d->intermediate_size, 1, &cfg->hidden_dim, path, err));
    LOOM_CHECK(get_int(root, "num_hidden_layers", d->num_hidden_layers, 1, &cfg->n_layers, path, err));
    LOOM_CHECK(get_int(root, "num_attention_heads", d->num_attention_heads, 1, &cfg->n_heads, path, err));
    LOOM_CHECK(get_int(root, "max_position_embeddings", d->max_position_embeddings, 1, &cfg->max_seq_len, path, err));
    LOOM_CHECK(get_int(root, "num_nextn_predict_layers", 0, 0, &cfg->n_nextn_layers, path, err));
    if (cfg->n_layers > LOOM_MAX_LAYER_TYPES)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: %s with more than %d layers", path, cfg->model_type,
                            LOOM_MAX_LAYER_TYPES);
    /* the latent is one KV head shared by every query head: num_key_value_heads is informational (the
     * classes default it to num_attention_heads) */
    cfg->n_kv_heads = 1;
    double eps = 0, theta = 0;
    LOOM_CHECK(get_num(root, "rms_norm_eps", d->rms_norm_eps, &eps, path, err));
    cfg->norm_eps = (float)eps;
    const cJSON *rp = field(root, "rope_parameters"), *rs = field(root, "rope_scaling");
    if (rp && rs) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: both rope_scaling and rope_parameters are given", path);
    LOOM_CHECK(get_num(rp && field(rp, "rope_theta") ? rp : root, "rope_theta", d->rope_theta, &theta, path, err));
    cfg->rope_theta = (float)theta;
    LOOM_CHECK(parse_mla(cfg, root, d, path, err));
    LOOM_CHECK(parse_rope(cfg, rp ? rp : rs, path, err));
    LOOM_CHECK(get_bool(root, "rope_interleave", d->rope_interleave, &cfg->rope_interleave, path, err));
    if (cfg->deepseek == 2 && !cfg->rope_interleave)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: rope_interleave false is not supported for deepseek_v2 (its RoPE turns interleaved "
                            "pairs)", path);
    LOOM_CHECK(parse_moe(cfg, root, d, path, err));
    const char *act = NULL;
    LOOM_CHECK(get_str(root, "hidden_act", "silu", &act, path, err));
    if (strcmp(act, "silu") && strcmp(act, "swish"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: hidden_act '%s' is not supported for %s (silu)", path, act,
                            cfg->model_type);
    cfg->hidden_act = LOOM_HIDDEN_SILU;
    int bias = 0;
    LOOM_CHECK(get_bool(root, "attention_bias", 0, &bias, path, err));
    if (bias)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: attention_bias true is not supported for %s", path,
                            cfg->model_type);
    LOOM_CHECK(get_bool(root, "mlp_bias", 0, &bias, path, err));
    if (bias)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: mlp_bias is true; Loom's MLP has no biases", path);
    LOOM_CHECK(get_bool(root, "tie_word_embeddings", 0, &cfg->tie_embeddings, path, err));
    cfg->bos_id = d->bos_token_id;
    const cJSON *bos = cJSON_GetObjectItemCaseSensitive(root, "bos_token_id");
    if (bos && cJSON_IsNull(bos)) cfg->bos_id = -1;
    else LOOM_CHECK(get_int(root, "bos_token_id", d->bos_token_id, 0, &cfg->bos_id, path, err));
    if (cfg->bos_id >= cfg->vocab_size)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: bos_token_id (%d) is not below vocab_size (%d)", path,
                            cfg->bos_id, cfg->vocab_size);
    LOOM_CHECK(parse_eos(cfg, root, d->eos_token_id, path, err));
    const cJSON *dt = field(root, "torch_dtype");
    if (!dt) dt = field(root, "dtype");
    cfg->torch_dtype = !cJSON_IsString(dt)                      ? LOOM_DT_F32
                       : !strcmp(dt->valuestring, "bfloat16") ? LOOM_DT_BF16
                       : !strcmp(dt->valuestring, "float16")  ? LOOM_DT_F16
                                                              : LOOM_DT_F32;
    return parse_quant(cfg, root, path, err);
}

/* ---------------------------------------------------------------- the checkpoint */

loom_status_t loom_deepseek_check_checkpoint(const loom_model_config_t *cfg, const loom_st_t *st, loom_err_t *err) {
    char name[256];
    for (int l = cfg->first_k_dense_replace; l < cfg->n_layers && cfg->topk_method == LOOM_DS_TOPK_NOAUX_TC; l++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        const loom_st_tensor_t *t = loom_st_find(st, name);
        if (!t)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: tensor '%s' is missing (topk_method noaux_tc chooses experts with it)",
                                cfg->model_type, name);
        if (t->n_dims != 1 || t->shape[0] != cfg->n_experts)
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s must have shape [%d]", name, t->file,
                                cfg->n_experts);
    }
    for (int i = 0; i < loom_st_count(st); i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        if (t->dtype != LOOM_DT_F8_E4M3) continue;
        if (cfg->ckpt_quant != LOOM_CKPT_FP8)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "tensor '%s' in %s is F8_E4M3 but config.json has no fp8 quantization_config",
                                t->name, t->file);
        if (strlen(t->name) + sizeof "_scale_inv" > sizeof name)
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor name '%s' is too long", t->name);
        snprintf(name, sizeof name, "%s_scale_inv", t->name);
        LOOM_CHECK(loom_fp8_check_scale(t, loom_st_find(st, name), cfg->ckpt_block[0], cfg->ckpt_block[1], err));
    }
    return LOOM_OK;
}
