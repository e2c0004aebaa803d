/* The preparation pool (coordinator/prepare.h): every job comes back once,
 * with its grammar compiled; a cancelled job comes back promptly, even one
 * that was compiling a schema that takes long; destroy frees what is
 * left. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "coordinator/prepare.h"
#include "tests/test.h"

static loom_prep_job_t *job(int kind, const char *spec, void *ctx) {
    loom_prep_job_t *j = calloc(1, sizeof *j);
    j->ctx = ctx;
    j->kind = kind;
    j->spec = loom_xstrdup(spec);
    j->len = strlen(spec);
    return j;
}

/* Waits for the pool's fd (up to ms) and takes one job. */
static loom_prep_job_t *wait_take(loom_prep_t *p, int ms) {
    uint64_t end = loom_now_ns() + (uint64_t)ms * 1000000ull;
    for (;;) {
        loom_prep_job_t *j = loom_prep_take(p);
        if (j || loom_now_ns() > end) return j;
        struct pollfd pf = {.fd = loom_prep_fd(p), .events = POLLIN};
        poll(&pf, 1, 50);
    }
}

/* A JSON schema that takes a while to compile: n objects with a string
 * pattern, an enum and a boolean each, all names distinct. */
static char *slow_schema(int n) {
    size_t cap = (size_t)n * 256 + 64, len = 0;
    char *s = malloc(cap);
    len += (size_t)snprintf(s + len, cap - len, "{\"type\":\"object\",\"properties\":{");
    for (int i = 0; i < n; i++)
        len += (size_t)snprintf(s + len, cap - len,
                                "%s\"f%d\":{\"type\":\"object\",\"properties\":{\"n%d\":{\"type\":\"string\","
                                "\"pattern\":\"^[a-z]{1,12}$\"},\"k%d\":{\"enum\":[\"a%d\",\"b%d\"]},"
                                "\"g%d\":{\"type\":\"boolean\"}},\"required\":[\"n%d\"]}",
                                i ? "," : "", i, i, i, i, i, i, i);
    snprintf(s + len, cap - len, "}}");
    return s;
}

static void test_round_trip(void) {
    loom_prep_t *p = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_prep_create(2, &p, &err) == LOOM_OK);
    int ctx[8];
    for (int i = 0; i < 8; i++)
        loom_prep_submit(p, job(i % 2 ? LOOM_GRAMMAR_REGEX : LOOM_GRAMMAR_JSON_SCHEMA,
                                i % 2 ? "[a-z]{1,8}" : "{\"type\":\"integer\"}", &ctx[i]));
    int seen[8] = {0};
    for (int n = 0; n < 8; n++) {
        loom_prep_job_t *j = wait_take(p, 30000);
        REQUIRE(j);
        int i = (int)((int *)j->ctx - ctx);
        CHECK(i >= 0 && i < 8 && !seen[i]);
        seen[i] = 1;
        CHECKF(j->status == LOOM_OK && j->grammar, "job %d: %s", i, j->err.msg);
        if (j->grammar) CHECK(loom_grammar_check(j->grammar, i % 2 ? "abc" : "42", i % 2 ? 3 : 2) == LOOM_GRAMMAR_MATCH);
        loom_prep_job_free(&j);
    }
    CHECK(loom_prep_take(p) == NULL && loom_prep_pending(p) == 0);
    /* a bad spec comes back with its error */
    loom_prep_submit(p, job(LOOM_GRAMMAR_JSON_SCHEMA, "{", NULL));
    loom_prep_job_t *j = wait_take(p, 30000);
    REQUIRE(j);
    CHECK(j->status < 0 && !j->grammar && strstr(j->err.msg, "not valid JSON"));
    loom_prep_job_free(&j);
    loom_prep_destroy(&p);
    loom_prep_destroy(&p); /* twice is safe */
}

static void test_cancel(void) {
    loom_prep_t *p = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_prep_create(1, &p, &err) == LOOM_OK);
    char *slow = slow_schema(8000);
    uint64_t t_alone = loom_now_ns();
    loom_prep_submit(p, job(LOOM_GRAMMAR_JSON_SCHEMA, slow, NULL));
    loom_prep_job_t *j = wait_take(p, 120000);
    REQUIRE(j);
    t_alone = loom_now_ns() - t_alone;
    CHECKF(j->status == LOOM_OK, "the slow grammar: %s", j->err.msg);
    loom_prep_job_free(&j);
    /* the same, cancelled soon after it starts; and one queued behind it, cancelled before it runs */
    loom_prep_job_t *a = job(LOOM_GRAMMAR_JSON_SCHEMA, slow, NULL), *b = job(LOOM_GRAMMAR_REGEX, "x", NULL);
    uint64_t t0 = loom_now_ns();
    loom_prep_submit(p, a);
    loom_prep_submit(p, b);
    loom_prep_cancel(b);
    while (loom_now_ns() - t0 < t_alone / 10) {} /* it runs */
    loom_prep_cancel(a);
    int back = 0;
    while (back < 2) {
        j = wait_take(p, 120000);
        REQUIRE(j);
        CHECK(atomic_load(&j->cancelled) && j->status < 0 && !j->grammar);
        back++;
        loom_prep_job_free(&j);
    }
    uint64_t took = loom_now_ns() - t0;
    printf("  a %.0f ms compile stopped by a cancel after %.0f ms\n", (double)t_alone * 1e-6, (double)took * 1e-6);
    /* the builder polls the cancel every 4Ki elements: well before the end (the finish pass is not polled) */
    CHECKF(took < t_alone, "cancelled after %.0f ms, the whole compile takes %.0f", (double)took * 1e-6,
           (double)t_alone * 1e-6);
    /* destroy with a job still out: it is cancelled and freed */
    loom_prep_submit(p, job(LOOM_GRAMMAR_JSON_SCHEMA, slow, NULL));
    loom_prep_destroy(&p);
    free(slow);
}

int main(void) {
    RUN(test_round_trip);
    RUN(test_cancel);
    return test_summary();
}
