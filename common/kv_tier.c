/* The directory tier's block files (kv_tier.h). */
#include "common/kv_tier.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

#define MAGIC 0x3142564b4d4f4f4cull /* "LOOMKVB1" little-endian */
#define VERSION 1u

typedef struct {
    uint64_t magic;
    uint32_t version, shard;
    uint64_t tier_id, hash, bytes, checksum;
} header_t;

/* The checksum, fed in pieces: every piece but the last a multiple of 8
 * bytes gives the one-shot value. */
static uint64_t sum_init(size_t bytes) { return 0x9e3779b97f4a7c15ull ^ (uint64_t)bytes; }
static uint64_t sum_update(uint64_t h, const void *data, size_t bytes) {
    const unsigned char *p = data;
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    for (; i < bytes; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
static uint64_t sum_final(uint64_t h) { return h ^ (h >> 29); }

uint64_t loom_kv_tier_checksum(const void *data, size_t bytes) {
    return sum_final(sum_update(sum_init(bytes), data, bytes));
}

uint64_t loom_kv_tier_file_bytes(size_t bytes) { return sizeof(header_t) + (uint64_t)bytes; }

void loom_kv_tier_path(char *out, size_t n, const char *dir, uint64_t tier_id, uint64_t hash, int shard) {
    snprintf(out, n, "%s/%016llx-%016llx-%d%s", dir, (unsigned long long)tier_id, (unsigned long long)hash, shard,
             LOOM_KV_TIER_SUFFIX);
}

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int read_all(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n > 0) {
        ssize_t k = read(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

loom_status_t loom_kv_tier_write(const char *dir, uint64_t tier_id, uint64_t hash, int shard, const void *data,
                                 size_t bytes, loom_err_t *err) {
    char path[4096], tmp[4200];
    loom_kv_tier_path(path, sizeof path, dir, tier_id, hash, shard);
    if (access(path, F_OK) == 0) {
        utimensat(AT_FDCWD, path, NULL, 0); /* another replica (or an earlier eviction) wrote it: keep it warm */
        return LOOM_OK;
    }
    /* unique per process and call: replicas sharing the directory never write one temp file */
    static _Thread_local unsigned seq;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%u", path, (long)getpid(), seq++);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return loom_err_set(err, LOOM_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    header_t h = {.magic = MAGIC, .version = VERSION, .shard = (uint32_t)shard, .tier_id = tier_id, .hash = hash,
                  .bytes = bytes, .checksum = loom_kv_tier_checksum(data, bytes)};
    int bad = write_all(fd, &h, sizeof h) < 0 || write_all(fd, data, bytes) < 0;
    int e = errno;
    if (close(fd) != 0 && !bad) bad = 1, e = errno;
    if (bad || rename(tmp, path) != 0) {
        if (!bad) e = errno;
        unlink(tmp);
        return loom_err_set(err, LOOM_ERR_IO, "cannot write %s: %s", path, strerror(e));
    }
    return LOOM_OK;
}

/* Opens and checks the header of a block file; -1 with err set (NOT_FOUND
 * when absent, FORMAT when the header is not this block's). */
static int open_checked(const char *path, uint64_t tier_id, uint64_t hash, int shard, size_t bytes, header_t *h,
                        loom_err_t *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        loom_err_set(err, errno == ENOENT ? LOOM_ERR_NOT_FOUND : LOOM_ERR_IO, "%s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (read_all(fd, h, sizeof *h) < 0 || h->magic != MAGIC || h->version != VERSION || h->tier_id != tier_id ||
        h->hash != hash || h->shard != (uint32_t)shard || h->bytes != bytes || fstat(fd, &st) != 0 ||
        (uint64_t)st.st_size != sizeof *h + bytes) {
        close(fd);
        loom_err_set(err, LOOM_ERR_FORMAT, "%s is not a whole block of this tier (header or size wrong)", path);
        return -1;
    }
    return fd;
}

/* A bad file is a miss: said once in the log, and deleted so that no one reads it again. */
static void drop_bad(const char *path, const loom_err_t *err) {
    LOOM_WARN("KV tier: %s; deleted (a miss: the block is recomputed)", err->msg);
    unlink(path);
}

loom_status_t loom_kv_tier_read(const char *dir, uint64_t tier_id, uint64_t hash, int shard, void *dst, size_t bytes,
                                loom_err_t *err) {
    loom_kv_tier_reader_t r;
    loom_status_t s = loom_kv_tier_open(&r, dir, tier_id, hash, shard, bytes, err);
    if (s < 0) return s;
    loom_err_t read_err = {0};
    if (loom_kv_tier_read_next(&r, dst, bytes, &read_err) < 0) r.bad = 1;
    return loom_kv_tier_close(&r, err);
}

int loom_kv_tier_check(const char *dir, uint64_t tier_id, uint64_t hash, int shard, size_t bytes) {
    void *buf = malloc(bytes ? bytes : 1);
    if (!buf) return 0;
    loom_err_t err = {0};
    int ok = loom_kv_tier_read(dir, tier_id, hash, shard, buf, bytes, &err) == LOOM_OK;
    free(buf);
    if (ok) {
        char path[4096];
        loom_kv_tier_path(path, sizeof path, dir, tier_id, hash, shard);
        utimensat(AT_FDCWD, path, NULL, 0);
    }
    return ok;
}

loom_status_t loom_kv_tier_open(loom_kv_tier_reader_t *r, const char *dir, uint64_t tier_id, uint64_t hash,
                                int shard, size_t bytes, loom_err_t *err) {
    *r = (loom_kv_tier_reader_t){.fd = -1};
    loom_kv_tier_path(r->path, sizeof r->path, dir, tier_id, hash, shard);
    header_t h;
    r->fd = open_checked(r->path, tier_id, hash, shard, bytes, &h, err);
    if (r->fd < 0) {
        if (err->code == LOOM_ERR_FORMAT) drop_bad(r->path, err);
        return err->code;
    }
    r->want = h.checksum;
    r->sum = sum_init(bytes);
    r->left = bytes;
    return LOOM_OK;
}

loom_status_t loom_kv_tier_read_next(loom_kv_tier_reader_t *r, void *dst, size_t n, loom_err_t *err) {
    LOOM_ASSERT(r->fd >= 0 && n <= r->left && (n % 8 == 0 || n == r->left));
    if (read_all(r->fd, dst, n) < 0) {
        loom_err_set(err, LOOM_ERR_FORMAT, "%s: short read", r->path);
        r->bad = 1;
        return LOOM_ERR_FORMAT;
    }
    r->sum = sum_update(r->sum, dst, n);
    r->left -= n;
    return LOOM_OK;
}

loom_status_t loom_kv_tier_close(loom_kv_tier_reader_t *r, loom_err_t *err) {
    if (r->fd < 0) return LOOM_OK;
    close(r->fd);
    r->fd = -1;
    if (!r->bad && r->left == 0 && sum_final(r->sum) == r->want) return LOOM_OK;
    if (!r->bad && r->left > 0) return LOOM_OK; /* abandoned before the end: nothing said of the file */
    loom_err_set(err, LOOM_ERR_FORMAT, "%s: checksum mismatch", r->path);
    drop_bad(r->path, err);
    return LOOM_ERR_FORMAT;
}

typedef struct {
    char name[256];
    int64_t mtime_ns;
    uint64_t size;
} entry_t;

static int older(const void *a, const void *b) {
    const entry_t *x = a, *y = b;
    return x->mtime_ns < y->mtime_ns ? -1 : x->mtime_ns > y->mtime_ns;
}

static int is_block_file(const char *name) {
    size_t n = strlen(name), k = strlen(LOOM_KV_TIER_SUFFIX);
    return n > k && n < 256 && !strcmp(name + n - k, LOOM_KV_TIER_SUFFIX);
}

uint64_t loom_kv_tier_trim(const char *dir, uint64_t max_bytes) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    entry_t *e = NULL;
    size_t n = 0, cap = 0;
    uint64_t total = 0;
    char path[4400];
    for (struct dirent *de; (de = readdir(d));) {
        if (!is_block_file(de->d_name)) continue;
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 256;
            e = loom_xrealloc(e, cap * sizeof *e);
        }
        snprintf(e[n].name, sizeof e[n].name, "%s", de->d_name);
        e[n].mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec;
        e[n].size = (uint64_t)st.st_size;
        total += e[n].size;
        n++;
    }
    closedir(d);
    if (total > max_bytes) {
        qsort(e, n, sizeof *e, older);
        for (size_t i = 0; i < n && total > max_bytes; i++) {
            snprintf(path, sizeof path, "%s/%s", dir, e[i].name);
            if (unlink(path) == 0 || errno == ENOENT) total -= e[i].size; /* a replica beside us may have taken it */
        }
    }
    free(e);
    return total;
}
