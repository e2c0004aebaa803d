/* Tool calling for /v1/chat/completions (see tool_calls.h). */
#include "coordinator/tool_calls.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

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

/* {"name": N, "arguments"|"parameters": {...}} -> an OpenAI tool call. */
static int add_call(cJSON *calls, const cJSON *o, const loom_tools_t *t, unsigned long long seed) {
    const cJSON *name = cJSON_IsObject(o) ? get(o, "name") : NULL;
    const cJSON *args = cJSON_IsObject(o) ? get(o, "arguments") : NULL;
    if (!args && cJSON_IsObject(o)) args = get(o, "parameters");
    if (!cJSON_IsString(name) || !cJSON_IsObject(args)) return -1;
    int known = 0;
    const cJSON *tool;
    cJSON_ArrayForEach(tool, t->tools) known |= !strcmp(get(fn_of(tool), "name")->valuestring, name->valuestring);
    if (!known) return -1;
    cJSON *c = cJSON_CreateObject();
    char id[48];
    snprintf(id, sizeof id, "call_%016llx%02d", seed, cJSON_GetArraySize(calls));
    cJSON_AddStringToObject(c, "id", id);
    cJSON_AddStringToObject(c, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(c, "function");
    cJSON_AddStringToObject(fn, "name", name->valuestring);
    char *a = cJSON_PrintUnformatted(args);
    cJSON_AddStringToObject(fn, "arguments", a ? a : "{}");
    free(a);
    cJSON_AddItemToArray(calls, c);
    return 0;
}

static int add_array(cJSON *calls, const cJSON *arr, const loom_tools_t *t, unsigned long long seed) {
    const cJSON *o;
    if (!cJSON_IsArray(arr) || !arr->child) return -1;
    cJSON_ArrayForEach(o, arr) if (add_call(calls, o, t, seed) < 0) return -1;
    return 0;
}

static const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r')) p++;
    return p;
}

cJSON *loom_tools_parse_output(const loom_tools_t *t, loom_chat_family_t family, const char *text, size_t len,
                               unsigned long long id_seed, char **rest) {
    *rest = NULL;
    if (t->mode == LOOM_TOOLS_OFF) return NULL;
    char *s = loom_xmalloc(len + 1);
    memcpy(s, text, len);
    s[len] = '\0';
    const char *end = s + len;
    cJSON *calls = cJSON_CreateArray();
    int ok = -1;
    if (t->mode == LOOM_TOOLS_NAMED) { /* the arguments object itself */
        cJSON *args = cJSON_Parse(s);
        if (cJSON_IsObject(args)) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "name", t->named);
            cJSON_AddItemToObject(o, "arguments", args);
            ok = add_call(calls, o, t, id_seed);
            cJSON_Delete(o);
        } else {
            cJSON_Delete(args);
        }
    } else if (t->mode == LOOM_TOOLS_REQUIRED) {
        cJSON *arr = cJSON_Parse(s);
        ok = add_array(calls, arr, t, id_seed);
        cJSON_Delete(arr);
    } else if (family == LOOM_CHAT_LLAMA3 || family == LOOM_CHAT_MISTRAL) {
        const char *p = skip_ws(s, end);
        static const char *const tags[] = {"<|python_tag|>", "[TOOL_CALLS]"};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(tags); i++)
            if (!strncmp(p, tags[i], strlen(tags[i]))) p = skip_ws(p + strlen(tags[i]), end);
        if (*p == '[' || *p == '{') {
            cJSON *v = cJSON_Parse(p);
            if (cJSON_IsArray(v)) ok = add_array(calls, v, t, id_seed);
            else if (cJSON_IsObject(v)) ok = add_call(calls, v, t, id_seed);
            cJSON_Delete(v);
            if (!v && family == LOOM_CHAT_LLAMA3) { /* several objects separated by ';' */
                char *dup = loom_xstrdup(p), *save = NULL;
                ok = 0;
                for (char *part = strtok_r(dup, ";", &save); part && ok == 0; part = strtok_r(NULL, ";", &save)) {
                    cJSON *o = cJSON_Parse(part);
                    ok = add_call(calls, o, t, id_seed);
                    cJSON_Delete(o);
                }
                free(dup);
            }
        }
        if (ok == 0 && !t->parallel && cJSON_GetArraySize(calls) > 1) ok = -1;
    } else { /* <tool_call> blocks; the text around them stays content */
        loom_sbuf_t keep = {0};
        loom_sbuf_add(&keep, "", 0);
        const char *p = s;
        ok = 0;
        int found = 0;
        for (;;) {
            const char *a = strstr(p, "<tool_call>");
            if (!a) break;
            const char *b = strstr(a, "</tool_call>");
            if (!b) break;
            loom_sbuf_add(&keep, p, (size_t)(a - p));
            size_t n = (size_t)(b - a) - strlen("<tool_call>");
            char *body = loom_xmalloc(n + 1);
            memcpy(body, a + strlen("<tool_call>"), n);
            body[n] = '\0';
            cJSON *o = cJSON_Parse(body);
            free(body);
            if (add_call(calls, o, t, id_seed) < 0) ok = -1;
            cJSON_Delete(o);
            found = 1;
            p = b + strlen("</tool_call>");
        }
        loom_sbuf_str(&keep, p);
        if (!found || (!t->parallel && cJSON_GetArraySize(calls) > 1)) ok = -1;
        const char *k = skip_ws(keep.p, keep.p + keep.len);
        if (ok == 0 && *k) *rest = loom_xstrdup(k);
        free(keep.p);
    }
    free(s);
    if (ok < 0 || cJSON_GetArraySize(calls) == 0) {
        cJSON_Delete(calls);
        free(*rest);
        *rest = NULL;
        return NULL;
    }
    return calls;
}
