/* The grid state machine (coordinator/grid.h) against in-process fake
 * workers that speak the real control protocol over ZeroMQ (loopback TCP):
 * every transition, a worker lost in every state, a coordinator restart in
 * every state, duplicate registrations, stale epochs, probes, and a peer
 * that tries to take over a connected worker's routing id. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/util.h"
#include "coordinator/grid.h"
#include "tests/test.h"
#include "tests/unit/fake_worker.h"

#define TP 2
#define PP 2
#define N (TP * PP)
#define VOCAB 100
/* The grid's heartbeat timeout and the waits below stretch by the run's
 * speed factor (LOOM_TEST_SPEED, scripts/test.sh): on a loaded machine this
 * process may sleep past 400 ms and its fakes' heartbeats with it. */
static double g_speed = 1.0;
#define HB_TIMEOUT_MS ((int)(400 * g_speed))

typedef struct env {
    void *zctx;
    loom_grid_t *g;
    char addr[256];
    fake_worker_t *w[N + 2];
    int n_ready, n_failed, n_done, n_dropped, bad_ids;
    uint64_t done_order[8];
    char why[600];
    /* micro-batches the tests plan (2 tokens, 2 logit rows each) */
    loom_microbatch_t mb[4];
    int32_t tokens[2], pos[2], slots[2], tok_seq[2], tables[1], rows[2];
    loom_sampling_t sampling[2];
    uint64_t steps[2];
} env_t;

static void cb_ready(void *ctx, loom_grid_t *g) {
    (void)g;
    ((env_t *)ctx)->n_ready++;
}
static void cb_failed(void *ctx, loom_grid_t *g, const char *why) {
    (void)g;
    env_t *e = ctx;
    e->n_failed++;
    snprintf(e->why, sizeof e->why, "%s", why);
}
static int cb_done(void *ctx, loom_microbatch_t *mb, const Loom__V1__StepResult *r, double step_s, char *err,
                   size_t err_n) {
    (void)err;
    (void)err_n;
    env_t *e = ctx;
    for (int i = 0; i < mb->n_logits; i++) e->bad_ids += r->ids[i] != 7;
    e->bad_ids += step_s < 0;
    if (e->n_done < 8) e->done_order[e->n_done] = mb->id;
    e->n_done++;
    return 0;
}
static void cb_dropped(void *ctx, loom_microbatch_t *mb) {
    (void)mb;
    ((env_t *)ctx)->n_dropped++;
}

static loom_status_t grid_open(env_t *e, const char *addr) {
    loom_grid_config_t gc = {.control = addr, .model_dir = "/models/fake", .model_name = "fake", .n_layers = 4,
                             .vocab_size = VOCAB, .tp = TP, .pp = PP, .comm = "tcp", .weight_dtype = "f32",
                             .max_num_seqs = 4, .max_batched_tokens = 64, .block_size = 16, .max_model_len = 128,
                             .kv_fraction = 0.5f, .heartbeat_timeout_ms = HB_TIMEOUT_MS};
    loom_grid_callbacks_t cb = {.ctx = e, .on_ready = cb_ready, .on_failed = cb_failed, .on_step_done = cb_done,
                                .on_step_failed = cb_dropped};
    loom_err_t err = {0};
    loom_status_t st = loom_grid_create(&gc, e->zctx, &cb, &e->g, &err);
    if (st < 0) fprintf(stderr, "grid: %s\n", err.msg);
    else snprintf(e->addr, sizeof e->addr, "%s", loom_grid_bound_addr(e->g));
    return st;
}

static void env_init(env_t *e) {
    memset(e, 0, sizeof *e);
    e->zctx = zmq_ctx_new();
    LOOM_ASSERT(grid_open(e, "tcp://127.0.0.1:0") == LOOM_OK);
    for (int i = 0; i < 2; i++) {
        e->tokens[i] = 5 + i;
        e->pos[i] = i;
        e->slots[i] = i;
        e->rows[i] = i;
        e->sampling[i] = (loom_sampling_t){.temperature = 0, .top_p = 1};
    }
    for (int k = 0; k < 4; k++)
        e->mb[k] = (loom_microbatch_t){.id = 100 + (uint64_t)k, .n_tokens = 2, .tokens = e->tokens, .pos = e->pos,
                                       .slots = e->slots, .tok_seq = e->tok_seq, .n_seqs = 1, .max_blocks = 1,
                                       .block_tables = e->tables, .n_logits = 2, .logit_rows = e->rows,
                                       .sampling = e->sampling, .steps = e->steps};
}

