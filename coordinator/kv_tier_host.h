/* The host-memory tier's coordinator half (docs/kv-offload.md): a KV
 * connector (kv_connector.h) that decides what each worker's host arena
 * holds. Every worker keeps the same n slots of one block each; the
 * coordinator orders every save into a slot and every load from one (the
 * step plan's kv_*_slots), so its map of chain hash -> slot is the tier's
 * content. Least recently used slots are reused first; a slot matched or
 * loaded in the step being planned is not reused before that step's plan
 * is built (the workers save before they load). */
#ifndef LOOM_COORDINATOR_KV_TIER_HOST_H
#define LOOM_COORDINATOR_KV_TIER_HOST_H

#include <stdint.h>

#include "coordinator/kv_connector.h"

/* lower: the tier below it (the directory: tier 2), owned, or NULL. With
 * one, a block the host tier gives up goes down to it (a spill: the slot
 * is written out by the step that reuses it, before the save into it),
 * match continues in it after the host tier's run, the loads it answers
 * have slot LOOM_KV_SLOT_LOWER, and write-through (its flag) goes to it. */
loom_kv_connector_t *loom_kv_host_connector_create(loom_kv_connector_t *lower);
/* The grid it serves (each epoch): n slots, all empty (the workers' arenas
 * are new). 0: it matches and saves nothing. */
void loom_kv_host_connector_set_slots(loom_kv_connector_t *c, int n_slots);
/* Blocks it holds, and its slots. */
int loom_kv_host_connector_used(const loom_kv_connector_t *c);
int loom_kv_host_connector_slots(const loom_kv_connector_t *c);
/* The slot holding the block with this chain hash, -1 if none. */
/* Blocks match asked of the lower tier beyond the host tier's run: those
 * it had, and the miss each walk stopped at. */
uint64_t loom_kv_host_connector_lower_queries(const loom_kv_connector_t *c);
int loom_kv_host_connector_slot_of(const loom_kv_connector_t *c, uint64_t hash);

#endif
