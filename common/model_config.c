/* Reads a Hugging Face config.json into loom_model_config_t: the fields a
 * Llama-family decoder needs, their defaults (k_families: a row per family,
 * from its Transformers config class), and checks that refuse a config
 * Loom would run wrongly (unknown architectures, unsupported RoPE scaling,
 * head counts that do not divide). generation_config.json adds EOS ids. */
#include "common/model_config.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "common/json.h"
#include "common/model_config_deepseek.h"
#include "common/util.h"

/* Every family's defaults, one row each, read from the __init__ (or the
 * dataclass fields) of its Transformers config class in
 * src/transformers/models/<family>/configuration_<family>.py, as of
 * Transformers 5.0 (Gemma3TextConfig: 4.50). rope_theta is the class's
 * default_theta where Transformers 5 moved it into rope_parameters. */
static const loom_family_defaults_t k_families[] = {
    /* LlamaConfig (configuration_llama.py) */
    {.model_type = "llama", .config_class = "LlamaConfig", .max_position_embeddings = 2048,
     .rms_norm_eps = 1e-6, .rope_theta = 10000.0, .hidden_act = "silu"},
    /* MistralConfig (configuration_mistral.py): 4096 * 32 positions, 8 KV heads, a window of 4096 */
    {.model_type = "mistral", .config_class = "MistralConfig", .n_kv_heads = 8, .max_position_embeddings = 131072,
     .rms_norm_eps = 1e-6, .rope_theta = 10000.0, .hidden_act = "silu", .sliding_window = 4096},
    /* Qwen2Config (configuration_qwen2.py): q/k/v biases always (Qwen2Attention); use_sliding_window false */
    {.model_type = "qwen2", .config_class = "Qwen2Config", .n_kv_heads = 32, .max_position_embeddings = 32768,
     .rms_norm_eps = 1e-6, .rope_theta = 10000.0, .hidden_act = "silu", .attention_bias = 1},
    /* Qwen3Config (configuration_qwen3.py): head_dim 128 whatever hidden_size / heads is */
    {.model_type = "qwen3", .config_class = "Qwen3Config", .n_kv_heads = 32, .head_dim = 128,
     .max_position_embeddings = 32768, .rms_norm_eps = 1e-6, .rope_theta = 10000.0, .hidden_act = "silu"},
    /* Phi3Config (configuration_phi3.py) */
    {.model_type = "phi3", .config_class = "Phi3Config", .max_position_embeddings = 4096, .rms_norm_eps = 1e-5,
     .rope_theta = 10000.0, .hidden_act = "silu", .original_max_position_embeddings = 4096},
    /* Gemma2Config (configuration_gemma2.py) */
    {.model_type = "gemma2", .config_class = "Gemma2Config", .n_kv_heads = 4, .head_dim = 256,
     .max_position_embeddings = 8192, .rms_norm_eps = 1e-6, .rope_theta = 10000.0,
     .hidden_act = "gelu_pytorch_tanh", .tie_word_embeddings = 1, .sliding_window = 4096,
     .query_pre_attn_scalar = 256, .attn_logit_softcapping = 50.0, .final_logit_softcapping = 30.0},
    /* Gemma3TextConfig (configuration_gemma3.py): the global layers' base 1e6, the sliding ones' 1e4 */
    {.model_type = "gemma3_text", .config_class = "Gemma3TextConfig", .n_kv_heads = 4, .head_dim = 256,
     .max_position_embeddings = 131072, .rms_norm_eps = 1e-6, .rope_theta = 1000000.0,
     .hidden_act = "gelu_pytorch_tanh", .tie_word_embeddings = 1, .sliding_window = 4096,
     .query_pre_attn_scalar = 256, .rope_local_base_freq = 10000.0, .sliding_window_pattern = 6},
    /* MixtralConfig (configuration_mixtral.py): default_theta 1e6 */
    {.model_type = "mixtral", .config_class = "MixtralConfig", .n_kv_heads = 8, .max_position_embeddings = 131072,
     .rms_norm_eps = 1e-5, .rope_theta = 1000000.0, .hidden_act = "silu", .n_experts = 8, .n_experts_per_tok = 2},
    /* Qwen3MoeConfig (configuration_qwen3_moe.py) */
    {.model_type = "qwen3_moe", .config_class = "Qwen3MoeConfig", .n_kv_heads = 4, .max_position_embeddings = 32768,
     .rms_norm_eps = 1e-6, .rope_theta = 10000.0, .hidden_act = "silu", .n_experts = 128, .n_experts_per_tok = 8,
     .moe_intermediate_size = 768, .decoder_sparse_step = 1},
    /* Qwen2MoeConfig (configuration_qwen2_moe.py): q/k/v biases always (qkv_bias) */
    {.model_type = "qwen2_moe", .config_class = "Qwen2MoeConfig", .n_kv_heads = 16, .max_position_embeddings = 32768,
     .rms_norm_eps = 1e-6, .rope_theta = 10000.0, .hidden_act = "silu", .attention_bias = 1, .n_experts = 60,
     .n_experts_per_tok = 4, .moe_intermediate_size = 1408, .shared_expert_intermediate_size = 5632,
     .decoder_sparse_step = 1},
    /* GptOssConfig (configuration_gpt_oss.py): default_theta 150000, and gpt-oss's yarn when rope_scaling is absent */
    {.model_type = "gpt_oss", .config_class = "GptOssConfig", .n_kv_heads = 8, .head_dim = 64,
     .max_position_embeddings = 131072, .rms_norm_eps = 1e-5, .rope_theta = 150000.0, .hidden_act = "silu",
     .attention_bias = 1, .sliding_window = 128, .n_experts = 128, .n_experts_per_tok = 4, .swiglu_limit = 7.0,
     .swiglu_alpha = 1.702,
     .rope_scaling = "{\"rope_type\":\"yarn\",\"factor\":32.0,\"beta_fast\":32.0,\"beta_slow\":1.0,"
                     "\"original_max_position_embeddings\":4096,\"truncate\":false}"},
};

const loom_family_defaults_t *loom_model_family_defaults(const char *model_type) {
    for (size_t i = 0; model_type && i < LOOM_ARRAY_LEN(k_families); i++)
        if (!strcmp(model_type, k_families[i].model_type)) return &k_families[i];
    return NULL;
}

const loom_family_defaults_t *loom_model_family_defaults_at(size_t i) {
    return i < LOOM_ARRAY_LEN(k_families) ? &k_families[i] : NULL;
}

