/* The shard forward pass: weights sliced for one grid cell, the paged KV
 * cache, and one batched step through the shard's layers (see model.h). */
#include "worker/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/model_config_deepseek.h"
#include "common/progress.h"
#include "common/util.h"
#include "worker/qweights.h"

/* The feed-forward block of a layer: the dense gated MLP
 * down(act(gate(x)) * up(x)), or a Mixture of Experts (Mixtral, Qwen3-MoE):
 * a router picks n_experts_per_tok experts per token and the block's output
 * is their MLPs' outputs weighted by the router. The layer loop calls
 * run_ffn() and does not look inside. */
typedef struct loom_ffn {
    loom_weight_t w13; /* dense: (2*hidden, dim): gate rows then up rows */
    loom_weight_t w2;  /* dense: (dim, hidden): this rank's input columns */
    int moe;              /* a Mixture of Experts: the fields below, not w13 / w2 */
    loom_weight_t router; /* (n_experts, dim), float, replicated on every rank */
    loom_weight_t *e13;   /* (n_experts) each (2*moe_hn, dim); only the held experts are loaded */
    loom_weight_t *e2;    /* (n_experts) each (dim, moe_hn) */
    /* Qwen2-MoE's shared expert, added to every token scaled by
     * sigmoid(shared_gate . x); TP-sliced as a dense MLP in both modes */
    loom_weight_t s13;    /* (2*shared_hn, dim) */
    loom_weight_t s2;     /* (dim, shared_hn) */
    loom_weight_t sgate;  /* (1, dim), float, replicated */
    /* the backend's tables of the E experts for its batched expert GEMV
     * (loom_backend_moe_table), used by decode steps of up to dev_n tokens */
    void *t13, *t2;
    int dev_n;
    /* GPT-OSS: the router's bias (n_experts), and each expert's biases: of
     * its gate then up rows (n_experts, 2*moe_hn), and of its down rows
     * (n_experts, dim; on the rank whose slice starts at 0, so it is added
     * once). NULL for the other families. */
    float *rbias, *b13, *b2;
} loom_ffn_t;

typedef struct loom_layer {
    float *attn_norm;   /* (dim) */
    loom_weight_t wqkv; /* (qkv_dim, dim): this rank's q heads, then k heads, then v heads */
    float *bqkv;        /* (qkv_dim) the same rows' biases (Qwen2), or NULL */
    float *q_norm;      /* (hd) per-head RMSNorm gain of q (Qwen3), or NULL */
    float *k_norm;      /* (hd) the same for k */
    float *sinks;       /* (n_heads) GPT-OSS: this rank's heads' attention sinks, or NULL */
    float *bo;          /* (dim) GPT-OSS: o_proj's bias, on TP rank 0 only (added once), or NULL */
    int window;         /* attention window in positions; 0 = full attention */
    loom_weight_t wo;   /* (dim, n_heads*hd): this rank's input columns */
    float *ffn_norm;    /* (dim) */
    float *post_attn_norm; /* (dim) Gemma: norm of the attention output before the residual add, or NULL */
    float *post_ffn_norm;  /* (dim) Gemma: the same for the feed-forward output */
    const float *inv_freq; /* RoPE table of this layer (Gemma's sliding layers have their own) */
    loom_ffn_t ffn;
    loom_kv_layer_t kv; /* (n_blocks, B, n_kv_heads, hd) K and V in opt.kv_dtype */
} loom_layer_t;

struct loom_model {
    loom_backend_t *be;
    loom_model_config_t cfg;
    loom_shard_spec_t spec;
    loom_shard_dims_t dims;
    loom_model_options_t opt;
    int qkv_dim; /* (n_heads + 2 * n_kv_heads) * hd */

    /* weights (device) */
    float *embed;         /* (vocab, dim), first stage */
    loom_layer_t *layers; /* (dims.n_layers) */
    float *final_norm;    /* (dim), last stage */
    loom_weight_t lm_head; /* (dims.vocab, dim), last stage */
    float *inv_freq;       /* (hd / 2) */
    float *inv_freq_local; /* (hd / 2) Gemma 3's sliding layers: rope_local_base_freq, unscaled; or NULL */
    size_t weight_bytes;
    size_t matmul_bytes; /* of the matmul weights */
    size_t expert_bytes; /* of them, the held experts' (a token reads k/E of these) */
    int n_quantized;     /* matmul weights stored quantized */

    /* KV pool; with decode buckets one more block, after the n_blocks the
     * plans address, takes the padding rows' keys and values */
    int n_blocks, block_size;
    int scratch_block; /* -1 when decode steps are not padded */
    int last_pad;      /* rows the last forward padded */
    void *kv_mem;

    /* activations (device), sized for opt.max_tokens */
    float *x;      /* (T, dim) residual stream */
    float *xb;     /* (T, dim) normed input */
    float *xb2;    /* (T, dim) projection output before all-reduce */
    float *qkv;    /* (T, qkv_dim) */
    float *att;    /* (T, n_heads*hd) */
    float *gu;     /* (T, 2*hidden) */
    float *hb;     /* (T, hidden) */
    float *xl;     /* (max_logits, dim) */
    float *logits; /* (max_logits, vocab) */

    /* step metadata: host staging and its device copy */
    int *sample_k; /* (max_logits) candidates per row */
    int32_t *meta_host;
    int32_t *meta_dev;
    size_t meta_cap; /* int32 entries */

    /* Mixture of Experts. With plain TP every rank holds every expert, its
     * intermediate rows [moe_hb, moe_hb+moe_hn) sliced like a dense MLP's;
     * with expert parallelism it holds whole experts [expert_begin,
     * expert_end). Either way the rank's partial sums meet in the MLP's
     * all-reduce. Routing runs on the host (the CPU backend's memory). */
    int expert_begin, expert_end;
    int moe_hb, moe_hn;
    int shared_hb, shared_hn; /* the shared expert's slice of shared_expert_intermediate_size */
    float *sgl;     /* (T) shared-expert gate logits (device) */
    float *h_sg;    /* (T) host: the same */
    float *rl;      /* (T, n_experts) router logits (device) */
    float *xg;      /* (T k, dim) the routed rows, grouped by expert, then their outputs (device) */
    float *mgu;     /* (T k, 2 moe_hn) their gate/up rows (device) */
    float *mhb;     /* (T k, moe_hn) their activations (device) */
    int32_t *d_rows; /* (T k) token of each routed row (device) */
    int32_t
        *d_pos;  /* (T k) row of xg of each (token, choice), -1: another rank's expert (device) */
    float *d_pw; /* (T k) its weight (device) */
    int32_t *d_sel;   /* (T k) decode on the device: the chosen experts */
    float *d_w;       /* (T k) and their weights */
    int32_t *d_ident; /* (T k) 0, 1, 2, ...: pair p's output is row p */
    int moe_device_n; /* every MoE layer runs decode steps of up to this many tokens without the
                         host */
    int32_t *h_pos;   /* (T k) host: d_pos */
    float *h_pw;      /* (T k) host: d_pw */
    int32_t *h_fill;  /* (T) host: choices of each token placed so far */
    float *h_probs;   /* (T, n_experts) host: router probabilities */
    int32_t *h_sel; /* (T, k) chosen experts */
    float *h_w;     /* (T, k) their weights */
    int32_t *h_cnt; /* (n_experts + 1) CSR offsets of the rows routed to each expert */
    int32_t *h_rows; /* (T * k) token of each routed row, grouped by expert */
    float *h_rw;     /* (T * k) its router weight */
};

/* ---- loading ------------------------------------------------------------ */

typedef struct loader {
    loom_model_t *m;
    loom_st_t *st;
    float *tmp; /* host staging for one fused matrix */
    size_t tmp_cap;
    int64_t rotary_rows; /* partial rotary: the first rows of the linear being loaded are q and k heads */
} loader_t;

static float *staging(loader_t *L, size_t n) {
    if (n > L->tmp_cap) {
        free(L->tmp);
        L->tmp = malloc(n * sizeof(float));
        L->tmp_cap = L->tmp ? n : 0;
    }
    return L->tmp;
}

/* The cheap scan that refuses NaN and Inf weights, naming the tensor. One
 * pass over what was just read, next to the conversion that read it. */
static loom_status_t check_finite(const float *x, size_t n, const char *name, const char *file, loom_err_t *err) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s holds %s (element %zu of the slice read)",
                                name, file ? file : "the checkpoint", isnan(x[i]) ? "NaN" : "Inf", i);
    return LOOM_OK;
}

/* Reads rows [r0, r0+nr) x cols [c0, c0+nc) of a (rows, cols) tensor into dst. */
static loom_status_t read_block(loader_t *L, const char *name, int64_t rows, int64_t cols,
                                int64_t r0, int64_t nr, int64_t c0, int64_t nc, float *dst,
                                loom_err_t *err) {
    const loom_st_tensor_t *t;
    int64_t shape[2] = {rows, cols};
    LOOM_CHECK(loom_st_get(L->st, name, cols > 0 ? 2 : 1, cols > 0 ? shape : &rows, &t, err));
    int64_t ncols = cols > 0 ? nc : rows;
    LOOM_CHECK(loom_st_read_f32(L->st, t, r0, nr, c0, ncols, dst, err));
    return check_finite(dst, (size_t)nr * (size_t)ncols, name, t->file, err);
}

/* Reads elements [e0, e0+ne) of a 1-D tensor of n elements into dst. */
static loom_status_t read_slice(loader_t *L, const char *name, int64_t n, int64_t e0, int64_t ne, float *dst,
                                loom_err_t *err) {
    const loom_st_tensor_t *t;
    LOOM_CHECK(loom_st_get(L->st, name, 1, &n, &t, err));
    LOOM_CHECK(loom_st_read_f32(L->st, t, 0, 1, e0, ne, dst, err));
    return check_finite(dst, (size_t)ne, name, t->file, err);
}

/* A float vector of the host to the device (norm gains, biases, sinks). */
static loom_status_t upload_host(loader_t *L, const float *h, size_t n, float **out,
                                 const char *what, loom_err_t *err) {
    *out = loom_backend_alloc(L->m->be, n * sizeof(float));
    if (!*out) return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for %s", what);
    loom_backend_upload(L->m->be, *out, h, n * sizeof(float));
    L->m->weight_bytes += n * sizeof(float);
    return LOOM_OK;
}

static loom_status_t upload_vec_add(loader_t *L, const char *name, int64_t n, float add,
                                    float **out, loom_err_t *err) {
    float *h = staging(L, (size_t)n);
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading %s", name);
    LOOM_CHECK(read_block(L, name, n, 0, 0, 1, 0, n, h, err));
    for (int64_t i = 0; add != 0.0f && i < n; i++)
        h[i] += add;
    return upload_host(L, h, (size_t)n, out, name, err);
}

static loom_status_t upload_weight(loader_t *L, loom_weight_t *w, int64_t rows, int64_t cols,
                                   const char *what, loom_err_t *err) {
    loom_status_t s = loom_weight_upload(L->m->be, w, rows, cols, L->tmp, err);
    if (s == LOOM_ERR_NOMEM)
        return loom_err_set(err, s, "out of device memory uploading %s (%lld x %lld)", what,
                            (long long)rows, (long long)cols);
    if (s == LOOM_OK) {
        L->m->weight_bytes += loom_weight_bytes(w);
        L->m->matmul_bytes += loom_weight_bytes(w);
    }
    return s;
}

static loom_status_t upload_qweight(loader_t *L, loom_weight_t *w, const loom_qtensor_t *t, const char *what,
                                    loom_err_t *err) {
    loom_status_t s = loom_weight_upload_quant(L->m->be, w, t, err);
    if (s == LOOM_ERR_NOMEM)
        return loom_err_set(err, s, "out of device memory uploading %s (%lld x %lld)", what, (long long)t->rows,
                            (long long)t->cols);
    if (s < 0) {
        loom_err_t e = *err;
        return loom_err_set(err, s, "%s: %s", what, e.msg);
    }
    L->m->weight_bytes += loom_weight_bytes(w);
    L->m->matmul_bytes += loom_weight_bytes(w);
    L->m->n_quantized++;
    return LOOM_OK;
}

/* An RMSNorm gain: Gemma stores w and scales by (1 + w), folded in here. */
static loom_status_t upload_norm(loader_t *L, const char *name, int64_t n, float **out, loom_err_t *err) {
    return upload_vec_add(L, name, n, L->m->cfg.gemma ? 1.0f : 0.0f, out, err);
}

/* Partial rotary (Phi-4-mini): Transformers turns dims [0, rd) of each q
 * and k head, pairing o with o + rd/2, and passes [rd, hd) through; the
 * kernels pair p with p + hd/2. So dim o of a head is stored at
 * rotary_slot(o): the rotary halves at [0, rd/2) and [hd/2, hd/2 + rd/2),
 * the others in the gaps, whose frequencies are 0. q.k is unchanged (q and
 * k are permuted alike; v is not). Longrope's and yarn's attention factor
 * multiplies cos and sin, so only the rotary dims: it is folded into their
 * rows here instead of the attention scale. */
static int rotary_slot(int o, int hd, int rd) {
    int half = hd / 2, r = rd / 2, pass = (hd - rd) / 2;
    if (o < r) return o;
    if (o < rd) return half + o - r;
    if (o < rd + pass) return r + o - rd;
    return half + r + o - rd - pass;
}

/* Rows [0, nrows) of a (., cols) float matrix are whole heads of hd rows:
 * each head's rows moved to their slots, the rotary ones times af. */
