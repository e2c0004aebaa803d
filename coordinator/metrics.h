/* Serving metrics in Prometheus form: latency and size histograms, gauges
 * and counters. The reactor records events; the HTTP thread renders the
 * text exposition format. Every call takes the metrics' mutex (cheap: a few
 * events per token). Each metric has a loom_ name; those vLLM also has are
 * rendered a second time under vLLM's name (vllm:..., vLLM's type, bucket
 * boundaries and labels model_name and engine), so dashboards made for vLLM
 * work unchanged. docs/operations.md lists both sets. */
#ifndef LOOM_METRICS_H
#define LOOM_METRICS_H

#include <stddef.h>
#include <stdint.h>

/* How a request ended; the finished_reason label (vLLM's values). */
typedef enum {
    LOOM_FINISHED_STOP = 0, /* "stop": EOS, a stop token or a stop string */
    LOOM_FINISHED_LENGTH,   /* "length": max_tokens or the context length */
    LOOM_FINISHED_ABORT,    /* "abort": cancelled by the client or a disconnect */
    LOOM_FINISHED_ERROR,    /* "error": failed (grid lost, deadline, internal) */
    LOOM_FINISHED_COUNT
} loom_finished_t;

typedef struct loom_metrics loom_metrics_t;

/* max_model_len sets the top of the token-count histograms' 1-2-5 buckets
 * (as vLLM does). */
loom_metrics_t *loom_metrics_create(const char *model_name, int n_stages, int max_model_len);
void loom_metrics_destroy(loom_metrics_t **m_p);

/* Where one request's time went, in seconds; a stage it never reached
 * is < 0 and not observed (tpot: fewer than two tokens). The sizes are
 * token counts (< 0: not known, not observed). */
typedef struct loom_request_times {
    double queue_s, tokenize_s, prefill_s, decode_s, detokenize_s, send_s;
    double ttft_s, tpot_s, e2e_s;
    int prompt_tokens, generation_tokens, max_tokens, n;
} loom_request_times_t;

/* A request ended. */
void loom_metrics_request_done(loom_metrics_t *m, loom_finished_t how,
                               const loom_request_times_t *t);
/* The time between two successive tokens of one request. */
void loom_metrics_observe_itl(loom_metrics_t *m, double itl_s);
void loom_metrics_observe_step(loom_metrics_t *m, double step_s);
void loom_metrics_observe_reactor_turn(loom_metrics_t *m, double turn_s);
/* One scheduled micro-batch carried n_tokens tokens (prefill and decode). */
void loom_metrics_observe_iteration(loom_metrics_t *m, int n_tokens);

typedef struct loom_metrics_state {
    int running, waiting;
    int kv_blocks_total, kv_blocks_used, kv_blocks_cached;
    /* data-parallel attention (rendered when n_dp > 1): each rank's KV partition, the blocks its sequences
     * hold, and the admissions bound to it */
    int n_dp;
    int dp_blocks_used[64];
    uint64_t dp_admissions[64];
    char kv_dtype[16]; /* KV cache element type on the workers ("" before the grid is ready) */
    int block_size;
    int prefix_caching; /* 1: automatic prefix caching is on */
    uint64_t prompt_tokens, generation_tokens;
    uint64_t prefix_cache_queries, prefix_cache_hits; /* in full blocks */
    uint64_t preemptions, requests_rejected;
    uint64_t prompt_tokens_computed;   /* prompt positions run by the workers */
    uint64_t kv_forks, kv_fork_tokens; /* sequences forked from a twin's prompt KV; its tokens */
    int kv_offload;                    /* a KV offload tier is set (its counters are rendered) */
    uint64_t kv_offload_queries, kv_offload_hits, kv_offload_saves; /* in blocks */
    char kv_offload_tier[8];           /* the counters' tier label: "dir" or "host" */
    int kv_host_slots, kv_host_used;   /* the host tier's blocks per worker, and those it holds */
    int kv_offload_lower;              /* the directory below the host tier: its counters, tier="dir" */
    uint64_t kv_lower_queries, kv_lower_hits, kv_lower_saves;
    int kv_transfer_tcp;               /* --kv-transfer-config on transport tcp (the gauge below is rendered) */
    int kv_transfer_held_blocks;       /* pool blocks a finished prefill holds for a decode side's pull */
    int grid_ready;
    /* speculative decoding (rendered only when spec_k > 0) */
    int spec_k;                /* most drafts per step (0: speculation off) */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens;
    uint64_t spec_accepted_per_pos[16]; /* accepted drafts by position in the draft */
} loom_metrics_state_t;
/* Gauges and counters the reactor owns, copied in once per loop turn. */
void loom_metrics_set_state(loom_metrics_t *m, const loom_metrics_state_t *st);
/* Per pipeline stage: seconds busy and in the data plane, steps run (summed
 * over the stage's workers, from their heartbeats). */
void loom_metrics_set_stage(loom_metrics_t *m, int stage, double busy_s, double comm_s,
                            uint64_t steps);

/* LoRA adapters (rendered only when max_loras > 0, i.e. --enable-lora):
 * the engine slots and the registry's counters (coordinator/lora_slots.h)
 * and, per served adapter, its requests. */
typedef struct loom_metrics_lora_adapter {
    char name[128];
    uint64_t requests; /* admitted sequences, ever */
    int running;       /* sequences running with it now */
    int waiting;       /* sequences waiting for it (its load, or a slot) */
} loom_metrics_lora_adapter_t;

typedef struct loom_metrics_lora {
    int max_loras;       /* engine slots; 0: LoRA off, nothing rendered */
    int resident;        /* slots holding a loaded adapter */
    int loading;         /* slots whose load is under way */
    uint64_t loads, evictions, load_failures;
    double load_seconds; /* summed time from a load order to its completion */
    int n_adapters;
    const loom_metrics_lora_adapter_t *adapters; /* copied by loom_metrics_set_lora */
} loom_metrics_lora_t;
/* The adapters' state, copied in by the reactor (like loom_metrics_set_state). */
void loom_metrics_set_lora(loom_metrics_t *m, const loom_metrics_lora_t *l);

/* The Prometheus text exposition (version 0.0.4); malloc'ed, *len bytes. */
char *loom_metrics_render(loom_metrics_t *m, size_t *len);

#endif
