/* The adapter registry and the engine's adapter slots (see lora_slots.h). */
#include "coordinator/lora_slots.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

struct loom_lora_slots {
    int n_slots;
    loom_lora_slot_t *slot;
    int cap;                  /* entries at most (registered, removed-but-pinned included) */
    loom_lora_entry_t *ent;   /* (cap); id = index; name[0] == 0: unused */
    uint64_t tick;
    loom_lora_slots_stats_t st;
};

loom_status_t loom_lora_slots_create(int max_loras, int max_registered, loom_lora_slots_t **out, loom_err_t *err) {
    *out = NULL;
    if (max_loras < 1 || max_loras > 4096)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "max_loras %d: must be 1 to 4096", max_loras);
    if (max_registered < max_loras)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the adapter registry (%d) is smaller than max_loras %d",
                            max_registered, max_loras);
    loom_lora_slots_t *s = loom_xcalloc(1, sizeof *s);
    s->n_slots = max_loras;
    s->slot = loom_xcalloc((size_t)max_loras, sizeof *s->slot);
    for (int i = 0; i < max_loras; i++) s->slot[i].adapter = -1;
    s->cap = max_registered;
    s->ent = loom_xcalloc((size_t)max_registered, sizeof *s->ent);
    *out = s;
    return LOOM_OK;
}

void loom_lora_slots_destroy(loom_lora_slots_t **s_p) {
    if (!s_p || !*s_p) return;
    free((*s_p)->slot);
    free((*s_p)->ent);
    free(*s_p);
    *s_p = NULL;
}

static loom_lora_entry_t *find(loom_lora_slots_t *s, const char *name) {
    for (int i = 0; i < s->cap; i++)
        if (s->ent[i].name[0] && !s->ent[i].removed && strcmp(s->ent[i].name, name) == 0) return &s->ent[i];
    return NULL;
}

/* Frees entry E for reuse once nothing refers to it. */
static void maybe_forget(loom_lora_slots_t *s, loom_lora_entry_t *e) {
    if (!e->removed || e->running > 0) return;
    if (e->slot >= 0) {
        loom_lora_slot_t *sl = &s->slot[e->slot];
        sl->state = LOOM_SLOT_FREE;
        sl->adapter = -1;
        sl->pins = 0;
        sl->load_sent = 0;
    }
    memset(e, 0, sizeof *e);
    e->slot = -1;
}

static void remove_entry(loom_lora_slots_t *s, loom_lora_entry_t *e) {
    e->removed = 1;
    maybe_forget(s, e);
}

int loom_lora_slots_add(loom_lora_slots_t *s, const char *name, const char *path, const char *base,
                        const uint8_t digest[32], int rank, loom_err_t *err) {
    if (!name || !*name || strlen(name) >= sizeof s->ent[0].name || strlen(path) >= sizeof s->ent[0].path)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "an adapter name must be 1 to %zu bytes",
                            sizeof s->ent[0].name - 1);
    loom_lora_entry_t *old = find(s, name);
    if (old) {
        if (memcmp(old->digest, digest, 32) == 0 && strcmp(old->path, path) == 0) return old->id;
        remove_entry(s, old); /* a reload with other content: a new identity */
    }
    int free_i = -1;
    for (int i = 0; i < s->cap && free_i < 0; i++)
        if (!s->ent[i].name[0]) free_i = i;
    if (free_i < 0)
        return loom_err_set(err, LOOM_ERR_RESOURCE_EXHAUSTED, "%d LoRA adapters are registered already (the most)",
                            s->cap);
    loom_lora_entry_t *e = &s->ent[free_i];
    memset(e, 0, sizeof *e);
    e->id = free_i;
    snprintf(e->name, sizeof e->name, "%s", name);
    snprintf(e->path, sizeof e->path, "%s", path);
    snprintf(e->base, sizeof e->base, "%s", base ? base : "");
    memcpy(e->digest, digest, 32);
    e->rank = rank;
    e->slot = -1;
    return e->id;
}

loom_status_t loom_lora_slots_remove(loom_lora_slots_t *s, const char *name, loom_err_t *err) {
    loom_lora_entry_t *e = find(s, name);
    if (!e) return loom_err_set(err, LOOM_ERR_NOT_FOUND, "no LoRA adapter named '%s'", name);
    remove_entry(s, e);
    return LOOM_OK;
}

const loom_lora_entry_t *loom_lora_slots_find(const loom_lora_slots_t *s, const char *name) {
    return find((loom_lora_slots_t *)s, name);
}

const loom_lora_entry_t *loom_lora_slots_entry(const loom_lora_slots_t *s, int id) {
    if (id < 0 || id >= s->cap || !s->ent[id].name[0]) return NULL;
    return &s->ent[id];
}

