/* Cost of one scheduler iteration (build a micro-batch, complete it) with
 * many running decode sequences, the steady state of a busy server. The
 * model's work is not included: ids are made up. Target: < 50 us at 256.
 *
 *   bench_sched [--seqs 256] [--ctx 512] [--iters 2000] [--block-size 16] */
#include <stdio.h>
#include <stdlib.h>

#include "common/cli.h"
#include "common/util.h"
#include "coordinator/sched.h"

static int g_finished;
static void on_token(void *ctx, loom_seq_t *q, int32_t id) {
    (void)id;
    loom_sched_t *s = ctx;
    if (q->n_tokens - q->n_prompt >= q->max_tokens) {
        loom_sched_finish(s, q);
        g_finished++;
    }
}

int main(int argc, char **argv) {
    int n_seqs = 256, ctx = 512, iters = 2000, bs = 16;
    loom_opt_t opts[] = {
        {"seqs", LOOM_OPT_INT, &n_seqs, "N", "running sequences (default 256)", 1, 65536, NULL},
        {"ctx", LOOM_OPT_INT, &ctx, "N", "prompt length of each sequence (default 512)", 1, 1 << 20, NULL},
        {"iters", LOOM_OPT_INT, &iters, "N", "measured iterations (default 2000)", 1, 1 << 24, NULL},
        {"block-size", LOOM_OPT_INT, &bs, "N", "KV block size (default 16)", 1, 1024, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, 4, "bench_sched [options]",
                           "Microseconds per scheduler iteration with N running decode sequences.");
    if (r) return r < 0 ? 2 : 0;
    int max_len = ctx + iters + 1100;
    loom_sched_config_t cfg = {.max_num_seqs = n_seqs, .max_batched_tokens = n_seqs * 2 > 8192 ? n_seqs * 2 : 8192,
                               .max_queue = n_seqs, .max_model_len = max_len, .n_micro = 1, .block_size = bs,
                               .n_blocks = n_seqs * ((max_len + bs - 1) / bs + 1), .prefix_cache = 1};
    loom_sched_t *s = loom_sched_create(&cfg);
    int32_t *prompt = loom_xmalloc((size_t)ctx * sizeof *prompt);
    loom_sampling_t sp = {.temperature = 0};
    for (int i = 0; i < n_seqs; i++) {
        for (int j = 0; j < ctx; j++) prompt[j] = 3 + (int32_t)((i * 7919 + j * 31) % 30000); /* distinct prompts */
        loom_seq_t *q;
        loom_err_t err;
        if (loom_sched_add(s, (uint64_t)i, prompt, ctx, iters + 1000, 0, &sp, NULL, &q, &err) < 0) {
            fprintf(stderr, "bench_sched: %s\n", err.msg);
            return 1;
        }
    }
    int32_t *ids = loom_xmalloc((size_t)n_seqs * sizeof *ids);
    for (int i = 0; i < n_seqs; i++) ids[i] = 7;
    /* admit and prefill everyone (not measured) */
    loom_microbatch_t *mb;
    int guard = 0;
    for (;;) {
        loom_sched_stats_t st;
        loom_sched_get_stats(s, &st);
        mb = loom_sched_schedule(s);
        if (!mb || guard++ > 100000) break;
        int all_decode = st.waiting == 0 && mb->n_tokens == mb->n_seqs;
        loom_sched_complete(s, mb, ids, on_token, s);
        if (all_decode) break;
    }
    double best = 1e30, total = 0;
    long tokens = 0;
    for (int it = 0; it < iters; it++) {
        uint64_t t0 = loom_now_ns();
        mb = loom_sched_schedule(s);
        if (!mb) break;
        int n = mb->n_tokens;
        loom_sched_complete(s, mb, ids, on_token, s);
        double us = (double)(loom_now_ns() - t0) * 1e-3;
        tokens += n;
        total += us;
        if (us < best) best = us;
    }
    loom_sched_stats_t st;
    loom_sched_get_stats(s, &st);
    printf("scheduler: %d running sequences, prompt %d, block %d: %.2f us per iteration (best %.2f), "
           "%.0f tokens per iteration, %.3f us per scheduled token\n",
           st.running, ctx, bs, total / iters, best, (double)tokens / iters, total / (double)tokens);
    free(ids);
    free(prompt);
    loom_sched_destroy(&s);
    return 0;
}
