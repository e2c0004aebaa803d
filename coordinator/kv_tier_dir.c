/* The directory tier's coordinator half (kv_tier_dir.h). */
#include "coordinator/kv_tier_dir.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_tier.h"
#include "common/util.h"

/* Files read through recently: a waiting request asked again each step
 * (it waits for memory) must not read its blocks each time. A file whose
 * size and modification time are those it had when it was read through is
 * taken as whole (writers never change a file in place: they rename). */
#define VERIFIED 4096

typedef struct {
    uint64_t key;   /* hash ^ shard mix (0: empty) */
    int64_t mtime_ns;
    int64_t size;
} verified_t;

typedef struct {
    loom_kv_connector_t base; /* first: the connector's address is the tier's */
    char *dir;
    uint64_t tier_id;
    int n_shards;
    uint64_t *shard_bytes;
    verified_t verified[VERIFIED];
} dir_conn_t;

static uint64_t verified_key(uint64_t hash, int shard) {
    uint64_t k = hash ^ ((uint64_t)(shard + 1) * 0x9e3779b97f4a7c15ull);
    return k ? k : 1;
}

static int stat_of(const dir_conn_t *d, uint64_t hash, int shard, int64_t *mtime_ns, int64_t *size) {
    char path[4096];
    loom_kv_tier_path(path, sizeof path, d->dir, d->tier_id, hash, shard);
    struct stat st;
    if (stat(path, &st) != 0) return -1;
    *mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec;
    *size = (int64_t)st.st_size;
    return 0;
}

/* One shard's file of block `hash` is there and whole; its time is
 * refreshed (about to be loaded: the last the LRU trim takes). */
static int shard_whole(dir_conn_t *d, uint64_t hash, int shard) {
    uint64_t k = verified_key(hash, shard);
    verified_t *v = &d->verified[k % VERIFIED];
    int64_t mt, sz;
    int known = v->key == k && stat_of(d, hash, shard, &mt, &sz) == 0 && mt == v->mtime_ns && sz == v->size;
    if (known) {
        char path[4096];
        loom_kv_tier_path(path, sizeof path, d->dir, d->tier_id, hash, shard);
        utimensat(AT_FDCWD, path, NULL, 0);
    } else if (!loom_kv_tier_check(d->dir, d->tier_id, hash, shard, (size_t)d->shard_bytes[shard])) {
        return 0;
    }
    if (stat_of(d, hash, shard, &mt, &sz) == 0) *v = (verified_t){.key = k, .mtime_ns = mt, .size = sz};
    return 1;
}

/* Every shard's file of block `hash` is there and whole. */
static int block_whole(dir_conn_t *d, uint64_t hash) {
    for (int sh = 0; sh < d->n_shards; sh++)
        if (!shard_whole(d, hash, sh)) return 0;
    return 1;
}

static int dir_match(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async) {
    dir_conn_t *d = (dir_conn_t *)c;
    *async = 0;
    if (d->n_shards == 0) return 0;
    int first = n_local / r->block_size, last = (r->n_tokens - 1) / r->block_size, n = 0;
    for (int i = first; i < last && block_whole(d, r->block_hashes[i]); i++) n++;
    return n * r->block_size;
}

static int dir_offer(loom_kv_connector_t *c, uint64_t hash) {
    dir_conn_t *d = (dir_conn_t *)c;
    if (d->n_shards == 0) return 0;
    char path[4096];
    loom_kv_tier_path(path, sizeof path, d->dir, d->tier_id, hash, 0);
    if (access(path, F_OK) != 0) return 1;
    utimensat(AT_FDCWD, path, NULL, 0); /* used again: the last to go */
    return 0;
}

static void dir_destroy(loom_kv_connector_t *c) {
    dir_conn_t *d = (dir_conn_t *)c;
    free(d->dir);
    free(d->shard_bytes);
    free(d);
}

static const loom_kv_connector_ops_t dir_ops = {
    .match = dir_match, .offer = dir_offer, .destroy = dir_destroy};

loom_kv_connector_t *loom_kv_dir_connector_create(const char *dir, int write_through) {
    dir_conn_t *d = loom_xcalloc(1, sizeof *d);
    d->base.ops = &dir_ops;
    d->base.tier = "dir";
    d->base.write_through = write_through;
    d->dir = loom_xstrdup(dir);
    return &d->base;
}

void loom_kv_dir_connector_set_grid(loom_kv_connector_t *c, uint64_t tier_id, int n_shards,
                                    const uint64_t *shard_bytes) {
    dir_conn_t *d = (dir_conn_t *)c;
    d->tier_id = tier_id;
    d->n_shards = n_shards;
    d->shard_bytes = loom_xrealloc(d->shard_bytes, (size_t)(n_shards > 0 ? n_shards : 1) * sizeof *d->shard_bytes);
    memset(d->verified, 0, sizeof d->verified); /* another grid: other files */
    memcpy(d->shard_bytes, shard_bytes, (size_t)n_shards * sizeof *shard_bytes);
}

int loom_kv_dir_connector_whole(loom_kv_connector_t *c, const uint64_t *hashes, int n) {
    dir_conn_t *d = (dir_conn_t *)c;
    int i = 0;
    while (d->n_shards > 0 && i < n && block_whole(d, hashes[i])) i++;
    return i;
}
