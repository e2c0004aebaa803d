/* DeepSeek-V2/V3's pieces against the float64 reference (tests/reference/deepseek_ref.py --pieces): the
 * config keys and their defaults, the refusals, the DeepSeekMoE router, yarn with mscale, FP8 block
 * dequantization, and one MLA layer both ways (decompressed prefill, absorbed decode over the latent cache).
 *
 * And the MTP module as a draft (loom run's --speculative-method mtp): its logits against the reference's
 * mtp_forward, and greedy ids equal with and without it.
 *
 *   test_deepseek --python /usr/bin/python3 --ref tests/reference/deepseek_ref.py --work DIR */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fp8.h"
#include "common/model_config.h"
#include "common/model_config_deepseek.h"
#include "common/safetensors.h"
#include "tests/test.h"
#include "worker/local.h"
#include "worker/mla.h"
#include "worker/model.h"
#include "worker/moe_ds.h"
#include "worker/mtp_rows.h"

static const char *g_python = "/usr/bin/python3", *g_ref = NULL, *g_work = "/tmp";

/* ---------------------------------------------------------------- the reference's pieces */

typedef struct {
    char name[64];
    long n;
    double *v;
} piece_t;

static piece_t g_pieces[256];
static int g_n_pieces;

static int load_pieces(void) {
    char path[1024], cmd[4096];
    snprintf(path, sizeof path, "%s/deepseek_pieces.txt", g_work);
    snprintf(cmd, sizeof cmd, "'%s' '%s' --pieces '%s'", g_python, g_ref, path);
    if (system(cmd) != 0) {
        fprintf(stderr, "the reference failed: %s\n", cmd);
        return 0;
    }
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    while (g_n_pieces < (int)(sizeof g_pieces / sizeof g_pieces[0])) {
        piece_t *p = &g_pieces[g_n_pieces];
        if (fscanf(f, "%63s %ld", p->name, &p->n) != 2) break;
        p->v = malloc((size_t)(p->n > 0 ? p->n : 1) * sizeof *p->v);
        for (long i = 0; i < p->n; i++)
            if (fscanf(f, "%lf", &p->v[i]) != 1) {
                fclose(f);
                return 0;
            }
        g_n_pieces++;
    }
    fclose(f);
    return g_n_pieces > 0;
}

static const piece_t *piece(const char *name) {
    for (int i = 0; i < g_n_pieces; i++)
        if (!strcmp(g_pieces[i].name, name)) return &g_pieces[i];
    fprintf(stderr, "no piece '%s'\n", name);
    return NULL;
}

static float *piece_f32(const char *name, long want) {
    const piece_t *p = piece(name);
    if (!p || (want >= 0 && p->n != want)) return NULL;
    float *out = malloc((size_t)(p->n > 0 ? p->n : 1) * sizeof *out);
    for (long i = 0; i < p->n; i++) out[i] = (float)p->v[i];
    return out;
}

/* ---------------------------------------------------------------- config */

static int parse(const char *json, loom_model_config_t *c, loom_err_t *err) {
    return loom_model_config_parse(json, strlen(json), "config.json", c, err) == LOOM_OK;
}

static void test_config_v3_defaults(void) {
    loom_model_config_t c;
    loom_err_t err = {0};
    REQUIRE(parse("{\"model_type\":\"deepseek_v3\"}", &c, &err));
    CHECK(c.deepseek == 3 && c.dim == 7168 && c.hidden_dim == 18432 && c.n_layers == 61 && c.n_heads == 128);
    CHECK(c.vocab_size == 129280 && c.max_seq_len == 4096 && c.bos_id == 0 && c.n_eos == 1 && c.eos_ids[0] == 1);
    CHECK(c.q_lora_rank == 1536 && c.kv_lora_rank == 512 && c.qk_nope_head_dim == 128 && c.qk_rope_head_dim == 64);
    CHECK(c.v_head_dim == 128 && c.head_dim == 576 && c.rotary_dim == 64 && c.rope_interleave == 1);
    CHECK(c.n_kv_heads == 1);
    CHECK(c.n_experts == 256 && c.n_experts_per_tok == 8 && c.n_shared_experts == 1 && c.moe_hidden_dim == 2048);
    CHECK(c.first_k_dense_replace == 3 && c.n_group == 8 && c.topk_group == 4 && c.norm_topk_prob == 1);
    CHECK(c.topk_method == LOOM_DS_TOPK_NOAUX_TC && c.scoring_sigmoid == 1 && c.routed_scaling_factor == 2.5f);
    CHECK(c.rope_scaling == LOOM_ROPE_NONE && fabsf(c.attn_scale - 0.0721687836f) < 1e-7f);
    CHECK(c.rope_theta == 10000.0f && c.norm_eps == 1e-6f && !c.tie_embeddings && c.n_nextn_layers == 0);
    CHECK(!loom_model_config_layer_moe(&c, 2) && loom_model_config_layer_moe(&c, 3) && loom_model_config_layer_moe(&c, 60));
    /* the latent cache: 61 layers x (512 + 64) values x 2 bytes */
    size_t b = loom_deepseek_kv_bytes_per_token(&c, 2);
    CHECKF(b == 70272, "%zu bytes per token", b);
    /* decompressed (--disable-mla): 61 layers x 128 heads x (192 + 128) values x 2 bytes, 71x the latent;
     * int8: a byte a value and a float scale per head for K and for V */
    b = loom_deepseek_mha_kv_bytes_per_token(&c, 2, 0);
    CHECKF(b == 4997120, "%zu bytes per token decompressed", b);
    b = loom_deepseek_mha_kv_bytes_per_token(&c, 1, 1);
    CHECKF(b == (size_t)61 * 128 * (320 + 8), "%zu bytes per token decompressed in int8", b);
}

/* LOOM_MLA_DISABLE, vLLM's VLLM_MLA_DISABLE: a nonzero integer or true on; unset, empty, 0, false or a word
 * off. */
