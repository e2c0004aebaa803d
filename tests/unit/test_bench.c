/* The parts of `loom bench` that need no server (client/bench/bench.h):
 * summaries against numbers worked by hand (numpy's percentile, population
 * standard deviation), goodput under objectives, arrival times (rate,
 * normalisation, burstiness), and the datasets (lengths, prefixes shared,
 * ShareGPT files good and bad). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "client/bench/bench.h"
#include "tests/test.h"

static void test_summarize(void) {
    double x[] = {4, 1, 3, 2, 10};
    double pcts[] = {25, 99.9};
    bench_stat_t s = bench_summarize(x, 5, pcts, 2);
    CHECK(s.n == 5 && fabs(s.mean - 4.0) < 1e-12 && fabs(s.median - 3.0) < 1e-12);
    /* numpy: std([1,2,3,4,10]) = sqrt(10) ; percentile(.., 25) = 2 ; percentile(.., 99.9) = 9.976 */
    CHECKF(fabs(s.std - sqrt(10.0)) < 1e-12, "%g", s.std);
    CHECKF(fabs(s.pct[0] - 2.0) < 1e-12 && fabs(s.pct[1] - 9.976) < 1e-9, "%g %g", s.pct[0], s.pct[1]);
    CHECKF(fabs(s.p90 - 7.6) < 1e-12 && fabs(s.p99 - 9.76) < 1e-12, "%g %g", s.p90, s.p99);
    bench_stat_t e = bench_summarize(x, 0, pcts, 2);
    CHECK(e.n == 0 && isnan(e.mean) && isnan(e.std) && isnan(e.pct[0]));
}

/* Three requests: 1 token, 3 tokens fast, 3 tokens slow; one failure. */
static void test_compute_and_goodput(void) {
    bench_item_t it = {.prompt_len = 4, .output_len = 3};
    double c1[] = {0.10}, c2[] = {0.05, 0.06, 0.07}, c3[] = {0.50, 0.70, 0.90};
    bench_rec_t r[4] = {
        {.item = &it, .t_send = 0, .t_first = 0.10, .t_end = 0.10, .chunk_t = c1, .n_chunks = 1, .tokens_seen = 1,
         .completion_tokens = 1, .prompt_tokens = 4, .status = LOOM_OK},
        {.item = &it, .t_send = 0, .t_first = 0.05, .t_end = 0.07, .chunk_t = c2, .n_chunks = 3, .tokens_seen = 3,
         .status = LOOM_OK},
        {.item = &it, .t_send = 0.1, .t_first = 0.50, .t_end = 0.90, .chunk_t = c3, .n_chunks = 3, .tokens_seen = 3,
         .completion_tokens = 3, .prompt_tokens = 5, .status = LOOM_OK},
        {.item = &it, .t_send = 0.2, .t_end = 0.3, .status = LOOM_ERR_UNAVAILABLE, .msg = "UNAVAILABLE: gone"},
    };
    double pcts[] = {50};
    bench_goodput_t slo = {.ttft_ms = 200, .tpot_ms = 50, .e2el_ms = -1, .any = 1};
    bench_result_t res = {0};
    bench_compute(r, 4, 1.0, pcts, 1, &slo, &res);
    CHECK(res.completed == 3 && res.failed == 1 && res.n_error_kinds == 1 && res.error_counts[0] == 1);
    CHECK(res.out_tokens == 7 && res.in_tokens == 4 + 4 + 5); /* the second has no usage: its item's length */
    /* TTFT 100, 50, 400 ms; TPOT (70-50)/2 = 10 and (800-400)/2 = 200 ms */
    CHECKF(fabs(res.ttft.mean - 550.0 / 3) < 1e-9 && fabs(res.tpot.median - 105) < 1e-9, "%g %g", res.ttft.mean,
           res.tpot.median);
    CHECKF(res.itl.n == 4 && fabs(res.itl.mean - 105) < 1e-9, "%g", res.itl.mean); /* 10, 10, 200, 200 */
    /* good: the first (TPOT 0) and the second; the third misses both */
    CHECKF(res.good == 2 && fabs(res.goodput_per_s - 2.0) < 1e-12, "%d", res.good);
    CHECK(res.max_concurrent_requests == 2 && res.max_output_tokens_per_s == 7);
    bench_result_t none = {0};
    bench_goodput_t off = {-1, -1, -1, 0};
    bench_compute(r, 4, 1.0, pcts, 1, &off, &none);
    CHECK(none.good == 0);
}

