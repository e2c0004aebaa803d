/* `loom bench`, the serving load generator, in parts: datasets and arrival
 * times (dataset.c), transports (zmq.c: the loom.v1 API; http.c: any
 * OpenAI-compatible server over libcurl), the run loop (run.c), statistics
 * (stats.c) and reports, JSON and plots (report.c). cmd_bench.c parses the
 * options and ties them together. Times are seconds since the start of a
 * rate's run unless they say otherwise. */
#ifndef LOOM_BENCH_H
#define LOOM_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "client/loom_client.h"
#include "common/status.h"

#define BENCH_MAX_PCT         8
#define BENCH_MAX_ERROR_KINDS 4
#define BENCH_MAX_TURNS       64 /* multiturn: turns a session may have */

/* ---- transports ---- */

/* What one request asks for: token ids or text (the transport says which
 * it needs: chat endpoints take text). */
typedef struct bench_req {
    const int32_t *prompt_ids;
    int n_prompt;
    const char *prompt_text; /* NULL: send the ids */
    int max_tokens;
    float temperature;
    uint64_t seed;
    int ignore_eos;
    const char *session; /* the conversation's key, for a router's session affinity (NULL: none) */
} bench_req_t;

/* Something that arrived for one request: tokens (n_tokens > 0, their text)
 * or its end (final, with the usage and Loom's timings when the server
 * sent them). text is valid until the next poll. */
typedef struct bench_event {
    uint64_t handle;
    int n_tokens, final;
    const int32_t *ids; /* the n_tokens ids, when the transport has them (NULL: text only) */
    const char *text;
    size_t text_len;
    loom_status_t status;
    char message[300];
    int prompt_tokens, completion_tokens; /* 0: the server did not say */
    int cached_tokens;      /* prompt tokens found in the prefix cache (-1: not said) */
    loom_timings_t timings; /* the server's, in the final event (has_timings) */
    int has_timings;
} bench_event_t;

typedef struct bench_model {
    char id[256];
    int context_length, vocab_size; /* 0: the server did not say */
} bench_model_t;

typedef struct bench_transport {
    const char *name; /* "zmq", "openai" (/v1/completions), "openai-chat" */
    int needs_text;   /* prompts must be text (chat) */
    void *self;
    loom_status_t (*submit)(void *self, const bench_req_t *r, uint64_t *handle, loom_err_t *err);
    loom_status_t (*poll)(void *self, int timeout_ms, bench_event_t *ev, int *got, loom_err_t *err);
    loom_status_t (*cancel)(void *self, uint64_t handle, loom_err_t *err);
    loom_status_t (*model)(void *self, bench_model_t *m, loom_err_t *err); /* optional */
    void (*close)(void *self);
} bench_transport_t;

loom_status_t bench_zmq_open(const char *addr, int timeout_ms, const char *api_key,
                             bench_transport_t *t, loom_err_t *err);
/* base_url: http://HOST:PORT (an optional /v1 is dropped); endpoint: the
 * path (NULL: /v1/completions, or /v1/chat/completions when chat). model:
 * the served name to send (NULL: found by model()). */
loom_status_t bench_http_open(const char *base_url, const char *endpoint, int chat, int timeout_ms,
                              const char *api_key, const char *model, bench_transport_t *t,
                              loom_err_t *err);

/* ---- datasets ---- */

typedef enum {
    BENCH_DS_RANDOM,
    BENCH_DS_SHAREGPT,
    BENCH_DS_PREFIX_REPETITION,
    BENCH_DS_MULTITURN
} bench_ds_kind_t;

