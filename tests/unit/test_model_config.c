/* Tests for config.json parsing: stories260K, Llama 3 and Qwen2 style
 * configs, defaults, generation_config.json EOS merging, and the errors a
 * broken or unsupported config must give. */
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>

#include "common/model_config.h"
#include "common/util.h"
#include "tests/test.h"

static char g_tmp[256];

static loom_status_t parse(const char *json, loom_model_config_t *cfg, loom_err_t *err) {
    return loom_model_config_parse(json, strlen(json), "config.json", cfg, err);
}

static void write_text(const char *dir, const char *name, const char *text) {
    char p[600];
    loom_path_join(p, sizeof p, dir, name);
    FILE *f = fopen(p, "wb");
    if (!f) {
        perror(p);
        exit(2);
    }
    fputs(text, f);
    fclose(f);
}

static void test_stories260k(void) {
    char dir[512];
    loom_path_join(dir, sizeof dir, test_models_dir(), "stories260K");
    loom_model_config_t c;
    loom_err_t err = {0};
    CHECKF(loom_model_config_load(dir, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(!strcmp(c.model_type, "llama"));
    CHECK(c.dim == 64 && c.hidden_dim == 172 && c.n_layers == 5);
    CHECK(c.n_heads == 8 && c.n_kv_heads == 4 && c.head_dim == 8);
    CHECK(c.vocab_size == 512 && c.max_seq_len == 512);
    CHECK(c.norm_eps == 1e-5f && c.rope_theta == 10000.0f);
    CHECK(c.rope_scaling == LOOM_ROPE_NONE);
    CHECK(c.tie_embeddings == 1 && c.attention_bias == 0);
    CHECK(c.bos_id == 1 && c.n_eos == 1 && c.eos_ids[0] == 2);
    CHECK(loom_model_config_is_eos(&c, 2) && !loom_model_config_is_eos(&c, 1));
    CHECK(c.torch_dtype == LOOM_DT_F32);
}

static const char *k_llama3 =
    "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"hidden_size\":4096,"
    "\"intermediate_size\":14336,\"num_hidden_layers\":32,\"num_attention_heads\":32,"
    "\"num_key_value_heads\":8,\"vocab_size\":128256,\"max_position_embeddings\":131072,"
    "\"rms_norm_eps\":1e-05,\"rope_theta\":500000.0,\"rope_scaling\":{\"factor\":8.0,"
    "\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192,"
    "\"rope_type\":\"llama3\"},\"tie_word_embeddings\":false,\"attention_bias\":false,"
    "\"bos_token_id\":128000,\"eos_token_id\":[128001,128008,128009],\"torch_dtype\":\"bfloat16\"}";

static void test_llama3(void) {
    loom_model_config_t c;
    loom_err_t err = {0};
    CHECKF(parse(k_llama3, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.dim == 4096 && c.hidden_dim == 14336 && c.n_layers == 32);
    CHECK(c.n_heads == 32 && c.n_kv_heads == 8 && c.head_dim == 128);
    CHECK(c.vocab_size == 128256 && c.max_seq_len == 131072);
    CHECK(c.rope_theta == 500000.0f && c.norm_eps == 1e-5f);
    CHECK(c.rope_scaling == LOOM_ROPE_LLAMA3 && c.rope_factor == 8.0f);
    CHECK(c.rope_low_freq_factor == 1.0f && c.rope_high_freq_factor == 4.0f);
    CHECK(c.rope_orig_max_pos == 8192);
    CHECK(c.bos_id == 128000 && c.n_eos == 3);
    CHECK(c.eos_ids[0] == 128001 && c.eos_ids[1] == 128008 && c.eos_ids[2] == 128009);
    CHECK(c.tie_embeddings == 0 && c.attention_bias == 0);
    CHECK(c.torch_dtype == LOOM_DT_BF16);

    /* "type" is the older spelling of "rope_type". */
    const char *old = "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
                      "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,"
                      "\"rope_scaling\":{\"type\":\"llama3\",\"factor\":32,\"low_freq_factor\":1,"
                      "\"high_freq_factor\":4,\"original_max_position_embeddings\":8192}}";
    CHECKF(parse(old, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.rope_scaling == LOOM_ROPE_LLAMA3 && c.rope_factor == 32.0f);
}

static void test_qwen2_and_defaults(void) {
    loom_model_config_t c;
    loom_err_t err = {0};
    const char *qwen =
        "{\"model_type\":\"qwen2\",\"hidden_size\":896,\"intermediate_size\":4864,"
        "\"num_hidden_layers\":24,\"num_attention_heads\":14,"
        "\"num_key_value_heads\":2,\"vocab_size\":151936,"
        "\"max_position_embeddings\":32768,\"rms_norm_eps\":1e-06,"
        "\"rope_theta\":1000000.0,\"rope_scaling\":null,\"sliding_window\":32768,"
        "\"use_sliding_window\":false,\"tie_word_embeddings\":true,"
        "\"bos_token_id\":151643,\"eos_token_id\":151645,\"torch_dtype\":\"bfloat16\"}";
    CHECKF(parse(qwen, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(!strcmp(c.model_type, "qwen2"));
    CHECK(c.attention_bias == 1); /* Qwen2 has q/k/v biases by default */
    CHECK(c.head_dim == 64 && c.n_kv_heads == 2 && c.tie_embeddings == 1);
    CHECK(c.rope_theta == 1000000.0f && c.rope_scaling == LOOM_ROPE_NONE);
    CHECK(c.n_eos == 1 && c.eos_ids[0] == 151645 && c.bos_id == 151643);

    const char *qwen_nobias =
        "{\"model_type\":\"qwen2\",\"hidden_size\":64,\"intermediate_size\":1,"
        "\"num_hidden_layers\":1,\"num_attention_heads\":4,\"vocab_size\":9,"
        "\"num_key_value_heads\":null,\"attention_bias\":false}";
    CHECKF(parse(qwen_nobias, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.attention_bias == 0 && c.n_kv_heads == 4 && c.max_seq_len == 32768);
    /* an absent num_key_value_heads is Qwen2Config's 32, which 4 heads cannot share */
    const char *qwen_nokv =
        "{\"model_type\":\"qwen2\",\"hidden_size\":64,\"intermediate_size\":1,"
        "\"num_hidden_layers\":1,\"num_attention_heads\":4,\"vocab_size\":9}";
    CHECK(parse(qwen_nokv, &c, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "num_key_value_heads (32, absent: the default of Qwen2Config) does not divide"), "%s",
           err.msg);

    /* Minimal Mistral config: every default. */
    const char *minimal =
        "{\"model_type\":\"mistral\",\"hidden_size\":64,\"intermediate_size\":128,"
        "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,"
        "\"head_dim\":null,\"num_key_value_heads\":null,\"eos_token_id\":null}";
    CHECKF(parse(minimal, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(!strcmp(c.model_type, "mistral"));
    CHECK(c.n_kv_heads == 4 && c.head_dim == 16);
    CHECK(c.rope_theta == 10000.0f && c.norm_eps == 1e-6f);
    CHECK(c.tie_embeddings == 0 && c.attention_bias == 0);
    CHECK(c.max_seq_len == 131072 && c.bos_id == -1 && c.n_eos == 0 && c.sliding_window == 4096);
    CHECK(c.rope_scaling == LOOM_ROPE_NONE && c.torch_dtype == LOOM_DT_F32);
    CHECK(!loom_model_config_is_eos(&c, 0));

    /* An explicit head_dim need not be hidden_size / heads. */
    const char *hd = "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
                     "\"num_hidden_layers\":2,\"num_attention_heads\":6,\"head_dim\":32,"
                     "\"num_key_value_heads\":2,\"vocab_size\":100,\"eos_token_id\":[5,5,7],"
                     "\"rope_scaling\":{\"rope_type\":\"default\"}}";
    CHECKF(parse(hd, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.head_dim == 32 && c.n_eos == 2 && c.eos_ids[0] == 5 && c.eos_ids[1] == 7);
    CHECK(c.rope_scaling == LOOM_ROPE_NONE);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void test_generation_config(void) {
    char dir[512];
    loom_path_join(dir, sizeof dir, g_tmp, "gen");
    mkdir(dir, 0755);
    write_text(dir, "config.json",
               "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
               "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":128256,"
               "\"eos_token_id\":128001}");
    write_text(dir, "generation_config.json",
               "{\"bos_token_id\":128000,\"eos_token_id\":[128001,128009],\"do_sample\":true}");
    loom_model_config_t c;
    loom_err_t err = {0};
    CHECKF(loom_model_config_load(dir, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.n_eos == 2 && c.eos_ids[0] == 128001 && c.eos_ids[1] == 128009);
    CHECK(loom_model_config_is_eos(&c, 128009));

    write_text(dir, "generation_config.json", "{\"eos_token_id\":128009}");
    CHECKF(loom_model_config_load(dir, &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.n_eos == 2);

    write_text(dir, "generation_config.json", "{\"eos_token_id\":");
    CHECK(loom_model_config_load(dir, &c, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "generation_config.json") != NULL, "%s", err.msg);
    write_text(dir, "generation_config.json", "{\"eos_token_id\":\"x\"}");
    CHECK(loom_model_config_load(dir, &c, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "generation_config.json: eos_token_id") != NULL, "%s", err.msg);

    char missing[600];
    loom_path_join(missing, sizeof missing, g_tmp, "no-such-model");
    CHECK(loom_model_config_load(missing, &c, &err) == LOOM_ERR_IO);
    CHECKF(strstr(err.msg, "no-such-model/config.json") != NULL, "%s", err.msg);
}

/* A base config with one field replaced (value NULL: the field removed). */
static void with_field(char *out, size_t n, const char *key, const char *value) {
    static const char *const keys[] = {
        "model_type",          "hidden_size",         "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "vocab_size"};
    static const char *const vals[] = {"\"llama\"", "64", "128", "2", "8", "4", "100"};
    size_t used = (size_t)snprintf(out, n, "{");
    int first = 1, seen = 0;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(keys); i++) {
        const char *v = vals[i];
        if (!strcmp(keys[i], key)) {
            seen = 1;
            v = value;
        }
        if (!v) continue;
        used += (size_t)snprintf(out + used, n - used, "%s\"%s\":%s", first ? "" : ",", keys[i], v);
        first = 0;
    }
    if (!seen && value)
        used += (size_t)snprintf(out + used, n - used, "%s\"%s\":%s", first ? "" : ",", key, value);
    snprintf(out + used, n - used, "}");
}

static void expect_err(int line, const char *key, const char *value, loom_status_t code,
                       const char *want) {
    char json[2048];
    with_field(json, sizeof json, key, value);
    loom_model_config_t c;
    loom_err_t err = {0};
    loom_status_t s = parse(json, &c, &err);
    CHECKF(s == code, "line %d: %s: got %s (%s)", line, json, loom_status_str(s), err.msg);
    CHECKF(strstr(err.msg, want) != NULL, "line %d: '%s' lacks '%s'", line, err.msg, want);
    CHECKF(!strncmp(err.msg, "config.json: ", 13), "line %d: '%s' does not name the file", line,
           err.msg);
}

#define ERR(key, value, want) expect_err(__LINE__, key, value, LOOM_ERR_FORMAT, want)

static void test_errors(void) {
    ERR("hidden_size", NULL, "config.json: hidden_size is missing");
    ERR("hidden_size", "null", "config.json: hidden_size is missing");
    ERR("hidden_size", "\"64\"", "config.json: hidden_size must be an integer");
    ERR("hidden_size", "64.5", "config.json: hidden_size must be an integer");
    ERR("hidden_size", "1e30", "config.json: hidden_size must be an integer");
    ERR("hidden_size", "-64", "config.json: hidden_size must be positive (got -64)");
    ERR("hidden_size", "0", "hidden_size must be positive");
    ERR("intermediate_size", NULL, "intermediate_size is missing");
    ERR("num_hidden_layers", "[2]", "num_hidden_layers must be an integer");
    ERR("num_attention_heads", NULL, "num_attention_heads is missing");
    ERR("num_attention_heads", "7",
        "config.json: num_key_value_heads (4) does not divide num_attention_heads (7)");
    ERR("num_key_value_heads", "3",
        "config.json: num_key_value_heads (3) does not divide num_attention_heads (8)");
    ERR("num_key_value_heads", "0", "num_key_value_heads must be positive");
    ERR("vocab_size", "0", "config.json: vocab_size must be positive (got 0)");
    ERR("vocab_size", NULL, "vocab_size is missing");
    ERR("max_position_embeddings", "-1", "max_position_embeddings must be positive");
    ERR("head_dim", "true", "head_dim must be an integer");
    ERR("rms_norm_eps", "\"1e-5\"", "rms_norm_eps must be a number");
    ERR("rms_norm_eps", "0", "rms_norm_eps must be a positive number");
    ERR("rope_theta", "-1", "rope_theta must be a positive number");
    ERR("tie_word_embeddings", "\"yes\"", "tie_word_embeddings must be true or false");
    ERR("attention_bias", "1", "attention_bias must be true or false");
    ERR("bos_token_id", "\"<s>\"", "bos_token_id must be a non-negative integer");
    ERR("bos_token_id", "100", "bos_token_id (100) is not below vocab_size (100)");
    ERR("eos_token_id", "\"</s>\"", "eos_token_id must be a non-negative integer or a list");
    ERR("eos_token_id", "[2,\"x\"]", "eos_token_id entries must be non-negative integers");
    ERR("eos_token_id", "-2", "eos_token_id must be a non-negative integer");
    ERR("eos_token_id", "[1,2,3,4,5,6,7,8,9]", "more than 8 distinct eos_token_id values");
    ERR("eos_token_id", "[1,200]", "eos_token_id 200 is not below vocab_size (100)");
    ERR("model_type", NULL, "config.json: model_type is missing");
    ERR("model_type", "3", "model_type must be a string");
    expect_err(__LINE__, "model_type", "\"gpt2\"", LOOM_ERR_UNSUPPORTED,
               "config.json: model_type 'gpt2' is not supported");
    expect_err(__LINE__, "mlp_bias", "true", LOOM_ERR_UNSUPPORTED, "config.json: mlp_bias is true");
    ERR("rope_scaling", "{\"type\":\"longrope\",\"factor\":2}",
        "config.json: rope_scaling.short_factor must list head_dim / 2 (4) numbers");
    ERR("rope_scaling", "{\"type\":\"su\",\"short_factor\":[1,1,1,1],\"long_factor\":[1,1,1,-1]}",
        "rope_scaling.long_factor[3] must be a positive number");
    expect_err(__LINE__, "rope_scaling", "{\"rope_type\":\"yarn\",\"factor\":4,\"mscale\":1}",
               LOOM_ERR_UNSUPPORTED, "rope_scaling.mscale");
    ERR("rope_scaling", "{\"type\":\"linear\"}", "rope_scaling.factor is missing");
    expect_err(__LINE__, "rope_scaling", "{\"type\":\"dynamic\",\"factor\":2}",
               LOOM_ERR_UNSUPPORTED, "rope_scaling type 'dynamic'");
    ERR("rope_scaling", "{\"factor\":2}", "rope_scaling needs a string \"rope_type\"");
    ERR("rope_scaling", "\"llama3\"", "rope_scaling must be an object or null");
    ERR("rope_scaling",
        "{\"rope_type\":\"llama3\",\"low_freq_factor\":1,\"high_freq_factor\":4,"
        "\"original_max_position_embeddings\":8192}",
        "rope_scaling.factor is missing");
    ERR("rope_scaling",
        "{\"rope_type\":\"llama3\",\"factor\":\"8\",\"low_freq_factor\":1,\"high_freq_factor\":4,"
        "\"original_max_position_embeddings\":8192}",
        "rope_scaling.factor must be a positive number");
    ERR("rope_scaling",
        "{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":4,\"high_freq_factor\":4,"
        "\"original_max_position_embeddings\":8192}",
        "high_freq_factor (4) must exceed low_freq_factor (4)");
    ERR("rope_scaling",
        "{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":1,\"high_freq_factor\":4}",
        "original_max_position_embeddings is missing");
    ERR("rope_scaling",
        "{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":1,\"high_freq_factor\":4,"
        "\"original_max_position_embeddings\":8192.5}",
        "original_max_position_embeddings must be a positive integer");

    /* hidden_size not divisible by heads when head_dim is absent (the exact text). */
    loom_model_config_t c;
    loom_err_t err = {0};
    const char *seven = "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
                        "\"num_hidden_layers\":2,\"num_attention_heads\":7,\"vocab_size\":100}";
    CHECK(parse(seven, &c, &err) == LOOM_ERR_FORMAT);
    CHECKF(
        !strcmp(err.msg, "config.json: num_attention_heads (7) does not divide hidden_size (64)"),
        "%s", err.msg);

    /* Not JSON, not an object. */
    const char *bad[] = {"",
                         "{",
                         "[1,2]",
                         "\"llama\"",
                         "null",
                         "{\"model_type\":\"llama\"} x",
                         "{\"model_type\":\"llama\",}"};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(bad); i++) {
        loom_status_t s = parse(bad[i], &c, &err);
        CHECKF(s == LOOM_ERR_FORMAT && strstr(err.msg, "config.json: "), "'%s': %s (%s)", bad[i],
               loom_status_str(s), err.msg);
    }
    /* Text that is not NUL-terminated is read only up to len. */
    char buf[64];
    memset(buf, '#', sizeof buf);
    memcpy(buf, "{}", 2);
    CHECK(loom_model_config_parse(buf, 2, "config.json", &c, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "model_type is missing") != NULL, "%s", err.msg);
    CHECK(loom_model_config_parse(NULL, 0, NULL, &c, &err) == LOOM_ERR_FORMAT);
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Mutated configs parse or fail with a status, never crash. */
/* The families beyond Llama, and the keys that change the math: each is
 * read into the config or refused by name (docs/model-format.md). */
static void test_families_and_refused_keys(void) {
#define BASE "\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":8," \
             "\"num_key_value_heads\":4,\"vocab_size\":100,\"max_position_embeddings\":4096"
    loom_model_config_t c;
    loom_err_t err = {0};
    CHECKF(parse("{\"model_type\":\"qwen3\"," BASE ",\"head_dim\":16}", &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.qk_norm && !c.attention_bias && c.head_dim == 16 && c.hidden_act == LOOM_HIDDEN_SILU);
    CHECK(!c.sliding_window && !loom_model_config_all_windowed(&c));
    CHECKF(parse("{\"model_type\":\"qwen2\"," BASE "}", &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(!c.qk_norm);

    /* Mistral: sliding_window absent means 4096 (MistralConfig), null none */
    CHECKF(parse("{\"model_type\":\"mistral\"," BASE ",\"sliding_window\":32}", &c, &err) == LOOM_OK, "%s",
           err.msg);
    CHECK(c.sliding_window == 32 && loom_model_config_layer_window(&c, 1) == 32 && loom_model_config_all_windowed(&c));
    CHECK(parse("{\"model_type\":\"mistral\"," BASE ",\"sliding_window\":null}", &c, &err) == LOOM_OK);
    CHECK(c.sliding_window == 0);
    CHECK(parse("{\"model_type\":\"mistral\",\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,"
                "\"num_attention_heads\":8,\"vocab_size\":100,\"max_position_embeddings\":32768}",
                &c, &err) == LOOM_OK);
    CHECK(c.sliding_window == 4096);
    /* a llama config's sliding_window is not read (LlamaConfig has none) */
    CHECK(parse("{\"model_type\":\"llama\"," BASE ",\"sliding_window\":32}", &c, &err) == LOOM_OK);
    CHECK(c.sliding_window == 0);

    /* hidden_act */
    static const struct {
        const char *name;
        loom_hidden_act_t act;
    } acts[] = {{"silu", LOOM_HIDDEN_SILU},          {"gelu", LOOM_HIDDEN_GELU},
                {"gelu_new", LOOM_HIDDEN_GELU_TANH}, {"gelu_pytorch_tanh", LOOM_HIDDEN_GELU_TANH},
                {"relu", LOOM_HIDDEN_RELU},          {"quick_gelu", LOOM_HIDDEN_QUICK_GELU}};
    char json[1024];
    for (size_t i = 0; i < LOOM_ARRAY_LEN(acts); i++) {
        snprintf(json, sizeof json, "{\"model_type\":\"llama\"," BASE ",\"hidden_act\":\"%s\"}", acts[i].name);
        CHECKF(parse(json, &c, &err) == LOOM_OK && c.hidden_act == acts[i].act, "%s: %s", acts[i].name, err.msg);
    }
    expect_err(__LINE__, "hidden_act", "\"mish\"", LOOM_ERR_UNSUPPORTED, "hidden_act 'mish' is not supported");
    ERR("hidden_act", "3", "hidden_act must be a string");

    /* keys Loom cannot honour are refused by name */
    expect_err(__LINE__, "attn_logit_softcapping", "50.0", LOOM_ERR_UNSUPPORTED, "attn_logit_softcapping");
    expect_err(__LINE__, "final_logit_softcapping", "30.0", LOOM_ERR_UNSUPPORTED, "final_logit_softcapping");
    expect_err(__LINE__, "query_pre_attn_scalar", "256", LOOM_ERR_UNSUPPORTED, "query_pre_attn_scalar");
    expect_err(__LINE__, "num_local_experts", "8", LOOM_ERR_UNSUPPORTED, "num_local_experts");
    expect_err(__LINE__, "num_experts", "64", LOOM_ERR_UNSUPPORTED, "num_experts");
    expect_err(__LINE__, "partial_rotary_factor", "0.75", LOOM_ERR_UNSUPPORTED, "partial_rotary_factor");
    expect_err(__LINE__, "use_sliding_window", "true", LOOM_ERR_UNSUPPORTED, "use_sliding_window");
    expect_err(__LINE__, "layer_types", "[\"sliding_attention\",\"full_attention\"]", LOOM_ERR_UNSUPPORTED,
               "layer_types entry 'sliding_attention'");
    ERR("layer_types", "[\"full_attention\"]", "layer_types must list num_hidden_layers (2) entries");
    CHECK(parse("{\"model_type\":\"llama\"," BASE ",\"num_experts\":0,\"partial_rotary_factor\":1.0,"
                "\"use_sliding_window\":false,\"layer_types\":[\"full_attention\",\"full_attention\"]}",
                &c, &err) == LOOM_OK);

    /* RoPE: linear and yarn */
    CHECK(parse("{\"model_type\":\"llama\"," BASE ",\"rope_scaling\":{\"type\":\"linear\",\"factor\":4}}", &c,
                &err) == LOOM_OK);
    CHECK(c.rope_scaling == LOOM_ROPE_LINEAR && c.rope_factor == 4.0f && c.rope_attn_factor == 1.0f);
    CHECKF(parse("{\"model_type\":\"qwen3\"," BASE ",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4,"
                 "\"original_max_position_embeddings\":1024}}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.rope_scaling == LOOM_ROPE_YARN && c.rope_orig_max_pos == 1024 && c.rope_beta_fast == 32.0f &&
          c.rope_beta_slow == 1.0f && c.rope_truncate);
    CHECKF(fabsf(c.rope_attn_factor - (float)(0.1 * log(4.0) + 1.0)) < 1e-6f, "%g", (double)c.rope_attn_factor);
    /* factor disagreeing with max_position_embeddings / original: the default
     * attention factor differs between Transformers versions, so refused */
    CHECK(parse("{\"model_type\":\"qwen3\"," BASE ",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":2,"
                "\"original_max_position_embeddings\":1024}}",
                &c, &err) == LOOM_ERR_UNSUPPORTED);
    CHECKF(strstr(err.msg, "attention_factor") != NULL, "%s", err.msg);
    CHECK(parse("{\"model_type\":\"qwen3\"," BASE ",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":2,"
                "\"original_max_position_embeddings\":1024,\"attention_factor\":1.5,\"beta_fast\":16}}",
                &c, &err) == LOOM_OK);
    CHECK(c.rope_attn_factor == 1.5f && c.rope_beta_fast == 16.0f);
    /* Transformers 5: rope_parameters holds rope_theta and the type */
    CHECK(parse("{\"model_type\":\"llama\"," BASE ",\"rope_parameters\":{\"rope_type\":\"default\","
                "\"rope_theta\":500000}}",
                &c, &err) == LOOM_OK);
    CHECK(c.rope_theta == 500000.0f && c.rope_scaling == LOOM_ROPE_NONE);
    CHECK(parse("{\"model_type\":\"llama\"," BASE ",\"rope_parameters\":{\"rope_type\":\"dynamic\","
                "\"rope_theta\":500000}}",
                &c, &err) == LOOM_ERR_UNSUPPORTED);
    /* Phi-3: fused projections, its sliding window, longrope cut to the original context */
    CHECKF(parse("{\"model_type\":\"phi3\",\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,"
                 "\"num_attention_heads\":8,\"vocab_size\":100,\"max_position_embeddings\":131072,"
                 "\"original_max_position_embeddings\":4096,\"sliding_window\":2047,\"rope_scaling\":{\"type\":"
                 "\"longrope\",\"short_factor\":[1,2,3,4],\"long_factor\":[5,6,7,8]}}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.fused_qkv && c.sliding_window == 2047 && c.rope_scaling == LOOM_ROPE_LONGROPE);
    CHECK(c.max_seq_len == 4096 && c.rope_ctx_capped && c.rope_orig_max_pos == 4096 && c.rope_ext_factor[2] == 3.0f);
    CHECKF(fabsf(c.rope_attn_factor - (float)sqrt(1.0 + log(32.0) / log(4096.0))) < 1e-6f, "%g",
           (double)c.rope_attn_factor);
    CHECK(parse("{\"model_type\":\"phi3\"," BASE "}", &c, &err) == LOOM_OK);
    CHECK(c.fused_qkv && c.sliding_window == 0 && !c.rope_ctx_capped && c.max_seq_len == 4096);
    CHECK(c.rotary_dim == c.head_dim && c.head_dim == 8);
    /* Phi-4-mini's partial rotary: int(0.75 * 8) = 6 dims turn; longrope lists one factor per rotary pair */
    CHECKF(parse("{\"model_type\":\"phi3\"," BASE ",\"partial_rotary_factor\":0.75,\"rope_scaling\":{\"type\":"
                 "\"longrope\",\"short_factor\":[1,2,3],\"long_factor\":[5,6,7]}}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.rotary_dim == 6 && c.head_dim == 8 && c.rope_ext_factor[2] == 3.0f);
    CHECK(parse("{\"model_type\":\"phi3\"," BASE ",\"partial_rotary_factor\":0.75,\"rope_scaling\":{\"type\":"
                "\"longrope\",\"short_factor\":[1,2,3,4],\"long_factor\":[5,6,7,8]}}",
                &c, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "the rotary dims / 2 (3)"));
    CHECK(parse("{\"model_type\":\"phi3\"," BASE ",\"partial_rotary_factor\":0.1}", &c, &err) == LOOM_ERR_FORMAT &&
          strstr(err.msg, "gives 0 rotary dims"));
    CHECK(parse("{\"model_type\":\"phi3\"," BASE ",\"partial_rotary_factor\":0.5}", &c, &err) == LOOM_OK &&
          c.rotary_dim == 4);
    CHECK(parse("{\"model_type\":\"phi3\"," BASE ",\"partial_rotary_factor\":1.5}", &c, &err) == LOOM_ERR_FORMAT &&
          strstr(err.msg, "(0, 1]"));

    /* Gemma 3 multimodal (gemma-3-4b-it's config.json, vision_config cut): the text model from a sparse
     * text_config over Gemma3TextConfig's defaults, eos from the top */
    CHECKF(parse("{\"architectures\":[\"Gemma3ForConditionalGeneration\"],\"boi_token_index\":255999,"
                 "\"eoi_token_index\":256000,\"eos_token_id\":[1,106],\"image_token_index\":262144,"
                 "\"initializer_range\":0.02,\"mm_tokens_per_image\":256,\"model_type\":\"gemma3\","
                 "\"text_config\":{\"hidden_size\":2560,\"intermediate_size\":10240,\"model_type\":\"gemma3_text\","
                 "\"num_hidden_layers\":34,\"rope_scaling\":{\"factor\":8.0,\"rope_type\":\"linear\"},"
                 "\"sliding_window\":1024},\"torch_dtype\":\"bfloat16\",\"vision_config\":{\"hidden_size\":1152,"
                 "\"model_type\":\"siglip_vision_model\",\"patch_size\":14}}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.multimodal && c.gemma && c.qk_norm && !strcmp(c.model_type, "gemma3_text"));
    CHECK(c.dim == 2560 && c.hidden_dim == 10240 && c.n_layers == 34 && c.n_heads == 8 && c.n_kv_heads == 4);
    CHECK(c.head_dim == 256 && c.vocab_size == 262208 && c.max_seq_len == 131072 && c.tie_embeddings);
    CHECK(c.rope_theta == 1000000.0f && c.rope_local_theta == 10000.0f && c.rope_scaling == LOOM_ROPE_LINEAR &&
          c.rope_factor == 8.0f);
    CHECK(c.sliding_window == 1024 && c.sliding_pattern == 6 && c.norm_eps == 1e-6f && c.bos_id == 2);
    CHECK(c.hidden_act == LOOM_HIDDEN_GELU_TANH && c.attn_softcap == 0 && c.final_softcap == 0);
    CHECK(fabsf(c.query_scale - 1.0f / 16.0f) < 1e-7f && c.torch_dtype == LOOM_DT_BF16);
    CHECK(c.n_eos == 2 && c.eos_ids[0] == 1 && c.eos_ids[1] == 106);
    CHECK(parse("{\"model_type\":\"gemma3\",\"vision_config\":{}}", &c, &err) == LOOM_ERR_FORMAT &&
          strstr(err.msg, "needs a text_config"));
    CHECK(parse("{\"model_type\":\"gemma3\",\"text_config\":{\"model_type\":\"llama\"}}", &c, &err) ==
              LOOM_ERR_UNSUPPORTED &&
          strstr(err.msg, "text_config.model_type must be gemma3_text"));
    CHECK(parse("{\"model_type\":\"gemma3_text\"," BASE "}", &c, &err) == LOOM_OK && !c.multimodal);

    /* Gemma 3 text: its defaults, and layer_types over sliding_window_pattern */
    CHECKF(parse("{\"model_type\":\"gemma3_text\"," BASE ",\"head_dim\":32,\"query_pre_attn_scalar\":24,"
                 "\"sliding_window\":512,\"final_logit_softcapping\":null,\"attn_logit_softcapping\":null}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.gemma && c.qk_norm && c.hidden_act == LOOM_HIDDEN_GELU_TANH && c.sliding_pattern == 6);
    CHECK(fabsf(c.query_scale - 1.0f / sqrtf(24.0f)) < 1e-7f && fabsf(c.embed_scale - 8.0f) < 1e-6f);
    CHECK(c.rope_local_theta == 10000.0f && loom_model_config_layer_window(&c, 0) == 512 &&
          loom_model_config_layer_window(&c, 5) == 0);
    CHECK(loom_model_config_all_windowed(&c)); /* 2 layers under a pattern of 6: both slide */
    CHECK(parse("{\"model_type\":\"gemma3_text\"," BASE ",\"sliding_window\":8,\"layer_types\":"
                "[\"full_attention\",\"sliding_attention\"]}",
                &c, &err) == LOOM_OK);
    CHECK(loom_model_config_layer_window(&c, 0) == 0 && loom_model_config_layer_window(&c, 1) == 8);
    CHECK(!loom_model_config_all_windowed(&c));
    CHECK(c.attn_softcap == 0 && c.final_softcap == 0); /* Gemma3TextConfig: no caps unless given */
    CHECKF(parse("{\"model_type\":\"gemma3_text\"," BASE ",\"attn_logit_softcapping\":50}", &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.attn_softcap == 50.0f && c.final_softcap == 0);

    /* Gemma 2: Gemma2Config's defaults (caps 50 and 30, window 4096, query_pre_attn_scalar 256, head_dim
     * 256, a tied head, gelu_pytorch_tanh), the even layers sliding, no q/k norms, one RoPE base */
    CHECKF(parse("{\"model_type\":\"gemma2\"," BASE "}", &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.gemma && !c.qk_norm && c.hidden_act == LOOM_HIDDEN_GELU_TANH && c.tie_embeddings);
    CHECK(c.attn_softcap == 50.0f && c.final_softcap == 30.0f && c.head_dim == 256 && c.sliding_window == 4096);
    CHECK(fabsf(c.query_scale - 1.0f / 16.0f) < 1e-7f && fabsf(c.embed_scale - 8.0f) < 1e-6f);
    CHECK(c.rope_local_theta == 0 && c.rope_theta == 10000.0f);
    CHECK(loom_model_config_layer_window(&c, 0) == 0); /* a window of 4096 in 4096 positions is never reached */
    /* a released config: both activation keys (hidden_activation is the one Gemma2MLP reads), null caps */
    CHECKF(parse("{\"model_type\":\"gemma2\"," BASE ",\"head_dim\":32,\"query_pre_attn_scalar\":144,"
                 "\"sliding_window\":1024,\"sliding_window_size\":1024,\"cache_implementation\":\"hybrid\","
                 "\"hidden_act\":\"gelu\",\"hidden_activation\":\"gelu_pytorch_tanh\",\"tie_word_embeddings\":false,"
                 "\"attn_logit_softcapping\":null,\"final_logit_softcapping\":null,\"rope_theta\":5000}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.hidden_act == LOOM_HIDDEN_GELU_TANH && !c.tie_embeddings && c.head_dim == 32);
    CHECK(c.attn_softcap == 0 && c.final_softcap == 0 && c.rope_theta == 5000.0f);
    CHECK(fabsf(c.query_scale - 1.0f / 12.0f) < 1e-7f);
    CHECK(loom_model_config_layer_window(&c, 0) == 1024 && loom_model_config_layer_window(&c, 1) == 0 &&
          loom_model_config_layer_window(&c, 2) == 1024 && !loom_model_config_all_windowed(&c));
    CHECKF(parse("{\"model_type\":\"gemma2\"," BASE ",\"sliding_window\":16,\"layer_types\":"
                 "[\"sliding_attention\",\"sliding_attention\"],\"attn_logit_softcapping\":20.5}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(loom_model_config_all_windowed(&c) && c.attn_softcap == 20.5f && c.final_softcap == 30.0f);
    CHECK(parse("{\"model_type\":\"gemma2\"," BASE ",\"sliding_window\":null}", &c, &err) == LOOM_OK);
    CHECK(loom_model_config_layer_window(&c, 0) == 0);
    /* caps that are not positive numbers, and scaling Loom does not run, are refused by name */
    static const char *const bad_caps[] = {"-1", "0", "\"50\"", "true", "1e39", "[50]"};
    static const char *const cap_keys[] = {"attn_logit_softcapping", "final_logit_softcapping"};
    for (size_t k = 0; k < LOOM_ARRAY_LEN(cap_keys); k++)
        for (size_t i = 0; i < LOOM_ARRAY_LEN(bad_caps); i++) {
            char js[512];
            snprintf(js, sizeof js, "{\"model_type\":\"gemma2\"," BASE ",\"%s\":%s}", cap_keys[k], bad_caps[i]);
            loom_status_t st = parse(js, &c, &err);
            CHECKF(st == LOOM_ERR_FORMAT && strstr(err.msg, cap_keys[k]) && strstr(err.msg, "positive number or null"),
                   "%s: %s (%s)", js, loom_status_str(st), err.msg);
        }
    CHECK(parse("{\"model_type\":\"gemma2\"," BASE ",\"attn_logit_softcapping\":NaN}", &c, &err) ==
          LOOM_ERR_FORMAT); /* not JSON */
    CHECK(parse("{\"model_type\":\"gemma2\"," BASE ",\"rope_scaling\":{\"rope_type\":\"linear\",\"factor\":2}}",
                &c, &err) == LOOM_ERR_UNSUPPORTED && strstr(err.msg, "gemma2 with rope_scaling"));
    CHECK(parse("{\"model_type\":\"gemma2\"," BASE ",\"use_bidirectional_attention\":true}", &c, &err) ==
          LOOM_ERR_UNSUPPORTED);
    CHECK(parse("{\"model_type\":\"gemma2\"," BASE ",\"query_pre_attn_scalar\":-4}", &c, &err) == LOOM_ERR_FORMAT &&
          strstr(err.msg, "query_pre_attn_scalar"));
    CHECK(parse("{\"model_type\":\"gemma3_text\"," BASE ",\"rope_scaling\":{\"rope_type\":\"yarn\","
                "\"factor\":2}}",
                &c, &err) == LOOM_ERR_UNSUPPORTED);

    /* absurd sizes parse (they fit an int); the loader checks them against the checkpoint */
    CHECK(parse("{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":1e9,"
                "\"num_attention_heads\":8,\"vocab_size\":100}",
                &c, &err) == LOOM_OK);
    CHECK(c.n_layers == 1000000000);
#undef BASE
}

static void test_fuzz(void) {
    size_t len = strlen(k_llama3);
    char *mut = loom_xmalloc(len + 1);
    static const char interesting[] = "0123456789-.e,[]{}\":tnul ";
    uint64_t rng = 12345;
    int n_ok = 0, n_wrong = 0;
    for (int iter = 0; iter < 2000; iter++) {
        memcpy(mut, k_llama3, len + 1);
        size_t n = len;
        int edits = 1 + (int)(rng_next(&rng) % 3);
        for (int e = 0; e < edits; e++) {
            uint64_t r = rng_next(&rng);
            if (r % 7 == 0)
                n = (size_t)(r >> 8) % (n + 1);
            else if (n)
                mut[(r >> 8) % n] = (r % 7 == 1)
                                        ? (char)(r >> 40)
                                        : interesting[(r >> 40) % (sizeof interesting - 1)];
        }
        loom_model_config_t c;
        loom_err_t err = {0};
        loom_status_t s = loom_model_config_parse(mut, n, "config.json", &c, &err);
        if (s == LOOM_OK) {
            n_ok++;
            if (c.dim <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 ||
                c.n_heads % c.n_kv_heads || c.vocab_size <= 0 || c.n_eos > LOOM_MAX_EOS)
                n_wrong++;
        } else if (s != LOOM_ERR_FORMAT && s != LOOM_ERR_UNSUPPORTED) {
            n_wrong++;
        }
    }
    fprintf(stderr, "  fuzz: %d of 2000 parsed\n", n_ok);
    CHECK(n_wrong == 0);
    free(mut);
}

/* quantization_config: loom, AWQ and GPTQ (v1 stores zero points minus one,
 * v2 does not) are recognised; other methods and bit widths are refused. */
static void test_quantization_config(void) {
    static const char base[] = "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":172,"
                               "\"num_hidden_layers\":2,\"num_attention_heads\":8,\"vocab_size\":512,"
                               "\"quantization_config\":%s}";
    static const struct {
        const char *qc;
        loom_status_t status;
        loom_ckpt_quant_t quant;
        int group, minus1;
        const char *msg;
    } cases[] = {
        {"{\"quant_method\":\"loom\",\"scheme\":\"q4\"}", LOOM_OK, LOOM_CKPT_LOOM, 0, 0, NULL},
        {"{\"quant_method\":\"awq\",\"bits\":4,\"group_size\":128,\"version\":\"GEMM\",\"zero_point\":true}", LOOM_OK,
         LOOM_CKPT_AWQ, 128, 0, NULL},
        {"{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":32,\"desc_act\":false}", LOOM_OK, LOOM_CKPT_GPTQ, 32, 1,
         NULL},
        {"{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":64,\"checkpoint_format\":\"gptq_v2\"}", LOOM_OK,
         LOOM_CKPT_GPTQ, 64, 0, NULL},
        {"{\"quant_method\":\"gptq\",\"bits\":8,\"group_size\":32}", LOOM_ERR_UNSUPPORTED, 0, 0, 0,
         "quantization_config.bits is 8"},
        {"{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":-1}", LOOM_ERR_UNSUPPORTED, 0, 0, 0, "group_size"},
        {"{\"quant_method\":\"awq\",\"bits\":4,\"group_size\":128,\"version\":\"gemv\"}", LOOM_ERR_UNSUPPORTED, 0, 0, 0,
         "AWQ version 'gemv'"},
        {"{\"quant_method\":\"bitsandbytes\"}", LOOM_ERR_UNSUPPORTED, 0, 0, 0, "'bitsandbytes' is not supported"},
        {"[1]", LOOM_ERR_FORMAT, 0, 0, 0, "quantization_config must be an object"},
    };
    for (size_t i = 0; i < LOOM_ARRAY_LEN(cases); i++) {
        char json[600];
        snprintf(json, sizeof json, base, cases[i].qc);
        loom_model_config_t c;
        loom_err_t err = {0};
        loom_status_t s = parse(json, &c, &err);
        CHECKF(s == cases[i].status, "%s: status %d (%s)", cases[i].qc, s, err.msg);
        if (s == LOOM_OK) {
            CHECKF(c.ckpt_quant == cases[i].quant && c.ckpt_group == cases[i].group &&
                       c.ckpt_zeros_minus1 == cases[i].minus1,
                   "%s: quant %d group %d minus1 %d", cases[i].qc, c.ckpt_quant, c.ckpt_group, c.ckpt_zeros_minus1);
        } else {
            CHECKF(strstr(err.msg, cases[i].msg) != NULL, "%s: message '%s'", cases[i].qc, err.msg);
        }
    }
    loom_model_config_t c;
    CHECK(parse("{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":172,\"num_hidden_layers\":2,"
                "\"num_attention_heads\":8,\"vocab_size\":512}",
                &c, NULL) == LOOM_OK &&
          c.ckpt_quant == LOOM_CKPT_FLOAT);
}

/* Mixtral and Qwen3-MoE: the expert keys, their defaults, which layers are
 * sparse, and the refusals that name the key. */
static void test_moe(void) {
#define MBASE "\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":4,\"num_attention_heads\":8," \
              "\"num_key_value_heads\":4,\"vocab_size\":100,\"max_position_embeddings\":4096"
    loom_model_config_t c;
    loom_err_t err = {0};
    CHECKF(parse("{\"model_type\":\"mixtral\"," MBASE ",\"num_local_experts\":8,\"num_experts_per_tok\":2,"
                 "\"sliding_window\":null,\"router_jitter_noise\":0.0}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.n_experts == 8 && c.n_experts_per_tok == 2 && c.moe_hidden_dim == 128 && c.norm_topk_prob &&
          c.moe_mixtral_names && !c.qk_norm && !c.sliding_window);
    for (int l = 0; l < 4; l++) CHECK(loom_model_config_layer_moe(&c, l));
    /* MixtralConfig's defaults: 8 experts, top-2 */
    CHECK(parse("{\"model_type\":\"mixtral\"," MBASE "}", &c, &err) == LOOM_OK);
    CHECK(c.n_experts == 8 && c.n_experts_per_tok == 2);

    CHECKF(parse("{\"model_type\":\"qwen3_moe\"," MBASE ",\"num_experts\":6,\"num_experts_per_tok\":3,"
                 "\"moe_intermediate_size\":40,\"norm_topk_prob\":false,\"decoder_sparse_step\":2,"
                 "\"mlp_only_layers\":[3],\"use_sliding_window\":false}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.n_experts == 6 && c.n_experts_per_tok == 3 && c.moe_hidden_dim == 40 && !c.norm_topk_prob &&
          !c.moe_mixtral_names && c.qk_norm && c.hidden_dim == 128);
    /* sparse iff not in mlp_only_layers and (L+1) % decoder_sparse_step == 0: only layer 1 here */
    CHECK(!loom_model_config_layer_moe(&c, 0) && loom_model_config_layer_moe(&c, 1) &&
          !loom_model_config_layer_moe(&c, 2) && !loom_model_config_layer_moe(&c, 3));
    CHECK(parse("{\"model_type\":\"qwen3_moe\"," MBASE ",\"num_experts\":4,\"norm_topk_prob\":true,"
                "\"num_experts_per_tok\":4}",
                &c, &err) == LOOM_OK);
    CHECK(c.norm_topk_prob && c.moe_hidden_dim == 768 && loom_model_config_layer_moe(&c, 2));
    /* Qwen2-MoE: Qwen2MoeConfig's defaults (60 experts, top-4, 1408, a shared expert of 5632), q/k/v biases */
    CHECKF(parse("{\"model_type\":\"qwen2_moe\"," MBASE "}", &c, &err) == LOOM_OK, "%s", err.msg);
    CHECK(c.n_experts == 60 && c.n_experts_per_tok == 4 && c.moe_hidden_dim == 1408 && c.moe_shared_hidden == 5632 &&
          c.attention_bias && !c.qk_norm && !c.norm_topk_prob);
    CHECK(parse("{\"model_type\":\"qwen2_moe\"," MBASE ",\"num_experts\":8,\"shared_expert_intermediate_size\":64,"
                "\"decoder_sparse_step\":2}",
                &c, &err) == LOOM_OK);
    CHECK(c.n_experts == 8 && c.moe_shared_hidden == 64 && !loom_model_config_layer_moe(&c, 0) &&
          loom_model_config_layer_moe(&c, 1));
    /* num_experts 0: every layer dense */
    CHECK(parse("{\"model_type\":\"qwen3_moe\"," MBASE ",\"num_experts\":0}", &c, &err) == LOOM_OK);
    CHECK(c.n_experts == 0 && !loom_model_config_layer_moe(&c, 0));

    struct {
        const char *json, *want;
    } bad[] = {
        {"{\"model_type\":\"mixtral\"," MBASE ",\"num_local_experts\":4,\"num_experts_per_tok\":5}",
         "num_experts_per_tok (5) must be between 1 and num_local_experts (4)"},
        {"{\"model_type\":\"qwen3_moe\"," MBASE ",\"num_experts\":4,\"num_experts_per_tok\":0}",
         "num_experts_per_tok (0) must be between 1 and num_experts (4)"},
        {"{\"model_type\":\"mixtral\"," MBASE ",\"num_local_experts\":0}", "num_local_experts must be positive"},
        {"{\"model_type\":\"qwen3_moe\"," MBASE ",\"num_experts\":-2}", "num_experts must be a non-negative"},
        {"{\"model_type\":\"qwen3_moe\"," MBASE ",\"num_experts\":4,\"num_experts_per_tok\":2,"
         "\"mlp_only_layers\":[4]}",
         "mlp_only_layers entries must be layer indices below num_hidden_layers (4)"},
        {"{\"model_type\":\"qwen3_moe\"," MBASE ",\"num_experts\":4,\"num_experts_per_tok\":2,"
         "\"decoder_sparse_step\":0}",
         "decoder_sparse_step must be positive"},
        /* a dense family's expert keys are still refused by name */
        {"{\"model_type\":\"qwen3\"," MBASE ",\"num_experts\":8}", "num_experts is not supported"},
        {"{\"model_type\":\"mixtral\"," MBASE ",\"n_routed_experts\":8}", "n_routed_experts is not supported"},
    };
    for (size_t i = 0; i < LOOM_ARRAY_LEN(bad); i++) {
        err.msg[0] = 0;
        CHECKF(parse(bad[i].json, &c, &err) < 0 && strstr(err.msg, bad[i].want), "case %zu: %s", i, err.msg);
    }
#undef MBASE
}

/* GPT-OSS: the expert keys (both spellings of top-k), every layer sparse,
 * the alternating windows (layer_types or the default), biases on by
 * default, swiglu_limit, the MXFP4 checkpoint method, and the refusals. */
static void test_gpt_oss(void) {
#define OBASE                                                                                      \
    "\"model_type\":\"gpt_oss\",\"hidden_size\":64,\"intermediate_size\":32,\"num_hidden_"         \
    "layers\":4,"                                                                                  \
    "\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":16,\"vocab_size\":100,"      \
    "\"max_position_embeddings\":131072"
    loom_model_config_t c;
    loom_err_t err = {0};
    CHECKF(
        parse(
            "{" OBASE ",\"num_local_experts\":8,\"experts_per_token\":2,\"sliding_window\":16,"
            "\"hidden_act\":\"silu\",\"router_aux_loss_coef\":0.9,\"output_router_logits\":false}",
            &c, &err) == LOOM_OK,
        "%s", err.msg);
    CHECK(c.gpt_oss && c.n_experts == 8 && c.n_experts_per_tok == 2 && c.moe_hidden_dim == 32 &&
          c.norm_topk_prob && c.attention_bias && !c.qk_norm && !c.gemma &&
          c.swiglu_limit == 7.0f && c.ckpt_quant == LOOM_CKPT_FLOAT);
    for (int l = 0; l < 4; l++) {
        CHECK(loom_model_config_layer_moe(&c, l));
        CHECKF(loom_model_config_layer_window(&c, l) == (l % 2 == 0 ? 16 : 0), "layer %d window %d",
               l, loom_model_config_layer_window(&c, l));
    }
    CHECK(!loom_model_config_all_windowed(&c));
    /* GptOssConfig's defaults: 128 experts top-4, window 128; layer_types wins over the default */
    CHECKF(parse("{" OBASE
                 ",\"layer_types\":[\"full_attention\",\"sliding_attention\",\"sliding_attention\","
                 "\"full_attention\"],\"swiglu_limit\":5.5,\"attention_bias\":false,"
                 "\"quantization_config\":{\"quant_method\":\"mxfp4\",\"modules_to_not_convert\":["
                 "\"lm_head\"]}}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.n_experts == 128 && c.n_experts_per_tok == 4 && c.swiglu_limit == 5.5f &&
          !c.attention_bias && c.ckpt_quant == LOOM_CKPT_MXFP4);
    CHECK(loom_model_config_layer_window(&c, 0) == 0 &&
          loom_model_config_layer_window(&c, 1) == 128 &&
          loom_model_config_layer_window(&c, 2) == 128 &&
          loom_model_config_layer_window(&c, 3) == 0);
    CHECK(parse("{" OBASE ",\"sliding_window\":null}", &c, &err) == LOOM_OK &&
          !loom_model_config_layer_window(&c, 0));
    /* GptOssConfig's defaults for what gpt-oss configs always carry: yarn over 4096 x 32 (truncate
     * false), rope_theta 150000, eps 1e-5, head_dim 64, 131072 positions, swiglu_alpha 1.702;
     * rope_scaling null: none */
    CHECKF(parse("{\"model_type\":\"gpt_oss\",\"hidden_size\":64,\"intermediate_size\":32,\"num_"
                 "hidden_layers\":2,"
                 "\"num_attention_heads\":4,\"num_key_value_heads\":2,\"vocab_size\":100}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.rope_scaling == LOOM_ROPE_YARN && c.rope_factor == 32.0f &&
          c.rope_orig_max_pos == 4096 && !c.rope_truncate && c.rope_theta == 150000.0f &&
          c.norm_eps == 1e-5f && c.head_dim == 64 && c.max_seq_len == 131072 &&
          c.swiglu_alpha == 1.702f);
    CHECK(parse("{" OBASE ",\"rope_scaling\":null,\"swiglu_alpha\":1.5}", &c, &err) == LOOM_OK &&
          c.rope_scaling == LOOM_ROPE_NONE && c.swiglu_alpha == 1.5f && c.head_dim == 16);
    struct {
        const char *json, *want;
    } bad[] = {
        {"{" OBASE ",\"num_local_experts\":0}", "num_local_experts must be positive"},
        {"{" OBASE ",\"num_local_experts\":4,\"num_experts_per_tok\":5}",
         "num_experts_per_tok (5) must be between 1 and num_local_experts (4)"},
        {"{" OBASE ",\"swiglu_limit\":-1}", "swiglu_limit"},
        {"{" OBASE ",\"layer_types\":[\"full_attention\"]}",
         "layer_types must list num_hidden_layers (4)"},
        {"{" OBASE
         ",\"layer_types\":[\"full_attention\",\"x\",\"full_attention\",\"full_attention\"]}",
         "layer_types entry 'x' is not supported"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":32,\"num_hidden_"
         "layers\":4,"
         "\"num_attention_heads\":4,\"vocab_size\":100,\"quantization_config\":{\"quant_method\":"
         "\"mxfp4\"}}",
         "'mxfp4' is read for gpt_oss only"},
    };
    for (size_t i = 0; i < LOOM_ARRAY_LEN(bad); i++) {
        err.msg[0] = 0;
        CHECKF(parse(bad[i].json, &c, &err) < 0 && strstr(err.msg, bad[i].want), "case %zu: %s", i,
               err.msg);
    }
#undef OBASE
}

/* Each family's defaults, written out here as read from its Transformers
 * config class, against both the table in common/model_config.c and what a
 * config.json that gives only the required keys parses to. */
static const struct {
    const char *type;
    int kv, head_dim, max_pos;
    float eps, theta;
    int tie, bias, window;
    loom_hidden_act_t act;
} k_expect[] = {
    {"llama", 32, 128, 2048, 1e-6f, 10000.0f, 0, 0, 0, LOOM_HIDDEN_SILU},
    {"mistral", 8, 128, 131072, 1e-6f, 10000.0f, 0, 0, 4096, LOOM_HIDDEN_SILU},
    {"qwen2", 32, 128, 32768, 1e-6f, 10000.0f, 0, 1, 0, LOOM_HIDDEN_SILU},
    {"qwen3", 32, 128, 32768, 1e-6f, 10000.0f, 0, 0, 0, LOOM_HIDDEN_SILU},
    {"phi3", 32, 128, 4096, 1e-5f, 10000.0f, 0, 0, 0, LOOM_HIDDEN_SILU},
    {"gemma2", 4, 256, 8192, 1e-6f, 10000.0f, 1, 0, 4096, LOOM_HIDDEN_GELU_TANH},
    {"gemma3_text", 4, 256, 131072, 1e-6f, 1000000.0f, 1, 0, 4096, LOOM_HIDDEN_GELU_TANH},
    {"mixtral", 8, 128, 131072, 1e-5f, 1000000.0f, 0, 0, 0, LOOM_HIDDEN_SILU},
    {"qwen3_moe", 4, 128, 32768, 1e-6f, 10000.0f, 0, 0, 0, LOOM_HIDDEN_SILU},
    {"qwen2_moe", 16, 128, 32768, 1e-6f, 10000.0f, 0, 1, 0, LOOM_HIDDEN_SILU},
    {"gpt_oss", 8, 64, 131072, 1e-5f, 150000.0f, 0, 1, 128, LOOM_HIDDEN_SILU},
};

static void test_family_defaults(void) {
    loom_model_config_t c;
    loom_err_t err = {0};
    char json[512];
    size_t n = 0;
    while (loom_model_family_defaults_at(n)) n++;
    CHECKF(n == LOOM_ARRAY_LEN(k_expect), "%zu families", n);
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_expect); i++) {
        const loom_family_defaults_t *d = loom_model_family_defaults(k_expect[i].type);
        REQUIRE(d != NULL && d == loom_model_family_defaults_at(i));
        CHECK(d->config_class && strstr(d->config_class, "Config"));
        /* hidden 4096 over 32 heads: head_dim 128 unless the class fixes it */
        snprintf(json, sizeof json,
                 "{\"model_type\":\"%s\",\"hidden_size\":4096,\"intermediate_size\":128,\"num_hidden_layers\":2,"
                 "\"num_attention_heads\":32,\"vocab_size\":100}",
                 k_expect[i].type);
        CHECKF(parse(json, &c, &err) == LOOM_OK, "%s: %s", k_expect[i].type, err.msg);
        CHECKF(c.n_kv_heads == k_expect[i].kv && c.head_dim == k_expect[i].head_dim &&
                   c.max_seq_len == k_expect[i].max_pos,
               "%s: kv %d head_dim %d max_pos %d", k_expect[i].type, c.n_kv_heads, c.head_dim, c.max_seq_len);
        CHECKF(c.norm_eps == k_expect[i].eps && c.rope_theta == k_expect[i].theta, "%s: eps %g theta %g",
               k_expect[i].type, (double)c.norm_eps, (double)c.rope_theta);
        CHECKF(c.tie_embeddings == k_expect[i].tie && c.attention_bias == k_expect[i].bias &&
                   c.sliding_window == k_expect[i].window && c.hidden_act == k_expect[i].act,
               "%s: tie %d bias %d window %d act %d", k_expect[i].type, c.tie_embeddings, c.attention_bias,
               c.sliding_window, (int)c.hidden_act);
        /* and the table says the same */
        CHECKF((d->n_kv_heads ? d->n_kv_heads : 32) == k_expect[i].kv &&
                   (d->head_dim ? d->head_dim : 128) == k_expect[i].head_dim &&
                   d->max_position_embeddings == k_expect[i].max_pos && (float)d->rms_norm_eps == k_expect[i].eps &&
                   (float)d->rope_theta == k_expect[i].theta && d->tie_word_embeddings == k_expect[i].tie &&
                   d->attention_bias == k_expect[i].bias && d->sliding_window == k_expect[i].window,
               "%s: table row", k_expect[i].type);
        /* an explicit null derives num_key_value_heads and head_dim, as the classes whose default is None do */
        snprintf(json, sizeof json,
                 "{\"model_type\":\"%s\",\"hidden_size\":4096,\"intermediate_size\":128,\"num_hidden_layers\":2,"
                 "\"num_attention_heads\":32,\"vocab_size\":100,\"num_key_value_heads\":null,\"head_dim\":null}",
                 k_expect[i].type);
        CHECKF(parse(json, &c, &err) == LOOM_OK && c.n_kv_heads == 32 && c.head_dim == 128, "%s: %s",
               k_expect[i].type, err.msg);
    }
    CHECK(loom_model_family_defaults("gemma3") == NULL && loom_model_family_defaults("falcon") == NULL);

    /* Gemma3TextConfig: a config without rope_theta, query_pre_attn_scalar and max_position_embeddings gets
     * 1e6 for the global layers, 256^-1/2 (not head_dim^-1/2) and 131072 */
    CHECKF(parse("{\"model_type\":\"gemma3_text\",\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":4,"
                 "\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":32,\"vocab_size\":512}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.rope_theta == 1000000.0f && c.rope_local_theta == 10000.0f && c.max_seq_len == 131072);
    CHECKF(c.query_scale == 1.0f / 16.0f, "query_scale %g", (double)c.query_scale);
    CHECK(c.sliding_pattern == 6 && c.sliding_window == 4096 && loom_model_config_layer_window(&c, 0) == 4096 &&
          loom_model_config_layer_window(&c, 5) == 0 && c.attn_softcap == 0 && c.final_softcap == 0);
    /* Gemma2Config: 8192 positions; the caps 50 and 30; query_pre_attn_scalar 256 */
    CHECK(parse("{\"model_type\":\"gemma2\",\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":4,"
                "\"num_attention_heads\":4,\"head_dim\":32,\"vocab_size\":512}",
                &c, &err) == LOOM_OK);
    CHECK(c.max_seq_len == 8192 && c.n_kv_heads == 4 && c.attn_softcap == 50.0f && c.final_softcap == 30.0f &&
          c.query_scale == 1.0f / 16.0f);
    /* MixtralConfig: default_theta 1e6, eps 1e-5, 8 experts top-2 */
    CHECK(parse("{\"model_type\":\"mixtral\",\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":2,"
                "\"num_attention_heads\":8,\"vocab_size\":512}",
                &c, &err) == LOOM_OK);
    CHECK(c.rope_theta == 1000000.0f && c.norm_eps == 1e-5f && c.n_experts == 8 && c.n_experts_per_tok == 2);
    /* Phi3Config: longrope without original_max_position_embeddings reads the class's 4096 */
    CHECKF(parse("{\"model_type\":\"phi3\",\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,"
                 "\"num_attention_heads\":8,\"vocab_size\":100,\"max_position_embeddings\":131072,"
                 "\"rope_scaling\":{\"type\":\"longrope\",\"short_factor\":[1,2,3,4],\"long_factor\":[5,6,7,8]}}",
                 &c, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(c.rope_orig_max_pos == 4096 && c.max_seq_len == 4096 && c.rope_ctx_capped && c.rope_factor == 32.0f);
    /* Qwen3Config: head_dim 128 even where hidden / heads is 8 */
    CHECK(parse("{\"model_type\":\"qwen3\",\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":2,"
                "\"num_attention_heads\":8,\"num_key_value_heads\":2,\"vocab_size\":512}",
                &c, &err) == LOOM_OK);
    CHECK(c.head_dim == 128 && c.rotary_dim == 128);
}

/* A number as the defaults table prints it: integers whole, others %g
 * with the exponent's leading zero dropped (1e-06 -> 1e-6). */
static void fmt_num(char *out, size_t cap, double v) {
    if (v == floor(v) && fabs(v) < 1e12) {
        snprintf(out, cap, "%.0f", v);
        return;
    }
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%g", v);
    char *e = strchr(tmp, 'e');
    if (e && (e[1] == '-' || e[1] == '+') && e[2] == '0') memmove(e + 2, e + 3, strlen(e + 3) + 1);
    snprintf(out, cap, "%s", tmp);
}

static void add(char *buf, size_t cap, const char *fmt, const char *a) {
    size_t n = strlen(buf);
    snprintf(buf + n, cap - n, fmt, a);
}

static void add_key(char *cell, size_t cap, const char *key, double v) {
    if (v == 0) return;
    char num[64], item[160];
    fmt_num(num, sizeof num, v);
    snprintf(item, sizeof item, "%s`%s` %s", cell[0] ? ", " : "", key, num);
    add(cell, cap, "%s", item);
}

/* docs/model-format.md's "Defaults by family" table, printed from the C table. */
static void defaults_markdown(char *buf, size_t cap) {
    buf[0] = 0;
    add(buf, cap, "%s",
        "| `model_type` | class | `num_key_value_heads` | `head_dim` | `max_position_embeddings` | `rms_norm_eps` | "
        "`rope_theta` | `hidden_act` | `tie_word_embeddings` | `attention_bias` | `sliding_window` | other keys |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    const loom_family_defaults_t *d;
    for (size_t i = 0; (d = loom_model_family_defaults_at(i)) != NULL; i++) {
        char num[64], other[1024] = "";
        int moe_q = d->moe_intermediate_size != 0;
        add_key(other, sizeof other, "query_pre_attn_scalar", d->query_pre_attn_scalar);
        add_key(other, sizeof other, "rope_local_base_freq", d->rope_local_base_freq);
        add_key(other, sizeof other, "sliding_window_pattern", d->sliding_window_pattern);
        add_key(other, sizeof other, "attn_logit_softcapping", d->attn_logit_softcapping);
        add_key(other, sizeof other, "final_logit_softcapping", d->final_logit_softcapping);
        add_key(other, sizeof other, moe_q ? "num_experts" : "num_local_experts", d->n_experts);
        add_key(other, sizeof other, "num_experts_per_tok", d->n_experts_per_tok);
        add_key(other, sizeof other, "moe_intermediate_size", d->moe_intermediate_size);
        add_key(other, sizeof other, "shared_expert_intermediate_size", d->shared_expert_intermediate_size);
        add_key(other, sizeof other, "decoder_sparse_step", d->decoder_sparse_step);
        add_key(other, sizeof other, "original_max_position_embeddings", d->original_max_position_embeddings);
        add_key(other, sizeof other, "swiglu_limit", d->swiglu_limit);
        add_key(other, sizeof other, "swiglu_alpha", d->swiglu_alpha);
        if (d->rope_scaling) {
            add(other, sizeof other, "%s", other[0] ? ", " : "");
            add(other, sizeof other, "`rope_scaling` `%s`", d->rope_scaling);
        }
        add(buf, cap, "| `%s` ", d->model_type);
        add(buf, cap, "| `%s` ", d->config_class);
        if (d->n_kv_heads) {
            fmt_num(num, sizeof num, d->n_kv_heads);
            add(buf, cap, "| %s ", num);
        } else {
            add(buf, cap, "| %s ", "`num_attention_heads`");
        }
        if (d->head_dim) {
            fmt_num(num, sizeof num, d->head_dim);
            add(buf, cap, "| %s ", num);
        } else {
            add(buf, cap, "| %s ", "hidden / heads");
        }
        fmt_num(num, sizeof num, d->max_position_embeddings);
        add(buf, cap, "| %s ", num);
        fmt_num(num, sizeof num, d->rms_norm_eps);
        add(buf, cap, "| %s ", num);
        fmt_num(num, sizeof num, d->rope_theta);
        add(buf, cap, "| %s ", num);
        add(buf, cap, "| `%s` ", d->hidden_act);
        add(buf, cap, "| %s ", d->tie_word_embeddings ? "true" : "false");
        add(buf, cap, "| %s ", d->attention_bias ? "true" : "false");
        if (d->sliding_window) {
            fmt_num(num, sizeof num, d->sliding_window);
            add(buf, cap, "| %s ", num);
        } else {
            add(buf, cap, "| %s ", "none");
        }
        add(buf, cap, other[0] ? "| %s |\n" : "|%s |\n", other);
    }
}

#define DOC_BEGIN "<!-- defaults-by-family: begin -->\n"
#define DOC_END "<!-- defaults-by-family: end -->"

/* The doc's table is the C table: regenerate it with
 * `test_model_config --print-defaults` when a default changes. */
static void test_defaults_doc(void) {
    static char want[16384];
    defaults_markdown(want, sizeof want);
    char path[1024];
    snprintf(path, sizeof path, "%s/docs/model-format.md", LOOM_SOURCE_DIR);
    char *doc = NULL;
    size_t len = 0;
    loom_err_t err = {0};
    REQUIRE(loom_read_file(path, &doc, &len, &err) == LOOM_OK);
    const char *b = strstr(doc, DOC_BEGIN), *e = b ? strstr(b, DOC_END) : NULL;
    CHECKF(b && e, "%s: no %s ... %s block", path, DOC_BEGIN, DOC_END);
    if (b && e) {
        b += strlen(DOC_BEGIN);
        int same = (size_t)(e - b) == strlen(want) && !memcmp(b, want, strlen(want));
        CHECKF(same, "%s's defaults table is stale; replace it with `test_model_config --print-defaults`:\n%s", path,
               want);
    }
    /* every family Loom runs has a row */
    CHECK(strstr(want, "`gemma3_text` | `Gemma3TextConfig` | 4 | 256 | 131072 | 1e-6 | 1000000 |") != NULL);
    free(doc);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--print-defaults")) {
        static char table[16384];
        defaults_markdown(table, sizeof table);
        fputs(table, stdout);
        return 0;
    }
    snprintf(g_tmp, sizeof g_tmp, "/tmp/loom_test_cfg_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 2;
    }
    RUN(test_stories260k);
    RUN(test_llama3);
    RUN(test_qwen2_and_defaults);
    RUN(test_generation_config);
    RUN(test_errors);
    RUN(test_families_and_refused_keys);
    RUN(test_quantization_config);
    RUN(test_moe);
    RUN(test_gpt_oss);
    RUN(test_family_defaults);
    RUN(test_defaults_doc);
    RUN(test_fuzz);
    nftw(g_tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