static void rotary_permute_f32(float *h, int64_t nrows, int64_t cols, int hd, int rd, float af) {
    float *tmp = loom_xmalloc((size_t)hd * (size_t)cols * sizeof(float));
    for (int64_t r0 = 0; r0 < nrows; r0 += hd) {
        float *head = h + (size_t)r0 * (size_t)cols;
        memcpy(tmp, head, (size_t)hd * (size_t)cols * sizeof(float));
        for (int o = 0; o < hd; o++) {
            float *dst = head + (size_t)rotary_slot(o, hd, rd) * (size_t)cols, *src = tmp + (size_t)o * (size_t)cols;
            for (int64_t c = 0; c < cols; c++) dst[c] = o < rd ? src[c] * af : src[c];
        }
    }
    free(tmp);
}

/* The same on a quantized tensor: codes, scales (and mins) row by row; the
 * factor scales a row's scales and mins. */
static void rotary_permute_q(loom_qtensor_t *t, int64_t nrows, int hd, int rd, float af) {
    size_t cb = loom_qtensor_code_bytes(t) / (size_t)t->rows, sc = loom_qtensor_scale_count(t) / (size_t)t->rows;
    uint8_t *tq = loom_xmalloc((size_t)hd * cb);
    float *ts = loom_xmalloc((size_t)hd * sc * sizeof(float)), *tm = loom_xmalloc((size_t)hd * sc * sizeof(float));
    for (int64_t r0 = 0; r0 < nrows; r0 += hd) {
        uint8_t *q = (uint8_t *)t->q + (size_t)r0 * cb;
        float *sv = t->scales + (size_t)r0 * sc, *mv = t->mins ? t->mins + (size_t)r0 * sc : NULL;
        memcpy(tq, q, (size_t)hd * cb);
        memcpy(ts, sv, (size_t)hd * sc * sizeof(float));
        if (mv) memcpy(tm, mv, (size_t)hd * sc * sizeof(float));
        for (int o = 0; o < hd; o++) {
            size_t p = (size_t)rotary_slot(o, hd, rd);
            float f = o < rd ? af : 1.0f;
            memcpy(q + p * cb, tq + (size_t)o * cb, cb);
            for (size_t j = 0; j < sc; j++) {
                sv[p * sc + j] = ts[(size_t)o * sc + j] * f;
                if (mv) mv[p * sc + j] = tm[(size_t)o * sc + j] * f;
            }
        }
    }
    free(tq);
    free(ts);
    free(tm);
}

/* How a float linear's input columns [c0, c0+nc) of cols are read and
 * quantized: the scheme (a 4-bit group that does not divide cols falls back
 * to int8, logged), and the columns [rc0, rc0+rnc) to read: per-channel
 * schemes (int8, fp8) quantize whole rows before taking the columns, so
 * every grid gets the same scales; 4-bit groups are local, so a rank
 * quantizes only its columns, which must be whole groups. */
typedef struct float_cols {
    loom_quant_spec_t q;
    int64_t cols, c0, nc;
    int whole_rows;
    int64_t rc0, rnc;
} float_cols_t;

static loom_status_t float_cols(loader_t *L, const char *what, int64_t cols, int64_t c0, int64_t nc,
                                float_cols_t *fc, loom_err_t *err) {
    loom_quant_spec_t q = L->m->opt.quant;
    if (q.quant == LOOM_QUANT_Q4 && cols % q.group) {
        LOOM_WARN(
            "%s: 4-bit group %d does not divide its %lld input columns; quantizing it as int8",
            what, q.group, (long long)cols);
        q = (loom_quant_spec_t){.quant = LOOM_QUANT_INT8};
    }
    if (q.quant == LOOM_QUANT_Q4 && (c0 % q.group || nc % q.group))
        return loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "%s: this tensor-parallel rank's input columns [%lld, %lld) are not whole 4-bit groups "
            "of %d; use fewer TP ranks or a smaller group",
            what, (long long)c0, (long long)(c0 + nc), q.group);
    int whole_rows = q.quant != LOOM_QUANT_NONE && q.quant != LOOM_QUANT_Q4 && nc != cols;
    *fc = (float_cols_t){.q = q,
                         .cols = cols,
                         .c0 = c0,
                         .nc = nc,
                         .whole_rows = whole_rows,
                         .rc0 = whole_rows ? 0 : c0,
                         .rnc = whole_rows ? cols : nc};
    return LOOM_OK;
}

/* Uploads the (rows, fc->rnc) float matrix in the staging buffer as w,
 * quantized as fc says, keeping input columns [c0, c0+nc). */
static loom_status_t upload_float_linear(loader_t *L, loom_weight_t *w, const char *what,
                                         const float_cols_t *fc, int64_t rows, loom_err_t *err) {
    if (fc->q.quant == LOOM_QUANT_NONE) return upload_weight(L, w, rows, fc->nc, what, err);
    loom_qtensor_t qt = {0};
    LOOM_CHECK(loom_quantize(&fc->q, L->tmp, rows, fc->rnc, &qt, err));
    if (fc->whole_rows) {
        loom_qtensor_t full = qt;
        loom_qw_slice_cols(&full, fc->c0, fc->nc, &qt);
        loom_qtensor_free(&full);
    }
    loom_status_t s = upload_qweight(L, w, &qt, what, err);
    loom_qtensor_free(&qt);
    return s;
}

/* One stored linear (its name without ".weight") and the block of its rows
 * (output features) this shard takes. */
typedef struct lin_part {
    const char *prefix;
    int64_t rows, r0, nr;
} lin_part_t;

/* Loads one matmul weight: the row blocks of n parts stacked (q/k/v, gate/up:
 * column-parallel), restricted to input columns [c0, c0+nc) of cols (o, down:
 * row-parallel). Linears the checkpoint stores quantized are sliced as stored;
 * float ones are quantized here when opt.quant asks. Per-channel schemes
 * (int8, fp8) quantize whole rows before taking the columns, so every grid
 * gets the same scales; 4-bit groups are local, so a rank quantizes only its
 * columns, which must be whole groups. A 4-bit group that does not divide the
 * linear's input columns falls back to int8 for that linear (logged). */
static loom_status_t load_linear(loader_t *L, loom_weight_t *w, const char *what, const lin_part_t *parts, int n,
                                 int64_t cols, int64_t c0, int64_t nc, loom_err_t *err) {
    loom_model_t *m = L->m;
    char name[300];
    int nq = 0;
    int64_t rows = 0;
    for (int i = 0; i < n; i++) {
        nq += loom_qw_stored(L->st, parts[i].prefix);
        rows += parts[i].nr;
    }
    loom_status_t s = LOOM_OK;
    loom_qtensor_t qt = {0};
    if (nq) {
        if (nq != n)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: the checkpoint stores some of its parts quantized and some not", what);
        loom_qtensor_t qp[3] = {{0}};
        LOOM_ASSERT(n <= 3);
        for (int i = 0; i < n && s == LOOM_OK; i++)
            s = loom_qw_read(L->st, &m->cfg, parts[i].prefix, parts[i].rows, cols, parts[i].r0, parts[i].nr, c0, nc,
                             &qp[i], err);
        for (int i = 0; i < n && s == LOOM_OK; i++) {
            snprintf(name, sizeof name, "%s.scales", parts[i].prefix);
            s = check_finite(qp[i].scales, loom_qtensor_scale_count(&qp[i]), name, NULL, err);
            if (s == LOOM_OK && qp[i].mins) {
                snprintf(name, sizeof name, "%s.mins", parts[i].prefix);
                s = check_finite(qp[i].mins, loom_qtensor_scale_count(&qp[i]), name, NULL, err);
            }
        }
        if (s == LOOM_OK) s = loom_qw_stack_rows(qp, n, what, &qt, err);
        for (int i = 0; i < n; i++) loom_qtensor_free(&qp[i]);
        if (s == LOOM_OK && L->rotary_rows)
            rotary_permute_q(&qt, L->rotary_rows, m->cfg.head_dim, m->cfg.rotary_dim, m->cfg.rope_attn_factor);
        if (s == LOOM_OK) s = upload_qweight(L, w, &qt, what, err);
        loom_qtensor_free(&qt);
        return s;
    }

    float_cols_t fc;
    LOOM_CHECK(float_cols(L, what, cols, c0, nc, &fc, err));
    float *h = staging(L, (size_t)rows * (size_t)fc.rnc);
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading %s", what);
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s.weight", parts[i].prefix);
        LOOM_CHECK(read_block(L, name, parts[i].rows, cols, parts[i].r0, parts[i].nr, fc.rc0,
                              fc.rnc, h + (size_t)off * (size_t)fc.rnc, err));
        off += parts[i].nr;
    }
    if (L->rotary_rows)
        rotary_permute_f32(h, L->rotary_rows, fc.rnc, m->cfg.head_dim, m->cfg.rotary_dim,
                           m->cfg.rope_attn_factor);
    return upload_float_linear(L, w, what, &fc, rows, err);
}

/* ---- GPT-OSS's experts ---------------------------------------------------
 * mlp.experts.gate_up_proj [E, dim, 2I] holds each expert's fused linear
 * input-major (x @ W), gate unit j in column 2j and up unit j in 2j+1;
 * down_proj [E, I, dim] likewise. An MXFP4 checkpoint stores them
 * output-major instead: <name>_blocks [E, rows, cols/32, 16] (two E2M1
 * codes a byte, the low nibble first) and <name>_scales [E, rows, cols/32]
 * (E8M0: 2^(s-127)) per group of 32 inputs. A held expert's rows are
 * assembled on the host in Loom's (out, in) layout -- gate rows
 * [moe_hb, moe_hb+moe_hn), then the same up rows; down's columns that
 * slice -- and take the float path of load_linear (quantized on load when
 * asked), so TP slicing, expert parallelism and --quantization work as for
 * the other families. */

static const float k_e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Rows [r0, r0+nr) of expert e's (rows, cols) MXFP4 matrix `base` as floats
 * (nr, cols) in dst. */
static loom_status_t read_mxfp4_rows(loader_t *L, const char *base, int E, int64_t rows,
                                     int64_t cols, int e, int64_t r0, int64_t nr, float *dst,
                                     loom_err_t *err) {
    char bn[300], sn[300];
    snprintf(bn, sizeof bn, "%s_blocks", base);
    snprintf(sn, sizeof sn, "%s_scales", base);
    if (cols % 32)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "%s: %lld input columns are not whole MXFP4 groups of 32", base,
                            (long long)cols);
    const int64_t G = cols / 32;
    const loom_st_tensor_t *tb = NULL, *ts = NULL;
    LOOM_CHECK(loom_st_get_dtype(L->st, bn, LOOM_DT_U8, 4, (int64_t[]){E, rows, G, 16}, &tb, err));
    LOOM_CHECK(loom_st_get_dtype(L->st, sn, LOOM_DT_U8, 3, (int64_t[]){E, rows, G}, &ts, err));
    uint8_t *codes = loom_xmalloc((size_t)(nr * G * 16)), *sc = loom_xmalloc((size_t)(nr * G));
    loom_status_t s =
        loom_st_read_raw(L->st, tb, ((int64_t)e * rows + r0) * G, nr * G, 0, 16, codes, err);
    if (s == LOOM_OK) s = loom_st_read_raw(L->st, ts, (int64_t)e * rows + r0, nr, 0, G, sc, err);
    for (int64_t g = 0; s == LOOM_OK && g < nr * G; g++) {
        if (sc[g] == 255) {
            s = loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s holds the E8M0 NaN scale 255",
                             sn, ts->file);
            break;
        }
        const float f = ldexpf(1.0f, (int)sc[g] - 127);
        for (int b = 0; b < 16; b++) {
            uint8_t c = codes[g * 16 + b];
            dst[g * 32 + 2 * b] = k_e2m1[c & 15] * f;
            dst[g * 32 + 2 * b + 1] = k_e2m1[c >> 4] * f;
        }
    }
    free(codes);
    free(sc);
    return s;
}

/* Expert e's gate/up rows (2*hn, dim) of the slice [hb, hb+hn): gate rows
 * then up rows, in the staging buffer. */
static loom_status_t oss_gate_up(loader_t *L, int gl, int e, int hb, int hn, loom_err_t *err) {
    const loom_model_config_t *c = &L->m->cfg;
    const int E = c->n_experts, dim = c->dim, I = c->moe_hidden_dim;
    char name[300];
    float *h = staging(L, (size_t)2 * hn * dim);
    if (!h)
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d's experts",
                            gl);
    float *t = loom_xmalloc((size_t)2 * hn * dim * sizeof(float));
    loom_status_t s;
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", gl);
    if (c->ckpt_quant == LOOM_CKPT_MXFP4) { /* output-major: rows 2hb .. 2(hb+hn), interleaved */
        s = read_mxfp4_rows(L, name, E, 2 * (int64_t)I, dim, e, 2 * (int64_t)hb, 2 * (int64_t)hn, t,
                            err);
        for (int64_t j = 0; s == LOOM_OK && j < 2 * (int64_t)hn; j++)
            memcpy(h + (size_t)((j & 1) * hn + j / 2) * dim, t + (size_t)j * dim,
                   (size_t)dim * sizeof(float));
    } else { /* input-major: rows of expert e are its dim inputs, columns 2hb .. 2(hb+hn) */
        const loom_st_tensor_t *tt = NULL;
        s = loom_st_get(L->st, name, 3, (int64_t[]){E, dim, 2 * (int64_t)I}, &tt, err);
        if (s == LOOM_OK)
            s = loom_st_read_f32(L->st, tt, (int64_t)e * dim, dim, 2 * (int64_t)hb, 2 * (int64_t)hn,
                                 t, err);
        for (int64_t d = 0; s == LOOM_OK && d < dim; d++)
            for (int64_t j = 0; j < 2 * (int64_t)hn; j++)
                h[(size_t)((j & 1) * hn + j / 2) * dim + d] = t[(size_t)d * 2 * hn + j];
    }
    free(t);
    return s == LOOM_OK ? check_finite(h, (size_t)2 * hn * dim, name, NULL, err) : s;
}

