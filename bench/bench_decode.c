/* Decode and prefill throughput of one process on a generated model, with
 * the machine's memory bandwidth measured in the same run (STREAM triad):
 * batch-1 decode is memory-bound, so MBU = weight bytes per token x tokens/s
 * over the triad bandwidth says how close the engine is to the roofline.
 * "+KV" adds the K/V cache bytes each token reads (the usual definition of
 * MBU counts parameters and KV cache), at the run's mean context.
 *
 * Every scheme is loaded first and the runs interleave round by round, a
 * triad after each round, so ratios compare schemes under the same load.
 *
 * --model takes a comma-separated list: every model with every scheme, in the
 * same interleaved rounds (ratios against the first model's first scheme),
 * e.g. a DeepSeek-shaped model against a Llama of the same bytes per token.
 *
 *   bench_decode --model DIR[,DIR...] [--threads 2] [--prompt 256] [--tokens 64] [--dtype f32]
 *                [--quantization none,int8,q4] [--reps 5] [--kv-layouts | --mla-fold | --disable-mla] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/membw.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "kernels/cpu/backend_cpu.h"
#include "worker/local.h"

enum { MAX_SCHEMES = 8, MAX_MODELS = 4, MAX_REPS = 100 };

typedef struct result {
    char scheme[24];
    const char *model;
    loom_local_t *l;
    double wbytes;                  /* bytes a decoded token reads */
    double prefill[MAX_REPS], decode[MAX_REPS]; /* tok/s per round */
} result_t;

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* Best (first) and median of v[0..n), sorted in place, highest first. */
static void best_median(double *v, int n, double *best, double *median) {
    qsort(v, (size_t)n, sizeof *v, cmp_desc);
    *best = v[0];
    *median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Loads the model with one quantization scheme (quantized on load). */
static int open_scheme(const char *model, const char *scheme, const loom_quant_spec_t *q, loom_dtype_t wdt,
                       const char *kv_cache_dtype, int layer_major, loom_mla_o_t mla_o, int mla_disable, int mla_rows,
                       int threads, int n_prompt, int n_gen, result_t *res) {
    loom_err_t err = {0};
    loom_local_options_t lo = {.model_dir = model, .n_threads = threads, .chunk = n_prompt,
                               .ctx = n_prompt + n_gen + 1, .weight_dtype = wdt, .quant = *q, .no_tokenizer = 1,
                               .kv_cache_dtype = kv_cache_dtype, .kv_layer_major = layer_major, .mla_o = mla_o,
                               .mla_disable = mla_disable, .mla_prefill_rows = mla_rows};
    if (loom_local_open(&lo, &res->l, &err) < 0) {
        fprintf(stderr, "bench_decode: %s: %s\n", scheme, err.msg);
        return 1;
    }
    const loom_model_config_t *c = loom_local_config(res->l);
    /* Bytes streamed per decoded token: every matmul weight (codes, scales
     * and mins as stored) and norm once; of the embedding only one row; of a
     * Mixture of Experts the router and the chosen experts' share. */
    double norms = (2.0 * c->n_layers + 1) * c->dim * 4.0;
    res->wbytes = (double)loom_model_active_bytes(loom_local_model(res->l)) + norms;
    snprintf(res->scheme, sizeof res->scheme, "%.23s", scheme);
    res->model = model;
    return 0;
}

/* One prefill + decode run of a loaded scheme, into round `rep`. */
static int run_once(result_t *res, const int32_t *prompt, int n_prompt, int n_gen, int rep) {
    loom_err_t err = {0};
    loom_sampling_t greedy = {.temperature = 0};
    loom_gen_stats_t st;
    const int vocab = loom_local_config(res->l)->vocab_size; /* the prompt's ids fit every model */
    int32_t *ids = loom_xmalloc((size_t)n_prompt * sizeof *ids);
    for (int i = 0; i < n_prompt; i++) ids[i] = prompt[i] % vocab;
    int bad = loom_local_generate(res->l, ids, n_prompt, n_gen, &greedy, 1, NULL, NULL, NULL, &st, &err) < 0;
    free(ids);
    if (bad) {
        fprintf(stderr, "bench_decode: %s: %s\n", res->scheme, err.msg);
        return 1;
    }
    res->prefill[rep] = st.prompt_tokens / st.prefill_s;
    res->decode[rep] = (st.gen_tokens - 1) / st.decode_s;
    return 0;
}

int main(int argc, char **argv) {
    loom_cpu_blas_check(argv); /* first: it may re-execute */
    loom_log_init("bench_decode");
    const char *model = NULL, *dtype = "f32", *json = NULL, *schemes = "none";
    const char *kv_cache_dtype = "auto";
    int threads = 2, n_prompt = 256, n_gen = 64, reps = 5, kv_layouts = 0, mla_fold = 0, mla_off = 0, mla_rows = 0;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR", "model directory (e.g. from tests/reference/gen_model.py)", 1, 0, NULL},
        {"threads", LOOM_OPT_INT, &threads, "N", "CPU threads (default 2)", 1, 256, NULL},
        {"prompt", LOOM_OPT_INT, &n_prompt, "N", "prompt tokens for the prefill measurement (default 256)", 1, 1e6, NULL},
        {"tokens", LOOM_OPT_INT, &n_gen, "N", "decode tokens (default 64)", 2, 1e6, NULL},
        {"reps", LOOM_OPT_INT, &reps, "N", "interleaved rounds over all schemes, best and median are reported (default 5)", 1, MAX_REPS, NULL},
        {"dtype", LOOM_OPT_STR, &dtype, "TYPE", "weight storage f32, bf16, f16 (default f32)", 1, 0, NULL},
        {"quantization", LOOM_OPT_STR, &schemes, "LIST", "comma-separated schemes measured in this run, each against the first, e.g. none,int8,q4 (default none)", 1, 0, NULL},
        {"kv-cache-dtype", LOOM_OPT_STR, &kv_cache_dtype, "TYPE", "KV cache elements: auto, f32, bf16, int8 (default auto)", 1, 0, NULL},
        {"kv-layouts", LOOM_OPT_FLAG, &kv_layouts, NULL, "also load each scheme with the layer-major KV layout (\"/lm\") against the block-contiguous one", 0, 0, NULL},
        {"mla-fold", LOOM_OPT_FLAG, &mla_fold, NULL,
         "DeepSeek: also load each scheme with MLA's output folded into one o' (\"/fold\") against the engine's choice",
         0, 0, NULL},
        {"disable-mla", LOOM_OPT_FLAG, &mla_off, NULL,
         "DeepSeek: also load each scheme with the decompressed KV cache (\"/mha\", --disable-mla) against the latent",
         0, 0, NULL},
        {"mla-prefill", LOOM_OPT_INT, &mla_rows, "ROWS",
         "DeepSeek: also load each scheme with the prefill decompressed for runs of ROWS rows or more (\"/dec\", "
         "LOOM_MLA_PREFILL_ROWS) against it absorbed (the base then absorbed, whatever the default)",
         1, 1e6, NULL},
        {"json", LOOM_OPT_STR, &json, "FILE", "also write the results as JSON", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "bench_decode --model DIR [options]",
                           "Prefill and batch-1 decode tokens/s, and MBU against a STREAM triad, for one or more\n"
                           "weight quantization schemes in the same run.");
    if (r) return r < 0 ? 2 : 0;
    if (!model) {
        fprintf(stderr, "bench_decode: --model is required\n");
        return 2;
    }
    loom_dtype_t wdt = !strcmp(dtype, "bf16") ? LOOM_DT_BF16 : !strcmp(dtype, "f16") ? LOOM_DT_F16 : LOOM_DT_F32;
    char names[MAX_SCHEMES][24];
    loom_quant_spec_t specs[MAX_SCHEMES];
    int n = 0;
    for (const char *p = schemes; *p;) {
        size_t len = strcspn(p, ",");
        if (n == MAX_SCHEMES || len == 0 || len >= sizeof names[0]) {
            fprintf(stderr, "bench_decode: bad --quantization list '%s'\n", schemes);
            return 2;
        }
        memcpy(names[n], p, len);
        names[n][len] = 0;
        if (!loom_quant_spec_parse(names[n], &specs[n])) {
            fprintf(stderr, "bench_decode: unknown quantization '%s'\n", names[n]);
            return 2;
        }
        n++;
        p += len + (p[len] == ',');
    }
    loom_log_set_level(LOOM_LOG_WARN);
    if (reps > MAX_REPS) reps = MAX_REPS;
    /* Every scheme is loaded first and the runs are interleaved round by
     * round, with a triad after each round, so the machine's load drifts
     * over all schemes alike; best and median are reported. */
    static result_t res[MAX_SCHEMES * MAX_MODELS];
    static char models[MAX_MODELS][1024];
    int n_models = 0;
    for (const char *p = model; *p;) {
        size_t len = strcspn(p, ",");
        if (n_models == MAX_MODELS || len == 0 || len >= sizeof models[0]) {
            fprintf(stderr, "bench_decode: bad --model list '%s' (at most %d)\n", model, MAX_MODELS);
            return 2;
        }
        memcpy(models[n_models], p, len);
        models[n_models++][len] = 0;
        p += len + (p[len] == ',');
    }
    double triad[MAX_REPS];
    int rc = 1;
    if (kv_layouts + mla_fold + mla_off + (mla_rows > 0) > 1) {
        fprintf(stderr, "bench_decode: one of --kv-layouts, --mla-fold, --disable-mla and --mla-prefill\n");
        return 2;
    }
    /* scheme i, then scheme i with the layer-major layout (or o' folded, or the decompressed cache) */
    if (kv_layouts || mla_fold || mla_off || mla_rows) {
        if (2 * n > MAX_SCHEMES) {
            fprintf(stderr, "bench_decode: --kv-layouts, --mla-fold and --disable-mla take at most %d schemes\n",
                    MAX_SCHEMES / 2);
            return 2;
        }
        for (int i = n - 1; i >= 0; i--) {
            specs[2 * i] = specs[2 * i + 1] = specs[i];
            char base[sizeof names[0]];
            memcpy(base, names[i], sizeof base);
            memcpy(names[2 * i], base, sizeof base);
            snprintf(names[2 * i + 1], sizeof names[0],
                     kv_layouts ? "%.19s/lm" : mla_off ? "%.18s/mha" : mla_rows ? "%.18s/dec" : "%.17s/fold", base);
        }
        n *= 2;
    }
    int n_schemes = n;
    n = 0;
    for (int mi = 0; mi < n_models; mi++)
        for (int i = 0; i < n_schemes; i++, n++)
            if (open_scheme(models[mi], names[i], &specs[i], wdt, kv_cache_dtype, kv_layouts && (i & 1),
                            mla_fold && (i & 1) ? LOOM_MLA_O_FOLDED : LOOM_MLA_O_AUTO, mla_off && (i & 1),
                            mla_rows ? (i & 1 ? mla_rows : -1) : 0, threads,
                            n_prompt, n_gen, &res[n]))
                goto out;
    const loom_model_config_t *c = loom_local_config(res[0].l);
    int vmax = c->vocab_size;
    for (int i = 1; i < n; i++) vmax = LOOM_MIN(vmax, loom_local_config(res[i].l)->vocab_size);
    int32_t *prompt = loom_xmalloc((size_t)n_prompt * sizeof *prompt);
    for (int i = 0; i < n_prompt; i++) prompt[i] = 3 + (int32_t)((i * 7919u) % (unsigned)(vmax - 3));
    for (int i = 0; i < n; i++) /* warm-up: first touch of weights, caches, scratch */
        if (run_once(&res[i], prompt, n_prompt, n_gen, 0)) goto out_prompt;
    for (int rep = 0; rep < reps; rep++) {
        for (int i = 0; i < n; i++)
            if (run_once(&res[i], prompt, n_prompt, n_gen, rep)) goto out_prompt;
        triad[rep] = loom_bench_triad_gbs(threads);
    }
    double tr_best, tr_med;
    best_median(triad, reps, &tr_best, &tr_med);
    for (int mi = 0; mi < n_models; mi++) {
        c = loom_local_config(res[mi * n_schemes].l);
        printf("model %d: %s (dim %d, %d layers, %d/%d heads, vocab %d%s)\n", mi, models[mi], c->dim, c->n_layers,
               c->n_heads, c->n_kv_heads, c->vocab_size, c->deepseek ? "; heads: MLA's absorbed heads over the latent" : "");
    }
    printf("%s, %d threads, %d interleaved rounds; triad best %.2f GB/s, median %.2f GB/s; ratios and MBU: best vs "
           "best (median vs median)\n",
           dtype, threads, reps, tr_best, tr_med);
    FILE *jf = json ? fopen(json, "w") : NULL;
    if (jf) fprintf(jf, "[");
    double pre0[2] = {0}, dec0[2] = {0};
    for (int i = 0; i < n; i++) {
        result_t *x = &res[i];
        c = loom_local_config(x->l);
        /* matmul parameters a token uses: two FLOPs each per token (a Mixture of
         * Experts layer: its router and n_experts_per_tok experts); for MLA an
         * approximation (the absorbed heads' shapes) */
        double qkv = (double)(c->n_heads + 2 * c->n_kv_heads) * c->head_dim * c->dim;
        double o = (double)c->n_heads * c->head_dim * c->dim, mlp = 3.0 * c->dim * c->hidden_dim;
        double moe = 3.0 * c->dim * c->moe_hidden_dim * c->n_experts_per_tok + (double)c->n_experts * c->dim;
        double params = (double)c->vocab_size * c->dim;
        for (int l = 0; l < c->n_layers; l++) params += qkv + o + (loom_model_config_layer_moe(c, l) ? moe : mlp);
        double pre, pre_med, dec, dec_med;
        best_median(x->prefill, reps, &pre, &pre_med);
        best_median(x->decode, reps, &dec, &dec_med);
        if (i == 0) {
            pre0[0] = pre, pre0[1] = pre_med;
            dec0[0] = dec, dec0[1] = dec_med;
        }
        double gbs = x->wbytes * dec / 1e9, gbs_med = x->wbytes * dec_med / 1e9;
        /* K and V read per decode token: every layer's cached positions, on
         * average n_prompt + (n_gen + 1) / 2 of them */
        loom_model_t *xm = loom_local_model(x->l);
        double kv_tok = (double)loom_model_kv_block_bytes(xm, loom_model_kv_block_size(xm)) /
                        loom_model_kv_block_size(xm); /* the layout's own bytes: MLA's latent row is K and V */
        double kvbytes = kv_tok * (n_prompt + (n_gen + 1) / 2.0);
        double mbu_kv = (x->wbytes + kvbytes) * dec / 1e9 / tr_best;
        printf("%d %-8s prefill %7.1f (%7.1f) tok/s %6.1f GFLOP/s %.2fx (%.2fx)  decode %7.2f (%7.2f) tok/s "
               "%.2fx (%.2fx)  %6.1f MB/token %6.2f GB/s  MBU %.2f (%.2f)  KV %.0f B/token, +KV %.1f MB: %.2f\n",
               i / n_schemes, x->scheme, pre, pre_med, pre * 2.0 * params / 1e9, pre / pre0[0], pre_med / pre0[1], dec, dec_med,
               dec / dec0[0], dec_med / dec0[1], x->wbytes / 1e6, gbs, gbs / tr_best, gbs_med / tr_med,
               kv_tok, kvbytes / 1e6, mbu_kv);
        if (jf)
            fprintf(jf,
                    "%s{\"model\":\"%s\",\"dtype\":\"%s\",\"quantization\":\"%s\",\"threads\":%d,\"rounds\":%d,"
                    "\"prefill_tok_s\":%.3f,\"prefill_tok_s_median\":%.3f,\"decode_tok_s\":%.3f,"
                    "\"decode_tok_s_median\":%.3f,\"weight_bytes_per_token\":%.0f,\"achieved_gbs\":%.3f,"
                    "\"triad_gbs\":%.3f,\"triad_gbs_median\":%.3f,\"mbu\":%.4f,\"mbu_median\":%.4f,"
                    "\"prefill_ratio\":%.4f,\"prefill_ratio_median\":%.4f,\"decode_ratio\":%.4f,"
                    "\"decode_ratio_median\":%.4f,\"kv_bytes_per_token\":%.0f,\"mbu_with_kv\":%.4f}",
                    i ? "," : "", x->model, dtype, x->scheme, threads, reps, pre, pre_med, dec, dec_med, x->wbytes, gbs,
                    tr_best, tr_med, gbs / tr_best, gbs_med / tr_med, pre / pre0[0], pre_med / pre0[1],
                    dec / dec0[0], dec_med / dec0[1], kvbytes, mbu_kv);
    }
    if (jf) {
        fprintf(jf, "]\n");
        fclose(jf);
    }
    rc = 0;
out_prompt:
    free(prompt);
out:
    for (int i = 0; i < n; i++) loom_local_close(&res[i].l);
    return rc;
}
