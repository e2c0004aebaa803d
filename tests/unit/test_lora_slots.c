/* Tests for the coordinator's LoRA registry and engine slots: admission
 * waits for a load, pinned slots are never evicted, the least recently used
 * idle adapter is, a reload under one name is a new identity, removal
 * while in use, load failures and a grid reset. */
#include <stdint.h>
#include <string.h>

#include "coordinator/lora_slots.h"
#include "tests/test.h"

static uint8_t g_dig[8][32];

static int add(loom_lora_slots_t *s, const char *name, int d) {
    loom_err_t err = {0};
    char path[64];
    snprintf(path, sizeof path, "/adapters/%s", name);
    return loom_lora_slots_add(s, name, path, "", g_dig[d], 8, &err);
}

/* acquire ID, loading it first if need be; returns its slot */
static int admit(loom_lora_slots_t *s, int id) {
    int slot = -1;
    if (loom_lora_slots_acquire(s, id, &slot)) return slot;
    int p[8];
    int n = loom_lora_slots_pending(s, p, 8);
    for (int i = 0; i < n; i++) loom_lora_slots_loaded(s, p[i], LOOM_OK, 0.01);
    return loom_lora_slots_acquire(s, id, &slot) ? slot : -1;
}

static void test_admission_and_eviction(void) {
    loom_lora_slots_t *s = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_lora_slots_create(2, 4, &s, &err) == LOOM_OK);
    int a = add(s, "a", 0), b = add(s, "b", 1), c = add(s, "c", 2);
    REQUIRE(a >= 0 && b >= 0 && c >= 0 && a != b && b != c);
    int slot = -1, p[4];
    /* the first acquire claims a slot and waits for its load */
    CHECK(loom_lora_slots_acquire(s, a, &slot) == 0);
    CHECK(loom_lora_slots_slot(s, 0)->state == LOOM_SLOT_LOADING);
    CHECK(loom_lora_slots_acquire(s, a, &slot) == 0); /* still loading: no second claim */
    CHECK(loom_lora_slots_pending(s, p, 4) == 1 && p[0] == 0);
    CHECK(loom_lora_slots_pending(s, p, 4) == 0); /* sent once */
    loom_lora_slots_loaded(s, 0, LOOM_OK, 0.25);
    CHECK(loom_lora_slots_acquire(s, a, &slot) == 1 && slot == 0);
    int sb = admit(s, b);
    CHECK(sb == 1);
    /* both slots pinned: c waits, and nothing is evicted */
    CHECK(loom_lora_slots_acquire(s, c, &slot) == 0);
    CHECK(loom_lora_slots_pending(s, p, 4) == 0);
    CHECK(loom_lora_slots_entry(s, a)->slot == 0 && loom_lora_slots_entry(s, b)->slot == 1);
    /* a's pin goes: c takes its slot */
    loom_lora_slots_release(s, 0);
    CHECK(admit(s, c) == 0);
    CHECK(loom_lora_slots_entry(s, a)->slot == -1);
    loom_lora_slots_stats_t st = loom_lora_slots_stats(s);
    CHECK(st.evictions == 1 && st.loads == 3 && st.registered == 3 && st.resident == 2);
    CHECK(st.load_seconds > 0.25);
    /* LRU among idle slots: release b, then c; a evicts b (used less recently) */
    loom_lora_slots_release(s, 1);
    loom_lora_slots_release(s, 0);
    CHECK(admit(s, a) == 1);
    CHECK(loom_lora_slots_entry(s, b)->slot == -1 && loom_lora_slots_entry(s, c)->slot == 0);
    CHECK(loom_lora_slots_entry(s, a)->n_requests == 2 && loom_lora_slots_entry(s, a)->running == 1);
    loom_lora_slots_destroy(&s);
    loom_lora_slots_destroy(&s);
}