/* Expert e's down rows (dim, fc->rnc): its input columns [rc0, rc0+rnc) of
 * I, in the staging buffer. */
static loom_status_t oss_down(loader_t *L, int gl, int e, const float_cols_t *fc, loom_err_t *err) {
    const loom_model_config_t *c = &L->m->cfg;
    const int E = c->n_experts, dim = c->dim, I = c->moe_hidden_dim;
    char name[300];
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj", gl);
    const int64_t rnc = fc->rnc, full = c->ckpt_quant == LOOM_CKPT_MXFP4 ? I : rnc;
    float *h = staging(L, (size_t)(dim * rnc));
    if (!h)
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d's experts",
                            gl);
    float *t = loom_xmalloc((size_t)(dim * full) * sizeof(float));
    loom_status_t s;
    if (c->ckpt_quant ==
        LOOM_CKPT_MXFP4) { /* output-major (dim, I): whole rows, then the columns */
        s = read_mxfp4_rows(L, name, E, dim, I, e, 0, dim, t, err);
        for (int64_t o = 0; s == LOOM_OK && o < dim; o++)
            memcpy(h + (size_t)(o * rnc), t + (size_t)(o * I + fc->rc0),
                   (size_t)rnc * sizeof(float));
    } else { /* input-major (I, dim): rows rc0 .. rc0+rnc of expert e, transposed */
        const loom_st_tensor_t *tt = NULL;
        s = loom_st_get(L->st, name, 3, (int64_t[]){E, I, dim}, &tt, err);
        if (s == LOOM_OK)
            s = loom_st_read_f32(L->st, tt, (int64_t)e * I + fc->rc0, rnc, 0, dim, t, err);
        for (int64_t r = 0; s == LOOM_OK && r < rnc; r++)
            for (int64_t o = 0; o < dim; o++)
                h[(size_t)(o * rnc + r)] = t[(size_t)(r * dim + o)];
    }
    free(t);
    return s == LOOM_OK ? check_finite(h, (size_t)(dim * rnc), name, NULL, err) : s;
}

static loom_status_t load_oss_moe(loader_t *L, int gl, loom_ffn_t *f, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const int E = c->n_experts, dim = c->dim, I = c->moe_hidden_dim, hb = m->moe_hb, hn = m->moe_hn;
    char name[256], what[256];
    f->moe = 1;
    snprintf(name, sizeof name, "model.layers.%d.mlp.router.weight", gl);
    float *h = staging(L, (size_t)E * dim);
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading %s", name);
    LOOM_CHECK(read_block(L, name, E, dim, 0, E, 0, dim, h, err));
    LOOM_CHECK(upload_weight(L, &f->router, E, dim, name, err));
    snprintf(name, sizeof name, "model.layers.%d.mlp.router.bias", gl);
    LOOM_CHECK(read_slice(L, name, E, 0, E, h, err));
    LOOM_CHECK(upload_host(L, h, (size_t)E, &f->rbias, name, err));
    /* the biases of the held experts' rows, gate then up as the weights */
    float *b13 = loom_xcalloc((size_t)E * 2 * hn, sizeof(float)),
          *b2 = loom_xcalloc((size_t)E * dim, sizeof(float));
    float *row = loom_xmalloc((size_t)LOOM_MAX(2 * hn, dim) * sizeof(float));
    loom_status_t s = LOOM_OK;
    for (int j = m->expert_begin; j < m->expert_end && s == LOOM_OK; j++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj_bias", gl);
        s = read_block(L, name, E, 2 * (int64_t)I, j, 1, 2 * (int64_t)hb, 2 * (int64_t)hn, row,
                       err);
        for (int i = 0; s == LOOM_OK && i < 2 * hn; i++)
            b13[(size_t)j * 2 * hn + (size_t)((i & 1) * hn + i / 2)] = row[i];
        if (s == LOOM_OK) {
            snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj_bias", gl);
            s = read_block(L, name, E, dim, j, 1, 0, dim, b2 + (size_t)j * dim, err);
        }
    }
    free(row);
    if (s == LOOM_OK)
        s = upload_host(L, b13, (size_t)E * 2 * hn, &f->b13, "the experts' gate/up biases", err);
    if (s == LOOM_OK && hb == 0)
        s = upload_host(L, b2, (size_t)E * dim, &f->b2, "the experts' down biases", err);
    free(b13);
    free(b2);
    LOOM_CHECK(s);
    f->e13 = loom_xcalloc((size_t)E, sizeof *f->e13);
    f->e2 = loom_xcalloc((size_t)E, sizeof *f->e2);
    for (int j = m->expert_begin; j < m->expert_end; j++) {
        float_cols_t fc;
        snprintf(what, sizeof what, "model.layers.%d.mlp.experts.%d.gate_up", gl, j);
        LOOM_CHECK(float_cols(L, what, dim, 0, dim, &fc, err));
        LOOM_CHECK(oss_gate_up(L, gl, j, hb, hn, err));
        LOOM_CHECK(upload_float_linear(L, &f->e13[j], what, &fc, 2 * (int64_t)hn, err));
        snprintf(what, sizeof what, "model.layers.%d.mlp.experts.%d.down", gl, j);
        LOOM_CHECK(float_cols(L, what, I, hb, hn, &fc, err));
        LOOM_CHECK(oss_down(L, gl, j, &fc, err));
        LOOM_CHECK(upload_float_linear(L, &f->e2[j], what, &fc, dim, err));
        m->expert_bytes += loom_weight_bytes(&f->e13[j]) + loom_weight_bytes(&f->e2[j]);
    }
    return LOOM_OK;
}

/* A Mixture-of-Experts block: the router whole, and each held expert's
 * gate / up rows and down columns [moe_hb, moe_hb+moe_hn) (all of them under
 * expert parallelism), through load_linear as a dense MLP's are, so
 * quantization on load and stored quantized experts work the same way. */
static loom_status_t load_moe(loader_t *L, int gl, loom_ffn_t *f, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const int E = c->n_experts, dim = c->dim, mx = c->moe_mixtral_names;
    const char *blk = mx ? "block_sparse_moe" : "mlp";
    char name[256], pg[256], pu[256], what[256];
    if (c->gpt_oss) return load_oss_moe(L, gl, f, err);
    f->moe = 1;
    snprintf(name, sizeof name, "model.layers.%d.%s.gate.weight", gl, blk);
    float *h = staging(L, (size_t)E * dim);
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading %s", name);
    LOOM_CHECK(read_block(L, name, E, dim, 0, E, 0, dim, h, err));
    LOOM_CHECK(upload_weight(L, &f->router, E, dim, name, err));
    f->e13 = loom_xcalloc((size_t)E, sizeof *f->e13);
    f->e2 = loom_xcalloc((size_t)E, sizeof *f->e2);
    if (c->moe_shared_hidden) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.shared_expert_gate.weight", gl);
        LOOM_CHECK(read_block(L, name, 1, dim, 0, 1, 0, dim, h, err));
        LOOM_CHECK(upload_weight(L, &f->sgate, 1, dim, name, err));
        snprintf(pg, sizeof pg, "model.layers.%d.mlp.shared_expert.gate_proj", gl);
        snprintf(pu, sizeof pu, "model.layers.%d.mlp.shared_expert.up_proj", gl);
        lin_part_t gu[2] = {{pg, c->moe_shared_hidden, m->shared_hb, m->shared_hn},
                            {pu, c->moe_shared_hidden, m->shared_hb, m->shared_hn}};
        snprintf(what, sizeof what, "model.layers.%d.mlp.shared_expert.gate_up", gl);
        LOOM_CHECK(load_linear(L, &f->s13, what, gu, 2, dim, 0, dim, err));
        snprintf(pg, sizeof pg, "model.layers.%d.mlp.shared_expert.down_proj", gl);
        lin_part_t dn = {pg, dim, 0, dim};
        LOOM_CHECK(load_linear(L, &f->s2, pg, &dn, 1, c->moe_shared_hidden, m->shared_hb, m->shared_hn, err));
    }
    for (int j = m->expert_begin; j < m->expert_end; j++) {
        snprintf(pg, sizeof pg, "model.layers.%d.%s.experts.%d.%s", gl, blk, j, mx ? "w1" : "gate_proj");
        snprintf(pu, sizeof pu, "model.layers.%d.%s.experts.%d.%s", gl, blk, j, mx ? "w3" : "up_proj");
        lin_part_t gu[2] = {{pg, c->moe_hidden_dim, m->moe_hb, m->moe_hn}, {pu, c->moe_hidden_dim, m->moe_hb, m->moe_hn}};
        snprintf(what, sizeof what, "model.layers.%d.%s.experts.%d.%s", gl, blk, j, mx ? "w1+w3" : "gate_up");
        LOOM_CHECK(load_linear(L, &f->e13[j], what, gu, 2, dim, 0, dim, err));
        snprintf(pg, sizeof pg, "model.layers.%d.%s.experts.%d.%s", gl, blk, j, mx ? "w2" : "down_proj");
        lin_part_t dn = {pg, dim, 0, dim};
        LOOM_CHECK(load_linear(L, &f->e2[j], pg, &dn, 1, c->moe_hidden_dim, m->moe_hb, m->moe_hn, err));
        m->expert_bytes += loom_weight_bytes(&f->e13[j]) + loom_weight_bytes(&f->e2[j]);
    }
    return LOOM_OK;
}

/* The backend's tables of loom_op_moe_gemv for every MoE layer whose held
 * experts it can run per (token, choice) pair (loom_backend_moe_device: the
 * CUDA backend up to 4 tokens, float experts; the CPU backend 1 token, where
 * a pair reads what its group would), so those decode steps route, run the
 * experts and combine without the host. Not Qwen2-MoE's layers (their
 * shared expert's gate is applied on the host) nor GPT-OSS's (biases and
 * the clamped SwiGLU are the grouped path's). */
static loom_status_t moe_tables(loom_model_t *m, loom_err_t *err) {
    const int E = m->cfg.n_experts, K = m->cfg.n_experts_per_tok;
    int n_moe = 0, n_dev = 0, max_n = 1 << 30;
    for (int l = 0; l < m->dims.n_layers; l++) {
        loom_ffn_t *f = &m->layers[l].ffn;
        if (!f->moe) continue;
        n_moe++;
        if (m->cfg.moe_shared_hidden || m->cfg.gpt_oss || m->expert_end <= m->expert_begin)
            continue;
        int n13 = loom_backend_moe_device(m->be, f->e13, E, K),
            n2 = loom_backend_moe_device(m->be, f->e2, E, K);
        int dn = LOOM_MIN(n13, n2);
        if (dn <= 0) continue;
        f->t13 = loom_backend_moe_table(m->be, f->e13, E);
        f->t2 = loom_backend_moe_table(m->be, f->e2, E);
        if (!f->t13 || !f->t2)
            return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for the expert tables");
        f->dev_n = dn;
        max_n = LOOM_MIN(max_n, dn);
        n_dev++;
    }
    m->moe_device_n = n_moe > 0 && n_dev == n_moe ? max_n : 0;
    if (n_dev > 0)
        LOOM_INFO("Mixture of Experts: decode steps of up to %d token(s) route and run the experts "
                  "on the %s device "
                  "(%d of %d MoE layers)",
                  max_n, loom_backend_name(m->be), n_dev, n_moe);
    return LOOM_OK;
}

