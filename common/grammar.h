/* Constrained decoding: a grammar engine over bytes and tokens.
 *
 * A spec (JSON Schema, "any JSON object", a regex, a list of choices or a
 * GBNF-style grammar) compiles to a context-free grammar over bytes
 * (loom_grammar_t, immutable and shared). A matcher runs the grammar as a
 * pushdown automaton over the bytes of the tokens a sequence accepts and
 * gives, per step, the set of vocabulary tokens that may come next as a bitset.
 *
 * Token masks follow the design of xgrammar's adaptive token mask cache: for
 * a stack top (the top few frames of one automaton stack) the vocabulary is
 * split once into tokens accepted whatever lies below, tokens rejected
 * whatever lies below, and a few uncertain ones that are checked against the
 * full stack at run time. The split is computed on first use and kept in the
 * grammar, so a step costs a bitset copy plus a handful of token checks.
 *
 * Thread safety: a grammar's mask cache is filled lazily; a grammar and the
 * matchers over it must be used from one thread at a time. */
#ifndef LOOM_GRAMMAR_H
#define LOOM_GRAMMAR_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct loom_grammar loom_grammar_t;
typedef struct loom_grammar_vocab loom_grammar_vocab_t;
typedef struct loom_grammar_matcher loom_grammar_matcher_t;
typedef struct loom_grammar_cache loom_grammar_cache_t;
struct loom_tokenizer;

typedef enum loom_grammar_kind {
    LOOM_GRAMMAR_JSON_OBJECT = 1, /* any JSON object (response_format json_object) */
    LOOM_GRAMMAR_JSON_SCHEMA = 2, /* spec: a JSON Schema document */
    LOOM_GRAMMAR_REGEX = 3,       /* spec: a regular expression, matched whole */
    LOOM_GRAMMAR_CHOICE = 4,      /* spec: a JSON array of strings; the output is one of them */
    LOOM_GRAMMAR_EBNF = 5,        /* spec: a GBNF-style grammar with a rule named root */
    LOOM_GRAMMAR_TOOL_CALLS = 6,  /* spec: forced tool calls in a model's syntax (loom_grammar_compile_tool_calls) */
} loom_grammar_kind_t;

/* ---- Compiling (each entry point takes bytes that need not be NUL-terminated;
 * bad input is LOOM_ERR_INVALID_ARGUMENT or LOOM_ERR_UNSUPPORTED with a
 * message naming the problem). */
loom_status_t loom_grammar_compile(loom_grammar_kind_t kind, const char *spec, size_t len,
                                   loom_grammar_t **out, loom_err_t *err);

/* Bounds on one compilation: its time, and the bytes its builder and the
 * compiled grammar hold. Past either, compilation stops adding to the
 * grammar and fails with LOOM_ERR_INVALID_ARGUMENT ("grammar too large" /
 * "too slow to compile"), and hit says which (the caller names its flag). */
typedef struct loom_grammar_limits {
    uint64_t deadline_ns; /* loom_now_ns() past which it gives up (0: none) */
    size_t max_bytes;     /* 0: no bound */
    _Atomic int *stop;    /* non-zero: give up as at the deadline (another thread cancels; NULL: none) */
    int hit;              /* out: LOOM_GRAMMAR_LIMIT_TIME or _BYTES (0: none) */
} loom_grammar_limits_t;
#define LOOM_GRAMMAR_LIMIT_TIME 1
#define LOOM_GRAMMAR_LIMIT_BYTES 2
/* loom_grammar_compile within lim (any thread: compilations share nothing). */
loom_status_t loom_grammar_compile_limited(loom_grammar_kind_t kind, const char *spec, size_t len,
                                           loom_grammar_limits_t *lim, loom_grammar_t **out, loom_err_t *err);
loom_status_t loom_grammar_compile_json_schema(const char *schema, size_t len, loom_grammar_t **out,
                                               loom_err_t *err);
loom_status_t loom_grammar_compile_json_object(loom_grammar_t **out, loom_err_t *err);
loom_status_t loom_grammar_compile_regex(const char *re, size_t len, loom_grammar_t **out,
                                         loom_err_t *err);
loom_status_t loom_grammar_compile_choice(const char *json_array, size_t len, loom_grammar_t **out,
                                          loom_err_t *err);
loom_status_t loom_grammar_compile_ebnf(const char *text, size_t len, loom_grammar_t **out,
                                        loom_err_t *err);
/* Tool calls wrapped in a model's markup (tool_grammar.c): {"begin", "end",
 * "item_begin", "item_end", "sep", "min", "max", "items": [...],
 * "prefixes": [per-item literals], "syntax", "special_tokens"} gives
 * begin item (sep item)* end, item = item_begin call_i item_end. syntax
 * "json" (default): call_i = prefix_i + items[i], a call object's schema;
 * "pythonic" / "qwen3_coder": items[i] = {"name", "parameters"} written as
 * NAME(KEY=value, ...) with Python literals, or as Qwen3-Coder's
 * <function=NAME> block of <parameter=KEY> values. special_tokens
 * {"TEXT": id}: TEXT in the markup is that special token, matched by its id
 * alone (loom_grammar_check, over decoded text, reads it as TEXT). */
loom_status_t loom_grammar_compile_tool_calls(const char *spec, size_t len, loom_grammar_t **out,
                                              loom_err_t *err);
/* Grammars are reference counted: _ref adds a holder, _destroy drops one
 * (and nulls the pointer; safe on NULL and twice). */
loom_grammar_t *loom_grammar_ref(loom_grammar_t *g);
void loom_grammar_destroy(loom_grammar_t **g_p);
int loom_grammar_n_rules(const loom_grammar_t *g);

