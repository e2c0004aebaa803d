/* Chat templates (chat_template.h): the model's Jinja template found,
 * compiled once, and rendered per request with vLLM's variables; client
 * special-token text kept plain through private-use placeholders. */
#include "common/chat_template.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/jinja.h"
#include "common/tokenizer.h"
#include "common/util.h"

#define DEFAULT_MAX_OUTPUT ((size_t)8 << 20)

/* docs/templates/NAME.jinja, embedded at build time (chat_shipped.c). */
extern const char loom_chat_shipped_chatml[];

struct loom_chat_template {
    loom_jinja_t *def, *tool_use; /* tool_use: when the request has tools (NULL: def) */
    char *text;                   /* def's source */
    char *tool_text;              /* tool_use's source (NULL: none) */
    char *origin;                 /* "FILE" or "tokenizer_config.json" or "chatml (shipped)" */
    cJSON *specials;              /* {bos_token: "...", eos_token, unk_token, pad_token} */
    char **plain; /* special-token strings kept plain in request text, longest first */
    size_t *plain_len;
    int n_plain;
    unsigned char first[256]; /* 1: some plain-kept string starts with this byte */
    loom_chat_template_opts_t o;
};

const char *loom_chat_template_shipped(const char *name) {
    if (name && !strcmp(name, "chatml")) return loom_chat_shipped_chatml;
    return NULL;
}

/* ---- loading ---- */

/* A tokenizer_config.json special token: a string or {"content": ...}. */
static const char *token_str(const cJSON *v) {
    if (cJSON_IsString(v)) return v->valuestring;
    const cJSON *c = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "content") : NULL;
    return cJSON_IsString(c) ? c->valuestring : NULL;
}

static int cmp_len_desc(const void *a, const void *b) {
    size_t la = strlen(*(char *const *)a), lb = strlen(*(char *const *)b);
    return la < lb ? 1 : la > lb ? -1 : strcmp(*(char *const *)a, *(char *const *)b);
}

/* The strings swapped for placeholders: the tokenizer's special tokens and
 * the placeholder's own lead character (so a client cannot forge one). */
static void collect_plain(loom_chat_template_t *t, const loom_tokenizer_t *tok) {
    int n = tok ? loom_tokenizer_vocab_size(tok) : 0, cap = 1;
    for (int id = 0; id < n; id++)
        cap += loom_tokenizer_is_special(tok, id) ? 1 : 0;
    t->plain = loom_xcalloc((size_t)cap, sizeof *t->plain);
    t->plain[t->n_plain++] = loom_xstrdup("\xEE\x80\x80"); /* U+E000 */
    for (int id = 0; id < n; id++) {
        if (!loom_tokenizer_is_special(tok, id)) continue;
        const char *p = loom_tokenizer_piece(tok, id);
        if (p && p[0]) t->plain[t->n_plain++] = loom_xstrdup(p);
    }
    qsort(t->plain, (size_t)t->n_plain, sizeof *t->plain, cmp_len_desc);
    t->plain_len = loom_xcalloc((size_t)t->n_plain, sizeof *t->plain_len);
    for (int i = 0; i < t->n_plain; i++) {
        t->plain_len[i] = strlen(t->plain[i]);
        t->first[(unsigned char)t->plain[i][0]] = 1;
    }
}

static loom_status_t compile(const char *src, const char *name, loom_jinja_t **out,
                             loom_err_t *err) {
    loom_err_t e = {0};
    loom_status_t st = loom_jinja_compile(src, strlen(src), name, out, &e);
    if (st < 0) return loom_err_set(err, st, "chat template %s", e.msg);
    return LOOM_OK;
}

/* The override's text: a shipped name, a file, or a template itself. */
static loom_status_t override_text(const char *ov, char **text, char **origin, loom_err_t *err) {
    const char *shipped = loom_chat_template_shipped(ov);
    if (shipped) {
        *text = loom_xstrdup(shipped);
        *origin = loom_xstrdup(ov);
        return LOOM_OK;
    }
    if (access(ov, F_OK) == 0) {
        size_t len;
        LOOM_CHECK(loom_read_file(ov, text, &len, err));
        *origin = loom_xstrdup(ov);
        return LOOM_OK;
    }
    if (strstr(ov, "{{") || strstr(ov, "{%")) { /* vLLM: the template itself, in single-line form */
        *text = loom_xstrdup(ov);
        *origin = loom_xstrdup("--chat-template");
        return LOOM_OK;
    }
    return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                        "--chat-template %s: no such file, and not a template Loom ships (%s)", ov,
                        LOOM_CHAT_SHIPPED_NAMES);
}

