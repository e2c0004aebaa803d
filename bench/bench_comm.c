/* Data-plane benchmark: two worker processes on this host, for the shm and tcp
 * backends. All-reduce latency (median and p99) at decode sizes and bandwidth
 * at 4 MB; pipeline send/recv latency (ping-pong, half the round trip) and
 * bandwidth (a one-way stream). Nothing is pinned: the OS places the two
 * processes as it would place workers.
 *
 *   bench_comm [shm|tcp|tcp-auth|tcp-enc]...     (default: shm and tcp)
 *   bench_comm --step [--work-us 250] [shm|tcp]...
 *
 * --step runs all-reduces as a TP decode step does: a fixed amount of memory-
 * bound work on each rank (a read of a 4 MB buffer, calibrated to about
 * --work-us on one core), then an all-reduce, at the hidden sizes of the
 * 76M benchmark model (768 floats) and of an 8B Llama (4096). Each rank puts
 * its entry time into the reduced buffer, so both learn when the last rank
 * arrived, and the time in the call splits into waiting for the other rank
 * (its work took longer: load imbalance, not the data plane) and the cost
 * after the last arrival: the copy into shared memory, the sum and, for the
 * rank that waited, its wake-up. That cost is printed apart for calls where
 * rank 0 arrived first (it waited: spin or futex wake-up included) and last
 * (the other rank was already there), beside a plain memcpy of the same
 * bytes. $LOOM_COMM_SPIN_US sets the waiters' spin as in a worker.
 *
 * tcp-auth: links authenticated with an epoch secret (the default in a
 * cluster; costs only at setup); tcp-enc: every frame encrypted as well
 * (ChaCha20-Poly1305, the coordinator's --encrypt-data-plane). Comparing
 * tcp-enc with tcp-auth at 4 MB gives the encryption's cost per MB.
 *
 * Napkin math: an all-reduce of n floats writes 4n bytes and reads 2 x 4n on
 * each rank (shm); on tcp each rank sends and receives 4n bytes. GB/s below is
 * the buffer size over the time of one call ("algorithm bandwidth"). */
#include <sched.h>
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

/* Work between all-reduces: sums `passes` reads of a buffer; the result is
 * kept so the reads are not optimised away. */
static volatile float g_sink;
static float *g_work;
static size_t g_work_n;
static int g_passes = 1, g_step_mode;
static uint64_t g_base; /* set before the fork: the one clock origin of both ranks */

static void do_work(int passes) {
    float acc[16] = {0};
    for (int p = 0; p < passes; p++)
        for (size_t i = 0; i < g_work_n; i += 16)
            for (int k = 0; k < 16; k++)
                acc[k] += g_work[i + k];
    float s = 0;
    for (int k = 0; k < 16; k++)
        s += acc[k];
    g_sink = s;
}

/* Calibrates g_passes to about work_us on this core (median of a few tries). */
static void calibrate_work(double work_us) {
    g_work_n = (size_t)1 << 20; /* 4 MB: beyond L2, like a layer's weights */
    g_work = loom_aligned_alloc(g_work_n * sizeof(float));
    if (!g_work) exit(1);
    for (size_t i = 0; i < g_work_n; i++)
        g_work[i] = (float)(i & 15);
    double t[9];
    for (int i = 0; i < 9; i++) {
        uint64_t t0 = loom_now_ns();
        do_work(1);
        t[i] = (double)(loom_now_ns() - t0) / 1e3;
    }
    double med, p99;
    stats(t, 9, &med, &p99);
    g_passes = LOOM_MAX(1, (int)(work_us / med + 0.5));
}

static double memcpy_us(int64_t n) {
    static double us[2000];
    float *a = loom_aligned_alloc((size_t)n * 4), *b = loom_aligned_alloc((size_t)n * 4);
    if (!a || !b) exit(1);
    memset(a, 1, (size_t)n * 4);
    memset(b, 0, (size_t)n * 4);
    for (int it = 0; it < 2000; it++) {
        uint64_t t0 = loom_now_ns();
        memcpy(it & 1 ? a : b, it & 1 ? b : a, (size_t)n * 4);
        __asm__ volatile("" ::: "memory");
        us[it] = (double)(loom_now_ns() - t0) / 1e3;
    }
    loom_aligned_free(a);
    loom_aligned_free(b);
    double med, p99;
    stats(us, 2000, &med, &p99);
    return med;
}

