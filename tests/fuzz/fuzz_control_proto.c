/* Fuzz target: bytes off the control socket (loom.v1 ControlMsg, every
 * body: Register ... Abort) through the unpacker, and step plans through
 * loom_wire_check_plan. A plan the check accepts is then walked the way a
 * worker indexes with it: every index it holds must lie inside the arrays
 * and pools the limits describe (ASan reports any that does not). */
#include <string.h>

#include "proto/wire.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    return 0;
}

/* What a worker touches for an accepted plan, on buffers of exactly the
 * sizes the limits allow. */
static void walk_plan(const Loom__V1__StepPlan *p, const loom_plan_limits_t *lim) {
    size_t pool = (size_t)lim->n_blocks * (size_t)lim->block_size;
    unsigned char *kv = calloc(pool, 1), *vocab = calloc((size_t)lim->vocab_size, 1);
    unsigned char *blocks = calloc((size_t)lim->n_blocks, 1);
    for (size_t i = 0; i < p->n_tokens; i++) {
        vocab[p->tokens[i]]++;
        kv[p->slots[i]]++;
        int32_t b = p->block_tables[(size_t)p->tok_seq[i] * p->max_blocks +
                                    (size_t)(p->pos[i] / lim->block_size)];
        if (b >= 0) blocks[b]++;
    }
    for (size_t i = 0; i < p->n_logit_rows; i++)
        vocab[p->tokens[p->logit_rows[i]]]++;
    for (size_t i = 0; i < p->n_copy_src; i++)
        blocks[p->copy_src[i]] = blocks[p->copy_dst[i]];
    free(kv);
    free(vocab);
    free(blocks);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_err_t err = {0};
    Loom__V1__ControlMsg *m = loom_wire_unpack_control(data, size, &err);
    if (!m) {
        FUZZ_ASSERT(err.msg[0]);
        return 0;
    }
    FUZZ_ASSERT(m->body_case != LOOM__V1__CONTROL_MSG__BODY__NOT_SET);
    if (m->body_case == LOOM__V1__CONTROL_MSG__BODY_STEP && m->step) {
        static const loom_plan_limits_t limits[] = {
            {.max_tokens = 512,
             .max_seqs = 64,
             .n_blocks = 2048,
             .vocab_size = 512,
             .max_pos = 512,
             .block_size = 16},
            {.max_tokens = 8,
             .max_seqs = 2,
             .n_blocks = 4,
             .vocab_size = 32,
             .max_pos = 64,
             .block_size = 16},
            {.max_tokens = 64,
             .max_seqs = 8,
             .n_blocks = 16,
             .vocab_size = 1000,
             .max_pos = 32,
             .block_size = 1},
        };
        for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++)
            if (loom_wire_check_plan(m->step, &limits[i], &err) == LOOM_OK)
                walk_plan(m->step, &limits[i]);
            else
                FUZZ_ASSERT(err.msg[0]);
    }
    size_t len = 0;
    void *buf = loom_wire_pack_control(m, &len);
    Loom__V1__ControlMsg *again = loom_wire_unpack_control(buf, len, &err);
    if (!again) fprintf(stderr, "the packed message does not unpack: %s\n", err.msg);
    FUZZ_ASSERT(fuzz_pb_has_unknown(&m->base) || (again && again->body_case == m->body_case));
    if (again) loom__v1__control_msg__free_unpacked(again, NULL);
    free(buf);
    loom__v1__control_msg__free_unpacked(m, NULL);
    return 0;
}
