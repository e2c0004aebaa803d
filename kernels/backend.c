/* Backend dispatch: creation by device kind and thin wrappers over the vtable. */
#include "kernels/backend_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

int loom_device_parse(const char *s, loom_device_kind_t *kind, int *index) {
    if (!s) return 0;
    if (!strcmp(s, "cpu")) {
        *kind = LOOM_DEVICE_CPU;
        *index = 0;
        return 1;
    }
    if (!strncmp(s, "cuda", 4)) {
        *kind = LOOM_DEVICE_CUDA;
        *index = 0;
        if (s[4] == '\0') return 1;
        if (s[4] != ':' || s[5] == '\0') return 0;
        char *end = NULL;
        long v = strtol(s + 5, &end, 10);
        if (*end != '\0' || v < 0 || v > 1024) return 0;
        *index = (int)v;
        return 1;
    }
    return 0;
}

int loom_backend_available(loom_device_kind_t kind, int device_index) {
    if (kind == LOOM_DEVICE_CPU) return 1;
#ifdef LOOM_HAVE_CUDA
    return device_index < loom_backend_cuda_device_count();
#else
    (void)device_index;
    return 0;
#endif
}

/* A backend's declared capabilities agree with the slots it fills (a
 * programmer error otherwise). */
static void check_caps(const loom_backend_t *be) {
    const loom_backend_ops_t *o = be->ops;
    LOOM_ASSERT(!(o->caps & LOOM_CAP_LOGIT_SOFTCAP) == !o->softcap);
    LOOM_ASSERT(!(o->caps & LOOM_CAP_ACT) == !o->act_mul);
    LOOM_ASSERT(!(o->caps & LOOM_CAP_SWIGLU_CLAMP) == !o->swiglu_clamp);
    LOOM_ASSERT(!(o->caps & LOOM_CAP_MOE) == !o->moe_combine);
    static const loom_dtype_t kv[] = {LOOM_DT_BF16, LOOM_DT_I8, LOOM_DT_F8_E4M3};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(kv); i++)
        LOOM_ASSERT(!(o->caps & loom_cap_kv(kv[i])) == !loom_backend_kv_supported(be, kv[i]));
}

static const struct {
    uint32_t cap;
    const char *key, *name;
} k_caps[LOOM_CAP_COUNT] = {
    {LOOM_CAP_ATTN_WINDOW, "attn_window", "sliding-window attention"},
    {LOOM_CAP_ATTN_SOFTCAP, "attn_softcap", "attention logit soft capping"},
    {LOOM_CAP_ATTN_SINKS, "attn_sinks", "attention sinks"},
    {LOOM_CAP_LOGIT_SOFTCAP, "logit_softcap", "final logit soft capping"},
    {LOOM_CAP_ACT, "act", "MLP activations other than SiLU"},
    {LOOM_CAP_SWIGLU_CLAMP, "swiglu_clamp", "the clamped SwiGLU"},
    {LOOM_CAP_MOE, "moe", "Mixture-of-Experts blocks"},
    {LOOM_CAP_KV_BF16, "kv_bf16", "a bf16 KV cache"},
    {LOOM_CAP_KV_I8, "kv_int8", "an int8 KV cache"},
    {LOOM_CAP_KV_FP8, "kv_fp8", "an fp8 KV cache"},
    {LOOM_CAP_ATTN_WIDE, "attn_wide", "attention heads wider than 256"},
    {LOOM_CAP_ATTN_HUGE, "attn_huge", "attention heads wider than 768"},
};
const char *loom_cap_name(uint32_t cap) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_caps); i++)
        if (k_caps[i].cap == cap) return k_caps[i].name;
    return "?";
}
const char *loom_cap_key(uint32_t cap) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_caps); i++)
        if (k_caps[i].cap == cap) return k_caps[i].key;
    return "?";
}
uint32_t loom_cap_kv(loom_dtype_t dtype) {
    return dtype == LOOM_DT_BF16 ? LOOM_CAP_KV_BF16 : dtype == LOOM_DT_I8 ? LOOM_CAP_KV_I8
           : dtype == LOOM_DT_F8_E4M3 ? LOOM_CAP_KV_FP8 : 0;
}
uint32_t loom_backend_caps(const loom_backend_t *be) { return be->ops->caps; }
int loom_backend_compiled(loom_device_kind_t kind) {
#ifdef LOOM_HAVE_CUDA
    if (kind == LOOM_DEVICE_CUDA) return 1;
#endif
    return kind == LOOM_DEVICE_CPU;
}
uint32_t loom_backend_kind_caps(loom_device_kind_t kind) {
#ifdef LOOM_HAVE_CUDA
    if (kind == LOOM_DEVICE_CUDA) return loom_backend_cuda_caps();
#endif
    return kind == LOOM_DEVICE_CPU ? loom_backend_cpu_caps() : 0;
}
int loom_backend_device_count(void) {
#ifdef LOOM_HAVE_CUDA
    return loom_backend_cuda_device_count();
#else
    return 0;
#endif
}

