/* Wire protocol checks: magic and version on every message kind, and the
 * step-plan validator every worker runs before executing a plan — each
 * out-of-range field refused, and random mutations of a packed plan never
 * crash the decoder or slip through as a plan that indexes out of bounds. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "proto/wire.h"
#include "tests/test.h"

static const loom_plan_limits_t k_lim = {.max_tokens = 64, .max_seqs = 8, .n_blocks = 32, .vocab_size = 512,
                                         .max_pos = 256, .block_size = 16, .max_loras = 2};

/* A valid plan: 2 sequences, a 3-token prefill chunk and a decode. */
typedef struct plan_buf {
    int32_t tokens[4], pos[4], slots[4], tok_seq[4], bt[2 * 2], rows[2], csrc[1], cdst[1], lora[2];
    Loom__V1__SampleParams sp[2];
    Loom__V1__SampleParams *spp[2];
    Loom__V1__StepPlan p;
} plan_buf_t;

static void make_plan(plan_buf_t *b) {
    memset(b, 0, sizeof *b);
    int32_t tokens[4] = {1, 400, 401, 7}, pos[4] = {0, 1, 2, 17}, tok_seq[4] = {0, 0, 0, 1};
    int32_t bt[4] = {3, -1, 5, 6}, slots[4] = {48, 49, 50, 6 * 16 + 1};
    memcpy(b->tokens, tokens, sizeof tokens);
    memcpy(b->pos, pos, sizeof pos);
    memcpy(b->tok_seq, tok_seq, sizeof tok_seq);
    memcpy(b->bt, bt, sizeof bt);
    memcpy(b->slots, slots, sizeof slots);
    b->rows[0] = 2;
    b->rows[1] = 3;
    b->csrc[0] = 4;
    b->cdst[0] = 5;
    loom__v1__step_plan__init(&b->p);
    Loom__V1__StepPlan *p = &b->p;
    p->epoch = 1;
    p->step_id = 9;
    p->tokens = b->tokens;
    p->n_tokens = 4;
    p->pos = b->pos;
    p->n_pos = 4;
    p->slots = b->slots;
    p->n_slots = 4;
    p->tok_seq = b->tok_seq;
    p->n_tok_seq = 4;
    p->n_seqs = 2;
    p->max_blocks = 2;
    p->block_tables = b->bt;
    p->n_block_tables = 4;
    p->logit_rows = b->rows;
    p->n_logit_rows = 2;
    for (int i = 0; i < 2; i++) {
        loom__v1__sample_params__init(&b->sp[i]);
        b->sp[i].temperature = 0.7f;
        b->sp[i].top_p = 0.9f;
        b->spp[i] = &b->sp[i];
    }
    p->sampling = b->spp;
    p->n_sampling = 2;
    p->copy_src = b->csrc;
    p->copy_dst = b->cdst;
    p->n_copy_src = p->n_copy_dst = 1;
    b->lora[0] = -1; /* the base model */
    b->lora[1] = 1;  /* the adapter in slot 1 */
    p->seq_lora = b->lora;
    p->n_seq_lora = 2;
}

static void test_valid_plan(void) {
    plan_buf_t b;
    make_plan(&b);
    loom_err_t err = {0};
    CHECKF(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_OK, "%s", err.msg);
}

/* Each mutation must be refused with LOOM_ERR_FORMAT and a message. */
static void expect_refused(plan_buf_t *b, const char *what) {
    loom_err_t err = {0};
    loom_status_t s = loom_wire_check_plan(&b->p, &k_lim, &err);
    CHECKF(s == LOOM_ERR_FORMAT && err.msg[0], "%s was accepted", what);
    make_plan(b);
}

