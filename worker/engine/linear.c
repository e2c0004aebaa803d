/* Every projection of every family passes through loom_blk_linear: q/k/v,
 * o, the MLP's gate/up and down, the MoE router, experts and shared
 * expert, and the LM head; the batched expert GEMV of device-routed MoE
 * decode steps through loom_blk_linear_experts. That is where per-request
 * low-rank deltas (LoRA) will enter, and nowhere else: the step's adapters
 * ride in the step's ops (loom_step_ops_t.adapters, NULL today) and each
 * call names its projection, layer and expert. It also owns the TP
 * all-reduce hook that row-parallel projections end with. */
#include "worker/engine/model_impl.h"

loom_status_t loom_blk_allreduce(loom_model_t *m, float *buf, int64_t n, loom_err_t *err) {
    if (m->spec.tp_size == 1 || !m->opt.allreduce) return LOOM_OK;
    return m->opt.allreduce(m->opt.allreduce_ctx, buf, n, err);
}

loom_status_t loom_blk_linear(loom_model_t *m, const loom_blk_adapters_t *ad, const loom_blk_linear_t *lin,
                              float *y, const float *x, int n, loom_err_t *err) {
    LOOM_ASSERT(ad == NULL); /* no adapters exist yet */
    loom_op_matmul(m->be, y, x, lin->w, n);
    if (lin->bias) loom_op_add_bias(m->be, y, lin->bias, n, (int)lin->w->rows);
    return lin->reduce ? loom_blk_allreduce(m, y, (int64_t)n * lin->w->rows, err) : LOOM_OK;
}

void loom_blk_linear_experts(loom_model_t *m, const loom_blk_adapters_t *ad, const loom_blk_linear_t *lin,
                             float *y, const float *x, int xdiv, const int32_t *sel, int n_pairs,
                             const void *table) {
    LOOM_ASSERT(ad == NULL && !lin->bias && !lin->reduce);
    loom_op_moe_gemv(m->be, y, x, xdiv, sel, n_pairs, table, lin->w->dtype, lin->w->rows, lin->w->cols);
}
