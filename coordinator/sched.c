/* Continuous-batching scheduler over the KV ledger (see sched.h). Costs a
 * few microseconds per micro-batch: arrays, a heap, no allocation in the
 * steady state beyond sequence growth. */
#include "coordinator/sched.h"

#include <stdlib.h>
#include <string.h>

#include "common/spec_gate.h"
#include "common/util.h"

/* A finished prefill's blocks kept for a decode side's pull (loom_sched_hold). */
typedef struct kv_hold {
    uint64_t id, deadline_ns;
    int n;
    int32_t *blocks; /* (n) each holding one reference */
} kv_hold_t;

struct loom_sched {
    loom_sched_config_t cfg;
    loom_kv_ledger_t *kv;
    loom_seq_t **running; /* sorted by arrival */
    int n_running;
    loom_seq_t **heap;    /* waiting: max-heap on (priority, -arrival) */
    int n_waiting, cap_waiting;
    loom_seq_t **parked;  /* (cap_waiting) taken off the heap during one admission pass */
    loom_lora_slots_t *lora; /* adapter slots for admission, or NULL */
    loom_microbatch_t *mbs;
    int n_mbs;
    int max_blocks_per_seq;
    uint64_t next_arrival, next_mb_id;
    loom_sched_stats_t stats;
    loom_spec_config_t spec;       /* speculation (method OFF: none) */
    loom_spec_stats_t spec_stats;
    loom_spec_cost_t spec_cost;    /* measured step times (loom_sched_observe_step) */
    loom_spec_gate_t spec_gate;    /* drafts only while they pay in wall time */
    loom_sched_clock_fn clock;     /* the gate's clock (NULL: loom_now_ns) */
    void *clock_ctx;
    loom_sched_draft_fn draft;     /* method DRAFT's proposer (NULL: none) */
    loom_sched_forget_fn draft_forget;
    void *draft_ctx;
    loom_kv_connector_t *conn;     /* the KV connector (NULL: none) */
    loom_microbatch_t *building;   /* the micro-batch loom_sched_schedule fills (evicted blocks' saves) */
    uint64_t *hashes;              /* (cap_hashes) chain hashes of a prompt's full blocks */
    int cap_hashes;
    int32_t *pend_block;           /* saves of evicted blocks waiting for the next micro-batch */
    uint64_t *pend_hash;
    int n_pend, cap_pend;
    loom_sched_tier_fn tier_obs;   /* told of each block sent to the tier (NULL: none) */
    void *tier_obs_ctx;
    int dp_next;                   /* data-parallel attention: the rank ties go to first (round robin) */
    kv_hold_t *holds;              /* delayed frees (loom_sched_hold), oldest first */
    int n_holds, cap_holds, held_blocks;
};

static void attach_ledger(loom_sched_t *s);
static void write_through(loom_sched_t *s, loom_microbatch_t *mb, const loom_seq_t *q, int take);

/* ---- waiting heap ----------------------------------------------------------- */

static int before(const loom_seq_t *a, const loom_seq_t *b) {
    return a->priority > b->priority || (a->priority == b->priority && a->arrival < b->arrival);
}

static void heap_set(loom_sched_t *s, int i, loom_seq_t *q) {
    s->heap[i] = q;
    q->heap_pos = i;
}

static void heap_up(loom_sched_t *s, int i) {
    loom_seq_t *q = s->heap[i];
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!before(q, s->heap[p])) break;
        heap_set(s, i, s->heap[p]);
        i = p;
    }
    heap_set(s, i, q);
}

static void heap_down(loom_sched_t *s, int i) {
    loom_seq_t *q = s->heap[i];
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        loom_seq_t *best = q;
        if (l < s->n_waiting && before(s->heap[l], best)) {
            m = l;
            best = s->heap[l];
        }
        if (r < s->n_waiting && before(s->heap[r], best)) m = r;
        if (m == i) break;
        heap_set(s, i, s->heap[m]);
        i = m;
    }
    heap_set(s, i, q);
}

static void heap_push(loom_sched_t *s, loom_seq_t *q) {
    if (s->n_waiting == s->cap_waiting) {
        s->cap_waiting = s->cap_waiting ? 2 * s->cap_waiting : 64;
        s->heap = loom_xrealloc(s->heap, (size_t)s->cap_waiting * sizeof *s->heap);
        s->parked = loom_xrealloc(s->parked, (size_t)s->cap_waiting * sizeof *s->parked);
    }
    heap_set(s, s->n_waiting++, q);
    heap_up(s, s->n_waiting - 1);
}

static void heap_remove(loom_sched_t *s, loom_seq_t *q) {
    int i = q->heap_pos;
    LOOM_ASSERT(i >= 0 && i < s->n_waiting && s->heap[i] == q);
    q->heap_pos = -1;
    s->n_waiting--;
    if (i == s->n_waiting) return;
    loom_seq_t *x = s->heap[s->n_waiting];
    heap_set(s, i, x);
    heap_down(s, i);
    heap_up(s, x->heap_pos);
}

/* ---- running array (sorted by arrival) ---------------------------------------- */

static void run_insert(loom_sched_t *s, loom_seq_t *q) {
    int lo = 0, hi = s->n_running;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (s->running[mid]->arrival < q->arrival) lo = mid + 1;
        else hi = mid;
    }
    memmove(s->running + lo + 1, s->running + lo, (size_t)(s->n_running - lo) * sizeof *s->running);
    s->running[lo] = q;
    s->n_running++;
    for (int i = lo; i < s->n_running; i++) s->running[i]->run_pos = i;
}

static void run_remove(loom_sched_t *s, loom_seq_t *q) {
    int i = q->run_pos;
    LOOM_ASSERT(i >= 0 && i < s->n_running && s->running[i] == q);
    memmove(s->running + i, s->running + i + 1, (size_t)(s->n_running - i - 1) * sizeof *s->running);
    s->n_running--;
    for (int j = i; j < s->n_running; j++) s->running[j]->run_pos = j;
    q->run_pos = -1;
}

/* ---- create / destroy ----------------------------------------------------------- */

loom_sched_t *loom_sched_create(const loom_sched_config_t *cfg) {
    loom_sched_t *s = loom_xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    if (s->cfg.n_micro < 1) s->cfg.n_micro = 1;
    if (s->cfg.n_dp < 1) s->cfg.n_dp = 1;
    LOOM_ASSERT(s->cfg.n_dp <= LOOM_SCHED_MAX_DP);
    s->kv = loom_kv_create_parts(cfg->n_blocks, cfg->block_size, cfg->prefix_cache, s->cfg.n_dp);
    attach_ledger(s);
    s->max_blocks_per_seq = (cfg->max_model_len + cfg->block_size - 1) / cfg->block_size + 1;
    s->running = loom_xcalloc((size_t)cfg->max_num_seqs, sizeof *s->running);
    s->n_mbs = s->cfg.n_micro + (s->cfg.ahead > 0 ? s->cfg.ahead : 0);
    s->mbs = loom_xcalloc((size_t)s->n_mbs, sizeof *s->mbs);
    size_t T = (size_t)cfg->max_batched_tokens, S = (size_t)cfg->max_num_seqs;
    for (int i = 0; i < s->n_mbs; i++) {
        loom_microbatch_t *mb = &s->mbs[i];
        mb->tokens = loom_xmalloc(T * sizeof(int32_t));
        mb->pos = loom_xmalloc(T * sizeof(int32_t));
        mb->slots = loom_xmalloc(T * sizeof(int32_t));
        mb->tok_seq = loom_xmalloc(T * sizeof(int32_t));
        mb->seqs = loom_xmalloc(S * sizeof(loom_seq_t *));
        mb->chunk = loom_xmalloc(S * sizeof(int));
        mb->block_tables = loom_xmalloc(S * (size_t)s->max_blocks_per_seq * sizeof(int32_t));
        mb->seq_lora = loom_xmalloc(S * sizeof(int32_t));
        mb->seq_dp_rank = loom_xmalloc(S * sizeof(int32_t));
        mb->logit_rows = loom_xmalloc(S * sizeof(int32_t));
        mb->logit_seq = loom_xmalloc(S * sizeof(loom_seq_t *));
        mb->sampling = loom_xmalloc(S * sizeof(loom_sampling_t));
        mb->steps = loom_xmalloc(S * sizeof(uint64_t));
        mb->copy_src = loom_xmalloc(S * sizeof(int32_t));
        mb->copy_dst = loom_xmalloc(S * sizeof(int32_t));
        mb->embed_begin = loom_xmalloc(S * sizeof(int32_t));
        mb->embed_end = loom_xmalloc(S * sizeof(int32_t));
        mb->embed_pos = loom_xmalloc(S * sizeof(int32_t));
        mb->embed_seq = loom_xmalloc(S * sizeof(loom_seq_t *));
        mb->embed_final = loom_xmalloc(S * sizeof(int));
        mb->plp_rows = loom_xmalloc(T * sizeof(int32_t));
        mb->plp_ids = loom_xmalloc(T * sizeof(int32_t));
        mb->plp_pos = loom_xmalloc(T * sizeof(int32_t));
        mb->plp_top = loom_xmalloc(T * sizeof(uint32_t));
        mb->plp_seq = loom_xmalloc(T * sizeof(loom_seq_t *));
        mb->spec_n = loom_xcalloc(S, sizeof(int));
        mb->spec_row0 = loom_xcalloc(S, sizeof(int));
        mb->spec_row = loom_xcalloc(S, sizeof(uint8_t));
        mb->prev_rows = loom_xmalloc(T * sizeof(int32_t));
    }
    return s;
}

