/* The coordinator's reactor: one thread owns the client API socket, the
 * worker control socket, the scheduler and the KV ledger, and runs the
 * step loop. See server.c for the grid lifecycle. */
#ifndef LOOM_SERVER_H
#define LOOM_SERVER_H

#include "coordinator/kv_transfer.h"
#include <stdint.h>

#include "common/spec.h"
#include "common/status.h"
#include "coordinator/security.h"

struct loom_lora_serve_opts;

typedef struct loom_server_config {
    const char *model_dir;
    const char *model_name;   /* served model id (default: the directory's name) */
    int tp, pp;
    const char *listen;       /* client API, e.g. tcp://127.0.0.1:5555 */
    const char *control;      /* workers, e.g. tcp://127.0.0.1:5556 */
    const char *comm;         /* auto, shm, tcp */
    const char *weight_dtype; /* f32, bf16, f16 */
    const char *quantization; /* matmul weights quantized on load: none, int8, fp8, q4, ... */
    const char *kv_cache_dtype; /* auto, f32, bf16, int8, fp8 (workers resolve auto) */
    int expert_parallel;      /* MoE layers: the TP ranks of a stage split the experts */
    /* data-parallel attention (--enable-dp-attention; DeepSeek's MLA): each TP
     * rank runs attention for its own sequences, holding only their KV (the
     * ledger's partitions); implies expert_parallel */
    int dp_attention;
    /* DeepSeek's MLA decompressed (--disable-mla, LOOM_MLA_DISABLE=1): per-head K
     * and V in the workers' pools, ordinary attention (Assign.mla_disable) */
    int mla_disable;
    int max_loras;            /* LoRA adapter slots of every engine (0: off; docs/lora.md) */
    int max_lora_rank;        /* the largest adapter rank they take (0: 16) */
    /* vLLM's LoRA flags, checked (loom_lora_serve_startup); with enable set
     * adapters are served and max_loras / max_lora_rank come from here.
     * NULL: none. Copied at create. */
    const struct loom_lora_serve_opts *lora;
    int max_num_seqs;
    int max_batched_tokens;
    int max_queue;
    int max_model_len;        /* 0: the model's */
    int block_size;
    int num_kv_blocks;        /* 0: sized from the workers' memory */
    uint64_t kv_memory;       /* bytes per worker for the KV pool (0: kv_fraction) */
    float kv_fraction;        /* of the memory left after weights, shared by workers of a host */
    int prefix_cache;
    int heartbeat_timeout_ms;
    int step_timeout_ms, step_token_us; /* a step's deadline: floor + tokens x per-token bound */
    /* overlapped scheduling (--async-scheduling): steps planned and sent
     * while the ones before them run, their decode tokens the ones those
     * steps sample; this many beyond the one running (0: off; one pipeline
     * stage, else off with a warning) */
    int async_scheduling;
    int liveness_timeout_ms;            /* Health is not ready when the reactor or the steps stall this long */
    /* the preparation pool (prepare.h): grammar compilation and long prompts off the reactor */
    int prepare_threads;
    int grammar_compile_timeout_ms; /* a request's grammar compiles within this, else 400 */
    uint64_t grammar_max_bytes;     /* a grammar's compiled (and building) bytes, else 400 */
    uint64_t grammar_cache_bytes;   /* the compiled grammars kept for reuse (0: only their count) */
    int recovery_timeout_ms;  /* how long requests wait for a broken grid to be restored */
    const char *api_key;      /* required in every request when set */
    const char *ready_file;   /* written with the API address once the grid is ready */
    const char *etcd_url;     /* membership in etcd (NULL: heartbeats only) */
    const char *cluster;      /* cluster name: keys under /loom/<cluster>/ */
    const char *advertise_host; /* host workers and clients should dial (published in etcd) */
    int etcd_ttl;             /* lease TTL in seconds */
    int shutdown_timeout_ms;  /* draining: how long requests in flight may run on after a stop */
    int has_seed;             /* --seed: requests without a seed get seeds derived from this one, */
    uint64_t seed;            /* so the same requests in the same order give the same text */
    loom_coord_security_t security; /* CURVE keys of the control plane and the client API */
    const char *kv_events;    /* publish prefix-cache events here for routers (NULL: off) */
    /* the directory tier (docs/kv-offload.md; NULL: none): block files
     * shared by replicas, at most kv_offload_max_bytes; write-through
     * instead of write-back on eviction */
    const char *kv_offload_dir;
    uint64_t kv_offload_max_bytes;
    int kv_offload_write_through;
    /* how long a request whose tier blocks are being checked (read through
     * on first sight, off the reactor) waits for them before it is admitted
     * with those known (--kv-offloading-prefetch-timeout-ms; 0: never) */
    int kv_offload_prefetch_timeout_ms;
    /* the host-memory tier (--kv-offloading-size; 0: none): bytes per
     * worker for blocks leaving the pool (write-back) */
    uint64_t kv_offload_host_bytes;
    /* --kv-transfer-config: kv_transfer_params taken (prefill/decode
     * disaggregation through the directory tier; both roles 0: refused) */
    loom_kv_transfer_config_t kv_transfer;
    int embedding_pooling;    /* /v1/embeddings: 0 or 1 the last token, 2 the mean (sched.h loom_pooling_t) */
    loom_spec_config_t spec;  /* speculative decoding (method OFF: none), common/spec.h */
    /* method DRAFT (coordinator/draft.h): the draft's directory (NULL: the
     * target's, a self-draft), its quantization on load, its sequence slots
     * and CPU threads */
    const char *spec_model;
    const char *spec_quantization;
    int spec_max_seqs;
    int spec_threads;
    const char *spec_device; /* the draft's backend (NULL: cpu) */
} loom_server_config_t;

typedef struct loom_server loom_server_t;

loom_status_t loom_server_create(const loom_server_config_t *cfg, loom_server_t **out, loom_err_t *err);
/* Runs until stopped: returns once a drain has finished, or at once after a
 * second loom_server_stop. */
int loom_server_run(loom_server_t *s);
/* Async-signal-safe. The first call starts a drain: no new requests, those
 * in flight finish (or end with finish LENGTH at shutdown_timeout_ms); the
 * second makes loom_server_run return at once, failing what is left. */
void loom_server_stop(loom_server_t *s);
void loom_server_destroy(loom_server_t **s_p);

/* The server's metrics (thread-safe), for the HTTP gateway's /metrics. */
struct loom_metrics;
struct loom_metrics *loom_server_metrics(loom_server_t *s);

/* --max-queue: the most requests that ever wait at once (constant). */
int loom_server_max_queue(const loom_server_t *s);

/* Thread-safe: 1 when the reactor turned and (with requests waiting on a
 * READY grid) a step completed within --liveness-timeout-ms; else 0 and
 * msg says which ("stalled: ..."). Health (ZeroMQ and HTTP) reports it. */
int loom_server_liveness(const loom_server_t *s, char *msg, size_t cap);

/* The ZeroMQ context and an inproc address serving the client API, for
 * in-process clients (the HTTP gateway). */
void *loom_server_zmq_context(loom_server_t *s);
const char *loom_server_inproc_addr(const loom_server_t *s);

#endif
