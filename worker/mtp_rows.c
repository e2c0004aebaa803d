/* Which token each MTP row of a step reads (see mtp_rows.h). */
#include "worker/mtp_rows.h"

static int same_seq_next(const loom_mtp_step_t *st, int t) {
    return t + 1 < st->n_tokens && st->tok_seq[t + 1] == st->tok_seq[t];
}

int loom_mtp_rows(const loom_mtp_step_t *st, int32_t *in_ids, int32_t *mtp_rows, int32_t *mtp_seq) {
    for (int t = 0; t < st->n_tokens; t++) {
        int s = st->tok_seq[t];
        if (same_seq_next(st, t))
            in_ids[t] = st->tokens[t + 1];
        else if (st->next && st->next[s] >= 0)
            in_ids[t] = st->next[s];
        else
            in_ids[t] = st->tokens[t];
    }
    int n = 0;
    for (int r = 0; r < st->n_logits;) {
        int s = st->tok_seq[st->logit_rows[r]], m = 1;
        while (r + m < st->n_logits && st->tok_seq[st->logit_rows[r + m]] == s)
            m++;
        for (int j = 0; j < m; j++)
            in_ids[st->logit_rows[r + j]] = st->sampled[r + j];
        /* a verify step: row j+1 fed the draft that row j's sample checks */
        int a = 0;
        while (a + 1 < m && st->sampled[r + a] == st->tokens[st->logit_rows[r + a + 1]])
            a++;
        mtp_rows[n] = st->logit_rows[r + a];
        mtp_seq[n++] = s;
        r += m;
    }
    return n;
}
