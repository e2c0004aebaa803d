/* Tests for LoRA adapters: the mixed-adapter CPU delta against its per-row
 * reference on odd shapes, and PEFT adapter directories built here (scaling,
 * rsLoRA, rank/alpha patterns, fused Phi-3 modules, pipeline layer ranges,
 * the content digest, tensor-parallel slices) and every refusal, each
 * naming the key, module or tensor. */
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/lora.h"
#include "common/util.h"
#include "kernels/cpu/lora.h"
#include "tests/test.h"

static char g_tmp[256];
static loom_backend_t *g_be; /* the CPU backend, 2 threads: loom_op_lora */
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;

static float frand(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (float)((double)(g_rng >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
}

/* ---- the CPU kernel ------------------------------------------------------ */

static void check_sgmv(int n, int64_t in, int64_t out, int n_slots, const int *ranks, const int32_t *row_slot) {
    loom_lora_op_slot_t slots[8];
    float *mats[16];
    int max_r = 0;
    for (int s = 0; s < n_slots; s++) {
        float *a = loom_xmalloc((size_t)(ranks[s] * in + 1) * sizeof(float));
        float *bt = loom_xmalloc((size_t)(ranks[s] * out + 1) * sizeof(float));
        for (int64_t i = 0; i < ranks[s] * in; i++) a[i] = frand();
        for (int64_t i = 0; i < ranks[s] * out; i++) bt[i] = frand();
        slots[s] = (loom_lora_op_slot_t){.a = a, .bt = bt, .r = ranks[s], .scale = 0.5f + (float)s};
        mats[2 * s] = a, mats[2 * s + 1] = bt;
        if (ranks[s] > max_r) max_r = ranks[s];
    }
    int64_t ldx = in + 3, ldy = out + 5;
    float *x = loom_xmalloc((size_t)(n * ldx) * sizeof(float));
    float *y = loom_xmalloc((size_t)(n * ldy) * sizeof(float));
    float *yr = loom_xmalloc((size_t)(n * ldy) * sizeof(float));
    float *yo = loom_xmalloc((size_t)(n * ldy) * sizeof(float));
    for (int64_t i = 0; i < n * ldx; i++) x[i] = frand();
    for (int64_t i = 0; i < n * ldy; i++) y[i] = yr[i] = yo[i] = frand();
    float *ws = loom_xmalloc(loom_cpu_lora_workspace(n, in, max_r) * sizeof(float));
    loom_cpu_lora_sgmv(y, ldy, x, ldx, n, in, out, row_slot, slots, n_slots, ws);
    loom_cpu_lora_ref(yr, ldy, x, ldx, n, in, out, row_slot, slots, n_slots);
    /* the backend's op: the pool's two passes below 64 rows, the sgemm groups above */
    loom_op_lora(g_be, yo, ldy, x, ldx, n, in, out, row_slot, slots, n_slots, max_r > 0 ? max_r : 1);
    const float *got[2] = {y, yo};
    for (int v = 0; v < 2; v++) {
        double worst = 0;
        int bad = 0;
        for (int i = 0; i < n; i++)
            for (int64_t o = 0; o < ldy; o++) {
                float a = got[v][i * ldy + o], b = yr[i * ldy + o];
                double d = fabs((double)a - b);
                if (d > worst) worst = d;
                if (d > 1e-4 + 1e-4 * fabs(b)) {
                    if (bad++ < 3) fprintf(stderr, "  row %d col %lld: %g vs %g\n", i, (long long)o, a, b);
                }
            }
        CHECKF(bad == 0, "%s: n %d in %lld out %lld: %d mismatches, worst %g", v ? "loom_op_lora" : "sgmv", n,
               (long long)in, (long long)out, bad, worst);
    }
    for (int s = 0; s < 2 * n_slots; s++) free(mats[s]);
    free(x), free(y), free(yr), free(yo), free(ws);
}

static void test_sgmv(void) {
    /* rows of three adapters interleaved with base rows (-1) and a slot of
     * rank 0; then one adapter on contiguous rows (the sgemm path in place),
     * then scattered (gathered) */
    int32_t mixed[13] = {0, -1, 1, 1, 2, 0, -1, 2, 2, 1, 0, 3, 2};
    int ranks4[4] = {1, 5, 16, 0};
    check_sgmv(13, 37, 29, 4, ranks4, mixed);
    int32_t one[9] = {-1, 0, 0, 0, 0, 0, 0, -1, -1};
    int r16[1] = {16};
    check_sgmv(9, 64, 172, 1, r16, one);
    int32_t scattered[11] = {0, -1, 0, -1, 0, 0, -1, 0, 1, 1, 0};
    int r2[2] = {8, 3};
    check_sgmv(11, 33, 65, 2, r2, scattered);
    int32_t single[1] = {0};
    check_sgmv(1, 7, 5, 1, r16, single);
    /* a decode batch of 8 adapters, and a prefill-sized one */
    int32_t dec[32], pre[70];
    int r8[8] = {16, 8, 16, 4, 16, 1, 16, 2};
    for (int i = 0; i < 32; i++) dec[i] = i % 9 - 1;
    check_sgmv(32, 203, 257, 8, r8, dec);
    for (int i = 0; i < 70; i++) pre[i] = i < 40 ? 0 : i % 3 - 1;
    check_sgmv(70, 96, 131, 2, r2, pre);
}

/* ---- adapter directories -------------------------------------------------- */

typedef struct tensor {
    char name[160];
    int64_t rows, cols;
    float *data;
} tensor_t;

static void write_adapter(const char *dir, const char *config, const tensor_t *t, int n) {
    mkdir(dir, 0755);
    char p[512];
    loom_path_join(p, sizeof p, dir, "adapter_config.json");
    FILE *f = fopen(p, "w");
    fputs(config, f);
    fclose(f);
    loom_sbuf_t h = {0};
    loom_sbuf_str(&h, "{");
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t nb = (size_t)(t[i].rows * t[i].cols) * 4;
        loom_sbuf_printf(&h, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%lld,%lld],\"data_offsets\":[%zu,%zu]}",
                         i ? "," : "", t[i].name, (long long)t[i].rows, (long long)t[i].cols, off, off + nb);
        off += nb;
    }
    loom_sbuf_str(&h, "}");
    while ((8 + h.len) % 8) loom_sbuf_str(&h, " ");
    loom_path_join(p, sizeof p, dir, "adapter_model.safetensors");
    f = fopen(p, "wb");
    uint64_t hl = h.len;
    fwrite(&hl, 8, 1, f);
    fwrite(h.p, 1, h.len, f);
    for (int i = 0; i < n; i++) fwrite(t[i].data, 4, (size_t)(t[i].rows * t[i].cols), f);
    fclose(f);
    loom_sbuf_free(&h);
}