/* q's pin on its adapter's slot goes (finished or preempted). */
static void lora_unpin(loom_sched_t *s, loom_seq_t *q) {
    if (q->lora_slot < 0) return;
    if (s->lora) loom_lora_slots_release(s->lora, q->lora_slot);
    q->lora_slot = -1;
}

static void pull_free(loom_seq_pull_t **p) {
    if (!*p) return;
    free((*p)->remote);
    free((*p)->addrs);
    free(*p);
    *p = NULL;
}

static void seq_free(loom_sched_t *s, loom_seq_t *q) {
    lora_unpin(s, q);
    pull_free(&q->pull);
    if (s->draft_forget) s->draft_forget(s->draft_ctx, q);
    for (int i = q->n_dropped; i < q->n_blocks; i++) loom_kv_release(s->kv, q->blocks[i]);
    free(q->blocks);
    free(q->tokens);
    free(q);
}

void loom_sched_destroy(loom_sched_t **s_p) {
    if (!s_p || !*s_p) return;
    loom_sched_t *s = *s_p;
    *s_p = NULL;
    /* sequences finished while in flight live only in their micro-batch */
    for (int i = 0; i < s->n_mbs; i++) {
        loom_microbatch_t *mb = &s->mbs[i];
        if (mb->in_use)
            for (int j = 0; j < mb->n_seqs; j++)
                if (mb->seqs[j]->finish_pending && --mb->seqs[j]->in_flight == 0) seq_free(s, mb->seqs[j]);
    }
    for (int i = 0; i < s->n_running; i++) seq_free(s, s->running[i]);
    for (int i = 0; i < s->n_waiting; i++) seq_free(s, s->heap[i]);
    while (s->n_holds > 0) loom_sched_unhold(s, s->holds[0].id);
    free(s->holds);
    for (int i = 0; i < s->n_mbs; i++) {
        loom_microbatch_t *mb = &s->mbs[i];
        free(mb->tokens);
        free(mb->pos);
        free(mb->slots);
        free(mb->tok_seq);
        free(mb->seqs);
        free(mb->chunk);
        free(mb->block_tables);
        free(mb->seq_lora);
        free(mb->seq_dp_rank);
        free(mb->logit_rows);
        free(mb->logit_seq);
        free(mb->sampling);
        free(mb->steps);
        free(mb->copy_src);
        free(mb->copy_dst);
        free(mb->embed_begin);
        free(mb->embed_end);
        free(mb->embed_pos);
        free(mb->embed_seq);
        free(mb->embed_final);
        free(mb->plp_rows);
        free(mb->plp_ids);
        free(mb->plp_pos);
        free(mb->plp_top);
        free(mb->plp_seq);
        free(mb->spec_n);
        free(mb->spec_row0);
        free(mb->spec_row);
        free(mb->prev_rows);
        free(mb->save_block);
        free(mb->save_hash);
        free(mb->load_block);
        free(mb->load_hash);
        free(mb->pull_block);
        free(mb->pull_remote);
        free(mb->pull_src);
        free(mb->pull_seq);
        free(mb->pull_addrs);
        free(mb->pull_transfer);
        free(mb->save_after_block);
        free(mb->save_after_hash);
        free(mb->save_slot);
        free(mb->load_slot);
        free(mb->save_after_slot);
    }
    free(s->hashes);
    free(s->pend_block);
    free(s->pend_hash);
    free(s->mbs);
    free(s->running);
    free(s->heap);
    free(s->parked);
    loom_kv_destroy(&s->kv);
    free(s);
}

const loom_sched_config_t *loom_sched_config(const loom_sched_t *s) { return &s->cfg; }
loom_kv_ledger_t *loom_sched_ledger(loom_sched_t *s) { return s->kv; }

/* ---- requests -------------------------------------------------------------------- */

loom_status_t loom_sched_add(loom_sched_t *s, uint64_t id, const int32_t *prompt, int n_prompt,
                             int max_tokens, int priority, const loom_sampling_t *sampling,
                             void *user, loom_seq_t **out, loom_err_t *err) {
    const loom_sched_config_t *c = &s->cfg;
    *out = NULL;
    if (n_prompt < 1) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the prompt is empty");
    if (max_tokens < 0) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "max_tokens %d is negative", max_tokens);
    if (n_prompt >= c->max_model_len)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the prompt is %d tokens but the context length is %d (room for at least one "
                            "generated token is needed)",
                            n_prompt, c->max_model_len);
    if (max_tokens == 0) max_tokens = c->max_model_len - n_prompt;
    if ((int64_t)n_prompt + max_tokens > c->max_model_len)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the prompt is %d tokens and max_tokens is %d: %lld exceeds the context length %d",
                            n_prompt, max_tokens, (long long)n_prompt + max_tokens, c->max_model_len);
    int64_t need = ((int64_t)n_prompt + max_tokens + c->block_size - 1) / c->block_size;
    if (need > c->n_blocks / s->cfg.n_dp)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the request needs %lld KV blocks of %d tokens but the whole cache holds %d%s",
                            (long long)need, c->block_size, c->n_blocks / s->cfg.n_dp,
                            s->cfg.n_dp > 1 ? " (one data-parallel attention rank's)" : "");
    if (s->n_waiting >= c->max_queue)
        return loom_err_set(err, LOOM_ERR_RESOURCE_EXHAUSTED,
                            "the waiting queue is full (%d requests); retry later", c->max_queue);
    loom_seq_t *q = loom_xcalloc(1, sizeof *q);
    q->id = id;
    q->user = user;
    q->cap_tokens = n_prompt + max_tokens;
    q->tokens = loom_xmalloc((size_t)q->cap_tokens * sizeof *q->tokens);
    memcpy(q->tokens, prompt, (size_t)n_prompt * sizeof *prompt);
    q->n_tokens = q->n_prompt = n_prompt;
    q->max_tokens = max_tokens;
    q->cap_blocks = (int)need + 1;
    q->blocks = loom_xmalloc((size_t)q->cap_blocks * sizeof *q->blocks);
    q->sampling = *sampling;
    q->priority = priority;
    q->arrival = s->next_arrival++;
    q->state = LOOM_SEQ_WAITING;
    q->run_pos = -1;
    q->t_arrival_ns = loom_now_ns();
    q->prompt_hash = loom_kv_chain_hash(0, prompt, n_prompt);
    q->lora_id = q->lora_slot = -1;
    q->dp_rank = -1;
    heap_push(s, q);
    *out = q;
    return LOOM_OK;
}

loom_status_t loom_sched_add_embed(loom_sched_t *s, uint64_t id, const int32_t *prompt, int n_prompt,
                                   loom_pooling_t pooling, int priority, void *user, loom_seq_t **out,
                                   loom_err_t *err) {
    if (pooling != LOOM_POOL_LAST && pooling != LOOM_POOL_MEAN)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "unknown pooling %d", (int)pooling);
    loom_sampling_t none = {0};
    LOOM_CHECK(loom_sched_add(s, id, prompt, n_prompt, 1, priority, &none, user, out, err));
    (*out)->embed = pooling;
    return LOOM_OK;
}

/* An embedding sequence's share of a chunk: the whole chunk (mean), or its
 * last token once the chunk reaches the end of the prompt (last). */
static void add_embed_range(loom_microbatch_t *mb, loom_seq_t *q, int take) {
    int end = q->n_computed + take == q->n_tokens;
    if (q->embed == LOOM_POOL_LAST && !end) return;
    int e = mb->n_embeds++, t1 = mb->n_tokens;
    int t0 = q->embed == LOOM_POOL_LAST ? t1 - 1 : t1 - take;
    mb->embed_begin[e] = t0;
    mb->embed_end[e] = t1;
    mb->embed_pos[e] = mb->pos[t0];
    mb->embed_seq[e] = q;
    mb->embed_final[e] = end;
}

/* Drops a running sequence's KV and sends it back to the waiting queue. */
/* Releases every block of q's table (the dropped ones are gone already). */
static void release_blocks(loom_sched_t *s, loom_seq_t *q) {
    for (int i = q->n_dropped; i < q->n_blocks; i++) loom_kv_release(s->kv, q->blocks[i]);
    q->n_blocks = 0;
    q->n_dropped = 0;
}

/* Sliding window: releases the blocks wholly before the first position the
 * next query attends to (n_computed + 1 - window), see sched.h. */
static void drop_behind_window(loom_sched_t *s, loom_seq_t *q) {
    const int W = s->cfg.window, B = s->cfg.block_size;
    if (W <= 0) return;
    const int first_seen = q->n_computed + 1 - W;
    while (q->n_dropped < q->n_blocks && (q->n_dropped + 1) * B <= first_seen) {
        LOOM_ASSERT(q->n_dropped < q->n_hashed); /* registered before it goes */
        loom_kv_release(s->kv, q->blocks[q->n_dropped]);
        q->blocks[q->n_dropped++] = -1;
    }
}

