/* Prometheus metrics: fixed-bucket histograms, gauges, counters (metrics.h). */
#include "coordinator/metrics.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define MAX_BUCKETS 20

typedef struct hist {
    const char *name, *vllm_name, *help; /* vllm_name: NULL where vLLM has no such metric */
    int n;
    const double *bounds;
    uint64_t counts[MAX_BUCKETS]; /* per bucket (not cumulative); the last is +Inf */
    double sum;
    uint64_t count;
} hist_t;

static const double k_latency[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                   0.5,   0.75,   1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0};
static const double k_tpot[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
                                0.05,   0.075, 0.1,    0.15,  0.2,  0.3,   0.4,  0.5,   1.0};

enum {
    H_TTFT,
    H_TPOT,
    H_ITL,
    H_E2E,
    H_QUEUE,
    H_TOKENIZE,
    H_PREFILL,
    H_DECODE,
    H_INFERENCE,
    H_DETOKENIZE,
    H_SEND,
    H_STEP,
    H_COUNT
};

typedef struct stage {
    double busy_s, comm_s;
    uint64_t steps;
} stage_t;

struct loom_metrics {
    pthread_mutex_t mu;
    char model[256];
    hist_t h[H_COUNT];
    uint64_t finished[LOOM_FINISHED_COUNT];
    loom_metrics_state_t st;
    stage_t *stages;
    int n_stages;
};

static void hist_init(hist_t *h, const char *name, const char *vllm_name, const char *help, const double *bounds,
                      int n) {
    memset(h, 0, sizeof *h);
    h->name = name;
    h->vllm_name = vllm_name;
    h->help = help;
    h->bounds = bounds;
    h->n = n;
}

static void hist_observe(hist_t *h, double v) {
    int i = 0;
    while (i < h->n && v > h->bounds[i]) i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

loom_metrics_t *loom_metrics_create(const char *model_name, int n_stages) {
    loom_metrics_t *m = loom_xcalloc(1, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    /* label values escape backslash, quote and newline */
    size_t o = 0;
    for (const char *p = model_name; *p && o + 2 < sizeof m->model; p++) {
        if (*p == '\\' || *p == '"') m->model[o++] = '\\';
        if (*p == '\n') {
            m->model[o++] = '\\';
            m->model[o++] = 'n';
            continue;
        }
        m->model[o++] = *p;
    }
    int nl = (int)LOOM_ARRAY_LEN(k_latency), nt = (int)LOOM_ARRAY_LEN(k_tpot);
    hist_t *h = m->h;
    hist_init(&h[H_TTFT], "loom_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
              "Time from arrival to the first token.", k_latency, nl);
    hist_init(&h[H_TPOT], "loom_time_per_output_token_seconds", "vllm:time_per_output_token_seconds",
              "Mean time per output token after the first, per request.", k_tpot, nt);
    hist_init(&h[H_ITL], "loom_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
              "Time between two successive tokens of a request.", k_tpot, nt);
    hist_init(&h[H_E2E], "loom_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
              "Time from arrival to the last token.", k_latency, nl);
    hist_init(&h[H_QUEUE], "loom_request_queue_time_seconds", "vllm:request_queue_time_seconds",
              "Time from being queued (tokenized) to the first scheduling.", k_latency, nl);
    hist_init(&h[H_TOKENIZE], "loom_request_tokenize_time_seconds", NULL, "Time spent encoding the prompt.",
              k_tpot, nt);
    hist_init(&h[H_PREFILL], "loom_request_prefill_time_seconds", "vllm:request_prefill_time_seconds",
              "Time from the first scheduling to the first token.", k_latency, nl);
    hist_init(&h[H_DECODE], "loom_request_decode_time_seconds", "vllm:request_decode_time_seconds",
              "Time from the first token to the last.", k_latency, nl);
    hist_init(&h[H_INFERENCE], "loom_request_inference_time_seconds", "vllm:request_inference_time_seconds",
              "Time from the first scheduling to the last token (prefill + decode).", k_latency, nl);
    hist_init(&h[H_DETOKENIZE], "loom_request_detokenize_time_seconds", NULL,
              "Time spent turning a request's ids into text (stop strings included).", k_tpot, nt);
    hist_init(&h[H_SEND], "loom_request_send_time_seconds", NULL, "Time spent packing and sending a request's chunks.",
              k_tpot, nt);
    hist_init(&h[H_STEP], "loom_step_seconds", NULL, "Micro-batch round trip, plan sent to result received.", k_tpot,
              nt);
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
    free(m);
}

void loom_metrics_request_done(loom_metrics_t *m, loom_finished_t how, const loom_request_times_t *t) {
    const struct {
        int h;
        double v;
    } obs[] = {{H_QUEUE, t->queue_s},     {H_TOKENIZE, t->tokenize_s},     {H_PREFILL, t->prefill_s},
               {H_DECODE, t->decode_s},   {H_DETOKENIZE, t->detokenize_s}, {H_SEND, t->send_s},
               {H_TTFT, t->ttft_s},       {H_TPOT, t->tpot_s},             {H_E2E, t->e2e_s},
               {H_INFERENCE, t->prefill_s >= 0 && t->decode_s >= 0 ? t->prefill_s + t->decode_s : -1}};
    pthread_mutex_lock(&m->mu);
    if ((unsigned)how < LOOM_FINISHED_COUNT) m->finished[how]++;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(obs); i++)
        if (obs[i].v >= 0) hist_observe(&m->h[obs[i].h], obs[i].v);
    pthread_mutex_unlock(&m->mu);
}

void loom_metrics_observe_itl(loom_metrics_t *m, double itl_s) {
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->h[H_ITL], itl_s);
    pthread_mutex_unlock(&m->mu);
}