/* stories260K's shapes: dim 64, 8 heads / 4 kv heads of 8, hidden 172, 5 layers */
static loom_model_config_t g_cfg;

static int mk_module(tensor_t *t, int layer, const char *module, int r, int64_t in, int64_t out) {
    snprintf(t[0].name, sizeof t[0].name, "base_model.model.model.layers.%d.%s.lora_A.weight", layer, module);
    t[0].rows = r, t[0].cols = in;
    snprintf(t[1].name, sizeof t[1].name, "base_model.model.model.layers.%d.%s.lora_B.weight", layer, module);
    t[1].rows = out, t[1].cols = r;
    for (int k = 0; k < 2; k++) {
        t[k].data = loom_xmalloc((size_t)(t[k].rows * t[k].cols) * sizeof(float));
        for (int64_t i = 0; i < t[k].rows * t[k].cols; i++) t[k].data[i] = frand();
    }
    return 2;
}

static void free_tensors(tensor_t *t, int n) {
    for (int i = 0; i < n; i++) free(t[i].data);
}

/* Every projection of every layer of stories260K at rank R (RANK_OF may
 * override per module name) */
static int all_modules(tensor_t *t, int r, int q_rank) {
    int n = 0;
    for (int l = 0; l < 5; l++) {
        n += mk_module(t + n, l, "self_attn.q_proj", q_rank, 64, 64);
        n += mk_module(t + n, l, "self_attn.k_proj", r, 64, 32);
        n += mk_module(t + n, l, "self_attn.v_proj", r, 64, 32);
        n += mk_module(t + n, l, "self_attn.o_proj", r, 64, 64);
        n += mk_module(t + n, l, "mlp.gate_proj", r, 64, 172);
        n += mk_module(t + n, l, "mlp.up_proj", r, 64, 172);
        n += mk_module(t + n, l, "mlp.down_proj", r, 172, 64);
    }
    return n;
}