static void env_free(env_t *e) {
    for (int i = 0; i < N + 2; i++) fake_destroy(&e->w[i]);
    loom_grid_destroy(&e->g);
    zmq_ctx_term(e->zctx);
}

static void pump_once(env_t *e) {
    if (e->g) {
        loom_grid_on_readable(e->g);
        loom_grid_tick(e->g);
    }
    for (int i = 0; i < N + 2; i++)
        if (e->w[i]) fake_poll(e->w[i]);
    usleep(1000);
}

/* Runs the grid and the fakes until cond holds or ms pass; yields cond. */
#define PUMP_UNTIL(e, cond, ms)                                                                                  \
    ({                                                                                                          \
        uint64_t t_end_ = loom_now_ns() + (uint64_t)((ms) * g_speed) * 1000000ull;                             \
        while (!(cond) && loom_now_ns() < t_end_) pump_once(e);                                               \
        (cond);                                                                                                 \
    })

static void pump_for(env_t *e, int ms) {
    uint64_t t_end = loom_now_ns() + (uint64_t)ms * 1000000ull;
    while (loom_now_ns() < t_end) pump_once(e);
}

static fake_worker_t *add_fake(env_t *e, int i) {
    char id[16];
    snprintf(id, sizeof id, "w%d", i);
    e->w[i] = fake_create(e->zctx, e->addr, id);
    return e->w[i];
}

/* How far fakes go on their own: 0 register only, 1 +Loaded, 2 +Ready, 3 +results. */
static void set_auto(fake_worker_t *f, int level) {
    f->auto_load = level >= 1;
    f->auto_ready = level >= 2;
    f->auto_step = level >= 3;
}

/* Brings the grid to `target` (WAITING: 3 of 4 registered). */
static int drive_to(env_t *e, loom_grid_state_t target) {
    int level = target == LOOM_GRID_WAITING ? 0 : target == LOOM_GRID_LOADING ? 0 : target == LOOM_GRID_JOINING ? 1 : 3;
    int n = target == LOOM_GRID_WAITING ? N - 1 : N;
    for (int i = 0; i < n; i++) {
        fake_worker_t *f = add_fake(e, i);
        set_auto(f, level);
        /* register in a scrambled order: slots follow registration, not names */
        (void)f;
    }
    for (int i = n - 1; i >= 0; i--) fake_register(e->w[i]);
    if (!PUMP_UNTIL(e, loom_grid_n_registered(e->g) == n, 3000)) return 0;
    return PUMP_UNTIL(e, loom_grid_state(e->g) == target, 3000);
}