static void test_mla_disable_env(void) {
    static const struct {
        const char *v;
        int on;
    } cases[] = {{NULL, 0}, {"", 0}, {"0", 0}, {"false", 0}, {"1", 1}, {"true", 1}, {"TRUE", 1}, {"2", 1}, {"yes", 0}};
    const char *old = getenv("LOOM_MLA_DISABLE");
    char *keep = old ? strdup(old) : NULL;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].v) setenv("LOOM_MLA_DISABLE", cases[i].v, 1);
        else unsetenv("LOOM_MLA_DISABLE");
        CHECKF(loom_mla_disable_env() == cases[i].on, "LOOM_MLA_DISABLE=%s", cases[i].v ? cases[i].v : "(unset)");
    }
    if (keep) setenv("LOOM_MLA_DISABLE", keep, 1);
    else unsetenv("LOOM_MLA_DISABLE");
    free(keep);
}

/* DeepSeek-V3's released config.json (the keys that matter here) */
#define V3_REAL                                                                                                  \
    "{\"model_type\":\"deepseek_v3\",\"hidden_size\":7168,\"num_hidden_layers\":61,\"max_position_embeddings\":" \
    "163840,\"num_nextn_predict_layers\":1,\"topk_method\":\"noaux_tc\",\"scoring_func\":\"sigmoid\","           \
    "\"n_group\":8,\"topk_group\":4,\"routed_scaling_factor\":2.5,\"norm_topk_prob\":true,\"q_lora_rank\":1536,"  \
    "\"rope_scaling\":{\"beta_fast\":32,\"beta_slow\":1,\"factor\":40,\"mscale\":1.0,\"mscale_all_dim\":1.0,"     \
    "\"original_max_position_embeddings\":4096,\"type\":\"yarn\"},\"quantization_config\":{\"activation_scheme\":" \
    "\"dynamic\",\"fmt\":\"e4m3\",\"quant_method\":\"fp8\",\"weight_block_size\":[128,128]},"                     \
    "\"torch_dtype\":\"bfloat16\",\"eos_token_id\":1,\"bos_token_id\":0}"

static void test_config_v3_real(void) {
    loom_model_config_t c;
    loom_err_t err = {0};
    REQUIRE(parse(V3_REAL, &c, &err));
    CHECK(c.rope_scaling == LOOM_ROPE_YARN && c.rope_factor == 40.0f && c.rope_orig_max_pos == 4096);
    CHECK(c.rope_mscale == 1.0f && c.rope_mscale_all_dim == 1.0f && c.rope_attn_factor == 1.0f);
    /* 192^-0.5 x (0.1 ln 40 + 1)^2 = 0.0721688 x 1.873855 */
    CHECKF(fabs(c.attn_scale - 0.13523378) < 1e-7, "attn_scale %.9g", (double)c.attn_scale);
    CHECK(c.ckpt_quant == LOOM_CKPT_FP8 && c.ckpt_block[0] == 128 && c.ckpt_block[1] == 128);
    CHECK(c.n_nextn_layers == 1 && c.max_seq_len == 163840 && c.torch_dtype == LOOM_DT_BF16);
}

static void test_config_v2(void) {
    loom_model_config_t c;
    loom_err_t err = {0};
    REQUIRE(parse("{\"model_type\":\"deepseek_v2\",\"num_experts_per_tok\":6}", &c, &err));
    CHECK(c.deepseek == 2 && c.dim == 4096 && c.hidden_dim == 11008 && c.n_layers == 32 && c.n_heads == 32);
    CHECK(c.vocab_size == 32000 && c.bos_id == 1 && c.eos_ids[0] == 2 && c.max_seq_len == 2048);
    CHECK(c.q_lora_rank == 1536 && c.kv_lora_rank == 512 && c.moe_hidden_dim == 1407 && c.n_experts == 64);
    CHECK(c.n_shared_experts == 2 && c.first_k_dense_replace == 0 && c.topk_method == LOOM_DS_TOPK_GREEDY);
    CHECK(!c.scoring_sigmoid && c.routed_scaling_factor == 1.0f && !c.norm_topk_prob && c.rope_interleave);
    /* V2-Lite: q_lora_rank null (one q_proj), group-limited V2 (DeepSeek-V2's 160 experts in 8 groups) */
    REQUIRE(parse("{\"model_type\":\"deepseek_v2\",\"num_experts_per_tok\":6,\"q_lora_rank\":null,"
                  "\"n_routed_experts\":64,\"first_k_dense_replace\":1,\"rope_scaling\":{\"type\":\"yarn\",\"factor\":40,"
                  "\"mscale\":0.707,\"mscale_all_dim\":0.707,\"original_max_position_embeddings\":4096}}",
                  &c, &err));
    CHECK(c.q_lora_rank == 0 && c.rope_attn_factor == 1.0f && c.first_k_dense_replace == 1);
    CHECKF(fabs(c.attn_scale - 0.114721387) < 1e-7, "attn_scale %.9g", (double)c.attn_scale);
    REQUIRE(parse("{\"model_type\":\"deepseek_v2\",\"num_experts_per_tok\":6,\"n_routed_experts\":160,"
                  "\"topk_method\":\"group_limited_greedy\",\"n_group\":8,\"topk_group\":3}", &c, &err));
    CHECK(c.topk_method == LOOM_DS_TOPK_GROUP_LIMITED && c.n_group == 8 && c.topk_group == 3);
}

