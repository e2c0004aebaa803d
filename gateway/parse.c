/* The gateway's request parsing (gateway_impl.h): the strict JSON body
 * reader, OpenAI request fields and sampling parameters, prompts, and chat
 * messages rendered through the chat template and tokenized. Moved from
 * the one-file gateway; no sockets here (see http_parse.h). */
#include "gateway/gateway_impl.h"


static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned min;
        if ((c & 0xE0) == 0xC0) {
            len = 2, min = 0x80, c &= 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3, min = 0x800, c &= 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4, min = 0x10000, c &= 0x07;
        } else {
            return 0;
        }
        if (i + len > n) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            c = (c << 6) | (s[i + k] & 0x3Fu);
        }
        if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 0;
        i += len;
    }
    return 1;
}

/* "\u0000" in a JSON text (cJSON would silently cut the string there). */
static int has_escaped_nul(const char *s, size_t n) {
    for (size_t i = 0; i + 1 < n; i++) {
        if (s[i] != '\\') continue;
        if (s[i + 1] == 'u' && i + 5 < n && !memcmp(s + i + 2, "0000", 4)) return 1;
        i++;
    }
    return 0;
}

/* The JSON object of a request body, strictly: UTF-8 without NUL bytes or
 * \u0000, one value with only whitespace after it, no key twice in one
 * object (at any depth). NULL with a message for the client otherwise. */
cJSON *loom_http_parse_json_body(const char *body, size_t len, char *msg, size_t cap) {
    if (!body || len == 0) {
        snprintf(msg, cap, "the request body is empty: send a JSON object");
        return NULL;
    }
    if (memchr(body, 0, len)) {
        snprintf(msg, cap, "the request body contains a NUL byte");
        return NULL;
    }
    if (!valid_utf8((const unsigned char *)body, len)) {
        snprintf(msg, cap, "the request body is not valid UTF-8");
        return NULL;
    }
    if (has_escaped_nul(body, len)) {
        snprintf(msg, cap, "strings in the request must not contain NUL characters (\\u0000)");
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    size_t at = end && end >= body ? (size_t)(end - body) : 0;
    if (!root) {
        snprintf(msg, cap, "We could not parse the JSON body of your request (error near byte %zu)", at);
        return NULL;
    }
    while (at < len && (body[at] == ' ' || body[at] == '\t' || body[at] == '\n' || body[at] == '\r')) at++;
    char path[256];
    if (at < len) {
        snprintf(msg, cap, "the request body goes on after its JSON value (at byte %zu of %zu): send exactly one "
                           "JSON object", at, len);
    } else if (!cJSON_IsObject(root)) {
        snprintf(msg, cap, "the request body must be a JSON object");
    } else if (loom_json_find_duplicate(root, path, sizeof path)) {
        snprintf(msg, cap, "the request body has the key %.200s more than once: each key may appear once per object",
                 path);
    } else {
        return root;
    }
    cJSON_Delete(root);
    return NULL;
}


/* ---- request parameters ---- */


int bad(perr_t *e, const char *param, const char *fmt, ...) {
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return -1;
}

const cJSON *field(const cJSON *o, const char *k) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    return x && !cJSON_IsNull(x) ? x : NULL;
}

/* Optional fields: 0 absent or null, 1 present (*v set), -1 bad (e set). */
static int opt_number(const cJSON *o, const char *k, double lo, double hi, double *v, perr_t *e) {
    const cJSON *x = field(o, k);
    if (!x) return 0;
    if (!cJSON_IsNumber(x)) return bad(e, k, "%s must be a number", k);
    if (!(x->valuedouble >= lo && x->valuedouble <= hi))
        return bad(e, k, "%s %g is outside [%g, %g]", k, x->valuedouble, lo, hi);
    *v = x->valuedouble;
    return 1;
}

int opt_int(const cJSON *o, const char *k, double lo, double hi, double *v, perr_t *e) {
    const cJSON *x = field(o, k);
    if (!x) return 0;
    if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble)) return bad(e, k, "%s must be an integer", k);
    if (!(x->valuedouble >= lo && x->valuedouble <= hi))
        return bad(e, k, "%s %.17g is outside [%.17g, %.17g]", k, x->valuedouble, lo, hi);
    *v = x->valuedouble;
    return 1;
}

int opt_bool(const cJSON *o, const char *k, int *v, perr_t *e) {
    const cJSON *x = field(o, k);
    if (!x) return 0;
    if (!cJSON_IsBool(x)) return bad(e, k, "%s must be true or false", k);
    *v = cJSON_IsTrue(x);
    return 1;
}

/* Which fields a request may carry. Loom answers every field it accepts:
 * one it does not implement (an OpenAI feature, or one of vLLM's
 * extensions) is refused with 400 naming it unless it holds the value
 * that turns the feature off, so a client never gets an answer computed
 * without what it asked for. A field no one here defines is ignored
 * (ignore_field): a new SDK's field must not break requests. */
typedef enum {
    F_ALL = 0,  /* implemented by every generation route */
    F_PROMPT,   /* implemented by /v1/completions */
    F_CHAT,     /* implemented by /v1/chat/completions */
    F_FALSY,    /* not implemented: null, false, 0, "", [] or {} only */
    F_ONE,      /* not implemented: null or 1 only (a neutral factor) */
    F_TRUE,     /* not implemented: null or true only (the default behaviour) */
    F_NONE_AUTO /* not implemented: null, "none" or "auto" only (no tools given) */
} field_kind_t;

