/* The draft model of speculative method DRAFT, run inside the coordinator
 * (its own worker, in-process): a smaller model with the target's
 * vocabulary, or the target itself quantized (a self-draft), on the CPU
 * backend (or a GPU of the coordinator's host, --speculative-device), with its own KV cache of
 * `max_seqs` sequence slots. The scheduler asks it for a sequence's drafts as it builds a step
 * (loom_sched_set_drafter); a slot follows one sequence and catches up with
 * the tokens it has not seen (the accepted ones, and the correction of a
 * rejected draft) before it proposes. A sequence that finds every slot busy
 * is decoded without drafts. Nothing the draft proposes changes the output
 * (docs/speculative.md): the target's verify step decides. */
#ifndef LOOM_COORD_DRAFT_H
#define LOOM_COORD_DRAFT_H

#include "common/model_config.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "coordinator/sched.h"

typedef struct loom_coord_draft_options {
    const char *model_dir;    /* the draft's directory (the target's for a self-draft) */
    const char *quantization; /* quantized on load (int8, q4, ...); NULL or "none": as stored */
    int max_seqs;             /* sequences drafted for at once (KV slots), >= 1 */
    int n_threads;            /* CPU threads of its forwards (0: all cores) */
    const char *device;       /* its backend: "cpu" (NULL) or "cuda:N" */
    int ctx;                  /* positions per slot: the coordinator's max_model_len */
} loom_coord_draft_options_t;

typedef struct loom_coord_draft loom_coord_draft_t;

/* INVALID_ARGUMENT with the reason when the draft cannot be loaded, or its
 * vocabulary, special ids or tokenizer (when its directory has one) differ
 * from the target's (naming both). target_tok: the target's tokenizer. */
loom_status_t loom_coord_draft_open(const loom_coord_draft_options_t *o,
                                    const loom_model_config_t *target,
                                    const loom_tokenizer_t *target_tok, loom_coord_draft_t **out,
                                    loom_err_t *err);
void loom_coord_draft_destroy(loom_coord_draft_t **d_p);
/* Makes d the drafter of s's method DRAFT (until s or d is destroyed:
 * destroy s first, its sequences tell d as they are freed). */
void loom_coord_draft_attach(loom_coord_draft_t *d, loom_sched_t *s);
/* Slots in use, and forwards that failed (logged; those steps drafted nothing). */
int loom_coord_draft_busy(const loom_coord_draft_t *d);
long loom_coord_draft_errors(const loom_coord_draft_t *d);

#endif
