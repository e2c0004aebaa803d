/* PEFT LoRA adapters: adapter_config.json + adapter_model.safetensors read,
 * checked against the base model and digested (see lora.h). */
#include "common/lora.h"

#include <math.h>
#include <regex.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "common/json.h"
#include "common/safetensors.h"
#include "common/util.h"

static const char *const k_target_names[LOOM_LORA_N_TARGETS] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"};

const char *loom_lora_target_name(loom_lora_target_t t) {
    return (t >= 0 && t < LOOM_LORA_N_TARGETS) ? k_target_names[t] : "?";
}

int loom_lora_rank_allowed(int r) {
    static const int ok[] = {1, 8, 16, 32, 64, 128, 256, 320, 512};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (ok[i] == r) return 1;
    return 0;
}

/* ---- adapter_config.json ---------------------------------------------- */

/* A rank_pattern / alpha_pattern entry: a regular expression matched against
 * the end of a module's name (PEFT: re.match(rf"(.*\.)?({key})$", name)). */
typedef struct pattern {
    regex_t re;
    double value;
} pattern_t;

typedef struct lora_cfg {
    int r;
    double alpha;
    int rslora;
    pattern_t *rank_pat, *alpha_pat;
    int n_rank_pat, n_alpha_pat;
    /* target_modules: names (a module matches one when its name is the name
     * or ends with "." + name), a regular expression (fullmatch), or
     * "all-linear" */
    char **targets;
    int n_targets;
    int targets_regex_set, all_linear;
    regex_t targets_re;
} lora_cfg_t;

static void cfg_free(lora_cfg_t *c) {
    for (int i = 0; i < c->n_rank_pat; i++) regfree(&c->rank_pat[i].re);
    for (int i = 0; i < c->n_alpha_pat; i++) regfree(&c->alpha_pat[i].re);
    free(c->rank_pat);
    free(c->alpha_pat);
    for (int i = 0; i < c->n_targets; i++) free(c->targets[i]);
    free(c->targets);
    if (c->targets_regex_set) regfree(&c->targets_re);
    memset(c, 0, sizeof *c);
}

static loom_status_t compile_re(regex_t *re, const char *fmt, const char *pat, const char *path, const char *key,
                                loom_err_t *err) {
    size_t n = strlen(fmt) + strlen(pat) + 1;
    char *full = loom_xmalloc(n);
    snprintf(full, n, fmt, pat);
    int rc = regcomp(re, full, REG_EXTENDED | REG_NOSUB);
    free(full);
    if (rc != 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: %s: '%s' is not a regular expression", path, key,
                            pat);
    return LOOM_OK;
}

static loom_status_t read_patterns(const cJSON *root, const char *key, const char *path, pattern_t **out, int *n,
                                   loom_err_t *err) {
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!o || cJSON_IsNull(o)) return LOOM_OK;
    if (!cJSON_IsObject(o)) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: %s must be an object", path, key);
    int cap = cJSON_GetArraySize(o);
    *out = loom_xcalloc((size_t)(cap > 0 ? cap : 1), sizeof **out);
    const cJSON *e;
    cJSON_ArrayForEach(e, o) {
        if (!cJSON_IsNumber(e) || !(e->valuedouble > 0))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: %s['%s'] must be a positive number", path, key,
                                e->string);
        LOOM_CHECK(compile_re(&(*out)[*n].re, "^(.*\\.)?(%s)$", e->string, path, key, err));
        (*out)[*n].value = e->valuedouble;
        (*n)++;
    }
    return LOOM_OK;
}

/* A key that must be absent, null, false or empty for Loom to apply the
 * adapter exactly; anything else is refused naming it. */
static int key_set(const cJSON *root, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v)) return 0;
    if ((cJSON_IsArray(v) || cJSON_IsObject(v)) && cJSON_GetArraySize(v) == 0) return 0;
    return 1;
}

