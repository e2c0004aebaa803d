/* The draft model of speculative method DRAFT, run inside the coordinator
 * (its own worker, in-process): a smaller model with the target's
 * vocabulary, or the target itself quantized (a self-draft), on the CPU
 * backend (or a GPU of the coordinator's host, --speculative-device), with its own KV cache of
 * `max_seqs` sequence slots. A slot follows one sequence and catches up with
 * the tokens it has not seen (the accepted ones, and the correction of a
 * rejected draft) before it proposes. A sequence that finds every slot busy
 * is decoded without drafts. Nothing the draft proposes changes the output
 * (docs/speculative.md): the target's verify step decides.
 *
 * The draft's forwards run on a thread of their own, never on the reactor
 * (STYLE.md: compute on its own threads, results handed back), in two
 * halves:
 *   reactor  as the scheduler builds a step it asks for each speculating
 *            decode's drafts (loom_sched_set_drafter); the answer is a
 *            reservation: the sequence's slot and how many drafts it gets
 *            (what the model will propose: K, fewer where the slot's context
 *            ends, none without a free slot), a copy of its tokens, and
 *            placeholder ids in the draft positions. loom_coord_draft_submit
 *            then hands the step's reservations to the thread (a job); the
 *            step waits, unsent.
 *   thread   runs the jobs in order (loom_local_propose per reservation)
 *            and wakes the reactor through a pipe (loom_coord_draft_fd).
 *   reactor  loom_coord_draft_take writes a done job's drafts into its step
 *            (mb->draft_s gets the forwards' time, so the step's time
 *            includes them) and hands the step back to be sent.
 * The steps, their drafts and the order of the draft's forwards are the
 * ones a draft run inside the scheduler would give. The slot table belongs
 * to the reactor; the model and its KV to the thread. Test hook:
 * LOOM_TEST_DRAFT_DELAY_MS=N makes the thread sleep N ms before each
 * sequence's drafts (a slow draft, for the reactor's liveness tests). */
#ifndef LOOM_COORD_DRAFT_H
#define LOOM_COORD_DRAFT_H

#include "common/model_config.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "coordinator/sched.h"
#include "worker/local.h"

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
/* After loom_sched_schedule built mb: 1 when mb holds reservations, now a
 * job of the drafting thread (mb must not be sent before
 * loom_coord_draft_take hands it back); 0 when it has none (send it). */
int loom_coord_draft_submit(loom_coord_draft_t *d, loom_microbatch_t *mb);
/* Readable when a job is done: poll it, then loom_coord_draft_take until 0. */
int loom_coord_draft_fd(const loom_coord_draft_t *d);
/* Takes the next done job: 1 and *mb its micro-batch with the drafts written
 * (NULL when the job was voided), 0 when none is done. */
int loom_coord_draft_take(loom_coord_draft_t *d, loom_microbatch_t **mb);
/* mb failed before it was sent (its grid is gone): its job, done or not, is
 * dropped unwritten (mb may be rebuilt before the job comes back). */
void loom_coord_draft_void(loom_coord_draft_t *d, const loom_microbatch_t *mb);
/* Slots in use, and forwards that failed (logged; those steps verify their
 * placeholder drafts, which changes nothing but the acceptance counts). */
int loom_coord_draft_busy(const loom_coord_draft_t *d);
long loom_coord_draft_errors(const loom_coord_draft_t *d);
/* The draft model's forwards and tokens read so far (worker/local.h); read
 * it between jobs (after loom_coord_draft_take returned the last). */
loom_local_counters_t loom_coord_draft_counters(const loom_coord_draft_t *d);

#endif
