/* The nccl comm backend: the data plane of GPU workers. One communicator for
 * the TP group (tp_size ranks, made from the id TP rank 0 created) and one
 * 2-rank communicator per pipeline link (the earlier stage is rank 0 and
 * made the id). Every operation is enqueued on the worker's compute stream
 * (cfg->cuda_stream, the backend's), so it is ordered with the kernels that
 * produce and consume its buffers:
 *   allreduce  ncclAllReduce(sum, float) in place on device memory;
 *   send_next  the hidden state is copied (on the compute stream) into a
 *              staging buffer and sent from there by ncclSend on a second,
 *              high-priority communication stream: the call returns once
 *              the copy is done, so this stage computes its next micro-batch
 *              while the next stage is still busy and has not taken the
 *              transfer; a later send first waits for the previous one;
 *   recv_prev  ncclRecv on the compute stream (the layers need it anyway);
 *   gather     host bytes -> device staging -> ncclSend/ncclRecv to rank 0
 *              inside one group -> host;
 *   barrier    an all-reduce of one float.
 * The communicators are non-blocking (ncclConfig_t.blocking = 0) and created
 * together in one group, so no creation order between workers can deadlock.
 *
 * Waiting: no call blocks inside CUDA or NCCL. After enqueueing, a call polls
 * cudaStreamQuery, and between polls checks the abort flag (set by
 * loom_comm_abort from any thread), ncclCommGetAsyncError on every
 * communicator, and the deadline (timeout_ms; none when 0). On abort, an
 * asynchronous NCCL error or a timeout the compute thread calls
 * ncclCommAbort on all communicators (which also ends kernels stuck on a
 * dead peer) and returns LOOM_ERR_UNAVAILABLE, then and on every later call.
 * The wait spins for the first SPIN_NS (a decode all-reduce takes tens of
 * microseconds), then sleeps POLL_SLEEP_NS between polls.
 *
 * Stream-ordered steps (loom_comm_step_begin .. step_end): the worker
 * brackets each step's forward pass, and inside the bracket allreduce only
 * enqueues (no wait per all-reduce), so model.c records decode steps with
 * TP into CUDA graphs too (NCCL collectives are captured since 2.9; the
 * backend captures in relaxed mode). While a step is in flight a watchdog
 * thread, one per comm, polls every WATCH_POLL_NS: the abort flag and
 * ncclCommGetAsyncError of every communicator, and the step's deadline
 * (comm_watchdog.h: a base plus a per-token share); on any of them it
 * aborts the communicators, which ends a kernel or graph stuck on a dead
 * peer, so the compute thread never hangs even when it is blocked in a CUDA
 * call outside this file. step_end then waits (polling, as above, with the
 * same checks and deadline) for the compute stream and reports the failure.
 * Locking: `mu` guards the communicators, the failure state and the
 * watchdog; every operation holds it for its whole run (its own waits poll
 * the same conditions), so the watchdog thread acts only while the compute
 * thread is outside this file: in a kernel launch, a graph launch, or a
 * blocking copy waiting for the stream.
 * Captured collectives are a collective property in NCCL: every TP rank
 * records the same decode shapes at the same step (the keys come from the
 * plan, the graph cache evicts the same way), which keeps it so.
 * The all-reduce result is identical on every rank (NCCL's algorithms
 * reduce each element once and broadcast it), but its summation order is
 * NCCL's, not rank order as in the shm and tcp backends. */
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/comm_impl.h"
#include "worker/comm_util.h"
#include "worker/comm_watchdog.h"

#define NCCL_CREATE_DEFAULT_MS 30000
#define DESTROY_DRAIN_MS       2000
#define SPIN_NS                200000ull /* busy-poll this long before sleeping */
#define POLL_SLEEP_NS          20000L
#define WATCH_POLL_NS          1000000L /* the watchdog thread's period while a step is in flight */

_Static_assert(sizeof(ncclUniqueId) == LOOM_COMM_ID_BYTES, "ncclUniqueId size");