static void test_config_refusals(void) {
    static const struct {
        const char *json, *want;
    } cases[] = {
        {"{\"model_type\":\"deepseek_v3\",\"head_dim\":100}", "inconsistent head dims: head_dim 100"},
        {"{\"model_type\":\"deepseek_v3\",\"qk_head_dim\":128}", "inconsistent head dims: qk_head_dim 128"},
        {"{\"model_type\":\"deepseek_v3\",\"qk_rope_head_dim\":63}", "qk_rope_head_dim (63) must be even"},
        {"{\"model_type\":\"deepseek_v3\",\"n_routed_experts\":100}", "n_routed_experts (100) is not divisible by n_group (8)"},
        {"{\"model_type\":\"deepseek_v3\",\"topk_group\":9}", "topk_group (9) exceeds n_group (8)"},
        {"{\"model_type\":\"deepseek_v3\",\"topk_method\":\"greedy\"}", "topk_method 'greedy' is not supported for deepseek_v3"},
        {"{\"model_type\":\"deepseek_v3\",\"scoring_func\":\"softmax\"}", "scoring_func 'softmax' is not supported"},
        {"{\"model_type\":\"deepseek_v3\",\"moe_layer_freq\":2}", "moe_layer_freq 2 is not supported"},
        {"{\"model_type\":\"deepseek_v3\",\"attention_bias\":true}", "attention_bias true is not supported"},
        {"{\"model_type\":\"deepseek_v3\",\"hidden_act\":\"gelu\"}", "hidden_act 'gelu' is not supported"},
        {"{\"model_type\":\"deepseek_v3\",\"rope_scaling\":{\"type\":\"linear\",\"factor\":2}}",
         "rope_scaling type 'linear' is not supported for deepseek_v3"},
        {"{\"model_type\":\"deepseek_v3\",\"rope_scaling\":{\"type\":\"yarn\",\"factor\":40}}",
         "original_max_position_embeddings is missing"},
        {"{\"model_type\":\"deepseek_v3\",\"quantization_config\":{\"quant_method\":\"awq\"}}",
         "quant_method 'awq' is not supported for deepseek_v3"},
        {"{\"model_type\":\"deepseek_v3\",\"quantization_config\":{\"quant_method\":\"fp8\"}}",
         "weight_block_size must list two positive integers"},
        {"{\"model_type\":\"deepseek_v3\",\"num_experts_per_tok\":200}", "num_experts_per_tok (200) exceeds the 128 experts"},
        {"{\"model_type\":\"deepseek_v2\"}", "num_experts_per_tok is missing"},
        {"{\"model_type\":\"deepseek_v2\",\"num_experts_per_tok\":6,\"norm_topk_prob\":true}",
         "norm_topk_prob true is not supported for deepseek_v2"},
        {"{\"model_type\":\"deepseek_v2\",\"num_experts_per_tok\":6,\"rope_interleave\":false}",
         "rope_interleave false is not supported for deepseek_v2"},
        {"{\"model_type\":\"deepseek_v2\",\"num_experts_per_tok\":6,\"topk_method\":\"group_limited_greedy\"}",
         "n_group is missing"},
        {"{\"model_type\":\"deepseek_v2\",\"num_experts_per_tok\":6,\"mlp_bias\":true}", "mlp_bias is true"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_model_config_t c;
        loom_err_t err = {0};
        int ok = parse(cases[i].json, &c, &err);
        CHECKF(!ok && strstr(err.msg, cases[i].want), "%s -> %s", cases[i].json, ok ? "accepted" : err.msg);
    }
    /* the other families still refuse DeepSeek's expert key */
    loom_model_config_t c;
    loom_err_t err = {0};
    CHECK(!parse("{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":1,"
                 "\"num_attention_heads\":4,\"vocab_size\":32,\"n_routed_experts\":8}", &c, &err) &&
          strstr(err.msg, "n_routed_experts is not supported"));
}

/* ---------------------------------------------------------------- router */

static void test_router(void) {
    static const char *const cases[] = {"r_v3", "r_small", "r_nonorm", "r_v2greedy", "r_v2group"};
    int flips = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%s_params", cases[c]);
        const piece_t *p = piece(nm);
        REQUIRE(p && p->n == 8);
        loom_moe_ds_route_t r = {.n_experts = (int)p->v[0], .top_k = (int)p->v[1], .sigmoid = (int)p->v[2],
                                 .method = (loom_ds_topk_t)(int)p->v[3], .n_group = (int)p->v[4],
                                 .topk_group = (int)p->v[5], .norm_topk_prob = (int)p->v[6],
                                 .routed_scaling_factor = (float)p->v[7]};
        const int E = r.n_experts, K = r.top_k;
        snprintf(nm, sizeof nm, "%s_logits", cases[c]);
        float *logits = piece_f32(nm, E), *bias = NULL, scratch[2 * 512], w[16];
        int ids[16];
        REQUIRE(logits);
        for (int pass = r.sigmoid ? 0 : 1; pass < 2; pass++) { /* sigmoid: without, then with the bias */
            if (pass == 1 && r.sigmoid) {
                snprintf(nm, sizeof nm, "%s_bias", cases[c]);
                bias = piece_f32(nm, E);
            }
            snprintf(nm, sizeof nm, "%s_ids%s", cases[c], pass ? "" : "_nobias");
            const piece_t *want_ids = piece(nm);
            snprintf(nm, sizeof nm, "%s_w%s", cases[c], pass ? "" : "_nobias");
            float *want_w = piece_f32(nm, K);
            REQUIRE(want_ids && want_ids->n == K && want_w);
            loom_moe_route_deepseek(&r, logits, bias, scratch, ids, w);
            int same = 1;
            for (int k = 0; k < K; k++) same &= ids[k] == (int)want_ids->v[k];
            CHECKF(same, "%s pass %d: ids %d %d ... want %d %d ...", cases[c], pass, ids[0], ids[1],
                   (int)want_ids->v[0], (int)want_ids->v[1]);
            CHECK(test_allclose(cases[c], w, want_w, K, 0, 2e-6));
            free(want_w);
        }
        if (bias) { /* the reference picked logits whose choice the bias changes */
            const piece_t *a = piece(strcat(strcpy(nm, cases[c]), "_ids")), *b;
            b = piece(strcat(strcpy(nm, cases[c]), "_ids_nobias"));
            for (int k = 0; k < K; k++)
                if (a->v[k] != b->v[k]) {
                    flips++;
                    break;
                }
        }
        free(logits);
        free(bias);
    }
    CHECKF(flips == 3, "%d sigmoid cases where the correction bias changes the choice", flips);
}

