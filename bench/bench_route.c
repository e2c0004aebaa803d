/* The router's decision cost against the number of replicas: hashing a
 * prompt's blocks, matching them in the prefix index, recording the routing
 * history and scoring every candidate (router/prefix_index.c), the parts of
 * a decision that grow with the prompt or the replicas. Sockets, protobuf
 * and tokenizing are not in it (bench/bench_router.sh measures the whole).
 * The index holds at most 64 replicas (one bit each); the score alone is
 * timed up to 4096 candidates. tools/sim uses the per-candidate slope.
 *
 *   bench_route [--prompt 2048] [--iters 20000] */
#include <stdio.h>
#include <stdlib.h>

#include "common/cli.h"
#include "common/util.h"
#include "router/prefix_index.h"

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int main(int argc, char **argv) {
    int prompt = 2048, iters = 20000;
    loom_opt_t opts[] = {
        {"prompt", LOOM_OPT_INT, &prompt, "N", "prompt tokens (default 2048: 128 blocks of 16)", 16, 1 << 20, NULL},
        {"iters", LOOM_OPT_INT, &iters, "N", "decisions timed per point (default 20000)", 1, 1 << 24, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, 2, "bench_route [options]",
                           "Microseconds per routing decision's index and score work against the replica count.");
    if (r) return r < 0 ? 2 : 0;
    const int B = 16, nb = prompt / B, n_prompts = 64;
    uint64_t seed = 7;
    int32_t *ids = loom_xmalloc((size_t)n_prompts * (size_t)prompt * sizeof *ids);
    for (size_t i = 0; i < (size_t)n_prompts * (size_t)prompt; i++)
        ids[i] = (int32_t)(rng_next(&seed) % 32000);
    for (int p = 1; p < n_prompts; p++) /* prompts share their first half (a system prompt) */
        for (int i = 0; i < prompt / 2; i++)
            ids[(size_t)p * prompt + i] = ids[i];
    uint64_t *h = loom_xmalloc((size_t)nb * sizeof *h);
    printf("%8s %12s %12s %12s %12s %14s\n", "replicas", "hash us", "match us", "insert us", "score us",
           "per decision");
    int reps[] = {4, 16, 64, 256, 1024, 4096};
    for (size_t k = 0; k < sizeof reps / sizeof *reps; k++) {
        int n = reps[k], n_ix = n < LOOM_PREFIX_MAX_REPLICAS ? n : LOOM_PREFIX_MAX_REPLICAS;
        loom_prefix_index_t *ix = loom_prefix_index_create(1 << 18);
        loom_route_cand_t *c = loom_xcalloc((size_t)n, sizeof *c);
        int *match = loom_xcalloc(LOOM_PREFIX_MAX_REPLICAS, sizeof *match);
        for (int i = 0; i < n; i++)
            c[i] = (loom_route_cand_t){.usable = 1, .inflight = i % 7, .inflight_tokens = 1000 + (i * 37) % 5000,
                                       .waiting = i % 3, .kv_usage = 0.5};
        uint64_t t_hash = 0, t_match = 0, t_ins = 0, t_score = 0;
        volatile int sink = 0;
        for (int it = 0; it < iters; it++) {
            const int32_t *pr = ids + (size_t)(it % n_prompts) * prompt;
            uint64_t t0 = loom_now_ns();
            int nh = loom_prefix_hashes(pr, prompt, B, h, nb);
            uint64_t t1 = loom_now_ns();
            loom_prefix_index_match(ix, h, nh, match, n_ix);
            uint64_t t2 = loom_now_ns();
            for (int i = 0; i < n; i++)
                c[i].matched_blocks = i < n_ix ? match[i] : 0;
            int pick = loom_route_pick_prefix(c, n, prompt, B, 1.0, (unsigned)it);
            uint64_t t3 = loom_now_ns();
            loom_prefix_index_insert(ix, h, nh, pick % n_ix);
            uint64_t t4 = loom_now_ns();
            c[pick].inflight_tokens += prompt;
            sink += pick;
            t_hash += t1 - t0;
            t_match += t2 - t1;
            t_score += t3 - t2;
            t_ins += t4 - t3;
        }
        double us = 1e-3 / iters;
        printf("%8d %12.2f %12.2f %12.2f %12.2f %11.2f us\n", n, t_hash * us, t_match * us, t_ins * us, t_score * us,
               (t_hash + t_match + t_ins + t_score) * us);
        (void)sink;
        free(c);
        free(match);
        loom_prefix_index_destroy(&ix);
    }
    printf("(%d-token prompts, %d blocks of %d; match and insert over at most %d replicas)\n", prompt, nb, B,
           LOOM_PREFIX_MAX_REPLICAS);
    free(h);
    free(ids);
    return 0;
}
