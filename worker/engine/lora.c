/* LoRA adapters in the engine: max_loras slots of rank <= max_lora_rank
 * sized at load, the host-side preparation that cuts an adapter into this
 * shard's layout, the install into a slot, and the delta each projection
 * adds for the rows of each adapter (called by loom_blk_linear only).
 *
 * The layout mirrors load_linear exactly:
 *   column-parallel (q, k, v, gate, up): A whole, B's rows those W keeps on
 *     this rank (its heads, replicated KV heads included, or its slice of
 *     the intermediate size); q and k rows take the partial-rotary
 *     permutation and attention factor the loader applies to W's rows;
 *   row-parallel (o, down): A's columns those W keeps, B whole; the partial
 *     deltas meet in the projection's all-reduce like W's partial sums.
 * Stored as A (r, in) and Bt (r, out), the kernel's layout. Only the
 * adapter's struct (common/lora.h) is read here, not its reader, so the
 * engine links without it (tests/gpu's standalone build). */
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/engine/model_impl.h"

static const char *const k_target[LOOM_LORA_N_TARGETS] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"};

/* The adapted module of global layer gl and target t, or NULL. */
static const loom_lora_module_t *module_of(const loom_lora_adapter_t *a, int gl, int t) {
    if (gl < a->layer_begin || gl >= a->layer_end || gl >= a->n_layers) return NULL;
    const loom_lora_module_t *m = &a->mod[(size_t)gl * LOOM_LORA_N_TARGETS + (size_t)t];
    return m->r > 0 ? m : NULL;
}

struct loom_lora_prepared {
    int n_layers;             /* the shard's */
    loom_lora_op_slot_t *mod; /* (n_layers, LOOM_LORA_N_TARGETS): host A and Bt */
    size_t bytes;
};

/* This shard's input columns and output rows of target t (shapes of W's slice). */
static void target_dims(const loom_model_t *m, int l, int t, int64_t *in, int64_t *out) {
    const loom_shard_dims_t *d = &m->dims;
    const int64_t hd = m->cfg.head_dim, dim = m->cfg.dim;
    int ffn = !m->layers[l].ffn.moe;
    switch (t) {
    case LOOM_LORA_Q: *in = dim, *out = d->n_heads * hd; break;
    case LOOM_LORA_K:
    case LOOM_LORA_V: *in = dim, *out = d->n_kv_heads * hd; break;
    case LOOM_LORA_O: *in = d->n_heads * hd, *out = dim; break;
    case LOOM_LORA_GATE:
    case LOOM_LORA_UP: *in = ffn ? dim : 0, *out = ffn ? d->hidden : 0; break;
    default: *in = ffn ? d->hidden : 0, *out = ffn ? dim : 0; break;
    }
}

loom_status_t loom_model_lora_alloc(loom_model_t *m, loom_err_t *err) {
    if (m->opt.max_loras <= 0) return LOOM_OK;
    if (!loom_backend_has_lora(m->be))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "the %s backend has no LoRA op: adapters run on the cpu backend",
                            loom_backend_name(m->be));
    if (m->opt.max_loras > LOOM_LORA_MAX_SLOTS)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "max_loras %d: at most %d adapter slots",
                            m->opt.max_loras, LOOM_LORA_MAX_SLOTS);
    if (m->opt.max_lora_rank <= 0) m->opt.max_lora_rank = 16;
    const int S = m->opt.max_loras, R = m->opt.max_lora_rank, L = m->dims.n_layers;
    size_t per_slot = 0;
    for (int l = 0; l < L; l++)
        for (int t = 0; t < LOOM_LORA_N_TARGETS; t++) {
            int64_t in, out;
            target_dims(m, l, t, &in, &out);
            per_slot += (size_t)R * (size_t)(in + out);
        }
    m->lora_tab = loom_xcalloc((size_t)L * LOOM_LORA_N_TARGETS * (size_t)S, sizeof *m->lora_tab);
    m->lora_mem = loom_xcalloc((size_t)S, sizeof *m->lora_mem);
    for (int s = 0; s < S; s++) {
        m->lora_mem[s] = loom_backend_alloc(m->be, per_slot * sizeof(float));
        if (!m->lora_mem[s] && per_slot)
            return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for %d LoRA slots of rank %d", S, R);
        float *p = m->lora_mem[s];
        for (int l = 0; l < L; l++)
            for (int t = 0; t < LOOM_LORA_N_TARGETS; t++) {
                int64_t in, out;
                target_dims(m, l, t, &in, &out);
                loom_lora_op_slot_t *e = &m->lora_tab[((size_t)l * LOOM_LORA_N_TARGETS + (size_t)t) * (size_t)S + (size_t)s];
                e->a = p;
                e->bt = p + (size_t)R * (size_t)in;
                p += (size_t)R * (size_t)(in + out);
            }
    }
    m->weight_bytes += (size_t)S * per_slot * sizeof(float);
    return LOOM_OK;
}

