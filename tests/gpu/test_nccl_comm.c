/* The NCCL data plane on real GPUs: two worker processes, one per GPU, each
 * with a CUDA backend and an nccl comm on its stream, as loom-worker does.
 * Checks the all-reduce (device buffers), barrier, gather (host buffers),
 * ordered send/recv between pipeline neighbours, and that an abort (from
 * another thread) or a silent peer ends a wait with LOOM_ERR_UNAVAILABLE
 * instead of a hang. Stream-ordered steps (loom_comm_step_begin/end): an
 * all-reduce recorded into a CUDA graph by the backend and replayed with new
 * data, and the watchdog: a peer that never joins the collective while the
 * compute thread is blocked in a CUDA copy behind it -> the watchdog thread
 * aborts within the step's budget, the copy returns and step_end reports
 * LOOM_ERR_UNAVAILABLE. Needs 2 GPUs (NCCL refuses two ranks on one
 * device): with one, only the single-process case runs (an abort inside a
 * step with no peers), then it prints "skipped: needs 2 GPUs" and exits 77.
 *
 * The parent never touches CUDA (a forked child could not use it then); it
 * counts GPUs in a probe child, and relays the ids rank 0 makes. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cuda/backend_cuda.h"
#include "worker/comm.h"

#define SKIP_CODE 77
#define N_IDS     5 /* TP group, pipeline link, TP groups for the abort, graph and watchdog cases */
#define WATCH_MS  1000 /* the watchdog case's step_base_ms: its steps' base budget */
#define NF        100003

static int fail(int rank, const char *what, const loom_err_t *err) {
    fprintf(stderr, "rank %d: FAIL %s%s%s\n", rank, what, err ? ": " : "", err ? err->msg : "");
    return 1;
}

static loom_comm_t *join(int rank, loom_backend_t *be, const uint8_t *tp_id, const uint8_t *prev_id,
                         const uint8_t *next_id, int tp_size, int timeout_ms, int step_base_ms,
                         loom_err_t *err) {
    loom_comm_peer_t self = {.worker_id = rank ? "w1" : "w0", .data_addr = ""};
    loom_comm_peer_t group[2] = {{"w0", ""}, {"w1", ""}};
    loom_comm_config_t cc = {.version = LOOM_COMM_CONFIG_VERSION, .backend = "nccl", .name = "nccl-test",
                             .self_id = self.worker_id, .tp_rank = tp_size > 1 ? rank : 0, .tp_size = tp_size,
                             .tp_group = tp_size > 1 ? group : &self, .prev = prev_id ? &group[0] : NULL,
                             .next = next_id ? &group[1] : NULL, .max_bytes = (size_t)NF * 4,
                             .timeout_ms = timeout_ms, .tp_group_id = tp_id, .prev_group_id = prev_id,
                             .next_group_id = next_id, .cuda_device = loom_backend_device_index(be),
                             .cuda_stream = loom_backend_stream(be), .step_base_ms = step_base_ms};
    loom_comm_t *c = NULL;
    return loom_comm_create(&cc, &c, err) < 0 ? NULL : c;
}

static void *abort_later(void *p) {
    struct timespec ts = {0, 500 * 1000 * 1000};
    nanosleep(&ts, NULL);
    loom_comm_abort(p);
    return NULL;
}

