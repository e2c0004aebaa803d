/* Tool calls read incrementally from a chat answer (see tool_stream.h):
 * a strict one-character-at-a-time JSON reader, and over it the families'
 * call syntax with what may go out now and what is held.
 *
 * Phases of the reader (s->phase):
 *   PRE    json families: leading whitespace and tags, held
 *   OUT    chatml: content, watching for "<tool_call>"
 *   OPEN   chatml: after "<tool_call>", whitespace, then the call's '{'
 *   VALUE  inside the JSON value holding the call(s)
 *   CLOSE  chatml: after the call object, whitespace, then "</tool_call>"
 *   TRAIL  json families: after the calls; whitespace is dropped
 *   SEMI   llama3: after ';', a next call object or content
 *   TEXT   everything from s->sent on goes out as content, now and later
 * Invariant: buf[0, sent) went out (content or arguments) or was dropped
 * (markup of a started call, whitespace next to a call); buf[sent, len)
 * is held. A call is started (CALL event) only once its name is known and
 * valid and its arguments object has begun; after that sent follows pos.
 * The marked syntaxes (tool_parsers.h) have their own phases, in
 * tool_marked.c, over the same buffer, events and invariant (s->marked). */
#include "gateway/tool_stream.h"

#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "gateway/tool_parsers.h"
#include "gateway/tool_stream_impl.h"

/* ---- strict incremental JSON (RFC 8259) ---- */

int ts_is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

int ts_in_string(int st) {
    return st == JS_STR || st == JS_ESC || st == JS_HEX;
}

void ts_js_start(js_t *j) {
    memset(j, 0, sizeof *j);
    j->st = JS_VALUE;
}

static void js_end_value(js_t *j) {
    j->st = j->depth ? JS_AFTER : JS_DONE;
}

