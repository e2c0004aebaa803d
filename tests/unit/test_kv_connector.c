/* The coordinator half of a KV connector: the checked entry points cut a
 * connector's answer to whole blocks within the request, the no-connector
 * case, delayed free and kv_transfer_params, the load-failure policy names. */
#include "coordinator/kv_connector.h"
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

int main(void) {
    RUN(test_worker_half);
    RUN(test_match);
    RUN(test_finished);
    RUN(test_policy);
    return test_summary();
}