static int run_rank(int rank, uint8_t ids[N_IDS][LOOM_COMM_ID_BYTES]) {
    loom_err_t err = {0};
    loom_backend_t *be = NULL;
    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CUDA,
                                .device_index = rank, .weight_dtype = LOOM_DT_BF16};
    if (loom_backend_create(&bc, &be, &err) < 0) return fail(rank, "backend", &err);
    float *h = loom_xmalloc((size_t)NF * 4), *back = loom_xmalloc((size_t)NF * 4);
    float *d = loom_backend_alloc(be, (size_t)NF * 4);
    if (!d) return fail(rank, "alloc", NULL);

    /* TP group: all-reduce, barrier, gather */
    loom_comm_t *tp = join(rank, be, ids[0], NULL, NULL, 2, 20000, 0, &err);
    if (!tp) return fail(rank, "join the TP group", &err);
    for (int i = 0; i < NF; i++) h[i] = (float)(rank + 1) + (float)(i % 1000) * 0.25f;
    loom_backend_upload(be, d, h, (size_t)NF * 4);
    if (loom_comm_allreduce(tp, d, NF, &err) < 0) return fail(rank, "all-reduce", &err);
    loom_backend_download(be, back, d, (size_t)NF * 4);
    for (int i = 0; i < NF; i++)
        if (back[i] != 3.0f + (float)(i % 1000) * 0.5f) {
            fprintf(stderr, "rank %d: all-reduce [%d] = %g\n", rank, i, (double)back[i]);
            return fail(rank, "all-reduce value", NULL);
        }
    if (loom_comm_barrier(tp, &err) < 0) return fail(rank, "barrier", &err);
    char part[4096], all[2 * 4096];
    for (size_t i = 0; i < sizeof part; i++) part[i] = (char)(i * 7 + (size_t)rank * 3);
    if (loom_comm_gather(tp, part, sizeof part, rank == 0 ? all : NULL, &err) < 0) return fail(rank, "gather", &err);
    if (rank == 0)
        for (size_t i = 0; i < sizeof all; i++)
            if (all[i] != (char)((i % 4096) * 7 + (i / 4096) * 3)) return fail(rank, "gather bytes", NULL);
    loom_comm_destroy(&tp);

    /* pipeline: rank 0 -> rank 1, three messages in order */
    loom_comm_t *pp = join(rank, be, NULL, rank == 1 ? ids[1] : NULL, rank == 0 ? ids[1] : NULL, 1, 20000, 0, &err);
    if (!pp) return fail(rank, "join the pipeline link", &err);
    for (int m = 0; m < 3; m++) {
        if (rank == 0) {
            for (int i = 0; i < NF; i++) h[i] = (float)(m * NF + i);
            loom_backend_upload(be, d, h, (size_t)NF * 4);
            if (loom_comm_send_next(pp, d, (size_t)NF * 4, &err) < 0) return fail(rank, "send", &err);
        } else {
            loom_backend_memset(be, d, 0xff, (size_t)NF * 4);
            if (loom_comm_recv_prev(pp, d, (size_t)NF * 4, &err) < 0) return fail(rank, "recv", &err);
            loom_backend_download(be, back, d, (size_t)NF * 4);
            for (int i = 0; i < NF; i++)
                if (back[i] != (float)(m * NF + i)) return fail(rank, "message order or content", NULL);
        }
    }
    loom_comm_destroy(&pp);

    /* abort: rank 1 joins and then stays silent; rank 0's all-reduce must end
     * with UNAVAILABLE once another thread aborts the comm */
    loom_comm_t *ab = join(rank, be, ids[2], NULL, NULL, 2, 0, 0, &err);
    if (!ab) return fail(rank, "join the second TP group", &err);
    if (rank == 0) {
        pthread_t th;
        pthread_create(&th, NULL, abort_later, ab);
        uint64_t t0 = loom_now_ns();
        loom_status_t s = loom_comm_allreduce(ab, d, NF, &err);
        double ms = (double)(loom_now_ns() - t0) * 1e-6;
        pthread_join(th, NULL);
        if (s != LOOM_ERR_UNAVAILABLE || ms > 5000) {
            fprintf(stderr, "rank 0: abort gave %s after %.0f ms\n", loom_status_str(s), ms);
            return fail(rank, "abort", NULL);
        }
        if (loom_comm_allreduce(ab, d, NF, &err) != LOOM_ERR_UNAVAILABLE) return fail(rank, "after abort", NULL);
    } else {
        sleep(2);
    }
    loom_comm_destroy(&ab);

    /* graph: a stream-ordered all-reduce recorded into a decode-style graph
     * (graph_begin/graph_end of the backend), then replayed on new data */
    loom_comm_t *gc = join(rank, be, ids[3], NULL, NULL, 2, 20000, 0, &err);
    if (!gc) return fail(rank, "join the graph TP group", &err);
    if (!loom_comm_stream_ordered(gc)) return fail(rank, "nccl steps are not stream-ordered", NULL);
    uint64_t rec0 = 0, rep0 = 0, rec1 = 0, rep1 = 0;
    loom_cuda_graph_stats(be, &rec0, &rep0);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < NF; i++) h[i] = (float)((rank + 1) * (round + 1)) + (float)(i % 100);
        loom_backend_upload(be, d, h, (size_t)NF * 4);
        if (loom_comm_step_begin(gc, 1, &err) < 0) return fail(rank, "graph step_begin", &err);
        loom_status_t s = LOOM_OK;
        int replay = loom_backend_graph_begin(be, 0x5eed);
        if (!replay) s = loom_comm_allreduce(gc, d, NF, &err);
        if (loom_backend_graph_end(be, 0x5eed)) return fail(rank, "recording the all-reduce graph", NULL);
        if (s < 0) return fail(rank, "captured all-reduce", &err);
        if (loom_comm_step_end(gc, &err) < 0) return fail(rank, "graph step_end", &err);
        loom_backend_download(be, back, d, (size_t)NF * 4);
        for (int i = 0; i < NF; i++)
            if (back[i] != (float)(3 * (round + 1)) + 2.0f * (float)(i % 100)) {
                fprintf(stderr, "rank %d: graph round %d [%d] = %g\n", rank, round, i, (double)back[i]);
                return fail(rank, "graph all-reduce value", NULL);
            }
    }
    loom_cuda_graph_stats(be, &rec1, &rep1);
    if (rec1 - rec0 != 1 || rep1 - rep0 != 2) {
        fprintf(stderr, "rank %d: graphs recorded %llu, replayed %llu (want 1, 2)\n", rank,
                (unsigned long long)(rec1 - rec0), (unsigned long long)(rep1 - rep0));
        return fail(rank, "graph reuse", NULL);
    }
    loom_backend_graph_drop(be); /* as the worker does before its comm goes: the graph holds its collectives */
    loom_comm_destroy(&gc);

    /* watchdog: rank 1 joins and never enters the collective; rank 0 enqueues
     * it stream-ordered and blocks in a copy behind it. The watchdog must
     * abort within the budget (WATCH_MS + a token's share), which ends the
     * stuck kernel and the copy; step_end then fails the step. */
    loom_comm_t *wc = join(rank, be, ids[4], NULL, NULL, 2, 20000, WATCH_MS, &err);
    if (!wc) return fail(rank, "join the watchdog TP group", &err);
    if (rank == 0) {
        uint64_t t0 = loom_now_ns();
        if (loom_comm_step_begin(wc, 1, &err) < 0) return fail(rank, "watchdog step_begin", &err);
        if (loom_comm_allreduce(wc, d, NF, &err) < 0) return fail(rank, "stream-ordered all-reduce", &err);
        loom_backend_download(be, back, d, (size_t)NF * 4); /* blocks until the watchdog aborts */
        double blocked_ms = (double)(loom_now_ns() - t0) * 1e-6;
        loom_status_t s = loom_comm_step_end(wc, &err);
        double ms = (double)(loom_now_ns() - t0) * 1e-6;
        fprintf(stderr, "rank 0: watchdog: copy returned after %.0f ms, step_end %s after %.0f ms (%s)\n",
                blocked_ms, loom_status_str(s), ms, err.msg);
        if (s != LOOM_ERR_UNAVAILABLE || ms < WATCH_MS * 0.9 || ms > WATCH_MS + 3000)
            return fail(rank, "watchdog", NULL);
        if (loom_comm_step_begin(wc, 1, &err) != LOOM_ERR_UNAVAILABLE) return fail(rank, "after the watchdog", NULL);
    } else {
        sleep(WATCH_MS / 1000 + 4);
    }
    loom_comm_destroy(&wc);
    loom_backend_free(be, d);
    loom_backend_destroy(&be);
    free(h), free(back);
    fprintf(stderr, "rank %d: ok\n", rank);
    return 0;
}

