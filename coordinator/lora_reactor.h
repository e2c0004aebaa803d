/* The reactor's LoRA state (docs/lora.md): the adapter registry and the
 * engines' slots (lora_slots.h), the tally of the workers' answers to load
 * orders (lora_tally.h), and vLLM's runtime load/unload. The reactor calls
 * it; it owns no socket but sends orders through the grid.
 *
 * A load, end to end: admission claims a slot for a waiting sequence's
 * adapter (LOADING) → loom_lora_reactor_dispatch sends the order to every
 * worker of the epoch → each prepares it off its compute thread and
 * installs it between steps, then answers LoraLoaded →
 * loom_lora_reactor_loaded tallies them: every worker ok makes the slot
 * READY (the sequences are admitted on the next schedule); the first
 * failure frees it, and the caller fails the adapter's waiting requests. */
#ifndef LOOM_LORA_REACTOR_H
#define LOOM_LORA_REACTOR_H

#include <stddef.h>

#include "common/model_config.h"
#include "common/status.h"
#include "coordinator/grid.h"
#include "coordinator/lora_serve.h"
#include "coordinator/lora_slots.h"
#include "coordinator/lora_tally.h"
#include "coordinator/prepare.h"

typedef struct loom_lora_reactor loom_lora_reactor_t;

/* From the checked options O (loom_lora_serve_startup): the slots, the
 * --lora-modules adapters registered (each read again against CFG). SERVED
 * is the base model's name (an adapter may not take it). */
loom_status_t loom_lora_reactor_create(const loom_lora_serve_opts_t *o, const loom_model_config_t *cfg,
                                       const char *served, loom_lora_reactor_t **out, loom_err_t *err);
void loom_lora_reactor_destroy(loom_lora_reactor_t **r_p);

loom_lora_slots_t *loom_lora_reactor_slots(loom_lora_reactor_t *r);

/* The grid is READY under a new epoch: its engines hold no adapters; the
 * resident ones are ordered again (their pins kept). */
void loom_lora_reactor_grid_ready(loom_lora_reactor_t *r);

/* Sends the load orders admission asked for (the grid READY). */
void loom_lora_reactor_dispatch(loom_lora_reactor_t *r, loom_grid_t *g);

/* Worker WORKER answered a load order. Returns the registry id of an
 * adapter whose load failed (MSG says why; its waiting requests must fail),
 * else -1. */
int loom_lora_reactor_loaded(loom_lora_reactor_t *r, loom_grid_t *g, int worker, const Loom__V1__LoraLoaded *l,
                             char *msg, size_t cap);

/* vLLM's /v1/load_lora_adapter, in two halves around the adapter's read,
 * which runs on a preparation pool (prepare.h) so that a large adapter
 * stalls no stream. _begin checks what the registry knows (runtime updating
 * on, NAME and PATH given, NAME neither the base model's nor loaded) and
 * fills J's adapter load (J freshly zeroed; the caller submits it). _end,
 * with J back from the pool: registers NAME unless the read failed or NAME
 * was loaded meanwhile (another load of the name came back first). Either
 * fails with INVALID_ARGUMENT (NOT_FOUND: no such directory) and MSG saying
 * why; _end's MSG on success is vLLM's text. */
loom_status_t loom_lora_reactor_load_begin(loom_lora_reactor_t *r, const char *name, const char *path,
                                           loom_prep_job_t *j, char *msg, size_t cap);
loom_status_t loom_lora_reactor_load_end(loom_lora_reactor_t *r, const loom_prep_job_t *j, char *msg, size_t cap);
/* vLLM's /v1/unload_lora_adapter. *ID is the entry the name had (its
 * waiting requests must fail before it goes: call loom_lora_reactor_forget
 * after failing them). NOT_FOUND when NAME is not loaded. */
loom_status_t loom_lora_reactor_unload_check(loom_lora_reactor_t *r, const char *name, int *id, char *msg,
                                             size_t cap);
void loom_lora_reactor_forget(loom_lora_reactor_t *r, const char *name, char *msg, size_t cap);

#endif