static loom_status_t load_layer(loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    int hd = c->head_dim, dim = c->dim;
    char name[256], pq[256], pk[256], pv[256];
    loom_status_t s;
#define LNAME(suffix) (snprintf(name, sizeof name, "model.layers.%d.%s", gl, suffix), name)
#define PNAME(buf, suffix) (snprintf(buf, sizeof buf, "model.layers.%d.%s", gl, suffix), buf)

    LOOM_CHECK(upload_norm(L, LNAME("input_layernorm.weight"), dim, &ly->attn_norm, err));
    if (c->gemma) { /* post_attention_layernorm normalises the attention output; the MLP has its own pair */
        LOOM_CHECK(upload_norm(L, LNAME("post_attention_layernorm.weight"), dim, &ly->post_attn_norm, err));
        LOOM_CHECK(upload_norm(L, LNAME("pre_feedforward_layernorm.weight"), dim, &ly->ffn_norm, err));
        LOOM_CHECK(upload_norm(L, LNAME("post_feedforward_layernorm.weight"), dim, &ly->post_ffn_norm, err));
    } else {
        LOOM_CHECK(upload_norm(L, LNAME("post_attention_layernorm.weight"), dim, &ly->ffn_norm, err));
    }

    /* q, k, v: this rank's heads stacked into one (qkv_dim, dim) matrix */
    int64_t qrows = (int64_t)c->n_heads * hd, kvrows = (int64_t)c->n_kv_heads * hd;
    lin_part_t qkv[3] = {
        {PNAME(pq, "self_attn.q_proj"), qrows, (int64_t)d->q_head_begin * hd, (int64_t)d->n_heads * hd},
        {PNAME(pk, "self_attn.k_proj"), kvrows, (int64_t)d->kv_head_begin * hd, (int64_t)d->n_kv_heads * hd},
        {PNAME(pv, "self_attn.v_proj"), kvrows, (int64_t)d->kv_head_begin * hd, (int64_t)d->n_kv_heads * hd},
    };
    if (c->fused_qkv) { /* Phi-3: one qkv_proj of q rows, then k rows, then v rows; this rank's heads of each */
        const char *f = PNAME(pq, "self_attn.qkv_proj");
        int64_t all = qrows + 2 * kvrows;
        qkv[0] = (lin_part_t){f, all, qkv[0].r0, qkv[0].nr};
        qkv[1] = (lin_part_t){f, all, qrows + qkv[1].r0, qkv[1].nr};
        qkv[2] = (lin_part_t){f, all, qrows + kvrows + qkv[2].r0, qkv[2].nr};
    }
    /* partial rotary: the q and k heads' rows to their kernel slots (rotary_slot) */
    L->rotary_rows = c->rotary_dim < hd ? (int64_t)(d->n_heads + d->n_kv_heads) * hd : 0;
    s = load_linear(L, &ly->wqkv, LNAME("self_attn.qkv"), qkv, 3, dim, 0, dim, err);
    L->rotary_rows = 0;
    LOOM_CHECK(s);
    if (c->attention_bias) {
        /* the biases of the same rows, stacked the same way */
        float *h = staging(L, (size_t)m->qkv_dim);
        if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
        LOOM_CHECK(read_slice(L, LNAME("self_attn.q_proj.bias"), qrows, (int64_t)d->q_head_begin * hd,
                              (int64_t)d->n_heads * hd, h, err));
        LOOM_CHECK(read_slice(L, LNAME("self_attn.k_proj.bias"), kvrows, (int64_t)d->kv_head_begin * hd,
                              (int64_t)d->n_kv_heads * hd, h + (size_t)d->n_heads * hd, err));
        LOOM_CHECK(read_slice(L, LNAME("self_attn.v_proj.bias"), kvrows, (int64_t)d->kv_head_begin * hd,
                              (int64_t)d->n_kv_heads * hd, h + (size_t)(d->n_heads + d->n_kv_heads) * hd, err));
        if (c->rotary_dim < hd)
            rotary_permute_f32(h, (int64_t)(d->n_heads + d->n_kv_heads) * hd, 1, hd, c->rotary_dim,
                               c->rope_attn_factor);
        LOOM_CHECK(
            upload_host(L, h, (size_t)m->qkv_dim, &ly->bqkv, LNAME("self_attn.q/k/v biases"), err));
    }

    if (c->gpt_oss) { /* this rank's heads' sinks; o_proj's bias where the partial sums get it once
                       */
        float *h = staging(L, (size_t)LOOM_MAX(d->n_heads, dim));
        if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
        LOOM_CHECK(read_slice(L, LNAME("self_attn.sinks"), c->n_heads, d->q_head_begin, d->n_heads,
                              h, err));
        LOOM_CHECK(upload_host(L, h, (size_t)d->n_heads, &ly->sinks, name, err));
        if (c->attention_bias && m->spec.tp_rank == 0) {
            LOOM_CHECK(read_slice(L, LNAME("self_attn.o_proj.bias"), dim, 0, dim, h, err));
            LOOM_CHECK(upload_host(L, h, (size_t)dim, &ly->bo, name, err));
        }
    }
    if (c->qk_norm) { /* Qwen3: one gain per head dimension, shared by the heads */
        LOOM_CHECK(upload_norm(L, LNAME("self_attn.q_norm.weight"), hd, &ly->q_norm, err));
        LOOM_CHECK(upload_norm(L, LNAME("self_attn.k_norm.weight"), hd, &ly->k_norm, err));
    }
    ly->window = loom_model_config_layer_window(c, gl);

    /* o: row-parallel, this rank's input columns */
    lin_part_t o = {PNAME(pk, "self_attn.o_proj"), dim, 0, dim};
    LOOM_CHECK(load_linear(L, &ly->wo, LNAME("self_attn.o_proj"), &o, 1, qrows, (int64_t)d->q_head_begin * hd,
                           (int64_t)d->n_heads * hd, err));

    if (loom_model_config_layer_moe(c, gl)) {
        LOOM_CHECK(load_moe(L, gl, &ly->ffn, err));
        return LOOM_OK;
    }

    /* gate and up: column-parallel, stacked */
    lin_part_t gu[2] = {
        {PNAME(pq, "mlp.gate_proj"), c->hidden_dim, d->hidden_begin, d->hidden},
        {PNAME(pk, "mlp.up_proj"), c->hidden_dim, d->hidden_begin, d->hidden},
    };
    if (c->fused_qkv) { /* Phi-3: gate_up_proj holds the gate rows, then the up rows */
        const char *f = PNAME(pq, "mlp.gate_up_proj");
        gu[0] = (lin_part_t){f, 2 * (int64_t)c->hidden_dim, d->hidden_begin, d->hidden};
        gu[1] = (lin_part_t){f, 2 * (int64_t)c->hidden_dim, c->hidden_dim + d->hidden_begin, d->hidden};
    }
    LOOM_CHECK(load_linear(L, &ly->ffn.w13, LNAME("mlp.gate_up"), gu, 2, dim, 0, dim, err));

    /* down: row-parallel */
    lin_part_t dn = {PNAME(pq, "mlp.down_proj"), dim, 0, dim};
    LOOM_CHECK(load_linear(L, &ly->ffn.w2, LNAME("mlp.down_proj"), &dn, 1, c->hidden_dim, d->hidden_begin, d->hidden,
                           err));
#undef LNAME
#undef PNAME
    return LOOM_OK;
}

/* With quantized weights, the intermediate size is split across TP ranks on
 * 32-column blocks (whole 4-bit groups when the group divides it) instead of
 * evenly: the CPU backend rounds activations to int8 per 32 columns, and a
 * down_proj slice that starts on a block boundary sees exactly the blocks
 * (and groups) one process sees, so every grid gives the same ids. */
#define QUANT_SPLIT_COLS 32

static loom_status_t align_split(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                                 const loom_model_options_t *opt, int hidden, int *begin, int *len,
                                 loom_err_t *err) {
    int quantized = opt->quant.quant != LOOM_QUANT_NONE || cfg->ckpt_quant != LOOM_CKPT_FLOAT;
    if (!quantized || spec->tp_size == 1) return LOOM_OK;
    int group = opt->quant.quant == LOOM_QUANT_Q4 ? opt->quant.group : cfg->ckpt_group;
    int unit = group > QUANT_SPLIT_COLS && hidden % group == 0 ? group : QUANT_SPLIT_COLS;
    int units = (hidden + unit - 1) / unit, ub, ul;
    if (units < spec->tp_size)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "intermediate size %d has %d blocks of %d columns, fewer than %d TP ranks: use fewer "
                            "ranks for quantized weights",
                            hidden, units, unit, spec->tp_size);
    loom_split_range(units, spec->tp_size, spec->tp_rank, &ub, &ul);
    *begin = ub * unit;
    *len = LOOM_MIN((ub + ul) * unit, hidden) - *begin;
    return LOOM_OK;
}

static loom_status_t align_hidden_split(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                                        const loom_model_options_t *opt, loom_shard_dims_t *d, loom_err_t *err) {
    return align_split(cfg, spec, opt, cfg->hidden_dim, &d->hidden_begin, &d->hidden, err);
}

/* Which experts this rank holds and which slice of their intermediate
 * rows: all of them sliced like a dense MLP (plain TP), or whole experts
 * {J : J*tp/E == rank} (expert parallelism), logged. */
static loom_status_t moe_split(loom_model_t *m, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_spec_t *sp = &m->spec;
    int any = 0;
    for (int l = sp->layer_begin; l < sp->layer_end; l++) any |= loom_model_config_layer_moe(c, l);
    if (!any) return LOOM_OK;
    int tp = sp->tp_size > 0 ? sp->tp_size : 1, E = c->n_experts;
    m->expert_begin = 0;
    m->expert_end = E;
    m->moe_hb = 0;
    m->moe_hn = c->moe_hidden_dim;
    if (c->moe_shared_hidden) {
        if (c->moe_shared_hidden < tp)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "shared_expert_intermediate_size %d is smaller than %d TP ranks", c->moe_shared_hidden,
                                tp);
        loom_split_range(c->moe_shared_hidden, tp, sp->tp_rank, &m->shared_hb, &m->shared_hn);
        LOOM_CHECK(align_split(c, sp, &m->opt, c->moe_shared_hidden, &m->shared_hb, &m->shared_hn, err));
    }
    if (m->opt.expert_parallel && tp > 1) {
        if (E % tp)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "expert parallelism: num_experts %d is not divisible by the %d tensor-parallel ranks "
                                "of the stage",
                                E, tp);
        m->expert_begin = sp->tp_rank * (E / tp);
        m->expert_end = m->expert_begin + E / tp;
        LOOM_INFO("expert parallel: tp rank %d/%d holds experts [%d, %d) of %d", sp->tp_rank, tp, m->expert_begin,
                  m->expert_end, E);
        return LOOM_OK;
    }
    if (c->moe_hidden_dim < tp)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "moe_intermediate_size %d is smaller than %d TP ranks",
                            c->moe_hidden_dim, tp);
    loom_split_range(c->moe_hidden_dim, tp, sp->tp_rank, &m->moe_hb, &m->moe_hn);
    LOOM_CHECK(align_split(c, sp, &m->opt, c->moe_hidden_dim, &m->moe_hb, &m->moe_hn, err));
    LOOM_INFO("experts: tp rank %d/%d holds all %d experts, intermediate rows [%d, %d) of %d", sp->tp_rank, tp, E,
              m->moe_hb, m->moe_hb + m->moe_hn, c->moe_hidden_dim);
    return LOOM_OK;
}

/* The RoPE table of the kernels: pair (j, j + head_dim/2) turns at pos x
 * out[j]. With partial rotary the rows of q and k were permuted at load
 * (rotary_perm) so that the first rotary_dim/2 pairs are the rotary ones,
 * with the frequencies of a head rotary_dim wide; the rest get 0, which
 * leaves them as they are. */
static void rope_inv_freq(const loom_model_config_t *c, float *out) {
    int half = c->head_dim / 2, rd = c->rotary_dim;
    for (int j = 0; j < half; j++) {
        if (j >= rd / 2) {
            out[j] = 0.0f;
            continue;
        }
        double inv = pow((double)c->rope_theta, -2.0 * j / (double)rd);
        if (c->rope_scaling == LOOM_ROPE_LONGROPE) {
            inv /= c->rope_ext_factor[j];
        } else if (c->rope_scaling == LOOM_ROPE_LINEAR) {
            inv /= c->rope_factor;
        } else if (c->rope_scaling == LOOM_ROPE_YARN) {
            /* NTK-by-parts: dimensions that turn fewer than beta_slow times
             * over the original context are interpolated (/ factor), those
             * that turn more than beta_fast times kept, a linear ramp between */
            double d = rd, base = c->rope_theta, orig = c->rope_orig_max_pos;
            double lo = d * log(orig / (c->rope_beta_fast * 2.0 * M_PI)) / (2.0 * log(base));
            double hi = d * log(orig / (c->rope_beta_slow * 2.0 * M_PI)) / (2.0 * log(base));
            if (c->rope_truncate) {
                lo = floor(lo);
                hi = ceil(hi);
            }
            if (lo < 0) lo = 0;
            if (hi > d - 1) hi = d - 1;
            if (lo == hi) hi += 0.001;
            double ramp = ((double)j - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extrap = 1.0 - ramp; /* weight of the unscaled frequency */
            inv = inv / c->rope_factor * (1.0 - extrap) + inv * extrap;
        } else if (c->rope_scaling == LOOM_ROPE_LLAMA3) {
            double orig = c->rope_orig_max_pos, factor = c->rope_factor;
            double lo = c->rope_low_freq_factor, hi = c->rope_high_freq_factor;
            double wavelen = 2.0 * M_PI / inv;
            if (wavelen > orig / lo) {
                inv = inv / factor;
            } else if (wavelen >= orig / hi) {
                double smooth = (orig / wavelen - lo) / (hi - lo);
                inv = (1.0 - smooth) * inv / factor + smooth * inv;
            }
        }
        out[j] = (float)inv;
    }
}

/* ---- checkpoint checks (before anything is allocated) ------------------ */

/* Whether `suffix` (after "model.layers.N.") names a tensor this
 * architecture reads. Linears may be stored float (.weight) or quantized
 * (.qweight with .scales / .mins, or AWQ/GPTQ's .qzeros and .g_idx). */
/* A Mixture-of-Experts layer's tensors: the router, and the experts'
 * linears (J below n_experts). */
static int moe_tensor_used(const loom_model_config_t *c, const char *suffix) {
    static const char *const parts[] = {"weight", "qweight", "scales", "mins", "qzeros", "g_idx"};
    const int mx = c->moe_mixtral_names;
    const char *blk = mx ? "block_sparse_moe." : "mlp.";
    size_t nb = strlen(blk);
    if (strncmp(suffix, blk, nb)) return 0;
    suffix += nb;
    if (c->gpt_oss) {
        static const char *const flt[] = {
            "router.weight",          "router.bias",          "experts.gate_up_proj_bias",
            "experts.down_proj_bias", "experts.gate_up_proj", "experts.down_proj"};
        static const char *const mx4[] = {"router.weight",
                                          "router.bias",
                                          "experts.gate_up_proj_bias",
                                          "experts.down_proj_bias",
                                          "experts.gate_up_proj_blocks",
                                          "experts.gate_up_proj_scales",
                                          "experts.down_proj_blocks",
                                          "experts.down_proj_scales"};
        int m4 = c->ckpt_quant == LOOM_CKPT_MXFP4;
        for (size_t i = 0; i < (m4 ? LOOM_ARRAY_LEN(mx4) : LOOM_ARRAY_LEN(flt)); i++)
            if (!strcmp(suffix, m4 ? mx4[i] : flt[i])) return 1;
        return 0;
    }
    if (!strcmp(suffix, "gate.weight")) return 1;
    if (c->moe_shared_hidden) {
        if (!strcmp(suffix, "shared_expert_gate.weight")) return 1;
        static const char *const shared[] = {"shared_expert.gate_proj.", "shared_expert.up_proj.",
                                             "shared_expert.down_proj."};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(shared); i++) {
            size_t n = strlen(shared[i]);
            if (strncmp(suffix, shared[i], n)) continue;
            for (size_t k = 0; k < LOOM_ARRAY_LEN(parts); k++)
                if (!strcmp(suffix + n, parts[k])) return 1;
        }
    }
    if (strncmp(suffix, "experts.", 8)) return 0;
    char *end;
    long j = strtol(suffix + 8, &end, 10);
    if (end == suffix + 8 || *end != '.' || j < 0 || j >= c->n_experts) return 0;
    static const char *const mx_names[] = {"w1", "w2", "w3"};
    static const char *const qw_names[] = {"gate_proj", "up_proj", "down_proj"};
    for (int i = 0; i < 3; i++) {
        const char *lin = mx ? mx_names[i] : qw_names[i];
        size_t n = strlen(lin);
        if (strncmp(end + 1, lin, n) || end[1 + n] != '.') continue;
        for (size_t k = 0; k < LOOM_ARRAY_LEN(parts); k++)
            if (!strcmp(end + 2 + n, parts[k])) return 1;
    }
    return 0;
}

