/* The parts of `loom bench` that need no server (client/bench/bench.h):
 * summaries against numbers worked by hand (numpy's percentile, population
 * standard deviation), goodput under objectives, arrival times (rate,
 * normalisation, burstiness), the datasets (lengths, prefixes shared,
 * ShareGPT files good and bad, multi-turn chats), and the run loop on a fake
 * transport: a chat's turn carries the answers received and never goes
 * before the turn ahead of it ended. */
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>

#include "client/bench/bench.h"
#include "common/util.h"
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

static void test_multiturn_dataset(void) {
    char msg[512];
    bench_item_t *it = NULL;
    bench_ds_cfg_t mt = {.kind = BENCH_DS_MULTITURN, .num_requests = 12, .vocab = 500, .seed = 3,
                         .sessions = 4, .turns = 3, .system_len = 16, .num_system = 2, .user_len = 5,
                         .output_len = 7, .think_s = 0.25};
    REQUIRE(bench_dataset_load(&mt, &it, msg, sizeof msg) == 0);
    int shape_ok = 1, systems = 0;
    for (int i = 0; i < 12; i++) {
        shape_ok &= it[i].session == i / 3 && it[i].turn == i % 3 && it[i].output_len == 7;
        shape_ok &= it[i].n_ids == (it[i].turn == 0 ? 21 : 5) && it[i].prompt_len == it[i].n_ids;
        shape_ok &= it[i].turn == 0 ? it[i].think_s == 0 : it[i].think_s >= 0;
        if (it[i].turn) continue;
        int same = 0; /* sessions share one of the two system prompts */
        for (int j = 0; j < i && !same; j += 3) same = !memcmp(it[i].ids, it[j].ids, 16 * sizeof(int32_t));
        systems += !same;
    }
    CHECKF(shape_ok && systems >= 1 && systems <= 2, "systems %d", systems);
    bench_dataset_free(it, 12);
    bench_ds_cfg_t bad = mt;
    bad.num_system = 0;
    CHECK(bench_dataset_load(&bad, &it, msg, sizeof msg) < 0 && strstr(msg, "multiturn needs"));
    bench_dataset_free(it, 12);
    bad = mt;
    bad.turns = BENCH_MAX_TURNS + 1;
    bad.num_requests = bad.sessions * bad.turns;
    CHECK(bench_dataset_load(&bad, &it, msg, sizeof msg) < 0);
    bench_dataset_free(it, bad.num_requests);
}

/* The next turn's prompt: the previous prompt, its answer ids, the new user tokens; text likewise. */
static void test_turn_prompt(void) {
    int32_t sys_user[] = {10, 11, 12}, user2[] = {20, 21}, ans[] = {90, 91, 92};
    bench_item_t it[2] = {{.ids = sys_user, .n_ids = 3, .text = "a b c", .session = 1, .turn = 0},
                          {.ids = user2, .n_ids = 2, .text = "d e", .session = 1, .turn = 1}};
    bench_rec_t r[2] = {{.item = &it[0], .state = 2, .status = LOOM_OK, .tokens_seen = 3, .n_ids = 3},
                        {.item = &it[1]}};
    r[0].ids = ans;
    r[0].text = "x y z";
    REQUIRE(bench_turn_prompt(&r[1], 0) == 0);
    const int32_t want[] = {10, 11, 12, 90, 91, 92, 20, 21};
    CHECKF(r[1].n_sent == 8 && !memcmp(r[1].sent_ids, want, sizeof want), "n_sent %d", r[1].n_sent);
    REQUIRE(bench_turn_prompt(&r[1], 1) == 0);
    CHECKF(!strcmp(r[1].sent_text, "a b c x y z d e"), "'%s'", r[1].sent_text);
    free(r[1].sent_ids);
    free(r[1].sent_text);
    r[1].sent_ids = NULL, r[1].sent_text = NULL;
    r[0].n_ids = 1; /* ids lost on the way: no prompt in ids */
    CHECK(bench_turn_prompt(&r[1], 0) < 0 && !r[1].sent_ids);
    r[0].n_ids = 3;
    r[0].status = LOOM_ERR_UNAVAILABLE; /* the previous turn failed */
    CHECK(bench_turn_prompt(&r[1], 0) < 0 && bench_turn_prompt(&r[1], 1) < 0);
}