static void preempt(loom_sched_t *s, loom_seq_t *q) {
    run_remove(s, q);
    release_blocks(s, q);
    lora_unpin(s, q);
    q->n_computed = 0;
    q->n_hashed = 0;
    q->chain = q->lora_seed;
    q->state = LOOM_SEQ_WAITING;
    q->n_preempted++;
    s->stats.preemptions++;
    heap_push(s, q);
}

static int in_mb(const loom_microbatch_t *mb, const loom_seq_t *q) {
    for (int i = 0; i < mb->n_seqs; i++)
        if (mb->seqs[i] == q) return 1;
    return 0;
}

/* Frees `need` blocks by preempting running sequences younger than q (the
 * youngest first) that are neither in flight nor in this micro-batch. */
static int make_room(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q, int need) {
    for (int i = s->n_running - 1; i >= 0 && loom_kv_part_free(s->kv, q->dp_rank) < need; i--) {
        loom_seq_t *v = s->running[i];
        if (v == q || v->arrival < q->arrival) break;
        if (v->in_flight || in_mb(mb, v) || v->dp_rank != q->dp_rank) continue; /* only q's partition helps */
        preempt(s, v);
    }
    return loom_kv_part_free(s->kv, q->dp_rank) >= need;
}

/* Blocks needed so that positions [0, upto) have a block. */
static int blocks_needed(const loom_sched_t *s, const loom_seq_t *q, int upto) {
    int want = (upto + s->cfg.block_size - 1) / s->cfg.block_size;
    return want > q->n_blocks ? want - q->n_blocks : 0;
}

static void grow(loom_sched_t *s, loom_seq_t *q, int upto) {
    for (int n = blocks_needed(s, q, upto); n > 0; n--) {
        int b = loom_kv_alloc_in(s->kv, q->dp_rank);
        LOOM_ASSERT(b >= 0);
        if (q->n_blocks == q->cap_blocks) {
            q->cap_blocks *= 2;
            q->blocks = loom_xrealloc(q->blocks, (size_t)q->cap_blocks * sizeof *q->blocks);
        }
        q->blocks[q->n_blocks++] = b;
    }
}

/* Appends tokens [n_computed, n_computed + take) of q to the micro-batch. */
static void add_chunk(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q, int take) {
    int B = s->cfg.block_size, si = mb->n_seqs++;
    mb->seqs[si] = q;
    mb->chunk[si] = take;
    mb->spec_n[si] = 0;
    for (int i = 0; i < take; i++) {
        int p = q->n_computed + i, t = mb->n_tokens++;
        mb->tokens[t] = q->tokens[p];
        mb->pos[t] = p;
        mb->slots[t] = q->blocks[p / B] * B + p % B;
        mb->tok_seq[t] = si;
        if (p < q->n_prompt) s->stats.prompt_tokens_computed++;
        if (q->prompt_lp && p + 1 < q->n_prompt) {
            int e = mb->n_plp++;
            mb->plp_rows[e] = t;
            mb->plp_ids[e] = q->tokens[p + 1];
            mb->plp_pos[e] = p;
            mb->plp_top[e] = (uint32_t)q->prompt_lp_top;
            mb->plp_seq[e] = q;
        }
    }
    if (q->embed) {
        add_embed_range(mb, q, take);
    } else if (q->n_computed + take == q->n_tokens) { /* the chunk reaches the end: sample the next token */
        int r = mb->n_logits++;
        mb->logit_rows[r] = mb->n_tokens - 1;
        mb->logit_seq[r] = q;
        mb->sampling[r] = q->sampling;
        mb->steps[r] = q->step_offset + (uint64_t)(q->n_tokens - q->n_prompt);
        mb->spec_row[r] = 0;
    }
    write_through(s, mb, q, take);
    q->in_flight = 1;
    s->stats.scheduled_tokens += (uint64_t)take;
}

/* ---- the KV connector (loom_sched_set_connector) -------------------------------- */

static void xfer_push(int32_t **blk, uint64_t **hash, int *n, int *cap, int32_t b, uint64_t h) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 16;
        *blk = loom_xrealloc(*blk, (size_t)*cap * sizeof **blk);
        *hash = loom_xrealloc(*hash, (size_t)*cap * sizeof **hash);
    }
    (*blk)[*n] = b;
    (*hash)[(*n)++] = h;
}

/* A save planned; lower: into the connector's lower tier (the directory
 * under the host tier). The observer (KV events) hears of the saves into
 * the shared tier: the only one, or the lower one. */
static void tier_saved(loom_sched_t *s, uint64_t hash, int lower) {
    s->stats.tier_saves++;
    if (lower) s->stats.lower_saves++;
    if (s->tier_obs && (lower || !s->conn->lower)) s->tier_obs(s->tier_obs_ctx, hash);
}

void loom_sched_set_tier_observer(loom_sched_t *s, loom_sched_tier_fn fn, void *ctx) {
    s->tier_obs = fn;
    s->tier_obs_ctx = ctx;
}

/* The ledger is evicting a cached block for this micro-batch: write-back.
 * The save precedes, on every worker, whatever the step writes into it; a
 * block the tier gives up for it (a spill, block -1) is written down to
 * the lower tier just before. */
static void on_evict(void *ctx, int block, uint64_t hash) {
    loom_sched_t *s = ctx;
    loom_microbatch_t *mb = s->building;
    if (!mb || !s->conn) return;
    uint64_t spill = 0;
    int to = loom_kv_connector_evict(s->conn, hash, &spill);
    if (spill) {
        xfer_push(&mb->save_block, &mb->save_hash, &mb->n_saves, &mb->cap_saves, -1, spill);
        tier_saved(s, spill, 1);
    }
    if (!to) return;
    xfer_push(&mb->save_block, &mb->save_hash, &mb->n_saves, &mb->cap_saves, block, hash);
    tier_saved(s, hash, to == 2);
}

static void attach_ledger(loom_sched_t *s) { loom_kv_set_evict_hook(s->kv, on_evict, s); }

void loom_sched_set_connector(loom_sched_t *s, loom_kv_connector_t *c) {
    s->conn = c;
    s->n_pend = 0;
}

/* Write-through: the blocks q's chunk of take tokens fills are saved by
 * the same step after its layers (mb->save_after_*), so they are in the
 * tier when its result comes back (a prefill for a remote decode). */
static void write_through(loom_sched_t *s, loom_microbatch_t *mb, const loom_seq_t *q, int take) {
    if (!s->conn || !(s->conn->write_through || q->kv_save)) return;
    const int B = s->cfg.block_size, first = q->n_computed / B, end = (q->n_computed + take) / B;
    uint64_t h = q->chain;
    for (int i = q->n_hashed; i < end; i++) {
        h = loom_kv_chain_hash(h, q->tokens + (size_t)i * B, B);
        if (i < first || i < q->n_dropped || !loom_kv_connector_offer(s->conn, h)) continue;
        xfer_push(&mb->save_after_block, &mb->save_after_hash, &mb->n_saves_after, &mb->cap_saves_after, q->blocks[i],
                  h);
        tier_saved(s, h, s->conn->lower != NULL);
    }
}

/* A remote decode's prefill (kv_save) admitted with blocks it did not
 * compute (the prefix cache's, the tier's): those the tier lacks are saved
 * too, after the step, so the decode side finds the whole prefix. */
static void save_admitted(loom_sched_t *s, loom_microbatch_t *mb, const loom_seq_t *q) {
    if (!s->conn || !q->kv_save) return;
    const int B = s->cfg.block_size;
    uint64_t h = q->lora_seed;
    for (int i = 0; i < q->n_computed / B; i++) {
        h = loom_kv_chain_hash(h, q->tokens + (size_t)i * B, B);
        if (i < q->n_dropped || !loom_kv_connector_offer(s->conn, h)) continue;
        xfer_push(&mb->save_after_block, &mb->save_after_hash, &mb->n_saves_after, &mb->cap_saves_after, q->blocks[i],
                  h);
        tier_saved(s, h, s->conn->lower != NULL);
    }
}

/* The step's moves get their slots (a connector with slots: the host
 * tier); a save whose slot a later one took is dropped (nothing will load
 * it); a move of the lower tier keeps LOOM_KV_SLOT_LOWER. */
