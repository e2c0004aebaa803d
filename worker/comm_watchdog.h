/* The step watchdog of stream-ordered comms (nccl): while a step's work is
 * in flight on the device (a graph launch or eager kernels, with the
 * collectives enqueued and never waited for one by one), something must
 * notice a dead peer or a stuck collective and end the step. This module is
 * that decision, free of CUDA and threads so it can be tested on the CPU:
 * the nccl backend calls loom_watchdog_check from its watchdog thread and
 * from the compute thread's end-of-step wait, with a probe that asks the
 * device (cudaEventQuery, ncclCommGetAsyncError, the abort flag).
 *
 * States and transitions:
 *   IDLE  --arm-->    ARMED   (a step begins; deadline = now + its budget)
 *   ARMED --disarm--> IDLE    (the step's work is done, or the caller ends it)
 *   ARMED --check-->  IDLE    (the probe says the work is done)
 *   ARMED --check-->  FIRED   (the probe reports a failure, or the deadline passed)
 *   FIRED is final: arm and disarm leave it; the comm is aborted and every
 *   later step fails (the coordinator re-plans on a new grid).
 * Invariant: deadline_ns is meaningful only while ARMED. */
#ifndef LOOM_COMM_WATCHDOG_H
#define LOOM_COMM_WATCHDOG_H

#include <stddef.h>
#include <stdint.h>

typedef enum { LOOM_WD_IDLE = 0, LOOM_WD_ARMED, LOOM_WD_FIRED } loom_wd_state_t;

/* What a probe saw: the step's work is still running, is done, or failed
 * (the probe wrote why). */
typedef enum { LOOM_WD_PROBE_RUNNING = 0, LOOM_WD_PROBE_DONE, LOOM_WD_PROBE_FAILED } loom_wd_probe_t;
typedef loom_wd_probe_t (*loom_wd_probe_fn)(void *ctx, char *why, size_t why_cap);

/* The budget of one step: base_ms for launching and the slowest collective
 * of a small step, plus us_per_token for each token of the step (prefill
 * chunks move and compute more than a decode batch), at most max_ms when
 * that is > 0. */
typedef struct loom_wd_limits {
    int base_ms;
    int us_per_token;
    int max_ms;
} loom_wd_limits_t;

#define LOOM_WD_BASE_MS_DEFAULT       10000
#define LOOM_WD_US_PER_TOKEN_DEFAULT  2000

typedef struct loom_watchdog {
    loom_wd_state_t state;
    uint64_t armed_ns, deadline_ns;
    char why[256]; /* FIRED: the reason */
} loom_watchdog_t;

/* Milliseconds a step of `tokens` tokens may take (>= 1). */
int64_t loom_watchdog_budget_ms(const loom_wd_limits_t *lim, int64_t tokens);

void loom_watchdog_init(loom_watchdog_t *wd);
/* IDLE -> ARMED with the deadline now_ns + budget_ms; no change when FIRED,
 * re-arms (a new deadline) when already ARMED. */
void loom_watchdog_arm(loom_watchdog_t *wd, uint64_t now_ns, int64_t budget_ms);
/* ARMED -> IDLE; no change otherwise. */
void loom_watchdog_disarm(loom_watchdog_t *wd);
/* One poll: when ARMED, asks the probe (probe NULL: only the deadline) and
 * moves to IDLE (done) or FIRED (failure or deadline); returns the state
 * after the poll. */
loom_wd_state_t loom_watchdog_check(loom_watchdog_t *wd, uint64_t now_ns, loom_wd_probe_fn probe, void *ctx);
/* Forces FIRED with a reason (an abort from outside); no change when already FIRED. */
void loom_watchdog_fire(loom_watchdog_t *wd, const char *why);

#endif