loom_status_t loom_backend_create(const loom_backend_config_t *cfg, loom_backend_t **out,
                                  loom_err_t *err) {
    *out = NULL;
    if (cfg->version != LOOM_BACKEND_CONFIG_VERSION)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "backend config version %d, expected %d",
                            cfg->version, LOOM_BACKEND_CONFIG_VERSION);
    loom_status_t s;
    switch (cfg->kind) {
    case LOOM_DEVICE_CPU:
        s = loom_backend_cpu_create(cfg, out, err);
        if (s == LOOM_OK) check_caps(*out);
        return s;
    case LOOM_DEVICE_CUDA:
#ifdef LOOM_HAVE_CUDA
        s = loom_backend_cuda_create(cfg, out, err);
        if (s == LOOM_OK) check_caps(*out);
        return s;
#else
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "device cuda:%d requested, but this build has no CUDA backend "
                            "(rebuild with -DLOOM_CUDA=ON)",
                            cfg->device_index);
#endif
    }
    return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "unknown device kind %d", (int)cfg->kind);
}

void loom_backend_destroy(loom_backend_t **be_p) {
    if (!be_p || !*be_p) return;
    loom_backend_t *be = *be_p;
    *be_p = NULL;
    be->ops->destroy(be);
}

const char *loom_backend_name(const loom_backend_t *be) { return be->name; }
loom_device_kind_t loom_backend_kind(const loom_backend_t *be) { return be->cfg.kind; }
int loom_backend_threads(const loom_backend_t *be) { return be->cfg.n_threads; }
int loom_backend_device_index(const loom_backend_t *be) { return be->cfg.device_index; }
void *loom_backend_stream(loom_backend_t *be) { return be->ops->stream ? be->ops->stream(be) : NULL; }

void *loom_backend_alloc(loom_backend_t *be, size_t bytes) { return be->ops->alloc(be, bytes); }
void loom_backend_free(loom_backend_t *be, void *p) {
    if (p) be->ops->free(be, p);
}
void loom_backend_upload(loom_backend_t *be, void *dst, const void *src, size_t bytes) {
    if (bytes) be->ops->upload(be, dst, src, bytes);
}
void loom_backend_download(loom_backend_t *be, void *dst, const void *src, size_t bytes) {
    if (bytes) be->ops->download(be, dst, src, bytes);
}
void loom_backend_memset(loom_backend_t *be, void *dst, int value, size_t bytes) {
    if (bytes) be->ops->memset(be, dst, value, bytes);
}
void *loom_backend_host_alloc(loom_backend_t *be, size_t bytes) {
    return be->ops->host_alloc ? be->ops->host_alloc(be, bytes) : malloc(bytes ? bytes : 1);
}
void loom_backend_host_free(loom_backend_t *be, void *p) {
    if (!p) return;
    if (be->ops->host_free) be->ops->host_free(be, p);
    else free(p);
}
void loom_backend_xfer_begin(loom_backend_t *be) {
    if (be->ops->xfer_begin) be->ops->xfer_begin(be);
}
void loom_backend_xfer(loom_backend_t *be, void *dst, const void *src, size_t bytes, int to_host) {
    if (!bytes) return;
    if (be->ops->xfer) be->ops->xfer(be, dst, src, bytes, to_host);
    else if (to_host) be->ops->download(be, dst, src, bytes);
    else be->ops->upload(be, dst, src, bytes);
}
void loom_backend_xfer_end(loom_backend_t *be) {
    if (be->ops->xfer_end) be->ops->xfer_end(be);
}
void loom_backend_copy(loom_backend_t *be, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    if (be->ops->copy) {
        be->ops->copy(be, dst, src, bytes);
        return;
    }
    void *tmp = malloc(bytes); /* backends without a device copy bounce through the host */
    LOOM_ASSERT(tmp != NULL);
    be->ops->download(be, tmp, src, bytes);
    be->ops->upload(be, dst, tmp, bytes);
    free(tmp);
}
loom_status_t loom_backend_synchronize(loom_backend_t *be, loom_err_t *err) {
    return be->ops->synchronize ? be->ops->synchronize(be, err) : LOOM_OK;
}
size_t loom_backend_mem_free(loom_backend_t *be) { return be->ops->mem_free(be); }