static void plan_slots(loom_sched_t *s, loom_microbatch_t *mb) {
    if (!loom_kv_connector_has_slots(s->conn)) return;
    int need = LOOM_MAX(LOOM_MAX(mb->n_saves, mb->n_loads), LOOM_MAX(mb->n_saves_after, 1));
    if (mb->cap_slots < need) {
        mb->cap_slots = need;
        mb->save_slot = loom_xrealloc(mb->save_slot, (size_t)need * sizeof *mb->save_slot);
        mb->load_slot = loom_xrealloc(mb->load_slot, (size_t)need * sizeof *mb->load_slot);
        mb->save_after_slot = loom_xrealloc(mb->save_after_slot, (size_t)need * sizeof *mb->save_after_slot);
    }
    loom_kv_connector_plan(s->conn, mb->save_hash, mb->n_saves, mb->save_slot, mb->load_hash, mb->n_loads,
                           mb->load_slot, mb->save_after_hash, mb->n_saves_after, mb->save_after_slot);
    int n = 0;
    for (int i = 0; i < mb->n_saves; i++) {
        if (mb->save_slot[i] == LOOM_KV_SLOT_DROP) {
            s->stats.tier_saves--;
            if (mb->save_block[i] < 0) s->stats.lower_saves--;
            continue;
        }
        mb->save_block[n] = mb->save_block[i];
        mb->save_hash[n] = mb->save_hash[i];
        mb->save_slot[n++] = mb->save_slot[i];
    }
    mb->n_saves = n;
    n = 0;
    for (int i = 0; i < mb->n_saves_after; i++) {
        if (mb->save_after_slot[i] == LOOM_KV_SLOT_DROP) {
            s->stats.tier_saves--;
            if (s->conn->lower) s->stats.lower_saves--;
            continue;
        }
        mb->save_after_block[n] = mb->save_after_block[i];
        mb->save_after_hash[n] = mb->save_after_hash[i];
        mb->save_after_slot[n++] = mb->save_after_slot[i];
    }
    mb->n_saves_after = n;
    for (int i = 0; i < mb->n_loads; i++) {
        LOOM_ASSERT(mb->load_slot[i] >= 0 || (s->conn->lower && mb->load_slot[i] == LOOM_KV_SLOT_LOWER));
        if (mb->load_slot[i] < 0) s->stats.lower_hits++; /* a host slot's: matched this step, pinned */
    }
}

/* Full blocks of q's prompt beyond its prefix-cache hit that the connector
 * holds: each gets a fresh block, loaded by the step before it runs. The
 * pool evicts a chain from its front first, so blocks after the tier's run
 * may still be in the pool: the walk takes each block from the pool when it
 * is there (retained first, so the loads' allocations never evict them),
 * else from the tier, and stops at the first block in neither (never at or
 * beyond the block of the last position, which always runs). Returns 1,
 * taking nothing, when q should wait: the connector is still looking for the
 * block the walk stopped at (loom_kv_connector_waiting, a bounded wait). */
/* s->hashes[0, n): the chain hashes of q's first n full blocks (from its adapter's seed). */
static void prompt_hashes(loom_sched_t *s, const loom_seq_t *q, int n) {
    const int B = s->cfg.block_size;
    if (s->cap_hashes < n) {
        s->cap_hashes = n;
        s->hashes = loom_xrealloc(s->hashes, (size_t)n * sizeof *s->hashes);
    }
    uint64_t h = q->lora_seed;
    for (int i = 0; i < n; i++) s->hashes[i] = h = loom_kv_chain_hash(h, q->tokens + (size_t)i * B, B);
}

void loom_sched_seq_set_pull(loom_sched_t *s, loom_seq_t *q, int n, const int32_t *remote, const char *addrs,
                             uint64_t transfer) {
    (void)s;
    LOOM_ASSERT(q->state == LOOM_SEQ_WAITING && q->n_blocks == 0 && !q->admitted_once && n >= 0);
    pull_free(&q->pull);
    if (n == 0) return;
    loom_seq_pull_t *p = loom_xcalloc(1, sizeof *p);
    p->n = n;
    p->remote = loom_xmalloc((size_t)n * sizeof *p->remote);
    memcpy(p->remote, remote, (size_t)n * sizeof *p->remote);
    p->addrs = loom_xstrdup(addrs);
    p->transfer = transfer;
    q->pull = p;
}

void loom_sched_pull_failed(loom_sched_t *s, loom_seq_t *q) {
    (void)s;
    if (!q->pull) return;
    /* its next admission is its first: cached_tokens then counts what the prefix cache gives, not the pull */
    q->admitted_once = 0;
    q->cached_tokens = 0;
    q->pull->tried = 1;
}

/* Transport tcp: q's prompt blocks beyond its prefix-cache hit that a
 * prefill replica holds get fresh blocks, filled by the step from there
 * (out of blocks: the run stops before the first one missing). Once. */
static void pull_lookup(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q) {
    loom_seq_pull_t *p = q->pull;
    const int B = s->cfg.block_size, have = q->n_blocks;
    if (!p || p->tried) return;
    p->tried = 1;
    const int lim = LOOM_MIN(p->n, (q->n_tokens - 1) / B);
    int end = have;
    for (; q->n_computed == have * B && end < lim; end++) {
        int b = loom_kv_alloc_in(s->kv, q->dp_rank);
        if (b < 0) break;
        q->blocks[end] = b;
    }
    /* a source even with nothing to pull (the prefix cache had it all, or
     * no block was free): the workers still tell the prefill side it may
     * free its hold */
    if (mb->n_pull_srcs == mb->cap_pull_srcs) {
        mb->cap_pull_srcs = mb->cap_pull_srcs ? 2 * mb->cap_pull_srcs : 4;
        mb->pull_seq = loom_xrealloc(mb->pull_seq, (size_t)mb->cap_pull_srcs * sizeof *mb->pull_seq);
        mb->pull_addrs = loom_xrealloc(mb->pull_addrs, (size_t)mb->cap_pull_srcs * sizeof *mb->pull_addrs);
        mb->pull_transfer = loom_xrealloc(mb->pull_transfer, (size_t)mb->cap_pull_srcs * sizeof *mb->pull_transfer);
    }
    const int src = mb->n_pull_srcs++;
    mb->pull_seq[src] = q;
    mb->pull_addrs[src] = p->addrs;
    mb->pull_transfer[src] = p->transfer;
    for (int i = have; i < end; i++) {
        if (mb->n_pulls == mb->cap_pulls) {
            mb->cap_pulls = mb->cap_pulls ? 2 * mb->cap_pulls : 16;
            mb->pull_block = loom_xrealloc(mb->pull_block, (size_t)mb->cap_pulls * sizeof *mb->pull_block);
            mb->pull_remote = loom_xrealloc(mb->pull_remote, (size_t)mb->cap_pulls * sizeof *mb->pull_remote);
            mb->pull_src = loom_xrealloc(mb->pull_src, (size_t)mb->cap_pulls * sizeof *mb->pull_src);
        }
        mb->pull_block[mb->n_pulls] = q->blocks[i];
        mb->pull_remote[mb->n_pulls] = p->remote[i];
        mb->pull_src[mb->n_pulls++] = (uint32_t)src;
    }
    q->n_blocks = end;
    q->n_computed = end * B;
    s->stats.pulled_blocks += (uint64_t)(end - have);
}

static int tier_lookup(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q) {
    const int B = s->cfg.block_size, nb = q->n_tokens / B, lim = (q->n_tokens - 1) / B, have = q->n_blocks;
    if (!s->conn || q->n_computed != have * B || have >= lim) return 0;
    prompt_hashes(s, q, nb);
    loom_kv_conn_req_t r = {.id = q->id, .tokens = q->tokens, .n_tokens = q->n_tokens, .block_hashes = s->hashes,
                            .block_size = B};
    int end = have, tier_end = have, wait = 0; /* blocks [have, end) found; those before tier_end are in the tier */
    while (end < lim) {
        int b = loom_kv_lookup_in(s->kv, q->dp_rank, s->hashes[end], q->tokens + (size_t)end * B);
        if (b >= 0) {
            q->blocks[end++] = b;
            s->stats.prefix_hits++;
            continue;
        }
        if (end >= tier_end) {
            tier_end = end + loom_kv_connector_match(s->conn, &r, end * B, NULL) / B;
            if (tier_end == end) {
                wait = loom_kv_connector_waiting(s->conn, &r);
                break;
            }
        }
        q->blocks[end++] = -1; /* to be loaded */
    }
    if (wait) {
        for (int i = have; i < end; i++)
            if (q->blocks[i] >= 0) loom_kv_release(s->kv, q->blocks[i]);
        s->stats.tier_waits++;
        return 1;
    }
    s->stats.tier_queries += (uint64_t)(lim - have);
    /* the loads' blocks, in order; out of blocks: the chain ends before the first one missing */
    int n_loaded = 0;
    for (int i = have; i < end; i++) {
        if (q->blocks[i] >= 0) continue;
        int b = loom_kv_alloc_in(s->kv, q->dp_rank);
        if (b < 0) {
            for (int j = i + 1; j < end; j++)
                if (q->blocks[j] >= 0) loom_kv_release(s->kv, q->blocks[j]);
            end = i;
            break;
        }
        q->blocks[i] = b;
        n_loaded++;
        xfer_push(&mb->load_block, &mb->load_hash, &mb->n_loads, &mb->cap_loads, b, s->hashes[i]);
    }
    q->n_blocks = end;
    loom_kv_connector_after_alloc(s->conn, &r, q->blocks + have, end - have, n_loaded * B);
    q->n_computed = end * B;
    s->stats.tier_hits += (uint64_t)n_loaded;
    return 0;
}

/* Reuses cached full blocks of q's tokens (prefix caching); 1 when q
 * should wait for the tier (tier_lookup). */