static void test_reload_remove(void) {
    loom_lora_slots_t *s = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_lora_slots_create(2, 3, &s, &err) == LOOM_OK);
    int a = add(s, "a", 0);
    CHECK(add(s, "a", 0) == a); /* the same content: the same entry */
    int sa = admit(s, a);
    REQUIRE(sa >= 0);
    /* reloaded with other weights while a sequence runs on the old ones */
    int a2 = add(s, "a", 3);
    CHECK(a2 >= 0 && a2 != a);
    CHECK(loom_lora_slots_find(s, "a")->id == a2);
    CHECK(memcmp(loom_lora_slots_find(s, "a")->digest, g_dig[3], 32) == 0);
    CHECK(loom_lora_slots_slot(s, sa)->adapter == a); /* the old one keeps its slot while pinned */
    int sa2 = admit(s, a2);
    CHECK(sa2 >= 0 && sa2 != sa);
    const loom_lora_entry_t *list[4];
    CHECK(loom_lora_slots_list(s, list, 4) == 1 && list[0]->id == a2);
    loom_lora_slots_release(s, sa); /* the old one's last sequence: its slot frees */
    CHECK(loom_lora_slots_slot(s, sa)->state == LOOM_SLOT_FREE);
    CHECK(loom_lora_slots_entry(s, a) == NULL || loom_lora_slots_entry(s, a)->id == a2);
    /* removal of an unknown name; of one in use */
    CHECK(loom_lora_slots_remove(s, "zzz", &err) == LOOM_ERR_NOT_FOUND && strstr(err.msg, "zzz"));
    CHECK(loom_lora_slots_remove(s, "a", &err) == LOOM_OK);
    CHECK(loom_lora_slots_find(s, "a") == NULL);
    int slot = -1;
    CHECK(loom_lora_slots_acquire(s, a2, &slot) == 1); /* its running slot still serves */
    loom_lora_slots_release(s, sa2);
    loom_lora_slots_release(s, sa2);
    CHECK(loom_lora_slots_slot(s, sa2)->state == LOOM_SLOT_FREE);
    /* the registry is bounded */
    CHECK(add(s, "x", 1) >= 0 && add(s, "y", 2) >= 0 && add(s, "z", 4) >= 0);
    CHECK(add(s, "w", 5) == LOOM_ERR_RESOURCE_EXHAUSTED);
    loom_lora_slots_destroy(&s);
}

static void test_failure_and_reset(void) {
    loom_lora_slots_t *s = NULL;
    loom_err_t err = {0};
    CHECK(loom_lora_slots_create(2, 1, &s, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_lora_slots_create(0, 4, &s, &err) == LOOM_ERR_INVALID_ARGUMENT);
    REQUIRE(loom_lora_slots_create(1, 4, &s, &err) == LOOM_OK);
    int a = add(s, "a", 0), b = add(s, "b", 1);
    int slot = -1, p[2];
    CHECK(loom_lora_slots_acquire(s, a, &slot) == 0);
    CHECK(loom_lora_slots_pending(s, p, 2) == 1);
    loom_lora_slots_loaded(s, p[0], LOOM_ERR_FORMAT, 0.1);
    CHECK(loom_lora_slots_slot(s, 0)->state == LOOM_SLOT_FREE && loom_lora_slots_entry(s, a)->slot == -1);
    CHECK(loom_lora_slots_stats(s).load_failures == 1);
    CHECK(admit(s, b) == 0);
    /* a new grid holds nothing: the slot is loaded again, its pin kept */
    loom_lora_slots_reset(s);
    CHECK(loom_lora_slots_slot(s, 0)->state == LOOM_SLOT_LOADING && loom_lora_slots_slot(s, 0)->pins == 1);
    CHECK(loom_lora_slots_acquire(s, b, &slot) == 0);
    CHECK(loom_lora_slots_pending(s, p, 2) == 1 && p[0] == 0);
    loom_lora_slots_loaded(s, 0, LOOM_OK, 0.1);
    loom_lora_slots_loaded(s, 0, LOOM_OK, 0.1); /* a stale second report changes nothing */
    CHECK(loom_lora_slots_acquire(s, b, &slot) == 1 && loom_lora_slots_slot(s, 0)->pins == 2);
    loom_lora_slots_destroy(&s);
}

int main(void) {
    for (int i = 0; i < 8; i++) memset(g_dig[i], i + 1, 32);
    RUN(test_admission_and_eviction);
    RUN(test_reload_remove);
    RUN(test_failure_and_reset);
    return test_summary();
}
