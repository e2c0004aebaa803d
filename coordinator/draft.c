/* The coordinator's in-process draft model: a loom_local with one KV slot
 * per sequence it drafts for (worker/local.h loom_local_propose). */
#include "coordinator/draft.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "kernels/quant.h"
#include "worker/local.h"

struct loom_coord_draft {
    loom_local_t *model;
    int n_slots;
    uint64_t *owner; /* (n_slots) the sequence id a slot follows */
    uint8_t *busy;   /* (n_slots) */
    int n_busy;
    long errors;
};

loom_status_t loom_coord_draft_open(const loom_coord_draft_options_t *o,
                                    const loom_model_config_t *target,
                                    const loom_tokenizer_t *target_tok, loom_coord_draft_t **out,
                                    loom_err_t *err) {
    *out = NULL;
    loom_local_options_t lo = {.model_dir = o->model_dir,
                               .n_threads = o->n_threads,
                               .device = o->device,
                               .ctx = o->ctx,
                               .no_tokenizer = 1,
                               .n_slots = LOOM_MAX(o->max_seqs, 1)};
    if (o->quantization && !loom_quant_spec_parse(o->quantization, &lo.quant))
        return loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "--speculative-quantization: unknown scheme '%s' (int8, fp8, q4, q4_min, q4:G ...)",
            o->quantization);
    uint64_t t0 = loom_now_ns();
    loom_local_t *l = NULL;
    loom_err_t e = {0};
    if (loom_local_open(&lo, &l, &e) < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the draft model %s cannot be loaded: %s", o->model_dir, e.msg);
    loom_status_t st = loom_local_check_draft(loom_local_config(l), target, o->model_dir, err);
    if (st == LOOM_OK) st = loom_local_check_draft_tokenizer(o->model_dir, target_tok, err);
    if (st < 0) {
        loom_local_close(&l);
        return st;
    }
    loom_coord_draft_t *d = loom_xcalloc(1, sizeof *d);
    d->model = l;
    d->n_slots = loom_local_slots(l);
    d->owner = loom_xcalloc((size_t)d->n_slots, sizeof *d->owner);
    d->busy = loom_xcalloc((size_t)d->n_slots, sizeof *d->busy);
    char q[64] = "as stored";
    if (lo.quant.quant != LOOM_QUANT_NONE) loom_quant_spec_name(&lo.quant, q, sizeof q);
    LOOM_INFO("speculative draft: %s (%s, %.1f MB) in the coordinator, %d sequence slot(s) of %d "
              "positions, "
              "loaded in %.2f s",
              o->model_dir, q, (double)loom_model_weight_bytes(loom_local_model(l)) / 1e6,
              d->n_slots, loom_local_ctx(l), (double)(loom_now_ns() - t0) * 1e-9);
    if (loom_local_ctx(l) < o->ctx)
        LOOM_WARN("the draft model's context is %d positions, the coordinator's %d: longer "
                  "sequences are decoded "
                  "without drafts past it",
                  loom_local_ctx(l), o->ctx);
    *out = d;
    return LOOM_OK;
}

void loom_coord_draft_destroy(loom_coord_draft_t **d_p) {
    if (!d_p || !*d_p) return;
    loom_coord_draft_t *d = *d_p;
    *d_p = NULL;
    loom_local_close(&d->model);
    free(d->owner);
    free(d->busy);
    free(d);
}

static int find_slot(const loom_coord_draft_t *d, uint64_t id) {
    for (int i = 0; i < d->n_slots; i++)
        if (d->busy[i] && d->owner[i] == id) return i;
    return -1;
}

static int draft_propose(void *ctx, const loom_seq_t *q, int k, int32_t *out) {
    loom_coord_draft_t *d = ctx;
    int slot = find_slot(d, q->id);
    if (slot < 0) {
        for (int i = 0; i < d->n_slots && slot < 0; i++)
            if (!d->busy[i]) slot = i;
        if (slot < 0) return 0; /* every slot follows another sequence */
        d->busy[slot] = 1;
        d->owner[slot] = q->id;
        d->n_busy++;
    }
    loom_err_t err = {0};
    int n = loom_local_propose(d->model, slot, q->tokens, q->n_tokens, k, out, &err);
    if (n < 0) {
        if (d->errors++ == 0)
            LOOM_WARN("speculative draft: %s (the step goes on without drafts)", err.msg);
        loom_local_forget(d->model, slot);
        return 0;
    }
    return n;
}

static void draft_forget(void *ctx, const loom_seq_t *q) {
    loom_coord_draft_t *d = ctx;
    int slot = find_slot(d, q->id);
    if (slot < 0) return;
    d->busy[slot] = 0;
    d->n_busy--;
    /* the slot keeps its KV: a next sequence with the same prefix (a chat's
     * next turn, a shared system prompt) reuses it */
}

void loom_coord_draft_attach(loom_coord_draft_t *d, loom_sched_t *s) {
    loom_sched_set_drafter(s, draft_propose, draft_forget, d);
}

int loom_coord_draft_busy(const loom_coord_draft_t *d) {
    return d->n_busy;
}
long loom_coord_draft_errors(const loom_coord_draft_t *d) {
    return d->errors;
}
