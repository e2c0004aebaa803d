/* The marked call syntaxes (tool_parsers.h: deepseek_v3, deepseek_v31,
 * pythonic, llama4_pythonic, qwen3_coder, openai) read incrementally, as
 * tool_stream.c reads the JSON ones: content goes out up to the calls'
 * start marker; a call starts (LOOM_TSE_CALL) as soon as its name is read
 * and found in tools, and its arguments go out as they are generated, the
 * JSON text the unstreamed answer has (loom_tp_parse reads the same text
 * whole, and the tests hold the two to agree).
 *
 * States (s->mk.phase), per syntax, after M_SEEK (content, looking for the
 * start with loom_tp_find_start):
 *   deepseek     DS_BEGIN <calls begin> DS_ITEM (<call begin> or <calls end>)
 *                [v3: DS_TYPE "function" <sep>] DS_NAME NAME (v3: to "\n",
 *                v31: to <sep>) [v3: DS_FENCE "```json\n"] DS_ARGS0 DS_ARGS
 *                {json} DS_ARGS_END [v3: "```"] <call end>, back to DS_ITEM;
 *                AFTER <calls end>: whitespace dropped, the rest content
 *   qwen3_coder  QC_OPEN <tool_call> QC_FUNC <function= QC_NAME NAME>
 *                QC_PARAM (<parameter= QC_KEY KEY> QC_VALUE VALUE</parameter>)*
 *                </function> QC_CLOSE </tool_call> QC_NEXT (another block, or
 *                the rest is content)
 *   pythonic     PY_START [<|python_start|>] '[' PY_ITEM PY_NAME NAME PY_PAREN
 *                '(' PY_KW (KW PY_EQ '=' PY_VALUE value PY_AFTER (',' | ')'))*
 *                PY_SEP (',' PY_ITEM | ']') PY_TAIL [<|python_end|>] whitespace
 *   openai       HM_HEAD header <|message|> HM_ARGS0 HM_ARGS {json} HM_ARGS_END
 *                [<|call|>] HM_NEXT (another header; a final message's
 *                header, dropped; else the rest is content)
 * Arguments: DeepSeek's and harmony's are the JSON text as generated less
 * the whitespace between tokens. qwen3_coder's and pythonic's are built:
 * '{' when the call starts, each key when it is read, a string value
 * escaped as it comes (qwen3_coder: less its first and last newline, so a
 * newline and what may begin "</parameter>" are held), and a value that is
 * no string (a qwen3_coder value typed by the schema, a Python number or
 * True/False/None) when it is complete, '}' at the call's end: nothing
 * sent is ever taken back.
 * Invariant (as tool_stream.c): buf[sent, len) is held; before a call
 * starts that is all of the calls' text from the marker (content if it
 * turns out not to be calls); while a call is read sent follows pos. */
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "gateway/tool_parsers.h"
#include "gateway/tool_stream_impl.h"

enum {
    M_SEEK,
    M_DS_BEGIN,
    M_DS_ITEM,
    M_DS_TYPE,
    M_DS_NAME,
    M_DS_FENCE,
    M_DS_ARGS0,
    M_DS_ARGS,
    M_DS_ARGS_END,
    M_AFTER,
    M_QC_OPEN,
    M_QC_FUNC,
    M_QC_NAME,
    M_QC_PARAM,
    M_QC_KEY,
    M_QC_VALUE,
    M_QC_CLOSE,
    M_QC_NEXT,
    M_PY_START,
    M_PY_ITEM,
    M_PY_NAME,
    M_PY_PAREN,
    M_PY_KW,
    M_PY_KWNAME,
    M_PY_EQ,
    M_PY_VALUE,
    M_PY_AFTER,
    M_PY_SEP,
    M_PY_TAIL,
    M_HM_HEAD,
    M_HM_ARGS0,
    M_HM_ARGS,
    M_HM_ARGS_END,
    M_HM_NEXT,
};

/* The pythonic value converter's states. */
enum { PV_VALUE, PV_STR, PV_SCALAR, PV_FIRST, PV_COLON, PV_AFTER, PV_COMMA };