static void test_every_transition(void) {
    env_t e;
    env_init(&e);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_WAITING && loom_grid_epoch(e.g) == 0);
    for (int i = 0; i < N; i++) set_auto(add_fake(&e, i), 0);
    e.w[N - 1]->heartbeats = e.w[N - 1]->auto_register = 0; /* it stays away until told */
    e.w[2]->kv_budget = 16 * 1024; /* the smallest worker decides the pool: 16 blocks */
    for (int i = 0; i < N - 1; i++) fake_register(e.w[i]);
    REQUIRE(PUMP_UNTIL(&e, loom_grid_n_registered(e.g) == N - 1, 3000));
    pump_for(&e, 50);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_WAITING);
    CHECK(e.w[0]->n_assign == 0);
    char msg[600];
    loom_grid_describe(e.g, msg, sizeof msg);
    CHECKF(strstr(msg, "waiting_for_workers, 3 of 4 workers registered") != NULL, "%s", msg);
    /* WAITING -> LOADING: the last slot fills; every worker gets its Assign */
    e.w[N - 1]->heartbeats = e.w[N - 1]->auto_register = 1;
    fake_register(e.w[N - 1]);
    REQUIRE(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_LOADING, 3000));
    REQUIRE(PUMP_UNTIL(&e, e.w[0]->n_assign && e.w[1]->n_assign && e.w[2]->n_assign && e.w[3]->n_assign, 3000));
    for (int i = 0; i < N; i++) {
        CHECK(e.w[i]->epoch == 1 && e.w[i]->incarnation == loom_grid_incarnation(e.g) && e.w[i]->incarnation != 0);
        int slot = (int)(e.w[i]->stage * TP + e.w[i]->tp_rank);
        CHECK(!strcmp(loom_grid_slot_worker(e.g, slot), e.w[i]->id));
    }
    /* Loaded of another epoch is a leftover: dropped */
    for (int i = 0; i < N; i++) fake_send_loaded(e.w[i], 7);
    pump_for(&e, 50);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_LOADING);
    for (int i = 0; i < N - 1; i++) fake_send_loaded(e.w[i], 1);
    pump_for(&e, 50);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_LOADING);
    /* LOADING -> JOINING: KvConfig to all */
    fake_send_loaded(e.w[N - 1], 1);
    REQUIRE(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_JOINING, 3000));
    CHECK(loom_grid_n_blocks(e.g) == 16);
    CHECK(!strcmp(loom_grid_kv_dtype(e.g), "f32") && loom_grid_kv_block_bytes(e.g) == 1024);
    REQUIRE(PUMP_UNTIL(&e, e.w[0]->n_kv && e.w[1]->n_kv && e.w[2]->n_kv && e.w[3]->n_kv, 3000));
    for (int i = 0; i < N; i++) fake_send_ready(e.w[i], 3); /* stale */
    pump_for(&e, 50);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_JOINING && e.n_ready == 0);
    /* JOINING -> READY */
    for (int i = 0; i < N; i++) fake_send_ready(e.w[i], 1);
    REQUIRE(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_READY, 3000));
    CHECK(e.n_ready == 1 && loom_grid_n_ready(e.g) == N && loom_grid_last_failure(e.g)[0] == '\0');
    /* READY: up to pp plans in flight, results in plan order */
    for (int i = 0; i < N; i++) set_auto(e.w[i], 3);
    CHECK(loom_grid_can_send(e.g));
    loom_grid_send_plan(e.g, &e.mb[0]);
    loom_grid_send_plan(e.g, &e.mb[1]);
    CHECK(!loom_grid_can_send(e.g) && loom_grid_n_inflight(e.g) == 2);
    REQUIRE(PUMP_UNTIL(&e, e.n_done == 2, 3000));
    CHECK(e.done_order[0] == 100 && e.done_order[1] == 101 && e.bad_ids == 0);
    for (int i = 0; i < N; i++) CHECK(e.w[i]->n_step == 2 && e.w[i]->last_step_epoch == 1);
    CHECK(loom_grid_n_inflight(e.g) == 0 && loom_grid_can_send(e.g));
    CHECK(e.n_failed == 0);
    /* a fifth worker stands by: the grid is full */
    fake_worker_t *spare = add_fake(&e, N);
    spare->heartbeats = spare->auto_register = 0;
    fake_register(spare);
    REQUIRE(PUMP_UNTIL(&e, spare->n_error > 0, 3000));
    CHECK(spare->last_error_code == LOOM_ERR_RESOURCE_EXHAUSTED && spare->n_assign == 0);
    env_free(&e);
}

static const char *state_label[] = {"waiting", "loading", "joining", "ready"};

