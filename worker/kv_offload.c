/* The worker's half of the directory tier (kv_offload.h). */
#include "worker/kv_offload.h"

#include <stdio.h>
#include <string.h>

#include "common/kv_tier.h"
#include "common/log.h"

loom_status_t loom_kv_offload_config(loom_kv_offload_t *o, const loom_model_t *m, const char *dir, uint64_t tier_id,
                                     uint64_t max_bytes, int shard, loom_err_t *err) {
    memset(o, 0, sizeof *o);
    if (!dir || !*dir) return LOOM_OK;
    if (!loom_model_kv_block_contiguous(m))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "--kv-offloading-dir needs KV blocks that are one contiguous span across the layers; "
                            "this worker's pool is layer-major (the CUDA backend's, or a DeepSeek MLA cache)");
    if (strlen(dir) >= sizeof o->dir)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--kv-offloading-dir is too long");
    snprintf(o->dir, sizeof o->dir, "%s", dir);
    o->tier_id = tier_id;
    o->max_bytes = max_bytes;
    o->shard = shard;
    o->bytes = loom_kv_tier_trim(dir, max_bytes);
    LOOM_INFO("KV offload: directory tier %s (shard %d, %zu bytes a block, %.1f MB there)", dir, shard,
              loom_model_kv_block_bytes(m, loom_model_kv_block_size(m)), (double)o->bytes / 1e6);
    return LOOM_OK;
}

void loom_kv_offload_put(loom_kv_offload_t *o, uint64_t hash, const void *src, size_t span) {
    if (o->broken || !o->dir[0]) return;
    loom_err_t err = {0};
    if (loom_kv_tier_write(o->dir, o->tier_id, hash, o->shard, src, span, &err) < 0) {
        LOOM_WARN("KV offload: %s; no more blocks are saved to %s (the tier only serves what it has)", err.msg, o->dir);
        o->broken = 1;
        return;
    }
    o->bytes += loom_kv_tier_file_bytes(span);
}

loom_status_t loom_kv_offload_get(loom_kv_offload_t *o, uint64_t hash, void *dst, size_t span, loom_err_t *err) {
    if (!o->dir[0])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the plan loads a KV block from the directory but this worker has no directory tier");
    loom_status_t s = loom_kv_tier_read(o->dir, o->tier_id, hash, o->shard, dst, span, err);
    if (s < 0) {
        char why[sizeof err->msg];
        snprintf(why, sizeof why, "%s", err->msg);
        return loom_err_set(err, s, "KV block %016llx (shard %d) could not be loaded: %s", (unsigned long long)hash,
                            o->shard, why);
    }
    return LOOM_OK;
}

static void save_all(loom_kv_offload_t *o, const loom_model_t *m, const int32_t *blocks, const uint64_t *hashes,
                     size_t n, size_t span) {
    for (size_t i = 0; i < n && !o->broken; i++)
        loom_kv_offload_put(o, hashes[i], loom_model_kv_block_ptr(m, blocks[i]), span);
}

/* Over the bound: the least recently used files go. After the step's loads,
 * so none of its own blocks goes before it is read. */
static void trim(loom_kv_offload_t *o) {
    if (o->bytes > o->max_bytes) o->bytes = loom_kv_tier_trim(o->dir, o->max_bytes);
}

void loom_kv_offload_trim(loom_kv_offload_t *o) {
    if (o->dir[0]) trim(o);
}

void loom_kv_offload_save(loom_kv_offload_t *o, const loom_model_t *m, const int32_t *blocks, const uint64_t *hashes,
                          size_t n) {
    if (!n || !o->dir[0]) return;
    save_all(o, m, blocks, hashes, n, loom_model_kv_block_bytes(m, loom_model_kv_block_size(m)));
    trim(o);
}

loom_status_t loom_kv_offload_step(loom_kv_offload_t *o, const loom_model_t *m, const int32_t *save_blocks,
                                   const uint64_t *save_hashes, size_t n_save, const int32_t *load_blocks,
                                   const uint64_t *load_hashes, size_t n_load, loom_err_t *err) {
    if (!n_save && !n_load) return LOOM_OK;
    if (!o->dir[0])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the plan moves KV blocks but this worker has no tier");
    size_t span = loom_model_kv_block_bytes(m, loom_model_kv_block_size(m));
    save_all(o, m, save_blocks, save_hashes, n_save, span);
    for (size_t i = 0; i < n_load; i++) {
        loom_status_t s = loom_kv_offload_get(o, load_hashes[i], loom_model_kv_block_ptr(m, load_blocks[i]), span, err);
        if (s < 0) {
            trim(o);
            return s;
        }
    }
    trim(o);
    return LOOM_OK;
}
