/* The model families' tables (worker/arch/): every model_type the config
 * parser accepts has a family; the tensor-names table gives the loader's
 * names and the checkpoint check's verdicts; a family's needs follow the
 * config; and loom_model_load refuses a family a backend lacks a
 * capability for, naming each one (a CPU backend with capabilities taken
 * away stands in for a backend without them). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model_config.h"
#include "kernels/backend_impl.h"
#include "tests/test.h"
#include "worker/engine/arch.h"
#include "worker/model.h"

static const char *const k_types[] = {"llama",  "mistral",     "qwen2",   "qwen3",     "phi3",     "gemma2",
                                      "gemma3_text", "mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss",
                                      "deepseek_v3", "deepseek_v2"};

static loom_model_config_t parse(const char *json) {
    loom_model_config_t c;
    loom_err_t err = {0};
    memset(&c, 0, sizeof c);
    loom_status_t s = loom_model_config_parse(json, strlen(json), "config.json", &c, &err);
    if (s != LOOM_OK) {
        fprintf(stderr, "%s: %s\n", json, err.msg);
        exit(1); /* the tests below assume a parsed config */
    }
    return c;
}

#define DIMS "\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":4,\"num_attention_heads\":4,\"num_key_value_heads\":4," \
             "\"vocab_size\":100,\"max_position_embeddings\":4096"

static void test_registry(void) {
    for (size_t i = 0; i < sizeof k_types / sizeof k_types[0]; i++)
        CHECKF(loom_arch_find(k_types[i]) != NULL, "%s", k_types[i]);
    CHECK(loom_arch_find("gpt2") == NULL);
    CHECK(loom_arch_find("gemma2") == loom_arch_find("gemma3_text"));
    CHECK(loom_arch_find("mixtral") == loom_arch_find("llama"));
    int n = 0;
    for (int i = 0; i < loom_arch_count(); i++)
        for (const loom_arch_type_t *t = loom_arch_at(i)->types; t->model_type; t++) n++;
    CHECK(n == (int)(sizeof k_types / sizeof k_types[0])); /* each model_type served once */
}

