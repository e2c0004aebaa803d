/* KV transfer over transport tcp (worker/kv_xfer.h) between two processes
 * on this host, over the socket and through shared memory, against the raw
 * TCP rate measured in the same run.
 *
 * A child process runs the KV service over a fake pool of blocks of the 8B
 * shape (32 layers, 8 KV heads of 128, bf16, 16-token blocks: 2 MiB a block
 * and shard); the parent dials it (handshake with the secret), then reads
 * 64 blocks at a time (128 MiB) several times, whole heads, and half the
 * heads (a TP=2 decode rank's read of a TP=1 prefill). The raw rate: the
 * child writes the same bytes down a plain TCP socket the parent reads into
 * one buffer. Both on loopback, nothing pinned: GB/s = bytes / time. The
 * service packs each block's slice straight from the pool (one copy, as a
 * worker's block-contiguous pool does): onto the socket (the tcp path: the
 * kernel copies it out and into the puller's buffer), or into the puller's
 * shared memory object (the shm path). First on connections kept across
 * the rounds (as a decode worker keeps them between steps: warm buffers
 * and mappings), then a new connection a read (the object made and its
 * pages first touched on both sides each time). The pull's caller would
 * unpack the slices (one copy, not timed here: bench what the wire
 * carries). The tcp path once more with every message sealed (the
 * service and the pull with encrypt: ChaCha20-Poly1305 records, as
 * --encrypt-data-plane makes them), on kept connections: its cost beside
 * the plain tcp row of the same round. */
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "worker/comm.h"
#include "worker/comm_util.h"
#include "worker/kv_xfer.h"
#include "worker/tcp_io.h"

enum { LAYERS = 32, BS = 16, HEADS = 8, HD = 128, N_POOL = 64, ROUNDS = 4 };
static const uint8_t K[] = "bench secret, thirty-two bytes..";

static loom_kv_span_fmt_t fmt(void) {
    size_t codes = (size_t)BS * HEADS * HD * 2;
    return (loom_kv_span_fmt_t){.n_layers = LAYERS, .block_size = BS, .n_heads = HEADS, .head_bytes = HD * 2,
                                .codes = codes, .scales = 0};
}
static size_t span(void) { return (size_t)LAYERS * 2 * fmt().codes; }

static uint8_t *g_pool;
static pid_t g_child; /* the service's process: killed on every way out */

static int die(void) {
    if (g_child > 0) {
        kill(g_child, SIGKILL);
        waitpid(g_child, NULL, 0);
    }
    return 1;
}
static loom_status_t read_block(void *ctx, int32_t block, void *host, loom_err_t *err) {
    (void)ctx, (void)err;
    memcpy(host, g_pool + (size_t)block * span(), span());
    return LOOM_OK;
}

static const void *peek_block(void *ctx, int32_t block) {
    (void)ctx;
    return g_pool + (size_t)block * span();
}

static loom_kv_ident_t ident(void) {
    loom_kv_ident_t id = {.model = 1, .n_layers = LAYERS, .layer_end = LAYERS, .block_size = BS, .n_kv_heads = HEADS,
                          .head_dim = HD, .kv_head_end = HEADS, .tp_size = 1, .pp_size = 1};
    memcpy(id.dtype, "bf16", 5);
    return id;
}

