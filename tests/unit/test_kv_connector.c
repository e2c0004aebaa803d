/* The coordinator half of a KV connector: the checked entry points cut a
 * connector's answer to whole blocks within the request, the no-connector
 * case, delayed free and kv_transfer_params, the load-failure policy names;
 * the scheduler with a connector: write-back saves of evicted blocks,
 * loads counted as cached, the walk between pool and tier, write-through;
 * transport tcp's hold (delayed free, lease) and pulls. */
#include "coordinator/kv_connector.h"
#include "coordinator/sched.h"
#include "worker/kv_connector.h" /* the worker half compiles on its own */
#include "tests/test.h"

#include <stdlib.h>
#include <string.h>

typedef struct fake {
    loom_kv_connector_t base;
    int says, async, allocs, last_external, keep;
} fake_t;

static int fake_match(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async) {
    (void)r, (void)n_local;
    *async = ((fake_t *)c)->async;
    return ((fake_t *)c)->says;
}
static void fake_after_alloc(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, const int32_t *b, int nb, int ne) {
    (void)r, (void)b, (void)nb;
    ((fake_t *)c)->allocs++;
    ((fake_t *)c)->last_external = ne;
}
static int fake_finished(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, const int32_t *b, int nb, char **p) {
    (void)r, (void)b, (void)nb;
    *p = strdup("{\"do_remote_decode\":true}");
    return ((fake_t *)c)->keep;
}
static const loom_kv_connector_ops_t fake_ops = {
    .match = fake_match, .after_alloc = fake_after_alloc, .finished = fake_finished};

static void test_match(void) {
    int32_t toks[70] = {0};
    loom_kv_conn_req_t r = {.id = 1, .tokens = toks, .n_tokens = 70, .block_size = 16};
    int async = 7;
    CHECK(loom_kv_connector_match(NULL, &r, 16, &async) == 0 && async == 0);
    fake_t f = {.base = {.ops = &fake_ops, .tier = "dir"}, .says = 1000, .async = 1};
    /* 70 tokens: 4 full blocks (64); 16 local -> 48 more at most */
    CHECK(loom_kv_connector_match(&f.base, &r, 16, &async) == 48 && async == 1);
    f.says = 20; /* not whole blocks: cut down */
    CHECK(loom_kv_connector_match(&f.base, &r, 16, &async) == 16);
    f.says = 15;
    CHECK(loom_kv_connector_match(&f.base, &r, 16, &async) == 0 && async == 0);
    r.n_tokens = 64; /* a prompt of whole blocks: its last position runs, so its last block is not taken */
    f.says = 1000;
    CHECK(loom_kv_connector_match(&f.base, &r, 0, &async) == 48);
    f.says = -5;
    CHECK(loom_kv_connector_match(&f.base, &r, 0, &async) == 0);
    int32_t blocks[3] = {4, 5, 6};
    loom_kv_connector_after_alloc(&f.base, &r, blocks, 3, 48);
    loom_kv_connector_after_alloc(NULL, &r, blocks, 3, 48);
    CHECK(f.allocs == 1 && f.last_external == 48);
}

static void test_finished(void) {
    loom_kv_conn_req_t r = {.id = 2, .block_size = 16};
    int32_t blocks[2] = {1, 2};
    char *p = (char *)1;
    CHECK(loom_kv_connector_finished(NULL, &r, blocks, 2, &p) == 0 && p == NULL);
    fake_t f = {.base = {.ops = &fake_ops}, .keep = 1};
    CHECK(loom_kv_connector_finished(&f.base, &r, blocks, 2, &p) == 1 && p && strstr(p, "do_remote_decode"));
    free(p);
    f.keep = 0;
    CHECK(loom_kv_connector_finished(&f.base, &r, blocks, 2, NULL) == 0); /* params dropped, not leaked */
    loom_kv_connector_t *c = &f.base;
    loom_kv_connector_destroy(&c);
    CHECK(c == NULL);
}