typedef struct nccl_comm {
    struct loom_comm base;
    int dev;
    cudaStream_t stream;
    int own_stream;
    ncclComm_t comms[3]; /* TP, previous link, next link; NULL when absent */
    atomic_int aborted;  /* loom_comm_abort, any thread */
    int dead;            /* communicators aborted (compute thread) */
    char why[256];       /* first failure, repeated by later calls */
    int timeout_ms;
    uint8_t *d_send, *d_recv; /* gather staging: max_bytes, and tp_size x max_bytes on rank 0 */
    cudaStream_t comm_stream; /* sends to the next stage */
    cudaEvent_t staged;       /* on the compute stream: d_stage holds the state to send */
    cudaEvent_t sent;         /* on comm_stream: the last send is done, d_stage is free */
    uint8_t *d_stage;         /* send_next staging (max_bytes) */
    float *d_one;             /* barrier */
    /* stream-ordered steps and their watchdog (see the top of the file) */
    pthread_mutex_t mu; /* guards comms, dead, why, ordered, wd, quit */
    pthread_cond_t cv;  /* a step was armed, or quit */
    pthread_t watch;
    int watch_started, quit;
    int ordered;             /* inside step_begin .. step_end: allreduce only enqueues */
    loom_watchdog_t wd;      /* ARMED while a step is in flight */
    loom_wd_limits_t lim;    /* the steps' budgets */
    cudaEvent_t step_done;   /* on the compute stream at step_end */
} nccl_comm_t;

enum { C_TP = 0, C_PREV = 1, C_NEXT = 2 };
static const char *const k_comm_names[3] = {"TP group", "link to the previous stage", "link to the next stage"};

static nccl_comm_t *nc(loom_comm_t *c) {
    return (nccl_comm_t *)c;
}

static void abort_comms(nccl_comm_t *c) {
    for (int i = 0; i < 3; i++)
        if (c->comms[i]) {
            (void)ncclCommAbort(c->comms[i]);
            c->comms[i] = NULL;
        }
    c->dead = 1;
}

/* Aborts the communicators and reports UNAVAILABLE with the reason. */
__attribute__((format(printf, 3, 4))) static loom_status_t fail(nccl_comm_t *c, loom_err_t *err, const char *fmt,
                                                                ...) {
    if (!c->dead) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->why, sizeof c->why, fmt, ap);
        va_end(ap);
        LOOM_WARN("nccl comm: %s; aborting the communicators", c->why);
        abort_comms(c);
    }
    return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "nccl comm: %s", c->why);
}

/* A failed CUDA call (CUDA_CHECK, kernels/cuda/cuda_check.h) aborts the
 * communicators like a failed NCCL call: every function that checks one
 * holds its communicator in `c`. */
#define CUDA_ON_ERROR(err, what, e, file, line)                                                    \
    fail(c, (err), "%s failed at %s:%d: %s", (what), (file), (line), cudaGetErrorString(e))
#include "kernels/cuda/cuda_check.h"

/* ncclInProgress is not an error for non-blocking communicators: the caller
 * then waits for the communicator with wait_ready. */
#define NCCL_CHECK(c, err, call)                                                                   \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess && r_ != ncclInProgress)                                             \
            return fail((c), (err), "%s failed at %s:%d: %s", #call, __FILE__, __LINE__,           \
                        ncclGetErrorString(r_));                                                   \
    } while (0)

static loom_status_t check_alive(nccl_comm_t *c, loom_err_t *err) {
    if (atomic_load(&c->aborted) && !c->dead) return fail(c, err, "aborted");
    if (c->dead) return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "nccl comm: %s", c->why);
    return LOOM_OK;
}

static void pause_poll(uint64_t t0) {
    if (loom_now_ns() - t0 < SPIN_NS) {
        loom_comm_cpu_relax();
        return;
    }
    struct timespec ts = {0, POLL_SLEEP_NS};
    nanosleep(&ts, NULL);
}

/* The reason to stop waiting, if any: abort, an asynchronous NCCL error, or
 * the deadline (ncclInProgress is not an error: a call still enqueueing). */
