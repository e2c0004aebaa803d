/* How a model is cut into grid cells: layer ranges per pipeline stage and
 * the slice of heads, intermediate rows and vocabulary per tensor-parallel
 * rank. Used by the coordinator to plan and by each worker to load. */
#ifndef LOOM_SHARD_H
#define LOOM_SHARD_H

#include "common/model_config.h"
#include "common/status.h"

/* Which cell of the grid this shard is. */
typedef struct loom_shard_spec {
    int tp_rank, tp_size;
    int layer_begin, layer_end; /* [begin, end) */
    int has_embed;              /* first stage: embeds token ids */
    int has_head;               /* last stage: final norm + LM head */
    int dp_attention;           /* data-parallel attention: every rank holds every head (Assign.dp_attention) */
} loom_shard_spec_t;

/* The slice of the model's dimensions this shard owns. */
typedef struct loom_shard_dims {
    int n_heads, n_kv_heads; /* on this rank (all of them with spec.dp_attention) */
    int kv_head_begin;       /* first global KV head held */
    int q_head_begin;        /* first global query head held */
    int hidden_begin, hidden; /* slice of the intermediate size */
    int vocab_begin, vocab;   /* slice of the vocabulary (LM head) */
    int n_layers;             /* layer_end - layer_begin */
} loom_shard_dims_t;

/* Splits [0, total) into `parts` balanced ranges; returns part p's begin/len. */
void loom_split_range(int total, int parts, int p, int *begin, int *len);
/* Checks that the model can be split tp ways and fills dims; a clear error if not. */
loom_status_t loom_shard_dims(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                              loom_shard_dims_t *dims, loom_err_t *err);

#endif