/* ---------------------------------------------------------------- yarn with mscale */

static void test_yarn(void) {
    static const char *const cases[] = {"y_v3", "y_v2lite", "y_nomsall"};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char nm[64], json[1024];
        snprintf(nm, sizeof nm, "%s_params", cases[c]);
        const piece_t *p = piece(nm);
        REQUIRE(p && p->n == 4);
        char ms[96] = "";
        if (p->v[2] > 0) snprintf(ms, sizeof ms, ",\"mscale\":%.17g,\"mscale_all_dim\":%.17g", p->v[2], p->v[3]);
        snprintf(json, sizeof json,
                 "{\"model_type\":\"deepseek_v3\",\"max_position_embeddings\":163840,\"rope_scaling\":{\"type\":"
                 "\"yarn\",\"factor\":%.17g,\"original_max_position_embeddings\":%d,\"beta_fast\":32,\"beta_slow\":1%s}}",
                 p->v[0], (int)p->v[1], ms);
        loom_model_config_t cfg;
        loom_err_t err = {0};
        REQUIRE(parse(json, &cfg, &err));
        double inv[32];
        loom_mla_rope_inv_freq(&cfg, inv);
        snprintf(nm, sizeof nm, "%s_inv_freq", cases[c]);
        const piece_t *want = piece(nm);
        REQUIRE(want && want->n == 32);
        double worst = 0;
        for (int j = 0; j < 32; j++) worst = fmax(worst, fabs(inv[j] - want->v[j]) / want->v[j]);
        CHECKF(worst < 1e-12, "%s inv_freq: worst relative error %.3g", cases[c], worst);
        snprintf(nm, sizeof nm, "%s_attn_factor", cases[c]);
        CHECK(fabs(cfg.rope_attn_factor - piece(nm)->v[0]) < 1e-6);
        snprintf(nm, sizeof nm, "%s_softmax_scale", cases[c]);
        CHECKF(fabs(cfg.attn_scale - piece(nm)->v[0]) < 1e-6 * piece(nm)->v[0], "%s softmax scale %.9g want %.9g",
               cases[c], (double)cfg.attn_scale, piece(nm)->v[0]);
        static const int positions[] = {0, 4095, 4096, 100000};
        for (int k = 0; k < 4; k++) {
            double wc = 0, ws = 0;
            snprintf(nm, sizeof nm, "%s_cos_%d", cases[c], positions[k]);
            const piece_t *pc = piece(nm);
            snprintf(nm, sizeof nm, "%s_sin_%d", cases[c], positions[k]);
            const piece_t *ps = piece(nm);
            REQUIRE(pc && ps);
            for (int j = 0; j < 32; j++) {
                double a = positions[k] * inv[j];
                wc = fmax(wc, fabs(cos(a) * cfg.rope_attn_factor - pc->v[j]));
                ws = fmax(ws, fabs(sin(a) * cfg.rope_attn_factor - ps->v[j]));
            }
            /* the angle at 100000 carries the frequency's relative error x 1e5 rad, and the attention factor
             * is a float */
            CHECKF(wc < 1e-6 && ws < 1e-6, "%s at %d: cos off by %.3g, sin by %.3g", cases[c], positions[k], wc, ws);
        }
    }
}

/* ---------------------------------------------------------------- FP8 */

/* A safetensors file of the given tensors (name, dtype, 2-D shape, data). */
typedef struct {
    const char *name, *dtype;
    int64_t r, c;
    const void *data;
    size_t nbytes;
} st_spec_t;

static int write_st(const char *path, const st_spec_t *t, int n) {
    char hdr[4096];
    size_t len = 0, off = 0;
    len += (size_t)snprintf(hdr + len, sizeof hdr - len, "{");
    for (int i = 0; i < n; i++) {
        if (t[i].c > 0)
            len += (size_t)snprintf(hdr + len, sizeof hdr - len,
                                    "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld],\"data_offsets\":[%zu,%zu]}",
                                    i ? "," : "", t[i].name, t[i].dtype, (long long)t[i].r, (long long)t[i].c, off,
                                    off + t[i].nbytes);
        else
            len += (size_t)snprintf(hdr + len, sizeof hdr - len,
                                    "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],\"data_offsets\":[%zu,%zu]}",
                                    i ? "," : "", t[i].name, t[i].dtype, (long long)t[i].r, off, off + t[i].nbytes);
        off += t[i].nbytes;
    }
    len += (size_t)snprintf(hdr + len, sizeof hdr - len, "}");
    while (len % 8) hdr[len++] = ' ';
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    uint64_t hl = len;
    fwrite(&hl, 8, 1, f);
    fwrite(hdr, 1, len, f);
    for (int i = 0; i < n; i++) fwrite(t[i].data, 1, t[i].nbytes, f);
    return fclose(f) == 0;
}