void loom_metrics_observe_step(loom_metrics_t *m, double step_s) {
    pthread_mutex_lock(&m->mu);
    hist_observe(&m->h[H_STEP], step_s);
    pthread_mutex_unlock(&m->mu);
}

void loom_metrics_set_state(loom_metrics_t *m, const loom_metrics_state_t *st) {
    pthread_mutex_lock(&m->mu);
    m->st = *st;
    pthread_mutex_unlock(&m->mu);
}

void loom_metrics_set_stage(loom_metrics_t *m, int stage, double busy_s, double comm_s, uint64_t steps) {
    if (stage < 0 || stage >= m->n_stages) return;
    pthread_mutex_lock(&m->mu);
    m->stages[stage] = (stage_t){busy_s, comm_s, steps};
    pthread_mutex_unlock(&m->mu);
}

static void family(loom_sbuf_t *o, const char *name, const char *type, const char *help) {
    loom_sbuf_printf(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void render_hist_as(loom_sbuf_t *o, const loom_metrics_t *m, const hist_t *h, const char *name) {
    family(o, name, "histogram", h->help);
    uint64_t cum = 0;
    for (int i = 0; i < h->n; i++) {
        cum += h->counts[i];
        loom_sbuf_printf(o, "%s_bucket{model_name=\"%s\",le=\"%g\"} %llu\n", name, m->model, h->bounds[i], (unsigned long long)cum);
    }
    cum += h->counts[h->n];
    loom_sbuf_printf(o, "%s_bucket{model_name=\"%s\",le=\"+Inf\"} %llu\n", name, m->model, (unsigned long long)cum);
    loom_sbuf_printf(o, "%s_sum{model_name=\"%s\"} %.9g\n", name, m->model, h->sum);
    loom_sbuf_printf(o, "%s_count{model_name=\"%s\"} %llu\n", name, m->model, (unsigned long long)h->count);
}

static void render_hist(loom_sbuf_t *o, const loom_metrics_t *m, const hist_t *h) {
    render_hist_as(o, m, h, h->name);
    if (h->vllm_name) render_hist_as(o, m, h, h->vllm_name);
}

static void gauge(loom_sbuf_t *o, const loom_metrics_t *m, const char *name, const char *help, double v) {
    family(o, name, "gauge", help);
    loom_sbuf_printf(o, "%s{model_name=\"%s\"} %.9g\n", name, m->model, v);
}

static void counter(loom_sbuf_t *o, const loom_metrics_t *m, const char *name, const char *help, uint64_t v) {
    family(o, name, "counter", help);
    loom_sbuf_printf(o, "%s{model_name=\"%s\"} %llu\n", name, m->model, (unsigned long long)v);
}

char *loom_metrics_render(loom_metrics_t *m, size_t *len) {
    loom_sbuf_t o = {0};
    pthread_mutex_lock(&m->mu);
    const loom_metrics_state_t *st = &m->st;
    for (int i = 0; i < H_COUNT; i++) render_hist(&o, m, &m->h[i]);
    double kv_usage = st->kv_blocks_total ? (double)st->kv_blocks_used / st->kv_blocks_total : 0.0;
    gauge(&o, m, "loom_num_requests_running", "Requests in the running batch.", st->running);
    gauge(&o, m, "vllm:num_requests_running", "Requests in the running batch.", st->running);
    gauge(&o, m, "loom_num_requests_waiting", "Requests waiting to be scheduled.", st->waiting);
    gauge(&o, m, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", st->waiting);
    gauge(&o, m, "loom_kv_cache_usage_ratio", "Fraction of KV cache blocks held by sequences.", kv_usage);
    gauge(&o, m, "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks held by sequences (0 to 1).", kv_usage);
    family(&o, "loom_kv_cache_blocks", "gauge", "KV cache blocks by state (used, cached = free but holding a prefix, free).");
    int free_blocks = st->kv_blocks_total - st->kv_blocks_used;
    loom_sbuf_printf(&o, "loom_kv_cache_blocks{model_name=\"%s\",state=\"used\"} %d\n", m->model, st->kv_blocks_used);
    loom_sbuf_printf(&o, "loom_kv_cache_blocks{model_name=\"%s\",state=\"cached\"} %d\n", m->model, st->kv_blocks_cached);
    loom_sbuf_printf(&o, "loom_kv_cache_blocks{model_name=\"%s\",state=\"free\"} %d\n", m->model, free_blocks - st->kv_blocks_cached);
    gauge(&o, m, "loom_kv_cache_blocks_total", "KV cache blocks per worker (the pool the scheduler hands out).",
          st->kv_blocks_total);
    family(&o, "loom_kv_cache_info", "gauge", "The KV cache's element type and block size (value 1).");
    loom_sbuf_printf(&o, "loom_kv_cache_info{model_name=\"%s\",dtype=\"%s\",block_size=\"%d\"} 1\n", m->model,
                     st->kv_dtype[0] ? st->kv_dtype : "none", st->block_size);
    gauge(&o, m, "loom_grid_ready", "1 when every worker of the grid is serving.", st->grid_ready);
    counter(&o, m, "loom_prompt_tokens_total", "Prompt tokens admitted.", st->prompt_tokens);
    counter(&o, m, "vllm:prompt_tokens_total", "Prompt tokens admitted.", st->prompt_tokens);
    counter(&o, m, "loom_generation_tokens_total", "Tokens generated.", st->generation_tokens);
    counter(&o, m, "vllm:generation_tokens_total", "Tokens generated.", st->generation_tokens);
    counter(&o, m, "loom_prefix_cache_queries_total", "Full prompt blocks looked up in the prefix cache.", st->prefix_cache_queries);
    counter(&o, m, "loom_prefix_cache_hits_total", "Full prompt blocks found in the prefix cache.", st->prefix_cache_hits);
    counter(&o, m, "loom_num_preemptions_total", "Sequences preempted (KV dropped, recomputed later).", st->preemptions);
    counter(&o, m, "vllm:num_preemptions_total", "Sequences preempted (KV dropped, recomputed later).", st->preemptions);
    counter(&o, m, "loom_requests_rejected_total", "Requests refused before scheduling.", st->requests_rejected);
    static const char *reasons[] = {"stop", "length", "cancelled", "error"};
    for (int v = 0; v < 2; v++) {
        const char *name = v ? "vllm:request_success_total" : "loom_request_success_total";
        family(&o, name, "counter", "Finished requests by finish reason.");
        for (int i = 0; i < LOOM_FINISHED_COUNT; i++)
            loom_sbuf_printf(&o, "%s{model_name=\"%s\",finished_reason=\"%s\"} %llu\n", name, m->model, reasons[i],
                (unsigned long long)m->finished[i]);
    }
    family(&o, "loom_stage_step_seconds", "gauge", "Mean compute time per step of each pipeline stage.");
    for (int s = 0; s < m->n_stages; s++)
        loom_sbuf_printf(&o, "loom_stage_step_seconds{model_name=\"%s\",stage=\"%d\"} %.9g\n", m->model, s,
            m->stages[s].steps ? m->stages[s].busy_s / (double)m->stages[s].steps : 0.0);
    family(&o, "loom_stage_busy_seconds_total", "counter", "Seconds each pipeline stage spent executing steps (summed over its workers).");
    for (int s = 0; s < m->n_stages; s++)
        loom_sbuf_printf(&o, "loom_stage_busy_seconds_total{model_name=\"%s\",stage=\"%d\"} %.9g\n", m->model, s, m->stages[s].busy_s);
    family(&o, "loom_stage_comm_seconds_total", "counter", "Seconds each pipeline stage spent in the data plane (summed over its workers).");
    for (int s = 0; s < m->n_stages; s++)
        loom_sbuf_printf(&o, "loom_stage_comm_seconds_total{model_name=\"%s\",stage=\"%d\"} %.9g\n", m->model, s, m->stages[s].comm_s);
    pthread_mutex_unlock(&m->mu);
    *len = o.len;
    return o.p;
}
