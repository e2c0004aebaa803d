/* The shard: loading one grid cell's weights (the family's layers through
 * its table in worker/arch/, the shared blocks in worker/engine/), the
 * activations, and one batched step through the shard's layers (see
 * model.h). Which family runs is the config's model_type (loom_arch_find). */
#include "worker/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/model_config_deepseek.h"
#include "common/progress.h"
#include "common/util.h"
#include "common/weights_check.h"
#include "worker/engine/model_impl.h"
#include "worker/qweights.h"

static void *act_alloc(loom_model_t *m, size_t n, int *fail) {
    void *p = loom_backend_alloc(m->be, n * sizeof(float));
    if (!p) *fail = 1;
    return p;
}


/* The one capability check: what this config of the family needs on this
 * shard (its layers, its head) and the KV cache it asks for, against what
 * the backend declares; the refusal names every missing capability and
 * why the config needs it. */
static loom_status_t check_caps(loom_backend_t *be, const loom_arch_t *arch, const loom_model_config_t *cfg,
                                const loom_shard_spec_t *spec, const loom_model_options_t *opt, loom_err_t *err) {
    uint32_t need = arch->needs(cfg, spec) | loom_cap_kv(opt->kv_dtype);
    uint32_t missing = need & ~loom_backend_caps(be);
    if (!missing) return LOOM_OK;
    char msg[512], detail[128];
    size_t off = 0;
    for (int i = 0; i < LOOM_CAP_COUNT; i++) {
        uint32_t cap = 1u << i;
        if (!(missing & cap)) continue;
        loom_arch_need_detail(cfg, spec, cap, detail, sizeof detail);
        int w = snprintf(msg + off, sizeof msg - off, "%s%s%s%s%s", off ? ", " : "", loom_cap_name(cap),
                         detail[0] ? " (" : "", detail, detail[0] ? ")" : "");
        if (w < 0 || (size_t)w >= sizeof msg - off) break;
        off += (size_t)w;
    }
    return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "the %s backend cannot run %s: it lacks %s", loom_backend_name(be),
                        cfg->model_type, msg);
}

/* opt.mtp: the shard must be MTP module 0 with the embedding and head (on
 * a TP rank: the layer's slice, the whole embedding and eh_proj, the head's
 * vocabulary slice); its config counts the module as one more layer, so
 * that the layer loads, caches and runs as any other. */
static loom_status_t mtp_config(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                                loom_model_config_t *out, loom_err_t *err) {
    if (!cfg->deepseek || cfg->n_nextn_layers < 1)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "an MTP draft needs a DeepSeek checkpoint with num_nextn_predict_layers >= 1 "
                            "(model_type '%s' has %d)", cfg->model_type, cfg->n_nextn_layers);
    if (spec->layer_begin != cfg->n_layers || spec->layer_end != cfg->n_layers + 1 || !spec->has_embed ||
        !spec->has_head)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "an MTP draft is layer %d with the embedding and head", cfg->n_layers);
    *out = *cfg;
    out->n_layers += cfg->n_nextn_layers;
    return LOOM_OK;
}

/* opt.mtp: enorm, hnorm and eh_proj's two halves (columns [0, dim) read
 * the embedding, [dim, 2 dim) the hidden state). */
static loom_status_t mtp_load(loom_loader_t *L, loom_err_t *err) {
    loom_model_t *m = L->m;
    const int dim = m->cfg.dim, gl = m->spec.layer_begin;
    char name[160], eh[160];
    snprintf(name, sizeof name, "model.layers.%d.enorm.weight", gl);
    LOOM_CHECK(loom_load_upload_norm(L, name, dim, &m->mtp_enorm, err));
    snprintf(name, sizeof name, "model.layers.%d.hnorm.weight", gl);
    LOOM_CHECK(loom_load_upload_norm(L, name, dim, &m->mtp_hnorm, err));
    snprintf(eh, sizeof eh, "model.layers.%d.eh_proj", gl);
    loom_lin_part_t part = {eh, dim, 0, dim};
    LOOM_CHECK(loom_load_linear(L, &m->mtp_eh_e, "eh_proj", &part, 1, 2 * (int64_t)dim, 0, dim, err));
    return loom_load_linear(L, &m->mtp_eh_h, "eh_proj", &part, 1, 2 * (int64_t)dim, dim, dim, err);
}

