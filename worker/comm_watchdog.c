/* The step watchdog's state machine and budget (comm_watchdog.h). */
#include "worker/comm_watchdog.h"

#include <stdio.h>
#include <string.h>

int64_t loom_watchdog_budget_ms(const loom_wd_limits_t *lim, int64_t tokens) {
    int64_t base = lim->base_ms > 0 ? lim->base_ms : LOOM_WD_BASE_MS_DEFAULT;
    int64_t per = lim->us_per_token > 0 ? lim->us_per_token : LOOM_WD_US_PER_TOKEN_DEFAULT;
    if (tokens < 0) tokens = 0;
    int64_t ms = base + (tokens * per + 999) / 1000;
    if (lim->max_ms > 0 && ms > lim->max_ms) ms = lim->max_ms;
    return ms > 0 ? ms : 1;
}

void loom_watchdog_init(loom_watchdog_t *wd) {
    memset(wd, 0, sizeof *wd);
    wd->state = LOOM_WD_IDLE;
}

void loom_watchdog_arm(loom_watchdog_t *wd, uint64_t now_ns, int64_t budget_ms) {
    if (wd->state == LOOM_WD_FIRED) return;
    if (budget_ms < 1) budget_ms = 1;
    wd->state = LOOM_WD_ARMED;
    wd->armed_ns = now_ns;
    wd->deadline_ns = now_ns + (uint64_t)budget_ms * 1000000ull;
}

void loom_watchdog_disarm(loom_watchdog_t *wd) {
    if (wd->state == LOOM_WD_ARMED) wd->state = LOOM_WD_IDLE;
}

void loom_watchdog_fire(loom_watchdog_t *wd, const char *why) {
    if (wd->state == LOOM_WD_FIRED) return;
    wd->state = LOOM_WD_FIRED;
    snprintf(wd->why, sizeof wd->why, "%s", why ? why : "aborted");
}

loom_wd_state_t loom_watchdog_check(loom_watchdog_t *wd, uint64_t now_ns, loom_wd_probe_fn probe, void *ctx) {
    if (wd->state != LOOM_WD_ARMED) return wd->state;
    if (probe) {
        char why[sizeof wd->why] = "";
        switch (probe(ctx, why, sizeof why)) {
        case LOOM_WD_PROBE_DONE: wd->state = LOOM_WD_IDLE; return wd->state;
        case LOOM_WD_PROBE_FAILED: loom_watchdog_fire(wd, why[0] ? why : "the device reported a failure"); return wd->state;
        case LOOM_WD_PROBE_RUNNING: break;
        }
    }
    if (now_ns >= wd->deadline_ns) {
        char why[sizeof wd->why];
        snprintf(why, sizeof why, "the step did not finish within its %llu ms budget",
                 (unsigned long long)((wd->deadline_ns - wd->armed_ns) / 1000000ull));
        loom_watchdog_fire(wd, why);
    }
    return wd->state;
}
