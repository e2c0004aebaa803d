/* The CPU data plane (comm shm and tcp) with real processes: every worker is a
 * forked child with its own comm; children report through a pipe and the
 * parent checks exit codes, reports and /dev/shm. The parent kills children
 * that outlive their timeout, and children die with the parent. */
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "common/log.h"
#include "common/util.h"
#include "tests/test.h"
#include "worker/comm.h"
#include "worker/comm_util.h"

#define MAX_PROCS        8
#define MAX_REPORTS      4096
#define GROUP_TIMEOUT_MS 30000

/* ---- a grid of workers (pp stages x tp ranks) ------------------------------ */

typedef struct grid {
    const char *backend;
    char name[200];
    int pp, tp;
    size_t max_bytes;
    int timeout_ms;
    char ids[MAX_PROCS][32];
    char addrs[MAX_PROCS][320]; /* copies: a child closes the listeners that are not its own */
    loom_comm_peer_t peers[MAX_PROCS]; /* worker (s, r) is peers[s * tp + r] */
    loom_comm_listener_t *listeners[MAX_PROCS];
    const uint8_t *secret[MAX_PROCS]; /* tcp: each worker's data-plane secret (NULL: none) */
    size_t secret_len;
    int encrypt;
} grid_t;

static char g_prefix[64]; /* "tc<pid>": every comm name of this run starts with it */

/* Listeners are opened here, in the parent, so every child knows every address. */
static void grid_init(grid_t *g, const char *backend, const char *tag, int pp, int tp,
                      size_t max_bytes) {
    memset(g, 0, sizeof *g);
    g->backend = backend;
    snprintf(g->name, sizeof g->name, "%s-%s-%s", g_prefix, tag, backend);
    g->pp = pp;
    g->tp = tp;
    g->max_bytes = max_bytes;
    g->timeout_ms = 10000;
    for (int i = 0; i < pp * tp; i++) {
        snprintf(g->ids[i], sizeof g->ids[i], "w%d.%d", i / tp, i % tp);
        g->peers[i].worker_id = g->ids[i];
        if (!strcmp(backend, "tcp")) {
            loom_err_t err;
            loom_status_t st = loom_comm_listener_create("127.0.0.1", 0, &g->listeners[i], &err);
            if (st != LOOM_OK) {
                fprintf(stderr, "listener: %s\n", err.msg);
                exit(2);
            }
            snprintf(g->addrs[i], sizeof g->addrs[i], "%s",
                     loom_comm_listener_addr(g->listeners[i]));
            g->peers[i].data_addr = g->addrs[i];
        }
    }
}

static void grid_free(grid_t *g) {
    for (int i = 0; i < MAX_PROCS; i++)
        loom_comm_listener_destroy(&g->listeners[i]);
}

static void grid_config(const grid_t *g, int idx, loom_comm_config_t *cfg) {
    int s = idx / g->tp, r = idx % g->tp;
    memset(cfg, 0, sizeof *cfg);
    cfg->version = LOOM_COMM_CONFIG_VERSION;
    cfg->backend = g->backend;
    cfg->name = g->name;
    cfg->self_id = g->ids[idx];
    cfg->tp_rank = r;
    cfg->tp_size = g->tp;
    cfg->tp_group = &g->peers[s * g->tp];
    cfg->prev = s > 0 ? &g->peers[(s - 1) * g->tp + r] : NULL;
    cfg->next = s + 1 < g->pp ? &g->peers[(s + 1) * g->tp + r] : NULL;
    cfg->max_bytes = g->max_bytes;
    cfg->timeout_ms = g->timeout_ms;
    cfg->listener = g->listeners[idx];
    cfg->auth_secret = g->secret[idx];
    cfg->auth_secret_len = g->secret[idx] ? g->secret_len : 0;
    cfg->encrypt = g->encrypt;
}

/* In a child: drops the other workers' listeners and joins the grid. */
static loom_comm_t *grid_join(grid_t *g, int idx) {
    for (int i = 0; i < MAX_PROCS; i++)
        if (i != idx) loom_comm_listener_destroy(&g->listeners[i]);
    loom_comm_config_t cfg;
    grid_config(g, idx, &cfg);
    loom_comm_t *c = NULL;
    loom_err_t err = {0};
    loom_status_t st = loom_comm_create(&cfg, &c, &err);
    CHECKF(st == LOOM_OK, "worker %s: create: %s", g->ids[idx], err.msg);
    return c;
}

/* ---- children and their reports -------------------------------------------- */

enum {
    KEY_READY = 1,
    KEY_FAILED = 2, /* value: status; t_ns: when */
    KEY_SUM = 100,  /* + size index: checksum of an all-reduce result */
    KEY_LOOP = 200,
    KEY_BARRIER_IN = 300, /* + round */
    KEY_BARRIER_OUT = 400,
};

typedef struct report {
    int32_t idx, key;
    int64_t value;
    uint64_t t_ns; /* CLOCK_MONOTONIC is one clock for every process */
} report_t;

typedef struct child {
    int idx;
    int report_fd;
    grid_t *g;
    void *arg;
} child_t;

static void report(const child_t *ch, int key, int64_t value) {
    report_t r = {ch->idx, key, value, loom_now_ns()};
    if (write(ch->report_fd, &r, sizeof r) != (ssize_t)sizeof r) perror("report");
}

typedef struct run {
    int n;
    pid_t pid[MAX_PROCS];
    int status[MAX_PROCS];
    int done[MAX_PROCS];
    report_t reports[MAX_REPORTS];
    int n_reports;
    int kill_idx;    /* SIGKILL this child once all have reported KEY_READY; -1: none */
    uint64_t t_kill; /* when it was killed */
} run_t;