static loom_status_t poll_health(nccl_comm_t *c, const char *what, uint64_t deadline, loom_err_t *err) {
    if (atomic_load(&c->aborted)) return fail(c, err, "aborted during %s", what);
    for (int i = 0; i < 3; i++) {
        if (!c->comms[i]) continue;
        ncclResult_t st = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(c->comms[i], &st);
        if (r != ncclSuccess) return fail(c, err, "%s: ncclCommGetAsyncError: %s", what, ncclGetErrorString(r));
        if (st != ncclSuccess && st != ncclInProgress)
            return fail(c, err, "%s on the %s: %s (%s)", what, k_comm_names[i], ncclGetErrorString(st),
                        ncclGetLastError(c->comms[i]));
    }
    if (loom_comm_expired(deadline)) return fail(c, err, "timed out during %s", what);
    if (loom_watchdog_check(&c->wd, loom_now_ns(), NULL, NULL) == LOOM_WD_FIRED)
        return fail(c, err, "%s during %s", c->wd.why, what);
    return LOOM_OK;
}

/* Non-blocking communicators: wait until `comm` has finished enqueueing
 * (creation, or a call that returned ncclInProgress). */
static loom_status_t wait_ready(nccl_comm_t *c, int which, const char *what, uint64_t deadline, loom_err_t *err) {
    uint64_t t0 = loom_now_ns();
    for (;;) {
        ncclResult_t st = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(c->comms[which], &st);
        if (r != ncclSuccess) return fail(c, err, "%s: ncclCommGetAsyncError: %s", what, ncclGetErrorString(r));
        if (st == ncclSuccess) return LOOM_OK;
        if (st != ncclInProgress)
            return fail(c, err, "%s on the %s: %s (%s)", what, k_comm_names[which], ncclGetErrorString(st),
                        ncclGetLastError(c->comms[which]));
        LOOM_CHECK(poll_health(c, what, deadline, err));
        pause_poll(t0);
    }
}

static loom_status_t wait_all_ready(nccl_comm_t *c, const char *what, uint64_t deadline, loom_err_t *err) {
    for (int i = 0; i < 3; i++)
        if (c->comms[i]) LOOM_CHECK(wait_ready(c, i, what, deadline, err));
    return LOOM_OK;
}

static int capturing(nccl_comm_t *c) {
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(c->stream, &cs) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return cs == cudaStreamCaptureStatusActive;
}

/* Waits until the work before `ev` (recorded on any stream) has run, or
 * with ev NULL everything enqueued on the compute stream. */
static loom_status_t wait_done(nccl_comm_t *c, cudaEvent_t ev, const char *what, loom_err_t *err) {
    const uint64_t t0 = loom_now_ns(), deadline = loom_comm_deadline(c->timeout_ms);
    for (;;) {
        cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(c->stream);
        if (e == cudaSuccess) return LOOM_OK;
        if (e != cudaErrorNotReady)
            return fail(c, err, "CUDA error while waiting for %s: %s", what, cudaGetErrorString(e));
        LOOM_CHECK(poll_health(c, what, deadline, err));
        pause_poll(t0);
    }
}

static loom_status_t wait_stream(nccl_comm_t *c, const char *what, loom_err_t *err) {
    return wait_done(c, NULL, what, err);
}

/* --- operations --------------------------------------------------------------------- */

static loom_status_t nccl_allreduce_locked(loom_comm_t *base, float *buf, int64_t n, loom_err_t *err) {
    nccl_comm_t *c = nc(base);
    LOOM_CHECK(check_alive(c, err));
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    ncclResult_t r = ncclAllReduce(buf, buf, (size_t)n, ncclFloat32, ncclSum, c->comms[C_TP], c->stream);
    NCCL_CHECK(c, err, r);
    if (r == ncclInProgress) LOOM_CHECK(wait_ready(c, C_TP, "all-reduce", loom_comm_deadline(c->timeout_ms), err));
    if (c->ordered || capturing(c)) return LOOM_OK; /* step_end waits, the watchdog watches */
    return wait_stream(c, "all-reduce", err);
}

