/* Single-process, single-sequence generation over one full-model shard. */
#include "worker/local.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/safetensors.h"
#include "common/util.h"

#define LOCAL_BLOCK 16

struct loom_local {
    loom_model_config_t cfg;
    loom_tokenizer_t *tok;
    loom_st_t *st;
    loom_backend_t *be;
    loom_model_t *model;
    int ctx, chunk, max_blocks;
    /* step buffers (host), sized for one chunk */
    int32_t *pos, *slots, *tok_seq, *rows, *block_table;
    int32_t *cand_ids;       /* (LOCAL_MAX_ROWS, LOOM_SAMPLE_MAX_CAND) sampling candidates per row */
    float *cand_keys;
    loom_spec_config_t spec; /* speculation (method OFF: none) */
    int32_t *hist;           /* (ctx) prompt and generated ids: the ngram drafter's history */
    loom_local_t *draft;     /* method DRAFT: the draft model, its own KV cache */
    /* method MTP: the checkpoint's MTP module (layer n_layers) as a model of
     * its own, with its own KV cache (slot 0's block table). Its cache holds
     * positions 0..mtp_done-1 computed from the target's rows; mtp_h holds
     * the target's final-normed rows of positions mtp_h0..mtp_h0+mtp_hn-1
     * (its last forward); mtp_prev the module's last output row */
    loom_model_t *mtp;
    float *mtp_h, *mtp_prev;
    int mtp_h0, mtp_hn, mtp_done;
    /* sequence slots (loom_local_propose): slot i owns KV blocks
     * [i max_blocks, (i+1) max_blocks); held[i ctx ..] are the ids whose KV
     * it holds at positions 0..held_n[i], the history's ids from held_off[i]
     * on (0, unless a windowed catch-up started the slot within the history) */
    int n_slots;
    int32_t lora_slot; /* the adapter's engine slot for every sequence: 0, or -1 without --lora */
    int32_t *held;
    int *held_n, *held_off;
    loom_local_counters_t counters; /* forwards run and the tokens they read */
};

#define LOCAL_MAX_ROWS (LOOM_SPEC_MAX_K + 1) /* logit rows a verify step samples */

loom_status_t loom_local_check_draft(const loom_model_config_t *dc, const loom_model_config_t *tc,
                                     const char *dir, loom_err_t *err) {
    if (dc->vocab_size != tc->vocab_size)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the draft model %s has a vocabulary of %d tokens, the target's has %d",
                            dir, dc->vocab_size, tc->vocab_size);
    if (dc->bos_id != tc->bos_id || dc->n_eos != tc->n_eos ||
        (tc->n_eos > 0 && dc->eos_ids[0] != tc->eos_ids[0]))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the draft model %s has other special tokens (bos %d, eos %d) than the "
                            "target (bos %d, eos %d)",
                            dir, dc->bos_id, dc->n_eos ? dc->eos_ids[0] : -1, tc->bos_id,
                            tc->n_eos ? tc->eos_ids[0] : -1);
    return LOOM_OK;
}

loom_status_t loom_local_check_draft_tokenizer(const char *dir, const loom_tokenizer_t *target,
                                               loom_err_t *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (!target || access(path, R_OK) != 0)
        return LOOM_OK; /* nothing to compare: the ids alone must agree */
    loom_tokenizer_t *tok = NULL;
    loom_err_t e = {0};
    if (loom_tokenizer_load(dir, &tok, &e) < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the draft model %s's tokenizer cannot be loaded: %s", dir, e.msg);
    loom_status_t st = LOOM_OK;
    int n = loom_tokenizer_vocab_size(tok), nt = loom_tokenizer_vocab_size(target);
    if (n != nt) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "the draft model %s's tokenizer has %d tokens, the target's has %d", dir,
                          n, nt);
    } else {
        for (int32_t id = 0; id < n; id++) {
            const char *a = loom_tokenizer_piece(tok, id), *b = loom_tokenizer_piece(target, id);
            if (!strcmp(a ? a : "", b ? b : "")) continue;
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "the draft model %s has another tokenizer than the target: token %d "
                              "is '%.40s' in the "
                              "draft's and '%.40s' in the target's",
                              dir, id, a ? a : "", b ? b : "");
            break;
        }
    }
    loom_tokenizer_destroy(&tok);
    return st;
}

/* The draft model of method DRAFT: greedy, one sequence, the target's
 * context, refused when its vocabulary or special ids differ. */
static loom_status_t open_draft(loom_local_t *l, const loom_local_options_t *opt, loom_err_t *err) {
    loom_local_options_t d = *opt;
    d.model_dir = opt->draft_model_dir ? opt->draft_model_dir : opt->model_dir;
    d.quant = opt->draft_quant;
    d.spec.method = LOOM_SPEC_OFF;
    d.no_tokenizer = 1;
    d.ctx = l->ctx;
    d.n_slots = 1;
    loom_err_t e = {0};
    if (loom_local_open(&d, &l->draft, &e) < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the draft model %s cannot be loaded: %s", d.model_dir,
                            e.msg);
    LOOM_CHECK(loom_local_check_draft(&l->draft->cfg, &l->cfg, d.model_dir, err));
    if (opt->draft_model_dir)
        LOOM_CHECK(loom_local_check_draft_tokenizer(d.model_dir, l->tok, err));
    if (l->draft->ctx < l->ctx) l->ctx = l->draft->ctx;
    return LOOM_OK;
}

