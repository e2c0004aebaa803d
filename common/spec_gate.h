/* The speculation gate: speculative decoding only while it pays in wall
 * time. Adaptive K (common/spec.h) weighs the acceptance against the
 * target's verify cost, but not what drafting itself costs: a draft model
 * as expensive as its target (a self-draft of a tiny model) accepts nearly
 * everything and still makes decoding slower. The gate measures both
 * sides, per engine: seconds per emitted token of steps that carried
 * drafts (the drafter's time included) against those of plain decode
 * steps, and lets drafts through only while the first is below the second.
 *
 * States and transitions (one step = one call of loom_spec_gate_step, then
 * one of loom_spec_gate_observe):
 *   WARMUP  the first LOOM_SPEC_GATE_WARMUP steps are plain: the baseline.
 *   ON      drafts allowed; one step in LOOM_SPEC_GATE_PLAIN_EVERY is plain
 *           so the baseline stays current. → OFF when, with at least
 *           LOOM_SPEC_GATE_MIN_SPEC speculative steps seen, a token costs
 *           more than (1 + margin) times a plain one, or after two steps
 *           when both cost more than twice.
 *   OFF     plain steps; after `probe_every` of them a probe of
 *           LOOM_SPEC_GATE_PROBE speculative steps (the first, which pays
 *           for the drafter catching up, is not measured; the probe's
 *           steps replace the speculative estimate). → ON when the
 *           probe's tokens cost less than (1 − margin) times a plain one;
 *           else probe_every grows 8× (up to LOOM_SPEC_GATE_MAX_PROBE): a
 *           draft model's probe first reads every token it missed while
 *           off (its prefill), so probes must be rare for a draft that
 *           never pays to cost a small share of the time.
 *   Where the engine can time its costs before drafting (loom run), the
 *   start-up estimate (loom_spec_gate_estimate, once, as WARMUP ends) asks
 *   what drafting could give at best, every draft accepted: (K+1) tokens in
 *   t_verify(K+1) + K·t_draft against one in t_plain. Below 1 +
 *   LOOM_SPEC_GATE_START_MARGIN the gate starts OFF (no draft work at all:
 *   a draft model never reads the prompt), with probes spaced so that they
 *   cost at most LOOM_SPEC_GATE_PROBE_BUDGET of the plain time; else WARMUP
 *   goes ON as above.
 * A probe's drafter catches up with at most LOOM_SPEC_GATE_PROBE_WINDOW of
 * the latest tokens (loom_spec_gate_probing says when a step is a probe):
 * a draft model then attends within that window only, which may lower its
 * acceptance but bounds what a probe costs.
 * Each rate is seconds over tokens of the recent steps of its kind (5
 * plain, 12 speculative: a speculative step emits 1 to K+1 tokens for
 * about the same time, so its rate needs more of them), leaving out a step
 * that took more than twice the window's median time (the OS descheduled
 * it on a shared machine). The ON state turns off only when the rate with
 * drafts stays dearer even with LOOM_SPEC_GATE_SPREAD standard deviations
 * of the window's token count added to its tokens: a run of short
 * acceptances is not taken for drafts that do not pay (drafts accepted
 * always or never have no spread and decide at once). Invariant: the gate
 * never changes the output (a plain step and a speculative one emit the
 * same ids, docs/speculative.md). */
#ifndef LOOM_SPEC_GATE_H
#define LOOM_SPEC_GATE_H

#include <stdint.h>

#define LOOM_SPEC_GATE_WARMUP 3
#define LOOM_SPEC_GATE_PLAIN_EVERY 8
#define LOOM_SPEC_GATE_MIN_SPEC 4
#define LOOM_SPEC_GATE_PROBE 3
#define LOOM_SPEC_GATE_FIRST_PROBE 64
#define LOOM_SPEC_GATE_MAX_PROBE 4096
/* The best case, every draft accepted, must beat plain decoding by this
 * much to start drafting: at an acceptance of 80 % a step of 4 drafts gets
 * two thirds of the best case's tokens, one of a single draft nine tenths. */
#define LOOM_SPEC_GATE_START_MARGIN 0.25
#define LOOM_SPEC_GATE_PROBE_BUDGET 0.02 /* a start-off gate's probes: this share of the plain time at most */
#define LOOM_SPEC_GATE_PROBE_WINDOW 64   /* tokens a probe's drafter catches up with at most */

typedef enum { LOOM_SPEC_GATE_S_WARMUP, LOOM_SPEC_GATE_S_ON, LOOM_SPEC_GATE_S_OFF } loom_spec_gate_state_t;