static int is_hex(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* Takes c; j->st becomes JS_ERR when c cannot come here. */
void ts_js_step(js_t *j, char c) {
    for (;;) {
        int digit = c >= '0' && c <= '9';
        switch (j->st) {
        case JS_ARR_FIRST:
            if (ts_is_ws(c)) return;
            if (c == ']') {
                j->depth--;
                js_end_value(j);
                return;
            }
            j->st = JS_VALUE;
            continue;
        case JS_VALUE:
            if (ts_is_ws(c)) return;
            if (c == '{' || c == '[') {
                if (j->depth == JS_MAX_DEPTH) {
                    j->st = JS_ERR;
                    return;
                }
                j->stack[j->depth++] = c;
                j->st = c == '{' ? JS_KEY_OR_END : JS_ARR_FIRST;
            } else if (c == '"') {
                j->key = 0;
                j->st = JS_STR;
            } else if (c == '-' || digit) {
                j->st = JS_NUM;
                j->num = c == '-' ? N_MINUS : c == '0' ? N_ZERO : N_INT;
            } else if (c == 't' || c == 'f' || c == 'n') {
                j->lit = c == 't' ? "true" : c == 'f' ? "false" : "null";
                j->lit_i = 1;
                j->st = JS_LIT;
            } else {
                j->st = JS_ERR;
            }
            return;
        case JS_KEY_OR_END:
        case JS_KEY:
            if (ts_is_ws(c)) return;
            if (c == '}' && j->st == JS_KEY_OR_END) {
                j->depth--;
                js_end_value(j);
            } else if (c == '"') {
                j->key = 1;
                j->st = JS_STR;
            } else {
                j->st = JS_ERR;
            }
            return;
        case JS_COLON:
            if (ts_is_ws(c)) return;
            j->st = c == ':' ? JS_VALUE : JS_ERR;
            return;
        case JS_AFTER: {
            if (ts_is_ws(c)) return;
            char top = j->stack[j->depth - 1];
            if (c == ',') {
                j->st = top == '{' ? JS_KEY : JS_VALUE;
            } else if (c == (top == '{' ? '}' : ']')) {
                j->depth--;
                js_end_value(j);
            } else {
                j->st = JS_ERR;
            }
            return;
        }
        case JS_STR:
            if (c == '"') {
                if (j->key) j->st = JS_COLON;
                else js_end_value(j);
            } else if (c == '\\') {
                j->st = JS_ESC;
            } else if ((unsigned char)c < 0x20) {
                j->st = JS_ERR;
            }
            return;
        case JS_ESC:
            if (c && strchr("\"\\/bfnrt", c)) {
                j->st = JS_STR;
            } else if (c == 'u') {
                j->hex = 4;
                j->st = JS_HEX;
            } else {
                j->st = JS_ERR;
            }
            return;
        case JS_HEX:
            if (!is_hex(c)) j->st = JS_ERR;
            else if (--j->hex == 0) j->st = JS_STR;
            return;
        case JS_NUM: {
            int next = -1, can_end = 0;
            switch (j->num) {
            case N_MINUS: next = c == '0' ? N_ZERO : digit ? N_INT : -1; break;
            case N_ZERO: next = c == '.' ? N_DOT : (c == 'e' || c == 'E') ? N_E : -1, can_end = 1; break;
            case N_INT: next = digit ? N_INT : c == '.' ? N_DOT : (c == 'e' || c == 'E') ? N_E : -1, can_end = 1; break;
            case N_DOT: next = digit ? N_FRAC : -1; break;
            case N_FRAC: next = digit ? N_FRAC : (c == 'e' || c == 'E') ? N_E : -1, can_end = 1; break;
            case N_E: next = (c == '+' || c == '-') ? N_ESIGN : digit ? N_EXP : -1; break;
            case N_ESIGN: next = digit ? N_EXP : -1; break;
            default: next = digit ? N_EXP : -1, can_end = 1; break;
            }
            if (next >= 0) {
                j->num = next;
                return;
            }
            if (!can_end || j->depth == 0) {
                j->st = JS_ERR;
                return;
            }
            js_end_value(j); /* c belongs to the container: read it there */
            continue;
        }
        case JS_LIT:
            if (c != j->lit[j->lit_i]) j->st = JS_ERR;
            else if (!j->lit[++j->lit_i]) js_end_value(j);
            return;
        default: /* nothing may follow a complete value */
            j->st = JS_ERR;
            return;
        }
    }
}

/* ---- the reader ---- */

enum { R_SKIP, R_NAME, R_ARGS }; /* what the current member of a call object is */

static const char k_open[] = "<tool_call>", k_close[] = "</tool_call>";

void ts_flush_args(loom_tstream_t *s) {
    if (!s->committed || s->args.len == s->args_sent) return;
    loom_tse_t e = {.kind = LOOM_TSE_ARGS, .index = s->ncalls - 1, .text = s->args.p + s->args_sent,
                    .len = s->args.len - s->args_sent};
    s->args_sent = s->args.len;
    s->emit(s->ctx, &e);
}

void ts_emit_content(loom_tstream_t *s, size_t from, size_t to) {
    if (to <= from) return;
    ts_flush_args(s);
    loom_tse_t e = {.kind = LOOM_TSE_CONTENT, .index = -1, .text = s->buf.p + from, .len = to - from};
    s->emit(s->ctx, &e);
}

void ts_reset_call(loom_tstream_t *s) {
    free(s->name);
    s->name = NULL;
    s->in_call = s->role = s->committed = s->args_on = s->have_name = s->have_args = 0;
    s->args.len = s->args_sent = 0;
}

/* Not calls after all: what is held goes out, and all that follows. */
void ts_fail(loom_tstream_t *s) {
    ts_flush_args(s);
    ts_reset_call(s);
    s->failed = 1;
    s->phase = P_TEXT;
    ts_emit_content(s, s->sent, s->buf.len);
    s->sent = s->pos = s->buf.len;
}

int ts_known(const loom_tools_t *t, const char *name) {
    const cJSON *tool;
    cJSON_ArrayForEach(tool, t->tools) {
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(tool, "function"), "name");
        if (cJSON_IsString(n) && !strcmp(n->valuestring, name)) return 1;
    }
    return 0;
}

