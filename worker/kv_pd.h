/* A worker's side of prefill/decode transfer over transport tcp
 * (docs/disaggregation.md): on a prefill replica, its KV service
 * (worker/kv_xfer.h) over this shard's pool, serving the blocks the
 * coordinator holds (KvHold) and telling it of reads (KvRead); on a decode
 * replica, the step plan's pulls (StepPlan.kv_pull_*) into this shard's
 * pool, each rank reading the KV heads it holds from the prefill ranks that
 * hold them (the latent KV, MLA, whole from one rank: it is replicated).
 *
 * Threads: config and pulls run on the compute thread (and the connections
 * kept to the services between steps); holds and the reads reported are
 * taken by the reactor; the service runs its own threads. The
 * service is made anew with each KvConfig (before the pool may move) and
 * serves only that epoch's holds. */
#ifndef LOOM_WORKER_KV_PD_H
#define LOOM_WORKER_KV_PD_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/backend.h"
#include "worker/kv_xfer.h"
#include "worker/model.h"

#define LOOM_KV_PD_SERVE 1
#define LOOM_KV_PD_PULL 2
#define LOOM_KV_PD_NO_SHM 4 /* kv_connector_extra_config.shm "off": TCP even on one host */
#define LOOM_KV_PD_ENCRYPT 8 /* --encrypt-data-plane or kv_connector_extra_config.encrypt: messages sealed */
#define LOOM_KV_PD_DONE_MAX 256

#define LOOM_KV_PD_CONNS 8

/* A connection kept to a prefill rank's service (compute thread). */
typedef struct loom_kv_pd_conn {
    char addr[320];
    loom_kv_pull_t *c; /* NULL: free */
    loom_kv_ident_t them;
    uint64_t used;     /* loom_now_ns of its last use */
} loom_kv_pd_conn_t;

typedef struct loom_kv_pd {
    pthread_mutex_t mu;         /* guards svc and epoch (compute thread: config; reactor: holds) */
    pthread_mutex_t done_mu;    /* guards the reads reported (service thread, reactor) */
    int init;
    int mode;                   /* LOOM_KV_PD_* bits */
    uint64_t epoch;
    loom_kv_service_t *svc;
    loom_kv_ident_t ident;
    loom_kv_span_fmt_t fmt;
    uint8_t secret[256];
    size_t secret_len;
    loom_model_t *model;
    loom_backend_t *be;
    uint8_t *stage;             /* one block's span */
    uint64_t done[LOOM_KV_PD_DONE_MAX]; /* transfers reported read, for the reactor */
    int n_done;
    loom_kv_pd_conn_t conns[LOOM_KV_PD_CONNS]; /* the pulls' connections, kept between steps */
    uint64_t pulled, pulled_shm, pull_failures; /* blocks pulled, of them through shared memory; sources that failed */
    int serve_delay_ms;         /* a test's hook ($LOOM_TEST_KV_SERVE_DELAY_MS): each block served waits */
} loom_kv_pd_t;

/* Before any thread uses p (zeroed). */
void loom_kv_pd_init(loom_kv_pd_t *p);

/* The shard's identity for the handshake (model: the coordinator's tier
 * seed; the latent layout, MLA: one replicated head of the latent row);
 * 0 when its KV cannot be moved this way (decompressed MLA's narrower V). */
int loom_kv_pd_ident(loom_model_t *m, uint64_t model, int tp_rank, int tp_size, int stage, int n_stages,
                     int layer_begin, int layer_end, loom_kv_ident_t *id, loom_kv_span_fmt_t *fmt);

/* (Re)configures for an epoch: the previous service goes; with mode SERVE
 * a new one listens on host (port 0). Before the pool is reallocated, call
 * loom_kv_pd_stop. */
loom_status_t loom_kv_pd_config(loom_kv_pd_t *p, int mode, uint64_t epoch, loom_model_t *m, loom_backend_t *be,
                                const loom_kv_ident_t *id, const loom_kv_span_fmt_t *fmt, const uint8_t *secret,
                                size_t secret_len, const char *host, loom_err_t *err);
/* Ends the service (the pool is about to change or go). */
void loom_kv_pd_stop(loom_kv_pd_t *p);
/* The service's address ("" : none). */
const char *loom_kv_pd_addr(loom_kv_pd_t *p, char *out, size_t cap);
/* Reactor: a KvHold of epoch (ignored when not the service's). */
void loom_kv_pd_hold(loom_kv_pd_t *p, uint64_t epoch, uint64_t transfer, const int32_t *blocks, int n, int release);
/* Reactor: transfers reported read since the last call (their epoch in *epoch). */
int loom_kv_pd_take_done(loom_kv_pd_t *p, uint64_t *ids, int cap, uint64_t *epoch);

/* Compute thread: the plan's pulls. Fills failed[] (n_src entries, 1 for a
 * source whose blocks did not all arrive) and why[] (a message per failed
 * source, malloc'd, NULL otherwise). Returns how many failed here. */
int loom_kv_pd_pull(loom_kv_pd_t *p, const int32_t *blocks, const int32_t *remote, const uint32_t *source, int n,
                    char *const *addrs, const uint64_t *transfer, int n_src, int *failed, char **why);
/* After the step (one rank speaks for the grid): tells each source that
 * did not fail, on its first rank's service, that its transfer was read. */
void loom_kv_pd_done(loom_kv_pd_t *p, char *const *addrs, const uint64_t *transfer, int n_src, const int *failed);
/* The service goes and the staging span (the backend's host memory) is freed: before the model and backend go. */
void loom_kv_pd_release(loom_kv_pd_t *p);
/* Everything (no thread uses p any more). */
void loom_kv_pd_free(loom_kv_pd_t *p);

#endif
