/* The coordinator's reactor (see server.h): requests and streams. The grid
 * lifecycle (worker slots, epochs, liveness, the in-flight step queue) is
 * coordinator/grid.c; it reports here through callbacks. When the grid
 * fails, requests are not lost: their sequences keep their tokens and wait
 * (their KV dropped) until the grid is READY again, then are re-prefilled
 * and their streams go on; if the grid is not back within
 * --recovery-timeout-ms they end with UNAVAILABLE.
 *
 * Draining (the first SIGTERM/SIGINT): new Generate requests are refused
 * with UNAVAILABLE ("draining"), Health reports not ready, requests in
 * flight go on; the reactor returns once none is left, or at
 * --shutdown-timeout, when the rest end with a final chunk (finish
 * LENGTH). A second signal returns at once.
 *
 * Preparing: a Generate whose grammar the cache lacks, or whose prompt is
 * long (PREP_PROMPT_BYTES), is not worked on here: its request is kept as it
 * came (preparing_t) while a thread of the preparation pool (prepare.h)
 * compiles the grammar (bounded by --grammar-compile-timeout-ms and
 * --grammar-max-bytes) and tokenizes the prompt; when the job comes back
 * the request is handled again with its results. A Cancel ends a preparing
 * request at once (the job is cancelled); so does its deadline. The reactor
 * itself never blocks on a request's size.
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
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/model_config.h"
#include "common/model_config_deepseek.h"
#include "common/model_digest.h"
#include "common/request_limits.h"
#include "common/tokenizer.h"
#include "common/util.h"
#include "common/shard.h"
#include "coordinator/draft.h"
#include "coordinator/grid.h"
#include "coordinator/kv_events.h"
#include "coordinator/kv_tier_dir.h"
#include "coordinator/kv_tier_host.h"
#include "coordinator/lora_reactor.h"
#include "coordinator/metrics.h"
#include "coordinator/prepare.h"
#include "coordinator/sampling_params.h"
#include "coordinator/structured.h"
#include "coordinator/sched.h"
#include "coordinator/security.h"
#include "coordinator/stop.h"
#include "proto/wire.h"
#include "proto/zapi.h"

#define MAX_STOP LOOM_MAX_STOP
#define MAX_STOP_IDS LOOM_MAX_STOP_IDS
#define MAX_KEEP_IDS 16 /* keep_special_ids */
#define MAX_TAG 128
#define MAX_STOP_LEN LOOM_MAX_STOP_LEN
#define RATE_WINDOW 8 /* seconds of tokens/s history */
#define PREP_PROMPT_BYTES 16384 /* a longer prompt is tokenized on the preparation pool */
#define PREP_GRACE_MS 2000      /* past its deadline, a job that did not stop by itself is abandoned */
#define KV_CHECK_TIMEOUT_MS 60000 /* a remote prefill's blocks read through on the pool within this */

/* A Generate waiting for the preparation pool (its grammar, its tokens). */
typedef struct preparing {
    uint8_t rid[256];
    size_t rid_len;
    uint64_t request_id;
    void *body; /* the Request, packed, handled again when the job is back */
    size_t body_len;
    uint64_t deadline; /* loom_now_ns(): answered with the time limit's error then */
    int kv_check;      /* its job reads a remote prefill's KV blocks (kv_check_submit) */
    loom_prep_job_t *job; /* NULL once abandoned */
    struct preparing *prev, *next;
} preparing_t;

/* A runtime adapter load (vLLM's /v1/load_lora_adapter) while its
 * directory is read and checked on the adapter pool; answered when the job
 * comes back (lora_loads_done). */
typedef struct lora_loading {
    uint8_t rid[256];
    size_t rid_len;
    uint64_t request_id;
    loom_prep_job_t *job;
    struct lora_loading *next;
} lora_loading_t;

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
    int32_t keep_ids[MAX_KEEP_IDS]; /* keep_special_ids (detok.keep points here) */
    int ignore_eos, max_tokens, prompt_tokens, completion_tokens;
    char tag[MAX_TAG + 1]; /* the caller's id, for log lines ("" if none) */
    /* sampling controls (sampling_params.h) */
    loom_sparams_t *sparams;
    int min_tokens;       /* EOS, stop ids and stop strings end nothing before this many tokens */
    int include_stop_str; /* a stop string that ends the request stays in the text */
    /* prompt logprobs (GenerateRequest.prompt_logprobs), by position: entry
     * p is prompt token p + 1's, written as the prefill chunks complete (a
     * re-prefill writes the same again) and sent with the first chunk */
    int plp_on, plp_top, plp_sent;
    int32_t *plp_prompt; /* (prompt_tokens) */
    int pids_want, pids_sent; /* GenerateRequest.return_prompt_ids: the ids (plp_prompt) go with the first chunk */
    float *plp_lp;       /* (prompt_tokens - 1) */
    uint32_t *plp_rank, *plp_ntop;
    int32_t *plp_ids;    /* (prompt_tokens - 1, LOOM_MAX_TOP_LOGPROBS) */
    float *plp_tlp;
    uint64_t t_arrival, t_queued, t_last_token; /* loom_now_ns() */
    uint64_t tokenize_ns, detok_ns, send_ns;    /* time spent in each, summed */
    int kv_remote_decode; /* kv_transfer_params.do_remote_decode: the final chunk carries the decode's params */
    struct request *prev, *next;
} request_t;

struct loom_server {
    loom_server_config_t cfg;
    char model_dir_abs[4096];
    char model_name[256];
    char weights_digest[LOOM_DIGEST_HEX], tokenizer_digest[LOOM_DIGEST_HEX]; /* published in ListModels */
    loom_model_config_t mcfg;
    loom_tokenizer_t *tok;
    int max_model_len;
    loom_structured_t *structured; /* constrained decoding: vocabulary and grammar cache */
    loom_coord_draft_t *draft;     /* speculative method DRAFT's draft model (NULL: none) */
    /* micro-batches built but not sent, in the order built: those whose
     * drafts the draft's thread is computing (ready 0), and the ones built
     * after them (sent in order) */
    struct {
        loom_microbatch_t *mb;
        int ready;
    } *unsent;
    int n_unsent;
    int ahead;               /* overlapped scheduling is on (cfg.async_scheduling, one stage) */
    loom_microbatch_t *tail; /* the latest micro-batch built while it is in flight (planned ahead of) */

    void *zctx, *api;
    char api_addr[256], inproc_addr[64];
    loom_zap_t *zap; /* CURVE: the ZAP handler of both sockets (NULL: nothing keyed) */
    volatile sig_atomic_t stop, drain_requested; /* set by loom_server_stop (signal handlers) */
    int draining;
    uint64_t drain_deadline;
    loom_grid_t *grid;
    loom_lora_reactor_t *lora; /* LoRA adapters (NULL: --enable-lora not given) */
    loom_prep_t *lora_prep;    /* runtime adapter loads' reads: one thread, so no request's grammar waits behind one */
    lora_loading_t *lora_loading; /* the loads out on it */
    int lora_max_cpu;          /* --max-cpu-loras (Assign.max_cpu_loras) */

    loom_sched_t *sched;
    loom_metrics_t *metrics;
    request_t *reqs; /* doubly linked list of live requests */
    struct embed_req *embeds; /* live Embed calls */
    loom_seq_t **embed_done;  /* the completing step's finished embedding sequences */
    int n_embed_done, cap_embed_done;
    int n_reqs;
    size_t max_piece;
    char *text_buf;
    uint64_t seed_state;

    loom_lp_view_t lp_view;        /* the completing step's logprobs, by sequence */
    const loom_token_lp_t *emit_lp; /* the logprobs of the token on_token is emitting */

    /* counters */
    uint64_t steps, requests_finished, requests_rejected, prompt_tokens_total, gen_tokens_total;
    uint64_t prefix_queries_base, prefix_hits_base, preemptions_base; /* from schedulers of earlier epochs */
    double step_s_total;
    uint64_t rate_tokens[RATE_WINDOW];
    uint64_t rate_second;
    uint64_t recovery_deadline; /* requests wait for the grid until then (0: none waiting) */
    loom_kv_events_t *kv_events; /* --kv-events publisher (NULL: off) */
    loom_kv_connector_t *kv_conn; /* the KV tier's connector: --kv-offloading-dir or -size (NULL: off) */
    int kv_check_fd;              /* readable when the directory tier's checks finish (-1: none) */
    loom_prep_t *prep;           /* the preparation pool */
    preparing_t *preparing;      /* requests waiting for it */
    int n_preparing;
    const loom_prep_job_t *handoff; /* while a prepared request is handled again: its job's results */

