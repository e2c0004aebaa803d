/* The coordinator's view of LoRA adapters: the registry of served names and
 * the engine's adapter slots (vLLM's --max-loras), with admission.
 *
 * An adapter is known by name (from --lora-modules or a runtime load) and
 * identified by its content digest (common/lora.h). The engine of every
 * worker keeps max_loras slots; a sequence can run only while its adapter
 * sits in a slot, and a slot holding an adapter that running sequences use
 * is pinned (never evicted under them).
 *
 * Slot states:
 *   FREE ──acquire (no free slot: the least recently used unpinned READY
 *          slot is evicted)──▶ LOADING (workers told to load; admission of
 *          the adapter's sequences waits)
 *   LOADING ──loaded(ok)──▶ READY ──pins drop to 0, LRU──▶ evicted (FREE or
 *          straight to LOADING for another adapter)
 *   LOADING ──loaded(error)──▶ FREE (the adapter's waiting requests fail)
 * Invariants: a slot holds at most one adapter and an adapter at most one
 * slot; pins > 0 only on READY slots; an adapter removed while pinned keeps
 * its slot until the last sequence using it releases it. */
#ifndef LOOM_LORA_SLOTS_H
#define LOOM_LORA_SLOTS_H

#include <stdint.h>

#include "common/status.h"

typedef struct loom_lora_slots loom_lora_slots_t;

typedef enum { LOOM_SLOT_FREE = 0, LOOM_SLOT_LOADING, LOOM_SLOT_READY } loom_slot_state_t;

/* One served adapter. */
typedef struct loom_lora_entry {
    int id;               /* stable while registered; loom.v1 and plans carry the slot, not this */
    char name[128];
    char path[1024];
    char base[128];       /* base_model_name ("" : the served model) */
    uint8_t digest[32];
    int rank;
    int slot;             /* -1: not resident */
    int removed;          /* unloaded by name; kept until its slot is unpinned */
    uint64_t n_requests;  /* admitted sequences, ever */
    int running;          /* sequences holding a pin now */
} loom_lora_entry_t;

typedef struct loom_lora_slot {
    loom_slot_state_t state;
    int adapter;          /* entry id, or -1 */
    int pins;             /* running sequences using it */
    uint64_t last_used;   /* a tick of the last acquire or release */
    int load_sent;        /* the load order went out to the workers */
} loom_lora_slot_t;

typedef struct loom_lora_slots_stats {
    int registered, resident, loading;
    uint64_t loads, evictions, load_failures;
    double load_seconds;  /* summed time from a load order to its completion */
} loom_lora_slots_stats_t;

loom_status_t loom_lora_slots_create(int max_loras, int max_registered, loom_lora_slots_t **out, loom_err_t *err);
void loom_lora_slots_destroy(loom_lora_slots_t **s_p);

/* Registers NAME (unique; ALREADY registered under another digest is a
 * reload: the old entry is removed as by loom_lora_slots_remove). Returns the
 * entry id, or a negative status (the registry full, a name taken). */
int loom_lora_slots_add(loom_lora_slots_t *s, const char *name, const char *path, const char *base,
                        const uint8_t digest[32], int rank, loom_err_t *err);
/* Unregisters NAME; its slot is freed now when unpinned, else when the last
 * sequence using it releases it. NOT_FOUND when not registered. */
loom_status_t loom_lora_slots_remove(loom_lora_slots_t *s, const char *name, loom_err_t *err);
/* The entry registered as NAME (not removed), or NULL. */
const loom_lora_entry_t *loom_lora_slots_find(const loom_lora_slots_t *s, const char *name);
const loom_lora_entry_t *loom_lora_slots_entry(const loom_lora_slots_t *s, int id);
/* Entries in registration order (removed ones skipped): for /v1/models. */
int loom_lora_slots_list(const loom_lora_slots_t *s, const loom_lora_entry_t **out, int cap);

/* Admission of one sequence of adapter ID: 1 and *slot when its slot is
 * READY (a pin is taken); 0 when it must wait (its slot is LOADING, or a
 * slot was just claimed for it: see loom_lora_slots_pending, or every slot
 * is pinned by other adapters). */
int loom_lora_slots_acquire(loom_lora_slots_t *s, int id, int *slot);
/* A sequence holding a pin on SLOT finished or was preempted. */
void loom_lora_slots_release(loom_lora_slots_t *s, int slot);
/* Load orders not yet sent: up to CAP slot numbers (their entry is the
 * slot's adapter); each is marked sent. */
int loom_lora_slots_pending(loom_lora_slots_t *s, int *slots, int cap);
/* Every worker reported the load of SLOT (ok, or failed with STATUS < 0). */
void loom_lora_slots_loaded(loom_lora_slots_t *s, int slot, loom_status_t status, double seconds);
/* The grid was re-formed: its engines hold no adapters. Every slot that was
 * READY or LOADING goes back to LOADING with its order unsent (pins kept). */
void loom_lora_slots_reset(loom_lora_slots_t *s);

const loom_lora_slot_t *loom_lora_slots_slot(const loom_lora_slots_t *s, int slot);
int loom_lora_slots_count(const loom_lora_slots_t *s); /* max_loras */
loom_lora_slots_stats_t loom_lora_slots_stats(const loom_lora_slots_t *s);

#endif
