/* GPT-OSS (gpt_oss): Llama's layer with q/k/v and o biases, a learned
 * attention sink per head, layers alternating sliding and full attention,
 * and every layer a Mixture of Experts whose router has a bias and whose
 * experts (3-D tensors, float or MXFP4, with biases) run through the
 * clamped SwiGLU. Its own loader for the experts; everything else is the
 * shared blocks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/engine/model_impl.h"

#define LIN LOOM_TN_LINEAR
#define TEN LOOM_TN_TENSOR

static const loom_tensor_name_t k_names[] = {
    {LOOM_TN_EMBED, "model.embed_tokens.weight", TEN, LOOM_TN_TOP},
    {LOOM_TN_FINAL_NORM, "model.norm.weight", TEN, LOOM_TN_TOP},
    {LOOM_TN_LM_HEAD, "lm_head", LIN, LOOM_TN_TOP},
    {LOOM_TN_ATTN_NORM, "input_layernorm.weight", TEN, 0},
    {LOOM_TN_FFN_NORM, "post_attention_layernorm.weight", TEN, 0},
    {LOOM_TN_Q, "self_attn.q_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_K, "self_attn.k_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_V, "self_attn.v_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_O, "self_attn.o_proj", LIN, 0},
    {LOOM_TN_Q_BIAS, "self_attn.q_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_K_BIAS, "self_attn.k_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_V_BIAS, "self_attn.v_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_O_BIAS, "self_attn.o_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_SINKS, "self_attn.sinks", TEN, 0},
    {LOOM_TN_GATE, "mlp.gate_proj", LIN, LOOM_TN_DENSE},
    {LOOM_TN_UP, "mlp.up_proj", LIN, LOOM_TN_DENSE},
    {LOOM_TN_DOWN, "mlp.down_proj", LIN, LOOM_TN_DENSE},
    {LOOM_TN_ROUTER, "mlp.router.weight", TEN, LOOM_TN_MOE},
    {LOOM_TN_ROUTER_BIAS, "mlp.router.bias", TEN, LOOM_TN_MOE},
    {LOOM_TN_EXPERTS_GATE_UP_BIAS, "mlp.experts.gate_up_proj_bias", TEN, LOOM_TN_MOE},
    {LOOM_TN_EXPERTS_DOWN_BIAS, "mlp.experts.down_proj_bias", TEN, LOOM_TN_MOE},
    {LOOM_TN_EXPERTS_GATE_UP, "mlp.experts.gate_up_proj", TEN, LOOM_TN_MOE | LOOM_TN_FLOAT},
    {LOOM_TN_EXPERTS_DOWN, "mlp.experts.down_proj", TEN, LOOM_TN_MOE | LOOM_TN_FLOAT},
    {LOOM_TN_EXPERTS_GATE_UP_BLOCKS, "mlp.experts.gate_up_proj_blocks", TEN, LOOM_TN_MOE | LOOM_TN_MXFP4},
    {LOOM_TN_EXPERTS_GATE_UP_SCALES, "mlp.experts.gate_up_proj_scales", TEN, LOOM_TN_MOE | LOOM_TN_MXFP4},
    {LOOM_TN_EXPERTS_DOWN_BLOCKS, "mlp.experts.down_proj_blocks", TEN, LOOM_TN_MOE | LOOM_TN_MXFP4},
    {LOOM_TN_EXPERTS_DOWN_SCALES, "mlp.experts.down_proj_scales", TEN, LOOM_TN_MOE | LOOM_TN_MXFP4},
};

static const loom_arch_type_t k_types[] = {
    {"gpt_oss", LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ATTN_SINKS | LOOM_CAP_SWIGLU_CLAMP | LOOM_CAP_MOE, LOOM_CAP_ACT},
    {NULL, 0, 0},
};

static uint32_t oss_needs(const loom_model_config_t *c, const loom_shard_spec_t *spec) {
    uint32_t need = loom_arch_needs_common(c, spec);
    if (spec->layer_end > spec->layer_begin) need |= LOOM_CAP_ATTN_SINKS | LOOM_CAP_SWIGLU_CLAMP;
    return need;
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
 * slice -- and take the float path of loom_load_linear (quantized on load when
 * asked), so TP slicing, expert parallelism and --quantization work as for
 * the other families. */

static const float k_e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Rows [r0, r0+nr) of expert e's (rows, cols) MXFP4 matrix `base` as floats
 * (nr, cols) in dst. */