static const struct {
    const char *name;
    field_kind_t kind;
} k_fields[] = {
    /* implemented */
    {"model", F_ALL}, {"max_tokens", F_ALL}, {"temperature", F_ALL}, {"top_p", F_ALL}, {"top_k", F_ALL},
    {"seed", F_ALL}, {"stop", F_ALL}, {"stream", F_ALL}, {"stream_options", F_ALL}, {"ignore_eos", F_ALL},
    {"speculative", F_ALL}, {"loom_cache", F_ALL},
    {"priority", F_ALL}, {"n", F_ALL}, {"best_of", F_ALL}, {"response_format", F_ALL}, {"stop_token_ids", F_ALL},
    {"skip_special_tokens", F_ALL}, {"user", F_ALL}, {"metadata", F_ALL}, {"kv_transfer_params", F_ALL},
    {"presence_penalty", F_ALL}, {"frequency_penalty", F_ALL}, {"repetition_penalty", F_ALL}, {"min_p", F_ALL},
    {"logit_bias", F_ALL}, {"allowed_token_ids", F_ALL}, {"bad_words", F_ALL}, {"min_tokens", F_ALL},
    {"include_stop_str_in_output", F_ALL}, {"logprobs", F_ALL}, {"top_logprobs", F_CHAT}, {"echo", F_ALL},
    {"prompt_logprobs", F_ALL},
    {"prompt", F_PROMPT}, {"add_special_tokens", F_PROMPT},
    {"guided_json", F_ALL}, {"guided_regex", F_ALL}, {"guided_choice", F_ALL}, {"guided_grammar", F_ALL},
    {"guided_decoding_backend", F_ALL}, {"structured_outputs", F_ALL},
    {"messages", F_CHAT}, {"max_completion_tokens", F_CHAT}, {"add_generation_prompt", F_CHAT},
    {"tools", F_CHAT}, {"tool_choice", F_CHAT}, {"parallel_tool_calls", F_CHAT},
    {"chat_template", F_CHAT}, {"chat_template_kwargs", F_CHAT}, {"continue_final_message", F_CHAT},
    {"documents", F_CHAT}, {"reasoning_effort", F_CHAT},
    /* OpenAI features Loom does not implement */
    {"suffix", F_FALSY}, {"functions", F_FALSY},
    {"function_call", F_NONE_AUTO}, {"store", F_FALSY}, {"audio", F_FALSY}, {"prediction", F_FALSY},
    {"web_search_options", F_FALSY}, {"modalities", F_FALSY},
    {"service_tier", F_NONE_AUTO},
    /* vLLM's extensions Loom does not implement */
    {"guided_whitespace_pattern", F_FALSY}, {"structural_tag", F_FALSY}, {"length_penalty", F_ONE}, {"use_beam_search", F_FALSY}, {"early_stopping", F_FALSY},
    {"stop_token_ids_str", F_FALSY},
    {"spaces_between_special_tokens", F_TRUE}, {"truncate_prompt_tokens", F_FALSY},
    {"logits_processors", F_FALSY},
    {"return_tokens_as_token_ids", F_FALSY}, {"return_token_ids", F_FALSY}, {"prompt_embeds", F_FALSY},
    {"request_id", F_FALSY}, {"cache_salt", F_FALSY}, {"vllm_xargs", F_FALSY},
    {"mm_processor_kwargs", F_FALSY}, {"thinking_token_budget", F_FALSY},
};

static int field_is_off(const cJSON *x, field_kind_t kind) {
    if (cJSON_IsNull(x)) return 1;
    switch (kind) {
    case F_FALSY:
        return cJSON_IsFalse(x) || (cJSON_IsNumber(x) && x->valuedouble == 0) ||
               (cJSON_IsString(x) && !x->valuestring[0]) || (cJSON_IsArray(x) && !x->child) ||
               (cJSON_IsObject(x) && !x->child);
    case F_ONE: return cJSON_IsNumber(x) && x->valuedouble == 1;
    case F_TRUE: return cJSON_IsTrue(x);
    case F_NONE_AUTO:
        return cJSON_IsString(x) && (!strcmp(x->valuestring, "none") || !strcmp(x->valuestring, "auto") ||
                                     !strcmp(x->valuestring, "default"));
    default: return 1;
    }
}

/* A field no table here names (a newer SDK's, another server's) is accepted
 * and ignored: logged, and named in the X-Loom-Ignored-Fields response
 * header (printable ASCII names only; others are listed as "?"). */
void ignore_field(req_t *q, const char *name) {
    char clean[65];
    size_t n = 0;
    for (const char *c = name; *c && n < 64; c++) clean[n++] = *c > 32 && *c < 127 && *c != ',' ? *c : '?';
    clean[n] = '\0';
    LOOM_WARN("request %s: ignoring the unknown field '%s'", q->xid, clean);
    size_t used = strlen(q->ignored);
    if (used + n + 3 < sizeof q->ignored)
        snprintf(q->ignored + used, sizeof q->ignored - used, "%s%s", used ? ", " : "", clean);
}

