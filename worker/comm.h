/* The data plane: moves activations between workers, never through the
 * coordinator. One loom_comm_t per worker covers its tensor-parallel group
 * (all-reduce, gather, barrier) and its two pipeline neighbours (send to the
 * next stage, receive from the previous one). Backends:
 *   shm  - shared memory between processes on one host (futex waits);
 *   tcp  - sockets, for workers on different hosts;
 *   nccl - GPUs (kernels/cuda), same calls on device pointers.
 * Every blocking call returns LOOM_ERR_UNAVAILABLE when the comm is aborted
 * (a peer died; see loom_comm_abort) or its timeout passes — never hangs. */
#ifndef LOOM_COMM_H
#define LOOM_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct loom_comm loom_comm_t;
typedef struct loom_comm_listener loom_comm_listener_t;

typedef struct loom_comm_peer {
    const char *worker_id;
    const char *data_addr; /* "tcp://127.0.0.1:40123" */
} loom_comm_peer_t;

#define LOOM_COMM_CONFIG_VERSION 1

typedef struct loom_comm_config {
    int version;                      /* LOOM_COMM_CONFIG_VERSION */
    const char *backend;              /* "shm" or "tcp" ("nccl" with CUDA) */
    const char *name;                 /* unique per grid epoch: names shm segments, tags tcp hellos */
    const char *self_id;              /* this worker's id */
    int tp_rank, tp_size;
    const loom_comm_peer_t *tp_group; /* (tp_size) in rank order, self included */
    const loom_comm_peer_t *prev;     /* previous stage, same tp rank; NULL on the first stage */
    const loom_comm_peer_t *next;     /* next stage, same tp rank; NULL on the last stage */
    size_t max_bytes;                 /* largest message: all-reduce buffer, hidden states, gather part */
    int timeout_ms;                   /* 0: wait until aborted */
    loom_comm_listener_t *listener;   /* tcp: this worker's listening socket */
    /* Backends whose groups need an id made by one member (nccl: the
     * ncclUniqueId bytes of loom_comm_make_id): the worker at TP rank 0 makes
     * its TP group's id, and the earlier worker of each pipeline pair the
     * pair's; each sends its ids up in Loaded and the coordinator hands them
     * to every member in KvConfig without reading them (control.proto's
     * tp_group_id, prev_group_id, next_group_id). NULL where the backend
     * needs none. nccl also takes the device and the CUDA stream
     * (cudaStream_t) the collectives are ordered on. */
    const void *tp_group_id;   /* this worker's TP group */
    const void *prev_group_id; /* the pair (previous stage, this) */
    const void *next_group_id; /* the pair (this, next stage) */
    int cuda_device;
    void *cuda_stream;
    /* tcp: the epoch's shared secret (Assign.data_secret); when set, every
     * link proves both ends hold it (HMAC-SHA256 challenge) before any frame
     * is read. NULL: links are not authenticated. */
    const uint8_t *auth_secret;
    size_t auth_secret_len;
    /* tcp, with auth_secret: encrypt every frame (ChaCha20-Poly1305, a key
     * per link and direction derived from the secret and the handshake's
     * nonces); a frame that fails its tag aborts the comm. */
    int encrypt;
    /* tcp: polled while create waits for its links (every 200 ms at most);
     * nonzero gives up at once with LOOM_ERR_UNAVAILABLE (the coordinator
     * aborted this epoch: a join that cannot finish). NULL: wait until
     * timeout_ms. */
    int (*cancelled)(void *ctx);
    void *cancel_ctx;
    /* nccl: the base of a stream-ordered step's budget (comm_watchdog.h),
     * to which each token adds its share; 0: timeout_ms when set, else 10 s */
    int step_base_ms;
} loom_comm_config_t;

/* A worker's data-plane listening socket, opened at start-up (before it knows
 * its peers) so its address can be announced when it registers. host is the
 * address to bind ("127.0.0.1", "0.0.0.0"); port 0 picks a free one.
 * loom_comm_listener_addr gives "tcp://host:port" as peers should dial it. */