/* A JSON string's text, decoded (malloc'ed), or NULL. */
static char *decode_str(const char *p, size_t n) {
    cJSON *v = cJSON_ParseWithLength(p, n);
    char *out = cJSON_IsString(v) ? loom_xstrdup(v->valuestring) : NULL;
    cJSON_Delete(v);
    return out;
}

int ts_commit(loom_tstream_t *s) {
    if (s->ncalls > 0 && !s->t->parallel) return -1;
    loom_tse_t e = {.kind = LOOM_TSE_CALL, .index = s->ncalls, .name = s->name};
    s->ncalls++;
    s->committed = 1;
    s->emit(s->ctx, &e);
    return 0;
}

/* The JSON value holding the call(s) begins at pos; cd: its calls' depth. */
static void begin_value(loom_tstream_t *s, int cd) {
    ts_js_start(&s->js);
    s->cd = cd;
    s->phase = P_VALUE;
    if (cd == 0) { /* named: the value is the arguments object */
        ts_reset_call(s);
        s->in_call = s->args_on = 1;
        s->name = loom_xstrdup(s->t->named);
        ts_commit(s);
    }
}

/* One character of the JSON value (at pos). */
static void value_char(loom_tstream_t *s, char c) {
    js_t *j = &s->js;
    int s0 = j->st, d0 = j->depth, cd = s->cd;
    if (cd > 0 && d0 == cd - 1 && (s0 == JS_VALUE || s0 == JS_ARR_FIRST) && !ts_is_ws(c)) {
        if (c != '{') { /* an array's element that is not a call object, or no element */
            ts_fail(s);
            return;
        }
        ts_reset_call(s);
        s->in_call = 1;
    }
    ts_js_step(j, c);
    if (j->st == JS_ERR) {
        ts_fail(s);
        return;
    }
    if (!s->in_call) return;
    if (cd > 0) {
        if ((s0 == JS_KEY_OR_END || s0 == JS_KEY) && d0 == cd && c == '"') {
            s->key_at = s->pos;
        } else if (s0 == JS_STR && j->st == JS_COLON && d0 == cd) {
            char *k = decode_str(s->buf.p + s->key_at, s->pos + 1 - s->key_at);
            s->role = R_SKIP;
            if (k && !strcmp(k, "name") && !s->have_name) s->role = R_NAME;
            else if (k && (!strcmp(k, "arguments") || !strcmp(k, "parameters")) && !s->have_args) s->role = R_ARGS;
            free(k);
        } else if (s0 == JS_VALUE && d0 == cd && !ts_is_ws(c)) {
            if (s->role == R_NAME) {
                if (c != '"') {
                    ts_fail(s);
                    return;
                }
                s->have_name = 1;
                s->name_at = s->pos;
            } else if (s->role == R_ARGS) {
                if (c != '{') {
                    ts_fail(s);
                    return;
                }
                s->have_args = s->args_on = 1;
            }
        } else if (s->role == R_NAME && !s->name && s0 == JS_STR && j->st == JS_AFTER && d0 == cd) {
            s->name = decode_str(s->buf.p + s->name_at, s->pos + 1 - s->name_at);
            if (!s->name || !ts_known(s->t, s->name)) {
                ts_fail(s);
                return;
            }
        }
    }
    if (s->args_on) {
        if (!ts_is_ws(c) || ts_in_string(s0)) loom_sbuf_add(&s->args, &c, 1);
        if (cd == 0 ? j->st == JS_DONE : (d0 == cd + 1 && j->depth == cd)) s->args_on = 0;
    }
    if (!s->committed && s->name && s->have_args && ts_commit(s) < 0) {
        ts_fail(s);
        return;
    }
    int ended = cd == 0 ? j->st == JS_DONE : (d0 == cd && j->depth == cd - 1);
    if (ended && !s->committed) {
        ts_fail(s);
        return;
    } /* a name or arguments missing */
    if (s->committed) s->sent = s->pos + 1;
    if (ended) {
        ts_flush_args(s);
        ts_reset_call(s);
    }
}