typedef struct bench_ds_cfg {
    bench_ds_kind_t kind;
    int num_requests, vocab;
    uint64_t seed;
    int want_text; /* make text prompts (a chat endpoint) */
    /* random: lengths uniform in len*(1 +- range) */
    int input_len, output_len;
    float input_range, output_range;
    /* sharegpt */
    const char *path;
    int sharegpt_output_len; /* 0: from the reply's length */
    /* prefix repetition: num_prefixes shared prefixes, each followed by a random suffix */
    int prefix_len, suffix_len, num_prefixes;
    /* multiturn: sessions x turns chats; every session starts with one of
     * num_system system prompts of system_len tokens, and each turn adds
     * user_len new tokens and asks for output_len; a turn is sent think_s
     * (mean, exponential) after the session's previous one ended */
    int sessions, turns, system_len, num_system, user_len;
    double think_s;
} bench_ds_cfg_t;

/* One request, or one turn of a chat. A chat's turns are consecutive
 * items, turn 0 first: turn 0's ids are its whole prompt (the system prompt
 * and the first user tokens); a later turn's ids are only its new user
 * tokens, and the run sends the previous turn's prompt, the answer that
 * came back for it, and these (bench_turn_prompt). */
typedef struct bench_item {
    int32_t *ids; /* NULL for text-only items (sharegpt) */
    int n_ids;
    char *text;     /* NULL: ids only */
    int prompt_len; /* tokens (about 4 bytes a token for text); a later turn: its new ones */
    int output_len;
    int session, turn; /* multiturn: which chat, and which of its turns (0 for other datasets) */
    double think_s;    /* a later turn: seconds between the previous turn's end and this one */
} bench_item_t;

/* Builds cfg->num_requests items (multiturn: sessions * turns, session-major);
 * on bad input fills msg and returns -1. */
int bench_dataset_load(const bench_ds_cfg_t *cfg, bench_item_t **items, char *msg, size_t msg_len);
void bench_dataset_free(bench_item_t *items, int n);
/* Arrival times: t[0] = 0, then gaps drawn from a gamma distribution of
 * shape burstiness and mean 1/rate (burstiness 1: Poisson), scaled so the
 * last arrives at n/rate as vLLM does; rate INFINITY: all at 0. */
void bench_arrivals(int n, double rate, double burstiness, uint64_t seed, double *t);

/* ---- one run ---- */

typedef struct bench_rec {
    const bench_item_t *item;
    double t_arrival; /* when it is due */
    double t_send, t_first, t_end;
    double *chunk_t; /* arrival of each chunk that carried tokens */
    int n_chunks, cap_chunks;
    int tokens_seen, prompt_tokens, completion_tokens;
    int cached_tokens; /* -1: the server did not say */
    int32_t *ids;      /* what came back, as ids (when the transport has them) */
    int n_ids, cap_ids;
    int32_t *sent_ids; /* a chat's later turn: the whole prompt sent (else NULL: the item's) */
    int n_sent;
    char *sent_text;
    char *text; /* what came back */
    size_t text_len, text_cap;
    loom_timings_t timings; /* the server's (has_timings) */
    int has_timings;
    int state; /* 0 not sent, 1 in flight, 2 done */
    loom_status_t status;
    char msg[300];
    uint64_t handle;
} bench_rec_t;

typedef struct bench_run_cfg {
    int num_requests, max_concurrency, ignore_eos;
    float temperature;
    uint64_t seed;
    double deadline;  /* loom_now_s() at which everything stops */
    int text_prompts; /* send text even where the transport takes ids (a chat's answers are text) */
    int chat;         /* multiturn: every request carries its session's key (bench-SEED-SESSION) */
} bench_run_cfg_t;

/* A chat's later turn q (q[-1] is its previous turn, done): the prompt is
 * the previous turn's prompt, then its answer, then q's new tokens. Fills
 * q->sent_ids (ids, when the previous answer's ids are known) or
 * q->sent_text (text); returns -1 when the previous turn failed. */
int bench_turn_prompt(bench_rec_t *q, int text);

/* Runs recs[0..n) (item and t_arrival set) through t; fills in what
 * happened. The first turns of chats and all other requests go at their
 * t_arrival; a chat's later turn only once its previous turn has ended,
 * think_s later (its t_arrival is set then). */