static loom_status_t read_mxfp4_rows(loom_loader_t *L, const char *base, int E, int64_t rows,
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

/* The name of a 3-D expert tensor (role, float checkpoints), or the base
 * of its MXFP4 pair (<base>_blocks, <base>_scales: the blocks role's name
 * without "_blocks"). */
static const char *oss_name(loom_loader_t *L, int gl, loom_tn_role_t role, loom_tn_role_t blocks, char *buf,
                            size_t size) {
    if (L->m->cfg.ckpt_quant != LOOM_CKPT_MXFP4) return loom_load_name(L, gl, role, -1, buf, size);
    loom_load_name(L, gl, blocks, -1, buf, size);
    size_t n = strlen(buf);
    LOOM_ASSERT(n > 7 && !strcmp(buf + n - 7, "_blocks"));
    buf[n - 7] = 0;
    return buf;
}

/* Expert e's gate/up rows (2*hn, dim) of the slice [hb, hb+hn): gate rows
 * then up rows, in the staging buffer. */
static loom_status_t oss_gate_up(loom_loader_t *L, int gl, int e, int hb, int hn, loom_err_t *err) {
    const loom_model_config_t *c = &L->m->cfg;
    const int E = c->n_experts, dim = c->dim, I = c->moe_hidden_dim;
    char name[300];
    float *h = loom_load_staging(L, (size_t)2 * hn * dim);
    if (!h)
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d's experts",
                            gl);
    float *t = loom_xmalloc((size_t)2 * hn * dim * sizeof(float));
    loom_status_t s;
    oss_name(L, gl, LOOM_TN_EXPERTS_GATE_UP, LOOM_TN_EXPERTS_GATE_UP_BLOCKS, name, sizeof name);
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
    return s == LOOM_OK ? loom_load_check_finite(h, (size_t)2 * hn * dim, name, NULL, err) : s;
}

/* Expert e's down rows (dim, fc->rnc): its input columns [rc0, rc0+rnc) of
 * I, in the staging buffer. */
static loom_status_t oss_down(loom_loader_t *L, int gl, int e, const loom_float_cols_t *fc, loom_err_t *err) {
    const loom_model_config_t *c = &L->m->cfg;
    const int E = c->n_experts, dim = c->dim, I = c->moe_hidden_dim;
    char name[300];
    oss_name(L, gl, LOOM_TN_EXPERTS_DOWN, LOOM_TN_EXPERTS_DOWN_BLOCKS, name, sizeof name);
    const int64_t rnc = fc->rnc, full = c->ckpt_quant == LOOM_CKPT_MXFP4 ? I : rnc;
    float *h = loom_load_staging(L, (size_t)(dim * rnc));
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
    return s == LOOM_OK ? loom_load_check_finite(h, (size_t)(dim * rnc), name, NULL, err) : s;
}