/* A fake server: it answers each request with out tokens, one chunk per
 * poll, taking turns among the requests in flight, and says as cached the
 * part of a prompt it saw for the session before. It checks each
 * session's turns come one at a time and resend what came back. */
#define FAKE_MAX 64
#define FAKE_LEN 512
typedef struct fake_req {
    uint64_t handle;
    int session, n_prompt, out, sent, live;
    int32_t prompt[FAKE_LEN], answer[FAKE_LEN];
} fake_req_t;
typedef struct fake {
    fake_req_t req[FAKE_MAX];
    int n, next_poll, overlaps, prefix_bad, no_session;
    int fail_session; /* > 0: refuse the second turn of session fail_session - 1 */
    int busy[8], finished[8], n_seen[8];
    int32_t seen[8][FAKE_LEN]; /* the session's last prompt and answer */
    int32_t id_out;
} fake_t;

static loom_status_t fake_submit(void *self, const bench_req_t *r, uint64_t *handle, loom_err_t *err) {
    fake_t *f = self;
    if (f->n >= FAKE_MAX || r->n_prompt > FAKE_LEN)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: over the fake's size");
    const char *dash = r->session ? strrchr(r->session, '-') : NULL;
    if (!dash) {
        f->no_session++;
        dash = "-0";
    }
    int s = atoi(dash + 1) % 8;
    if (f->fail_session == s + 1 && f->finished[s] == 1)
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "UNAVAILABLE: refused");
    f->overlaps += f->busy[s];
    f->busy[s] = 1;
    if (f->finished[s] && (r->n_prompt <= f->n_seen[s] ||
                           memcmp(r->prompt_ids, f->seen[s], (size_t)f->n_seen[s] * sizeof(int32_t))))
        f->prefix_bad++;
    fake_req_t *q = &f->req[f->n++];
    *q = (fake_req_t){.handle = (uint64_t)f->n, .session = s, .n_prompt = r->n_prompt, .out = r->max_tokens,
                      .live = 1};
    memcpy(q->prompt, r->prompt_ids, (size_t)r->n_prompt * sizeof *q->prompt);
    *handle = q->handle;
    return LOOM_OK;
}

static loom_status_t fake_poll(void *self, int timeout_ms, bench_event_t *ev, int *got, loom_err_t *err) {
    (void)timeout_ms, (void)err;
    fake_t *f = self;
    *got = 0;
    for (int k = 0; k < f->n; k++) {
        fake_req_t *q = &f->req[(f->next_poll + k) % f->n];
        if (!q->live) continue;
        f->next_poll = (int)(q - f->req) + 1;
        *ev = (bench_event_t){.handle = q->handle, .cached_tokens = -1};
        if (q->sent < q->out) {
            f->id_out = (int32_t)(3 + (q->handle * 7 + (uint64_t)q->sent) % 50);
            q->answer[q->sent++] = f->id_out;
            ev->n_tokens = 1;
            ev->ids = &f->id_out;
        } else {
            int s = q->session;
            ev->final = 1;
            ev->status = LOOM_OK;
            ev->prompt_tokens = q->n_prompt;
            ev->completion_tokens = q->out;
            ev->cached_tokens = f->finished[s] ? f->n_seen[s] : 0;
            q->live = 0;
            f->busy[s] = 0;
            f->finished[s]++;
            memcpy(f->seen[s], q->prompt, (size_t)q->n_prompt * sizeof(int32_t));
            memcpy(f->seen[s] + q->n_prompt, q->answer, (size_t)q->out * sizeof(int32_t));
            f->n_seen[s] = q->n_prompt + q->out;
        }
        *got = 1;
        return LOOM_OK;
    }
    return LOOM_OK;
}

static loom_status_t fake_cancel(void *self, uint64_t handle, loom_err_t *err) {
    (void)self, (void)handle, (void)err;
    return LOOM_OK;
}