loom_status_t loom_chat_template_from_text(const char *text, const char *config_json,
                                           const char *name, const loom_chat_template_opts_t *o,
                                           const loom_tokenizer_t *tok, loom_chat_template_t **out,
                                           loom_err_t *err) {
    *out = NULL;
    cJSON *cfg = config_json ? cJSON_Parse(config_json) : NULL;
    if (config_json && !cfg)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tokenizer_config.json is not valid JSON");
    const char *def = text, *tool_use = NULL;
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    if (!def && cJSON_IsString(ct)) {
        def = ct->valuestring;
    } else if (cJSON_IsArray(ct)) { /* [{name, template}, ...] */
        const cJSON *it;
        cJSON_ArrayForEach(it, ct) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(it, "name"),
                        *tx = cJSON_GetObjectItemCaseSensitive(it, "template");
            if (!cJSON_IsString(nm) || !cJSON_IsString(tx)) continue;
            if (!strcmp(nm->valuestring, "default") && !def) def = tx->valuestring;
            if (!strcmp(nm->valuestring, "tool_use") && !text) tool_use = tx->valuestring;
        }
    }
    if (!def) {
        cJSON_Delete(cfg);
        return LOOM_OK;
    }
    loom_chat_template_t *t = loom_xcalloc(1, sizeof *t);
    if (o) t->o = *o;
    if (!t->o.max_output) t->o.max_output = DEFAULT_MAX_OUTPUT;
    t->text = loom_xstrdup(def);
    t->origin = loom_xstrdup(name ? name : "tokenizer_config.json");
    t->specials = cJSON_CreateObject();
    static const char *const keys[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(keys); i++) {
        const char *s = token_str(cJSON_GetObjectItemCaseSensitive(cfg, keys[i]));
        cJSON_AddStringToObject(t->specials, keys[i], s ? s : "");
    }
    loom_status_t st = compile(def, t->origin, &t->def, err);
    if (st == LOOM_OK && tool_use) {
        char nm[300];
        snprintf(nm, sizeof nm, "%s[tool_use]", t->origin);
        st = compile(tool_use, nm, &t->tool_use, err);
        t->tool_text = loom_xstrdup(tool_use);
    }
    cJSON_Delete(cfg);
    if (st < 0) {
        loom_chat_template_destroy(&t);
        return st;
    }
    collect_plain(t, tok);
    *out = t;
    return LOOM_OK;
}

loom_status_t loom_chat_template_load(const char *model_dir, const loom_chat_template_opts_t *o,
                                      const loom_tokenizer_t *tok, loom_chat_template_t **out,
                                      loom_err_t *err) {
    *out = NULL;
    char *cfg = NULL, *text = NULL, *origin = NULL;
    size_t len;
    char path[4096];
    loom_err_t ign = {0};
    if (model_dir) {
        snprintf(path, sizeof path, "%s/tokenizer_config.json", model_dir);
        if (access(path, F_OK) == 0) LOOM_CHECK(loom_read_file(path, &cfg, &len, err));
    }
    loom_status_t st = LOOM_OK;
    if (o && o->override) {
        st = override_text(o->override, &text, &origin, err);
    } else if (model_dir) {
        cJSON *c = cfg ? cJSON_Parse(cfg) : NULL;
        int has = cJSON_GetObjectItemCaseSensitive(c, "chat_template") != NULL;
        cJSON_Delete(c);
        snprintf(path, sizeof path, "%s/chat_template.jinja", model_dir);
        if (!has && loom_read_file(path, &text, &len, &ign) == LOOM_OK)
            origin = loom_xstrdup(path);
        else if (has)
            origin = loom_xstrdup("tokenizer_config.json");
    }
    if (st == LOOM_OK) st = loom_chat_template_from_text(text, cfg, origin, o, tok, out, err);
    free(cfg);
    free(text);
    free(origin);
    return st;
}

void loom_chat_template_destroy(loom_chat_template_t **t_p) {
    loom_chat_template_t *t = t_p ? *t_p : NULL;
    if (!t) return;
    loom_jinja_destroy(&t->def);
    loom_jinja_destroy(&t->tool_use);
    for (int i = 0; i < t->n_plain; i++)
        free(t->plain[i]);
    free(t->plain);
    free(t->plain_len);
    cJSON_Delete(t->specials);
    free(t->text);
    free(t->tool_text);
    free(t->origin);
    free(t);
    *t_p = NULL;
}

