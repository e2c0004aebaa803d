/* The directory tier's files (docs/kv-offload.md): one file per KV block
 * and shard, named by the tier identity (model, tokenizer, KV dtype, block
 * size and bytes, grid shape, layout) and the block's prefix-cache chain
 * hash, so replicas of one model and grid share files and any other model
 * or shard layout never reads them. Shared by the coordinator (which asks
 * whether a block is there, and checks it) and the workers (which write and
 * read their shard's span).
 *
 * A file: a header (magic, version, shard, tier id, chain hash, payload
 * bytes, checksum of the payload) then the block's span. Written under a
 * temporary name and renamed (a reader never sees half a file); a file that
 * fails any check on reading is a miss, logged and deleted. */
#ifndef LOOM_KV_TIER_H
#define LOOM_KV_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define LOOM_KV_TIER_SUFFIX ".kvb"

/* "<dir>/<tier id hex>-<hash hex>-<shard>.kvb"; shard = stage * tp + rank. */
void loom_kv_tier_path(char *out, size_t n, const char *dir, uint64_t tier_id, uint64_t hash, int shard);

/* Writes the block (atomically: temp + rename). A file already there is
 * left as it is (same name, same content) and its time refreshed. */
loom_status_t loom_kv_tier_write(const char *dir, uint64_t tier_id, uint64_t hash, int shard, const void *data,
                                 size_t bytes, loom_err_t *err);

/* Reads a block into dst (bytes): NOT_FOUND when there is no file; a file
 * whose header or checksum is wrong is deleted (DATA: LOOM_ERR_FORMAT). */
loom_status_t loom_kv_tier_read(const char *dir, uint64_t tier_id, uint64_t hash, int shard, void *dst, size_t bytes,
                                loom_err_t *err);

/* A block file read in pieces, in order (the directory tier's loads read
 * layer by layer, so attention of layer l waits only for layer l): open
 * checks the header (NOT_FOUND / FORMAT as loom_kv_tier_read), read_next
 * fills the next n bytes (a multiple of 8, or the rest), close checks the
 * checksum once every byte was read (a bad file deleted and logged:
 * FORMAT) and closes; a reader closed early says nothing of the file. */
typedef struct loom_kv_tier_reader {
    int fd;
    int bad;
    size_t left;
    uint64_t sum, want;
    char path[4096];
} loom_kv_tier_reader_t;
loom_status_t loom_kv_tier_open(loom_kv_tier_reader_t *r, const char *dir, uint64_t tier_id, uint64_t hash,
                                int shard, size_t bytes, loom_err_t *err);
loom_status_t loom_kv_tier_read_next(loom_kv_tier_reader_t *r, void *dst, size_t n, loom_err_t *err);
loom_status_t loom_kv_tier_close(loom_kv_tier_reader_t *r, loom_err_t *err);

/* Whether the block's file is there and whole (header and checksum read
 * through; a bad one deleted and logged). Refreshes its time (LRU). */
int loom_kv_tier_check(const char *dir, uint64_t tier_id, uint64_t hash, int shard, size_t bytes);

/* Deletes the least recently used block files (by modification time) until
 * the directory's block files take at most max_bytes; returns the bytes
 * they take afterwards. */
uint64_t loom_kv_tier_trim(const char *dir, uint64_t max_bytes);

/* Bytes a block file of a span of `bytes` takes (its header included). */
uint64_t loom_kv_tier_file_bytes(size_t bytes);

/* 64-bit checksum of a span (the file's). */
uint64_t loom_kv_tier_checksum(const void *data, size_t bytes);

#endif