loom_status_t loom_weight_upload(loom_backend_t *be, loom_weight_t *w, int64_t rows, int64_t cols,
                                 const float *host, loom_err_t *err) {
    return be->ops->weight_upload(be, w, rows, cols, host, err);
}
void loom_weight_free(loom_backend_t *be, loom_weight_t *w) {
    if (w && w->data) be->ops->weight_free(be, w);
}
loom_status_t loom_weight_upload_quant(loom_backend_t *be, loom_weight_t *w,
                                       const loom_qtensor_t *t, loom_err_t *err) {
    *w = (loom_weight_t){0};
    loom_status_t st = loom_qtensor_check(t, "weight", err);
    if (st != LOOM_OK) return st;
    if (!be->ops->weight_upload_quant)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s backend: no quantized weights",
                            be->ops->name);
    return be->ops->weight_upload_quant(be, w, t, err);
}
size_t loom_weight_bytes(const loom_weight_t *w) {
    if (w->quant == LOOM_QUANT_NONE)
        return (size_t)w->rows * (size_t)w->cols * loom_dtype_size(w->dtype);
    loom_qtensor_t t = {.quant = w->quant, .rows = w->rows, .cols = w->cols, .group = w->group,
                        .mins = w->mins};
    return loom_qtensor_bytes(&t);
}

