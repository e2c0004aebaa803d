/* The coordinator's tally of LoRA adapter loads: a load order goes to every
 * worker of the epoch, each prepares the adapter off its compute thread and
 * reports (only one worker returns StepResults, so readiness has its own
 * message); a slot's load is decided when every worker reported it ok, or
 * at the first failure (the adapter's waiting requests then fail, not the
 * grid). Pure: the caller passes loom_lora_slots_loaded the outcome.
 *
 * Per slot: IDLE ──start──▶ WAITING ──every worker ok──▶ IDLE (decided ok)
 *                                   └─a worker failed──▶ IDLE (decided failed)
 * Reports of another epoch, of an IDLE slot, or a worker's second report
 * are ignored; reset (a re-formed grid) returns every slot to IDLE. */
#ifndef LOOM_LORA_TALLY_H
#define LOOM_LORA_TALLY_H

#include <stdint.h>

#include "common/status.h"

typedef struct loom_lora_tally loom_lora_tally_t;

loom_lora_tally_t *loom_lora_tally_create(int n_slots);
void loom_lora_tally_destroy(loom_lora_tally_t **t_p);

/* The load order of SLOT went to the N_WORKERS workers of EPOCH at NOW_S. */
void loom_lora_tally_start(loom_lora_tally_t *t, int slot, uint64_t epoch, int n_workers,
                           double now_s);
/* Worker WORKER (0..n_workers-1) of EPOCH reported SLOT with STATUS. Returns
 * 1 when this decides the slot's load: *outcome (LOOM_OK, or the failure)
 * and *seconds since its start; 0 otherwise. */
int loom_lora_tally_report(loom_lora_tally_t *t, uint64_t epoch, int slot, int worker,
                           loom_status_t status, double now_s, loom_status_t *outcome,
                           double *seconds);
/* The grid was re-formed: no load is awaited any more. */
void loom_lora_tally_reset(loom_lora_tally_t *t);
/* Slots whose load is awaited. */
int loom_lora_tally_waiting(const loom_lora_tally_t *t);

#endif