static loom_status_t parse_config(const char *path, lora_cfg_t *c, loom_err_t *err) {
    char *text = NULL;
    size_t len = 0;
    LOOM_CHECK(loom_read_file(path, &text, &len, err));
    size_t bad = 0;
    cJSON *root = loom_json_parse_strict(text, len, &bad);
    free(text);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not a JSON object (at byte %zu)", path, bad);
    }
    loom_status_t s = LOOM_OK;
    const cJSON *v;
    v = cJSON_GetObjectItemCaseSensitive(root, "peft_type");
    if (v && !(cJSON_IsString(v) && strcmp(v->valuestring, "LORA") == 0)) {
        s = loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: peft_type %s is not LORA", path,
                         cJSON_IsString(v) ? v->valuestring : "(not a string)");
        goto done;
    }
    /* what Loom would otherwise drop silently */
    static const struct {
        const char *key, *why;
    } refused[] = {
        {"use_dora", "DoRA adapters (use_dora) are not supported"},
        {"modules_to_save", "modules_to_save (whole modules trained beside the adapter) is not supported"},
        {"fan_in_fan_out", "fan_in_fan_out (transposed Conv1D weights) is not supported"},
        {"layer_replication", "layer_replication is not supported"},
        {"lora_bias", "lora_bias (a bias on lora_B) is not supported"},
        {"trainable_token_indices", "trainable_token_indices (embedding rows trained beside the adapter) is not supported"},
        {"target_parameters", "target_parameters (adapters on MoE experts' parameters) is not supported"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        if (key_set(root, refused[i].key)) {
            s = loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: %s", path, refused[i].why);
            goto done;
        }
    v = cJSON_GetObjectItemCaseSensitive(root, "bias");
    if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && strcmp(v->valuestring, "none") == 0)) {
        s = loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: bias \"%s\" is not supported (only \"none\")", path,
                         cJSON_IsString(v) ? v->valuestring : "?");
        goto done;
    }
    c->r = 8;
    c->alpha = 8;
    v = cJSON_GetObjectItemCaseSensitive(root, "r");
    if (v) {
        if (!cJSON_IsNumber(v) || v->valuedouble != (double)(int)v->valuedouble || v->valueint <= 0) {
            s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: r must be a positive integer", path);
            goto done;
        }
        c->r = v->valueint;
    }
    v = cJSON_GetObjectItemCaseSensitive(root, "lora_alpha");
    if (v) {
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0)) {
            s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: lora_alpha must be a positive number", path);
            goto done;
        }
        c->alpha = v->valuedouble;
    }
    v = cJSON_GetObjectItemCaseSensitive(root, "use_rslora");
    c->rslora = v && cJSON_IsTrue(v);
    if ((s = read_patterns(root, "rank_pattern", path, &c->rank_pat, &c->n_rank_pat, err)) < 0) goto done;
    if ((s = read_patterns(root, "alpha_pattern", path, &c->alpha_pat, &c->n_alpha_pat, err)) < 0) goto done;
    for (int i = 0; i < c->n_rank_pat; i++)
        if (c->rank_pat[i].value != (double)(int)c->rank_pat[i].value) {
            s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: rank_pattern values must be integers", path);
            goto done;
        }
    v = cJSON_GetObjectItemCaseSensitive(root, "target_modules");
    if (v && cJSON_IsString(v)) {
        if (strcmp(v->valuestring, "all-linear") == 0)
            c->all_linear = 1;
        else {
            if ((s = compile_re(&c->targets_re, "^(%s)$", v->valuestring, path, "target_modules", err)) < 0) goto done;
            c->targets_regex_set = 1;
        }
    } else if (v && cJSON_IsArray(v)) {
        c->targets = loom_xcalloc((size_t)cJSON_GetArraySize(v) + 1, sizeof *c->targets);
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (!cJSON_IsString(e)) {
                s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: target_modules must hold strings", path);
                goto done;
            }
            c->targets[c->n_targets++] = loom_xstrdup(e->valuestring);
        }
    } else if (v && !cJSON_IsNull(v)) {
        s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: target_modules must be a list or a string", path);
        goto done;
    }
done:
    cJSON_Delete(root);
    return s;
}

static const pattern_t *match_pattern(const pattern_t *p, int n, const char *module) {
    for (int i = 0; i < n; i++)
        if (regexec(&p[i].re, module, 0, NULL, 0) == 0) return &p[i];
    return NULL;
}

/* ---- the base model's modules ------------------------------------------ */

/* One module an adapter tensor may name, relative to "model.layers.L.". */
typedef struct module_kind {
    const char *suffix;
    int parts;                         /* projections it feeds (fused: 2 or 3) */
    loom_lora_target_t t[3];
    int fused;                         /* exists only in fused (Phi-3) checkpoints; -1: only in unfused */
    int mlp;                           /* part of the dense MLP */
} module_kind_t;

