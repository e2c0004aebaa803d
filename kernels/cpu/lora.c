/* Mixed-adapter LoRA deltas on the CPU (see lora.h). */
#include "kernels/cpu/lora.h"

#include <cblas.h>
#include <string.h>

#include "common/status.h"

/* Groups of at least this many rows go through sgemm; fewer run as loops
 * (sgemm's call cost dominates a one-row product of a rank-16 adapter). */
#define SGEMM_MIN_ROWS 4

size_t loom_cpu_lora_workspace(int n, int64_t in, int max_r) {
    /* the group's row indices (as floats' room), its gathered x, its t */
    return (size_t)n + (size_t)n * (size_t)in + (size_t)n * (size_t)max_r;
}

static void rows_loop(float *y, int64_t ldy, const float *x, int64_t ldx, const int32_t *rows, int nr, int64_t in,
                      int64_t out, const loom_lora_op_slot_t *sl, float *t) {
    for (int g = 0; g < nr; g++) {
        const float *xi = x + (int64_t)rows[g] * ldx;
        float *yi = y + (int64_t)rows[g] * ldy;
        for (int k = 0; k < sl->r; k++) {
            const float *ak = sl->a + (int64_t)k * in;
            float acc = 0;
            for (int64_t c = 0; c < in; c++) acc += ak[c] * xi[c];
            t[k] = acc * sl->scale;
        }
        for (int k = 0; k < sl->r; k++) {
            const float *bk = sl->bt + (int64_t)k * out;
            float tk = t[k];
            for (int64_t o = 0; o < out; o++) yi[o] += tk * bk[o];
        }
    }
}

void loom_cpu_lora_sgmv(float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in, int64_t out,
                        const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots, float *ws) {
    int32_t *rows = (int32_t *)ws;
    float *xg = ws + n, *tg = xg + (size_t)n * (size_t)in;
    for (int s = 0; s < n_slots; s++) {
        const loom_lora_op_slot_t *sl = &slots[s];
        if (sl->r <= 0) continue;
        int nr = 0;
        for (int i = 0; i < n; i++)
            if (row_slot[i] == s) rows[nr++] = i;
        if (nr == 0) continue;
        if (nr < SGEMM_MIN_ROWS) {
            rows_loop(y, ldy, x, ldx, rows, nr, in, out, sl, tg);
            continue;
        }
        /* contiguous rows are read in place; others are gathered */
        const float *xs = x + (int64_t)rows[0] * ldx;
        int contiguous = rows[nr - 1] - rows[0] == nr - 1;
        if (!contiguous) {
            for (int g = 0; g < nr; g++) memcpy(xg + (int64_t)g * in, x + (int64_t)rows[g] * ldx, (size_t)in * sizeof(float));
            xs = xg;
        }
        int64_t lds = contiguous ? ldx : in;
        /* t = scale * xs A^T  (nr x r) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, sl->r, (int)in, sl->scale, xs, (int)lds, sl->a,
                    (int)in, 0.0f, tg, sl->r);
        if (contiguous) {
            /* y[rows] += t Bt  (nr x out) */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, (int)out, sl->r, 1.0f, tg, sl->r, sl->bt,
                        (int)out, 1.0f, y + (int64_t)rows[0] * ldy, (int)ldy);
        } else {
            for (int g = 0; g < nr; g++) {
                float *yi = y + (int64_t)rows[g] * ldy;
                const float *t = tg + (int64_t)g * sl->r;
                for (int k = 0; k < sl->r; k++) {
                    const float *bk = sl->bt + (int64_t)k * out;
                    float tk = t[k];
                    for (int64_t o = 0; o < out; o++) yi[o] += tk * bk[o];
                }
            }
        }
    }
}

void loom_cpu_lora_ref(float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in, int64_t out,
                       const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots) {
    for (int i = 0; i < n; i++) {
        int s = row_slot[i];
        if (s < 0) continue;
        LOOM_ASSERT(s < n_slots);
        const loom_lora_op_slot_t *sl = &slots[s];
        const float *xi = x + (int64_t)i * ldx;
        for (int64_t o = 0; o < out; o++) {
            double acc = 0;
            for (int k = 0; k < sl->r; k++) {
                double t = 0;
                for (int64_t c = 0; c < in; c++) t += (double)sl->a[k * in + c] * xi[c];
                acc += t * sl->bt[(int64_t)k * out + o];
            }
            y[(int64_t)i * ldy + o] += (float)(acc * sl->scale);
        }
    }
}
