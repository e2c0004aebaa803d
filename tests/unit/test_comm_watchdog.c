/* The step watchdog (worker/comm_watchdog.h) with a fake probe standing in
 * for the device: budgets, the IDLE/ARMED/FIRED transitions, and that a
 * silent peer (a probe that keeps saying "running") fires exactly at the
 * deadline, never before. */
#include <string.h>

#include "tests/test.h"
#include "worker/comm_watchdog.h"

#define MS 1000000ull

typedef struct fake {
    loom_wd_probe_t answer;
    int calls;
} fake_t;

static loom_wd_probe_t fake_probe(void *ctx, char *why, size_t cap) {
    fake_t *f = ctx;
    f->calls++;
    if (f->answer == LOOM_WD_PROBE_FAILED) snprintf(why, cap, "peer 1 lost");
    return f->answer;
}

static void test_budget(void) {
    loom_wd_limits_t lim = {0};
    CHECK(loom_watchdog_budget_ms(&lim, 0) == LOOM_WD_BASE_MS_DEFAULT);
    CHECK(loom_watchdog_budget_ms(&lim, 1000) == LOOM_WD_BASE_MS_DEFAULT + LOOM_WD_US_PER_TOKEN_DEFAULT);
    lim = (loom_wd_limits_t){.base_ms = 50, .us_per_token = 10};
    CHECK(loom_watchdog_budget_ms(&lim, 1) == 51); /* partial milliseconds round up */
    CHECK(loom_watchdog_budget_ms(&lim, 100) == 51);
    CHECK(loom_watchdog_budget_ms(&lim, 101) == 52);
    CHECK(loom_watchdog_budget_ms(&lim, -5) == 50);
    lim.max_ms = 60;
    CHECK(loom_watchdog_budget_ms(&lim, 1000000) == 60);
    lim = (loom_wd_limits_t){.base_ms = 1, .us_per_token = 1, .max_ms = 1};
    CHECK(loom_watchdog_budget_ms(&lim, 0) == 1);
}

static void test_done_and_disarm(void) {
    loom_watchdog_t wd;
    loom_watchdog_init(&wd);
    fake_t f = {.answer = LOOM_WD_PROBE_RUNNING};
    CHECK(loom_watchdog_check(&wd, 0, fake_probe, &f) == LOOM_WD_IDLE);
    CHECK(f.calls == 0); /* an idle watchdog asks nothing */
    loom_watchdog_arm(&wd, 1000 * MS, 100);
    CHECK(wd.state == LOOM_WD_ARMED);
    CHECK(loom_watchdog_check(&wd, 1050 * MS, fake_probe, &f) == LOOM_WD_ARMED);
    f.answer = LOOM_WD_PROBE_DONE;
    CHECK(loom_watchdog_check(&wd, 1060 * MS, fake_probe, &f) == LOOM_WD_IDLE);
    /* done beats a late poll: the work finished, no failure */
    loom_watchdog_arm(&wd, 2000 * MS, 100);
    CHECK(loom_watchdog_check(&wd, 9000 * MS, fake_probe, &f) == LOOM_WD_IDLE);
    loom_watchdog_arm(&wd, 3000 * MS, 100);
    loom_watchdog_disarm(&wd);
    CHECK(wd.state == LOOM_WD_IDLE);
    loom_watchdog_disarm(&wd);
    CHECK(wd.state == LOOM_WD_IDLE);
}

static void test_deadline(void) {
    loom_watchdog_t wd;
    loom_watchdog_init(&wd);
    fake_t f = {.answer = LOOM_WD_PROBE_RUNNING};
    loom_watchdog_arm(&wd, 500 * MS, 250);
    for (uint64_t t = 500; t < 750; t += 10) CHECK(loom_watchdog_check(&wd, t * MS, fake_probe, &f) == LOOM_WD_ARMED);
    CHECK(loom_watchdog_check(&wd, 750 * MS - 1, fake_probe, &f) == LOOM_WD_ARMED);
    CHECK(loom_watchdog_check(&wd, 750 * MS, fake_probe, &f) == LOOM_WD_FIRED);
    CHECKF(strstr(wd.why, "250 ms") != NULL, "why: %s", wd.why);
    /* final: neither arm, disarm nor a done probe revive it */
    loom_watchdog_arm(&wd, 800 * MS, 1000);
    loom_watchdog_disarm(&wd);
    f.answer = LOOM_WD_PROBE_DONE;
    CHECK(loom_watchdog_check(&wd, 900 * MS, fake_probe, &f) == LOOM_WD_FIRED);
    /* without a probe only the deadline counts */
    loom_watchdog_init(&wd);
    loom_watchdog_arm(&wd, 0, 5);
    CHECK(loom_watchdog_check(&wd, 4 * MS, NULL, NULL) == LOOM_WD_ARMED);
    CHECK(loom_watchdog_check(&wd, 5 * MS, NULL, NULL) == LOOM_WD_FIRED);
}

static void test_failure_and_fire(void) {
    loom_watchdog_t wd;
    loom_watchdog_init(&wd);
    fake_t f = {.answer = LOOM_WD_PROBE_FAILED};
    loom_watchdog_arm(&wd, 0, 10000);
    CHECK(loom_watchdog_check(&wd, 1 * MS, fake_probe, &f) == LOOM_WD_FIRED);
    CHECKF(!strcmp(wd.why, "peer 1 lost"), "why: %s", wd.why);
    loom_watchdog_fire(&wd, "later reason");
    CHECK(!strcmp(wd.why, "peer 1 lost")); /* the first reason stays */
    loom_watchdog_init(&wd);
    loom_watchdog_fire(&wd, "aborted by the coordinator");
    CHECK(wd.state == LOOM_WD_FIRED);
    loom_watchdog_arm(&wd, 0, 10);
    CHECK(wd.state == LOOM_WD_FIRED);
}

int main(void) {
    RUN(test_budget);
    RUN(test_done_and_disarm);
    RUN(test_deadline);
    RUN(test_failure_and_fire);
    return test_summary();
}