void loom_op_matmul(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w, int n) {
    if (n > 0) be->ops->matmul(be, y, x, w, n);
}
void loom_op_rmsnorm(loom_backend_t *be, float *y, const float *x, const float *g, int n, int dim,
                     float eps) {
    if (n > 0) be->ops->rmsnorm(be, y, x, g, n, dim, eps);
}
void loom_op_add(loom_backend_t *be, float *y, const float *a, int64_t n) {
    if (n > 0) be->ops->add(be, y, a, n);
}
void loom_op_add_bias(loom_backend_t *be, float *y, const float *bias, int n, int cols) {
    if (n <= 0 || cols <= 0) return;
    if (be->ops->add_bias) {
        be->ops->add_bias(be, y, bias, n, cols);
        return;
    }
    for (int i = 0; i < n; i++) be->ops->add(be, y + (size_t)i * cols, bias, cols);
}
void loom_op_matmul_bias(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w, const float *bias,
                         int n) {
    if (n <= 0) return;
    if (be->ops->matmul_bias) {
        be->ops->matmul_bias(be, y, x, w, bias, n);
        return;
    }
    be->ops->matmul(be, y, x, w, n);
    loom_op_add_bias(be, y, bias, n, (int)w->rows);
}
void loom_op_silu_mul(loom_backend_t *be, float *out, const float *gu, int n, int hidden) {
    if (n > 0) be->ops->silu_mul(be, out, gu, n, hidden);
}
void loom_op_act_mul(loom_backend_t *be, loom_act_t act, float *out, const float *gu, int n, int hidden) {
    if (n <= 0) return;
    if (act == LOOM_ACT_SILU) {
        be->ops->silu_mul(be, out, gu, n, hidden);
        return;
    }
    LOOM_ASSERT(be->ops->act_mul);
    be->ops->act_mul(be, act, out, gu, n, hidden);
}
int loom_backend_act_supported(const loom_backend_t *be, loom_act_t act) {
    return act == LOOM_ACT_SILU || be->ops->act_mul != NULL;
}
void loom_op_swiglu_clamp(loom_backend_t *be, float *out, const float *gu, int n, int hidden,
                          float alpha, float limit) {
    LOOM_ASSERT(be->ops->swiglu_clamp && limit > 0);
    if (n > 0) be->ops->swiglu_clamp(be, out, gu, n, hidden, alpha, limit);
}
int loom_backend_swiglu_clamp_supported(const loom_backend_t *be) {
    return be->ops->swiglu_clamp != NULL;
}
void loom_op_head_rmsnorm(loom_backend_t *be, float *x, int stride, int n, int n_heads, int hd, const float *g,
                          float eps) {
    for (int i = 0; i < n; i++) {
        float *row = x + (size_t)i * (size_t)stride;
        be->ops->rmsnorm(be, row, row, g, n_heads, hd, eps);
    }
}
void loom_op_embed(loom_backend_t *be, float *x, const float *table, const int32_t *ids, int n,
                   int dim) {
    if (n > 0) be->ops->embed(be, x, table, ids, n, dim);
}
void loom_op_gather_rows(loom_backend_t *be, float *dst, const float *src, const int32_t *rows,
                         int n, int dim) {
    if (n > 0) be->ops->gather_rows(be, dst, src, rows, n, dim);
}
void loom_op_moe_combine(loom_backend_t *be, float *out, const float *y, const int32_t *pos,
                         const float *w, int n, int k, int dim, int accumulate) {
    LOOM_ASSERT(be->ops->moe_combine);
    if (n > 0) be->ops->moe_combine(be, out, y, pos, w, n, k, dim, accumulate);
}
void loom_moe_route_row(const float *logits, int E, int k, int norm, float *probs, int32_t *sel,
                        float *w) {
    float mx = logits[0];
    for (int e = 1; e < E; e++)
        mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0.0f;
    for (int e = 0; e < E; e++)
        sum += probs[e] = expf(logits[e] - mx);
    for (int e = 0; e < E; e++)
        probs[e] /= sum;
    float ksum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++)
                taken |= sel[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        sel[j] = best;
        w[j] = probs[best];
        ksum += w[j];
    }
    for (int j = 0; norm && j < k; j++)
        w[j] /= ksum;
    for (int j = 1; j < k; j++) /* ascending expert order */
        for (int i = j; i > 0 && sel[i - 1] > sel[i]; i--) {
            int32_t s = sel[i];
            float v = w[i];
            sel[i] = sel[i - 1], w[i] = w[i - 1];
            sel[i - 1] = s, w[i - 1] = v;
        }
}
int loom_backend_moe_device(loom_backend_t *be, const loom_weight_t *experts, int n_experts,
                            int k) {
    if (!be->ops->moe_route || !be->ops->moe_gemv || !be->ops->moe_device || !be->ops->moe_table)
        return 0;
    return be->ops->moe_device(be, experts, n_experts, k);
}
void *loom_backend_moe_table(loom_backend_t *be, const loom_weight_t *experts, int n_experts) {
    LOOM_ASSERT(be->ops->moe_table);
    return be->ops->moe_table(be, experts, n_experts);
}
void loom_op_moe_route(loom_backend_t *be, const float *logits, int n, int n_experts, int k,
                       int norm, int32_t *sel, float *w) {
    LOOM_ASSERT(be->ops->moe_route && k >= 1 && k <= n_experts);
    if (n > 0) be->ops->moe_route(be, logits, n, n_experts, k, norm, sel, w);
}
void loom_op_moe_gemv(loom_backend_t *be, float *y, const float *x, int xdiv, const int32_t *sel,
                      int n_pairs, const void *table, loom_dtype_t dtype, int64_t rows,
                      int64_t cols) {
    LOOM_ASSERT(be->ops->moe_gemv && xdiv >= 1);
    if (n_pairs > 0) be->ops->moe_gemv(be, y, x, xdiv, sel, n_pairs, table, dtype, rows, cols);
}
void loom_op_moe_add_bias(loom_backend_t *be, float *y, const int32_t *sel, int n_pairs, const float *bias,
                          int cols) {
    LOOM_ASSERT(be->ops->moe_add_bias);
    if (n_pairs > 0) be->ops->moe_add_bias(be, y, sel, n_pairs, bias, cols);
}
int loom_backend_moe_add_bias_supported(const loom_backend_t *be) {
    return be->ops->moe_add_bias != NULL;
}
int loom_backend_moe_route_ds_supported(const loom_backend_t *be, const loom_moe_ds_args_t *r) {
    return be->ops->moe_route_ds && be->ops->moe_route_ds_fits && be->ops->moe_route_ds_fits(r);
}
void loom_op_moe_route_ds(loom_backend_t *be, const float *logits, int n, const loom_moe_ds_args_t *r,
                          int32_t *sel, float *w) {
    LOOM_ASSERT(loom_backend_moe_route_ds_supported(be, r));
    if (n > 0) be->ops->moe_route_ds(be, logits, n, r, sel, w);
}
int loom_backend_has_lora(const loom_backend_t *be) { return be->ops->lora != NULL; }
void loom_op_lora(loom_backend_t *be, float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in,
                  int64_t out, const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots, int max_r) {
    LOOM_ASSERT(be->ops->lora && max_r >= 1);
    if (n > 0 && n_slots > 0) be->ops->lora(be, y, ldy, x, ldx, n, in, out, row_slot, slots, n_slots, max_r);
}
void loom_op_rope(loom_backend_t *be, float *x, int stride, int n, int n_heads, int hd,
                  const int32_t *pos, const float *inv_freq) {
    if (n > 0) be->ops->rope(be, x, stride, n, n_heads, hd, pos, inv_freq);
}
/* --- KV cache dtypes ---------------------------------------------------- */

