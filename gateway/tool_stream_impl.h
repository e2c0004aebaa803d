/* Internals of the streaming tool-call reader (tool_stream.h), shared by
 * tool_stream.c (the JSON syntaxes, the events, the strict JSON reader)
 * and tool_marked.c (the marked syntaxes of tool_parsers.h). */
#ifndef LOOM_TOOL_STREAM_IMPL_H
#define LOOM_TOOL_STREAM_IMPL_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "gateway/tool_stream.h"

/* ---- strict incremental JSON (RFC 8259), one character at a time ---- */

#define JS_MAX_DEPTH 64

enum {
    JS_VALUE,
    JS_ARR_FIRST,
    JS_KEY_OR_END,
    JS_KEY,
    JS_COLON,
    JS_AFTER,
    JS_STR,
    JS_ESC,
    JS_HEX,
    JS_NUM,
    JS_LIT,
    JS_DONE,
    JS_ERR
};
enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };

typedef struct {
    int st;          /* JS_* */
    int depth;       /* open containers */
    int key;         /* the string being read is an object key */
    int hex;         /* \u digits still to come */
    int num;         /* N_*: where in a number */
    const char *lit; /* true / false / null being matched */
    int lit_i;
    char stack[JS_MAX_DEPTH]; /* '{' or '[' per open container */
} js_t;

int ts_is_ws(char c);
int ts_in_string(int st);
void ts_js_start(js_t *j);
/* Takes c; j->st becomes JS_ERR when c cannot come here. */
void ts_js_step(js_t *j, char c);

/* ---- the reader ---- */

enum { P_PRE, P_OUT, P_OPEN, P_VALUE, P_CLOSE, P_TRAIL, P_SEMI, P_TEXT };

/* A marked syntax's state (tool_marked.c). */
typedef struct {
    int phase;     /* M_* (tool_marked.c) */
    int tagged;    /* llama4_pythonic: 1 inside <|python_start|>, 2 after <|python_end|> */
    int nargs;     /* the call's arguments so far (qwen3_coder parameters, pythonic keywords) */
    size_t tok_at; /* where the name, key or literal being read starts */
    /* qwen3_coder: the parameter being read */
    const cJSON *params; /* the tool's parameters schema */
    char *key;
    int typed;  /* not a string by the schema: its value is held to the end */
    int vfirst; /* its first character is still to come */
    size_t vat; /* its value starts here */
    /* pythonic: Python literals converted to JSON as they come */
    int pv; /* PV_* */
    int pdepth;
    char pstack[32]; /* the closing bracket of each open list, tuple, dict */
    int pkey;        /* the string being read is a dict key */
    char quote;
} ts_marked_t;

struct loom_tstream {
    const loom_tools_t *t;
    loom_tse_fn emit;
    void *ctx;
    int blocks;       /* hermes: <tool_call> blocks within text */
    int marked;       /* a marked syntax (tool_parsers.h): read by tool_marked.c */
    loom_sbuf_t buf;  /* everything fed, NULs dropped */
    size_t pos, sent; /* scanned up to; out or dropped up to (see the top) */
    int phase;
    int tag_i;      /* PRE: the next tag that may come */
    int close_i;    /* CLOSE: characters of "</tool_call>" matched */
    size_t semi_at; /* SEMI: where the ';' is */
    int after_call; /* OUT: the last thing was a call (whitespace next is dropped) */
    size_t pend_at,
        pend_len; /* OUT: whitespace between content and a call, kept if content follows it */
    int array;    /* the calls are a JSON array */
    int ncalls;   /* calls started */
    int failed;   /* the answer is not calls */
    js_t js;
    int cd; /* depth of a call object's members (0: bare, the value is the arguments) */
    /* the call being read */
    int in_call, role, committed, args_on, have_name, have_args;
    size_t key_at, name_at;
    char *name;       /* read and valid */
    loom_sbuf_t args; /* its arguments so far (whitespace between tokens dropped) */
    size_t args_sent;
    ts_marked_t mk;
};

/* Sends the call's arguments not sent yet. */
void ts_flush_args(loom_tstream_t *s);
/* buf[from, to) as content. */
void ts_emit_content(loom_tstream_t *s, size_t from, size_t to);
void ts_reset_call(loom_tstream_t *s);
/* Not calls after all: what is held goes out, and all that follows. */
void ts_fail(loom_tstream_t *s);
/* 1 when name is a function in tools. */
int ts_known(const loom_tools_t *t, const char *name);
/* The call s->name starts (-1: a second call with parallel_tool_calls false). */
int ts_commit(loom_tstream_t *s);
/* Longest proper prefix of tag that p[0, n) ends with. */
size_t ts_partial_suffix(const char *p, size_t n, const char *tag);

/* The marked syntaxes: what the text fed so far allows to go out; the end. */
void ts_marked_run(loom_tstream_t *s);
int ts_marked_finish(loom_tstream_t *s, int complete);

#endif
