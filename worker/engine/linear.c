/* Every projection of every family passes through loom_blk_linear: q/k/v,
 * o, the MLP's gate/up and down, the MoE router, experts and shared
 * expert, and the LM head; the batched expert GEMV of device-routed MoE
 * decode steps through loom_blk_linear_experts. That is where per-request
 * low-rank deltas (LoRA) enter, and nowhere else: the step's adapters ride
 * in the step's ops (loom_step_ops_t.adapters, NULL when no row has one)
 * and each call names its projection, layer and expert (loom_blk_lora
 * picks the adapted ones). The delta is added before the TP all-reduce
 * that row-parallel projections end with, which this file also owns, so
 * the ranks' partial deltas are summed with W's partial sums. */
#include "worker/engine/model_impl.h"

loom_status_t loom_blk_allreduce(loom_model_t *m, float *buf, int64_t n, loom_err_t *err) {
    if (m->spec.tp_size == 1 || !m->opt.allreduce) return LOOM_OK;
    return m->opt.allreduce(m->opt.allreduce_ctx, buf, n, err);
}

loom_status_t loom_blk_linear(loom_model_t *m, const loom_blk_adapters_t *ad, const loom_blk_linear_t *lin,
                              float *y, const float *x, int n, loom_err_t *err) {
    if (lin->bias)
        loom_op_matmul_bias(m->be, y, x, lin->w, lin->bias, n);
    else
        loom_op_matmul(m->be, y, x, lin->w, n);
    if (ad) loom_blk_lora(m, ad, lin, y, x, n);
    return lin->reduce ? loom_blk_allreduce(m, y, (int64_t)n * lin->w->rows, err) : LOOM_OK;
}

void loom_blk_linear_experts(loom_model_t *m, const loom_blk_adapters_t *ad, const loom_blk_linear_t *lin,
                             float *y, const float *x, int xdiv, const int32_t *sel, int n_pairs,
                             const void *table) {
    (void)ad; /* experts are never adapted (common/lora.c refuses them) */
    LOOM_ASSERT(!lin->bias && !lin->reduce);
    loom_op_moe_gemv(m->be, y, x, xdiv, sel, n_pairs, table, lin->w->dtype, lin->w->rows, lin->w->cols);
}