static void test_names(void) {
    char buf[256];
    int lin = -1;
    loom_model_config_t q3 = parse("{\"model_type\":\"qwen3\"," DIMS "}");
    const loom_arch_t *a = loom_arch_find("qwen3");
    CHECK(!strcmp(loom_arch_tensor_name(a, &q3, 3, LOOM_TN_Q, -1, buf, sizeof buf), "model.layers.3.self_attn.q_proj"));
    CHECK(!strcmp(loom_arch_tensor_name(a, &q3, 0, LOOM_TN_Q_NORM, -1, buf, sizeof buf),
                  "model.layers.0.self_attn.q_norm.weight"));
    CHECK(!strcmp(loom_arch_tensor_name(a, &q3, -1, LOOM_TN_LM_HEAD, -1, buf, sizeof buf), "lm_head"));
    CHECK(loom_arch_tensor_name(a, &q3, 0, LOOM_TN_QKV, -1, buf, sizeof buf) == NULL); /* not fused */
    CHECK(loom_arch_tensor_used(a, &q3, "model.layers.0.self_attn.q_norm.weight", &lin) && lin == 0);
    CHECK(loom_arch_tensor_used(a, &q3, "model.layers.2.mlp.down_proj.qweight", &lin) && lin == 1);
    CHECK(loom_arch_tensor_used(a, &q3, "lm_head.scales", &lin) && lin == 1);
    CHECK(!loom_arch_tensor_used(a, &q3, "model.layers.2.mlp.down_proj.bias", NULL));
    CHECK(!loom_arch_tensor_used(a, &q3, "model.layers.0.self_attn.q_proj.bias", NULL));
    loom_model_config_t l = parse("{\"model_type\":\"llama\"," DIMS "}");
    CHECK(!loom_arch_tensor_used(loom_arch_find("llama"), &l, "model.layers.0.self_attn.q_norm.weight", NULL));

    loom_model_config_t mx = parse("{\"model_type\":\"mixtral\"," DIMS ",\"num_local_experts\":8,"
                                   "\"num_experts_per_tok\":2}");
    a = loom_arch_find("mixtral");
    CHECK(!strcmp(loom_arch_tensor_name(a, &mx, 1, LOOM_TN_EXPERT_UP, 7, buf, sizeof buf),
                  "model.layers.1.block_sparse_moe.experts.7.w3"));
    CHECK(loom_arch_tensor_used(a, &mx, "model.layers.1.block_sparse_moe.experts.7.w1.qweight", &lin) && lin == 1);
    CHECK(!loom_arch_tensor_used(a, &mx, "model.layers.1.block_sparse_moe.experts.8.w1.weight", NULL));
    CHECK(!loom_arch_tensor_used(a, &mx, "model.layers.1.block_sparse_moe.experts.x.w1.weight", NULL));
    CHECK(loom_arch_tensor_used(a, &mx, "model.layers.1.block_sparse_moe.gate.weight", &lin) && lin == 0);
    CHECK(!loom_arch_tensor_used(a, &mx, "model.layers.1.mlp.gate_proj.weight", NULL)); /* no dense MLP */

    /* DeepSeek: q_a/q_b or one q_proj by q_lora_rank, the router's correction bias under noaux_tc, and
     * kv_b_proj read as a float tensor (rebuilt at load, so `loom quantize` leaves it) */
    loom_model_config_t ds = parse("{\"model_type\":\"deepseek_v3\",\"num_hidden_layers\":4,"
                                   "\"first_k_dense_replace\":1}");
    a = loom_arch_find("deepseek_v3");
    CHECK(a && a == loom_arch_find("deepseek_v2"));
    CHECK(!strcmp(loom_arch_tensor_name(a, &ds, 2, LOOM_TN_Q_B, -1, buf, sizeof buf),
                  "model.layers.2.self_attn.q_b_proj.weight"));
    CHECK(loom_arch_tensor_name(a, &ds, 2, LOOM_TN_Q, -1, buf, sizeof buf) == NULL);
    CHECK(loom_arch_tensor_used(a, &ds, "model.layers.1.mlp.gate.e_score_correction_bias", &lin) && lin == 0);
    CHECK(!loom_arch_tensor_used(a, &ds, "model.layers.0.mlp.gate.e_score_correction_bias", NULL)); /* dense */
    CHECK(loom_arch_tensor_used(a, &ds, "model.layers.3.self_attn.kv_b_proj.weight", &lin) && lin == 0);
    CHECK(loom_arch_tensor_used(a, &ds, "model.layers.3.mlp.shared_experts.up_proj.weight", &lin) && lin == 1);

    loom_model_config_t g2 = parse("{\"model_type\":\"gemma2\"," DIMS ",\"head_dim\":16}");
    a = loom_arch_find("gemma2");
    CHECK(!strcmp(loom_arch_tensor_name(a, &g2, 0, LOOM_TN_FFN_NORM, -1, buf, sizeof buf),
                  "model.layers.0.pre_feedforward_layernorm.weight"));
    CHECK(!strcmp(loom_arch_tensor_name(loom_arch_find("llama"), &l, 0, LOOM_TN_FFN_NORM, -1, buf, sizeof buf),
                  "model.layers.0.post_attention_layernorm.weight"));
}