loom_status_t loom_model_load(loom_backend_t *be, const loom_model_config_t *cfg_in, loom_st_t *st,
                              const loom_shard_spec_t *spec, const loom_model_options_t *opt,
                              loom_model_t **out, loom_err_t *err) {
    *out = NULL;
    const loom_model_config_t *cfg = cfg_in;
    loom_model_config_t mtp_cfg;
    if (opt->mtp) {
        LOOM_CHECK(mtp_config(cfg_in, spec, &mtp_cfg, err));
        cfg = &mtp_cfg;
    }
    if (cfg->head_dim % 2 != 0)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "head_dim %d is odd; RoPE needs pairs", cfg->head_dim);
    const loom_arch_t *arch = loom_arch_find(cfg->model_type);
    if (!arch)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "no model family serves model_type '%s'", cfg->model_type);
    LOOM_CHECK(check_caps(be, arch, cfg, spec, opt, err));
    if (cfg->deepseek) /* the router's bias, the FP8 scale grids */
        LOOM_CHECK(loom_deepseek_check_checkpoint(cfg_in, st, err));
    const int mla_mha = opt->mla_disable && cfg->deepseek; /* decompressed MLA (attn_mla_mha.c) */
    if (mla_mha) {
        const char *no = !loom_backend_kv_v_dim(be)                  ? "the %s backend (V heads narrower than K's)"
                         : spec->dp_attention && spec->tp_size > 1 ? "data-parallel attention (%s)"
                         : opt->mtp                                 ? "the MTP module (%s)"
                         : opt->max_loras > 0                       ? "LoRA adapters (%s)"
                         : (cfg->qk_nope_head_dim + cfg->qk_rope_head_dim) % 2 ? "an odd qk head dim (%s)"
                         /* CUDA's kernels for V rows of their own width stop at 256 (docs/cuda.md) */
                         : loom_backend_kind(be) == LOOM_DEVICE_CUDA &&
                                 (cfg->qk_nope_head_dim + cfg->qk_rope_head_dim > 256 || cfg->v_head_dim > 256)
                             ? "K or V heads wider than 256 on %s"
                             : NULL;
        if (no) {
            char what[128];
            snprintf(what, sizeof what, no, loom_backend_name(be));
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "decompressed MLA (--disable-mla) is not implemented for %s",
                                what);
        }
    }
    LOOM_CHECK(loom_model_check_checkpoint(cfg_in, st, err));
    if (cfg->rope_ctx_capped)
        LOOM_WARN("longrope: serving %d positions (original_max_position_embeddings), where the short factors "
                  "apply; the long factors beyond are not supported",
                  cfg->max_seq_len);
    loom_model_t *m = loom_xcalloc(1, sizeof *m);
    m->be = be;
    m->arch = arch;
    m->cfg = *cfg;
    if (!(m->cfg.rope_attn_factor > 0)) m->cfg.rope_attn_factor = 1.0f; /* a config not from the parser */
    if (m->cfg.rotary_dim <= 0 || m->cfg.rotary_dim > cfg->head_dim) m->cfg.rotary_dim = cfg->head_dim;
    m->spec = *spec;
    m->opt = *opt;
    m->opt.mla_disable = mla_mha;
    m->opt.mla_prefill_rows = loom_blk_attn_mla_prefill_rows(m, opt);
    if (mla_mha) m->cfg.head_dim = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim; /* K's heads, q's */
    m->scratch_block = -1;
    if (m->opt.max_tokens < 1) m->opt.max_tokens = 512;
    if (m->opt.max_seqs < 1) m->opt.max_seqs = 1;
    if (m->opt.max_logits < 1) m->opt.max_logits = m->opt.max_seqs;
    loom_status_t s = loom_shard_dims(cfg, spec, &m->dims, err);
    if (s < 0) goto fail;
    if (mla_mha) { /* per-head K and V: this rank's heads, not the replicated latent */
        m->dims.n_kv_heads = m->dims.n_heads;
        m->dims.kv_head_begin = m->dims.q_head_begin;
        LOOM_INFO("MLA decompressed: %d heads of K (%d) and V (%d) values a token and layer in the cache, "
                  "where the latent row is %d", m->dims.n_heads, m->cfg.head_dim, cfg->v_head_dim,
                  cfg->kv_lora_rank + cfg->qk_rope_head_dim);
    }
    if (spec->dp_attention && spec->tp_size > 1) {
        /* attn_dp.c runs the MLA block; the other families' TP-only parts (o_proj's bias on rank 0, a GQA
         * pool sliced by heads) were not made per-sequence */
        const char *no = !cfg->deepseek                          ? "a model other than DeepSeek's MLA"
                         : opt->mtp                              ? "the MTP module"
                         : opt->max_loras > 0                    ? "LoRA adapters"
                         : strcmp(loom_backend_name(be), "cpu") ? "a backend other than cpu"
                                                                 : NULL;
        if (no) {
            s = loom_err_set(err, LOOM_ERR_UNSUPPORTED, "data-parallel attention does not run %s (%s, %s backend)",
                             no, cfg->model_type, loom_backend_name(be));
            goto fail;
        }
        m->opt.expert_parallel = 1; /* the MoE layers: dispatch and combine over the TP all-reduce */
    }
    s = loom_load_align_hidden_split(cfg, spec, opt, &m->dims, err);
    if (s < 0) goto fail;
    s = loom_blk_moe_split(m, err);
    if (s < 0) goto fail;
    const loom_shard_dims_t *d = &m->dims;
    int dim = cfg->dim, hd = m->cfg.head_dim;
    /* decompressed MLA: q (n_heads qk), then k (n_heads qk) and v (n_heads v) */
    m->qkv_dim = mla_mha ? d->n_heads * (2 * hd + cfg->v_head_dim) : (d->n_heads + 2 * d->n_kv_heads) * hd;

    loom_loader_t L = {.m = m, .st = st};
    uint64_t t0 = loom_now_ns(), read0 = loom_st_bytes_read(st);
    LOOM_INFO("loading %s: layers [%d, %d) of %d, tp rank %d/%d%s%s", loom_backend_name(be),
              spec->layer_begin, spec->layer_end, cfg->n_layers, spec->tp_rank, spec->tp_size,
              spec->has_embed ? ", embedding" : "", spec->has_head ? ", LM head" : "");
    loom_progress_t prog;
    char what[96];
    snprintf(what, sizeof what, "loading layers [%d, %d), tp rank %d/%d", spec->layer_begin, spec->layer_end,
             spec->tp_rank, spec->tp_size);
    loom_progress_begin(&prog, what, loom_load_read_estimate(cfg, st, spec));
    if (spec->has_embed && opt->embed_from && opt->embed_from->embed) {
        m->embed = opt->embed_from->embed; /* the MTP module's tokens: the target's table, not a copy */
        m->embed_borrowed = 1;
    } else if (spec->has_embed) {
        float *h = loom_load_staging(&L, (size_t)cfg->vocab_size * dim);
        if (!h) {
            s = loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory for the embedding table");
            goto fail_loader;
        }
        char embed[128];
        loom_arch_tensor_name(arch, cfg, -1, LOOM_TN_EMBED, -1, embed, sizeof embed);
        s = loom_load_read_block(&L, embed, cfg->vocab_size, dim, 0, cfg->vocab_size, 0, dim, h, err);
        if (s < 0) goto fail_loader;
        size_t bytes = (size_t)cfg->vocab_size * dim * sizeof(float);
        m->embed = loom_backend_alloc(be, bytes);
        if (!m->embed) {
            s = loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for the embedding table");
            goto fail_loader;
        }
        if (cfg->embed_scale > 0) {
            loom_load_scale_embedding(h, (size_t)cfg->vocab_size * dim, cfg->embed_scale,
                                      loom_st_find(st, embed)->dtype);
            s = loom_weights_check_finite(embed, "the embedding scale", h, (size_t)cfg->vocab_size * dim, err);
            if (s < 0) goto fail_loader;
        }
        loom_backend_upload(be, m->embed, h, bytes);
        m->weight_bytes += bytes;
    }
    m->layers = loom_xcalloc((size_t)(d->n_layers ? d->n_layers : 1), sizeof *m->layers);
    for (int i = 0; i < d->n_layers; i++) {
        s = arch->load_layer(&L, spec->layer_begin + i, &m->layers[i], err);
        if (s < 0) goto fail_loader;
        loom_progress_update(&prog, loom_st_bytes_read(st) - read0);
    }
    if (opt->mtp) {
        s = mtp_load(&L, err);
        if (s < 0) goto fail_loader;
    }
    if (spec->has_head) {
        char norm[128], head[128];
        loom_arch_tensor_name(arch, cfg, -1, LOOM_TN_FINAL_NORM, -1, norm, sizeof norm);
        if (opt->mtp) snprintf(norm, sizeof norm, "model.layers.%d.shared_head.norm.weight", spec->layer_begin);
        s = loom_load_upload_norm(&L, norm, dim, &m->final_norm, err);
        if (s < 0) goto fail_loader;
        /* a tied head reads the embedding, unless `loom quantize` stored it quantized */
        loom_arch_tensor_name(arch, cfg, -1, LOOM_TN_LM_HEAD, -1, head, sizeof head);
        if (opt->mtp) { /* the module's own copy of the head, where the checkpoint has one */
            char own[128], own_w[136];
            snprintf(own, sizeof own, "model.layers.%d.shared_head.head", spec->layer_begin);
            snprintf(own_w, sizeof own_w, "%s.weight", own);
            if (loom_st_find(st, own_w) || loom_qw_stored(st, own)) snprintf(head, sizeof head, "%s", own);
        } else if (cfg->tie_embeddings && !loom_qw_stored(st, head)) { /* the embedding's name without ".weight" */
            loom_arch_tensor_name(arch, cfg, -1, LOOM_TN_EMBED, -1, head, sizeof head);
            char *dot = strrchr(head, '.');
            if (dot) *dot = 0;
        }
        loom_lin_part_t hp = {head, cfg->vocab_size, d->vocab_begin, d->vocab};
        s = loom_load_linear(&L, &m->lm_head, "lm_head", &hp, 1, dim, 0, dim, err);
        if (s < 0) goto fail_loader;
    }
    loom_progress_end(&prog, loom_st_bytes_read(st) - read0);
    free(L.tmp);
    L.tmp = NULL;
    s = loom_blk_moe_tables(m, err);
    if (s < 0) goto fail;
    s = loom_model_lora_alloc(m, err);
    if (s < 0) goto fail;

    float inv[512];
    if (hd / 2 > (int)LOOM_ARRAY_LEN(inv)) {
        s = loom_err_set(err, LOOM_ERR_UNSUPPORTED, "head_dim %d is larger than 1024", hd);
        goto fail;
    }
    loom_model_config_t rc = *cfg;
    rc.head_dim = hd; /* decompressed MLA: q's and k's heads of nope + rope, the rope pairs first */
    loom_blk_attn_rope_table(&rc, inv);
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
        loom_blk_attn_rope_table(&local, inv);
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
    m->att = act_alloc(m, T * (size_t)d->n_heads * (mla_mha ? LOOM_MAX(hd, cfg->v_head_dim) : hd), &oom);
    if (cfg->deepseek) m->mla_z = act_alloc(m, T * (size_t)loom_blk_attn_mla_zdim(cfg, d), &oom);
    size_t hid = (size_t)LOOM_MAX(LOOM_MAX(d->hidden, m->moe_hn), m->shared_hn);
    m->gu = act_alloc(m, T * 2 * hid, &oom);
    m->hb = act_alloc(m, T * hid, &oom);
    if (opt->mtp) m->mtp_in = act_alloc(m, T * dim, &oom);
    if (spec->dp_attention && spec->tp_size > 1) {
        m->dp_xb = act_alloc(m, T * dim, &oom);
        m->dp_xb2 = act_alloc(m, T * dim, &oom);
        m->dp_one = act_alloc(m, T, &oom);
        if (m->dp_one) {
            float *one = loom_xmalloc(T * sizeof *one);
            for (size_t i = 0; i < T; i++) one[i] = 1.0f;
            loom_backend_upload(be, m->dp_one, one, T * sizeof *one);
            free(one);
        }
        LOOM_INFO("data-parallel attention: tp rank %d/%d holds all %d heads and runs its own sequences' attention",
                  spec->tp_rank, spec->tp_size, d->n_heads);
    }
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
              (unsigned long long)(loom_st_bytes_read(st) - read0), (unsigned long long)total,
              total ? 100.0 * (double)(loom_st_bytes_read(st) - read0) / (double)total : 0.0);
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
            loom_weight_free(be, &ly->wkv_a);
            loom_weight_free(be, &ly->mla_q_a);
            loom_weight_free(be, &ly->mla_kv_b);
            loom_weight_free(be, &ly->mla_dq);
            loom_weight_free(be, &ly->mla_dk);
            loom_weight_free(be, &ly->mla_dv);
            free(ly->ffn.ds_bias);
            loom_weight_free(be, &ly->wo);
            for (int j = 0; ly->mla_uv && j < m->dims.n_heads; j++) loom_weight_free(be, &ly->mla_uv[j]);
            free(ly->mla_uv);
            loom_backend_free(be, ly->mla_uv_table);
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
            loom_backend_free(be, ly->ffn.d_ds_bias);
            loom_backend_free(be, ly->ffn.t2);
            free(ly->ffn.e13);
            free(ly->ffn.e2);
        }
        free(m->layers);
    }
    if (!m->embed_borrowed) loom_backend_free(be, m->embed);
    loom_backend_free(be, m->final_norm);
    loom_weight_free(be, &m->lm_head);
    loom_backend_free(be, m->mtp_enorm);
    loom_backend_free(be, m->mtp_hnorm);
    loom_weight_free(be, &m->mtp_eh_e);
    loom_weight_free(be, &m->mtp_eh_h);
    loom_backend_free(be, m->inv_freq);
    loom_backend_free(be, m->mla_sel);
    loom_backend_free(be, m->mla_dec);
    free(m->mla_dec_pos);
    loom_backend_free(be, m->inv_freq_local);
    loom_backend_free(be, m->kv_mem);
    loom_model_lora_free(m);
    float *acts[] = {m->x,
                     m->xb,
                     m->xb2,
                     m->qkv,
                     m->att,
                     m->mla_z,
                     m->mtp_in,
                     m->dp_xb,
                     m->dp_xb2,
                     m->dp_one,
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
    free(m->dp_host);
    free(m->dp_seq_map);
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
float *loom_model_hidden(loom_model_t *m) { return m->x; }
float *loom_model_mtp_input(loom_model_t *m) {
    LOOM_ASSERT(m->opt.mtp);
    return m->mtp_in;
}

/* opt.mtp: x = eh_proj([enorm(embed(token)) ; hnorm(h)]), as the two
 * halves' products summed; a row at position 0 has no token before it and
 * reads a zero embedding. */
static loom_status_t mtp_input(loom_model_t *m, const loom_step_ops_t *so, loom_err_t *err) {
    loom_backend_t *be = m->be;
    const int n = so->n, dim = m->cfg.dim;
    const float eps = m->cfg.norm_eps;
    loom_op_embed(be, m->xb, m->embed, so->d_tok, n, dim);
    loom_op_rmsnorm(be, m->xb, m->xb, m->mtp_enorm, n, dim, eps);
    for (int i = 0; i < m->mtp_n; i++)
        if (m->mtp_pos[i] == 0) loom_backend_memset(be, m->xb + (size_t)i * dim, 0, (size_t)dim * sizeof(float));
    loom_op_rmsnorm(be, m->xb2, m->mtp_in, m->mtp_hnorm, n, dim, eps);
    const loom_blk_linear_t e = {.w = &m->mtp_eh_e, .proj = LOOM_PROJ_MTP_EH, .layer = -1, .expert = -1};
    const loom_blk_linear_t h = {.w = &m->mtp_eh_h, .proj = LOOM_PROJ_MTP_EH, .layer = -1, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, NULL, &e, m->x, m->xb, n, err));
    LOOM_CHECK(loom_blk_linear(m, NULL, &h, m->mtp_in, m->xb2, n, err));
    loom_op_add(be, m->x, m->mtp_in, (int64_t)n * dim);
    return LOOM_OK;
}
float *loom_model_logits(loom_model_t *m) { return m->logits; }

