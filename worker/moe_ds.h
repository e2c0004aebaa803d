/* DeepSeekMoE's router for one token: V3's sigmoid scores with a correction
 * bias for the choice and group-limited top-k (noaux_tc), V2's softmax with
 * greedy or group-limited top-k. Pure: logits in, experts and weights out. */
#ifndef LOOM_MOE_DS_H
#define LOOM_MOE_DS_H

#include "common/model_config.h"

typedef struct {
    int n_experts, top_k;
    int sigmoid;                 /* scores: 1 sigmoid (V3), 0 softmax (V2) */
    loom_ds_topk_t method;
    int n_group, topk_group;     /* grouped methods: experts in n_group equal groups, topk_group kept */
    int norm_topk_prob;          /* sigmoid: the chosen weights divided by their sum */
    float routed_scaling_factor; /* then every weight times this */
} loom_moe_ds_route_t;

/* The router of a deepseek config (cfg->deepseek set). */
loom_moe_ds_route_t loom_moe_ds_route_of(const loom_model_config_t *cfg);

/* One token: logits (n_experts) of the router's matmul in float, bias (n_experts, e_score_correction_bias;
 * NULL for none) added to the scores for the choice only. Writes the top_k chosen experts in ascending
 * order to ids and their weights (from the unbiased scores) to weights. scratch holds 2 x n_experts
 * floats. Ties go to the lower expert or group. Experts of the dropped groups are never chosen. */
void loom_moe_route_deepseek(const loom_moe_ds_route_t *r, const float *logits, const float *bias, float *scratch,
                             int *ids, float *weights);

#endif
