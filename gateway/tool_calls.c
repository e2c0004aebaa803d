/* Tool calling for /v1/chat/completions (see tool_calls.h). */
#include "gateway/tool_calls.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"
#include "common/util.h"
#include "gateway/tool_parsers.h"
#include "gateway/tool_stream.h"

#define MAX_TOOLS 128

/* DeepSeek V3's markers (tool_parsers.c reads them) */

static int fail(char *msg, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *msg, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, cap, fmt, ap);
    va_end(ap);
    return -1;
}

static const cJSON *get(const cJSON *o, const char *k) {
    return cJSON_GetObjectItemCaseSensitive(o, k);
}

/* The function object of tools[i]: {name, description?, parameters?}. */
static const cJSON *fn_of(const cJSON *tool) {
    return get(tool, "function");
}

static cJSON *params_or_empty(const cJSON *fn) {
    const cJSON *p = get(fn, "parameters");
    if (p && !cJSON_IsNull(p)) return cJSON_Duplicate(p, 1);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "object");
    cJSON_AddObjectToObject(o, "properties");
    return o;
}

static const struct {
    loom_toolfmt_t f;
    const char *name;
} k_fmts[] = {
    {LOOM_TOOLFMT_HERMES, "hermes"},
    {LOOM_TOOLFMT_LLAMA3_JSON, "llama3_json"},
    {LOOM_TOOLFMT_MISTRAL, "mistral"},
    {LOOM_TOOLFMT_GRANITE, "granite"},
    {LOOM_TOOLFMT_DEEPSEEK_V3, "deepseek_v3"},
    {LOOM_TOOLFMT_DEEPSEEK_V31, "deepseek_v31"},
    {LOOM_TOOLFMT_PYTHONIC, "pythonic"},
    {LOOM_TOOLFMT_LLAMA4_PYTHONIC, "llama4_pythonic"},
    {LOOM_TOOLFMT_QWEN3_CODER, "qwen3_coder"},
    {LOOM_TOOLFMT_OPENAI, "openai"},
};

const char *loom_toolfmt_name(loom_toolfmt_t f) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_fmts); i++)
        if (k_fmts[i].f == f) return k_fmts[i].name;
    return "none";
}

loom_toolfmt_t loom_toolfmt_from_name(const char *name) {
    for (size_t i = 0; name && i < LOOM_ARRAY_LEN(k_fmts); i++)
        if (!strcmp(k_fmts[i].name, name)) return k_fmts[i].f;
    return LOOM_TOOLFMT_NONE;
}

loom_toolfmt_t loom_toolfmt_detect(const char *text) {
    if (!text) return LOOM_TOOLFMT_NONE;
    if (strstr(text, "<|channel|>commentary") && strstr(text, "<|call|>")) /* GPT-OSS harmony */
        return LOOM_TOOLFMT_OPENAI;
    if (strstr(text, "tool\xe2\x96\x81" "calls\xe2\x96\x81" "begin")) /* DeepSeek's markers */
        return strstr(text, "```json") ? LOOM_TOOLFMT_DEEPSEEK_V3 : LOOM_TOOLFMT_DEEPSEEK_V31;
    if (strstr(text, "[func_name1(")) /* Llama 3.2 / 4's pythonic instructions */
        return strstr(text, "<|python_start|>") ? LOOM_TOOLFMT_LLAMA4_PYTHONIC : LOOM_TOOLFMT_PYTHONIC;
    if (strstr(text, "<function=") && strstr(text, "<parameter=")) return LOOM_TOOLFMT_QWEN3_CODER;
    if (strstr(text, "[TOOL_CALLS]")) return LOOM_TOOLFMT_MISTRAL;
    if (strstr(text, "<|tool_call|>")) return LOOM_TOOLFMT_GRANITE;
    if (strstr(text, "<tool_call>")) return LOOM_TOOLFMT_HERMES;
    if (strstr(text, "<|python_tag|>") || (strstr(text, "<|start_header_id|>") && strstr(text, "\"parameters\"")))
        return LOOM_TOOLFMT_LLAMA3_JSON;
    return LOOM_TOOLFMT_NONE;
}