/* The child: the KV service, and a raw listener that streams `raw` bytes to whoever dials it. */
static void child(int pfd, size_t raw) {
    g_pool = malloc((size_t)N_POOL * span());
    for (size_t i = 0; i < (size_t)N_POOL * span(); i++) g_pool[i] = (uint8_t)(i * 13);
    int32_t all[N_POOL];
    for (int i = 0; i < N_POOL; i++) all[i] = i;
    loom_kv_service_config_t c = {.host = "127.0.0.1", .ident = ident(), .fmt = fmt(), .secret = K,
                                  .secret_len = sizeof K - 1, .read = read_block, .peek = peek_block};
    loom_kv_service_t *s = NULL;
    loom_err_t err = {0};
    if (loom_kv_service_create(&c, &s, &err) < 0) _exit(1);
    loom_kv_service_hold(s, 7, all, N_POOL);
    loom_kv_service_t *se = NULL; /* the same, sealed */
    c.encrypt = 1;
    if (loom_kv_service_create(&c, &se, &err) < 0) _exit(1);
    loom_kv_service_hold(se, 7, all, N_POOL);
    loom_comm_listener_t *l = NULL;
    if (loom_comm_listener_create("127.0.0.1", 0, &l, &err) < 0) _exit(1);
    char addrs[700];
    snprintf(addrs, sizeof addrs, "%s %s %s", loom_kv_service_addr(s), loom_kv_service_addr(se),
             loom_comm_listener_addr(l));
    if (write(pfd, addrs, strlen(addrs) + 1) < 0) _exit(1);
    for (int r = 0; r < ROUNDS; r++) {
        int fd = -1;
        while ((fd = accept(loom_comm_listener_fd(l), NULL, NULL)) < 0) usleep(100);
        if (loom_tcp_write_full(fd, g_pool, raw, loom_comm_deadline(60000), "raw", &err) < 0) _exit(1);
        close(fd);
    }
    pause();
}

/* A connection over the socket (path 0), through shared memory (1) or over the socket sealed (2, to the sealed
 * service), checked to take that path. */
static int open_path(const char *addr, int path, loom_kv_pull_t **c, loom_err_t *err) {
    loom_kv_ident_t ours = ident(), theirs;
    if (loom_kv_pull_open(addr, &ours, K, sizeof K - 1, path == 1 ? LOOM_KV_SHM_AUTO : LOOM_KV_SHM_OFF, path == 2,
                          loom_comm_deadline(10000), c, &theirs, err) < 0) {
        fprintf(stderr, "bench_kv_xfer: %s\n", err->msg);
        return -1;
    }
    if (loom_kv_pull_shm(*c) != (path == 1)) {
        fprintf(stderr, "bench_kv_xfer: the %s path was not taken\n", path == 1 ? "shm" : "tcp");
        return -1;
    }
    return 0;
}

