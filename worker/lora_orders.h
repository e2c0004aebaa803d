/* A worker's LoRA load orders (docs/lora.md): the coordinator's LoraLoad
 * messages turned into installed engine slots. An order names a slot, the
 * adapter's directory and its content digest; the adapter is prepared on
 * the host cache's thread (worker/lora_cache.h, never on the compute
 * thread) and installed into the slot by the compute thread between steps,
 * which then reports the outcome (the worker's LoraLoaded).
 *
 * Per slot: NONE ──add──▶ WAITING (the cache prepares it) ──poll: ready──▶
 * installed, reported ok, NONE; ──poll: failed──▶ reported with the
 * problem, NONE. An adapter the cache already holds is installed by add at
 * once. A second order for a slot replaces the first (only the last one is
 * reported). Called from one thread (the compute thread). */
#ifndef LOOM_LORA_ORDERS_H
#define LOOM_LORA_ORDERS_H

#include <stdint.h>

#include "common/status.h"
#include "worker/lora_cache.h"
#include "worker/model.h"

typedef struct loom_lora_orders loom_lora_orders_t;

/* One decided order: EPOCH and SLOT as ordered, STATUS (LOOM_OK: installed)
 * with MSG naming the problem, SECONDS from the order to its outcome. */
typedef void (*loom_lora_report_fn)(void *ctx, uint64_t epoch, int slot, const uint8_t digest[32],
                                    loom_status_t status, const char *msg, double seconds);

/* For model M (its config CFG, layers [layer_begin, layer_end)); adapters of
 * rank up to MAX_RANK; CAPACITY prepared adapters kept on the host. */
loom_status_t loom_lora_orders_create(loom_model_t *m, const loom_model_config_t *cfg, int layer_begin,
                                      int layer_end, int max_rank, int capacity, loom_lora_report_fn report,
                                      void *ctx, loom_lora_orders_t **out, loom_err_t *err);
void loom_lora_orders_destroy(loom_lora_orders_t **o_p);

/* An order: load the adapter in PATH (content DIGEST) into SLOT. A slot
 * outside the engine's is reported failed at once. */
void loom_lora_orders_add(loom_lora_orders_t *o, uint64_t epoch, int slot, const char *path,
                          const uint8_t digest[32]);
/* Installs and reports what the cache finished since the last call. */
void loom_lora_orders_poll(loom_lora_orders_t *o);
/* Orders not yet decided. */
int loom_lora_orders_pending(const loom_lora_orders_t *o);
/* A new epoch: the orders of the old one are dropped unreported. */
void loom_lora_orders_forget(loom_lora_orders_t *o);

#endif