static void test_fp8(void) {
    const piece_t *table = piece("fp8_table");
    REQUIRE(table && table->n == 256);
    int bad = 0;
    for (int k = 0; k < 256; k++) {
        float v = loom_e4m3fn_value((uint8_t)k);
        double want = table->v[k];
        if (isnan(want) ? !isnan(v) : (double)v != want) bad++;
    }
    CHECKF(bad == 0, "%d of 256 e4m3 codes decode wrongly", bad);
    /* a 200 x 300 weight in 128 x 128 blocks: a 2 x 3 scale grid, the edge blocks partial */
    const piece_t *pc = piece("fp8_codes");
    float *scale = piece_f32("fp8_scale_inv", 6), *want = piece_f32("fp8_out", 200 * 300);
    REQUIRE(pc && pc->n == 200 * 300 && scale && want);
    uint8_t *codes = malloc(200 * 300);
    float *got = malloc(200 * 300 * sizeof *got);
    for (int i = 0; i < 200 * 300; i++) codes[i] = (uint8_t)pc->v[i];
    loom_fp8_block_dequant(codes, 200, 300, scale, 128, 128, got);
    CHECK(test_allclose("fp8 dequant", got, want, 200 * 300, 0, 1e-7));
    /* through a checkpoint: a TP slice (rows 70..199, columns 100..299 cross every block edge) */
    char path[1024];
    snprintf(path, sizeof path, "%s/deepseek_fp8.safetensors", g_work);
    float bad_scale[4] = {1, 1, 1, 1};
    st_spec_t t[] = {{"w", "F8_E4M3", 200, 300, codes, 200 * 300},
                     {"w_scale_inv", "F32", 2, 3, scale, 6 * sizeof(float)},
                     {"v", "F8_E4M3", 200, 300, codes, 200 * 300},
                     {"v_scale_inv", "F32", 2, 2, bad_scale, 4 * sizeof(float)}};
    REQUIRE(write_st(path, t, 4));
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_st_open_file(path, &st, &err) == LOOM_OK);
    float *slice = malloc(130 * 200 * sizeof *slice), *ref = malloc(130 * 200 * sizeof *ref);
    CHECK(loom_st_read_fp8(st, loom_st_find(st, "w"), loom_st_find(st, "w_scale_inv"), 128, 128, 70, 130, 100, 200,
                           slice, &err) == LOOM_OK);
    for (int i = 0; i < 130; i++)
        for (int j = 0; j < 200; j++) ref[i * 200 + j] = want[(70 + i) * 300 + 100 + j];
    CHECK(test_allclose("fp8 slice", slice, ref, 130 * 200, 0, 1e-7));
    loom_status_t rc = loom_st_read_fp8(st, loom_st_find(st, "v"), loom_st_find(st, "v_scale_inv"), 128, 128, 0, 1,
                                        0, 1, slice, &err);
    CHECKF(rc == LOOM_ERR_FORMAT && strstr(err.msg, "'v_scale_inv'") && strstr(err.msg, "[2, 2]") &&
               strstr(err.msg, "[2, 3]"),
           "%s", err.msg);
    rc = loom_st_read_fp8(st, loom_st_find(st, "v"), NULL, 128, 128, 0, 1, 0, 1, slice, &err);
    CHECKF(rc == LOOM_ERR_FORMAT && strstr(err.msg, "no 'v_scale_inv'"), "%s", err.msg);
    loom_st_close(&st);
    free(codes);
    free(got);
    free(scale);
    free(want);
    free(slice);
    free(ref);
}

/* The checkpoint checks at load: a one-layer MoE with an fp8 projection in 16 x 16 blocks. */
static void test_checkpoint(void) {
    static const char cfg_json[] =
        "{\"model_type\":\"deepseek_v3\",\"hidden_size\":20,\"num_hidden_layers\":1,\"first_k_dense_replace\":0,"
        "\"n_routed_experts\":8,\"n_group\":2,\"topk_group\":1,\"num_experts_per_tok\":2,\"vocab_size\":32,"
        "\"quantization_config\":{\"quant_method\":\"fp8\",\"weight_block_size\":[16,16]}}";
    loom_model_config_t c;
    loom_err_t err = {0};
    REQUIRE(parse(cfg_json, &c, &err));
    uint8_t codes[40 * 20] = {0};
    float scale[6] = {1, 1, 1, 1, 1, 1}, bias[8] = {0};
    const char *bname = "model.layers.0.mlp.gate.e_score_correction_bias";
    const char *wname = "model.layers.0.self_attn.o_proj.weight", *sname = "model.layers.0.self_attn.o_proj.weight_scale_inv";
    struct {
        st_spec_t t[3];
        int n;
        const char *want; /* NULL: accepted */
    } cases[] = {
        {{{bname, "F32", 8, 0, bias, sizeof bias}, {wname, "F8_E4M3", 40, 20, codes, sizeof codes},
          {sname, "F32", 3, 2, scale, sizeof scale}}, 3, NULL},
        {{{wname, "F8_E4M3", 40, 20, codes, sizeof codes}, {sname, "F32", 3, 2, scale, sizeof scale}}, 2,
         "e_score_correction_bias' is missing"},
        {{{bname, "F32", 4, 0, bias, 4 * sizeof(float)}}, 1, "must have shape [8]"},
        {{{bname, "F32", 8, 0, bias, sizeof bias}, {wname, "F8_E4M3", 40, 20, codes, sizeof codes},
          {sname, "F32", 3, 1, scale, 3 * sizeof(float)}}, 3, "needs a float [3, 2]"},
        {{{bname, "F32", 8, 0, bias, sizeof bias}, {wname, "F8_E4M3", 40, 20, codes, sizeof codes}}, 2,
         "no 'model.layers.0.self_attn.o_proj.weight_scale_inv' beside it"},
    };
    char path[1024];
    snprintf(path, sizeof path, "%s/deepseek_ckpt.safetensors", g_work);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        REQUIRE(write_st(path, cases[i].t, cases[i].n));
        loom_st_t *st = NULL;
        REQUIRE(loom_st_open_file(path, &st, &err) == LOOM_OK);
        loom_status_t rc = loom_deepseek_check_checkpoint(&c, st, &err);
        if (!cases[i].want) {
            CHECKF(rc == LOOM_OK, "case %zu: %s", i, err.msg);
            /* fp8 codes without an fp8 quantization_config */
            loom_model_config_t plain = c;
            plain.ckpt_quant = LOOM_CKPT_FLOAT;
            rc = loom_deepseek_check_checkpoint(&plain, st, &err);
            CHECKF(rc == LOOM_ERR_FORMAT && strstr(err.msg, "no fp8 quantization_config"), "%s", err.msg);
        } else {
            CHECKF(rc == LOOM_ERR_FORMAT && strstr(err.msg, cases[i].want), "case %zu: %s", i,
                   rc ? err.msg : "accepted");
        }
        loom_st_close(&st);
    }
}

