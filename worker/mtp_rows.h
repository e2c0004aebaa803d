/* DeepSeek's MTP module as a worker-side draft (docs/speculative.md, MTP on
 * the grid): which token each MTP row of a step reads, and which row gives
 * each sequence's draft. Pure: a step plan's arrays and the sampled ids in,
 * the MTP step's rows out. */
#ifndef LOOM_MTP_ROWS_H
#define LOOM_MTP_ROWS_H

#include <stdint.h>

typedef struct {
    const int32_t *tokens, *tok_seq; /* (n_tokens) the step's fed tokens and their sequence */
    int n_tokens, n_seqs;
    const int32_t *logit_rows; /* (n_logits) token rows sampled, a sequence's consecutive */
    const int32_t *sampled;    /* (n_logits) the ids sampled for them */
    int n_logits;
    const int32_t
        *next; /* (n_seqs or NULL) the token after a sequence's last fed one, -1 unknown */
} loom_mtp_step_t;

/* The MTP row at token t reads the token after t: the id sampled at t
 * where t has a logit row (equal to the next fed draft while drafts are
 * accepted), else the next fed token of the same sequence, else
 * next[seq]; a row with none of these reads its own token (its KV is
 * rewritten before any draft reads it). Writes in_ids (n_tokens); per
 * sequence with logit rows, the token row of its last accepted row (the
 * leading rows whose sampled id equals the draft fed after them) to
 * mtp_rows, in sequence order, and its sequence to mtp_seq. Returns the
 * count of mtp_rows (<= n_seqs). */
int loom_mtp_rows(const loom_mtp_step_t *st, int32_t *in_ids, int32_t *mtp_rows, int32_t *mtp_seq);

#endif