static const module_kind_t k_modules[] = {
    {"self_attn.q_proj", 1, {LOOM_LORA_Q}, -1, 0},
    {"self_attn.k_proj", 1, {LOOM_LORA_K}, -1, 0},
    {"self_attn.v_proj", 1, {LOOM_LORA_V}, -1, 0},
    {"self_attn.qkv_proj", 3, {LOOM_LORA_Q, LOOM_LORA_K, LOOM_LORA_V}, 1, 0},
    {"self_attn.o_proj", 1, {LOOM_LORA_O}, 0, 0},
    {"mlp.gate_proj", 1, {LOOM_LORA_GATE}, -1, 1},
    {"mlp.up_proj", 1, {LOOM_LORA_UP}, -1, 1},
    {"mlp.gate_up_proj", 2, {LOOM_LORA_GATE, LOOM_LORA_UP}, 1, 1},
    {"mlp.down_proj", 1, {LOOM_LORA_DOWN}, 0, 1},
};
#define N_KINDS (int)(sizeof k_modules / sizeof k_modules[0])

static int kind_exists(const loom_model_config_t *cfg, const module_kind_t *k, int layer) {
    if (k->fused == 1 && !cfg->fused_qkv) return 0;
    if (k->fused == -1 && cfg->fused_qkv) return 0;
    if (k->mlp && loom_model_config_layer_moe(cfg, layer)) return 0;
    return 1;
}

static void target_dims(const loom_model_config_t *cfg, loom_lora_target_t t, int64_t *in, int64_t *out) {
    int64_t hd = cfg->head_dim, q = (int64_t)cfg->n_heads * hd, kv = (int64_t)cfg->n_kv_heads * hd;
    switch (t) {
    case LOOM_LORA_Q: *in = cfg->dim, *out = q; break;
    case LOOM_LORA_K:
    case LOOM_LORA_V: *in = cfg->dim, *out = kv; break;
    case LOOM_LORA_O: *in = q, *out = cfg->dim; break;
    case LOOM_LORA_GATE:
    case LOOM_LORA_UP: *in = cfg->dim, *out = cfg->hidden_dim; break;
    default: *in = cfg->hidden_dim, *out = cfg->dim; break;
    }
}

/* Does target_modules select MODULE (its full name, "model.layers.L.x.y")? */
static int targeted(const lora_cfg_t *c, const char *module) {
    if (c->all_linear) return 1;
    if (c->targets_regex_set) return regexec(&c->targets_re, module, 0, NULL, 0) == 0;
    if (!c->targets) return 1; /* no target_modules: the tensors say */
    size_t ml = strlen(module);
    for (int i = 0; i < c->n_targets; i++) {
        size_t tl = strlen(c->targets[i]);
        if (strcmp(module, c->targets[i]) == 0) return 1;
        if (ml > tl && module[ml - tl - 1] == '.' && strcmp(module + ml - tl, c->targets[i]) == 0) return 1;
    }
    return 0;
}

/* Every entry of a target_modules list must name a module the model has
 * (in some layer); an expert's module is refused as such. */
static loom_status_t check_targets(const lora_cfg_t *c, const loom_model_config_t *cfg, const char *path,
                                   loom_err_t *err) {
    for (int i = 0; i < c->n_targets; i++) {
        const char *t = c->targets[i];
        int found = 0, on_moe = 0;
        for (int l = 0; l < cfg->n_layers && !found; l++)
            for (int k = 0; k < N_KINDS && !found; k++) {
                char name[160];
                snprintf(name, sizeof name, "model.layers.%d.%s", l, k_modules[k].suffix);
                lora_cfg_t one = {.targets = (char **)&c->targets[i], .n_targets = 1};
                if (!targeted(&one, name)) continue;
                if (kind_exists(cfg, &k_modules[k], l))
                    found = 1;
                else if (k_modules[k].mlp && loom_model_config_layer_moe(cfg, l))
                    on_moe = 1;
            }
        if (found) continue;
        if (on_moe || strstr(t, "expert") || strcmp(t, "w1") == 0 || strcmp(t, "w2") == 0 || strcmp(t, "w3") == 0)
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                "%s: target module '%s' is in the Mixture-of-Experts layers of this %s model; "
                                "adapters on experts are not supported",
                                path, t, cfg->model_type);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "%s: target module '%s' is not a module of this %s model (it has %s)", path, t,
                            cfg->model_type,
                            cfg->fused_qkv ? "qkv_proj, o_proj, gate_up_proj, down_proj"
                                           : "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj");
    }
    return LOOM_OK;
}

/* ---- the tensors -------------------------------------------------------- */

#define PEFT_PREFIX "base_model.model."

