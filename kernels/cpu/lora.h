/* Low-rank adapter deltas for a batch that mixes adapters (Punica's SGMV on
 * the CPU): every row of a projection's input may use another adapter, or
 * none, and the delta scale * B (A x) is added to that row's output. Rows
 * are grouped by adapter so each group's shrink (x A^T, n_g x r) and expand
 * (t B^T, n_g x out) run as matrix products rather than one row at a time.
 *
 * Napkin math for a rank-16 adapter on a 4096 x 4096 projection: the delta
 * costs 2 * 16 * (4096 + 4096) = 262k FLOPs per row against 33.5M for W x,
 * 0.8%; its A and B (0.5 MiB in f32) stay in cache across the rows. */
#ifndef LOOM_CPU_LORA_H
#define LOOM_CPU_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

/* loom_lora_op_slot_t: one resident adapter's matrices for one projection (kernels/backend.h) */

/* Floats of workspace loom_cpu_lora_sgmv needs for N rows. */
size_t loom_cpu_lora_workspace(int n, int64_t in, int max_r);

/* y[i, 0:out] += slots[s].scale * ((x[i, 0:in] A_s^T) B_s^T) for every row i
 * whose row_slot[i] = s >= 0 (rows with -1, or a slot of rank 0, are left
 * alone). ldx / ldy are the row strides of x and y. WS holds
 * loom_cpu_lora_workspace(n, in, max_r) floats. */
void loom_cpu_lora_sgmv(float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in, int64_t out,
                        const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots, float *ws);

/* The plain per-row reference of loom_cpu_lora_sgmv (double accumulation). */
void loom_cpu_lora_ref(float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in, int64_t out,
                       const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots);

#endif