/* hidden_act values (Hugging Face's ACT2FN names) and what computes them. */
static const struct {
    const char *name;
    loom_hidden_act_t act;
} k_acts[] = {
    {"silu", LOOM_HIDDEN_SILU},           {"swish", LOOM_HIDDEN_SILU},
    {"gelu", LOOM_HIDDEN_GELU},           {"gelu_python", LOOM_HIDDEN_GELU},
    {"gelu_new", LOOM_HIDDEN_GELU_TANH},  {"gelu_pytorch_tanh", LOOM_HIDDEN_GELU_TANH},
    {"gelu_fast", LOOM_HIDDEN_GELU_TANH}, {"gelu_accurate", LOOM_HIDDEN_GELU_TANH},
    {"quick_gelu", LOOM_HIDDEN_QUICK_GELU}, {"relu", LOOM_HIDDEN_RELU},
    {"relu2", LOOM_HIDDEN_RELU2},
};


/* An absent key and an explicit null both mean "use the default". */
static const cJSON *field(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static int json_int(const cJSON *v, int *out) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= INT_MIN && d <= INT_MAX)) return 0;
    int i = (int)d;
    if ((double)i != d) return 0;
    *out = i;
    return 1;
}

/* Integer field: required ones must be present; present ones must be
 * positive integers. */
static loom_status_t get_pos_int(const cJSON *root, const char *key, int required, int dflt,
                                 int *out, const char *path, loom_err_t *err) {
    const cJSON *v = field(root, key);
    if (!v) {
        if (required) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s is missing", path, key);
        *out = dflt;
        return LOOM_OK;
    }
    if (!json_int(v, out))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be an integer", path, key);
    if (*out <= 0)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be positive (got %d)", path, key,
                            *out);
    return LOOM_OK;
}

static loom_status_t get_pos_float(const cJSON *obj, const char *key, int required, float dflt,
                                   float *out, const char *path, loom_err_t *err) {
    const cJSON *v = field(obj, key);
    if (!v) {
        if (required) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s is missing", path, key);
        *out = dflt;
        return LOOM_OK;
    }
    if (!cJSON_IsNumber(v))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a number", path, key);
    double d = v->valuedouble;
    if (!(d > 0 && d <= 3.0e38))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a positive number (got %g)", path,
                            key, d);
    *out = (float)d;
    return LOOM_OK;
}

static loom_status_t get_bool(const cJSON *root, const char *key, int dflt, int *out,
                              const char *path, loom_err_t *err) {
    const cJSON *v = field(root, key);
    if (!v) {
        *out = dflt;
        return LOOM_OK;
    }
    if (!cJSON_IsBool(v))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be true or false", path, key);
    *out = cJSON_IsTrue(v);
    return LOOM_OK;
}

static loom_status_t add_eos(loom_model_config_t *cfg, int id, const char *path, loom_err_t *err) {
    if (loom_model_config_is_eos(cfg, id)) return LOOM_OK;
    if (cfg->n_eos == LOOM_MAX_EOS)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: more than %d distinct eos_token_id values",
                            path, LOOM_MAX_EOS);
    cfg->eos_ids[cfg->n_eos++] = id;
    return LOOM_OK;
}

/* eos_token_id: absent, null, an int, or a list of ints (Llama 3). */
static loom_status_t merge_eos(loom_model_config_t *cfg, const cJSON *root, const char *path,
                               loom_err_t *err) {
    const cJSON *v = field(root, "eos_token_id");
    if (!v) return LOOM_OK;
    int id;
    if (cJSON_IsArray(v)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (!json_int(e, &id) || id < 0)
                return loom_err_set(err, LOOM_ERR_FORMAT,
                                    "%s: eos_token_id entries must be non-negative integers", path);
            LOOM_CHECK(add_eos(cfg, id, path, err));
        }
        return LOOM_OK;
    }
    if (!json_int(v, &id) || id < 0)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: eos_token_id must be a non-negative integer or a list of them",
                            path);
    return add_eos(cfg, id, path, err);
}

static loom_status_t rope_num(const cJSON *rs, const char *name, int required, double dflt, double *out,
                              const char *path, loom_err_t *err) {
    const cJSON *v = field(rs, name);
    if (!v) {
        if (required) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling.%s is missing", path, name);
        *out = dflt;
        return LOOM_OK;
    }
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0 && v->valuedouble <= 1e30))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling.%s must be a positive number", path, name);
    *out = v->valuedouble;
    return LOOM_OK;
}

static loom_status_t rope_orig(loom_model_config_t *cfg, const cJSON *rs, int required, const char *path,
                               loom_err_t *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(rs, "original_max_position_embeddings");
    if (!v || cJSON_IsNull(v)) {
        if (required)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling.original_max_position_embeddings is missing",
                                path);
        cfg->rope_orig_max_pos = cfg->max_seq_len;
        return LOOM_OK;
    }
    if (!json_int(v, &cfg->rope_orig_max_pos) || cfg->rope_orig_max_pos <= 0)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: rope_scaling.original_max_position_embeddings must be a positive integer", path);
    return LOOM_OK;
}

/* rope_scaling (or Transformers 5's rope_parameters): default, linear,
 * llama3 and yarn are computed (worker/model.c rope_inv_freq); dynamic
 * (NTK that changes with each sequence's length) and longrope (factor sets
 * chosen by length) are refused by name. */
/* longrope (Phi-3's "su"): inv_freq_j = 1 / (ext_j * theta^(2j/hd)) with
 * short_factor below original_max_position_embeddings and long_factor
 * beyond, where Transformers switches by the sequence's length. Loom runs
 * the short factors only and cuts max_seq_len to the original context, so
 * every sequence it serves is computed as Transformers computes it. */
static loom_status_t parse_longrope(loom_model_config_t *cfg, const cJSON *root, const cJSON *rs, const char *path,
                                    loom_err_t *err) {
    const char *names[2] = {"short_factor", "long_factor"};
    int pairs = cfg->rotary_dim / 2;
    for (int k = 0; k < 2; k++) {
        const cJSON *a = field(rs, names[k]), *e;
        if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != pairs)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling.%s must list %s / 2 (%d) numbers", path,
                                names[k], cfg->rotary_dim < cfg->head_dim ? "the rotary dims" : "head_dim", pairs);
        int j = 0;
        cJSON_ArrayForEach(e, a) {
            if (!cJSON_IsNumber(e) || !(e->valuedouble > 0 && e->valuedouble < 1e30))
                return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling.%s[%d] must be a positive number", path,
                                    names[k], j);
            if (k == 0) cfg->rope_ext_factor[j] = (float)e->valuedouble;
            j++;
        }
    }
    const cJSON *o = field(rs, "original_max_position_embeddings");
    if (!o) o = field(root, "original_max_position_embeddings");
    const loom_family_defaults_t *d = loom_model_family_defaults(cfg->model_type);
    cfg->rope_orig_max_pos = d && d->original_max_position_embeddings ? d->original_max_position_embeddings
                                                                      : cfg->max_seq_len;
    if (o && (!json_int(o, &cfg->rope_orig_max_pos) || cfg->rope_orig_max_pos <= 0))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: original_max_position_embeddings must be a positive integer",
                            path);
    double factor = (double)cfg->max_seq_len / cfg->rope_orig_max_pos, af = 1;
    LOOM_CHECK(rope_num(rs, "factor", 0, factor, &factor, path, err));
    if (field(rs, "attention_factor"))
        LOOM_CHECK(rope_num(rs, "attention_factor", 1, 0, &af, path, err));
    else
        af = factor <= 1.0 ? 1.0 : sqrt(1.0 + log(factor) / log((double)cfg->rope_orig_max_pos));
    cfg->rope_scaling = LOOM_ROPE_LONGROPE;
    cfg->rope_factor = (float)factor;
    cfg->rope_attn_factor = (float)af;
    if (cfg->max_seq_len > cfg->rope_orig_max_pos) {
        cfg->max_seq_len = cfg->rope_orig_max_pos;
        cfg->rope_ctx_capped = 1;
    }
    return LOOM_OK;
}

