/* The worker half of a KV connector (docs/kv-offload.md; the coordinator
 * half is coordinator/kv_connector.h), after vLLM's KVConnectorBase_V1:
 * loads into and saves from the pool's blocks, named by block id and
 * content hash in the step plan. A block is one contiguous span across the
 * shard's layers (loom_model_kv_block_ptr), so each moves with one copy.
 *
 * The table an asynchronous tier is to implement; the directory tier is
 * synchronous and calls plain functions (worker/kv_offload.h). */
#ifndef LOOM_WORKER_KV_CONNECTOR_H
#define LOOM_WORKER_KV_CONNECTOR_H

#include <stddef.h>
#include <stdint.h>

/* One block to move: the pool's block id and its content hash (chain hash
 * with the model's identity, dtype, layout and shard). */
typedef struct loom_kv_xfer {
    int32_t block;
    uint64_t hash;
} loom_kv_xfer_t;

typedef struct loom_kv_wconn loom_kv_wconn_t;

typedef struct loom_kv_wconn_ops {
    /* start_load_kv: copies the blocks into the pool at span (block_bytes
     * each at the block's address); returns how many failed and lists them
     * in failed[] (the coordinator recomputes or fails their requests). */
    int (*load)(loom_kv_wconn_t *c, const loom_kv_xfer_t *x, int n, int32_t *failed);
    /* wait_for_layer_load / the per-step wait before the layers run: 0
     * when every load of this step is in the pool. */
    int (*wait_load)(loom_kv_wconn_t *c);
    /* save_kv_layer + wait_for_save: copies the blocks out of the pool. */
    int (*save)(loom_kv_wconn_t *c, const loom_kv_xfer_t *x, int n);
    /* get_finished: saves done since the last call (their blocks may be
     * freed: the delayed free of request_finished). */
    int (*finished)(loom_kv_wconn_t *c, int32_t *blocks, int max);
    void (*destroy)(loom_kv_wconn_t *c);
} loom_kv_wconn_ops_t;

struct loom_kv_wconn {
    const loom_kv_wconn_ops_t *ops;
    size_t block_bytes;
};

#endif
