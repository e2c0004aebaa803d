/* The coordinator's LoRA serving options: --lora-modules parsed in both of
 * vLLM's forms, the start-up checks, each adapter read and checked against
 * the served model, and a request's "model" mapped to an adapter
 * (lora_serve.h). */
#include "coordinator/lora_serve.h"

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SLOTS 32 /* the engine's and the kernels' limit (docs/lora.md) */

void loom_lora_serve_opts_init(loom_lora_serve_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->max_loras = 1;
    o->max_lora_rank = 16;
}

static loom_status_t copy_field(char *dst, size_t cap, const char *src, size_t len,
                                const char *what, const char *arg, loom_err_t *err) {
    if (len == 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--lora-modules %s: empty %s", arg,
                            what);
    if (len >= cap)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--lora-modules %s: %s longer than %zu bytes", arg, what, cap - 1);
    memcpy(dst, src, len);
    dst[len] = '\0';
    return LOOM_OK;
}

static loom_status_t add_json(loom_lora_module_spec_t *m, const char *arg, loom_err_t *err) {
    cJSON *j = cJSON_Parse(arg);
    loom_status_t st = LOOM_OK;
    if (!cJSON_IsObject(j)) {
        st = loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "--lora-modules %s: not a JSON object {\"name\", \"path\", \"base_model_name\"}", arg);
        goto done;
    }
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(j, "name");
    const cJSON *path = cJSON_GetObjectItemCaseSensitive(j, "path");
    const cJSON *base = cJSON_GetObjectItemCaseSensitive(j, "base_model_name");
    if (!cJSON_IsString(name) || !cJSON_IsString(path)) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "--lora-modules %s: \"name\" and \"path\" must be strings", arg);
        goto done;
    }
    if (base && !cJSON_IsNull(base) && !cJSON_IsString(base)) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "--lora-modules %s: \"base_model_name\" must be a string", arg);
        goto done;
    }
    st = copy_field(m->name, sizeof m->name, name->valuestring, strlen(name->valuestring), "name",
                    arg, err);
    if (st == LOOM_OK)
        st = copy_field(m->path, sizeof m->path, path->valuestring, strlen(path->valuestring),
                        "path", arg, err);
    if (st == LOOM_OK && cJSON_IsString(base) && base->valuestring[0])
        st = copy_field(m->base, sizeof m->base, base->valuestring, strlen(base->valuestring),
                        "base_model_name", arg, err);
done:
    cJSON_Delete(j);
    return st;
}

loom_status_t loom_lora_serve_add_module(loom_lora_serve_opts_t *o, const char *arg,
                                         loom_err_t *err) {
    if (o->n_modules >= LOOM_LORA_SERVE_MAX_MODULES)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--lora-modules: more than %d adapters",
                            LOOM_LORA_SERVE_MAX_MODULES);
    loom_lora_module_spec_t m;
    memset(&m, 0, sizeof m);
    loom_status_t st;
    const char *p = arg;
    while (*p == ' ' || *p == '\t')
        p++;
    if (*p == '{') {
        st = add_json(&m, p, err);
    } else {
        const char *eq = strchr(arg, '=');
        if (!eq)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "--lora-modules %s: expected name=path or a JSON object", arg);
        st = copy_field(m.name, sizeof m.name, arg, (size_t)(eq - arg), "name", arg, err);
        if (st == LOOM_OK)
            st = copy_field(m.path, sizeof m.path, eq + 1, strlen(eq + 1), "path", arg, err);
    }
    if (st != LOOM_OK) return st;
    o->modules[o->n_modules++] = m;
    return LOOM_OK;
}

static loom_status_t int_value(const char *flag, const char *v, int *out, loom_err_t *err) {
    char *end = NULL;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end || x < 0 || x > 1000000)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--%s needs a number, got '%s'", flag,
                            v ? v : "");
    *out = (int)x;
    return LOOM_OK;
}

