/* Decode and prefill throughput of one process on a generated model, with
 * the machine's memory bandwidth measured in the same run (STREAM triad):
 * batch-1 decode is memory-bound, so MBU = weight bytes per token x tokens/s
 * over the triad bandwidth says how close the engine is to the roofline.
 *
 *   bench_decode --model DIR [--threads 2] [--prompt 256] [--tokens 64] [--dtype f32] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/membw.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "worker/local.h"

int main(int argc, char **argv) {
    loom_log_init("bench_decode");
    const char *model = NULL, *dtype = "f32", *json = NULL;
    const char *kv_cache_dtype = "auto";
    int threads = 2, n_prompt = 256, n_gen = 64, reps = 3;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR", "model directory (e.g. from tests/reference/gen_model.py)", 1, 0, NULL},
        {"threads", LOOM_OPT_INT, &threads, "N", "CPU threads (default 2)", 1, 256, NULL},
        {"prompt", LOOM_OPT_INT, &n_prompt, "N", "prompt tokens for the prefill measurement (default 256)", 1, 1e6, NULL},
        {"tokens", LOOM_OPT_INT, &n_gen, "N", "decode tokens (default 64)", 2, 1e6, NULL},
        {"reps", LOOM_OPT_INT, &reps, "N", "repetitions, best is reported (default 3)", 1, 100, NULL},
        {"dtype", LOOM_OPT_STR, &dtype, "TYPE", "weight storage f32, bf16, f16 (default f32)", 1, 0, NULL},
        {"kv-cache-dtype", LOOM_OPT_STR, &kv_cache_dtype, "TYPE", "KV cache elements: auto, f32, bf16, int8 (default auto)", 1, 0, NULL},
        {"json", LOOM_OPT_STR, &json, "FILE", "also write the results as JSON", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "bench_decode --model DIR [options]",
                           "Prefill and batch-1 decode tokens/s, and MBU against a STREAM triad.");
    if (r) return r < 0 ? 2 : 0;
    if (!model) {
        fprintf(stderr, "bench_decode: --model is required\n");
        return 2;
    }
    loom_dtype_t wdt = !strcmp(dtype, "bf16") ? LOOM_DT_BF16 : !strcmp(dtype, "f16") ? LOOM_DT_F16 : LOOM_DT_F32;
    loom_log_set_level(LOOM_LOG_WARN);
    loom_err_t err = {0};
    loom_local_options_t lo = {.model_dir = model, .n_threads = threads, .chunk = n_prompt,
                               .ctx = n_prompt + n_gen + 1, .weight_dtype = wdt, .no_tokenizer = 1,
                               .kv_cache_dtype = kv_cache_dtype};
    loom_local_t *l = NULL;
    if (loom_local_open(&lo, &l, &err) < 0) {
        fprintf(stderr, "bench_decode: %s\n", err.msg);
        return 1;
    }
    const loom_model_config_t *c = loom_local_config(l);
    int32_t *prompt = loom_xmalloc((size_t)n_prompt * sizeof *prompt);
    for (int i = 0; i < n_prompt; i++) prompt[i] = 3 + (int32_t)((i * 7919u) % (unsigned)(c->vocab_size - 3));
    /* Bytes streamed per decoded token: every matmul weight and norm once; of
     * the embedding table only one row. */
    double emb = (double)c->vocab_size * c->dim * 4.0;
    double wbytes = (double)loom_model_weight_bytes(loom_local_model(l)) - emb;
    double best_pre = 0, best_dec = 0;
    loom_sampling_t greedy = {.temperature = 0};
    for (int rep = 0; rep < reps; rep++) {
        loom_gen_stats_t st;
        if (loom_local_generate(l, prompt, n_prompt, n_gen, &greedy, 1, NULL, NULL, NULL, &st, &err) < 0) {
            fprintf(stderr, "bench_decode: %s\n", err.msg);
            return 1;
        }
        double pre = st.prompt_tokens / st.prefill_s, dec = (st.gen_tokens - 1) / st.decode_s;
        if (pre > best_pre) best_pre = pre;
        if (dec > best_dec) best_dec = dec;
    }
    double triad = loom_bench_triad_gbs(threads);
    double achieved = wbytes * best_dec / 1e9;
    double params = (double)loom_model_weight_bytes(loom_local_model(l)) / (wdt == LOOM_DT_F32 ? 4.0 : 2.0);
    printf("model: %s (%.1fM parameters, dim %d, %d layers, %d/%d heads, vocab %d), %s weights, %d threads\n",
           model, params / 1e6, c->dim, c->n_layers, c->n_heads, c->n_kv_heads, c->vocab_size, dtype, threads);
    printf("prefill: %d tokens, %.1f tokens/s (%.1f GFLOP/s)\n", n_prompt, best_pre, best_pre * 2.0 * params / 1e9);
    printf("decode:  %.2f tokens/s, %.1f MB of weights per token, %.2f GB/s achieved\n", best_dec, wbytes / 1e6,
           achieved);
    printf("triad:   %.2f GB/s (same run) -> MBU %.2f\n", triad, achieved / triad);
    if (json) {
        FILE *f = fopen(json, "w");
        if (f) {
            fprintf(f,
                    "{\"model\":\"%s\",\"dtype\":\"%s\",\"threads\":%d,\"prefill_tok_s\":%.3f,"
                    "\"decode_tok_s\":%.3f,\"weight_bytes_per_token\":%.0f,\"achieved_gbs\":%.3f,"
                    "\"triad_gbs\":%.3f,\"mbu\":%.4f}\n",
                    model, dtype, threads, best_pre, best_dec, wbytes, achieved, triad, achieved / triad);
            fclose(f);
        }
    }
    free(prompt);
    loom_local_close(&l);
    return 0;
}
