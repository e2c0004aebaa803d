/* Internals of the Jinja engine (common/jinja.h): tokens, the syntax tree,
 * run-time values, the per-render arena and the render context. The lexer
 * (jinja_lex.c) turns text into tokens, the parser (jinja_parse.c) tokens
 * into a tree, the evaluator (jinja_eval.c) walks the tree with values
 * (jinja_value.c) and builtins (jinja_builtins.c). */
#ifndef LOOM_JINJA_IMPL_H
#define LOOM_JINJA_IMPL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/jinja.h"

/* ---- tokens ---- */
typedef enum {
    JT_EOF,
    JT_TEXT,      /* template text between tags (already whitespace-controlled) */
    JT_VAR_BEGIN, /* {{ */
    JT_VAR_END,   /* }} */
    JT_BLOCK_BEGIN,
    JT_BLOCK_END,
    JT_NAME,
    JT_STRING, /* unescaped */
    JT_INT,
    JT_FLOAT,
    JT_OP, /* one of the operator strings; op holds its code */
} loom_jinja_tok_kind_t;

enum {
    JOP_ADD = 1,
    JOP_SUB,
    JOP_MUL,
    JOP_DIV,
    JOP_FLOORDIV,
    JOP_MOD,
    JOP_POW,
    JOP_TILDE,
    JOP_LPAREN,
    JOP_RPAREN,
    JOP_LBRACKET,
    JOP_RBRACKET,
    JOP_LBRACE,
    JOP_RBRACE,
    JOP_COMMA,
    JOP_DOT,
    JOP_COLON,
    JOP_PIPE,
    JOP_ASSIGN,
    JOP_EQ,
    JOP_NE,
    JOP_LT,
    JOP_LE,
    JOP_GT,
    JOP_GE,
    /* not tokens: operators the parser builds */
    JOP_AND,
    JOP_OR,
    JOP_NOT,
    JOP_IN,
    JOP_NOTIN,
    JOP_NEG,
    JOP_POS,
};

typedef struct loom_jinja_tok {
    loom_jinja_tok_kind_t kind;
    int op;
    int line, col;
    const char *s; /* text, name or unescaped string (owned by the template) */
    size_t len;
    int64_t i;
    double f;
} loom_jinja_tok_t;

/* ---- syntax tree ---- */
typedef enum {
    /* statements */
    JN_TEXT,
    JN_OUTPUT,
    JN_IF,
    JN_FOR,
    JN_SET,
    JN_SET_BLOCK,
    JN_MACRO,
    JN_CALL_BLOCK,
    JN_FILTER_BLOCK,
    JN_BREAK,
    JN_CONTINUE,
    JN_BODY,
    /* expressions */
    JN_CONST,
    JN_NAME,
    JN_LIST,
    JN_TUPLE,
    JN_DICT,
    JN_GETATTR,
    JN_GETITEM,
    JN_SLICE,
    JN_CALL,
    JN_FILTER,
    JN_TEST,
    JN_BINOP,
    JN_UNOP,
    JN_COMPARE,
    JN_CONDEXPR,
    JN_CONCAT,
    JN_NSREF, /* ns.attr as an assignment target */
} loom_jinja_node_kind_t;

typedef struct loom_jinja_node loom_jinja_node_t;

typedef struct loom_jinja_nodes {
    loom_jinja_node_t **v;
    int n;
} loom_jinja_nodes_t;

/* A constant, as the parser keeps it (a string constant has no data mark). */
typedef struct loom_jinja_const {
    int type; /* JV_* */
    int64_t i;
    double f;
    const char *s;
    size_t len;
} loom_jinja_const_t;

struct loom_jinja_node {
    loom_jinja_node_kind_t kind;
    int line, col;
    int op;           /* binop/unop/compare operator */
    const char *name; /* NAME, GETATTR attribute, FILTER/TEST name, MACRO name, SET target name */
    size_t name_len;
    loom_jinja_const_t c; /* CONST */
    loom_jinja_node_t *a, *b,
        *c3; /* operands: IF/CONDEXPR test,then,else; GETITEM obj,key; SLICE lo,hi,step */
    loom_jinja_nodes_t args;   /* call/filter/test args (positional), list/tuple/dict items, body */
    loom_jinja_nodes_t kwargs; /* keyword args: each a CONST-named node: name + a = value */
    loom_jinja_nodes_t body, else_body;
    loom_jinja_node_t *target; /* FOR/SET target (NAME, TUPLE or NSREF) */
    loom_jinja_node_t
        *iter; /* FOR iterable; SET value; CALL_BLOCK call; FILTER_BLOCK filter chain */
    loom_jinja_node_t *cond;   /* FOR inline if */
    loom_jinja_nodes_t params; /* MACRO/CALL_BLOCK parameter names (NAME nodes, a = default) */
    bool negate;               /* TEST: is not */
    bool uses_varargs;         /* MACRO/CALL_BLOCK: the body reads varargs (else extra arguments */
    bool uses_kwargs;          /* are errors), or kwargs (else unknown keywords are) */
};