/* Every top-level field of a generation request is one this route
 * implements, one that is off (see k_fields), or one no one here knows
 * (ignored, see ignore_field). */
static int check_fields(req_t *q, const cJSON *o, int chat, perr_t *e) {
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        size_t i = 0;
        while (i < LOOM_ARRAY_LEN(k_fields) && strcmp(k_fields[i].name, x->string) != 0) i++;
        if (i == LOOM_ARRAY_LEN(k_fields)) {
            ignore_field(q, x->string);
            continue;
        }
        field_kind_t k = k_fields[i].kind;
        if (k == F_ALL || (k == F_PROMPT && !chat) || (k == F_CHAT && chat)) continue;
        if (k == F_PROMPT || k == F_CHAT)
            return bad(e, x->string, "%s is not a field of %s", x->string,
                       chat ? "/v1/chat/completions" : "/v1/completions");
        if (!field_is_off(x, k)) return bad(e, x->string, "%s is not supported by this server", x->string);
    }
    return 0;
}


void gen_free(gen_t *g) {
    for (int i = 0; i < g->n_batch; i++) free(g->batch_ids[i]);
    free(g->batch_ids);
    free(g->batch_text);
    free(g->batch_n_ids);
    free(g->allowed);
    free(g->guide_spec);
    free(g->kv_params);
    loom_tools_free(&g->tools);
    free(g->prompt);
    free(g->ids);
}

int is_token_id(const cJSON *t) {
    return cJSON_IsNumber(t) && t->valuedouble == floor(t->valuedouble) && t->valuedouble >= 0 &&
           t->valuedouble <= 2147483647.0;
}

/* Sampling controls: OpenAI's penalties and logit_bias, vLLM's
 * repetition_penalty, min_p, allowed_token_ids, bad_words, min_tokens and
 * include_stop_str_in_output. The coordinator checks ids against the
 * vocabulary and min_tokens against max_tokens. */
static int parse_controls(const cJSON *o, int chat, gen_t *g, perr_t *e) {
    double v;
    int r, b = 0;
    if ((r = opt_number(o, "presence_penalty", -2, 2, &v, e)) < 0) return -1;
    if (r) g->p.presence_penalty = (float)v;
    if ((r = opt_number(o, "frequency_penalty", -2, 2, &v, e)) < 0) return -1;
    if (r) g->p.frequency_penalty = (float)v;
    if ((r = opt_number(o, "repetition_penalty", 0, 10, &v, e)) < 0) return -1;
    if (r && v <= 0) return bad(e, "repetition_penalty", "repetition_penalty must be greater than 0 (got %g)", v);
    if (r) g->p.repetition_penalty = (float)v;
    if ((r = opt_number(o, "min_p", 0, 1, &v, e)) < 0) return -1;
    if (r) g->p.min_p = (float)v;
    if ((r = opt_int(o, "min_tokens", 0, 1 << 30, &v, e)) < 0) return -1;
    if (r) g->p.min_tokens = (int)v;
    if ((r = opt_bool(o, "include_stop_str_in_output", &b, e)) < 0) return -1;
    g->p.include_stop_str_in_output = r && b;
    if ((r = opt_bool(o, "echo", &b, e)) < 0) return -1;
    if (r && b && chat) return bad(e, "echo", "echo is not supported on /v1/chat/completions");
    g->echo = r && b;
    if ((r = opt_int(o, "prompt_logprobs", -1e9, 1e9, &v, e)) < 0) return -1;
    if (r && v < 0) return bad(e, "prompt_logprobs", "prompt_logprobs must be a non-negative integer (got %g)", v);
    if (r && v > MAX_TOP_LOGPROBS)
        return bad(e, "prompt_logprobs", "prompt_logprobs %g is over the limit of %d", v, MAX_TOP_LOGPROBS);
    g->prompt_lp = r ? (int)v : -1;
    if (!chat) { /* completions: logprobs N, the sampled token's and the N most likely */
        if ((r = opt_int(o, "logprobs", 0, 1e9, &v, e)) < 0) return -1;
        if (r && v > MAX_TOP_LOGPROBS)
            return bad(e, "logprobs", "logprobs %g is over the limit of %d", v, MAX_TOP_LOGPROBS);
        g->p.logprobs = r;
        g->p.top_logprobs = r ? (int)v : 0;
    } else { /* chat: logprobs true, top_logprobs N */
        if ((r = opt_bool(o, "logprobs", &b, e)) < 0) return -1;
        g->p.logprobs = r && b;
        if ((r = opt_int(o, "top_logprobs", 0, 1e9, &v, e)) < 0) return -1;
        if (r && v > MAX_TOP_LOGPROBS)
            return bad(e, "top_logprobs", "top_logprobs %g is over the limit of %d", v, MAX_TOP_LOGPROBS);
        if (r && v > 0 && !g->p.logprobs)
            return bad(e, "top_logprobs", "top_logprobs needs logprobs set to true");
        g->p.top_logprobs = r ? (int)v : 0;
    }
    const cJSON *x = field(o, "logit_bias"), *t;
    if (x) { /* {"token id": bias}, the keys strings as JSON requires */
        if (!cJSON_IsObject(x)) return bad(e, "logit_bias", "logit_bias must be an object of token id -> bias");
        cJSON_ArrayForEach(t, x) {
            char *end;
            errno = 0;
            long id = strtol(t->string, &end, 10);
            if (!t->string[0] || *end || errno || id < 0 || id > 2147483647L)
                return bad(e, "logit_bias", "logit_bias key '%.64s' is not a token id (a non-negative integer)",
                           t->string);
            if (!cJSON_IsNumber(t) || !(t->valuedouble >= -100 && t->valuedouble <= 100))
                return bad(e, "logit_bias", "logit_bias['%.64s'] must be a number in [-100, 100]", t->string);
            if (g->p.n_logit_bias == MAX_LOGIT_BIAS)
                return bad(e, "logit_bias", "logit_bias has more than %d entries", MAX_LOGIT_BIAS);
            g->bias_ids[g->p.n_logit_bias] = (int32_t)id;
            g->bias_values[g->p.n_logit_bias++] = (float)t->valuedouble;
        }
        g->p.logit_bias_ids = g->bias_ids;
        g->p.logit_bias_values = g->bias_values;
    }
    x = field(o, "allowed_token_ids");
    if (x) {
        int n = cJSON_IsArray(x) ? cJSON_GetArraySize(x) : -1;
        if (n <= 0) return bad(e, "allowed_token_ids", "allowed_token_ids must be a non-empty array of token ids");
        if (n > MAX_ALLOWED_IDS) return bad(e, "allowed_token_ids", "at most %d allowed_token_ids", MAX_ALLOWED_IDS);
        g->allowed = loom_xmalloc((size_t)n * sizeof *g->allowed);
        cJSON_ArrayForEach(t, x) {
            if (!is_token_id(t))
                return bad(e, "allowed_token_ids", "allowed_token_ids[%d] is not a token id (a non-negative integer)",
                           g->p.n_allowed_token_ids);
            g->allowed[g->p.n_allowed_token_ids++] = (int32_t)t->valuedouble;
        }
        g->p.allowed_token_ids = g->allowed;
    }
    x = field(o, "bad_words");
    if (x) {
        if (!cJSON_IsArray(x)) return bad(e, "bad_words", "bad_words must be an array of strings");
        cJSON_ArrayForEach(t, x) {
            if (!cJSON_IsString(t) || !t->valuestring[0])
                return bad(e, "bad_words", "bad_words[%d] must be a non-empty string", g->p.n_bad_words);
            if (g->p.n_bad_words == MAX_BAD_WORDS) return bad(e, "bad_words", "at most %d bad_words", MAX_BAD_WORDS);
            g->bad_words[g->p.n_bad_words++] = t->valuestring;
        }
        g->p.bad_words = g->bad_words;
    }
    return 0;
}