static void test_policy(void) {
    loom_kv_load_policy_t p = LOOM_KV_LOAD_FAIL;
    CHECK(loom_kv_load_policy_parse("recompute", &p) && p == LOOM_KV_LOAD_RECOMPUTE);
    CHECK(loom_kv_load_policy_parse("fail", &p) && p == LOOM_KV_LOAD_FAIL);
    CHECK(!loom_kv_load_policy_parse("retry", &p) && !loom_kv_load_policy_parse(NULL, &p));
}

/* The worker half's table: a block to move is its id and content hash. */
static void test_worker_half(void) {
    loom_kv_xfer_t x = {.block = 3, .hash = 0x1234};
    loom_kv_wconn_t w = {.ops = NULL, .block_bytes = 2097152};
    CHECK(x.block == 3 && w.block_bytes == 2u << 20);
}

/* ---- the scheduler with a connector ------------------------------------ */

/* A tier of chain hashes: match walks the request's blocks from n_local
 * while the tier holds them; offer takes every block it lacks. */
typedef struct {
    loom_kv_connector_t base;
    uint64_t held[64];
    int n_held, offers;
} tier_t;

static int tier_has(const tier_t *t, uint64_t h) {
    for (int i = 0; i < t->n_held; i++)
        if (t->held[i] == h) return 1;
    return 0;
}
static int tier_match(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async) {
    *async = 0;
    int n = 0;
    for (int i = n_local / r->block_size; i < r->n_tokens / r->block_size && tier_has((tier_t *)c, r->block_hashes[i]);
         i++)
        n += r->block_size;
    return n;
}
static int tier_offer(loom_kv_connector_t *c, uint64_t h) {
    tier_t *t = (tier_t *)c;
    t->offers++;
    return !tier_has(t, h);
}
static const loom_kv_connector_ops_t tier_ops = {.match = tier_match, .offer = tier_offer};

enum { TB = 4 };

static loom_sched_t *tier_sched(int n_blocks) {
    loom_sched_config_t c = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 16, .max_model_len = 64,
                             .n_micro = 1, .block_size = TB, .n_blocks = n_blocks, .prefix_cache = 1};
    return loom_sched_create(&c);
}

/* Runs q's prompt to its first token and finishes it (its blocks stay cached). */
static loom_microbatch_t *run_prompt(loom_sched_t *s, const int32_t *p, int n, loom_seq_t **q_out) {
    loom_sampling_t sp = {0};
    loom_err_t err = {0};
    loom_seq_t *q = NULL;
    CHECK(loom_sched_add(s, (uint64_t)p[0], p, n, 1, 0, &sp, NULL, &q, &err) == LOOM_OK);
    loom_microbatch_t *mb = loom_sched_schedule(s);
    CHECK(mb != NULL);
    if (q_out) *q_out = q;
    return mb;
}

static void finish_mb(loom_sched_t *s, loom_microbatch_t *mb) {
    int32_t ids[8] = {0};
    loom_seq_t *seqs[8];
    int n = mb->n_seqs;
    memcpy(seqs, mb->seqs, (size_t)n * sizeof *seqs);
    loom_sched_complete(s, mb, ids, NULL, NULL);
    for (int i = 0; i < n; i++) loom_sched_finish(s, seqs[i]);
}

static void chain(const int32_t *p, int n_blocks, uint64_t *h) {
    uint64_t x = 0;
    for (int i = 0; i < n_blocks; i++) h[i] = x = loom_kv_chain_hash(x, p + i * TB, TB);
}

/* Write-back: the blocks a new prompt evicts are saved by the step that
 * reuses them; a prompt whose blocks the tier holds loads them instead of
 * computing them, and counts them as cached. */
