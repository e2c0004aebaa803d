/* Data-plane benchmark: two worker processes on this host, for the shm and tcp
 * backends. All-reduce latency (median and p99) at decode sizes and bandwidth
 * at 4 MB; pipeline send/recv latency (ping-pong, half the round trip) and
 * bandwidth (a one-way stream). Nothing is pinned: the OS places the two
 * processes as it would place workers.
 *
 *   bench_comm [shm|tcp|tcp-auth|tcp-enc]...     (default: shm and tcp)
 *
 * tcp-auth: links authenticated with an epoch secret (the default in a
 * cluster; costs only at setup); tcp-enc: every frame encrypted as well
 * (ChaCha20-Poly1305, the coordinator's --encrypt-data-plane). Comparing
 * tcp-enc with tcp-auth at 4 MB gives the encryption's cost per MB.
 *
 * Napkin math: an all-reduce of n floats writes 4n bytes and reads 2 x 4n on
 * each rank (shm); on tcp each rank sends and receives 4n bytes. GB/s below is
 * the buffer size over the time of one call ("algorithm bandwidth"). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/comm.h"

typedef struct setup {
    const char *backend; /* as printed: shm, tcp, tcp-auth, tcp-enc */
    const char *kind;    /* the comm backend: shm or tcp */
    int auth, encrypt;
    char ar_name[64], pp_name[64];
    loom_comm_peer_t ar_peers[2], pp_peers[2];
    loom_comm_listener_t *ar_l[2], *pp_l[2];
    char addrs[4][320]; /* copies: each worker closes the other's listeners */
    size_t max_bytes;
} setup_t;

static const char *k_ids[2] = {"bench0", "bench1"};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void stats(double *us, int n, double *median, double *p99) {
    qsort(us, (size_t)n, sizeof *us, cmp_double);
    *median = us[n / 2];
    *p99 = us[(int)((double)n * 0.99)];
}

static loom_comm_t *join(setup_t *s, int rank, int pipeline) {
    loom_comm_config_t cfg = {
        .version = LOOM_COMM_CONFIG_VERSION,
        .backend = s->kind,
        .self_id = k_ids[rank],
        .max_bytes = s->max_bytes,
        .timeout_ms = 20000,
    };
    static const uint8_t secret[32] = "bench_comm's epoch secret ......";
    if (s->auth) {
        cfg.auth_secret = secret;
        cfg.auth_secret_len = sizeof secret;
        cfg.encrypt = s->encrypt;
    }
    if (pipeline) {
        /* A ring of two one-rank stages: each process is the other's next and previous. */
        cfg.name = s->pp_name;
        cfg.tp_rank = 0;
        cfg.tp_size = 1;
        cfg.tp_group = &s->pp_peers[rank];
        cfg.next = cfg.prev = &s->pp_peers[1 - rank];
        cfg.listener = s->pp_l[rank];
    } else {
        cfg.name = s->ar_name;
        cfg.tp_rank = rank;
        cfg.tp_size = 2;
        cfg.tp_group = s->ar_peers;
        cfg.listener = s->ar_l[rank];
    }
    loom_comm_t *c = NULL;
    loom_err_t err = {0};
    if (loom_comm_create(&cfg, &c, &err) != LOOM_OK) {
        fprintf(stderr, "bench_comm: create: %s\n", err.msg);
        exit(1);
    }
    return c;
}