/* ---- Constrained decoding: response_format, vLLM's guided_* and
 * structured_outputs become one (guide_kind, guide_spec) pair; the
 * coordinator compiles it (a bad spec is a 400 with the compiler's message). */
enum { GUIDE_JSON_OBJECT = 1, GUIDE_JSON_SCHEMA = 2, GUIDE_REGEX = 3, GUIDE_CHOICE = 4, GUIDE_GRAMMAR = 5,
       GUIDE_TOOL_CALLS = 6 };

static int set_guide(gen_t *g, int kind, const cJSON *x, const char *param, perr_t *e) {
    if (g->p.guide_kind)
        return bad(e, param, "%s: only one of response_format, guided_json, guided_regex, guided_choice, "
                             "guided_grammar and structured_outputs may constrain the output", param);
    char *spec = NULL;
    switch (kind) {
    case GUIDE_JSON_OBJECT: spec = loom_xstrdup(""); break;
    case GUIDE_JSON_SCHEMA: /* a schema object, or its JSON text */
        if (cJSON_IsString(x)) spec = loom_xstrdup(x->valuestring);
        else if (cJSON_IsObject(x) || cJSON_IsBool(x)) spec = cJSON_PrintUnformatted(x);
        else return bad(e, param, "%s must be a JSON Schema (an object, or its JSON text)", param);
        break;
    case GUIDE_CHOICE: {
        const cJSON *t;
        if (!cJSON_IsArray(x) || !x->child) return bad(e, param, "%s must be a non-empty array of strings", param);
        cJSON_ArrayForEach(t, x) if (!cJSON_IsString(t)) return bad(e, param, "%s must be a non-empty array of strings", param);
        spec = cJSON_PrintUnformatted(x);
        break;
    }
    default: /* regex, grammar */
        if (!cJSON_IsString(x) || !x->valuestring[0]) return bad(e, param, "%s must be a non-empty string", param);
        spec = loom_xstrdup(x->valuestring);
    }
    if (!spec) return bad(e, param, "%s cannot be serialised", param);
    g->guide_spec = spec;
    g->p.guide_kind = kind;
    g->p.guide_spec = spec;
    return 0;
}