/* ---------------------------------------------------------------- MLA */

static void test_mla_case(const char *name) {
    char nm[96];
    snprintf(nm, sizeof nm, "%s_dims", name);
    const piece_t *d = piece(nm);
    REQUIRE(d && d->n == 9);
    loom_mla_shape_t s = {.dim = (int)d->v[0], .n_heads = (int)d->v[1], .q_lora_rank = (int)d->v[2],
                          .kv_lora_rank = (int)d->v[3], .nope = (int)d->v[4], .rope = (int)d->v[5],
                          .v = (int)d->v[6], .interleave = (int)d->v[7], .latent_eps = 1e-6f};
    const int T = (int)d->v[8], D = s.dim, R = loom_mla_cache_row(&s);
    snprintf(nm, sizeof nm, "%s_inv_freq", name);
    const piece_t *inv = piece(nm);
    snprintf(nm, sizeof nm, "%s_rope", name);
    const piece_t *rp = piece(nm);
    REQUIRE(inv && inv->n == s.rope / 2 && rp && rp->n == 2);
    s.inv_freq = inv->v;
    s.rope_factor = (float)rp->v[0];
    s.softmax_scale = (float)rp->v[1];
    loom_mla_weights_t w = {0};
    static const struct {
        const char *key;
        size_t off;
    } names[] = {{"q_proj", offsetof(loom_mla_weights_t, q_proj)},
                 {"q_a_proj", offsetof(loom_mla_weights_t, q_a_proj)},
                 {"q_a_layernorm", offsetof(loom_mla_weights_t, q_a_norm)},
                 {"q_b_proj", offsetof(loom_mla_weights_t, q_b_proj)},
                 {"kv_a_proj_with_mqa", offsetof(loom_mla_weights_t, kv_a_proj)},
                 {"kv_a_layernorm", offsetof(loom_mla_weights_t, kv_a_norm)},
                 {"kv_b_proj", offsetof(loom_mla_weights_t, kv_b_proj)},
                 {"o_proj", offsetof(loom_mla_weights_t, o_proj)}};
    float *owned[8] = {0};
    for (size_t i = 0; i < 8; i++) {
        if (!strncmp(names[i].key, "q_", 2) && (s.q_lora_rank ? !strcmp(names[i].key, "q_proj")
                                                               : strcmp(names[i].key, "q_proj")))
            continue;
        snprintf(nm, sizeof nm, "%s_%s", name, names[i].key);
        owned[i] = piece_f32(nm, -1);
        REQUIRE(owned[i]);
        memcpy((char *)&w + names[i].off, &owned[i], sizeof owned[i]);
    }
    snprintf(nm, sizeof nm, "%s_x", name);
    float *x = piece_f32(nm, (long)T * D);
    snprintf(nm, sizeof nm, "%s_out", name);
    float *want = piece_f32(nm, (long)T * D);
    snprintf(nm, sizeof nm, "%s_cache", name);
    float *want_cache = piece_f32(nm, (long)T * R);
    REQUIRE(x && want && want_cache);
    float *scratch = malloc(loom_mla_scratch_floats(&s, T, T) * sizeof *scratch);
    float *cache = malloc((size_t)T * R * sizeof *cache), *cache2 = malloc((size_t)T * R * sizeof *cache);
    float *pre = malloc((size_t)T * D * sizeof *pre), *chunked = malloc((size_t)T * D * sizeof *pre);
    float *dec = malloc((size_t)T * D * sizeof *dec);
    /* decompressed, the whole prompt at once */
    loom_mla_prefill(&s, &w, x, T, 0, cache, pre, scratch);
    snprintf(nm, sizeof nm, "%s prefill", name);
    CHECK(test_allclose(nm, pre, want, (long)T * D, 1e-4, 1e-4));
    snprintf(nm, sizeof nm, "%s cache", name);
    CHECK(test_allclose(nm, cache, want_cache, (long)T * R, 1e-5, 1e-5));
    /* decompressed in two chunks (3, then T - 3 over the cached rows) */
    loom_mla_prefill(&s, &w, x, 3, 0, cache2, chunked, scratch);
    loom_mla_prefill(&s, &w, x + 3 * D, T - 3, 3, cache2, chunked + 3 * D, scratch);
    snprintf(nm, sizeof nm, "%s chunked", name);
    CHECK(test_allclose(nm, chunked, pre, (long)T * D, 1e-5, 1e-5));
    /* absorbed, one token at a time over the latent cache */
    for (int t = 0; t < T; t++) loom_mla_decode(&s, &w, x + (size_t)t * D, t, cache2, dec + (size_t)t * D, scratch);
    snprintf(nm, sizeof nm, "%s absorbed vs decompressed", name);
    CHECK(test_allclose(nm, dec, pre, (long)T * D, 1e-4, 1e-4));
    snprintf(nm, sizeof nm, "%s absorbed", name);
    CHECK(test_allclose(nm, dec, want, (long)T * D, 1e-4, 1e-4));
    for (size_t i = 0; i < 8; i++) free(owned[i]);
    free(x);
    free(want);
    free(want_cache);
    free(scratch);
    free(cache);
    free(cache2);
    free(pre);
    free(chunked);
    free(dec);
}

/* q compressed, yarn (factor 4, mscale 0.9 / 0.8), interleaved pairs */
static void test_mla_q_lora_yarn(void) { test_mla_case("mla_a"); }
/* one q_proj, no scaling, rotate-half pairs (rope_interleave false) */
static void test_mla_q_proj_rotate_half(void) { test_mla_case("mla_b"); }

/* ---------------------------------------------------------------- the MTP draft */

typedef struct {
    int32_t ids[64];
    int n;
} collect_t;

static int collect(void *ctx, int32_t id) {
    collect_t *c = ctx;
    if (c->n < 64) c->ids[c->n++] = id;
    return 0;
}

