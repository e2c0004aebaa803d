/* A worker's host cache of prepared LoRA adapters (docs/lora.md): each load
 * order is read (loom_lora_load, this shard's layers) and prepared
 * (loom_model_lora_prepare, this shard's TP layout) on a background thread,
 * never on the compute thread; prepared adapters stay on the host, keyed by
 * content digest, and the least recently used beyond CAPACITY
 * (--max-cpu-loras) are dropped.
 *
 * Entry states:  QUEUED ──thread takes it──▶ PREPARING ──▶ READY | FAILED
 *   READY: reported once by loom_lora_cache_poll (a use: its install
 *          follows, so that poll's eviction spares it), then kept until
 *          evicted;
 *   FAILED: reported once, then forgotten (a later request tries again).
 * Only the owner's thread evicts (in request and poll), so a pointer from
 * loom_lora_cache_get stays valid until its next request or poll.
 * The test hook LOOM_TEST_LORA_PREPARE_DELAY_MS=N makes each preparation
 * sleep N ms first (a slow disk, a busy machine). */
#ifndef LOOM_LORA_CACHE_H
#define LOOM_LORA_CACHE_H

#include <stdint.h>

#include "common/lora.h"
#include "common/status.h"
#include "worker/model.h"

typedef struct loom_lora_cache loom_lora_cache_t;

/* One finished preparation. */
typedef struct loom_lora_cache_done {
    uint8_t digest[32];
    loom_status_t status; /* LOOM_OK: ready */
    char msg[512];        /* the problem, when it failed */
} loom_lora_cache_done_t;

/* For model M (its config CFG, layers [layer_begin, layer_end)); adapters of
 * rank up to MAX_RANK; at most CAPACITY (>= 1) prepared adapters kept. M must
 * outlive the cache. */
loom_status_t loom_lora_cache_create(const loom_model_t *m, const loom_model_config_t *cfg,
                                     int layer_begin, int layer_end, int max_rank, int capacity,
                                     loom_lora_cache_t **out, loom_err_t *err);
void loom_lora_cache_destroy(loom_lora_cache_t **c_p);

/* Asks for the adapter in PATH whose content digest is DIGEST (the one the
 * coordinator registered; another digest on disk fails the order). Nothing
 * happens when it is READY or under way. */
void loom_lora_cache_request(loom_lora_cache_t *c, const char *path, const uint8_t digest[32]);
/* Preparations finished since the last call, up to CAP; returns how many. */
int loom_lora_cache_poll(loom_lora_cache_t *c, loom_lora_cache_done_t *out, int cap);
/* The prepared adapter of DIGEST (marked recently used), or NULL. */
const loom_lora_prepared_t *loom_lora_cache_get(loom_lora_cache_t *c, const uint8_t digest[32]);
/* Prepared adapters held now. */
int loom_lora_cache_count(loom_lora_cache_t *c);

#endif