static int parse_response_format(const cJSON *x, gen_t *g, perr_t *e) {
    const cJSON *t = cJSON_IsObject(x) ? field(x, "type") : NULL;
    if (!cJSON_IsString(t)) return bad(e, "response_format", "response_format must be an object with a type");
    if (!strcmp(t->valuestring, "text")) return 0;
    if (!strcmp(t->valuestring, "json_object")) return set_guide(g, GUIDE_JSON_OBJECT, NULL, "response_format", e);
    if (strcmp(t->valuestring, "json_schema") != 0)
        return bad(e, "response_format",
                   "response_format type '%.64s' is not supported (text, json_object or json_schema)", t->valuestring);
    const cJSON *js = field(x, "json_schema");
    if (!cJSON_IsObject(js))
        return bad(e, "response_format", "response_format.json_schema must be an object with a schema");
    const cJSON *strict = field(js, "strict"), *name = field(js, "name");
    if (strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict))
        return bad(e, "response_format", "response_format.json_schema.strict must be a boolean");
    if (name && !cJSON_IsString(name))
        return bad(e, "response_format", "response_format.json_schema.name must be a string");
    const cJSON *schema = field(js, "schema");
    if (!schema) return bad(e, "response_format", "response_format.json_schema.schema is required");
    /* strict or not, the output follows the schema exactly */
    return set_guide(g, GUIDE_JSON_SCHEMA, schema, "response_format", e);
}

static int parse_guide(const cJSON *o, gen_t *g, perr_t *e) {
    const cJSON *x = field(o, "response_format");
    if (x && parse_response_format(x, g, e) < 0) return -1;
    static const struct {
        const char *name;
        int kind;
    } guided[] = {{"guided_json", GUIDE_JSON_SCHEMA}, {"guided_regex", GUIDE_REGEX},
                  {"guided_choice", GUIDE_CHOICE}, {"guided_grammar", GUIDE_GRAMMAR}};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(guided); i++) {
        x = field(o, guided[i].name);
        if (x && set_guide(g, guided[i].kind, x, guided[i].name, e) < 0) return -1;
    }
    x = field(o, "guided_decoding_backend"); /* one engine here: any name is accepted */
    if (x && !cJSON_IsString(x)) return bad(e, "guided_decoding_backend", "guided_decoding_backend must be a string");
    x = field(o, "structured_outputs");
    if (x) {
        if (!cJSON_IsObject(x)) return bad(e, "structured_outputs", "structured_outputs must be an object");
        static const struct {
            const char *name;
            int kind;
        } so[] = {{"json", GUIDE_JSON_SCHEMA}, {"regex", GUIDE_REGEX}, {"choice", GUIDE_CHOICE},
                  {"grammar", GUIDE_GRAMMAR}};
        const cJSON *t;
        cJSON_ArrayForEach(t, x) {
            char what[96];
            snprintf(what, sizeof what, "structured_outputs.%.64s", t->string);
            if (cJSON_IsNull(t)) continue;
            size_t i = 0;
            while (i < LOOM_ARRAY_LEN(so) && strcmp(so[i].name, t->string) != 0) i++;
            if (i < LOOM_ARRAY_LEN(so)) {
                if (set_guide(g, so[i].kind, t, what, e) < 0) return -1;
            } else if (!strcmp(t->string, "json_object")) {
                if (!cJSON_IsBool(t)) return bad(e, "structured_outputs", "%s must be a boolean", what);
                if (cJSON_IsTrue(t) && set_guide(g, GUIDE_JSON_OBJECT, NULL, what, e) < 0) return -1;
            } else if (strcmp(t->string, "backend") != 0 && strcmp(t->string, "disable_fallback") != 0 &&
                       strcmp(t->string, "disable_any_whitespace") != 0 &&
                       strcmp(t->string, "disable_additional_properties") != 0) {
                return bad(e, "structured_outputs", "%s is not supported by this server", what);
            }
        }
    }
    return 0;
}

/* ---- Tool calling (tool_calls.h): a forced call (tool_choice "required"
 * or a named function) becomes a JSON Schema guide, so its arguments always
 * match the tool's schema. */
static int parse_tools(req_t *q, const cJSON *o, gen_t *g, perr_t *e) {
    const char *param = "tools";
    char msg[300];
    loom_toolfmt_t fmt = q->h ? q->h->tool_fmt : LOOM_TOOLFMT_HERMES;
    if (loom_tools_parse(o, fmt, &g->tools, &param, msg, sizeof msg) < 0) return bad(e, param, "%s", msg);
    loom_tools_set_tokenizer(&g->tools, q->h ? q->h->tok : NULL);
    /* the markers the tool-call parser reads, written into the text */
    memcpy(g->keep_ids, g->tools.keep_ids, g->tools.n_keep * sizeof *g->keep_ids);
    g->p.keep_special_ids = g->keep_ids;
    g->p.n_keep_special_ids = g->tools.n_keep;
    if (!g->tools.schema) return 0;
    if (g->p.guide_kind)
        return bad(e, "tool_choice", "tool_choice '%s' forces the output; it cannot be combined with response_format, "
                                     "guided_* or structured_outputs",
                   g->tools.mode == LOOM_TOOLS_NAMED ? g->tools.named : "required");
    g->guide_spec = loom_xstrdup(g->tools.schema);
    g->p.guide_kind = GUIDE_TOOL_CALLS;
    g->p.guide_spec = g->guide_spec;
    return 0;
}

