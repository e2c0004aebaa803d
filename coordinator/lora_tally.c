/* The tally of LoRA adapter loads over a grid's workers (lora_tally.h). */
#include "coordinator/lora_tally.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

typedef struct slot {
    int waiting; /* a load is awaited */
    uint64_t epoch;
    int n_workers, n_ok;
    uint8_t *reported; /* (n_workers) */
    double start_s;
} slot_t;

struct loom_lora_tally {
    int n_slots;
    slot_t *slots;
};

loom_lora_tally_t *loom_lora_tally_create(int n_slots) {
    loom_lora_tally_t *t = loom_xcalloc(1, sizeof *t);
    t->n_slots = n_slots > 0 ? n_slots : 0;
    t->slots = loom_xcalloc((size_t)(t->n_slots ? t->n_slots : 1), sizeof *t->slots);
    return t;
}

void loom_lora_tally_destroy(loom_lora_tally_t **t_p) {
    if (!t_p || !*t_p) return;
    loom_lora_tally_t *t = *t_p;
    *t_p = NULL;
    for (int i = 0; i < t->n_slots; i++)
        free(t->slots[i].reported);
    free(t->slots);
    free(t);
}

void loom_lora_tally_start(loom_lora_tally_t *t, int slot, uint64_t epoch, int n_workers,
                           double now_s) {
    LOOM_ASSERT(slot >= 0 && slot < t->n_slots && n_workers > 0);
    slot_t *s = &t->slots[slot];
    free(s->reported);
    s->reported = loom_xcalloc((size_t)n_workers, 1);
    s->waiting = 1;
    s->epoch = epoch;
    s->n_workers = n_workers;
    s->n_ok = 0;
    s->start_s = now_s;
}

int loom_lora_tally_report(loom_lora_tally_t *t, uint64_t epoch, int slot, int worker,
                           loom_status_t status, double now_s, loom_status_t *outcome,
                           double *seconds) {
    if (slot < 0 || slot >= t->n_slots) return 0;
    slot_t *s = &t->slots[slot];
    if (!s->waiting || s->epoch != epoch || worker < 0 || worker >= s->n_workers ||
        s->reported[worker])
        return 0;
    s->reported[worker] = 1;
    if (status == LOOM_OK && ++s->n_ok < s->n_workers) return 0;
    s->waiting = 0;
    *outcome = status;
    *seconds = now_s - s->start_s;
    return 1;
}

void loom_lora_tally_reset(loom_lora_tally_t *t) {
    for (int i = 0; i < t->n_slots; i++)
        t->slots[i].waiting = 0;
}

int loom_lora_tally_waiting(const loom_lora_tally_t *t) {
    int n = 0;
    for (int i = 0; i < t->n_slots; i++)
        n += t->slots[i].waiting;
    return n;
}
