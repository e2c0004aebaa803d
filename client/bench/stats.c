/* The bench's statistics: latency summaries (mean, median, standard
 * deviation, percentiles by linear interpolation between ranks, as numpy
 * has them), throughput, goodput under service-level objectives (vLLM's
 * rule: a request is good when it meets every objective given; TPOT is 0
 * for a request of one token) and the server's stage breakdown. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

#include "client/bench/bench.h"
#include "common/util.h"

const char *const bench_stage_names[BENCH_ST_COUNT] = {"tokenize",   "queue", "prefill", "decode",
                                                       "detokenize", "send",  "ttft"};

static double stage_ms(const loom_timings_t *t, int st) {
    switch (st) {
    case BENCH_ST_TOKENIZE:
        return t->tokenize_ms;
    case BENCH_ST_QUEUE:
        return t->queue_ms;
    case BENCH_ST_PREFILL:
        return t->prefill_ms;
    case BENCH_ST_DECODE:
        return t->decode_ms;
    case BENCH_ST_DETOKENIZE:
        return t->detokenize_ms;
    case BENCH_ST_SEND:
        return t->send_ms;
    default:
        return t->ttft_ms;
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(const double *sorted, int n, double q) {
    double pos = q * (n - 1);
    int lo = (int)floor(pos), hi = LOOM_MIN(lo + 1, n - 1);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

bench_stat_t bench_summarize(double *x, int n, const double *pcts, int n_pcts) {
    bench_stat_t s = {
        .n = n, .mean = NAN, .median = NAN, .std = NAN, .p50 = NAN, .p90 = NAN, .p99 = NAN};
    for (int k = 0; k < BENCH_MAX_PCT; k++)
        s.pct[k] = NAN;
    if (n == 0) return s;
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    double sum = 0, sq = 0;
    for (int i = 0; i < n; i++)
        sum += x[i];
    s.mean = sum / n;
    for (int i = 0; i < n; i++)
        sq += (x[i] - s.mean) * (x[i] - s.mean);
    s.std = sqrt(sq / n);
    s.median = s.p50 = percentile(x, n, 0.50);
    s.p90 = percentile(x, n, 0.90);
    s.p99 = percentile(x, n, 0.99);
    for (int k = 0; k < n_pcts && k < BENCH_MAX_PCT; k++)
        s.pct[k] = percentile(x, n, pcts[k] / 100.0);
    return s;
}

static void add_error(bench_result_t *res, const char *msg) {
    for (int k = 0; k < res->n_error_kinds; k++)
        if (!strcmp(res->errors[k], msg)) {
            res->error_counts[k]++;
            return;
        }
    if (res->n_error_kinds == BENCH_MAX_ERROR_KINDS) return;
    snprintf(res->errors[res->n_error_kinds], sizeof res->errors[0], "%s", msg);
    res->error_counts[res->n_error_kinds++] = 1;
}

static int cmp_edge(const void *a,
                    const void *b) { /* (time, +1/-1): a departure before an arrival */
    const double *x = a, *y = b;
    if (x[0] != y[0]) return (x[0] > y[0]) - (x[0] < y[0]);
    return (x[1] > y[1]) - (x[1] < y[1]);
}

/* The busiest second's output tokens and the most requests in flight at once (completed ones). */
static void peaks(const bench_rec_t *recs, int n, bench_result_t *res) {
    double t_min = INFINITY, t_max = 0;
    int n_ok = 0;
    for (int i = 0; i < n; i++)
        if (recs[i].status == LOOM_OK) {
            t_min = LOOM_MIN(t_min, recs[i].t_send);
            t_max = LOOM_MAX(t_max, recs[i].t_end);
            n_ok++;
        }
    if (!n_ok) return;
    int secs = (int)ceil(t_max - t_min) + 1;
    double *tok = loom_xcalloc((size_t)secs, sizeof *tok),
           *edges = loom_xmalloc((size_t)n_ok * 4 * sizeof *edges);
    int ne = 0;
    for (int i = 0; i < n; i++) {
        const bench_rec_t *q = &recs[i];
        if (q->status != LOOM_OK) continue;
        for (int k = 0; k < q->n_chunks; k++) {
            int b = (int)(q->chunk_t[k] - t_min);
            if (b >= 0 && b < secs) tok[b] += 1;
        }
        edges[2 * ne] = q->t_send, edges[2 * ne + 1] = 1, ne++;
        edges[2 * ne] = q->t_end, edges[2 * ne + 1] = -1, ne++;
    }
    for (int b = 0; b < secs; b++)
        res->max_output_tokens_per_s = LOOM_MAX(res->max_output_tokens_per_s, tok[b]);
    qsort(edges, (size_t)ne, 2 * sizeof *edges, cmp_edge);
    int cur = 0;
    for (int e = 0; e < ne; e++) {
        cur += (int)edges[2 * e + 1];
        res->max_concurrent_requests = LOOM_MAX(res->max_concurrent_requests, cur);
    }
    free(tok);
    free(edges);
}

/* Prompt tokens a request sent: the server's count, else ours. */
static int sent_len(const bench_rec_t *q) {
    if (q->prompt_tokens > 0) return q->prompt_tokens;
    if (q->sent_ids) return q->n_sent;
    if (q->sent_text) return LOOM_MAX(1, (int)((strlen(q->sent_text) + 3) / 4));
    return q->item->prompt_len;
}