int parse_common(req_t *q, const cJSON *o, gen_t *g, perr_t *e) {
    double v;
    int r, b = 0;
    if (check_fields(q, o, q->chat, e) < 0) return -1;
    const cJSON *x = field(o, "model");
    if (x && !cJSON_IsString(x)) return bad(e, "model", "model must be a string");
    if (x && x->valuestring[0]) g->p.model = x->valuestring;
    g->n = 1;
    if ((r = opt_int(o, "n", -1e9, 1e9, &v, e)) < 0) return -1;
    if (r && (v < 1 || v > MAX_CHOICES)) return bad(e, "n", "n must be in [1, %d] (got %g)", MAX_CHOICES, v);
    if (r) g->n = (int)v;
    if ((r = opt_int(o, "best_of", -1e9, 1e9, &v, e)) < 0) return -1;
    if (r && v != g->n) return bad(e, "best_of", "best_of must equal n, %d (got %g)", g->n, v);
    if ((r = opt_bool(o, "skip_special_tokens", &b, e)) < 0) return -1;
    g->p.keep_special = r && !b;
    x = field(o, "stop_token_ids");
    if (x) {
        if (!cJSON_IsArray(x)) return bad(e, "stop_token_ids", "stop_token_ids must be an array of token ids");
        const cJSON *t;
        cJSON_ArrayForEach(t, x) {
            if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
                t->valuedouble > 2147483647.0)
                return bad(e, "stop_token_ids", "stop_token_ids[%d] is not a token id (a non-negative integer)",
                           g->p.n_stop_token_ids);
            if (g->p.n_stop_token_ids == MAX_STOP_IDS)
                return bad(e, "stop_token_ids", "at most %d stop token ids", MAX_STOP_IDS);
            g->stop_ids[g->p.n_stop_token_ids++] = (int32_t)t->valuedouble;
        }
        g->p.stop_token_ids = g->stop_ids;
    }
    x = field(o, "user");
    if (x && !cJSON_IsString(x)) return bad(e, "user", "user must be a string");
    if (x) g->p.session = x->valuestring; /* a router's session affinity */
    x = field(o, "metadata");
    if (x && !cJSON_IsObject(x)) return bad(e, "metadata", "metadata must be an object");
    x = field(o, "kv_transfer_params"); /* disaggregated prefill/decode: the coordinator reads it */
    if (x && !cJSON_IsNull(x) && !cJSON_IsObject(x))
        return bad(e, "kv_transfer_params", "kv_transfer_params must be an object");
    if (x && cJSON_IsObject(x) && x->child) {
        free(g->kv_params);
        g->kv_params = cJSON_PrintUnformatted(x);
        g->p.kv_transfer_params = g->kv_params;
    }
    if (parse_guide(o, g, e) < 0) return -1;
    if (q->chat && parse_tools(q, o, g, e) < 0) return -1;

    /* max_tokens; for chat max_completion_tokens wins */
    static const loom_gen_defaults_t no_defaults; /* loom_http_parse_generate has no gateway */
    const loom_gen_defaults_t *gd = q->h ? &q->h->gen : &no_defaults;
    g->p.max_tokens = gd->has_max_tokens ? gd->max_tokens : q->chat ? 0 : COMPLETIONS_DEFAULT_MAX_TOKENS;
    if ((r = opt_int(o, "max_tokens", -1e18, 1e18, &v, e)) < 0) return -1;
    const char *mt = "max_tokens";
    if (q->chat) {
        double v2;
        int r2 = opt_int(o, "max_completion_tokens", -1e18, 1e18, &v2, e);
        if (r2 < 0) return -1;
        if (r2) {
            r = 1, v = v2;
            mt = "max_completion_tokens";
        }
    }
    if (r) {
        if (v < 1) return bad(e, mt, "%s must be at least 1 (got %g)", mt, v);
        g->p.max_tokens = v > (1 << 30) ? (1 << 30) : (int)v;
    }
    g->p.temperature = gd->has_temperature ? gd->temperature : 1.0f;
    if ((r = opt_number(o, "temperature", 0, 2, &v, e)) < 0) return -1;
    if (r) g->p.temperature = (float)v;
    g->p.top_p = gd->has_top_p ? gd->top_p : 1.0f;
    if ((r = opt_number(o, "top_p", 0, 1, &v, e)) < 0) return -1;
    if (r) g->p.top_p = (float)v;
    if (gd->has_top_k) g->p.top_k = gd->top_k;
    if ((r = opt_int(o, "top_k", -1, 1 << 30, &v, e)) < 0) return -1;
    if (r) g->p.top_k = v < 0 ? 0 : (int)v;
    if ((r = opt_int(o, "seed", -9223372036854775808.0, 18446744073709551615.0, &v, e)) < 0) return -1;
    if (r) {
        g->p.seed = v < 0 ? (uint64_t)(int64_t)v : v >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)v;
        g->p.has_seed = 1;
    }
    x = field(o, "stop");
    if (x) {
        if (cJSON_IsString(x)) {
            g->stop[g->p.n_stop++] = x->valuestring;
        } else if (cJSON_IsArray(x)) {
            const cJSON *s;
            cJSON_ArrayForEach(s, x) {
                if (!cJSON_IsString(s)) return bad(e, "stop", "stop must be a string or an array of strings");
                if (g->p.n_stop == MAX_STOP) return bad(e, "stop", "at most %d stop strings", MAX_STOP);
                g->stop[g->p.n_stop++] = s->valuestring;
            }
        } else {
            return bad(e, "stop", "stop must be a string or an array of strings");
        }
        g->p.stop = g->stop;
    }
    if ((r = opt_bool(o, "stream", &b, e)) < 0) return -1;
    q->stream = r && b;
    x = field(o, "stream_options");
    if (x) {
        if (!cJSON_IsObject(x)) return bad(e, "stream_options", "stream_options must be an object");
        if ((r = opt_bool(x, "include_usage", &b, e)) < 0) return -1;
        q->include_usage = r && b;
    }
    if ((r = opt_bool(o, "ignore_eos", &b, e)) < 0) return -1;
    g->p.ignore_eos = r && b;
    if ((r = opt_bool(o, "speculative", &b, e)) < 0) return -1; /* false: no speculation for this request */
    g->p.no_speculation = r && !b;
    if ((r = opt_bool(o, "loom_cache", &b, e)) < 0) return -1; /* false: a router's response cache is skipped */
    g->p.no_cache = r && !b;
    if ((r = opt_int(o, "priority", -1e6, 1e6, &v, e)) < 0) return -1;
    if (r) g->p.priority = (int)v;
    if (parse_controls(o, q->chat, g, e) < 0) return -1;
    q->logprobs = g->p.logprobs;
    q->top_logprobs = g->p.top_logprobs;
    q->echo = g->echo;
    q->prompt_lp = g->prompt_lp;
    if (q->prompt_lp >= 0 && q->stream) /* as vLLM */
        return bad(e, "prompt_logprobs", "prompt_logprobs are not available when stream is true");
    if (q->prompt_lp >= 0 || (g->echo && g->p.logprobs)) { /* echo with logprobs covers the prompt's tokens too */
        g->p.prompt_logprobs = 1;
        g->p.prompt_top_logprobs = LOOM_MAX(q->prompt_lp, g->echo && g->p.logprobs ? g->p.top_logprobs : 0);
    }
    return 0;
}