int loom_lora_slots_list(const loom_lora_slots_t *s, const loom_lora_entry_t **out, int cap) {
    int n = 0;
    for (int i = 0; i < s->cap && n < cap; i++)
        if (s->ent[i].name[0] && !s->ent[i].removed) out[n++] = &s->ent[i];
    return n;
}

int loom_lora_slots_acquire(loom_lora_slots_t *s, int id, int *slot) {
    LOOM_ASSERT(id >= 0 && id < s->cap && s->ent[id].name[0]);
    loom_lora_entry_t *e = &s->ent[id];
    if (e->slot >= 0) {
        loom_lora_slot_t *sl = &s->slot[e->slot];
        if (sl->state != LOOM_SLOT_READY) return 0;
        sl->pins++;
        sl->last_used = ++s->tick;
        e->running++;
        e->n_requests++;
        *slot = e->slot;
        return 1;
    }
    if (e->removed) return 0;
    /* claim a free slot, else evict the least recently used unpinned READY one */
    int pick = -1;
    for (int i = 0; i < s->n_slots && pick < 0; i++)
        if (s->slot[i].state == LOOM_SLOT_FREE) pick = i;
    if (pick < 0)
        for (int i = 0; i < s->n_slots; i++) {
            const loom_lora_slot_t *sl = &s->slot[i];
            if (sl->state == LOOM_SLOT_READY && sl->pins == 0 &&
                (pick < 0 || sl->last_used < s->slot[pick].last_used))
                pick = i;
        }
    if (pick < 0) return 0;
    loom_lora_slot_t *sl = &s->slot[pick];
    if (sl->adapter >= 0) {
        s->ent[sl->adapter].slot = -1;
        s->st.evictions++;
    }
    sl->state = LOOM_SLOT_LOADING;
    sl->adapter = id;
    sl->pins = 0;
    sl->load_sent = 0;
    sl->last_used = ++s->tick;
    e->slot = pick;
    return 0;
}

void loom_lora_slots_release(loom_lora_slots_t *s, int slot) {
    LOOM_ASSERT(slot >= 0 && slot < s->n_slots);
    loom_lora_slot_t *sl = &s->slot[slot];
    LOOM_ASSERT(sl->pins > 0 && sl->adapter >= 0);
    sl->pins--;
    sl->last_used = ++s->tick;
    loom_lora_entry_t *e = &s->ent[sl->adapter];
    e->running--;
    maybe_forget(s, e);
}

int loom_lora_slots_pending(loom_lora_slots_t *s, int *slots, int cap) {
    int n = 0;
    for (int i = 0; i < s->n_slots && n < cap; i++)
        if (s->slot[i].state == LOOM_SLOT_LOADING && !s->slot[i].load_sent) {
            s->slot[i].load_sent = 1;
            slots[n++] = i;
        }
    return n;
}

void loom_lora_slots_loaded(loom_lora_slots_t *s, int slot, loom_status_t status, double seconds) {
    if (slot < 0 || slot >= s->n_slots) return;
    loom_lora_slot_t *sl = &s->slot[slot];
    if (sl->state != LOOM_SLOT_LOADING) return; /* a stale report (reset or evicted since) */
    if (status == LOOM_OK) {
        sl->state = LOOM_SLOT_READY;
        s->st.loads++;
        s->st.load_seconds += seconds;
        return;
    }
    s->st.load_failures++;
    if (sl->adapter >= 0) s->ent[sl->adapter].slot = -1;
    sl->state = LOOM_SLOT_FREE;
    sl->adapter = -1;
    sl->load_sent = 0;
}

void loom_lora_slots_reset(loom_lora_slots_t *s) {
    for (int i = 0; i < s->n_slots; i++)
        if (s->slot[i].state != LOOM_SLOT_FREE) {
            s->slot[i].state = LOOM_SLOT_LOADING;
            s->slot[i].load_sent = 0;
        }
}

const loom_lora_slot_t *loom_lora_slots_slot(const loom_lora_slots_t *s, int slot) {
    return (slot >= 0 && slot < s->n_slots) ? &s->slot[slot] : NULL;
}

int loom_lora_slots_count(const loom_lora_slots_t *s) { return s->n_slots; }

loom_lora_slots_stats_t loom_lora_slots_stats(const loom_lora_slots_t *s) {
    loom_lora_slots_stats_t st = s->st;
    st.registered = st.resident = st.loading = 0;
    for (int i = 0; i < s->cap; i++)
        if (s->ent[i].name[0] && !s->ent[i].removed) st.registered++;
    for (int i = 0; i < s->n_slots; i++) {
        if (s->slot[i].state == LOOM_SLOT_READY) st.resident++;
        if (s->slot[i].state == LOOM_SLOT_LOADING) st.loading++;
    }
    return st;
}