#define CHECK_OK(call)                                                                             \
    do {                                                                                           \
        if ((call) != LOOM_OK) {                                                                   \
            fprintf(stderr, "bench_comm: %s failed: %s\n", #call, err.msg);                        \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void bench_allreduce(loom_comm_t *c, int rank, const char *backend, float *buf) {
    loom_err_t err = {0};
    static const int64_t sizes[] = {768, 4096, 65536};
    static const int iters[] = {3000, 3000, 1000};
    static double us[3000];
    for (size_t k = 0; k < 3; k++) {
        int64_t n = sizes[k];
        for (int64_t i = 0; i < n; i++)
            buf[i] = (float)(i % 7);
        for (int w = 0; w < 200; w++)
            CHECK_OK(loom_comm_allreduce(c, buf, n, &err));
        for (int it = 0; it < iters[k]; it++) {
            buf[0] = (float)it;
            uint64_t t0 = loom_now_ns();
            CHECK_OK(loom_comm_allreduce(c, buf, n, &err));
            us[it] = (double)(loom_now_ns() - t0) / 1e3;
        }
        double med, p99;
        stats(us, iters[k], &med, &p99);
        if (rank == 0)
            printf("%-8s all-reduce   %8lld floats %9lld B   median %8.1f us   p99 %8.1f us   "
                   "%6.2f GB/s\n",
                   backend, (long long)n, (long long)n * 4, med, p99, (double)n * 4 / (med * 1e3));
    }
    int64_t n = 1 << 20; /* 4 MB */
    for (int w = 0; w < 5; w++)
        CHECK_OK(loom_comm_allreduce(c, buf, n, &err));
    struct timespec c0, c1; /* this rank's CPU time: what encryption adds, whatever the load */
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    for (int it = 0; it < 40; it++) {
        uint64_t t0 = loom_now_ns();
        CHECK_OK(loom_comm_allreduce(c, buf, n, &err));
        us[it] = (double)(loom_now_ns() - t0) / 1e3;
    }
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    double cpu_ms = ((double)(c1.tv_sec - c0.tv_sec) * 1e3 + (double)(c1.tv_nsec - c0.tv_nsec) / 1e6) / 40;
    double med, p99;
    stats(us, 40, &med, &p99);
    if (rank == 0)
        printf("%-8s all-reduce   %8lld floats %9lld B   median %8.1f us   p99 %8.1f us   %6.2f "
               "GB/s   CPU %.2f ms per call (%.2f ms per MB sent + received)\n",
               backend, (long long)n, (long long)n * 4, med, p99, (double)n * 4 / (med * 1e3), cpu_ms,
               cpu_ms / ((double)n * 8 / 1048576.0));
}

static void bench_sendrecv(loom_comm_t *c, int rank, const char *backend, float *buf) {
    loom_err_t err = {0};
    static double us[3000];
    static const size_t sizes[] = {768 * 4, 16384 * 4};
    for (size_t k = 0; k < 2; k++) {
        size_t bytes = sizes[k];
        int iters = 3000;
        for (int it = -200; it < iters; it++) {
            uint64_t t0 = loom_now_ns();
            if (rank == 0) {
                CHECK_OK(loom_comm_send_next(c, buf, bytes, &err));
                CHECK_OK(loom_comm_recv_prev(c, buf, bytes, &err));
            } else {
                CHECK_OK(loom_comm_recv_prev(c, buf, bytes, &err));
                CHECK_OK(loom_comm_send_next(c, buf, bytes, &err));
            }
            if (it >= 0) us[it] = (double)(loom_now_ns() - t0) / 2e3;
        }
        double med, p99;
        stats(us, iters, &med, &p99);
        if (rank == 0)
            printf("%-8s send/recv    %8zu floats %9zu B   median %8.1f us   p99 %8.1f us   (one "
                   "way, ping-pong / 2)\n",
                   backend, bytes / 4, bytes, med, p99);
    }
    /* One-way stream of 4 MB messages; the receiver answers once at the end. */
    size_t bytes = (size_t)4 << 20;
    int msgs = 100;
    for (int round = 0; round < 2; round++) { /* round 0 warms up */
        uint64_t t0 = loom_now_ns();
        if (rank == 0) {
            for (int m = 0; m < msgs; m++)
                CHECK_OK(loom_comm_send_next(c, buf, bytes, &err));
            CHECK_OK(loom_comm_recv_prev(c, buf, 4, &err));
        } else {
            for (int m = 0; m < msgs; m++)
                CHECK_OK(loom_comm_recv_prev(c, buf, bytes, &err));
            CHECK_OK(loom_comm_send_next(c, buf, 4, &err));
        }
        double s = (double)(loom_now_ns() - t0) / 1e9;
        if (rank == 0 && round == 1)
            printf("%-8s send/recv    %8zu floats %9zu B   stream of %d: %6.2f GB/s\n", backend,
                   bytes / 4, bytes, msgs, (double)bytes * msgs / s / 1e9);
    }
}

static void worker(setup_t *s, int rank) {
    for (int i = 0; i < 2; i++) {
        if (i == rank) continue;
        loom_comm_listener_destroy(&s->ar_l[i]);
        loom_comm_listener_destroy(&s->pp_l[i]);
    }
    float *buf = loom_aligned_alloc(s->max_bytes);
    if (!buf) exit(1);
    memset(buf, 0, s->max_bytes);
    loom_comm_t *ar = join(s, rank, 0);
    bench_allreduce(ar, rank, s->backend, buf);
    loom_comm_destroy(&ar);
    loom_comm_t *pp = join(s, rank, 1);
    bench_sendrecv(pp, rank, s->backend, buf);
    loom_comm_destroy(&pp);
    loom_aligned_free(buf);
    fflush(stdout);
}

static int run_backend(const char *backend) {
    setup_t s = {.backend = backend, .kind = strncmp(backend, "tcp", 3) ? backend : "tcp",
                 .auth = !strcmp(backend, "tcp-auth") || !strcmp(backend, "tcp-enc"),
                 .encrypt = !strcmp(backend, "tcp-enc"), .max_bytes = (size_t)4 << 20};
    snprintf(s.ar_name, sizeof s.ar_name, "bench%d-ar-%s", (int)getpid(), backend);
    snprintf(s.pp_name, sizeof s.pp_name, "bench%d-pp-%s", (int)getpid(), backend);
    for (int r = 0; r < 2; r++) {
        s.ar_peers[r].worker_id = s.pp_peers[r].worker_id = k_ids[r];
        if (!strcmp(s.kind, "tcp")) {
            loom_err_t err;
            if (loom_comm_listener_create("127.0.0.1", 0, &s.ar_l[r], &err) != LOOM_OK ||
                loom_comm_listener_create("127.0.0.1", 0, &s.pp_l[r], &err) != LOOM_OK) {
                fprintf(stderr, "bench_comm: %s\n", err.msg);
                return 1;
            }
            snprintf(s.addrs[2 * r], sizeof s.addrs[0], "%s", loom_comm_listener_addr(s.ar_l[r]));
            snprintf(s.addrs[2 * r + 1], sizeof s.addrs[0], "%s",
                     loom_comm_listener_addr(s.pp_l[r]));
            s.ar_peers[r].data_addr = s.addrs[2 * r];
            s.pp_peers[r].data_addr = s.addrs[2 * r + 1];
        }
    }
    fflush(stdout);
    pid_t pids[2];
    for (int r = 0; r < 2; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            alarm(60);
            worker(&s, r);
            exit(0);
        }
    }
    int failed = 0;
    for (int r = 0; r < 2; r++) {
        int st = 0;
        waitpid(pids[r], &st, 0);
        failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
    }
    for (int r = 0; r < 2; r++) {
        loom_comm_listener_destroy(&s.ar_l[r]);
        loom_comm_listener_destroy(&s.pp_l[r]);
    }
    return failed;
}

int main(int argc, char **argv) {
    loom_log_init("bench_comm");
    signal(SIGPIPE, SIG_IGN);
    const char *all[] = {"shm", "tcp"};
    int failed = 0;
    if (argc > 1) {
        for (int i = 1; i < argc; i++)
            failed |= run_backend(argv[i]);
    } else {
        for (int i = 0; i < 2; i++)
            failed |= run_backend(all[i]);
    }
    return failed;
}