/* Splits "base_model.model.model.layers.L.<suffix>.lora_X.weight" into the
 * layer, the module kind and X ('A' or 'B'); 0 when it is not of that form. */
static int parse_name(const char *name, int *layer, int *kind, char *ab, char *module, size_t module_cap) {
    if (strncmp(name, PEFT_PREFIX, strlen(PEFT_PREFIX)) != 0) return 0;
    const char *p = name + strlen(PEFT_PREFIX);
    const char *tail = strstr(p, ".lora_");
    if (!tail || (tail[6] != 'A' && tail[6] != 'B') || strcmp(tail + 7, ".weight") != 0) return 0;
    size_t mlen = (size_t)(tail - p);
    if (mlen + 1 > module_cap) return 0;
    memcpy(module, p, mlen);
    module[mlen] = 0;
    *ab = tail[6];
    int l = -1, off = 0;
    if (sscanf(module, "model.layers.%d.%n", &l, &off) != 1 || off == 0 || l < 0) return 0;
    for (int k = 0; k < N_KINDS; k++)
        if (strcmp(module + off, k_modules[k].suffix) == 0) {
            *layer = l;
            *kind = k;
            return 1;
        }
    *layer = l;
    *kind = -1;
    return 1;
}

static loom_status_t read_f32(loom_st_t *st, const loom_st_tensor_t *t, float **out, loom_err_t *err) {
    int64_t rows = t->shape[0], cols = t->shape[1];
    *out = loom_xmalloc((size_t)(rows * cols) * sizeof(float));
    loom_status_t s = loom_st_read_f32(st, t, 0, rows, 0, cols, *out, err);
    if (s < 0) {
        free(*out);
        *out = NULL;
        return s;
    }
    for (int64_t i = 0; i < rows * cols; i++)
        if (!isfinite((*out)[i]))
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s holds a non-finite value", t->name, t->file);
    return LOOM_OK;
}

static void digest_modules(loom_lora_adapter_t *a, const lora_cfg_t *c, crypto_generichash_state *h) {
    char head[96];
    int n = snprintf(head, sizeof head, "loom-lora/1 r=%d alpha=%.9g rslora=%d layers=%d", c->r, c->alpha, c->rslora,
                     a->n_layers);
    crypto_generichash_update(h, (const unsigned char *)head, (unsigned long long)n);
    for (int l = 0; l < a->n_layers; l++)
        for (int t = 0; t < LOOM_LORA_N_TARGETS; t++) {
            const loom_lora_module_t *m = &a->mod[l * LOOM_LORA_N_TARGETS + t];
            if (m->r == 0) continue;
            int64_t hdr[5] = {l, t, m->r, m->in, m->out};
            float sc = m->scale;
            crypto_generichash_update(h, (const unsigned char *)hdr, sizeof hdr);
            crypto_generichash_update(h, (const unsigned char *)&sc, sizeof sc);
            crypto_generichash_update(h, (const unsigned char *)m->a, (size_t)(m->r * m->in) * sizeof(float));
            crypto_generichash_update(h, (const unsigned char *)m->b, (size_t)(m->out * m->r) * sizeof(float));
        }
}

