/* The speculation gate (see spec_gate.h): a per-engine wall-time check
 * that drafts pay for themselves. */
#include "common/spec_gate.h"

#define GATE_DECAY 0.9 /* weight of the past per observed step */
#define GATE_CLAMP 4.0 /* an observation counts at most this many times its class's rate */
#define GATE_FAST_OFF 2.0 /* a token this many times dearer turns drafts off after one step */

void loom_spec_gate_init(loom_spec_gate_t *g) {
    *g = (loom_spec_gate_t){.state = LOOM_SPEC_GATE_S_WARMUP, .margin = 0.02,
                            .probe_every = LOOM_SPEC_GATE_FIRST_PROBE};
}

double loom_spec_gate_plain_rate(const loom_spec_gate_t *g) {
    return g->plain_n > 0 ? g->plain_s / g->plain_n : 0.0;
}

double loom_spec_gate_spec_rate(const loom_spec_gate_t *g) {
    return g->spec_n > 0 ? g->spec_s / g->spec_n : 0.0;
}

const char *loom_spec_gate_state_name(loom_spec_gate_state_t s) {
    switch (s) {
    case LOOM_SPEC_GATE_S_WARMUP: return "warmup";
    case LOOM_SPEC_GATE_S_ON: return "on";
    default: return "off";
    }
}

/* The drafter's first step after plain ones also catches up with the
 * tokens it did not see (a draft model's prefill): not a fair sample. */
static void start_speculating(loom_spec_gate_t *g) {
    g->skip_next = 1;
}

int loom_spec_gate_step(loom_spec_gate_t *g) {
    switch (g->state) {
    case LOOM_SPEC_GATE_S_WARMUP:
        if (g->steps < LOOM_SPEC_GATE_WARMUP) {
            g->steps++;
            return g->allowed = 0;
        }
        g->state = LOOM_SPEC_GATE_S_ON;
        g->steps = 0;
        start_speculating(g);
        /* fall through */
    case LOOM_SPEC_GATE_S_ON:
        g->steps++;
        return g->allowed = g->steps % LOOM_SPEC_GATE_PLAIN_EVERY != 0;
    case LOOM_SPEC_GATE_S_OFF:
        if (g->probe_left > 0) {
            g->probe_left--;
            return g->allowed = 1;
        }
        if (++g->steps < g->probe_every) return g->allowed = 0;
        /* a probe: its steps outweigh the stale speculative estimates */
        g->steps = 0;
        g->probe_left = LOOM_SPEC_GATE_PROBE - 1;
        g->spec_s *= 0.25;
        g->spec_n *= 0.25;
        g->spec_w *= 0.25;
        start_speculating(g);
        return g->allowed = 1;
    }
    return g->allowed = 0;
}

static void turn_off(loom_spec_gate_t *g) {
    g->state = LOOM_SPEC_GATE_S_OFF;
    g->steps = 0;
    g->probe_left = 0;
    g->probe_every = LOOM_SPEC_GATE_FIRST_PROBE;
    g->turned_off++;
}

void loom_spec_gate_observe(loom_spec_gate_t *g, int drafted, int emitted, int seqs, double seconds) {
    if (emitted <= 0 || seqs <= 0 || !(seconds > 0)) return;
    const double per_seq = (double)emitted / seqs;
    /* A step descheduled by the machine's other load would weigh for many
     * steps in a decayed mean: clamp it to GATE_CLAMP times the rate of its
     * class once the class has a rate. */
    const double known = drafted <= 0 ? loom_spec_gate_plain_rate(g) : loom_spec_gate_spec_rate(g);
    if (known > 0 && seconds > GATE_CLAMP * known * per_seq) seconds = GATE_CLAMP * known * per_seq;
    if (drafted <= 0) {
        g->plain_s = GATE_DECAY * g->plain_s + seconds;
        g->plain_n = GATE_DECAY * g->plain_n + per_seq;
    } else if (g->skip_next) {
        g->skip_next = 0;
    } else {
        g->spec_s = GATE_DECAY * g->spec_s + seconds;
        g->spec_n = GATE_DECAY * g->spec_n + per_seq;
        g->spec_w = GATE_DECAY * g->spec_w + 1;
    }
    const double plain = loom_spec_gate_plain_rate(g), spec = loom_spec_gate_spec_rate(g);
    if (g->state == LOOM_SPEC_GATE_S_ON) {
        /* spec_w after MIN_SPEC steps: 1 + 0.9 + 0.81 + 0.729 = 3.44 (decay 0.9) */
        if (plain > 0 && g->spec_w >= 0.85 * LOOM_SPEC_GATE_MIN_SPEC && spec > plain * (1 + g->margin))
            turn_off(g);
        else if (plain > 0 && g->spec_w > 0 && spec > GATE_FAST_OFF * plain)
            turn_off(g); /* far dearer: no need for more samples */
    } else if (g->state == LOOM_SPEC_GATE_S_OFF && g->allowed && g->probe_left == 0) {
        /* the probe's last step: keep speculating only if it paid */
        if (plain > 0 && spec > 0 && spec < plain * (1 - g->margin)) {
            g->state = LOOM_SPEC_GATE_S_ON;
            g->steps = 0;
            g->turned_on++;
        } else if (g->probe_every < LOOM_SPEC_GATE_MAX_PROBE) {
            g->probe_every *= 2;
        }
        g->allowed = 0;
    }
}