static void test_sched_write_back_and_load(void) {
    loom_sched_t *s = tier_sched(4);
    tier_t t = {.base = {.ops = &tier_ops, .tier = "dir"}};
    loom_sched_set_connector(s, &t.base);
    int32_t a[9], b[13];
    for (int i = 0; i < 9; i++) a[i] = 10 + i;
    for (int i = 0; i < 13; i++) b[i] = 50 + i;
    uint64_t ha[2];
    chain(a, 2, ha);
    loom_microbatch_t *mb = run_prompt(s, a, 9, NULL);
    if (!mb) return;
    CHECK(mb->n_saves == 0 && mb->n_loads == 0);
    finish_mb(s, mb); /* a's 2 full blocks cached */
    mb = run_prompt(s, b, 13, NULL); /* 4 blocks: a's two evicted and saved */
    if (!mb) return;
    CHECK(mb->n_saves == 2 && mb->n_loads == 0);
    int saved = 0;
    for (int i = 0; i < mb->n_saves; i++) saved += mb->save_hash[i] == ha[0] || mb->save_hash[i] == ha[1];
    CHECK(saved == 2);
    for (int i = 0; i < mb->n_saves; i++) t.held[t.n_held++] = mb->save_hash[i];
    finish_mb(s, mb);
    loom_seq_t *q;
    mb = run_prompt(s, a, 9, &q); /* a again: both full blocks from the tier, only position 8 runs */
    if (!mb) return;
    CHECK(mb->n_loads == 2 && mb->load_hash[0] == ha[0] && mb->load_hash[1] == ha[1]);
    CHECK(mb->n_tokens == 1 && mb->pos[0] == 8 && q->cached_tokens == 8);
    CHECK(mb->block_tables[0] == mb->load_block[0] && mb->block_tables[1] == mb->load_block[1]);
    loom_sched_stats_t st;
    loom_sched_get_stats(s, &st);
    /* the third step evicted b's blocks in turn */
    CHECK(st.tier_hits == 2 && st.tier_saves == 2 + (uint64_t)mb->n_saves && mb->n_saves > 0);
    CHECK(st.prompt_tokens_computed == 9 + 13 + 1);
    finish_mb(s, mb);
    CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    loom_sched_destroy(&s);
}

/* The pool evicts a chain from its front: the tier gives the front, the
 * pool the rest; the block of the last position is never loaded. */
static void test_sched_pool_after_tier(void) {
    loom_sched_t *s = tier_sched(8);
    tier_t t = {.base = {.ops = &tier_ops}};
    int32_t a[13];
    for (int i = 0; i < 13; i++) a[i] = 7 + i;
    uint64_t ha[3];
    chain(a, 3, ha);
    loom_microbatch_t *mb = run_prompt(s, a, 13, NULL);
    if (!mb) return;
    finish_mb(s, mb); /* blocks 0..2 cached, 0 the least recently used */
    loom_kv_ledger_t *L = loom_sched_ledger(s);
    int got[8], n = 0, b;
    while (loom_kv_n_cached(L) == 3 && (b = loom_kv_alloc(L)) >= 0) got[n++] = b; /* the free ones, then block 0 */
    for (int i = 0; i < n; i++) loom_kv_release(L, got[i]);
    CHECK(loom_kv_n_cached(L) == 2);
    t.held[t.n_held++] = ha[0];
    t.held[t.n_held++] = ha[2]; /* also in the pool: the pool's copy is taken */
    loom_sched_set_connector(s, &t.base);
    loom_seq_t *q;
    mb = run_prompt(s, a, 13, &q);
    if (!mb) return;
    CHECK(q->cached_tokens == 12 && mb->n_tokens == 1 && mb->pos[0] == 12);
    CHECK(mb->n_loads == 1 && mb->load_hash[0] == ha[0] && mb->block_tables[0] == mb->load_block[0]);
    finish_mb(s, mb);
    CHECK(loom_kv_check(L) == 0);
    loom_sched_destroy(&s);
}

/* Write-through: the blocks a step fills are saved by that step, after its
 * layers; blocks the tier has already are not saved again. */