static int prefix_lookup(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q) {
    int B = s->cfg.block_size, nb = q->n_tokens / B;
    uint64_t parent = q->lora_seed, prev = q->lora_seed;
    int hits = 0;
    for (; hits < nb; hits++) {
        uint64_t h = loom_kv_chain_hash(parent, q->tokens + (size_t)hits * B, B);
        int b = loom_kv_lookup_in(s->kv, q->dp_rank, h, q->tokens + (size_t)hits * B);
        if (b < 0) break;
        q->blocks[q->n_blocks++] = b;
        prev = parent;
        parent = h;
    }
    s->stats.prefix_queries += (uint64_t)nb;
    s->stats.prefix_hits += (uint64_t)hits;
    q->n_hashed = hits;
    q->chain = parent;
    q->n_computed = hits * B;
    if (hits > 0 && q->n_computed == q->n_tokens) {
        /* Everything is cached, but the last token must run to give logits:
         * it rewrites a shared block, so copy that block first. */
        int old = q->blocks[hits - 1], fresh = loom_kv_alloc_in(s->kv, q->dp_rank);
        if (fresh >= 0) {
            mb->copy_src[mb->n_copies] = old;
            mb->copy_dst[mb->n_copies] = fresh;
            mb->n_copies++;
            q->blocks[hits - 1] = fresh;
            q->n_computed = q->n_tokens - 1;
        } else { /* no block to copy into: recompute the whole last block */
            q->n_blocks--;
            q->n_computed -= B;
        }
        loom_kv_release(s->kv, old);
        q->n_hashed = hits - 1;
        q->chain = prev;
    }
    pull_lookup(s, mb, q);
    return tier_lookup(s, mb, q);
}

/* KV fork (sched.h): what admission does with a waiting q whose prompt a
 * running sequence also has. */
typedef enum { FORK_NONE = 0, FORK_PARK, FORK_DONE } fork_t;

/* A running sequence with q's prompt whose KV q may share: no blocks
 * dropped behind a window, not an embedding (finished after its prefill). */
static loom_seq_t *fork_leader(loom_sched_t *s, const loom_seq_t *q) {
    for (int i = 0; i < s->n_running; i++) {
        loom_seq_t *l = s->running[i];
        if (l->n_prompt != q->n_prompt || l->prompt_hash != q->prompt_hash || l->lora_id != q->lora_id ||
            l->embed || l->n_dropped > 0 || (q->dp_rank >= 0 && l->dp_rank != q->dp_rank) ||
            l->n_blocks == 0 || memcmp(l->tokens, q->tokens, (size_t)q->n_prompt * sizeof *q->tokens))
            continue;
        return l;
    }
    return NULL;
}

/* Parks q behind a leader still in its prefill, or forks q from a leader
 * whose prompt is computed: the full prompt blocks are shared, the one
 * holding position n_prompt - 1 is copied into a fresh block before the
 * step, which runs that position again for q's own logits. */
static fork_t fork_lookup(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q) {
    if (q->embed || q->prompt_lp || q->n_tokens != q->n_prompt || q->n_blocks != 0) return FORK_NONE;
    loom_seq_t *l = fork_leader(s, q);
    if (!l) return FORK_NONE;
    if (l->n_computed < l->n_prompt) return FORK_PARK;
    int B = s->cfg.block_size, last = (q->n_prompt - 1) / B; /* the block holding position n_prompt - 1 */
    LOOM_ASSERT(l->n_blocks > last && q->cap_blocks > last);
    int fresh = loom_kv_alloc_in(s->kv, q->dp_rank);
    if (fresh < 0) return FORK_NONE;
    uint64_t chain = q->lora_seed;
    for (int i = 0; i < last; i++) {
        loom_kv_retain(s->kv, l->blocks[i]);
        q->blocks[i] = l->blocks[i];
        chain = loom_kv_chain_hash(chain, q->tokens + (size_t)i * B, B);
    }
    q->blocks[last] = fresh;
    q->n_blocks = last + 1;
    mb->copy_src[mb->n_copies] = l->blocks[last];
    mb->copy_dst[mb->n_copies] = fresh;
    mb->n_copies++;
    q->n_hashed = last;
    q->chain = chain;
    q->n_computed = q->n_prompt - 1;
    return FORK_DONE;
}

/* Data-parallel attention (cfg.n_dp > 1): binds a sequence without blocks
 * to the rank whose partition will hold them: that of a running twin it
 * may fork from, else the one caching the longest prefix of its tokens,
 * else the one with the most free blocks; ties go round robin. */
static void bind_rank(loom_sched_t *s, loom_seq_t *q) {
    const int n = s->cfg.n_dp, B = s->cfg.block_size, nb = q->n_tokens / B;
    if (n == 1) {
        q->dp_rank = 0;
        return;
    }
    q->dp_rank = -1;
    loom_seq_t *l = q->embed || q->prompt_lp || q->n_tokens != q->n_prompt ? NULL : fork_leader(s, q);
    if (l) {
        q->dp_rank = l->dp_rank;
        return;
    }
    const int lookup = q->embed != LOOM_POOL_MEAN && !q->prompt_lp ? nb : 0; /* blocks to look up */
    prompt_hashes(s, q, lookup);
    int best = -1, best_hits = -1, best_free = -1;
    for (int k = 0; k < n; k++) {
        int p = (s->dp_next + k) % n, hits = 0;
        while (hits < lookup && loom_kv_peek_in(s->kv, p, s->hashes[hits], q->tokens + (size_t)hits * B) >= 0)
            hits++;
        int fr = loom_kv_part_free(s->kv, p);
        if (hits > best_hits || (hits == best_hits && fr > best_free)) {
            best = p;
            best_hits = hits;
            best_free = fr;
        }
    }
    q->dp_rank = best;
    s->dp_next = (best + 1) % n;
}

/* Takes back what pull_lookup added to mb for q since it held pulls0
 * pulls and srcs0 sources; q's pull is to be tried again. */
static void undo_pulls(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q, int pulls0, int srcs0) {
    if (mb->n_pull_srcs > srcs0) {
        s->stats.pulled_blocks -= (uint64_t)(mb->n_pulls - pulls0);
        q->pull->tried = 0;
    }
    mb->n_pulls = pulls0;
    mb->n_pull_srcs = srcs0;
}

static void undo_lookup(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q) {
    if (mb->n_copies > 0 && q->n_blocks > 0 && mb->copy_dst[mb->n_copies - 1] == q->blocks[q->n_blocks - 1])
        mb->n_copies--;
    release_blocks(s, q);
    q->n_computed = 0;
    q->n_hashed = 0;
    q->chain = q->lora_seed;
}

static void fill_block_tables(loom_sched_t *s, loom_microbatch_t *mb) {
    int mx = 1;
    for (int i = 0; i < mb->n_seqs; i++)
        if (mb->seqs[i]->n_blocks > mx) mx = mb->seqs[i]->n_blocks;
    mb->max_blocks = mx;
    mb->any_lora = 0;
    for (int i = 0; i < mb->n_seqs; i++) {
        mb->seq_lora[i] = mb->seqs[i]->lora_slot;
        mb->any_lora |= mb->seqs[i]->lora_slot >= 0;
        mb->seq_dp_rank[i] = mb->seqs[i]->dp_rank;
    }
    for (int i = 0; i < mb->n_seqs; i++) {
        const loom_seq_t *q = mb->seqs[i];
        int32_t *row = mb->block_tables + (size_t)i * mx;
        memcpy(row, q->blocks, (size_t)q->n_blocks * sizeof *row);
        for (int j = q->n_blocks; j < mx; j++) row[j] = -1;
    }
    (void)s;
}

/* ---- speculative decoding ------------------------------------------------- */

static void register_blocks(loom_sched_t *s, loom_seq_t *q);

void loom_sched_set_spec(loom_sched_t *s, const loom_spec_config_t *c) {
    s->spec = *c;
    loom_spec_gate_init(&s->spec_gate);
}

void loom_sched_set_drafter(loom_sched_t *s, loom_sched_draft_fn propose,
                            loom_sched_forget_fn forget, void *ctx) {
    s->draft = propose;
    s->draft_forget = forget;
    s->draft_ctx = ctx;
}
const loom_spec_stats_t *loom_sched_spec_stats(const loom_sched_t *s) { return &s->spec_stats; }

int loom_sched_spec_probing(const loom_sched_t *s) {
    return !s->spec.fixed_k && loom_spec_gate_probing(&s->spec_gate);
}

void loom_sched_set_clock(loom_sched_t *s, loom_sched_clock_fn now_ns, void *ctx) {
    s->clock = now_ns;
    s->clock_ctx = ctx;
}

void loom_sched_observe_step(loom_sched_t *s, int n_tokens, double seconds) {
    if (n_tokens <= 2 * LOOM_MAX(s->spec.compute_knee, 32)) loom_spec_cost_observe(&s->spec_cost, n_tokens, seconds);
}