static void test_each_bad_field(void) {
    plan_buf_t b;
    make_plan(&b);
    b.tokens[1] = 512;
    expect_refused(&b, "token id = vocab");
    b.tokens[0] = -1;
    expect_refused(&b, "negative token id");
    b.pos[3] = 256;
    expect_refused(&b, "position = max_pos");
    b.slots[2] = 32 * 16;
    expect_refused(&b, "slot past the pool");
    b.tok_seq[3] = 2;
    expect_refused(&b, "sequence row past n_seqs");
    b.pos[3] = 40; /* block 2 of a 2-block table */
    expect_refused(&b, "position past the block table");
    b.bt[1] = 32;
    expect_refused(&b, "block id past the pool");
    b.bt[1] = -2;
    expect_refused(&b, "negative block id");
    b.rows[1] = 4;
    expect_refused(&b, "logit row past the tokens");
    b.sp[0].temperature = NAN;
    expect_refused(&b, "NaN temperature");
    b.sp[1].top_p = 1.5f;
    expect_refused(&b, "top_p > 1");
    b.sp[1].top_k = -3;
    expect_refused(&b, "negative top_k");
    b.cdst[0] = 99;
    expect_refused(&b, "block copy past the pool");
    b.p.n_pos = 3;
    expect_refused(&b, "arrays of different lengths");
    b.p.n_block_tables = 3;
    expect_refused(&b, "block tables of the wrong size");
    b.p.n_sampling = 1;
    expect_refused(&b, "sampling count != logit rows");
    b.p.n_copy_dst = 0;
    expect_refused(&b, "copy sources without destinations");
    b.p.n_seqs = 9;
    expect_refused(&b, "more sequences than allowed");
    b.p.n_tokens = 0;
    expect_refused(&b, "an empty plan");
    b.p.max_blocks = 1000;
    expect_refused(&b, "an absurd block-table width");
    /* planned ahead: one previous-step row (or -1) per token, below max_seqs */
    int32_t prev[4] = {1, -1, 0, -1};
    b.p.prev_rows = prev;
    b.p.n_prev_rows = 4;
    b.p.prev_step = 7;
    {
        loom_err_t e = {0};
        CHECKF(loom_wire_check_plan(&b.p, &k_lim, &e) == LOOM_OK, "%s", e.msg);
    }
    b.p.n_prev_rows = 3;
    b.p.prev_rows = prev;
    expect_refused(&b, "previous-step rows for fewer tokens");
    prev[2] = -2;
    b.p.prev_rows = prev;
    b.p.n_prev_rows = 4;
    expect_refused(&b, "previous-step row below -1");
    prev[2] = k_lim.max_seqs;
    b.p.prev_rows = prev;
    b.p.n_prev_rows = 4;
    expect_refused(&b, "previous-step row past max_seqs");
    /* the KV connector's moves: block ids in the pool, one hash each */
    int32_t blk[1] = {3};
    uint64_t hash[1] = {0x1234};
    b.p.kv_load_blocks = b.p.kv_save_blocks = blk;
    b.p.kv_load_hashes = b.p.kv_save_hashes = hash;
    b.p.n_kv_load_blocks = b.p.n_kv_load_hashes = b.p.n_kv_save_blocks = b.p.n_kv_save_hashes = 1;
    loom_err_t err = {0};
    CHECKF(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_OK, "%s", err.msg);
    blk[0] = 32;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV"));
    blk[0] = 3;
    b.p.n_kv_load_hashes = 0;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV moves"));
    b.p.n_kv_load_hashes = 1;
    /* the host tier's slots: none, or one per block */
    int32_t slot[2] = {0, 1};
    b.p.kv_save_slots = b.p.kv_load_slots = slot;
    b.p.n_kv_save_slots = b.p.n_kv_load_slots = 1;
    CHECKF(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_OK, "%s", err.msg);
    b.p.n_kv_load_slots = 2;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "host slots"));
    /* under the host tier, the directory: a spill (save of block -1) names
     * the slot it writes down; a load from the directory has slot -1 */
    int32_t spill_blk[1] = {-1}, dir_slot[1] = {-1};
    b.p.kv_save_blocks = spill_blk;
    b.p.kv_load_slots = dir_slot;
    b.p.n_kv_load_slots = 1;
    CHECKF(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_OK, "%s", err.msg);
    b.p.kv_save_slots = dir_slot; /* a spill from no slot */
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV save 0"));
    b.p.n_kv_load_slots = b.p.n_kv_save_slots = 0; /* a spill without slots */
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV save 0"));
    spill_blk[0] = -2;
    b.p.kv_save_slots = slot;
    b.p.n_kv_save_slots = 1;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV save 0"));
    b.p.kv_save_blocks = blk;
    b.p.kv_load_slots = slot;
    b.p.n_kv_load_slots = b.p.n_kv_save_slots = 0;
    b.p.n_kv_load_blocks = 0;
    b.p.n_kv_save_hashes = 0;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT);
    /* transport tcp pulls: a pool block, a remote block id and a source each; sources with a transfer each */
    make_plan(&b);
    int32_t pb[2] = {3, 4}, pr[2] = {17, 900};
    uint32_t ps[2] = {0, 1};
    char *addrs[2] = {"tcp://127.0.0.1:7001,tcp://127.0.0.1:7002", "tcp://10.0.0.2:7001"};
    uint64_t xid[2] = {0xabc, 0xdef};
    b.p.kv_pull_blocks = pb;
    b.p.kv_pull_remote = pr;
    b.p.kv_pull_source = ps;
    b.p.kv_pull_addrs = addrs;
    b.p.kv_pull_transfer = xid;
    b.p.n_kv_pull_blocks = b.p.n_kv_pull_remote = b.p.n_kv_pull_source = 2;
    b.p.n_kv_pull_addrs = b.p.n_kv_pull_transfer = 2;
    CHECKF(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_OK, "%s", err.msg);
    ps[1] = 2;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV pull 1"));
    ps[1] = 1;
    pb[0] = 32;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV pull 0"));
    pb[0] = 3;
    pr[1] = -1;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV pull 1"));
    pr[1] = 900;
    b.p.n_kv_pull_transfer = 1;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV pulls"));
    b.p.n_kv_pull_transfer = 2;
    b.p.n_kv_pull_remote = 1;
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "KV pulls"));
    b.p.n_kv_pull_remote = 2;
    addrs[0] = "";
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "no address"));
    make_plan(&b);
    b.lora[1] = 2;
    expect_refused(&b, "an adapter slot the worker does not have");
    b.lora[0] = -2;
    expect_refused(&b, "a negative adapter slot other than -1");
    b.p.n_seq_lora = 1;
    expect_refused(&b, "adapter slots for fewer sequences than the plan's");
}