static void test_arrivals(void) {
    enum { N = 2000 };
    static double t[N], u[N];
    bench_arrivals(N, 50, 1, 3, t);
    CHECKF(t[0] == 0 && fabs(t[N - 1] - N / 50.0) < 1e-9, "last at %g", t[N - 1]);
    int sorted = 1;
    for (int i = 1; i < N; i++) sorted &= t[i] >= t[i - 1];
    CHECK(sorted);
    /* the spread of gaps: coefficient of variation 1/sqrt(burstiness) */
    double cv[3], b[3] = {0.25, 1, 16};
    for (int k = 0; k < 3; k++) {
        bench_arrivals(N, 50, b[k], 9, u);
        double m = u[N - 1] / (N - 1), v = 0;
        for (int i = 1; i < N; i++) v += (u[i] - u[i - 1] - m) * (u[i] - u[i - 1] - m);
        cv[k] = sqrt(v / (N - 1)) / m;
        CHECKF(fabs(cv[k] - 1 / sqrt(b[k])) < 0.15 / sqrt(b[k]), "burstiness %g: CV %g", b[k], cv[k]);
    }
    bench_arrivals(5, INFINITY, 1, 3, u);
    CHECK(u[0] == 0 && u[4] == 0);
}

static void test_datasets(void) {
    char msg[512];
    bench_item_t *it = NULL;
    bench_ds_cfg_t rnd = {.kind = BENCH_DS_RANDOM, .num_requests = 50, .vocab = 100, .seed = 1, .input_len = 10,
                          .output_len = 5, .input_range = 0.4f, .output_range = 0.4f, .want_text = 1};
    CHECK(bench_dataset_load(&rnd, &it, msg, sizeof msg) == 0);
    int lo = 99, hi = 0, ids_ok = 1;
    for (int i = 0; i < 50; i++) {
        lo = it[i].n_ids < lo ? it[i].n_ids : lo;
        hi = it[i].n_ids > hi ? it[i].n_ids : hi;
        for (int k = 0; k < it[i].n_ids; k++) ids_ok &= it[i].ids[k] >= 3 && it[i].ids[k] < 100;
        int words = 1;
        for (const char *p = it[i].text; *p; p++) words += *p == ' ';
        ids_ok &= words == it[i].n_ids && it[i].output_len >= 3 && it[i].output_len <= 7;
    }
    CHECKF(lo == 6 && hi == 14 && ids_ok, "lengths %d..%d", lo, hi);
    bench_dataset_free(it, 50);

    bench_ds_cfg_t pre = {.kind = BENCH_DS_PREFIX_REPETITION, .num_requests = 20, .vocab = 1000, .seed = 2,
                          .prefix_len = 32, .suffix_len = 4, .num_prefixes = 2, .output_len = 3};
    CHECK(bench_dataset_load(&pre, &it, msg, sizeof msg) == 0);
    int distinct = 1;
    for (int i = 1; i < 20; i++) {
        int same = 0;
        for (int j = 0; j < i && !same; j++) same = !memcmp(it[i].ids, it[j].ids, 32 * sizeof(int32_t));
        distinct += !same;
    }
    CHECK(distinct == 2 && it[0].n_ids == 36 && it[0].output_len == 3 && !it[0].text);
    bench_dataset_free(it, 20);

    char path[] = "/tmp/loom_test_bench_ds_XXXXXX";
    int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    const char *good = "[{\"conversations\": [{\"from\": \"human\", \"value\": \"hi there\"}, "
                       "{\"from\": \"gpt\", \"value\": \"0123456789abcdef\"}]}, {\"conversations\": []}]";
    REQUIRE(write(fd, good, strlen(good)) == (ssize_t)strlen(good));
    close(fd);
    bench_ds_cfg_t sg = {.kind = BENCH_DS_SHAREGPT, .num_requests = 3, .path = path, .seed = 1};
    CHECK(bench_dataset_load(&sg, &it, msg, sizeof msg) == 0);
    CHECK(!strcmp(it[2].text, "hi there") && it[2].output_len == 4 && it[2].prompt_len == 2 && !it[2].ids);
    bench_dataset_free(it, 3);
    const char *bad[] = {"{not json", "{\"a\": 1}", "[{\"conversations\": [{\"value\": \"only\"}]}]"};
    const char *want[] = {"is not JSON", "not a list", "no conversation"};
    for (int k = 0; k < 3; k++) {
        FILE *f = fopen(path, "w");
        REQUIRE(f);
        fputs(bad[k], f);
        fclose(f);
        CHECKF(bench_dataset_load(&sg, &it, msg, sizeof msg) < 0 && strstr(msg, want[k]), "%s: %s", bad[k], msg);
        bench_dataset_free(it, 3);
    }
    unlink(path);
    CHECK(bench_dataset_load(&sg, &it, msg, sizeof msg) < 0 && strstr(msg, "cannot read"));
    bench_dataset_free(it, 3);
}

int main(void) {
    RUN(test_summarize);
    RUN(test_compute_and_goodput);
    RUN(test_arrivals);
    RUN(test_datasets);
    return test_summary();
}