static int layer_tensor_used(const loom_model_config_t *c, int layer, const char *suffix) {
    static const char *const split[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                        "mlp.down_proj"};
    static const char *const fused[] = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                        "mlp.down_proj", "", "", ""};
    const char *const *linears = c->fused_qkv ? fused : split;
    static const char *const parts[] = {"weight", "qweight", "scales", "mins", "qzeros", "g_idx"};
    if (!strcmp(suffix, "input_layernorm.weight") || !strcmp(suffix, "post_attention_layernorm.weight"))
        return 1;
    if (c->gemma &&
        (!strcmp(suffix, "pre_feedforward_layernorm.weight") || !strcmp(suffix, "post_feedforward_layernorm.weight")))
        return 1;
    if (c->qk_norm && (!strcmp(suffix, "self_attn.q_norm.weight") || !strcmp(suffix, "self_attn.k_norm.weight")))
        return 1;
    if (c->attention_bias && (!strcmp(suffix, "self_attn.q_proj.bias") || !strcmp(suffix, "self_attn.k_proj.bias") ||
                              !strcmp(suffix, "self_attn.v_proj.bias")))
        return 1;
    if (c->gpt_oss && (!strcmp(suffix, "self_attn.sinks") ||
                       (c->attention_bias && !strcmp(suffix, "self_attn.o_proj.bias"))))
        return 1;
    int moe = loom_model_config_layer_moe(c, layer);
    if (moe) return moe_tensor_used(c, suffix) || (strncmp(suffix, "mlp.", 4) && layer_tensor_used(c, -1, suffix));
    for (size_t i = 0; i < LOOM_ARRAY_LEN(split); i++) {
        size_t n = strlen(linears[i]);
        if (!n) continue;
        if (strncmp(suffix, linears[i], n) || suffix[n] != '.') continue;
        for (size_t j = 0; j < LOOM_ARRAY_LEN(parts); j++)
            if (!strcmp(suffix + n + 1, parts[j])) return 1;
    }
    return 0;
}

static int top_tensor_used(const loom_model_config_t *c, const char *name) {
    static const char *const parts[] = {"weight", "qweight", "scales", "mins", "qzeros", "g_idx"};
    if (!strcmp(name, "model.embed_tokens.weight") || !strcmp(name, "model.norm.weight")) return 1;
    /* a tied head reads the embedding; a stored lm_head is then not read
     * (as in Transformers), except one `loom quantize` wrote */
    if (!strcmp(name, "lm_head.weight")) return 1;
    if (!strncmp(name, "lm_head.", 8))
        for (size_t j = 0; j < LOOM_ARRAY_LEN(parts); j++)
            if (!strcmp(name + 8, parts[j])) return 1;
    (void)c;
    return 0;
}

/* A multimodal checkpoint's vision tower and projector, which a text model leaves unread. */
static const char *const k_vision_prefixes[] = {"vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                                "model.multi_modal_projector."};

/* Tensors safe to skip: RoPE tables some exporters store (Loom computes
 * them), and the vision half of a multimodal checkpoint served as text. */
static int tensor_allowed_unused(const loom_model_config_t *c, const char *name) {
    const char *p = strstr(name, "rotary_emb.inv_freq");
    if (p && p[strlen("rotary_emb.inv_freq")] == 0) return 1;
    for (size_t i = 0; c->multimodal && i < LOOM_ARRAY_LEN(k_vision_prefixes); i++)
        if (!strncmp(name, k_vision_prefixes[i], strlen(k_vision_prefixes[i]))) return 1;
    return 0;
}

loom_status_t loom_model_map_tensor_names(const loom_model_config_t *c, loom_st_t *st, loom_err_t *err) {
    static const char *const maps[][2] = {
        {"language_model.model.", "model."},      /* Transformers < 4.52 */
        {"language_model.lm_head.", "lm_head."},
        {"model.language_model.", "model."},      /* Transformers >= 4.52 */
    };
    if (!c->multimodal) return LOOM_OK;
    int total = 0, vision = 0;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(maps); i++) {
        int n = 0;
        LOOM_CHECK(loom_st_rename_prefix(st, maps[i][0], maps[i][1], &n, err));
        total += n;
    }
    for (int i = 0; i < loom_st_count(st); i++) vision += tensor_allowed_unused(c, loom_st_at(st, i)->name);
    LOOM_INFO("multimodal checkpoint: serving its text model (%d tensors renamed), %d vision tensors left unread",
              total, vision);
    return LOOM_OK;
}

/* Checks config.json against the checkpoint before the shard allocates
 * anything: the layer count, the embedding's shape, and that every tensor is
 * one this architecture reads (the first that is not is named: a checkpoint
 * relabelled to a model_type with fewer tensors fails here). */
loom_status_t loom_model_check_checkpoint(const loom_model_config_t *c, const loom_st_t *st, loom_err_t *err) {
    const loom_st_tensor_t *e = loom_st_find(st, "model.embed_tokens.weight");
    if (!e) return loom_err_set(err, LOOM_ERR_FORMAT, "the checkpoint has no tensor 'model.embed_tokens.weight'");
    if (e->n_dims != 2 || e->shape[0] != c->vocab_size || e->shape[1] != c->dim)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "tensor 'model.embed_tokens.weight' in %s has shape [%lld, %lld]; config.json says "
                            "vocab_size %d, hidden_size %d",
                            e->file, (long long)e->shape[0], (long long)(e->n_dims > 1 ? e->shape[1] : 0),
                            c->vocab_size, c->dim);
    long long layers = 0; /* 1 + the highest layer index present */
    for (int i = 0; i < loom_st_count(st); i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        const char *name = t->name;
        if (tensor_allowed_unused(c, name)) continue;
        if (!strncmp(name, "model.layers.", 13)) {
            char *end;
            long long li = strtoll(name + 13, &end, 10);
            if (end == name + 13 || *end != '.' || li < 0)
                return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s: no layer index", name, t->file);
            if (li >= c->n_layers)
                return loom_err_set(err, LOOM_ERR_FORMAT,
                                    "tensor '%s' in %s is in layer %lld, but config.json's num_hidden_layers is %d",
                                    name, t->file, li, c->n_layers);
            if (li + 1 > layers) layers = li + 1;
            if (!layer_tensor_used(c, (int)li, end + 1))
                return loom_err_set(err, LOOM_ERR_FORMAT,
                                    "tensor '%s' in %s is not used by a %s model (is config.json's model_type "
                                    "right?)",
                                    name, t->file, c->model_type);
            continue;
        }
        if (!top_tensor_used(c, name))
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "tensor '%s' in %s is not used by a %s model (is config.json's model_type right?)",
                                name, t->file, c->model_type);
    }
    if (layers != c->n_layers)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "config.json's num_hidden_layers is %d but the checkpoint has tensors for %lld layers",
                            c->n_layers, layers);
    return LOOM_OK;
}

/* x rounded to the precision of dtype (BF16 / F16: nearest even), as the
 * checkpoint's dtype holds it. */
static float round_to(float x, loom_dtype_t dt) {
    if (dt == LOOM_DT_BF16) {
        uint32_t u;
        memcpy(&u, &x, 4);
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        memcpy(&x, &u, 4);
        return x;
    }
    if (dt == LOOM_DT_F16) return loom_f16_to_f32(loom_f32_to_f16(x));
    return x;
}

/* Gemma scales the embedding rows by sqrt(hidden_size), the factor and the
 * product in the embedding's dtype (Gemma3TextScaledWordEmbedding); done
 * once here on the table. A tied LM head reads the unscaled checkpoint. */
static void scale_embedding(float *h, size_t n, float scale, loom_dtype_t dt) {
    const float s = round_to(scale, dt);
    for (size_t i = 0; i < n; i++) h[i] = round_to(h[i] * s, dt);
}

static void *act_alloc(loom_model_t *m, size_t n, int *fail) {
    void *p = loom_backend_alloc(m->be, n * sizeof(float));
    if (!p) *fail = 1;
    return p;
}

/* Bytes this shard will read from the checkpoint, for the progress line:
 * its layers' tensors split tp ways, the embedding whole, the head (or a
 * tied embedding) split tp ways. An estimate (norms are read whole,
 * replicated KV heads too), so the line says "~" until done. */
static uint64_t shard_read_estimate(const loom_model_config_t *cfg, const loom_st_t *st, const loom_shard_spec_t *spec) {
    uint64_t total = 0, tp = (uint64_t)(spec->tp_size > 0 ? spec->tp_size : 1);
    int has_lm_head = 0;
    for (int i = 0; i < loom_st_count(st); i++) has_lm_head |= !strncmp(loom_st_at(st, i)->name, "lm_head", 7);
    for (int i = 0; i < loom_st_count(st); i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        int layer;
        if (sscanf(t->name, "model.layers.%d.", &layer) == 1) {
            if (layer >= spec->layer_begin && layer < spec->layer_end) total += t->nbytes / tp;
        } else if (!strncmp(t->name, "model.embed_tokens", 18)) {
            if (spec->has_embed) total += t->nbytes;
            if (spec->has_head && cfg->tie_embeddings && !has_lm_head) total += t->nbytes / tp;
        } else if (!strncmp(t->name, "lm_head", 7)) {
            if (spec->has_head) total += t->nbytes / tp;
        } else if (spec->has_head) {
            total += t->nbytes; /* the final norm */
        }
    }
    return total;
}

