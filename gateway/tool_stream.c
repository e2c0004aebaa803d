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
 * valid and its arguments object has begun; after that sent follows pos. */
#include "gateway/tool_stream.h"

#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "gateway/tool_parsers.h"

#define JS_MAX_DEPTH 64

/* ---- strict incremental JSON (RFC 8259) ---- */

enum { JS_VALUE, JS_ARR_FIRST, JS_KEY_OR_END, JS_KEY, JS_COLON, JS_AFTER, JS_STR, JS_ESC, JS_HEX, JS_NUM, JS_LIT,
       JS_DONE, JS_ERR };
enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };

typedef struct {
    int st;                    /* JS_* */
    int depth;                 /* open containers */
    int key;                   /* the string being read is an object key */
    int hex;                   /* \u digits still to come */
    int num;                   /* N_*: where in a number */
    const char *lit;           /* true / false / null being matched */
    int lit_i;
    char stack[JS_MAX_DEPTH];  /* '{' or '[' per open container */
} js_t;

static int is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static int in_string(int st) {
    return st == JS_STR || st == JS_ESC || st == JS_HEX;
}

static void js_start(js_t *j) {
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
static void js_step(js_t *j, char c) {
    for (;;) {
        int digit = c >= '0' && c <= '9';
        switch (j->st) {
        case JS_ARR_FIRST:
            if (is_ws(c)) return;
            if (c == ']') {
                j->depth--;
                js_end_value(j);
                return;
            }
            j->st = JS_VALUE;
            continue;
        case JS_VALUE:
            if (is_ws(c)) return;
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
            if (is_ws(c)) return;
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
            if (is_ws(c)) return;
            j->st = c == ':' ? JS_VALUE : JS_ERR;
            return;
        case JS_AFTER: {
            if (is_ws(c)) return;
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

enum { P_PRE, P_OUT, P_OPEN, P_VALUE, P_CLOSE, P_TRAIL, P_SEMI, P_TEXT };
enum { R_SKIP, R_NAME, R_ARGS }; /* what the current member of a call object is */

static const char k_open[] = "<tool_call>", k_close[] = "</tool_call>";

struct loom_tstream {
    const loom_tools_t *t;
    loom_tse_fn emit;
    void *ctx;
    int blocks;        /* hermes: <tool_call> blocks within text */
    int held;          /* a syntax read whole (tool_parsers.h): content until its start, then held */
    int hold;          /* held: buf[sent, len) is the calls' text, parsed at the end */
    loom_sbuf_t buf;   /* everything fed, NULs dropped */
    size_t pos, sent;  /* scanned up to; out or dropped up to (see the top) */
    int phase;
    int tag_i;         /* PRE: the next tag that may come */
    int close_i;       /* CLOSE: characters of "</tool_call>" matched */
    size_t semi_at;    /* SEMI: where the ';' is */
    int after_call;    /* OUT: the last thing was a call (whitespace next is dropped) */
    size_t pend_at, pend_len; /* OUT: whitespace between content and a call, kept if content follows it */
    int array;         /* the calls are a JSON array */
    int ncalls;        /* calls started */
    int failed;        /* the answer is not calls */
    js_t js;
    int cd;            /* depth of a call object's members (0: bare, the value is the arguments) */
    /* the call being read */
    int in_call, role, committed, args_on, have_name, have_args;
    size_t key_at, name_at;
    char *name;        /* read and valid */
    loom_sbuf_t args;  /* its arguments so far (whitespace between tokens dropped) */
    size_t args_sent;
};

static void flush_args(loom_tstream_t *s) {
    if (!s->committed || s->args.len == s->args_sent) return;
    loom_tse_t e = {.kind = LOOM_TSE_ARGS, .index = s->ncalls - 1, .text = s->args.p + s->args_sent,
                    .len = s->args.len - s->args_sent};
    s->args_sent = s->args.len;
    s->emit(s->ctx, &e);
}

static void emit_content(loom_tstream_t *s, size_t from, size_t to) {
    if (to <= from) return;
    flush_args(s);
    loom_tse_t e = {.kind = LOOM_TSE_CONTENT, .index = -1, .text = s->buf.p + from, .len = to - from};
    s->emit(s->ctx, &e);
}

static void reset_call(loom_tstream_t *s) {
    free(s->name);
    s->name = NULL;
    s->in_call = s->role = s->committed = s->args_on = s->have_name = s->have_args = 0;
    s->args.len = s->args_sent = 0;
}

/* Not calls after all: what is held goes out, and all that follows. */
static void fail(loom_tstream_t *s) {
    flush_args(s);
    reset_call(s);
    s->failed = 1;
    s->phase = P_TEXT;
    emit_content(s, s->sent, s->buf.len);
    s->sent = s->pos = s->buf.len;
}

static int known(const loom_tools_t *t, const char *name) {
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

static int commit(loom_tstream_t *s) {
    if (s->ncalls > 0 && !s->t->parallel) return -1;
    loom_tse_t e = {.kind = LOOM_TSE_CALL, .index = s->ncalls, .name = s->name};
    s->ncalls++;
    s->committed = 1;
    s->emit(s->ctx, &e);
    return 0;
}

/* The JSON value holding the call(s) begins at pos; cd: its calls' depth. */
static void begin_value(loom_tstream_t *s, int cd) {
    js_start(&s->js);
    s->cd = cd;
    s->phase = P_VALUE;
    if (cd == 0) { /* named: the value is the arguments object */
        reset_call(s);
        s->in_call = s->args_on = 1;
        s->name = loom_xstrdup(s->t->named);
        commit(s);
    }
}

/* One character of the JSON value (at pos). */
static void value_char(loom_tstream_t *s, char c) {
    js_t *j = &s->js;
    int s0 = j->st, d0 = j->depth, cd = s->cd;
    if (cd > 0 && d0 == cd - 1 && (s0 == JS_VALUE || s0 == JS_ARR_FIRST) && !is_ws(c)) {
        if (c != '{') { /* an array's element that is not a call object, or no element */
            fail(s);
            return;
        }
        reset_call(s);
        s->in_call = 1;
    }
    js_step(j, c);
    if (j->st == JS_ERR) {
        fail(s);
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
        } else if (s0 == JS_VALUE && d0 == cd && !is_ws(c)) {
            if (s->role == R_NAME) {
                if (c != '"') {
                    fail(s);
                    return;
                }
                s->have_name = 1;
                s->name_at = s->pos;
            } else if (s->role == R_ARGS) {
                if (c != '{') {
                    fail(s);
                    return;
                }
                s->have_args = s->args_on = 1;
            }
        } else if (s->role == R_NAME && !s->name && s0 == JS_STR && j->st == JS_AFTER && d0 == cd) {
            s->name = decode_str(s->buf.p + s->name_at, s->pos + 1 - s->name_at);
            if (!s->name || !known(s->t, s->name)) {
                fail(s);
                return;
            }
        }
    }
    if (s->args_on) {
        if (!is_ws(c) || in_string(s0)) loom_sbuf_add(&s->args, &c, 1);
        if (cd == 0 ? j->st == JS_DONE : (d0 == cd + 1 && j->depth == cd)) s->args_on = 0;
    }
    if (!s->committed && s->name && s->have_args && commit(s) < 0) {
        fail(s);
        return;
    }
    int ended = cd == 0 ? j->st == JS_DONE : (d0 == cd && j->depth == cd - 1);
    if (ended && !s->committed) {
        fail(s);
        return;
    } /* a name or arguments missing */
    if (s->committed) s->sent = s->pos + 1;
    if (ended) {
        flush_args(s);
        reset_call(s);
    }
}

/* Longest proper prefix of tag that p[0, n) ends with. */
static size_t partial_suffix(const char *p, size_t n, const char *tag) {
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
    size_t end = m ? (size_t)(m - b) : len - partial_suffix(b + from, len - from, k_open);
    if (s->after_call) { /* whitespace after a call is dropped */
        while (from < end && is_ws(b[from])) from++;
        s->sent = from;
        if (from < end) { /* content again: the whitespace before the call(s) separates it */
            s->after_call = 0;
            emit_content(s, s->pend_at, s->pend_at + s->pend_len);
            s->pend_len = 0;
        }
    }
    size_t last = end;
    while (last > from && is_ws(b[last - 1])) last--;
    emit_content(s, from, last);
    s->sent = last;
    if (m) {
        if (!s->after_call) {
            s->pend_at = last;
            s->pend_len = last > 0 && !is_ws(b[last - 1]) ? end - last : 0;
        }
        s->pos = end + strlen(k_open);
        s->phase = P_OPEN;
    } else {
        s->pos = len;
    }
}

/* PRE: 1 when the character at pos was dealt with, 0 to wait for more. */
static int pre_char(loom_tstream_t *s, char c) {
    if (is_ws(c)) {
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
        fail(s);
    }
    return 1;
}

/* A syntax read whole: content goes out until the calls' start marker
 * (less a suffix that may begin it); from the marker on, all is held. */
static void run_held(loom_tstream_t *s) {
    if (s->hold || s->sent == s->buf.len) return;
    size_t len = s->buf.len - s->sent, maybe = 0;
    if (s->phase != P_TEXT) {
        size_t at = loom_tp_find_start(s->t->fmt, s->buf.p + s->sent, len, &maybe);
        if (at < len) {
            emit_content(s, s->sent, s->sent + at);
            s->sent += at;
            s->hold = 1;
            return;
        }
        if ((s->t->fmt == LOOM_TOOLFMT_PYTHONIC || s->t->fmt == LOOM_TOOLFMT_LLAMA4_PYTHONIC) && !maybe)
            s->phase = P_TEXT; /* the answer is no call list */
    }
    emit_content(s, s->sent, s->buf.len - maybe);
    s->sent = s->pos = s->buf.len - maybe;
}

/* The end of a syntax read whole: the held text parsed into calls, or content. */
static int finish_held(loom_tstream_t *s, int complete) {
    run_held(s);
    size_t len = s->buf.len;
    if (s->hold && complete) {
        loom_tp_call_t *calls = NULL;
        size_t end = 0;
        int n = loom_tp_parse(s->t->fmt, s->t->tools, s->buf.p + s->sent, len - s->sent, &calls, &end);
        if (n > 0 && (n == 1 || s->t->parallel)) {
            for (int i = 0; i < n; i++) {
                loom_tse_t e = {.kind = LOOM_TSE_CALL, .index = i, .name = calls[i].name};
                s->emit(s->ctx, &e);
                loom_tse_t a = {.kind = LOOM_TSE_ARGS, .index = i, .text = calls[i].args, .len = strlen(calls[i].args)};
                if (a.len) s->emit(s->ctx, &a);
            }
            s->ncalls = n;
            size_t rest = s->sent + end;
            while (rest < len && is_ws(s->buf.p[rest])) rest++;
            emit_content(s, rest, len);
            loom_tp_calls_free(calls, n);
            s->sent = s->pos = len;
            s->phase = P_TEXT;
            return n;
        }
        if (n > 0) loom_tp_calls_free(calls, n);
    }
    emit_content(s, s->sent, len); /* not calls: the held text is content */
    s->sent = s->pos = len;
    s->phase = P_TEXT;
    return LOOM_TS_TEXT;
}

static void run(loom_tstream_t *s) {
    if (s->held) {
        run_held(s);
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
            else if (is_ws(c)) s->pos++;
            else fail(s);
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
            } else if (s->close_i == 0 && is_ws(c)) {
                s->pos++;
            } else {
                fail(s);
            }
            break;
        case P_TRAIL:
            if (is_ws(c)) {
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
            } else if (is_ws(c)) {
                s->pos++;
            } else {
                s->sent = s->semi_at;
                s->phase = P_TEXT;
            }
            break;
        }
    }
    if (s->phase == P_TEXT) {
        emit_content(s, s->sent, s->buf.len);
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
    s->held = loom_tp_held(t->fmt);
    s->phase = s->blocks ? P_OUT : P_PRE;
    return s;
}

void loom_tstream_destroy(loom_tstream_t **self_p) {
    loom_tstream_t *s = *self_p;
    if (!s) return;
    free(s->name);
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
    flush_args(s);
}

int loom_tstream_finish(loom_tstream_t *s, int complete) {
    if (s->held) return finish_held(s, complete);
    run(s);
    flush_args(s);
    size_t len = s->buf.len;
    if (!complete) { /* cut short: not calls, whatever was read */
        if (s->phase != P_TEXT) fail(s);
        s->failed = 1;
    }
    switch (s->phase) {
    case P_TEXT:
    case P_TRAIL:
        break;
    case P_OUT:
        if (s->ncalls && s->after_call)
            while (s->sent < len && is_ws(s->buf.p[s->sent])) s->sent++;
        emit_content(s, s->sent, len);
        break;
    case P_SEMI:
        emit_content(s, s->semi_at, len);
        break;
    default: /* PRE: no call; OPEN, VALUE, CLOSE: one unfinished */
        fail(s);
        break;
    }
    s->sent = s->pos = len;
    s->phase = P_TEXT;
    if (s->failed || !s->ncalls) return s->ncalls ? LOOM_TS_BROKEN : LOOM_TS_TEXT;
    return s->ncalls;
}