#define MAX_NAME     64 /* tools' names are 1 to 64 characters (tool_calls.c) */
#define PY_MAX_DEPTH 32

#define HM_FINAL "<|start|>assistant<|channel|>final<|message|>"

enum { WAIT = 0, MOVED = 1 }; /* a step: more text is needed, or it went on */

/* Not calls: the text from here on is content (a started call's pieces
 * before pos stay sent). */
static void fail_here(loom_tstream_t *s) {
    if (s->committed) s->sent = s->pos;
    ts_fail(s);
}

static int is_ds(const loom_tstream_t *s) {
    return s->t->fmt == LOOM_TOOLFMT_DEEPSEEK_V3 || s->t->fmt == LOOM_TOOLFMT_DEEPSEEK_V31;
}

/* Whether the text at pos is lit: 1, 0 (no), -1 (it ends inside a prefix of lit). */
static int at_lit(const loom_tstream_t *s, const char *lit) {
    size_t n = strlen(lit), have = s->buf.len - s->pos;
    if (memcmp(s->buf.p + s->pos, lit, LOOM_MIN(n, have)) != 0) return 0;
    return have >= n ? 1 : -1;
}

/* Moves pos past whitespace; 0 when the text ends there. */
static int skip_ws(loom_tstream_t *s) {
    while (s->pos < s->buf.len && ts_is_ws(s->buf.p[s->pos]))
        s->pos++;
    return s->pos < s->buf.len;
}

static const char *find(const loom_tstream_t *s, size_t from, const char *lit) {
    return from < s->buf.len ? memmem(s->buf.p + from, s->buf.len - from, lit, strlen(lit)) : NULL;
}

static void args_str(loom_tstream_t *s, const char *text) {
    loom_sbuf_str(&s->args, text);
}

/* p[0, n) appended as the inside of a JSON string, escaped as cJSON
 * prints strings (so the arguments equal loom_tp_parse's byte for byte). */
static void args_escaped(loom_tstream_t *s, const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        const char *e = c == '"'    ? "\\\""
                        : c == '\\' ? "\\\\"
                        : c == '\b' ? "\\b"
                        : c == '\f' ? "\\f"
                        : c == '\n' ? "\\n"
                        : c == '\r' ? "\\r"
                        : c == '\t' ? "\\t"
                                    : NULL;
        if (e) {
            loom_sbuf_str(&s->args, e);
        } else if (c < 32) {
            loom_sbuf_printf(&s->args, "\\u%04x", c);
        } else {
            size_t k = i;
            while (k < n && (unsigned char)p[k] >= 32 && p[k] != '"' && p[k] != '\\')
                k++;
            loom_sbuf_add(&s->args, p + i, k - i);
            i = k - 1;
        }
    }
}

/* The call named buf[at, at + n) starts (it must be a known tool). */
static int start_call(loom_tstream_t *s, size_t at, size_t n) {
    char *name = loom_xmalloc(n + 1);
    memcpy(name, s->buf.p + at, n);
    name[n] = 0;
    if (!ts_known(s->t, name) || (s->ncalls > 0 && !s->t->parallel)) {
        free(name);
        fail_here(s);
        return -1;
    }
    ts_reset_call(s);
    s->name = name;
    s->in_call = 1;
    ts_commit(s);
    s->mk.nargs = 0;
    return 0;
}

static void end_call(loom_tstream_t *s) {
    ts_flush_args(s);
    ts_reset_call(s);
    s->sent = s->pos;
}

/* One character of a JSON arguments object (DeepSeek, harmony). */
static int json_arg(loom_tstream_t *s) {
    char c = s->buf.p[s->pos];
    int s0 = s->js.st;
    ts_js_step(&s->js, c);
    if (s->js.st == JS_ERR) {
        fail_here(s);
        return -1;
    }
    if (!ts_is_ws(c) || ts_in_string(s0)) loom_sbuf_add(&s->args, &c, 1);
    s->pos++;
    return 0;
}

/* ---- deepseek_v3, deepseek_v31 ---- */

/* A field of a DeepSeek call from tok_at up to term: 1 and *end where term
 * begins; 0 to wait; -1 (failed) when the field runs past MAX_NAME bytes or
 * a call's end comes first. Decided from the field's own text, so the same
 * however the text is cut. */