static const struct {
    const char *name;
    loom_dtype_t dtype;
} k_kv_dtypes[] = {
    {"f32", LOOM_DT_F32}, {"bf16", LOOM_DT_BF16}, {"int8", LOOM_DT_I8}, {"fp8", LOOM_DT_F8_E4M3}};

size_t loom_kv_head_bytes(loom_dtype_t dtype, int hd) {
    return (size_t)hd * loom_dtype_size(dtype) + (dtype == LOOM_DT_I8 ? sizeof(float) : 0);
}

int loom_kv_dtype_parse(const char *s, loom_dtype_t *out) {
    for (size_t i = 0; s && i < sizeof k_kv_dtypes / sizeof k_kv_dtypes[0]; i++)
        if (!strcmp(s, k_kv_dtypes[i].name)) {
            *out = k_kv_dtypes[i].dtype;
            return 1;
        }
    return 0;
}

const char *loom_kv_dtype_name(loom_dtype_t dtype) {
    for (size_t i = 0; i < sizeof k_kv_dtypes / sizeof k_kv_dtypes[0]; i++)
        if (k_kv_dtypes[i].dtype == dtype) return k_kv_dtypes[i].name;
    return "?";
}

int loom_backend_kv_supported(const loom_backend_t *be, loom_dtype_t dtype) {
    return be->ops->kv_supported ? be->ops->kv_supported(be, dtype) : dtype == LOOM_DT_F32;
}

loom_status_t loom_backend_kv_resolve(const loom_backend_t *be, const char *name, loom_dtype_t *out,
                                      loom_err_t *err) {
    loom_dtype_t dt;
    if (!name || !strcmp(name, "auto") || !*name) {
        dt = be->cfg.kind == LOOM_DEVICE_CUDA ? LOOM_DT_BF16 : LOOM_DT_F32;
        if (!loom_backend_kv_supported(be, dt)) dt = LOOM_DT_F32;
    } else if (!loom_kv_dtype_parse(name, &dt)) {
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "unknown KV cache dtype '%s' (use auto, f32, bf16, int8 or fp8)", name);
    }
    if (!loom_backend_kv_supported(be, dt)) {
        char have[64] = "";
        for (size_t i = 0; i < sizeof k_kv_dtypes / sizeof k_kv_dtypes[0]; i++)
            if (loom_backend_kv_supported(be, k_kv_dtypes[i].dtype))
                snprintf(have + strlen(have), sizeof have - strlen(have), "%s%s", *have ? ", " : "",
                         k_kv_dtypes[i].name);
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "the %s backend has no %s KV cache (it has %s)", be->ops->name,
                            loom_kv_dtype_name(dt), have);
    }
    *out = dt;
    return LOOM_OK;
}