static loom_status_t nccl_gather_locked(loom_comm_t *base, const void *send, size_t bytes, void *recv, loom_err_t *err) {
    nccl_comm_t *c = nc(base);
    LOOM_CHECK(check_alive(c, err));
    if (bytes == 0) return LOOM_OK;
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    const int rank = base->tp_rank, size = base->tp_size;
    /* Drain first: copies from pageable memory may wait for the stream, and
     * nothing may wait on it without polling. */
    LOOM_CHECK(wait_stream(c, "gather", err));
    if (rank != 0) CUDA_CHECK(err, cudaMemcpyAsync(c->d_send, send, bytes, cudaMemcpyHostToDevice, c->stream));
    NCCL_CHECK(c, err, ncclGroupStart());
    if (rank == 0) {
        for (int r = 1; r < size; r++)
            NCCL_CHECK(c, err, ncclRecv(c->d_recv + (size_t)r * bytes, bytes, ncclUint8, r, c->comms[C_TP], c->stream));
    } else {
        NCCL_CHECK(c, err, ncclSend(c->d_send, bytes, ncclUint8, 0, c->comms[C_TP], c->stream));
    }
    ncclResult_t r = ncclGroupEnd();
    NCCL_CHECK(c, err, r);
    if (r == ncclInProgress) LOOM_CHECK(wait_ready(c, C_TP, "gather", loom_comm_deadline(c->timeout_ms), err));
    LOOM_CHECK(wait_stream(c, "gather", err));
    if (rank == 0) {
        memcpy(recv, send, bytes);
        CUDA_CHECK(err, cudaMemcpyAsync((uint8_t *)recv + bytes, c->d_recv + bytes, (size_t)(size - 1) * bytes,
                                           cudaMemcpyDeviceToHost, c->stream));
        LOOM_CHECK(wait_stream(c, "gather", err));
    }
    return LOOM_OK;
}

static loom_status_t nccl_send_next_locked(loom_comm_t *base, const void *buf, size_t bytes, loom_err_t *err) {
    nccl_comm_t *c = nc(base);
    LOOM_CHECK(check_alive(c, err));
    if (!c->comms[C_NEXT])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "nccl comm: send_next on the last stage");
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    /* (loom_comm_send_next checked bytes <= max_bytes) the staging buffer is free once the previous send has gone */
    LOOM_CHECK(wait_done(c, c->sent, "the previous send to the next stage", err));
    CUDA_CHECK(err, cudaMemcpyAsync(c->d_stage, buf, bytes, cudaMemcpyDeviceToDevice, c->stream));
    CUDA_CHECK(err, cudaEventRecord(c->staged, c->stream));
    CUDA_CHECK(err, cudaStreamWaitEvent(c->comm_stream, c->staged, 0));
    ncclResult_t r = ncclSend(c->d_stage, bytes, ncclUint8, 1, c->comms[C_NEXT], c->comm_stream);
    NCCL_CHECK(c, err, r);
    if (r == ncclInProgress) LOOM_CHECK(wait_ready(c, C_NEXT, "send", loom_comm_deadline(c->timeout_ms), err));
    CUDA_CHECK(err, cudaEventRecord(c->sent, c->comm_stream));
    /* the caller may overwrite buf once the copy has run; the send goes on */
    return wait_stream(c, "staging the send to the next stage", err);
}

static loom_status_t nccl_recv_prev_locked(loom_comm_t *base, void *buf, size_t bytes, loom_err_t *err) {
    nccl_comm_t *c = nc(base);
    LOOM_CHECK(check_alive(c, err));
    if (!c->comms[C_PREV])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "nccl comm: recv_prev on the first stage");
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    ncclResult_t r = ncclRecv(buf, bytes, ncclUint8, 0, c->comms[C_PREV], c->stream);
    NCCL_CHECK(c, err, r);
    if (r == ncclInProgress) LOOM_CHECK(wait_ready(c, C_PREV, "receive", loom_comm_deadline(c->timeout_ms), err));
    return wait_stream(c, "receive from the previous stage", err);
}

/* --- stream-ordered steps and the watchdog ---------------------------------------------- */

/* The watchdog's probe: the abort flag and the communicators' asynchronous
 * errors; with `ev`, also whether the step's work is done. */
