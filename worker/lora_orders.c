/* A worker's LoRA load orders (lora_orders.h): the host cache prepares,
 * this installs into the engine's slots and reports. */
#include "worker/lora_orders.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define MAX_SLOTS 32 /* the engine's limit (docs/lora.md) */

typedef struct order {
    int waiting;
    uint64_t epoch, t0_ns;
    uint8_t digest[32];
} order_t;

struct loom_lora_orders {
    loom_model_t *m;
    loom_lora_cache_t *cache;
    loom_lora_report_fn report;
    void *ctx;
    int n_slots;
    order_t slot[MAX_SLOTS];
};

loom_status_t loom_lora_orders_create(loom_model_t *m, const loom_model_config_t *cfg, int layer_begin,
                                      int layer_end, int max_rank, int capacity, loom_lora_report_fn report,
                                      void *ctx, loom_lora_orders_t **out, loom_err_t *err) {
    *out = NULL;
    int n = loom_model_max_loras(m);
    if (n < 1 || n > MAX_SLOTS)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "LoRA orders: the engine has %d adapter slots (1 to %d)",
                            n, MAX_SLOTS);
    loom_lora_orders_t *o = loom_xcalloc(1, sizeof *o);
    loom_status_t st = loom_lora_cache_create(m, cfg, layer_begin, layer_end, max_rank, capacity < n ? n : capacity,
                                              &o->cache, err);
    if (st != LOOM_OK) {
        free(o);
        return st;
    }
    o->m = m, o->report = report, o->ctx = ctx, o->n_slots = n;
    *out = o;
    return LOOM_OK;
}

void loom_lora_orders_destroy(loom_lora_orders_t **o_p) {
    if (!o_p || !*o_p) return;
    loom_lora_cache_destroy(&(*o_p)->cache);
    free(*o_p);
    *o_p = NULL;
}

static double since_s(uint64_t t0) { return (double)(loom_now_ns() - t0) * 1e-9; }

/* Installs SLOT's adapter when the cache holds it; 1 when decided. */
static int try_install(loom_lora_orders_t *o, int slot) {
    order_t *q = &o->slot[slot];
    const loom_lora_prepared_t *p = loom_lora_cache_get(o->cache, q->digest);
    if (!p) return 0;
    loom_err_t err = {0};
    loom_status_t st = loom_model_lora_install(o->m, slot, p, &err);
    q->waiting = 0;
    if (st != LOOM_OK) loom_model_lora_clear(o->m, slot);
    o->report(o->ctx, q->epoch, slot, q->digest, st, st == LOOM_OK ? "" : err.msg, since_s(q->t0_ns));
    return 1;
}

void loom_lora_orders_add(loom_lora_orders_t *o, uint64_t epoch, int slot, const char *path,
                          const uint8_t digest[32]) {
    if (slot < 0 || slot >= o->n_slots) {
        char msg[128];
        snprintf(msg, sizeof msg, "adapter slot %d out of range (this engine has %d)", slot, o->n_slots);
        o->report(o->ctx, epoch, slot, digest, LOOM_ERR_INVALID_ARGUMENT, msg, 0.0);
        return;
    }
    order_t *q = &o->slot[slot];
    *q = (order_t){.waiting = 1, .epoch = epoch, .t0_ns = loom_now_ns()};
    memcpy(q->digest, digest, 32);
    /* the slot's old adapter is not used any more (the coordinator evicted
     * it); clearing it now keeps a failed load from leaving it behind */
    loom_model_lora_clear(o->m, slot);
    if (try_install(o, slot)) return;
    loom_lora_cache_request(o->cache, path, digest);
}

void loom_lora_orders_poll(loom_lora_orders_t *o) {
    loom_lora_cache_done_t done[8];
    int n;
    while ((n = loom_lora_cache_poll(o->cache, done, 8)) > 0)
        for (int i = 0; i < n; i++)
            for (int s = 0; s < o->n_slots; s++) {
                order_t *q = &o->slot[s];
                if (!q->waiting || memcmp(q->digest, done[i].digest, 32)) continue;
                if (done[i].status == LOOM_OK && try_install(o, s)) continue;
                q->waiting = 0;
                o->report(o->ctx, q->epoch, s, q->digest, done[i].status < 0 ? done[i].status : LOOM_ERR_INTERNAL,
                          done[i].status < 0 ? done[i].msg : "the prepared adapter was dropped before its install",
                          since_s(q->t0_ns));
            }
}

int loom_lora_orders_pending(const loom_lora_orders_t *o) {
    int n = 0;
    for (int s = 0; s < o->n_slots; s++) n += o->slot[s].waiting;
    return n;
}

void loom_lora_orders_forget(loom_lora_orders_t *o) {
    for (int s = 0; s < o->n_slots; s++) o->slot[s].waiting = 0;
}