/* The last steps of one kind: seconds and tokens of one sequence. Plain
 * steps keep LOOM_SPEC_GATE_PLAIN_WINDOW, few, so the plain rate follows
 * the context growing (attention) while drafts run; speculative ones
 * LOOM_SPEC_GATE_SPEC_WINDOW, enough that their varying tokens average out
 * (at 84 % acceptance and K = 4 a step emits 3.7 ± 1.5). */
#define LOOM_SPEC_GATE_PLAIN_WINDOW 5
#define LOOM_SPEC_GATE_SPEC_WINDOW 12
#define LOOM_SPEC_GATE_WINDOW LOOM_SPEC_GATE_SPEC_WINDOW /* a ring's room */
/* Standard deviations of a window's token count that turning off allows
 * for: with drafts accepted at 84 % (a step of 4 drafts emits 3.7 ± 1.5),
 * 12 steps that pay by 20 % on average read as dearer in about one check in
 * 20 at 0, one in 200 at 1, one in 5,000 at 2 (a normal approximation). */
#define LOOM_SPEC_GATE_SPREAD 2.0
typedef struct loom_spec_gate_ring {
    double sec[LOOM_SPEC_GATE_WINDOW], tok[LOOM_SPEC_GATE_WINDOW];
    int cap, n, next;
} loom_spec_gate_ring_t;

typedef struct loom_spec_gate {
    loom_spec_gate_state_t state;
    double margin;                /* relative hysteresis (default 0.02) */
    loom_spec_gate_ring_t plain;  /* seconds per token of plain steps */
    loom_spec_gate_ring_t spec;   /* the same for steps that carried drafts */
    int steps;                    /* steps in the current state */
    int probe_every, probe_left, skip_next;
    int allowed;                  /* what the last loom_spec_gate_step answered */
    double decided_spec, decided_plain; /* the two rates at the last turn or failed probe */
    int64_t turned_off, turned_on; /* transitions, for stats and tests */
    int estimated;                /* loom_spec_gate_estimate was called */
    int started_off;              /* ... and found that drafting could not pay */
    double best_case;             /* its best-case speed-up over plain decoding (0: none) */
} loom_spec_gate_t;

void loom_spec_gate_init(loom_spec_gate_t *g);
/* Whether the step being built may carry drafts (advances the schedule of
 * plain and probing steps: call once per step). */
int loom_spec_gate_step(loom_spec_gate_t *g);
/* After that step: drafted (0: it carried none, whatever the gate allowed),
 * tokens emitted by the step's `seqs` decoding sequences, and its wall time
 * including the drafter's. The rates are seconds per token of one sequence
 * (seconds / (emitted / seqs)): a step's latency per token, so steps of
 * several sequences compare with the same measure. */
void loom_spec_gate_observe(loom_spec_gate_t *g, int drafted, int emitted, int seqs, double seconds);
/* The start-up estimate, due when loom_spec_gate_wants_estimate says so
 * (WARMUP's plain steps done, no estimate yet). t_plain: a plain step's
 * target forward; t_verify: one of k+1 tokens (0: not timed, taken as
 * t_plain, the least it can cost); t_draft: one draft forward (0 for a
 * drafter that costs nothing). The best case over K = 1..k, every draft
 * accepted and t_verify linear in the tokens between 1 and k+1, below
 * 1 + LOOM_SPEC_GATE_START_MARGIN turns the gate OFF, with the first probe
 * after the plain steps whose time LOOM_SPEC_GATE_PROBE_BUDGET of is what
 * a probe could cost (its catch-up of LOOM_SPEC_GATE_PROBE_WINDOW tokens
 * and LOOM_SPEC_GATE_PROBE steps of k drafts, each token at t_draft).
 * Returns the best case. An engine that never calls it keeps the gate as
 * it was (WARMUP, then ON). */
double loom_spec_gate_estimate(loom_spec_gate_t *g, double t_plain, double t_verify, int k, double t_draft);
/* The best case alone: (K+1) t_plain / (t_verify(K+1) + K t_draft), the
 * largest over K = 1..k. */
double loom_spec_gate_best_case(double t_plain, double t_verify, int k, double t_draft);
int loom_spec_gate_wants_estimate(const loom_spec_gate_t *g);
/* The step the last loom_spec_gate_step allowed is a probe of an OFF gate
 * (its drafter catches up with a recent window only). */
int loom_spec_gate_probing(const loom_spec_gate_t *g);
/* Seconds per token of a sequence in plain and in speculative steps: the
 * recent steps' seconds over their tokens, a descheduled step left out (0:
 * none seen). */
double loom_spec_gate_plain_rate(const loom_spec_gate_t *g);
double loom_spec_gate_spec_rate(const loom_spec_gate_t *g);
const char *loom_spec_gate_state_name(loom_spec_gate_state_t s);

#endif