static loom_wd_probe_t probe_device(nccl_comm_t *c, cudaEvent_t ev, char *why, size_t cap) {
    if (atomic_load(&c->aborted)) {
        snprintf(why, cap, "aborted");
        return LOOM_WD_PROBE_FAILED;
    }
    for (int i = 0; i < 3; i++) {
        if (!c->comms[i]) continue;
        ncclResult_t st = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(c->comms[i], &st);
        if (r != ncclSuccess) {
            snprintf(why, cap, "ncclCommGetAsyncError: %s", ncclGetErrorString(r));
            return LOOM_WD_PROBE_FAILED;
        }
        if (st != ncclSuccess && st != ncclInProgress) {
            snprintf(why, cap, "the %s failed: %s (%s)", k_comm_names[i], ncclGetErrorString(st),
                     ncclGetLastError(c->comms[i]));
            return LOOM_WD_PROBE_FAILED;
        }
    }
    if (!ev) return LOOM_WD_PROBE_RUNNING;
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return LOOM_WD_PROBE_DONE;
    if (e == cudaErrorNotReady) return LOOM_WD_PROBE_RUNNING;
    snprintf(why, cap, "CUDA error while the step ran: %s", cudaGetErrorString(e));
    return LOOM_WD_PROBE_FAILED;
}

static loom_wd_probe_t probe_running(void *ctx, char *why, size_t cap) {
    return probe_device(ctx, NULL, why, cap);
}

static loom_wd_probe_t probe_step_done(void *ctx, char *why, size_t cap) {
    nccl_comm_t *c = ctx;
    return probe_device(c, c->step_done, why, cap);
}

/* The watchdog thread: sleeps until a step is armed, then polls until the
 * step ends or the watchdog fires, and on firing aborts the communicators
 * (under mu: never while the compute thread is inside this file). */