static void adapter_dir(char *out, size_t n, const char *name) {
    loom_path_join(out, n, g_tmp, name);
}

static void test_load_all_linear(void) {
    tensor_t t[80];
    int n = all_modules(t, 8, 8);
    char dir[512];
    adapter_dir(dir, sizeof dir, "all");
    write_adapter(dir,
                  "{\"peft_type\":\"LORA\",\"r\":8,\"lora_alpha\":16,\"target_modules\":[\"q_proj\",\"k_proj\","
                  "\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\",\"down_proj\"],\"bias\":\"none\","
                  "\"use_dora\":false,\"modules_to_save\":null,\"fan_in_fan_out\":false,\"rank_pattern\":{},"
                  "\"alpha_pattern\":{},\"lora_dropout\":0.05}",
                  t, n);
    loom_lora_adapter_t *a = NULL, *b = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_lora_load(dir, &g_cfg, 16, 0, 0, &a, &err) == LOOM_OK);
    CHECK(a->n_modules == 35 && a->max_r == 8);
    const loom_lora_module_t *m = loom_lora_module(a, 3, LOOM_LORA_DOWN);
    REQUIRE(m != NULL);
    CHECK(m->r == 8 && m->in == 172 && m->out == 64 && fabsf(m->scale - 2.0f) < 1e-7f);
    /* layer 3's down_proj is tensors 3*14 + 12, 13 */
    CHECK(memcmp(m->a, t[3 * 14 + 12].data, 8 * 172 * sizeof(float)) == 0);
    CHECK(memcmp(m->b, t[3 * 14 + 13].data, 64 * 8 * sizeof(float)) == 0);
    /* the digest is of the content: equal on reload, another after one value changes */
    REQUIRE(loom_lora_load(dir, &g_cfg, 16, 2, 4, &b, &err) == LOOM_OK);
    CHECK(memcmp(a->digest, b->digest, 32) == 0);
    CHECK(strlen(a->digest_hex) == 64);
    CHECK(b->n_modules == 14 && loom_lora_module(b, 1, LOOM_LORA_Q) == NULL && loom_lora_module(b, 3, LOOM_LORA_Q));
    loom_lora_destroy(&b);
    t[20].data[5] += 1e-3f;
    write_adapter(dir, "{\"r\":8,\"lora_alpha\":16,\"target_modules\":\"all-linear\"}", t, n);
    REQUIRE(loom_lora_load(dir, &g_cfg, 16, 0, 0, &b, &err) == LOOM_OK);
    CHECK(memcmp(a->digest, b->digest, 32) != 0);
    /* tensor-parallel slices: rows of B, columns of A */
    float as[8 * 10], bs[4 * 8];
    loom_lora_slice(m, 60, 4, 100, 10, as, bs);
    CHECK(as[0] == m->a[100] && as[8 * 10 - 1] == m->a[7 * 172 + 109]);
    CHECK(bs[0] == m->b[60 * 8] && bs[31] == m->b[63 * 8 + 7]);
    loom_lora_destroy(&a);
    loom_lora_destroy(&b);
    loom_lora_destroy(&b); /* twice is safe */
    free_tensors(t, n);
}

