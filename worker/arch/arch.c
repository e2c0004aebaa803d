/* The families' registry and what every family's table means: which names
 * apply to a config and layer (loom_arch_conds), a role's name, whether a
 * checkpoint tensor is one the family reads, and the capabilities a config
 * needs. Adding a family: its file in worker/arch/ and a line below. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/engine/arch.h"

extern const loom_arch_t loom_arch_llama;
extern const loom_arch_t loom_arch_gemma;
extern const loom_arch_t loom_arch_gpt_oss;
extern const loom_arch_t loom_arch_deepseek;

static const loom_arch_t *const k_archs[] = {&loom_arch_llama, &loom_arch_gemma, &loom_arch_gpt_oss,
                                             &loom_arch_deepseek};

int loom_arch_count(void) { return (int)LOOM_ARRAY_LEN(k_archs); }
const loom_arch_t *loom_arch_at(int i) { return i >= 0 && i < loom_arch_count() ? k_archs[i] : NULL; }

const loom_arch_t *loom_arch_find(const char *model_type) {
    for (int i = 0; i < loom_arch_count(); i++)
        for (const loom_arch_type_t *t = k_archs[i]->types; t->model_type; t++)
            if (!strcmp(t->model_type, model_type)) return k_archs[i];
    return NULL;
}

uint32_t loom_arch_conds(const loom_model_config_t *c, int layer) {
    uint32_t f = layer < 0 ? LOOM_TN_TOP : 0;
    f |= c->fused_qkv ? LOOM_TN_FUSED : LOOM_TN_SPLIT;
    if (c->qk_norm) f |= LOOM_TN_QK_NORM;
    if (c->attention_bias) f |= LOOM_TN_BIAS;
    f |= loom_model_config_layer_moe(c, layer) ? LOOM_TN_MOE : LOOM_TN_DENSE;
    f |= c->moe_mixtral_names ? LOOM_TN_MIXTRAL : LOOM_TN_QWEN_MOE;
    if (c->moe_shared_hidden) f |= LOOM_TN_SHARED;
    f |= c->ckpt_quant == LOOM_CKPT_MXFP4 ? LOOM_TN_MXFP4 : LOOM_TN_FLOAT;
    f |= c->q_lora_rank ? LOOM_TN_Q_LORA : LOOM_TN_Q_FULL;
    if (c->deepseek && c->topk_method == LOOM_DS_TOPK_NOAUX_TC) f |= LOOM_TN_NOAUX;
    return f;
}

/* Whether entry e applies at `layer` (-1: top-level) under conds. */
static int applies(const loom_tensor_name_t *e, int layer, uint32_t conds) {
    if (!(e->when & LOOM_TN_TOP) != (layer >= 0)) return 0;
    return (e->when & ~conds) == 0;
}

const char *loom_arch_tensor_name(const loom_arch_t *a, const loom_model_config_t *c, int layer,
                                  loom_tn_role_t role, int expert, char *buf, size_t size) {
    uint32_t conds = loom_arch_conds(c, layer);
    for (int i = 0; i < a->n_names; i++) {
        const loom_tensor_name_t *e = &a->names[i];
        if (e->role != role || !applies(e, layer, conds)) continue;
        if (layer < 0) {
            snprintf(buf, size, "%s", e->name);
            return buf;
        }
        char tail[200];
        const char *pct = strstr(e->name, "%d");
        if (pct)
            snprintf(tail, sizeof tail, "%.*s%d%s", (int)(pct - e->name), e->name, expert, pct + 2);
        else
            snprintf(tail, sizeof tail, "%s", e->name);
        snprintf(buf, size, "model.layers.%d.%s", layer, tail);
        return buf;
    }
    return NULL;
}

/* Matches s against a name with an optional "%d" (a decimal below
 * n_experts); returns what follows the match in s, or NULL. */
static const char *match(const char *pat, const char *s, int n_experts) {
    const char *pct = strstr(pat, "%d");
    if (!pct) {
        size_t n = strlen(pat);
        return strncmp(s, pat, n) ? NULL : s + n;
    }
    size_t n = (size_t)(pct - pat);
    if (strncmp(s, pat, n)) return NULL;
    s += n;
    char *end;
    long j = strtol(s, &end, 10);
    if (end == s || *s < '0' || *s > '9' || j < 0 || j >= n_experts) return NULL;
    return match(pct + 2, end, n_experts);
}

