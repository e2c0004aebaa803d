/* The reactor's LoRA state (lora_reactor.h). */
#include "coordinator/lora_reactor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

#define REGISTRY_CAP (LOOM_LORA_SERVE_MAX_MODULES * 4) /* start-up adapters and runtime loads */

struct loom_lora_reactor {
    loom_lora_serve_opts_t opt;
    loom_model_config_t cfg;
    char served[256];
    loom_lora_slots_t *slots;
    loom_lora_tally_t *tally;
    long load_delay_ms; /* test hook LOOM_TEST_LORA_LOAD_DELAY_MS: each runtime load's read sleeps first */
};

loom_status_t loom_lora_reactor_create(const loom_lora_serve_opts_t *o, const loom_model_config_t *cfg,
                                       const char *served, loom_lora_reactor_t **out, loom_err_t *err) {
    *out = NULL;
    for (int i = 0; i < o->n_modules; i++)
        if (!strcmp(o->modules[i].name, served))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "LoRA adapter %s: the served model is named so; give the adapter another name",
                                served);
    loom_lora_reactor_t *r = loom_xcalloc(1, sizeof *r);
    r->opt = *o;
    r->cfg = *cfg;
    snprintf(r->served, sizeof r->served, "%s", served);
    loom_status_t st = loom_lora_slots_create(o->max_loras, REGISTRY_CAP, &r->slots, err);
    if (st == LOOM_OK) st = loom_lora_serve_register(o, cfg, r->slots, err);
    if (st != LOOM_OK) {
        loom_lora_reactor_destroy(&r);
        return st;
    }
    r->tally = loom_lora_tally_create(o->max_loras);
    const char *delay = getenv("LOOM_TEST_LORA_LOAD_DELAY_MS");
    r->load_delay_ms = delay ? strtol(delay, NULL, 10) : 0;
    if (r->load_delay_ms > 0)
        LOOM_WARN("test hook: each runtime LoRA load sleeps %ld ms before its read", r->load_delay_ms);
    *out = r;
    return LOOM_OK;
}

void loom_lora_reactor_destroy(loom_lora_reactor_t **r_p) {
    if (!r_p || !*r_p) return;
    loom_lora_slots_destroy(&(*r_p)->slots);
    loom_lora_tally_destroy(&(*r_p)->tally);
    free(*r_p);
    *r_p = NULL;
}

loom_lora_slots_t *loom_lora_reactor_slots(loom_lora_reactor_t *r) { return r ? r->slots : NULL; }

void loom_lora_reactor_grid_ready(loom_lora_reactor_t *r) {
    loom_lora_slots_reset(r->slots);
    loom_lora_tally_reset(r->tally);
}

static double now_s(void) { return (double)loom_now_ns() * 1e-9; }

void loom_lora_reactor_dispatch(loom_lora_reactor_t *r, loom_grid_t *g) {
    if (loom_grid_state(g) != LOOM_GRID_READY) return;
    int slots[32];
    int n = loom_lora_slots_pending(r->slots, slots, 32);
    for (int i = 0; i < n; i++) {
        const loom_lora_slot_t *sl = loom_lora_slots_slot(r->slots, slots[i]);
        const loom_lora_entry_t *e = loom_lora_slots_entry(r->slots, sl->adapter);
        LOOM_ASSERT(e);
        LOOM_INFO("LoRA adapter %s (%s) loads into slot %d", e->name, e->path, slots[i]);
        loom_lora_tally_start(r->tally, slots[i], loom_grid_epoch(g), loom_grid_n_slots(g), now_s());
        loom_grid_send_lora_load(g, slots[i], e->name, e->path, e->digest);
    }
}

int loom_lora_reactor_loaded(loom_lora_reactor_t *r, loom_grid_t *g, int worker, const Loom__V1__LoraLoaded *l,
                             char *msg, size_t cap) {
    const loom_lora_slot_t *sl = loom_lora_slots_slot(r->slots, (int)l->slot);
    if (!sl || sl->state != LOOM_SLOT_LOADING) return -1; /* stale: evicted, removed or reset since */
    const loom_lora_entry_t *e = loom_lora_slots_entry(r->slots, sl->adapter);
    /* an answer to an earlier order for this slot (another adapter) */
    if (!e || l->digest.len != 32 || memcmp(l->digest.data, e->digest, 32)) return -1;
    loom_status_t outcome;
    double seconds;
    if (!loom_lora_tally_report(r->tally, l->epoch, (int)l->slot, worker, l->code ? (loom_status_t)l->code : LOOM_OK,
                                now_s(), &outcome, &seconds))
        return -1;
    int id = e->id;
    if (outcome == LOOM_OK) {
        LOOM_INFO("LoRA adapter %s is resident in slot %u (%.3f s)", e->name, l->slot, seconds);
    } else {
        snprintf(msg, cap, "LoRA adapter %s failed to load on worker %s: %s", e->name,
                 loom_grid_slot_worker(g, worker) ? loom_grid_slot_worker(g, worker) : "?",
                 l->message ? l->message : "");
        LOOM_WARN("%s", msg);
    }
    loom_lora_slots_loaded(r->slots, (int)l->slot, outcome, seconds);
    return outcome == LOOM_OK ? -1 : id;
}