static loom_local_t *open_local(const char *dir, loom_spec_method_t method) {
    loom_local_options_t o = {.model_dir = dir, .n_threads = 1, .ctx = 128, .chunk = 16, .no_tokenizer = 1};
    loom_spec_config_defaults(&o.spec);
    o.spec.method = method;
    o.spec.k = 3;
    o.spec.fixed_k = 1;
    loom_local_t *l = NULL;
    loom_err_t err = {0};
    if (loom_local_open(&o, &l, &err) != LOOM_OK) fprintf(stderr, "  open %s: %s\n", dir, err.msg);
    return l;
}

static void test_mtp_draft(void) {
    char dir[512], refdir[512], path[600], cmd[4096];
    snprintf(dir, sizeof dir, "%s/deepseek_mtp", g_work);
    snprintf(refdir, sizeof refdir, "%s", g_ref);
    char *slash = strrchr(refdir, '/');
    if (slash) *slash = 0;
    snprintf(path, sizeof path, "%s/deepseek_mtp_logits.f32", g_work);
    static const int32_t ids[] = {1, 7, 300, 42, 5, 99, 17, 250, 3, 88, 401};
    const int n = (int)(sizeof ids / sizeof ids[0]);
    snprintf(cmd, sizeof cmd,
             "'%s' '%s/gen_deepseek.py' --out '%s' --shape v3 --seed 7 --mtp 1 --tokenizer-from '' && "
             "'%s' '%s' --model '%s' --ids 1,7,300,42,5,99,17,250,3,88,401 --mtp-logits-out '%s'",
             g_python, refdir, dir, g_python, g_ref, dir, path);
    REQUIRE(system(cmd) == 0);
    loom_local_t *mtp = open_local(dir, LOOM_SPEC_MTP), *plain = open_local(dir, LOOM_SPEC_OFF);
    REQUIRE(mtp && plain);
    const int vocab = loom_local_config(mtp)->vocab_size;
    float *want = malloc((size_t)(n - 1) * (size_t)vocab * sizeof *want);
    float *got = malloc((size_t)(n - 1) * (size_t)vocab * sizeof *got);
    FILE *f = fopen(path, "rb");
    REQUIRE(f);
    size_t rd = fread(want, sizeof *want, (size_t)(n - 1) * (size_t)vocab, f);
    fclose(f);
    REQUIRE(rd == (size_t)(n - 1) * (size_t)vocab);
    loom_err_t err = {0};
    CHECKF(loom_local_mtp_logits(mtp, ids, n, got, &err) == LOOM_OK, "%s", err.msg);
    double amax = 0;
    for (long i = 0; i < (long)(n - 1) * vocab; i++) amax = fmax(amax, fabs(want[i]));
    CHECK(test_allclose("mtp draft logits", got, want, (long)(n - 1) * vocab, 1e-4 * amax, 1e-4));
    /* greedy, in two prefill chunks of 16: the same ids with MTP drafts as without */
    int32_t prompt[20];
    for (int i = 0; i < 20; i++) prompt[i] = ids[i % n] + i;
    const loom_sampling_t greedy = {.temperature = 0.0f, .top_p = 1.0f};
    collect_t a = {0}, b = {0};
    loom_gen_stats_t sa = {0}, sb = {0};
    CHECKF(loom_local_generate(plain, prompt, 20, 40, &greedy, 1, collect, &a, NULL, &sa, &err) == LOOM_OK, "%s",
           err.msg);
    CHECKF(loom_local_generate(mtp, prompt, 20, 40, &greedy, 1, collect, &b, NULL, &sb, &err) == LOOM_OK, "%s",
           err.msg);
    CHECKF(a.n == 40 && b.n == 40 && !memcmp(a.ids, b.ids, sizeof a.ids), "%d and %d ids, differing", a.n, b.n);
    CHECKF(sb.spec.num_draft_tokens > 0, "no drafts");
    printf("  mtp: 40 greedy ids equal; %lld drafts, %lld draft tokens, %lld accepted (%.1f%%), %.2f tokens a "
           "target step (a random model)\n",
           (long long)sb.spec.num_drafts, (long long)sb.spec.num_draft_tokens,
           (long long)sb.spec.num_accepted_tokens,
           sb.spec.num_draft_tokens ? 100.0 * (double)sb.spec.num_accepted_tokens / (double)sb.spec.num_draft_tokens
                                    : 0.0,
           sb.spec.target_steps ? (double)sb.spec.emitted_tokens / (double)sb.spec.target_steps : 0.0);
    /* refused without the module */
    CHECKF(loom_local_mtp_logits(plain, ids, n, got, &err) == LOOM_ERR_INVALID_ARGUMENT, "%s", err.msg);
    loom_local_close(&mtp);
    loom_local_close(&plain);
    free(want);
    free(got);
}

/* The MTP rows of a grid step (worker/mtp_rows.h): a verify step whose
 * first draft is accepted and second rejected, a plain decode, a prefill
 * chunk that is not the prompt's last (the coordinator's next token) and
 * one that is (sampled). */