void loom_model_lora_free(loom_model_t *m) {
    for (int s = 0; m->lora_mem && s < m->opt.max_loras; s++) loom_backend_free(m->be, m->lora_mem[s]);
    free(m->lora_mem);
    free(m->lora_tab);
    m->lora_mem = NULL;
    m->lora_tab = NULL;
}

int loom_model_max_loras(const loom_model_t *m) { return m->opt.max_loras > 0 ? m->opt.max_loras : 0; }

loom_status_t loom_model_lora_prepare(const loom_model_t *m, const loom_lora_adapter_t *a, loom_lora_prepared_t **out,
                                      loom_err_t *err) {
    *out = NULL;
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    const int L = d->n_layers, hd = c->head_dim, R = m->opt.max_lora_rank > 0 ? m->opt.max_lora_rank : 16;
    if (a->n_layers != c->n_layers)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the adapter is for %d layers, the model has %d",
                            a->n_layers, c->n_layers);
    if (a->layer_begin > m->spec.layer_begin || a->layer_end < m->spec.layer_end)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "the adapter holds layers [%d, %d), this shard runs [%d, %d)",
                            a->layer_begin, a->layer_end, m->spec.layer_begin, m->spec.layer_end);
    loom_lora_prepared_t *p = loom_xcalloc(1, sizeof *p);
    p->n_layers = L;
    p->mod = loom_xcalloc((size_t)L * LOOM_LORA_N_TARGETS, sizeof *p->mod);
    for (int l = 0; l < L; l++) {
        int gl = m->spec.layer_begin + l;
        for (int t = 0; t < LOOM_LORA_N_TARGETS; t++) {
            const loom_lora_module_t *mod = module_of(a, gl, t);
            if (!mod) continue;
            int64_t in, nout;
            target_dims(m, l, t, &in, &nout);
            if (mod->r > R) {
                loom_lora_prepared_destroy(&p);
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                    "layer %d %s: rank %d is greater than max_lora_rank %d", gl,
                                    k_target[t], mod->r, R);
            }
            if (in == 0) {
                loom_lora_prepared_destroy(&p);
                return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "layer %d %s: adapters on MoE experts are not supported",
                                    gl, k_target[t]);
            }
            int64_t row0 = 0, col0 = 0;
            switch (t) {
            case LOOM_LORA_Q: row0 = (int64_t)d->q_head_begin * hd; break;
            case LOOM_LORA_K:
            case LOOM_LORA_V: row0 = (int64_t)d->kv_head_begin * hd; break;
            case LOOM_LORA_O: col0 = (int64_t)d->q_head_begin * hd; break;
            case LOOM_LORA_GATE:
            case LOOM_LORA_UP: row0 = d->hidden_begin; break;
            default: col0 = d->hidden_begin; break;
            }
            const int r = mod->r;
            float *av = loom_xmalloc((size_t)r * (size_t)in * sizeof(float));
            float *b = loom_xmalloc((size_t)nout * (size_t)r * sizeof(float));
            float *bt = loom_xmalloc((size_t)r * (size_t)nout * sizeof(float));
            LOOM_ASSERT(col0 + in <= mod->in && row0 + nout <= mod->out); /* the reader checked the shapes */
            for (int k = 0; k < r; k++)
                memcpy(av + (size_t)k * (size_t)in, mod->a + (size_t)k * (size_t)mod->in + (size_t)col0,
                       (size_t)in * sizeof(float));
            memcpy(b, mod->b + (size_t)row0 * (size_t)r, (size_t)nout * (size_t)r * sizeof(float));
            /* q and k rows as the loader stores W's: partial rotary's slots and factor */
            if ((t == LOOM_LORA_Q || t == LOOM_LORA_K) && c->rotary_dim > 0 && c->rotary_dim < hd)
                loom_load_rotary_permute_f32(b, nout, r, hd, c->rotary_dim, c->rope_attn_factor);
            for (int64_t o = 0; o < nout; o++)
                for (int k = 0; k < r; k++) bt[(size_t)k * (size_t)nout + (size_t)o] = b[(size_t)o * (size_t)r + (size_t)k];
            free(b);
            p->mod[(size_t)l * LOOM_LORA_N_TARGETS + (size_t)t] =
                (loom_lora_op_slot_t){.a = av, .bt = bt, .r = r, .scale = mod->scale};
            p->bytes += (size_t)r * (size_t)(in + nout) * sizeof(float);
        }
    }
    *out = p;
    return LOOM_OK;
}

