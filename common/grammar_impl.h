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

#endif
