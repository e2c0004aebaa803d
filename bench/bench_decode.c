/* Decode and prefill throughput of one process on a generated model, with
 * the machine's memory bandwidth measured in the same run (STREAM triad):
 * batch-1 decode is memory-bound, so MBU = weight bytes per token x tokens/s
 * over the triad bandwidth says how close the engine is to the roofline.
 *
 *   bench_decode --model DIR [--threads 2] [--prompt 256] [--tokens 64] [--dtype f32]
 *                [--quantization none,int8,q4] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/membw.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "worker/local.h"

typedef struct result {
    char scheme[24];
    double prefill, decode, wbytes, achieved;
} result_t;

/* Loads the model with one quantization scheme and measures the best of
 * `reps` prefill + decode runs. */
static int measure(const char *model, const char *scheme, const loom_quant_spec_t *q, loom_dtype_t wdt,
                   const char *kv_cache_dtype, int threads, int n_prompt, int n_gen, int reps, result_t *res,
                   const loom_model_config_t **cfg_out,
                   loom_local_t **l_out) {
    loom_err_t err = {0};
    loom_local_options_t lo = {.model_dir = model, .n_threads = threads, .chunk = n_prompt,
                               .ctx = n_prompt + n_gen + 1, .weight_dtype = wdt, .quant = *q, .no_tokenizer = 1,
                               .kv_cache_dtype = kv_cache_dtype};
    loom_local_t *l = NULL;
    if (loom_local_open(&lo, &l, &err) < 0) {
        fprintf(stderr, "bench_decode: %s: %s\n", scheme, err.msg);
        return 1;
    }
    const loom_model_config_t *c = loom_local_config(l);
    int32_t *prompt = loom_xmalloc((size_t)n_prompt * sizeof *prompt);
    for (int i = 0; i < n_prompt; i++) prompt[i] = 3 + (int32_t)((i * 7919u) % (unsigned)(c->vocab_size - 3));
    /* Bytes streamed per decoded token: every matmul weight (codes, scales
     * and mins as stored) and norm once; of the embedding only one row. */
    double norms = (2.0 * c->n_layers + 1) * c->dim * 4.0;
    res->wbytes = (double)loom_model_matmul_bytes(loom_local_model(l)) + norms;
    snprintf(res->scheme, sizeof res->scheme, "%.23s", scheme);
    res->prefill = res->decode = 0;
    loom_sampling_t greedy = {.temperature = 0};
    for (int rep = 0; rep < reps; rep++) {
        loom_gen_stats_t st;
        if (loom_local_generate(l, prompt, n_prompt, n_gen, &greedy, 1, NULL, NULL, NULL, &st, &err) < 0) {
            fprintf(stderr, "bench_decode: %s\n", err.msg);
            free(prompt);
            loom_local_close(&l);
            return 1;
        }
        double pre = st.prompt_tokens / st.prefill_s, dec = (st.gen_tokens - 1) / st.decode_s;
        if (pre > res->prefill) res->prefill = pre;
        if (dec > res->decode) res->decode = dec;
    }
    res->achieved = res->wbytes * res->decode / 1e9;
    free(prompt);
    *cfg_out = c;
    *l_out = l;
    return 0;
}

int main(int argc, char **argv) {
    loom_log_init("bench_decode");
    const char *model = NULL, *dtype = "f32", *json = NULL, *schemes = "none";
    const char *kv_cache_dtype = "auto";
    int threads = 2, n_prompt = 256, n_gen = 64, reps = 3;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR", "model directory (e.g. from tests/reference/gen_model.py)", 1, 0, NULL},
        {"threads", LOOM_OPT_INT, &threads, "N", "CPU threads (default 2)", 1, 256, NULL},
        {"prompt", LOOM_OPT_INT, &n_prompt, "N", "prompt tokens for the prefill measurement (default 256)", 1, 1e6, NULL},
        {"tokens", LOOM_OPT_INT, &n_gen, "N", "decode tokens (default 64)", 2, 1e6, NULL},
        {"reps", LOOM_OPT_INT, &reps, "N", "repetitions, best is reported (default 3)", 1, 100, NULL},
        {"dtype", LOOM_OPT_STR, &dtype, "TYPE", "weight storage f32, bf16, f16 (default f32)", 1, 0, NULL},
        {"quantization", LOOM_OPT_STR, &schemes, "LIST", "comma-separated schemes measured in this run, each against the first, e.g. none,int8,q4 (default none)", 1, 0, NULL},
        {"kv-cache-dtype", LOOM_OPT_STR, &kv_cache_dtype, "TYPE", "KV cache elements: auto, f32, bf16, int8 (default auto)", 1, 0, NULL},
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
    enum { MAX_SCHEMES = 8 };
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
    result_t res[MAX_SCHEMES];
    const loom_model_config_t *c = NULL;
    loom_local_t *l = NULL;
    double params = 0;
    FILE *jf = json ? fopen(json, "w") : NULL;
    if (jf) fprintf(jf, "[");
    for (int i = 0; i < n; i++) {
        if (measure(model, names[i], &specs[i], wdt, kv_cache_dtype, threads, n_prompt, n_gen, reps, &res[i], &c, &l)) return 1;
        /* the triad right after each scheme: the machine's load drifts during a run */
        double triad = loom_bench_triad_gbs(threads);
        if (i == 0) {
            /* matmul parameters: two FLOPs each per token */
            double qkv = (double)(c->n_heads + 2 * c->n_kv_heads) * c->head_dim * c->dim;
            double o = (double)c->n_heads * c->head_dim * c->dim, mlp = 3.0 * c->dim * c->hidden_dim;
            params = c->n_layers * (qkv + o + mlp) + (double)c->vocab_size * c->dim;
            printf("model: %s (%.1fM matmul parameters, dim %d, %d layers, %d/%d heads, vocab %d), %s, %d threads\n",
                   model, params / 1e6, c->dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size, dtype,
                   threads);
        }
        result_t *x = &res[i];
        printf("%-10s prefill %8.1f tok/s (%6.1f GFLOP/s, %.2fx)  decode %7.2f tok/s (%.2fx), %7.1f MB/token, "
               "%6.2f GB/s, triad %.2f GB/s, MBU %.2f\n",
               x->scheme, x->prefill, x->prefill * 2.0 * params / 1e9, x->prefill / res[0].prefill, x->decode,
               x->decode / res[0].decode, x->wbytes / 1e6, x->achieved, triad, x->achieved / triad);
        if (jf)
            fprintf(jf,
                    "%s{\"model\":\"%s\",\"dtype\":\"%s\",\"quantization\":\"%s\",\"threads\":%d,"
                    "\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f,\"weight_bytes_per_token\":%.0f,"
                    "\"achieved_gbs\":%.3f,\"triad_gbs\":%.3f,\"mbu\":%.4f,\"prefill_ratio\":%.4f,"
                    "\"decode_ratio\":%.4f}",
                    i ? "," : "", model, dtype, x->scheme, threads, x->prefill, x->decode, x->wbytes, x->achieved,
                    triad, x->achieved / triad, x->prefill / res[0].prefill, x->decode / res[0].decode);
        loom_local_close(&l);
    }
    if (jf) {
        fprintf(jf, "]\n");
        fclose(jf);
    }
    return 0;
}
