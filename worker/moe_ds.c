/* DeepSeekMoE routing for one token (worker/moe_ds.h). Plain C: E is at most
 * a few hundred, k and the groups a handful; the selections are repeated
 * argmax scans, which keep the tie order exact (the lower index wins). */
#include "worker/moe_ds.h"

#include <math.h>

#include "common/status.h"

loom_moe_ds_route_t loom_moe_ds_route_of(const loom_model_config_t *cfg) {
    loom_moe_ds_route_t r = {
        .n_experts = cfg->n_experts,
        .top_k = cfg->n_experts_per_tok,
        .sigmoid = cfg->scoring_sigmoid,
        .method = cfg->topk_method,
        .n_group = cfg->n_group > 0 ? cfg->n_group : 1,
        .topk_group = cfg->topk_group > 0 ? cfg->topk_group : 1,
        .norm_topk_prob = cfg->norm_topk_prob,
        .routed_scaling_factor = cfg->routed_scaling_factor,
    };
    return r;
}

/* The index of the largest of v[0..n) not yet taken (taken[i] != 0), the lowest on ties; -1 if none. */
static int argmax_free(const float *v, const unsigned char *taken, int n) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

void loom_moe_route_deepseek(const loom_moe_ds_route_t *r, const float *logits, const float *bias, float *scratch,
                             int *ids, float *weights) {
    const int E = r->n_experts, K = r->top_k;
    LOOM_ASSERT(E > 0 && K > 0 && K <= E && E <= 4096);
    float *scores = scratch, *choice = scratch + E;
    if (r->sigmoid) {
        for (int e = 0; e < E; e++) scores[e] = 1.0f / (1.0f + expf(-logits[e]));
    } else { /* softmax in float, the sum in double */
        float mx = logits[0];
        for (int e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        double sum = 0;
        for (int e = 0; e < E; e++) sum += scores[e] = expf(logits[e] - mx);
        for (int e = 0; e < E; e++) scores[e] = (float)(scores[e] / sum);
    }
    for (int e = 0; e < E; e++) choice[e] = scores[e] + (bias ? bias[e] : 0.0f);

    unsigned char taken[4096] = {0}; /* experts outside the kept groups, then the chosen ones */
    if (r->method != LOOM_DS_TOPK_GREEDY && r->n_group > 1) {
        const int G = r->n_group, per = E / G;
        LOOM_ASSERT(E % G == 0 && r->topk_group <= G && G <= 256);
        float gscore[256];
        unsigned char gtaken[256] = {0};
        for (int g = 0; g < G; g++) {
            const float *c = choice + g * per;
            if (r->method == LOOM_DS_TOPK_NOAUX_TC) { /* the sum of the group's best two */
                int a = c[1] > c[0] ? 1 : 0, b = 1 - a;
                for (int i = 2; i < per; i++) {
                    if (c[i] > c[a]) {
                        b = a;
                        a = i;
                    } else if (c[i] > c[b]) {
                        b = i;
                    }
                }
                gscore[g] = c[a] + c[b];
            } else { /* group_limited_greedy: the group's best */
                float m = c[0];
                for (int i = 1; i < per; i++) m = c[i] > m ? c[i] : m;
                gscore[g] = m;
            }
        }
        unsigned char keep[256] = {0};
        for (int t = 0; t < r->topk_group; t++) {
            int g = argmax_free(gscore, gtaken, G);
            gtaken[g] = keep[g] = 1;
        }
        for (int e = 0; e < E; e++) taken[e] = !keep[e / per];
    }
    unsigned char chosen[4096] = {0};
    for (int k = 0; k < K; k++) {
        int e = argmax_free(choice, taken, E);
        LOOM_ASSERT(e >= 0);
        taken[e] = chosen[e] = 1;
    }
    int n = 0;
    double sum = 0;
    for (int e = 0; e < E; e++)
        if (chosen[e]) {
            ids[n] = e;
            weights[n++] = scores[e];
            sum += scores[e];
        }
    double norm = r->sigmoid && r->norm_topk_prob ? 1.0 / (sum + 1e-20) : 1.0;
    for (int k = 0; k < K; k++) weights[k] = (float)(weights[k] * norm * r->routed_scaling_factor);
}