static int ds_field(loom_tstream_t *s, const char *term, size_t *end) {
    const char *t = find(s, s->mk.tok_at, term), *ce = find(s, s->mk.tok_at, DS_CALL_END);
    size_t at = t ? (size_t)(t - s->buf.p) : s->buf.len;
    size_t room =
        t ? at - s->mk.tok_at
          : s->buf.len - s->mk.tok_at - LOOM_MIN(s->buf.len - s->mk.tok_at, strlen(term) - 1);
    if (room > MAX_NAME || (ce && (size_t)(ce - s->buf.p) < at)) {
        fail_here(s);
        return -1;
    }
    if (!t) return 0;
    *end = at;
    return 1;
}

static int ds_step(loom_tstream_t *s) {
    int v31 = s->t->fmt == LOOM_TOOLFMT_DEEPSEEK_V31;
    ts_marked_t *m = &s->mk;
    switch (m->phase) {
    case M_DS_BEGIN:
        s->pos += strlen(DS_CALLS_BEGIN);
        m->phase = M_DS_ITEM;
        return MOVED;
    case M_DS_ITEM: {
        if (!skip_ws(s)) return WAIT;
        int e = at_lit(s, DS_CALLS_END), b = at_lit(s, DS_CALL_BEGIN);
        if (e > 0 && s->ncalls) {
            s->pos += strlen(DS_CALLS_END);
            s->sent = s->pos;
            m->phase = M_AFTER;
        } else if (b > 0) {
            s->pos += strlen(DS_CALL_BEGIN);
            m->tok_at = s->pos;
            m->phase = v31 ? M_DS_NAME : M_DS_TYPE;
        } else if (e < 0 || b < 0) {
            return WAIT;
        } else {
            fail_here(s);
        }
        return MOVED;
    }
    case M_DS_TYPE:   /* "function", up to <sep> */
    case M_DS_NAME: { /* v3: up to the newline before the fence; v31: up to <sep> */
        const char *term = m->phase == M_DS_NAME && !v31 ? "\n" : DS_SEP;
        size_t end = 0;
        int r = ds_field(s, term, &end);
        if (r <= 0) return r < 0 ? MOVED : WAIT;
        s->pos = end + strlen(term);
        if (m->phase == M_DS_TYPE) {
            m->tok_at = s->pos;
            m->phase = M_DS_NAME;
            return MOVED;
        }
        size_t a = m->tok_at, b = end;
        while (a < b && ts_is_ws(s->buf.p[a]))
            a++;
        while (b > a && ts_is_ws(s->buf.p[b - 1]))
            b--;
        if (start_call(s, a, b - a) < 0) return MOVED;
        m->phase = v31 ? M_DS_ARGS0 : M_DS_FENCE;
        return MOVED;
    }
    case M_DS_FENCE: {
        int r = at_lit(s, "```json\n");
        if (r < 0) return WAIT;
        if (r == 0) {
            fail_here(s);
            return MOVED;
        }
        s->pos += strlen("```json\n");
        m->phase = M_DS_ARGS0;
        return MOVED;
    }
    case M_DS_ARGS0:
    case M_HM_ARGS0:
        if (!skip_ws(s)) return WAIT;
        if (s->buf.p[s->pos] != '{') {
            fail_here(s);
            return MOVED;
        }
        ts_js_start(&s->js);
        m->phase = m->phase == M_DS_ARGS0 ? M_DS_ARGS : M_HM_ARGS;
        return MOVED;
    case M_DS_ARGS:
    case M_HM_ARGS:
        if (s->pos == s->buf.len) return WAIT;
        while (s->pos < s->buf.len && s->js.st != JS_DONE)
            if (json_arg(s) < 0) return MOVED;
        if (s->js.st == JS_DONE) m->phase = m->phase == M_DS_ARGS ? M_DS_ARGS_END : M_HM_ARGS_END;
        return MOVED;
    case M_DS_ARGS_END: {
        if (!skip_ws(s)) return WAIT;
        const char *close = v31 ? DS_CALL_END : "```" DS_CALL_END;
        int r = at_lit(s, close);
        if (r < 0) return WAIT;
        if (r == 0) {
            fail_here(s);
            return MOVED;
        }
        s->pos += strlen(close);
        end_call(s);
        m->phase = M_DS_ITEM;
        return MOVED;
    }
    default: /* M_AFTER: whitespace after the calls is dropped, then content */
        if (!skip_ws(s)) {
            s->sent = s->pos;
            return WAIT;
        }
        s->sent = s->pos;
        s->phase = P_TEXT;
        return MOVED;
    }
}