static void drain(run_t *run, int fd) {
    report_t r;
    while (read(fd, &r, sizeof r) == (ssize_t)sizeof r)
        if (run->n_reports < MAX_REPORTS) run->reports[run->n_reports++] = r;
}

static int count_reports(const run_t *run, int key) {
    int n = 0;
    for (int i = 0; i < run->n_reports; i++)
        n += run->reports[i].key == key;
    return n;
}

static const report_t *find_report(const run_t *run, int idx, int key) {
    for (int i = 0; i < run->n_reports; i++)
        if (run->reports[i].idx == idx && run->reports[i].key == key) return &run->reports[i];
    return NULL;
}

/* Forks n children running fn and waits for them, at most timeout_ms; kills
 * the ones left. Fails the current test if a child fails or hangs. */
static void run_children(run_t *run, int n, void (*fn)(child_t *), grid_t *g, void *arg,
                         int timeout_ms) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
        CHECK(!"pipe");
        return;
    }
    run->n = n;
    fflush(stdout);
    fflush(stderr);
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            alarm((unsigned)(timeout_ms / 1000 + 5));
            int before = g_test_failures;
            child_t ch = {i, fds[1], g, arg};
            fn(&ch);
            exit(g_test_failures != before ? 1 : 0);
        }
        run->pid[i] = pid;
        if (pid < 0) {
            CHECK(!"fork");
            run->done[i] = 1;
        }
    }
    close(fds[1]);
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    uint64_t deadline = loom_now_ns() + (uint64_t)timeout_ms * 1000000ull, kill_at = 0;
    int left = n;
    for (int i = 0; i < n; i++)
        left -= run->done[i];
    while (left > 0 && loom_now_ns() < deadline) {
        struct pollfd pf = {fds[0], POLLIN, 0};
        poll(&pf, 1, 5);
        drain(run, fds[0]);
        if (run->kill_idx >= 0 && !run->t_kill) {
            if (!kill_at && count_reports(run, KEY_READY) == n)
                kill_at = loom_now_ns() + 50000000ull;
            if (kill_at && loom_now_ns() >= kill_at) {
                kill(run->pid[run->kill_idx], SIGKILL);
                run->t_kill = loom_now_ns();
            }
        }
        for (int i = 0; i < n; i++) {
            if (run->done[i]) continue;
            if (waitpid(run->pid[i], &run->status[i], WNOHANG) == run->pid[i]) {
                run->done[i] = 1;
                left--;
            }
        }
    }
    for (int i = 0; i < n; i++) {
        if (run->done[i]) continue;
        CHECKF(0, "child %d (pid %d) still running after %d ms: killed", i, (int)run->pid[i],
               timeout_ms);
        kill(run->pid[i], SIGKILL);
        waitpid(run->pid[i], &run->status[i], 0);
        run->done[i] = 1;
        run->status[i] = -1;
    }
    drain(run, fds[0]);
    close(fds[0]);
    for (int i = 0; i < n; i++) {
        if (i == run->kill_idx) continue;
        int st = run->status[i];
        CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child %d: %s %d", i,
               WIFSIGNALED(st) ? "killed by signal" : "exit status",
               WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    }
}

static void run_init(run_t *run) {
    memset(run, 0, sizeof *run);
    run->kill_idx = -1;
}

/* Counts (and removes) /dev/shm entries of this test run. */
static int shm_leftovers(void) {
    char prefix[96];
    snprintf(prefix, sizeof prefix, "loom-%s", g_prefix);
    DIR *d = opendir("/dev/shm");
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, prefix, strlen(prefix))) continue;
        fprintf(stderr, "  leftover /dev/shm/%s\n", e->d_name);
        char name[300];
        snprintf(name, sizeof name, "/%s", e->d_name);
        shm_unlink(name);
        n++;
    }
    closedir(d);
    return n;
}

/* ---- data ------------------------------------------------------------------- */

/* Deterministic values with a per-rank scale, so the result depends on the
 * order of the sum: a check of "rank order" and not just "a sum". */
static float gen(int rank, int64_t i, uint64_t salt) {
    uint64_t z =
        salt * 0x9E3779B97F4A7C15ull + (uint64_t)rank * 0xBF58476D1CE4E5B9ull + (uint64_t)i + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = (float)(z >> 40) / 16777216.0f * 2.0f - 1.0f;
    return ldexpf(u, 3 * rank);
}

static void fill(float *buf, int rank, int64_t n, uint64_t salt) {
    for (int64_t i = 0; i < n; i++)
        buf[i] = gen(rank, i, salt);
}

static void expected_sum(float *out, int tp, int64_t n, uint64_t salt) {
    for (int64_t i = 0; i < n; i++) {
        float acc = gen(0, i, salt);
        for (int r = 1; r < tp; r++)
            acc += gen(r, i, salt);
        out[i] = acc;
    }
}

static int64_t checksum(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return (int64_t)(h >> 1);
}

static int same_bits(const char *what, const float *got, const float *want, int64_t n) {
    if (!memcmp(got, want, (size_t)n * sizeof(float))) return 1;
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], sizeof(float))) {
            fprintf(stderr, "  %s[%lld]: got %.9g want %.9g\n", what, (long long)i, (double)got[i],
                    (double)want[i]);
            break;
        }
    }
    return 0;
}

/* ---- unit checks without processes ----------------------------------------- */