loom_status_t loom_lora_load(const char *dir, const loom_model_config_t *cfg, int max_rank, int layer_begin,
                             int layer_end, loom_lora_adapter_t **out, loom_err_t *err) {
    *out = NULL;
    if (layer_end <= 0 || layer_end > cfg->n_layers) layer_end = cfg->n_layers;
    if (layer_begin < 0) layer_begin = 0;
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return loom_err_set(err, LOOM_ERR_NOT_FOUND, "LoRA adapter directory %s does not exist", dir);
    char path[4096], st_path[4096];
    loom_path_join(path, sizeof path, dir, "adapter_config.json");
    loom_path_join(st_path, sizeof st_path, dir, "adapter_model.safetensors");
    if (stat(path, &sb) != 0)
        return loom_err_set(err, LOOM_ERR_NOT_FOUND, "%s: no adapter_config.json (not a PEFT adapter directory)", dir);
    if (stat(st_path, &sb) != 0) {
        char bin[4096];
        loom_path_join(bin, sizeof bin, dir, "adapter_model.bin");
        if (stat(bin, &sb) == 0)
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                "%s: adapter_model.bin (pickle) is not read; save the adapter with safetensors", dir);
        return loom_err_set(err, LOOM_ERR_NOT_FOUND, "%s: no adapter_model.safetensors", dir);
    }
    if (cfg->n_layers <= 0 || cfg->n_layers > 4096)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the base model has %d layers", cfg->n_layers);

    lora_cfg_t c = {0};
    loom_st_t *st = NULL;
    loom_lora_adapter_t *a = NULL;
    loom_status_t s = parse_config(path, &c, err);
    if (s < 0) goto fail;
    if ((s = check_targets(&c, cfg, path, err)) < 0) goto fail;
    if ((s = loom_st_open_file(st_path, &st, err)) < 0) goto fail;

    a = loom_xcalloc(1, sizeof *a);
    a->n_layers = cfg->n_layers;
    a->layer_begin = layer_begin;
    a->layer_end = layer_end;
    a->mod = loom_xcalloc((size_t)cfg->n_layers * LOOM_LORA_N_TARGETS, sizeof *a->mod);

    /* pass 1: every tensor must be an A or B of a module the model has */
    int nt = loom_st_count(st);
    for (int i = 0; i < nt; i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        int layer = -1, kind = -1;
        char ab = 0, module[256];
        if (!parse_name(t->name, &layer, &kind, &ab, module, sizeof module)) {
            s = loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                             "tensor '%s' in %s is not a LoRA A or B matrix of a decoder layer "
                             "(base_model.model.model.layers.N.<module>.lora_A/lora_B.weight)",
                             t->name, st_path);
            goto fail;
        }
        if (layer >= cfg->n_layers) {
            s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tensor '%s' in %s: layer %d, but the model has %d",
                             t->name, st_path, layer, cfg->n_layers);
            goto fail;
        }
        if (kind < 0 || !kind_exists(cfg, &k_modules[kind], layer)) {
            int expert = strstr(module, "expert") != NULL || strstr(module, "block_sparse_moe") != NULL ||
                         (kind >= 0 && k_modules[kind].mlp && loom_model_config_layer_moe(cfg, layer));
            s = loom_err_set(err, expert ? LOOM_ERR_UNSUPPORTED : LOOM_ERR_INVALID_ARGUMENT,
                             expert ? "tensor '%s' in %s adapts module %s of a Mixture-of-Experts layer; adapters on "
                                      "experts are not supported"
                                    : "tensor '%s' in %s adapts module %s, which this %s model does not have",
                             t->name, st_path, module, cfg->model_type);
            goto fail;
        }
        if (!targeted(&c, module)) {
            s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                             "tensor '%s' in %s adapts %s, which adapter_config.json's target_modules does not name",
                             t->name, st_path, module);
            goto fail;
        }
        if (ab == 'B') continue;
        /* A: find its B, check both shapes against the module's rank */
        const module_kind_t *k = &k_modules[kind];
        const pattern_t *rp = match_pattern(c.rank_pat, c.n_rank_pat, module);
        const pattern_t *ap = match_pattern(c.alpha_pat, c.n_alpha_pat, module);
        int r = rp ? (int)rp->value : c.r;
        double alpha = ap ? ap->value : c.alpha;
        if (r > max_rank) {
            s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: LoRA rank %d is greater than max_lora_rank %d", dir,
                             r, max_rank);
            goto fail;
        }
        int64_t in, outd = 0, part_out[3];
        target_dims(cfg, k->t[0], &in, &part_out[0]);
        for (int p = 0; p < k->parts; p++) {
            int64_t pin;
            target_dims(cfg, k->t[p], &pin, &part_out[p]);
            outd += part_out[p];
        }
        char bname[320];
        snprintf(bname, sizeof bname, PEFT_PREFIX "%s.lora_B.weight", module);
        const loom_st_tensor_t *ta = NULL, *tb = NULL;
        if ((s = loom_st_get(st, t->name, 2, (int64_t[]){r, in}, &ta, err)) < 0) goto fail;
        if (!loom_st_find(st, bname)) {
            s = loom_err_set(err, LOOM_ERR_FORMAT, "%s has %s but no %s", st_path, t->name, bname);
            goto fail;
        }
        if ((s = loom_st_get(st, bname, 2, (int64_t[]){outd, r}, &tb, err)) < 0) goto fail;
        float *fa = NULL, *fb = NULL;
        if ((s = read_f32(st, ta, &fa, err)) < 0) goto fail;
        if ((s = read_f32(st, tb, &fb, err)) < 0) {
            free(fa);
            goto fail;
        }
        float scale = (float)(c.rslora ? alpha / sqrt((double)r) : alpha / r);
        int64_t row0 = 0;
        for (int p = 0; p < k->parts; p++) {
            loom_lora_module_t *m = &a->mod[layer * LOOM_LORA_N_TARGETS + k->t[p]];
            if (m->r) {
                s = loom_err_set(err, LOOM_ERR_FORMAT, "%s adapts %s of layer %d twice", st_path,
                                 loom_lora_target_name(k->t[p]), layer);
                free(fa);
                free(fb);
                goto fail;
            }
            m->r = r;
            m->scale = scale;
            m->in = in;
            m->out = part_out[p];
            m->a = loom_xmalloc((size_t)(r * in) * sizeof(float));
            memcpy(m->a, fa, (size_t)(r * in) * sizeof(float));
            m->b = loom_xmalloc((size_t)(part_out[p] * r) * sizeof(float));
            memcpy(m->b, fb + row0 * r, (size_t)(part_out[p] * r) * sizeof(float));
            row0 += part_out[p];
        }
        free(fa);
        free(fb);
    }
    /* every B has its A */
    for (int i = 0; i < nt; i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        size_t n = strlen(t->name);
        if (n > 14 && strcmp(t->name + n - 14, ".lora_B.weight") == 0) {
            char aname[320];
            snprintf(aname, sizeof aname, "%.*s.lora_A.weight", (int)(n - 14), t->name);
            if (!loom_st_find(st, aname)) {
                s = loom_err_set(err, LOOM_ERR_FORMAT, "%s has %s but no %s", st_path, t->name, aname);
                goto fail;
            }
        }
    }

    int any = 0;
    for (int i = 0; i < a->n_layers * LOOM_LORA_N_TARGETS && !any; i++) any = a->mod[i].r > 0;
    if (!any) {
        s = loom_err_set(err, LOOM_ERR_FORMAT, "%s holds no LoRA matrices", st_path);
        goto fail;
    }
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, sizeof a->digest);
    digest_modules(a, &c, &h);
    crypto_generichash_final(&h, a->digest, sizeof a->digest);
    for (int i = 0; i < 32; i++) snprintf(a->digest_hex + 2 * i, 3, "%02x", a->digest[i]);

    /* keep only this stage's layers */
    for (int l = 0; l < a->n_layers; l++)
        for (int t = 0; t < LOOM_LORA_N_TARGETS; t++) {
            loom_lora_module_t *m = &a->mod[l * LOOM_LORA_N_TARGETS + t];
            if (!m->r) continue;
            if (l < layer_begin || l >= layer_end) {
                free(m->a);
                free(m->b);
                memset(m, 0, sizeof *m);
                continue;
            }
            a->n_modules++;
            if (m->r > a->max_r) a->max_r = m->r;
            a->bytes += (size_t)(m->r * (m->in + m->out)) * sizeof(float);
        }
    loom_st_close(&st);
    cfg_free(&c);
    *out = a;
    return LOOM_OK;