loom_status_t bench_run(const bench_transport_t *t, const bench_run_cfg_t *cfg, bench_rec_t *recs,
                        int n, int *peak, double *duration, loom_err_t *err);
void bench_recs_reset(bench_rec_t *recs, int n); /* frees what a run collected */

/* ---- statistics ---- */

typedef struct bench_stat {
    int n;
    double mean, median, std, p50, p90, p99; /* NAN when n = 0 */
    double pct[BENCH_MAX_PCT];               /* at the --metric-percentiles */
} bench_stat_t;

typedef struct bench_goodput {
    double ttft_ms, tpot_ms, e2el_ms; /* < 0: no objective */
    int any;
} bench_goodput_t;

/* The server-side stages of a request, from its timings. */
enum {
    BENCH_ST_TOKENIZE,
    BENCH_ST_QUEUE,
    BENCH_ST_PREFILL,
    BENCH_ST_DECODE,
    BENCH_ST_DETOKENIZE,
    BENCH_ST_SEND,
    BENCH_ST_TTFT,
    BENCH_ST_COUNT
};
extern const char *const bench_stage_names[BENCH_ST_COUNT];

typedef struct bench_result {
    double rate; /* requests/s; INFINITY: all at once */
    int skipped;
    int n, completed, failed, good, peak_in_flight, max_concurrent_requests;
    double duration_s, req_per_s, goodput_per_s, out_tok_per_s, total_tok_per_s,
        max_output_tokens_per_s;
    long long in_tokens, out_tokens;
    long long cached_tokens;             /* prompt tokens the servers' prefix caches held */
    int n_cached_said;                   /* completed requests whose server said how many */
    bench_stat_t ttft, tpot, itl, e2e;   /* milliseconds */
    bench_stat_t stages[BENCH_ST_COUNT]; /* server timings, ms (n = 0: the server sent none) */
    char errors[BENCH_MAX_ERROR_KINDS][300];
    int error_counts[BENCH_MAX_ERROR_KINDS], n_error_kinds;
    /* multiturn: per turn (n_turns > 0) */
    int n_turns;
    struct bench_turn_stat {
        int completed, failed;
        double prompt_mean;        /* tokens sent */
        double cached_frac;        /* cached / prompt tokens (NAN: not said) */
        double ttft_p50, ttft_p99; /* ms */
    } turns[BENCH_MAX_TURNS];
} bench_result_t;

/* pcts: n_pcts percentiles in (0, 100]. */
void bench_compute(const bench_rec_t *recs, int n, double duration, const double *pcts, int n_pcts,
                   const bench_goodput_t *slo, bench_result_t *res);
bench_stat_t bench_summarize(double *x, int n, const double *pcts, int n_pcts); /* sorts x */

/* ---- reports ---- */

typedef struct bench_report_cfg {
    const char *backend, *endpoint, *model, *base_url, *dataset;
    int num_requests, max_concurrency, save_detailed, prompt_len, output_len;
    float prompt_range, output_range, temperature;
    double burstiness;
    uint64_t seed;
    const double *pcts;
    int n_pcts;
    const char *percentile_metrics; /* "ttft,tpot,itl" */
    const bench_goodput_t *goodput;
} bench_report_cfg_t;

void bench_print_result(const bench_result_t *r, const bench_report_cfg_t *cfg);
void bench_print_sweep(const bench_result_t *res, int n);
/* recs: the last rate's requests (for the per-request lists), or NULL. */
int bench_write_json(const char *path, const bench_result_t *res, int n, int sweep,
                     const bench_report_cfg_t *cfg, bench_rec_t *const *recs, const int *n_recs);
int bench_write_plot(const char *png, const bench_result_t *res, int n, const char *model);
int bench_write_stage_plot(const char *png, const bench_result_t *res, int n, const char *model);

#endif