static void test_shm_name(void) {
    char a[LOOM_COMM_SHM_NAME_MAX + 16], b[LOOM_COMM_SHM_NAME_MAX + 16];
    const char *p1[] = {"grid/7 epoch:3", "tp", "w0"};
    loom_comm_shm_name(a, p1, 3);
    CHECKF(!strncmp(a, "/loom-grid_7_epoch_3-tp-w0~", 27), "%s", a);
    CHECK(strchr(a + 1, '/') == NULL);
    const char *p2[] = {"grid_7 epoch:3", "tp", "w0"}; /* reads the same once sanitised */
    loom_comm_shm_name(b, p2, 3);
    CHECK(strcmp(a, b) != 0);
    char longname[600];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    const char *p3[] = {longname, "pp", "a", "b"};
    const char *p4[] = {longname, "pp", "a", "c"};
    loom_comm_shm_name(a, p3, 4);
    loom_comm_shm_name(b, p4, 4);
    CHECKF(strlen(a) < 250 && strlen(b) < 250, "%zu %zu", strlen(a), strlen(b));
    CHECK(strcmp(a, b) != 0);
    const char *p5[] = {"ab", "c"}, *p6[] = {"a", "bc"};
    loom_comm_shm_name(a, p5, 2);
    loom_comm_shm_name(b, p6, 2);
    CHECK(strcmp(a, b) != 0);
}

static void test_sum_ranks(void) {
    enum { N = 5003 }; /* not a multiple of the block or the vector width */
    static float s[3][N], out[N], ref[N];
    for (int r = 0; r < 3; r++)
        fill(s[r], r, N, 9);
    expected_sum(ref, 3, N, 9);
    const float *src[3] = {s[0], s[1], s[2]};
    loom_comm_sum_ranks(out, src, 3, N);
    CHECK(same_bits("sum", out, ref, N));
    loom_comm_sum_ranks(s[1], src, 3, N); /* in place, into a middle source */
    CHECK(same_bits("sum in place", s[1], ref, N));
}

static void test_listener(void) {
    loom_comm_listener_t *l = NULL;
    loom_err_t err;
    REQUIRE(loom_comm_listener_create("127.0.0.1", 0, &l, &err) == LOOM_OK);
    const char *addr = loom_comm_listener_addr(l);
    int port = 0;
    CHECKF(sscanf(addr, "tcp://127.0.0.1:%d", &port) == 1 && port > 0, "%s", addr);
    loom_comm_listener_destroy(&l);
    loom_comm_listener_destroy(&l);
    CHECK(l == NULL);
    CHECK(loom_comm_listener_create("127.0.0.1", 70000, &l, &err) == LOOM_ERR_INVALID_ARGUMENT);
}

/* A comm whose peers never come fails at its timeout and leaves nothing behind. */
static void test_create_timeout(void) {
    const char *backends[] = {"shm", "tcp"};
    for (int b = 0; b < 2; b++) {
        grid_t g;
        grid_init(&g, backends[b], "lonely", 1, 2, 1024);
        g.timeout_ms = 300;
        loom_comm_config_t cfg;
        grid_config(&g, 1, &cfg);
        loom_comm_t *c = NULL;
        loom_err_t err = {0};
        uint64_t t0 = loom_now_ns();
        loom_status_t st = loom_comm_create(&cfg, &c, &err);
        double ms = (double)(loom_now_ns() - t0) / 1e6;
        CHECKF(st == LOOM_ERR_UNAVAILABLE && c == NULL, "%s: %s", backends[b], loom_status_str(st));
        CHECKF(ms >= 250 && ms < 2000, "%s: gave up after %.0f ms", backends[b], ms);
        CHECKF(strstr(err.msg, "tp rank 0") || strstr(err.msg, "attach"), "%s: %s", backends[b],
               err.msg);
        grid_free(&g);
    }
    {
        loom_comm_config_t cfg = {.version = 99};
        loom_comm_t *c = NULL;
        CHECK(loom_comm_create(&cfg, &c, NULL) == LOOM_ERR_INVALID_ARGUMENT);
    }
    CHECK(shm_leftovers() == 0);
}

/* ---- collectives ------------------------------------------------------------ */

static const int64_t k_sizes[] = {1, 7, 768, 100000};