/* Phi3Config's partial_rotary_factor (Phi-4-mini: 0.75): RoPE turns the
 * first int(factor * head_dim) dims of each head, rotate-half within them,
 * and the frequencies are those of a head that size
 * (Transformers' apply_rotary_pos_emb with cos.shape[-1] < head_dim). */
static loom_status_t parse_rotary_dim(loom_model_config_t *cfg, const cJSON *root, const char *path, loom_err_t *err) {
    cfg->rotary_dim = cfg->head_dim;
    const cJSON *v = field(root, "partial_rotary_factor");
    if (!v || strcmp(cfg->model_type, "phi3")) return LOOM_OK; /* refuse_keys refuses it elsewhere */
    if (!cJSON_IsNumber(v) || !(v->valuedouble > 0 && v->valuedouble <= 1))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: partial_rotary_factor must be a number in (0, 1]", path);
    int rd = (int)(v->valuedouble * cfg->head_dim);
    if (rd < 2 || rd % 2)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: partial_rotary_factor %g of head_dim %d gives %d rotary dims; RoPE needs an even "
                            "number, at least 2",
                            path, v->valuedouble, cfg->head_dim, rd);
    cfg->rotary_dim = rd;
    return LOOM_OK;
}

static loom_status_t parse_rope_scaling(loom_model_config_t *cfg, const cJSON *root, const cJSON *rs,
                                        const char *path, loom_err_t *err) {
    cfg->rope_scaling = LOOM_ROPE_NONE;
    cfg->rope_attn_factor = 1.0f;
    if (!rs) return LOOM_OK;
    if (!cJSON_IsObject(rs))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_scaling must be an object or null",
                            path);
    const cJSON *type = field(rs, "rope_type");
    if (!type) type = field(rs, "type");
    if (!cJSON_IsString(type))
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: rope_scaling needs a string \"rope_type\" (or \"type\")", path);
    const char *t = type->valuestring;
    double f = 0;
    if (!strcmp(t, "default")) return LOOM_OK;
    if (!strcmp(t, "longrope") || !strcmp(t, "su")) {
        if (cfg->head_dim / 2 > LOOM_MAX_ROPE_PAIRS)
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: head_dim %d is too large for longrope", path,
                                cfg->head_dim);
        return parse_longrope(cfg, root, rs, path, err);
    }
    if (!strcmp(t, "linear")) {
        LOOM_CHECK(rope_num(rs, "factor", 1, 0, &f, path, err));
        cfg->rope_scaling = LOOM_ROPE_LINEAR;
        cfg->rope_factor = (float)f;
        return LOOM_OK;
    }
    if (!strcmp(t, "yarn")) {
        static const char *const refused[] = {"mscale", "mscale_all_dim"};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(refused); i++)
            if (field(rs, refused[i]))
                return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                    "%s: rope_scaling.%s (DeepSeek's yarn variant) is not supported", path,
                                    refused[i]);
        cfg->rope_scaling = LOOM_ROPE_YARN;
        double bf = 0, bs = 0, af = 1;
        LOOM_CHECK(rope_num(rs, "factor", 1, 0, &f, path, err));
        LOOM_CHECK(rope_num(rs, "beta_fast", 0, 32, &bf, path, err));
        LOOM_CHECK(rope_num(rs, "beta_slow", 0, 1, &bs, path, err));
        LOOM_CHECK(rope_orig(cfg, rs, 0, path, err));
        LOOM_CHECK(get_bool(rs, "truncate", 1, &cfg->rope_truncate, path, err));
        cfg->rope_factor = (float)f;
        cfg->rope_beta_fast = (float)bf;
        cfg->rope_beta_slow = (float)bs;
        if (field(rs, "attention_factor")) {
            LOOM_CHECK(rope_num(rs, "attention_factor", 1, 0, &af, path, err));
        } else {
            /* Transformers versions differ on the default when
             * max_position_embeddings / original_max_position_embeddings is
             * not the factor; refuse rather than pick one. */
            double ratio = (double)cfg->max_seq_len / cfg->rope_orig_max_pos;
            if (field(rs, "original_max_position_embeddings") && fabs(ratio - f) > 1e-6 * f)
                return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                    "%s: rope_scaling yarn: factor %g is not max_position_embeddings / "
                                    "original_max_position_embeddings (%g); give rope_scaling.attention_factor",
                                    path, f, ratio);
            af = f <= 1 ? 1.0 : 0.1 * log(f) + 1.0;
        }
        cfg->rope_attn_factor = (float)af;
        return LOOM_OK;
    }
    if (strcmp(t, "llama3") != 0)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: rope_scaling type '%s' is not supported (Loom supports default, linear, llama3, "
                            "yarn and longrope)",
                            path, t);

    cfg->rope_scaling = LOOM_ROPE_LLAMA3;
    char key[64];
    const char *names[3] = {"factor", "low_freq_factor", "high_freq_factor"};
    float *dsts[3] = {&cfg->rope_factor, &cfg->rope_low_freq_factor, &cfg->rope_high_freq_factor};
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "rope_scaling.%s", names[i]);
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(rs, names[i]);
        if (!v) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s is missing", path, key);
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0 && v->valuedouble <= 1e30))
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a positive number", path,
                                key);
        *dsts[i] = (float)v->valuedouble;
    }
    if (!(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor))
        return loom_err_set(
            err, LOOM_ERR_FORMAT,
            "%s: rope_scaling.high_freq_factor (%g) must exceed low_freq_factor (%g)", path,
            (double)cfg->rope_high_freq_factor, (double)cfg->rope_low_freq_factor);
    return rope_orig(cfg, rs, 1, path, err);
}

