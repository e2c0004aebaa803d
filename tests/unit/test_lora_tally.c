/* Tests for the tally of LoRA adapter loads: decided when every worker
 * reported ok, at the first failure, never by a stale epoch, a duplicate
 * report or an idle slot; a reset forgets what was awaited. */
#include "coordinator/lora_tally.h"
#include "tests/test.h"

static void test_tally(void) {
    loom_lora_tally_t *t = loom_lora_tally_create(2);
    loom_status_t out = LOOM_ERR_INTERNAL;
    double sec = -1;
    CHECK(loom_lora_tally_report(t, 1, 0, 0, LOOM_OK, 0, &out, &sec) == 0); /* idle: ignored */
    loom_lora_tally_start(t, 0, 1, 3, 10.0);
    loom_lora_tally_start(t, 1, 1, 3, 10.0);
    CHECK(loom_lora_tally_waiting(t) == 2);
    CHECK(loom_lora_tally_report(t, 1, 0, 0, LOOM_OK, 10.1, &out, &sec) == 0);
    CHECK(loom_lora_tally_report(t, 1, 0, 0, LOOM_OK, 10.2, &out, &sec) == 0); /* a second report */
    CHECK(loom_lora_tally_report(t, 0, 0, 1, LOOM_OK, 10.2, &out, &sec) == 0); /* another epoch */
    CHECK(loom_lora_tally_report(t, 1, 0, 3, LOOM_OK, 10.2, &out, &sec) == 0); /* no such worker */
    CHECK(loom_lora_tally_report(t, 1, 5, 1, LOOM_OK, 10.2, &out, &sec) == 0); /* no such slot */
    CHECK(loom_lora_tally_report(t, 1, 0, 1, LOOM_OK, 10.3, &out, &sec) == 0);
    CHECK(loom_lora_tally_report(t, 1, 0, 2, LOOM_OK, 10.5, &out, &sec) == 1);
    CHECK(out == LOOM_OK && sec > 0.49 && sec < 0.51);
    CHECK(loom_lora_tally_report(t, 1, 0, 2, LOOM_OK, 10.6, &out, &sec) ==
          0); /* decided: idle again */
    /* slot 1: the first failure decides */
    CHECK(loom_lora_tally_report(t, 1, 1, 2, LOOM_OK, 11.0, &out, &sec) == 0);
    CHECK(loom_lora_tally_report(t, 1, 1, 0, LOOM_ERR_FORMAT, 12.0, &out, &sec) == 1);
    CHECK(out == LOOM_ERR_FORMAT && sec > 1.99 && sec < 2.01);
    CHECK(loom_lora_tally_report(t, 1, 1, 1, LOOM_OK, 12.5, &out, &sec) == 0);
    CHECK(loom_lora_tally_waiting(t) == 0);
    /* a re-formed grid forgets; the orders go out again under the new epoch */
    loom_lora_tally_start(t, 0, 1, 2, 20.0);
    loom_lora_tally_reset(t);
    CHECK(loom_lora_tally_waiting(t) == 0);
    CHECK(loom_lora_tally_report(t, 1, 0, 0, LOOM_OK, 20.1, &out, &sec) == 0);
    loom_lora_tally_start(t, 0, 2, 1, 30.0);
    CHECK(loom_lora_tally_report(t, 1, 0, 0, LOOM_OK, 30.1, &out, &sec) == 0); /* the old epoch */
    CHECK(loom_lora_tally_report(t, 2, 0, 0, LOOM_OK, 30.1, &out, &sec) == 1 && out == LOOM_OK);
    loom_lora_tally_destroy(&t);
    loom_lora_tally_destroy(&t); /* safe twice */
}

int main(void) {
    RUN(test_tally);
    return test_summary();
}