/* Longest proper prefix of tag that p[0, n) ends with. */
size_t ts_partial_suffix(const char *p, size_t n, const char *tag) {
    size_t t = strlen(tag);
    for (size_t k = LOOM_MIN(n, t - 1); k > 0; k--)
        if (!memcmp(p + n - k, tag, k)) return k;
    return 0;
}

static const char *find(const char *p, size_t n, const char *tag) {
    size_t t = strlen(tag);
    for (size_t i = 0; i + t <= n; i++)
        if (p[i] == tag[0] && !memcmp(p + i, tag, t)) return p + i;
    return NULL;
}

/* OUT (chatml): content up to the next "<tool_call>", less what may
 * still be the start of one or whitespace that may run up to one. */
static void out_text(loom_tstream_t *s) {
    const char *b = s->buf.p;
    size_t len = s->buf.len, from = s->sent;
    const char *m = find(b + from, len - from, k_open);
    size_t end = m ? (size_t)(m - b) : len - ts_partial_suffix(b + from, len - from, k_open);
    if (s->after_call) { /* whitespace after a call is dropped */
        while (from < end && ts_is_ws(b[from])) from++;
        s->sent = from;
        if (from < end) { /* content again: the whitespace before the call(s) separates it */
            s->after_call = 0;
            ts_emit_content(s, s->pend_at, s->pend_at + s->pend_len);
            s->pend_len = 0;
        }
    }
    size_t last = end;
    while (last > from && ts_is_ws(b[last - 1])) last--;
    ts_emit_content(s, from, last);
    s->sent = last;
    if (m) {
        if (!s->after_call) {
            s->pend_at = last;
            s->pend_len = last > 0 && !ts_is_ws(b[last - 1]) ? end - last : 0;
        }
        s->pos = end + strlen(k_open);
        s->phase = P_OPEN;
    } else {
        s->pos = len;
    }
}

/* PRE: 1 when the character at pos was dealt with, 0 to wait for more. */
static int pre_char(loom_tstream_t *s, char c) {
    if (ts_is_ws(c)) {
        s->pos++;
        return 1;
    }
    {
        static const char *const tags[] = {"<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>"};
        while (s->tag_i < (int)LOOM_ARRAY_LEN(tags)) {
            const char *tag = tags[s->tag_i];
            size_t n = strlen(tag), have = s->buf.len - s->pos;
            if (have < n && !memcmp(s->buf.p + s->pos, tag, have)) return 0;
            s->tag_i++;
            if (have >= n && !memcmp(s->buf.p + s->pos, tag, n)) {
                s->pos += n;
                return 1;
            }
        }
    }
    if (c == '[') {
        s->array = 1;
        begin_value(s, 2);
    } else if (c == '{') {
        begin_value(s, 1);
    } else {
        ts_fail(s);
    }
    return 1;
}