static void test_rslora_patterns(void) {
    tensor_t t[80];
    int n = all_modules(t, 8, 4);
    char dir[512];
    adapter_dir(dir, sizeof dir, "patterns");
    write_adapter(dir,
                  "{\"r\":8,\"lora_alpha\":16,\"use_rslora\":true,\"target_modules\":\"all-linear\","
                  "\"rank_pattern\":{\"q_proj\":4},\"alpha_pattern\":{\"layers\\\\.1\\\\.self_attn\\\\.v_proj\":32}}",
                  t, n);
    loom_lora_adapter_t *a = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_lora_load(dir, &g_cfg, 16, 0, 0, &a, &err) == LOOM_OK);
    const loom_lora_module_t *q = loom_lora_module(a, 0, LOOM_LORA_Q), *v1 = loom_lora_module(a, 1, LOOM_LORA_V),
                             *v2 = loom_lora_module(a, 2, LOOM_LORA_V);
    REQUIRE(q && v1 && v2);
    CHECK(q->r == 4 && fabsf(q->scale - 16.0f / 2.0f) < 1e-6f);          /* 16 / sqrt(4) */
    CHECK(v1->r == 8 && fabsf(v1->scale - 32.0f / sqrtf(8.0f)) < 1e-5f); /* alpha_pattern, rsLoRA */
    CHECK(fabsf(v2->scale - 16.0f / sqrtf(8.0f)) < 1e-5f);
    loom_lora_destroy(&a);
    /* a rank_pattern the tensors do not follow: the shape is named */
    write_adapter(dir, "{\"r\":8,\"lora_alpha\":16,\"target_modules\":\"all-linear\"}", t, n);
    CHECK(loom_lora_load(dir, &g_cfg, 16, 0, 0, &a, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "self_attn.q_proj.lora_A.weight") && strstr(err.msg, "[8, 64]"), "%s", err.msg);
    free_tensors(t, n);
}

static void expect_refusal_cfg(const loom_model_config_t *cfg, const char *name, const char *config, tensor_t *t,
                               int n, int max_rank, const char *want) {
    char dir[512];
    adapter_dir(dir, sizeof dir, name);
    write_adapter(dir, config, t, n);
    loom_lora_adapter_t *a = NULL;
    loom_err_t err = {0};
    loom_status_t s = loom_lora_load(dir, cfg, max_rank, 0, 0, &a, &err);
    CHECKF(s < 0 && a == NULL, "%s: loaded", name);
    CHECKF(strstr(err.msg, want) != NULL, "%s: \"%s\" lacks \"%s\"", name, err.msg, want);
}

static void expect_refusal(const char *name, const char *config, tensor_t *t, int n, int max_rank, const char *want) {
    expect_refusal_cfg(&g_cfg, name, config, t, n, max_rank, want);
}