static void *watch_main(void *arg) {
    nccl_comm_t *c = arg;
    if (cudaSetDevice(c->dev) != cudaSuccess) (void)cudaGetLastError();
    pthread_mutex_lock(&c->mu);
    while (!c->quit) {
        if (c->wd.state != LOOM_WD_ARMED || c->dead) {
            pthread_cond_wait(&c->cv, &c->mu);
            continue;
        }
        if (loom_watchdog_check(&c->wd, loom_now_ns(), probe_running, c) == LOOM_WD_FIRED)
            (void)fail(c, NULL, "watchdog: %s", c->wd.why);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += WATCH_POLL_NS;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static loom_status_t step_begin_locked(nccl_comm_t *c, int64_t tokens, loom_err_t *err) {
    LOOM_CHECK(check_alive(c, err));
    c->ordered = 1;
    loom_watchdog_arm(&c->wd, loom_now_ns(), loom_watchdog_budget_ms(&c->lim, tokens));
    pthread_cond_signal(&c->cv);
    return LOOM_OK;
}

static loom_status_t step_end_locked(nccl_comm_t *c, loom_err_t *err) {
    if (!c->ordered) return check_alive(c, err);
    c->ordered = 0;
    LOOM_CHECK(check_alive(c, err));
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    CUDA_CHECK(err, cudaEventRecord(c->step_done, c->stream));
    const uint64_t t0 = loom_now_ns();
    for (;;) {
        loom_wd_state_t st = loom_watchdog_check(&c->wd, loom_now_ns(), probe_step_done, c);
        if (st == LOOM_WD_FIRED) return fail(c, err, "watchdog: %s", c->wd.why);
        if (st == LOOM_WD_IDLE) return LOOM_OK;
        pause_poll(t0);
    }
}

/* --- the locked entry points ------------------------------------------------------------ */

#define LOCKED(c, call)                                                                            \
    do {                                                                                           \
        pthread_mutex_lock(&(c)->mu);                                                              \
        loom_status_t s_ = (call);                                                                 \
        pthread_mutex_unlock(&(c)->mu);                                                            \
        return s_;                                                                                 \
    } while (0)

static loom_status_t nccl_allreduce(loom_comm_t *base, float *buf, int64_t n, loom_err_t *err) {
    LOCKED(nc(base), nccl_allreduce_locked(base, buf, n, err));
}

static loom_status_t nccl_gather(loom_comm_t *base, const void *send, size_t bytes, void *recv, loom_err_t *err) {
    LOCKED(nc(base), nccl_gather_locked(base, send, bytes, recv, err));
}

static loom_status_t nccl_barrier(loom_comm_t *base, loom_err_t *err) {
    LOCKED(nc(base), nccl_allreduce_locked(base, nc(base)->d_one, 1, err));
}

static loom_status_t nccl_send_next(loom_comm_t *base, const void *buf, size_t bytes, loom_err_t *err) {
    LOCKED(nc(base), nccl_send_next_locked(base, buf, bytes, err));
}

static loom_status_t nccl_recv_prev(loom_comm_t *base, void *buf, size_t bytes, loom_err_t *err) {
    LOCKED(nc(base), nccl_recv_prev_locked(base, buf, bytes, err));
}

static loom_status_t nccl_step_begin(loom_comm_t *base, int64_t tokens, loom_err_t *err) {
    LOCKED(nc(base), step_begin_locked(nc(base), tokens, err));
}

static loom_status_t nccl_step_end(loom_comm_t *base, loom_err_t *err) {
    nccl_comm_t *c = nc(base);
    pthread_mutex_lock(&c->mu);
    loom_status_t s = step_end_locked(c, err);
    loom_watchdog_disarm(&c->wd); /* FIRED stays FIRED */
    pthread_mutex_unlock(&c->mu);
    return s;
}

static void nccl_abort(loom_comm_t *base) {
    atomic_store(&nc(base)->aborted, 1);
}

static void nccl_destroy(loom_comm_t *base) {
    nccl_comm_t *c = nc(base);
    if (c->watch_started) {
        pthread_mutex_lock(&c->mu);
        c->quit = 1;
        pthread_cond_signal(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->watch, NULL);
    }
    if (cudaSetDevice(c->dev) != cudaSuccess) (void)cudaGetLastError();
    if (!c->dead) { /* let finished work drain, briefly; a stuck op is aborted below */
        uint64_t deadline = loom_comm_deadline(DESTROY_DRAIN_MS), t0 = loom_now_ns();
        while (((c->stream && cudaStreamQuery(c->stream) == cudaErrorNotReady) ||
                (c->comm_stream && cudaStreamQuery(c->comm_stream) == cudaErrorNotReady)) &&
               !loom_comm_expired(deadline))
            pause_poll(t0);
    }
    /* Abort rather than finalize: it never waits for peers, which may be gone. */
    abort_comms(c);
    if (c->step_done) (void)cudaEventDestroy(c->step_done);
    if (c->staged) (void)cudaEventDestroy(c->staged);
    if (c->sent) (void)cudaEventDestroy(c->sent);
    if (c->comm_stream) (void)cudaStreamDestroy(c->comm_stream);
    if (c->d_stage) (void)cudaFree(c->d_stage);
    if (c->d_send) (void)cudaFree(c->d_send);
    if (c->d_recv) (void)cudaFree(c->d_recv);
    if (c->d_one) (void)cudaFree(c->d_one);
    if (c->own_stream && c->stream) (void)cudaStreamDestroy(c->stream);
    (void)cudaGetLastError();
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static const loom_comm_ops_t nccl_ops = {
    .name = "nccl",
    .destroy = nccl_destroy,
    .allreduce = nccl_allreduce,
    .gather = nccl_gather,
    .barrier = nccl_barrier,
    .send_next = nccl_send_next,
    .recv_prev = nccl_recv_prev,
    .abort = nccl_abort,
    .step_begin = nccl_step_begin,
    .step_end = nccl_step_end,
};

loom_status_t loom_comm_nccl_make_id(uint8_t id[LOOM_COMM_ID_BYTES], size_t *len, loom_err_t *err) {
    *len = 0;
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess)
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "nccl: ncclGetUniqueId: %s", ncclGetErrorString(r));
    memcpy(id, &u, sizeof u);
    *len = sizeof u;
    return LOOM_OK;
}

/* Starts the communicators of this worker in one group (non-blocking). */
static loom_status_t init_comms(nccl_comm_t *c, const loom_comm_config_t *cfg, loom_err_t *err) {
    ncclConfig_t conf = NCCL_CONFIG_INITIALIZER;
    conf.blocking = 0;
    conf.commName = cfg->name;
    ncclUniqueId id;
    NCCL_CHECK(c, err, ncclGroupStart());
    if (cfg->tp_size > 1) {
        memcpy(&id, cfg->tp_group_id, sizeof id);
        NCCL_CHECK(c, err, ncclCommInitRankConfig(&c->comms[C_TP], cfg->tp_size, id, cfg->tp_rank, &conf));
    }
    if (cfg->prev) {
        memcpy(&id, cfg->prev_group_id, sizeof id);
        NCCL_CHECK(c, err, ncclCommInitRankConfig(&c->comms[C_PREV], 2, id, 1, &conf));
    }
    if (cfg->next) {
        memcpy(&id, cfg->next_group_id, sizeof id);
        NCCL_CHECK(c, err, ncclCommInitRankConfig(&c->comms[C_NEXT], 2, id, 0, &conf));
    }
    NCCL_CHECK(c, err, ncclGroupEnd());
    int ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : NCCL_CREATE_DEFAULT_MS;
    return wait_all_ready(c, "joining", loom_comm_deadline(ms), err);
}

loom_status_t loom_comm_nccl_create(const loom_comm_config_t *cfg, loom_comm_t **out, loom_err_t *err) {
    *out = NULL;
    if (cfg->tp_size > 1 && !cfg->tp_group_id)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "nccl comm: tp_size %d but no TP group id", cfg->tp_size);
    if ((cfg->prev && !cfg->prev_group_id) || (cfg->next && !cfg->next_group_id))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "nccl comm: a pipeline link has no id");
    nccl_comm_t *c = loom_xcalloc(1, sizeof *c);
    loom_comm_base_init(&c->base, &nccl_ops, cfg);
    atomic_init(&c->aborted, 0);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    loom_watchdog_init(&c->wd);
    /* a step's base budget: step_base_ms, else the comm's timeout when set */
    c->lim = (loom_wd_limits_t){.base_ms = cfg->step_base_ms > 0 ? cfg->step_base_ms
                                           : cfg->timeout_ms > 0 ? cfg->timeout_ms
                                                                 : LOOM_WD_BASE_MS_DEFAULT,
                                .us_per_token = LOOM_WD_US_PER_TOKEN_DEFAULT};
    c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 0;
    c->dev = cfg->cuda_device;
    c->stream = cfg->cuda_stream;
    loom_status_t s = LOOM_OK;
    cudaError_t e = cudaSetDevice(c->dev);
    if (e == cudaSuccess && !c->stream) {
        e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
        c->own_stream = e == cudaSuccess;
    }
    size_t mb = cfg->max_bytes ? cfg->max_bytes : 1;
    if (e == cudaSuccess && cfg->tp_size > 1) {
        e = cudaMalloc((void **)&c->d_send, mb);
        if (e == cudaSuccess && cfg->tp_rank == 0) e = cudaMalloc((void **)&c->d_recv, mb * (size_t)cfg->tp_size);
    }
    if (e == cudaSuccess && cfg->next) {
        int lo = 0, hi = 0; /* numerically lower is higher priority */
        e = cudaDeviceGetStreamPriorityRange(&lo, &hi);
        if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&c->comm_stream, cudaStreamNonBlocking, hi);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->staged, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->sent, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaMalloc((void **)&c->d_stage, mb);
    }
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->step_done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaMalloc((void **)&c->d_one, sizeof(float));
    if (e == cudaSuccess) e = cudaMemsetAsync(c->d_one, 0, sizeof(float), c->stream);
    if (e != cudaSuccess) {
        s = loom_err_set(err, e == cudaErrorMemoryAllocation ? LOOM_ERR_NOMEM : LOOM_ERR_UNAVAILABLE,
                         "nccl comm on cuda:%d: %s", c->dev, cudaGetErrorString(e));
        (void)cudaGetLastError();
        goto fail;
    }
    if ((s = init_comms(c, cfg, err)) < 0) goto fail;
    if (pthread_create(&c->watch, NULL, watch_main, c) != 0) {
        s = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "nccl comm: cannot start the watchdog thread");
        goto fail;
    }
    c->watch_started = 1;
    LOOM_INFO("nccl comm up on cuda:%d: tp rank %d/%d%s%s", c->dev, cfg->tp_rank, cfg->tp_size,
              cfg->prev ? ", previous stage" : "", cfg->next ? ", next stage" : "");
    *out = &c->base;
    return LOOM_OK;
fail:
    nccl_destroy(&c->base);
    return s;
}
