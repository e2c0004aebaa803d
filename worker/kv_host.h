/* The worker's half of the host-memory KV tier (docs/kv-offload.md): an
 * arena of n slots of one block each in host memory (loom_backend_host_alloc:
 * pinned on CUDA, malloc'd on the CPU backend), and the step plan's saves
 * into slots and loads from them (kv_*_slots). The coordinator decides what
 * every slot holds; the worker keeps each slot's chain hash only to check a
 * load names what the slot holds (a mismatch fails the step: the
 * coordinator recomputes). */
#ifndef LOOM_WORKER_KV_HOST_H
#define LOOM_WORKER_KV_HOST_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "worker/kv_offload.h"
#include "worker/model.h"

typedef struct loom_kv_host {
    loom_backend_t *be; /* whose host memory the arena is */
    char *arena;        /* (n_slots, span) */
    uint64_t *hash;     /* (n_slots) what each slot holds (0: nothing) */
    int n_slots;
    size_t span;        /* bytes of one block on this shard */
} loom_kv_host_t;

/* Sets n_slots empty slots for the model's pool (0: no tier), freeing any
 * earlier arena; out of host memory is an error naming the bytes. */
loom_status_t loom_kv_host_config(loom_kv_host_t *h, loom_backend_t *be, const loom_model_t *m, int n_slots,
                                  loom_err_t *err);
void loom_kv_host_free(loom_kv_host_t *h);

/* The plan's saves (block -> slot) then loads (slot -> block), enqueued
 * in that order on the backend's transfer stream and ordered with the
 * compute stream (loom_backend_xfer_*). With the directory below
 * (lower, a configured tier; NULL or unset: none), in plan order too: a
 * save with block -1 writes its slot to the directory (a spill, before a
 * later save reuses the slot), a save or load with slot -1 goes straight
 * between the pool and the directory. A slot out of range, a spill or
 * load whose slot does not hold its hash at that point, a directory move
 * without a directory, a directory load that fails: an error, the step
 * must not run. */
loom_status_t loom_kv_host_step(loom_kv_host_t *h, loom_model_t *m, loom_kv_offload_t *lower,
                                const int32_t *save_blocks, const uint64_t *save_hashes, const int32_t *save_slots,
                                size_t n_save, const int32_t *load_blocks, const uint64_t *load_hashes,
                                const int32_t *load_slots, size_t n_load, loom_err_t *err);

#endif