static void test_refusals(void) {
    tensor_t t[4];
    int n = mk_module(t, 0, "self_attn.q_proj", 8, 64, 64);
    const char *ok_tail = "\"target_modules\":[\"q_proj\"]}";
    char cfg[512];
#define CFG(extra) (snprintf(cfg, sizeof cfg, "{\"r\":8,\"lora_alpha\":8,%s,%s", extra, ok_tail), cfg)
    expect_refusal("dora", CFG("\"use_dora\":true"), t, n, 16, "use_dora");
    expect_refusal("mts", CFG("\"modules_to_save\":[\"lm_head\"]"), t, n, 16, "modules_to_save");
    expect_refusal("bias", CFG("\"bias\":\"lora_only\""), t, n, 16, "bias \"lora_only\"");
    expect_refusal("fifo", CFG("\"fan_in_fan_out\":true"), t, n, 16, "fan_in_fan_out");
    expect_refusal("repl", CFG("\"layer_replication\":[[0,2]]"), t, n, 16, "layer_replication");
    expect_refusal("peft", CFG("\"peft_type\":\"IA3\""), t, n, 16, "peft_type IA3");
    expect_refusal("target", "{\"r\":8,\"target_modules\":[\"q_proj\",\"c_attn\"]}", t, n, 16,
                   "target module 'c_attn' is not a module of this llama model");
    expect_refusal("untargeted", "{\"r\":8,\"target_modules\":[\"v_proj\"]}", t, n, 16,
                   "target_modules does not name");
    expect_refusal("rank", "{\"r\":128,\"target_modules\":[\"q_proj\"]}", t, n, 64,
                   "rank 128 is greater than max_lora_rank 64");
    expect_refusal("json", "{\"r\":8,", t, n, 16, "not a JSON object");
    expect_refusal("empty", "{\"r\":8}", t, 0, 16, "holds no LoRA matrices");
    /* wrong shape, named */
    tensor_t w[2];
    mk_module(w, 0, "self_attn.k_proj", 8, 64, 64); /* k_proj is 32 rows */
    expect_refusal("shape", "{\"r\":8}", w, 2, 16, "expected [32, 8]");
    free_tensors(w, 2);
    /* a tensor that is not an adapter matrix; a module the model lacks; a B without its A */
    mk_module(w, 0, "self_attn.qkv_proj", 8, 64, 128);
    expect_refusal("fused", "{\"r\":8}", w, 2, 16, "self_attn.qkv_proj, which this llama model does not have");
    expect_refusal("lonely", "{\"r\":8}", t + 1, 1, 16, "but no");
    snprintf(w[0].name, sizeof w[0].name, "base_model.model.lm_head.lora_A.weight");
    expect_refusal("lmhead", "{\"r\":8}", w, 2, 16, "is not a LoRA A or B matrix");
    free_tensors(w, 2);
    /* no directory; no config; truncated safetensors */
    loom_lora_adapter_t *a = NULL;
    loom_err_t err = {0};
    CHECK(loom_lora_load("/nonexistent/adapter", &g_cfg, 16, 0, 0, &a, &err) == LOOM_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "does not exist"), "%s", err.msg);
    char dir[512], p[600];
    adapter_dir(dir, sizeof dir, "trunc");
    write_adapter(dir, "{\"r\":8}", t, n);
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    struct stat sb;
    stat(p, &sb);
    CHECK(truncate(p, sb.st_size - 100) == 0);
    CHECK(loom_lora_load(dir, &g_cfg, 16, 0, 0, &a, &err) < 0 && a == NULL);
    CHECKF(strstr(err.msg, "adapter_model.safetensors"), "%s", err.msg);
    unlink(p);
    CHECK(loom_lora_load(dir, &g_cfg, 16, 0, 0, &a, &err) == LOOM_ERR_NOT_FOUND);
    free_tensors(t, n);
    CHECK(loom_lora_rank_allowed(16) && loom_lora_rank_allowed(320) && !loom_lora_rank_allowed(24));
#undef CFG
}

static const char k_phi3[] =
    "{\"model_type\":\"phi3\",\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":2,"
    "\"num_attention_heads\":4,\"num_key_value_heads\":2,\"vocab_size\":512,\"max_position_embeddings\":256,"
    "\"rms_norm_eps\":1e-5,\"rope_theta\":10000.0}";

static void test_fused_phi3(void) {
    loom_model_config_t cfg;
    loom_err_t err = {0};
    REQUIRE(loom_model_config_parse(k_phi3, strlen(k_phi3), "config.json", &cfg, &err) == LOOM_OK);
    REQUIRE(cfg.fused_qkv);
    tensor_t t[4];
    int n = mk_module(t, 1, "self_attn.qkv_proj", 4, 64, 64 + 2 * 32);
    n += mk_module(t + n, 0, "mlp.gate_up_proj", 4, 64, 2 * 96);
    char dir[512];
    adapter_dir(dir, sizeof dir, "phi3");
    write_adapter(dir, "{\"r\":4,\"lora_alpha\":8,\"target_modules\":[\"qkv_proj\",\"gate_up_proj\"]}", t, n);
    loom_lora_adapter_t *a = NULL;
    REQUIRE(loom_lora_load(dir, &cfg, 16, 0, 0, &a, &err) == LOOM_OK);
    const loom_lora_module_t *q = loom_lora_module(a, 1, LOOM_LORA_Q), *k = loom_lora_module(a, 1, LOOM_LORA_K),
                             *v = loom_lora_module(a, 1, LOOM_LORA_V), *up = loom_lora_module(a, 0, LOOM_LORA_UP);
    REQUIRE(q && k && v && up);
    CHECK(q->out == 64 && k->out == 32 && v->out == 32 && up->out == 96);
    /* each part keeps the whole A and its rows of B */
    CHECK(memcmp(v->a, t[0].data, 4 * 64 * sizeof(float)) == 0);
    CHECK(memcmp(v->b, t[1].data + (64 + 32) * 4, 32 * 4 * sizeof(float)) == 0);
    CHECK(memcmp(up->b, t[3].data + 96 * 4, 96 * 4 * sizeof(float)) == 0);
    loom_lora_destroy(&a);
    /* q_proj alone is not a module of a fused checkpoint */
    expect_refusal_cfg(&cfg, "phi3q", "{\"r\":4,\"target_modules\":[\"q_proj\"]}", t, n, 16,
                       "'q_proj' is not a module of this phi3 model");
    free_tensors(t, n);
}