const char *loom_chat_template_text(const loom_chat_template_t *t) {
    return t ? t->text : NULL;
}

const char *loom_chat_template_tool_text(const loom_chat_template_t *t) {
    return t ? (t->tool_text ? t->tool_text : t->text) : NULL;
}

const char *loom_chat_template_origin(const loom_chat_template_t *t) {
    return t ? t->origin : NULL;
}

/* ---- placeholders: U+E000 <index> U+E001 ---- */

#define PH_OPEN  "\xEE\x80\x80"
#define PH_CLOSE "\xEE\x80\x81"

/* s with every plain-kept string swapped for its placeholder (NULL: none in s). */
static char *swap_out(const loom_chat_template_t *t, const char *s) {
    loom_sbuf_t b = {0};
    size_t n = strlen(s), i = 0, from = 0;
    while (i < n) {
        int hit = -1;
        for (int k = 0; k < t->n_plain && hit < 0 && t->first[(unsigned char)s[i]]; k++)
            if (t->plain_len[k] <= n - i && !memcmp(s + i, t->plain[k], t->plain_len[k])) hit = k;
        if (hit < 0) {
            i++;
            continue;
        }
        if (!b.p) loom_sbuf_add(&b, "", 0);
        loom_sbuf_add(&b, s + from, i - from);
        loom_sbuf_printf(&b, PH_OPEN "%d" PH_CLOSE, hit);
        i += t->plain_len[hit];
        from = i;
    }
    if (!b.p) return NULL;
    loom_sbuf_add(&b, s + from, n - from);
    return b.p;
}

/* Every string in v (object values, array items), swapped in place. */
static void swap_tree(const loom_chat_template_t *t, cJSON *v) {
    if (cJSON_IsString(v)) {
        char *r = swap_out(t, v->valuestring);
        if (r) {
            cJSON_SetValuestring(v, r);
            free(r);
        }
        return;
    }
    cJSON *c;
    cJSON_ArrayForEach(c, v) swap_tree(t, c);
}

typedef struct {
    size_t *v;
    size_t n, cap;
} spans_t;

static void span_add(spans_t *sp, size_t a, size_t e) {
    if (sp->n && sp->v[2 * sp->n - 1] == a) {
        sp->v[2 * sp->n - 1] = e;
        return;
    }
    if (sp->n == sp->cap) {
        sp->cap = sp->cap ? 2 * sp->cap : 8;
        sp->v = loom_xrealloc(sp->v, 2 * sp->cap * sizeof *sp->v);
    }
    sp->v[2 * sp->n] = a;
    sp->v[2 * sp->n + 1] = e;
    sp->n++;
}

/* The rendered text with the placeholders swapped back, their spans noted. */
static char *swap_in(const loom_chat_template_t *t, const char *s, size_t n, size_t *out_len,
                     spans_t *sp) {
    loom_sbuf_t b = {0};
    loom_sbuf_add(&b, "", 0);
    size_t i = 0;
    while (i < n) {
        const char *p = memmem(s + i, n - i, PH_OPEN, 3);
        if (!p) {
            loom_sbuf_add(&b, s + i, n - i);
            break;
        }
        size_t at = (size_t)(p - s), j = at + 3;
        long idx = 0;
        int digits = 0;
        while (j < n && s[j] >= '0' && s[j] <= '9' && digits < 6)
            idx = idx * 10 + (s[j++] - '0'), digits++;
        if (digits && idx < t->n_plain && j + 3 <= n && !memcmp(s + j, PH_CLOSE, 3)) {
            loom_sbuf_add(&b, s + i, at - i);
            size_t a = b.len;
            loom_sbuf_add(&b, t->plain[idx], t->plain_len[idx]);
            span_add(sp, a, b.len);
            i = j + 3;
        } else { /* not ours (the template wrote it): as is */
            loom_sbuf_add(&b, s + i, at + 3 - i);
            i = at + 3;
        }
    }
    *out_len = b.len;
    return b.p;
}

/* ---- the variables ---- */