static void test_sched_write_through(void) {
    loom_sched_t *s = tier_sched(8);
    tier_t t = {.base = {.ops = &tier_ops, .write_through = 1}};
    loom_sched_set_connector(s, &t.base);
    int32_t a[11];
    for (int i = 0; i < 11; i++) a[i] = 30 + i;
    uint64_t ha[2];
    chain(a, 2, ha);
    t.held[t.n_held++] = ha[0];
    loom_seq_t *q;
    loom_microbatch_t *mb = run_prompt(s, a, 11, &q);
    if (!mb) return;
    /* block 0 came from the tier; block 1 is filled by this step and saved after it */
    CHECK(mb->n_loads == 1 && mb->n_saves == 0);
    CHECK(mb->n_saves_after == 1 && mb->save_after_hash[0] == ha[1] && mb->save_after_block[0] == q->blocks[1]);
    finish_mb(s, mb);
    CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    loom_sched_destroy(&s);
}


/* Write-through with overlapped scheduling (loom_sched_schedule_ahead): a
 * decode row that fills a block is saved under its tokens' chain hash, which
 * a row planned ahead does not know, so that row waits for its token: every
 * full block of the output is saved, under the right hash, once. */
static void test_sched_write_through_ahead(void) {
    loom_sched_config_t c = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 16, .max_model_len = 64,
                             .n_micro = 1, .block_size = TB, .n_blocks = 16, .prefix_cache = 1, .ahead = 1};
    loom_sched_t *s = loom_sched_create(&c);
    tier_t t = {.base = {.ops = &tier_ops, .write_through = 1}};
    loom_sched_set_connector(s, &t.base);
    int32_t a[3] = {30, 31, 32}, all[20];
    memcpy(all, a, sizeof a);
    loom_sampling_t sp = {0};
    loom_err_t err = {0};
    loom_seq_t *q = NULL;
    CHECK(loom_sched_add(s, 1, a, 3, 13, 0, &sp, NULL, &q, &err) == LOOM_OK);
    loom_microbatch_t *fly[2];
    int n_fly = 0, n_all = 3, ahead = 0, n_saved = 0, last_ids[4] = {0};
    uint64_t saved[16];
    for (int iter = 0; iter < 64 && n_all < 16; iter++) {
        loom_microbatch_t *mb;
        if (n_fly == 0 && (mb = loom_sched_schedule(s))) fly[n_fly++] = mb;
        if (n_fly == 1 && (mb = loom_sched_schedule_ahead(s, fly[0], NULL, NULL))) fly[n_fly++] = mb;
        CHECK(n_fly > 0);
        if (!n_fly) break;
        mb = fly[0];
        for (int i = 0; i < mb->n_prev; i++) {
            CHECKF((mb->pos[i] + 1) % TB != 0, "position %d, which fills a block, was planned ahead", mb->pos[i]);
            mb->tokens[i] = last_ids[mb->prev_rows[i]];
            ahead++;
        }
        for (int i = 0; i < mb->n_saves_after && n_saved < 16; i++) saved[n_saved++] = mb->save_after_hash[i];
        int32_t ids[4];
        for (int r = 0; r < mb->n_logits; r++) ids[r] = last_ids[r] = 40 + mb->pos[mb->logit_rows[r]];
        loom_sched_complete(s, mb, ids, NULL, NULL);
        for (int r = 0; r < mb->n_logits; r++) all[n_all++] = ids[r];
        fly[0] = fly[1];
        n_fly--;
    }
    CHECK(n_all == 16 && ahead > 0);
    uint64_t want[3];
    chain(all, 3, want); /* positions 0..14 computed: blocks 0, 1 and 2 are full */
    CHECKF(n_saved == 3, "%d blocks saved", n_saved);
    for (int i = 0; i < 3 && i < n_saved; i++) CHECK(saved[i] == want[i]);
    while (n_fly > 0) loom_sched_fail(s, fly[--n_fly]);
    loom_sched_finish(s, q);
    CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    loom_sched_destroy(&s);
}