static const char k_qwen3_moe[] =
    "{\"model_type\":\"qwen3_moe\",\"hidden_size\":64,\"intermediate_size\":96,\"moe_intermediate_size\":32,"
    "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":16,"
    "\"vocab_size\":512,\"max_position_embeddings\":256,\"rms_norm_eps\":1e-5,\"rope_theta\":10000.0,"
    "\"num_experts\":4,\"num_experts_per_tok\":2}";

static void test_moe(void) {
    loom_model_config_t cfg;
    loom_err_t err = {0};
    REQUIRE(loom_model_config_parse(k_qwen3_moe, strlen(k_qwen3_moe), "config.json", &cfg, &err) == LOOM_OK);
    tensor_t t[4];
    int n = mk_module(t, 0, "self_attn.q_proj", 4, 64, 64);
    n += mk_module(t + n, 1, "mlp.experts.2.gate_proj", 4, 64, 32);
    char dir[512];
    adapter_dir(dir, sizeof dir, "moe");
    write_adapter(dir, "{\"r\":4,\"target_modules\":[\"q_proj\",\"gate_proj\"]}", t, n);
    loom_lora_adapter_t *a = NULL;
    CHECK(loom_lora_load(dir, &cfg, 16, 0, 0, &a, &err) == LOOM_ERR_UNSUPPORTED);
    CHECKF(strstr(err.msg, "'gate_proj' is in the Mixture-of-Experts layers") &&
               strstr(err.msg, "experts are not supported"),
           "%s", err.msg);
    /* with no target_modules the tensor itself is refused, named */
    expect_refusal_cfg(&cfg, "moe_tensor", "{\"r\":4}", t, n, 16, "mlp.experts.2.gate_proj of a Mixture-of-Experts");
    /* attention of an MoE model is fine */
    write_adapter(dir, "{\"r\":4,\"target_modules\":[\"q_proj\"]}", t, 2);
    REQUIRE(loom_lora_load(dir, &cfg, 16, 0, 0, &a, &err) == LOOM_OK);
    CHECK(loom_lora_module(a, 0, LOOM_LORA_Q) && a->n_modules == 1);
    loom_lora_destroy(&a);
    expect_refusal_cfg(&cfg, "moe_t", "{\"r\":4,\"target_modules\":[\"down_proj\"]}", t, 2, 16,
                       "Mixture-of-Experts");
    free_tensors(t, n);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/loom_test_lora_XXXXXX");
    if (!mkdtemp(g_tmp)) return 2;
    loom_err_t err = {0};
    if (loom_model_config_load(LOOM_MODELS_DIR_DEFAULT "/stories260K", &g_cfg, &err) != LOOM_OK) {
        fprintf(stderr, "stories260K: %s\n", err.msg);
        return 2;
    }
    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .n_threads = 2, .weight_dtype = LOOM_DT_F32};
    if (loom_backend_create(&bc, &g_be, &err) != LOOM_OK) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        return 2;
    }
    RUN(test_sgmv);
    RUN(test_load_all_linear);
    RUN(test_rslora_patterns);
    RUN(test_refusals);
    RUN(test_fused_phi3);
    RUN(test_moe);
    nftw(g_tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    loom_backend_destroy(&g_be);
    return test_summary();
}