void loom_lora_prepared_destroy(loom_lora_prepared_t **p_p) {
    if (!p_p || !*p_p) return;
    loom_lora_prepared_t *p = *p_p;
    *p_p = NULL;
    for (size_t i = 0; i < (size_t)p->n_layers * LOOM_LORA_N_TARGETS; i++) {
        free((void *)p->mod[i].a);
        free((void *)p->mod[i].bt);
    }
    free(p->mod);
    free(p);
}

size_t loom_lora_prepared_bytes(const loom_lora_prepared_t *p) { return p->bytes; }

loom_status_t loom_model_lora_install(loom_model_t *m, int slot, const loom_lora_prepared_t *p, loom_err_t *err) {
    const int S = loom_model_max_loras(m);
    if (slot < 0 || slot >= S)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "adapter slot %d out of range (max_loras %d)", slot, S);
    if (p->n_layers != m->dims.n_layers)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "adapter prepared for %d layers, the shard has %d", p->n_layers,
                            m->dims.n_layers);
    for (int l = 0; l < m->dims.n_layers; l++)
        for (int t = 0; t < LOOM_LORA_N_TARGETS; t++) {
            const loom_lora_op_slot_t *src = &p->mod[(size_t)l * LOOM_LORA_N_TARGETS + (size_t)t];
            loom_lora_op_slot_t *e = &m->lora_tab[((size_t)l * LOOM_LORA_N_TARGETS + (size_t)t) * (size_t)S + (size_t)slot];
            int64_t in, out;
            target_dims(m, l, t, &in, &out);
            if (src->r > 0) {
                loom_backend_upload(m->be, (float *)e->a, src->a, (size_t)src->r * (size_t)in * sizeof(float));
                loom_backend_upload(m->be, (float *)e->bt, src->bt, (size_t)src->r * (size_t)out * sizeof(float));
            }
            e->r = src->r;
            e->scale = src->scale;
        }
    return LOOM_OK;
}

void loom_model_lora_clear(loom_model_t *m, int slot) {
    const int S = loom_model_max_loras(m);
    if (slot < 0 || slot >= S) return;
    for (size_t i = 0; i < (size_t)m->dims.n_layers * LOOM_LORA_N_TARGETS; i++) m->lora_tab[i * (size_t)S + (size_t)slot].r = 0;
}

/* The targets of a projection and where each one's output columns sit in y. */
void loom_blk_lora(loom_model_t *m, const loom_blk_adapters_t *ad, const loom_blk_linear_t *lin, float *y,
                   const float *x, int n) {
    int t0, nt;
    switch (lin->proj) {
    case LOOM_PROJ_QKV: t0 = LOOM_LORA_Q, nt = 3; break;
    case LOOM_PROJ_O: t0 = LOOM_LORA_O, nt = 1; break;
    case LOOM_PROJ_GATE_UP: t0 = LOOM_LORA_GATE, nt = 2; break;
    case LOOM_PROJ_DOWN: t0 = LOOM_LORA_DOWN, nt = 1; break;
    default: return; /* the router, experts, the shared expert and the head are never adapted */
    }
    if (lin->layer < 0 || lin->expert >= 0) return;
    const int S = m->opt.max_loras;
    const int64_t ldy = lin->w->rows, ldx = lin->w->cols;
    int64_t off = 0;
    for (int t = t0; t < t0 + nt; t++) {
        int64_t in, out;
        target_dims(m, lin->layer, t, &in, &out);
        const loom_lora_op_slot_t *tab = &m->lora_tab[((size_t)lin->layer * LOOM_LORA_N_TARGETS + (size_t)t) * (size_t)S];
        LOOM_ASSERT(in == ldx && off + out <= ldy);
        loom_op_lora(m->be, y + off, ldy, x, ldx, n, in, out, ad->d_row_slot, tab, S, m->opt.max_lora_rank);
        off += out;
    }
}
