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
 * shared memory object (the shm path: made for the connection, so its pages
 * are first touched in the read, as in a worker's pull); the pull's caller
 * would unpack it (one copy, not timed here: bench what the wire carries). */
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
    loom_comm_listener_t *l = NULL;
    if (loom_comm_listener_create("127.0.0.1", 0, &l, &err) < 0) _exit(1);
    char addrs[700];
    snprintf(addrs, sizeof addrs, "%s %s", loom_kv_service_addr(s), loom_comm_listener_addr(l));
    if (write(pfd, addrs, strlen(addrs) + 1) < 0) _exit(1);
    for (int r = 0; r < ROUNDS; r++) {
        int fd = -1;
        while ((fd = accept(loom_comm_listener_fd(l), NULL, NULL)) < 0) usleep(100);
        if (loom_tcp_write_full(fd, g_pool, raw, loom_comm_deadline(60000), "raw", &err) < 0) _exit(1);
        close(fd);
    }
    pause();
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const size_t bytes = (size_t)N_POOL * span();
    int p[2];
    if (pipe(p) != 0) return 1;
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        child(p[1], bytes);
    }
    close(p[1]);
    char addrs[700] = "";
    size_t got = 0;
    while (got < sizeof addrs - 1) {
        ssize_t r = read(p[0], addrs + got, sizeof addrs - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
        if (memchr(addrs, 0, got)) break;
    }
    char *raw_addr = strchr(addrs, ' ');
    if (!raw_addr) return 1;
    *raw_addr++ = '\0';
    uint8_t *buf = malloc(bytes);
    int32_t ids[N_POOL];
    for (int i = 0; i < N_POOL; i++) ids[i] = i;
    loom_err_t err = {0};
    printf("KV transfer on loopback: %d blocks of %.1f MiB a read (the 8B shape's block, bf16), %d rounds; each "
           "round a connection per path (as a decode worker makes one per source and step)\n",
           N_POOL, (double)span() / 1048576.0, ROUNDS);
    double best_raw = 0, best[2][2] = {{0}}; /* [tcp, shm][all heads, half] */
    loom_kv_span_fmt_t f = fmt();
    const size_t all_bytes = loom_kv_slice_bytes(&f, HEADS) * N_POOL, half = loom_kv_slice_bytes(&f, HEADS / 2) * N_POOL;
    for (int r = 0; r < ROUNDS; r++) {
        uint64_t t0 = loom_now_ns();
        int rfd = -1;
        if (loom_tcp_dial(raw_addr, loom_comm_deadline(10000), &rfd, &err) < 0 ||
            loom_tcp_read_full(rfd, buf, bytes, loom_comm_deadline(60000), "raw", &err) < 0) {
            fprintf(stderr, "bench_kv_xfer: raw: %s\n", err.msg);
            return 1;
        }
        close(rfd);
        double raw = (double)bytes / ((double)(loom_now_ns() - t0) * 1e-9) / 1e9, gbs[2][2];
        for (int path = 0; path < 2; path++) {
            loom_kv_ident_t ours = ident(), theirs;
            loom_kv_pull_t *c = NULL;
            if (loom_kv_pull_open(addrs, &ours, K, sizeof K - 1, path ? LOOM_KV_SHM_AUTO : LOOM_KV_SHM_OFF,
                                  loom_comm_deadline(10000), &c, &theirs, &err) < 0) {
                fprintf(stderr, "bench_kv_xfer: %s\n", err.msg);
                return 1;
            }
            if (loom_kv_pull_shm(c) != path) {
                fprintf(stderr, "bench_kv_xfer: the %s path was not taken\n", path ? "shm" : "tcp");
                return 1;
            }
            for (int h = 0; h < 2; h++) { /* all heads, then half (a TP=2 decode rank's read of a TP=1 prefill) */
                const void *slices = NULL;
                size_t want = h ? half : all_bytes;
                t0 = loom_now_ns();
                if (loom_kv_pull_read(c, 7, ids, N_POOL, h ? HEADS / 2 : 0, h ? HEADS / 2 : HEADS, want, &slices,
                                      loom_comm_deadline(60000), &err) < 0) {
                    fprintf(stderr, "bench_kv_xfer: %s\n", err.msg);
                    return 1;
                }
                gbs[path][h] = (double)want / ((double)(loom_now_ns() - t0) * 1e-9) / 1e9;
                best[path][h] = LOOM_MAX(best[path][h], gbs[path][h]);
            }
            loom_kv_pull_close(&c);
        }
        printf("  round %d: raw tcp %.2f GB/s | KV tcp %.2f GB/s (%.2fx raw), half the heads %.2f | KV shm %.2f GB/s "
               "(%.2fx raw, %.2fx KV tcp), half the heads %.2f\n", r, raw, gbs[0][0], gbs[0][0] / raw, gbs[0][1],
               gbs[1][0], gbs[1][0] / raw, gbs[1][0] / gbs[0][0], gbs[1][1]);
        best_raw = LOOM_MAX(best_raw, raw);
    }
    printf("best: raw tcp %.2f GB/s; KV tcp %.2f GB/s (%.2fx raw), half the heads %.2f; KV shm %.2f GB/s (%.2fx raw, "
           "%.2fx KV tcp), half the heads %.2f (%.2fx KV tcp's half)\n", best_raw, best[0][0], best[0][0] / best_raw,
           best[0][1], best[1][0], best[1][0] / best_raw, best[1][0] / best[0][0], best[1][1],
           best[1][1] / best[0][1]);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    free(buf);
    return 0;
}