static void test_lost_in_every_state(void) {
    for (int t = LOOM_GRID_WAITING; t <= LOOM_GRID_READY; t++) {
        env_t e;
        env_init(&e);
        REQUIRE(drive_to(&e, (loom_grid_state_t)t));
        uint64_t epoch = loom_grid_epoch(e.g);
        int busy = t == LOOM_GRID_READY;
        if (busy) {
            set_auto(e.w[3], 0); /* w3 holds the plan back: it stays in flight */
            for (int i = 0; i < N; i++) e.w[i]->auto_step = 0;
            loom_grid_send_plan(e.g, &e.mb[0]);
            REQUIRE(PUMP_UNTIL(&e, e.w[0]->n_step == 1, 3000));
        }
        /* the worker of slot 1 falls silent */
        const char *victim_id = loom_grid_slot_worker(e.g, 1);
        REQUIRE(victim_id != NULL);
        fake_worker_t *victim = NULL;
        for (int i = 0; i < N; i++)
            if (e.w[i] && !strcmp(e.w[i]->id, victim_id)) victim = e.w[i];
        REQUIRE(victim != NULL);
        victim->heartbeats = 0;
        victim->auto_register = 0;
        int registered = loom_grid_n_registered(e.g);
        CHECKF(PUMP_UNTIL(&e, loom_grid_n_registered(e.g) == registered - 1, 3000), "state %s", state_label[t]);
        CHECKF(loom_grid_state(e.g) == LOOM_GRID_WAITING && loom_grid_slot_worker(e.g, 1) == NULL, "state %s",
               state_label[t]);
        CHECKF(e.n_failed == 1 && strstr(e.why, "missed heartbeats") != NULL, "state %s: %d %s", state_label[t],
               e.n_failed, e.why);
        CHECKF(e.n_dropped == busy && loom_grid_n_inflight(e.g) == 0, "state %s", state_label[t]);
        /* the others were told to stop waiting on the data plane */
        for (int i = 0; i < N; i++)
            if (e.w[i] && e.w[i] != victim)
                CHECKF(PUMP_UNTIL(&e, e.w[i]->n_abort == 1, 1000) && e.w[i]->abort_epoch == epoch &&
                           e.w[i]->abort_incarnation == loom_grid_incarnation(e.g),
                       "state %s: w%d", state_label[t], i);
        /* it comes back and gets its own slot again (it names its shard) */
        for (int i = 0; i < N; i++)
            if (e.w[i]) set_auto(e.w[i], 3);
        victim->heartbeats = 1;
        fake_register(victim);
        if (t == LOOM_GRID_WAITING) {
            CHECK(PUMP_UNTIL(&e, loom_grid_n_registered(e.g) == N - 1, 3000));
        } else {
            CHECKF(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_READY, 5000), "state %s", state_label[t]);
            CHECKF(!strcmp(loom_grid_slot_worker(e.g, 1), victim->id), "state %s", state_label[t]);
            CHECK(loom_grid_epoch(e.g) == epoch + 1);
        }
        env_free(&e);
    }
}

static void test_restart_in_every_state(void) {
    for (int t = LOOM_GRID_WAITING; t <= LOOM_GRID_READY; t++) {
        env_t e;
        env_init(&e);
        REQUIRE(drive_to(&e, (loom_grid_state_t)t));
        char held[N][64] = {{0}};
        for (int i = 0; i < N; i++)
            if (loom_grid_slot_worker(e.g, i)) snprintf(held[i], sizeof held[i], "%s", loom_grid_slot_worker(e.g, i));
        uint64_t old_inc = loom_grid_incarnation(e.g);
        char addr[256];
        snprintf(addr, sizeof addr, "%s", e.addr);
        /* the coordinator dies (no Shutdown) and a new one binds the same address */
        loom_grid_destroy(&e.g);
        pump_for(&e, 50);
        REQUIRE(grid_open(&e, addr) == LOOM_OK);
        CHECK(loom_grid_incarnation(e.g) != old_inc);
        if (!e.w[N - 1]) {
            set_auto(add_fake(&e, N - 1), 3);
            fake_register(e.w[N - 1]);
        }
        for (int i = 0; i < N; i++) set_auto(e.w[i], 3);
        /* the fakes' heartbeats are answered NOT_FOUND; they register again */
        CHECKF(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_READY, 8000), "restart in %s: %s", state_label[t],
               loom_grid_state_name(loom_grid_state(e.g)));
        CHECK(loom_grid_epoch(e.g) == 1);
        for (int i = 0; i < N; i++) CHECK(e.w[i]->incarnation == loom_grid_incarnation(e.g));
        if (t != LOOM_GRID_WAITING) /* they held shards: each gets its own slot back */
            for (int i = 0; i < N; i++)
                CHECKF(loom_grid_slot_worker(e.g, i) && !strcmp(loom_grid_slot_worker(e.g, i), held[i]),
                       "restart in %s: slot %d is %s, was %s", state_label[t], i,
                       loom_grid_slot_worker(e.g, i) ? loom_grid_slot_worker(e.g, i) : "(free)", held[i]);
        loom_grid_send_plan(e.g, &e.mb[0]);
        CHECK(PUMP_UNTIL(&e, e.n_done == 1, 3000));
        env_free(&e);
    }
}