static loom_status_t bad(loom_err_t *err, const char **param, const char *p, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static loom_status_t bad(loom_err_t *err, const char **param, const char *p, const char *fmt, ...) {
    *param = p;
    char m[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s", m);
}

/* messages as vLLM hands them to templates: text parts joined into a
 * string, no content as "", tool_calls' arguments parsed into objects. */
static loom_status_t messages_var(const cJSON *msgs, cJSON **out, const char **param,
                                  loom_err_t *err) {
    if (!msgs) return bad(err, param, "messages", "messages is required");
    if (!cJSON_IsArray(msgs) || !msgs->child)
        return bad(err, param, "messages",
                   "messages must be a non-empty array of {role, content} objects");
    cJSON *arr = cJSON_CreateArray();
    *out = arr;
    int i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, msgs) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsObject(m) || !cJSON_IsString(role))
            return bad(err, param, "messages", "messages[%d] must be an object with a string role",
                       i);
        cJSON *c = cJSON_Duplicate(m, 1);
        cJSON_AddItemToArray(arr, c);
        cJSON *content = cJSON_GetObjectItemCaseSensitive(c, "content");
        if (cJSON_IsArray(content)) {
            loom_sbuf_t s = {0};
            loom_sbuf_add(&s, "", 0);
            const cJSON *part;
            int k = 0;
            cJSON_ArrayForEach(part, content) {
                const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type"),
                            *text = cJSON_GetObjectItemCaseSensitive(part, "text");
                if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0 ||
                    !cJSON_IsString(text)) {
                    free(s.p);
                    return bad(err, param, "messages",
                               "messages[%d].content: only {\"type\": \"text\", \"text\": ...} "
                               "parts are supported",
                               i);
                }
                if (k++) loom_sbuf_str(&s, "\n");
                loom_sbuf_str(&s, text->valuestring);
            }
            cJSON_ReplaceItemInObjectCaseSensitive(c, "content", cJSON_CreateString(s.p));
            free(s.p);
        } else if (content && !cJSON_IsString(content) && !cJSON_IsNull(content)) {
            return bad(err, param, "messages",
                       "messages[%d].content must be a string or an array of text parts", i);
        } else if (!content && strcmp(role->valuestring, "assistant") != 0) {
            return bad(err, param, "messages", "messages[%d] has no content", i);
        } else if (!cJSON_IsString(
                       content)) { /* vLLM: no content is "" (an assistant's tool calls) */
            if (content)
                cJSON_ReplaceItemInObjectCaseSensitive(c, "content", cJSON_CreateString(""));
            else
                cJSON_AddStringToObject(c, "content", "");
        }
        cJSON *calls = cJSON_GetObjectItemCaseSensitive(c, "tool_calls"), *call;
        if (calls && !cJSON_IsNull(calls) && !cJSON_IsArray(calls))
            return bad(err, param, "messages", "messages[%d].tool_calls must be an array", i);
        int k = 0;
        if (!cJSON_IsArray(calls)) calls = NULL;
        cJSON_ArrayForEach(call, calls) {
            cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
            cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name"),
                  *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
            if (!cJSON_IsString(name) || !cJSON_IsString(args))
                return bad(err, param, "messages",
                           "messages[%d].tool_calls: each must have function.name and "
                           "function.arguments (a JSON string)",
                           i);
            cJSON *parsed = cJSON_Parse(args->valuestring);
            if (!parsed)
                return bad(err, param, "messages",
                           "messages[%d].tool_calls[%d]: function.arguments '%.80s' is not JSON", i,
                           k, args->valuestring);
            cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", parsed);
            k++;
        }
        i++;
    }
    return LOOM_OK;
}

static const cJSON *get(const cJSON *o, const char *k) {
    return cJSON_GetObjectItemCaseSensitive(o, k);
}

static int opt_bool(const cJSON *req, const char *k, int dflt, int *out, const char **param,
                    loom_err_t *err) {
    const cJSON *v = get(req, k);
    *out = dflt;
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsBool(v)) {
        bad(err, param, k, "%s must be a boolean", k);
        return -1;
    }
    *out = cJSON_IsTrue(v);
    return 0;
}