fail:
    loom_st_close(&st);
    cfg_free(&c);
    loom_lora_destroy(&a);
    return s;
}

void loom_lora_destroy(loom_lora_adapter_t **a_p) {
    if (!a_p || !*a_p) return;
    loom_lora_adapter_t *a = *a_p;
    if (a->mod)
        for (int i = 0; i < a->n_layers * LOOM_LORA_N_TARGETS; i++) {
            free(a->mod[i].a);
            free(a->mod[i].b);
        }
    free(a->mod);
    free(a);
    *a_p = NULL;
}

const loom_lora_module_t *loom_lora_module(const loom_lora_adapter_t *a, int layer, loom_lora_target_t t) {
    if (!a || layer < 0 || layer >= a->n_layers || t < 0 || t >= LOOM_LORA_N_TARGETS) return NULL;
    const loom_lora_module_t *m = &a->mod[layer * LOOM_LORA_N_TARGETS + t];
    return m->r ? m : NULL;
}

void loom_lora_slice(const loom_lora_module_t *m, int64_t row0, int64_t nrows, int64_t col0, int64_t ncols,
                     float *a_out, float *b_out) {
    LOOM_ASSERT(row0 >= 0 && row0 + nrows <= m->out && col0 >= 0 && col0 + ncols <= m->in);
    for (int k = 0; k < m->r; k++) memcpy(a_out + k * ncols, m->a + k * m->in + col0, (size_t)ncols * sizeof(float));
    memcpy(b_out, m->b + row0 * m->r, (size_t)(nrows * m->r) * sizeof(float));
}
