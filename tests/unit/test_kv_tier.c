/* The directory tier: its block files (common/kv_tier.h) and its
 * coordinator connector (coordinator/kv_tier_dir.h): a block written is
 * read back bit for bit; another tier identity, hash or shard never reads
 * it; a corrupted or truncated file is a miss and is deleted; the LRU trim
 * keeps the newest files within the bound; match counts the blocks whole
 * for every shard, offer asks only for blocks the directory lacks. */
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/block_hash.h"
#include "common/kv_tier.h"
#include "coordinator/kv_tier_dir.h"
#include "tests/test.h"

#define SPAN 4096

static char g_dir[256];

static void fill(unsigned char *b, int seed) {
    for (int i = 0; i < SPAN; i++) b[i] = (unsigned char)(i * 31 + seed * 7);
}

static int exists(uint64_t id, uint64_t hash, int shard) {
    char p[4096];
    loom_kv_tier_path(p, sizeof p, g_dir, id, hash, shard);
    return access(p, F_OK) == 0;
}

static void test_roundtrip(void) {
    unsigned char a[SPAN], b[SPAN];
    fill(a, 1);
    loom_err_t err = {0};
    CHECK(loom_kv_tier_write(g_dir, 7, 0xabc, 0, a, SPAN, &err) == LOOM_OK);
    CHECK(loom_kv_tier_write(g_dir, 7, 0xabc, 0, a, SPAN, &err) == LOOM_OK); /* already there: kept */
    memset(b, 0, SPAN);
    CHECK(loom_kv_tier_read(g_dir, 7, 0xabc, 0, b, SPAN, &err) == LOOM_OK && !memcmp(a, b, SPAN));
    CHECK(loom_kv_tier_read(g_dir, 8, 0xabc, 0, b, SPAN, &err) == LOOM_ERR_NOT_FOUND); /* another model or grid */
    CHECK(loom_kv_tier_read(g_dir, 7, 0xabd, 0, b, SPAN, &err) == LOOM_ERR_NOT_FOUND);
    CHECK(loom_kv_tier_read(g_dir, 7, 0xabc, 1, b, SPAN, &err) == LOOM_ERR_NOT_FOUND); /* another shard */
    CHECK(loom_kv_tier_check(g_dir, 7, 0xabc, 0, SPAN));
    CHECK(!loom_kv_tier_check(g_dir, 7, 0xabc, 0, SPAN / 2)); /* another block size: bad, deleted */
    CHECK(!exists(7, 0xabc, 0));
}

static void test_corrupt(void) {
    unsigned char a[SPAN], b[SPAN];
    fill(a, 2);
    loom_err_t err = {0};
    char p[4096];
    CHECK(loom_kv_tier_write(g_dir, 7, 0x111, 0, a, SPAN, &err) == LOOM_OK);
    loom_kv_tier_path(p, sizeof p, g_dir, 7, 0x111, 0);
    int fd = open(p, O_RDWR);
    CHECK(fd >= 0);
    unsigned char x;
    CHECK(pread(fd, &x, 1, 1000) == 1);
    x ^= 0x40;
    CHECK(pwrite(fd, &x, 1, 1000) == 1);
    close(fd);
    CHECK(loom_kv_tier_read(g_dir, 7, 0x111, 0, b, SPAN, &err) == LOOM_ERR_FORMAT);
    CHECK(strstr(err.msg, "checksum") != NULL);
    CHECK(!exists(7, 0x111, 0));
    CHECK(loom_kv_tier_write(g_dir, 7, 0x222, 0, a, SPAN, &err) == LOOM_OK);
    loom_kv_tier_path(p, sizeof p, g_dir, 7, 0x222, 0);
    CHECK(truncate(p, 100) == 0);
    CHECK(loom_kv_tier_read(g_dir, 7, 0x222, 0, b, SPAN, &err) == LOOM_ERR_FORMAT);
    CHECK(!exists(7, 0x222, 0));
}