/* One read of every block, all heads (half 0) or the upper half: GB/s, or -1. */
static double timed_read(loom_kv_pull_t *c, const int32_t *ids, int half, size_t bytes, loom_err_t *err) {
    const void *slices = NULL;
    uint64_t t0 = loom_now_ns();
    if (loom_kv_pull_read(c, 7, ids, N_POOL, half ? HEADS / 2 : 0, half ? HEADS / 2 : HEADS, bytes, &slices,
                          loom_comm_deadline(60000), err) < 0) {
        fprintf(stderr, "bench_kv_xfer: %s\n", err->msg);
        return -1;
    }
    return (double)bytes / ((double)(loom_now_ns() - t0) * 1e-9) / 1e9;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const size_t bytes = (size_t)N_POOL * span();
    int p[2];
    if (pipe(p) != 0) return die();
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        child(p[1], bytes);
    }
    g_child = pid;
    close(p[1]);
    char addrs[700] = "";
    size_t got = 0;
    while (got < sizeof addrs - 1) {
        ssize_t r = read(p[0], addrs + got, sizeof addrs - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
        if (memchr(addrs, 0, got)) break;
    }
    char *enc_addr = strchr(addrs, ' '), *raw_addr = enc_addr ? strchr(enc_addr + 1, ' ') : NULL;
    if (!raw_addr) return die();
    *enc_addr++ = '\0';
    *raw_addr++ = '\0';
    const char *path_addr[3] = {addrs, addrs, enc_addr};
    uint8_t *buf = malloc(bytes);
    int32_t ids[N_POOL];
    for (int i = 0; i < N_POOL; i++) ids[i] = i;
    loom_err_t err = {0};
    printf("KV transfer on loopback: %d blocks of %.1f MiB a read (the 8B shape's block, bf16), %d rounds\n", N_POOL,
           (double)span() / 1048576.0, ROUNDS);
    loom_kv_span_fmt_t f = fmt();
    const size_t sizes[2] = {loom_kv_slice_bytes(&f, HEADS) * N_POOL, loom_kv_slice_bytes(&f, HEADS / 2) * N_POOL};
    /* kept connections, one a path, as a decode worker keeps them between steps */
    loom_kv_pull_t *kept[3] = {NULL, NULL, NULL};
    for (int path = 2; path >= 0; path--) /* each warmed by a read (untimed): the service closes one idle for 2 s */
        if (open_path(path_addr[path], path, &kept[path], &err) < 0 ||
            timed_read(kept[path], ids, 0, sizes[0], &err) < 0)
            return die();
    double best_raw = 0, best[3][2] = {{0}}, fresh[2] = {0}; /* [tcp, shm, tcp sealed][all heads, half]; fresh: all */
    for (int r = 0; r < ROUNDS; r++) {
        uint64_t t0 = loom_now_ns();
        int rfd = -1;
        if (loom_tcp_dial(raw_addr, loom_comm_deadline(10000), &rfd, &err) < 0 ||
            loom_tcp_read_full(rfd, buf, bytes, loom_comm_deadline(60000), "raw", &err) < 0) {
            fprintf(stderr, "bench_kv_xfer: raw: %s\n", err.msg);
            return die();
        }
        close(rfd);
        double raw = (double)bytes / ((double)(loom_now_ns() - t0) * 1e-9) / 1e9, gbs[3][2];
        for (int path = 0; path < 3; path++)
            for (int h = 0; h < 2; h++) { /* all heads, then half (a TP=2 decode rank's read of a TP=1 prefill) */
                if ((gbs[path][h] = timed_read(kept[path], ids, h, sizes[h], &err)) < 0) {
                    /* the service closes a connection idle for 2 s (a slow round on a loaded machine): anew */
                    loom_kv_pull_close(&kept[path]);
                    if (open_path(path_addr[path], path, &kept[path], &err) < 0 ||
                        (gbs[path][h] = timed_read(kept[path], ids, h, sizes[h], &err)) < 0)
                        return die();
                    printf("  (the %s connection was closed idle: a new one)\n",
                           path == 1 ? "shm" : path ? "sealed tcp" : "tcp");
                }
                best[path][h] = LOOM_MAX(best[path][h], gbs[path][h]);
            }
        printf("  round %d: raw tcp %.2f GB/s | KV tcp %.2f GB/s (%.2fx raw), half the heads %.2f | KV shm %.2f GB/s "
               "(%.2fx raw, %.2fx KV tcp), half the heads %.2f | KV tcp sealed %.2f GB/s (%.2fx KV tcp), half the "
               "heads %.2f\n",
               r, raw, gbs[0][0], gbs[0][0] / raw, gbs[0][1], gbs[1][0], gbs[1][0] / raw, gbs[1][0] / gbs[0][0],
               gbs[1][1], gbs[2][0], gbs[2][0] / gbs[0][0], gbs[2][1]);
        best_raw = LOOM_MAX(best_raw, raw);
    }
    loom_kv_pull_close(&kept[0]);
    loom_kv_pull_close(&kept[1]);
    loom_kv_pull_close(&kept[2]);
    /* a connection per read: the shm object made and its pages first touched on both sides every time */
    for (int r = 0; r < ROUNDS; r++)
        for (int path = 0; path < 2; path++) {
            loom_kv_pull_t *c = NULL;
            double g;
            if (open_path(addrs, path, &c, &err) < 0 || (g = timed_read(c, ids, 0, sizes[0], &err)) < 0) return die();
            fresh[path] = LOOM_MAX(fresh[path], g);
            loom_kv_pull_close(&c);
        }
    printf("best, kept connections: raw tcp %.2f GB/s; KV tcp %.2f GB/s (%.2fx raw), half the heads %.2f; KV shm "
           "%.2f GB/s (%.2fx raw, %.2fx KV tcp), half the heads %.2f (%.2fx KV tcp's half)\n", best_raw, best[0][0],
           best[0][0] / best_raw, best[0][1], best[1][0], best[1][0] / best_raw, best[1][0] / best[0][0], best[1][1],
           best[1][1] / best[0][1]);
    printf("best, kept connections, sealed (encrypt): KV tcp %.2f GB/s (%.2fx KV tcp), half the heads %.2f (%.2fx)\n",
           best[2][0], best[2][0] / best[0][0], best[2][1], best[2][1] / best[0][1]);
    printf("best, a new connection a read: KV tcp %.2f GB/s, KV shm %.2f GB/s (%.2fx)\n", fresh[0], fresh[1],
           fresh[1] / fresh[0]);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    free(buf);
    return 0;
}