/* ---- qwen3_coder ---- */

static const cJSON *tool_params(const loom_tools_t *t, const char *name) {
    const cJSON *tool;
    cJSON_ArrayForEach(tool, t->tools) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(tool, "function");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(fn, "name");
        if (cJSON_IsString(nm) && !strcmp(nm->valuestring, name))
            return cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    }
    return NULL;
}

/* Whether the schema types parameter key as a string (or not at all): its
 * value then streams as a JSON string. */
static int string_typed(const cJSON *params, const char *key) {
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(params, "properties");
    const cJSON *type =
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(props, key), "type");
    return !cJSON_IsString(type) || !strcmp(type->valuestring, "string");
}

/* A parameter's value up to "</parameter>": a string's text goes out as it
 * comes, less a last newline and what may begin the close tag. */
static int coder_value(loom_tstream_t *s) {
    ts_marked_t *m = &s->mk;
    static const char close[] = "</parameter>";
    if (m->vfirst) {
        if (s->pos == s->buf.len) return WAIT;
        if (s->buf.p[s->pos] == '\n') s->pos++; /* the value sits on lines of its own */
        m->vfirst = 0;
        m->vat = s->pos;
    }
    const char *c = find(s, s->pos, close);
    size_t end = c ? (size_t)(c - s->buf.p)
                   : s->buf.len - ts_partial_suffix(s->buf.p + s->pos, s->buf.len - s->pos, close);
    if (end > m->vat && end > s->pos && s->buf.p[end - 1] == '\n')
        end--; /* the last newline: held, dropped at the close */
    if (!c) {
        if (!m->typed) {
            args_escaped(s, s->buf.p + s->pos, end - s->pos);
            s->pos = end;
        }
        return WAIT;
    }
    if (m->typed) {
        loom_tp_coder_value(m->params, m->key, s->buf.p + m->vat, end - m->vat, &s->args);
    } else {
        args_escaped(s, s->buf.p + s->pos, end - s->pos);
        args_str(s, "\"");
    }
    s->pos = (size_t)(c - s->buf.p) + strlen(close);
    free(m->key);
    m->key = NULL;
    m->phase = M_QC_PARAM;
    return MOVED;
}

/* Expects lit at pos (after whitespace when ws): moves past it to phase next. */
static int expect(loom_tstream_t *s, int ws, const char *lit, int next) {
    if (ws && !skip_ws(s)) return WAIT;
    int r = at_lit(s, lit);
    if (r < 0) return WAIT;
    if (r == 0) {
        fail_here(s);
        return MOVED;
    }
    s->pos += strlen(lit);
    s->mk.phase = next;
    return MOVED;
}