/* Method MTP: the module loads as a one-layer model over the same checkpoint. */
static loom_status_t open_mtp(loom_local_t *l, const loom_local_options_t *opt, loom_dtype_t kv_dtype,
                              loom_err_t *err) {
    loom_shard_spec_t spec = {.tp_rank = 0, .tp_size = 1, .layer_begin = l->cfg.n_layers,
                              .layer_end = l->cfg.n_layers + 1, .has_embed = 1, .has_head = 1};
    loom_model_options_t mo = {.max_tokens = l->chunk, .max_seqs = 1, .max_logits = 1, .quant = opt->quant,
                               .kv_dtype = kv_dtype, .decode_buckets = -1, .mtp = 1, .mla_o = opt->mla_o,
                               .mla_prefill_rows = opt->mla_prefill_rows,
                               .embed_from = l->model};
    LOOM_CHECK(loom_model_load(l->be, &l->cfg, l->st, &spec, &mo, &l->mtp, err));
    LOOM_CHECK(loom_model_alloc_kv(l->mtp, l->max_blocks, LOCAL_BLOCK, err));
    l->mtp_h = loom_xmalloc((size_t)l->chunk * (size_t)l->cfg.dim * sizeof(float));
    l->mtp_prev = loom_xmalloc((size_t)l->cfg.dim * sizeof(float));
    return LOOM_OK;
}

/* The adapter in DIR read, prepared and installed into engine slot 0. */
static loom_status_t load_lora(loom_local_t *l, const char *dir, int max_rank, loom_err_t *err) {
    loom_lora_adapter_t *a = NULL;
    loom_lora_prepared_t *p = NULL;
    loom_status_t s = loom_lora_load(dir, &l->cfg, max_rank, 0, l->cfg.n_layers, &a, err);
    if (s == LOOM_OK) s = loom_model_lora_prepare(l->model, a, &p, err);
    if (s == LOOM_OK) s = loom_model_lora_install(l->model, 0, p, err);
    if (s == LOOM_OK) {
        LOOM_INFO("LoRA adapter %s: %d modules, rank up to %d, %.1f MiB, digest %.16s", dir, a->n_modules, a->max_r,
                  (double)loom_lora_prepared_bytes(p) / (1 << 20), a->digest_hex);
        l->lora_slot = 0;
    }
    loom_lora_prepared_destroy(&p);
    loom_lora_destroy(&a);
    return s;
}