static void child_collectives(child_t *ch) {
    grid_t *g = ch->g;
    int tp = g->tp, rank = ch->idx;
    loom_comm_t *c = grid_join(g, ch->idx);
    if (!c) return;
    CHECK(loom_comm_tp_rank(c) == rank && loom_comm_tp_size(c) == tp);
    CHECK(!strcmp(loom_comm_backend(c), g->backend));
    loom_err_t err = {0};
    float *buf = malloc(100000 * sizeof(float)), *want = malloc(100000 * sizeof(float));

    for (size_t k = 0; k < LOOM_ARRAY_LEN(k_sizes); k++) {
        int64_t n = k_sizes[k];
        fill(buf, rank, n, (uint64_t)k);
        expected_sum(want, tp, n, (uint64_t)k);
        loom_status_t st = loom_comm_allreduce(c, buf, n, &err);
        CHECKF(st == LOOM_OK, "all-reduce of %lld: %s", (long long)n, err.msg);
        CHECKF(same_bits("all-reduce", buf, want, n), "rank %d, %lld floats", rank, (long long)n);
        report(ch, KEY_SUM + (int)k, checksum(buf, (size_t)n * sizeof(float)));
    }

    /* Many small ones back to back: slot reuse, counters, wake-ups. */
    int64_t loop_sum = 0;
    int bad = 0;
    for (int it = 0; it < 1000; it++) {
        int64_t n = 1 + it % 37;
        fill(buf, rank, n, 1000 + (uint64_t)it);
        if (loom_comm_allreduce(c, buf, n, &err) != LOOM_OK) {
            CHECKF(0, "iteration %d: %s", it, err.msg);
            break;
        }
        expected_sum(want, tp, n, 1000 + (uint64_t)it);
        if (memcmp(buf, want, (size_t)n * sizeof(float)) && bad++ < 3)
            fprintf(stderr, "  rank %d iteration %d: wrong sum\n", rank, it);
        loop_sum += checksum(buf, (size_t)n * sizeof(float)) & 0xffff;
    }
    CHECKF(bad == 0, "%d of 1000 small all-reduces wrong on rank %d", bad, rank);
    report(ch, KEY_LOOP, loop_sum);

    /* Gather: each rank's record to rank 0, in rank order. */
    for (int round = 0; round < 3; round++) {
        int64_t mine[3] = {rank, round, rank * 1000 + round};
        int64_t all[MAX_PROCS][3];
        memset(all, 0xff, sizeof all);
        loom_status_t st = loom_comm_gather(c, mine, sizeof mine, rank == 0 ? all : NULL, &err);
        CHECKF(st == LOOM_OK, "gather: %s", err.msg);
        if (rank == 0)
            for (int r = 0; r < tp; r++)
                CHECKF(all[r][0] == r && all[r][1] == round && all[r][2] == r * 1000 + round,
                       "gather slot %d", r);
    }

    /* Barrier: nobody leaves before the last one arrives. */
    for (int round = 0; round < 3; round++) {
        struct timespec ts = {0, (long)(((rank + round) % tp) * 20) * 1000000L};
        nanosleep(&ts, NULL);
        report(ch, KEY_BARRIER_IN + round, 0);
        CHECKF(loom_comm_barrier(c, &err) == LOOM_OK, "barrier: %s", err.msg);
        report(ch, KEY_BARRIER_OUT + round, 0);
    }

    /* Disagreeing sizes are a protocol error, and the comm goes on. */
    fill(buf, rank, 9, 77);
    loom_status_t st = loom_comm_allreduce(c, buf, rank == 0 ? 8 : 9, &err);
    CHECKF(st == LOOM_ERR_PROTOCOL, "size mismatch gave %s", loom_status_str(st));
    fill(buf, rank, 5, 78);
    expected_sum(want, tp, 5, 78);
    st = loom_comm_allreduce(c, buf, 5, &err);
    CHECKF(st == LOOM_OK && same_bits("after mismatch", buf, want, 5), "after mismatch: %s",
           err.msg);
    /* Larger than max_bytes: refused before anything moves. */
    st = loom_comm_allreduce(c, buf, (int64_t)(g->max_bytes / sizeof(float)) + 1, &err);
    CHECK(st == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_comm_send_next(c, buf, 4, &err) == LOOM_ERR_INVALID_ARGUMENT); /* no next stage */
    CHECK(loom_comm_barrier(c, &err) == LOOM_OK);
    CHECK(loom_comm_seconds(c) > 0);

    free(buf);
    free(want);
    loom_comm_destroy(&c);
    loom_comm_destroy(&c);
}

static void collectives(const char *backend, int tp) {
    grid_t g;
    grid_init(&g, backend, "coll", 1, tp, 100000 * sizeof(float));
    static run_t run;
    run_init(&run);
    run_children(&run, tp, child_collectives, &g, NULL, GROUP_TIMEOUT_MS);
    grid_free(&g);
    for (size_t k = 0; k < LOOM_ARRAY_LEN(k_sizes) + 1; k++) {
        int key = k < LOOM_ARRAY_LEN(k_sizes) ? KEY_SUM + (int)k : KEY_LOOP;
        const report_t *r0 = find_report(&run, 0, key);
        CHECKF(r0 != NULL, "%s tp %d: no result from rank 0 (key %d)", backend, tp, key);
        for (int r = 1; r < tp && r0; r++) {
            const report_t *rr = find_report(&run, r, key);
            CHECKF(rr && rr->value == r0->value,
                   "%s tp %d: rank %d's result differs from rank 0's (key %d)", backend, tp, r,
                   key);
        }
    }
    for (int round = 0; round < 3; round++) {
        uint64_t last_in = 0, first_out = UINT64_MAX;
        for (int i = 0; i < run.n_reports; i++) {
            const report_t *r = &run.reports[i];
            if (r->key == KEY_BARRIER_IN + round) last_in = LOOM_MAX(last_in, r->t_ns);
            if (r->key == KEY_BARRIER_OUT + round) first_out = LOOM_MIN(first_out, r->t_ns);
        }
        CHECKF(count_reports(&run, KEY_BARRIER_OUT + round) == tp && first_out >= last_in,
               "%s tp %d: barrier round %d let a rank out early", backend, tp, round);
    }
    CHECKF(shm_leftovers() == 0, "%s tp %d", backend, tp);
}

static void test_collectives_shm(void) {
    for (int tp = 2; tp <= 4; tp++)
        collectives("shm", tp);
}

static void test_collectives_tcp(void) {
    for (int tp = 2; tp <= 4; tp++)
        collectives("tcp", tp);
}

/* ---- pipeline --------------------------------------------------------------- */

#define PIPE_MSGS 64

static int64_t msg_len(int m) {
    return m < 4 ? 256 : 1 + (int64_t)(((uint32_t)m * 2654435761u) % 20000u);
}