/* Delayed free: a finished prefill's prompt blocks held under an id stay
 * out of the pool (not freed, not reused) until unheld or the lease's
 * deadline passes; a new pool ends every hold. */
static void test_sched_hold(void) {
    loom_sched_t *s = tier_sched(4);
    loom_kv_ledger_t *L = loom_sched_ledger(s);
    int32_t a[9], b[13];
    for (int i = 0; i < 9; i++) a[i] = 10 + i;
    for (int i = 0; i < 13; i++) b[i] = 50 + i;
    loom_seq_t *q;
    loom_microbatch_t *mb = run_prompt(s, a, 9, &q);
    if (!mb) return;
    int32_t ids[8] = {0};
    loom_sched_complete(s, mb, ids, NULL, NULL);
    const int32_t *held = NULL;
    int32_t want[2] = {q->blocks[0], q->blocks[1]};
    CHECK(loom_sched_hold(s, q, 77, 1000, &held) == 2 && held && held[0] == want[0] && held[1] == want[1]);
    loom_sched_finish(s, q);
    CHECK(loom_sched_held_blocks(s) == 2 && loom_kv_n_free(L) == 2);
    CHECK(loom_kv_ref(L, want[0]) == 1 && loom_kv_ref(L, want[1]) == 1);
    int n = 0;
    CHECK(loom_sched_held(s, 77, &n) && n == 2 && !loom_sched_held(s, 78, &n) && n == 0);
    /* b needs 4 blocks: only 2 are free, the held ones are not taken */
    loom_err_t err = {0};
    loom_sampling_t sp = {0};
    CHECK(loom_sched_add(s, 2, b, 13, 1, 0, &sp, NULL, &q, &err) == LOOM_OK);
    mb = loom_sched_schedule(s);
    for (int i = 0; mb && i < mb->n_seqs; i++)
        for (int j = 0; j < mb->seqs[i]->n_blocks; j++)
            CHECK(mb->seqs[i]->blocks[j] != want[0] && mb->seqs[i]->blocks[j] != want[1]);
    if (mb) loom_sched_complete(s, mb, ids, NULL, NULL);
    loom_sched_finish(s, q);
    CHECK(loom_kv_ref(L, want[0]) == 1 && loom_kv_ref(L, want[1]) == 1);
    CHECK(loom_sched_unhold(s, 78) == 0 && loom_sched_unhold(s, 77) == 2 && loom_sched_unhold(s, 77) == 0);
    CHECK(loom_sched_held_blocks(s) == 0 && loom_kv_n_free(L) == 4 && loom_kv_check(L) == 0);
    /* the lease: held until its deadline */
    mb = run_prompt(s, a, 9, &q);
    if (!mb) return;
    loom_sched_complete(s, mb, ids, NULL, NULL);
    CHECK(loom_sched_hold(s, q, 5, 100, &held) == 2);
    loom_sched_finish(s, q);
    uint64_t gone[4] = {0};
    CHECK(loom_sched_hold_expire(s, 99, gone, 4) == 0 && loom_sched_held_blocks(s) == 2);
    CHECK(loom_sched_hold_expire(s, 100, gone, 4) == 1 && gone[0] == 5 && loom_sched_held_blocks(s) == 0);
    CHECK(loom_kv_n_free(L) == 4 && loom_kv_check(L) == 0);
    /* a new pool ends the holds (their ids were the old pool's) */
    mb = run_prompt(s, a, 9, &q);
    if (!mb) return;
    loom_sched_complete(s, mb, ids, NULL, NULL);
    CHECK(loom_sched_hold(s, q, 6, 100, &held) == 2);
    loom_sched_finish(s, q);
    loom_sched_reset_kv(s, 4);
    CHECK(loom_sched_held_blocks(s) == 0 && !loom_sched_held(s, 6, &n));
    CHECK(loom_kv_n_free(loom_sched_ledger(s)) == 4);
    /* a hold the scheduler still has when it goes is released with it (ASan: nothing leaks) */
    mb = run_prompt(s, a, 9, &q);
    if (!mb) return;
    loom_sched_complete(s, mb, ids, NULL, NULL);
    CHECK(loom_sched_hold(s, q, 9, 100, &held) == 2);
    loom_sched_finish(s, q);
    loom_sched_destroy(&s);
}

