/* Prometheus metrics: fixed-bucket histograms, gauges, counters (metrics.h).
 *
 * vLLM's names, types, labels and bucket boundaries follow its
 * PrometheusStatLogger (vllm/v1/metrics/loggers.py); docs/operations.md
 * has the table. Histograms saturate only past vLLM's last boundary
 * (2560 s for TTFT, 7680 s for request phases). */
#include "coordinator/metrics.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util.h"

#define MAX_BUCKETS    40 /* boundaries; one more bucket holds +Inf */
#define MAX_VLLM_NAMES 2

typedef struct hist {
    const char *name, *help;
    const char *vllm[MAX_VLLM_NAMES]; /* vLLM's names for the same data (NULL: none) */
    int n;
    double bounds[MAX_BUCKETS];
    uint64_t counts[MAX_BUCKETS + 1]; /* per bucket (not cumulative); the last is +Inf */
    double sum;
    uint64_t count;
} hist_t;

/* vLLM's boundaries: time to first token; per-token times (TPOT, ITL);
 * request phases (e2e, queue, prefill, decode, inference); tokens per
 * engine step; the n parameter; prefill time per prompt token. */
static const double k_ttft[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
static const double k_token[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                 0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double k_request[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                   5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const double k_iteration[] = {1,   8,    16,   32,   64,   128,  256,
                                     512, 1024, 2048, 4096, 8192, 16384};
static const double k_n[] = {1, 2, 5, 10, 20};
static const double k_prefill_token[] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0};
/* Loom's own sub-millisecond stages (tokenize, detokenize, send, step). */
static const double k_fine[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02,
                                0.025,  0.03,    0.04,   0.05,  0.075,  0.1,   0.15, 0.2,   0.3,
                                0.4,    0.5,     1.0,    2.5,   5.0,    10.0,  20.0, 40.0,  80.0};

enum {
    H_TTFT,
    H_TPOT,
    H_ITL,
    H_E2E,
    H_QUEUE,
    H_TOKENIZE,
    H_PREFILL,
    H_PREFILL_PER_TOKEN,
    H_DECODE,
    H_INFERENCE,
    H_DETOKENIZE,
    H_SEND,
    H_STEP,
    H_REACTOR_TURN,
    H_PROMPT_TOKENS,
    H_GEN_TOKENS,
    H_MAX_TOKENS,
    H_N,
    H_ITERATION,
    H_COUNT
};

typedef struct stage {
    double busy_s, comm_s;
    uint64_t steps;
} stage_t;

struct loom_metrics {
    pthread_mutex_t mu;
    char lbl[320];      /* model_name="..." (escaped) */
    char lbl_vllm[340]; /* model_name="...",engine="0" */
    hist_t h[H_COUNT];
    uint64_t finished[LOOM_FINISHED_COUNT];
    loom_metrics_state_t st;
    stage_t *stages;
    int n_stages;
    loom_metrics_lora_t lora;               /* .adapters points at lora_adapters */
    loom_metrics_lora_adapter_t *lora_adapters; /* owned; lora_cap entries */
    int lora_cap;
};

static void hist_init(hist_t *h, const char *name, const char *vllm0, const char *vllm1,
                      const char *help, const double *bounds, int n) {
    memset(h, 0, sizeof *h);
    h->name = name;
    h->vllm[0] = vllm0;
    h->vllm[1] = vllm1;
    h->help = help;
    LOOM_ASSERT(n <= MAX_BUCKETS);
    memcpy(h->bounds, bounds, (size_t)n * sizeof *bounds);
    h->n = n;
}

/* 1, 2, 5, 10, 20, 50, ... up to max (vLLM's build_1_2_5_buckets). */
static int buckets_125(double *out, int cap, int max) {
    static const int mant[] = {1, 2, 5};
    int n = 0;
    for (double scale = 1; n < cap; scale *= 10)
        for (int i = 0; i < 3 && n < cap; i++) {
            double v = mant[i] * scale;
            if (v > max) return n;
            out[n++] = v;
        }
    return n;
}

static void hist_observe(hist_t *h, double v) {
    int i = 0;
    while (i < h->n && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

loom_metrics_t *loom_metrics_create(const char *model_name, int n_stages, int max_model_len) {
    loom_metrics_t *m = loom_xcalloc(1, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    /* label values escape backslash, quote and newline */
    char model[256];
    size_t o = 0;
    for (const char *p = model_name; *p && o + 3 < sizeof model; p++) {
        if (*p == '\\' || *p == '"') model[o++] = '\\';
        if (*p == '\n') {
            model[o++] = '\\';
            model[o++] = 'n';
            continue;
        }
        model[o++] = *p;
    }
    model[o] = '\0';
    snprintf(m->lbl, sizeof m->lbl, "model_name=\"%s\"", model);
    snprintf(m->lbl_vllm, sizeof m->lbl_vllm, "model_name=\"%s\",engine=\"0\"", model);
#define HI(id, name, v0, v1, help, b)                                                              \
    hist_init(&m->h[id], name, v0, v1, help, b, (int)LOOM_ARRAY_LEN(b))
    HI(H_TTFT, "loom_time_to_first_token_seconds", "vllm:time_to_first_token_seconds", NULL,
       "Time from arrival to the first token.", k_ttft);
    HI(H_TPOT, "loom_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
       NULL, "Mean time per output token after the first, per request.", k_token);
    /* vLLM renders the inter-token latency under its older name too */
    HI(H_ITL, "loom_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
       "vllm:time_per_output_token_seconds", "Time between two successive tokens of a request.",
       k_token);
    HI(H_E2E, "loom_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds", NULL,
       "Time from arrival to the last token.", k_request);
    HI(H_QUEUE, "loom_request_queue_time_seconds", "vllm:request_queue_time_seconds", NULL,
       "Time from being queued (tokenized) to the first scheduling.", k_request);
    HI(H_TOKENIZE, "loom_request_tokenize_time_seconds", NULL, NULL,
       "Time spent encoding the prompt.", k_fine);
    HI(H_PREFILL, "loom_request_prefill_time_seconds", "vllm:request_prefill_time_seconds", NULL,
       "Time from the first scheduling to the first token.", k_request);
    HI(H_PREFILL_PER_TOKEN, "loom_request_prefill_time_per_token_seconds",
       "vllm:time_per_prefill_token_request_seconds", NULL,
       "Prefill time divided by the prompt's tokens.", k_prefill_token);
    HI(H_DECODE, "loom_request_decode_time_seconds", "vllm:request_decode_time_seconds", NULL,
       "Time from the first token to the last.", k_request);
    HI(H_INFERENCE, "loom_request_inference_time_seconds", "vllm:request_inference_time_seconds",
       NULL, "Time from the first scheduling to the last token (prefill + decode).", k_request);
    HI(H_DETOKENIZE, "loom_request_detokenize_time_seconds", NULL, NULL,
       "Time spent turning a request's ids into text (stop strings included).", k_fine);
    HI(H_SEND, "loom_request_send_time_seconds", NULL, NULL,
       "Time spent packing and sending a request's chunks.", k_fine);
    HI(H_STEP, "loom_step_seconds", NULL, NULL,
       "Micro-batch round trip, plan sent to result received.", k_fine);
    HI(H_REACTOR_TURN, "loom_reactor_turn_seconds", NULL, NULL,
       "Time between two turns of the coordinator's reactor: how long streams, Health and the API can wait.",
       k_fine);
    HI(H_ITERATION, "loom_iteration_tokens", "vllm:iteration_tokens_total", NULL,
       "Tokens per scheduled micro-batch (prompt and decode).", k_iteration);
    HI(H_N, "loom_request_params_n", "vllm:request_params_n", NULL,
       "The n parameter of finished requests.", k_n);
#undef HI
    double b[MAX_BUCKETS];
    int nb = buckets_125(b, MAX_BUCKETS, max_model_len > 0 ? max_model_len : 1);
    hist_init(&m->h[H_PROMPT_TOKENS], "loom_request_prompt_tokens", "vllm:request_prompt_tokens",
              NULL, "Prompt tokens of finished requests.", b, nb);
    hist_init(&m->h[H_GEN_TOKENS], "loom_request_generation_tokens",
              "vllm:request_generation_tokens", NULL, "Generated tokens of finished requests.", b,
              nb);
    /* with n = 1 the most tokens a request may generate is its max_tokens */
    hist_init(&m->h[H_MAX_TOKENS], "loom_request_params_max_tokens",
              "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens",
              "The max_tokens parameter of finished requests.", b, nb);
    m->n_stages = n_stages;
    m->stages = loom_xcalloc((size_t)(n_stages > 0 ? n_stages : 1), sizeof *m->stages);
    return m;
}

void loom_metrics_destroy(loom_metrics_t **m_p) {
    if (!m_p || !*m_p) return;
    loom_metrics_t *m = *m_p;
    *m_p = NULL;
    pthread_mutex_destroy(&m->mu);
    free(m->stages);
    free(m->lora_adapters);
    free(m);
}

void loom_metrics_request_done(loom_metrics_t *m, loom_finished_t how,
                               const loom_request_times_t *t) {
    double per_token =
        t->prefill_s >= 0 && t->prompt_tokens > 0 ? t->prefill_s / t->prompt_tokens : -1;
    const struct {
        int h;
        double v;
    } obs[] = {
        {H_QUEUE, t->queue_s},
        {H_TOKENIZE, t->tokenize_s},
        {H_PREFILL, t->prefill_s},
        {H_PREFILL_PER_TOKEN, per_token},
        {H_DECODE, t->decode_s},
        {H_DETOKENIZE, t->detokenize_s},
        {H_SEND, t->send_s},
        {H_TTFT, t->ttft_s},
        {H_TPOT, t->tpot_s},
        {H_E2E, t->e2e_s},
        {H_INFERENCE, t->prefill_s >= 0 && t->decode_s >= 0 ? t->prefill_s + t->decode_s : -1},
        {H_PROMPT_TOKENS, t->prompt_tokens},
        {H_GEN_TOKENS, t->generation_tokens},
        {H_MAX_TOKENS, t->max_tokens > 0 ? t->max_tokens : -1},
        {H_N, t->n > 0 ? t->n : -1}};
    pthread_mutex_lock(&m->mu);
    if ((unsigned)how < LOOM_FINISHED_COUNT) m->finished[how]++;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(obs); i++)
        if (obs[i].v >= 0) hist_observe(&m->h[obs[i].h], obs[i].v);
    pthread_mutex_unlock(&m->mu);
}

static void observe(loom_metrics_t *m, int h, double v) {
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->h[h], v);
    pthread_mutex_unlock(&m->mu);
}

void loom_metrics_observe_itl(loom_metrics_t *m, double itl_s) {
    observe(m, H_ITL, itl_s);
}
void loom_metrics_observe_step(loom_metrics_t *m, double step_s) {
    observe(m, H_STEP, step_s);
}
void loom_metrics_observe_reactor_turn(loom_metrics_t *m, double turn_s) {
    observe(m, H_REACTOR_TURN, turn_s);
}
void loom_metrics_observe_iteration(loom_metrics_t *m, int n_tokens) {
    if (n_tokens > 0) observe(m, H_ITERATION, n_tokens);
}

void loom_metrics_set_state(loom_metrics_t *m, const loom_metrics_state_t *st) {
    pthread_mutex_lock(&m->mu);
    m->st = *st;
    pthread_mutex_unlock(&m->mu);
}

void loom_metrics_set_lora(loom_metrics_t *m, const loom_metrics_lora_t *l) {
    int n = l->n_adapters > 0 && l->adapters ? l->n_adapters : 0;
    pthread_mutex_lock(&m->mu);
    if (n > m->lora_cap) {
        m->lora_adapters = loom_xrealloc(m->lora_adapters, (size_t)n * sizeof *m->lora_adapters);
        m->lora_cap = n;
    }
    if (n) memcpy(m->lora_adapters, l->adapters, (size_t)n * sizeof *m->lora_adapters);
    m->lora = *l;
    m->lora.n_adapters = n;
    m->lora.adapters = m->lora_adapters;
    pthread_mutex_unlock(&m->mu);
}

void loom_metrics_set_stage(loom_metrics_t *m, int stage, double busy_s, double comm_s,
                            uint64_t steps) {
    if (stage < 0 || stage >= m->n_stages) return;
    pthread_mutex_lock(&m->mu);
    m->stages[stage] = (stage_t){busy_s, comm_s, steps};
    pthread_mutex_unlock(&m->mu);
}

/* ---- rendering ------------------------------------------------------------------ */

static void family(loom_sbuf_t *o, const char *name, const char *type, const char *help) {
    loom_sbuf_printf(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void render_hist_as(loom_sbuf_t *o, const hist_t *h, const char *name, const char *lbl) {
    family(o, name, "histogram", h->help);
    uint64_t cum = 0;
    for (int i = 0; i < h->n; i++) {
        cum += h->counts[i];
        loom_sbuf_printf(o, "%s_bucket{%s,le=\"%g\"} %llu\n", name, lbl, h->bounds[i],
                         (unsigned long long)cum);
    }
    cum += h->counts[h->n];
    loom_sbuf_printf(o, "%s_bucket{%s,le=\"+Inf\"} %llu\n", name, lbl, (unsigned long long)cum);
    loom_sbuf_printf(o, "%s_sum{%s} %.9g\n", name, lbl, h->sum);
    loom_sbuf_printf(o, "%s_count{%s} %llu\n", name, lbl, (unsigned long long)h->count);
}

static void render_hist(loom_sbuf_t *o, const loom_metrics_t *m, const hist_t *h) {
    render_hist_as(o, h, h->name, m->lbl);
    for (int i = 0; i < MAX_VLLM_NAMES; i++)
        if (h->vllm[i]) render_hist_as(o, h, h->vllm[i], m->lbl_vllm);
}

static void gauge(loom_sbuf_t *o, const char *lbl, const char *name, const char *help, double v) {
    family(o, name, "gauge", help);
    loom_sbuf_printf(o, "%s{%s} %.9g\n", name, lbl, v);
}

static void counter(loom_sbuf_t *o, const char *lbl, const char *name, const char *help,
                    uint64_t v) {
    family(o, name, "counter", help);
    loom_sbuf_printf(o, "%s{%s} %llu\n", name, lbl, (unsigned long long)v);
}

/* A value both sets have: loom_NAME{model_name} and vllm:NAME{model_name,engine}. */
static void gauge2(loom_sbuf_t *o, const loom_metrics_t *m, const char *loom_name,
                   const char *vllm_name, const char *help, double v) {
    gauge(o, m->lbl, loom_name, help, v);
    gauge(o, m->lbl_vllm, vllm_name, help, v);
}

static void counter2(loom_sbuf_t *o, const loom_metrics_t *m, const char *loom_name,
                     uint64_t loom_v, const char *vllm_name, uint64_t vllm_v, const char *help) {
    counter(o, m->lbl, loom_name, help, loom_v);
    counter(o, m->lbl_vllm, vllm_name, help, vllm_v);
}

/* Speculative decoding counters, vLLM's spec_decode family (both names). */
static void render_spec(loom_sbuf_t *o, const loom_metrics_t *m, const loom_metrics_state_t *st) {
    counter2(o, m, "loom_spec_decode_num_drafts_total", st->spec_drafts, "vllm:spec_decode_num_drafts_total",
             st->spec_drafts, "Verify steps of a sequence that carried drafted tokens.");
    counter2(o, m, "loom_spec_decode_num_draft_tokens_total", st->spec_draft_tokens,
             "vllm:spec_decode_num_draft_tokens_total", st->spec_draft_tokens, "Drafted tokens verified.");
    counter2(o, m, "loom_spec_decode_num_accepted_tokens_total", st->spec_accepted_tokens,
             "vllm:spec_decode_num_accepted_tokens_total", st->spec_accepted_tokens, "Drafted tokens accepted.");
    int k = st->spec_k < 16 ? st->spec_k : 16;
    for (int v = 0; v < 2; v++) {
        const char *name = v ? "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                             : "loom_spec_decode_num_accepted_tokens_per_pos_total";
        family(o, name, "counter", "Accepted drafted tokens by position in the draft.");
        for (int i = 0; i < k; i++)
            loom_sbuf_printf(o, "%s{%s,position=\"%d\"} %llu\n", name, v ? m->lbl_vllm : m->lbl, i,
                             (unsigned long long)st->spec_accepted_per_pos[i]);
    }
}

/* A Prometheus label value: backslash, quote and newline escaped. */
static void label_value(loom_sbuf_t *o, const char *v) {
    for (const char *p = v; *p; p++) {
        if (*p == '\\' || *p == '"') loom_sbuf_printf(o, "\\%c", *p);
        else if (*p == '\n') loom_sbuf_printf(o, "\\n");
        else loom_sbuf_printf(o, "%c", *p);
    }
}

/* The adapters' comma-separated names with running (WAITING = 0) or
 * waiting (1) sequences, in registration order, as vLLM's label values. */
static void lora_names(loom_sbuf_t *o, const loom_metrics_lora_t *l, int waiting) {
    int first = 1;
    for (int i = 0; i < l->n_adapters; i++) {
        const loom_metrics_lora_adapter_t *a = &l->adapters[i];
        if ((waiting ? a->waiting : a->running) <= 0) continue;
        if (!first) loom_sbuf_printf(o, ",");
        label_value(o, a->name);
        first = 0;
    }
}

/* LoRA adapters: loom_lora_* and vLLM's vllm:lora_requests_info (whose value
 * is, as vLLM sets it, the time of the last update in Unix seconds). */
static void render_lora(loom_sbuf_t *o, const loom_metrics_t *m, const loom_metrics_lora_t *l) {
    gauge(o, m->lbl, "loom_lora_max_adapters", "Engine adapter slots (--max-loras).", l->max_loras);
    gauge(o, m->lbl, "loom_lora_resident_adapters", "Adapters loaded in an engine slot.", l->resident);
    gauge(o, m->lbl, "loom_lora_loading_adapters", "Adapter loads under way.", l->loading);
    gauge(o, m->lbl, "loom_lora_registered_adapters", "Adapters served by name.", l->n_adapters);
    counter(o, m->lbl, "loom_lora_loads_total", "Adapter loads into an engine slot completed.", l->loads);
    counter(o, m->lbl, "loom_lora_evictions_total",
            "Adapters evicted from an engine slot (least recently used, unpinned).", l->evictions);
    counter(o, m->lbl, "loom_lora_load_failures_total", "Adapter loads that failed on a worker.",
            l->load_failures);
    family(o, "loom_lora_load_seconds_total", "counter",
           "Seconds from adapter load orders to their completion on every worker.");
    loom_sbuf_printf(o, "loom_lora_load_seconds_total{%s} %.9g\n", m->lbl, l->load_seconds);
    static const struct {
        const char *name, *help;
        int what; /* 0 requests, 1 running, 2 waiting */
    } per[] = {
        {"loom_lora_requests_total", "Sequences admitted with each adapter.", 0},
        {"loom_lora_requests_running", "Sequences running with each adapter.", 1},
        {"loom_lora_requests_waiting", "Sequences waiting for each adapter.", 2},
    };
    for (size_t k = 0; k < LOOM_ARRAY_LEN(per); k++) {
        family(o, per[k].name, per[k].what ? "gauge" : "counter", per[k].help);
        for (int i = 0; i < l->n_adapters; i++) {
            const loom_metrics_lora_adapter_t *a = &l->adapters[i];
            loom_sbuf_printf(o, "%s{%s,lora_name=\"", per[k].name, m->lbl);
            label_value(o, a->name);
            if (per[k].what == 0)
                loom_sbuf_printf(o, "\"} %llu\n", (unsigned long long)a->requests);
            else
                loom_sbuf_printf(o, "\"} %d\n", per[k].what == 1 ? a->running : a->waiting);
        }
    }
    family(o, "vllm:lora_requests_info", "gauge", "Running stats on lora requests.");
    loom_sbuf_printf(o, "vllm:lora_requests_info{max_lora=\"%d\",running_lora_adapters=\"",
                     l->max_loras);
    lora_names(o, l, 0);
    loom_sbuf_printf(o, "\",waiting_lora_adapters=\"");
    lora_names(o, l, 1);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    loom_sbuf_printf(o, "\"} %.9g\n", (double)now.tv_sec + (double)now.tv_nsec * 1e-9);
}

char *loom_metrics_render(loom_metrics_t *m, size_t *len) {
    loom_sbuf_t o = {0};
    pthread_mutex_lock(&m->mu);
    const loom_metrics_state_t *st = &m->st;
    for (int i = 0; i < H_COUNT; i++)
        render_hist(&o, m, &m->h[i]);
    double kv_usage = st->kv_blocks_total ? (double)st->kv_blocks_used / st->kv_blocks_total : 0.0;
    gauge2(&o, m, "loom_num_requests_running", "vllm:num_requests_running",
           "Requests in the running batch.", st->running);
    gauge2(&o, m, "loom_num_requests_waiting", "vllm:num_requests_waiting",
           "Requests waiting to be scheduled.", st->waiting);
    gauge(&o, m->lbl, "loom_kv_cache_usage_ratio", "Fraction of KV cache blocks held by sequences.",
          kv_usage);
    gauge(&o, m->lbl_vllm, "vllm:kv_cache_usage_perc",
          "Fraction of KV cache blocks held by sequences (0 to 1).", kv_usage);
    gauge(&o, m->lbl_vllm, "vllm:gpu_cache_usage_perc",
          "Fraction of KV cache blocks held by sequences (0 to 1); vLLM's older name of "
          "vllm:kv_cache_usage_perc.",
          kv_usage);
    family(&o, "loom_kv_cache_blocks", "gauge",
           "KV cache blocks by state (used, cached = free but holding a prefix, free).");
    int free_blocks = st->kv_blocks_total - st->kv_blocks_used;
    loom_sbuf_printf(&o, "loom_kv_cache_blocks{%s,state=\"used\"} %d\n", m->lbl,
                     st->kv_blocks_used);
    loom_sbuf_printf(&o, "loom_kv_cache_blocks{%s,state=\"cached\"} %d\n", m->lbl,
                     st->kv_blocks_cached);
    loom_sbuf_printf(&o, "loom_kv_cache_blocks{%s,state=\"free\"} %d\n", m->lbl,
                     free_blocks - st->kv_blocks_cached);
    if (st->kv_transfer_tcp)
        gauge(&o, m->lbl, "loom_kv_transfer_held_blocks",
              "KV blocks finished prefills hold for their decode side's pull (freed when it reports them read or "
              "when kv_connector_extra_config.lease_ms passes).", st->kv_transfer_held_blocks);
    gauge(&o, m->lbl, "loom_kv_cache_capacity_blocks",
          "KV cache blocks per worker (the pool the scheduler hands out; with data-parallel attention, the sum "
          "of the ranks' pools).", st->kv_blocks_total);
    if (st->n_dp > 1) {
        family(&o, "loom_dp_attention_kv_blocks", "gauge",
               "KV blocks held by the sequences of each data-parallel attention rank (its partition).");
        for (int r = 0; r < st->n_dp; r++)
            loom_sbuf_printf(&o, "loom_dp_attention_kv_blocks{%s,rank=\"%d\"} %d\n", m->lbl, r,
                             st->dp_blocks_used[r]);
        family(&o, "loom_dp_attention_admissions_total", "counter",
               "Sequences admitted to each data-parallel attention rank (re-admissions after preemption too).");
        for (int r = 0; r < st->n_dp; r++)
            loom_sbuf_printf(&o, "loom_dp_attention_admissions_total{%s,rank=\"%d\"} %llu\n", m->lbl, r,
                             (unsigned long long)st->dp_admissions[r]);
    }
    const char *dtype = st->kv_dtype[0] ? st->kv_dtype : "none";
    family(&o, "loom_kv_cache_info", "gauge",
           "The KV cache's element type and block size (value 1).");
    loom_sbuf_printf(&o, "loom_kv_cache_info{%s,dtype=\"%s\",block_size=\"%d\"} 1\n", m->lbl, dtype,
                     st->block_size);
    family(&o, "vllm:cache_config_info", "gauge", "The KV cache's configuration (value 1).");
    loom_sbuf_printf(
        &o,
        "vllm:cache_config_info{block_size=\"%d\",cache_dtype=\"%s\",enable_prefix_caching=\"%s\","
        "engine=\"0\",num_gpu_blocks=\"%d\"} 1\n",
        st->block_size, dtype, st->prefix_caching ? "True" : "False", st->kv_blocks_total);
    gauge(&o, m->lbl, "loom_grid_ready", "1 when every worker of the grid is serving.",
          st->grid_ready);
    counter2(&o, m, "loom_prompt_tokens_total", st->prompt_tokens, "vllm:prompt_tokens_total",
             st->prompt_tokens, "Prompt tokens admitted.");
    counter2(&o, m, "loom_generation_tokens_total", st->generation_tokens,
             "vllm:generation_tokens_total", st->generation_tokens, "Tokens generated.");
    counter(&o, m->lbl, "loom_prefix_cache_queries_total",
            "Full prompt blocks looked up in the prefix cache.", st->prefix_cache_queries);
    counter(&o, m->lbl, "loom_prefix_cache_hits_total",
            "Full prompt blocks found in the prefix cache.", st->prefix_cache_hits);
    /* vLLM counts these in tokens */
    uint64_t bs = st->block_size > 0 ? (uint64_t)st->block_size : 0;
    counter(&o, m->lbl_vllm, "vllm:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (full blocks).",
            st->prefix_cache_queries * bs);
    counter(&o, m->lbl_vllm, "vllm:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache (full blocks).", st->prefix_cache_hits * bs);
    counter(&o, m->lbl, "loom_prompt_tokens_computed_total",
            "Prompt positions run (prefill and recompute; forked and cached ones are not).",
            st->prompt_tokens_computed);
    counter(&o, m->lbl, "loom_kv_forks_total",
            "Sequences admitted as a fork of a running sequence with the same prompt (n > 1).", st->kv_forks);
    counter(&o, m->lbl, "loom_kv_fork_tokens_total", "Prompt tokens taken over from the fork's leader.",
            st->kv_fork_tokens);
    if (st->kv_offload) {
        /* one series per tier: the tier, and the directory below the host tier */
        char tl[2][sizeof m->lbl + 32];
        snprintf(tl[0], sizeof tl[0], "%s,tier=\"%s\"", m->lbl, st->kv_offload_tier);
        snprintf(tl[1], sizeof tl[1], "%s,tier=\"dir\"", m->lbl);
        int nt = st->kv_offload_lower ? 2 : 1;
        const struct {
            const char *name, *help;
            uint64_t v[2];
        } fam[] = {
            {"loom_kv_offload_queries_total",
             "Full prompt blocks beyond the prefix cache's hit asked of the KV offload tier.",
             {st->kv_offload_queries, st->kv_lower_queries}},
            {"loom_kv_offload_hits_total", "Blocks loaded from the KV offload tier.",
             {st->kv_offload_hits, st->kv_lower_hits}},
            {"loom_kv_offload_saves_total", "Blocks sent to the KV offload tier.",
             {st->kv_offload_saves, st->kv_lower_saves}},
        };
        for (size_t f = 0; f < sizeof fam / sizeof fam[0]; f++) {
            family(&o, fam[f].name, "counter", fam[f].help);
            for (int t = 0; t < nt; t++)
                loom_sbuf_printf(&o, "%s{%s} %llu\n", fam[f].name, tl[t], (unsigned long long)fam[f].v[t]);
        }
        if (!strcmp(st->kv_offload_tier, "host")) {
            gauge(&o, m->lbl, "loom_kv_offload_host_blocks", "Blocks the host-memory KV tier holds (per worker).",
                  st->kv_host_used);
            gauge(&o, m->lbl, "loom_kv_offload_host_capacity_blocks",
                  "Blocks the host-memory KV tier can hold (per worker).", st->kv_host_slots);
        }
    }
    counter2(&o, m, "loom_num_preemptions_total", st->preemptions, "vllm:num_preemptions_total",
             st->preemptions, "Sequences preempted (KV dropped, recomputed later).");
    counter(&o, m->lbl, "loom_requests_rejected_total", "Requests refused before scheduling.",
            st->requests_rejected);
    if (st->spec_k > 0) render_spec(&o, m, st);
    if (m->lora.max_loras > 0) render_lora(&o, m, &m->lora);
    static const char *const reasons[LOOM_FINISHED_COUNT] = {"stop", "length", "abort", "error"};
    for (int v = 0; v < 2; v++) {
        const char *name = v ? "vllm:request_success_total" : "loom_request_success_total";
        family(&o, name, "counter", "Finished requests by finish reason.");
        for (int i = 0; i < LOOM_FINISHED_COUNT; i++)
            loom_sbuf_printf(&o, "%s{%s,finished_reason=\"%s\"} %llu\n", name,
                             v ? m->lbl_vllm : m->lbl, reasons[i],
                             (unsigned long long)m->finished[i]);
    }
    family(&o, "loom_stage_step_seconds", "gauge",
           "Mean compute time per step of each pipeline stage.");
    for (int s = 0; s < m->n_stages; s++)
        loom_sbuf_printf(&o, "loom_stage_step_seconds{%s,stage=\"%d\"} %.9g\n", m->lbl, s,
                         m->stages[s].steps ? m->stages[s].busy_s / (double)m->stages[s].steps
                                            : 0.0);
    family(&o, "loom_stage_busy_seconds_total", "counter",
           "Seconds each pipeline stage spent executing steps (summed over its workers).");
    for (int s = 0; s < m->n_stages; s++)
        loom_sbuf_printf(&o, "loom_stage_busy_seconds_total{%s,stage=\"%d\"} %.9g\n", m->lbl, s,
                         m->stages[s].busy_s);
    family(&o, "loom_stage_comm_seconds_total", "counter",
           "Seconds each pipeline stage spent in the data plane (summed over its workers).");
    for (int s = 0; s < m->n_stages; s++)
        loom_sbuf_printf(&o, "loom_stage_comm_seconds_total{%s,stage=\"%d\"} %.9g\n", m->lbl, s,
                         m->stages[s].comm_s);
    pthread_mutex_unlock(&m->mu);
    *len = o.len;
    return o.p;
}