static void child_pipeline(child_t *ch) {
    grid_t *g = ch->g;
    int stage = ch->idx;
    loom_comm_t *c = grid_join(g, ch->idx);
    if (!c) return;
    loom_err_t err = {0};
    float *buf = malloc(g->max_bytes);
    if (stage == 0) {
        /* Four messages fit in flight while the next stage is still asleep. */
        uint64_t t0 = loom_now_ns();
        for (int m = 0; m < PIPE_MSGS; m++) {
            int64_t n = msg_len(m);
            for (int64_t i = 0; i < n; i++)
                buf[i] = (float)(m * 1000 + i);
            CHECKF(loom_comm_send_next(c, buf, (size_t)n * sizeof(float), &err) == LOOM_OK,
                   "send %d: %s", m, err.msg);
            if (m == 3) {
                double ms = (double)(loom_now_ns() - t0) / 1e6;
                CHECKF(ms < 80, "4 sends took %.0f ms: not buffered", ms);
            }
        }
        CHECK(loom_comm_recv_prev(c, buf, 4, &err) ==
              LOOM_ERR_INVALID_ARGUMENT); /* no previous stage */
        /* A size the receiver does not expect, then a good one. */
        CHECK(loom_comm_send_next(c, buf, 10 * sizeof(float), &err) == LOOM_OK);
        for (int i = 0; i < 5; i++)
            buf[i] = (float)(i + 7);
        CHECK(loom_comm_send_next(c, buf, 5 * sizeof(float), &err) == LOOM_OK);
    } else {
        if (stage == 1) {
            struct timespec ts = {0, 150 * 1000000L};
            nanosleep(&ts, NULL);
        }
        int bad = 0;
        for (int m = 0; m < PIPE_MSGS; m++) {
            int64_t n = msg_len(m);
            loom_status_t st = loom_comm_recv_prev(c, buf, (size_t)n * sizeof(float), &err);
            if (st != LOOM_OK) {
                CHECKF(0, "stage %d recv %d: %s", stage, m, err.msg);
                break;
            }
            float add = stage == 1 ? 0.0f : 0.5f;
            for (int64_t i = 0; i < n; i++)
                bad += buf[i] != (float)(m * 1000 + i) + add;
            if (stage == 1) {
                for (int64_t i = 0; i < n; i++)
                    buf[i] += 0.5f;
                CHECKF(loom_comm_send_next(c, buf, (size_t)n * sizeof(float), &err) == LOOM_OK,
                       "forward %d: %s", m, err.msg);
            }
        }
        CHECKF(bad == 0, "stage %d: %d wrong values", stage, bad);
        if (stage == 1) {
            loom_status_t st = loom_comm_recv_prev(c, buf, 12 * sizeof(float), &err);
            CHECKF(st == LOOM_ERR_PROTOCOL, "size mismatch gave %s", loom_status_str(st));
            st = loom_comm_recv_prev(c, buf, 5 * sizeof(float), &err);
            CHECKF(st == LOOM_OK && buf[0] == 7.0f && buf[4] == 11.0f, "after mismatch: %s",
                   err.msg);
        } else {
            CHECK(loom_comm_send_next(c, buf, 4, &err) ==
                  LOOM_ERR_INVALID_ARGUMENT); /* no next stage */
        }
    }
    free(buf);
    loom_comm_destroy(&c);
}

static void pipeline(const char *backend) {
    grid_t g;
    grid_init(&g, backend, "pipe", 3, 1, 20000 * sizeof(float));
    static run_t run;
    run_init(&run);
    run_children(&run, 3, child_pipeline, &g, NULL, GROUP_TIMEOUT_MS);
    grid_free(&g);
    CHECKF(shm_leftovers() == 0, "%s", backend);
}

static void test_pipeline_shm(void) {
    pipeline("shm");
}

static void test_pipeline_tcp(void) {
    pipeline("tcp");
}

/* ---- a 2 x 2 grid, as workers use it ---------------------------------------- */

#define GRID_STEPS 50
#define GRID_DIM   768

static void child_grid(child_t *ch) {
    grid_t *g = ch->g;
    int stage = ch->idx / g->tp, rank = ch->idx % g->tp;
    loom_comm_t *c = grid_join(g, ch->idx);
    if (!c) return;
    loom_err_t err = {0};
    float x[GRID_DIM], want[GRID_DIM];
    int bad = 0;
    for (int step = 0; step < GRID_STEPS && !bad; step++) {
        expected_sum(want, g->tp, GRID_DIM, (uint64_t)step);
        if (stage == 0) {
            fill(x, rank, GRID_DIM, (uint64_t)step);
            if (loom_comm_allreduce(c, x, GRID_DIM, &err) != LOOM_OK ||
                loom_comm_send_next(c, x, sizeof x, &err) != LOOM_OK) {
                CHECKF(0, "stage 0 step %d: %s", step, err.msg);
                break;
            }
            bad += memcmp(x, want, sizeof x) != 0;
        } else {
            if (loom_comm_recv_prev(c, x, sizeof x, &err) != LOOM_OK) {
                CHECKF(0, "stage 1 step %d: %s", step, err.msg);
                break;
            }
            bad += memcmp(x, want, sizeof x) != 0;
            if (loom_comm_allreduce(c, x, GRID_DIM, &err) != LOOM_OK) {
                CHECKF(0, "stage 1 step %d: %s", step, err.msg);
                break;
            }
            for (int i = 0; i < GRID_DIM; i++)
                bad += x[i] != want[i] + want[i];
            /* Sampling results to tp rank 0. */
            int32_t mine[2] = {rank, step}, all[2 * MAX_PROCS];
            if (loom_comm_gather(c, mine, sizeof mine, rank == 0 ? all : NULL, &err) != LOOM_OK) {
                CHECKF(0, "stage 1 step %d gather: %s", step, err.msg);
                break;
            }
            if (rank == 0)
                for (int r = 0; r < g->tp; r++)
                    bad += all[2 * r] != r || all[2 * r + 1] != step;
        }
    }
    CHECKF(bad == 0, "worker %s: wrong data", g->ids[ch->idx]);
    loom_comm_destroy(&c);
}

static void grid2x2(const char *backend) {
    grid_t g;
    grid_init(&g, backend, "grid", 2, 2, GRID_DIM * sizeof(float));
    static run_t run;
    run_init(&run);
    run_children(&run, 4, child_grid, &g, NULL, GROUP_TIMEOUT_MS);
    grid_free(&g);
    CHECKF(shm_leftovers() == 0, "%s", backend);
}

static void test_grid_shm(void) {
    grid2x2("shm");
}

static void test_grid_tcp(void) {
    grid2x2("tcp");
}

/* ---- abort ------------------------------------------------------------------ */

