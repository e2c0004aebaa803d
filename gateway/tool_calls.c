/* Tool calling for /v1/chat/completions (see tool_calls.h). */
#include "gateway/tool_calls.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "gateway/tool_stream.h"

#define MAX_TOOLS 128

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

/* One function as the prompt lists it: {"type": "function", "function": {...}}. */
static char *tools_json_lines(const cJSON *tools, const char *sep) {
    loom_sbuf_t b = {0};
    loom_sbuf_add(&b, "", 0);
    const cJSON *t;
    int i = 0;
    cJSON_ArrayForEach(t, tools) {
        char *s = cJSON_PrintUnformatted(t);
        if (i++) loom_sbuf_str(&b, sep);
        loom_sbuf_str(&b, s ? s : "{}");
        free(s);
    }
    return b.p;
}

static char *render_tools(const cJSON *tools, loom_chat_family_t family) {
    loom_sbuf_t b = {0};
    loom_sbuf_add(&b, "", 0);
    char *lines;
    switch (family) {
    case LOOM_CHAT_LLAMA3:
        lines = tools_json_lines(tools, "\n\n");
        loom_sbuf_str(&b, "Given the following functions, please respond with a JSON for a function call with its "
                          "proper arguments that best answers the given prompt.\n\nRespond in the format "
                          "{\"name\": function name, \"parameters\": dictionary of argument name and its value}. "
                          "Do not use variables.\n\n");
        loom_sbuf_str(&b, lines);
        loom_sbuf_str(&b, "\n\n");
        break;
    case LOOM_CHAT_MISTRAL:
        lines = tools_json_lines(tools, ", ");
        loom_sbuf_printf(&b, "[AVAILABLE_TOOLS] [%s][/AVAILABLE_TOOLS]", lines);
        break;
    default: /* chatml (Hermes, Qwen) and the rest */
        lines = tools_json_lines(tools, "\n");
        loom_sbuf_str(&b, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                          "provided with function signatures within <tools></tools> XML tags:\n<tools>\n");
        loom_sbuf_str(&b, lines);
        loom_sbuf_str(&b, "\n</tools>\n\nFor each function call, return a json object with function name and "
                          "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                          "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
        break;
    }
    free(lines);
    return b.p;
}

static char *forced_schema(const loom_tools_t *t) {
    cJSON *s;
    if (t->mode == LOOM_TOOLS_NAMED) {
        const cJSON *tool;
        s = NULL;
        cJSON_ArrayForEach(tool, t->tools) {
            const cJSON *name = get(fn_of(tool), "name");
            if (!strcmp(name->valuestring, t->named)) s = params_or_empty(fn_of(tool));
        }
    } else {
        s = cJSON_CreateObject();
        cJSON_AddStringToObject(s, "type", "array");
        cJSON_AddNumberToObject(s, "minItems", 1);
        if (!t->parallel) cJSON_AddNumberToObject(s, "maxItems", 1);
        cJSON *items = cJSON_AddObjectToObject(s, "items"), *any = cJSON_AddArrayToObject(items, "anyOf");
        const cJSON *tool;
        cJSON_ArrayForEach(tool, t->tools) {
            cJSON *o = cJSON_CreateObject(), *props;
            cJSON_AddStringToObject(o, "type", "object");
            props = cJSON_AddObjectToObject(o, "properties");
            cJSON *nm = cJSON_AddObjectToObject(props, "name");
            cJSON_AddStringToObject(nm, "const", get(fn_of(tool), "name")->valuestring);
            cJSON_AddItemToObject(props, "arguments", params_or_empty(fn_of(tool)));
            cJSON *req = cJSON_AddArrayToObject(o, "required");
            cJSON_AddItemToArray(req, cJSON_CreateString("name"));
            cJSON_AddItemToArray(req, cJSON_CreateString("arguments"));
            cJSON_AddFalseToObject(o, "additionalProperties");
            cJSON_AddItemToArray(any, o);
        }
    }
    char *out = s ? cJSON_PrintUnformatted(s) : NULL;
    cJSON_Delete(s);
    return out;
}

int loom_tools_parse(const cJSON *req, loom_chat_family_t family, loom_tools_t *t, const char **param, char *msg,
                     size_t cap) {
    *t = (loom_tools_t){.parallel = 1};
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
    t->render = render_tools(tools, family);
    if (t->mode == LOOM_TOOLS_REQUIRED || t->mode == LOOM_TOOLS_NAMED) {
        t->schema = forced_schema(t);
        if (!t->schema) return fail(msg, cap, "tools cannot be serialised");
    }
    return 0;
}

void loom_tools_free(loom_tools_t *t) {
    free(t->render);
    free(t->schema);
    *t = (loom_tools_t){0};
}

char *loom_tools_render_calls(loom_chat_family_t family, const cJSON *tool_calls, const char *content, char *msg,
                              size_t cap) {
    if (!cJSON_IsArray(tool_calls)) {
        fail(msg, cap, "tool_calls must be an array");
        return NULL;
    }
    loom_sbuf_t b = {0};
    loom_sbuf_add(&b, "", 0);
    if (content && content[0]) loom_sbuf_str(&b, content);
    const cJSON *c;
    int i = 0;
    if (family == LOOM_CHAT_MISTRAL) loom_sbuf_str(&b, "[TOOL_CALLS] [");
    cJSON_ArrayForEach(c, tool_calls) {
        const cJSON *fn = get(c, "function"), *name = cJSON_IsObject(fn) ? get(fn, "name") : NULL;
        const cJSON *args = cJSON_IsObject(fn) ? get(fn, "arguments") : NULL;
        if (!cJSON_IsString(name) || !cJSON_IsString(args)) {
            free(b.p);
            fail(msg, cap, "tool_calls[%d] must have function.name and function.arguments (a JSON string)", i);
            return NULL;
        }
        cJSON *parsed = cJSON_Parse(args->valuestring);
        char *a = parsed ? cJSON_PrintUnformatted(parsed) : NULL;
        cJSON_Delete(parsed);
        cJSON *nm = cJSON_CreateString(name->valuestring);
        char *ns = cJSON_PrintUnformatted(nm);
        cJSON_Delete(nm);
        const char *av = a ? a : "{}";
        switch (family) {
        case LOOM_CHAT_LLAMA3:
            loom_sbuf_printf(&b, "%s{\"name\": %s, \"parameters\": %s}", i ? "; " : "", ns, av);
            break;
        case LOOM_CHAT_MISTRAL:
            loom_sbuf_printf(&b, "%s{\"name\": %s, \"arguments\": %s}", i ? ", " : "", ns, av);
            break;
        default:
            loom_sbuf_printf(&b, "%s<tool_call>\n{\"name\": %s, \"arguments\": %s}\n</tool_call>",
                             (i || b.len) ? "\n" : "", ns, av);
        }
        free(ns);
        free(a);
        i++;
    }
    if (family == LOOM_CHAT_MISTRAL) loom_sbuf_str(&b, "]");
    return b.p;
}

char *loom_tools_render_result(loom_chat_family_t family, const char *content) {
    loom_sbuf_t b = {0};
    loom_sbuf_add(&b, "", 0);
    if (family == LOOM_CHAT_MISTRAL) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "content", content);
        char *s = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        loom_sbuf_printf(&b, "[TOOL_RESULTS] %s[/TOOL_RESULTS]", s ? s : "{}");
        free(s);
    } else if (family == LOOM_CHAT_LLAMA3) {
        loom_sbuf_str(&b, content);
    } else {
        loom_sbuf_printf(&b, "<tool_response>\n%s\n</tool_response>", content);
    }
    return b.p;
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

cJSON *loom_tools_parse_output(const loom_tools_t *t, loom_chat_family_t family, const char *text, size_t len,
                               unsigned long long id_seed, char **rest) {
    *rest = NULL;
    if (t->mode == LOOM_TOOLS_OFF) return NULL;
    collected_t c = {0};
    loom_tstream_t *s = loom_tstream_create(t, family, collect, &c);
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