/* Keys that change the math of architectures Loom does not run (or of
 * variants of the ones it does): refused by name rather than ignored.
 * docs/model-format.md lists them. */
static loom_status_t refuse_keys(const cJSON *root, loom_model_config_t *cfg, const char *path,
                                 loom_err_t *err) {
    static const char *const numbers[] = {
        "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
        "num_local_experts",      "num_experts",            "n_routed_experts",
        "embedding_multiplier",   "residual_multiplier",    "logits_scaling",
        "attention_multiplier",
    };
    for (size_t i = 0; i < LOOM_ARRAY_LEN(numbers); i++) {
        const cJSON *v = field(root, numbers[i]);
        if (cfg->gemma && (!strcmp(numbers[i], "query_pre_attn_scalar") || strstr(numbers[i], "softcapping")))
            continue; /* read by parse_gemma */
        if (cfg->n_experts && (!strcmp(numbers[i], "num_local_experts") || !strcmp(numbers[i], "num_experts")))
            continue; /* read by parse_moe */
        if (v && !(cJSON_IsNumber(v) && v->valuedouble == 0 && strstr(numbers[i], "experts")))
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: %s is not supported for model_type '%s'", path,
                                numbers[i], cfg->model_type);
    }
    const cJSON *v = field(root, "partial_rotary_factor");
    if (v && !(cJSON_IsNumber(v) && v->valuedouble == 1.0) && strcmp(cfg->model_type, "phi3"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: partial_rotary_factor other than 1 is not supported for model_type '%s' (phi3's "
                            "is)",
                            path, cfg->model_type);
    v = field(root, "use_sliding_window");
    if (v && !cJSON_IsFalse(v))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: use_sliding_window is not supported for model_type '%s' (Mistral's "
                            "sliding_window is)",
                            path, cfg->model_type);
    v = field(root, "use_bidirectional_attention");
    if (v && !cJSON_IsFalse(v))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: use_bidirectional_attention is not supported", path);
    v = field(root, "layer_types");
    if (v && (cfg->gemma || cfg->gpt_oss)) {
        const cJSON *e;
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != cfg->n_layers || cfg->n_layers > LOOM_MAX_LAYER_TYPES)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: layer_types must list num_hidden_layers (%d) entries",
                                path, cfg->n_layers);
        int i = 0;
        cJSON_ArrayForEach(e, v) {
            int sl = cJSON_IsString(e) && !strcmp(e->valuestring, "sliding_attention");
            if (!sl && !(cJSON_IsString(e) && !strcmp(e->valuestring, "full_attention")))
                return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: layer_types entry '%s' is not supported", path,
                                    cJSON_IsString(e) ? e->valuestring : "?");
            cfg->layer_sliding[i++] = (unsigned char)sl;
        }
        cfg->has_layer_types = 1;
    } else if (v) {
        const char *want = cfg->sliding_window ? "sliding_attention" : "full_attention";
        const cJSON *e;
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != cfg->n_layers)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: layer_types must list num_hidden_layers (%d) entries",
                                path, cfg->n_layers);
        cJSON_ArrayForEach(e, v) {
            if (!cJSON_IsString(e) || strcmp(e->valuestring, want))
                return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                    "%s: layer_types entry '%s' is not supported for model_type '%s' (every "
                                    "layer must be %s)",
                                    path, cJSON_IsString(e) ? e->valuestring : "?", cfg->model_type, want);
        }
    }
    return LOOM_OK;
}

/* attn_logit_softcapping / final_logit_softcapping: a positive number, or
 * null for no cap; `dflt` when the key is absent. */
static loom_status_t get_softcap(const cJSON *root, const char *key, float dflt, float *out, const char *path,
                                 loom_err_t *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    *out = v ? 0.0f : dflt;
    if (!v || cJSON_IsNull(v)) return LOOM_OK;
    if (!cJSON_IsNumber(v))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a positive number or null", path, key);
    double d = v->valuedouble;
    if (!(d > 0 && d <= 3.0e38))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a positive number or null (got %g)", path, key,
                            d);
    *out = (float)d;
    return LOOM_OK;
}

/* Gemma 3's text model (Gemma3TextConfig): (1+w) norms around both blocks,
 * q/k norms, embeddings scaled by sqrt(hidden_size), query_pre_attn_scalar,
 * sliding layers (sliding_window wide, rope_local_base_freq, no scaling)
 * and global ones (rope_theta and rope_scaling) as layer_types or
 * sliding_window_pattern say. */
static loom_status_t parse_gemma3(loom_model_config_t *cfg, const loom_family_defaults_t *d, const cJSON *root,
                                  const char *path, loom_err_t *err) {
    cfg->gemma = 1;
    cfg->qk_norm = 1;
    cfg->embed_scale = sqrtf((float)cfg->dim);
    int qpas = 0;
    LOOM_CHECK(get_pos_int(root, "query_pre_attn_scalar", 0, d->query_pre_attn_scalar, &qpas, path, err));
    cfg->query_scale = 1.0f / sqrtf((float)qpas);
    LOOM_CHECK(get_pos_float(root, "rope_local_base_freq", 0, (float)d->rope_local_base_freq, &cfg->rope_local_theta,
                             path, err));
    LOOM_CHECK(get_pos_int(root, "sliding_window_pattern", 0, d->sliding_window_pattern, &cfg->sliding_pattern, path,
                           err));
    LOOM_CHECK(get_pos_int(root, "sliding_window", 0, d->sliding_window, &cfg->sliding_window, path, err));
    if (cfg->rope_scaling != LOOM_ROPE_NONE && cfg->rope_scaling != LOOM_ROPE_LINEAR)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: gemma3_text with rope_scaling other than linear", path);
    /* Gemma3TextConfig: both default to none (the released configs say null) */
    LOOM_CHECK(get_softcap(root, "attn_logit_softcapping", (float)d->attn_logit_softcapping, &cfg->attn_softcap,
                           path, err));
    return get_softcap(root, "final_logit_softcapping", (float)d->final_logit_softcapping, &cfg->final_softcap,
                       path, err);
}

/* Gemma 2 (Gemma2Config, modeling_gemma2): Gemma 3's layer without the q/k
 * norms, with attention and final logit soft-capping; the even layers
 * (0, 2, ...) attend to the latest sliding_window positions and the odd
 * ones to all (layer_types, when given, says which); one rope_theta for
 * every layer. Absent keys take Gemma2Config's defaults: query_pre_attn_scalar
 * 256, sliding_window 4096, soft caps 50 (attention) and 30 (final); an
 * explicit null turns a cap off. */