loom_status_t loom_chat_template_render(const loom_chat_template_t *t, const cJSON *req, char **out,
                                        size_t *out_len, size_t **plain, size_t *n_plain,
                                        const char **param, loom_err_t *err) {
    *out = NULL;
    *out_len = 0;
    if (plain) {
        *plain = NULL;
        *n_plain = 0;
    }
    *param = NULL;
    cJSON *vars = cJSON_Duplicate(t->specials, 1), *msgs = NULL;
    loom_jinja_t *own = NULL;
    char *text = NULL;
    size_t len = 0;
    loom_status_t st = messages_var(get(req, "messages"), &msgs, param, err);
    if (msgs) cJSON_AddItemToObject(vars, "messages", msgs);
    if (st < 0) goto done;
    int add_gen, cont;
    if (opt_bool(req, "add_generation_prompt", 1, &add_gen, param, err) < 0 ||
        opt_bool(req, "continue_final_message", 0, &cont, param, err) < 0) {
        st = LOOM_ERR_INVALID_ARGUMENT;
        goto done;
    }
    if (add_gen && cont && get(req, "add_generation_prompt") &&
        cJSON_IsTrue(get(req, "add_generation_prompt"))) {
        st = bad(err, param, "continue_final_message",
                 "continue_final_message and add_generation_prompt cannot both be true");
        goto done;
    }
    if (cont) add_gen = 0;
    cJSON_AddBoolToObject(vars, "add_generation_prompt", add_gen);
    cJSON_AddBoolToObject(vars, "continue_final_message", cont);
    const cJSON *tools = get(req, "tools"), *docs = get(req, "documents"),
                *effort = get(req, "reasoning_effort");
    int has_tools = cJSON_IsArray(tools) && tools->child;
    cJSON_AddItemToObject(vars, "tools",
                          has_tools ? cJSON_Duplicate(tools, 1) : cJSON_CreateNull());
    if (docs && !cJSON_IsNull(docs)) {
        if (!cJSON_IsArray(docs)) {
            st = bad(err, param, "documents", "documents must be an array of objects");
            goto done;
        }
        cJSON_AddItemToObject(vars, "documents", cJSON_Duplicate(docs, 1));
    }
    if (cJSON_IsString(effort))
        cJSON_AddStringToObject(vars, "reasoning_effort", effort->valuestring);
    swap_tree(t, cJSON_GetObjectItemCaseSensitive(vars, "messages"));
    swap_tree(t, cJSON_GetObjectItemCaseSensitive(vars, "tools"));
    swap_tree(t, cJSON_GetObjectItemCaseSensitive(vars, "documents"));
    const cJSON *kw = get(req, "chat_template_kwargs");
    if (kw && !cJSON_IsNull(kw)) {
        if (!cJSON_IsObject(kw)) {
            st = bad(err, param, "chat_template_kwargs", "chat_template_kwargs must be an object");
            goto done;
        }
        const cJSON *k;
        cJSON_ArrayForEach(k, kw) {
            cJSON_DeleteItemFromObjectCaseSensitive(vars, k->string);
            cJSON_AddItemToObject(vars, k->string, cJSON_Duplicate(k, 1));
        }
    }
    const loom_jinja_t *tmpl = has_tools && t->tool_use ? t->tool_use : t->def;
    const cJSON *rt = get(req, "chat_template");
    if (rt && !cJSON_IsNull(rt)) {
        if (!t->o.trust_request) {
            st = bad(err, param, "chat_template",
                     "a request's own chat_template is used only when the server runs with "
                     "--trust-request-chat-template");
            goto done;
        }
        if (!cJSON_IsString(rt)) {
            st = bad(err, param, "chat_template", "chat_template must be a string");
            goto done;
        }
        loom_err_t e = {0};
        if (loom_jinja_compile(rt->valuestring, strlen(rt->valuestring), "chat_template", &own,
                               &e) < 0) {
            st = bad(err, param, "chat_template", "%s", e.msg);
            goto done;
        }
        tmpl = own;
    }
    loom_jinja_limits_t lim = {.max_output = t->o.max_output, .max_steps = t->o.max_steps};
    loom_err_t e = {0};
    st = loom_jinja_render(tmpl, vars, &lim, &text, &len, &e);
    if (st < 0) {
        *param = "messages";
        if (st == LOOM_ERR_RESOURCE_EXHAUSTED)
            loom_err_set(err, st, "the chat template's render exceeded its limits: %s", e.msg);
        else
            loom_err_set(err, st == LOOM_ERR_INVALID_ARGUMENT ? st : LOOM_ERR_INVALID_ARGUMENT,
                         "%s", e.msg);
        st = err->code;
        goto done;
    }
    spans_t sp = {0};
    *out = swap_in(t, text, len, out_len, &sp);
    if (plain) {
        *plain = sp.v;
        *n_plain = sp.n;
    } else {
        free(sp.v);
    }
done:
    free(text);
    loom_jinja_destroy(&own);
    cJSON_Delete(vars);
    return st;
}