static void test_duplicate_registration(void) {
    env_t e;
    env_init(&e);
    REQUIRE(drive_to(&e, LOOM_GRID_READY));
    const char *id1 = loom_grid_slot_worker(e.g, 1);
    fake_worker_t *w1 = NULL;
    for (int i = 0; i < N; i++)
        if (!strcmp(e.w[i]->id, id1)) w1 = e.w[i];
    REQUIRE(w1 != NULL);
    /* the same process registering twice (a retry that crossed the
     * coordinator's answer) changes nothing: it is answered with a heartbeat */
    int hb = w1->n_heartbeat;
    fake_register(w1);
    fake_register(w1);
    CHECK(PUMP_UNTIL(&e, w1->n_heartbeat >= hb + 2, 3000));
    CHECK(e.n_failed == 0 && loom_grid_state(e.g) == LOOM_GRID_READY && loom_grid_epoch(e.g) == 1);
    /* a restarted process with the same id (a new data-plane address) aborts
     * the epoch and rebuilds the grid with it in its own slot */
    fake_worker_t old = *w1;
    int k = 0;
    while (e.w[k] != w1) k++;
    fake_destroy(&e.w[k]);
    pump_for(&e, 100); /* its connection closes */
    w1 = e.w[k] = fake_create(e.zctx, e.addr, old.id);
    w1->has_shard = 1;
    w1->stage = old.stage, w1->n_stages = old.n_stages, w1->tp_rank = old.tp_rank, w1->tp_size = old.tp_size;
    snprintf(w1->model_dir, sizeof w1->model_dir, "%s", old.model_dir);
    fake_register(w1);
    REQUIRE(PUMP_UNTIL(&e, e.n_failed == 1, 3000));
    CHECK(strstr(e.why, "registered again") != NULL);
    CHECK(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_READY && loom_grid_epoch(e.g) == 2, 5000));
    CHECK(!strcmp(loom_grid_slot_worker(e.g, 1), w1->id) && e.n_ready == 2);
    /* a Register whose worker id is not the connection's routing id */
    fake_worker_t *odd = add_fake(&e, N);
    odd->heartbeats = odd->auto_register = 0;
    fake_register_as(odd, "somebody-else");
    REQUIRE(PUMP_UNTIL(&e, odd->n_error > 0, 3000));
    CHECK(odd->last_error_code == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_READY && loom_grid_epoch(e.g) == 2);
    env_free(&e);
}

static void test_stale_and_bad_results(void) {
    env_t e;
    env_init(&e);
    REQUIRE(drive_to(&e, LOOM_GRID_READY));
    fake_worker_t *last = NULL; /* the fake that answers plans */
    for (int i = 0; i < N; i++) {
        e.w[i]->auto_step = 0;
        if (e.w[i]->stage == PP - 1 && e.w[i]->tp_rank == 0) last = e.w[i];
    }
    REQUIRE(last != NULL);
    loom_grid_send_plan(e.g, &e.mb[0]);
    REQUIRE(PUMP_UNTIL(&e, last->n_step == 1, 3000));
    /* a result of an older epoch is a leftover */
    fake_send_result(last, 0, 100, 2, 0);
    pump_for(&e, 50);
    CHECK(e.n_done == 0 && loom_grid_n_inflight(e.g) == 1 && loom_grid_state(e.g) == LOOM_GRID_READY);
    fake_send_result(last, 1, 100, 2, 0);
    REQUIRE(PUMP_UNTIL(&e, e.n_done == 1, 3000));
    /* a result out of plan order aborts the epoch; every member answers its
     * probe, so the same members rebuild the grid */
    loom_grid_send_plan(e.g, &e.mb[1]);
    REQUIRE(PUMP_UNTIL(&e, last->n_step == 2, 3000));
    fake_send_result(last, 1, 999, 2, 0);
    REQUIRE(PUMP_UNTIL(&e, e.n_failed == 1, 3000));
    CHECK(strstr(e.why, "out of order") != NULL && e.n_dropped == 1);
    CHECK(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_READY && loom_grid_epoch(e.g) == 2, 5000));
    /* a wrong number of ids, and a token outside the vocabulary */
    loom_grid_send_plan(e.g, &e.mb[2]);
    REQUIRE(PUMP_UNTIL(&e, last->n_step == 3, 3000));
    fake_send_result(last, 2, 102, 1, 0);
    REQUIRE(PUMP_UNTIL(&e, e.n_failed == 2, 3000));
    CHECK(strstr(e.why, "returned 1 ids for 2 rows") != NULL && e.n_dropped == 2);
    /* a step failure on a worker */
    CHECK(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_READY && loom_grid_epoch(e.g) == 3, 5000));
    loom_grid_send_plan(e.g, &e.mb[3]);
    REQUIRE(PUMP_UNTIL(&e, last->n_step == 4, 3000));
    fake_send_result(last, 3, 103, 2, LOOM_ERR_INTERNAL);
    REQUIRE(PUMP_UNTIL(&e, e.n_failed == 3, 3000));
    CHECK(strstr(e.why, "fake failure") != NULL);
    env_free(&e);
}