/* One prompt: a non-empty string, or an array of token ids (*ids owned by
 * the caller). `what` names it in errors ("prompt", "prompt[2]"). */
static int parse_one_prompt(const cJSON *x, const char *what, const char **text, int32_t **ids, int *n_ids,
                            perr_t *e) {
    if (cJSON_IsString(x)) {
        if (!x->valuestring[0]) return bad(e, "prompt", "%s must not be empty", what);
        *text = x->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(x)) return bad(e, "prompt", "%s must be a string or an array of token ids", what);
    int n = cJSON_GetArraySize(x);
    if (n == 0) return bad(e, "prompt", "%s must not be empty", what);
    *ids = loom_xmalloc((size_t)n * sizeof **ids);
    const cJSON *t;
    int k = 0;
    cJSON_ArrayForEach(t, x) {
        if (!is_token_id(t)) return bad(e, "prompt", "%s[%d] is not a token id (a non-negative integer)", what, k);
        (*ids)[k++] = (int32_t)t->valuedouble;
    }
    *n_ids = n;
    return 0;
}

/* /v1/completions: prompt is a string, an array of token ids, or a batch
 * (an array) of either, answered as choices in prompt order (OpenAI's
 * index: prompt i, choice j of n is i * n + j). add_special_tokens: false
 * (an extension, as in vLLM) sends the text as already formatted: special
 * tokens parsed, no BOS added. */
int parse_prompt(const cJSON *o, gen_t *g, perr_t *e) {
    const cJSON *x = field(o, "prompt");
    if (!x) return bad(e, "prompt", "prompt is required");
    if (cJSON_IsArray(x) && cJSON_GetArraySize(x) >= 1 && !cJSON_IsNumber(x->child)) { /* a batch */
        int n = cJSON_GetArraySize(x);
        if (n > MAX_CHOICES) return bad(e, "prompt", "a batch of %d prompts; at most %d", n, MAX_CHOICES);
        g->batch_text = loom_xcalloc((size_t)n, sizeof *g->batch_text);
        g->batch_ids = loom_xcalloc((size_t)n, sizeof *g->batch_ids);
        g->batch_n_ids = loom_xcalloc((size_t)n, sizeof *g->batch_n_ids);
        g->n_batch = n;
        const cJSON *t;
        int i = 0;
        cJSON_ArrayForEach(t, x) {
            char what[32];
            snprintf(what, sizeof what, "prompt[%d]", i);
            if (parse_one_prompt(t, what, &g->batch_text[i], &g->batch_ids[i], &g->batch_n_ids[i], e) < 0) return -1;
            i++;
        }
        if (n == 1) { /* a batch of one is the prompt itself */
            g->p.prompt = g->batch_text[0];
            g->p.prompt_ids = g->batch_ids[0];
            g->p.n_prompt_ids = g->batch_n_ids[0];
        }
    } else {
        if (parse_one_prompt(x, "prompt", &g->p.prompt, &g->ids, &g->p.n_prompt_ids, e) < 0) return -1;
        g->p.prompt_ids = g->ids;
    }
    int r, b = 0;
    if ((r = opt_bool(o, "add_special_tokens", &b, e)) < 0) return -1;
    if (r && !b) g->p.raw_prompt = 1;
    return 0;
}