/* The call object a forced call writes: {"name": const, ARGS: the parameters' schema}. */
static cJSON *call_schema(const cJSON *tool, const char *args_key) {
    cJSON *o = cJSON_CreateObject(), *props;
    cJSON_AddStringToObject(o, "type", "object");
    props = cJSON_AddObjectToObject(o, "properties");
    cJSON *nm = cJSON_AddObjectToObject(props, "name");
    cJSON_AddStringToObject(nm, "const", get(fn_of(tool), "name")->valuestring);
    cJSON_AddItemToObject(props, args_key, params_or_empty(fn_of(tool)));
    cJSON *req = cJSON_AddArrayToObject(o, "required");
    cJSON_AddItemToArray(req, cJSON_CreateString("name"));
    cJSON_AddItemToArray(req, cJSON_CreateString(args_key));
    cJSON_AddFalseToObject(o, "additionalProperties");
    /* the parameters' "#/$defs/..." references resolve from the call object's root */
    for (const char *const *k = (const char *const[]){"$defs", "definitions", NULL}; *k; k++) {
        const cJSON *defs = get(get(fn_of(tool), "parameters"), *k);
        if (defs) cJSON_AddItemToObject(o, *k, cJSON_Duplicate(defs, 1));
    }
    return o;
}

/* The markers each syntax's parser reads (and its forced grammar writes):
 * where the tokenizer has one as one token, the grammar takes that token,
 * and when it is a special token the coordinator writes it into the text. */
static const char *const *markers_of(loom_toolfmt_t f) {
    static const char *const hermes[] = {"<tool_call>", "</tool_call>", NULL};
    static const char *const llama3[] = {"<|python_tag|>", NULL};
    static const char *const mistral[] = {"[TOOL_CALLS]", NULL};
    static const char *const granite[] = {"<|tool_call|>", NULL};
    static const char *const ds[] = {DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN,
                                     DS_CALL_END,    DS_SEP,       NULL};
    static const char *const llama4[] = {"<|python_start|>", "<|python_end|>", NULL};
    static const char *const harmony[] = {
        "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|end|>", NULL};
    static const char *const none[] = {NULL};
    switch (f) {
    case LOOM_TOOLFMT_HERMES:
    case LOOM_TOOLFMT_QWEN3_CODER:
        return hermes;
    case LOOM_TOOLFMT_LLAMA3_JSON:
        return llama3;
    case LOOM_TOOLFMT_MISTRAL:
        return mistral;
    case LOOM_TOOLFMT_GRANITE:
        return granite;
    case LOOM_TOOLFMT_DEEPSEEK_V3:
    case LOOM_TOOLFMT_DEEPSEEK_V31:
        return ds;
    case LOOM_TOOLFMT_LLAMA4_PYTHONIC:
        return llama4;
    case LOOM_TOOLFMT_OPENAI:
        return harmony;
    default:
        return none;
    }
}

/* The forced output's grammar spec (grammar.h, LOOM_GRAMMAR_TOOL_CALLS):
 * one call (of the named function, or of any tool) or, for "required" with
 * parallel_tool_calls, one or more, in the model's syntax; markers that are
 * one token (t->mark_ids) named in special_tokens. */