loom_status_t loom_model_load(loom_backend_t *be, const loom_model_config_t *cfg, loom_st_t *st,
                              const loom_shard_spec_t *spec, const loom_model_options_t *opt,
                              loom_model_t **out, loom_err_t *err) {
    *out = NULL;
    if (cfg->deepseek) { /* the checkpoint is checked, then refused until the engine's MLA block runs it */
        LOOM_CHECK(loom_deepseek_check_checkpoint(cfg, st, err));
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: not yet runnable (multi-head latent attention and DeepSeekMoE are not in the "
                            "forward pass yet)", cfg->model_type);
    }
    if (cfg->head_dim % 2 != 0)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "head_dim %d is odd; RoPE needs pairs", cfg->head_dim);
    if (!loom_backend_kv_supported(be, opt->kv_dtype))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "the %s backend has no %s KV cache", loom_backend_name(be),
                            loom_kv_dtype_name(opt->kv_dtype));
    if (!loom_backend_act_supported(be, (loom_act_t)cfg->hidden_act))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "the %s backend has no kernel for this model's hidden_act",
                            loom_backend_name(be));
    for (int l = spec->layer_begin; l < spec->layer_end; l++)
        if (loom_model_config_layer_window(cfg, l) && !loom_backend_attn_window_supported(be))
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                "the %s backend has no sliding-window attention (layer %d has a window of %d)",
                                loom_backend_name(be), l, loom_model_config_layer_window(cfg, l));
    if (cfg->attn_softcap > 0 && spec->layer_end > spec->layer_begin && !loom_backend_attn_softcap_supported(be))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "the %s backend has no attention logit soft-capping (attn_logit_softcapping %g)",
                            loom_backend_name(be), (double)cfg->attn_softcap);
    if (cfg->final_softcap > 0 && spec->has_head && !loom_backend_softcap_supported(be))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "the %s backend has no final logit soft-capping (final_logit_softcapping %g)",
                            loom_backend_name(be), (double)cfg->final_softcap);
    if (cfg->gpt_oss && spec->layer_end > spec->layer_begin &&
        !loom_backend_attn_sinks_supported(be))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "the %s backend has no attention sinks (gpt_oss)",
                            loom_backend_name(be));
    if (cfg->gpt_oss && spec->layer_end > spec->layer_begin &&
        !loom_backend_swiglu_clamp_supported(be))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "the %s backend has no clamped SwiGLU (gpt_oss's experts)",
                            loom_backend_name(be));
    /* A Mixture-of-Experts block runs on any backend through run_moe's
     * generic ops (routing on the host between them); the activation is
     * checked with the dense MLP's above. */
    LOOM_CHECK(loom_model_check_checkpoint(cfg, st, err));
    if (cfg->rope_ctx_capped)
        LOOM_WARN("longrope: serving %d positions (original_max_position_embeddings), where the short factors "
                  "apply; the long factors beyond are not supported",
                  cfg->max_seq_len);
    loom_model_t *m = loom_xcalloc(1, sizeof *m);
    m->be = be;
    m->cfg = *cfg;
    if (!(m->cfg.rope_attn_factor > 0)) m->cfg.rope_attn_factor = 1.0f; /* a config not from the parser */
    if (m->cfg.rotary_dim <= 0 || m->cfg.rotary_dim > cfg->head_dim) m->cfg.rotary_dim = cfg->head_dim;
    m->spec = *spec;
    m->opt = *opt;
    m->scratch_block = -1;
    if (m->opt.max_tokens < 1) m->opt.max_tokens = 512;
    if (m->opt.max_seqs < 1) m->opt.max_seqs = 1;
    if (m->opt.max_logits < 1) m->opt.max_logits = m->opt.max_seqs;
    loom_status_t s = loom_shard_dims(cfg, spec, &m->dims, err);
    if (s < 0) goto fail;
    s = align_hidden_split(cfg, spec, opt, &m->dims, err);
    if (s < 0) goto fail;
    s = moe_split(m, err);
    if (s < 0) goto fail;
    const loom_shard_dims_t *d = &m->dims;
    int dim = cfg->dim, hd = cfg->head_dim;
    m->qkv_dim = (d->n_heads + 2 * d->n_kv_heads) * hd;

    loader_t L = {.m = m, .st = st};
    uint64_t t0 = loom_now_ns(), read0 = loom_st_bytes_read(st);
    LOOM_INFO("loading %s: layers [%d, %d) of %d, tp rank %d/%d%s%s", loom_backend_name(be),
              spec->layer_begin, spec->layer_end, cfg->n_layers, spec->tp_rank, spec->tp_size,
              spec->has_embed ? ", embedding" : "", spec->has_head ? ", LM head" : "");
    loom_progress_t prog;
    char what[96];
    snprintf(what, sizeof what, "loading layers [%d, %d), tp rank %d/%d", spec->layer_begin, spec->layer_end,
             spec->tp_rank, spec->tp_size);
    loom_progress_begin(&prog, what, shard_read_estimate(cfg, st, spec));
    if (spec->has_embed) {
        float *h = staging(&L, (size_t)cfg->vocab_size * dim);
        if (!h) {
            s = loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory for the embedding table");
            goto fail_loader;
        }
        s = read_block(&L, "model.embed_tokens.weight", cfg->vocab_size, dim, 0, cfg->vocab_size, 0, dim, h, err);
        if (s < 0) goto fail_loader;
        size_t bytes = (size_t)cfg->vocab_size * dim * sizeof(float);
        m->embed = loom_backend_alloc(be, bytes);
        if (!m->embed) {
            s = loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for the embedding table");
            goto fail_loader;
        }
        if (cfg->embed_scale > 0) scale_embedding(h, (size_t)cfg->vocab_size * dim, cfg->embed_scale,
                                                  loom_st_find(st, "model.embed_tokens.weight")->dtype);
        loom_backend_upload(be, m->embed, h, bytes);
        m->weight_bytes += bytes;
    }
    m->layers = loom_xcalloc((size_t)(d->n_layers ? d->n_layers : 1), sizeof *m->layers);
    for (int i = 0; i < d->n_layers; i++) {
        s = load_layer(&L, spec->layer_begin + i, &m->layers[i], err);
        if (s < 0) goto fail_loader;
        loom_progress_update(&prog, loom_st_bytes_read(st) - read0);
    }
    if (spec->has_head) {
        s = upload_norm(&L, "model.norm.weight", dim, &m->final_norm, err);
        if (s < 0) goto fail_loader;
        /* a tied head reads the embedding, unless `loom quantize` stored it quantized */
        const char *head = cfg->tie_embeddings && !loom_qw_stored(st, "lm_head") ? "model.embed_tokens" : "lm_head";
        lin_part_t hp = {head, cfg->vocab_size, d->vocab_begin, d->vocab};
        s = load_linear(&L, &m->lm_head, "lm_head", &hp, 1, dim, 0, dim, err);
        if (s < 0) goto fail_loader;
    }
    loom_progress_end(&prog, loom_st_bytes_read(st) - read0);
    free(L.tmp);
    L.tmp = NULL;
    s = moe_tables(m, err);
    if (s < 0) goto fail;

    float inv[512];
    if (hd / 2 > (int)LOOM_ARRAY_LEN(inv)) {
        s = loom_err_set(err, LOOM_ERR_UNSUPPORTED, "head_dim %d is larger than 1024", hd);
        goto fail;
    }
    rope_inv_freq(cfg, inv);
    m->inv_freq = loom_backend_alloc(be, (size_t)(hd / 2) * sizeof(float));
    if (!m->inv_freq) {
        s = loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory");
        goto fail;
    }
    loom_backend_upload(be, m->inv_freq, inv, (size_t)(hd / 2) * sizeof(float));
    if (cfg->gemma && cfg->rope_local_theta > 0) { /* Gemma 3's sliding layers: their own base, no scaling */
        loom_model_config_t local = *cfg;
        local.rope_theta = cfg->rope_local_theta;
        local.rope_scaling = LOOM_ROPE_NONE;
        rope_inv_freq(&local, inv);
        m->inv_freq_local = loom_backend_alloc(be, (size_t)(hd / 2) * sizeof(float));
        if (!m->inv_freq_local) {
            s = loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory");
            goto fail;
        }
        loom_backend_upload(be, m->inv_freq_local, inv, (size_t)(hd / 2) * sizeof(float));
    }
    for (int i = 0; i < d->n_layers; i++)
        m->layers[i].inv_freq = m->inv_freq_local && m->layers[i].window ? m->inv_freq_local : m->inv_freq;

    size_t T = (size_t)m->opt.max_tokens, NL = (size_t)m->opt.max_logits;
    int oom = 0;
    m->x = act_alloc(m, T * dim, &oom);
    m->xb = act_alloc(m, T * dim, &oom);
    m->xb2 = act_alloc(m, T * dim, &oom);
    m->qkv = act_alloc(m, T * (size_t)m->qkv_dim, &oom);
    m->att = act_alloc(m, T * (size_t)d->n_heads * hd, &oom);
    size_t hid = (size_t)LOOM_MAX(LOOM_MAX(d->hidden, m->moe_hn), m->shared_hn);
    m->gu = act_alloc(m, T * 2 * hid, &oom);
    m->hb = act_alloc(m, T * hid, &oom);
    if (m->expert_end > 0) { /* the shard holds MoE layers (moe_split) */
        size_t E = (size_t)cfg->n_experts, K = (size_t)cfg->n_experts_per_tok;
        m->rl = act_alloc(m, T * E, &oom);
        m->sgl = act_alloc(m, T, &oom);
        m->h_sg = loom_xmalloc(T * sizeof(float));
        m->xg = act_alloc(m, T * K * dim, &oom);
        m->mgu = act_alloc(m, T * K * 2 * (size_t)m->moe_hn, &oom);
        m->mhb = act_alloc(m, T * K * (size_t)m->moe_hn, &oom);
        m->d_rows = (int32_t *)act_alloc(m, T * K, &oom); /* 4-byte elements, as floats */
        m->d_pos = (int32_t *)act_alloc(m, T * K, &oom);
        m->d_pw = act_alloc(m, T * K, &oom);
        m->d_sel = (int32_t *)act_alloc(m, T * K, &oom);
        m->d_w = act_alloc(m, T * K, &oom);
        m->d_ident = (int32_t *)act_alloc(m, T * K, &oom);
        m->h_pos = loom_xmalloc(T * K * sizeof(int32_t));
        m->h_pw = loom_xmalloc(T * K * sizeof(float));
        m->h_fill = loom_xmalloc(T * sizeof(int32_t));
        if (m->d_ident) {
            for (size_t i = 0; i < T * K; i++)
                m->h_pos[i] = (int32_t)i;
            loom_backend_upload(be, m->d_ident, m->h_pos, T * K * sizeof(int32_t));
        }
        m->h_probs = loom_xmalloc(T * E * sizeof(float));
        m->h_sel = loom_xmalloc(T * K * sizeof(int32_t));
        m->h_w = loom_xmalloc(T * K * sizeof(float));
        m->h_cnt = loom_xmalloc((E + 1) * sizeof(int32_t));
        m->h_rows = loom_xmalloc(T * K * sizeof(int32_t));
        m->h_rw = loom_xmalloc(T * K * sizeof(float));
    }
    if (spec->has_head) {
        m->xl = act_alloc(m, NL * dim, &oom);
        m->logits = act_alloc(m, NL * (size_t)d->vocab, &oom);
    }
    /* metadata: tokens, pos, slots, tok_seq (T each), logit rows (NL), block tables */
    m->meta_cap = 4 * T + NL;
    m->meta_host = loom_xmalloc(m->meta_cap * sizeof(int32_t));
    m->sample_k = loom_xmalloc(NL * sizeof(int));
    m->meta_dev = loom_backend_alloc(be, m->meta_cap * sizeof(int32_t));
    if (!m->meta_dev) oom = 1;
    if (oom) {
        s = loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for activations (%zu tokens)", T);
        goto fail;
    }
    uint64_t total = 0;
    for (int i = 0; i < loom_st_count(st); i++) total += loom_st_at(st, i)->nbytes;
    LOOM_INFO("shard loaded: %.1f MB of weights (%d matmul weights quantized) in %.2f s; read %llu of the "
              "checkpoint's %llu bytes (%.1f%%)",
              (double)m->weight_bytes / 1e6, m->n_quantized, (double)(loom_now_ns() - t0) * 1e-9,
              (unsigned long long)loom_st_bytes_read(st), (unsigned long long)total,
              total ? 100.0 * (double)loom_st_bytes_read(st) / (double)total : 0.0);
    *out = m;
    return LOOM_OK;

fail_loader:
    free(L.tmp);
fail:
    loom_model_destroy(&m);
    return s;
}

void loom_model_destroy(loom_model_t **m_p) {
    if (!m_p || !*m_p) return;
    loom_model_t *m = *m_p;
    *m_p = NULL;
    loom_backend_t *be = m->be;
    if (m->layers) {
        for (int i = 0; i < m->dims.n_layers; i++) {
            loom_layer_t *ly = &m->layers[i];
            loom_backend_free(be, ly->attn_norm);
            loom_backend_free(be, ly->bqkv);
            loom_backend_free(be, ly->q_norm);
            loom_backend_free(be, ly->post_attn_norm);
            loom_backend_free(be, ly->post_ffn_norm);
            loom_backend_free(be, ly->k_norm);
            loom_backend_free(be, ly->sinks);
            loom_backend_free(be, ly->bo);
            loom_backend_free(be, ly->ffn.rbias);
            loom_backend_free(be, ly->ffn.b13);
            loom_backend_free(be, ly->ffn.b2);
            loom_backend_free(be, ly->ffn_norm);
            loom_weight_free(be, &ly->wqkv);
            loom_weight_free(be, &ly->wo);
            loom_weight_free(be, &ly->ffn.w13);
            loom_weight_free(be, &ly->ffn.w2);
            loom_weight_free(be, &ly->ffn.router);
            loom_weight_free(be, &ly->ffn.s13);
            loom_weight_free(be, &ly->ffn.s2);
            loom_weight_free(be, &ly->ffn.sgate);
            for (int j = 0; ly->ffn.e13 && j < m->cfg.n_experts; j++) {
                loom_weight_free(be, &ly->ffn.e13[j]);
                loom_weight_free(be, &ly->ffn.e2[j]);
            }
            loom_backend_free(be, ly->ffn.t13);
            loom_backend_free(be, ly->ffn.t2);
            free(ly->ffn.e13);
            free(ly->ffn.e2);
        }
        free(m->layers);
    }
    loom_backend_free(be, m->embed);
    loom_backend_free(be, m->final_norm);
    loom_weight_free(be, &m->lm_head);
    loom_backend_free(be, m->inv_freq);
    loom_backend_free(be, m->inv_freq_local);
    loom_backend_free(be, m->kv_mem);
    float *acts[] = {m->x,
                     m->xb,
                     m->xb2,
                     m->qkv,
                     m->att,
                     m->gu,
                     m->hb,
                     m->xl,
                     m->logits,
                     m->rl,
                     m->xg,
                     m->sgl,
                     m->mgu,
                     m->mhb,
                     (float *)m->d_rows,
                     (float *)m->d_pos,
                     m->d_pw,
                     (float *)m->d_sel,
                     m->d_w,
                     (float *)m->d_ident};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(acts); i++) loom_backend_free(be, acts[i]);
    void *host[] = {m->h_sg,   m->h_probs, m->h_sel, m->h_w,  m->h_cnt,
                    m->h_rows, m->h_rw,    m->h_pos, m->h_pw, m->h_fill};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(host); i++) free(host[i]);
    loom_backend_free(be, m->meta_dev);
    free(m->meta_host);
    free(m->sample_k);
    free(m);
}

const loom_shard_dims_t *loom_model_dims(const loom_model_t *m) { return &m->dims; }
const loom_model_config_t *loom_model_config(const loom_model_t *m) { return &m->cfg; }
size_t loom_model_weight_bytes(const loom_model_t *m) { return m->weight_bytes; }
size_t loom_model_matmul_bytes(const loom_model_t *m) { return m->matmul_bytes; }
size_t loom_model_active_bytes(const loom_model_t *m) {
    if (!m->expert_bytes) return m->matmul_bytes;
    /* a token's k experts of E: under expert parallelism k/tp of this rank's E/tp on average */
    double active = (double)m->expert_bytes * m->cfg.n_experts_per_tok / m->cfg.n_experts;
    return m->matmul_bytes - m->expert_bytes + (size_t)active;
}
int loom_model_kv_blocks(const loom_model_t *m) { return m->n_blocks; }
int loom_model_kv_block_size(const loom_model_t *m) { return m->block_size; }
float *loom_model_hidden(loom_model_t *m) { return m->x; }
float *loom_model_logits(loom_model_t *m) { return m->logits; }

loom_dtype_t loom_model_kv_dtype(const loom_model_t *m) { return m->opt.kv_dtype; }

size_t loom_model_kv_block_bytes(const loom_model_t *m, int block_size) {
    return 2 * (size_t)m->dims.n_layers * (size_t)block_size * (size_t)m->dims.n_kv_heads *
           loom_kv_head_bytes(m->opt.kv_dtype, m->cfg.head_dim);
}

