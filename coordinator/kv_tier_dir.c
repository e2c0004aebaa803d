/* The directory tier's coordinator half (kv_tier_dir.h). */
#include "coordinator/kv_tier_dir.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_tier.h"
#include "common/util.h"

typedef struct {
    loom_kv_connector_t base; /* first: the connector's address is the tier's */
    char *dir;
    uint64_t tier_id;
    int n_shards;
    uint64_t *shard_bytes;
} dir_conn_t;

/* Every shard's file of block `hash` is there and whole. */
static int block_whole(const dir_conn_t *d, uint64_t hash) {
    for (int sh = 0; sh < d->n_shards; sh++)
        if (!loom_kv_tier_check(d->dir, d->tier_id, hash, sh, (size_t)d->shard_bytes[sh])) return 0;
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
    memcpy(d->shard_bytes, shard_bytes, (size_t)n_shards * sizeof *shard_bytes);
}

int loom_kv_dir_connector_whole(const loom_kv_connector_t *c, const uint64_t *hashes, int n) {
    const dir_conn_t *d = (const dir_conn_t *)c;
    int i = 0;
    while (d->n_shards > 0 && i < n && block_whole(d, hashes[i])) i++;
    return i;
}
