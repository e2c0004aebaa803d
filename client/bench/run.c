/* The bench's run loop: one thread submits each request when its arrival
 * time comes (and a --max-concurrency slot is free) and polls the
 * transport for chunks in between; at the deadline what is left fails
 * and is cancelled. Requests wait in a heap by arrival time; a chat's
 * later turn enters it only when the turn before it has ended (its
 * arrival is then that end plus the think time), so turn k + 1 is never
 * sent before turn k finished, and its prompt holds turn k's answer. */
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

/* ---- the pending heap: rec indices by (t_arrival, index) ---- */

typedef struct pending {
    int *ix, n;
    const bench_rec_t *recs;
} pending_t;

static int before(const pending_t *h, int a, int b) {
    double x = h->recs[a].t_arrival, y = h->recs[b].t_arrival;
    return x < y || (x == y && a < b);
}

static void pending_push(pending_t *h, int i) {
    int k = h->n++;
    h->ix[k] = i;
    while (k > 0 && before(h, h->ix[k], h->ix[(k - 1) / 2])) {
        int p = (k - 1) / 2, x = h->ix[p];
        h->ix[p] = h->ix[k];
        h->ix[k] = x;
        k = p;
    }
}

static int pending_pop(pending_t *h) {
    int top = h->ix[0];
    h->ix[0] = h->ix[--h->n];
    for (int k = 0;;) {
        int l = 2 * k + 1, r = l + 1, m = k;
        if (l < h->n && before(h, h->ix[l], h->ix[m])) m = l;
        if (r < h->n && before(h, h->ix[r], h->ix[m])) m = r;
        if (m == k) break;
        int x = h->ix[m];
        h->ix[m] = h->ix[k];
        h->ix[k] = x;
        k = m;
    }
    return top;
}

/* recs[i] has ended: the next turn of its chat, if any, becomes due. */
static void turn_ended(pending_t *h, bench_rec_t *recs, int n, int i) {
    if (i + 1 >= n || recs[i + 1].item->turn == 0) return;
    recs[i + 1].t_arrival = recs[i].t_end + recs[i + 1].item->think_s;
    pending_push(h, i + 1);
}

/* a, b, c in a row, a space between two where neither side has one */
static char *join_text(const char *a, const char *b, const char *c) {
    loom_sbuf_t s = {0};
    const char *part[3] = {a, b, c};
    for (int k = 0; k < 3; k++) {
        if (!part[k] || !part[k][0]) continue;
        if (s.len && s.p[s.len - 1] != ' ' && s.p[s.len - 1] != '\n' && part[k][0] != ' ' &&
            part[k][0] != '\n')
            loom_sbuf_add(&s, " ", 1);
        loom_sbuf_str(&s, part[k]);
    }
    if (!s.p) loom_sbuf_add(&s, "", 0);
    return s.p;
}

int bench_turn_prompt(bench_rec_t *q, int text) {
    const bench_rec_t *prev = q - 1;
    const bench_item_t *it = q->item;
    LOOM_ASSERT(it->turn > 0 && prev->item->session == it->session);
    if (prev->state != 2 || prev->status != LOOM_OK) return -1;
    if (text) {
        free(q->sent_text);
        q->sent_text =
            join_text(prev->sent_text ? prev->sent_text : prev->item->text, prev->text, it->text);
        return 0;
    }
    if (prev->tokens_seen > 0 && prev->n_ids != prev->tokens_seen) return -1; /* ids unknown */
    const int32_t *pp = prev->sent_ids ? prev->sent_ids : prev->item->ids;
    int np = prev->sent_ids ? prev->n_sent : prev->item->n_ids;
    free(q->sent_ids);
    q->n_sent = np + prev->n_ids + it->n_ids;
    q->sent_ids = loom_xmalloc((size_t)LOOM_MAX(q->n_sent, 1) * sizeof *q->sent_ids);
    memcpy(q->sent_ids, pp, (size_t)np * sizeof *pp);
    if (prev->n_ids) memcpy(q->sent_ids + np, prev->ids, (size_t)prev->n_ids * sizeof *prev->ids);
    memcpy(q->sent_ids + np + prev->n_ids, it->ids, (size_t)it->n_ids * sizeof *it->ids);
    return 0;
}