static int coder_step(loom_tstream_t *s) {
    ts_marked_t *m = &s->mk;
    switch (m->phase) {
    case M_QC_OPEN:
        return expect(s, 0, "<tool_call>", M_QC_FUNC);
    case M_QC_FUNC:
        if (expect(s, 1, "<function=", M_QC_NAME) == WAIT) return WAIT;
        m->tok_at = s->pos;
        return MOVED;
    case M_QC_NAME: {
        const char *gt = memchr(s->buf.p + m->tok_at, '>', s->buf.len - m->tok_at);
        if (!gt) {
            if (s->buf.len - m->tok_at > MAX_NAME) fail_here(s);
            return s->phase == P_TEXT ? MOVED : WAIT;
        }
        s->pos = (size_t)(gt - s->buf.p) + 1;
        if (start_call(s, m->tok_at, (size_t)(gt - s->buf.p) - m->tok_at) < 0) return MOVED;
        m->params = tool_params(s->t, s->name);
        args_str(s, "{");
        m->phase = M_QC_PARAM;
        return MOVED;
    }
    case M_QC_PARAM: {
        if (!skip_ws(s)) return WAIT;
        int p = at_lit(s, "<parameter="), f = at_lit(s, "</function>");
        if (p > 0) {
            s->pos += strlen("<parameter=");
            m->tok_at = s->pos;
            m->phase = M_QC_KEY;
        } else if (f > 0) {
            s->pos += strlen("</function>");
            args_str(s, "}");
            m->phase = M_QC_CLOSE;
        } else if (p < 0 || f < 0) {
            return WAIT;
        } else {
            fail_here(s);
        }
        return MOVED;
    }
    case M_QC_KEY: {
        const char *gt = memchr(s->buf.p + m->tok_at, '>', s->buf.len - m->tok_at);
        if (!gt) return WAIT;
        size_t n = (size_t)(gt - s->buf.p) - m->tok_at;
        m->key = loom_xmalloc(n + 1);
        memcpy(m->key, s->buf.p + m->tok_at, n);
        m->key[n] = 0;
        if (m->nargs++) args_str(s, ",");
        args_str(s, "\"");
        args_escaped(s, m->key, n);
        args_str(s, "\":");
        m->typed = !string_typed(m->params, m->key);
        if (!m->typed) args_str(s, "\"");
        m->vfirst = 1;
        s->pos = (size_t)(gt - s->buf.p) + 1;
        m->phase = M_QC_VALUE;
        return MOVED;
    }
    case M_QC_VALUE:
        return coder_value(s);
    case M_QC_CLOSE:
        if (expect(s, 1, "</tool_call>", M_QC_NEXT) == WAIT) return WAIT;
        if (s->phase != P_TEXT) end_call(s);
        return MOVED;
    default: { /* M_QC_NEXT: another block, or the rest is content */
        if (!skip_ws(s)) return WAIT;
        int r = at_lit(s, "<tool_call>");
        if (r < 0) return WAIT;
        if (r > 0) {
            m->phase = M_QC_OPEN;
        } else {
            s->sent = s->pos;
            s->phase = P_TEXT;
        }
        return MOVED;
    }
    }
}

/* ---- pythonic, llama4_pythonic ---- */

static int py_ident(char c, int first, int kw) {
    return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (!first && ((c >= '0' && c <= '9') || (!kw && (c == '.' || c == '-'))));
}

static int py_scalar_char(char c) {
    return py_ident(c, 0, 0) || c == '+';
}

/* A value complete: the list, tuple or dict around it goes on, or the keyword argument is done. */
static void py_value_done(loom_tstream_t *s) {
    ts_marked_t *m = &s->mk;
    if (m->pkey) {
        m->pkey = 0;
        m->pv = PV_COLON;
    } else if (m->pdepth == 0) {
        m->phase = M_PY_AFTER;
    } else {
        m->pv = PV_AFTER;
    }
}

static void py_close(loom_tstream_t *s) {
    ts_marked_t *m = &s->mk;
    args_str(s, m->pstack[--m->pdepth] == '}' ? "}" : "]");
    s->pos++;
    py_value_done(s);
}

/* A Python string's characters, converted to a JSON string's as they come. */
static int py_string(loom_tstream_t *s) {
    ts_marked_t *m = &s->mk;
    const char *b = s->buf.p;
    while (s->pos < s->buf.len) {
        char c = b[s->pos];
        if (c == m->quote) {
            s->pos++;
            args_str(s, "\"");
            py_value_done(s);
            return MOVED;
        }
        if (c == '\n') {
            fail_here(s);
            return MOVED;
        }
        if (c != '\\') {
            size_t k = s->pos;
            while (k < s->buf.len && b[k] != m->quote && b[k] != '\n' && b[k] != '\\')
                k++;
            args_escaped(s, b + s->pos, k - s->pos);
            s->pos = k;
            continue;
        }
        if (s->pos + 1 == s->buf.len) return WAIT;
        char e = b[s->pos + 1], d = e == 'n' ? '\n' : e == 'r' ? '\r' : e == 't' ? '\t' : e;
        if (e != 'n' && e != 'r' && e != 't' && e != '\\' && e != '\'' && e != '"')
            args_str(s, "\\\\"); /* an escape Python would not take: kept as written */
        args_escaped(s, &d, 1);
        s->pos += 2;
    }
    return WAIT;
}