static loom_status_t parse_gemma2(loom_model_config_t *cfg, const loom_family_defaults_t *d, const cJSON *root,
                                  const char *path, loom_err_t *err) {
    cfg->gemma = 1;
    cfg->embed_scale = sqrtf((float)cfg->dim);
    int qpas = 0;
    LOOM_CHECK(get_pos_int(root, "query_pre_attn_scalar", 0, d->query_pre_attn_scalar, &qpas, path, err));
    cfg->query_scale = 1.0f / sqrtf((float)qpas);
    cfg->rope_local_theta = 0.0f; /* the sliding layers share rope_theta */
    cfg->sliding_pattern = 2;
    const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
    cfg->sliding_window = sw ? 0 : d->sliding_window; /* null: no window */
    if (sw && !cJSON_IsNull(sw))
        LOOM_CHECK(get_pos_int(root, "sliding_window", 1, 0, &cfg->sliding_window, path, err));
    if (cfg->rope_scaling != LOOM_ROPE_NONE)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: gemma2 with rope_scaling is not supported", path);
    LOOM_CHECK(get_softcap(root, "attn_logit_softcapping", (float)d->attn_logit_softcapping, &cfg->attn_softcap,
                           path, err));
    return get_softcap(root, "final_logit_softcapping", (float)d->final_logit_softcapping, &cfg->final_softcap,
                       path, err);
}

/* hidden_act, or Gemma's hidden_activation: Gemma2MLP and Gemma3MLP read
 * hidden_activation, so for them it wins when a config carries both. */
static loom_status_t parse_hidden_act(loom_model_config_t *cfg, const loom_family_defaults_t *d, const cJSON *root,
                                      int gemma, const char *path, loom_err_t *err) {
    const char *key = gemma && field(root, "hidden_activation") ? "hidden_activation" : "hidden_act";
    const cJSON *v = field(root, key);
    if (!v) v = field(root, key = "hidden_activation");
    const char *name = v && cJSON_IsString(v) ? v->valuestring : d->hidden_act;
    cfg->hidden_act = LOOM_HIDDEN_SILU;
    if (v && !cJSON_IsString(v)) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a string", path, key);
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_acts); i++)
        if (!strcmp(name, k_acts[i].name)) {
            cfg->hidden_act = k_acts[i].act;
            return LOOM_OK;
        }
    return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                        "%s: hidden_act '%s' is not supported (Loom runs silu, swish, gelu, gelu_python, gelu_new, "
                        "gelu_pytorch_tanh, gelu_fast, gelu_accurate, quick_gelu, relu, relu2)",
                        path, name);
}

/* quantization_config: loom (`loom quantize`), or 4-bit AWQ (GEMM) and GPTQ. */
static loom_status_t parse_quantization(loom_model_config_t *cfg, const cJSON *root, const char *path,
                                        loom_err_t *err) {
    const cJSON *qc = field(root, "quantization_config");
    if (!qc) return LOOM_OK;
    if (!cJSON_IsObject(qc)) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: quantization_config must be an object", path);
    const cJSON *m = field(qc, "quant_method");
    if (!cJSON_IsString(m))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: quantization_config.quant_method must be a string", path);
    if (!strcmp(m->valuestring, "loom")) {
        cfg->ckpt_quant = LOOM_CKPT_LOOM;
        const cJSON *g = field(qc, "group_size"); /* 4-bit schemes; -1 for per-channel ones */
        if (g && (!json_int(g, &cfg->ckpt_group) || cfg->ckpt_group < 0)) cfg->ckpt_group = 0;
        return LOOM_OK;
    }
    if (!strcmp(m->valuestring, "mxfp4")) {
        if (!cfg->gpt_oss)
            return loom_err_set(
                err, LOOM_ERR_UNSUPPORTED,
                "%s: quantization_config.quant_method 'mxfp4' is read for gpt_oss only (not '%s')",
                path, cfg->model_type);
        cfg->ckpt_quant = LOOM_CKPT_MXFP4;
        cfg->ckpt_group = 32;
        return LOOM_OK;
    }
    if (strcmp(m->valuestring, "awq") && strcmp(m->valuestring, "gptq"))
        return loom_err_set(
            err, LOOM_ERR_UNSUPPORTED,
            "%s: quantization_config.quant_method '%s' is not supported (Loom reads loom, awq, "
            "gptq and, for gpt_oss, mxfp4 checkpoints)",
            path, m->valuestring);
    cfg->ckpt_quant = !strcmp(m->valuestring, "awq") ? LOOM_CKPT_AWQ : LOOM_CKPT_GPTQ;
    int bits = 0;
    LOOM_CHECK(get_pos_int(qc, "bits", 0, 0, &bits, path, err));
    if (!bits) LOOM_CHECK(get_pos_int(qc, "w_bit", 1, 0, &bits, path, err)); /* older AWQ configs */
    if (bits != 4)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: quantization_config.bits is %d; Loom reads 4-bit %s",
                            path, bits, m->valuestring);
    cfg->ckpt_group = 0;
    const cJSON *g = field(qc, "group_size");
    if (!g) g = field(qc, "q_group_size");
    if (!g || !json_int(g, &cfg->ckpt_group) || cfg->ckpt_group <= 0)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: quantization_config.group_size must be a positive integer (per-channel -1 "
                            "is not supported)",
                            path);
    if (cfg->ckpt_quant == LOOM_CKPT_AWQ) {
        const cJSON *v = field(qc, "version");
        if (v && (!cJSON_IsString(v) || strcasecmp(v->valuestring, "gemm")))
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                "%s: AWQ version '%s' is not supported (Loom reads the GEMM layout)", path,
                                cJSON_IsString(v) ? v->valuestring : "?");
    } else {
        LOOM_CHECK(get_bool(qc, "desc_act", 0, &cfg->ckpt_desc_act, path, err));
        const cJSON *f = field(qc, "checkpoint_format");
        if (f && !cJSON_IsString(f))
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: quantization_config.checkpoint_format must be a string", path);
        if (f && strcmp(f->valuestring, "gptq") && strcmp(f->valuestring, "gptq_v2"))
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                "%s: GPTQ checkpoint_format '%s' is not supported (gptq, gptq_v2)", path,
                                f->valuestring);
        cfg->ckpt_zeros_minus1 = !f || !strcmp(f->valuestring, "gptq");
    }
    return LOOM_OK;
}

/* The Mixture-of-Experts keys of Mixtral (MixtralConfig: num_local_experts,
 * every layer sparse, experts of intermediate_size, top-k always
 * renormalised) and Qwen3-MoE (Qwen3MoeConfig: num_experts,
 * moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
 * mlp_only_layers: dense layers of intermediate_size). */