/* One GPU: a comm without peers (tp_size 1, no links) still brackets steps;
 * an abort from another thread inside the bracket fails step_end. */
static int run_single(void) {
    loom_err_t err = {0};
    loom_backend_t *be = NULL;
    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CUDA,
                                .device_index = 0, .weight_dtype = LOOM_DT_BF16};
    if (loom_backend_create(&bc, &be, &err) < 0) return fail(0, "backend", &err);
    loom_comm_t *c = join(0, be, NULL, NULL, NULL, 1, 0, 0, &err);
    if (!c) return fail(0, "join alone", &err);
    if (loom_comm_step_begin(c, 16, &err) < 0 || loom_comm_step_end(c, &err) < 0) return fail(0, "empty step", &err);
    if (loom_comm_step_begin(c, 16, &err) < 0) return fail(0, "step_begin", &err);
    loom_comm_abort(c);
    if (loom_comm_step_end(c, &err) != LOOM_ERR_UNAVAILABLE) return fail(0, "abort inside a step", NULL);
    loom_comm_destroy(&c);
    loom_backend_destroy(&be);
    fprintf(stderr, "single: ok\n");
    return 0;
}

/* Waits for pid at most limit_s, killing it after that. */
static int wait_child(pid_t pid, int limit_s) {
    for (int i = 0; i < limit_s * 10; i++) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return 124;
}

