/* Data-parallel attention (spec.dp_attention; docs/architecture.md): every
 * TP rank of a stage holds the whole attention block and runs it for its own
 * sequences only, over a KV pool that holds only their blocks; between
 * layers every rank still holds every row of the batch.
 *
 *   xb (all rows) --gather own rows--> attention on the sub-batch (local KV
 *   ids, o_proj not reduced) --scatter into zeroed rows--> xb2 --all-reduce-->
 *   every rank has every row (x + 0 = x: the sum is exact)
 *
 * So a layer makes as many collectives as under TP, each of the same bytes:
 * an all-gather of the ranks' rows done as an all-reduce of zero-padded
 * ones. The step's sub-batch is built on the host (loom_blk_attn_dp_batch) and
 * uploaded with the rest of the step's metadata. */
#include <string.h>

#include "common/util.h"
#include "worker/engine/model_impl.h"

loom_status_t loom_blk_attn_dp_batch(loom_model_t *m, const loom_step_batch_t *b, loom_dp_batch_t *dp,
                                     loom_err_t *err) {
    const int rank = m->spec.tp_rank, nb = m->n_blocks, B = m->block_size, mb = b->max_blocks;
    const int n = b->n_tokens;
    const int32_t lo = (int32_t)rank * nb; /* this rank's partition of the plan's ids: [lo, lo + nb) */
    memset(dp, 0, sizeof *dp);
    if (!b->seq_dp_rank)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "a data-parallel attention step names no ranks");
    if (m->dp_seq_cap < b->n_seqs) {
        m->dp_seq_cap = b->n_seqs;
        m->dp_seq_map = loom_xrealloc(m->dp_seq_map, (size_t)b->n_seqs * sizeof *m->dp_seq_map);
    }
    for (int q = 0; q < b->n_seqs; q++) {
        if (b->seq_dp_rank[q] < 0 || b->seq_dp_rank[q] >= m->spec.tp_size)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "sequence %d: data-parallel attention rank %d of %d",
                                q, b->seq_dp_rank[q], m->spec.tp_size);
        m->dp_seq_map[q] = b->seq_dp_rank[q] == rank ? dp->n_seqs++ : -1;
    }
    for (int i = 0; i < n; i++) dp->n += m->dp_seq_map[b->tok_seq[i]] >= 0;
    /* host layout: rows (k), each batch row's index among them or -1 (n), then the sub-batch's pos, slots,
     * tok_seq (k each) and block tables (its sequences x max_blocks) */
    const int k = dp->n;
    dp->n_meta = (size_t)k * 4 + (size_t)n + (size_t)dp->n_seqs * (size_t)mb;
    if (m->dp_host_cap < dp->n_meta) {
        m->dp_host_cap = dp->n_meta;
        m->dp_host = loom_xrealloc(m->dp_host, m->dp_host_cap * sizeof *m->dp_host);
    }
    int32_t *rows = m->dp_host, *at = rows + k, *pos = at + n, *slots = pos + k, *seq = slots + k, *bt = seq + k;
    int j = 0;
    dp->max_pos = 0;
    for (int i = 0; i < n; i++) {
        int q = m->dp_seq_map[b->tok_seq[i]];
        at[i] = q >= 0 ? j : -1;
        if (q < 0) continue;
        int32_t sl = b->slots[i] - lo * B;
        if (sl < 0 || sl >= nb * B)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "step token %d: slot %d outside data-parallel attention rank %d's blocks", i,
                                b->slots[i], rank);
        rows[j] = i;
        pos[j] = b->pos[i];
        slots[j] = sl;
        seq[j] = q;
        if (b->pos[i] > dp->max_pos) dp->max_pos = b->pos[i];
        j++;
    }
    for (int q = 0; q < b->n_seqs; q++) {
        if (m->dp_seq_map[q] < 0) continue;
        const int32_t *src = b->block_tables + (size_t)q * mb;
        int32_t *dst = bt + (size_t)m->dp_seq_map[q] * mb;
        for (int e = 0; e < mb; e++) {
            if (src[e] >= 0 && (src[e] < lo || src[e] >= lo + nb))
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                    "sequence %d: block %d outside data-parallel attention rank %d's blocks", q,
                                    src[e], rank);
            dst[e] = src[e] >= 0 ? src[e] - lo : -1;
        }
    }
    return LOOM_OK;
}

int loom_model_dp_copies(const loom_model_t *m, const int32_t *src, const int32_t *dst, int n, int32_t *lsrc,
                         int32_t *ldst) {
    const int32_t lo = (int32_t)m->spec.tp_rank * m->n_blocks, hi = lo + m->n_blocks;
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (src[i] < lo || src[i] >= hi || dst[i] < lo || dst[i] >= hi) continue; /* another rank's sequence */
        lsrc[k] = src[i] - lo;
        ldst[k++] = dst[i] - lo;
    }
    return k;
}

loom_status_t loom_blk_attn_dp(loom_model_t *m, const loom_step_ops_t *so, int l, loom_blk_attn_fn attn,
                               loom_err_t *err) {
    const int dim = m->cfg.dim;
    float *xb = m->xb, *xb2 = m->xb2;
    if (so->dp->n > 0) {
        loom_op_gather_rows(m->be, m->dp_xb, xb, so->d_dp_rows, so->dp->n, dim);
        /* the block reads xb and writes xb2: pointed at this rank's compact rows while it runs */
        m->xb = m->dp_xb;
        m->xb2 = m->dp_xb2;
        loom_status_t s = attn(m, so->dp, l, err);
        m->xb = xb;
        m->xb2 = xb2;
        LOOM_CHECK(s);
    }
    /* xb2 = this rank's rows where it owns them, 0 elsewhere (rows of no pair are zeroed) */
    loom_op_moe_combine(m->be, xb2, m->dp_xb2, so->d_dp_at, m->dp_one, so->n, 1, dim, 0);
    return loom_blk_allreduce(m, xb2, (int64_t)so->n * dim, err);
}