loom_status_t loom_local_open(const loom_local_options_t *opt, loom_local_t **out, loom_err_t *err) {
    *out = NULL;
    loom_local_t *l = loom_xcalloc(1, sizeof *l);
    loom_status_t s = loom_spec_config_check(&opt->spec, err);
    if (s < 0) goto fail;
    l->spec = opt->spec;
    s = loom_model_config_load(opt->model_dir, &l->cfg, err);
    if (s < 0) goto fail;
    if (!opt->no_tokenizer) {
        s = loom_tokenizer_load(opt->model_dir, &l->tok, err);
        if (s < 0) goto fail;
    }
    s = loom_st_open_dir(opt->model_dir, &l->st, err);
    if (s == LOOM_OK) s = loom_model_map_tensor_names(&l->cfg, l->st, err);
    if (s < 0) goto fail;

    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION,
                                .n_threads = opt->n_threads,
                                .weight_dtype = opt->weight_dtype};
    if (!loom_device_parse(opt->device ? opt->device : "cpu", &bc.kind, &bc.device_index)) {
        s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "unknown device '%s' (use cpu or cuda:N)", opt->device);
        goto fail;
    }
    s = loom_backend_create(&bc, &l->be, err);
    if (s < 0) goto fail;
    loom_dtype_t kv_dtype;
    s = loom_backend_kv_resolve(l->be, opt->kv_cache_dtype, &kv_dtype, err);
    if (s < 0) goto fail;

    l->ctx = opt->ctx > 0 && opt->ctx < l->cfg.max_seq_len ? opt->ctx : l->cfg.max_seq_len;
    l->chunk = opt->chunk > 0 ? opt->chunk : 256;
    loom_shard_spec_t spec = {.tp_rank = 0, .tp_size = 1, .layer_begin = 0,
                              .layer_end = l->cfg.n_layers, .has_embed = 1, .has_head = 1};
    loom_model_options_t mo = {.max_tokens = l->chunk, .max_seqs = 1, .max_logits = l->chunk, .quant = opt->quant,
                               .kv_dtype = kv_dtype, .kv_layer_major = opt->kv_layer_major,
                               .max_loras = opt->lora_dir ? 1 : 0,
                               .max_lora_rank = opt->max_lora_rank > 0 ? opt->max_lora_rank : 16,
                               .mla_o = opt->mla_o, .mla_disable = opt->mla_disable,
                               .mla_prefill_rows = opt->mla_prefill_rows};
    if (opt->mla_disable && l->cfg.deepseek && opt->spec.method == LOOM_SPEC_MTP) {
        s = loom_err_set(err, LOOM_ERR_UNSUPPORTED, "--disable-mla: the MTP module's draft is not implemented with "
                         "the decompressed cache");
        goto fail;
    }
    s = loom_model_load(l->be, &l->cfg, l->st, &spec, &mo, &l->model, err);
    if (s < 0) goto fail;
    l->lora_slot = -1;
    if (opt->lora_dir) {
        s = load_lora(l, opt->lora_dir, mo.max_lora_rank, err);
        if (s < 0) goto fail;
    }
    l->max_blocks = (l->ctx + LOCAL_BLOCK - 1) / LOCAL_BLOCK;
    l->n_slots = opt->n_slots > 0 ? opt->n_slots : 1;
    s = loom_model_alloc_kv(l->model, l->max_blocks * l->n_slots, LOCAL_BLOCK, err);
    if (s < 0) goto fail;

    l->pos = loom_xmalloc((size_t)l->chunk * sizeof(int32_t));
    l->slots = loom_xmalloc((size_t)l->chunk * sizeof(int32_t));
    l->tok_seq = loom_xcalloc((size_t)l->chunk, sizeof(int32_t));
    l->rows = loom_xmalloc((size_t)l->chunk * sizeof(int32_t));
    l->block_table = loom_xmalloc((size_t)l->max_blocks * l->n_slots * sizeof(int32_t));
    for (int i = 0; i < l->max_blocks * l->n_slots; i++)
        l->block_table[i] = i;
    l->held = loom_xmalloc((size_t)l->ctx * l->n_slots * sizeof(int32_t));
    l->held_n = loom_xcalloc((size_t)l->n_slots, sizeof(int));
    l->held_off = loom_xcalloc((size_t)l->n_slots, sizeof(int));
    l->cand_ids = loom_xmalloc((size_t)LOCAL_MAX_ROWS * LOOM_SAMPLE_MAX_CAND * sizeof(int32_t));
    l->cand_keys = loom_xmalloc((size_t)LOCAL_MAX_ROWS * LOOM_SAMPLE_MAX_CAND * sizeof(float));
    l->hist = loom_xmalloc((size_t)l->ctx * sizeof(int32_t));
    if (opt->spec.method == LOOM_SPEC_DRAFT) {
        s = open_draft(l, opt, err);
        if (s < 0) goto fail;
    }
    if (opt->spec.method == LOOM_SPEC_MTP) {
        s = open_mtp(l, opt, kv_dtype, err);
        if (s < 0) goto fail;
    }
    *out = l;
    return LOOM_OK;
fail:
    loom_local_close(&l);
    return s;
}

void loom_local_close(loom_local_t **l_p) {
    if (!l_p || !*l_p) return;
    loom_local_t *l = *l_p;
    *l_p = NULL;
    loom_local_close(&l->draft);
    loom_model_destroy(&l->mtp);
    free(l->mtp_h);
    free(l->mtp_prev);
    loom_model_destroy(&l->model);
    loom_backend_destroy(&l->be);
    loom_st_close(&l->st);
    loom_tokenizer_destroy(&l->tok);
    free(l->pos);
    free(l->slots);
    free(l->tok_seq);
    free(l->rows);
    free(l->block_table);
    free(l->cand_ids);
    free(l->cand_keys);
    free(l->hist);
    free(l->held);
    free(l->held_n);
    free(l->held_off);
    free(l);
}

const loom_model_config_t *loom_local_config(const loom_local_t *l) { return &l->cfg; }
const loom_tokenizer_t *loom_local_tokenizer(const loom_local_t *l) { return l->tok; }
loom_model_t *loom_local_model(loom_local_t *l) { return l->model; }
int loom_local_ctx(const loom_local_t *l) { return l->ctx; }
loom_dtype_t loom_local_kv_dtype(const loom_local_t *l) { return loom_model_kv_dtype(l->model); }

/* Runs tokens[0..n) of sequence slot `slot` at positions p0.. and asks
 * logits for the rows in rows[0..nr). */
static loom_status_t run_slot(loom_local_t *l, int slot, const int32_t *tokens, int n, int p0,
                              int nr, loom_err_t *err) {
    int base = slot * l->max_blocks *
               LOCAL_BLOCK; /* the slot's blocks are contiguous: slot = base + position */
    for (int i = 0; i < n; i++) {
        l->pos[i] = p0 + i;
        l->slots[i] = base + p0 + i;
    }
    loom_step_batch_t b = {.n_tokens = n,
                           .tokens = tokens,
                           .pos = l->pos,
                           .slots = l->slots,
                           .tok_seq = l->tok_seq,
                           .n_seqs = 1,
                           .block_tables = l->block_table + (size_t)slot * l->max_blocks,
                           .max_blocks = l->max_blocks,
                           .n_logits = nr,
                           .logit_rows = l->rows,
                           .seq_lora = l->lora_slot >= 0 ? &l->lora_slot : NULL};
    l->counters.forwards++;
    l->counters.tokens += n;
    return loom_model_forward(l->model, &b, err);
}