static void run(loom_tstream_t *s) {
    if (s->marked) {
        ts_marked_run(s);
        return;
    }
    while (s->phase != P_TEXT && s->pos < s->buf.len) {
        char c = s->buf.p[s->pos];
        switch (s->phase) {
        case P_PRE:
            if (!pre_char(s, c)) return;
            break;
        case P_OUT:
            out_text(s);
            break;
        case P_OPEN:
            if (c == '{') begin_value(s, 1);
            else if (ts_is_ws(c)) s->pos++;
            else ts_fail(s);
            break;
        case P_VALUE:
            value_char(s, c);
            if (s->phase == P_TEXT) break;
            s->pos++;
            if (s->js.st == JS_DONE) {
                s->phase = s->blocks ? P_CLOSE : P_TRAIL;
                s->close_i = 0;
            }
            break;
        case P_CLOSE:
            if (c == k_close[s->close_i]) {
                s->pos++;
                if (!k_close[++s->close_i]) {
                    s->sent = s->pos;
                    s->after_call = 1;
                    s->phase = P_OUT;
                }
            } else if (s->close_i == 0 && ts_is_ws(c)) {
                s->pos++;
            } else {
                ts_fail(s);
            }
            break;
        case P_TRAIL:
            if (ts_is_ws(c)) {
                s->sent = ++s->pos;
            } else if (c == ';' && s->t->fmt == LOOM_TOOLFMT_LLAMA3_JSON && !s->array) {
                s->semi_at = s->pos++;
                s->phase = P_SEMI;
            } else {
                s->sent = s->pos;
                s->phase = P_TEXT; /* content after the calls */
            }
            break;
        case P_SEMI:
            if (c == '{') {
                begin_value(s, 1);
            } else if (ts_is_ws(c)) {
                s->pos++;
            } else {
                s->sent = s->semi_at;
                s->phase = P_TEXT;
            }
            break;
        }
    }
    if (s->phase == P_TEXT) {
        ts_emit_content(s, s->sent, s->buf.len);
        s->sent = s->pos = s->buf.len;
    }
}

loom_tstream_t *loom_tstream_create(const loom_tools_t *t, loom_tse_fn emit, void *ctx) {
    LOOM_ASSERT(t->mode != LOOM_TOOLS_OFF);
    loom_tstream_t *s = loom_xcalloc(1, sizeof *s);
    s->t = t;
    s->emit = emit;
    s->ctx = ctx;
    s->blocks = t->fmt == LOOM_TOOLFMT_HERMES || t->fmt == LOOM_TOOLFMT_NONE;
    s->marked = loom_tp_held(t->fmt);
    s->phase = s->blocks ? P_OUT : P_PRE;
    return s;
}

void loom_tstream_destroy(loom_tstream_t **self_p) {
    loom_tstream_t *s = *self_p;
    if (!s) return;
    free(s->name);
    free(s->mk.key);
    free(s->args.p);
    free(s->buf.p);
    free(s);
    *self_p = NULL;
}

void loom_tstream_feed(loom_tstream_t *s, const char *text, size_t len) {
    for (size_t i = 0; i < len;) {
        size_t k = i;
        while (k < len && text[k]) k++;
        loom_sbuf_add(&s->buf, text + i, k - i);
        i = k + 1;
    }
    run(s);
    ts_flush_args(s);
}

int loom_tstream_finish(loom_tstream_t *s, int complete) {
    if (s->marked) return ts_marked_finish(s, complete);
    run(s);
    ts_flush_args(s);
    size_t len = s->buf.len;
    if (!complete) { /* cut short: not calls, whatever was read */
        if (s->phase != P_TEXT) ts_fail(s);
        s->failed = 1;
    }
    switch (s->phase) {
    case P_TEXT:
    case P_TRAIL:
        break;
    case P_OUT:
        if (s->ncalls && s->after_call)
            while (s->sent < len && ts_is_ws(s->buf.p[s->sent])) s->sent++;
        ts_emit_content(s, s->sent, len);
        break;
    case P_SEMI:
        ts_emit_content(s, s->semi_at, len);
        break;
    default: /* PRE: no call; OPEN, VALUE, CLOSE: one unfinished */
        ts_fail(s);
        break;
    }
    s->sent = s->pos = len;
    s->phase = P_TEXT;
    if (s->failed || !s->ncalls) return s->ncalls ? LOOM_TS_BROKEN : LOOM_TS_TEXT;
    return s->ncalls;
}