static void test_probes_exclude_the_dead(void) {
    env_t e;
    env_init(&e);
    REQUIRE(drive_to(&e, LOOM_GRID_READY));
    const char *id2 = loom_grid_slot_worker(e.g, 2);
    fake_worker_t *w2 = NULL;
    for (int i = 0; i < N; i++)
        if (!strcmp(e.w[i]->id, id2)) w2 = e.w[i];
    REQUIRE(w2 != NULL);
    /* its data plane is gone but it still heartbeats: the failed step's probes find it */
    fake_close_data_plane(w2);
    w2->auto_register = 0;
    for (int i = 0; i < N; i++) e.w[i]->auto_step = 0;
    loom_grid_send_plan(e.g, &e.mb[0]);
    REQUIRE(PUMP_UNTIL(&e, e.w[0]->n_step == 1, 3000));
    for (int i = 0; i < N; i++)
        if (e.w[i]->stage == PP - 1 && e.w[i]->tp_rank == 0) fake_send_result(e.w[i], 1, 100, 2, LOOM_ERR_UNAVAILABLE);
    REQUIRE(PUMP_UNTIL(&e, e.n_failed == 1, 3000));
    CHECK(loom_grid_probing(e.g) || loom_grid_slot_worker(e.g, 2) == NULL);
    CHECK(PUMP_UNTIL(&e, !loom_grid_probing(e.g), 3000));
    CHECK(loom_grid_state(e.g) == LOOM_GRID_WAITING && loom_grid_slot_worker(e.g, 2) == NULL);
    CHECK(strstr(loom_grid_last_failure(e.g), "refused a connection") != NULL);
    /* a spare takes the free place */
    fake_worker_t *spare = add_fake(&e, N);
    fake_register(spare);
    CHECK(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_READY, 5000));
    CHECK(loom_grid_slot_worker(e.g, 2) && !strcmp(loom_grid_slot_worker(e.g, 2), spare->id));
    env_free(&e);
}

/* A worker whose join failed (UNAVAILABLE) says so naming the epoch: the grid
 * plans again with the same workers (a new epoch) instead of staying JOINING;
 * an error naming another epoch, or a deterministic one, changes nothing. */
