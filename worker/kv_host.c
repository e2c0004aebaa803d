/* The worker's half of the host-memory KV tier (kv_host.h). */
#include "worker/kv_host.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

void loom_kv_host_free(loom_kv_host_t *h) {
    if (h->arena) loom_backend_host_free(h->be, h->arena);
    free(h->hash);
    memset(h, 0, sizeof *h);
}

loom_status_t loom_kv_host_config(loom_kv_host_t *h, loom_backend_t *be, const loom_model_t *m, int n_slots,
                                  loom_err_t *err) {
    loom_kv_host_free(h);
    if (n_slots <= 0) return LOOM_OK;
    size_t span = loom_model_kv_block_bytes(m, loom_model_kv_block_size(m));
    size_t bytes = span * (size_t)n_slots;
    h->be = be;
    h->arena = loom_backend_host_alloc(h->be, bytes);
    if (!h->arena)
        return loom_err_set(err, LOOM_ERR_NOMEM,
                            "--kv-offloading-size: out of host memory for %d KV blocks of %zu bytes (%.2f GB)",
                            n_slots, span, (double)bytes / 1e9);
    h->hash = loom_xcalloc((size_t)n_slots, sizeof *h->hash);
    h->n_slots = n_slots;
    h->span = span;
    LOOM_INFO("KV offload: host tier of %d blocks of %zu bytes (%.2f GB%s)", n_slots, span, (double)bytes / 1e9,
              loom_backend_kind(h->be) == LOOM_DEVICE_CUDA ? ", pinned" : "");
    return LOOM_OK;
}

/* What slot s holds once the first n saves are done. */
static uint64_t held_after(const loom_kv_host_t *h, int s, const int32_t *save_blocks, const uint64_t *save_hashes,
                           const int32_t *save_slots, size_t n) {
    uint64_t held = h->hash[s];
    for (size_t j = 0; j < n; j++)
        if (save_slots[j] == s && save_blocks[j] >= 0) held = save_hashes[j];
    return held;
}

loom_status_t loom_kv_host_step(loom_kv_host_t *h, loom_model_t *m, loom_kv_offload_t *lower,
                                const int32_t *save_blocks, const uint64_t *save_hashes, const int32_t *save_slots,
                                size_t n_save, const int32_t *load_blocks, const uint64_t *load_hashes,
                                const int32_t *load_slots, size_t n_load, loom_err_t *err) {
    if (!n_save && !n_load) return LOOM_OK;
    int has_lower = lower && lower->dir[0];
    if (!h->n_slots && !has_lower)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the plan moves KV blocks to host slots but this worker "
                                                            "has no host tier");
    for (size_t i = 0; i < n_save; i++) {
        int s = save_slots[i];
        if (s == -1 && save_blocks[i] >= 0 && has_lower) continue; /* a pool block straight to the directory */
        if (s < 0 || s >= h->n_slots)
            return loom_err_set(err, LOOM_ERR_FORMAT, "KV save %zu: host slot %d out of range (%d slots%s)", i, s,
                                h->n_slots, has_lower ? "" : ", no directory tier");
        if (save_blocks[i] >= 0) continue;
        /* a spill: the slot must hold its block at that point of the order */
        uint64_t held = held_after(h, s, save_blocks, save_hashes, save_slots, i);
        if (!has_lower || held != save_hashes[i] || !held)
            return loom_err_set(err, LOOM_ERR_FORMAT, "KV block %016llx: host slot %d holds %016llx, not it%s",
                                (unsigned long long)save_hashes[i], s, (unsigned long long)held,
                                has_lower ? "" : " (and no directory tier to write it to)");
    }
    /* what the slots hold once the saves are done: each load must name it */
    for (size_t i = 0; i < n_load; i++) {
        int s = load_slots[i];
        if (s == -1 && has_lower) continue; /* from the directory */
        uint64_t held = s >= 0 && s < h->n_slots ? held_after(h, s, save_blocks, save_hashes, save_slots, n_save) : 0;
        if (s < 0 || s >= h->n_slots || held != load_hashes[i] || !load_hashes[i])
            return loom_err_set(err, LOOM_ERR_FORMAT, "KV block %016llx: host slot %d holds %016llx, not it",
                                (unsigned long long)load_hashes[i], s, (unsigned long long)held);
    }
    /* A pool block straight to the directory goes first: it reads the pool,
     * which only the loads write. Then in plan order: a spill reads its slot
     * on the host before a later save overwrites it; a spill of a slot an
     * earlier save of this step filled waits for the copies issued so far
     * (asynchronous on CUDA). The directory's loads into the pool come last,
     * after the slots' copies. */
    for (size_t i = 0; i < n_save; i++)
        if (save_slots[i] < 0 && save_blocks[i] >= 0) loom_kv_offload_put_block(lower, m, save_blocks[i], save_hashes[i]);
    if (h->be) loom_backend_xfer_begin(h->be);
    for (size_t i = 0; i < n_save; i++) {
        int s = save_slots[i];
        if (save_blocks[i] < 0) {
            int filled = 0; /* by a save of this step, its copy maybe still in flight */
            for (size_t j = 0; j < i && !filled; j++) filled = save_blocks[j] >= 0 && save_slots[j] == s;
            if (filled && h->be) {
                loom_backend_xfer_end(h->be);
                loom_backend_xfer_begin(h->be);
            }
            loom_kv_offload_put(lower, save_hashes[i], h->arena + (size_t)s * h->span, h->span);
        } else if (s >= 0) {
            loom_model_kv_block_xfer(m, save_blocks[i], h->arena + (size_t)s * h->span, 1);
            h->hash[s] = save_hashes[i];
        }
    }
    for (size_t i = 0; i < n_load; i++)
        if (load_slots[i] >= 0)
            loom_model_kv_block_xfer(m, load_blocks[i], h->arena + (size_t)load_slots[i] * h->span, 0);
    if (h->be) loom_backend_xfer_end(h->be);
    loom_status_t st = LOOM_OK;
    for (size_t i = 0; i < n_load && st >= 0; i++)
        if (load_slots[i] < 0) st = loom_kv_offload_get_block(lower, m, load_blocks[i], load_hashes[i], err);
    if (has_lower) loom_kv_offload_trim(lower);
    return st;
}