static void test_trim(void) {
    unsigned char a[SPAN];
    loom_err_t err = {0};
    for (int i = 0; i < 6; i++) {
        fill(a, i);
        CHECK(loom_kv_tier_write(g_dir, 9, 0x1000 + (uint64_t)i, 0, a, SPAN, &err) == LOOM_OK);
        char p[4096];
        loom_kv_tier_path(p, sizeof p, g_dir, 9, 0x1000 + (uint64_t)i, 0);
        struct timespec t[2] = {{.tv_sec = 1000000 + i}, {.tv_sec = 1000000 + i}};
        CHECK(utimensat(AT_FDCWD, p, t, 0) == 0);
    }
    uint64_t file = loom_kv_tier_file_bytes(SPAN);
    CHECK(file > SPAN);
    uint64_t left = loom_kv_tier_trim(g_dir, 3 * file + 10);
    CHECK(left <= 3 * file + 10 && left >= 3 * file);
    for (int i = 0; i < 6; i++) CHECKF(exists(9, 0x1000 + (uint64_t)i, 0) == (i >= 3), "file %d", i);
    loom_kv_tier_trim(g_dir, 0);
    for (int i = 0; i < 6; i++) CHECK(!exists(9, 0x1000 + (uint64_t)i, 0));
}

static void test_connector(void) {
    const int B = 4;
    int32_t toks[18];
    for (int i = 0; i < 18; i++) toks[i] = 100 + i;
    uint64_t h[4], p = 0;
    for (int i = 0; i < 4; i++) h[i] = p = loom_kv_chain_hash(p, toks + i * B, B);
    loom_kv_connector_t *c = loom_kv_dir_connector_create(g_dir, 0);
    loom_kv_conn_req_t r = {.id = 1, .tokens = toks, .n_tokens = 18, .block_hashes = h, .block_size = B};
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == 0); /* no grid yet */
    uint64_t bytes[2] = {SPAN, SPAN / 2};
    loom_kv_dir_connector_set_grid(c, 5, 2, bytes);
    CHECK(loom_kv_connector_offer(c, h[0]) == 1);
    unsigned char a[SPAN];
    fill(a, 3);
    loom_err_t err = {0};
    for (int i = 0; i < 3; i++) { /* blocks 0..2 whole on both shards, block 3 on shard 0 only */
        CHECK(loom_kv_tier_write(g_dir, 5, h[i], 0, a, SPAN, &err) == LOOM_OK);
        CHECK(loom_kv_tier_write(g_dir, 5, h[i], 1, a, SPAN / 2, &err) == LOOM_OK);
    }
    CHECK(loom_kv_tier_write(g_dir, 5, h[3], 0, a, SPAN, &err) == LOOM_OK);
    CHECK(loom_kv_connector_offer(c, h[0]) == 0 && loom_kv_connector_offer(c, h[3]) == 0);
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == 3 * B);
    CHECK(loom_kv_connector_match(c, &r, B, NULL) == 2 * B);
    /* block 1's second shard is bad: the run stops before it */
    char path[4096];
    loom_kv_tier_path(path, sizeof path, g_dir, 5, h[1], 1);
    CHECK(truncate(path, 64) == 0);
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == B);
    loom_kv_connector_destroy(&c);
    loom_kv_tier_trim(g_dir, 0);
}

/* Waits (at most ~10 s) until c's checker has nothing queued or running;
 * the descriptor woke for what finished. */
static int checks_settle(loom_kv_connector_t *c, int fd) {
    int woke = 0;
    for (int i = 0; i < 1000 && loom_kv_dir_connector_checking(c) > 0; i++) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        poll(&p, 1, 10);
        woke += loom_kv_dir_connector_drain(c);
    }
    return woke + loom_kv_dir_connector_drain(c);
}