static void test_failed_join_plans_again(void) {
    env_t e;
    env_init(&e);
    REQUIRE(drive_to(&e, LOOM_GRID_JOINING));
    REQUIRE(PUMP_UNTIL(&e, e.w[0]->n_kv && e.w[1]->n_kv && e.w[2]->n_kv && e.w[3]->n_kv, 3000));
    uint64_t epoch = loom_grid_epoch(e.g);
    Loom__V1__Error er = LOOM__V1__ERROR__INIT;
    er.code = LOOM_ERR_UNAVAILABLE;
    er.message = "tcp comm: timed out waiting for: tp rank 0";
    er.epoch = epoch + 5; /* not this epoch's join */
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_ERROR;
    m.error = &er;
    fake_send(e.w[1], &m);
    pump_for(&e, 50);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_JOINING && loom_grid_epoch(e.g) == epoch);
    er.epoch = epoch; /* this epoch, but a deterministic failure: reported, not retried */
    er.code = LOOM_ERR_UNSUPPORTED;
    fake_send(e.w[1], &m);
    pump_for(&e, 50);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_JOINING && loom_grid_epoch(e.g) == epoch);
    er.code = LOOM_ERR_UNAVAILABLE;
    fake_send(e.w[1], &m);
    REQUIRE(PUMP_UNTIL(&e, loom_grid_epoch(e.g) == epoch + 1, 3000));
    CHECK(strstr(loom_grid_last_failure(e.g), "timed out waiting for") != NULL);
    for (int i = 0; i < N; i++) set_auto(e.w[i], 2);
    CHECK(PUMP_UNTIL(&e, loom_grid_state(e.g) == LOOM_GRID_READY, 5000));
    CHECK(loom_grid_epoch(e.g) == epoch + 1 && loom_grid_n_registered(e.g) == N);
    env_free(&e);
}

static void test_routing_id_hijack(void) {
    env_t e;
    env_init(&e);
    REQUIRE(drive_to(&e, LOOM_GRID_READY));
    const char *id0 = loom_grid_slot_worker(e.g, 0);
    fake_worker_t *w0 = NULL;
    for (int i = 0; i < N; i++)
        if (!strcmp(e.w[i]->id, id0)) w0 = e.w[i];
    REQUIRE(w0 != NULL);
    uint64_t epoch = loom_grid_epoch(e.g);
    /* a second connection with the same routing id: registers, heartbeats */
    fake_worker_t *thief = fake_create(e.zctx, e.addr, w0->id);
    e.w[N] = thief;
    set_auto(thief, 3);
    pump_for(&e, 100);
    fake_register(thief);
    fake_send_result(thief, epoch, 100, 2, 0);
    pump_for(&e, 200);
    loom_grid_send_plan(e.g, &e.mb[0]);
    REQUIRE(PUMP_UNTIL(&e, e.n_done == 1, 3000));
    pump_for(&e, 100);
    CHECK(thief->n_assign == 0 && thief->n_step == 0 && thief->n_heartbeat == 0 && thief->n_error == 0);
    CHECK(w0->n_step == 1);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_READY && loom_grid_epoch(e.g) == epoch && e.n_failed == 0);
    CHECK(!strcmp(loom_grid_slot_worker(e.g, 0), w0->id));
    /* a peer of its own id that speaks for w0: refused, nothing changes */
    fake_worker_t *other = add_fake(&e, N + 1);
    other->heartbeats = other->auto_register = 0;
    fake_register_as(other, w0->id);
    REQUIRE(PUMP_UNTIL(&e, other->n_error > 0, 3000));
    CHECK(other->last_error_code == LOOM_ERR_INVALID_ARGUMENT);
    fake_send_result(other, epoch, 101, 2, 0);
    REQUIRE(PUMP_UNTIL(&e, other->n_error > 1, 3000));
    CHECK(other->last_error_code == LOOM_ERR_NOT_FOUND && other->n_step == 0);
    CHECK(loom_grid_state(e.g) == LOOM_GRID_READY && loom_grid_epoch(e.g) == epoch && e.n_failed == 0);
    /* the identity hook: a slot registered without authentication speaks
     * only for peers without one; another identity is refused */
    CHECK(loom_grid_peer_allowed(e.g, 0, NULL));
    CHECK(!loom_grid_peer_allowed(e.g, 0, "some-other-key"));
    CHECK(!loom_grid_peer_allowed(e.g, 99, NULL) && !loom_grid_peer_allowed(e.g, -1, NULL));
    env_free(&e);
}

int main(void) {
    loom_log_set_level(LOOM_LOG_WARN);
    const char *speed = getenv("LOOM_TEST_SPEED");
    if (speed && atof(speed) > 1.0) g_speed = atof(speed);
    RUN(test_every_transition);
    RUN(test_lost_in_every_state);
    RUN(test_restart_in_every_state);
    RUN(test_duplicate_registration);
    RUN(test_stale_and_bad_results);
    RUN(test_probes_exclude_the_dead);
    RUN(test_routing_id_hijack);
    RUN(test_failed_join_plans_again);
    return test_summary();
}
