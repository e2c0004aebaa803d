/* Multi-head latent attention on the CPU, one layer (worker/mla.h): the
 * decompressed prefill and the absorbed decode over one latent cache, and
 * DeepSeek's RoPE frequencies (yarn over the rope dims). Plain loops with
 * double accumulators: this is the reference, not the fast path. */
#include "worker/mla.h"

#include <math.h>

#include "common/status.h"

loom_mla_shape_t loom_mla_shape_of(const loom_model_config_t *cfg, const double *inv_freq) {
    loom_mla_shape_t s = {
        .dim = cfg->dim,
        .n_heads = cfg->n_heads,
        .q_lora_rank = cfg->q_lora_rank,
        .kv_lora_rank = cfg->kv_lora_rank,
        .nope = cfg->qk_nope_head_dim,
        .rope = cfg->qk_rope_head_dim,
        .v = cfg->v_head_dim,
        .interleave = cfg->rope_interleave,
        .softmax_scale = cfg->attn_scale,
        .rope_factor = cfg->rope_attn_factor,
        .inv_freq = inv_freq,
        .latent_eps = 1e-6f,
    };
    return s;
}

void loom_mla_rope_inv_freq(const loom_model_config_t *cfg, double *inv) {
    const int d = cfg->qk_rope_head_dim;
    const double base = cfg->rope_theta;
    for (int j = 0; j < d / 2; j++) inv[j] = 1.0 / pow(base, 2.0 * j / d);
    if (cfg->rope_scaling != LOOM_ROPE_YARN) return;
    /* the pair index whose wavelength turns `rot` times over the original context */
    const double orig = cfg->rope_orig_max_pos, f = cfg->rope_factor;
    double lo = d * log(orig / (cfg->rope_beta_fast * 2 * 3.14159265358979323846)) / (2 * log(base));
    double hi = d * log(orig / (cfg->rope_beta_slow * 2 * 3.14159265358979323846)) / (2 * log(base));
    if (cfg->rope_truncate) {
        lo = floor(lo);
        hi = ceil(hi);
    }
    lo = lo < 0 ? 0 : lo;
    hi = hi > d - 1 ? d - 1 : hi;
    if (lo == hi) hi += 0.001;
    for (int j = 0; j < d / 2; j++) {
        double ramp = (j - lo) / (hi - lo);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        inv[j] = inv[j] / f * ramp + inv[j] * (1 - ramp); /* ramp 0: kept, 1: interpolated */
    }
}

size_t loom_mla_scratch_floats(const loom_mla_shape_t *s, int n_ctx, int T) {
    size_t H = (size_t)s->n_heads, qk = (size_t)(s->nope + s->rope), kvw = (size_t)(s->nope + s->v);
    return (size_t)T * H * qk + (size_t)n_ctx * H * kvw + (size_t)n_ctx + H * (size_t)s->v +
           (size_t)(s->q_lora_rank + loom_mla_cache_row(s) + 2 * s->kv_lora_rank);
}

/* y (n_out) = W (n_out x n_in) x */
static void matvec(const float *W, const float *x, int n_out, int n_in, float *y) {
    for (int o = 0; o < n_out; o++) {
        const float *row = W + (size_t)o * (size_t)n_in;
        double acc = 0;
        for (int i = 0; i < n_in; i++) acc += (double)row[i] * x[i];
        y[o] = (float)acc;
    }
}

static void rmsnorm(float *x, const float *w, int n, float eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    double k = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) x[i] = (float)(x[i] * k * w[i]);
}

static void rope(const loom_mla_shape_t *s, float *x, int pos) {
    const int half = s->rope / 2;
    for (int j = 0; j < half; j++) {
        double a = pos * s->inv_freq[j], c = cos(a) * s->rope_factor, sn = sin(a) * s->rope_factor;
        int i0 = s->interleave ? 2 * j : j, i1 = s->interleave ? 2 * j + 1 : j + half;
        double x0 = x[i0], x1 = x[i1];
        x[i0] = (float)(x0 * c - x1 * sn);
        x[i1] = (float)(x0 * sn + x1 * c);
    }
}

/* q (H x (nope + rope)) with its rope parts turned, and the token's cache row (normed latent, turned k_pe). */
static void project(const loom_mla_shape_t *s, const loom_mla_weights_t *w, const float *x, int pos, float *q,
                    float *row, float *tmp) {
    const int H = s->n_heads, qk = s->nope + s->rope;
    if (s->q_lora_rank) {
        matvec(w->q_a_proj, x, s->q_lora_rank, s->dim, tmp);
        rmsnorm(tmp, w->q_a_norm, s->q_lora_rank, s->latent_eps);
        matvec(w->q_b_proj, tmp, H * qk, s->q_lora_rank, q);
    } else {
        matvec(w->q_proj, x, H * qk, s->dim, q);
    }
    for (int h = 0; h < H; h++) rope(s, q + h * qk + s->nope, pos);
    matvec(w->kv_a_proj, x, s->kv_lora_rank + s->rope, s->dim, row);
    rmsnorm(row, w->kv_a_norm, s->kv_lora_rank, s->latent_eps);
    rope(s, row + s->kv_lora_rank, pos);
}