/* Data-parallel attention: one rank a sequence, within the ranks; a copy stays in one rank's partition. */
static void test_dp_ranks(void) {
    plan_buf_t b;
    make_plan(&b);
    loom_plan_limits_t lim = k_lim;
    lim.n_dp = 2; /* partitions of 16 blocks: the plan's blocks 3 and 5, 6 and the copy 4 -> 5 are rank 0's */
    int32_t ranks[2] = {0, 0};
    loom_err_t err = {0};
    CHECK(loom_wire_check_plan(&b.p, &lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "one each"));
    b.p.seq_dp_rank = ranks;
    b.p.n_seq_dp_rank = 2;
    CHECKF(loom_wire_check_plan(&b.p, &lim, &err) == LOOM_OK, "%s", err.msg);
    CHECK(loom_wire_check_plan(&b.p, &k_lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "none without it"));
    ranks[1] = 2;
    CHECK(loom_wire_check_plan(&b.p, &lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "rank 2 of 2"));
    ranks[1] = 1;
    b.cdst[0] = 17; /* 4 -> 17: from rank 0's partition into rank 1's */
    CHECK(loom_wire_check_plan(&b.p, &lim, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "crosses"));
    b.cdst[0] = 5;
    b.p.n_seq_dp_rank = 1;
    CHECK(loom_wire_check_plan(&b.p, &lim, &err) == LOOM_ERR_FORMAT);
}