/* Byte-level check: LOOM_GRAMMAR_MATCH when s is a complete sentence,
 * LOOM_GRAMMAR_PREFIX when it is a proper prefix of one, else REJECT. */
enum { LOOM_GRAMMAR_REJECT = 0, LOOM_GRAMMAR_PREFIX = 1, LOOM_GRAMMAR_MATCH = 2 };
int loom_grammar_check(const loom_grammar_t *g, const char *s, size_t n);

/* ---- Vocabulary: the decoded bytes of every token, sorted. Special tokens
 * and tokens with no bytes are never allowed, except the end tokens (EOS),
 * which are allowed exactly where the grammar accepts, and a grammar's own
 * special tokens, allowed exactly at their elements. */
loom_status_t loom_grammar_vocab_create(const struct loom_tokenizer *tok,
                                        loom_grammar_vocab_t **out, loom_err_t *err);
/* From explicit byte strings (tests; NULL or length 0 = never allowed). */
loom_status_t loom_grammar_vocab_create_bytes(int n_vocab, const char *const *bytes,
                                              const size_t *lens, loom_grammar_vocab_t **out,
                                              loom_err_t *err);
void loom_grammar_vocab_add_eos(loom_grammar_vocab_t *v, int32_t id);
void loom_grammar_vocab_destroy(loom_grammar_vocab_t **v_p);
int loom_grammar_vocab_size(const loom_grammar_vocab_t *v);
/* Words (uint32) in a token mask: bit id%32 of word id/32 is token id. */
size_t loom_grammar_mask_words(const loom_grammar_vocab_t *v);
/* The token's bytes (NULL for specials and empty tokens). */
const char *loom_grammar_vocab_bytes(const loom_grammar_vocab_t *v, int32_t id, size_t *len);

/* ---- Matching. The matcher holds a reference to the grammar. */
loom_status_t loom_grammar_matcher_create(loom_grammar_t *g, const loom_grammar_vocab_t *v,
                                          loom_grammar_matcher_t **out, loom_err_t *err);
void loom_grammar_matcher_destroy(loom_grammar_matcher_t **m_p);
void loom_grammar_matcher_reset(loom_grammar_matcher_t *m);
/* Writes the allowed next tokens into mask (loom_grammar_mask_words words). */
void loom_grammar_matcher_fill_mask(loom_grammar_matcher_t *m, uint32_t *mask);
/* Advances by one token; a token the grammar does not allow is
 * LOOM_ERR_INVALID_ARGUMENT and leaves the state unchanged. An EOS token is
 * allowed when the grammar accepts; after it the matcher is terminated. */
loom_status_t loom_grammar_matcher_accept_token(loom_grammar_matcher_t *m, int32_t id);
/* Rebuilds the state from the tokens accepted so far (after a re-prefill):
 * reset, then accept each; stops at the first refused token. */
loom_status_t loom_grammar_matcher_replay(loom_grammar_matcher_t *m, const int32_t *ids, int n);
/* Makes dst's state that of src (both made over the same grammar and
 * vocabulary, else INVALID_ARGUMENT): dst can then be advanced through
 * tokens not yet accepted (speculative drafts) while src stays put. */
loom_status_t loom_grammar_matcher_copy(loom_grammar_matcher_t *dst, const loom_grammar_matcher_t *src);
/* Advances by raw bytes (tests and choice/prefix checks). */
loom_status_t loom_grammar_matcher_accept_bytes(loom_grammar_matcher_t *m, const char *s, size_t n);
int loom_grammar_matcher_can_finish(const loom_grammar_matcher_t *m);    /* grammar accepts here */
int loom_grammar_matcher_is_terminated(const loom_grammar_matcher_t *m); /* EOS accepted */
/* Number of tokens accepted since the last reset. */
int loom_grammar_matcher_n_accepted(const loom_grammar_matcher_t *m);

/* ---- Cache of compiled grammars keyed by (kind, spec bytes) hash. */
loom_grammar_cache_t *loom_grammar_cache_create(int capacity);
void loom_grammar_cache_destroy(loom_grammar_cache_t **c_p);
/* Returns a new reference to the cached or freshly compiled grammar. */
loom_status_t loom_grammar_cache_get(loom_grammar_cache_t *c, loom_grammar_kind_t kind,
                                     const char *spec, size_t len, loom_grammar_t **out,
                                     loom_err_t *err);
void loom_grammar_cache_stats(const loom_grammar_cache_t *c, uint64_t *hits, uint64_t *misses);
/* The same in two halves, for compiling elsewhere (another thread): lookup
 * gives a new reference and returns 1 on a hit, 0 on a miss (not counted:
 * the caller counts it with _miss); put keeps its own reference to g. */
int loom_grammar_cache_lookup(loom_grammar_cache_t *c, loom_grammar_kind_t kind, const char *spec, size_t len,
                              loom_grammar_t **out);
void loom_grammar_cache_put(loom_grammar_cache_t *c, loom_grammar_kind_t kind, const char *spec, size_t len,
                            loom_grammar_t *g);
void loom_grammar_cache_miss(loom_grammar_cache_t *c);
/* Bounds the cache in bytes besides entries (0: no bound): the least recently
 * used entries go until a new one fits; one larger than the bound alone is
 * used but not kept. _bytes: what the entries hold now (spec copies, the
 * grammars and their mask caches as they have grown). */
void loom_grammar_cache_set_max_bytes(loom_grammar_cache_t *c, size_t max_bytes);
size_t loom_grammar_cache_bytes(const loom_grammar_cache_t *c);
/* A compiled grammar's bytes in memory (its mask cache included). */
size_t loom_grammar_bytes(const loom_grammar_t *g);

#endif