/* p[0..n) = softmax(p) in place */
static void softmax(float *p, int n) {
    float mx = p[0];
    for (int j = 1; j < n; j++) mx = p[j] > mx ? p[j] : mx;
    double sum = 0;
    for (int j = 0; j < n; j++) sum += p[j] = expf(p[j] - mx);
    for (int j = 0; j < n; j++) p[j] = (float)(p[j] / sum);
}

void loom_mla_prefill(const loom_mla_shape_t *s, const loom_mla_weights_t *w, const float *x, int T, int pos0,
                      float *cache, float *out, float *scratch) {
    const int H = s->n_heads, qk = s->nope + s->rope, r = s->kv_lora_rank, R = loom_mla_cache_row(s);
    const int kvw = s->nope + s->v, n_ctx = pos0 + T;
    float *q = scratch, *kv = q + (size_t)T * H * qk, *att = kv + (size_t)n_ctx * H * kvw, *o = att + n_ctx,
          *tmp = o + H * s->v;
    for (int t = 0; t < T; t++)
        project(s, w, x + (size_t)t * s->dim, pos0 + t, q + (size_t)t * H * qk, cache + (size_t)(pos0 + t) * R, tmp);
    for (int j = 0; j < n_ctx; j++) /* every head's k_nope and v of token j, from its latent */
        matvec(w->kv_b_proj, cache + (size_t)j * R, H * kvw, r, kv + (size_t)j * H * kvw);
    for (int t = 0; t < T; t++) {
        const int n = pos0 + t + 1;
        for (int h = 0; h < H; h++) {
            const float *qh = q + ((size_t)t * H + h) * qk;
            for (int j = 0; j < n; j++) {
                const float *k = kv + ((size_t)j * H + h) * kvw, *kpe = cache + (size_t)j * R + r;
                double acc = 0;
                for (int i = 0; i < s->nope; i++) acc += (double)qh[i] * k[i];
                for (int i = 0; i < s->rope; i++) acc += (double)qh[s->nope + i] * kpe[i];
                att[j] = (float)(acc * s->softmax_scale);
            }
            softmax(att, n);
            for (int i = 0; i < s->v; i++) {
                double acc = 0;
                for (int j = 0; j < n; j++) acc += (double)att[j] * kv[((size_t)j * H + h) * kvw + s->nope + i];
                o[h * s->v + i] = (float)acc;
            }
        }
        matvec(w->o_proj, o, s->dim, H * s->v, out + (size_t)t * s->dim);
    }
}

void loom_mla_decode(const loom_mla_shape_t *s, const loom_mla_weights_t *w, const float *x, int pos, float *cache,
                     float *out, float *scratch) {
    const int H = s->n_heads, qk = s->nope + s->rope, r = s->kv_lora_rank, R = loom_mla_cache_row(s);
    const int kvw = s->nope + s->v, n = pos + 1;
    float *q = scratch, *att = q + H * qk, *o = att + n, *tmp = o + H * s->v, *qlat = tmp + R + s->q_lora_rank,
          *olat = qlat + r;
    project(s, w, x, pos, q, cache + (size_t)pos * R, tmp);
    for (int h = 0; h < H; h++) {
        const float *qh = q + h * qk, *wk = w->kv_b_proj + (size_t)h * kvw * r; /* W_UK: nope rows of r */
        for (int c = 0; c < r; c++) { /* q_lat = W_UK^T q_nope */
            double acc = 0;
            for (int i = 0; i < s->nope; i++) acc += (double)qh[i] * wk[(size_t)i * r + c];
            qlat[c] = (float)acc;
        }
        for (int j = 0; j < n; j++) { /* MQA over the rows: [q_lat, q_pe] . [c_j, k_pe_j] */
            const float *row = cache + (size_t)j * R;
            double acc = 0;
            for (int c = 0; c < r; c++) acc += (double)qlat[c] * row[c];
            for (int i = 0; i < s->rope; i++) acc += (double)qh[s->nope + i] * row[r + i];
            att[j] = (float)(acc * s->softmax_scale);
        }
        softmax(att, n);
        for (int c = 0; c < r; c++) { /* the weighted latent, then W_UV */
            double acc = 0;
            for (int j = 0; j < n; j++) acc += (double)att[j] * cache[(size_t)j * R + c];
            olat[c] = (float)acc;
        }
        matvec(wk + (size_t)s->nope * r, olat, s->v, r, o + h * s->v);
    }
    matvec(w->o_proj, o, s->dim, H * s->v, out);
}