static int spec_eligible(const loom_sched_t *s, const loom_seq_t *q) {
    /* sampling controls and grammar masks too: each verify row's plan fields
     * are computed with the earlier drafts as output (loom_sparams_fill_plan) */
    if (q->spec_off) return 0;
    return s->spec.method == LOOM_SPEC_NGRAM || s->spec.method == LOOM_SPEC_MTP ||
           (s->spec.method == LOOM_SPEC_DRAFT && s->draft);
}

void loom_sched_mtp_drafts(loom_microbatch_t *mb, const int32_t *drafts) {
    for (int i = 0; i < mb->n_seqs; i++) {
        loom_seq_t *q = mb->seqs[i];
        if (drafts[i] < 0 || q->finish_pending) continue;
        q->mtp_draft = drafts[i];
        q->mtp_draft_for = q->n_steps + 1; /* a sequence sampled in mb completes one step */
    }
}

/* After add_chunk(q, 1) of a decode: appends up to K drafts of q as
 * tokens n_computed + 1.. with a logit row each. rows_reserved: logit rows
 * the rest of this micro-batch may still need; step_tokens: the decode
 * tokens the step will carry (for the compute knee). */
static void spec_extend(loom_sched_t *s, loom_microbatch_t *mb, loom_seq_t *q, int budget, int rows_reserved,
                        int step_tokens) {
    int si = mb->n_seqs - 1;
    if (!s->spec.fixed_k) { /* one answer of the gate per batch */
        if (mb->spec_gate < 0) mb->spec_gate = loom_spec_gate_step(&s->spec_gate);
        if (!mb->spec_gate) return;
    }
    loom_spec_config_t c = s->spec;
    c.verify_cost = loom_spec_cost_relative(&s->spec_cost, step_tokens, s->spec.verify_cost);
    int k = loom_spec_adapt_k(&q->spec_adapt, &c, step_tokens);
    k = LOOM_MIN(k, q->max_tokens - (q->n_tokens - q->n_prompt) - 1); /* never more than asked */
    k = LOOM_MIN(k, budget);
    k = LOOM_MIN(k, s->cfg.max_num_seqs - mb->n_logits - rows_reserved); /* the workers' logit rows */
    int room = (q->n_blocks + loom_kv_part_free(s->kv, q->dp_rank)) * s->cfg.block_size - (q->n_computed + 1);
    k = LOOM_MIN(k, room); /* drafts use free blocks only, never a preemption */
    if (k <= 0) return;
    int32_t drafts[LOOM_SPEC_MAX_K];
    int n;
    if (s->spec.method == LOOM_SPEC_DRAFT) {
        uint64_t t0 = loom_now_ns();
        n = s->draft(s->draft_ctx, q, k, drafts);
        mb->draft_s += (double)(loom_now_ns() - t0) * 1e-9;
    } else if (s->spec.method == LOOM_SPEC_MTP) {
        n = q->mtp_draft_for > 0 && q->mtp_draft_for == q->n_steps;
        drafts[0] = q->mtp_draft;
    } else {
        n = loom_spec_ngram_propose(q->tokens, q->n_tokens, s->spec.ngram_min, s->spec.ngram_max, k,
                                    drafts);
    }
    if (n <= 0) return;
    n = LOOM_MIN(n, k);
    grow(s, q, q->n_computed + 1 + n);
    int B = s->cfg.block_size;
    mb->spec_n[si] = n;
    mb->spec_row0[si] = mb->n_logits - 1;
    mb->chunk[si] = 1 + n;
    for (int j = 0; j < n; j++) {
        int p = q->n_computed + 1 + j, t = mb->n_tokens++;
        mb->tokens[t] = drafts[j];
        mb->pos[t] = p;
        mb->slots[t] = q->blocks[p / B] * B + p % B;
        mb->tok_seq[t] = si;
        int r = mb->n_logits++;
        mb->logit_rows[r] = t;
        mb->logit_seq[r] = q;
        mb->sampling[r] = q->sampling;
        mb->steps[r] = q->step_offset + (uint64_t)(q->n_tokens - q->n_prompt + 1 + j);
        mb->spec_row[r] = 1;
    }
    mb->spec_row[mb->spec_row0[si]] = 1;
    s->stats.scheduled_tokens += (uint64_t)n;
}

/* Accepts, emits and rolls back one speculating sequence of a completed
 * micro-batch (see loom_sched_set_spec); returns the tokens it emitted. */
static int spec_complete(loom_sched_t *s, loom_microbatch_t *mb, int si, const int32_t *ids,
                          loom_sched_token_fn on_token, void *ctx) {
    loom_seq_t *q = mb->seqs[si];
    int n = mb->spec_n[si], r0 = mb->spec_row0[si], t0 = mb->logit_rows[r0];
    int base = q->n_computed, accepted = 0, emitted = 0;
    /* the sequence's counts are current before each token goes out: the
     * request's final usage is taken as its last token is emitted */
    q->spec_drafted += n;
    q->n_steps++;
    for (int j = 0; j <= n && !q->finish_pending; j++) {
        int32_t id = ids[r0 + j];
        int match = j < n && id == mb->tokens[t0 + 1 + j];
        LOOM_ASSERT(q->n_tokens < q->cap_tokens);
        q->tokens[q->n_tokens++] = id;
        emitted++;
        if (match) accepted++, q->spec_accepted++;
        /* KV is kept for the fed token and the accepted drafts */
        q->n_computed = base + 1 + accepted;
        if (!q->t_first_token_ns) q->t_first_token_ns = loom_now_ns();
        if (on_token) on_token(ctx, q, id);
        if (!match) break;
    }
    if (!q->finish_pending) {
        /* roll back: blocks that only rejected drafts wrote go back to the pool */
        int keep = (q->n_tokens + s->cfg.block_size - 1) / s->cfg.block_size;
        while (q->n_blocks > keep && q->n_blocks > q->n_hashed) loom_kv_release(s->kv, q->blocks[--q->n_blocks]);
        register_blocks(s, q);
    }
    loom_spec_adapt_update(&q->spec_adapt, n, accepted);
    loom_spec_stats_record(&s->spec_stats, n, accepted, emitted);
    return emitted;
}

/* A free micro-batch, emptied, that evictions now save into (NULL: all in flight). */
static loom_microbatch_t *mb_take(loom_sched_t *s) {
    loom_microbatch_t *mb = NULL;
    for (int i = 0; i < s->n_mbs; i++)
        if (!s->mbs[i].in_use) {
            mb = &s->mbs[i];
            break;
        }
    if (!mb) return NULL;
    mb->n_tokens = mb->n_seqs = mb->n_logits = mb->n_copies = mb->n_embeds = mb->n_plp = 0;
    mb->n_saves = mb->n_loads = mb->n_saves_after = 0;
    mb->n_pulls = mb->n_pull_srcs = 0;
    mb->n_prev = 0;
    mb->prev_step = 0;
    mb->draft_s = 0;
    s->building = mb;
    for (int i = 0; i < s->n_pend; i++) /* before anything reuses their blocks */
        xfer_push(&mb->save_block, &mb->save_hash, &mb->n_saves, &mb->cap_saves, s->pend_block[i], s->pend_hash[i]);
    s->n_pend = 0;
    mb->spec_gate = -1;
    return mb;
}

static loom_microbatch_t *mb_fill(loom_sched_t *s, loom_microbatch_t *mb);

loom_microbatch_t *loom_sched_schedule(loom_sched_t *s) {
    loom_microbatch_t *mb = mb_take(s);
    return mb ? mb_fill(s, mb) : NULL;
}

/* Fills mb (which may hold rows planned ahead) from the sequences not in
 * flight: decodes, prefill chunks, admissions. */