static char *forced_schema(const loom_tools_t *t) {
    cJSON *s = cJSON_CreateObject(), *items = cJSON_AddArrayToObject(s, "items");
    const char *args = t->fmt == LOOM_TOOLFMT_LLAMA3_JSON ? "parameters" : "arguments";
    int ds = t->fmt == LOOM_TOOLFMT_DEEPSEEK_V3 || t->fmt == LOOM_TOOLFMT_DEEPSEEK_V31;
    int hm = t->fmt == LOOM_TOOLFMT_OPENAI;
    int py = t->fmt == LOOM_TOOLFMT_PYTHONIC || t->fmt == LOOM_TOOLFMT_LLAMA4_PYTHONIC;
    int coder = t->fmt == LOOM_TOOLFMT_QWEN3_CODER;
    cJSON *prefixes = ds || hm ? cJSON_AddArrayToObject(s, "prefixes") : NULL;
    const cJSON *tool;
    cJSON_ArrayForEach(tool, t->tools) {
        if (t->mode == LOOM_TOOLS_NAMED && strcmp(get(fn_of(tool), "name")->valuestring, t->named) != 0) continue;
        if (py || coder) { /* the syntax's own form of NAME and the parameters */
            cJSON *it = cJSON_CreateObject();
            cJSON_AddStringToObject(it, "name", get(fn_of(tool), "name")->valuestring);
            cJSON_AddItemToObject(it, "parameters", params_or_empty(fn_of(tool)));
            cJSON_AddItemToArray(items, it);
            continue;
        }
        if (!ds && !hm) {
            cJSON_AddItemToArray(items, call_schema(tool, args));
            continue;
        }
        /* DeepSeek: the name is markup before the arguments object */
        const char *nm = get(fn_of(tool), "name")->valuestring;
        char pre[256];
        /* GPT-OSS: a commentary message to the function; <|call|> ends it (a stop token) */
        snprintf(pre, sizeof pre,
                 hm ? "<|channel|>commentary to=functions.%s <|constrain|>json<|message|>"
                 : t->fmt == LOOM_TOOLFMT_DEEPSEEK_V3 ? DS_CALL_BEGIN "function" DS_SEP "%s\n```json\n" : DS_CALL_BEGIN "%s" DS_SEP,
                 nm);
        cJSON_AddItemToArray(prefixes, cJSON_CreateString(pre));
        cJSON_AddItemToArray(items, params_or_empty(fn_of(tool)));
    }
    cJSON_AddNumberToObject(s, "min", 1);
    /* (GPT-OSS: one call per message, the message ends the turn) */
    cJSON_AddNumberToObject(s, "max", t->parallel && t->mode == LOOM_TOOLS_REQUIRED && !hm ? 0 : 1);
    if (t->n_marks) {
        cJSON *sp = cJSON_AddObjectToObject(s, "special_tokens");
        for (int i = 0; i < t->n_marks; i++)
            cJSON_AddNumberToObject(sp, t->mark_text[i], t->mark_ids[i]);
    }
    switch (t->fmt) {
    case LOOM_TOOLFMT_OPENAI: /* the prefix is all the markup */
        break;
    case LOOM_TOOLFMT_PYTHONIC:
    case LOOM_TOOLFMT_LLAMA4_PYTHONIC: /* [NAME(KEY=VALUE, ...), ...] */
        cJSON_AddStringToObject(s, "syntax", "pythonic");
        cJSON_AddStringToObject(s, "begin", "[");
        cJSON_AddStringToObject(s, "sep", ", ");
        cJSON_AddStringToObject(s, "end", "]");
        break;
    case LOOM_TOOLFMT_QWEN3_CODER: /* <tool_call> blocks one after another */
        cJSON_AddStringToObject(s, "syntax", "qwen3_coder");
        cJSON_AddStringToObject(s, "sep", "\n");
        break;
    case LOOM_TOOLFMT_LLAMA3_JSON:
        cJSON_AddStringToObject(s, "sep", "; ");
        break;
    case LOOM_TOOLFMT_DEEPSEEK_V3:
    case LOOM_TOOLFMT_DEEPSEEK_V31:
        cJSON_AddStringToObject(s, "begin", DS_CALLS_BEGIN);
        cJSON_AddStringToObject(s, "end", DS_CALLS_END);
        cJSON_AddStringToObject(s, "item_end", t->fmt == LOOM_TOOLFMT_DEEPSEEK_V3 ? "\n```" DS_CALL_END : DS_CALL_END);
        break;
    case LOOM_TOOLFMT_MISTRAL:
    case LOOM_TOOLFMT_GRANITE:
        cJSON_AddStringToObject(s, "begin", t->fmt == LOOM_TOOLFMT_MISTRAL ? "[TOOL_CALLS][" : "<|tool_call|>[");
        cJSON_AddStringToObject(s, "sep", ", ");
        cJSON_AddStringToObject(s, "end", "]");
        break;
    default: /* hermes */
        cJSON_AddStringToObject(s, "item_begin", "<tool_call>\n");
        cJSON_AddStringToObject(s, "item_end", "\n</tool_call>");
        cJSON_AddStringToObject(s, "sep", "\n");
        break;
    }
    char *out = cJSON_PrintUnformatted(s);
    cJSON_Delete(s);
    return out;
}

