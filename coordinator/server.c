/* The coordinator's reactor (see server.h).
 *
 * Grid lifecycle (state):
 *   WAITING   slots not all filled; workers register into free slots
 *   LOADING   every slot filled; Assign sent (epoch e); waiting for Loaded
 *   JOINING   KV pool sized (smallest worker decides); KvConfig sent; waiting for Ready
 *   READY     serving: the step loop runs, requests are admitted
 * A lost worker (missed heartbeats) or a failed step aborts epoch e: workers
 * are told to stop waiting on the data plane, the slot (if lost) is freed,
 * and the grid goes back to WAITING or LOADING with epoch e+1. When every
 * slot is still filled (the data plane failed, not a heartbeat), each
 * member's data-plane listener is probed first (WAITING with probes out): a
 * member whose port refuses or does not answer within PROBE_MS is dead and
 * its slot is freed at once, so the next plan never includes it. Workers keep
 * their weights when the new Assign gives them the same shard. Requests are
 * not lost: their sequences keep their tokens and wait (their KV dropped)
 * until the grid is READY again, then are re-prefilled and their streams go
 * on; if the grid is not back within --recovery-timeout-ms they end with
 * UNAVAILABLE.
 *
 * Draining (the first SIGTERM/SIGINT): new Generate requests are refused
 * with UNAVAILABLE ("draining"), Health reports not ready, requests in
 * flight go on; the reactor returns once none is left, or at
 * --shutdown-timeout, when the rest end with a final chunk (finish
 * LENGTH). A second signal returns at once.
 *
 * Requests: Generate is tokenized here and queued in the scheduler; each
 * sampled token is detokenized, checked against EOS/stop tokens/stop
 * strings/max_tokens and streamed back as one chunk. A client whose
 * connection is gone (ROUTER reports it unreachable) has its request
 * cancelled. Each request keeps the times of its stages (arrival, queued,
 * admitted, first and last token; time spent detokenizing and sending):
 * the final chunk carries them as Timings and /metrics gets one histogram
 * per stage. Log lines about a request name its tag (X-Request-Id). */
#include "coordinator/server.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <pthread.h>
#include <zmq.h>

#include <cjson/cJSON.h>

#include "common/etcd.h"
#include "common/log.h"
#include "common/model_config.h"
#include "common/tokenizer.h"
#include "common/util.h"
#include "common/shard.h"
#include "coordinator/kv_events.h"
#include "coordinator/metrics.h"
#include "coordinator/sched.h"
#include "coordinator/stop.h"
#include "proto/wire.h"

#define MAX_STOP 8
#define MAX_STOP_IDS 64
#define MAX_TAG 128
#define MAX_STOP_LEN 256
#define RATE_WINDOW 8 /* seconds of tokens/s history */
#define PROBE_MS 1000  /* a member's data-plane listener that does not answer a connect this long is gone */

typedef enum { GRID_WAITING, GRID_LOADING, GRID_JOINING, GRID_READY } grid_state_t;
static const char *grid_state_name[] = {"waiting_for_workers", "loading", "joining", "ready"};

typedef struct worker_slot {
    int used;
    char id[128], host[128], host_id[128], device[32], data_addr[128];
    uint32_t pid;
    uint64_t last_seen_ns;
    int loaded, ready;
    uint64_t kv_block_bytes, kv_budget, weight_bytes, bytes_read;
    char kv_dtype[16]; /* the worker's KV pool dtype, from Loaded */
    uint8_t nccl_tp_id[128], nccl_next_id[128]; /* group ids this worker made (nccl) */
    size_t nccl_tp_len, nccl_next_len;
    double busy_s, comm_s;
    uint64_t steps;
} worker_slot_t;

typedef struct request {
    uint8_t rid[256]; /* client routing id */
    size_t rid_len;
    uint64_t request_id;
    loom_seq_t *seq;
    loom_detok_t detok;
    char *stop[MAX_STOP];
    int n_stop, max_stop_len;
    char *pending; /* text held back while it may begin a stop string */
    size_t n_pending, cap_pending;
    int32_t stop_ids[MAX_STOP_IDS]; /* stop_token_ids */
    int n_stop_ids;
    int ignore_eos, max_tokens, prompt_tokens, completion_tokens;
    char tag[MAX_TAG + 1]; /* the caller's id, for log lines ("" if none) */
    uint64_t t_arrival, t_queued, t_last_token; /* loom_now_ns() */
    uint64_t tokenize_ns, detok_ns, send_ns;    /* time spent in each, summed */
    struct request *prev, *next;
} request_t;

typedef struct inflight {
    loom_microbatch_t *mb;
    uint64_t step_id, t_sent;
} inflight_t;

/* A worker key that left etcd, handed from the watch thread to the reactor. */
typedef struct gone_key {
    char id[128];
    struct gone_key *next;
} gone_key_t;

struct loom_server {
    loom_server_config_t cfg;
    char model_dir_abs[4096];
    char model_name[256];
    loom_model_config_t mcfg;
    loom_tokenizer_t *tok;
    int max_model_len;

    void *zctx, *api, *ctl;
    char api_addr[256], ctl_addr[256], inproc_addr[64];
    volatile sig_atomic_t stop, drain_requested; /* set by loom_server_stop (signal handlers) */
    int draining;
    uint64_t drain_deadline;
    int probing;   /* probes of the members' data planes are out (state WAITING) */
    int *probe_fd; /* per slot: a probe's socket, -1: none */
    uint64_t probe_deadline;

    worker_slot_t *slots;
    int n_slots;
    grid_state_t state;
    uint64_t epoch, run_id;
    int n_blocks;
    char kv_dtype[16];       /* the workers' KV dtype ("mixed" if they differ) */
    uint64_t kv_block_bytes; /* the largest worker's bytes per block */
    char last_failure[512];

    loom_sched_t *sched;
    loom_metrics_t *metrics;
    inflight_t *inflight; /* FIFO, n_micro entries */
    int n_inflight;
    request_t *reqs; /* doubly linked list of live requests */
    int n_reqs;
    size_t max_piece;
    char *text_buf;
    uint64_t seed_state;

    /* step plan scratch */
    Loom__V1__SampleParams *sp;
    Loom__V1__SampleParams **sp_ptrs;

    /* counters */
    uint64_t steps, requests_finished, requests_rejected, prompt_tokens_total, gen_tokens_total;
    uint64_t prefix_queries_base, prefix_hits_base, preemptions_base; /* from schedulers of earlier epochs */
    double step_s_total;
    uint64_t rate_tokens[RATE_WINDOW];
    uint64_t rate_second;
    uint64_t last_hb_sent, last_check;
    uint64_t recovery_deadline; /* requests wait for the grid until then (0: none waiting) */

    /* etcd membership (optional) */
    loom_etcd_t *etcd;
    loom_etcd_keeper_t *etcd_keeper;
    loom_kv_events_t *kv_events; /* --kv-events publisher (NULL: off) */
    loom_etcd_watch_t *etcd_watch;
    pthread_mutex_t gone_mu;
    gone_key_t *gone;
    char etcd_prefix[300];
};

/* ---- small helpers ---------------------------------------------------------- */

static void *zsock(loom_server_t *s, int type) {
    void *z = zmq_socket(s->zctx, type);
    int zero = 0;
    int64_t maxmsg = LOOM_MAX_MSG_BYTES;
    zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    return z;
}