int loom_model_kv_scratch_blocks(const loom_model_t *m) {
    return m->opt.decode_buckets > 0 || (m->opt.decode_buckets == 0 && loom_backend_has_graphs(m->be));
}

/* The pool is one allocation: per layer K codes, V codes, then (I8) K
 * scales and V scales, each array starting on a 256-byte boundary. */
#define KV_ALIGN 256
static size_t kv_align(size_t b) { return (b + KV_ALIGN - 1) / KV_ALIGN * KV_ALIGN; }

loom_status_t loom_model_alloc_kv(loom_model_t *m, int n_blocks, int block_size, loom_err_t *err) {
    if (n_blocks < 1 || block_size < 1)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "KV pool of %d blocks of %d tokens", n_blocks, block_size);
    loom_backend_free(m->be, m->kv_mem);
    m->kv_mem = NULL;
    int pad = loom_model_kv_scratch_blocks(m);
    int total = n_blocks + pad;
    const loom_dtype_t dt = m->opt.kv_dtype;
    const size_t tokens = (size_t)total * block_size * m->dims.n_kv_heads; /* token-heads per layer */
    const size_t codes = kv_align(tokens * m->cfg.head_dim * loom_dtype_size(dt));
    const size_t scales = dt == LOOM_DT_I8 ? kv_align(tokens * sizeof(float)) : 0;
    size_t bytes = (size_t)m->dims.n_layers * 2 * (codes + scales);
    if (bytes == 0) bytes = 64; /* a stage with no layers */
    m->kv_mem = loom_backend_alloc(m->be, bytes);
    if (!m->kv_mem)
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for a KV pool of %d blocks (%.1f MB)",
                            n_blocks, (double)bytes / 1e6);
    loom_backend_memset(m->be, m->kv_mem, 0, bytes);
    char *p = m->kv_mem;
    for (int i = 0; i < m->dims.n_layers; i++) {
        loom_kv_layer_t *kv = &m->layers[i].kv;
        kv->dtype = dt;
        kv->k = p;
        kv->v = p + codes;
        p += 2 * codes;
        kv->k_scale = scales ? (float *)p : NULL;
        kv->v_scale = scales ? (float *)(p + scales) : NULL;
        p += 2 * scales;
    }
    m->n_blocks = n_blocks;
    m->block_size = block_size;
    m->scratch_block = pad ? n_blocks : -1;
    return LOOM_OK;
}

/* Copy-on-write copies a block's codes and, for I8, its scales. */
void loom_model_copy_blocks(loom_model_t *m, const int32_t *src, const int32_t *dst, int n) {
    const size_t heads = (size_t)m->block_size * m->dims.n_kv_heads; /* token-heads per block */
    const size_t code_bytes = heads * m->cfg.head_dim * loom_dtype_size(m->opt.kv_dtype);
    for (int i = 0; i < n; i++) {
        LOOM_ASSERT(src[i] >= 0 && src[i] < m->n_blocks && dst[i] >= 0 && dst[i] < m->n_blocks);
        const size_t s = (size_t)src[i], d = (size_t)dst[i];
        for (int l = 0; l < m->dims.n_layers; l++) {
            loom_kv_layer_t *kv = &m->layers[l].kv;
            loom_backend_copy(m->be, (char *)kv->k + d * code_bytes, (char *)kv->k + s * code_bytes,
                              code_bytes);
            loom_backend_copy(m->be, (char *)kv->v + d * code_bytes, (char *)kv->v + s * code_bytes,
                              code_bytes);
            if (kv->k_scale) {
                loom_backend_copy(m->be, kv->k_scale + d * heads, kv->k_scale + s * heads,
                                  heads * sizeof(float));
                loom_backend_copy(m->be, kv->v_scale + d * heads, kv->v_scale + s * heads,
                                  heads * sizeof(float));
            }
        }
    }
}

/* ---- forward ------------------------------------------------------------ */

static loom_status_t allreduce(loom_model_t *m, float *buf, int64_t n, loom_err_t *err) {
    if (m->spec.tp_size == 1 || !m->opt.allreduce) return LOOM_OK;
    return m->opt.allreduce(m->opt.allreduce_ctx, buf, n, err);
}

/* Device pointers and sizes of one step's ops (see loom_model_forward). */
typedef struct step_ops {
    int n, nl, max_blocks, max_ctx;
    const int32_t *d_tok, *d_pos, *d_slots, *d_seq, *d_rows, *d_bt;
} step_ops_t;

/* The router of Transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock
 * for one token: softmax in float32 over all E logits, the k largest
 * probabilities (torch.topk; ties to the lower index), renormalised to sum 1
 * when norm (Mixtral always, Qwen3-MoE as norm_topk_prob says). */
/* A Mixture-of-Experts block: xb -> xb2, all-reduced. Every rank routes
 * every token (the router is replicated). Decode steps on a backend with
 * the device ops (loom_backend_moe_device) route, run the chosen experts (a
 * batched expert GEMV for gate/up and for down) and combine on the device.
 * Otherwise the router's logits come to the host (n x E floats), which
 * routes and groups the (token, choice) pairs by expert; the rows stay on
 * the device: they are gathered grouped, each held expert's group runs
 * through its MLP as one matmul (a GEMM, or GEMVs for a decode step's single
 * rows), and each token's outputs are summed, weighted, in ascending expert
 * order. */
static loom_status_t run_moe(loom_model_t *m, const loom_ffn_t *f, int n, loom_err_t *err) {
    loom_backend_t *be = m->be;
    const loom_model_config_t *c = &m->cfg;
    const int E = c->n_experts, K = c->n_experts_per_tok, dim = c->dim, H = m->moe_hn;
    const loom_act_t act = (loom_act_t)c->hidden_act;
    loom_op_matmul(be, m->rl, m->xb, &f->router, n);
    if (f->rbias) loom_op_add_bias(be, m->rl, f->rbias, n, E);
    if (f->t13 && n <= f->dev_n) {
        loom_op_moe_route(be, m->rl, n, E, K, c->norm_topk_prob, m->d_sel, m->d_w);
        loom_op_moe_gemv(be, m->mgu, m->xb, K, m->d_sel, n * K, f->t13,
                         f->e13[m->expert_begin].dtype, 2 * (int64_t)H, dim);
        loom_op_act_mul(be, act, m->mhb, m->mgu, n * K, H);
        loom_op_moe_gemv(be, m->xg, m->mhb, 1, m->d_sel, n * K, f->t2, f->e2[m->expert_begin].dtype,
                         dim, H);
        loom_op_moe_combine(be, m->xb2, m->xg, m->d_ident, m->d_w, n, K, dim, 0);
        return allreduce(m, m->xb2, (int64_t)n * dim, err);
    }
    loom_backend_download(be, m->h_probs, m->rl, (size_t)n * E * sizeof(float));
    for (int t = 0; t < n; t++) {
        float *p = m->h_probs + (size_t)t * E;
        loom_moe_route_row(p, E, K, c->norm_topk_prob, p, m->h_sel + (size_t)t * K,
                           m->h_w + (size_t)t * K);
    }
    /* group the (token, expert) pairs by expert: CSR offsets in h_cnt */
    memset(m->h_cnt, 0, (size_t)(E + 1) * sizeof(int32_t));
    for (int i = 0; i < n * K; i++) m->h_cnt[m->h_sel[i] + 1]++;
    for (int e = 0; e < E; e++) m->h_cnt[e + 1] += m->h_cnt[e];
    for (int t = 0; t < n; t++)
        for (int j = 0; j < K; j++) {
            int e = m->h_sel[(size_t)t * K + j];
            int at = m->h_cnt[e]++;
            m->h_rows[at] = t;
            m->h_rw[at] = m->h_w[(size_t)t * K + j];
        }
    for (int e = E; e > 0; e--) m->h_cnt[e] = m->h_cnt[e - 1]; /* back to begin offsets */
    m->h_cnt[0] = 0;
    /* each token's choices in ascending expert order: row of xg (from the
     * held experts' first) and weight; another rank's experts last, -1 */
    const int i0 = m->h_cnt[m->expert_begin], nl = m->h_cnt[m->expert_end] - i0;
    memset(m->h_fill, 0, (size_t)n * sizeof(int32_t));
    for (int i = i0; i < i0 + nl; i++) {
        int t = m->h_rows[i], at = t * K + m->h_fill[t]++;
        m->h_pos[at] = i - i0;
        m->h_pw[at] = m->h_rw[i];
    }
    for (int t = 0; t < n; t++)
        for (int j = m->h_fill[t]; j < K; j++) {
            m->h_pos[t * K + j] = -1;
            m->h_pw[t * K + j] = 0.0f;
        }
    if (nl > 0) {
        loom_backend_upload(be, m->d_rows, m->h_rows + i0, (size_t)nl * sizeof(int32_t));
        loom_op_gather_rows(be, m->xg, m->xb, m->d_rows, nl, dim);
        for (int e = m->expert_begin; e < m->expert_end; e++) {
            int b = m->h_cnt[e] - i0, g = m->h_cnt[e + 1] - m->h_cnt[e];
            if (g > 0)
                loom_op_matmul(be, m->mgu + (size_t)b * 2 * H, m->xg + (size_t)b * dim, &f->e13[e],
                               g);
            if (g > 0 && f->b13)
                loom_op_add_bias(be, m->mgu + (size_t)b * 2 * H, f->b13 + (size_t)e * 2 * H, g,
                                 2 * H);
        }
        if (c->gpt_oss)
            loom_op_swiglu_clamp(be, m->mhb, m->mgu, nl, H, c->swiglu_alpha, c->swiglu_limit);
        else
            loom_op_act_mul(be, act, m->mhb, m->mgu, nl, H);
        for (int e = m->expert_begin; e < m->expert_end;
             e++) { /* xg's rows are read: the outputs go there */
            int b = m->h_cnt[e] - i0, g = m->h_cnt[e + 1] - m->h_cnt[e];
            if (g > 0)
                loom_op_matmul(be, m->xg + (size_t)b * dim, m->mhb + (size_t)b * H, &f->e2[e], g);
            if (g > 0 && f->b2)
                loom_op_add_bias(be, m->xg + (size_t)b * dim, f->b2 + (size_t)e * dim, g, dim);
        }
    }
    loom_backend_upload(be, m->d_pos, m->h_pos, (size_t)n * K * sizeof(int32_t));
    loom_backend_upload(be, m->d_pw, m->h_pw, (size_t)n * K * sizeof(float));
    loom_op_moe_combine(be, m->xb2, m->xg, m->d_pos, m->d_pw, n, K, dim, 0);
    if (c->moe_shared_hidden) { /* Qwen2-MoE: + sigmoid(shared_gate . x) * shared_expert(x), this rank's slice */
        loom_op_matmul(be, m->sgl, m->xb, &f->sgate, n);
        loom_backend_download(be, m->h_sg, m->sgl, (size_t)n * sizeof(float));
        loom_op_matmul(be, m->gu, m->xb, &f->s13, n);
        loom_op_act_mul(be, act, m->hb, m->gu, n, m->shared_hn);
        loom_op_matmul(be, m->xg, m->hb, &f->s2, n);
        for (int t = 0; t < n; t++)
            m->h_sg[t] = 1.0f / (1.0f + expf(-m->h_sg[t]));
        loom_backend_upload(be, m->d_w, m->h_sg, (size_t)n * sizeof(float));
        loom_op_moe_combine(be, m->xb2, m->xg, m->d_ident, m->d_w, n, 1, dim, 1);
    }
    return allreduce(m, m->xb2, (int64_t)n * dim, err);
}

/* The feed-forward block: xb (normed input) -> xb2, all-reduced. */
static loom_status_t run_ffn(loom_model_t *m, const loom_ffn_t *f, int n, loom_err_t *err) {
    loom_backend_t *be = m->be;
    if (f->moe) return run_moe(m, f, n, err);
    loom_op_matmul(be, m->gu, m->xb, &f->w13, n);
    loom_op_act_mul(be, (loom_act_t)m->cfg.hidden_act, m->hb, m->gu, n, m->dims.hidden);
    loom_op_matmul(be, m->xb2, m->hb, &f->w2, n);
    return allreduce(m, m->xb2, (int64_t)n * m->cfg.dim, err);
}

/* Gemma 2's final_logit_softcapping on the first n_rows rows of logits:
 * element-wise, so each TP rank caps its own slice of the vocabulary, and
 * everything downstream (logprobs, logit processors, grammar masks,
 * sampling) reads the capped values. */
static void final_softcap(loom_model_t *m, int n_rows) {
    if (m->cfg.final_softcap > 0)
        loom_op_softcap(m->be, m->logits, (int64_t)n_rows * m->dims.vocab, m->cfg.final_softcap);
}