/* Transport tcp, the decode side: a sequence whose first blocks a prefill
 * holds gets fresh blocks the step pulls (the prefill's ids, its source),
 * counted as cached; the block of the last position is never pulled; a
 * prompt whose blocks the prefix cache holds pulls nothing but still names
 * its source (the prefill hears it may free them); once tried, never
 * again (a re-admission computes). */
static void test_sched_pull(void) {
    loom_sched_t *s = tier_sched(16);
    int32_t a[13];
    for (int i = 0; i < 13; i++) a[i] = 30 + i;
    loom_err_t err = {0};
    loom_sampling_t sp = {0};
    loom_seq_t *q = NULL;
    CHECK(loom_sched_add(s, 1, a, 13, 1, 0, &sp, NULL, &q, &err) == LOOM_OK);
    int32_t remote[4] = {100, 101, 102, 103}; /* 4 named, 3 full blocks before the last position's */
    loom_sched_seq_set_pull(s, q, 4, remote, "tcp://127.0.0.1:1,tcp://127.0.0.1:2", 0x77);
    loom_microbatch_t *mb = loom_sched_schedule(s);
    if (!mb) return;
    CHECK(mb->n_pull_srcs == 1 && mb->pull_seq[0] == q && mb->pull_transfer[0] == 0x77 &&
          !strcmp(mb->pull_addrs[0], "tcp://127.0.0.1:1,tcp://127.0.0.1:2"));
    CHECK(mb->n_pulls == 3 && mb->pull_remote[0] == 100 && mb->pull_remote[2] == 102 && mb->pull_src[2] == 0);
    CHECK(mb->pull_block[0] == q->blocks[0] && mb->pull_block[2] == q->blocks[2]);
    CHECK(mb->n_tokens == 1 && mb->pos[0] == 12 && q->cached_tokens == 12);
    finish_mb(s, mb);
    /* the same prompt again: its blocks are in the prefix cache; nothing pulled, the source still named */
    CHECK(loom_sched_add(s, 2, a, 13, 1, 0, &sp, NULL, &q, &err) == LOOM_OK);
    loom_sched_seq_set_pull(s, q, 3, remote, "tcp://127.0.0.1:1", 0x78);
    mb = loom_sched_schedule(s);
    if (!mb) return;
    CHECK(mb->n_pull_srcs == 1 && mb->n_pulls == 0 && mb->pull_transfer[0] == 0x78 && q->cached_tokens == 12);
    finish_mb(s, mb);
    /* a failed pull: the next admission computes and counts as the first */
    int32_t b[9];
    for (int i = 0; i < 9; i++) b[i] = 70 + i;
    CHECK(loom_sched_add(s, 3, b, 9, 1, 0, &sp, NULL, &q, &err) == LOOM_OK);
    loom_sched_seq_set_pull(s, q, 2, remote, "tcp://127.0.0.1:1", 0x79);
    mb = loom_sched_schedule(s);
    if (!mb) return;
    CHECK(mb->n_pulls == 2 && q->cached_tokens == 8);
    loom_sched_pull_failed(s, q);
    loom_sched_fail(s, mb);
    mb = loom_sched_schedule(s);
    if (!mb) return;
    CHECK(mb->n_pull_srcs == 0 && mb->n_pulls == 0 && mb->n_tokens == 9 && q->cached_tokens == 0);
    finish_mb(s, mb);
    CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    loom_sched_destroy(&s);
}

