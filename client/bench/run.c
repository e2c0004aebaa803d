/* The bench's run loop: one thread submits each request when its arrival
 * time comes (and a --max-concurrency slot is free) and polls the
 * transport for chunks in between; at the deadline what is left fails
 * and is cancelled. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/bench/bench.h"
#include "common/util.h"

typedef struct handle_ix {
    uint64_t handle;
    int index;
} handle_ix_t;

/* handles are handed out in increasing order, so the index stays sorted */
static int find_handle(const handle_ix_t *h, int n, uint64_t handle) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (h[mid].handle == handle) return h[mid].index;
        if (h[mid].handle < handle)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

static void finish_rec(bench_rec_t *q, double now, loom_status_t status, const char *msg) {
    q->state = 2;
    q->t_end = now;
    q->status = status;
    snprintf(q->msg, sizeof q->msg, "%s%s%.280s", loom_status_str(status),
             msg && msg[0] ? ": " : "", msg ? msg : "");
}

static void on_event(bench_rec_t *q, const bench_event_t *ev, double now) {
    if (ev->n_tokens > 0) {
        if (!q->tokens_seen) q->t_first = now;
        q->tokens_seen += ev->n_tokens;
        if (q->n_chunks == q->cap_chunks) {
            q->cap_chunks = q->cap_chunks ? 2 * q->cap_chunks : 64;
            q->chunk_t = loom_xrealloc(q->chunk_t, (size_t)q->cap_chunks * sizeof *q->chunk_t);
        }
        q->chunk_t[q->n_chunks++] = now;
    }
    if (ev->text && ev->text_len) {
        if (q->text_len + ev->text_len + 1 > q->text_cap) {
            q->text_cap = (q->text_len + ev->text_len + 1) * 2;
            q->text = loom_xrealloc(q->text, q->text_cap);
        }
        memcpy(q->text + q->text_len, ev->text, ev->text_len);
        q->text_len += ev->text_len;
        q->text[q->text_len] = '\0';
    }
    if (ev->final) {
        q->prompt_tokens = ev->prompt_tokens;
        q->completion_tokens = ev->completion_tokens;
        q->timings = ev->timings;
        q->has_timings = ev->has_timings;
        finish_rec(q, now, ev->status, ev->status == LOOM_OK ? NULL : ev->message);
    }
}

void bench_recs_reset(bench_rec_t *recs, int n) {
    for (int i = 0; i < n; i++) {
        free(recs[i].chunk_t);
        free(recs[i].text);
        recs[i] = (bench_rec_t){.item = recs[i].item, .t_arrival = recs[i].t_arrival};
    }
}

loom_status_t bench_run(const bench_transport_t *t, const bench_run_cfg_t *cfg, bench_rec_t *recs,
                        int n, int *peak, double *duration, loom_err_t *err) {
    int next = 0, in_flight = 0, done = 0, n_hix = 0;
    handle_ix_t *hix = loom_xmalloc((size_t)LOOM_MAX(n, 1) * sizeof *hix);
    double t0 = loom_now_s();
    loom_status_t st = LOOM_OK;
    *peak = 0;
    while (done < n) {
        double now = loom_now_s() - t0;
        if (t0 + now >= cfg->deadline) break;
        while (next < n && recs[next].t_arrival <= now &&
               (!cfg->max_concurrency || in_flight < cfg->max_concurrency)) {
            bench_rec_t *q = &recs[next++];
            const bench_item_t *it = q->item;
            bench_req_t br = {.prompt_ids = it->ids,
                              .n_prompt = it->n_ids,
                              .prompt_text = t->needs_text || !it->ids ? it->text : NULL,
                              .max_tokens = it->output_len,
                              .temperature = cfg->temperature,
                              .seed = cfg->seed + (uint64_t)next,
                              .ignore_eos = cfg->ignore_eos};
            loom_err_t serr = {0};
            q->t_send = loom_now_s() - t0;
            if (t->submit(t->self, &br, &q->handle, &serr) < 0) {
                finish_rec(q, q->t_send, serr.code, NULL);
                snprintf(q->msg, sizeof q->msg, "%.299s", serr.msg); /* already names the status */
                done++;
                continue;
            }
            q->state = 1;
            hix[n_hix++] = (handle_ix_t){q->handle, (int)(q - recs)};
            in_flight++;
            *peak = LOOM_MAX(*peak, in_flight);
        }
        double wait = 0.05;
        if (next < n && (!cfg->max_concurrency || in_flight < cfg->max_concurrency))
            wait = LOOM_MIN(wait, recs[next].t_arrival - now);
        wait = LOOM_MIN(wait, cfg->deadline - (t0 + now));
        int wait_ms = wait > 0 ? (int)ceil(wait * 1000) : 0;
        bench_event_t ev;
        int got = 0;
        if ((st = t->poll(t->self, wait_ms, &ev, &got, err)) < 0) goto out;
        if (!got) continue;
        int i = find_handle(hix, n_hix, ev.handle);
        if (i < 0 || recs[i].state != 1) continue; /* left over from an earlier run */
        on_event(&recs[i], &ev, loom_now_s() - t0);
        if (recs[i].state == 2) {
            in_flight--;
            done++;
        }
    }
    double end = loom_now_s() - t0;
    *duration = 0;
    for (int i = 0; i < n; i++) {
        bench_rec_t *q = &recs[i];
        if (q->state == 2) {
            *duration = LOOM_MAX(*duration, q->t_end);
            continue;
        }
        if (q->state == 1) t->cancel(t->self, q->handle, NULL);
        finish_rec(q, end, LOOM_ERR_DEADLINE_EXCEEDED,
                   q->state == 1 ? "unfinished at the --timeout-s limit"
                                 : "not sent before the --timeout-s limit");
        *duration = end;
    }
    /* Give the cancels a moment to leave and their streams to end. */
    double grace_end = loom_now_s() + 1.0;
    for (int left = in_flight; left > 0 && loom_now_s() < grace_end;) {
        bench_event_t ev;
        int got = 0;
        if (t->poll(t->self, 100, &ev, &got, NULL) < 0) break;
        if (got && ev.final && find_handle(hix, n_hix, ev.handle) >= 0) left--;
    }
out:
    free(hix);
    return st;
}