loom_status_t loom_comm_listener_create(const char *host, int port, loom_comm_listener_t **out,
                                        loom_err_t *err);
const char *loom_comm_listener_addr(const loom_comm_listener_t *l);
int loom_comm_listener_fd(const loom_comm_listener_t *l); /* the listening socket (non-blocking) */
void loom_comm_listener_destroy(loom_comm_listener_t **l_p);

#define LOOM_COMM_ID_BYTES 128

/* Makes a group id for backends that need one from a single member (nccl:
 * ncclGetUniqueId). *len = 0 for backends that need none (shm, tcp). */
loom_status_t loom_comm_make_id(const char *backend, uint8_t id[LOOM_COMM_ID_BYTES], size_t *len,
                                loom_err_t *err);

/* Joins the groups: every member must call it (each from its own process);
 * returns when all links are up, or fails after timeout_ms (or 30 s when 0). */
loom_status_t loom_comm_create(const loom_comm_config_t *cfg, loom_comm_t **out, loom_err_t *err);
void loom_comm_destroy(loom_comm_t **c_p); /* safe on NULL and twice */

int loom_comm_tp_rank(const loom_comm_t *c);
int loom_comm_tp_size(const loom_comm_t *c);
const char *loom_comm_backend(const loom_comm_t *c);

/* Buffers of allreduce/send/recv are device memory of the worker's backend
 * (host memory for cpu workers); gather buffers are always host memory. */

/* Sum of n floats over the TP group, in place. Every rank gets bitwise the
 * same result (the sum is taken in rank order). */
loom_status_t loom_comm_allreduce(loom_comm_t *c, float *buf, int64_t n, loom_err_t *err);
/* Each rank contributes `bytes` bytes; TP rank 0 receives tp_size * bytes in
 * rank order into recv (other ranks pass recv = NULL). */
loom_status_t loom_comm_gather(loom_comm_t *c, const void *send, size_t bytes, void *recv,
                               loom_err_t *err);
loom_status_t loom_comm_barrier(loom_comm_t *c, loom_err_t *err);
/* Pipeline: messages arrive in the order they were sent. A send may return
 * before the receiver has taken the data (buffered, a few messages deep). */
loom_status_t loom_comm_send_next(loom_comm_t *c, const void *buf, size_t bytes, loom_err_t *err);
loom_status_t loom_comm_recv_prev(loom_comm_t *c, void *buf, size_t bytes, loom_err_t *err);

/* Stream-ordered steps (nccl; a no-op returning LOOM_OK elsewhere). Between
 * step_begin and step_end, allreduce only enqueues the collective on the
 * compute stream and returns: no host wait per all-reduce, so the model may
 * record them into its decode graphs (loom_comm_stream_ordered says whether
 * the backend can). Meanwhile a watchdog thread polls the device for an
 * asynchronous NCCL error, an abort (loom_comm_abort) or the step's
 * deadline, derived from its token count (worker/comm_watchdog.h), and on
 * any of them aborts the communicators, which also ends kernels stuck on a
 * dead peer. step_end waits (polling) for everything enqueued on the
 * compute stream and returns LOOM_ERR_UNAVAILABLE if the watchdog fired:
 * the step failed, as on the CPU grid. Call step_end after every
 * step_begin, also when the step failed in between. */
int loom_comm_stream_ordered(const loom_comm_t *c);
loom_status_t loom_comm_step_begin(loom_comm_t *c, int64_t tokens, loom_err_t *err);
loom_status_t loom_comm_step_end(loom_comm_t *c, loom_err_t *err);

/* Wakes every waiter of this comm with LOOM_ERR_UNAVAILABLE, now and for every
 * later call. Safe from any thread and from a signal-free context while
 * another thread is blocked in the comm. */
void loom_comm_abort(loom_comm_t *c);

/* Seconds this comm has spent inside its calls (waiting included; not
 * step_end's wait for the forward pass, so inside nccl steps only the
 * enqueueing of the all-reduces counts). */
double loom_comm_seconds(const loom_comm_t *c);

#endif
