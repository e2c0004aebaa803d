/* The coordinator half of a KV connector (docs/kv-offload.md): what moves
 * KV blocks between the pool and something outside it (a host-memory or
 * directory tier, another replica's prefill). The two halves follow vLLM's
 * KVConnectorBase_V1; the worker half is worker/kv_connector.h.
 *
 * The scheduler (loom_sched_set_connector) asks match at admission,
 * after the prefix cache, and offer for each full block leaving the pool
 * (write-back) or, with write_through, as it is registered; the loads and
 * saves go to the workers in the step plan (kv_load_*, kv_save_*). */
#ifndef LOOM_COORDINATOR_KV_CONNECTOR_H
#define LOOM_COORDINATOR_KV_CONNECTOR_H

#include <stddef.h>
#include <stdint.h>

/* What a KV load failure does to its request (vLLM's kv_load_failure_policy). */
typedef enum {
    LOOM_KV_LOAD_RECOMPUTE = 0, /* the sequence falls back to its first failed block and recomputes from there */
    LOOM_KV_LOAD_FAIL,          /* the request ends with an error */
} loom_kv_load_policy_t;

/* "recompute" or "fail"; 0 for anything else. */
int loom_kv_load_policy_parse(const char *s, loom_kv_load_policy_t *out);

/* A request as a connector sees it: its tokens and the chain hashes of its
 * full blocks (the prefix cache's, salted by model and adapter). */
typedef struct loom_kv_conn_req {
    uint64_t id;
    const int32_t *tokens;
    int n_tokens;
    const uint64_t *block_hashes; /* (n_tokens / block_size) */
    int block_size;
} loom_kv_conn_req_t;

typedef struct loom_kv_connector loom_kv_connector_t;

/* A move's slot in the plan (kv_*_slots), besides a host slot >= 0: the
 * lower tier's (the directory below the host tier), or a save dropped. */
#define LOOM_KV_SLOT_LOWER (-1)
#define LOOM_KV_SLOT_DROP (-2)

typedef struct loom_kv_connector_ops {
    /* get_num_new_matched_tokens: tokens beyond the n_local the prefix
     * cache holds that the connector can supply (whole blocks); *async 1
     * when they arrive after the step that allocates them. It may be asked
     * again for the same request, so what it does besides answering must
     * bear repeating (the host tier's LRU touch and step pin, the
     * directory tier's queued checks). */
    int (*match)(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async);
    /* (optional) Asked after a match of r that stopped short: 1 when r
     * should wait before admission, its next blocks being looked for (a
     * bounded wait: the connector answers 0 once its time is up). */
    int (*waiting)(loom_kv_connector_t *c, const loom_kv_conn_req_t *r);
    /* update_state_after_alloc: the blocks the ledger gave the n_external
     * tokens, in order; they become the destinations of the loads. */
    void (*after_alloc)(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, const int32_t *blocks, int n_blocks,
                        int n_external);
    /* request_finished: the request's blocks; returns 1 when the connector
     * keeps them (freed when it reports the save done: delayed free), 0 to
     * free them now; *kv_transfer_params (malloc'd JSON or NULL) goes on
     * the response. */
    int (*finished)(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, const int32_t *blocks, int n_blocks,
                    char **kv_transfer_params);
    /* A full block with this chain hash is leaving the pool (write-back)
     * or was just computed (write-through): 1 when the workers should save
     * it (the tier lacks it), 0 when not. */
    int (*offer)(loom_kv_connector_t *c, uint64_t hash);
    /* A cached block is leaving the pool (write-back, also with
     * write_through: optional, NULL is offer unless write_through): 0 no
     * save, 1 a save into the tier, 2 a save into its lower tier. *spill
     * (0: none) is a block the tier gives up for it, to be written from the
     * tier to the lower one first (a save with block -1 before it). */
    int (*evict)(loom_kv_connector_t *c, uint64_t hash, uint64_t *spill);
    /* build_connector_meta (optional): the step's moves are planned (in
     * the order the workers do them: saves, loads, saves after the
     * layers); fills each one's slot in the connector's storage,
     * LOOM_KV_SLOT_LOWER for a move of the lower tier, LOOM_KV_SLOT_DROP
     * for a save it no longer wants (its slot went to a later block of the
     * same step). Called once per planned step, in plan order; what match and
     * offer held for the step is released. NULL: the moves need no slots. */
    void (*plan)(loom_kv_connector_t *c, const uint64_t *save, int n_save, int32_t *save_slot, const uint64_t *load,
                 int n_load, int32_t *load_slot, const uint64_t *after, int n_after, int32_t *after_slot);
    void (*destroy)(loom_kv_connector_t *c);
} loom_kv_connector_ops_t;

struct loom_kv_connector {
    const loom_kv_connector_ops_t *ops;
    const char *tier; /* the kv_events "tier": "host", "dir", "remote" */
    loom_kv_load_policy_t load_policy;
    int write_through; /* offer blocks as they are computed, not only as they leave the pool */
    loom_kv_connector_t *lower; /* the tier below (the directory under the host tier; NULL: none); owned */
};

/* The checked entry points: NULL c is the no-connector case. match's
 * answer is cut to whole blocks within the request's full blocks beyond
 * n_local (a connector that says more is not believed). */
int loom_kv_connector_match(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async);
/* ops->waiting, else the lower tier's (0 without either). */
int loom_kv_connector_waiting(loom_kv_connector_t *c, const loom_kv_conn_req_t *r);
void loom_kv_connector_after_alloc(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, const int32_t *blocks,
                                   int n_blocks, int n_external);
int loom_kv_connector_finished(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, const int32_t *blocks,
                               int n_blocks, char **kv_transfer_params);
int loom_kv_connector_offer(loom_kv_connector_t *c, uint64_t hash);
/* ops->evict, or offer unless write_through; *spill 0 when none. */
int loom_kv_connector_evict(loom_kv_connector_t *c, uint64_t hash, uint64_t *spill);
/* Whether the connector's moves carry slots (ops->plan). */
int loom_kv_connector_has_slots(const loom_kv_connector_t *c);
void loom_kv_connector_plan(loom_kv_connector_t *c, const uint64_t *save, int n_save, int32_t *save_slot,
                            const uint64_t *load, int n_load, int32_t *load_slot, const uint64_t *after, int n_after,
                            int32_t *after_slot);
void loom_kv_connector_destroy(loom_kv_connector_t **c);

#endif