int loom_tools_parse(const cJSON *req, loom_toolfmt_t fmt, loom_tools_t *t, const char **param, char *msg,
                     size_t cap) {
    *t = (loom_tools_t){.parallel = 1, .fmt = fmt ? fmt : LOOM_TOOLFMT_HERMES};
    const cJSON *tools = get(req, "tools"), *choice = get(req, "tool_choice"), *par = get(req, "parallel_tool_calls");
    *param = "parallel_tool_calls";
    if (par && !cJSON_IsNull(par) && !cJSON_IsBool(par)) return fail(msg, cap, "parallel_tool_calls must be a boolean");
    t->parallel = !cJSON_IsFalse(par);
    *param = "tools";
    int n = 0;
    if (tools && !cJSON_IsNull(tools)) {
        if (!cJSON_IsArray(tools)) return fail(msg, cap, "tools must be an array of {type: function, function}");
        const cJSON *tool;
        cJSON_ArrayForEach(tool, tools) {
            const cJSON *type = get(tool, "type"), *fn = fn_of(tool);
            const cJSON *name = cJSON_IsObject(fn) ? get(fn, "name") : NULL;
            if (!cJSON_IsObject(tool) || !cJSON_IsString(type) || strcmp(type->valuestring, "function") != 0)
                return fail(msg, cap, "tools[%d] must be {\"type\": \"function\", \"function\": {...}}", n);
            if (!cJSON_IsString(name) || !name->valuestring[0] || strlen(name->valuestring) > 64)
                return fail(msg, cap, "tools[%d].function.name must be a string of 1 to 64 characters", n);
            const cJSON *p = get(fn, "parameters");
            if (p && !cJSON_IsNull(p) && !cJSON_IsObject(p))
                return fail(msg, cap, "tools[%d].function.parameters must be a JSON Schema object", n);
            if (++n > MAX_TOOLS) return fail(msg, cap, "at most %d tools", MAX_TOOLS);
        }
    }
    *param = "tool_choice";
    t->mode = n ? LOOM_TOOLS_AUTO : LOOM_TOOLS_OFF;
    if (choice && !cJSON_IsNull(choice)) {
        if (cJSON_IsString(choice)) {
            const char *c = choice->valuestring;
            if (!strcmp(c, "none")) t->mode = LOOM_TOOLS_OFF;
            else if (!strcmp(c, "auto")) t->mode = n ? LOOM_TOOLS_AUTO : LOOM_TOOLS_OFF;
            else if (!strcmp(c, "required")) t->mode = LOOM_TOOLS_REQUIRED;
            else return fail(msg, cap, "tool_choice '%.64s' is not none, auto, required or a function", c);
        } else if (cJSON_IsObject(choice)) {
            const cJSON *fn = get(choice, "function"), *name = cJSON_IsObject(fn) ? get(fn, "name") : NULL;
            if (!cJSON_IsString(name))
                return fail(msg, cap, "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
            t->mode = LOOM_TOOLS_NAMED;
            t->named = name->valuestring;
        } else {
            return fail(msg, cap, "tool_choice must be a string or an object");
        }
        if ((t->mode == LOOM_TOOLS_REQUIRED || t->mode == LOOM_TOOLS_NAMED) && n == 0)
            return fail(msg, cap, "tool_choice %s needs tools", t->mode == LOOM_TOOLS_NAMED ? "a function" : "required");
        if (t->mode == LOOM_TOOLS_NAMED) {
            int found = 0;
            const cJSON *tool;
            cJSON_ArrayForEach(tool, tools) found |= !strcmp(get(fn_of(tool), "name")->valuestring, t->named);
            if (!found) return fail(msg, cap, "tool_choice names '%.64s', which is not in tools", t->named);
        }
    }
    t->tools = tools;
    if (t->mode == LOOM_TOOLS_OFF) return 0;
    if (t->mode == LOOM_TOOLS_REQUIRED || t->mode == LOOM_TOOLS_NAMED) {
        t->schema = forced_schema(t);
        if (!t->schema) return fail(msg, cap, "tools cannot be serialised");
    }
    return 0;
}

/* The id of the one token whose text is marker exactly (-1: none). */
static int32_t marker_token(const loom_tokenizer_t *tok, const char *marker) {
    int32_t id = loom_tokenizer_token_id(tok, marker);
    if (id < 0 || loom_tokenizer_is_special(tok, id)) return id;
    size_t n = 0;
    const char *b = loom_tokenizer_token_bytes(tok, id, &n);
    return b && n == strlen(marker) && !memcmp(b, marker, n) ? id : -1;
}

void loom_tools_set_tokenizer(loom_tools_t *t, const loom_tokenizer_t *tok) {
    t->n_marks = t->n_keep = 0;
    if (!tok || t->mode == LOOM_TOOLS_OFF) return;
    for (const char *const *m = markers_of(t->fmt); *m && t->n_marks < LOOM_TOOLS_MAX_KEEP; m++) {
        int32_t id = marker_token(tok, *m);
        if (id < 0) continue;
        t->mark_ids[t->n_marks] = id;
        t->mark_text[t->n_marks++] = *m;
        if (loom_tokenizer_is_special(tok, id)) t->keep_ids[t->n_keep++] = id;
    }
    if (t->schema && t->n_marks) { /* the forced call takes the tokens themselves */
        free(t->schema);
        t->schema = forced_schema(t);
    }
}

void loom_tools_free(loom_tools_t *t) {
    free(t->schema);
    *t = (loom_tools_t){0};
}

void loom_tools_call_id(unsigned long long id_seed, int index, char *buf, size_t cap) {
    snprintf(buf, cap, "call_%016llx%02d", id_seed, index);
}

/* The unstreamed parse: the streaming reader (tool_stream.h) fed the whole
 * answer, its events collected. */
typedef struct {
    loom_sbuf_t content;
    char **names;
    loom_sbuf_t *args;
    int n;
} collected_t;

static void collect(void *ctx, const loom_tse_t *e) {
    collected_t *c = ctx;
    if (e->kind == LOOM_TSE_CONTENT) {
        loom_sbuf_add(&c->content, e->text, e->len);
    } else if (e->kind == LOOM_TSE_CALL) {
        LOOM_ASSERT(e->index == c->n);
        c->names = loom_xrealloc(c->names, (size_t)(c->n + 1) * sizeof *c->names);
        c->args = loom_xrealloc(c->args, (size_t)(c->n + 1) * sizeof *c->args);
        c->names[c->n] = loom_xstrdup(e->name);
        c->args[c->n] = (loom_sbuf_t){0};
        loom_sbuf_add(&c->args[c->n], "", 0);
        c->n++;
    } else {
        LOOM_ASSERT(e->index == c->n - 1);
        loom_sbuf_add(&c->args[e->index], e->text, e->len);
    }
}

cJSON *loom_tools_parse_output(const loom_tools_t *t, const char *text, size_t len,
                               unsigned long long id_seed, char **rest) {
    *rest = NULL;
    if (t->mode == LOOM_TOOLS_OFF) return NULL;
    collected_t c = {0};
    loom_tstream_t *s = loom_tstream_create(t, collect, &c);
    loom_tstream_feed(s, text, len);
    int n = loom_tstream_finish(s, 1);
    loom_tstream_destroy(&s);
    cJSON *calls = NULL;
    if (n > 0) {
        LOOM_ASSERT(n == c.n);
        calls = cJSON_CreateArray();
        for (int i = 0; i < c.n; i++) {
            cJSON *o = cJSON_CreateObject();
            char id[48];
            loom_tools_call_id(id_seed, i, id, sizeof id);
            cJSON_AddStringToObject(o, "id", id);
            cJSON_AddStringToObject(o, "type", "function");
            cJSON *fn = cJSON_AddObjectToObject(o, "function");
            cJSON_AddStringToObject(fn, "name", c.names[i]);
            cJSON_AddStringToObject(fn, "arguments", c.args[i].p);
            cJSON_AddItemToArray(calls, o);
        }
        if (c.content.len) *rest = loom_xstrdup(c.content.p);
    }
    for (int i = 0; i < c.n; i++) {
        free(c.names[i]);
        free(c.args[i].p);
    }
    free(c.names);
    free(c.args);
    free(c.content.p);
    return calls;
}