int loom_arch_tensor_used(const loom_arch_t *a, const loom_model_config_t *c, const char *name, int *linear) {
    static const char *const parts[] = {"weight", "qweight", "scales", "mins", "qzeros", "g_idx"};
    static const char inv[] = "_scale_inv";
    size_t len = strlen(name);
    if (c->ckpt_quant == LOOM_CKPT_FP8 && len > sizeof inv && len < 512 &&
        !strcmp(name + len - (sizeof inv - 1), inv)) { /* an FP8 weight's scales: used with the weight */
        char base[512];
        snprintf(base, sizeof base, "%.*s", (int)(len - (sizeof inv - 1)), name);
        return loom_arch_tensor_used(a, c, base, linear);
    }
    int layer = -1;
    if (!strncmp(name, "model.layers.", 13)) {
        char *end;
        long li = strtol(name + 13, &end, 10);
        if (end == name + 13 || *end != '.' || li < 0 || li > 1 << 24) return 0;
        layer = (int)li;
        name = end + 1;
    }
    uint32_t conds = loom_arch_conds(c, layer);
    for (int i = 0; i < a->n_names; i++) {
        const loom_tensor_name_t *e = &a->names[i];
        if (!applies(e, layer, conds)) continue;
        const char *rest = match(e->name, name, c->n_experts);
        if (!rest) continue;
        if (e->kind == LOOM_TN_TENSOR && !*rest) {
            if (linear) *linear = 0;
            return 1;
        }
        if (e->kind == LOOM_TN_LINEAR && *rest == '.')
            for (size_t k = 0; k < LOOM_ARRAY_LEN(parts); k++)
                if (!strcmp(rest + 1, parts[k])) {
                    if (linear) *linear = 1;
                    return 1;
                }
    }
    return 0;
}

uint32_t loom_arch_needs_common(const loom_model_config_t *c, const loom_shard_spec_t *spec) {
    uint32_t need = 0;
    for (int l = spec->layer_begin; l < spec->layer_end; l++) {
        if (loom_model_config_layer_window(c, l)) need |= LOOM_CAP_ATTN_WINDOW;
        if (loom_model_config_layer_moe(c, l)) need |= LOOM_CAP_MOE;
    }
    if (c->attn_softcap > 0 && spec->layer_end > spec->layer_begin) need |= LOOM_CAP_ATTN_SOFTCAP;
    if (c->final_softcap > 0 && spec->has_head) need |= LOOM_CAP_LOGIT_SOFTCAP;
    if (c->hidden_act != LOOM_HIDDEN_SILU) need |= LOOM_CAP_ACT;
    if (c->head_dim > 256 && spec->layer_end > spec->layer_begin) need |= LOOM_CAP_ATTN_WIDE;
    if (c->head_dim > 768 && spec->layer_end > spec->layer_begin) need |= LOOM_CAP_ATTN_HUGE;
    return need;
}

void loom_arch_need_detail(const loom_model_config_t *c, const loom_shard_spec_t *spec, uint32_t cap, char *buf,
                           size_t size) {
    static const char *const acts[] = {"silu", "gelu", "gelu_pytorch_tanh", "quick_gelu", "relu", "relu2"};
    buf[0] = 0;
    switch (cap) {
    case LOOM_CAP_ATTN_WINDOW:
        for (int l = spec->layer_begin; l < spec->layer_end; l++)
            if (loom_model_config_layer_window(c, l)) {
                snprintf(buf, size, "layer %d has a window of %d", l, loom_model_config_layer_window(c, l));
                return;
            }
        return;
    case LOOM_CAP_ATTN_SOFTCAP: snprintf(buf, size, "attn_logit_softcapping %g", (double)c->attn_softcap); return;
    case LOOM_CAP_LOGIT_SOFTCAP: snprintf(buf, size, "final_logit_softcapping %g", (double)c->final_softcap); return;
    case LOOM_CAP_ACT:
        if ((unsigned)c->hidden_act < LOOM_ARRAY_LEN(acts)) snprintf(buf, size, "hidden_act %s", acts[c->hidden_act]);
        return;
    case LOOM_CAP_ATTN_SINKS: snprintf(buf, size, "%s's attention", c->model_type); return;
    case LOOM_CAP_SWIGLU_CLAMP: snprintf(buf, size, "%s's experts", c->model_type); return;
    case LOOM_CAP_ATTN_WIDE:
    case LOOM_CAP_ATTN_HUGE: snprintf(buf, size, "head_dim %d", c->head_dim); return;
    default: return;
    }
}
