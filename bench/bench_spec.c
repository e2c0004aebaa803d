/* The cost of a speculative verify step: one forward over K+1 tokens of one
 * sequence (K+1 logit rows) relative to a one-token decode step, at a given
 * context, on one process. At batch 1 both read every weight once, so the
 * ratio stays near 1 while the step is memory-bound; from it and an
 * acceptance rate a the expected speed-up of speculation is
 * E(K) / cost(K), E(K) = (1 - a^(K+1)) / (1 - a) tokens per target step
 * (docs/speculative.md). Use a model larger than the L3 cache
 * (tests/reference/gen_model.py) for figures that carry over to big models.
 *
 *   bench_spec --model DIR [--threads 2] [--context 128] [--kmax 8] [--reps 15]
 *              [--acceptance 0.3,0.5,0.7] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/util.h"
#include "worker/local.h"

enum { MAX_K = LOOM_SPEC_MAX_K, MAX_REPS = 200, BLOCK = 16 };

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const char *model = NULL, *acc_list = "0.3,0.5,0.7,0.9";
    int threads = 0, context = 128, kmax = 8, reps = 15;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR", "model directory (a generated one needs no tokenizer)", 1, 0, NULL},
        {"threads", LOOM_OPT_INT, &threads, "N", "CPU threads (default: all cores)", 0, 1024, NULL},
        {"context", LOOM_OPT_INT, &context, "N", "tokens already in the KV cache (default 128)", 1, 1 << 20, NULL},
        {"kmax", LOOM_OPT_INT, &kmax, "K", "largest K measured (default 8)", 1, MAX_K, NULL},
        {"reps", LOOM_OPT_INT, &reps, "N", "timed steps per K (median reported, default 15)", 1, MAX_REPS, NULL},
        {"acceptance", LOOM_OPT_STR, &acc_list, "A,B", "per-token acceptance rates for the expected speed-up", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "bench_spec --model DIR [options]",
                           "Times a verify step of K+1 tokens against a one-token decode step.");
    if (r) return r < 0 ? 2 : 0;
    if (!model) {
        fprintf(stderr, "bench_spec: --model is required\n");
        return 2;
    }
    loom_log_set_level(LOOM_LOG_WARN);
    loom_err_t err = {0};
    int ctx = context + kmax + 2;
    loom_local_options_t lo = {.model_dir = model, .n_threads = threads, .chunk = 256, .ctx = ctx, .no_tokenizer = 1};
    loom_local_t *l = NULL;
    if (loom_local_open(&lo, &l, &err) < 0) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return 1;
    }
    const loom_model_config_t *c = loom_local_config(l);
    ctx = loom_local_ctx(l);
    if (context + kmax + 1 > ctx) {
        fprintf(stderr, "bench_spec: the model's context (%d) is too short for --context %d\n", ctx, context);
        return 2;
    }
    int32_t *toks = loom_xmalloc((size_t)ctx * sizeof *toks);
    for (int i = 0; i < ctx; i++) toks[i] = (int32_t)(1 + (i * 7919) % (c->vocab_size - 1));
    float *logits = loom_xmalloc((size_t)context * c->vocab_size * sizeof(float));
    if (loom_local_logits(l, toks, context, logits, &err) < 0) { /* KV of positions [0, context) */
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return 1;
    }
    loom_model_t *m = loom_local_model(l);
    int max_blocks = (ctx + BLOCK - 1) / BLOCK;
    int32_t *bt = loom_xmalloc((size_t)max_blocks * sizeof *bt), pos[MAX_K + 1], seq[MAX_K + 1] = {0},
            rows[MAX_K + 1];
    for (int i = 0; i < max_blocks; i++) bt[i] = i; /* the local engine's identity block table */
    double t_step[MAX_K + 2] = {0};
    printf("model %s: dim %d, %d layers, vocab %d, %.1f MB of matmul weights; context %d\n", model, c->dim,
           c->n_layers, c->vocab_size, (double)loom_model_matmul_bytes(m) / 1e6, context);
    printf("%4s %10s %8s\n", "K", "step ms", "cost");
    /* rounds interleave every K, so the machine's load hits all of them alike */
    static double t[MAX_K + 1][MAX_REPS];
    for (int rep = -2; rep < reps; rep++) /* two warm-up rounds */
        for (int k = 0; k <= kmax; k++) {
            int n = k + 1;
            for (int i = 0; i < n; i++) {
                pos[i] = context + i;
                rows[i] = i;
            }
            loom_step_batch_t b = {.n_tokens = n, .tokens = toks + context, .pos = pos, .slots = pos,
                                   .tok_seq = seq, .n_seqs = 1, .block_tables = bt, .max_blocks = max_blocks,
                                   .n_logits = n, .logit_rows = rows};
            uint64_t t0 = loom_now_ns();
            if (loom_model_forward(m, &b, &err) < 0) {
                fprintf(stderr, "bench_spec: %s\n", err.msg);
                return 1;
            }
            loom_model_download_logits(m, logits, n); /* the rows the sampler reads */
            if (rep >= 0) t[k][rep] = (double)(loom_now_ns() - t0) * 1e-9;
        }
    for (int k = 0; k <= kmax; k++) {
        qsort(t[k], (size_t)reps, sizeof(double), cmp_dbl);
        t_step[k] = t[k][reps / 2];
        printf("%4d %10.3f %8.3f\n", k, t_step[k] * 1e3, t_step[k] / t_step[0]);
    }
    printf("\nexpected speed-up E(K)/cost(K) at per-token acceptance a:\n%6s", "a");
    for (int k = 1; k <= kmax; k++) printf("  K=%-4d", k);
    printf("\n");
    char *list = loom_xstrdup(acc_list), *save = NULL;
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        double a = atof(tok);
        if (a < 0 || a > 1) continue;
        printf("%6.2f", a);
        for (int k = 1; k <= kmax; k++) printf("  %6.2f", loom_spec_expected_tokens(a, k) / (t_step[k] / t_step[0]));
        printf("\n");
    }
    free(list);
    free(bt);
    free(toks);
    free(logits);
    loom_local_close(&l);
    return 0;
}
