/* The coordinator half of a KV connector: checked entry points
 * (kv_connector.h). */
#include "coordinator/kv_connector.h"

#include <stdlib.h>
#include <string.h>

int loom_kv_load_policy_parse(const char *s, loom_kv_load_policy_t *out) {
    if (!s) return 0;
    if (!strcmp(s, "recompute")) *out = LOOM_KV_LOAD_RECOMPUTE;
    else if (!strcmp(s, "fail")) *out = LOOM_KV_LOAD_FAIL;
    else return 0;
    return 1;
}

int loom_kv_connector_match(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async) {
    if (async) *async = 0;
    if (!c || !c->ops->match || r->block_size < 1 || n_local < 0) return 0;
    int a = 0, n = c->ops->match(c, r, n_local, &a);
    /* whole blocks, none beyond the request's full blocks; the last
     * position always runs for its logits */
    int room = (r->n_tokens - 1) / r->block_size * r->block_size - n_local;
    if (n > room) n = room;
    n = n > 0 ? n / r->block_size * r->block_size : 0;
    if (async) *async = n > 0 && a;
    return n;
}

int loom_kv_connector_waiting(loom_kv_connector_t *c, const loom_kv_conn_req_t *r) {
    if (!c) return 0;
    if (c->ops->waiting) return c->ops->waiting(c, r) > 0;
    return loom_kv_connector_waiting(c->lower, r);
}

void loom_kv_connector_after_alloc(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, const int32_t *blocks,
                                   int n_blocks, int n_external) {
    if (c && c->ops->after_alloc) c->ops->after_alloc(c, r, blocks, n_blocks, n_external);
}

int loom_kv_connector_finished(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, const int32_t *blocks,
                               int n_blocks, char **kv_transfer_params) {
    if (kv_transfer_params) *kv_transfer_params = NULL;
    if (!c || !c->ops->finished) return 0;
    char *params = NULL;
    int keep = c->ops->finished(c, r, blocks, n_blocks, &params) > 0;
    if (kv_transfer_params) *kv_transfer_params = params;
    else free(params);
    return keep;
}

int loom_kv_connector_offer(loom_kv_connector_t *c, uint64_t hash) {
    return c && c->ops->offer && c->ops->offer(c, hash) > 0;
}

int loom_kv_connector_evict(loom_kv_connector_t *c, uint64_t hash, uint64_t *spill) {
    *spill = 0;
    if (!c) return 0;
    if (c->ops->evict) {
        int to = c->ops->evict(c, hash, spill);
        return to == 1 || to == 2 ? to : 0;
    }
    return !c->write_through && loom_kv_connector_offer(c, hash);
}

int loom_kv_connector_has_slots(const loom_kv_connector_t *c) { return c && c->ops->plan; }

void loom_kv_connector_plan(loom_kv_connector_t *c, const uint64_t *save, int n_save, int32_t *save_slot,
                            const uint64_t *load, int n_load, int32_t *load_slot, const uint64_t *after, int n_after,
                            int32_t *after_slot) {
    if (c && c->ops->plan) c->ops->plan(c, save, n_save, save_slot, load, n_load, load_slot, after, n_after, after_slot);
}

void loom_kv_connector_destroy(loom_kv_connector_t **c) {
    if (!c || !*c) return;
    loom_kv_connector_t *lower = (*c)->lower;
    if ((*c)->ops->destroy) (*c)->ops->destroy(*c);
    *c = NULL;
    loom_kv_connector_destroy(&lower);
}