struct loom_jinja {
    char *name;
    loom_jinja_nodes_t body;
    struct loom_jinja_pool *pool; /* every allocation of the compiled template */
};

/* ---- compile-time pool ---- */
typedef struct loom_jinja_pool {
    struct loom_jinja_pool_blk *head;
} loom_jinja_pool_t;
void *loom_jinja_pool_alloc(loom_jinja_pool_t *p, size_t n);
void loom_jinja_pool_free(loom_jinja_pool_t *p);

/* ---- lexer / parser ---- */
typedef struct loom_jinja_lex {
    const char *name;
    char *src; /* newline-normalised copy */
    size_t len, pos;
    int line, col;
    bool in_tag;        /* inside {{ }} or {% %} */
    int tag_kind;       /* JT_VAR_BEGIN or JT_BLOCK_BEGIN */
    bool line_starting; /* the last token ended a line */
    loom_jinja_pool_t *pool;
    loom_jinja_tok_t *toks;
    size_t ntoks, cap;
    loom_err_t *err;
} loom_jinja_lex_t;

loom_status_t loom_jinja_lex_all(loom_jinja_lex_t *lx);
loom_status_t loom_jinja_parse(loom_jinja_t *t, loom_jinja_lex_t *lx, loom_err_t *err);

/* ---- run-time values ---- */
enum {
    JV_UNDEF,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,
    JV_DICT,
    JV_FUNC,
    JV_NS,
    JV_LOOP
};

typedef struct loom_jinja_str loom_jinja_str_t;
typedef struct loom_jinja_list loom_jinja_list_t;
typedef struct loom_jinja_dict loom_jinja_dict_t;
typedef struct loom_jinja_func loom_jinja_func_t;
typedef struct loom_jinja_loop loom_jinja_loop_t;

typedef struct loom_jinja_val {
    int t;
    union {
        bool b;
        int64_t i;
        double f;
        loom_jinja_str_t *s;
        loom_jinja_list_t *l;
        loom_jinja_dict_t *d; /* DICT and NS */
        loom_jinja_func_t *fn;
        loom_jinja_loop_t *loop;
        const char *uname; /* UNDEF: the name that was missing (may be NULL) */
    } u;
} jv_t;

/* A string; its data spans say which bytes came from VARS. */
struct loom_jinja_str {
    const char *p;
    size_t len;
    uint32_t nsp;
    loom_jinja_span_t *sp;
};

struct loom_jinja_list {
    jv_t *v;
    size_t n, cap;
    bool tuple;
    bool range; /* made by range(): prints as range(start, stop[, step]) */
    int64_t r_start, r_stop, r_step;
};

struct loom_jinja_dict {
    jv_t *k, *v;
    size_t n, cap;
};

enum { JF_MACRO, JF_CALLER, JF_GLOBAL, JF_METHOD };
struct loom_jinja_func {
    int kind;
    const loom_jinja_node_t *node;   /* MACRO / CALL_BLOCK */
    struct loom_jinja_scope *scope;  /* defining scope */
    const loom_jinja_node_t *caller; /* MACRO invoked from a call block */
    struct loom_jinja_scope *caller_scope;
    int id;    /* GLOBAL / METHOD id */
    jv_t self; /* METHOD receiver */
};

struct loom_jinja_loop {
    int64_t index0, length;
    jv_t prev, next;
    bool has_prev, has_next;
    jv_t changed_last; /* loop.changed(...)'s last arguments */
    bool changed_seen;
};

/* ---- render context ---- */
typedef struct loom_jinja_arena {
    struct loom_jinja_arena_blk *head;
    size_t used, limit;
} loom_jinja_arena_t;

typedef struct loom_jinja_buf {
    char *p;
    size_t len, cap;
    loom_jinja_span_t *sp;
    size_t nsp, spcap;
} loom_jinja_buf_t;

typedef struct loom_jinja_scope {
    struct loom_jinja_scope *parent;
    jv_t *vals;
    const char **names;
    size_t *lens;
    int n, cap;
    bool captured; /* a macro closed over it: a loop must not reuse it */
} loom_jinja_scope_t;

typedef struct loom_jinja_ctx {
    const loom_jinja_t *t;
    loom_jinja_arena_t arena;
    loom_jinja_buf_t *out; /* current output (set blocks and macros capture) */
    size_t max_output;
    uint64_t steps, max_steps;
    int depth, max_depth;
    loom_err_t *err;
    loom_status_t status;
    jmp_buf jb;
    bool track_spans;
    const void *repr_stack[256]; /* containers being printed (Python prints a cycle as {...}) */
    int repr_depth;
} loom_jinja_ctx_t;