static void test_needs(void) {
    loom_shard_spec_t all = {.tp_size = 1, .layer_begin = 0, .layer_end = 4, .has_embed = 1, .has_head = 1};
    loom_shard_spec_t head_only = {.tp_size = 1, .layer_begin = 4, .layer_end = 4, .has_head = 1};
    loom_model_config_t m = parse("{\"model_type\":\"mistral\"," DIMS "}");
    CHECK(loom_arch_find("mistral")->needs(&m, &all) == 0); /* no sliding_window: nothing beyond Llama */
    m = parse("{\"model_type\":\"mistral\"," DIMS ",\"sliding_window\":512,\"hidden_act\":\"gelu\"}");
    CHECK(loom_arch_find("mistral")->needs(&m, &all) == (LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT));
    loom_model_config_t g2 = parse("{\"model_type\":\"gemma2\"," DIMS ",\"head_dim\":16,\"sliding_window\":512}");
    uint32_t n = loom_arch_find("gemma2")->needs(&g2, &all);
    CHECK(n & LOOM_CAP_ATTN_WINDOW && n & LOOM_CAP_ATTN_SOFTCAP && n & LOOM_CAP_LOGIT_SOFTCAP && n & LOOM_CAP_ACT);
    /* a stage with the head and no layers needs only the head's cap (and the activation, checked as before) */
    CHECK((loom_arch_find("gemma2")->needs(&g2, &head_only) & ~LOOM_CAP_ACT) == LOOM_CAP_LOGIT_SOFTCAP);
}

/* What `loom info` says of a model type (always / maybe) agrees with what
 * loading computes for a config of that type (needs): every config needs
 * `always`, and nothing outside always | maybe. */
static void test_info_agrees(void) {
    static const char *const extra[] = {
        "",
        "",
        "",
        "",
        "",
        ",\"head_dim\":16",
        ",\"head_dim\":16",
        ",\"num_local_experts\":4,\"num_experts_per_tok\":2",
        ",\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32",
        ",\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
        "\"shared_expert_intermediate_size\":64",
        ",\"head_dim\":16,\"num_local_experts\":4,\"num_experts_per_tok\":2",
        "",                             /* deepseek_v3: DeepseekV3Config's 576-wide latent rows */
        ",\"num_experts_per_tok\":2",  /* deepseek_v2 */
    };
    loom_shard_spec_t all = {.tp_size = 1, .layer_begin = 0, .layer_end = 4, .has_embed = 1, .has_head = 1};
    char json[512];
    for (size_t i = 0; i < sizeof k_types / sizeof k_types[0]; i++) {
        snprintf(json, sizeof json,
                 "{\"model_type\":\"%s\",\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":4,"
                 "\"num_attention_heads\":4,\"num_key_value_heads\":4,\"vocab_size\":100,\"max_position_embeddings\":131072%s}",
                 k_types[i], extra[i]);
        loom_model_config_t c = parse(json);
        const loom_arch_t *a = loom_arch_find(k_types[i]);
        const loom_arch_type_t *t = a->types;
        while (strcmp(t->model_type, k_types[i])) t++;
        uint32_t need = a->needs(&c, &all);
        CHECKF((need & t->always) == t->always && !(need & ~(t->always | t->maybe)),
               "%s: needs %#x, always %#x, maybe %#x", k_types[i], need, t->always, t->maybe);
    }
}