static void test_multiturn_run(void) {
    char msg[512];
    bench_item_t *it = NULL;
    enum { S = 4, T = 3 };
    bench_ds_cfg_t mt = {.kind = BENCH_DS_MULTITURN, .num_requests = S * T, .vocab = 100, .seed = 5,
                         .sessions = S, .turns = T, .system_len = 8, .num_system = 1, .user_len = 3,
                         .output_len = 4, .think_s = 0};
    REQUIRE(bench_dataset_load(&mt, &it, msg, sizeof msg) == 0);
    fake_t *f = calloc(1, sizeof *f);
    REQUIRE(f);
    bench_transport_t t = {.name = "fake", .self = f, .submit = fake_submit, .poll = fake_poll,
                           .cancel = fake_cancel};
    bench_rec_t recs[S * T] = {{0}};
    for (int i = 0; i < S * T; i++) recs[i] = (bench_rec_t){.item = &it[i]};
    bench_run_cfg_t cfg = {.num_requests = S * T, .ignore_eos = 1, .seed = 5, .deadline = loom_now_s() + 30,
                           .chat = 1};
    int peak = 0;
    double duration = 0;
    loom_err_t err = {0};
    REQUIRE(bench_run(&t, &cfg, recs, S * T, &peak, &duration, &err) == LOOM_OK);
    CHECKF(f->n == S * T && !f->overlaps && !f->prefix_bad && !f->no_session, "sent %d, overlaps %d, prefix %d",
           f->n, f->overlaps, f->prefix_bad);
    CHECKF(peak == S, "peak %d: one turn per session in flight, all sessions at once", peak);
    int order_ok = 1, len_ok = 1;
    for (int i = 0; i < S * T; i++) {
        const bench_rec_t *q = &recs[i];
        order_ok &= q->status == LOOM_OK && q->n_ids == 4;
        if (it[i].turn == 0) continue;
        order_ok &= q->t_send >= q[-1].t_end;
        len_ok &= q->n_sent == 8 + 3 + it[i].turn * (4 + 3); /* system + user, then (answer + user) per turn */
    }
    CHECK(order_ok && len_ok);
    bench_result_t res = {0};
    bench_compute(recs, S * T, duration, NULL, 0, NULL, &res);
    CHECKF(res.completed == S * T && res.n_turns == T && res.turns[0].completed == S && res.turns[2].completed == S,
           "completed %d, turns %d", res.completed, res.n_turns);
    CHECKF(res.turns[0].cached_frac == 0 && res.turns[1].cached_frac > 0.5 && res.turns[2].cached_frac > 0.6,
           "cached %g %g %g", res.turns[0].cached_frac, res.turns[1].cached_frac, res.turns[2].cached_frac);
    CHECK(res.turns[1].prompt_mean == 18 && res.n_cached_said == S * T && res.cached_tokens > 0);
    bench_recs_reset(recs, S * T);

    /* a failed turn fails the rest of its chat unsent */
    memset(f, 0, sizeof *f);
    f->fail_session = 3;
    for (int i = 0; i < S * T; i++) recs[i] = (bench_rec_t){.item = &it[i]};
    cfg.deadline = loom_now_s() + 30;
    REQUIRE(bench_run(&t, &cfg, recs, S * T, &peak, &duration, &err) == LOOM_OK);
    int ok = 0;
    for (int i = 0; i < S * T; i++) ok += recs[i].status == LOOM_OK;
    CHECKF(ok == S * T - 2 && recs[2 * T].status == LOOM_OK && recs[2 * T + 1].status == LOOM_ERR_UNAVAILABLE &&
               recs[2 * T + 2].status == LOOM_ERR_UNAVAILABLE && strstr(recs[2 * T + 2].msg, "previous turn failed"),
           "ok %d: %s / %s", ok, recs[2 * T + 1].msg, recs[2 * T + 2].msg);
    CHECK(f->n == S * T - 2 && !f->overlaps && !f->prefix_bad);
    bench_recs_reset(recs, S * T);
    free(f);
    bench_dataset_free(it, S * T);
}

int main(void) {
    RUN(test_summarize);
    RUN(test_compute_and_goodput);
    RUN(test_arrivals);
    RUN(test_datasets);
    RUN(test_multiturn_dataset);
    RUN(test_turn_prompt);
    RUN(test_multiturn_run);
    return test_summary();
}