static loom_status_t run_chunk(loom_local_t *l, const int32_t *tokens, int n, int p0, int nr,
                               loom_err_t *err) {
    return run_slot(l, 0, tokens, n, p0, nr, err);
}

/* Samples model's last forward's rows 0..n_rows as generated tokens step0.. */
static void sample_model(loom_local_t *l, loom_model_t *model, const loom_sampling_t *s, uint64_t step0,
                         int n_rows, int32_t *ids) {
    loom_sample_part_t parts[LOCAL_MAX_ROWS];
    uint64_t steps[LOCAL_MAX_ROWS] = {0};
    loom_sampling_t params[LOCAL_MAX_ROWS] = {0};
    for (int i = 0; i < n_rows; i++) {
        steps[i] = step0 + (uint64_t)i;
        params[i] = *s;
        parts[i] = (loom_sample_part_t){.ids = l->cand_ids + (size_t)i * LOOM_SAMPLE_MAX_CAND,
                                        .keys = l->cand_keys + (size_t)i * LOOM_SAMPLE_MAX_CAND};
    }
    loom_model_sample_parts(model, n_rows, params, steps, parts);
    for (int i = 0; i < n_rows; i++) ids[i] = loom_sample_merge(&parts[i], 1, l->cfg.vocab_size, s, steps[i]);
}

static void sample_rows(loom_local_t *l, const loom_sampling_t *s, uint64_t step0, int n_rows, int32_t *ids) {
    sample_model(l, l->model, s, step0, n_rows, ids);
}

/* Method MTP: rows at positions p0..p0+n-1 of the module, row i reading
 * ids[i] (the token at p0+i+1) and h[i] (host, dim floats); the last row's
 * logits and output row (into mtp_prev) are kept. */
static loom_status_t mtp_run(loom_local_t *l, const int32_t *ids, const float *h, int n, int p0, loom_err_t *err) {
    const size_t dim = (size_t)l->cfg.dim;
    loom_backend_upload(l->be, loom_model_mtp_input(l->mtp), h, (size_t)n * dim * sizeof(float));
    for (int i = 0; i < n; i++) {
        l->pos[i] = p0 + i;
        l->slots[i] = p0 + i; /* slot 0's blocks: the slot is the position */
    }
    l->rows[0] = n - 1;
    loom_step_batch_t b = {.n_tokens = n, .tokens = ids, .pos = l->pos, .slots = l->slots, .tok_seq = l->tok_seq,
                           .n_seqs = 1, .block_tables = l->block_table, .max_blocks = l->max_blocks,
                           .n_logits = 1, .logit_rows = l->rows};
    LOOM_CHECK(loom_model_forward(l->mtp, &b, err));
    loom_backend_download(l->be, l->mtp_prev, loom_model_hidden(l->mtp) + (size_t)(n - 1) * dim,
                          dim * sizeof(float));
    return LOOM_OK;
}

/* Method MTP: keeps the target's final-normed rows of its last forward,
 * positions p0..p0+n-1 (called before the next target forward). */
static void mtp_keep_rows(loom_local_t *l, int p0, int n) {
    loom_model_normed_rows(l->model, 0, n, l->mtp_h);
    l->mtp_h0 = p0;
    l->mtp_hn = n;
}

/* Method MTP: the module's cache catches up with positions mtp_done..t_end-1
 * (position t reads the target's row at t and hist[t + 1]); no-op when it
 * holds them. Returns 1 when rows ran (the last one's logits are fresh). */
static int mtp_catch_up(loom_local_t *l, const int32_t *hist, int t_end, loom_err_t *err) {
    int n = t_end - l->mtp_done;
    if (n <= 0) return 0;
    LOOM_ASSERT(l->mtp_done >= l->mtp_h0 && t_end <= l->mtp_h0 + l->mtp_hn && n <= l->chunk);
    loom_status_t s = mtp_run(l, hist + l->mtp_done + 1,
                              l->mtp_h + (size_t)(l->mtp_done - l->mtp_h0) * (size_t)l->cfg.dim, n,
                              l->mtp_done, err);
    if (s < 0) return (int)s;
    l->mtp_done = t_end;
    return 1;
}

/* Method MTP: the drafts after hist[0..n_hist) (the target has run
 * positions 0..n_hist-2). The first comes from the caught-up row at
 * n_hist-2; each next one from a row at the next position that reads the
 * previous draft and the module's own output row as its h (those rows are
 * rewritten by the next catch-up). Greedy, so a point mass: the verification
 * rule is unchanged. Returns the count, or a negative status. */