/* Transport tcp with overlapped scheduling: a batch that pulls gets no row
 * planned ahead of it (a failed pull fails it whole), neither the pulling
 * sequence's nor a decode beside it, which the batch after one without
 * pulls does get; failed, every sequence of it is computed again and no
 * block is lost. */
static void test_sched_pull_ahead(void) {
    loom_sched_config_t c = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 16, .max_model_len = 64,
                             .n_micro = 1, .block_size = TB, .n_blocks = 16, .prefix_cache = 1, .ahead = 1};
    loom_sched_t *s = loom_sched_create(&c);
    int32_t a[5] = {20, 21, 22, 23, 24}, b[13], ids[4] = {0};
    for (int i = 0; i < 13; i++) b[i] = 30 + i;
    loom_sampling_t sp = {0};
    loom_err_t err = {0};
    loom_seq_t *r = NULL, *q = NULL;
    CHECK(loom_sched_add(s, 1, a, 5, 8, 0, &sp, NULL, &r, &err) == LOOM_OK);
    loom_microbatch_t *mb = loom_sched_schedule(s);
    if (!mb) return;
    /* no pulls: r's decode is planned ahead of its prefill */
    loom_microbatch_t *next = loom_sched_schedule_ahead(s, mb, NULL, NULL);
    CHECK(next && next->n_prev == 1 && next->logit_seq[0] == r);
    loom_sched_complete(s, mb, ids, NULL, NULL);
    if (!next) return;
    loom_sched_complete(s, next, ids, NULL, NULL);
    /* q's admission pulls, beside r's decode: nothing is planned ahead of that batch */
    CHECK(loom_sched_add(s, 2, b, 13, 4, 0, &sp, NULL, &q, &err) == LOOM_OK);
    int32_t remote[3] = {100, 101, 102};
    loom_sched_seq_set_pull(s, q, 3, remote, "tcp://127.0.0.1:1", 0x7a);
    mb = loom_sched_schedule(s);
    if (!mb) return;
    CHECK(mb->n_seqs == 2 && mb->n_pulls == 3 && mb->n_pull_srcs == 1);
    next = loom_sched_schedule_ahead(s, mb, NULL, NULL);
    CHECKF(!next, "a batch with %d rows planned ahead of one that pulls", next ? next->n_prev : -1);
    if (next) loom_sched_fail(s, next);
    /* the pull failed: both are computed again, q without pulling */
    loom_sched_pull_failed(s, q);
    loom_sched_fail(s, mb);
    CHECK(r->state == LOOM_SEQ_WAITING && q->state == LOOM_SEQ_WAITING && r->in_flight == 0 && q->in_flight == 0);
    mb = loom_sched_schedule(s);
    if (!mb) return;
    CHECK(mb->n_pull_srcs == 0 && mb->n_pulls == 0 && mb->n_seqs == 2 && q->cached_tokens == 0);
    next = loom_sched_schedule_ahead(s, mb, NULL, NULL);
    CHECK(next && next->n_prev == 2);
    loom_sched_complete(s, mb, ids, NULL, NULL);
    if (next) loom_sched_complete(s, next, ids, NULL, NULL);
    loom_sched_finish(s, r);
    loom_sched_finish(s, q);
    CHECK(loom_kv_check(loom_sched_ledger(s)) == 0 && loom_kv_n_free(loom_sched_ledger(s)) == 16);
    loom_sched_destroy(&s);
}

int main(void) {
    RUN(test_sched_hold);
    RUN(test_sched_pull);
    RUN(test_sched_pull_ahead);
    RUN(test_sched_write_back_and_load);
    RUN(test_sched_pool_after_tier);
    RUN(test_sched_write_through);
    RUN(test_sched_write_through_ahead);
    RUN(test_worker_half);
    RUN(test_match);
    RUN(test_finished);
    RUN(test_policy);
    return test_summary();
}