static void test_versions_and_magic(void) {
    Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    size_t len;
    uint8_t *buf = loom_wire_pack_control(&m, &len);
    loom_err_t err;
    Loom__V1__ControlMsg *ok = loom_wire_unpack_control(buf, len, &err);
    CHECK(ok != NULL);
    if (ok) protobuf_c_message_free_unpacked(&ok->base, NULL);
    free(buf);
    /* another version: refused with both numbers in the message */
    m.magic = LOOM_PROTO_MAGIC;
    m.version = 7;
    len = loom__v1__control_msg__get_packed_size(&m);
    buf = malloc(len);
    loom__v1__control_msg__pack(&m, buf);
    CHECK(loom_wire_unpack_control(buf, len, &err) == NULL && err.code == LOOM_ERR_PROTOCOL);
    CHECKF(strstr(err.msg, "7") && strstr(err.msg, "1"), "%s", err.msg);
    /* no magic */
    m.magic = 0x12345678;
    m.version = LOOM_PROTO_VERSION;
    loom__v1__control_msg__pack(&m, buf);
    CHECK(loom_wire_unpack_control(buf, len, &err) == NULL && err.code == LOOM_ERR_FORMAT);
    free(buf);
    /* no body */
    Loom__V1__Request rq = LOOM__V1__REQUEST__INIT;
    buf = loom_wire_pack_request(&rq, &len);
    CHECK(loom_wire_unpack_request(buf, len, &err) == NULL && err.code == LOOM_ERR_FORMAT);
    free(buf);
    /* a reply of another version */
    Loom__V1__Reply rp = LOOM__V1__REPLY__INIT;
    rp.magic = LOOM_PROTO_MAGIC;
    rp.version = 2;
    len = loom__v1__reply__get_packed_size(&rp);
    buf = malloc(len ? len : 1);
    loom__v1__reply__pack(&rp, buf);
    CHECK(loom_wire_unpack_reply(buf, len, &err) == NULL && err.code == LOOM_ERR_PROTOCOL);
    free(buf);
    /* empty and oversized buffers */
    CHECK(loom_wire_unpack_control("", 0, &err) == NULL);
    static const uint8_t any[8];
    CHECK(loom_wire_unpack_control(any, (size_t)LOOM_MAX_MSG_BYTES + 1, &err) == NULL); /* refused by size, unread */
}

/* Flips bytes and truncates a packed StepPlan: the decoder either refuses it
 * or yields a message that the validator accepts only when every index is in
 * range (checked here independently). */
static void test_fuzzed_plans(void) {
    plan_buf_t b;
    make_plan(&b);
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_STEP;
    m.step = &b.p;
    size_t len;
    uint8_t *good = loom_wire_pack_control(&m, &len);
    uint8_t *buf = malloc(len);
    unsigned long long rng = 99;
    int decoded = 0, accepted = 0;
    for (int it = 0; it < 20000; it++) {
        memcpy(buf, good, len);
        int flips = 1 + it % 4;
        for (int f = 0; f < flips; f++) {
            size_t at = (size_t)((test_randf(&rng, 0.5f) + 0.5f) * (float)len) % len;
            buf[at] = (uint8_t)(test_randf(&rng, 128.0f) + 128.0f);
        }
        size_t n = it % 7 == 0 ? (size_t)((test_randf(&rng, 0.5f) + 0.5f) * (float)len) % len : len;
        loom_err_t err;
        Loom__V1__ControlMsg *d = loom_wire_unpack_control(buf, n, &err);
        if (!d) continue;
        decoded++;
        if (d->body_case == LOOM__V1__CONTROL_MSG__BODY_STEP &&
            loom_wire_check_plan(d->step, &k_lim, &err) == LOOM_OK) {
            accepted++;
            const Loom__V1__StepPlan *p = d->step;
            int bad = 0;
            for (size_t i = 0; i < p->n_tokens; i++) {
                bad |= p->tokens[i] < 0 || p->tokens[i] >= k_lim.vocab_size;
                bad |= p->slots[i] < 0 || p->slots[i] >= k_lim.n_blocks * k_lim.block_size;
                bad |= p->tok_seq[i] < 0 || (uint32_t)p->tok_seq[i] >= p->n_seqs;
                bad |= (size_t)p->tok_seq[i] * p->max_blocks + (size_t)(p->pos[i] / k_lim.block_size) >=
                       p->n_block_tables;
            }
            for (size_t i = 0; i < p->n_logit_rows; i++) bad |= (size_t)p->logit_rows[i] >= p->n_tokens;
            CHECKF(!bad, "iteration %d: an out-of-range plan passed the validator", it);
        }
        protobuf_c_message_free_unpacked(&d->base, NULL);
    }
    fprintf(stderr, "  20000 mutated plans: %d decoded, %d passed validation (all in range)\n", decoded, accepted);
    free(buf);
    free(good);
}

int main(void) {
    RUN(test_valid_plan);
    RUN(test_each_bad_field);
    RUN(test_dp_ranks);
    RUN(test_versions_and_magic);
    RUN(test_fuzzed_plans);
    return test_summary();
}