void loom_model_set_layer_wait(loom_model_t *m, void (*fn)(void *ctx, int layer), void *ctx) {
    m->layer_wait = fn;
    m->layer_wait_ctx = ctx;
}

/* Issues the step's ops: embedding, the layers (the family's), and the LM head. */
static loom_status_t run_ops(loom_model_t *m, const loom_step_ops_t *so, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    loom_backend_t *be = m->be;
    const int n = so->n, nl = so->nl, dim = c->dim;

    if (m->opt.mtp) LOOM_CHECK(mtp_input(m, so, err));
    else if (m->spec.has_embed) loom_op_embed(be, m->x, m->embed, so->d_tok, n, dim);
    /* Each residual add is fused with the norm that follows it (the MLP's,
     * or the next layer's attention norm); backends without the fused op
     * run the two plain ops. */
    if (d->n_layers > 0) loom_op_rmsnorm(be, m->xb, m->x, m->layers[0].attn_norm, n, dim, c->norm_eps);
    for (int l = 0; l < d->n_layers; l++) {
        if (m->layer_wait) m->layer_wait(m->layer_wait_ctx, l);
        LOOM_CHECK(m->arch->layer(m, so, l, err));
    }
    if (nl > 0) {
        loom_op_gather_rows(be, m->xl, m->x, so->d_rows, nl, dim);
        loom_op_rmsnorm(be, m->xl, m->xl, m->final_norm, nl, dim, c->norm_eps);
        const loom_blk_linear_t head = {.w = &m->lm_head, .proj = LOOM_PROJ_LM_HEAD, .layer = -1, .expert = -1};
        LOOM_CHECK(loom_blk_linear(m, so->adapters, &head, m->logits, m->xl, nl, err));
        if (m->arch->head) m->arch->head(m, nl);
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
    /* data-parallel attention: the plan's ids address every rank's pool; this rank's
     * sub-batch, in its own ids, is checked and built by loom_blk_attn_dp_batch */
    const int dp_on = m->spec.dp_attention && m->spec.tp_size > 1;
    const int plan_blocks = dp_on ? m->n_blocks * m->spec.tp_size : m->n_blocks;

    /* Validate ids against the pool so a bad plan cannot write out of bounds. */
    int max_pos = 0;
    for (int i = 0; i < n; i++) {
        if (b->pos[i] < 0 || b->pos[i] >= c->max_seq_len || b->tok_seq[i] < 0 || b->tok_seq[i] >= b->n_seqs ||
            b->slots[i] < 0 || b->slots[i] >= plan_blocks * m->block_size ||
            (m->spec.has_embed && (b->tokens[i] < 0 || b->tokens[i] >= c->vocab_size)))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "step token %d is out of range", i);
        if (b->pos[i] / m->block_size >= b->max_blocks)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "position %d beyond the block table", b->pos[i]);
        if (b->pos[i] > max_pos) max_pos = b->pos[i];
    }
    size_t nbt = (size_t)b->n_seqs * (size_t)b->max_blocks;
    for (size_t i = 0; i < nbt; i++)
        if (b->block_tables[i] < -1 || b->block_tables[i] >= plan_blocks)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "block id %d out of range", b->block_tables[i]);
    /* the step's adapter slots: a row with one turns the deltas on */
    int lora = 0;
    for (int q = 0; b->seq_lora && q < b->n_seqs; q++) {
        if (b->seq_lora[q] < -1 || b->seq_lora[q] >= loom_model_max_loras(m))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "sequence %d: adapter slot %d out of range (max_loras %d)",
                                q, b->seq_lora[q], loom_model_max_loras(m));
        lora |= b->seq_lora[q] >= 0;
    }
    int nl = m->spec.has_head ? b->n_logits : 0;
    for (int i = 0; i < nl; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= n)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "logit row %d out of range", b->logit_rows[i]);
    loom_dp_batch_t dp = {0};
    if (dp_on) LOOM_CHECK(loom_blk_attn_dp_batch(m, b, &dp, err));

    /* Decode steps (one token per sequence) of a shard without TP all-reduces,
     * or whose all-reduce hook is stream-ordered (opt.allreduce_in_graphs),
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
    int graph = loom_backend_has_graphs(be) && decode && n < (1 << 20) && !lora && !m->opt.mtp && !dp_on &&
                !(m->spec.tp_size > 1 && m->opt.allreduce && !m->opt.allreduce_in_graphs) &&
                /* loom_blk_moe routes on the host between ops, except decode steps on the device */
                (m->expert_end == 0 || decode_bucket(n) <= m->moe_device_n) &&
                /* runs of one row attending decompressed upload their positions between ops */
                m->opt.mla_prefill_rows != 1;
    int N = n; /* tokens after padding */
    if (m->scratch_block >= 0 && decode && !dp_on && (nl == 0 || nl == n) && (graph || m->opt.decode_buckets > 0)) {
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
    size_t need = 4 * (size_t)N + (size_t)nlp + nbt_packed + (lora ? (size_t)N : 0) + dp.n_meta;
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
    if (m->opt.mtp) { /* the input stage reads the positions on the host; padding rows read zero h */
        m->mtp_pos = b->pos;
        m->mtp_n = n;
        if (pad) loom_backend_memset(be, m->mtp_in + (size_t)n * c->dim, 0, (size_t)pad * c->dim * sizeof(float));
    }
    if (lora) { /* after the block tables: each row's adapter slot, -1 for padding */
        int32_t *h_lora = h_bt + nbt_packed;
        for (int i = 0; i < N; i++) h_lora[i] = i < n ? b->seq_lora[b->tok_seq[i]] : -1;
    }
    const size_t dp_at = need - dp.n_meta; /* after everything else: the sub-batch (attn_dp.c's layout) */
    if (dp_on) memcpy(h + dp_at, m->dp_host, dp.n_meta * 4);
    loom_backend_upload(be, m->meta_dev, h, need * 4);
    const int32_t *d_tok = m->meta_dev;
    loom_step_ops_t so = {.n = N, .nl = nlp, .max_blocks = mb, .max_ctx = max_pos + 1, .d_tok = d_tok,
                     .d_pos = d_tok + N, .d_slots = d_tok + 2 * N, .d_seq = d_tok + 3 * N,
                     .d_rows = d_tok + 4 * N, .d_bt = d_tok + 4 * N + nlp, .h_pos = h_pos, .h_seq = h_seq};
    if (lora) {
        m->lora_step.d_row_slot = so.d_bt + nbt_packed;
        so.adapters = &m->lora_step;
    }
    loom_step_ops_t sub;
    if (dp_on) { /* rows (k), each row's index among them (n), then the sub-batch's pos, slots, seq, tables */
        const int32_t *d = d_tok + dp_at;
        const int k = dp.n;
        so.d_dp_rows = d;
        so.d_dp_at = d + k;
        const int32_t *hdp = h + dp_at;
        sub = (loom_step_ops_t){.n = k, .max_blocks = mb, .max_ctx = dp.max_pos + 1, .d_pos = d + k + n,
                                .d_slots = d + 2 * k + n, .d_seq = d + 3 * k + n, .d_bt = d + 4 * k + n,
                                .h_pos = hdp + k + n, .h_seq = hdp + 3 * k + n, .local = 1};
        so.dp = &sub;
    }
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
    const loom_blk_linear_t head = {.w = &m->lm_head, .proj = LOOM_PROJ_LM_HEAD, .layer = -1, .expert = -1};
    loom_err_t err = {0};
    loom_status_t s = loom_blk_linear(m, NULL, &head, m->logits, m->xl, n_rows, &err);
    LOOM_ASSERT(s == LOOM_OK); /* the head is not row-parallel: no all-reduce to fail */
    (void)s;
    if (m->arch->head) m->arch->head(m, n_rows);
}

int loom_model_max_logits(const loom_model_t *m) { return m->opt.max_logits; }
int loom_model_mla_prefill_rows(const loom_model_t *m) { return m->opt.mla_prefill_rows; }

void loom_model_download_logits(loom_model_t *m, float *dst, int n_rows) {
    loom_backend_download(m->be, dst, m->logits, (size_t)n_rows * m->dims.vocab * sizeof(float));
}

void loom_model_normed_rows(loom_model_t *m, int t0, int t1, float *out) {
    LOOM_ASSERT(m->spec.has_head && t0 >= 0 && t0 <= t1 && t1 <= m->opt.max_tokens);
    const int dim = m->cfg.dim, cap = m->opt.max_logits;
    for (int t = t0; t < t1; t += cap) {
        int n = LOOM_MIN(cap, t1 - t);
        loom_backend_copy(m->be, m->xl, m->x + (size_t)t * dim, (size_t)n * dim * sizeof(float));
        loom_op_rmsnorm(m->be, m->xl, m->xl, m->final_norm, n, dim, m->cfg.norm_eps);
        loom_backend_download(m->be, out + (size_t)(t - t0) * dim, m->xl, (size_t)n * dim * sizeof(float));
    }
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