/* What the registry knows of a runtime load of NAME (its read aside). */
static loom_status_t load_check(const loom_lora_reactor_t *r, const char *name, const char *path, loom_err_t *err) {
    if (!r->opt.allow_runtime_updating)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "runtime LoRA updating is off: start with --allow-runtime-lora-updating or "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True");
    if (!name || !name[0] || !path || !path[0])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "both 'lora_name' and 'lora_path' must be provided.");
    if (!strcmp(name, r->served))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "'%s' is the served model's name; give the adapter another name", name);
    if (loom_lora_slots_find(r->slots, name))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "The lora adapter '%s' has already been loaded.", name);
    return LOOM_OK;
}

loom_status_t loom_lora_reactor_load_begin(loom_lora_reactor_t *r, const char *name, const char *path,
                                           loom_prep_job_t *j, char *msg, size_t cap) {
    loom_err_t err = {0};
    loom_status_t st = load_check(r, name, path, &err);
    if (st != LOOM_OK) {
        snprintf(msg, cap, "%s", err.msg);
        return st;
    }
    j->lora.name = loom_xstrdup(name);
    j->lora.path = loom_xstrdup(path);
    j->lora.cfg = r->cfg;
    j->lora.max_rank = r->opt.max_lora_rank;
    j->lora.delay_ms = r->load_delay_ms;
    return LOOM_OK;
}

loom_status_t loom_lora_reactor_load_end(loom_lora_reactor_t *r, const loom_prep_job_t *j, char *msg, size_t cap) {
    const char *name = j->lora.name;
    loom_err_t err = {0};
    loom_status_t st = j->status;
    if (st != LOOM_OK) err = j->err;
    else st = load_check(r, name, j->lora.path, &err); /* another load of NAME may have come back first */
    if (st == LOOM_OK) {
        int id = loom_lora_slots_add(r->slots, name, j->lora.path, "", j->lora.digest, j->lora.rank, &err);
        if (id < 0) st = (loom_status_t)id;
    }
    if (st != LOOM_OK) {
        snprintf(msg, cap, "%s", err.msg);
        return st;
    }
    LOOM_INFO("LoRA adapter %s registered from %s at run time (read and checked in %.3f s off the reactor, "
              "%.3f s queued)", name, j->lora.path, j->lora.read_s, j->queued_s);
    snprintf(msg, cap, "Success: LoRA adapter '%s' added successfully.", name);
    return LOOM_OK;
}

loom_status_t loom_lora_reactor_unload_check(loom_lora_reactor_t *r, const char *name, int *id, char *msg,
                                             size_t cap) {
    *id = -1;
    if (!r->opt.allow_runtime_updating) {
        snprintf(msg, cap, "runtime LoRA updating is off: start with --allow-runtime-lora-updating or "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True");
        return LOOM_ERR_INVALID_ARGUMENT;
    }
    if (!name || !name[0]) {
        snprintf(msg, cap, "'lora_name' must be provided.");
        return LOOM_ERR_INVALID_ARGUMENT;
    }
    const loom_lora_entry_t *e = loom_lora_slots_find(r->slots, name);
    if (!e) {
        snprintf(msg, cap, "The lora adapter '%s' cannot be found.", name);
        return LOOM_ERR_NOT_FOUND;
    }
    *id = e->id;
    return LOOM_OK;
}

void loom_lora_reactor_forget(loom_lora_reactor_t *r, const char *name, char *msg, size_t cap) {
    loom_err_t err = {0};
    loom_lora_slots_remove(r->slots, name, &err);
    LOOM_INFO("LoRA adapter %s unloaded", name);
    snprintf(msg, cap, "Success: LoRA adapter '%s' removed successfully.", name);
}