static loom_status_t parse_moe(loom_model_config_t *cfg, const loom_family_defaults_t *d, const cJSON *root,
                               const char *path, loom_err_t *err) {
    int mixtral = !strcmp(cfg->model_type, "mixtral"), oss = cfg->gpt_oss;
    const char *ekey = mixtral || oss ? "num_local_experts" : "num_experts";
    const cJSON *v = field(root, ekey);
    int e = d->n_experts;
    if (v && (!json_int(v, &e) || e < 0))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: %s must be a non-negative integer", path, ekey);
    int qwen2 = !strcmp(cfg->model_type, "qwen2_moe");
    int k = d->n_experts_per_tok;
    v = field(root, "num_experts_per_tok");
    if (!v && oss) v = field(root, "experts_per_token"); /* the name of OpenAI's own config */
    if (v && !json_int(v, &k))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: num_experts_per_tok must be an integer", path);
    cfg->moe_mixtral_names = mixtral;
    cfg->moe_sparse_step = 1;
    cfg->norm_topk_prob =
        mixtral || oss; /* GPT-OSS: softmax over the top-k logits, the same weights */
    cfg->moe_hidden_dim = cfg->hidden_dim;
    if (e == 0) {
        if (mixtral || oss)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: num_local_experts must be positive",
                                path);
        return LOOM_OK; /* a qwen3_moe of dense layers */
    }
    if (k < 1 || k > e)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: num_experts_per_tok (%d) must be between 1 and %s (%d)", path,
                            k, ekey, e);
    if (!mixtral && !oss) {
        LOOM_CHECK(get_pos_int(root, "moe_intermediate_size", 0, d->moe_intermediate_size, &cfg->moe_hidden_dim, path,
                               err));
        if (qwen2)
            LOOM_CHECK(get_pos_int(root, "shared_expert_intermediate_size", 0, d->shared_expert_intermediate_size,
                                   &cfg->moe_shared_hidden, path, err));
        LOOM_CHECK(get_bool(root, "norm_topk_prob", 0, &cfg->norm_topk_prob, path, err));
        LOOM_CHECK(get_pos_int(root, "decoder_sparse_step", 0, d->decoder_sparse_step, &cfg->moe_sparse_step, path,
                               err));
        v = field(root, "mlp_only_layers");
        if (v) {
            const cJSON *it;
            if (!cJSON_IsArray(v))
                return loom_err_set(err, LOOM_ERR_FORMAT, "%s: mlp_only_layers must be a list of layer indices",
                                    path);
            cJSON_ArrayForEach(it, v) {
                int l;
                if (!json_int(it, &l) || l < 0 || l >= cfg->n_layers || l >= LOOM_MAX_LAYER_TYPES)
                    return loom_err_set(err, LOOM_ERR_FORMAT,
                                        "%s: mlp_only_layers entries must be layer indices below "
                                        "num_hidden_layers (%d)",
                                        path, cfg->n_layers);
                cfg->mlp_only[l] = 1;
            }
        }
    }
    cfg->n_experts = e;
    cfg->n_experts_per_tok = k;
    return LOOM_OK;
}

/* GPT-OSS (GptOssConfig, modeling_gpt_oss): every layer a Mixture of
 * Experts (parse_moe: num_local_experts, experts of intermediate_size,
 * top-k softmax), alternating sliding (even layers) and full attention
 * unless layer_types says otherwise, q/k/v/o biases (attention_bias,
 * true by default), attention sinks, and the experts' clamped SwiGLU. */
static loom_status_t parse_gpt_oss(loom_model_config_t *cfg, const loom_family_defaults_t *d, const cJSON *root,
                                   const char *path, loom_err_t *err) {
    const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
    cfg->sliding_window = sw ? 0 : d->sliding_window; /* null: every layer full */
    if (sw && !cJSON_IsNull(sw))
        LOOM_CHECK(get_pos_int(root, "sliding_window", 1, 0, &cfg->sliding_window, path, err));
    if (cfg->n_layers > LOOM_MAX_LAYER_TYPES)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: gpt_oss with more than %d layers", path,
                            LOOM_MAX_LAYER_TYPES);
    for (int l = 0; l < cfg->n_layers; l++)
        cfg->layer_sliding[l] = (unsigned char)(l % 2 == 0);
    cfg->has_layer_types = 1; /* refuse_keys reads layer_types over this */
    LOOM_CHECK(get_pos_float(root, "swiglu_limit", 0, (float)d->swiglu_limit, &cfg->swiglu_limit, path, err));
    LOOM_CHECK(get_pos_float(root, "swiglu_alpha", 0, (float)d->swiglu_alpha, &cfg->swiglu_alpha, path, err));
    if (!(cfg->swiglu_limit > 0 && isfinite(cfg->swiglu_limit)))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: swiglu_limit must be a positive number",
                            path);
    cfg->hidden_act = LOOM_HIDDEN_SILU; /* the experts' activation is the clamped SwiGLU whatever
                                           hidden_act says */
    return LOOM_OK;
}

static loom_dtype_t dtype_from_torch(const cJSON *v) {
    if (!cJSON_IsString(v)) return LOOM_DT_F32;
    if (!strcmp(v->valuestring, "float16")) return LOOM_DT_F16;
    if (!strcmp(v->valuestring, "bfloat16")) return LOOM_DT_BF16;
    return LOOM_DT_F32;
}