/* Multiturn: completions, prompt length, prefix-cache share and TTFT per turn. */
static void per_turn(const bench_rec_t *recs, int n, bench_result_t *res) {
    for (int i = 0; i < n; i++)
        if (recs[i].item->turn > 0) res->n_turns = LOOM_MAX(res->n_turns, recs[i].item->turn + 1);
    if (res->n_turns > BENCH_MAX_TURNS) res->n_turns = BENCH_MAX_TURNS;
    double *ttft = loom_xmalloc((size_t)(n + 1) * sizeof *ttft);
    for (int k = 0; k < res->n_turns; k++) {
        struct bench_turn_stat *ts = &res->turns[k];
        long long prompt = 0, cached = 0, said_prompt = 0;
        int m = 0, said = 0;
        for (int i = 0; i < n; i++) {
            const bench_rec_t *q = &recs[i];
            if (q->item->turn != k) continue;
            if (q->status != LOOM_OK) {
                ts->failed++;
                continue;
            }
            ts->completed++;
            prompt += sent_len(q);
            if (q->cached_tokens >= 0) {
                cached += q->cached_tokens;
                said_prompt += sent_len(q);
                said++;
            }
            if (q->n_chunks > 0) ttft[m++] = (q->t_first - q->t_send) * 1e3;
        }
        ts->prompt_mean = ts->completed ? (double)prompt / ts->completed : NAN;
        ts->cached_frac = said && said_prompt ? (double)cached / (double)said_prompt : NAN;
        bench_stat_t s = bench_summarize(ttft, m, NULL, 0);
        ts->ttft_p50 = s.p50;
        ts->ttft_p99 = s.p99;
    }
    free(ttft);
}

void bench_compute(const bench_rec_t *recs, int n, double duration, const double *pcts, int n_pcts,
                   const bench_goodput_t *slo, bench_result_t *res) {
    size_t n_itl = 0;
    for (int i = 0; i < n; i++)
        if (recs[i].status == LOOM_OK && recs[i].n_chunks > 1)
            n_itl += (size_t)recs[i].n_chunks - 1;
    double *ttft = loom_xmalloc((size_t)(n + 1) * sizeof *ttft),
           *tpot = loom_xmalloc((size_t)(n + 1) * sizeof *tpot);
    double *e2e = loom_xmalloc((size_t)(n + 1) * sizeof *e2e),
           *itl = loom_xmalloc((n_itl + 1) * sizeof *itl);
    int n_ttft = 0, n_tpot = 0, n_e2e = 0;
    n_itl = 0;
    res->n = n;
    res->duration_s = duration;
    for (int i = 0; i < n; i++) {
        const bench_rec_t *q = &recs[i];
        if (q->status != LOOM_OK) {
            res->failed++;
            add_error(res, q->msg);
            continue;
        }
        res->completed++;
        int out = q->completion_tokens > 0 ? q->completion_tokens : q->tokens_seen;
        res->out_tokens += out;
        res->in_tokens += sent_len(q);
        if (q->cached_tokens >= 0) {
            res->cached_tokens += q->cached_tokens;
            res->n_cached_said++;
        }
        double e = (q->t_end - q->t_send) * 1e3, f = -1, tp = 0;
        e2e[n_e2e++] = e;
        if (q->n_chunks > 0) {
            f = (q->t_first - q->t_send) * 1e3;
            ttft[n_ttft++] = f;
            if (out > 1) tpot[n_tpot++] = tp = (e - f) / (out - 1);
        }
        for (int k = 1; k < q->n_chunks; k++)
            itl[n_itl++] = (q->chunk_t[k] - q->chunk_t[k - 1]) * 1e3;
        if (slo && slo->any && (slo->ttft_ms < 0 || (f >= 0 && f <= slo->ttft_ms)) &&
            (slo->tpot_ms < 0 || tp <= slo->tpot_ms) && (slo->e2el_ms < 0 || e <= slo->e2el_ms))
            res->good++;
    }
    double *st = loom_xmalloc((size_t)(n + 1) * sizeof *st);
    for (int k = 0; k < BENCH_ST_COUNT; k++) {
        int m = 0;
        for (int i = 0; i < n; i++)
            if (recs[i].status == LOOM_OK && recs[i].has_timings)
                st[m++] = stage_ms(&recs[i].timings, k);
        res->stages[k] = bench_summarize(st, m, pcts, n_pcts);
    }
    free(st);
    res->ttft = bench_summarize(ttft, n_ttft, pcts, n_pcts);
    res->tpot = bench_summarize(tpot, n_tpot, pcts, n_pcts);
    res->itl = bench_summarize(itl, (int)n_itl, pcts, n_pcts);
    res->e2e = bench_summarize(e2e, n_e2e, pcts, n_pcts);
    if (duration > 0) {
        res->req_per_s = res->completed / duration;
        res->goodput_per_s = res->good / duration;
        res->out_tok_per_s = (double)res->out_tokens / duration;
        res->total_tok_per_s = (double)(res->in_tokens + res->out_tokens) / duration;
    }
    peaks(recs, n, res);
    per_turn(recs, n, res);
    free(ttft);
    free(tpot);
    free(e2e);
    free(itl);
}