static int mtp_propose(loom_local_t *l, const int32_t *hist, int n_hist, int k, int32_t *out, loom_err_t *err) {
    int r = mtp_catch_up(l, hist, n_hist - 1, err);
    if (r < 0) return r;
    if (k <= 0) return 0;
    LOOM_ASSERT(r == 1);
    const loom_sampling_t greedy = {.temperature = 0.0f, .top_p = 1.0f};
    float *h = l->mtp_h; /* the catch-up consumed the target's rows */
    for (int j = 0; j < k; j++) {
        sample_model(l, l->mtp, &greedy, 0, 1, &out[j]);
        if (j + 1 == k) break;
        memcpy(h, l->mtp_prev, (size_t)l->cfg.dim * sizeof(float));
        loom_status_t s = mtp_run(l, &out[j], h, 1, n_hist - 1 + j, err);
        if (s < 0) return (int)s;
    }
    return k;
}

int loom_local_slots(const loom_local_t *l) {
    return l->n_slots;
}

void loom_local_forget(loom_local_t *l, int slot) {
    if (slot >= 0 && slot < l->n_slots) l->held_n[slot] = l->held_off[slot] = 0;
}

loom_local_counters_t loom_local_counters(const loom_local_t *l) {
    return l->counters;
}

int loom_local_propose(loom_local_t *l, int slot, const int32_t *hist, int n_hist, int k,
                       int32_t *out, loom_err_t *err) {
    return loom_local_propose_window(l, slot, hist, n_hist, k, 0, out, err);
}

int loom_local_propose_window(loom_local_t *l, int slot, const int32_t *hist, int n_hist, int k, int window,
                              int32_t *out, loom_err_t *err) {
    if (slot < 0 || slot >= l->n_slots)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "slot %d of %d", slot, l->n_slots);
    k = LOOM_MIN(k,
                 l->ctx - n_hist); /* drafts 0..k-2 go in at n_hist.., and the history must fit */
    if (n_hist < 1 || k <= 0) return 0;
    for (int i = 0; i < n_hist; i++)
        if (hist[i] < 0 || hist[i] >= l->cfg.vocab_size)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "token id %d is outside the vocabulary (%d)", hist[i],
                                l->cfg.vocab_size);
    int32_t *held = l->held + (size_t)slot * l->ctx;
    /* the cache is valid for the longest prefix it holds of hist[off..)
     * (the rest: rejected drafts, or another sequence's tokens), at
     * positions 0..; at least the last id runs again, for its logits */
    int off = l->held_off[slot], valid = 0, n_held = l->held_n[slot];
    while (valid < n_held && off + valid < n_hist && held[valid] == hist[off + valid])
        valid++;
    if (valid == 0) off = 0; /* nothing to reuse: the whole history */
    if (off + valid >= n_hist) valid = n_hist - 1 - off;
    if (window > 0 && n_hist - off - valid > window) {
        /* a window of the latest tokens, from position 0: RoPE scores
         * depend on distances only, so this is attention within them */
        off = n_hist - window;
        valid = 0;
    }
    l->held_off[slot] = off;
    l->held_n[slot] = valid;
    const int n_seq = n_hist - off; /* the slot's sequence: hist[off..n_hist) */
    l->counters.last_read = n_seq - valid;
    l->counters.max_read = LOOM_MAX(l->counters.max_read, l->counters.last_read);
    for (int p0 = valid; p0 < n_seq; p0 += l->chunk) {
        int n = LOOM_MIN(l->chunk, n_seq - p0);
        l->rows[0] = n - 1;
        LOOM_CHECK(run_slot(l, slot, hist + off + p0, n, p0, 1, err));
        memcpy(held + p0, hist + off + p0, (size_t)n * sizeof *hist);
        l->held_n[slot] = p0 + n;
    }
    const loom_sampling_t greedy = {.temperature = 0.0f, .top_p = 1.0f};
    for (int j = 0; j < k; j++) {
        sample_rows(l, &greedy, 0, 1, &out[j]);
        if (j + 1 < k) {
            l->rows[0] = 0;
            LOOM_CHECK(run_slot(l, slot, &out[j], 1, n_seq + j, 1, err));
            held[n_seq + j] = out[j];
            l->held_n[slot] = n_seq + j + 1;
        }
    }
    return k;
}

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The start-up estimate's clock: on the CPU backend the process's CPU
 * time, which the waits of a loaded machine (other jobs on its cores) do
 * not move, so forwards of different sizes compare; elsewhere (a GPU:
 * the host waits for the device) wall time. */
static double cost_clock(const loom_local_t *l) {
    return loom_backend_kind(l->be) == LOOM_DEVICE_CPU ? cpu_seconds() : (double)loom_now_ns() * 1e-9;
}

static void sleep_ms(long ms) {
    struct timespec d = {ms / 1000, ms % 1000 * 1000000L};
    nanosleep(&d, NULL);
}

/* The start-up estimate's draft side: the draft's slot 0 restarts and runs
 * hist[0], hist[1].. one a forward (the prefill it would do, a token at a
 * time), each timed (cost_clock) with its greedy pick (and the test hook's
 * delay, in wall time); the fastest of up to `reps` into *sec. */