/* Issues the step's ops: embedding, the layers, and the LM head. */
static loom_status_t run_ops(loom_model_t *m, const step_ops_t *so, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    loom_backend_t *be = m->be;
    const int n = so->n, nl = so->nl, dim = c->dim, hd = c->head_dim;
    const int32_t *d_tok = so->d_tok, *d_pos = so->d_pos, *d_slots = so->d_slots;
    const int32_t *d_seq = so->d_seq, *d_rows = so->d_rows, *d_bt = so->d_bt;

    if (m->spec.has_embed) loom_op_embed(be, m->x, m->embed, d_tok, n, dim);

    /* Each residual add is fused with the norm that follows it (the MLP's,
     * or the next layer's attention norm); backends without the fused op
     * run the two plain ops. */
    int nh = d->n_heads, nkv = d->n_kv_heads, qd = m->qkv_dim;
    if (d->n_layers > 0) loom_op_rmsnorm(be, m->xb, m->x, m->layers[0].attn_norm, n, dim, c->norm_eps);
    for (int l = 0; l < d->n_layers; l++) {
        loom_layer_t *ly = &m->layers[l];
        /* attention: xb holds rmsnorm(x) * attn_norm */
        loom_op_matmul(be, m->qkv, m->xb, &ly->wqkv, n);
        if (ly->bqkv) loom_op_add_bias(be, m->qkv, ly->bqkv, n, qd);
        float *q = m->qkv, *k = m->qkv + nh * hd, *v = k + nkv * hd;
        if (ly->q_norm) {
            loom_op_head_rmsnorm(be, q, qd, n, nh, hd, ly->q_norm, c->norm_eps);
            loom_op_head_rmsnorm(be, k, qd, n, nkv, hd, ly->k_norm, c->norm_eps);
        }
        loom_op_rope_kv_write(be, q, k, v, qd, n, nh, nkv, hd, d_pos, ly->inv_freq, &ly->kv, d_slots);
        loom_attn_args_t a = {
            .n = n,
            .n_heads = nh,
            .n_kv_heads = nkv,
            .head_dim = hd,
            /* yarn and longrope scale q and k by their attention factor (with partial rotary
             * folded into the rotary rows at load); Gemma sets the scale */
            .scale = (c->rotary_dim < hd ? 1.0f : c->rope_attn_factor * c->rope_attn_factor) *
                     (c->query_scale > 0 ? c->query_scale : 1.0f / sqrtf((float)hd)),
            .q = q,
            .q_stride = qd,
            .out = m->att,
            .out_stride = nh * hd,
            .kv = ly->kv,
            .block_size = m->block_size,
            .tok_seq = d_seq,
            .tok_pos = d_pos,
            .block_tables = d_bt,
            .max_blocks = so->max_blocks,
            .max_ctx = so->max_ctx,
            .window = ly->window,
            .softcap = c->attn_softcap,
            .sinks = ly->sinks,
        };
        loom_op_attention(be, &a);
        loom_op_matmul(be, m->xb2, m->att, &ly->wo, n);
        if (ly->bo) loom_op_add_bias(be, m->xb2, ly->bo, n, dim);
        LOOM_CHECK(allreduce(m, m->xb2, (int64_t)n * dim, err));
        if (ly->post_attn_norm) loom_op_rmsnorm(be, m->xb2, m->xb2, ly->post_attn_norm, n, dim, c->norm_eps);
        loom_op_add_rmsnorm(be, m->x, m->xb2, m->xb, ly->ffn_norm, n, dim, c->norm_eps);
        LOOM_CHECK(run_ffn(m, &ly->ffn, n, err));
        if (ly->post_ffn_norm) loom_op_rmsnorm(be, m->xb2, m->xb2, ly->post_ffn_norm, n, dim, c->norm_eps);
        if (l + 1 < d->n_layers)
            loom_op_add_rmsnorm(be, m->x, m->xb2, m->xb, m->layers[l + 1].attn_norm, n, dim, c->norm_eps);
        else
            loom_op_add(be, m->x, m->xb2, (int64_t)n * dim);
    }
    if (nl > 0) {
        loom_op_gather_rows(be, m->xl, m->x, d_rows, nl, dim);
        loom_op_rmsnorm(be, m->xl, m->xl, m->final_norm, nl, dim, c->norm_eps);
        loom_op_matmul(be, m->logits, m->xl, &m->lm_head, nl);
        final_softcap(m, nl);
    }
    return LOOM_OK;
}

/* The batch-size bucket of a decode step of n sequences: 1, 2, 4, then
 * multiples of 8 (at most 7 padding rows, under 2x below 8). */
static int decode_bucket(int n) {
    if (n <= 4) return n <= 1 ? 1 : n <= 2 ? 2 : 4;
    return (n + 7) / 8 * 8;
}

loom_status_t loom_model_forward(loom_model_t *m, const loom_step_batch_t *b, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    loom_backend_t *be = m->be;
    int n = b->n_tokens;
    if (n < 1 || n > m->opt.max_tokens)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "step of %d tokens (limit %d)", n, m->opt.max_tokens);
    if (m->spec.has_head && (b->n_logits < 0 || b->n_logits > m->opt.max_logits))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%d logit rows (limit %d)", b->n_logits, m->opt.max_logits);
    if (!m->kv_mem) return loom_err_set(err, LOOM_ERR_INTERNAL, "KV pool not allocated");

    /* Validate ids against the pool so a bad plan cannot write out of bounds. */
    int max_pos = 0;
    for (int i = 0; i < n; i++) {
        if (b->pos[i] < 0 || b->pos[i] >= c->max_seq_len || b->tok_seq[i] < 0 || b->tok_seq[i] >= b->n_seqs ||
            b->slots[i] < 0 || b->slots[i] >= m->n_blocks * m->block_size ||
            (m->spec.has_embed && (b->tokens[i] < 0 || b->tokens[i] >= c->vocab_size)))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "step token %d is out of range", i);
        if (b->pos[i] / m->block_size >= b->max_blocks)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "position %d beyond the block table", b->pos[i]);
        if (b->pos[i] > max_pos) max_pos = b->pos[i];
    }
    size_t nbt = (size_t)b->n_seqs * (size_t)b->max_blocks;
    for (size_t i = 0; i < nbt; i++)
        if (b->block_tables[i] < -1 || b->block_tables[i] >= m->n_blocks)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "block id %d out of range", b->block_tables[i]);
    int nl = m->spec.has_head ? b->n_logits : 0;
    for (int i = 0; i < nl; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= n)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "logit row %d out of range", b->logit_rows[i]);

    /* Decode steps (one token per sequence) of a shard without TP all-reduces
     * are recorded once per shape as a graph on backends that have them, and
     * replayed (backend.h). The recorded ops bake in the token count, the
     * logit rows and the block-table stride, so those make the key. To keep
     * the number of shapes small, a decode step is padded up to its batch
     * bucket with rows that read and write only the scratch KV block (token
     * 0 at position 0 of a sequence of their own; their logits are computed
     * and never sampled), and the stride is padded to a power of two so that
     * growing sequences keep their graph. Everything else the ops read is
     * device data uploaded below, before the replay. */
    int decode = n == b->n_seqs;
    int graph = loom_backend_has_graphs(be) && decode && n < (1 << 20) &&
                !(m->spec.tp_size > 1 && m->opt.allreduce) &&
                /* run_moe routes on the host between ops, except decode steps on the device */
                (m->expert_end == 0 || decode_bucket(n) <= m->moe_device_n);
    int N = n; /* tokens after padding */
    if (m->scratch_block >= 0 && decode && (nl == 0 || nl == n) && (graph || m->opt.decode_buckets > 0)) {
        N = decode_bucket(n);
        int cap = m->opt.max_tokens;
        if (nl && m->opt.max_logits < cap) cap = m->opt.max_logits;
        if (N > cap) N = cap;
    }
    int pad = N - n, nlp = nl ? nl + pad : 0, n_seqs = b->n_seqs + (pad ? 1 : 0);
    m->last_pad = pad;
    int mb = b->max_blocks;
    if (graph) {
        mb = 16;
        while (mb < b->max_blocks) mb *= 2;
    }
    size_t nbt_packed = (size_t)n_seqs * (size_t)mb;

    /* Pack the step's metadata and upload it once. */
    size_t need = 4 * (size_t)N + (size_t)nlp + nbt_packed;
    if (need > m->meta_cap) {
        loom_backend_free(be, m->meta_dev);
        m->meta_cap = need + need / 2;
        m->meta_host = loom_xrealloc(m->meta_host, m->meta_cap * sizeof(int32_t));
        m->meta_dev = loom_backend_alloc(be, m->meta_cap * sizeof(int32_t));
        if (!m->meta_dev) return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for step metadata");
    }
    int32_t *h = m->meta_host;
    int32_t *h_pos = h + N, *h_slots = h + 2 * N, *h_seq = h + 3 * N, *h_rows = h + 4 * N, *h_bt = h_rows + nlp;
    if (m->spec.has_embed) memcpy(h, b->tokens, (size_t)n * 4);
    else memset(h, 0, (size_t)n * 4);
    memcpy(h_pos, b->pos, (size_t)n * 4);
    memcpy(h_slots, b->slots, (size_t)n * 4);
    memcpy(h_seq, b->tok_seq, (size_t)n * 4);
    if (nl) memcpy(h_rows, b->logit_rows, (size_t)nl * 4);
    for (int i = n; i < N; i++) {
        h[i] = 0;
        h_pos[i] = 0;
        h_slots[i] = m->scratch_block * m->block_size;
        h_seq[i] = b->n_seqs;
        if (nl) h_rows[nl + i - n] = i;
    }
    if (mb == b->max_blocks) {
        memcpy(h_bt, b->block_tables, nbt * 4);
    } else {
        for (int q = 0; q < b->n_seqs; q++) {
            int32_t *row = h_bt + (size_t)q * mb;
            memcpy(row, b->block_tables + (size_t)q * b->max_blocks, (size_t)b->max_blocks * 4);
            for (int j = b->max_blocks; j < mb; j++) row[j] = -1;
        }
    }
    if (pad) {
        int32_t *row = h_bt + (size_t)b->n_seqs * mb;
        row[0] = m->scratch_block;
        for (int j = 1; j < mb; j++) row[j] = -1;
        /* a later stage's padding rows hold whatever the buffer had: make them finite */
        if (!m->spec.has_embed)
            loom_backend_memset(be, m->x + (size_t)n * c->dim, 0, (size_t)pad * c->dim * sizeof(float));
    }
    loom_backend_upload(be, m->meta_dev, h, need * 4);
    const int32_t *d_tok = m->meta_dev;
    step_ops_t so = {.n = N, .nl = nlp, .max_blocks = mb, .max_ctx = max_pos + 1, .d_tok = d_tok,
                     .d_pos = d_tok + N, .d_slots = d_tok + 2 * N, .d_seq = d_tok + 3 * N,
                     .d_rows = d_tok + 4 * N, .d_bt = d_tok + 4 * N + nlp};
    if (!graph) return run_ops(m, &so, err);
    uint64_t key = (uint64_t)N | (uint64_t)nlp << 20;
    for (int lg = 0; (1 << lg) < mb; lg++) key += (uint64_t)1 << 40;
    key ^= ((uint64_t)(uintptr_t)m * 0x9e3779b97f4a7c15ull) & ~(((uint64_t)1 << 46) - 1);
    int replay = loom_backend_graph_begin(be, key);
    loom_status_t s = replay ? LOOM_OK : run_ops(m, &so, err);
    if (loom_backend_graph_end(be, key) && s == LOOM_OK) s = run_ops(m, &so, err); /* recording failed */
    return s;
}

int loom_model_last_pad(const loom_model_t *m) { return m->last_pad; }

void loom_model_sample_parts(loom_model_t *m, int n_rows, const loom_sampling_t *params,
                             const uint64_t *steps, loom_sample_part_t *parts) {
    LOOM_ASSERT(n_rows <= m->opt.max_logits);
    for (int i = 0; i < n_rows; i++) m->sample_k[i] = loom_sample_k(&params[i], m->cfg.vocab_size);
    loom_op_sample_shard(m->be, m->logits, n_rows, m->dims.vocab, m->dims.vocab_begin,
                         m->cfg.vocab_size, params, steps, m->sample_k, parts);
}

void loom_model_head_rows(loom_model_t *m, const int32_t *rows, int n_rows) {
    LOOM_ASSERT(m->spec.has_head && n_rows >= 0 && n_rows <= m->opt.max_logits);
    const int dim = m->cfg.dim;
    for (int i = 0; i < n_rows;) { /* runs of consecutive tokens, one copy each */
        int j = i + 1;
        while (j < n_rows && rows[j] == rows[j - 1] + 1) j++;
        loom_backend_copy(m->be, m->xl + (size_t)i * dim, m->x + (size_t)rows[i] * dim,
                          (size_t)(j - i) * dim * sizeof(float));
        i = j;
    }
    loom_op_rmsnorm(m->be, m->xl, m->xl, m->final_norm, n_rows, dim, m->cfg.norm_eps);
    loom_op_matmul(m->be, m->logits, m->xl, &m->lm_head, n_rows);
    final_softcap(m, n_rows);
}

int loom_model_max_logits(const loom_model_t *m) { return m->opt.max_logits; }

void loom_model_download_logits(loom_model_t *m, float *dst, int n_rows) {
    loom_backend_download(m->be, dst, m->logits, (size_t)n_rows * m->dims.vocab * sizeof(float));
}

void loom_model_pool_hidden(loom_model_t *m, int t0, int t1, float *out) {
    LOOM_ASSERT(m->spec.has_head && t0 >= 0 && t0 < t1 && t1 <= m->opt.max_tokens);
    const int dim = m->cfg.dim, cap = m->opt.max_logits;
    float *rows = loom_xmalloc((size_t)LOOM_MIN(cap, t1 - t0) * (size_t)dim * sizeof(float));
    memset(out, 0, (size_t)dim * sizeof(float));
    for (int t = t0; t < t1; t += cap) {
        int n = LOOM_MIN(cap, t1 - t);
        /* xl is free once the head has run: the rows are normed there as the head's input is */
        loom_backend_copy(m->be, m->xl, m->x + (size_t)t * dim, (size_t)n * dim * sizeof(float));
        loom_op_rmsnorm(m->be, m->xl, m->xl, m->final_norm, n, dim, m->cfg.norm_eps);
        loom_backend_download(m->be, rows, m->xl, (size_t)n * dim * sizeof(float));
        for (int i = 0; i < n; i++)
            for (int j = 0; j < dim; j++) out[j] += rows[(size_t)i * dim + j];
    }
    free(rows);
}