static void *abort_later(void *arg) {
    struct timespec ts = {0, 200 * 1000000L};
    nanosleep(&ts, NULL);
    loom_comm_abort(arg);
    loom_comm_abort(arg); /* idempotent */
    return NULL;
}

static double ms_since(uint64_t t0) {
    return (double)(loom_now_ns() - t0) / 1e6;
}

/* tp 3: rank 2 never arrives; rank 1 aborts from another thread after 200 ms.
 * shm spreads the abort through the segment: ranks 0 and 2 fail too. On tcp
 * rank 1's sockets are shut down, so the others fail when they next need a
 * frame from rank 1: rank 0 may still complete the all-reduce it was in (it
 * already has rank 1's part), but not the one after. */
static void child_abort(child_t *ch) {
    int rank = ch->idx, spread_now = !strcmp(ch->g->backend, "shm");
    loom_comm_t *c = grid_join(ch->g, ch->idx);
    if (!c) return;
    loom_err_t err = {0};
    float buf[64] = {0};
    if (rank == 2) {
        struct timespec ts = {1, 500 * 1000000L};
        nanosleep(&ts, NULL);
    }
    pthread_t th;
    if (rank == 1) pthread_create(&th, NULL, abort_later, c);
    uint64_t t0 = loom_now_ns();
    loom_status_t st = loom_comm_allreduce(c, buf, 64, &err);
    double ms = ms_since(t0);
    if (rank == 1 || spread_now) {
        CHECKF(st == LOOM_ERR_UNAVAILABLE, "rank %d: %s", rank, loom_status_str(st));
        CHECKF(ms < (rank == 2 ? 100 : 1200),
               "rank %d: the all-reduce returned after %.0f ms (abort at 200)", rank, ms);
    } else {
        CHECKF(st == LOOM_ERR_UNAVAILABLE || st == LOOM_OK, "rank %d: %s", rank,
               loom_status_str(st));
    }
    if (rank == 1) pthread_join(th, NULL);
    /* Now every call fails at once, on every rank. */
    t0 = loom_now_ns();
    CHECKF(loom_comm_allreduce(c, buf, 64, &err) == LOOM_ERR_UNAVAILABLE, "rank %d", rank);
    CHECKF(loom_comm_barrier(c, &err) == LOOM_ERR_UNAVAILABLE, "rank %d", rank);
    CHECKF(loom_comm_gather(c, buf, 8, rank == 0 ? buf : NULL, &err) == LOOM_ERR_UNAVAILABLE,
           "rank %d", rank);
    CHECKF(ms_since(t0) < 100, "rank %d: calls after the abort took %.0f ms", rank, ms_since(t0));
    loom_comm_destroy(&c);
}

static void abort_case(const char *backend) {
    grid_t g;
    grid_init(&g, backend, "abort", 1, 3, 4096);
    static run_t run;
    run_init(&run);
    run_children(&run, 3, child_abort, &g, NULL, GROUP_TIMEOUT_MS);
    grid_free(&g);
    CHECKF(shm_leftovers() == 0, "%s", backend);
}

static void test_abort_shm(void) {
    abort_case("shm");
}

static void test_abort_tcp(void) {
    abort_case("tcp");
}

/* ---- a peer killed mid-run -------------------------------------------------- */

static void child_killed(child_t *ch) {
    loom_comm_t *c = grid_join(ch->g, ch->idx);
    if (!c) return;
    loom_err_t err = {0};
    float buf[256];
    fill(buf, ch->idx, 256, 1);
    CHECK(loom_comm_allreduce(c, buf, 256, &err) == LOOM_OK);
    report(ch, KEY_READY, 0);
    uint64_t t0 = loom_now_ns();
    loom_status_t st = LOOM_OK;
    while (st == LOOM_OK && ms_since(t0) < 8000) {
        fill(buf, ch->idx, 256, 2);
        st = loom_comm_allreduce(c, buf, 256, &err);
    }
    report(ch, KEY_FAILED, st);
    CHECKF(st == LOOM_ERR_UNAVAILABLE, "worker %d: %s (%s)", ch->idx, loom_status_str(st), err.msg);
    loom_comm_destroy(&c);
}

static void killed_case(const char *backend, int timeout_ms, double limit_ms) {
    grid_t g;
    grid_init(&g, backend, "killed", 1, 3, 4096);
    g.timeout_ms = timeout_ms;
    static run_t run;
    run_init(&run);
    run.kill_idx = 2;
    run_children(&run, 3, child_killed, &g, NULL, GROUP_TIMEOUT_MS);
    grid_free(&g);
    CHECKF(run.t_kill != 0, "%s: nobody was killed", backend);
    for (int i = 0; i < 2 && run.t_kill; i++) {
        const report_t *r = find_report(&run, i, KEY_FAILED);
        CHECKF(r && r->value == LOOM_ERR_UNAVAILABLE, "%s: worker %d did not fail with UNAVAILABLE",
               backend, i);
        if (!r) continue;
        double ms = (double)((int64_t)(r->t_ns - run.t_kill)) / 1e6;
        CHECKF(ms < limit_ms, "%s: worker %d noticed the kill after %.0f ms", backend, i, ms);
        fprintf(stderr, "  %s: worker %d noticed the killed peer after %.1f ms\n", backend, i, ms);
    }
    CHECKF(shm_leftovers() == 0, "%s", backend);
}

static void test_killed_shm(void) {
    killed_case("shm", 3000, 1000); /* seen by the liveness check between futex slices */
}

static void test_killed_tcp(void) {
    killed_case("tcp", 0, 500); /* no timeout at all: the closed socket tells */
}

/* ---- strangers at a tcp listener ---------------------------------------------- */