static int py_value(loom_tstream_t *s) {
    ts_marked_t *m = &s->mk;
    if (m->pv == PV_STR) return py_string(s);
    if (m->pv == PV_SCALAR) { /* a number, True, False, None: converted once complete */
        while (s->pos < s->buf.len && py_scalar_char(s->buf.p[s->pos]))
            s->pos++;
        if (s->pos == s->buf.len) return WAIT;
        if (loom_tp_py_literal(s->buf.p + m->tok_at, s->pos - m->tok_at, &s->args) < 0) {
            fail_here(s);
            return MOVED;
        }
        py_value_done(s);
        return MOVED;
    }
    if (!skip_ws(s)) return WAIT;
    char c = s->buf.p[s->pos], close = m->pdepth ? m->pstack[m->pdepth - 1] : 0;
    switch (m->pv) {
    case PV_COLON:
        if (c != ':') break;
        args_str(s, ":");
        s->pos++;
        m->pv = PV_VALUE;
        return MOVED;
    case PV_AFTER:
        if (c == ',') {
            s->pos++;
            m->pv = PV_COMMA;
            return MOVED;
        }
        if (c != close) break;
        py_close(s);
        return MOVED;
    case PV_FIRST:
    case PV_COMMA:
        if (c == close) { /* empty, or a trailing comma */
            py_close(s);
            return MOVED;
        }
        if (m->pv == PV_COMMA) args_str(s, ",");
        m->pv = PV_VALUE;
        if (close == '}') { /* a dict's key: a string */
            if (c != '"' && c != '\'') break;
            m->pkey = 1;
        }
        return MOVED;
    default: /* PV_VALUE */
        if (m->pdepth + 1 > PY_MAX_DEPTH) break;
        if (c == '"' || c == '\'') {
            m->quote = c;
            args_str(s, "\"");
            s->pos++;
            m->pv = PV_STR;
        } else if (c == '[' || c == '(' || c == '{') {
            m->pstack[m->pdepth++] = c == '[' ? ']' : c == '(' ? ')' : '}';
            args_str(s, c == '{' ? "{" : "[");
            s->pos++;
            m->pv = PV_FIRST;
        } else if (py_scalar_char(c)) {
            m->tok_at = s->pos;
            m->pv = PV_SCALAR;
        } else {
            break;
        }
        return MOVED;
    }
    fail_here(s);
    return MOVED;
}

/* An identifier from tok_at (a function's or a keyword's name): 1 when it
 * has ended. (A keyword fails only where it ends, so that what goes out as
 * content is the same however the text was cut.) */
static int py_ident_end(loom_tstream_t *s, int kw) {
    ts_marked_t *m = &s->mk;
    while (s->pos < s->buf.len && py_ident(s->buf.p[s->pos], s->pos == m->tok_at, kw))
        s->pos++;
    int too_long = !kw && s->pos - m->tok_at > MAX_NAME; /* no tool has that name */
    if (s->pos < s->buf.len && s->pos > m->tok_at && !too_long) return 1;
    if (s->pos < s->buf.len || too_long) fail_here(s);
    return 0;
}