void loom_op_kv_write(loom_backend_t *be, const loom_kv_layer_t *kv, const float *k, const float *v,
                      int stride, const int32_t *slots, int n, int nkv, int hd) {
    LOOM_ASSERT(!kv->v_dim || be->ops->kv_v_dim);
    if (n > 0) be->ops->kv_write(be, kv, k, v, stride, slots, n, nkv, hd);
}
void loom_op_attention(loom_backend_t *be, const loom_attn_args_t *a) {
    LOOM_ASSERT(a->window >= 0 && (a->window == 0 || (be->ops->caps & LOOM_CAP_ATTN_WINDOW)));
    LOOM_ASSERT(a->softcap >= 0 && (a->softcap == 0 || (be->ops->caps & LOOM_CAP_ATTN_SOFTCAP)));
    LOOM_ASSERT(!a->sinks || (be->ops->caps & LOOM_CAP_ATTN_SINKS));
    LOOM_ASSERT(!a->kv.v_dim || be->ops->kv_v_dim);
    LOOM_ASSERT(!a->lse || (!a->sinks && loom_backend_attn_lse_supported(be)));
    if (a->n > 0) be->ops->attention(be, a);
}
int loom_backend_attn_window_supported(const loom_backend_t *be) { return (be->ops->caps & LOOM_CAP_ATTN_WINDOW) != 0; }
int loom_backend_attn_softcap_supported(const loom_backend_t *be) { return (be->ops->caps & LOOM_CAP_ATTN_SOFTCAP) != 0; }
int loom_backend_attn_sinks_supported(const loom_backend_t *be) {
    return (be->ops->caps & LOOM_CAP_ATTN_SINKS) != 0;
}
int loom_backend_attn_lse_supported(const loom_backend_t *be) {
    return be->ops->attn_lse && be->ops->attn_merge != NULL;
}
void loom_op_attn_merge(loom_backend_t *be, float *out, float *lse_run, const float *o, const float *lse, int n,
                        int nh, int vd) {
    LOOM_ASSERT(be->ops->attn_merge && n >= 0 && nh > 0 && vd > 0);
    if (n > 0) be->ops->attn_merge(be, out, lse_run, o, lse, n, nh, vd);
}
void loom_op_kv_gather(loom_backend_t *be, const loom_kv_layer_t *kv, const int32_t *bt, int p0, int cn, int nkv,
                       int hd, float *rows) {
    LOOM_ASSERT(be->ops->kv_gather && p0 >= 0 && cn >= 0 && nkv > 0 && hd > 0);
    if (cn > 0) be->ops->kv_gather(be, kv, bt, p0, cn, nkv, hd, rows);
}
int loom_backend_kv_gather_supported(const loom_backend_t *be) { return be->ops->kv_gather != NULL; }
void loom_op_softcap(loom_backend_t *be, float *x, int64_t n, float cap) {
    LOOM_ASSERT(cap > 0 && be->ops->softcap);
    if (n > 0) be->ops->softcap(be, x, n, cap);
}
int loom_backend_softcap_supported(const loom_backend_t *be) { return be->ops->softcap != NULL; }
void loom_op_sample_shard(loom_backend_t *be, const float *logits, int n_rows, int vocab_shard,
                          int id_offset, int vocab_size, const loom_sampling_t *params,
                          const uint64_t *steps, const int *k, loom_sample_part_t *parts) {
    if (n_rows > 0)
        be->ops->sample_shard(be, logits, n_rows, vocab_shard, id_offset, vocab_size, params, steps,
                              k, parts);
}

void loom_op_add_rmsnorm(loom_backend_t *be, float *x, const float *a, float *y, const float *g,
                         int n, int dim, float eps) {
    if (n <= 0) return;
    if (be->ops->add_rmsnorm) {
        be->ops->add_rmsnorm(be, x, a, y, g, n, dim, eps);
        return;
    }
    be->ops->add(be, x, a, (int64_t)n * dim);
    be->ops->rmsnorm(be, y, x, g, n, dim, eps);
}

void loom_op_rope_kv_write(loom_backend_t *be, float *q, float *k, const float *v, int stride,
                           int n, int nh, int nkv, int hd, const int32_t *pos,
                           const float *inv_freq, const loom_kv_layer_t *kv, const int32_t *slots) {
    if (n <= 0) return;
    if (be->ops->rope_kv_write) {
        be->ops->rope_kv_write(be, q, k, v, stride, n, nh, nkv, hd, pos, inv_freq, kv, slots);
        return;
    }
    be->ops->rope(be, q, stride, n, nh, hd, pos, inv_freq);
    be->ops->rope(be, k, stride, n, nkv, hd, pos, inv_freq);
    be->ops->kv_write(be, kv, k, v, stride, slots, n, nkv, hd);
}

int loom_backend_kv_block_strided(const loom_backend_t *be) { return be->ops->kv_block_strided; }
int loom_backend_kv_v_dim(const loom_backend_t *be) { return be->ops->kv_v_dim; }

int loom_backend_has_graphs(const loom_backend_t *be) {
    return be->ops->graph_begin != NULL && be->ops->graph_end != NULL;
}
int loom_backend_graph_begin(loom_backend_t *be, uint64_t key) {
    return loom_backend_has_graphs(be) ? be->ops->graph_begin(be, key) : 0;
}
void loom_backend_graph_drop(loom_backend_t *be) {
    if (be->ops->graph_drop) be->ops->graph_drop(be);
}
int loom_backend_graph_end(loom_backend_t *be, uint64_t key) {
    return loom_backend_has_graphs(be) ? be->ops->graph_end(be, key) : 0;
}