static int connect_to(const char *addr) {
    int port = 0;
    if (sscanf(addr, "tcp://127.0.0.1:%d", &port) != 1) return -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void child_stranger(child_t *ch) {
    loom_comm_t *c = grid_join(ch->g, ch->idx);
    if (!c) return;
    loom_err_t err = {0};
    float buf[768], want[768];
    fill(buf, ch->idx, 768, 5);
    expected_sum(want, 2, 768, 5);
    CHECKF(loom_comm_allreduce(c, buf, 768, &err) == LOOM_OK, "%s", err.msg);
    CHECK(same_bits("with strangers", buf, want, 768));
    loom_comm_destroy(&c);
}

static void test_stranger_tcp(void) {
    grid_t g;
    grid_init(&g, "tcp", "stranger", 1, 2, 768 * sizeof(float));
    /* Rank 1 accepts rank 0's link; strangers queue up at its listener first. */
    const char *addr = g.peers[1].data_addr;
    int garbage = connect_to(addr), wrong_name = connect_to(addr), silent = connect_to(addr);
    CHECK(garbage >= 0 && wrong_name >= 0 && silent >= 0);
    char junk[64];
    memset(junk, 0xA5, sizeof junk);
    CHECK(write(garbage, "GET / HTTP/1.0\r\n\r\n", 18) == 18);
    CHECK(write(garbage, junk, sizeof junk) == (ssize_t)sizeof junk);
    uint8_t hello[64] = {0x4c, 0x4d, 0x48, 0x31, 1, 0, 1, 0, 0, 0, 0, 0, 5, 0, 4, 0};
    memcpy(hello + 16, "otherw0.0", 9); /* comm "other", worker "w0.0" */
    CHECK(write(wrong_name, hello, 25) == 25);
    static run_t run;
    run_init(&run);
    run_children(&run, 2, child_stranger, &g, NULL, GROUP_TIMEOUT_MS);
    /* The refused ones were closed by the acceptor. */
    char tmp[8];
    struct pollfd pf = {garbage, POLLIN, 0};
    CHECK(poll(&pf, 1, 1000) == 1 && read(garbage, tmp, sizeof tmp) <= 0);
    close(garbage);
    close(wrong_name);
    close(silent);
    grid_free(&g);
}

/* 100 idle connections queue at rank 1's listener before rank 0 dials: more
 * than the acceptor's table holds (32). The oldest idle ones make room, the
 * peer behind them is admitted, and every stranger is closed by the end. */
static void test_idle_strangers_tcp(void) {
    grid_t g;
    grid_init(&g, "tcp", "idle-strangers", 1, 2, 768 * sizeof(float));
    const char *addr = g.peers[1].data_addr;
    enum { N_IDLE = 100 };
    int idle[N_IDLE];
    for (int i = 0; i < N_IDLE; i++) {
        idle[i] = connect_to(addr);
        CHECK(idle[i] >= 0);
    }
    static run_t run;
    run_init(&run);
    run_children(&run, 2, child_stranger, &g, NULL, GROUP_TIMEOUT_MS);
    int closed = 0;
    for (int i = 0; i < N_IDLE; i++) {
        char tmp[8];
        struct pollfd pf = {idle[i], POLLIN, 0};
        closed += poll(&pf, 1, 1000) == 1 && read(idle[i], tmp, sizeof tmp) <= 0;
        close(idle[i]);
    }
    CHECKF(closed == N_IDLE, "%d of %d idle strangers closed", closed, N_IDLE);
    grid_free(&g);
}

/* ---- authenticated links (the epoch secret) ------------------------------------- */

static const uint8_t k_secret[32] = "an epoch secret of 32 bytes ...";
static const uint8_t k_other[32] = "another cluster's secret .......";

static void set_secret(grid_t *g, const uint8_t *a, const uint8_t *b) {
    g->secret[0] = a;
    g->secret[1] = b;
    g->secret_len = 32;
}

/* Every collective works on authenticated links, tp and pipeline. */
static void test_auth_tcp(void) {
    grid_t g;
    grid_init(&g, "tcp", "auth", 2, 2, 100000 * sizeof(float));
    for (int i = 0; i < 4; i++) g.secret[i] = k_secret;
    g.secret_len = 32;
    static run_t run;
    run_init(&run);
    run_children(&run, 4, child_grid, &g, NULL, GROUP_TIMEOUT_MS);
    grid_free(&g);
}

/* The same grid with every frame encrypted: results bit-identical. */
static void test_encrypted_tcp(void) {
    grid_t g;
    grid_init(&g, "tcp", "enc", 2, 2, 100000 * sizeof(float));
    for (int i = 0; i < 4; i++) g.secret[i] = k_secret;
    g.secret_len = 32;
    g.encrypt = 1;
    static run_t run;
    run_init(&run);
    run_children(&run, 4, child_grid, &g, NULL, GROUP_TIMEOUT_MS);
    grid_free(&g);
    /* encryption without the secret is refused */
    grid_init(&g, "tcp", "encnokey", 1, 2, 1024);
    g.encrypt = 1;
    loom_comm_config_t cfg;
    grid_config(&g, 0, &cfg);
    loom_comm_t *c = NULL;
    loom_err_t err = {0};
    CHECK(loom_comm_create(&cfg, &c, &err) == LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "secret"));
    grid_free(&g);
}

/* The peer that sends a wrong proof, run in its own process (a thread
 * alive across run_children()'s fork() can leave the children a held
 * allocator lock: under ASan a child then hung at exit). Exits with bit 0
 * set when it got an ack, bit 1 when it was closed after its proof (an end
 * of file, or a reset where the listener closed with the proof unread). */