/* Stops the render: sets err and longjmps out. */
_Noreturn void loom_jinja_fail(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at,
                               loom_status_t code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Stops the render for using the undefined value V. */
_Noreturn void loom_jinja_undefined_error(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at,
                                          jv_t v);
_Noreturn void loom_jinja_raise(loom_jinja_ctx_t *cx, const char *msg, size_t len);

void *loom_jinja_alloc(loom_jinja_ctx_t *cx, size_t n);

/* values (jinja_value.c) */
jv_t loom_jinja_undef(const char *name);
jv_t loom_jinja_none(void);
jv_t loom_jinja_bool(bool b);
jv_t loom_jinja_int(int64_t i);
jv_t loom_jinja_float(double f);
jv_t loom_jinja_str(loom_jinja_ctx_t *cx, const char *p, size_t len, bool data);
jv_t loom_jinja_str_c(loom_jinja_ctx_t *cx, const char *p); /* a literal (no data mark) */
jv_t loom_jinja_substr(loom_jinja_ctx_t *cx, const loom_jinja_str_t *s, size_t a, size_t b);
jv_t loom_jinja_list_new(loom_jinja_ctx_t *cx, size_t cap);
void loom_jinja_list_push(loom_jinja_ctx_t *cx, loom_jinja_list_t *l, jv_t v);
jv_t loom_jinja_dict_new(loom_jinja_ctx_t *cx, size_t cap);
void loom_jinja_dict_set(loom_jinja_ctx_t *cx, loom_jinja_dict_t *d, jv_t k, jv_t v);
jv_t *loom_jinja_dict_get(const loom_jinja_dict_t *d, jv_t k);
jv_t *loom_jinja_dict_get_s(const loom_jinja_dict_t *d, const char *k, size_t len);
jv_t loom_jinja_from_json(loom_jinja_ctx_t *cx, const cJSON *j);
bool loom_jinja_truthy(jv_t v);
bool loom_jinja_eq(jv_t a, jv_t b);
int loom_jinja_cmp(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t a, jv_t b);
const char *loom_jinja_type_name(jv_t v);

/* String builder with spans, on malloc (the output) or the arena (temporaries). */
void loom_jinja_buf_put(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, const char *p, size_t n);
void loom_jinja_buf_putc(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, char c);
void loom_jinja_buf_put_str(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, const loom_jinja_str_t *s);
void loom_jinja_buf_printf(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
jv_t loom_jinja_buf_take(loom_jinja_ctx_t *cx,
                         loom_jinja_buf_t *b); /* as a string value; frees b */

/* str(v) as Python prints it (into B), and repr(v). */
void loom_jinja_write_str(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, jv_t v);
void loom_jinja_write_repr(loom_jinja_ctx_t *cx, loom_jinja_buf_t *b, jv_t v);
jv_t loom_jinja_to_str(loom_jinja_ctx_t *cx, jv_t v);
void loom_jinja_write_float(loom_jinja_buf_t *b, loom_jinja_ctx_t *cx, double f);
/* json.dumps(v, ensure_ascii=False, indent, separators, sort_keys) */
void loom_jinja_write_json(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, loom_jinja_buf_t *b,
                           jv_t v, int indent, const char *item_sep, const char *key_sep,
                           bool sort_keys, int level);

/* evaluator (jinja_eval.c) */
jv_t loom_jinja_eval(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc, const loom_jinja_node_t *n);
jv_t loom_jinja_call_value(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc,
                           const loom_jinja_node_t *at, jv_t fn, jv_t *args, int nargs,
                           const char **kwn, jv_t *kwv, int nkw);
jv_t loom_jinja_getattr(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj,
                        const char *name, size_t len);
jv_t loom_jinja_getattr_raw(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj,
                            const char *name, size_t len);
jv_t loom_jinja_getitem(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj, jv_t key);
void loom_jinja_step(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at);
/* The items a for loop or a filter walks: a list value (dict keys, string chars). */
loom_jinja_list_t *loom_jinja_iterate(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t v);

/* builtins (jinja_builtins.c) */
typedef struct loom_jinja_args {
    jv_t *v;
    int n;
    const char **kwn;
    jv_t *kwv;
    int nkw;
} loom_jinja_args_t;
jv_t loom_jinja_filter(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc, const loom_jinja_node_t *at,
                       const char *name, jv_t v, loom_jinja_args_t *a);
bool loom_jinja_test(loom_jinja_ctx_t *cx, loom_jinja_scope_t *sc, const loom_jinja_node_t *at,
                     const char *name, jv_t v, loom_jinja_args_t *a);
bool loom_jinja_has_filter(const char *name);
bool loom_jinja_has_test(const char *name);
/* Method lookup: returns a METHOD function value, or UNDEF when OBJ has no such method. */
jv_t loom_jinja_method(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at, jv_t obj,
                       const char *name, size_t len);
jv_t loom_jinja_call_method(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at,
                            loom_jinja_func_t *fn, loom_jinja_args_t *a);
enum { JG_RANGE = 1, JG_NAMESPACE, JG_DICT, JG_RAISE, JG_STRFTIME, JG_CYCLE, JG_CHANGED };
jv_t loom_jinja_call_global(loom_jinja_ctx_t *cx, const loom_jinja_node_t *at,
                            loom_jinja_func_t *fn, loom_jinja_args_t *a);
int loom_jinja_global_id(const char *name, size_t len);

#endif