static void test_refusal(void) {
    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CPU, .n_threads = 1};
    loom_backend_t *be = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_backend_create(&bc, &be, &err) == LOOM_OK);
    CHECK(loom_backend_caps(be) == loom_backend_kind_caps(LOOM_DEVICE_CPU));
    CHECK(loom_backend_compiled(LOOM_DEVICE_CPU));
    loom_shard_spec_t spec = {.tp_size = 1, .layer_begin = 0, .layer_end = 4, .has_embed = 1, .has_head = 1};
    loom_model_options_t opt = {.kv_dtype = LOOM_DT_F8_E4M3};
    loom_model_t *m = NULL;
    loom_model_config_t l = parse("{\"model_type\":\"llama\"," DIMS "}");
    /* the CPU backend has no fp8 KV cache; refused before the checkpoint is looked at */
    CHECK(loom_model_load(be, &l, NULL, &spec, &opt, &m, &err) == LOOM_ERR_UNSUPPORTED && m == NULL);
    CHECKF(!strcmp(err.msg, "the cpu backend cannot run llama: it lacks an fp8 KV cache"), "%s", err.msg);

    /* the same backend without windows, soft caps and activations beyond SiLU (today's CUDA) */
    const loom_backend_ops_t *orig = be->ops;
    loom_backend_ops_t ops = *orig;
    ops.caps &= ~(uint32_t)(LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ATTN_SOFTCAP | LOOM_CAP_LOGIT_SOFTCAP | LOOM_CAP_ACT);
    be->ops = &ops;
    opt.kv_dtype = LOOM_DT_F32;
    loom_model_config_t g2 = parse("{\"model_type\":\"gemma2\"," DIMS ",\"head_dim\":16,\"sliding_window\":512}");
    CHECK(loom_model_load(be, &g2, NULL, &spec, &opt, &m, &err) == LOOM_ERR_UNSUPPORTED && m == NULL);
    CHECKF(!strcmp(err.msg, "the cpu backend cannot run gemma2: it lacks sliding-window attention (layer 0 has a "
                            "window of 512), attention logit soft capping (attn_logit_softcapping 50), final logit "
                            "soft capping (final_logit_softcapping 30), MLP activations other than SiLU "
                            "(hidden_act gelu_pytorch_tanh)"),
           "%s", err.msg);
    /* a later stage without the head does not need the final cap; one of the odd layers only: no window */
    loom_shard_spec_t odd = {.tp_size = 1, .layer_begin = 1, .layer_end = 2};
    CHECK(loom_model_load(be, &g2, NULL, &odd, &opt, &m, &err) == LOOM_ERR_UNSUPPORTED);
    CHECKF(strstr(err.msg, "attention logit soft capping") && !strstr(err.msg, "final logit") &&
               !strstr(err.msg, "sliding-window"),
           "%s", err.msg);
    ops.caps &= ~(uint32_t)(LOOM_CAP_ATTN_SINKS | LOOM_CAP_SWIGLU_CLAMP);
    loom_model_config_t oss = parse("{\"model_type\":\"gpt_oss\",\"hidden_size\":64,\"intermediate_size\":128,"
                                    "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"num_key_value_heads\":4,\"vocab_size\":100,"
                                    "\"max_position_embeddings\":131072,\"head_dim\":16,\"num_local_experts\":4,"
                                    "\"num_experts_per_tok\":2,\"sliding_window\":128}");
    CHECK(loom_model_load(be, &oss, NULL, &spec, &opt, &m, &err) == LOOM_ERR_UNSUPPORTED);
    CHECKF(strstr(err.msg, "cannot run gpt_oss: it lacks sliding-window attention") &&
               strstr(err.msg, "attention sinks (gpt_oss's attention)") &&
               strstr(err.msg, "the clamped SwiGLU (gpt_oss's experts)"),
           "%s", err.msg);
    /* CUDA's wide kernel stops at 768: DeepSeek-V3's 576 loads past the capability check, a latent of
     * 1024 + 64 is refused by name */
    ops.caps &= ~(uint32_t)LOOM_CAP_ATTN_HUGE;
    loom_model_config_t dsh = parse("{\"model_type\":\"deepseek_v3\",\"kv_lora_rank\":1024}");
    CHECK(loom_model_load(be, &dsh, NULL, &spec, &opt, &m, &err) == LOOM_ERR_UNSUPPORTED);
    CHECKF(!strcmp(err.msg, "the cpu backend cannot run deepseek_v3: it lacks attention heads wider than 768 "
                            "(head_dim 1088)"),
           "%s", err.msg);
    /* DeepSeek-V3's latent rows are 576 wide: a backend whose attention stops at 256 refuses it */
    ops.caps &= ~(uint32_t)LOOM_CAP_ATTN_WIDE;
    loom_model_config_t ds = parse("{\"model_type\":\"deepseek_v3\"}");
    CHECK(loom_model_load(be, &ds, NULL, &spec, &opt, &m, &err) == LOOM_ERR_UNSUPPORTED);
    CHECKF(!strcmp(err.msg, "the cpu backend cannot run deepseek_v3: it lacks attention heads wider than 256 "
                            "(head_dim 576)"),
           "%s", err.msg);
    be->ops = orig;
    loom_backend_destroy(&be);
}

int main(void) {
    RUN(test_registry);
    RUN(test_names);
    RUN(test_needs);
    RUN(test_info_agrees);
    RUN(test_refusal);
    return test_summary();
}