static int py_step(loom_tstream_t *s) {
    ts_marked_t *m = &s->mk;
    switch (m->phase) {
    case M_PY_START:
        if (!skip_ws(s)) return WAIT;
        if (s->t->fmt == LOOM_TOOLFMT_LLAMA4_PYTHONIC && !m->tagged) {
            int r = at_lit(s, "<|python_start|>");
            if (r < 0) return WAIT;
            if (r > 0) {
                s->pos += strlen("<|python_start|>");
                m->tagged = 1;
                return MOVED;
            }
        }
        if (s->buf.p[s->pos] != '[') break;
        s->pos++;
        m->phase = M_PY_ITEM;
        return MOVED;
    case M_PY_ITEM:
        if (!skip_ws(s)) return WAIT;
        m->tok_at = s->pos;
        m->phase = M_PY_NAME;
        return MOVED;
    case M_PY_NAME:
        if (!py_ident_end(s, 0)) return s->phase == P_TEXT ? MOVED : WAIT;
        m->vat = s->pos; /* the name is buf[tok_at, vat) */
        m->phase = M_PY_PAREN;
        return MOVED;
    case M_PY_PAREN:
        if (!skip_ws(s)) return WAIT;
        if (s->buf.p[s->pos] != '(') break;
        s->pos++;
        if (start_call(s, m->tok_at, m->vat - m->tok_at) < 0) return MOVED;
        args_str(s, "{");
        m->phase = M_PY_KW;
        return MOVED;
    case M_PY_KW:
        if (!skip_ws(s)) return WAIT;
        if (s->buf.p[s->pos] == ')') {
            s->pos++;
            args_str(s, "}");
            end_call(s);
            m->phase = M_PY_SEP;
            return MOVED;
        }
        m->tok_at = s->pos;
        m->phase = M_PY_KWNAME;
        return MOVED;
    case M_PY_KWNAME:
        if (!py_ident_end(s, 1)) return s->phase == P_TEXT ? MOVED : WAIT;
        if (m->nargs++) args_str(s, ",");
        args_str(s, "\"");
        loom_sbuf_add(&s->args, s->buf.p + m->tok_at, s->pos - m->tok_at);
        args_str(s, "\":");
        m->phase = M_PY_EQ;
        return MOVED;
    case M_PY_EQ:
        if (!skip_ws(s)) return WAIT;
        if (s->buf.p[s->pos] != '=') break;
        s->pos++;
        m->pv = PV_VALUE;
        m->pdepth = m->pkey = 0;
        m->phase = M_PY_VALUE;
        return MOVED;
    case M_PY_VALUE:
        return py_value(s);
    case M_PY_AFTER:
        if (!skip_ws(s)) return WAIT;
        if (s->buf.p[s->pos] == ',') {
            s->pos++;
            m->phase = M_PY_KW;
            return MOVED;
        }
        if (s->buf.p[s->pos] != ')') break;
        s->pos++;
        args_str(s, "}");
        end_call(s);
        m->phase = M_PY_SEP;
        return MOVED;
    case M_PY_SEP:
        if (!skip_ws(s)) return WAIT;
        if (s->buf.p[s->pos] == ',') {
            s->pos++;
            m->phase = M_PY_ITEM;
            return MOVED;
        }
        if (s->buf.p[s->pos] != ']') break;
        s->pos++;
        s->sent = s->pos;
        m->phase = M_PY_TAIL;
        return MOVED;
    default: /* M_PY_TAIL: the list was the whole answer, less <|python_end|> */
        if (!skip_ws(s)) return WAIT;
        if (m->tagged == 1) {
            int r = at_lit(s, "<|python_end|>");
            if (r < 0) return WAIT;
            if (r > 0) {
                s->pos += strlen("<|python_end|>");
                s->sent = s->pos;
                m->tagged = 2;
                return MOVED;
            }
        }
        break;
    }
    fail_here(s);
    return MOVED;
}

/* ---- openai (GPT-OSS harmony) ---- */

static int harmony_step(loom_tstream_t *s) {
    ts_marked_t *m = &s->mk;
    switch (m->phase) {
    case M_HM_HEAD: {
        size_t at = s->pos, name_at = 0, name_len = 0;
        int r = loom_tp_harmony_header(s->buf.p, s->buf.len, &at, &name_at, &name_len);
        if (r < 0) return WAIT;
        if (r == 0) {
            fail_here(s);
            return MOVED;
        }
        s->pos = at;
        if (name_len > MAX_NAME || start_call(s, name_at, name_len) < 0) {
            if (s->phase != P_TEXT) fail_here(s);
            return MOVED;
        }
        m->phase = M_HM_ARGS0;
        return MOVED;
    }
    case M_HM_ARGS0:
    case M_HM_ARGS:
        return ds_step(s); /* the same JSON arguments */
    case M_HM_ARGS_END:
        if (!skip_ws(s)) return WAIT;
        if (expect(s, 0, "<|call|>", M_HM_NEXT) == WAIT) return WAIT;
        if (s->phase != P_TEXT) end_call(s);
        return MOVED;
    default: { /* M_HM_NEXT: another call, a final message (its text content), or content */
        if (!skip_ws(s)) return WAIT;
        size_t at = s->pos, name_at, name_len;
        int h = loom_tp_harmony_header(s->buf.p, s->buf.len, &at, &name_at, &name_len);
        int f = at_lit(s, HM_FINAL);
        if (h > 0) {
            m->phase = M_HM_HEAD;
        } else if (f > 0) {
            s->pos += strlen(HM_FINAL);
            s->sent = s->pos;
            s->phase = P_TEXT;
        } else if (h < 0 || f < 0) {
            return WAIT;
        } else {
            s->sent = s->pos;
            s->phase = P_TEXT;
        }
        return MOVED;
    }
    }
}