static loom_status_t time_draft(loom_local_t *d, const int32_t *hist, int n_hist, int reps, long delay_ms,
                                double *sec, loom_err_t *err) {
    const loom_sampling_t greedy = {.temperature = 0.0f, .top_p = 1.0f};
    loom_local_forget(d, 0);
    *sec = 0;
    for (int p = 0; p < reps && p < n_hist; p++) {
        const double t = cost_clock(d);
        int32_t id;
        d->rows[0] = 0;
        LOOM_CHECK(run_slot(d, 0, hist + p, 1, p, 1, err));
        sample_rows(d, &greedy, 0, 1, &id);
        const double s = cost_clock(d) - t + (double)delay_ms * 1e-3;
        if (p == 0 || s < *sec) *sec = s;
        d->held[p] = hist[p];
        d->held_n[0] = p + 1;
    }
    return LOOM_OK;
}

/* The start-up estimate's verify side: a target forward of n tokens at
 * positions pos.. (rewritten by the next step, as rejected drafts are) and
 * the sampling of its n rows, timed (cost_clock) into *sec, in wall time
 * into *wall. */
static loom_status_t time_verify(loom_local_t *l, int32_t tok, int pos, int n, const loom_sampling_t *s,
                                 uint64_t g, double *sec, double *wall, loom_err_t *err) {
    int32_t feed[LOCAL_MAX_ROWS], ids[LOCAL_MAX_ROWS];
    for (int i = 0; i < n; i++) {
        feed[i] = tok;
        l->rows[i] = i;
    }
    const uint64_t t = loom_now_ns();
    const double c = cost_clock(l);
    LOOM_CHECK(run_chunk(l, feed, n, pos, n, err));
    sample_rows(l, s, g, n, ids);
    *sec = cost_clock(l) - c;
    *wall = (double)(loom_now_ns() - t) * 1e-9;
    return LOOM_OK;
}

