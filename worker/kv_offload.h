/* The worker's half of the directory tier (docs/kv-offload.md): the step
 * plan's kv_save_* and kv_load_* done on this worker's shard of each block,
 * one contiguous span (loom_model_kv_block_ptr) to or from one file
 * (common/kv_tier.h). */
#ifndef LOOM_WORKER_KV_OFFLOAD_H
#define LOOM_WORKER_KV_OFFLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/backend.h"
#include "worker/model.h"

typedef struct loom_kv_offload {
    char dir[4096];     /* "" : no tier */
    uint64_t tier_id;
    uint64_t max_bytes; /* the directory's bound */
    uint64_t bytes;     /* what it holds, as of the last trim plus what this worker wrote since */
    int shard;          /* stage * tp + tp rank */
    int broken;         /* a write failed (disk full, read-only): no more saves, loads still */
    loom_backend_t *be; /* a layer-major pool's (stage's) */
    void *stage;        /* layer-major pool: one block's span in host memory, packed (loom_model_kv_block_xfer) */
    struct loom_kv_load *load; /* the step's loads, while they run (NULL: none) */
    uint64_t loads, layer_waits; /* blocks loaded; layers the forward waited for */
    /* a test's hook, called on the load thread before each layer's reads */
    void (*layer_hook)(void *ctx, int layer);
    void *layer_hook_ctx;
} loom_kv_offload_t;

/* Sets (dir non-empty) or clears the tier for the model's pool (o zeroed
 * or configured before: a staging span it holds is freed). A pool
 * whose blocks are one span (the CPU's) moves each block with one read or
 * write; a layer-major one (the CUDA backend's, DeepSeek's latent cache)
 * through a staging span of the backend's host memory, packed as
 * loom_model_kv_block_xfer packs it (the file holds the packed span). */
loom_status_t loom_kv_offload_config(loom_kv_offload_t *o, loom_backend_t *be, const loom_model_t *m, const char *dir,
                                     uint64_t tier_id, uint64_t max_bytes, int shard, loom_err_t *err);
/* Frees the staging span (before the backend goes). */
void loom_kv_offload_free(loom_kv_offload_t *o);

/* Saves, then starts the loads (the plan's order). A failed save is logged
 * and the tier stops saving. The loads run on a thread of their own, layer
 * by layer across the step's blocks (each file's header is checked here: a
 * file gone since the coordinator checked it is an error at once); the
 * forward waits for each layer (loom_kv_offload_wait_layer), and
 * loom_kv_offload_finish, after the forward, ends them: a file found bad
 * there (its checksum) is an error, and the step's results must not be
 * reported. A layer-major pool loads block by block here, before the step. */
loom_status_t loom_kv_offload_step(loom_kv_offload_t *o, loom_model_t *m, const int32_t *save_blocks,
                                   const uint64_t *save_hashes, size_t n_save, const int32_t *load_blocks,
                                   const uint64_t *load_hashes, size_t n_load, loom_err_t *err);

/* Waits until layer `layer` (the shard's) of every block the step loads is
 * in the pool; at once without loads. */
void loom_kv_offload_wait_layer(loom_kv_offload_t *o, int layer);
/* Layers in so far for every block (-1: no loads running). */
int loom_kv_offload_layers_ready(loom_kv_offload_t *o);
/* Waits for the step's loads to end (OK at once without loads); then the
 * bound is kept. Call after the forward, on every path. */
loom_status_t loom_kv_offload_finish(loom_kv_offload_t *o, loom_err_t *err);

/* Write-through saves after the step's layers (a failure as for saves). */
void loom_kv_offload_save(loom_kv_offload_t *o, loom_model_t *m, const int32_t *blocks, const uint64_t *hashes,
                          size_t n);

/* The directory as the host tier's lower tier (worker/kv_host.c): one
 * block's span written from memory (a host slot or a pool block; a failure
 * as for saves), read into memory (an error as for loads), and the bound
 * kept once the step's moves are done. */
void loom_kv_offload_put(loom_kv_offload_t *o, uint64_t hash, const void *src, size_t span);
/* A pool block to its file, and a file into a pool block, in either layout
 * (an error as for loads). */
void loom_kv_offload_put_block(loom_kv_offload_t *o, loom_model_t *m, int block, uint64_t hash);
loom_status_t loom_kv_offload_get_block(loom_kv_offload_t *o, loom_model_t *m, int block, uint64_t hash,
                                        loom_err_t *err);
loom_status_t loom_kv_offload_get(loom_kv_offload_t *o, uint64_t hash, void *dst, size_t span, loom_err_t *err);
void loom_kv_offload_trim(loom_kv_offload_t *o);

#endif