/* ---- the driver ---- */

/* M_SEEK: content up to the calls' start marker (less a suffix that may
 * begin it); from the marker on, the syntax's states. */
static int seek(loom_tstream_t *s) {
    size_t len = s->buf.len - s->sent, maybe = 0;
    loom_toolfmt_t f = s->t->fmt;
    if (!len) return WAIT;
    size_t at = loom_tp_find_start(f, s->buf.p + s->sent, len, &maybe);
    if (at < len) {
        ts_emit_content(s, s->sent, s->sent + at);
        s->sent += at;
        s->pos = s->sent;
        s->mk.phase = is_ds(s)                        ? M_DS_BEGIN
                      : f == LOOM_TOOLFMT_QWEN3_CODER ? M_QC_OPEN
                      : f == LOOM_TOOLFMT_OPENAI      ? M_HM_HEAD
                                                      : M_PY_START;
        return MOVED;
    }
    if ((f == LOOM_TOOLFMT_PYTHONIC || f == LOOM_TOOLFMT_LLAMA4_PYTHONIC) && !maybe) {
        s->phase = P_TEXT; /* the answer is no call list */
        return MOVED;
    }
    ts_emit_content(s, s->sent, s->buf.len - maybe);
    s->sent = s->pos = s->buf.len - maybe;
    return WAIT;
}

static int step(loom_tstream_t *s) {
    int p = s->mk.phase;
    if (p == M_SEEK) return seek(s);
    if (p <= M_AFTER) return ds_step(s);
    if (p <= M_QC_NEXT) return coder_step(s);
    if (p <= M_PY_TAIL) return py_step(s);
    return harmony_step(s);
}

void ts_marked_run(loom_tstream_t *s) {
    while (s->phase != P_TEXT && step(s) == MOVED)
        if (s->committed) s->sent = s->pos;
    if (s->phase != P_TEXT && s->committed) s->sent = s->pos;
    if (s->phase == P_TEXT) {
        ts_emit_content(s, s->sent, s->buf.len);
        s->sent = s->pos = s->buf.len;
    }
}

/* Where the calls may end: the answer is calls if nothing but whitespace
 * (or, after qwen3_coder's blocks and harmony's messages, content) follows. */
static int may_end(loom_tstream_t *s) {
    int p = s->mk.phase;
    if (p == M_QC_NEXT || p == M_HM_NEXT) return 1;
    if (p != M_AFTER && p != M_PY_TAIL && p != M_HM_ARGS_END) return 0;
    skip_ws(s);
    return s->pos == s->buf.len;
}

int ts_marked_finish(loom_tstream_t *s, int complete) {
    ts_marked_run(s);
    if (s->phase != P_TEXT) {
        if (complete && s->ncalls && may_end(s)) {
            if (s->mk.phase == M_HM_ARGS_END) end_call(s); /* its <|call|> stop token left out */
            skip_ws(s);
            ts_emit_content(s, s->pos, s->buf.len);
        } else {
            fail_here(s);
        }
    }
    ts_flush_args(s);
    if (!complete) s->failed = 1;
    s->sent = s->pos = s->buf.len;
    s->phase = P_TEXT;
    if (s->failed || !s->ncalls) return s->ncalls ? LOOM_TS_BROKEN : LOOM_TS_TEXT;
    return s->ncalls;
}