loom_status_t loom_local_generate(loom_local_t *l, const int32_t *prompt, int n_prompt, int max_new,
                                  const loom_sampling_t *s, int ignore_eos, loom_token_fn on_token,
                                  void *ctx, float *prompt_logits, loom_gen_stats_t *stats,
                                  loom_err_t *err) {
    loom_gen_stats_t st = {.prompt_tokens = n_prompt};
    if (n_prompt < 1) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the prompt is empty");
    if (n_prompt >= l->ctx)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the prompt is %d tokens but the context holds %d (it needs room for at "
                            "least one generated token)",
                            n_prompt, l->ctx);
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= l->cfg.vocab_size)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "token id %d is outside the vocabulary (%d)",
                                prompt[i], l->cfg.vocab_size);
    if (max_new > l->ctx - n_prompt) max_new = l->ctx - n_prompt;
    l->held_n[0] = l->held_off[0] = 0; /* slot 0's cache is rewritten */
    uint64_t t0 = loom_now_ns();
    int vocab = l->cfg.vocab_size;
    for (int p0 = 0; p0 < n_prompt; p0 += l->chunk) {
        int n = LOOM_MIN(l->chunk, n_prompt - p0);
        int nr = 0;
        if (prompt_logits) {
            for (int i = 0; i < n; i++) l->rows[i] = i;
            nr = n;
        } else if (p0 + n == n_prompt) {
            l->rows[0] = n - 1;
            nr = 1;
        }
        LOOM_CHECK(run_chunk(l, prompt + p0, n, p0, nr, err));
        if (prompt_logits) loom_model_download_logits(l->model, prompt_logits + (size_t)p0 * vocab, n);
        if (l->mtp) { /* the module runs behind the target: the prompt's last row waits for the first token */
            if (p0 == 0) l->mtp_done = 0;
            mtp_keep_rows(l, p0, n);
            if (p0 + n < n_prompt) {
                int r = mtp_catch_up(l, prompt, p0 + n, err);
                if (r < 0) return (loom_status_t)r;
            }
        }
    }
    if (prompt_logits) { /* the sampler reads row 0: rerun the last token alone (same KV) */
        l->rows[0] = 0;
        LOOM_CHECK(run_chunk(l, prompt + n_prompt - 1, 1, n_prompt - 1, 1, err));
    }
    /* Each pass of the loop samples the last forward's rows (the token after
     * pos - 1, then one per draft fed with it), emits the sampled tokens up to
     * and including the first one that differs from its draft, and runs the
     * next forward: the last emitted token at pos plus the new drafts. KV of
     * rejected drafts (positions past the accepted ones) is simply rewritten
     * by later steps: the cache's slots are the positions. */
    memcpy(l->hist, prompt, (size_t)n_prompt * sizeof *prompt);
    int n_hist = n_prompt, pos = n_prompt, g = 0, n_draft = 0, done = max_new <= 0;
    int32_t feed[LOCAL_MAX_ROWS], sampled[LOCAL_MAX_ROWS];
    loom_spec_adapt_t adapt;
    loom_spec_adapt_init(&adapt);
    loom_spec_cost_t cost = {0}; /* measured decode / verify step times */
    loom_spec_gate_t gate;       /* drafts only while they pay in wall time */
    loom_spec_gate_init(&gate);
    loom_spec_config_t spec = l->spec;
    uint64_t t1 = 0;
    double cpu1 = 0;
    uint64_t t_step = 0; /* when the step being emitted started (its drafting included) */
    /* A test hook: every draft proposal of a draft model sleeps this long,
     * an expensive draft on demand (tests/integration/test_spec.py). */
    const char *delay_env = getenv("LOOM_TEST_DRAFT_DELAY_MS");
    const long draft_delay_ms = delay_env ? LOOM_MAX(0L, strtol(delay_env, NULL, 10)) : 0;
    /* Another: no start-up estimate, the gate as an engine without one has
     * it (drafts from the end of WARMUP), so tests reach its later states. */
    const char *no_est_env = getenv("LOOM_TEST_SPEC_NO_ESTIMATE");
    const int estimate = !(no_est_env && no_est_env[0] == '1') && !l->spec.fixed_k &&
                         (l->draft || l->spec.method == LOOM_SPEC_NGRAM);
    double t_plain = 0; /* the fastest WARMUP step's forward and sampling (cost_clock) */
    const loom_local_counters_t draft0 = l->draft ? loom_local_counters(l->draft) : (loom_local_counters_t){0};
    if (!done) {
        sample_rows(l, s, 0, 1, sampled);
        t1 = loom_now_ns();
        cpu1 = cpu_seconds();
        st.prefill_s = (double)(t1 - t0) * 1e-9;
    }
    while (!done) {
        int accepted = 0, emitted = 0;
        for (int i = 0; i <= n_draft; i++) {
            int32_t id = sampled[i];
            emitted++;
            g++;
            l->hist[n_hist++] = id;
            int match = i < n_draft && id == feed[i + 1];
            int stop = on_token ? on_token(ctx, id) : 0;
            if (stop || (!ignore_eos && loom_model_config_is_eos(&l->cfg, id)) || g == max_new) done = 1;
            if (match) accepted++;
            if (done || !match) break;
        }
        loom_spec_stats_record(&st.spec, n_draft, accepted, emitted);
        loom_spec_adapt_update(&adapt, n_draft, accepted);
        /* the gate times the whole cycle: drafting, forward, sampling, emitting */
        if (t_step) loom_spec_gate_observe(&gate, n_draft, emitted, 1, (double)(loom_now_ns() - t_step) * 1e-9);
        pos += accepted; /* the accepted drafts' KV stays; the next token goes in after them */
        if (done || pos + 1 > l->ctx) break;
        /* the last emitted token goes in at position pos (its predecessor's
         * KV is at pos - 1) */
        feed[0] = l->hist[n_hist - 1];
        int k = 0;
        if (estimate && loom_spec_gate_wants_estimate(&gate)) {
            /* Before the first drafts: what could drafting give at best? A
             * draft forward (timed first: where it alone rules drafting out,
             * the verify is not timed) and a verify step of K+1 tokens
             * against the plain steps so far, on cost_clock. The verify's
             * wall time also gives adaptive K its cost line's slope at once. */
            const int kk = LOOM_MIN(LOOM_MIN(l->spec.k, l->chunk - 1), l->ctx - pos - 1);
            double t_draft = 0, t_verify = 0;
            if (kk >= 1 && t_plain > 0) {
                if (l->draft) LOOM_CHECK(time_draft(l->draft, l->hist, n_hist, 3, draft_delay_ms, &t_draft, err));
                if (loom_spec_gate_best_case(t_plain, 0, kk, t_draft) >= 1.0 + LOOM_SPEC_GATE_START_MARGIN) {
                    double wall;
                    LOOM_CHECK(time_verify(l, feed[0], pos, kk + 1, s, (uint64_t)g, &t_verify, &wall, err));
                    loom_spec_cost_observe(&cost, kk + 1, wall);
                }
            }
            const double best = loom_spec_gate_estimate(&gate, t_plain, t_verify, kk, t_draft);
            LOOM_DEBUG("speculation estimate: plain %.3f ms, verify of %d %.3f ms, draft %.3f ms: at best %.2fx, %s",
                       t_plain * 1e3, kk + 1, t_verify * 1e3, t_draft * 1e3, best,
                       gate.started_off ? "starting off" : "drafting");
        }
        t_step = loom_now_ns();
        if (l->spec.method != LOOM_SPEC_OFF) {
            spec.verify_cost = loom_spec_cost_relative(&cost, 1, l->spec.verify_cost);
            k = loom_spec_adapt_k(&adapt, &spec, 1);
            if (!spec.fixed_k && !loom_spec_gate_step(&gate)) k = 0;
            else if (!spec.fixed_k && loom_spec_gate_probing(&gate)) k = LOOM_MAX(k, 1); /* a probe must draft */
            k = LOOM_MIN(k, max_new - g - 1);     /* never more tokens than asked */
            k = LOOM_MIN(k, l->ctx - pos - 1);    /* positions pos..pos+k must fit */
            k = LOOM_MIN(k, l->chunk - 1);        /* one forward holds at most a chunk */
            if (l->mtp) {
                n_draft = mtp_propose(l, l->hist, n_hist, k, feed + 1, err);
                if (n_draft < 0) return (loom_status_t)n_draft;
            } else if (l->draft) {
                n_draft = 0;
                if (k > 0) {
                    if (draft_delay_ms > 0) sleep_ms(draft_delay_ms);
                    /* a probe reads a recent window only: it costs the same however long the gate was off */
                    const int probing = loom_spec_gate_probing(&gate);
                    n_draft = loom_local_propose_window(l->draft, 0, l->hist, n_hist, k,
                                                        probing ? LOOM_SPEC_GATE_PROBE_WINDOW : 0, feed + 1, err);
                    if (n_draft < 0) return (loom_status_t)n_draft;
                    if (probing) st.draft_probe_read = LOOM_MAX(st.draft_probe_read, l->draft->counters.last_read);
                }
            } else {
                n_draft = k > 0 ? loom_spec_ngram_propose(l->hist, n_hist, l->spec.ngram_min, l->spec.ngram_max,
                                                          k, feed + 1)
                                : 0;
            }
        } else {
            n_draft = 0;
        }
        /* adaptive K weighs the target's verify cost alone; what drafting
         * costs is the gate's (it times the whole cycle) */
        const uint64_t ts = loom_now_ns();
        /* the estimate's plain side: WARMUP's steps on its clock (no other
         * step's: a CPU-time read is a system call, ~1 us) */
        const int time_plain = estimate && n_draft == 0 &&
                               gate.state == LOOM_SPEC_GATE_S_WARMUP && !gate.estimated;
        const double cs = time_plain ? cost_clock(l) : 0;
        for (int i = 0; i <= n_draft; i++) l->rows[i] = i;
        LOOM_CHECK(run_chunk(l, feed, n_draft + 1, pos, n_draft + 1, err));
        sample_rows(l, s, (uint64_t)g, n_draft + 1, sampled);
        if (l->mtp) mtp_keep_rows(l, pos, n_draft + 1);
        loom_spec_cost_observe(&cost, n_draft + 1, (double)(loom_now_ns() - ts) * 1e-9);
        if (time_plain) {
            const double c = cost_clock(l) - cs;
            if (t_plain == 0 || c < t_plain) t_plain = c;
        }
        pos++;
    }
    st.gen_tokens = g;
    st.gate = gate;
    if (l->draft) {
        const loom_local_counters_t d1 = loom_local_counters(l->draft);
        st.draft_forwards = d1.forwards - draft0.forwards;
        st.draft_tokens = d1.tokens - draft0.tokens;
    }
    if (t1) {
        st.decode_s = (double)(loom_now_ns() - t1) * 1e-9;
        st.decode_cpu_s = cpu_seconds() - cpu1;
    }
    if (stats) *stats = st;
    return LOOM_OK;
}