static loom_status_t parse_fields(const cJSON *root, const char *path, loom_model_config_t *cfg,
                                  loom_err_t *err) {
    const cJSON *mt = field(root, "model_type");
    if (!mt) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: model_type is missing", path);
    if (!cJSON_IsString(mt))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: model_type must be a string", path);
    if (loom_model_config_is_deepseek(mt->valuestring)) return loom_model_config_parse_deepseek(root, path, cfg, err);
    const loom_family_defaults_t *d = loom_model_family_defaults(mt->valuestring);
    if (!d)
        return loom_err_set(
            err, LOOM_ERR_UNSUPPORTED,
            "%s: model_type '%s' is not supported (Loom runs llama, mistral, "
            "qwen2, qwen3, phi3, gemma2, gemma3_text, mixtral, qwen3_moe, qwen2_moe, gpt_oss, deepseek_v2 and deepseek_v3)",
            path, mt->valuestring);
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", mt->valuestring);
    cfg->gpt_oss = !strcmp(cfg->model_type, "gpt_oss");
    const int oss = cfg->gpt_oss;

    LOOM_CHECK(get_pos_int(root, "hidden_size", 1, 0, &cfg->dim, path, err));
    LOOM_CHECK(get_pos_int(root, "intermediate_size", 1, 0, &cfg->hidden_dim, path, err));
    LOOM_CHECK(get_pos_int(root, "num_hidden_layers", 1, 0, &cfg->n_layers, path, err));
    LOOM_CHECK(get_pos_int(root, "num_attention_heads", 1, 0, &cfg->n_heads, path, err));
    /* absent: the class's default; an explicit null: derived (num_attention_heads, hidden_size / heads), as the
     * classes whose default is None derive it */
    const int kv_given = cJSON_GetObjectItemCaseSensitive(root, "num_key_value_heads") != NULL;
    const int hd_given = cJSON_GetObjectItemCaseSensitive(root, "head_dim") != NULL;
    LOOM_CHECK(get_pos_int(root, "num_key_value_heads", 0, kv_given || !d->n_kv_heads ? cfg->n_heads : d->n_kv_heads,
                           &cfg->n_kv_heads, path, err));
    LOOM_CHECK(get_pos_int(root, "head_dim", 0, hd_given ? 0 : d->head_dim, &cfg->head_dim, path, err));
    LOOM_CHECK(get_pos_int(root, "vocab_size", 1, 0, &cfg->vocab_size, path, err));
    LOOM_CHECK(get_pos_int(root, "max_position_embeddings", 0, d->max_position_embeddings, &cfg->max_seq_len, path,
                           err));
    LOOM_CHECK(get_pos_float(root, "rms_norm_eps", 0, (float)d->rms_norm_eps, &cfg->norm_eps, path, err));
    /* Transformers 5 keeps rope_theta and the scaling in rope_parameters */
    const cJSON *rp = field(root, "rope_parameters");
    if (rp && !cJSON_IsObject(rp))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: rope_parameters must be an object", path);
    if (rp && field(rp, "rope_theta"))
        LOOM_CHECK(get_pos_float(rp, "rope_theta", 1, 0, &cfg->rope_theta, path, err));
    else
        LOOM_CHECK(get_pos_float(root, "rope_theta", 0, (float)d->rope_theta, &cfg->rope_theta, path, err));
    if (rp && field(root, "rope_scaling"))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: both rope_scaling and rope_parameters are given", path);
    /* head_dim is needed first (longrope lists a factor per frequency) */
    if (cfg->head_dim == 0 && cfg->dim % cfg->n_heads == 0) cfg->head_dim = cfg->dim / cfg->n_heads;
    LOOM_CHECK(parse_rotary_dim(cfg, root, path, err));
    /* a family's default scaling (GptOssConfig: gpt-oss's yarn) when the key is absent; an explicit null is none */
    const int rs_absent = !rp && !cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    cJSON *rs_dflt = d->rope_scaling && rs_absent ? cJSON_Parse(d->rope_scaling) : NULL;
    LOOM_ASSERT(!d->rope_scaling || !rs_absent || rs_dflt);
    loom_status_t rs_st = parse_rope_scaling(cfg, root,
                                             rs_dflt ? rs_dflt
                                             : rp    ? rp
                                                     : field(root, "rope_scaling"),
                                             path, err);
    cJSON_Delete(rs_dflt);
    LOOM_CHECK(rs_st);
    int gemma = !strcmp(cfg->model_type, "gemma2") || !strcmp(cfg->model_type, "gemma3_text");
    LOOM_CHECK(parse_hidden_act(cfg, d, root, gemma, path, err));
    cfg->qk_norm = !strcmp(cfg->model_type, "qwen3") || !strcmp(cfg->model_type, "qwen3_moe");
    if (!strcmp(cfg->model_type, "mixtral") || !strcmp(cfg->model_type, "qwen3_moe") ||
        !strcmp(cfg->model_type, "qwen2_moe") || oss)
        LOOM_CHECK(parse_moe(cfg, d, root, path, err));
    if (oss) LOOM_CHECK(parse_gpt_oss(cfg, d, root, path, err));
    cfg->fused_qkv = !strcmp(cfg->model_type, "phi3");
    if (!strcmp(cfg->model_type, "gemma3_text")) LOOM_CHECK(parse_gemma3(cfg, d, root, path, err));
    if (!strcmp(cfg->model_type, "gemma2")) LOOM_CHECK(parse_gemma2(cfg, d, root, path, err));
    if (!strcmp(cfg->model_type, "mistral") || !strcmp(cfg->model_type, "mixtral") ||
        !strcmp(cfg->model_type, "phi3")) {
        /* one window on every layer: absent means the class's default (MistralConfig 4096, the others none),
         * null means none; a window that is never reached is none */
        const cJSON *sw = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
        cfg->sliding_window = sw ? 0 : d->sliding_window;
        if (sw && !cJSON_IsNull(sw))
            LOOM_CHECK(get_pos_int(root, "sliding_window", 1, 0, &cfg->sliding_window, path, err));
        if (cfg->sliding_window >= cfg->max_seq_len) cfg->sliding_window = 0;
    }
    LOOM_CHECK(refuse_keys(root, cfg, path, err));
    LOOM_CHECK(get_bool(root, "tie_word_embeddings", d->tie_word_embeddings, &cfg->tie_embeddings, path, err));
    LOOM_CHECK(get_bool(root, "attention_bias", d->attention_bias, &cfg->attention_bias, path, err));
    int mlp_bias = 0;
    LOOM_CHECK(get_bool(root, "mlp_bias", 0, &mlp_bias, path, err));
    if (mlp_bias)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: mlp_bias is true; Loom's MLP has no biases", path);

    if (cfg->n_heads % cfg->n_kv_heads != 0)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: num_key_value_heads (%d%s%s) does not divide num_attention_heads (%d)", path,
                            cfg->n_kv_heads, kv_given ? "" : ", absent: the default of ", kv_given ? "" : d->config_class,
                            cfg->n_heads);
    if (cfg->head_dim == 0) {
        if (cfg->dim % cfg->n_heads != 0)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: num_attention_heads (%d) does not divide hidden_size (%d)",
                                path, cfg->n_heads, cfg->dim);
        cfg->head_dim = cfg->dim / cfg->n_heads;
    }

    cfg->bos_id = -1;
    const cJSON *bos = field(root, "bos_token_id");
    if (bos && (!json_int(bos, &cfg->bos_id) || cfg->bos_id < 0))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: bos_token_id must be a non-negative integer",
                            path);
    if (cfg->bos_id >= cfg->vocab_size)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: bos_token_id (%d) is not below vocab_size (%d)", path, cfg->bos_id,
                            cfg->vocab_size);
    LOOM_CHECK(merge_eos(cfg, root, path, err));

    const cJSON *dt = field(root, "torch_dtype");
    cfg->torch_dtype = dtype_from_torch(dt ? dt : field(root, "dtype"));
    return parse_quantization(cfg, root, path, err);
}

static loom_status_t check_eos_range(const loom_model_config_t *cfg, const char *path,
                                     loom_err_t *err) {
    for (int i = 0; i < cfg->n_eos; i++)
        if (cfg->eos_ids[i] >= cfg->vocab_size)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: eos_token_id %d is not below vocab_size (%d)", path,
                                cfg->eos_ids[i], cfg->vocab_size);
    return LOOM_OK;
}