static loom_microbatch_t *mb_fill(loom_sched_t *s, loom_microbatch_t *mb) {
    const loom_sched_config_t *c = &s->cfg;
    int budget = c->max_batched_tokens - mb->n_tokens;
    int cap = c->max_num_seqs;
    if (c->n_micro > 1) { /* share the sequences among the micro-batches in flight */
        int total = s->n_running + s->n_waiting;
        cap = (total + c->n_micro - 1) / c->n_micro;
        if (cap < 1) cap = 1;
    }

    /* 1. decodes, oldest first */
    for (int i = 0; i < s->n_running && budget > 0 && mb->n_seqs < cap; i++) {
        loom_seq_t *q = s->running[i];
        if (q->in_flight || q->n_tokens - q->n_computed != 1) continue;
        int need = blocks_needed(s, q, q->n_computed + 1);
        if (need > loom_kv_part_free(s->kv, q->dp_rank) && !make_room(s, mb, q, need)) {
            if (!in_mb(mb, q)) {
                preempt(s, q); /* nothing younger to take from: this one waits */
                i--;
            }
            continue;
        }
        grow(s, q, q->n_computed + 1);
        add_chunk(s, mb, q, 1);
        budget--;
        if (spec_eligible(s, q)) {
            int others = LOOM_MIN(cap, s->n_running + s->n_waiting) - mb->n_seqs; /* rows they may need */
            int before = mb->n_tokens;
            spec_extend(s, mb, q, budget, others > 0 ? others : 0, LOOM_MIN(cap, s->n_running));
            budget -= mb->n_tokens - before;
        }
    }
    /* 2. prefills already running, continued in chunks */
    for (int i = 0; i < s->n_running && budget > 0 && mb->n_seqs < cap; i++) {
        loom_seq_t *q = s->running[i];
        if (q->in_flight || q->n_tokens - q->n_computed < 2) continue;
        int take = LOOM_MIN(q->n_tokens - q->n_computed, budget);
        int need = blocks_needed(s, q, q->n_computed + take);
        if (need > loom_kv_part_free(s->kv, q->dp_rank)) make_room(s, mb, q, need);
        int room = (q->n_blocks + loom_kv_part_free(s->kv, q->dp_rank)) * c->block_size - q->n_computed;
        if (take > room) take = room;
        if (take <= 0) continue;
        grow(s, q, q->n_computed + take);
        add_chunk(s, mb, q, take);
        budget -= take;
    }
    /* 3. admissions: priority, then first come first served; parked
     * sequences (waiting for a leader's prefill) are passed over */
    int n_parked = 0;
    while (s->n_waiting > 0 && budget > 0 && mb->n_seqs < cap && s->n_running < c->max_num_seqs) {
        loom_seq_t *q = s->heap[0];
        if (q->lora_id >= 0 && q->lora_slot < 0 &&
            (!s->lora || !loom_lora_slots_acquire(s->lora, q->lora_id, &q->lora_slot))) {
            q->lora_slot = -1; /* its adapter is not resident yet: the ones behind it go first */
            heap_remove(s, q);
            s->parked[n_parked++] = q;
            continue;
        }
        if (q->n_blocks == 0) bind_rank(s, q);
        fork_t f = q->n_blocks == 0 ? fork_lookup(s, mb, q) : FORK_NONE;
        if (f == FORK_PARK) {
            heap_remove(s, q);
            s->parked[n_parked++] = q;
            continue;
        }
        int loads0 = mb->n_loads, pulls0 = mb->n_pulls, srcs0 = mb->n_pull_srcs;
        if (f == FORK_NONE && q->n_blocks == 0 && q->embed != LOOM_POOL_MEAN && !q->prompt_lp &&
            prefix_lookup(s, mb, q)) {
            undo_pulls(s, mb, q, pulls0, srcs0);
            undo_lookup(s, mb, q); /* its tier blocks are being checked: the ones behind it go first */
            lora_unpin(s, q);
            heap_remove(s, q);
            s->parked[n_parked++] = q;
            continue;
        }
        int take = LOOM_MIN(q->n_tokens - q->n_computed, budget);
        int room = (q->n_blocks + loom_kv_part_free(s->kv, q->dp_rank)) * c->block_size - q->n_computed;
        if (take > room) take = room;
        if (take <= 0) {
            s->stats.tier_hits -= (uint64_t)(mb->n_loads - loads0);
            mb->n_loads = loads0; /* its blocks go back below */
            undo_pulls(s, mb, q, pulls0, srcs0);
            undo_lookup(s, mb, q);
            lora_unpin(s, q);
            break; /* strict FCFS: the head waits for memory */
        }
        heap_remove(s, q);
        q->state = LOOM_SEQ_RUNNING;
        if (c->n_dp > 1) s->stats.dp_admissions[q->dp_rank]++;
        if (f == FORK_DONE) {
            s->stats.forks++;
            s->stats.fork_tokens += (uint64_t)q->n_computed;
        }
        if (!q->admitted_once) {
            q->admitted_once = 1;
            q->cached_tokens = q->n_computed;
            q->forked = f == FORK_DONE;
            q->t_admitted_ns = loom_now_ns();
            save_admitted(s, mb, q);
        }
        run_insert(s, q);
        grow(s, q, q->n_computed + take);
        add_chunk(s, mb, q, take);
        budget -= take;
    }
    for (int i = 0; i < n_parked; i++) heap_push(s, s->parked[i]);
    s->building = NULL;
    if (mb->n_seqs == 0) {
        /* saves of blocks this empty step evicted cannot wait for a step:
         * keep them for the next one (nothing reuses those blocks before) */
        for (int i = 0; i < mb->n_saves; i++)
            xfer_push(&s->pend_block, &s->pend_hash, &s->n_pend, &s->cap_pend, mb->save_block[i], mb->save_hash[i]);
        return NULL;
    }
    plan_slots(s, mb);
    fill_block_tables(s, mb);
    mb->id = ++s->next_mb_id;
    mb->in_use = 1;
    s->stats.batches++;
    return mb;
}

/* Registers q's newly full, computed blocks in the prefix cache. */
static void register_blocks(loom_sched_t *s, loom_seq_t *q) {
    int B = s->cfg.block_size;
    while ((q->n_hashed + 1) * B <= q->n_computed && q->n_hashed < q->n_blocks) {
        const int32_t *t = q->tokens + (size_t)q->n_hashed * B;
        uint64_t h = loom_kv_chain_hash(q->chain, t, B);
        loom_kv_register(s->kv, q->blocks[q->n_hashed], h, t);
        q->chain = h;
        q->n_hashed++;
    }
}

static void release_mb(loom_sched_t *s, loom_microbatch_t *mb) {
    for (int i = 0; i < mb->n_seqs; i++) {
        loom_seq_t *q = mb->seqs[i];
        LOOM_ASSERT(q->in_flight > 0);
        if (--q->in_flight == 0 && q->finish_pending) seq_free(s, q);
    }
    mb->in_use = 0;
}

/* ---- planning ahead (loom_sched_schedule_ahead) ------------------------------------- */

/* Adds to mb a decode of each sequence prev samples for (not speculating)
 * whose next token can be planned without knowing that sample: its token
 * is the one prev samples (mb->prev_rows), at the position after prev's.
 * prev is the latest batch built, so q is in no batch after it; the ones
 * before it may still be in flight too (several planned ahead). */
static void add_ahead(loom_sched_t *s, loom_microbatch_t *mb, loom_microbatch_t *prev, loom_sched_ahead_fn ok,
                      void *ctx) {
    const int B = s->cfg.block_size;
    /* prev pulls KV from a prefill replica: until it reports, whether its
     * sequences' KV landed is unknown (a failed pull fails the step, every
     * sequence of it recomputed or failed: loom_sched_pull_failed), so none
     * of them is planned ahead of it; the next batch holds the others */
    if (prev->n_pull_srcs) return;
    for (int r = 0; r < prev->n_logits; r++) {
        loom_seq_t *q = prev->logit_seq[r];
        if (mb->n_seqs >= s->cfg.max_num_seqs || mb->n_tokens >= s->cfg.max_batched_tokens) break;
        if (prev->spec_row[r] || q->finish_pending || q->state != LOOM_SEQ_RUNNING || q->embed) continue;
        const int p = prev->pos[prev->logit_rows[r]] + 1; /* the position of the token prev samples */
        const uint64_t step = prev->steps[r] + 1;          /* and the index of the one this row samples */
        /* prev's token is its last (max_tokens, the context), or its next
         * step would carry drafts made from that token */
        if ((int)(step - q->step_offset) >= q->max_tokens || p + 1 >= s->cfg.max_model_len || spec_eligible(s, q))
            continue;
        if (ok && !ok(ctx, q)) continue;
        /* a block it fills that a write-through connector saves is named by
         * its tokens' chain hash: that row waits for its token */
        if (s->conn && (s->conn->write_through || q->kv_save) && (p + 1) % B == 0) continue;
        int need = blocks_needed(s, q, p + 1);
        if (need > loom_kv_part_free(s->kv, q->dp_rank)) continue; /* never a preemption for it */
        grow(s, q, p + 1);
        int si = mb->n_seqs++, t = mb->n_tokens++, lr = mb->n_logits++;
        mb->seqs[si] = q;
        mb->chunk[si] = 1;
        mb->spec_n[si] = 0;
        mb->tokens[t] = 0; /* the worker reads prev's sample for it */
        mb->prev_rows[t] = r;
        mb->pos[t] = p;
        mb->slots[t] = q->blocks[p / B] * B + p % B;
        mb->tok_seq[t] = si;
        mb->logit_rows[lr] = t;
        mb->logit_seq[lr] = q;
        mb->sampling[lr] = q->sampling;
        mb->steps[lr] = step;
        mb->spec_row[lr] = 0;
        mb->n_prev++;
        q->in_flight++;
        s->stats.scheduled_tokens++;
        s->stats.ahead_tokens++;
    }
}

loom_microbatch_t *loom_sched_schedule_ahead(loom_sched_t *s, loom_microbatch_t *prev, loom_sched_ahead_fn ok,
                                             void *ctx) {
    LOOM_ASSERT(prev->in_use && s->cfg.ahead);
    loom_microbatch_t *mb = mb_take(s);
    if (!mb) return NULL;
    add_ahead(s, mb, prev, ok, ctx);
    if (mb->n_prev) mb->prev_step = prev->id;
    mb = mb_fill(s, mb);
    if (mb && mb->n_prev)
        for (int t = mb->n_prev; t < mb->n_tokens; t++) mb->prev_rows[t] = -1; /* tokens the plan holds */
    return mb;
}