loom_status_t loom_lora_serve_take_args(int *argc, char **argv, loom_lora_serve_opts_t *o,
                                        loom_err_t *err) {
    static const struct {
        const char *name;
        int kind; /* 0 flag, 1 number, 2 modules */
        size_t off;
    } flags[] = {
        {"enable-lora", 0, offsetof(loom_lora_serve_opts_t, enable)},
        {"allow-runtime-lora-updating", 0,
         offsetof(loom_lora_serve_opts_t, allow_runtime_updating)},
        {"max-loras", 1, offsetof(loom_lora_serve_opts_t, max_loras)},
        {"max-lora-rank", 1, offsetof(loom_lora_serve_opts_t, max_lora_rank)},
        {"max-cpu-loras", 1, offsetof(loom_lora_serve_opts_t, max_cpu_loras)},
        {"lora-modules", 2, 0},
    };
    int out = 1, n = *argc;
    for (int i = 1; i < n; i++) {
        const char *a = argv[i];
        int k = -1;
        size_t len = 0;
        const char *eq = NULL;
        if (!strncmp(a, "--", 2)) {
            eq = strchr(a + 2, '=');
            len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
            for (size_t j = 0; j < sizeof flags / sizeof flags[0]; j++)
                if (strlen(flags[j].name) == len && !strncmp(flags[j].name, a + 2, len)) k = (int)j;
        }
        if (k < 0) {
            argv[out++] = argv[i];
            continue;
        }
        int *dst = (int *)(void *)((char *)o + flags[k].off);
        if (flags[k].kind == 0) {
            if (eq)
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--%s takes no value",
                                    flags[k].name);
            *dst = 1;
        } else if (flags[k].kind == 1) {
            const char *v = eq ? eq + 1 : i + 1 < n ? argv[++i] : NULL;
            loom_status_t st = int_value(flags[k].name, v, dst, err);
            if (st != LOOM_OK) return st;
        } else {
            int taken = 0;
            if (eq) {
                loom_status_t st = loom_lora_serve_add_module(o, eq + 1, err);
                if (st != LOOM_OK) return st;
                taken = 1;
            }
            while (!eq && i + 1 < n && argv[i + 1][0] != '-') {
                loom_status_t st = loom_lora_serve_add_module(o, argv[++i], err);
                if (st != LOOM_OK) return st;
                taken++;
            }
            if (!taken)
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                    "--lora-modules needs name=path (or a JSON object) values");
        }
    }
    if (out < n) argv[out] = NULL;
    *argc = out;
    return LOOM_OK;
}

loom_status_t loom_lora_serve_check(loom_lora_serve_opts_t *o, loom_err_t *err) {
    if (!o->enable) {
        if (o->n_modules)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "--lora-modules needs --enable-lora");
        return LOOM_OK;
    }
    if (o->max_loras < 1 || o->max_loras > MAX_SLOTS)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--max-loras %d: must be 1 to %d",
                            o->max_loras, MAX_SLOTS);
    if (!loom_lora_rank_allowed(o->max_lora_rank))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--max-lora-rank %d: must be one of " LOOM_LORA_RANKS,
                            o->max_lora_rank);
    if (o->max_cpu_loras == 0) o->max_cpu_loras = o->max_loras;
    if (o->max_cpu_loras < o->max_loras)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--max-cpu-loras %d must be at least --max-loras %d", o->max_cpu_loras,
                            o->max_loras);
    for (int i = 0; i < o->n_modules; i++)
        for (int k = 0; k < i; k++)
            if (!strcmp(o->modules[i].name, o->modules[k].name))
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                    "--lora-modules: the name %s is given twice",
                                    o->modules[i].name);
    return LOOM_OK;
}

loom_status_t loom_lora_serve_validate(const char *name, const char *path,
                                       const loom_model_config_t *cfg, int max_lora_rank,
                                       uint8_t digest[32], int *rank, loom_err_t *err) {
    loom_lora_adapter_t *a = NULL;
    loom_err_t e = {0};
    loom_status_t st = loom_lora_load(path, cfg, max_lora_rank, 0, cfg->n_layers, &a, &e);
    if (st != LOOM_OK) return loom_err_set(err, st, "LoRA adapter %s (%s): %s", name, path, e.msg);
    memcpy(digest, a->digest, 32);
    *rank = a->max_r;
    loom_lora_destroy(&a);
    return LOOM_OK;
}