/* Gemma 3's multimodal layout (Gemma3Config, model_type gemma3, as
 * gemma-3-4b/12b/27b ship): the text model's keys sit in text_config, most
 * left at Gemma3TextConfig's defaults (configuration_gemma3.py), and eos,
 * bos, the dtype and a quantization_config may sit at the top. Loom serves
 * the text model: a gemma3_text config of the keys below, overlaid with
 * the top-level keys, overlaid with text_config; the gemma3_text row of
 * k_families fills in the rest. NULL when root is not one. These are the
 * keys a plain config.json must give (the sizes) or whose class default
 * Loom does not take elsewhere (the token ids). */
static const char k_gemma3_text_defaults[] =
    "{\"vocab_size\":262208,\"hidden_size\":2304,\"intermediate_size\":9216,\"num_hidden_layers\":26,"
    "\"num_attention_heads\":8,\"bos_token_id\":2,\"eos_token_id\":1}";

static void json_set(cJSON *obj, const char *key, cJSON *v) {
    cJSON_DeleteItemFromObjectCaseSensitive(obj, key);
    cJSON_AddItemToObject(obj, key, v);
}

static loom_status_t gemma3_text_of(const cJSON *root, const char *path, cJSON **out, loom_err_t *err) {
    static const char *const top_keys[] = {"eos_token_id", "bos_token_id", "torch_dtype", "dtype",
                                           "quantization_config"};
    *out = NULL;
    const cJSON *mt = field(root, "model_type");
    if (!cJSON_IsString(mt) || strcmp(mt->valuestring, "gemma3")) return LOOM_OK;
    const cJSON *tc = field(root, "text_config");
    if (!cJSON_IsObject(tc))
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: model_type gemma3 needs a text_config object", path);
    const cJSON *tmt = field(tc, "model_type");
    if (tmt && !(cJSON_IsString(tmt) && !strcmp(tmt->valuestring, "gemma3_text")))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: text_config.model_type must be gemma3_text", path);
    cJSON *m = cJSON_Parse(k_gemma3_text_defaults);
    LOOM_ASSERT(m);
    for (size_t i = 0; i < LOOM_ARRAY_LEN(top_keys); i++)
        if (field(root, top_keys[i])) json_set(m, top_keys[i], cJSON_Duplicate(field(root, top_keys[i]), 1));
    const cJSON *e;
    cJSON_ArrayForEach(e, tc) json_set(m, e->string, cJSON_Duplicate(e, 1));
    json_set(m, "model_type", cJSON_CreateString("gemma3_text"));
    *out = m;
    return LOOM_OK;
}

loom_status_t loom_model_config_parse(const char *json, size_t len, const char *path,
                                      loom_model_config_t *cfg, loom_err_t *err) {
    memset(cfg, 0, sizeof *cfg);
    cfg->bos_id = -1;
    if (!path) path = "config.json";
    size_t bad_at;
    cJSON *root = loom_json_parse_strict(json ? json : "", json ? len : 0, &bad_at);
    if (!root)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not valid JSON (at byte %zu)", path, bad_at);
    loom_status_t s = LOOM_OK;
    cJSON *text = NULL;
    if (!cJSON_IsObject(root))
        s = loom_err_set(err, LOOM_ERR_FORMAT, "%s: not a JSON object", path);
    else
        s = gemma3_text_of(root, path, &text, err);
    if (s == LOOM_OK) s = parse_fields(text ? text : root, path, cfg, err);
    if (s == LOOM_OK) cfg->multimodal = text != NULL;
    if (s == LOOM_OK) s = check_eos_range(cfg, path, err);
    cJSON_Delete(text);
    cJSON_Delete(root);
    return s;
}

/* generation_config.json often lists more stop ids than config.json does
 * (Llama 3 instruct ends turns with <|eot_id|>); they are merged in. */
static loom_status_t merge_generation_config(const char *dir, loom_model_config_t *cfg,
                                             loom_err_t *err) {
    char path[4096];
    struct stat sb;
    if (!loom_path_join(path, sizeof path, dir, "generation_config.json") || stat(path, &sb) != 0)
        return LOOM_OK;
    char *text;
    size_t len;
    LOOM_CHECK(loom_read_file(path, &text, &len, err));
    size_t bad_at;
    cJSON *root = loom_json_parse_strict(text, len, &bad_at);
    free(text);
    if (!root)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not valid JSON (at byte %zu)", path, bad_at);
    loom_status_t s = LOOM_OK;
    if (!cJSON_IsObject(root))
        s = loom_err_set(err, LOOM_ERR_FORMAT, "%s: not a JSON object", path);
    else
        s = merge_eos(cfg, root, path, err);
    if (s == LOOM_OK) s = check_eos_range(cfg, path, err);
    cJSON_Delete(root);
    return s;
}

loom_status_t loom_model_config_load(const char *dir, loom_model_config_t *cfg, loom_err_t *err) {
    char path[4096];
    memset(cfg, 0, sizeof *cfg);
    cfg->bos_id = -1;
    if (!loom_path_join(path, sizeof path, dir, "config.json"))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: path too long", dir);
    char *text;
    size_t len;
    LOOM_CHECK(loom_read_file(path, &text, &len, err));
    loom_status_t s = loom_model_config_parse(text, len, path, cfg, err);
    free(text);
    LOOM_CHECK(s);
    return merge_generation_config(dir, cfg, err);
}

int loom_model_config_is_eos(const loom_model_config_t *cfg, int id) {
    for (int i = 0; i < cfg->n_eos; i++)
        if (cfg->eos_ids[i] == id) return 1;
    return 0;
}

int loom_model_config_layer_window(const loom_model_config_t *cfg, int layer) {
    if (!cfg->gemma && !cfg->gpt_oss) return cfg->sliding_window; /* Mistral, Phi-3: every layer */
    int sliding = cfg->has_layer_types ? layer >= 0 && layer < LOOM_MAX_LAYER_TYPES && cfg->layer_sliding[layer]
                                       : (layer + 1) % cfg->sliding_pattern != 0;
    return sliding && cfg->sliding_window < cfg->max_seq_len ? cfg->sliding_window : 0;
}

int loom_model_config_layer_moe(const loom_model_config_t *cfg, int layer) {
    if (cfg->n_experts <= 0 || layer < 0) return 0;
    if (layer < LOOM_MAX_LAYER_TYPES && cfg->mlp_only[layer]) return 0;
    return (layer + 1) % cfg->moe_sparse_step == 0;
}

int loom_model_config_all_windowed(const loom_model_config_t *cfg) {
    for (int l = 0; l < cfg->n_layers; l++)
        if (!loom_model_config_layer_window(cfg, l)) return 0;
    return cfg->n_layers > 0;
}