static void test_connector_checks(void) {
    const int B = 4;
    int32_t toks[22];
    for (int i = 0; i < 22; i++) toks[i] = 200 + i;
    uint64_t h[5], p = 0;
    for (int i = 0; i < 5; i++) h[i] = p = loom_kv_chain_hash(p, toks + i * B, B);
    uint64_t bytes[2] = {SPAN, SPAN / 2};
    unsigned char a[SPAN];
    fill(a, 4);
    loom_err_t err = {0};
    for (int i = 0; i < 3; i++) { /* blocks 0..2 whole, block 3 truncated on shard 1, block 4 absent */
        CHECK(loom_kv_tier_write(g_dir, 6, h[i], 0, a, SPAN, &err) == LOOM_OK);
        CHECK(loom_kv_tier_write(g_dir, 6, h[i], 1, a, SPAN / 2, &err) == LOOM_OK);
    }
    CHECK(loom_kv_tier_write(g_dir, 6, h[3], 0, a, SPAN, &err) == LOOM_OK);
    CHECK(loom_kv_tier_write(g_dir, 6, h[3], 1, a, SPAN / 2, &err) == LOOM_OK);
    char path[4096];
    loom_kv_tier_path(path, sizeof path, g_dir, 6, h[3], 1);
    CHECK(truncate(path, 64) == 0);
    loom_kv_conn_req_t r = {.id = 7, .tokens = toks, .n_tokens = 22, .block_hashes = h, .block_size = B};

    /* a long wait: nothing known at first, the request waits for the checks */
    setenv("LOOM_TEST_KV_CHECK_DELAY_MS", "20", 1);
    loom_kv_connector_t *c = loom_kv_dir_connector_create(g_dir, 0);
    loom_kv_dir_connector_set_grid(c, 6, 2, bytes);
    int fd = loom_kv_dir_connector_start_checks(c, 60000);
    unsetenv("LOOM_TEST_KV_CHECK_DELAY_MS");
    CHECK(fd >= 0);
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == 0);
    CHECK(loom_kv_connector_waiting(c, &r) == 1);
    CHECK(loom_kv_dir_connector_checking(c) == 4); /* blocks 0..3 queued; block 4's file is not there */
    loom_kv_conn_req_t other = r;
    other.id = 8;
    CHECK(loom_kv_connector_waiting(c, &other) == 0); /* the answer is the last match's request's */
    CHECK(checks_settle(c, fd) == 4);
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == 3 * B); /* block 3 found not whole: a miss */
    CHECK(loom_kv_connector_waiting(c, &r) == 0);
    CHECK(loom_kv_dir_connector_checking(c) == 0);
    CHECK(loom_kv_connector_match(c, &r, B, NULL) == 2 * B);
    /* a file changed since it was read through is checked again */
    CHECK(loom_kv_tier_write(g_dir, 6, h[1], 1, a, SPAN / 2, &err) == LOOM_OK);
    struct timespec later[2] = {{.tv_sec = 2000000000}, {.tv_sec = 2000000000}};
    loom_kv_tier_path(path, sizeof path, g_dir, 6, h[1], 1);
    CHECK(utimensat(AT_FDCWD, path, later, 0) == 0);
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == B);
    CHECK(loom_kv_connector_waiting(c, &r) == 1);
    checks_settle(c, fd);
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == 3 * B);
    loom_kv_connector_destroy(&c);

    /* timeout 0: never waits, the checks still run for later requests */
    c = loom_kv_dir_connector_create(g_dir, 0);
    loom_kv_dir_connector_set_grid(c, 6, 2, bytes);
    fd = loom_kv_dir_connector_start_checks(c, 0);
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == 0);
    CHECK(loom_kv_connector_waiting(c, &r) == 0);
    checks_settle(c, fd);
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == 3 * B);
    /* destroyed with checks queued: the thread stops */
    loom_kv_dir_connector_set_grid(c, 6, 2, bytes); /* another grid: nothing known */
    CHECK(loom_kv_connector_match(c, &r, 0, NULL) == 0);
    loom_kv_connector_destroy(&c);
    loom_kv_tier_trim(g_dir, 0);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/loom-test-kv-tier-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    RUN(test_roundtrip);
    RUN(test_corrupt);
    RUN(test_trim);
    RUN(test_connector);
    RUN(test_connector_checks);
    loom_kv_tier_trim(g_dir, 0);
    rmdir(g_dir);
    return test_summary();
}