    /* liveness, read by other threads (loom_server_liveness): the reactor's
     * last turn, the last moment a step completed or none was due, and the
     * requests waiting then */
    _Atomic uint64_t live_turn_ns, live_progress_ns;
    _Atomic int live_pending;
    uint64_t stall_max_ns, stall_log_ns; /* the longest reactor turn since the last log of one */
    const char *stall_file;               /* test hook LOOM_TEST_STALL_FILE (NULL: off) */
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

/* Replies to a client (proto/zapi.h); -1: the client is gone. */
static int send_reply(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Reply *r) {
    return loom_zapi_send_reply(s->api, rid, rid_len, r);
}

static int reply_error(loom_server_t *s, const void *rid, size_t rid_len, uint64_t request_id,
                       loom_status_t code, const char *msg) {
    return loom_zapi_reply_error(s->api, rid, rid_len, request_id, code, msg);
}

/* A LoRA load or unload answered: vLLM's text on success, else the error. */
static void reply_lora_adapter(loom_server_t *s, const void *rid, size_t rid_len, uint64_t request_id,
                               loom_status_t st, const char *msg) {
    if (st != LOOM_OK) {
        reply_error(s, rid, rid_len, request_id, st, msg);
        return;
    }
    Loom__V1__LoraAdapterReply la = LOOM__V1__LORA_ADAPTER_REPLY__INIT;
    la.message = (char *)msg;
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = request_id;
    r.body_case = LOOM__V1__REPLY__BODY_LORA_ADAPTER;
    r.lora_adapter = &la;
    send_reply(s, rid, rid_len, &r);
}

/* ---- requests ------------------------------------------------------------------- */

static void prep_unlink(loom_server_t *s, preparing_t *p) {
    if (p->prev) p->prev->next = p->next;
    else s->preparing = p->next;
    if (p->next) p->next->prev = p->prev;
    s->n_preparing--;
}

/* Ends a preparing request: its job, if still out, is cancelled and freed
 * when it comes back. */
static void prep_drop(loom_server_t *s, preparing_t *p) {
    prep_unlink(s, p);
    if (p->job) {
        p->job->ctx = NULL;
        loom_prep_cancel(p->job);
    }
    free(p->body);
    free(p);
}


static void req_unlink(loom_server_t *s, request_t *q) {
    if (q->prev) q->prev->next = q->next;
    else s->reqs = q->next;
    if (q->next) q->next->prev = q->prev;
    s->n_reqs--;
}

static char *kv_decode_params(loom_server_t *s, const request_t *q);

static void req_free(request_t *q) {
    for (int i = 0; i < q->n_stop; i++) free(q->stop[i]);
    free(q->plp_prompt);
    free(q->plp_lp);
    free(q->plp_rank);
    free(q->plp_ntop);
    free(q->plp_ids);
    free(q->plp_tlp);
    free(q->pending);
    loom_sparams_destroy(&q->sparams);
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

/* A constrained request's text is kept and, at the end, checked against its
 * grammar: an end on anything but a complete match (the budget, a stop
 * string or id cutting it short) is reported as length. */
static Loom__V1__FinishReason guided_finish(loom_guide_t *g, const char *text, size_t n, Loom__V1__FinishReason f) {
    loom_guide_text_append(g, text, n);
    if (f == LOOM__V1__FINISH_REASON__FINISH_STOP && !loom_guide_text_complete(g))
        return LOOM__V1__FINISH_REASON__FINISH_LENGTH;
    return f;
}

/* Sends a chunk; finish != NONE makes it the final one and ends the request.
 * Returns 1 when the request ended (it is freed: do not touch it again),
 * which also happens when its client is gone. */
static int req_emit(loom_server_t *s, request_t *q, const int32_t *ids, int n_ids, const char *text,
                     size_t text_len, Loom__V1__FinishReason finish, loom_status_t code, const char *msg) {
    Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
    ch.ids = (int32_t *)ids;
    ch.n_ids = (size_t)n_ids;
    float lp = 0.0f;
    uint32_t n_top = 0;
    if (n_ids == 1 && s->emit_lp) {
        lp = s->emit_lp->logprob;
        n_top = (uint32_t)s->emit_lp->n_top;
        ch.logprobs = &lp;
        ch.n_logprobs = 1;
        ch.n_top = &n_top;
        ch.n_n_top = 1;
        ch.top_ids = (int32_t *)s->emit_lp->top_ids;
        ch.top_logprobs = (float *)s->emit_lp->top_lps;
        ch.n_top_ids = ch.n_top_logprobs = n_top;
    }
    s->emit_lp = NULL;
    int32_t *p_ids = NULL;
    float *p_lps = NULL;
    if (q->pids_want && !q->pids_sent && !q->plp_on) { /* the prompt's ids alone, in the first chunk */
        ch.prompt_ids = q->plp_prompt;
        ch.n_prompt_ids = (size_t)q->prompt_tokens;
        q->pids_sent = 1;
    }
    if (q->plp_on && !q->plp_sent && n_ids > 0) { /* the prefill is done: the prompt's logprobs go first */
        int np = q->prompt_tokens - 1;
        size_t nt = 0;
        for (int i = 0; i < np; i++) nt += q->plp_ntop[i];
        p_ids = loom_xmalloc((nt + 1) * sizeof *p_ids);
        p_lps = loom_xmalloc((nt + 1) * sizeof *p_lps);
        nt = 0;
        for (int i = 0; i < np; i++) {
            memcpy(p_ids + nt, q->plp_ids + (size_t)i * LOOM_MAX_TOP_LOGPROBS, q->plp_ntop[i] * sizeof *p_ids);
            memcpy(p_lps + nt, q->plp_tlp + (size_t)i * LOOM_MAX_TOP_LOGPROBS, q->plp_ntop[i] * sizeof *p_lps);
            nt += q->plp_ntop[i];
        }
        ch.prompt_ids = q->plp_prompt;
        ch.n_prompt_ids = (size_t)q->prompt_tokens;
        ch.prompt_logprobs = q->plp_lp;
        ch.prompt_ranks = q->plp_rank;
        ch.prompt_n_top = q->plp_ntop;
        ch.n_prompt_logprobs = ch.n_prompt_ranks = ch.n_prompt_n_top = (size_t)np;
        ch.prompt_top_ids = p_ids;
        ch.prompt_top_logprobs = p_lps;
        ch.n_prompt_top_ids = ch.n_prompt_top_logprobs = nt;
        q->plp_sent = 1;
    }
    loom_guide_t *guide = loom_sparams_guide(q->sparams);
    if (guide) finish = guided_finish(guide, text, text_len, finish);
    char *t = s->text_buf;
    if (text_len) {
        t = text_len < s->max_piece * 4 + 4096 ? s->text_buf : loom_xmalloc(text_len + 1);
        memcpy(t, text, text_len);
    }
    t[text_len] = '\0';
    ch.text = t;
    ch.finish_reason = finish;
    char *kv_params = NULL;
    Loom__V1__Usage usage = LOOM__V1__USAGE__INIT;
    Loom__V1__Timings timings = LOOM__V1__TIMINGS__INIT;
    int final = finish != LOOM__V1__FINISH_REASON__FINISH_NONE;
    uint64_t t_send = loom_now_ns();
    if (final) {
        ch.final = 1;
        usage.prompt_tokens = (uint32_t)q->prompt_tokens;
        usage.completion_tokens = (uint32_t)q->completion_tokens;
        usage.cached_tokens = q->seq ? (uint32_t)q->seq->cached_tokens : 0;
        if (q->seq) {
            usage.spec_draft_tokens = (uint32_t)q->seq->spec_drafted;
            usage.spec_accepted_tokens = (uint32_t)q->seq->spec_accepted;
            usage.target_steps = (uint32_t)q->seq->n_steps;
        }
        ch.usage = &usage;
        if (q->kv_remote_decode && q->seq && code == LOOM_OK) ch.kv_transfer_params = kv_params = kv_decode_params(s, q);
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
    free(p_ids);
    free(p_lps);
    free(kv_params);
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
    s->emit_lp = loom_lp_view_get(&s->lp_view, seq); /* sent with the token by req_emit */
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

    int may_stop = q->completion_tokens > q->min_tokens; /* min_tokens: the workers ban EOS and stop ids */
    /* a grammar allows EOS only where it accepts: that ends the output even with ignore_eos */
    int eos_ends = !q->ignore_eos || loom_sparams_guide(q->sparams);
    if (may_stop && ((eos_ends && loom_model_config_is_eos(&s->mcfg, id)) || is_stop_id(q, id))) {
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
    long hit = may_stop ? loom_stop_find(q->stop, q->n_stop, q->pending, q->n_pending) : -1;
    if (hit >= 0) {
        if (q->include_stop_str) hit += (long)loom_stop_len_at(q->stop, q->n_stop, q->pending, q->n_pending, (size_t)hit);
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

/* ---- embeddings (the Embed method) ------------------------------------------------------ */

/* One Embed call: each input is a sequence of its own (sched.h
 * loom_sched_add_embed), all queued at once; the reply goes when the last
 * has its vector. */
typedef struct embed_item {
    struct embed_req *req;
    loom_seq_t *seq;  /* NULL once its vector is complete */
    int index;
} embed_item_t;

typedef struct embed_req {
    uint8_t rid[256];
    size_t rid_len;
    uint64_t request_id;
    char tag[MAX_TAG + 1];
    int n, n_left, prompt_tokens;
    embed_item_t *items; /* (n) */
    float *vec;          /* (n, dim) sums, then unit vectors */
    struct embed_req *prev, *next;
} embed_req_t;

static int valid_tag(const char *t);

static void embed_unlink_free(loom_server_t *s, embed_req_t *e) {
    if (e->prev) e->prev->next = e->next;
    else s->embeds = e->next;
    if (e->next) e->next->prev = e->prev;
    for (int i = 0; i < e->n; i++)
        if (e->items[i].seq && s->sched) loom_sched_finish(s->sched, e->items[i].seq);
    free(e->items);
    free(e->vec);
    free(e);
}

static void embed_fail(loom_server_t *s, embed_req_t *e, loom_status_t code, const char *msg) {
    reply_error(s, e->rid, e->rid_len, e->request_id, code, msg);
    embed_unlink_free(s, e);
}

static void embed_fail_all(loom_server_t *s, loom_status_t code, const char *msg) {
    while (s->embeds) embed_fail(s, s->embeds, code, msg);
}

static void embed_reply(loom_server_t *s, embed_req_t *e) {
    size_t dim = (size_t)s->mcfg.dim;
    Loom__V1__Embedding *rows = loom_xcalloc((size_t)e->n, sizeof *rows);
    Loom__V1__Embedding **ptrs = loom_xcalloc((size_t)e->n, sizeof *ptrs);
    for (int i = 0; i < e->n; i++) {
        loom__v1__embedding__init(&rows[i]);
        rows[i].values = e->vec + (size_t)i * dim;
        rows[i].n_values = dim;
        ptrs[i] = &rows[i];
    }
    Loom__V1__EmbedReply er = LOOM__V1__EMBED_REPLY__INIT;
    er.data = ptrs;
    er.n_data = (size_t)e->n;
    er.prompt_tokens = (uint32_t)e->prompt_tokens;
    er.pooling = s->cfg.embedding_pooling == LOOM_POOL_MEAN ? "mean" : "last";
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = e->request_id;
    r.body_case = LOOM__V1__REPLY__BODY_EMBED;
    r.embed = &er;
    send_reply(s, e->rid, e->rid_len, &r);
    loom_log_req(LOOM_LOG_DEBUG, e->tag, "embed %llu done: %d input(s), %d tokens",
                 (unsigned long long)e->request_id, e->n, e->prompt_tokens);
    s->requests_finished++;
    free(ptrs);
    free(rows);
    embed_unlink_free(s, e);
}

/* A completed micro-batch's embedding ranges (before loom_sched_complete):
 * the sums are added up per sequence (a range starting at position 0 starts
 * over: a preempted sequence is prefilled again); a sequence's final range
 * makes its vector, L2-normalised (which makes sum and mean the same). */
static int embed_step(loom_server_t *s, loom_microbatch_t *mb, const Loom__V1__StepResult *r, char *err,
                      size_t err_n) {
    size_t dim = (size_t)s->mcfg.dim;
    if (r->n_embeddings != (size_t)mb->n_embeds * dim) {
        snprintf(err, err_n, "the last stage returned %zu embedding values for %d range(s) of %zu", r->n_embeddings,
                 mb->n_embeds, dim);
        return -1;
    }
    for (int k = 0; k < mb->n_embeds; k++) {
        loom_seq_t *q = mb->embed_seq[k];
        if (q->finish_pending) continue;
        embed_item_t *it = q->user;
        embed_req_t *e = it->req;
        float *v = e->vec + (size_t)it->index * dim;
        const float *src = r->embeddings + (size_t)k * dim;
        if (mb->embed_pos[k] == 0 || q->embed == LOOM_POOL_LAST) memset(v, 0, dim * sizeof *v);
        for (size_t j = 0; j < dim; j++) v[j] += src[j];
        if (!mb->embed_final[k]) continue;
        double ss = 0;
        for (size_t j = 0; j < dim; j++) ss += (double)v[j] * v[j];
        double inv = ss > 0 ? 1.0 / sqrt(ss) : 0.0;
        for (size_t j = 0; j < dim; j++) v[j] = (float)(v[j] * inv);
        /* finished after loom_sched_complete, so that its blocks join the prefix cache */
        if (s->n_embed_done == s->cap_embed_done) {
            s->cap_embed_done = s->cap_embed_done ? 2 * s->cap_embed_done : 64;
            s->embed_done = loom_xrealloc(s->embed_done, (size_t)s->cap_embed_done * sizeof *s->embed_done);
        }
        s->embed_done[s->n_embed_done++] = q;
        it->seq = NULL;
        if (--e->n_left == 0) embed_reply(s, e);
    }
    return 0;
}

#define MAX_EMBED_INPUTS 2048

static void on_embed(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    const Loom__V1__EmbedRequest *g = rq->embed;
    char msg[600];
    loom_err_t err = {0};
    loom_status_t code = LOOM_ERR_INVALID_ARGUMENT;
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    embed_req_t *e = NULL;
    if (s->draining) {
        snprintf(msg, sizeof msg, "draining: this coordinator is shutting down and admits no new requests");
        code = LOOM_ERR_UNAVAILABLE;
        goto refuse;
    }
    if (loom_grid_state(s->grid) != LOOM_GRID_READY || !s->sched) {
        loom_grid_describe(s->grid, msg, sizeof msg);
        code = LOOM_ERR_UNAVAILABLE;
        goto refuse;
    }
    if (g->model && g->model[0] && strcmp(g->model, s->model_name) != 0) {
        snprintf(msg, sizeof msg, "model '%s' is not served here; this server serves '%s'", g->model, s->model_name);
        code = LOOM_ERR_NOT_FOUND;
        goto refuse;
    }
    if (g->tag && g->tag[0] && !valid_tag(g->tag)) {
        snprintf(msg, sizeof msg, "tag must be at most %d printable ASCII characters", MAX_TAG);
        goto refuse;
    }
    if (g->n_inputs == 0) {
        snprintf(msg, sizeof msg, "input is empty: give at least one text or list of token ids");
        goto refuse;
    }
    if (g->n_inputs > MAX_EMBED_INPUTS) {
        snprintf(msg, sizeof msg, "input has %zu items; at most %d are allowed", g->n_inputs, MAX_EMBED_INPUTS);
        goto refuse;
    }
    e = loom_xcalloc(1, sizeof *e);
    memcpy(e->rid, rid, rid_len);
    e->rid_len = rid_len;
    e->request_id = rq->request_id;
    snprintf(e->tag, sizeof e->tag, "%s", g->tag ? g->tag : "");
    e->n = (int)g->n_inputs;
    e->items = loom_xcalloc(g->n_inputs, sizeof *e->items);
    e->vec = loom_xcalloc(g->n_inputs * (size_t)s->mcfg.dim, sizeof *e->vec);
    e->next = s->embeds;
    if (s->embeds) s->embeds->prev = e;
    s->embeds = e;
    loom_pooling_t pool = s->cfg.embedding_pooling == LOOM_POOL_MEAN ? LOOM_POOL_MEAN : LOOM_POOL_LAST;
    for (size_t i = 0; i < g->n_inputs; i++) {
        const Loom__V1__EmbedInput *in = g->inputs[i];
        n_ids = 0;
        if (in->text && in->text[0]) {
            if (loom_tokenizer_encode(s->tok, in->text, strlen(in->text), 1, 0, &ids, &n_ids, &cap, &err) < 0) {
                snprintf(msg, sizeof msg, "cannot tokenize input %zu: %s", i, err.msg);
                goto refuse;
            }
        } else {
            for (size_t j = 0; j < in->n_ids; j++)
                if (in->ids[j] < 0 || in->ids[j] >= s->mcfg.vocab_size) {
                    snprintf(msg, sizeof msg, "input %zu: token id %d at %zu is outside the vocabulary [0, %d)", i,
                             in->ids[j], j, s->mcfg.vocab_size);
                    goto refuse;
                }
            if (cap < (int)in->n_ids) {
                cap = (int)in->n_ids;
                ids = loom_xrealloc(ids, (size_t)cap * sizeof *ids);
            }
            if (in->n_ids) memcpy(ids, in->ids, in->n_ids * sizeof *ids);
            n_ids = (int)in->n_ids;
        }
        if (n_ids == 0) {
            snprintf(msg, sizeof msg, "input %zu is empty", i);
            goto refuse;
        }
        if (n_ids >= s->max_model_len) {
            snprintf(msg, sizeof msg, "input %zu is %d tokens; the context length is %d", i, n_ids, s->max_model_len);
            goto refuse;
        }
        e->items[i].req = e;
        e->items[i].index = (int)i;
        loom_status_t st = loom_sched_add_embed(s->sched, rq->request_id, ids, n_ids, pool, g->priority,
                                                &e->items[i], &e->items[i].seq, &err);
        if (st < 0) {
            code = st;
            snprintf(msg, sizeof msg, "input %zu: %s", i, err.msg);
            goto refuse;
        }
        e->prompt_tokens += n_ids;
    }
    free(ids);
    e->n_left = e->n;
    s->prompt_tokens_total += (uint64_t)e->prompt_tokens;
    loom_log_req(LOOM_LOG_DEBUG, e->tag, "embed %llu queued: %d input(s), %d tokens", (unsigned long long)e->request_id,
                 e->n, e->prompt_tokens);
    return;
refuse:
    free(ids);
    s->requests_rejected++;
    if (e) embed_unlink_free(s, e);
    reply_error(s, rid, rid_len, rq->request_id, code, msg);
}

/* Ends every live request with an error (the grid failed or is going away). */
static void fail_all_requests(loom_server_t *s, loom_status_t code, const char *msg) {
    while (s->reqs) {
        request_t *q = s->reqs;
        req_emit(s, q, NULL, 0, NULL, 0, LOOM__V1__FINISH_REASON__FINISH_ERROR, code, msg);
    }
    while (s->preparing) {
        reply_error(s, s->preparing->rid, s->preparing->rid_len, s->preparing->request_id, code, msg);
        prep_drop(s, s->preparing);
    }
    embed_fail_all(s, code, msg);
}

/* ---- the grid's callbacks ---------------------------------------------------------- */

/* The host tier is the connector (not the directory's). */
static int kv_host(const loom_server_t *s) { return s->kv_conn && !strcmp(s->kv_conn->tier, "host"); }

/* Prefill/decode transfers go worker to worker (transport tcp). */
static int kv_xfer_tcp(const loom_server_t *s) {
    const loom_kv_transfer_config_t *c = &s->cfg.kv_transfer;
    return (c->producer || c->consumer) && c->transport == LOOM_KV_TRANSPORT_TCP;
}

/* The directory tier's connector (alone, or below the host tier), NULL
 * when there is none. */
static loom_kv_connector_t *kv_dir(const loom_server_t *s) {
    if (!s->kv_conn) return NULL;
    loom_kv_connector_t *c = kv_host(s) ? s->kv_conn->lower : s->kv_conn;
    return c && !strcmp(c->tier, "dir") ? c : NULL;
}

/* The tier serves this epoch's grid: the directory tier its identity and
 * shards, the host tier its slots (empty: the workers' arenas are new). */
static void kv_tier_attach(loom_server_t *s, loom_grid_t *g) {
    if (kv_host(s)) loom_kv_host_connector_set_slots(s->kv_conn, loom_grid_kv_host_slots(g));
    loom_kv_connector_t *dir = kv_dir(s);
    if (dir) {
        int n = loom_grid_n_slots(g);
        uint64_t *bytes = loom_xmalloc((size_t)n * sizeof *bytes);
        for (int i = 0; i < n; i++) bytes[i] = loom_grid_slot_kv_block_bytes(g, i);
        loom_kv_dir_connector_set_grid(dir, loom_grid_kv_tier_id(g), n, bytes);
        free(bytes);
    }
    loom_sched_set_connector(s->sched, s->kv_conn);
}

/* --enable-dp-attention against the model and the other options: what it
 * cannot serve is refused at start, by name (docs/architecture.md). */
static loom_status_t dp_attention_check(loom_server_t *s, loom_err_t *err) {
    loom_server_config_t *c = &s->cfg;
    if (!c->dp_attention) return LOOM_OK;
    if (c->tp < 2) {
        LOOM_INFO("--enable-dp-attention with --tp 1: one rank runs every sequence's attention already; ignored");
        c->dp_attention = 0;
        return LOOM_OK;
    }
    const char *no = !s->mcfg.deepseek ? "a model other than DeepSeek's MLA (model_type '%s')"
                     : c->kv_offload_dir || c->kv_offload_host_bytes ||
                             c->kv_transfer.transport == LOOM_KV_TRANSPORT_TCP
                         ? "the KV offload tiers (--kv-offloading-dir, --kv-offloading-size, --kv-transfer-config)"
                     : c->spec.method == LOOM_SPEC_MTP ? "--speculative-method mtp"
                     : c->max_loras > 0 ? "LoRA adapters (--enable-lora, --max-loras)"
                                        : NULL;
    if (no) {
        char what[160];
        snprintf(what, sizeof what, no, s->mcfg.model_type);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--enable-dp-attention does not serve %s", what);
    }
    if (!c->expert_parallel && s->mcfg.n_experts > 0)
        LOOM_INFO("--enable-dp-attention: the MoE layers run expert-parallel (--expert-parallel implied)");
    c->expert_parallel = 1;
    return LOOM_OK;
}

/* --disable-mla (decompressed MLA) against the model and the other options:
 * a model without MLA ignores it (as vLLM does VLLM_MLA_DISABLE); what it
 * cannot serve is refused at start, by name (docs/architecture.md). The
 * workers refuse a backend without narrower V heads (CUDA) at load. */
static loom_status_t mla_disable_check(loom_server_t *s, loom_err_t *err) {
    loom_server_config_t *c = &s->cfg;
    if (!c->mla_disable) return LOOM_OK;
    if (!s->mcfg.deepseek) {
        LOOM_INFO("--disable-mla: model_type '%s' has no latent attention; ignored", s->mcfg.model_type);
        c->mla_disable = 0;
        return LOOM_OK;
    }
    const char *no = c->dp_attention                   ? "--enable-dp-attention (its attention runs the latent)"
                     : c->spec.method == LOOM_SPEC_MTP ? "--speculative-method mtp (the module's cache is the latent)"
                     : c->max_loras > 0                ? "LoRA adapters (--enable-lora, --max-loras)"
                                                       : NULL;
    if (no) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--disable-mla does not serve %s", no);
    LOOM_INFO("--disable-mla: decompressed keys and values per head in the KV pool, %zu B a token in f32 "
              "(the latent: %zu B)", loom_deepseek_mha_kv_bytes_per_token(&s->mcfg, 4, 0),
              loom_deepseek_kv_bytes_per_token(&s->mcfg, 4));
    return LOOM_OK;
}

/* The grid is READY: a scheduler for its KV pool, or the old one reset. */
static void on_grid_ready(void *ctx, loom_grid_t *g) {
    loom_server_t *s = ctx;
    /* data-parallel attention: the ledger holds every rank's pool, one partition each */
    const int n_dp = s->cfg.dp_attention ? s->cfg.tp : 1, n_blocks = loom_grid_n_blocks(g);
    if (s->lora) loom_lora_reactor_grid_ready(s->lora); /* the new engines hold no adapters */
    if (s->sched) {
        /* the KV cache of the old grid is gone: recompute the waiting requests */
        loom_sched_reset_kv(s->sched, n_blocks * n_dp);
        for (request_t *q = s->reqs, *next; q; q = next) {
            next = q->next;
            if (q->seq && loom_sched_seq_max_blocks(s->sched, q->seq) > n_blocks)
                req_emit(s, q, NULL, 0, NULL, 0, LOOM__V1__FINISH_REASON__FINISH_ERROR, LOOM_ERR_UNAVAILABLE,
                         "the restored grid's KV cache is too small for this request");
        }
        if (s->n_reqs) LOOM_INFO("grid restored: %d request(s) resume (re-prefilled from their tokens)", s->n_reqs);
        s->recovery_deadline = 0;
    } else {
        loom_sched_config_t sc = {.max_num_seqs = s->cfg.max_num_seqs, .max_batched_tokens = s->cfg.max_batched_tokens,
                                  .max_queue = s->cfg.max_queue, .max_model_len = s->max_model_len,
                                  .n_micro = s->cfg.pp, .block_size = s->cfg.block_size,
                                  .n_blocks = n_blocks * n_dp, .n_dp = n_dp, .prefix_cache = s->cfg.prefix_cache,
                                  .ahead = s->ahead,
                                  .window = loom_model_config_all_windowed(&s->mcfg) ? s->mcfg.sliding_window : 0};
        s->sched = loom_sched_create(&sc);
        loom_sched_set_spec(s->sched, &s->cfg.spec);
        if (s->lora) loom_sched_set_lora_slots(s->sched, loom_lora_reactor_slots(s->lora));
        if (s->draft) loom_coord_draft_attach(s->draft, s->sched);
    }
    if (s->kv_conn) kv_tier_attach(s, g);
    /* a host tier is not shared; the directory under it is (its saves are the events') */
    loom_kv_events_set_tier(s->kv_events, kv_dir(s) ? loom_grid_kv_tier_id(g) : 0);
    loom_kv_events_publish(s->kv_events, s->sched); /* observe the new ledger at once */
    LOOM_INFO("grid ready (epoch %llu): %d worker(s), %d KV blocks of %d tokens; serving %s on %s",
              (unsigned long long)loom_grid_epoch(g), loom_grid_n_slots(g), n_blocks, s->cfg.block_size,
              s->model_name, s->api_addr);
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

/* The micro-batches not sent yet did not run either: their sequences go
 * back as the in-flight ones did (drafts still being computed are dropped). */
static void unsent_fail(loom_server_t *s) {
    s->tail = NULL;
    for (int i = 0; i < s->n_unsent; i++) {
        if (s->draft) loom_coord_draft_void(s->draft, s->unsent[i].mb);
        loom_sched_fail(s->sched, s->unsent[i].mb);
    }
    s->n_unsent = 0;
}

/* The grid's epoch was aborted: requests wait for it to come back, or end
 * with UNAVAILABLE at once when there is no recovery time. */
static void on_grid_failed(void *ctx, loom_grid_t *g, const char *why) {
    (void)g;
    loom_server_t *s = ctx;
    if (!s->sched) return;
    unsent_fail(s);
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

/* A completed micro-batch's prompt logprobs (checked first: a malformed
 * result fails the step), stored by position in their requests. */
static int prompt_lp_step(loom_server_t *s, const loom_microbatch_t *mb, const Loom__V1__StepResult *r, char *err,
                          size_t err_n) {
    size_t n = (size_t)mb->n_plp;
    if (r->n_prompt_logprobs != n || r->n_prompt_ranks != n || r->n_prompt_n_top != n ||
        r->n_prompt_top_ids != r->n_prompt_top_logprobs) {
        snprintf(err, err_n, "a worker returned prompt logprobs for %zu of %zu positions", r->n_prompt_logprobs, n);
        return -1;
    }
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        if (r->prompt_n_top[i] > mb->plp_top[i] || off + r->prompt_n_top[i] > r->n_prompt_top_ids) {
            snprintf(err, err_n, "a worker returned a malformed prompt top_logprobs list");
            return -1;
        }
        for (size_t j = off; j < off + r->prompt_n_top[i]; j++)
            if (r->prompt_top_ids[j] < 0 || r->prompt_top_ids[j] >= s->mcfg.vocab_size) {
                snprintf(err, err_n, "a worker returned a prompt top_logprobs id outside the vocabulary");
                return -1;
            }
        off += r->prompt_n_top[i];
    }
    off = 0;
    for (size_t i = 0; i < n; i++) {
        const loom_seq_t *seq = mb->plp_seq[i];
        size_t k = r->prompt_n_top[i];
        request_t *q = seq->finish_pending ? NULL : seq->user; /* finished while in flight: gone */
        int p = mb->plp_pos[i];
        if (q && q->plp_on && p >= 0 && p + 1 < q->prompt_tokens) {
            q->plp_lp[p] = r->prompt_logprobs[i];
            q->plp_rank[p] = r->prompt_ranks[i];
            q->plp_ntop[p] = (uint32_t)k;
            if (k) { /* protobuf-c leaves an empty repeated field NULL */
                memcpy(q->plp_ids + (size_t)p * LOOM_MAX_TOP_LOGPROBS, r->prompt_top_ids + off, k * sizeof(int32_t));
                memcpy(q->plp_tlp + (size_t)p * LOOM_MAX_TOP_LOGPROBS, r->prompt_top_logprobs + off,
                       k * sizeof(float));
            }
        }
        off += k;
    }
    return 0;
}

static void schedule(loom_server_t *s);

static void on_step_failed(void *ctx, loom_microbatch_t *mb);

/* Transport tcp: the decode side reported a transfer read; its blocks go. */
static void on_kv_read(void *ctx, uint64_t transfer) {
    loom_server_t *s = ctx;
    if (!s->sched) return;
    int n = loom_sched_unhold(s->sched, transfer);
    if (n > 0) loom_grid_kv_hold(s->grid, transfer, NULL, 0, 1);
    LOOM_DEBUG("KV transfer %016llx read by the decode side: %d blocks freed", (unsigned long long)transfer, n);
}

/* Transport tcp: some of a step's pulls failed (StepResult.kv_pull_failed).
 * Their sequences' KV is not valid, so the step's results go: every
 * sequence of the step is computed again (the failed ones without pulling:
 * kv_load_failure_policy recompute), or a failed one's request ends with
 * UNAVAILABLE (fail). */
static void pulls_failed(loom_server_t *s, loom_microbatch_t *mb, const Loom__V1__StepResult *r) {
    for (size_t i = 0; i < r->n_kv_pull_failed; i++) {
        uint32_t src = r->kv_pull_failed[i];
        const char *why = i < r->n_kv_pull_errors ? r->kv_pull_errors[i] : "";
        if (src >= (uint32_t)mb->n_pull_srcs) continue;
        loom_seq_t *q = mb->pull_seq[src];
        request_t *rq = q->user;
        if (s->cfg.kv_transfer.policy == LOOM_KV_LOAD_FAIL && rq && rq->seq == q) {
            char msg[700]; /* so worded, loom-router relays it rather than fail over (kv_load_refused) */
            snprintf(msg, sizeof msg, "kv_transfer_params: the prefill's KV blocks could not be pulled "
                     "(kv_load_failure_policy fail): %.500s", why);
            loom_log_req(LOOM_LOG_INFO, rq->tag, "request %llu: %s", (unsigned long long)rq->request_id, msg);
            req_emit(s, rq, NULL, 0, NULL, 0, LOOM__V1__FINISH_REASON__FINISH_ERROR, LOOM_ERR_UNAVAILABLE, msg);
        } else {
            LOOM_INFO("kv_transfer_params: the prefill's KV blocks could not be pulled: recomputed: %s", why);
            loom_sched_pull_failed(s->sched, q);
        }
    }
    on_step_failed(s, mb);
}

static int on_step_done(void *ctx, loom_microbatch_t *mb, const Loom__V1__StepResult *r, double step_s, char *err,
                        size_t err_n) {
    loom_server_t *s = ctx;
    if (r->n_kv_pull_failed) {
        pulls_failed(s, mb, r);
        return 0;
    }
    if (mb == s->tail) s->tail = NULL;
    s->steps++;
    s->step_s_total += step_s;
    loom_metrics_observe_step(s->metrics, step_s);
    loom_sched_observe_step(s->sched, mb->n_tokens, step_s); /* the target's cost; the gate times the draft */
    atomic_store(&s->live_progress_ns, loom_now_ns());
    if (loom_lp_view_bind(&s->lp_view, mb, r, s->mcfg.vocab_size, err, err_n) < 0) return -1;
    if (prompt_lp_step(s, mb, r, err, err_n) < 0) return -1;
    s->n_embed_done = 0;
    if (embed_step(s, mb, r, err, err_n) < 0) return -1;
    if (r->n_mtp_drafts) {
        if (s->cfg.spec.method != LOOM_SPEC_MTP || r->n_mtp_drafts != (size_t)mb->n_seqs) {
            snprintf(err, err_n, "a worker returned %zu MTP drafts for %d sequences", r->n_mtp_drafts, mb->n_seqs);
            return -1;
        }
        for (size_t i = 0; i < r->n_mtp_drafts; i++)
            if (r->mtp_drafts[i] < -1 || r->mtp_drafts[i] >= s->mcfg.vocab_size) {
                snprintf(err, err_n, "a worker returned an MTP draft outside the vocabulary");
                return -1;
            }
        loom_sched_mtp_drafts(mb, r->mtp_drafts);
    }
    loom_sched_complete(s->sched, mb, r->ids, on_token, s);
    for (int i = 0; i < s->n_embed_done; i++) loom_sched_finish(s->sched, s->embed_done[i]);
    loom_lp_view_unbind(&s->lp_view);
    /* overlapped: the step after the one now running goes out at once, not
     * after the results already queued behind this one are read */
    if (s->ahead) schedule(s);
    return 0;
}

static void on_step_failed(void *ctx, loom_microbatch_t *mb) {
    loom_server_t *s = ctx;
    if (mb == s->tail) s->tail = NULL;
    if (kv_host(s) && loom_kv_host_connector_used(s->kv_conn)) {
        /* its saves may not have run: the host tier forgets what it holds
         * rather than order a load of a slot a worker never filled */
        LOOM_WARN("KV offload: a step failed; the host tier's %d blocks are forgotten",
                  loom_kv_host_connector_used(s->kv_conn));
        loom_kv_host_connector_set_slots(s->kv_conn, loom_kv_host_connector_slots(s->kv_conn));
    }
    loom_sched_fail(s->sched, mb);
}

/* Ends with CODE and MSG the requests of adapter ID that wait for it (its
 * load failed), or with ALL every one using it (it is being unloaded: no
 * sequence may name a registry entry that is gone). */
static void fail_lora_requests(loom_server_t *s, int id, int all, loom_status_t code, const char *msg) {
    for (request_t *q = s->reqs, *next; q; q = next) {
        next = q->next;
        if (q->seq && q->seq->lora_id == id && (all || q->seq->lora_slot < 0))
            req_emit(s, q, NULL, 0, NULL, 0, LOOM__V1__FINISH_REASON__FINISH_ERROR, code, msg);
    }
}

static void on_lora_loaded(void *ctx, loom_grid_t *g, int worker, const Loom__V1__LoraLoaded *l) {
    loom_server_t *s = ctx;
    char msg[800];
    if (!s->lora) return;
    int failed = loom_lora_reactor_loaded(s->lora, g, worker, l, msg, sizeof msg);
    if (failed >= 0) fail_lora_requests(s, failed, 0, LOOM_ERR_UNAVAILABLE, msg);
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

/* ---- preparing requests (the preparation pool) ------------------------------------------ */

/* Sends rq's work to the pool: its grammar (compile: the cache lacks it;
 * else cached, handed along) and its prompt when long. */
static void prep_submit(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq, int compile,
                        loom_grammar_t *cached) {
    Loom__V1__GenerateRequest *g = rq->generate;
    preparing_t *p = loom_xcalloc(1, sizeof *p);
    memcpy(p->rid, rid, rid_len);
    p->rid_len = rid_len;
    p->request_id = rq->request_id;
    p->body = loom_wire_pack_request(rq, &p->body_len);
    p->deadline = loom_now_ns() + (uint64_t)s->cfg.grammar_compile_timeout_ms * 1000000ull;
    loom_prep_job_t *j = loom_xcalloc(1, sizeof *j);
    j->ctx = p;
    if (compile) {
        const char *spec = g->guide_spec ? g->guide_spec : "";
        j->kind = (int)g->guide_kind;
        j->len = strlen(spec);
        j->spec = loom_xstrdup(spec);
        j->lim.deadline_ns = p->deadline;
        j->lim.max_bytes = s->cfg.grammar_max_bytes;
    } else {
        j->grammar = loom_grammar_ref(cached); /* the pool never touches it */
    }
    if (g->prompt && strlen(g->prompt) > PREP_PROMPT_BYTES) {
        j->tok = s->tok;
        j->prompt = loom_xstrdup(g->prompt);
        j->add_bos = !g->raw_prompt;
        j->parse_special = g->raw_prompt;
    }
    p->job = j;
    p->next = s->preparing;
    if (s->preparing) s->preparing->prev = p;
    s->preparing = p;
    s->n_preparing++;
    loom_log_req(LOOM_LOG_DEBUG, g->tag && valid_tag(g->tag) ? g->tag : NULL,
                 "request %llu preparing off the reactor:%s%s", (unsigned long long)rq->request_id,
                 compile ? " compiling its grammar" : "", j->prompt ? " tokenizing its prompt" : "");
    loom_prep_submit(s->prep, j);
}

static int kv_whole(void *conn, const uint64_t *hashes, int n) {
    return loom_kv_dir_connector_whole(conn, hashes, n);
}

/* A decode whose prefill's KV blocks the directory tier has not read yet:
 * kept as it came while a thread of the preparation pool reads their files
 * through (2 MB a block and shard at the 8B shape), then handled again with
 * the count, its prompt's ids (*ids taken) and its grammar. */
static void kv_check_submit(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq, int32_t **ids,
                            int n_ids, uint64_t tokenize_ns, loom_grammar_t *gr, loom_kv_transfer_req_t *kvt) {
    preparing_t *p = loom_xcalloc(1, sizeof *p);
    memcpy(p->rid, rid, rid_len);
    p->rid_len = rid_len;
    p->request_id = rq->request_id;
    p->body = loom_wire_pack_request(rq, &p->body_len);
    p->deadline = loom_now_ns() + (uint64_t)KV_CHECK_TIMEOUT_MS * 1000000ull;
    p->kv_check = 1;
    loom_prep_job_t *j = loom_xcalloc(1, sizeof *j);
    j->ctx = p;
    j->grammar = gr ? loom_grammar_ref(gr) : NULL;
    j->ids = *ids;
    j->n_ids = n_ids;
    *ids = NULL;
    j->tokenize_s = (double)tokenize_ns * 1e-9;
    j->kv.whole = kv_whole;
    j->kv.conn = kv_dir(s);
    j->kv.n = kvt->n_blocks;
    j->kv.hashes = loom_xmalloc((size_t)kvt->n_blocks * sizeof *j->kv.hashes);
    memcpy(j->kv.hashes, kvt->blocks, (size_t)kvt->n_blocks * sizeof *j->kv.hashes);
    loom_kv_transfer_req_free(kvt);
    p->job = j;
    p->next = s->preparing;
    if (s->preparing) s->preparing->prev = p;
    s->preparing = p;
    s->n_preparing++;
    loom_log_req(LOOM_LOG_DEBUG, rq->generate->tag && valid_tag(rq->generate->tag) ? rq->generate->tag : NULL,
                 "request %llu: its prefill's %d KV blocks read through off the reactor",
                 (unsigned long long)rq->request_id, j->kv.n);
    loom_prep_submit(s->prep, j);
}

/* The message of a job that failed on a bound, naming the flag. */
static void prep_limit_msg(const loom_server_t *s, const loom_prep_job_t *j, char *msg, size_t cap) {
    if (j->lim.hit == LOOM_GRAMMAR_LIMIT_BYTES)
        snprintf(msg, cap, "%s (--grammar-max-bytes %llu)", j->err.msg, (unsigned long long)s->cfg.grammar_max_bytes);
    else if (j->lim.hit == LOOM_GRAMMAR_LIMIT_TIME)
        snprintf(msg, cap, "%s (--grammar-compile-timeout-ms %d)", j->err.msg, s->cfg.grammar_compile_timeout_ms);
    else
        snprintf(msg, cap, "%s", j->err.msg);
}

static void on_generate(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq);

/* Jobs back from the pool: each request is handled again with its results,
 * or refused with the job's error. */
static void prep_done(loom_server_t *s) {
    loom_prep_job_t *j;
    while ((j = loom_prep_take(s->prep))) {
        preparing_t *p = j->ctx;
        if (j->kind && j->status == LOOM_OK && j->grammar) {
            if (j->compile_s > 0.1)
                LOOM_INFO("grammar compiled off the reactor in %.0f ms (waited %.0f ms): a %zu-byte spec, %zu bytes "
                          "compiled", j->compile_s * 1e3, j->queued_s * 1e3, j->len, loom_grammar_bytes(j->grammar));
            loom_structured_put(s->structured, j->kind, j->spec, j->len, j->grammar);
        }
        if (!p) { /* abandoned: cancelled or past its deadline */
            loom_prep_job_free(&j);
            continue;
        }
        prep_unlink(s, p);
        if (j->status < 0) {
            char msg[700];
            prep_limit_msg(s, j, msg, sizeof msg);
            s->requests_rejected++;
            loom_log_req(LOOM_LOG_DEBUG, NULL, "refused request %llu: %s", (unsigned long long)p->request_id, msg);
            reply_error(s, p->rid, p->rid_len, p->request_id, j->status, msg);
        } else {
            loom_err_t err = {0};
            Loom__V1__Request *rq = loom_wire_unpack_request(p->body, p->body_len, &err);
            LOOM_ASSERT(rq); /* we packed it */
            s->handoff = j;
            on_generate(s, p->rid, p->rid_len, rq);
            s->handoff = NULL;
            protobuf_c_message_free_unpacked(&rq->base, NULL);
        }
        free(p->body);
        free(p);
        loom_prep_job_free(&j);
    }
}

/* Preparing requests past their deadline whose job did not stop by itself. */
static void prep_timers(loom_server_t *s, uint64_t now) {
    for (preparing_t *p = s->preparing, *next; p; p = next) {
        next = p->next;
        if (now < p->deadline + (uint64_t)PREP_GRACE_MS * 1000000ull) continue;
        char msg[300];
        if (p->kv_check)
            snprintf(msg, sizeof msg, "kv_transfer_params: the KV tier's files of the prefill's blocks were not read "
                                      "within %d s", KV_CHECK_TIMEOUT_MS / 1000);
        else
            snprintf(msg, sizeof msg, "grammar too slow to compile: it passed its time limit "
                                      "(--grammar-compile-timeout-ms %d)", s->cfg.grammar_compile_timeout_ms);
        s->requests_rejected++;
        reply_error(s, p->rid, p->rid_len, p->request_id, LOOM_ERR_INVALID_ARGUMENT, msg);
        prep_drop(s, p);
    }
}

/* A request's kv_transfer_params (kv_transfer.h): checked against this
 * replica and the prompt; a decode whose prefill's blocks are not all in
 * the tier is refused under kv_load_failure_policy fail, else recomputes
 * what is missing. The tier's files are read on the preparation pool: 1
 * when they have not been yet (kv_check_submit; the request is handled
 * again with the job's count). */
static loom_status_t kv_transfer_check(loom_server_t *s, const char *json, const int32_t *ids, int n_ids,
                                       int lora_id, const loom_prep_job_t *prepared, loom_kv_transfer_req_t *kvt,
                                       char *msg, size_t n) {
    char engine[64];
    loom_kv_transfer_engine_id(loom_grid_kv_tier_id(s->grid), engine);
    loom_err_t err = {0};
    uint64_t seed =
        lora_id >= 0 ? loom_sched_lora_seed(loom_lora_slots_entry(loom_lora_reactor_slots(s->lora), lora_id)->digest)
                     : 0;
    const loom_kv_transfer_config_t *cfg = kv_xfer_tcp(s) || kv_dir(s) ? &s->cfg.kv_transfer : NULL;
    loom_status_t st = loom_kv_transfer_parse(json, cfg, engine, ids, n_ids, s->cfg.block_size, seed, kvt, &err);
    if (st < 0) {
        snprintf(msg, n, "%s", err.msg);
        return st;
    }
    if (!kvt->remote_prefill || kvt->n_blocks == 0) return LOOM_OK;
    if (kv_xfer_tcp(s)) return LOOM_OK; /* the workers pull at admission; a failure is the step's */
    if (!prepared || !prepared->kv.whole) return 1;
    int have = prepared->kv.have;
    if (prepared->kv.read_s > 0.1)
        LOOM_INFO("kv_transfer_params: the prefill's %d KV blocks read through off the reactor in %.0f ms",
                  kvt->n_blocks, prepared->kv.read_s * 1e3);
    if (have == kvt->n_blocks) return LOOM_OK;
    if (s->cfg.kv_transfer.policy == LOOM_KV_LOAD_FAIL) { /* so worded, loom-router relays it (kv_load_refused) */
        snprintf(msg, n,
                 "kv_transfer_params: %d of the prefill's %d KV blocks are not in the KV tier "
                 "(kv_load_failure_policy fail)",
                 kvt->n_blocks - have, kvt->n_blocks);
        loom_kv_transfer_req_free(kvt);
        return LOOM_ERR_UNAVAILABLE;
    }
    LOOM_INFO("kv_transfer_params: %d of the prefill's %d KV blocks are not in the KV tier: recomputed",
              kvt->n_blocks - have, kvt->n_blocks);
    return LOOM_OK;
}

/* The params a prefill for a remote decode answers with (malloc'd JSON).
 * Transport tcp: its prompt's blocks are held (delayed free) for the
 * decode side's pull, until it reports them read or the lease ends. */
static char *kv_decode_params(loom_server_t *s, const request_t *q) {
    char engine[64], host[256] = "";
    loom_kv_transfer_engine_id(loom_grid_kv_tier_id(s->grid), engine);
    const char *a = strncmp(s->api_addr, "tcp://", 6) ? s->api_addr : s->api_addr + 6, *colon = strrchr(a, ':');
    int port = colon ? atoi(colon + 1) : 0;
    snprintf(host, sizeof host, "%.*s", colon ? (int)(colon - a) : 0, a);
    if (kv_xfer_tcp(s)) {
        uint64_t id = 0;
        while (!id || loom_sched_held(s->sched, id, &(int){0})) loom_coord_epoch_secret((uint8_t *)&id, sizeof id);
        const int32_t *blocks = NULL;
        uint64_t lease = (uint64_t)s->cfg.kv_transfer.lease_ms * 1000000ull;
        int n = loom_sched_hold(s->sched, q->seq, id, loom_now_ns() + lease, &blocks);
        char addrs[1024];
        if (!loom_grid_kv_xfer_addrs(s->grid, addrs, sizeof addrs)) addrs[0] = '\0';
        if (n > 0) loom_grid_kv_hold(s->grid, id, blocks, n, 0); /* before the answer leaves */
        if (n > 0)
            loom_log_req(LOOM_LOG_DEBUG, q->tag,
                         "request %llu: %d KV blocks held for the decode side (transfer %016llx, lease %d ms)",
                         (unsigned long long)q->request_id, n, (unsigned long long)id, s->cfg.kv_transfer.lease_ms);
        return loom_kv_transfer_params_tcp(engine, q->seq->tokens, blocks, n, s->cfg.block_size, q->seq->lora_seed,
                                           addrs, q->request_id, n > 0 ? id : 0, s->cfg.tp);
    }
    return loom_kv_transfer_params(engine, q->seq->tokens, q->seq->n_prompt, s->cfg.block_size, q->seq->lora_seed,
                                   host, port,
                                   q->request_id, s->cfg.tp);
}

static void on_generate(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    loom_kv_transfer_req_t kvt = {0};
    Loom__V1__GenerateRequest *g = rq->generate;
    char msg[600];
    loom_err_t err = {0};
    loom_status_t code = LOOM_ERR_INVALID_ARGUMENT;
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    loom_sparams_t *sparams = NULL;
    uint64_t t_arrival = loom_now_ns(), tokenize_ns = 0;
    loom_grammar_t *gr = NULL; /* the guide's grammar, kept in case the prompt must be tokenized elsewhere */
    int need_compile = 0;
    const char *tag = g->tag && valid_tag(g->tag) ? g->tag : "";
    const loom_prep_job_t *prepared = s->handoff; /* handled again with its job's results */
    if (s->draining && !prepared) {
        snprintf(msg, sizeof msg, "draining: this coordinator is shutting down and admits no new requests; retry "
                                  "on another one or after it restarts");
        code = LOOM_ERR_UNAVAILABLE;
        goto refuse;
    }
    int dup = 0;
    for (const request_t *o = s->reqs; o; o = o->next)
        dup |= o->request_id == rq->request_id && o->rid_len == rid_len && !memcmp(o->rid, rid, rid_len);
    for (const preparing_t *o = s->preparing; o; o = o->next)
        dup |= o->request_id == rq->request_id && o->rid_len == rid_len && !memcmp(o->rid, rid, rid_len);
    if (dup) {
        snprintf(msg, sizeof msg, "request id %llu is already in flight on this connection: request ids must be "
                                  "unique among a connection's live requests",
                 (unsigned long long)rq->request_id);
        goto refuse;
    }
    if (g->tag && g->tag[0] && !tag[0]) {
        snprintf(msg, sizeof msg, "tag must be at most %d printable ASCII characters", MAX_TAG);
        goto refuse;
    }
    if (loom_grid_state(s->grid) != LOOM_GRID_READY) {
        loom_grid_describe(s->grid, msg, sizeof msg);
        code = LOOM_ERR_UNAVAILABLE;
        goto refuse;
    }
    int lora_id = -1; /* the adapter the request's model names (-1: the base model) */
    if (s->lora) {
        if ((code = loom_lora_serve_select(loom_lora_reactor_slots(s->lora), s->model_name, NULL, g->model, &lora_id,
                                           &err)) < 0) {
            snprintf(msg, sizeof msg, "%s", err.msg);
            goto refuse;
        }
        code = LOOM_ERR_INVALID_ARGUMENT;
    } else if (g->model && g->model[0] && strcmp(g->model, s->model_name) != 0) {
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
    if (g->n_keep_special_ids > MAX_KEEP_IDS) {
        snprintf(msg, sizeof msg, "%zu keep_special_ids; at most %d are allowed",
                 g->n_keep_special_ids, MAX_KEEP_IDS);
        goto refuse;
    }
    for (size_t i = 0; i < g->n_stop_token_ids; i++)
        if (g->stop_token_ids[i] < 0 || g->stop_token_ids[i] >= s->mcfg.vocab_size) {
            snprintf(msg, sizeof msg, "stop token id %d is outside the vocabulary [0, %d)", g->stop_token_ids[i],
                     s->mcfg.vocab_size);
            goto refuse;
        }
    if (loom_sparams_create(g, s->tok, &s->mcfg, &sparams, &err) < 0) {
        snprintf(msg, sizeof msg, "%s", err.msg);
        goto refuse;
    }
    if (g->guide_kind) {
        loom_guide_t *guide = NULL;
        const char *spec = g->guide_spec ? g->guide_spec : "";
        if (g->guide_kind > LOOM_GRAMMAR_TOOL_CALLS) {
            snprintf(msg, sizeof msg, "guide_kind %u is not one of 1 to 6", g->guide_kind);
            goto refuse;
        }
        if (prepared && prepared->grammar) gr = loom_grammar_ref(prepared->grammar);
        else if (!loom_structured_lookup(s->structured, (int)g->guide_kind, spec, strlen(spec), &gr)) {
            need_compile = 1; /* not on the reactor: on the preparation pool */
            goto defer;
        }
        if (loom_guide_create_from(s->structured, gr, g->guide_after, &guide, &err) < 0) {
            snprintf(msg, sizeof msg, "%s", err.msg);
            goto refuse;
        }
        loom_sparams_set_guide(&sparams, guide);
    }
    if (g->prompt_logprobs && g->prompt_top_logprobs > LOOM_MAX_TOP_LOGPROBS) {
        snprintf(msg, sizeof msg, "prompt_logprobs %u is over the limit of %d", g->prompt_top_logprobs,
                 LOOM_MAX_TOP_LOGPROBS);
        goto refuse;
    }
    if (g->max_tokens > (uint32_t)s->max_model_len) {
        snprintf(msg, sizeof msg, "max_tokens %u exceeds the context length %d", g->max_tokens, s->max_model_len);
        goto refuse;
    }
    if (g->prompt && g->prompt[0] && prepared && prepared->ids) {
        n_ids = prepared->n_ids;
        ids = loom_xmalloc(((size_t)n_ids + 1) * sizeof *ids);
        memcpy(ids, prepared->ids, (size_t)n_ids * sizeof *ids);
        tokenize_ns = (uint64_t)(prepared->tokenize_s * 1e9);
    } else if (g->prompt && strlen(g->prompt) > PREP_PROMPT_BYTES && !prepared) {
        goto defer; /* a long prompt is tokenized on the preparation pool */
    } else if (g->prompt && g->prompt[0]) {
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
    if (g->sample_step_offset > (uint32_t)n_ids) {
        snprintf(msg, sizeof msg, "sample_step_offset %u exceeds the prompt's %d tokens", g->sample_step_offset, n_ids);
        goto refuse;
    }
    if (g->kv_transfer_params && g->kv_transfer_params[0]) {
        code = kv_transfer_check(s, g->kv_transfer_params, ids, n_ids, lora_id, prepared, &kvt, msg, sizeof msg);
        if (code < 0) goto refuse;
        if (code == 1) {
            kv_check_submit(s, rid, rid_len, rq, &ids, n_ids, tokenize_ns, gr, &kvt);
            loom_grammar_destroy(&gr);
            loom_sparams_destroy(&sparams);
            return;
        }
    }
    code = LOOM_ERR_INVALID_ARGUMENT;
    request_t *q = loom_xcalloc(1, sizeof *q);
    q->sparams = sparams;
    sparams = NULL;
    q->min_tokens = loom_sparams_min_tokens(q->sparams);
    q->include_stop_str = g->include_stop_str_in_output;
    memcpy(q->rid, rid, rid_len);
    q->rid_len = rid_len;
    q->request_id = rq->request_id;
    q->ignore_eos = g->ignore_eos;
    q->prompt_tokens = n_ids;
    q->t_arrival = t_arrival;
    q->tokenize_ns = tokenize_ns + g->gateway_tokenize_ns; /* the gateway's part happened before t_arrival */
    q->t_queued = loom_now_ns();
    snprintf(q->tag, sizeof q->tag, "%s", tag);
    for (size_t i = 0; i < g->n_stop_token_ids; i++) q->stop_ids[q->n_stop_ids++] = g->stop_token_ids[i];
    for (size_t i = 0; i < g->n_stop; i++) q->stop[q->n_stop++] = loom_xstrdup(g->stop[i]);
    loom_detok_init(&q->detok, s->tok, !g->keep_special, 0);
    if (g->n_keep_special_ids) memcpy(q->keep_ids, g->keep_special_ids, g->n_keep_special_ids * sizeof *q->keep_ids);
    loom_detok_keep(&q->detok, q->keep_ids, (int)g->n_keep_special_ids);
    loom_sampling_t samp = {.temperature = temp, .top_k = top_k, .top_p = top_p == 0.0f ? 1.0f : top_p,
                            .seed = sp && sp->has_seed ? sp->seed : next_seed(s)};
    loom_status_t st = loom_sched_add(s->sched, rq->request_id, ids, n_ids, (int)g->max_tokens, g->priority, &samp,
                                      q, &q->seq, &err);
    free(ids);
    ids = NULL;
    if (st < 0) {
        loom_kv_transfer_req_free(&kvt);
        req_free(q);
        code = st;
        snprintf(msg, sizeof msg, "%s", err.msg);
        goto refuse;
    }
    q->max_tokens = q->seq->max_tokens;
    if (lora_id >= 0)
        loom_sched_seq_set_lora(s->sched, q->seq, lora_id,
                                loom_lora_slots_entry(loom_lora_reactor_slots(s->lora), lora_id)->digest);
    q->seq->sparams = q->sparams;
    q->seq->spec_off = g->no_speculation;
    if (kvt.remote_decode) { /* dir: its blocks written through for the decode; tcp: held when it finishes */
        q->kv_remote_decode = 1;
        q->seq->kv_save = !kv_xfer_tcp(s);
    }
    if (kvt.remote_prefill && kv_xfer_tcp(s) && kvt.n_blocks > 0)
        loom_sched_seq_set_pull(s->sched, q->seq, kvt.n_blocks, kvt.pool_blocks, kvt.addrs, kvt.transfer_id);
    loom_kv_transfer_req_free(&kvt);
    if (g->return_prompt_ids && !g->prompt_logprobs) {
        q->pids_want = 1;
        q->plp_prompt = loom_xmalloc((size_t)n_ids * sizeof *q->plp_prompt);
        memcpy(q->plp_prompt, q->seq->tokens, (size_t)n_ids * sizeof *q->plp_prompt);
    }
    if (g->prompt_logprobs) {
        size_t np = (size_t)n_ids;
        q->plp_on = 1;
        q->plp_top = (int)g->prompt_top_logprobs;
        q->plp_prompt = loom_xmalloc(np * sizeof *q->plp_prompt);
        memcpy(q->plp_prompt, q->seq->tokens, np * sizeof *q->plp_prompt);
        q->plp_lp = loom_xcalloc(np, sizeof *q->plp_lp);
        q->plp_rank = loom_xcalloc(np, sizeof *q->plp_rank);
        q->plp_ntop = loom_xcalloc(np, sizeof *q->plp_ntop);
        q->plp_ids = loom_xcalloc(np * LOOM_MAX_TOP_LOGPROBS, sizeof *q->plp_ids);
        q->plp_tlp = loom_xcalloc(np * LOOM_MAX_TOP_LOGPROBS, sizeof *q->plp_tlp);
        q->seq->prompt_lp = 1;
        q->seq->prompt_lp_top = q->plp_top;
    }
    q->seq->step_offset = g->sample_step_offset;
    q->next = s->reqs;
    if (s->reqs) s->reqs->prev = q;
    s->reqs = q;
    s->n_reqs++;
    s->prompt_tokens_total += (uint64_t)n_ids;
    loom_log_req(LOOM_LOG_DEBUG, q->tag, "request %llu queued: %d prompt tokens, max_tokens %d",
                 (unsigned long long)rq->request_id, n_ids, q->max_tokens);
    loom_grammar_destroy(&gr);
    return;
defer:
    free(ids);
    loom_sparams_destroy(&sparams);
    prep_submit(s, rid, rid_len, rq, need_compile, gr);
    loom_grammar_destroy(&gr);
    return;
refuse:
    free(ids);
    loom_grammar_destroy(&gr);
    loom_sparams_destroy(&sparams);
    s->requests_rejected++;
    loom_log_req(LOOM_LOG_DEBUG, g->tag && valid_tag(g->tag) ? g->tag : NULL, "refused request %llu: %s",
                 (unsigned long long)rq->request_id, msg);
    reply_error(s, rid, rid_len, rq->request_id, code, msg);
}

static void on_cancel(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    uint64_t target = rq->cancel->target_request_id;
    request_t *q = s->reqs;
    while (q && !(q->request_id == target && q->rid_len == rid_len && !memcmp(q->rid, rid, rid_len))) q = q->next;
    preparing_t *pr = s->preparing;
    while (pr && !(pr->request_id == target && pr->rid_len == rid_len && !memcmp(pr->rid, rid, rid_len)))
        pr = pr->next;
    Loom__V1__CancelReply cr = LOOM__V1__CANCEL_REPLY__INIT;
    cr.found = q != NULL || pr != NULL;
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = rq->request_id;
    r.body_case = LOOM__V1__REPLY__BODY_CANCEL;
    r.cancel = &cr;
    char msg[160];
    if (!q && !pr) {
        snprintf(msg, sizeof msg, "no request %llu in flight on this connection (finished, or never sent)",
                 (unsigned long long)target);
        r.code = loom_wire_status_code(LOOM_ERR_NOT_FOUND);
        r.message = msg;
    }
    send_reply(s, rid, rid_len, &r);
    if (pr) { /* still preparing: its job is cancelled, the client hears the end now */
        loom_log_req(LOOM_LOG_DEBUG, NULL, "request %llu cancelled by its client while preparing",
                     (unsigned long long)target);
        reply_error(s, pr->rid, pr->rid_len, target, LOOM_ERR_CANCELLED, "cancelled by the client");
        prep_drop(s, pr);
    }
    if (q) {
        loom_log_req(LOOM_LOG_DEBUG, q->tag, "request %llu cancelled by its client", (unsigned long long)target);
        req_emit(s, q, NULL, 0, NULL, 0, LOOM__V1__FINISH_REASON__FINISH_CANCELLED, LOOM_ERR_CANCELLED,
                 "cancelled by the client");
    }
}

static void on_health(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    Loom__V1__HealthReply h = LOOM__V1__HEALTH_REPLY__INIT;
    char msg[600];
    h.ready = loom_grid_state(s->grid) == LOOM_GRID_READY && !s->draining;
    h.state = s->draining ? "draining" : (char *)loom_grid_state_name(loom_grid_state(s->grid));
    h.workers_ready = (uint32_t)loom_grid_n_ready(s->grid);
    h.workers_expected = (uint32_t)loom_grid_n_slots(s->grid);
    int live = loom_server_liveness(s, msg, sizeof msg);
    if (h.ready && !live) {
        h.ready = 0;
        h.state = "stalled";
    }
    if (s->draining) snprintf(msg, sizeof msg, "draining: shutting down, %d request(s) in flight", s->n_reqs);
    else if (!live) {} /* msg says why */
    else if (!h.ready) loom_grid_describe(s->grid, msg, sizeof msg);
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
    mi.weights_digest = s->weights_digest;
    mi.tokenizer_digest = s->tokenizer_digest;
    /* then the LoRA adapters, as vLLM lists them: parent the base, root the directory */
    const loom_lora_entry_t *ad[LOOM_LORA_SERVE_MAX_MODULES * 4];
    int n_ad = s->lora ? loom_lora_slots_list(loom_lora_reactor_slots(s->lora), ad, (int)LOOM_ARRAY_LEN(ad)) : 0;
    Loom__V1__ModelInfo *infos = loom_xcalloc((size_t)n_ad + 1, sizeof *infos);
    Loom__V1__ModelInfo **mp = loom_xcalloc((size_t)n_ad + 1, sizeof *mp);
    infos[0] = mi;
    mp[0] = &infos[0];
    char (*hex)[65] = loom_xcalloc((size_t)n_ad + 1, sizeof *hex);
    for (int i = 0; i < n_ad; i++) {
        Loom__V1__ModelInfo *a = &infos[i + 1];
        const loom_lora_slot_t *sl = loom_lora_slots_slot(loom_lora_reactor_slots(s->lora), ad[i]->slot);
        *a = mi;
        a->id = (char *)ad[i]->name;
        a->parent = s->model_name;
        a->root = (char *)ad[i]->path;
        a->resident = sl && sl->state == LOOM_SLOT_READY;
        for (int b = 0; b < 32; b++) snprintf(hex[i] + 2 * b, 3, "%02x", ad[i]->digest[b]);
        a->adapter_digest = hex[i];
        mp[i + 1] = a;
    }
    Loom__V1__ListModelsReply lm = LOOM__V1__LIST_MODELS_REPLY__INIT;
    lm.models = mp;
    lm.n_models = (size_t)n_ad + 1;
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = rq->request_id;
    r.body_case = LOOM__V1__REPLY__BODY_MODELS;
    r.models = &lm;
    send_reply(s, rid, rid_len, &r);
    free(hex);
    free(mp);
    free(infos);
}

/* vLLM's runtime adapter updates (LoadLoraAdapter, UnloadLoraAdapter). The
 * requests using an unloaded adapter end now (NOT_FOUND). */
static void on_lora_update(loom_server_t *s, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    char msg[1100];
    loom_status_t st;
    if (!s->lora) {
        snprintf(msg, sizeof msg, "LoRA is not enabled: start the server with --enable-lora");
        st = LOOM_ERR_INVALID_ARGUMENT;
    } else if (rq->body_case == LOOM__V1__REQUEST__BODY_LOAD_LORA_ADAPTER) {
        loom_prep_job_t *j = loom_xcalloc(1, sizeof *j);
        st = loom_lora_reactor_load_begin(s->lora, rq->load_lora_adapter->lora_name, rq->load_lora_adapter->lora_path,
                                          j, msg, sizeof msg);
        if (st == LOOM_OK) { /* answered when the read comes back (lora_loads_done) */
            lora_loading_t *l = loom_xcalloc(1, sizeof *l);
            memcpy(l->rid, rid, rid_len);
            l->rid_len = rid_len;
            l->request_id = rq->request_id;
            l->job = j;
            l->next = s->lora_loading;
            s->lora_loading = l;
            j->ctx = l;
            loom_prep_submit(s->lora_prep, j);
            return;
        }
        loom_prep_job_free(&j);
    } else {
        const char *name = rq->unload_lora_adapter->lora_name;
        int id;
        st = loom_lora_reactor_unload_check(s->lora, name, &id, msg, sizeof msg);
        if (st == LOOM_OK) {
            char why[300];
            snprintf(why, sizeof why, "LoRA adapter '%.200s' was unloaded", name);
            fail_lora_requests(s, id, 1, LOOM_ERR_NOT_FOUND, why);
            loom_lora_reactor_forget(s->lora, name, msg, sizeof msg);
        }
    }
    reply_lora_adapter(s, rid, rid_len, rq->request_id, st, msg);
}

static void lora_loading_unlink(loom_server_t *s, lora_loading_t *l) {
    lora_loading_t **pp = &s->lora_loading;
    while (*pp != l) pp = &(*pp)->next;
    *pp = l->next;
}

/* Adapter reads back from their pool: each is registered (unless its name
 * was taken meanwhile) and its load answered. */
static void lora_loads_done(loom_server_t *s) {
    loom_prep_job_t *j;
    while ((j = loom_prep_take(s->lora_prep))) {
        lora_loading_t *l = j->ctx;
        if (l) {
            char msg[1100];
            lora_loading_unlink(s, l);
            loom_status_t st = loom_lora_reactor_load_end(s->lora, j, msg, sizeof msg);
            reply_lora_adapter(s, l->rid, l->rid_len, l->request_id, st, msg);
            free(l);
        } /* else abandoned at shutdown: nothing registered */
        loom_prep_job_free(&j);
    }
}

/* Ends the loads still reading (their jobs are freed when they come back,
 * registering nothing), answering each with CODE and MSG (0: no answer). */
static void lora_loads_end(loom_server_t *s, loom_status_t code, const char *msg) {
    while (s->lora_loading) {
        lora_loading_t *l = s->lora_loading;
        s->lora_loading = l->next;
        if (code) reply_error(s, l->rid, l->rid_len, l->request_id, code, msg);
        l->job->ctx = NULL;
        loom_prep_cancel(l->job);
        free(l);
    }
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
        st.ahead_tokens = ss.ahead_tokens;
        st.ahead_dropped = ss.ahead_dropped;
    }
    st.prefix_cache_hit_rate =
        st.prefix_cache_queries ? (double)st.prefix_cache_hits / (double)st.prefix_cache_queries : 0.0;
    st.kv_block_size = (uint32_t)s->cfg.block_size;
    st.kv_cache_dtype = (char *)loom_grid_kv_dtype(s->grid);
    st.kv_block_bytes = loom_grid_kv_block_bytes(s->grid);
    st.kv_events = (char *)loom_kv_events_addr(s->kv_events);
    st.preparing = s->prep ? (uint32_t)loom_prep_pending(s->prep) : 0;
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
    if (loom_wire_check_text(&loom__v1__request__descriptor, zmq_msg_data(&frames[2]), zmq_msg_size(&frames[2]),
                             &err) < 0) {
        /* as HTTP refuses them: a NUL would cut the text, invalid UTF-8 has no tokens */
        char msg[sizeof err.msg + 32];
        snprintf(msg, sizeof msg, "invalid request: %s", err.msg);
        reply_error(s, rid, rid_len, rq->request_id, LOOM_ERR_INVALID_ARGUMENT, msg);
    } else if (strlen(method) != ml || memcmp(method, zmq_msg_data(&frames[1]), ml) != 0) {
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
        case LOOM__V1__REQUEST__BODY_EMBED: on_embed(s, rid, rid_len, rq); break;
        case LOOM__V1__REQUEST__BODY_LOAD_LORA_ADAPTER:
        case LOOM__V1__REQUEST__BODY_UNLOAD_LORA_ADAPTER: on_lora_update(s, rid, rid_len, rq); break;
        default: break;
        }
    }
    protobuf_c_message_free_unpacked(&rq->base, NULL);
}

/* ---- the step loop ------------------------------------------------------------------------ */

/* Sends the unsent micro-batches from the oldest while they are ready. */
static void send_ready(loom_server_t *s) {
    int n = 0;
    while (n < s->n_unsent && s->unsent[n].ready && loom_grid_can_send(s->grid))
        loom_grid_send_plan(s->grid, s->unsent[n++].mb);
    memmove(s->unsent, s->unsent + n, (size_t)(s->n_unsent - n) * sizeof *s->unsent);
    s->n_unsent -= n;
}

/* Overlapped scheduling: q's next plan row does not depend on the token
 * it samples now (sampling_params.h). */
static int plan_ahead_ok(void *ctx, const loom_seq_t *q) {
    (void)ctx;
    return loom_sparams_plan_ahead(q->sparams, q);
}

/* The next micro-batch to send: with overlapped scheduling, while one is
 * in flight (and sent), the one planned ahead of it; else a fresh one. */
static loom_microbatch_t *next_batch(loom_server_t *s) {
    if (!s->ahead) return loom_sched_schedule(s->sched);
    int busy = loom_grid_n_inflight(s->grid) + s->n_unsent;
    if (busy == 0) return loom_sched_schedule(s->sched);
    if (busy > s->ahead || s->n_unsent || !s->tail) return NULL;
    return loom_sched_schedule_ahead(s->sched, s->tail, plan_ahead_ok, s);
}

/* Keeps up to pp micro-batches in flight while the grid is READY (with
 * overlapped scheduling, one more planned ahead). One with a draft model's
 * drafts to compute waits unsent until the draft's thread has them
 * (drafts_done), so the reactor goes on meanwhile. */
static void schedule(loom_server_t *s) {
    send_ready(s);
    loom_microbatch_t *mb;
    while (loom_grid_can_send(s->grid) && (mb = next_batch(s))) {
        loom_metrics_observe_iteration(s->metrics, mb->n_tokens);
        LOOM_ASSERT(s->n_unsent < s->cfg.pp + s->ahead); /* the scheduler builds at most that many at once */
        s->tail = mb;
        s->unsent[s->n_unsent].mb = mb;
        s->unsent[s->n_unsent++].ready = !(s->draft && loom_coord_draft_submit(s->draft, mb));
        send_ready(s);
    }
    /* the adapters admission claimed slots for: their load orders go out */
    if (s->lora) loom_lora_reactor_dispatch(s->lora, s->grid);
}

/* The draft's thread has drafts: their micro-batches are ready to go. */
static void drafts_done(loom_server_t *s) {
    loom_microbatch_t *mb;
    while (loom_coord_draft_take(s->draft, &mb))
        for (int i = 0; mb && i < s->n_unsent; i++)
            if (s->unsent[i].mb == mb) s->unsent[i].ready = 1;
}

/* Speculative decoding counters for /metrics (vLLM's spec_decode family). */
static void set_spec_metrics(const loom_server_t *s, loom_metrics_state_t *st) {
    if (s->cfg.spec.method == LOOM_SPEC_OFF) return;
    const loom_spec_stats_t *sp = loom_sched_spec_stats(s->sched);
    st->spec_k = s->cfg.spec.k;
    st->spec_drafts = (uint64_t)sp->num_drafts;
    st->spec_draft_tokens = (uint64_t)sp->num_draft_tokens;
    st->spec_accepted_tokens = (uint64_t)sp->num_accepted_tokens;
    for (int i = 0; i < LOOM_SPEC_MAX_K; i++) st->spec_accepted_per_pos[i] = (uint64_t)sp->accepted_per_pos[i];
}

static void publish_state(loom_server_t *s) {
    loom_metrics_state_t st = {.prompt_tokens = s->prompt_tokens_total, .generation_tokens = s->gen_tokens_total,
                               .requests_rejected = s->requests_rejected,
                               .grid_ready = loom_grid_state(s->grid) == LOOM_GRID_READY && !s->draining};
    if (s->sched) {
        loom_sched_stats_t ss;
        loom_sched_get_stats(s->sched, &ss);
        loom_kv_ledger_t *L = loom_sched_ledger(s->sched);
        st.running = ss.running;
        st.waiting = ss.waiting;
        st.kv_blocks_total = loom_kv_n_blocks(L);
        st.kv_blocks_used = loom_kv_n_held(L);
        st.kv_blocks_cached = loom_kv_n_cached(L);
        st.n_dp = LOOM_MIN(loom_kv_n_parts(L), (int)LOOM_ARRAY_LEN(st.dp_blocks_used));
        for (int r = 0; r < st.n_dp; r++) {
            st.dp_blocks_used[r] = loom_kv_part_held(L, r);
            st.dp_admissions[r] = ss.dp_admissions[r];
        }
        snprintf(st.kv_dtype, sizeof st.kv_dtype, "%s", loom_grid_kv_dtype(s->grid));
        st.block_size = s->cfg.block_size;
        st.prefix_caching = s->cfg.prefix_cache;
        st.prefix_cache_queries = s->prefix_queries_base + ss.prefix_queries;
        st.prefix_cache_hits = s->prefix_hits_base + ss.prefix_hits;
        st.preemptions = s->preemptions_base + ss.preemptions;
        st.prompt_tokens_computed = ss.prompt_tokens_computed;
        st.kv_forks = ss.forks;
        st.kv_fork_tokens = ss.fork_tokens;
        st.kv_offload = s->kv_conn != NULL;
        if (s->kv_conn) snprintf(st.kv_offload_tier, sizeof st.kv_offload_tier, "%s", s->kv_conn->tier);
        if (kv_host(s)) {
            st.kv_host_slots = loom_kv_host_connector_slots(s->kv_conn);
            st.kv_host_used = loom_kv_host_connector_used(s->kv_conn);
        }
        st.kv_offload_queries = ss.tier_queries;
        st.kv_offload_hits = ss.tier_hits - ss.lower_hits;
        st.kv_offload_saves = ss.tier_saves - ss.lower_saves;
        st.kv_transfer_tcp = kv_xfer_tcp(s);
        st.kv_transfer_held_blocks = loom_sched_held_blocks(s->sched);
        if (s->kv_conn && s->kv_conn->lower) { /* the directory below the host tier: its own series */
            st.kv_offload_lower = 1;
            st.kv_lower_queries = loom_kv_host_connector_lower_queries(s->kv_conn);
            st.kv_lower_hits = ss.lower_hits;
            st.kv_lower_saves = ss.lower_saves;
        }
        set_spec_metrics(s, &st);
    } else {
        st.prefix_cache_queries = s->prefix_queries_base;
        st.prefix_cache_hits = s->prefix_hits_base;
        st.preemptions = s->preemptions_base;
    }
    loom_metrics_set_state(s->metrics, &st);
    if (s->lora) {
        loom_metrics_lora_adapter_t ad[LOOM_LORA_SERVE_MAX_MODULES];
        loom_metrics_lora_t ml;
        loom_lora_serve_metrics(loom_lora_reactor_slots(s->lora), s->sched, ad, LOOM_LORA_SERVE_MAX_MODULES, &ml);
        loom_metrics_set_lora(s->metrics, &ml);
    }
    loom_kv_events_publish(s->kv_events, s->sched);
}

static void timers(loom_server_t *s) {
    uint64_t now = loom_now_ns();
    prep_timers(s, now);
    uint64_t gone[16];
    for (int n_gone = 16; s->sched && n_gone == 16;) {
        n_gone = loom_sched_hold_expire(s->sched, now, gone, 16);
        for (int i = 0; i < n_gone; i++) {
            loom_grid_kv_hold(s->grid, gone[i], NULL, 0, 1);
            LOOM_INFO("KV transfer %016llx: the decode side did not read the held blocks within lease_ms %d: freed",
                      (unsigned long long)gone[i], s->cfg.kv_transfer.lease_ms);
        }
    }
    if (s->recovery_deadline && now > s->recovery_deadline && loom_grid_state(s->grid) != LOOM_GRID_READY) {
        char msg[700];
        snprintf(msg, sizeof msg, "the serving grid failed and was not restored within %d ms: %s",
                 s->cfg.recovery_timeout_ms, loom_grid_last_failure(s->grid));
        fail_all_requests(s, LOOM_ERR_UNAVAILABLE, msg);
        s->recovery_deadline = 0;
    }
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
    if (s->n_reqs == 0 && !s->embeds && !s->preparing && !s->lora_loading) {
        LOOM_INFO("drained: no request left in flight");
        return 1;
    }
    if (now < s->drain_deadline) return 0;
    LOOM_WARN("shutdown timeout: ending %d request(s) still in flight", s->n_reqs);
    while (s->reqs) cut_request(s, s->reqs);
    embed_fail_all(s, LOOM_ERR_UNAVAILABLE, "the coordinator shut down before the embeddings were computed");
    return 1;
}

/* Liveness bookkeeping, once per reactor turn: the turn's time, and
 * progress (a step completed, or no step is due: no request waits, or the
 * grid is not READY, which Health reports by itself). A turn over 250 ms is
 * logged (at most every 10 s, with the longest since): that is a stall of
 * every stream. The test hook LOOM_TEST_STALL_FILE stalls one turn for the
 * milliseconds the file holds, then removes it. */
static void liveness_turn(loom_server_t *s) {
    uint64_t now = loom_now_ns(), prev = atomic_load(&s->live_turn_ns);
    if (prev && now - prev > s->stall_max_ns) s->stall_max_ns = now - prev;
    if (prev) loom_metrics_observe_reactor_turn(s->metrics, (double)(now - prev) * 1e-9);
    if (s->stall_max_ns > 250000000ull && now - s->stall_log_ns > 10000000000ull) {
        LOOM_WARN("the reactor stalled: a turn took %.0f ms (the longest in the last 10 s); streams, Health and the "
                  "API waited that long", (double)s->stall_max_ns * 1e-6);
        s->stall_log_ns = now;
        s->stall_max_ns = 0;
    }
    atomic_store(&s->live_turn_ns, now);
    int pending = s->n_reqs + (s->embeds != NULL);
    atomic_store(&s->live_pending, s->n_reqs);
    if (!pending || loom_grid_state(s->grid) != LOOM_GRID_READY) atomic_store(&s->live_progress_ns, now);
    if (s->stall_file) {
        char *txt = NULL;
        if (loom_read_file(s->stall_file, &txt, NULL, NULL) == LOOM_OK) {
            unlink(s->stall_file);
            long ms = strtol(txt, NULL, 10);
            free(txt);
            LOOM_WARN("test hook: stalling the reactor for %ld ms", ms);
            struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
            if (ms > 0) nanosleep(&ts, NULL);
        }
    }
}

int loom_server_max_queue(const loom_server_t *s) { return s->cfg.max_queue; }

int loom_server_liveness(const loom_server_t *s, char *msg, size_t cap) {
    int limit_ms = s->cfg.liveness_timeout_ms;
    if (limit_ms <= 0) return 1;
    uint64_t now = loom_now_ns(), turn = atomic_load(&s->live_turn_ns), prog = atomic_load(&s->live_progress_ns);
    uint64_t limit = (uint64_t)limit_ms * 1000000ull;
    if (turn && now > turn && now - turn > limit) {
        snprintf(msg, cap, "stalled: the coordinator's reactor has not turned for %.1f s (limit %d ms, "
                           "--liveness-timeout-ms)", (double)(now - turn) * 1e-9, limit_ms);
        return 0;
    }
    if (prog && now > prog && now - prog > limit) {
        snprintf(msg, cap, "stalled: no step has completed for %.1f s while %d request(s) wait (limit %d ms, "
                           "--liveness-timeout-ms)", (double)(now - prog) * 1e-9, atomic_load(&s->live_pending),
                 limit_ms);
        return 0;
    }
    return 1;
}

int loom_server_run(loom_server_t *s) {
    LOOM_INFO("coordinator for %s (tp %d x pp %d): API on %s, workers on %s; waiting for %d worker(s)",
              s->model_name, s->cfg.tp, s->cfg.pp, s->api_addr, loom_grid_bound_addr(s->grid),
              loom_grid_n_slots(s->grid));
    while (!s->stop) {
        zmq_pollitem_t items[6] = {{loom_grid_socket(s->grid), 0, ZMQ_POLLIN, 0},
                                   {s->api, 0, ZMQ_POLLIN, 0},
                                   {NULL, loom_prep_fd(s->prep), ZMQ_POLLIN, 0}};
        int n_items = 3, draft_i = -1, lora_i = -1, check_i = -1;
        if (s->draft) items[draft_i = n_items++] = (zmq_pollitem_t){NULL, loom_coord_draft_fd(s->draft), ZMQ_POLLIN, 0};
        if (s->lora_prep) items[lora_i = n_items++] = (zmq_pollitem_t){NULL, loom_prep_fd(s->lora_prep), ZMQ_POLLIN, 0};
        if (s->kv_check_fd >= 0) items[check_i = n_items++] = (zmq_pollitem_t){NULL, s->kv_check_fd, ZMQ_POLLIN, 0};
        if (zmq_poll(items, n_items, 20) < 0 && errno != EINTR) break;
        if (check_i >= 0 && (items[check_i].revents & ZMQ_POLLIN)) loom_kv_dir_connector_drain(kv_dir(s));
        if (items[0].revents & ZMQ_POLLIN) loom_grid_on_readable(s->grid);
        if (items[2].revents & ZMQ_POLLIN) prep_done(s);
        if (draft_i >= 0 && (items[draft_i].revents & ZMQ_POLLIN)) drafts_done(s);
        if (lora_i >= 0 && (items[lora_i].revents & ZMQ_POLLIN)) lora_loads_done(s);
        for (int burst = 0; burst < 256 && (items[1].revents & ZMQ_POLLIN); burst++) {
            zmq_msg_t f[8];
            int n = loom_zapi_recv_frames(s->api, f, 8);
            if (n == 0) break;
            on_api(s, f, n);
            for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
        }
        loom_grid_tick(s->grid);
        liveness_turn(s);
        timers(s);
        schedule(s);
        publish_state(s);
        if (drain_step(s)) break;
    }
    LOOM_INFO("shutting down: %d request(s) still live", s->n_reqs);
    fail_all_requests(s, LOOM_ERR_UNAVAILABLE, "the coordinator is shutting down");
    lora_loads_end(s, LOOM_ERR_UNAVAILABLE, "the coordinator is shutting down");
    loom_grid_shutdown(s->grid, "the coordinator is shutting down");
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

/* The grid on the control socket (and etcd, when configured). */
/* The grid's control socket, before it binds: CURVE on it and on the client
 * API, one ZAP handler for both; then the API socket binds (its address is
 * what the grid publishes in etcd). */
static loom_status_t secure_sockets(void *ctx, void *ctl, loom_zap_t **ctl_zap, loom_err_t *err) {
    loom_server_t *s = ctx;
    LOOM_CHECK(loom_coord_security_setup(&s->cfg.security, s->zctx, s->api, ctl, loom_kv_events_socket(s->kv_events),
                                         s->cfg.listen, s->cfg.control, &s->zap, ctl_zap, err));
    return bind_sock(s->api, s->cfg.listen, s->api_addr, sizeof s->api_addr, err);
}

/* The model's part of the directory tier's identity: its weights and
 * tokenizer by content, so replicas of one model share block files and no
 * other model reads them. */
static uint64_t kv_tier_seed(const loom_server_t *s) {
    int32_t v[2 * LOOM_DIGEST_HEX / 4 + 2] = {0};
    memcpy(v, s->weights_digest, strlen(s->weights_digest));
    memcpy((char *)v + LOOM_DIGEST_HEX, s->tokenizer_digest, strlen(s->tokenizer_digest));
    return loom_kv_chain_hash(0x4b56544945520001ull, v, (int)(sizeof v / sizeof *v));
}

/* --kv-transfer-config's kv_role (vLLM's names), as etcd publishes it; NULL without one. */
static const char *kv_role(const loom_kv_transfer_config_t *t) {
    return t->producer && t->consumer ? "kv_both" : t->producer ? "kv_producer" : t->consumer ? "kv_consumer" : NULL;
}

static loom_status_t grid_open(loom_server_t *s, loom_err_t *err) {
    const loom_server_config_t *c = &s->cfg;
    loom_grid_config_t gc = {.control = c->control, .model_dir = c->model_dir, .model_name = s->model_name,
                             .n_layers = s->mcfg.n_layers, .vocab_size = s->mcfg.vocab_size, .tp = c->tp,
                             .pp = c->pp, .comm = c->comm, .weight_dtype = c->weight_dtype,
                             .quantization = c->quantization, .kv_cache_dtype = c->kv_cache_dtype,
                             .max_num_seqs = c->max_num_seqs, .max_batched_tokens = c->max_batched_tokens,
                             .block_size = c->block_size, .num_kv_blocks = c->num_kv_blocks,
                             .max_model_len = s->max_model_len, .kv_memory = c->kv_memory,
                             .kv_fraction = c->kv_fraction, .heartbeat_timeout_ms = c->heartbeat_timeout_ms,
                             .step_timeout_ms = c->step_timeout_ms, .step_token_us = c->step_token_us,
                             .etcd_url = c->etcd_url, .cluster = c->cluster, .advertise_host = c->advertise_host,
                             .api_addr = s->api_addr, .etcd_ttl = c->etcd_ttl, .metrics = s->metrics,
                             .kv_role = kv_role(&c->kv_transfer),
                             .secure_ctl = secure_sockets, .secure_ctx = s,
                             .encrypt_data = c->security.encrypt_data, .expert_parallel = c->expert_parallel,
                             .dp_attention = c->dp_attention, .mla_disable = c->mla_disable,
                             .mtp = c->spec.method == LOOM_SPEC_MTP,
                             .max_loras = c->max_loras, .max_lora_rank = c->max_lora_rank,
                             .kv_offload_dir = c->kv_offload_dir, .kv_offload_max_bytes = c->kv_offload_max_bytes,
                             .kv_host_bytes = c->kv_offload_host_bytes,
                             .kv_tier_seed = kv_tier_seed(s), .max_cpu_loras = s->lora_max_cpu, .ahead = s->ahead};
    if (kv_xfer_tcp(s)) {
        gc.kv_xfer = (c->kv_transfer.producer ? 1 : 0) | (c->kv_transfer.consumer ? 2 : 0) |
                     (c->kv_transfer.shm_off ? 4 : 0) | (c->kv_transfer.encrypt || c->security.encrypt_data ? 8 : 0);
        gc.kv_xfer_secret = c->kv_transfer.secret;
        gc.kv_xfer_secret_len = c->kv_transfer.secret_len;
    }
    loom_grid_callbacks_t cb = {.ctx = s, .on_ready = on_grid_ready, .on_failed = on_grid_failed,
                                .on_step_done = on_step_done, .on_step_failed = on_step_failed,
                                .on_lora_loaded = on_lora_loaded, .on_kv_read = on_kv_read};
    return loom_grid_create(&gc, s->zctx, &cb, &s->grid, err);
}

loom_status_t loom_server_create(const loom_server_config_t *cfg, loom_server_t **out, loom_err_t *err) {
    *out = NULL;
    loom_server_t *s = loom_xcalloc(1, sizeof *s);
    s->kv_check_fd = -1;
    s->cfg = *cfg;
    s->stall_file = getenv("LOOM_TEST_STALL_FILE");
    if (cfg->async_scheduling > 0 && cfg->pp == 1) s->ahead = cfg->async_scheduling;
    else if (cfg->async_scheduling > 0)
        LOOM_WARN("--async-scheduling needs one pipeline stage (this grid is tp %d x pp %d): it is off", cfg->tp,
                  cfg->pp);
    s->unsent = loom_xcalloc((size_t)(cfg->pp > 0 ? cfg->pp : 1) + (size_t)s->ahead, sizeof *s->unsent);
    /* workers may run elsewhere: hand them an absolute path */
    if (realpath(cfg->model_dir, s->model_dir_abs)) s->cfg.model_dir = s->model_dir_abs;
    cfg = &s->cfg;
    loom_status_t st = loom_model_config_load(cfg->model_dir, &s->mcfg, err);
    if (st < 0) goto fail;
    st = loom_tokenizer_load(cfg->model_dir, &s->tok, err);
    if (st < 0) goto fail;
    loom_err_t derr = {0};
    if (loom_model_digest(cfg->model_dir, s->weights_digest, s->tokenizer_digest, &derr) < 0) {
        LOOM_WARN("no model digest for ListModels (a router cannot check these weights): %s", derr.msg);
        if (cfg->kv_offload_dir) {
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "--kv-offloading-dir needs the model's digest to name its block files: %s", derr.msg);
            goto fail;
        }
    }
    if (cfg->kv_offload_dir) {
        struct stat dst;
        if (stat(cfg->kv_offload_dir, &dst) != 0 || !S_ISDIR(dst.st_mode) || access(cfg->kv_offload_dir, W_OK | X_OK)) {
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--kv-offloading-dir %s is not a writable directory",
                              cfg->kv_offload_dir);
            goto fail;
        }
        s->kv_conn = loom_kv_dir_connector_create(cfg->kv_offload_dir, cfg->kv_offload_write_through);
        /* first-sight reads of block files off the reactor */
        s->kv_check_fd = loom_kv_dir_connector_start_checks(s->kv_conn, cfg->kv_offload_prefetch_timeout_ms);
        if (s->kv_check_fd < 0) {
            st = loom_err_set(err, LOOM_ERR_INTERNAL, "cannot start the KV tier's checker thread");
            goto fail;
        }
        LOOM_INFO("KV offload: directory tier %s, at most %.2f GB, %s%s", cfg->kv_offload_dir,
                  (double)cfg->kv_offload_max_bytes / 1e9,
                  cfg->kv_offload_write_through ? "write-through" : "write-back",
                  cfg->kv_offload_host_bytes ? " (tier 2, below the host tier)" : "");
    }
    if (cfg->kv_offload_host_bytes) {
        s->kv_conn = loom_kv_host_connector_create(s->kv_conn); /* above the directory, if any */
        LOOM_INFO("KV offload: host-memory tier, %.2f GB per worker, write-back%s",
                  (double)cfg->kv_offload_host_bytes / 1e9, s->kv_conn->lower ? " (tier 1, above the directory)" : "");
    }
    /* an impossible split is a start-up error, before any worker comes */
    for (int r = 0; r < cfg->tp; r++) {
        loom_shard_spec_t spec = {.tp_rank = r, .tp_size = cfg->tp, .layer_begin = 0, .layer_end = s->mcfg.n_layers,
                                  .dp_attention = cfg->dp_attention};
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
    if (cfg->spec.method == LOOM_SPEC_MTP && (!s->mcfg.deepseek || s->mcfg.n_nextn_layers < 1)) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "--speculative-method mtp needs a DeepSeek checkpoint with num_nextn_predict_layers >= 1 "
                          "(model_type '%s' has %d)",
                          s->mcfg.model_type, s->mcfg.n_nextn_layers);
        goto fail;
    }
    if (cfg->spec.method == LOOM_SPEC_DRAFT) {
        loom_coord_draft_options_t dopt = {
            .model_dir = cfg->spec_model ? cfg->spec_model : cfg->model_dir,
            .quantization = cfg->spec_quantization,
            .max_seqs = cfg->spec_max_seqs > 0 ? cfg->spec_max_seqs : 8,
            .n_threads = cfg->spec_threads,
            .device = cfg->spec_device,
            .ctx = s->max_model_len};
        st =
            loom_coord_draft_open(&dopt, &s->mcfg, cfg->spec_model ? s->tok : NULL, &s->draft, err);
        if (st < 0) goto fail;
    }
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
    if (cfg->lora && cfg->lora->enable) {
        st = loom_lora_reactor_create(cfg->lora, &s->mcfg, s->model_name, &s->lora, err);
        if (st < 0) goto fail;
        s->cfg.max_loras = cfg->lora->max_loras;
        s->cfg.max_lora_rank = cfg->lora->max_lora_rank;
        s->lora_max_cpu = cfg->lora->max_cpu_loras;
        st = loom_prep_create(1, &s->lora_prep, err);
        if (st < 0) goto fail;
    }
    s->cfg.lora = NULL; /* the caller's options: copied into the reactor */
    if ((st = dp_attention_check(s, err)) < 0) goto fail;
    if ((st = mla_disable_check(s, err)) < 0) goto fail;
    s->max_piece = loom_tokenizer_max_piece_len(s->tok);
    s->text_buf = loom_xmalloc(s->max_piece * 4 + 4096 + 1);
    s->structured = loom_structured_create(s->tok, &s->mcfg, (size_t)cfg->grammar_cache_bytes);
    st = loom_prep_create(cfg->prepare_threads, &s->prep, err);
    if (st < 0) goto fail;
    s->seed_state = loom_now_ns() ^ ((uint64_t)getpid() << 32);
    if (cfg->has_seed) s->seed_state = cfg->seed; /* --seed: reproducible seeds for requests without one */
    s->metrics = loom_metrics_create(s->model_name, cfg->pp, s->max_model_len);

    s->zctx = zmq_ctx_new();
    s->api = zsock(s, ZMQ_ROUTER);
    int one = 1, unlimited = 0;
    zmq_setsockopt(s->api, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    /* a slow client must not lose chunks: queue instead of dropping */
    zmq_setsockopt(s->api, ZMQ_SNDHWM, &unlimited, sizeof unlimited);
    /* the KV events socket exists before the grid keys the sockets (it is
     * keyed with the client API), and binds once it is keyed */
    if (cfg->kv_events && (st = loom_kv_events_create(s->zctx, cfg->kv_events, cfg->advertise_host, &s->kv_events, err)) < 0)
        goto fail;
    st = grid_open(s, err); /* keys and binds the API socket too (secure_sockets) */
    if (st < 0) goto fail;
    if (s->kv_events && (st = loom_kv_events_bind(s->kv_events, err)) < 0) goto fail;
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
    embed_fail_all(s, LOOM_ERR_UNAVAILABLE, "the coordinator is shutting down");
    while (s->preparing) prep_drop(s, s->preparing);
    loom_prep_destroy(&s->prep); /* after the requests: their jobs are freed here */
    lora_loads_end(s, LOOM_OK, NULL);
    loom_prep_destroy(&s->lora_prep); /* before the reactor whose loads it reads */
    loom_grid_destroy(&s->grid);
    loom_kv_events_destroy(&s->kv_events); /* before the ledger it observes */
    loom_sched_destroy(&s->sched);
    loom_kv_connector_destroy(&s->kv_conn); /* after the scheduler that holds it */
    loom_lora_reactor_destroy(&s->lora); /* after the scheduler: its sequences hold pins */
    loom_coord_draft_destroy(
        &s->draft); /* after the scheduler: its sequences tell the draft as they go */
    loom_metrics_destroy(&s->metrics);
    if (s->api) zmq_close(s->api);
    loom_zap_stop(&s->zap); /* after every socket it guards is closed */
    if (s->zctx) zmq_ctx_term(s->zctx);
    loom_structured_destroy(&s->structured);
    loom_tokenizer_destroy(&s->tok);
    loom_lp_view_free(&s->lp_view);
    free(s->embed_done);
    free(s->text_buf);
    free(s->unsent);
    free(s);
}

void *loom_server_zmq_context(loom_server_t *s) { return s->zctx; }
loom_metrics_t *loom_server_metrics(loom_server_t *s) { return s->metrics; }
const char *loom_server_inproc_addr(const loom_server_t *s) { return s->inproc_addr; }