static loom_status_t oss_load_moe(loom_loader_t *L, int gl, loom_ffn_t *f, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const int E = c->n_experts, dim = c->dim, I = c->moe_hidden_dim, hb = m->moe_hb, hn = m->moe_hn;
    char name[256], what[256];
    f->moe = 1;
    f->swiglu_clamp = 1;
    loom_load_name(L, gl, LOOM_TN_ROUTER, -1, name, sizeof name);
    float *h = loom_load_staging(L, (size_t)E * dim);
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading %s", name);
    LOOM_CHECK(loom_load_read_block(L, name, E, dim, 0, E, 0, dim, h, err));
    LOOM_CHECK(loom_load_upload_weight(L, &f->router, E, dim, name, err));
    loom_load_name(L, gl, LOOM_TN_ROUTER_BIAS, -1, name, sizeof name);
    LOOM_CHECK(loom_load_read_slice(L, name, E, 0, E, h, err));
    LOOM_CHECK(loom_load_upload_host(L, h, (size_t)E, &f->rbias, name, err));
    /* the biases of the held experts' rows, gate then up as the weights */
    float *b13 = loom_xcalloc((size_t)E * 2 * hn, sizeof(float)),
          *b2 = loom_xcalloc((size_t)E * dim, sizeof(float));
    float *row = loom_xmalloc((size_t)LOOM_MAX(2 * hn, dim) * sizeof(float));
    loom_status_t s = LOOM_OK;
    for (int j = m->expert_begin; j < m->expert_end && s == LOOM_OK; j++) {
        loom_load_name(L, gl, LOOM_TN_EXPERTS_GATE_UP_BIAS, -1, name, sizeof name);
        s = loom_load_read_block(L, name, E, 2 * (int64_t)I, j, 1, 2 * (int64_t)hb, 2 * (int64_t)hn, row,
                       err);
        for (int i = 0; s == LOOM_OK && i < 2 * hn; i++)
            b13[(size_t)j * 2 * hn + (size_t)((i & 1) * hn + i / 2)] = row[i];
        if (s == LOOM_OK) {
            loom_load_name(L, gl, LOOM_TN_EXPERTS_DOWN_BIAS, -1, name, sizeof name);
            s = loom_load_read_block(L, name, E, dim, j, 1, 0, dim, b2 + (size_t)j * dim, err);
        }
    }
    free(row);
    if (s == LOOM_OK)
        s = loom_load_upload_host(L, b13, (size_t)E * 2 * hn, &f->b13, "the experts' gate/up biases", err);
    if (s == LOOM_OK && hb == 0)
        s = loom_load_upload_host(L, b2, (size_t)E * dim, &f->b2, "the experts' down biases", err);
    free(b13);
    free(b2);
    LOOM_CHECK(s);
    f->e13 = loom_xcalloc((size_t)E, sizeof *f->e13);
    f->e2 = loom_xcalloc((size_t)E, sizeof *f->e2);
    for (int j = m->expert_begin; j < m->expert_end; j++) {
        loom_float_cols_t fc;
        snprintf(what, sizeof what, "model.layers.%d.mlp.experts.%d.gate_up", gl, j);
        LOOM_CHECK(loom_load_float_cols(L, what, dim, 0, dim, &fc, err));
        LOOM_CHECK(oss_gate_up(L, gl, j, hb, hn, err));
        LOOM_CHECK(loom_load_upload_float_linear(L, &f->e13[j], what, &fc, 2 * (int64_t)hn, err));
        snprintf(what, sizeof what, "model.layers.%d.mlp.experts.%d.down", gl, j);
        LOOM_CHECK(loom_load_float_cols(L, what, I, hb, hn, &fc, err));
        LOOM_CHECK(oss_down(L, gl, j, &fc, err));
        LOOM_CHECK(loom_load_upload_float_linear(L, &f->e2[j], what, &fc, dim, err));
        m->expert_bytes += loom_weight_bytes(&f->e13[j]) + loom_weight_bytes(&f->e2[j]);
    }
    return LOOM_OK;
}

static loom_status_t oss_load_layer(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    const int dim = c->dim;
    char name[256];
#define TNAME(role) loom_load_name(L, gl, role, -1, name, sizeof name)
    LOOM_CHECK(loom_blk_prenorm_load_norms(L, gl, ly, err));
    LOOM_CHECK(loom_blk_attn_load(L, gl, ly, err));
    /* this rank's heads' sinks; o_proj's bias where the partial sums get it once */
    float *h = loom_load_staging(L, (size_t)LOOM_MAX(d->n_heads, dim));
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    LOOM_CHECK(loom_load_read_slice(L, TNAME(LOOM_TN_SINKS), c->n_heads, d->q_head_begin, d->n_heads, h, err));
    LOOM_CHECK(loom_load_upload_host(L, h, (size_t)d->n_heads, &ly->sinks, name, err));
    if (c->attention_bias && m->spec.tp_rank == 0) {
        LOOM_CHECK(loom_load_read_slice(L, TNAME(LOOM_TN_O_BIAS), dim, 0, dim, h, err));
        LOOM_CHECK(loom_load_upload_host(L, h, (size_t)dim, &ly->bo, name, err));
    }
#undef TNAME
    if (loom_model_config_layer_moe(c, gl)) return oss_load_moe(L, gl, &ly->ffn, err);
    return loom_blk_ffn_load(L, gl, &ly->ffn, err);
}

static loom_status_t oss_layer(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    return loom_blk_prenorm_layer(m, so, l, loom_blk_attn, err);
}

const loom_arch_t loom_arch_gpt_oss = {
    .name = "gpt_oss",
    .types = k_types,
    .names = k_names,
    .n_names = (int)LOOM_ARRAY_LEN(k_names),
    .needs = oss_needs,
    .load_layer = oss_load_layer,
    .layer = oss_layer,
};