void loom_sched_complete(loom_sched_t *s, loom_microbatch_t *mb, const int32_t *ids,
                         loom_sched_token_fn on_token, void *ctx) {
    for (int i = 0; i < mb->n_seqs; i++) {
        loom_seq_t *q = mb->seqs[i];
        if (q->finish_pending || mb->spec_n[i] > 0) continue;
        q->n_computed += mb->chunk[i];
        register_blocks(s, q);
        drop_behind_window(s, q);
    }
    int drafted = 0, emitted = 0, timed = 0, first_drafts = 0;
    for (int i = 0; i < mb->n_seqs; i++) {
        drafted += mb->spec_n[i];
        /* a sequence's first drafts paid for the drafter reading its prompt */
        first_drafts += mb->spec_n[i] > 0 && mb->seqs[i]->spec_drafted == 0;
    }
    /* The gate compares batches of decodes only (a prefill chunk's time is
     * not a token's), each timed as its sequences' whole cycle: from their
     * previous step's completion to this one. */
    const int all_decode = mb->spec_gate >= 0 && mb->n_tokens == mb->n_seqs + drafted;
    const uint64_t now = s->clock ? s->clock(s->clock_ctx) : loom_now_ns();
    double cycle_s = 0;
    for (int i = 0; i < mb->n_seqs; i++) {
        loom_seq_t *q = mb->seqs[i];
        if (q->finish_pending) continue;
        if (all_decode && q->t_step_ns) {
            cycle_s += (double)(now - q->t_step_ns) * 1e-9;
            timed++;
        }
        q->t_step_ns = now;
    }
    for (int i = 0; i < mb->n_seqs; i++)
        if (mb->spec_n[i] > 0 && !mb->seqs[i]->finish_pending) emitted += spec_complete(s, mb, i, ids, on_token, ctx);
    for (int r = 0; r < mb->n_logits; r++) {
        loom_seq_t *q = mb->logit_seq[r];
        if (q->finish_pending && mb->logit_rows[r] < mb->n_prev) s->stats.ahead_dropped++;
        if (q->finish_pending || mb->spec_row[r]) continue;
        LOOM_ASSERT(q->n_tokens < q->cap_tokens);
        emitted++;
        q->tokens[q->n_tokens++] = ids[r];
        q->n_steps++;
        if (!q->t_first_token_ns) q->t_first_token_ns = loom_now_ns();
        if (on_token) on_token(ctx, q, ids[r]);
    }
    if (timed == mb->n_seqs && timed > 0 && !first_drafts)
        loom_spec_gate_observe(&s->spec_gate, drafted, emitted, mb->n_seqs, cycle_s / timed);
    release_mb(s, mb);
}

void loom_sched_fail(loom_sched_t *s, loom_microbatch_t *mb) {
    /* Whether the step's KV (and its block copies) landed is unknown:
     * recompute those sequences from scratch. */
    for (int i = 0; i < mb->n_seqs; i++) {
        loom_seq_t *q = mb->seqs[i];
        if (!q->finish_pending && q->state == LOOM_SEQ_RUNNING) preempt(s, q);
    }
    release_mb(s, mb);
}

void loom_sched_finish(loom_sched_t *s, loom_seq_t *q) {
    if (q->finish_pending) return;
    if (q->state == LOOM_SEQ_RUNNING) run_remove(s, q);
    else if (q->state == LOOM_SEQ_WAITING) heap_remove(s, q);
    q->state = LOOM_SEQ_FINISHED;
    if (q->in_flight) q->finish_pending = 1;
    else seq_free(s, q);
}

void loom_sched_reset_kv(loom_sched_t *s, int n_blocks) {
    LOOM_ASSERT(loom_sched_in_flight(s) == 0);
    while (s->n_running > 0) {
        preempt(s, s->running[s->n_running - 1]);
        s->stats.preemptions--; /* a lost cache, not memory pressure */
    }
    /* the new ledger is made before the old one goes, so it never has the
     * old one's address (observers such as kv_events.c tell them apart by it) */
    loom_kv_ledger_t *old = s->kv;
    for (int i = 0; i < s->n_holds; i++) free(s->holds[i].blocks); /* the old pool's: gone with it */
    s->n_holds = s->held_blocks = 0;
    s->cfg.n_blocks = n_blocks;
    s->kv = loom_kv_create_parts(n_blocks, s->cfg.block_size, s->cfg.prefix_cache, s->cfg.n_dp);
    attach_ledger(s);
    s->n_pend = 0; /* the old pool's blocks are gone */
    loom_kv_destroy(&old);
}

int loom_sched_seq_max_blocks(const loom_sched_t *s, const loom_seq_t *q) {
    return (q->n_prompt + q->max_tokens + s->cfg.block_size - 1) / s->cfg.block_size;
}

void loom_sched_set_lora_slots(loom_sched_t *s, loom_lora_slots_t *slots) { s->lora = slots; }

uint64_t loom_sched_lora_seed(const uint8_t digest[32]) {
    uint64_t seed = 0;
    if (digest) memcpy(&seed, digest, sizeof seed);
    return seed ? seed : 1; /* 0 is the base model's */
}

void loom_sched_seq_set_lora(loom_sched_t *s, loom_seq_t *q, int lora_id, const uint8_t digest[32]) {
    (void)s;
    LOOM_ASSERT(q->state == LOOM_SEQ_WAITING && q->n_blocks == 0 && !q->admitted_once);
    q->lora_id = lora_id;
    uint64_t seed = lora_id >= 0 ? loom_sched_lora_seed(digest) : 0;
    q->lora_seed = seed;
    q->chain = seed;
    /* a fork shares KV only with a twin of the same adapter */
    q->prompt_hash = loom_kv_chain_hash(seed, q->tokens, q->n_prompt);
}

int loom_sched_n_seqs(const loom_sched_t *s) { return s->n_running + s->n_waiting; }

loom_seq_t *loom_sched_seq_at(loom_sched_t *s, int i) {
    return i < s->n_running ? s->running[i] : s->heap[i - s->n_running];
}

int loom_sched_in_flight(const loom_sched_t *s) {
    int n = 0;
    for (int i = 0; i < s->n_mbs; i++) n += s->mbs[i].in_use;
    return n;
}

/* ---- delayed free (loom_sched_hold) ------------------------------------------ */

int loom_sched_hold(loom_sched_t *s, const loom_seq_t *q, uint64_t id, uint64_t deadline_ns,
                    const int32_t **blocks) {
    *blocks = NULL;
    const int B = s->cfg.block_size;
    int n = q->n_prompt > 0 ? (q->n_prompt - 1) / B : 0;
    if (n > q->n_blocks) n = q->n_blocks;
    if (n > q->n_computed / B) n = q->n_computed / B;
    if (q->n_dropped > 0 || n <= 0) return 0; /* a window dropped the first blocks: nothing whole to hand over */
    for (int i = 0; i < s->n_holds; i++) LOOM_ASSERT(s->holds[i].id != id);
    if (s->n_holds == s->cap_holds) {
        s->cap_holds = s->cap_holds ? 2 * s->cap_holds : 8;
        s->holds = loom_xrealloc(s->holds, (size_t)s->cap_holds * sizeof *s->holds);
    }
    kv_hold_t *h = &s->holds[s->n_holds++];
    h->id = id;
    h->deadline_ns = deadline_ns;
    h->n = n;
    h->blocks = loom_xmalloc((size_t)n * sizeof *h->blocks);
    for (int i = 0; i < n; i++) {
        h->blocks[i] = q->blocks[i];
        loom_kv_retain(s->kv, q->blocks[i]);
    }
    s->held_blocks += n;
    *blocks = h->blocks;
    return n;
}

const int32_t *loom_sched_held(const loom_sched_t *s, uint64_t id, int *n) {
    for (int i = 0; i < s->n_holds; i++)
        if (s->holds[i].id == id) {
            *n = s->holds[i].n;
            return s->holds[i].blocks;
        }
    *n = 0;
    return NULL;
}

int loom_sched_unhold(loom_sched_t *s, uint64_t id) {
    for (int i = 0; i < s->n_holds; i++) {
        kv_hold_t *h = &s->holds[i];
        if (h->id != id) continue;
        int n = h->n;
        for (int j = 0; j < n; j++) loom_kv_release(s->kv, h->blocks[j]);
        free(h->blocks);
        memmove(h, h + 1, (size_t)(s->n_holds - i - 1) * sizeof *h);
        s->n_holds--;
        s->held_blocks -= n;
        return n;
    }
    return 0;
}

int loom_sched_hold_expire(loom_sched_t *s, uint64_t now_ns, uint64_t *ids, int cap) {
    int n = 0;
    for (int i = 0; i < s->n_holds && n < cap;) {
        if (now_ns < s->holds[i].deadline_ns) {
            i++;
            continue;
        }
        ids[n++] = s->holds[i].id;
        loom_sched_unhold(s, s->holds[i].id);
    }
    return n;
}

int loom_sched_held_blocks(const loom_sched_t *s) { return s->held_blocks; }

void loom_sched_get_stats(const loom_sched_t *s, loom_sched_stats_t *st) {
    *st = s->stats;
    st->running = s->n_running;
    st->waiting = s->n_waiting;
}