loom_status_t loom_local_mtp_logits(loom_local_t *l, const int32_t *tokens, int n, float *logits,
                                    loom_err_t *err) {
    if (!l->mtp) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "no MTP module (speculative method mtp)");
    if (n < 2 || n > l->chunk || n > l->ctx)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%d tokens: MTP logits take 2 .. %d", n,
                            LOOM_MIN(l->chunk, l->ctx));
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= l->cfg.vocab_size)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "token id %d is outside the vocabulary (%d)",
                                tokens[i], l->cfg.vocab_size);
    l->held_n[0] = l->held_off[0] = 0;
    LOOM_CHECK(run_chunk(l, tokens, n, 0, 0, err));
    mtp_keep_rows(l, 0, n);
    const size_t dim = (size_t)l->cfg.dim, vocab = (size_t)l->cfg.vocab_size;
    for (int t = 0; t + 1 < n; t++) { /* one row a step: the module's cache fills as in drafting */
        LOOM_CHECK(mtp_run(l, tokens + t + 1, l->mtp_h + (size_t)t * dim, 1, t, err));
        loom_model_download_logits(l->mtp, logits + (size_t)t * vocab, 1);
    }
    l->mtp_done = 0;
    return LOOM_OK;
}

loom_status_t loom_local_logits(loom_local_t *l, const int32_t *tokens, int n, float *logits,
                                loom_err_t *err) {
    if (n < 1 || n > l->ctx)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%d tokens for a context of %d", n, l->ctx);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= l->cfg.vocab_size)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "token id %d is outside the vocabulary (%d)",
                                tokens[i], l->cfg.vocab_size);
    l->held_n[0] = l->held_off[0] = 0;
    for (int p0 = 0; p0 < n; p0 += l->chunk) {
        int c = LOOM_MIN(l->chunk, n - p0);
        for (int i = 0; i < c; i++) l->rows[i] = i;
        LOOM_CHECK(run_chunk(l, tokens + p0, c, p0, c, err));
        loom_model_download_logits(l->model, logits + (size_t)p0 * l->cfg.vocab_size, c);
    }
    return LOOM_OK;
}
