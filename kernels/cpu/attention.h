/* Paged GQA attention on the CPU (semantics in backend.h, loom_op_attention).
 * The work splits into tasks of (token, a run of query heads sharing one KV
 * head); a task reads each cached key and value row once for all its heads. */
#ifndef LOOM_CPU_ATTENTION_H
#define LOOM_CPU_ATTENTION_H

#include <stddef.h>

#include "kernels/backend.h"

/* Query heads per task: the largest divisor of the group size nh/nkv that
 * still gives at least 2 tasks per thread (1 if none does). */
int loom_cpu_attention_heads_per_task(const loom_attn_args_t *a, int n_threads);
/* Floats of scratch one task needs: heads_per_task * (max_ctx + 1 + block)
 * + block. */
size_t loom_cpu_attention_scratch_floats(const loom_attn_args_t *a, int heads_per_task);
/* Runs task `task` of a->n * (n_heads / heads_per_task). */
void loom_cpu_attention_task(const loom_attn_args_t *a, int heads_per_task, int task,
                             float *scratch);

#endif