static pid_t impostor_start(int fd) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    uint8_t buf[512];
    struct pollfd pf = {fd, POLLIN, 0};
    int acked = 0, closed = 0;
    if (poll(&pf, 1, 10000) == 1 && read(fd, buf, sizeof buf) > 16) acked = 1;
    uint8_t proof[32] = {0};
    if (write(fd, proof, sizeof proof) == (ssize_t)sizeof proof && poll(&pf, 1, 10000) == 1 &&
        read(fd, buf, sizeof buf) <= 0) /* EOF, or a reset: closed with its proof unread */
        closed = 1;
    _exit(acked | closed << 1);
}

/* A hello for comm `name` claiming worker w0.0 (tp rank 0), version v. */
static size_t claim_hello(uint8_t *out, const char *name, int v) {
    size_t nl = strlen(name);
    uint8_t hdr[16] = {0x4c, 0x4d, 0x48, 0x31, (uint8_t)v, 0, 1, 0, 0, 0, 0, 0, (uint8_t)nl, 0, 4, 0};
    memcpy(out, hdr, 16);
    memcpy(out + 16, name, nl);
    memcpy(out + 16 + nl, "w0.0", 4);
    memset(out + 20 + nl, 0x5a, 16); /* a nonce */
    return 20 + nl + (v == 2 ? 16 : 0);
}

/* Peers at rank 1's listener that claim to be rank 0 but do not hold the
 * secret: one without authentication, one that never proves, one that sends
 * a wrong proof. None takes the slot; the real rank 0 joins and the
 * all-reduce is right. */
static void test_impostor_tcp(void) {
    grid_t g;
    grid_init(&g, "tcp", "impostor", 1, 2, 768 * sizeof(float));
    set_secret(&g, k_secret, k_secret);
    const char *addr = g.peers[1].data_addr;
    uint8_t h[256];
    int plain = connect_to(addr), silent = connect_to(addr);
    int wrong = connect_to(addr);
    CHECK(plain >= 0 && silent >= 0 && wrong >= 0);
    size_t n = claim_hello(h, g.name, 1);
    CHECK(write(plain, h, n) == (ssize_t)n);
    n = claim_hello(h, g.name, 2);
    CHECK(write(silent, h, n) == (ssize_t)n);
    CHECK(write(wrong, h, n) == (ssize_t)n);
    pid_t imp = impostor_start(wrong);
    CHECK(imp > 0);
    static run_t run;
    run_init(&run);
    run_children(&run, 2, child_stranger, &g, NULL, GROUP_TIMEOUT_MS);
    int st = 0;
    CHECK(waitpid(imp, &st, 0) == imp && WIFEXITED(st));
    CHECKF(WEXITSTATUS(st) == 3, "the impostor with a wrong proof: acked %d, closed %d",
           WEXITSTATUS(st) & 1, WEXITSTATUS(st) >> 1 & 1);
    char tmp[8];
    struct pollfd pf = {plain, POLLIN, 0};
    CHECK(poll(&pf, 1, 1000) == 1 && read(plain, tmp, sizeof tmp) <= 0); /* refused at its hello */
    close(plain);
    close(silent);
    close(wrong);
    grid_free(&g);
}

static void child_wrong_secret(child_t *ch) {
    for (int i = 0; i < MAX_PROCS; i++)
        if (i != ch->idx) loom_comm_listener_destroy(&ch->g->listeners[i]);
    loom_comm_config_t cfg;
    grid_config(ch->g, ch->idx, &cfg);
    loom_comm_t *c = NULL;
    loom_err_t err = {0};
    loom_status_t st = loom_comm_create(&cfg, &c, &err);
    report(ch, KEY_FAILED, st);
    if (ch->idx == 0) /* the dialler: the acceptor's proof is wrong */
        CHECKF(st == LOOM_ERR_UNAUTHENTICATED && strstr(err.msg, "data-plane secret"), "rank 0: %s: %s",
               loom_status_str(st), err.msg);
    else /* the acceptor: rank 0 never proved itself */
        CHECKF(st == LOOM_ERR_UNAVAILABLE, "rank 1: %s: %s", loom_status_str(st), err.msg);
    loom_comm_destroy(&c);
}

/* Two workers of different epochs (or clusters): no link comes up. */
static void test_wrong_secret_tcp(void) {
    grid_t g;
    grid_init(&g, "tcp", "wrongsecret", 1, 2, 1024);
    g.timeout_ms = 1500;
    set_secret(&g, k_secret, k_other);
    static run_t run;
    run_init(&run);
    run_children(&run, 2, child_wrong_secret, &g, NULL, GROUP_TIMEOUT_MS);
    CHECK(count_reports(&run, KEY_FAILED) == 2);
    grid_free(&g);
}

int main(void) {
    loom_log_init("test_comm");
    if (!getenv("LOOM_LOG_LEVEL")) loom_log_set_level(LOOM_LOG_ERROR);
    signal(SIGPIPE, SIG_IGN);
    snprintf(g_prefix, sizeof g_prefix, "tc%d", (int)getpid());
    RUN(test_shm_name);
    RUN(test_sum_ranks);
    RUN(test_listener);
    RUN(test_create_timeout);
    RUN(test_collectives_shm);
    RUN(test_collectives_tcp);
    RUN(test_pipeline_shm);
    RUN(test_pipeline_tcp);
    RUN(test_grid_shm);
    RUN(test_grid_tcp);
    RUN(test_abort_shm);
    RUN(test_abort_tcp);
    RUN(test_killed_shm);
    RUN(test_killed_tcp);
    RUN(test_stranger_tcp);
    RUN(test_idle_strangers_tcp);
    RUN(test_auth_tcp);
    RUN(test_encrypted_tcp);
    RUN(test_impostor_tcp);
    RUN(test_wrong_secret_tcp);
    int leftovers = shm_leftovers();
    g_test_checks++;
    if (leftovers) {
        g_test_failures++;
        fprintf(stderr, "FAIL: %d shared-memory segments left in /dev/shm\n", leftovers);
    }
    return test_summary();
}