loom_status_t loom_lora_serve_register(const loom_lora_serve_opts_t *o,
                                       const loom_model_config_t *cfg, loom_lora_slots_t *slots,
                                       loom_err_t *err) {
    for (int i = 0; i < o->n_modules; i++) {
        const loom_lora_module_spec_t *m = &o->modules[i];
        uint8_t digest[32];
        int rank = 0;
        loom_status_t st =
            loom_lora_serve_validate(m->name, m->path, cfg, o->max_lora_rank, digest, &rank, err);
        if (st != LOOM_OK) return st;
        loom_err_t e = {0};
        int id = loom_lora_slots_add(slots, m->name, m->path, m->base, digest, rank, &e);
        if (id < 0)
            return loom_err_set(err, (loom_status_t)id, "LoRA adapter %s: %s", m->name, e.msg);
    }
    return LOOM_OK;
}

static int is_served(const char *name, size_t len, const char *served, const char *const *aliases) {
    if (served && strlen(served) == len && !strncmp(served, name, len)) return 1;
    for (const char *const *a = aliases; a && *a; a++)
        if (strlen(*a) == len && !strncmp(*a, name, len)) return 1;
    return 0;
}

loom_status_t loom_lora_serve_select(const loom_lora_slots_t *slots, const char *served,
                                     const char *const *aliases, const char *model, int *id,
                                     loom_err_t *err) {
    *id = -1;
    if (!model || !model[0] || is_served(model, strlen(model), served, aliases)) return LOOM_OK;
    const loom_lora_entry_t *e = slots ? loom_lora_slots_find(slots, model) : NULL;
    if (!e && slots) {
        /* SGLang's base:adapter */
        const char *colon = strchr(model, ':');
        if (colon && is_served(model, (size_t)(colon - model), served, aliases) && colon[1])
            e = loom_lora_slots_find(slots, colon + 1);
    }
    if (!e) return loom_err_set(err, LOOM_ERR_NOT_FOUND, "The model `%s` does not exist.", model);
    *id = e->id;
    return LOOM_OK;
}

loom_status_t loom_lora_serve_startup(loom_lora_serve_opts_t *o, const char *model_dir,
                                      loom_err_t *err) {
    if (!o->enable && !o->n_modules) return LOOM_OK;
    const char *env = getenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING");
    if (env && (!strcmp(env, "1") || !strcmp(env, "True") || !strcmp(env, "true")))
        o->allow_runtime_updating = 1;
    loom_status_t st = loom_lora_serve_check(o, err);
    if (st != LOOM_OK) return st;
    loom_model_config_t mc;
    st = loom_model_config_load(model_dir, &mc, err);
    if (st != LOOM_OK) return st;
    loom_lora_slots_t *slots = NULL;
    st = loom_lora_slots_create(o->max_loras, o->n_modules + 1, &slots, err);
    if (st == LOOM_OK) st = loom_lora_serve_register(o, &mc, slots, err);
    loom_lora_slots_destroy(&slots);
    return st;
}

void loom_lora_serve_metrics(const loom_lora_slots_t *slots, loom_sched_t *sched,
                             loom_metrics_lora_adapter_t *buf, int cap, loom_metrics_lora_t *out) {
    memset(out, 0, sizeof *out);
    if (!slots) return;
    loom_lora_slots_stats_t st = loom_lora_slots_stats(slots);
    out->max_loras = loom_lora_slots_count(slots);
    out->resident = st.resident, out->loading = st.loading;
    out->loads = st.loads, out->evictions = st.evictions, out->load_failures = st.load_failures;
    out->load_seconds = st.load_seconds;
    const loom_lora_entry_t *list[LOOM_LORA_SERVE_MAX_MODULES * 4];
    int n = loom_lora_slots_list(slots, list, (int)(sizeof list / sizeof list[0]));
    if (n > cap) n = cap;
    int running = 0, n_seqs = 0;
    if (sched) {
        loom_sched_stats_t ss;
        loom_sched_get_stats(sched, &ss);
        running = ss.running;
        n_seqs = loom_sched_n_seqs(sched);
    }
    for (int i = 0; i < n; i++) {
        loom_metrics_lora_adapter_t *a = &buf[i];
        memset(a, 0, sizeof *a);
        snprintf(a->name, sizeof a->name, "%s", list[i]->name);
        a->requests = list[i]->n_requests;
        a->running = list[i]->running;
        for (int k = running; k < n_seqs; k++) { /* running first, then waiting */
            const loom_seq_t *q = loom_sched_seq_at(sched, k);
            a->waiting += q && q->lora_id == list[i]->id;
        }
    }
    out->n_adapters = n;
    out->adapters = buf;
}