static void test_mtp_rows(void) {
    /* seq 0: fed 10 (decode) + drafts 11, 12; seq 1: decode 20; seq 2: prompt chunk 30 31 (next 32);
     * seq 3: final chunk 40 41 */
    static const int32_t tokens[] = {10, 11, 12, 20, 30, 31, 40, 41};
    static const int32_t tok_seq[] = {0, 0, 0, 1, 2, 2, 3, 3};
    static const int32_t logit_rows[] = {0, 1, 2, 3, 7};
    static const int32_t sampled[] = {11, 99, 13, 21, 42}; /* 11 accepts draft 11, 99 rejects 12 */
    static const int32_t next[] = {-1, -1, 32, -1};
    loom_mtp_step_t st = {.tokens = tokens, .tok_seq = tok_seq, .n_tokens = 8, .n_seqs = 4,
                          .logit_rows = logit_rows, .sampled = sampled, .n_logits = 5, .next = next};
    int32_t in[8], rows[4], seq[4];
    int n = loom_mtp_rows(&st, in, rows, seq);
    static const int32_t want_in[] = {11, 99, 13, 21, 31, 32, 41, 42};
    CHECKF(n == 3, "%d MTP logit rows", n);
    CHECK(!memcmp(in, want_in, sizeof in));
    /* seq 0's last accepted row is token 1 (draft 11 accepted, its row sampled 99) */
    CHECKF(rows[0] == 1 && seq[0] == 0 && rows[1] == 3 && seq[1] == 1 && rows[2] == 7 && seq[2] == 3,
           "rows %d %d %d, seqs %d %d %d", rows[0], rows[1], rows[2], seq[0], seq[1], seq[2]);
    /* every draft accepted: the last row; no next tokens given: a chunk's last row reads its own token */
    static const int32_t all[] = {11, 12, 77, 21, 42};
    st.sampled = all;
    st.next = NULL;
    n = loom_mtp_rows(&st, in, rows, seq);
    CHECKF(n == 3 && rows[0] == 2 && in[2] == 77 && in[5] == 31, "n %d row %d in %d %d", n, rows[0], in[2], in[5]);
}

/* MLA's output two ways (attn_mla.c): W_UV folded into o_proj, and W_UV per
 * head then o_proj; the same logits and greedy ids, AUTO choosing the fold
 * on this tiny shape (kv_lora + rope = v = dim = 32: the split holds twice
 * the weights) and the split's extra weights exactly those. Run after
 * test_mtp_draft, whose generated model it reads. */
static void test_mla_o_split(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/deepseek_mtp", g_work);
    loom_local_t *l[3] = {0};
    static const loom_mla_o_t how[3] = {LOOM_MLA_O_FOLDED, LOOM_MLA_O_SPLIT, LOOM_MLA_O_AUTO};
    for (int i = 0; i < 3; i++) {
        loom_local_options_t o = {.model_dir = dir, .n_threads = 1, .ctx = 128, .chunk = 16, .no_tokenizer = 1,
                                  .mla_o = how[i]};
        loom_err_t err = {0};
        CHECKF(loom_local_open(&o, &l[i], &err) == LOOM_OK, "%s", err.msg);
        if (!l[i]) goto done;
    }
    const loom_model_config_t *c = loom_local_config(l[0]);
    const int vocab = c->vocab_size, H = c->n_heads, D = c->head_dim, v = c->v_head_dim;
    size_t folded = loom_model_weight_bytes(loom_local_model(l[0])),
           split = loom_model_weight_bytes(loom_local_model(l[1])),
           autow = loom_model_weight_bytes(loom_local_model(l[2]));
    /* a layer: W_UV (H, v, D) + o_proj (dim, H v) against o' (dim, H D) */
    size_t extra = (size_t)c->n_layers * ((size_t)H * v * D + (size_t)c->dim * H * v - (size_t)c->dim * H * D) * 4;
    CHECKF(split == folded + extra && autow == folded, "weights: folded %zu, split %zu (+%zu expected), auto %zu",
           folded, split, extra, autow);
    static const int32_t ids[] = {1, 7, 300, 42, 5, 99, 17, 250, 3, 88, 401, 12, 9, 77, 300, 6, 21, 8};
    const int n = (int)(sizeof ids / sizeof ids[0]); /* two prefill chunks */
    float *a = malloc((size_t)n * vocab * sizeof *a), *b = malloc((size_t)n * vocab * sizeof *b);
    loom_err_t err = {0};
    CHECKF(loom_local_logits(l[0], ids, n, a, &err) == LOOM_OK, "%s", err.msg);
    CHECKF(loom_local_logits(l[1], ids, n, b, &err) == LOOM_OK, "%s", err.msg);
    double amax = 0;
    for (long i = 0; i < (long)n * vocab; i++) amax = fmax(amax, fabs(a[i]));
    CHECK(test_allclose("split against folded logits", b, a, (long)n * vocab, 1e-5 * amax, 1e-5));
    const loom_sampling_t greedy = {.temperature = 0.0f, .top_p = 1.0f};
    collect_t ga = {0}, gb = {0};
    loom_gen_stats_t sa = {0}, sb = {0};
    CHECKF(loom_local_generate(l[0], ids, 6, 40, &greedy, 1, collect, &ga, NULL, &sa, &err) == LOOM_OK, "%s",
           err.msg);
    CHECKF(loom_local_generate(l[1], ids, 6, 40, &greedy, 1, collect, &gb, NULL, &sb, &err) == LOOM_OK, "%s",
           err.msg);
    CHECKF(ga.n == 40 && gb.n == 40 && !memcmp(ga.ids, gb.ids, sizeof ga.ids), "%d and %d greedy ids, differing",
           ga.n, gb.n);
    free(a);
    free(b);
done:
    for (int i = 0; i < 3; i++) loom_local_close(&l[i]);
}

int main(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--python")) g_python = argv[i + 1];
        else if (!strcmp(argv[i], "--ref")) g_ref = argv[i + 1];
        else if (!strcmp(argv[i], "--work")) g_work = argv[i + 1];
    }
    RUN(test_config_v3_defaults);
    RUN(test_mla_disable_env);
    RUN(test_config_v3_real);
    RUN(test_config_v2);
    RUN(test_config_refusals);
    RUN(test_checkpoint);
    RUN(test_mtp_rows);
    if (!g_ref || !load_pieces()) {
        fprintf(stderr, "FAIL: the reference's pieces could not be made (--ref)\n");
        return 1;
    }
    RUN(test_router);
    RUN(test_yarn);
    RUN(test_fp8);
    RUN(test_mla_q_lora_yarn);
    RUN(test_mla_q_proj_rotate_half);
    RUN(test_mtp_draft);
    RUN(test_mla_o_split);
    for (int i = 0; i < g_n_pieces; i++) free(g_pieces[i].v);
    return test_summary();
}