static void on_event(bench_rec_t *q, const bench_event_t *ev, double now) {
    if (ev->n_tokens > 0 && ev->ids) {
        if (q->n_ids + ev->n_tokens > q->cap_ids) {
            q->cap_ids = LOOM_MAX(2 * q->cap_ids, q->n_ids + ev->n_tokens + 64);
            q->ids = loom_xrealloc(q->ids, (size_t)q->cap_ids * sizeof *q->ids);
        }
        memcpy(q->ids + q->n_ids, ev->ids, (size_t)ev->n_tokens * sizeof *ev->ids);
        q->n_ids += ev->n_tokens;
    }
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
        q->cached_tokens = ev->cached_tokens;
        q->timings = ev->timings;
        q->has_timings = ev->has_timings;
        finish_rec(q, now, ev->status, ev->status == LOOM_OK ? NULL : ev->message);
    }
}

void bench_recs_reset(bench_rec_t *recs, int n) {
    for (int i = 0; i < n; i++) {
        free(recs[i].chunk_t);
        free(recs[i].text);
        free(recs[i].ids);
        free(recs[i].sent_ids);
        free(recs[i].sent_text);
        recs[i] = (bench_rec_t){.item = recs[i].item, .t_arrival = recs[i].t_arrival};
    }
}

loom_status_t bench_run(const bench_transport_t *t, const bench_run_cfg_t *cfg, bench_rec_t *recs,
                        int n, int *peak, double *duration, loom_err_t *err) {
    int in_flight = 0, done = 0, n_hix = 0, text = t->needs_text || cfg->text_prompts;
    handle_ix_t *hix = loom_xmalloc((size_t)LOOM_MAX(n, 1) * sizeof *hix);
    pending_t due = {loom_xmalloc((size_t)LOOM_MAX(n, 1) * sizeof *due.ix), 0, recs};
    for (int i = 0; i < n; i++)
        if (recs[i].item->turn == 0) pending_push(&due, i);
    double t0 = loom_now_s();
    loom_status_t st = LOOM_OK;
    *peak = 0;
    while (done < n) {
        double now = loom_now_s() - t0;
        if (t0 + now >= cfg->deadline) break;
        while (due.n > 0 && recs[due.ix[0]].t_arrival <= now &&
               (!cfg->max_concurrency || in_flight < cfg->max_concurrency)) {
            int i = pending_pop(&due);
            bench_rec_t *q = &recs[i];
            const bench_item_t *it = q->item;
            char session[48];
            snprintf(session, sizeof session, "bench-%llu-%d", (unsigned long long)cfg->seed,
                     it->session);
            q->t_send = loom_now_s() - t0;
            if (it->turn > 0 && bench_turn_prompt(q, text) < 0) {
                int failed = q[-1].status != LOOM_OK;
                finish_rec(q, q->t_send, failed ? q[-1].status : LOOM_ERR_INVALID_ARGUMENT,
                           failed
                               ? "not sent: the chat's previous turn failed"
                               : "not sent: the previous answer came back without its token ids");
                done++;
                turn_ended(&due, recs, n, i);
                continue;
            }
            const char *ptext = text || !it->ids ? q->sent_text ? q->sent_text : it->text : NULL;
            bench_req_t br = {.prompt_ids = q->sent_ids ? q->sent_ids : it->ids,
                              .n_prompt = q->sent_ids ? q->n_sent : it->n_ids,
                              .prompt_text = ptext,
                              .max_tokens = it->output_len,
                              .temperature = cfg->temperature,
                              .seed = cfg->seed + (uint64_t)i + 1,
                              .ignore_eos = cfg->ignore_eos,
                              .session = cfg->chat ? session : NULL};
            loom_err_t serr = {0};
            if (t->submit(t->self, &br, &q->handle, &serr) < 0) {
                finish_rec(q, q->t_send, serr.code, NULL);
                snprintf(q->msg, sizeof q->msg, "%.299s", serr.msg); /* already names the status */
                done++;
                turn_ended(&due, recs, n, i);
                continue;
            }
            q->state = 1;
            q->cached_tokens = -1;
            hix[n_hix++] = (handle_ix_t){q->handle, i};
            in_flight++;
            *peak = LOOM_MAX(*peak, in_flight);
        }
        double wait = 0.05;
        if (due.n > 0 && (!cfg->max_concurrency || in_flight < cfg->max_concurrency))
            wait = LOOM_MIN(wait, recs[due.ix[0]].t_arrival - now);
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
            turn_ended(&due, recs, n, i);
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
    free(due.ix);
    free(hix);
    return st;
}
