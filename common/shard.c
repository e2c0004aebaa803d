/* Grid cell dimensions (see shard.h). */
#include "common/shard.h"

#include <stdint.h>
#include <string.h>

void loom_split_range(int total, int parts, int p, int *begin, int *len) {
    int64_t b = (int64_t)total * p / parts;
    int64_t e = (int64_t)total * (p + 1) / parts;
    *begin = (int)b;
    *len = (int)(e - b);
}

loom_status_t loom_shard_dims(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                              loom_shard_dims_t *d, loom_err_t *err) {
    memset(d, 0, sizeof *d);
    int tp = spec->tp_size, r = spec->tp_rank;
    if (tp < 1 || r < 0 || r >= tp)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tp rank %d of %d is invalid", r, tp);
    if (spec->layer_begin < 0 || spec->layer_end > cfg->n_layers || spec->layer_begin > spec->layer_end)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "layer range [%d, %d) outside 0..%d",
                            spec->layer_begin, spec->layer_end, cfg->n_layers);
    if (!spec->dp_attention && cfg->n_heads % tp != 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tensor parallelism %d does not divide the %d attention heads", tp,
                            cfg->n_heads);
    int group = cfg->n_heads / cfg->n_kv_heads; /* query heads per KV head */
    d->n_heads = cfg->n_heads / tp;
    d->q_head_begin = r * d->n_heads;
    if (spec->dp_attention) { /* the attention block whole on every rank; the MLPs and head sliced below */
        d->n_heads = cfg->n_heads;
        d->n_kv_heads = cfg->n_kv_heads;
        d->q_head_begin = d->kv_head_begin = 0;
    } else if (cfg->n_kv_heads % tp == 0) {
        d->n_kv_heads = cfg->n_kv_heads / tp;
        d->kv_head_begin = r * d->n_kv_heads;
    } else if (tp % cfg->n_kv_heads == 0 && group % d->n_heads == 0) {
        d->n_kv_heads = 1; /* fewer KV heads than ranks: replicate */
        d->kv_head_begin = d->q_head_begin / group;
    } else {
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tensor parallelism %d cannot split %d KV heads (it must divide them "
                            "or be a multiple of them)",
                            tp, cfg->n_kv_heads);
    }
    if (cfg->hidden_dim < tp || cfg->vocab_size < tp)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "model too small for %d-way tensor parallelism", tp);
    loom_split_range(cfg->hidden_dim, tp, r, &d->hidden_begin, &d->hidden);
    loom_split_range(cfg->vocab_size, tp, r, &d->vocab_begin, &d->vocab);
    d->n_layers = spec->layer_end - spec->layer_begin;
    return LOOM_OK;
}