/* /v1/chat/completions: the request through the model's chat template
 * (chat_template.h). The prompt is tokenized here, with special-token text
 * inside the request's strings encoded as plain text (only the template's
 * own special tokens are control tokens), and sent as ids; with
 * special_in_content (the --chat-special-tokens-in-content flag) the
 * rendered text goes to the coordinator, which parses every special token
 * in it. The rendered text holds BOS already: none is added. */
int parse_messages(const loom_chat_template_t *tmpl, const loom_tokenizer_t *tok, int special_in_content,
                   const cJSON *o, gen_t *g, perr_t *e) {
    loom_err_t err = {0};
    size_t len, *plain = NULL, n_plain = 0;
    const char *param = NULL;
    int rc = -1;
    if (!special_in_content && !tok) return bad(e, "messages", "this server has no tokenizer loaded to encode chat prompts");
    uint64_t t0 = loom_now_ns();
    if (loom_chat_template_render(tmpl, o, &g->prompt, &len, special_in_content ? NULL : &plain,
                                  special_in_content ? NULL : &n_plain, &param, &err) < 0)
        return bad(e, param ? param : "messages", "%s", err.msg);
    if (len == 0) {
        bad(e, "messages", "the conversation renders to an empty prompt");
        goto done;
    }
    g->p.raw_prompt = 1;
    if (special_in_content) {
        g->p.prompt = g->prompt;
    } else {
        int n_ids = 0, cap = 0;
        loom_status_t st = loom_tokenizer_encode_spans(tok, g->prompt, len, 0, plain, n_plain, &g->ids, &n_ids, &cap,
                                                       &err);
        if (st < 0) {
            bad(e, "messages", "cannot tokenize the conversation: %s", err.msg);
            goto done;
        }
        g->p.prompt_ids = g->ids;
        g->p.n_prompt_ids = n_ids;
    }
    g->tok_ns = loom_now_ns() - t0;
    g->p.gateway_tokenize_ns = g->tok_ns; /* the coordinator counts it in the tokenize stage */
    rc = 0;
done:
    free(plain);
    return rc;
}

/* A reasoning model answers after its reasoning: a guide (structured
 * output, a forced tool call) holds from the parser's end-of-reasoning
 * marker on, unless the rendered prompt closed the reasoning already (Qwen3
 * with enable_thinking false). No speculation then: drafts would cross the
 * marker unguided. */
void guide_after_reasoning(const loom_http_t *h, gen_t *g) {
    if (!h->reasoning || !g->p.guide_kind || !g->prompt) return;
    /* GPT-OSS: a forced call is a message of its own, the analysis optional */
    if (h->reasoning == LOOM_REASONING_OPENAI && g->p.guide_kind == GUIDE_TOOL_CALLS) return;
    const char *end = loom_reasoning_end_marker(h->reasoning);
    size_t n = strlen(g->prompt);
    while (n && (g->prompt[n - 1] == ' ' || g->prompt[n - 1] == '\n' || g->prompt[n - 1] == '\t' ||
                 g->prompt[n - 1] == '\r'))
        n--;
    for (const char *e = end; *e;) { /* (one of the ways it is written, '\n' between them) */
        size_t m = strcspn(e, "\n");
        if (m && n >= m && !memcmp(g->prompt + n - m, e, m)) return;
        e += m + (e[m] == '\n');
    }
    g->p.guide_after = end;
    g->p.no_speculation = 1;
}

/* A reasoning parser reads its markers from the text: those that are
 * special tokens of the model's (GPT-OSS's harmony markers) stay in it, as a
 * tool-call parser's do, and the parser takes them out of the answer. */
void keep_reasoning_markers(const loom_http_t *h, gen_t *g) {
    if (!h->reasoning || !h->tok) return;
    size_t n = g->p.n_keep_special_ids;
    for (const char *const *m = loom_reasoning_token_markers(h->reasoning); *m; m++) {
        int32_t id = loom_tokenizer_token_id(h->tok, *m);
        if (id < 0 || !loom_tokenizer_is_special(h->tok, id)) continue;
        size_t i = 0;
        while (i < n && g->keep_ids[i] != id) i++;
        if (i == n && n < LOOM_ARRAY_LEN(g->keep_ids)) g->keep_ids[n++] = id;
    }
    g->p.keep_special_ids = g->keep_ids;
    g->p.n_keep_special_ids = n;
}

int loom_http_parse_generate(const char *body, size_t len, int chat, const loom_chat_template_t *tmpl,
                             const loom_tokenizer_t *tok, int special_in_content, char *msg, size_t cap) {
    cJSON *root = loom_http_parse_json_body(body, len, msg, cap);
    if (!root) return -1;
    req_t q = {.chat = chat};
    gen_t g = {0};
    perr_t e = {0};
    int rc = -1;
    if (chat && !tmpl) snprintf(msg, cap, "this model has no chat template");
    else if (parse_common(&q, root, &g, &e) < 0 ||
             (chat ? parse_messages(tmpl, tok, special_in_content, root, &g, &e) : parse_prompt(root, &g, &e)) < 0)
        snprintf(msg, cap, "%s", e.msg);
    else
        rc = 0;
    gen_free(&g);
    cJSON_Delete(root);
    return rc;
}