static uint64_t next_seed(loom_server_t *s) {
    uint64_t x = (s->seed_state += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void send_to_worker(loom_server_t *s, const worker_slot_t *w, const void *buf, size_t len) {
    zmq_send(s->ctl, w->id, strlen(w->id), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(s->ctl, buf, len, ZMQ_DONTWAIT);
}

static void send_ctl(loom_server_t *s, const worker_slot_t *w, Loom__V1__ControlMsg *m) {
    size_t len;
    void *buf = loom_wire_pack_control(m, &len);
    send_to_worker(s, w, buf, len);
    free(buf);
}

static void send_ctl_to_id(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__ControlMsg *m) {
    size_t len;
    void *buf = loom_wire_pack_control(m, &len);
    zmq_send(s->ctl, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(s->ctl, buf, len, ZMQ_DONTWAIT);
    free(buf);
}

static void refuse_worker(loom_server_t *s, const void *rid, size_t rid_len, loom_status_t code, const char *msg) {
    Loom__V1__Error e = LOOM__V1__ERROR__INIT;
    e.code = code;
    e.message = (char *)msg;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_ERROR;
    m.error = &e;
    send_ctl_to_id(s, rid, rid_len, &m);
}

/* Sends one Reply to a client; returns -1 when the client is gone (the
 * ROUTER knows no such peer any more). */
static int send_reply(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Reply *r) {
    size_t len;
    void *buf = loom_wire_pack_reply(r, &len);
    int rc = zmq_send(s->api, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    int gone = rc < 0 && errno == EHOSTUNREACH;
    if (rc >= 0) rc = zmq_send(s->api, buf, len, ZMQ_DONTWAIT);
    if (rc < 0 && !gone) LOOM_WARN("could not send a reply: %s", zmq_strerror(errno));
    free(buf);
    return gone ? -1 : 0;
}

static int reply_error(loom_server_t *s, const void *rid, size_t rid_len, uint64_t request_id,
                       loom_status_t code, const char *msg) {
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = request_id;
    r.code = loom_wire_status_code(code);
    r.message = (char *)msg;
    /* a Generate stream ends with a final chunk even on error */
    Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
    ch.final = 1;
    ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_ERROR;
    r.body_case = LOOM__V1__REPLY__BODY_CHUNK;
    r.chunk = &ch;
    return send_reply(s, rid, rid_len, &r);
}

/* ---- requests ------------------------------------------------------------------- */

static void req_unlink(loom_server_t *s, request_t *q) {
    if (q->prev) q->prev->next = q->next;
    else s->reqs = q->next;
    if (q->next) q->next->prev = q->prev;
    s->n_reqs--;
}

static void req_free(request_t *q) {
    for (int i = 0; i < q->n_stop; i++) free(q->stop[i]);
    free(q->pending);
    free(q);
}

/* Seconds from a to b, or -1 when a stage was not reached (a == 0). */
static double span_s(uint64_t a, uint64_t b) {
    return a && b >= a ? (double)(b - a) * 1e-9 : -1.0;
}

/* Where q's time went, up to now (seconds; -1: not reached). */
static loom_request_times_t req_times(const request_t *q, uint64_t now) {
    uint64_t admitted = q->seq ? q->seq->t_admitted_ns : 0, first = q->seq ? q->seq->t_first_token_ns : 0;
    loom_request_times_t t = {.queue_s = span_s(q->t_queued, admitted), .tokenize_s = (double)q->tokenize_ns * 1e-9,
                              .prefill_s = first ? span_s(admitted, first) : -1.0, .decode_s = span_s(first, now),
                              .detokenize_s = (double)q->detok_ns * 1e-9, .send_s = (double)q->send_ns * 1e-9,
                              .ttft_s = first ? span_s(q->t_arrival, first) : -1.0, .tpot_s = -1.0,
                              .e2e_s = span_s(q->t_arrival, now)};
    if (first && q->completion_tokens > 1) t.tpot_s = t.decode_s / (q->completion_tokens - 1);
    return t;
}

static double ms_or_none(double sec) {
    return sec < 0 ? -1.0 : sec * 1e3;
}

static void record_done(loom_server_t *s, const request_t *q, Loom__V1__FinishReason finish, uint64_t now) {
    loom_finished_t how = finish == LOOM__V1__FINISH_REASON__FINISH_STOP     ? LOOM_FINISHED_STOP
                          : finish == LOOM__V1__FINISH_REASON__FINISH_LENGTH ? LOOM_FINISHED_LENGTH
                          : finish == LOOM__V1__FINISH_REASON__FINISH_CANCELLED ? LOOM_FINISHED_ABORT
                                                                                : LOOM_FINISHED_ERROR;
    loom_request_times_t t = req_times(q, now);
    t.prompt_tokens = q->prompt_tokens;
    t.generation_tokens = q->completion_tokens;
    t.max_tokens = q->max_tokens;
    t.n = 1;
    loom_metrics_request_done(s->metrics, how, &t);
    loom_log_req(LOOM_LOG_DEBUG, q->tag,
                 "request %llu done: %d+%d tokens; ms: tokenize %.2f queue %.2f prefill %.2f decode %.2f "
                 "detokenize %.2f send %.2f ttft %.2f e2e %.2f (-1: not reached)",
                 (unsigned long long)q->request_id, q->prompt_tokens, q->completion_tokens, ms_or_none(t.tokenize_s),
                 ms_or_none(t.queue_s), ms_or_none(t.prefill_s), ms_or_none(t.decode_s), ms_or_none(t.detokenize_s),
                 ms_or_none(t.send_s), ms_or_none(t.ttft_s), ms_or_none(t.e2e_s));
}

/* Sends a chunk; finish != NONE makes it the final one and ends the request.
 * Returns 1 when the request ended (it is freed: do not touch it again),
 * which also happens when its client is gone. */
static int req_emit(loom_server_t *s, request_t *q, const int32_t *ids, int n_ids, const char *text,
                     size_t text_len, Loom__V1__FinishReason finish, loom_status_t code, const char *msg) {
    Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
    ch.ids = (int32_t *)ids;
    ch.n_ids = (size_t)n_ids;
    char *t = s->text_buf;
    if (text_len) {
        t = text_len < s->max_piece * 4 + 4096 ? s->text_buf : loom_xmalloc(text_len + 1);
        memcpy(t, text, text_len);
    }
    t[text_len] = '\0';
    ch.text = t;
    ch.finish_reason = finish;
    Loom__V1__Usage usage = LOOM__V1__USAGE__INIT;
    Loom__V1__Timings timings = LOOM__V1__TIMINGS__INIT;
    int final = finish != LOOM__V1__FINISH_REASON__FINISH_NONE;
    uint64_t t_send = loom_now_ns();
    if (final) {
        ch.final = 1;
        usage.prompt_tokens = (uint32_t)q->prompt_tokens;
        usage.completion_tokens = (uint32_t)q->completion_tokens;
        usage.cached_tokens = q->seq ? (uint32_t)q->seq->cached_tokens : 0;
        ch.usage = &usage;
        /* a stage not reached reads 0 */
        loom_request_times_t tt = req_times(q, t_send);
        timings.queue_ms = q->seq && !q->seq->t_admitted_ns ? (double)(t_send - q->t_queued) * 1e-6
                                                            : LOOM_MAX(tt.queue_s, 0.0) * 1e3;
        timings.tokenize_ms = tt.tokenize_s * 1e3;
        timings.prefill_ms = LOOM_MAX(tt.prefill_s, 0.0) * 1e3;
        timings.decode_ms = LOOM_MAX(tt.decode_s, 0.0) * 1e3;
        timings.detokenize_ms = tt.detokenize_s * 1e3;
        timings.send_ms = tt.send_s * 1e3;
        timings.ttft_ms = LOOM_MAX(tt.ttft_s, 0.0) * 1e3;
        timings.total_ms = LOOM_MAX(tt.e2e_s, 0.0) * 1e3;
        ch.timings = &timings;
    }
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = q->request_id;
    r.code = loom_wire_status_code(code);
    r.message = (char *)(msg ? msg : "");
    r.body_case = LOOM__V1__REPLY__BODY_CHUNK;
    r.chunk = &ch;
    int gone = send_reply(s, q->rid, q->rid_len, &r) < 0;
    if (t != s->text_buf) free(t);
    uint64_t t_sent = loom_now_ns();
    q->send_ns += t_sent - t_send;
    if (gone && !final) {
        loom_log_req(LOOM_LOG_INFO, q->tag, "request %llu: the client went away; cancelling",
                     (unsigned long long)q->request_id);
        final = 1;
    }
    if (final) {
        if (code == LOOM_OK) s->requests_finished++;
        record_done(s, q, gone ? LOOM__V1__FINISH_REASON__FINISH_CANCELLED : finish, t_send);
        if (q->seq) loom_sched_finish(s->sched, q->seq);
        q->seq = NULL;
        req_unlink(s, q);
        req_free(q);
    }
    return final;
}

static void pending_append(request_t *q, const char *t, size_t n) {
    if (q->n_pending + n + 1 > q->cap_pending) {
        q->cap_pending = (q->n_pending + n + 1) * 2;
        q->pending = loom_xrealloc(q->pending, q->cap_pending);
    }
    memcpy(q->pending + q->n_pending, t, n);
    q->n_pending += n;
    q->pending[q->n_pending] = '\0';
}

static int is_stop_id(const request_t *q, int32_t id) {
    for (int i = 0; i < q->n_stop_ids; i++)
        if (q->stop_ids[i] == id) return 1;
    return 0;
}

static void on_token(void *ctx, loom_seq_t *seq, int32_t id) {
    loom_server_t *s = ctx;
    request_t *q = seq->user;
    uint64_t t0 = loom_now_ns();
    if (q->t_last_token) loom_metrics_observe_itl(s->metrics, (double)(t0 - q->t_last_token) * 1e-9);
    q->t_last_token = t0;
    q->completion_tokens++;
    s->gen_tokens_total++;
    uint64_t sec = loom_now_ns() / 1000000000ull;
    if (sec != s->rate_second) {
        for (uint64_t t = s->rate_second + 1; t <= sec && t <= s->rate_second + RATE_WINDOW; t++)
            s->rate_tokens[t % RATE_WINDOW] = 0;
        s->rate_second = sec;
    }
    s->rate_tokens[sec % RATE_WINDOW]++;

    if ((!q->ignore_eos && loom_model_config_is_eos(&s->mcfg, id)) || is_stop_id(q, id)) {
        size_t n = loom_detok_flush(&q->detok, s->text_buf, s->max_piece * 4 + 4096);
        pending_append(q, s->text_buf, n);
        q->detok_ns += loom_now_ns() - t0;
        req_emit(s, q, NULL, 0, q->pending, q->n_pending, LOOM__V1__FINISH_REASON__FINISH_STOP, LOOM_OK, NULL);
        return;
    }
    size_t n = loom_detok_push(&q->detok, id, s->text_buf, s->max_piece * 4 + 4096);
    pending_append(q, s->text_buf, n);
    int at_length = q->completion_tokens >= q->max_tokens;
    if (at_length) {
        n = loom_detok_flush(&q->detok, s->text_buf, s->max_piece * 4 + 4096);
        pending_append(q, s->text_buf, n);
    }
    /* the earliest stop string ends the text before it */
    long hit = loom_stop_find(q->stop, q->n_stop, q->pending, q->n_pending);
    if (hit >= 0) {
        q->detok_ns += loom_now_ns() - t0;
        req_emit(s, q, &id, 1, q->pending, (size_t)hit, LOOM__V1__FINISH_REASON__FINISH_STOP, LOOM_OK, NULL);
        return;
    }
    size_t emit = at_length ? q->n_pending : loom_stop_safe_prefix(q->stop, q->n_stop, q->pending, q->n_pending);
    q->detok_ns += loom_now_ns() - t0;
    if (at_length) {
        req_emit(s, q, &id, 1, q->pending, q->n_pending, LOOM__V1__FINISH_REASON__FINISH_LENGTH, LOOM_OK, NULL);
        return;
    }
    if (req_emit(s, q, &id, 1, q->pending, emit, LOOM__V1__FINISH_REASON__FINISH_NONE, LOOM_OK, NULL))
        return; /* the client is gone and the request with it */
    memmove(q->pending, q->pending + emit, q->n_pending - emit + 1);
    q->n_pending -= emit;
}

/* Ends every live request with an error (the grid failed or is going away). */
static void fail_all_requests(loom_server_t *s, loom_status_t code, const char *msg) {
    while (s->reqs) {
        request_t *q = s->reqs;
        req_emit(s, q, NULL, 0, NULL, 0, LOOM__V1__FINISH_REASON__FINISH_ERROR, code, msg);
    }
}

/* ---- grid ------------------------------------------------------------------------- */

static int count_used(const loom_server_t *s) {
    int n = 0;
    for (int i = 0; i < s->n_slots; i++) n += s->slots[i].used;
    return n;
}

static int count_ready(const loom_server_t *s) {
    int n = 0;
    for (int i = 0; i < s->n_slots; i++) n += s->slots[i].used && s->slots[i].ready;
    return n;
}

static void fill_peer(Loom__V1__CommPeer *p, const worker_slot_t *w) {
    loom__v1__comm_peer__init(p);
    p->worker_id = (char *)w->id;
    p->data_addr = (char *)w->data_addr;
}

/* Writes the grid plan to /loom/<cluster>/plan for operators and tools. */
static void publish_plan(loom_server_t *s, const char *backend) {
    if (!s->etcd) return;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "epoch", (double)s->epoch);
    cJSON_AddStringToObject(j, "model", s->model_name);
    cJSON_AddNumberToObject(j, "tp", s->cfg.tp);
    cJSON_AddNumberToObject(j, "pp", s->cfg.pp);
    cJSON_AddStringToObject(j, "data_plane", backend);
    cJSON *ws = cJSON_AddArrayToObject(j, "workers");
    for (int i = 0; i < s->n_slots; i++) {
        int lb, ln;
        loom_split_range(s->mcfg.n_layers, s->cfg.pp, i / s->cfg.tp, &lb, &ln);
        cJSON *w = cJSON_CreateObject();
        cJSON_AddStringToObject(w, "id", s->slots[i].id);
        cJSON_AddNumberToObject(w, "stage", i / s->cfg.tp);
        cJSON_AddNumberToObject(w, "tp_rank", i % s->cfg.tp);
        cJSON_AddNumberToObject(w, "layer_begin", lb);
        cJSON_AddNumberToObject(w, "layer_end", lb + ln);
        cJSON_AddStringToObject(w, "host", s->slots[i].host);
        cJSON_AddStringToObject(w, "device", s->slots[i].device);
        cJSON_AddItemToArray(ws, w);
    }
    char *text = cJSON_PrintUnformatted(j);
    char key[400];
    snprintf(key, sizeof key, "%splan", s->etcd_prefix);
    loom_err_t err = {0};
    if (loom_etcd_put(s->etcd, key, text, strlen(text), loom_etcd_keeper_lease(s->etcd_keeper), &err) < 0)
        LOOM_WARN("could not publish the plan to etcd: %s", err.msg);
    free(text);
    cJSON_Delete(j);
}

/* Every slot is filled: plan the grid and send each worker its Assign. */
static void start_epoch(loom_server_t *s) {
    s->epoch++;
    int tp = s->cfg.tp, pp = s->cfg.pp;
    int same_host = 1;
    for (int i = 1; i < s->n_slots; i++)
        if (strcmp(s->slots[i].host_id, s->slots[0].host_id) != 0 || !s->slots[i].host_id[0]) same_host = 0;
    int all_gpu = 1;
    for (int i = 0; i < s->n_slots; i++) all_gpu &= !strncmp(s->slots[i].device, "cuda", 4);
    const char *backend = strcmp(s->cfg.comm, "auto") ? s->cfg.comm : all_gpu ? "nccl" : same_host ? "shm" : "tcp";
    char name[128];
    snprintf(name, sizeof name, "loom-%d-%llx-e%llu", (int)getpid(), (unsigned long long)s->run_id,
             (unsigned long long)s->epoch);
    LOOM_INFO("plan (epoch %llu): %d pipeline stage(s) x %d tensor-parallel rank(s), data plane %s",
              (unsigned long long)s->epoch, pp, tp, backend);
    Loom__V1__CommPeer *peers = loom_xcalloc((size_t)s->n_slots, sizeof *peers);
    Loom__V1__CommPeer **tp_ptrs = loom_xcalloc((size_t)tp, sizeof *tp_ptrs);
    for (int i = 0; i < s->n_slots; i++) fill_peer(&peers[i], &s->slots[i]);
    for (int st = 0; st < pp; st++) {
        int lb, ln;
        loom_split_range(s->mcfg.n_layers, pp, st, &lb, &ln);
        for (int r = 0; r < tp; r++) {
            worker_slot_t *w = &s->slots[st * tp + r];
            int same = 0; /* workers of this host share its memory */
            for (int j = 0; j < s->n_slots; j++) same += !strcmp(s->slots[j].host_id, w->host_id);
            LOOM_INFO("  stage %d layers [%d, %d) tp rank %d -> worker %s (%s, %s, pid %u)", st, lb, lb + ln, r, w->id,
                      w->host, w->device, w->pid);
            for (int k = 0; k < tp; k++) tp_ptrs[k] = &peers[st * tp + k];
            Loom__V1__CommSetup cs = LOOM__V1__COMM_SETUP__INIT;
            cs.backend = (char *)backend;
            cs.name = name;
            cs.tp_group = tp_ptrs;
            cs.n_tp_group = (size_t)tp;
            cs.prev = st > 0 ? &peers[(st - 1) * tp + r] : NULL;
            cs.next = st + 1 < pp ? &peers[(st + 1) * tp + r] : NULL;
            Loom__V1__Assign a = LOOM__V1__ASSIGN__INIT;
            a.model_dir = (char *)s->cfg.model_dir;
            a.stage = (uint32_t)st;
            a.n_stages = (uint32_t)pp;
            a.tp_rank = (uint32_t)r;
            a.tp_size = (uint32_t)tp;
            a.layer_begin = (uint32_t)lb;
            a.layer_end = (uint32_t)(lb + ln);
            a.comm = &cs;
            a.max_tokens = (uint32_t)s->cfg.max_batched_tokens;
            a.max_seqs = (uint32_t)s->cfg.max_num_seqs;
            a.block_size = (uint32_t)s->cfg.block_size;
            a.weight_dtype = (char *)s->cfg.weight_dtype;
            a.quantization = (char *)(s->cfg.quantization ? s->cfg.quantization : "none");
            a.kv_cache_dtype = (char *)(s->cfg.kv_cache_dtype ? s->cfg.kv_cache_dtype : "auto");
            a.epoch = s->epoch;
            a.kv_memory = s->cfg.kv_memory;
            a.kv_fraction = s->cfg.kv_fraction / (float)(same > 0 ? same : 1);
            Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
            m.body_case = LOOM__V1__CONTROL_MSG__BODY_ASSIGN;
            m.assign = &a;
            w->loaded = w->ready = 0;
            send_ctl(s, w, &m);
        }
    }
    free(peers);
    free(tp_ptrs);
    s->state = GRID_LOADING;
    publish_plan(s, backend);
}

/* ---- liveness probes ----------------------------------------------------------------- */

/* Starts a non-blocking connect to a worker's data-plane listener
 * ("tcp://host:port" or "tcp://[v6]:port"), which lives as long as the
 * worker process. Returns the socket, or -1 when the connect failed at once
 * (or the address cannot be read: the worker sent it, so that is its loss). */
static int probe_connect(const char *addr) {
    char host[256], port[16];
    if (strncmp(addr, "tcp://", 6) != 0) return -1;
    const char *h = addr + 6, *colon = strrchr(h, ':');
    if (!colon || colon == h || strlen(colon + 1) >= sizeof port) return -1;
    size_t hl = (size_t)(colon - h);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') h++, hl -= 2;
    if (hl >= sizeof host) return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    snprintf(port, sizeof port, "%s", colon + 1);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0 || !res) return -1;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static void probes_stop(loom_server_t *s) {
    for (int i = 0; i < s->n_slots; i++) {
        if (s->probe_fd[i] >= 0) close(s->probe_fd[i]);
        s->probe_fd[i] = -1;
    }
    s->probing = 0;
}

/* After a failure of a full grid: probe every member; probes_poll decides. */
static void probes_start(loom_server_t *s) {
    for (int i = 0; i < s->n_slots; i++) s->probe_fd[i] = -2; /* -2: failed at once */
    for (int i = 0; i < s->n_slots; i++) {
        int fd = probe_connect(s->slots[i].data_addr);
        if (fd >= 0) s->probe_fd[i] = fd;
    }
    s->probing = 1;
    s->probe_deadline = loom_now_ns() + PROBE_MS * 1000000ull;
}

/* Frees the slot of a worker found dead (no epoch to abort: it is aborted). */
static void exclude_worker(loom_server_t *s, int i, const char *why) {
    worker_slot_t *w = &s->slots[i];
    LOOM_ERROR("worker %s (stage %d, tp rank %d, pid %u) is gone: its data plane at %s %s; excluded from the "
               "next plan",
               w->id, i / s->cfg.tp, i % s->cfg.tp, w->pid, w->data_addr, why);
    snprintf(s->last_failure, sizeof s->last_failure, "worker %s is gone: its data plane %s", w->id, why);
    w->used = 0;
}

/* Reactor: settles the probes once each answered or PROBE_MS passed. */
static void probes_poll(loom_server_t *s) {
    if (!s->probing) return;
    int pending = 0, gone = 0;
    for (int i = 0; i < s->n_slots; i++) {
        int fd = s->probe_fd[i];
        if (fd == -1) continue;
        int soerr = ECONNREFUSED;
        if (fd >= 0) {
            struct pollfd pf = {fd, POLLOUT, 0};
            if (poll(&pf, 1, 0) <= 0) {
                pending++;
                continue;
            }
            socklen_t len = sizeof soerr;
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0) soerr = errno;
            close(fd);
        }
        s->probe_fd[i] = -1;
        if (soerr) {
            char why[160];
            snprintf(why, sizeof why, "refused a connection (%s)", strerror(soerr));
            exclude_worker(s, i, why);
            gone++;
        }
    }
    if (pending && loom_now_ns() < s->probe_deadline) return;
    for (int i = 0; i < s->n_slots; i++)
        if (s->probe_fd[i] >= 0) {
            char why[80];
            snprintf(why, sizeof why, "did not answer a connection within %d ms", PROBE_MS);
            exclude_worker(s, i, why);
            gone++;
        }
    probes_stop(s);
    if (count_used(s) == s->n_slots) start_epoch(s); /* every member is alive: rebuild with them */
    else LOOM_INFO("waiting for %d worker(s) to take the free place(s) (%d of %d registered)", gone, count_used(s),
                   s->n_slots);
}

/* Aborts the current epoch: in-flight micro-batches fail, requests wait for
 * the grid to come back (or end with UNAVAILABLE when it does not in time). */
static void fail_grid(loom_server_t *s, const char *why) {
    snprintf(s->last_failure, sizeof s->last_failure, "%s", why);
    LOOM_ERROR("grid failure (epoch %llu): %s", (unsigned long long)s->epoch, why);
    Loom__V1__Abort ab = LOOM__V1__ABORT__INIT;
    ab.epoch = s->epoch;
    ab.reason = (char *)why;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_ABORT;
    m.abort = &ab;
    for (int i = 0; i < s->n_slots; i++)
        if (s->slots[i].used) send_ctl(s, &s->slots[i], &m);
    if (s->sched) {
        for (int i = 0; i < s->n_inflight; i++) loom_sched_fail(s->sched, s->inflight[i].mb);
        s->n_inflight = 0;
        if (s->cfg.recovery_timeout_ms <= 0 || s->n_reqs == 0) {
            char msg[700];
            snprintf(msg, sizeof msg, "the serving grid failed: %s", why);
            fail_all_requests(s, LOOM_ERR_UNAVAILABLE, msg);
        } else if (!s->recovery_deadline) {
            s->recovery_deadline = loom_now_ns() + (uint64_t)s->cfg.recovery_timeout_ms * 1000000ull;
            LOOM_WARN("%d request(s) wait up to %d ms for the grid to be restored", s->n_reqs,
                      s->cfg.recovery_timeout_ms);
        }
    }
    for (int i = 0; i < s->n_slots; i++) s->slots[i].loaded = s->slots[i].ready = 0;
    probes_stop(s);
    s->state = GRID_WAITING;
    if (count_used(s) == s->n_slots) probes_start(s); /* who of them is still alive? then rebuild */
}

static void lose_worker(loom_server_t *s, int i, const char *why) {
    worker_slot_t *w = &s->slots[i];
    char msg[512];
    snprintf(msg, sizeof msg, "worker %s (stage %d, tp rank %d, pid %u) %s", w->id, i / s->cfg.tp, i % s->cfg.tp,
             w->pid, why);
    w->used = 0;
    fail_grid(s, msg);
    LOOM_INFO("waiting for a worker to take its place (%d of %d registered)", count_used(s), s->n_slots);
}

static void grid_ready(loom_server_t *s) {
    if (s->sched) {
        /* the KV cache of the old grid is gone: recompute the waiting requests */
        loom_sched_reset_kv(s->sched, s->n_blocks);
        for (request_t *q = s->reqs, *next; q; q = next) {
            next = q->next;
            if (q->seq && loom_sched_seq_max_blocks(s->sched, q->seq) > s->n_blocks)
                req_emit(s, q, NULL, 0, NULL, 0, LOOM__V1__FINISH_REASON__FINISH_ERROR, LOOM_ERR_UNAVAILABLE,
                         "the restored grid's KV cache is too small for this request");
        }
        if (s->n_reqs) LOOM_INFO("grid restored: %d request(s) resume (re-prefilled from their tokens)", s->n_reqs);
        s->recovery_deadline = 0;
    } else {
        loom_sched_config_t sc = {.max_num_seqs = s->cfg.max_num_seqs, .max_batched_tokens = s->cfg.max_batched_tokens,
                                  .max_queue = s->cfg.max_queue, .max_model_len = s->max_model_len,
                                  .n_micro = s->cfg.pp, .block_size = s->cfg.block_size, .n_blocks = s->n_blocks,
                                  .prefix_cache = s->cfg.prefix_cache};
        s->sched = loom_sched_create(&sc);
    }
    s->state = GRID_READY;
    s->last_failure[0] = '\0';
    LOOM_INFO("grid ready (epoch %llu): %d worker(s), %d KV blocks of %d tokens; serving %s on %s",
              (unsigned long long)s->epoch, s->n_slots, s->n_blocks, s->cfg.block_size, s->model_name, s->api_addr);
    if (s->cfg.ready_file) {
        char tmp[1100];
        snprintf(tmp, sizeof tmp, "%s.tmp", s->cfg.ready_file);
        FILE *f = fopen(tmp, "w");
        if (f) {
            fprintf(f, "%s\n", s->api_addr);
            fclose(f);
            rename(tmp, s->cfg.ready_file);
        }
    }
}

static void all_loaded(loom_server_t *s) {
    uint64_t nb = UINT64_MAX;
    for (int i = 0; i < s->n_slots; i++) {
        worker_slot_t *w = &s->slots[i];
        uint64_t b = w->kv_block_bytes ? w->kv_budget / w->kv_block_bytes : UINT64_MAX;
        if (b < nb) nb = b;
    }
    int per_seq = (s->max_model_len + s->cfg.block_size - 1) / s->cfg.block_size;
    uint64_t cap = (uint64_t)s->cfg.max_num_seqs * (uint64_t)per_seq;
    if (nb > cap) nb = cap; /* more could never be used */
    if (s->cfg.num_kv_blocks > 0) nb = (uint64_t)s->cfg.num_kv_blocks;
    if (nb > INT32_MAX / 1024) nb = INT32_MAX / 1024;
    if (nb < 1) {
        char msg[256];
        snprintf(msg, sizeof msg, "no memory left for the KV cache after the weights (raise --kv-fraction or "
                                  "--kv-cache-memory)");
        LOOM_ERROR("%s", msg);
        snprintf(s->last_failure, sizeof s->last_failure, "%s", msg);
        return;
    }
    s->n_blocks = (int)nb;
    snprintf(s->kv_dtype, sizeof s->kv_dtype, "%s", s->slots[0].kv_dtype);
    s->kv_block_bytes = 0;
    for (int i = 0; i < s->n_slots; i++) {
        if (strcmp(s->slots[i].kv_dtype, s->kv_dtype)) snprintf(s->kv_dtype, sizeof s->kv_dtype, "mixed");
        s->kv_block_bytes = LOOM_MAX(s->kv_block_bytes, s->slots[i].kv_block_bytes);
    }
    if (s->n_blocks < per_seq)
        LOOM_WARN("the KV pool (%d blocks) holds %d tokens, less than the context length %d: longer requests "
                  "will be refused",
                  s->n_blocks, s->n_blocks * s->cfg.block_size, s->max_model_len);
    LOOM_INFO("KV pool: %d blocks of %d tokens per worker, %s (the smallest worker decides)", s->n_blocks,
              s->cfg.block_size, s->kv_dtype);
    for (int i = 0; i < s->n_slots; i++) {
        int st = i / s->cfg.tp, r = i % s->cfg.tp;
        const worker_slot_t *lead = &s->slots[st * s->cfg.tp]; /* TP rank 0 made the group's id */
        Loom__V1__KvConfig k = LOOM__V1__KV_CONFIG__INIT;
        k.epoch = s->epoch;
        k.n_blocks = (uint32_t)s->n_blocks;
        k.nccl_tp_id = (ProtobufCBinaryData){lead->nccl_tp_len, (uint8_t *)lead->nccl_tp_id};
        k.nccl_next_id = (ProtobufCBinaryData){s->slots[i].nccl_next_len, (uint8_t *)s->slots[i].nccl_next_id};
        if (st > 0) {
            const worker_slot_t *prev = &s->slots[(st - 1) * s->cfg.tp + r];
            k.nccl_prev_id = (ProtobufCBinaryData){prev->nccl_next_len, (uint8_t *)prev->nccl_next_id};
        }
        Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
        m.body_case = LOOM__V1__CONTROL_MSG__BODY_KV_CONFIG;
        m.kv_config = &k;
        send_ctl(s, &s->slots[i], &m);
    }
    s->state = GRID_JOINING;
}

/* ---- control messages ------------------------------------------------------------ */

static int slot_of(const loom_server_t *s, const void *rid, size_t len) {
    for (int i = 0; i < s->n_slots; i++)
        if (s->slots[i].used && strlen(s->slots[i].id) == len && !memcmp(s->slots[i].id, rid, len)) return i;
    return -1;
}

static void on_register(loom_server_t *s, const void *rid, size_t rid_len, const Loom__V1__Register *r) {
    int i = slot_of(s, rid, rid_len);
    if (i >= 0) { /* a known worker registering again (restarted, same id) */
        lose_worker(s, i, "registered again");
    }
    if (!r->worker_id || strlen(r->worker_id) != rid_len || memcmp(r->worker_id, rid, rid_len) != 0 ||
        rid_len >= sizeof s->slots[0].id || !r->data_addr || !r->data_addr[0]) {
        refuse_worker(s, rid, rid_len, LOOM_ERR_INVALID_ARGUMENT,
                      "registration refused: worker id must match the connection's routing id and a data "
                      "address is required");
        LOOM_WARN("refused a malformed registration");
        return;
    }
    i = 0;
    if (r->has_shard && r->shard_n_stages == (uint32_t)s->cfg.pp && r->shard_tp_size == (uint32_t)s->cfg.tp &&
        r->shard_stage < (uint32_t)s->cfg.pp && r->shard_tp_rank < (uint32_t)s->cfg.tp && r->shard_model_dir &&
        !strcmp(r->shard_model_dir, s->cfg.model_dir))
        i = (int)(r->shard_stage * (uint32_t)s->cfg.tp + r->shard_tp_rank); /* it holds these weights already */
    if (s->slots[i].used)
        for (i = 0; i < s->n_slots && s->slots[i].used; i++) {}
    if (i == s->n_slots) {
        char msg[256];
        snprintf(msg, sizeof msg, "the grid is full (%d workers for tp %d x pp %d)", s->n_slots, s->cfg.tp, s->cfg.pp);
        refuse_worker(s, rid, rid_len, LOOM_ERR_RESOURCE_EXHAUSTED, msg);
        LOOM_DEBUG("worker %s stands by: %s", r->worker_id, msg);
        return;
    }
    worker_slot_t *w = &s->slots[i];
    memset(w, 0, sizeof *w);
    w->used = 1;
    snprintf(w->id, sizeof w->id, "%s", r->worker_id);
    snprintf(w->host, sizeof w->host, "%s", r->host ? r->host : "");
    snprintf(w->host_id, sizeof w->host_id, "%s", r->host_id ? r->host_id : "");
    snprintf(w->device, sizeof w->device, "%s", r->device ? r->device : "");
    snprintf(w->data_addr, sizeof w->data_addr, "%s", r->data_addr);
    w->pid = r->pid;
    w->last_seen_ns = loom_now_ns();
    LOOM_INFO("worker %s registered (%s, %s, pid %u, data plane %s): %d of %d", w->id, w->host, w->device, w->pid,
              w->data_addr, count_used(s), s->n_slots);
    if (count_used(s) == s->n_slots && s->state == GRID_WAITING) start_epoch(s);
}

static void on_result(loom_server_t *s, int wi, const Loom__V1__StepResult *r) {
    if (r->epoch != s->epoch || s->state != GRID_READY) return; /* a leftover of an aborted epoch */
    if (r->code != LOOM_OK) {
        char msg[700];
        snprintf(msg, sizeof msg, "step %llu failed on worker %s: %s", (unsigned long long)r->step_id,
                 s->slots[wi].id, r->message);
        fail_grid(s, msg);
        return;
    }
    if (s->n_inflight == 0 || s->inflight[0].step_id != r->step_id) {
        char msg[256];
        snprintf(msg, sizeof msg, "worker %s returned step %llu out of order", s->slots[wi].id,
                 (unsigned long long)r->step_id);
        fail_grid(s, msg);
        return;
    }
    inflight_t f = s->inflight[0];
    memmove(s->inflight, s->inflight + 1, (size_t)(--s->n_inflight) * sizeof *s->inflight);
    if (r->n_ids != (size_t)f.mb->n_logits) {
        char msg[256];
        snprintf(msg, sizeof msg, "worker %s returned %zu ids for %d rows", s->slots[wi].id, r->n_ids, f.mb->n_logits);
        loom_sched_fail(s->sched, f.mb);
        fail_grid(s, msg);
        return;
    }
    for (size_t i = 0; i < r->n_ids; i++)
        if (r->ids[i] < 0 || r->ids[i] >= s->mcfg.vocab_size) {
            loom_sched_fail(s->sched, f.mb);
            fail_grid(s, "a worker returned a token id outside the vocabulary");
            return;
        }
    s->steps++;
    double step_s = (double)(loom_now_ns() - f.t_sent) * 1e-9;
    s->step_s_total += step_s;
    loom_metrics_observe_step(s->metrics, step_s);
    loom_sched_complete(s->sched, f.mb, r->ids, on_token, s);
}

static void on_control(loom_server_t *s, const void *rid, size_t rid_len, const void *data, size_t len) {
    loom_err_t err = {0};
    Loom__V1__ControlMsg *m = loom_wire_unpack_control(data, len, &err);
    if (!m) {
        LOOM_WARN("refused a control message (%zu bytes): %s", len, err.msg);
        refuse_worker(s, rid, rid_len, err.code, err.msg);
        return;
    }
    int wi = slot_of(s, rid, rid_len);
    if (m->body_case == LOOM__V1__CONTROL_MSG__BODY_REGISTER) {
        on_register(s, rid, rid_len, m->register_);
        goto done;
    }
    if (wi < 0) {
        refuse_worker(s, rid, rid_len, LOOM_ERR_NOT_FOUND, "unknown worker: register first");
        goto done;
    }
    worker_slot_t *w = &s->slots[wi];
    w->last_seen_ns = loom_now_ns();
    switch (m->body_case) {
    case LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT: {
        w->busy_s = m->heartbeat->busy_s;
        w->comm_s = m->heartbeat->comm_s;
        w->steps = m->heartbeat->steps;
        int stage = wi / s->cfg.tp;
        double busy = 0, comm = 0;
        uint64_t steps = 0;
        for (int r = 0; r < s->cfg.tp; r++) {
            const worker_slot_t *x = &s->slots[stage * s->cfg.tp + r];
            busy += x->busy_s;
            comm += x->comm_s;
            steps += x->steps;
        }
        loom_metrics_set_stage(s->metrics, stage, busy, comm, steps);
        break;
    }
    case LOOM__V1__CONTROL_MSG__BODY_LOADED:
        if (m->loaded->epoch != s->epoch || s->state != GRID_LOADING) break;
        w->loaded = 1;
        w->kv_block_bytes = m->loaded->kv_block_bytes;
        w->kv_budget = m->loaded->kv_budget;
        snprintf(w->kv_dtype, sizeof w->kv_dtype, "%s", m->loaded->kv_cache_dtype);
        w->weight_bytes = m->loaded->weight_bytes;
        w->bytes_read = m->loaded->bytes_read;
        w->nccl_tp_len = LOOM_MIN(m->loaded->nccl_tp_id.len, sizeof w->nccl_tp_id);
        if (w->nccl_tp_len) memcpy(w->nccl_tp_id, m->loaded->nccl_tp_id.data, w->nccl_tp_len);
        w->nccl_next_len = LOOM_MIN(m->loaded->nccl_next_id.len, sizeof w->nccl_next_id);
        if (w->nccl_next_len) memcpy(w->nccl_next_id, m->loaded->nccl_next_id.data, w->nccl_next_len);
        LOOM_INFO("worker %s loaded its shard in %.2f s: %.1f MB of weights (%.1f MB read)", w->id,
                  m->loaded->load_s, (double)w->weight_bytes / 1e6, (double)w->bytes_read / 1e6);
        {
            int all = 1;
            for (int i = 0; i < s->n_slots; i++) all &= s->slots[i].loaded;
            if (all) all_loaded(s);
        }
        break;
    case LOOM__V1__CONTROL_MSG__BODY_READY:
        if (m->ready->epoch != s->epoch || s->state != GRID_JOINING) break;
        w->ready = 1;
        if (count_ready(s) == s->n_slots) grid_ready(s);
        break;
    case LOOM__V1__CONTROL_MSG__BODY_RESULT: on_result(s, wi, m->result); break;
    case LOOM__V1__CONTROL_MSG__BODY_ERROR: {
        char msg[700];
        snprintf(msg, sizeof msg, "worker %s reported: %s", w->id, m->error->message);
        LOOM_ERROR("%s", msg);
        snprintf(s->last_failure, sizeof s->last_failure, "%.500s", msg);
        if (s->state == GRID_READY) fail_grid(s, msg);
        break;
    }
    default:
        LOOM_WARN("worker %s sent an unexpected message (%d); ignored", w->id, (int)m->body_case);
        break;
    }
done:
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

/* ---- client API ----------------------------------------------------------------------- */

static int check_key(const loom_server_t *s, const Loom__V1__Request *rq) {
    if (!s->cfg.api_key) return 1;
    const char *given = rq->api_key ? rq->api_key : "";
    return loom_secret_equal(s->cfg.api_key, strlen(s->cfg.api_key), given, strlen(given));
}

/* A tag names a request in log lines: bounded, printable ASCII. */
static int valid_tag(const char *t) {
    size_t n = 0;
    for (; t[n]; n++)
        if (n >= MAX_TAG || t[n] < 0x20 || t[n] > 0x7e) return 0;
    return 1;
}

static void grid_not_ready_msg(const loom_server_t *s, char *out, size_t n) {
    if (s->last_failure[0])
        snprintf(out, n, "the grid is not ready (%s, %d of %d workers registered): last failure: %s",
                 grid_state_name[s->state], count_used(s), s->n_slots, s->last_failure);
    else
        snprintf(out, n, "the grid is not ready (%s, %d of %d workers registered)", grid_state_name[s->state],
                 count_used(s), s->n_slots);
}

static void on_generate(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    Loom__V1__GenerateRequest *g = rq->generate;
    char msg[600];
    loom_err_t err = {0};
    loom_status_t code = LOOM_ERR_INVALID_ARGUMENT;
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    uint64_t t_arrival = loom_now_ns(), tokenize_ns = 0;
    const char *tag = g->tag && valid_tag(g->tag) ? g->tag : "";
    if (s->draining) {
        snprintf(msg, sizeof msg, "draining: this coordinator is shutting down and admits no new requests; retry "
                                  "on another one or after it restarts");
        code = LOOM_ERR_UNAVAILABLE;
        goto refuse;
    }
    if (g->tag && g->tag[0] && !tag[0]) {
        snprintf(msg, sizeof msg, "tag must be at most %d printable ASCII characters", MAX_TAG);
        goto refuse;
    }
    if (s->state != GRID_READY) {
        grid_not_ready_msg(s, msg, sizeof msg);
        code = LOOM_ERR_UNAVAILABLE;
        goto refuse;
    }
    if (g->model && g->model[0] && strcmp(g->model, s->model_name) != 0) {
        snprintf(msg, sizeof msg, "model '%s' is not served here; this server serves '%s'", g->model, s->model_name);
        code = LOOM_ERR_NOT_FOUND;
        goto refuse;
    }
    const Loom__V1__SamplingParams *sp = g->sampling;
    float temp = sp ? sp->temperature : 1.0f, top_p = sp ? sp->top_p : 1.0f;
    int top_k = sp ? sp->top_k : 0;
    if (!(temp >= 0.0f && temp <= 100.0f)) {
        snprintf(msg, sizeof msg, "temperature %g is outside [0, 100]", (double)temp);
        goto refuse;
    }
    if (!(top_p >= 0.0f && top_p <= 1.0f)) {
        snprintf(msg, sizeof msg, "top_p %g is outside [0, 1]", (double)top_p);
        goto refuse;
    }
    if (top_k < 0) {
        snprintf(msg, sizeof msg, "top_k %d is negative", top_k);
        goto refuse;
    }
    if (g->n_stop > MAX_STOP) {
        snprintf(msg, sizeof msg, "%zu stop strings; at most %d are allowed", g->n_stop, MAX_STOP);
        goto refuse;
    }
    for (size_t i = 0; i < g->n_stop; i++) {
        size_t l = strlen(g->stop[i]);
        if (l == 0 || l > MAX_STOP_LEN) {
            snprintf(msg, sizeof msg, "stop string %zu must be 1 to %d bytes long", i, MAX_STOP_LEN);
            goto refuse;
        }
    }
    if (g->n_stop_token_ids > MAX_STOP_IDS) {
        snprintf(msg, sizeof msg, "%zu stop token ids; at most %d are allowed", g->n_stop_token_ids, MAX_STOP_IDS);
        goto refuse;
    }
    for (size_t i = 0; i < g->n_stop_token_ids; i++)
        if (g->stop_token_ids[i] < 0 || g->stop_token_ids[i] >= s->mcfg.vocab_size) {
            snprintf(msg, sizeof msg, "stop token id %d is outside the vocabulary [0, %d)", g->stop_token_ids[i],
                     s->mcfg.vocab_size);
            goto refuse;
        }
    if (g->max_tokens > (uint32_t)s->max_model_len) {
        snprintf(msg, sizeof msg, "max_tokens %u exceeds the context length %d", g->max_tokens, s->max_model_len);
        goto refuse;
    }
    if (g->prompt && g->prompt[0]) {
        int raw = g->raw_prompt; /* chat-templated: the template wrote BOS and special tokens itself */
        uint64_t t0 = loom_now_ns();
        if (loom_tokenizer_encode(s->tok, g->prompt, strlen(g->prompt), !raw, raw, &ids, &n_ids, &cap, &err) < 0) {
            snprintf(msg, sizeof msg, "cannot tokenize the prompt: %s", err.msg);
            goto refuse;
        }
        tokenize_ns = loom_now_ns() - t0;
    } else {
        if (g->n_prompt_ids == 0) {
            snprintf(msg, sizeof msg, "the request has neither a prompt nor prompt_ids");
            goto refuse;
        }
        for (size_t i = 0; i < g->n_prompt_ids; i++)
            if (g->prompt_ids[i] < 0 || g->prompt_ids[i] >= s->mcfg.vocab_size) {
                snprintf(msg, sizeof msg, "prompt id %d at %zu is outside the vocabulary [0, %d)", g->prompt_ids[i], i,
                         s->mcfg.vocab_size);
                goto refuse;
            }
        n_ids = (int)g->n_prompt_ids;
        ids = loom_xmalloc((size_t)n_ids * sizeof *ids);
        memcpy(ids, g->prompt_ids, (size_t)n_ids * sizeof *ids);
    }
    request_t *q = loom_xcalloc(1, sizeof *q);
    memcpy(q->rid, rid, rid_len);
    q->rid_len = rid_len;
    q->request_id = rq->request_id;
    q->ignore_eos = g->ignore_eos;
    q->prompt_tokens = n_ids;
    q->t_arrival = t_arrival;
    q->tokenize_ns = tokenize_ns;
    q->t_queued = loom_now_ns();
    snprintf(q->tag, sizeof q->tag, "%s", tag);
    for (size_t i = 0; i < g->n_stop_token_ids; i++) q->stop_ids[q->n_stop_ids++] = g->stop_token_ids[i];
    for (size_t i = 0; i < g->n_stop; i++) q->stop[q->n_stop++] = loom_xstrdup(g->stop[i]);
    loom_detok_init(&q->detok, s->tok, !g->keep_special, 0);
    loom_sampling_t samp = {.temperature = temp, .top_k = top_k, .top_p = top_p == 0.0f ? 1.0f : top_p,
                            .seed = sp && sp->has_seed ? sp->seed : next_seed(s)};
    loom_status_t st = loom_sched_add(s->sched, rq->request_id, ids, n_ids, (int)g->max_tokens, g->priority, &samp,
                                      q, &q->seq, &err);
    free(ids);
    ids = NULL;
    if (st < 0) {
        req_free(q);
        code = st;
        snprintf(msg, sizeof msg, "%s", err.msg);
        goto refuse;
    }
    q->max_tokens = q->seq->max_tokens;
    q->next = s->reqs;
    if (s->reqs) s->reqs->prev = q;
    s->reqs = q;
    s->n_reqs++;
    s->prompt_tokens_total += (uint64_t)n_ids;
    loom_log_req(LOOM_LOG_DEBUG, q->tag, "request %llu queued: %d prompt tokens, max_tokens %d",
                 (unsigned long long)rq->request_id, n_ids, q->max_tokens);
    return;
refuse:
    free(ids);
    s->requests_rejected++;
    loom_log_req(LOOM_LOG_DEBUG, g->tag && valid_tag(g->tag) ? g->tag : NULL, "refused request %llu: %s",
                 (unsigned long long)rq->request_id, msg);
    reply_error(s, rid, rid_len, rq->request_id, code, msg);
}

static void on_cancel(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    uint64_t target = rq->cancel->target_request_id;
    request_t *q = s->reqs;
    while (q && !(q->request_id == target && q->rid_len == rid_len && !memcmp(q->rid, rid, rid_len))) q = q->next;
    Loom__V1__CancelReply cr = LOOM__V1__CANCEL_REPLY__INIT;
    cr.found = q != NULL;
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = rq->request_id;
    r.body_case = LOOM__V1__REPLY__BODY_CANCEL;
    r.cancel = &cr;
    send_reply(s, rid, rid_len, &r);
    if (q) {
        loom_log_req(LOOM_LOG_DEBUG, q->tag, "request %llu cancelled by its client", (unsigned long long)target);
        req_emit(s, q, NULL, 0, NULL, 0, LOOM__V1__FINISH_REASON__FINISH_CANCELLED, LOOM_ERR_CANCELLED,
                 "cancelled by the client");
    }
}

static void on_health(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    Loom__V1__HealthReply h = LOOM__V1__HEALTH_REPLY__INIT;
    char msg[600];
    h.ready = s->state == GRID_READY && !s->draining;
    h.state = s->draining ? "draining" : (char *)grid_state_name[s->state];
    h.workers_ready = (uint32_t)count_ready(s);
    h.workers_expected = (uint32_t)s->n_slots;
    if (s->draining) snprintf(msg, sizeof msg, "draining: shutting down, %d request(s) in flight", s->n_reqs);
    else if (!h.ready) grid_not_ready_msg(s, msg, sizeof msg);
    else snprintf(msg, sizeof msg, "serving %s", s->model_name);
    h.message = msg;
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = rq->request_id;
    r.body_case = LOOM__V1__REPLY__BODY_HEALTH;
    r.health = &h;
    send_reply(s, rid, rid_len, &r);
}

static void on_list_models(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    Loom__V1__ModelInfo mi = LOOM__V1__MODEL_INFO__INIT;
    mi.id = s->model_name;
    mi.context_length = (uint32_t)s->max_model_len;
    mi.vocab_size = (uint32_t)s->mcfg.vocab_size;
    mi.tp = (uint32_t)s->cfg.tp;
    mi.pp = (uint32_t)s->cfg.pp;
    Loom__V1__ModelInfo *mp = &mi;
    Loom__V1__ListModelsReply lm = LOOM__V1__LIST_MODELS_REPLY__INIT;
    lm.models = &mp;
    lm.n_models = 1;
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = rq->request_id;
    r.body_case = LOOM__V1__REPLY__BODY_MODELS;
    r.models = &lm;
    send_reply(s, rid, rid_len, &r);
}

static void on_stats(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    Loom__V1__StatsReply st = LOOM__V1__STATS_REPLY__INIT;
    st.prefix_cache_queries = s->prefix_queries_base;
    st.prefix_cache_hits = s->prefix_hits_base;
    st.preemptions = s->preemptions_base;
    if (s->sched) {
        loom_sched_stats_t ss;
        loom_sched_get_stats(s->sched, &ss);
        loom_kv_ledger_t *L = loom_sched_ledger(s->sched);
        st.running = (uint32_t)ss.running;
        st.waiting = (uint32_t)ss.waiting;
        st.kv_blocks_total = (uint32_t)loom_kv_n_blocks(L);
        st.kv_blocks_used = (uint32_t)loom_kv_n_held(L);
        st.kv_blocks_free = (uint32_t)loom_kv_n_free(L);
        st.kv_blocks_cached = (uint64_t)loom_kv_n_cached(L);
        st.prefix_cache_queries += ss.prefix_queries;
        st.prefix_cache_hits += ss.prefix_hits;
        st.preemptions += ss.preemptions;
    }
    st.prefix_cache_hit_rate =
        st.prefix_cache_queries ? (double)st.prefix_cache_hits / (double)st.prefix_cache_queries : 0.0;
    st.kv_block_size = (uint32_t)s->cfg.block_size;
    st.kv_cache_dtype = s->kv_dtype;
    st.kv_block_bytes = s->kv_block_bytes;
    st.kv_events = (char *)loom_kv_events_addr(s->kv_events);
    uint64_t sec = loom_now_ns() / 1000000000ull, sum = 0;
    for (int i = 1; i < RATE_WINDOW; i++) /* full seconds only: skip the current one */
        if (sec >= (uint64_t)i && s->rate_second + RATE_WINDOW > sec - (uint64_t)i && s->rate_second >= sec - (uint64_t)i)
            sum += s->rate_tokens[(sec - (uint64_t)i) % RATE_WINDOW];
    st.gen_tokens_per_s = (double)sum / (RATE_WINDOW - 1);
    st.requests_finished = s->requests_finished;
    st.requests_rejected = s->requests_rejected;
    st.prompt_tokens_total = s->prompt_tokens_total;
    st.gen_tokens_total = s->gen_tokens_total;
    st.steps = s->steps;
    st.step_ms_mean = s->steps ? s->step_s_total * 1e3 / (double)s->steps : 0.0;
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = rq->request_id;
    r.body_case = LOOM__V1__REPLY__BODY_STATS;
    r.stats = &st;
    send_reply(s, rid, rid_len, &r);
}

static void on_api(loom_server_t *s, zmq_msg_t *frames, int n) {
    const void *rid = zmq_msg_data(&frames[0]);
    size_t rid_len = zmq_msg_size(&frames[0]);
    if (n != 3) {
        LOOM_WARN("refused a client message of %d frames (expected method + body)", n - 1);
        reply_error(s, rid, rid_len, 0, LOOM_ERR_INVALID_ARGUMENT,
                    "malformed request: expected two frames, the method name and a loom.v1.Request");
        return;
    }
    loom_err_t err = {0};
    Loom__V1__Request *rq = loom_wire_unpack_request(zmq_msg_data(&frames[2]), zmq_msg_size(&frames[2]), &err);
    if (!rq) {
        LOOM_WARN("refused a client request: %s", err.msg);
        reply_error(s, rid, rid_len, 0, LOOM_ERR_INVALID_ARGUMENT, err.msg);
        return;
    }
    const char *method = loom_wire_method(rq->body_case);
    size_t ml = zmq_msg_size(&frames[1]);
    if (strlen(method) != ml || memcmp(method, zmq_msg_data(&frames[1]), ml) != 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "the method frame does not name the request's body (%s)", method);
        reply_error(s, rid, rid_len, rq->request_id, LOOM_ERR_INVALID_ARGUMENT, msg);
    } else if (!check_key(s, rq)) {
        reply_error(s, rid, rid_len, rq->request_id, LOOM_ERR_UNAUTHENTICATED, "missing or wrong API key");
    } else {
        switch (rq->body_case) {
        case LOOM__V1__REQUEST__BODY_GENERATE: on_generate(s, rid, rid_len, rq); break;
        case LOOM__V1__REQUEST__BODY_CANCEL: on_cancel(s, rid, rid_len, rq); break;
        case LOOM__V1__REQUEST__BODY_HEALTH: on_health(s, rid, rid_len, rq); break;
        case LOOM__V1__REQUEST__BODY_LIST_MODELS: on_list_models(s, rid, rid_len, rq); break;
        case LOOM__V1__REQUEST__BODY_STATS: on_stats(s, rid, rid_len, rq); break;
        default: break;
        }
    }
    protobuf_c_message_free_unpacked(&rq->base, NULL);
}

/* ---- the step loop ------------------------------------------------------------------------ */

static void send_plan(loom_server_t *s, loom_microbatch_t *mb) {
    Loom__V1__StepPlan p = LOOM__V1__STEP_PLAN__INIT;
    p.epoch = s->epoch;
    p.step_id = mb->id;
    p.tokens = mb->tokens;
    p.n_tokens = (size_t)mb->n_tokens;
    p.pos = mb->pos;
    p.n_pos = (size_t)mb->n_tokens;
    p.slots = mb->slots;
    p.n_slots = (size_t)mb->n_tokens;
    p.tok_seq = mb->tok_seq;
    p.n_tok_seq = (size_t)mb->n_tokens;
    p.n_seqs = (uint32_t)mb->n_seqs;
    p.max_blocks = (uint32_t)mb->max_blocks;
    p.block_tables = mb->block_tables;
    p.n_block_tables = (size_t)mb->n_seqs * (size_t)mb->max_blocks;
    p.logit_rows = mb->logit_rows;
    p.n_logit_rows = (size_t)mb->n_logits;
    for (int i = 0; i < mb->n_logits; i++) {
        Loom__V1__SampleParams *sp = &s->sp[i];
        loom__v1__sample_params__init(sp);
        sp->temperature = mb->sampling[i].temperature;
        sp->top_k = mb->sampling[i].top_k;
        sp->top_p = mb->sampling[i].top_p;
        sp->seed = mb->sampling[i].seed;
        sp->step = mb->steps[i];
        s->sp_ptrs[i] = sp;
    }
    p.sampling = s->sp_ptrs;
    p.n_sampling = (size_t)mb->n_logits;
    p.copy_src = mb->copy_src;
    p.copy_dst = mb->copy_dst;
    p.n_copy_src = p.n_copy_dst = (size_t)mb->n_copies;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_STEP;
    m.step = &p;
    size_t len;
    void *buf = loom_wire_pack_control(&m, &len);
    for (int i = 0; i < s->n_slots; i++) send_to_worker(s, &s->slots[i], buf, len);
    free(buf);
    s->inflight[s->n_inflight++] = (inflight_t){.mb = mb, .step_id = mb->id, .t_sent = loom_now_ns()};
}

static void schedule(loom_server_t *s) {
    if (s->state != GRID_READY) return;
    loom_microbatch_t *mb;
    while (s->n_inflight < s->cfg.pp && (mb = loom_sched_schedule(s->sched))) {
        loom_metrics_observe_iteration(s->metrics, mb->n_tokens);
        send_plan(s, mb);
    }
}

/* Watch thread: a worker's key left etcd (lease expired or revoked). */
static void on_etcd_event(void *ctx, const loom_etcd_event_t *ev) {
    loom_server_t *s = ctx;
    if (ev->type != LOOM_ETCD_DELETE) return;
    size_t pl = strlen(s->etcd_prefix) + strlen("workers/");
    if (strlen(ev->key) <= pl) return;
    gone_key_t *g = loom_xcalloc(1, sizeof *g);
    snprintf(g->id, sizeof g->id, "%s", ev->key + pl);
    pthread_mutex_lock(&s->gone_mu);
    g->next = s->gone;
    s->gone = g;
    pthread_mutex_unlock(&s->gone_mu);
}

/* Reactor: acts on workers whose etcd key went away. A worker that is still
 * heartbeating only lost its link to etcd, and is kept. */
static void etcd_drain(loom_server_t *s) {
    if (!s->etcd) return;
    pthread_mutex_lock(&s->gone_mu);
    gone_key_t *g = s->gone;
    s->gone = NULL;
    pthread_mutex_unlock(&s->gone_mu);
    while (g) {
        gone_key_t *next = g->next;
        int i = slot_of(s, g->id, strlen(g->id));
        if (i >= 0) {
            uint64_t age_ms = (loom_now_ns() - s->slots[i].last_seen_ns) / 1000000ull;
            if (age_ms > 500) lose_worker(s, i, "left etcd (its lease expired)");
            else LOOM_WARN("worker %s left etcd but is still heartbeating: kept", g->id);
        }
        free(g);
        g = next;
    }
}

static void publish_state(loom_server_t *s) {
    loom_metrics_state_t st = {.prompt_tokens = s->prompt_tokens_total, .generation_tokens = s->gen_tokens_total,
                               .requests_rejected = s->requests_rejected,
                               .grid_ready = s->state == GRID_READY && !s->draining};
    if (s->sched) {
        loom_sched_stats_t ss;
        loom_sched_get_stats(s->sched, &ss);
        loom_kv_ledger_t *L = loom_sched_ledger(s->sched);
        st.running = ss.running;
        st.waiting = ss.waiting;
        st.kv_blocks_total = loom_kv_n_blocks(L);
        st.kv_blocks_used = loom_kv_n_held(L);
        st.kv_blocks_cached = loom_kv_n_cached(L);
        snprintf(st.kv_dtype, sizeof st.kv_dtype, "%s", s->kv_dtype);
        st.block_size = s->cfg.block_size;
        st.prefix_caching = s->cfg.prefix_cache;
        st.prefix_cache_queries = s->prefix_queries_base + ss.prefix_queries;
        st.prefix_cache_hits = s->prefix_hits_base + ss.prefix_hits;
        st.preemptions = s->preemptions_base + ss.preemptions;
    } else {
        st.prefix_cache_queries = s->prefix_queries_base;
        st.prefix_cache_hits = s->prefix_hits_base;
        st.preemptions = s->preemptions_base;
    }
    loom_metrics_set_state(s->metrics, &st);
    loom_kv_events_publish(s->kv_events, s->sched);
}

static void timers(loom_server_t *s) {
    uint64_t now = loom_now_ns();
    if (now - s->last_check >= 100000000ull) {
        s->last_check = now;
        uint64_t limit = (uint64_t)s->cfg.heartbeat_timeout_ms * 1000000ull;
        for (int i = 0; i < s->n_slots; i++)
            if (s->slots[i].used && now - s->slots[i].last_seen_ns > limit) {
                char why[128];
                snprintf(why, sizeof why, "missed heartbeats for %d ms: lost", s->cfg.heartbeat_timeout_ms);
                lose_worker(s, i, why);
            }
    }
    if (s->recovery_deadline && now > s->recovery_deadline && s->state != GRID_READY) {
        char msg[700];
        snprintf(msg, sizeof msg, "the serving grid failed and was not restored within %d ms: %s",
                 s->cfg.recovery_timeout_ms, s->last_failure);
        fail_all_requests(s, LOOM_ERR_UNAVAILABLE, msg);
        s->recovery_deadline = 0;
    }
    if (now - s->last_hb_sent >= 500000000ull) {
        s->last_hb_sent = now;
        Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
        Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
        m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
        m.heartbeat = &hb;
        for (int i = 0; i < s->n_slots; i++)
            if (s->slots[i].used) send_ctl(s, &s->slots[i], &m);
    }
}

/* Reads one multipart message; frames beyond `max` are dropped (the count
 * then equals max, which no valid message has). */
static int recv_frames(void *sock, zmq_msg_t *frames, int max) {
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t extra, *f = n < max ? &frames[n] : &extra;
        zmq_msg_init(f);
        if (zmq_msg_recv(f, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(f);
            break;
        }
        more = zmq_msg_more(f);
        if (n < max) n++;
        else zmq_msg_close(f);
    }
    return n;
}

/* Ends a request still running when the drain runs out of time: its text so
 * far and a final chunk with finish LENGTH, as a length limit would. */
static void cut_request(loom_server_t *s, request_t *q) {
    size_t n = loom_detok_flush(&q->detok, s->text_buf, s->max_piece * 4 + 4096);
    pending_append(q, s->text_buf, n);
    char msg[160];
    snprintf(msg, sizeof msg, "the coordinator shut down: the output was cut after %d token(s) at the %d ms "
                              "shutdown timeout", q->completion_tokens, s->cfg.shutdown_timeout_ms);
    req_emit(s, q, NULL, 0, q->pending ? q->pending : "", q->n_pending, LOOM__V1__FINISH_REASON__FINISH_LENGTH,
             LOOM_OK, msg);
}

/* Returns 1 once a drain is over (nothing left in flight, or out of time). */
static int drain_step(loom_server_t *s) {
    if (!s->drain_requested) return 0;
    uint64_t now = loom_now_ns();
    if (!s->draining) {
        s->draining = 1;
        s->drain_deadline = now + (uint64_t)s->cfg.shutdown_timeout_ms * 1000000ull;
        LOOM_INFO("draining: new requests are refused; %d request(s) in flight get up to %d ms to finish", s->n_reqs,
                  s->cfg.shutdown_timeout_ms);
    }
    if (s->n_reqs == 0) {
        LOOM_INFO("drained: no request left in flight");
        return 1;
    }
    if (now < s->drain_deadline) return 0;
    LOOM_WARN("shutdown timeout: ending %d request(s) still in flight", s->n_reqs);
    while (s->reqs) cut_request(s, s->reqs);
    return 1;
}

int loom_server_run(loom_server_t *s) {
    LOOM_INFO("coordinator for %s (tp %d x pp %d): API on %s, workers on %s; waiting for %d worker(s)",
              s->model_name, s->cfg.tp, s->cfg.pp, s->api_addr, s->ctl_addr, s->n_slots);
    while (!s->stop) {
        zmq_pollitem_t items[] = {{s->ctl, 0, ZMQ_POLLIN, 0}, {s->api, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, 20) < 0 && errno != EINTR) break;
        for (int burst = 0; burst < 256 && (items[0].revents & ZMQ_POLLIN); burst++) {
            zmq_msg_t f[8];
            int n = recv_frames(s->ctl, f, 8);
            if (n == 0) break;
            if (n == 2) on_control(s, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), zmq_msg_data(&f[1]), zmq_msg_size(&f[1]));
            else LOOM_WARN("refused a control message of %d frames", n - 1);
            for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
        }
        for (int burst = 0; burst < 256 && (items[1].revents & ZMQ_POLLIN); burst++) {
            zmq_msg_t f[8];
            int n = recv_frames(s->api, f, 8);
            if (n == 0) break;
            on_api(s, f, n);
            for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
        }
        etcd_drain(s);
        probes_poll(s);
        timers(s);
        schedule(s);
        publish_state(s);
        if (drain_step(s)) break;
    }
    LOOM_INFO("shutting down: %d request(s) still live", s->n_reqs);
    fail_all_requests(s, LOOM_ERR_UNAVAILABLE, "the coordinator is shutting down");
    Loom__V1__Shutdown sd = LOOM__V1__SHUTDOWN__INIT;
    sd.reason = "the coordinator is shutting down";
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_SHUTDOWN;
    m.shutdown = &sd;
    for (int i = 0; i < s->n_slots; i++)
        if (s->slots[i].used) send_ctl(s, &s->slots[i], &m);
    return 0;
}

void loom_server_stop(loom_server_t *s) {
    if (s->drain_requested) s->stop = 1;
    else s->drain_requested = 1;
}

/* ---- create / destroy ------------------------------------------------------------------------ */

static loom_status_t bind_sock(void *z, const char *addr, char *out, size_t n, loom_err_t *err) {
    if (zmq_bind(z, addr) != 0)
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cannot bind %s: %s", addr, zmq_strerror(errno));
    size_t len = n;
    zmq_getsockopt(z, ZMQ_LAST_ENDPOINT, out, &len);
    return LOOM_OK;
}

/* "tcp://HOST:PORT" with HOST replaced by --advertise-host when given. */
static void advertised(const loom_server_t *s, const char *endpoint, char *out, size_t n) {
    const char *colon = strrchr(endpoint, ':');
    if (!s->cfg.advertise_host || !colon || strncmp(endpoint, "tcp://", 6) != 0) {
        snprintf(out, n, "%s", endpoint);
        return;
    }
    snprintf(out, n, "tcp://%s%s", s->cfg.advertise_host, colon);
}

/* Claims /loom/<cluster>/coordinator (one coordinator per cluster), so
 * workers can find the control address, and watches the workers' keys. */
static loom_status_t etcd_setup(loom_server_t *s, loom_err_t *err) {
    const char *cluster = s->cfg.cluster ? s->cfg.cluster : "default";
    snprintf(s->etcd_prefix, sizeof s->etcd_prefix, "/loom/%s/", cluster);
    LOOM_CHECK(loom_etcd_open(s->cfg.etcd_url, 2000, &s->etcd, err));
    /* a wildcard bind (0.0.0.0) is not dialable: publish --advertise-host instead */
    char ctl[300], api[300];
    advertised(s, s->ctl_addr, ctl, sizeof ctl);
    advertised(s, s->api_addr, api, sizeof api);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "control", ctl);
    cJSON_AddStringToObject(j, "api", api);
    cJSON_AddStringToObject(j, "model", s->model_name);
    cJSON_AddNumberToObject(j, "pid", (double)getpid());
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    char key[400];
    snprintf(key, sizeof key, "%scoordinator", s->etcd_prefix);
    loom_status_t st = loom_etcd_keeper_start(s->etcd, key, text, strlen(text), s->cfg.etcd_ttl, 1, &s->etcd_keeper, err);
    free(text);
    if (st == LOOM_ERR_RESOURCE_EXHAUSTED) {
        char held[sizeof err->msg];
        snprintf(held, sizeof held, "%s", err->msg);
        return loom_err_set(err, st, "another coordinator serves cluster '%s' (%s)", cluster, held);
    }
    LOOM_CHECK(st);
    char prefix[400];
    snprintf(prefix, sizeof prefix, "%sworkers/", s->etcd_prefix);
    LOOM_CHECK(loom_etcd_watch_start(s->etcd, prefix, 0, on_etcd_event, s, &s->etcd_watch, err));
    LOOM_INFO("membership: etcd %s, cluster '%s' (lease TTL %d s)", s->cfg.etcd_url, cluster, s->cfg.etcd_ttl);
    return LOOM_OK;
}

loom_status_t loom_server_create(const loom_server_config_t *cfg, loom_server_t **out, loom_err_t *err) {
    *out = NULL;
    loom_server_t *s = loom_xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    /* workers may run elsewhere: hand them an absolute path */
    if (realpath(cfg->model_dir, s->model_dir_abs)) s->cfg.model_dir = s->model_dir_abs;
    cfg = &s->cfg;
    loom_status_t st = loom_model_config_load(cfg->model_dir, &s->mcfg, err);
    if (st < 0) goto fail;
    st = loom_tokenizer_load(cfg->model_dir, &s->tok, err);
    if (st < 0) goto fail;
    /* an impossible split is a start-up error, before any worker comes */
    for (int r = 0; r < cfg->tp; r++) {
        loom_shard_spec_t spec = {.tp_rank = r, .tp_size = cfg->tp, .layer_begin = 0, .layer_end = s->mcfg.n_layers};
        loom_shard_dims_t d;
        st = loom_shard_dims(&s->mcfg, &spec, &d, err);
        if (st < 0) goto fail;
    }
    if (cfg->pp > s->mcfg.n_layers) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%d pipeline stages for %d layers: every stage needs a layer",
                          cfg->pp, s->mcfg.n_layers);
        goto fail;
    }
    s->max_model_len = cfg->max_model_len > 0 && cfg->max_model_len < s->mcfg.max_seq_len ? cfg->max_model_len
                                                                                              : s->mcfg.max_seq_len;
    if (cfg->model_name) {
        snprintf(s->model_name, sizeof s->model_name, "%s", cfg->model_name);
    } else {
        const char *b = strrchr(cfg->model_dir, '/');
        size_t len = strlen(cfg->model_dir);
        while (len > 1 && cfg->model_dir[len - 1] == '/') len--;
        char tmp[1024];
        snprintf(tmp, sizeof tmp, "%.*s", (int)len, cfg->model_dir);
        b = strrchr(tmp, '/');
        snprintf(s->model_name, sizeof s->model_name, "%.255s", b ? b + 1 : tmp);
    }
    s->n_slots = cfg->tp * cfg->pp;
    s->slots = loom_xcalloc((size_t)s->n_slots, sizeof *s->slots);
    s->inflight = loom_xcalloc((size_t)cfg->pp, sizeof *s->inflight);
    s->probe_fd = loom_xmalloc((size_t)s->n_slots * sizeof *s->probe_fd);
    for (int i = 0; i < s->n_slots; i++) s->probe_fd[i] = -1;
    s->sp = loom_xcalloc((size_t)cfg->max_num_seqs, sizeof *s->sp);
    s->sp_ptrs = loom_xcalloc((size_t)cfg->max_num_seqs, sizeof *s->sp_ptrs);
    s->max_piece = loom_tokenizer_max_piece_len(s->tok);
    s->text_buf = loom_xmalloc(s->max_piece * 4 + 4096 + 1);
    s->seed_state = loom_now_ns() ^ ((uint64_t)getpid() << 32);
    s->run_id = next_seed(s);
    s->metrics = loom_metrics_create(s->model_name, cfg->pp, s->max_model_len);

    s->zctx = zmq_ctx_new();
    s->api = zsock(s, ZMQ_ROUTER);
    s->ctl = zsock(s, ZMQ_ROUTER);
    int one = 1, unlimited = 0;
    zmq_setsockopt(s->api, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    /* a slow client must not lose chunks: queue instead of dropping */
    zmq_setsockopt(s->api, ZMQ_SNDHWM, &unlimited, sizeof unlimited);
    zmq_setsockopt(s->ctl, ZMQ_SNDHWM, &unlimited, sizeof unlimited);
    zmq_setsockopt(s->ctl, ZMQ_ROUTER_HANDOVER, &one, sizeof one);
    st = bind_sock(s->api, cfg->listen, s->api_addr, sizeof s->api_addr, err);
    if (st < 0) goto fail;
    st = bind_sock(s->ctl, cfg->control, s->ctl_addr, sizeof s->ctl_addr, err);
    if (st < 0) goto fail;
    pthread_mutex_init(&s->gone_mu, NULL);
    if (cfg->etcd_url) {
        st = etcd_setup(s, err);
        if (st < 0) goto fail;
    }
    if (cfg->kv_events && (st = loom_kv_events_create(s->zctx, cfg->kv_events, cfg->advertise_host, &s->kv_events, err)) < 0)
        goto fail;
    snprintf(s->inproc_addr, sizeof s->inproc_addr, "inproc://loom-api");
    if (zmq_bind(s->api, s->inproc_addr) != 0) {
        st = loom_err_set(err, LOOM_ERR_INTERNAL, "cannot bind %s", s->inproc_addr);
        goto fail;
    }
    *out = s;
    return LOOM_OK;
fail:
    loom_server_destroy(&s);
    return st;
}