/* The --step mode (see the top of the file). */
static void bench_step(loom_comm_t *c, int rank, const char *backend, float *buf) {
    loom_err_t err = {0};
    enum { ITERS = 1500 };
    static const int64_t sizes[] = {768, 4096};
    static double total[ITERS], wait[ITERS], first[ITERS], last[ITERS], work[ITERS];
    for (size_t k = 0; k < 2; k++) {
        int64_t n = sizes[k];
        double copy = memcpy_us(n);
        for (int64_t i = 0; i < n; i++)
            buf[i] = (float)(i % 7);
        for (int w = 0; w < 100; w++)
            CHECK_OK(loom_comm_allreduce(c, buf, n, &err));
        int n_first = 0, n_last = 0;
        double comm_s = 0, work_s = 0;
        CHECK_OK(loom_comm_allreduce(c, buf, n, &err)); /* both start from here */
        uint64_t base = g_base;
        for (int it = 0; it < ITERS; it++) {
            uint64_t w0 = loom_now_ns();
            do_work(g_passes);
            uint64_t t0 = loom_now_ns();
            /* Entry times in µs since the base, exchanged through the sum:
             * each rank contributes its own and a zero for the other's (a
             * float keeps ~0.1 µs over the series' second or so). */
            buf[0] = rank == 0 ? (float)((double)(t0 - base) / 1e3) : 0.0f;
            buf[1] = rank == 1 ? (float)((double)(t0 - base) / 1e3) : 0.0f;
            CHECK_OK(loom_comm_allreduce(c, buf, n, &err));
            uint64_t t1 = loom_now_ns();
            double mine = (double)(t0 - base) / 1e3, theirs = buf[1 - rank];
            double after = (double)(t1 - base) / 1e3 - LOOM_MAX(mine, theirs);
            total[it] = (double)(t1 - t0) / 1e3;
            work[it] = (double)(t0 - w0) / 1e3;
            if (mine <= theirs) {
                wait[n_first] = theirs - mine;
                first[n_first++] = after;
            } else {
                last[n_last++] = after;
            }
            comm_s += (double)(t1 - t0) / 1e9;
            work_s += (double)(t0 - w0) / 1e9;
        }
        double tot_med, tot_p99, work_med, work_p99;
        double wait_med = 0, wait_p99 = 0, first_med = 0, first_p99 = 0, last_med = 0, last_p99 = 0;
        stats(total, ITERS, &tot_med, &tot_p99);
        stats(work, ITERS, &work_med, &work_p99);
        if (n_first) stats(wait, n_first, &wait_med, &wait_p99);
        if (n_first) stats(first, n_first, &first_med, &first_p99);
        if (n_last) stats(last, n_last, &last_med, &last_p99);
        if (rank == 0) {
            printf("%-8s step all-reduce %5lld floats (%6lld B), work median %6.1f us: in the call "
                   "median %6.1f us, mean %6.1f (p99 %7.1f), %.1f%% of the time\n",
                   backend, (long long)n, (long long)n * 4, work_med, tot_med, comm_s * 1e6 / ITERS,
                   tot_p99, 100.0 * comm_s / (comm_s + work_s));
            printf("%-8s   rank 0 first (%d calls): waited for the other rank median %6.1f us (p99 "
                   "%7.1f), then took %5.1f us (p99 %6.1f) after its arrival (wake-up, sum)\n",
                   backend, n_first, wait_med, wait_p99, first_med, first_p99);
            printf("%-8s   rank 0 last (%d calls): %5.1f us (p99 %6.1f) in the call (copy in, "
                   "publish, sum); memcpy of the bytes alone %5.2f us\n",
                   backend, n_last, last_med, last_p99, copy);
        }
    }
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
    if (g_step_mode) {
        bench_step(ar, rank, s->backend, buf);
        loom_comm_destroy(&ar);
        loom_aligned_free(buf);
        fflush(stdout);
        return;
    }
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
    g_base = loom_now_ns();
    for (int r = 0; r < 2; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (g_step_mode && sysconf(_SC_NPROCESSORS_ONLN) >= 2) {
                /* as deploy/local/launch.sh places one-thread workers: a core each */
                cpu_set_t set;
                CPU_ZERO(&set);
                CPU_SET(r, &set);
                sched_setaffinity(0, sizeof set, &set);
            }
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
    int failed = 0, first = 1;
    double work_us = 250;
    while (first < argc && !strncmp(argv[first], "--", 2)) {
        if (!strcmp(argv[first], "--step")) {
            g_step_mode = 1;
            first++;
        } else if (!strcmp(argv[first], "--work-us") && first + 1 < argc) {
            work_us = atof(argv[first + 1]);
            first += 2;
        } else {
            fprintf(stderr,
                    "usage: bench_comm [--step [--work-us US]] [shm|tcp|tcp-auth|tcp-enc]...\n");
            return 2;
        }
    }
    if (g_step_mode) {
        calibrate_work(work_us);
        const char *e = getenv("LOOM_COMM_SPIN_US");
        printf("step mode: %d passes over 4 MB between all-reduces (~%.0f us), "
               "LOOM_COMM_SPIN_US=%s\n",
               g_passes, work_us, e && *e ? e : "(default)");
    }
    if (argc > first) {
        for (int i = first; i < argc; i++)
            failed |= run_backend(argv[i]);
    } else {
        for (int i = 0; i < 2; i++)
            failed |= run_backend(all[i]);
    }
    return failed;
}
