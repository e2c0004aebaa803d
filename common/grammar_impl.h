/* The grammar builder that the front ends (JSON Schema, regex, GBNF) share.
 * A grammar is a list of rules; a rule is a list of alternatives; an
 * alternative is a sequence of elements, each a byte set (a 256-bit class)
 * or a reference to a rule. loom_gb_finish() checks it (undefined rules,
 * left recursion, rules that can never complete), drops alternatives that
 * can never complete and flattens it for the matcher. */
#ifndef LOOM_GRAMMAR_IMPL_H
#define LOOM_GRAMMAR_IMPL_H

#include <stdint.h>

#include "common/grammar.h"

typedef struct loom_gb loom_gb_t;
typedef struct {
    uint8_t b[32];
} loom_gb_set_t;

loom_gb_t *loom_gb_create(void);
void loom_gb_destroy(loom_gb_t **gb_p);
/* A new rule; name NULL gives a generated one. */
int loom_gb_rule(loom_gb_t *gb, const char *name);
/* The rule named so, created undefined if new (a forward reference). */
int loom_gb_rule_named(loom_gb_t *gb, const char *name, size_t len);
const char *loom_gb_rule_name(const loom_gb_t *gb, int rule);
/* Marks a rule defined (a rule with alternatives is defined already). */
void loom_gb_define(loom_gb_t *gb, int rule);
int loom_gb_is_defined(const loom_gb_t *gb, int rule);
/* Starts a new (empty) alternative of rule; elements go to the last one. */
void loom_gb_alt(loom_gb_t *gb, int rule);
void loom_gb_add_set(loom_gb_t *gb, int rule, const loom_gb_set_t *set);
void loom_gb_add_byte(loom_gb_t *gb, int rule, uint8_t c);
void loom_gb_add_lit(loom_gb_t *gb, int rule, const char *s, size_t n);
void loom_gb_add_ref(loom_gb_t *gb, int rule, int ref);
/* A special token: vocabulary id `id` and nothing else matches here (not
 * its text spelled by other tokens); a check of decoded text, where the
 * token was written out, reads text[0..n) in its place. */
void loom_gb_add_token(loom_gb_t *gb, int rule, int32_t id, const char *text, size_t n);
/* Derived rules: R ::= x R | "" ; R ::= x x* ; R ::= x | "" ; x{min,max} (max -1 = unbounded). */
int loom_gb_star(loom_gb_t *gb, int x);
int loom_gb_plus(loom_gb_t *gb, int x);
int loom_gb_opt(loom_gb_t *gb, int x);
int loom_gb_repeat(loom_gb_t *gb, int x, int min, int max);
/* A rule that matches exactly the literal. */
int loom_gb_lit_rule(loom_gb_t *gb, const char *s, size_t n);
/* A rule that matches one UTF-8 character (any code point >= 0x20 except
 * the bytes excluded in `ascii_out`, which may be NULL). */
int loom_gb_utf8_char(loom_gb_t *gb, const loom_gb_set_t *ascii_ok);

static inline void loom_gb_set_add(loom_gb_set_t *s, unsigned c) {
    s->b[c >> 3] = (uint8_t)(s->b[c >> 3] | (1u << (c & 7)));
}
static inline int loom_gb_set_has(const loom_gb_set_t *s, unsigned c) {
    return (s->b[c >> 3] >> (c & 7)) & 1;
}
void loom_gb_set_range(loom_gb_set_t *s, unsigned lo, unsigned hi);

/* Checks and flattens; the builder is consumed (destroyed) either way. */
loom_status_t loom_gb_finish(loom_gb_t **gb_p, int root, loom_grammar_t **out, loom_err_t *err);

/* Adds the rules of a regex (the whole pattern) to gb; returns the rule.
 * json_string: the rule produces the body of a JSON string ('"' and '\'
 * escaped, no control characters). */
loom_status_t loom_regex_to_rule(loom_gb_t *gb, const char *re, size_t len, int json_string,
                                 int *rule, loom_err_t *err);

/* A character class [...] at s[*i] (just after the '['); *i moves past ']'. */
loom_status_t loom_regex_class(loom_gb_t *gb, const char *s, size_t n, size_t *i, int *rule,
                               loom_err_t *err);

/* ---- JSON Schema values inside other markup (json_schema.c; the tool-call
 * grammars of tool_grammar.c build on it). Values are written as JSON, or
 * as Python literals (True/False/None, double-quoted strings with only the
 * escapes \" \\ \n \r \t); no_lt keeps '<' out of strings (markup that '<'
 * would end). Errors stick: after one, every call returns -1 and
 * loom_js_status() gives it (the message in the err given at creation). */
struct cJSON;
typedef enum { LOOM_JS_JSON = 0, LOOM_JS_PYTHON = 1 } loom_js_syntax_t;
typedef struct loom_js loom_js_t;
loom_js_t *loom_js_create(loom_gb_t *gb, loom_js_syntax_t syntax, int no_lt, loom_err_t *err);
void loom_js_destroy(loom_js_t **j_p); /* the builder stays the caller's */
loom_status_t loom_js_status(const loom_js_t *j);
/* Records an error (fmt has one %s, arg); returns -1. */
int loom_js_fail(loom_js_t *j, loom_status_t code, const char *fmt, const char *arg);
/* The rule of a value valid against schema; $refs resolve inside doc. */
int loom_js_schema(loom_js_t *j, const struct cJSON *doc, const struct cJSON *schema);
/* The members of object schema doc in another syntax: each pair pre KEY
 * mid VALUE post, sep between two, the properties in order, the required
 * ones always and the others maybe (no further keys). */
typedef struct loom_js_members {
    const char *pre, *mid, *post, *sep;
    /* the value's rule for property key (NULL: loom_js_schema) */
    int (*value)(loom_js_t *j, const char *key, const struct cJSON *schema, void *ctx);
    void *ctx;
} loom_js_members_t;
int loom_js_members(loom_js_t *j, const struct cJSON *doc, const loom_js_members_t *style);

#endif