void loom_server_destroy(loom_server_t **s_p) {
    if (!s_p || !*s_p) return;
    loom_server_t *s = *s_p;
    *s_p = NULL;
    while (s->reqs) {
        request_t *q = s->reqs;
        req_unlink(s, q);
        req_free(q);
    }
    loom_etcd_watch_stop(&s->etcd_watch);
    loom_etcd_keeper_stop(&s->etcd_keeper); /* revokes: the coordinator key goes at once */
    loom_etcd_close(&s->etcd);
    while (s->gone) {
        gone_key_t *g = s->gone;
        s->gone = g->next;
        free(g);
    }
    loom_sched_destroy(&s->sched);
    loom_metrics_destroy(&s->metrics);
    loom_kv_events_destroy(&s->kv_events);
    if (s->api) zmq_close(s->api);
    if (s->ctl) zmq_close(s->ctl);
    if (s->zctx) zmq_ctx_term(s->zctx);
    loom_tokenizer_destroy(&s->tok);
    if (s->probe_fd) probes_stop(s);
    free(s->probe_fd);
    free(s->slots);
    free(s->inflight);
    free(s->sp);
    free(s->sp_ptrs);
    free(s->text_buf);
    free(s);
}

void *loom_server_zmq_context(loom_server_t *s) { return s->zctx; }
loom_metrics_t *loom_server_metrics(loom_server_t *s) { return s->metrics; }
const char *loom_server_inproc_addr(const loom_server_t *s) { return s->inproc_addr; }