int main(void) {
    loom_log_init("test_nccl_comm");
    pid_t probe = fork();
    if (probe == 0)
        _exit(loom_backend_available(LOOM_DEVICE_CUDA, 1) ? 2 : loom_backend_available(LOOM_DEVICE_CUDA, 0) ? 1 : 0);
    int ngpu = wait_child(probe, 60);
    if (ngpu == 0) {
        printf("skipped: no GPU\n");
        return SKIP_CODE;
    }
    pid_t one = fork();
    if (one == 0) _exit(run_single());
    if (wait_child(one, 60) != 0) {
        fprintf(stderr, "test_nccl_comm: the single-GPU case failed\n");
        return 1;
    }
    if (ngpu < 2) {
        printf("skipped: needs 2 GPUs\n");
        return SKIP_CODE;
    }
    int fds[2];
    if (pipe(fds) != 0) return 1;
    pid_t c0 = fork();
    if (c0 == 0) {
        close(fds[0]);
        uint8_t ids[N_IDS][LOOM_COMM_ID_BYTES];
        loom_err_t err = {0};
        for (int i = 0; i < N_IDS; i++) {
            size_t len = 0;
            if (loom_comm_make_id("nccl", ids[i], &len, &err) < 0 || len != LOOM_COMM_ID_BYTES) _exit(fail(0, "make id", &err));
        }
        if (write(fds[1], ids, sizeof ids) != (ssize_t)sizeof ids) _exit(1);
        close(fds[1]);
        _exit(run_rank(0, ids));
    }
    close(fds[1]);
    uint8_t ids[N_IDS][LOOM_COMM_ID_BYTES];
    size_t got = 0;
    while (got < sizeof ids) {
        ssize_t r = read(fds[0], (uint8_t *)ids + got, sizeof ids - got);
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fds[0]);
    if (got != sizeof ids) {
        wait_child(c0, 5);
        fprintf(stderr, "test_nccl_comm: rank 0 made no ids\n");
        return 1;
    }
    pid_t c1 = fork();
    if (c1 == 0) _exit(run_rank(1, ids));
    int r0 = wait_child(c0, 120), r1 = wait_child(c1, 120);
    printf("test_nccl_comm: rank 0 exit %d, rank 1 exit %d\n", r0, r1);
    return r0 == 0 && r1 == 0 ? 0 : 1;
}
