/* The grammar engine: the builder the front ends share, the checks that make
 * a grammar safe to run, the pushdown automaton over bytes, token masks with
 * their per-stack-top cache, and the cache of compiled grammars.
 *
 * Automaton. A stack is a chain of nodes (pos, parent) in an append-only
 * arena; pos indexes the flattened element array: the top node's pos is the
 * byte set to match next, a lower node's pos is where its rule resumes when
 * the rule above it ends (a reference in tail position pushes nothing, so
 * repetition does not grow the stack). The state is a set of stacks (the
 * grammar may be ambiguous), kept closed: every top is at a byte set. Parent
 * ROOT below the bottom means the whole grammar may end there (ACCEPT);
 * parent UNKNOWN is used when classifying tokens from a stack top whose lower
 * frames are not known (ESC: the bottom rule ended, what follows is context).
 *
 * Special tokens. A token element (K_TOK) stands for one vocabulary id,
 * which the matcher takes only there: no byte matches it, so a byte-spelled
 * alternative of its text is never allowed, and a stack whose top is at it
 * allows exactly that id in the mask (it never reaches the mask cache).
 * Checking decoded text (loom_grammar_check, where the token was written
 * out) reads the element as a reference to a rule of its text instead
 * (lg_walk_t.text_mode).
 *
 * Invariants (established by loom_gb_finish): no left recursion, so closure
 * terminates; every alternative kept can complete, so a live state can
 * always reach ACCEPT. */
#include "common/grammar_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"
#include "common/util.h"

/* ------------------------------------------------------------------------ */
/* Elements                                                                 */

#define K_TOK      0u /* a special token: value indexes the grammar's token table */
#define K_SET      1u
#define K_REF      2u
#define K_END      3u
#define EL(k, v)   (((uint32_t)(k) << 30) | (uint32_t)(v))
#define EL_KIND(e) ((e) >> 30)
#define EL_VAL(e)  ((e)&0x3FFFFFFFu)

#define P_ROOT   (-1)
#define P_UNK    (-2)
#define F_ACCEPT 1
#define F_ESC    2

#define KEY_DEPTH        4    /* stack frames in a mask-cache key */
#define MAX_STATE_STACKS 4096 /* an ambiguous grammar beyond this is refused at run time */
#define MAX_REPEAT       4096

/* ------------------------------------------------------------------------ */
/* Builder                                                                  */

typedef struct {
    uint32_t *e;
    int n, cap;
} gb_alt_t;

typedef struct {
    int32_t id; /* vocabulary id */
    int rule;   /* a rule matching its text (for checks of decoded text) */
} gb_tok_t;

typedef struct {
    char *name;
    gb_alt_t *alts;
    int n_alts, cap_alts;
    int defined;
} gb_rule_t;

struct loom_gb {
    gb_rule_t *rules;
    int n_rules, cap_rules;
    int *by_name; /* open addressing over rule names: rule id + 1, 0 empty (cap_by_name a power of 2) */
    size_t cap_by_name;
    loom_grammar_limits_t *lim; /* this compilation's bounds (NULL: none) */
    size_t bytes;               /* what the builder holds, roughly */
    uint64_t n_push;            /* elements pushed: the clock (and the stop flag) is read every 4Ki */
    int over;                   /* past a bound: nothing more is added */
    loom_gb_set_t *sets;
    int n_sets, cap_sets;
    gb_tok_t *toks; /* the special tokens K_TOK elements index */
    int n_toks, cap_toks;
};

/* The bounds of the compilation running on this thread (set by
 * loom_grammar_compile_limited for the length of one call): the builders
 * are made deep inside each compiler, which need not know of them. */
static _Thread_local loom_grammar_limits_t *tl_limits;

loom_gb_t *loom_gb_create(void) {
    loom_gb_t *gb = loom_xcalloc(1, sizeof *gb);
    gb->lim = tl_limits;
    return gb;
}

/* Counts bytes added (and now and then the time) against the bounds. */
static int gb_over(loom_gb_t *gb, size_t add) {
    if (gb->over) return 1;
    gb->bytes += add;
    if (!gb->lim) return 0;
    if (gb->lim->max_bytes && gb->bytes > gb->lim->max_bytes) gb->over = LOOM_GRAMMAR_LIMIT_BYTES;
    else if ((++gb->n_push & 0xFFF) == 0 && ((gb->lim->stop && atomic_load(gb->lim->stop)) ||
                                               (gb->lim->deadline_ns && loom_now_ns() > gb->lim->deadline_ns)))
        gb->over = LOOM_GRAMMAR_LIMIT_TIME;
    return gb->over != 0;
}

void loom_gb_destroy(loom_gb_t **gb_p) {
    if (!gb_p || !*gb_p) return;
    loom_gb_t *gb = *gb_p;
    for (int i = 0; i < gb->n_rules; i++) {
        for (int a = 0; a < gb->rules[i].n_alts; a++)
            free(gb->rules[i].alts[a].e);
        free(gb->rules[i].alts);
        free(gb->rules[i].name);
    }
    free(gb->rules);
    free(gb->by_name);
    free(gb->sets);
    free(gb->toks);
    free(gb);
    *gb_p = NULL;
}

static uint64_t name_hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

/* The slot of name in by_name: its rule's, or the empty one where it goes. */
static size_t name_slot(const loom_gb_t *gb, const char *name, size_t len) {
    size_t mask = gb->cap_by_name - 1, i = (size_t)name_hash(name, len) & mask;
    for (;; i = (i + 1) & mask) {
        int id = gb->by_name[i] - 1;
        if (id < 0) return i;
        const char *rn = gb->rules[id].name;
        if (strlen(rn) == len && memcmp(rn, name, len) == 0) return i;
    }
}

/* Indexes rule id by its name (the first rule of a name keeps it). */
static void name_index(loom_gb_t *gb, int id) {
    if ((size_t)gb->n_rules * 2 > gb->cap_by_name) { /* grow and rehash: load stays under 1/2 */
        int *old = gb->by_name;
        size_t old_cap = gb->cap_by_name;
        gb->cap_by_name = old_cap ? old_cap * 2 : 128;
        gb->by_name = loom_xcalloc(gb->cap_by_name, sizeof *gb->by_name);
        for (size_t i = 0; i < old_cap; i++)
            if (old[i]) gb->by_name[name_slot(gb, gb->rules[old[i] - 1].name, strlen(gb->rules[old[i] - 1].name))] = old[i];
        free(old);
    }
    const char *n = gb->rules[id].name;
    size_t s = name_slot(gb, n, strlen(n));
    if (!gb->by_name[s]) gb->by_name[s] = id + 1;
}

int loom_gb_rule(loom_gb_t *gb, const char *name) {
    gb_over(gb, sizeof(gb_rule_t) + 2 * sizeof(int) + 16);
    if (gb->n_rules == gb->cap_rules) {
        gb->cap_rules = gb->cap_rules ? gb->cap_rules * 2 : 64;
        gb->rules = loom_xrealloc(gb->rules, (size_t)gb->cap_rules * sizeof *gb->rules);
    }
    int id = gb->n_rules++;
    gb_rule_t *r = &gb->rules[id];
    memset(r, 0, sizeof *r);
    if (name) {
        r->name = loom_xstrdup(name);
    } else {
        char buf[32];
        snprintf(buf, sizeof buf, "_r%d", id);
        r->name = loom_xstrdup(buf);
        r->defined = 1;
    }
    name_index(gb, id);
    return id;
}

int loom_gb_rule_named(loom_gb_t *gb, const char *name, size_t len) {
    if (gb->cap_by_name) {
        int id = gb->by_name[name_slot(gb, name, len)] - 1;
        if (id >= 0) return id;
    }
    char *s = loom_xmalloc(len + 1);
    memcpy(s, name, len);
    s[len] = 0;
    int id = loom_gb_rule(gb, s);
    free(s);
    return id;
}

const char *loom_gb_rule_name(const loom_gb_t *gb, int rule) {
    return gb->rules[rule].name;
}
void loom_gb_define(loom_gb_t *gb, int rule) {
    gb->rules[rule].defined = 1;
}
int loom_gb_is_defined(const loom_gb_t *gb, int rule) {
    return gb->rules[rule].defined;
}

void loom_gb_alt(loom_gb_t *gb, int rule) {
    gb_rule_t *r = &gb->rules[rule];
    if (r->n_alts == r->cap_alts) {
        r->cap_alts = r->cap_alts ? r->cap_alts * 2 : 2;
        r->alts = loom_xrealloc(r->alts, (size_t)r->cap_alts * sizeof *r->alts);
    }
    memset(&r->alts[r->n_alts++], 0, sizeof(gb_alt_t));
    r->defined = 1;
}

static void gb_push(loom_gb_t *gb, int rule, uint32_t e) {
    if (gb_over(gb, sizeof e)) return;
    gb_rule_t *r = &gb->rules[rule];
    if (r->n_alts == 0) loom_gb_alt(gb, rule);
    gb_alt_t *a = &r->alts[r->n_alts - 1];
    if (a->n == a->cap) {
        a->cap = a->cap ? a->cap * 2 : 8;
        a->e = loom_xrealloc(a->e, (size_t)a->cap * sizeof *a->e);
    }
    a->e[a->n++] = e;
}

static int gb_set_id(loom_gb_t *gb, const loom_gb_set_t *s) {
    for (int i = gb->n_sets - 1; i >= 0; i--)
        if (memcmp(gb->sets[i].b, s->b, 32) == 0) return i;
    if (gb->n_sets == gb->cap_sets) {
        gb->cap_sets = gb->cap_sets ? gb->cap_sets * 2 : 64;
        gb->sets = loom_xrealloc(gb->sets, (size_t)gb->cap_sets * sizeof *gb->sets);
    }
    gb->sets[gb->n_sets] = *s;
    return gb->n_sets++;
}

void loom_gb_set_range(loom_gb_set_t *s, unsigned lo, unsigned hi) {
    for (unsigned c = lo; c <= hi && c < 256; c++)
        loom_gb_set_add(s, c);
}

void loom_gb_add_set(loom_gb_t *gb, int rule, const loom_gb_set_t *set) {
    gb_push(gb, rule, EL(K_SET, gb_set_id(gb, set)));
}
void loom_gb_add_byte(loom_gb_t *gb, int rule, uint8_t c) {
    loom_gb_set_t s = {{0}};
    loom_gb_set_add(&s, c);
    loom_gb_add_set(gb, rule, &s);
}
void loom_gb_add_lit(loom_gb_t *gb, int rule, const char *s, size_t n) {
    if (gb->rules[rule].n_alts == 0) loom_gb_alt(gb, rule);
    for (size_t i = 0; i < n; i++)
        loom_gb_add_byte(gb, rule, (uint8_t)s[i]);
}
void loom_gb_add_ref(loom_gb_t *gb, int rule, int ref) {
    gb_push(gb, rule, EL(K_REF, ref));
}
void loom_gb_add_token(loom_gb_t *gb, int rule, int32_t id, const char *text, size_t n) {
    int k = 0;
    while (k < gb->n_toks && gb->toks[k].id != id)
        k++;
    if (k == gb->n_toks) {
        if (gb->n_toks == gb->cap_toks) {
            gb->cap_toks = gb->cap_toks ? gb->cap_toks * 2 : 4;
            gb->toks = loom_xrealloc(gb->toks, (size_t)gb->cap_toks * sizeof *gb->toks);
        }
        gb->toks[k].id = id;
        gb->toks[k].rule = loom_gb_lit_rule(gb, text, n);
        gb->n_toks++;
    }
    if (gb->rules[rule].n_alts == 0) loom_gb_alt(gb, rule);
    gb_push(gb, rule, EL(K_TOK, k));
}

/* Adds to rule r each alternative of x followed by a reference to tail;
 * an alternative that is a lone reference is opened up in place (so x*
 * of a choice of byte sequences runs as one flat loop, no stack frames). */
static void copy_alts(loom_gb_t *gb, int r, int x, int tail, int depth) {
    int n_alts = gb->rules[x].n_alts;
    for (int a = 0; a < n_alts; a++) {
        int n = gb->rules[x].alts[a].n;
        uint32_t first = n ? gb->rules[x].alts[a].e[0] : 0;
        if (n == 1 && EL_KIND(first) == K_REF && depth < 4 && gb->rules[EL_VAL(first)].n_alts > 0 &&
            (int)EL_VAL(first) != x) {
            copy_alts(gb, r, (int)EL_VAL(first), tail, depth + 1);
            continue;
        }
        uint32_t *tmp = loom_xmalloc((size_t)n * sizeof *tmp + 1);
        if (n) memcpy(tmp, gb->rules[x].alts[a].e, (size_t)n * sizeof *tmp);
        loom_gb_alt(gb, r);
        for (int i = 0; i < n; i++)
            gb_push(gb, r, tmp[i]);
        gb_push(gb, r, EL(K_REF, tail));
        free(tmp);
    }
}

int loom_gb_star(loom_gb_t *gb, int x) {
    int r = loom_gb_rule(gb, NULL);
    if (gb->rules[x].n_alts > 0) {
        copy_alts(gb, r, x, r, 0);
    } else { /* x not defined yet (a forward reference) */
        loom_gb_alt(gb, r);
        loom_gb_add_ref(gb, r, x);
        loom_gb_add_ref(gb, r, r);
    }
    loom_gb_alt(gb, r);
    return r;
}
int loom_gb_plus(loom_gb_t *gb, int x) {
    int s = loom_gb_star(gb, x);
    int r = loom_gb_rule(gb, NULL);
    loom_gb_alt(gb, r);
    loom_gb_add_ref(gb, r, x);
    loom_gb_add_ref(gb, r, s);
    return r;
}
int loom_gb_opt(loom_gb_t *gb, int x) {
    int r = loom_gb_rule(gb, NULL);
    loom_gb_alt(gb, r);
    loom_gb_add_ref(gb, r, x);
    loom_gb_alt(gb, r);
    return r;
}
int loom_gb_repeat(loom_gb_t *gb, int x, int min, int max) {
    if (min < 0) min = 0;
    if (min > MAX_REPEAT) min = MAX_REPEAT;
    if (max >= 0 && max > MAX_REPEAT) max = MAX_REPEAT;
    /* tail: the optional part, x{0,max-min} as nested options or x* */
    int tail = -1;
    if (max < 0) {
        tail = loom_gb_star(gb, x);
    } else {
        for (int k = 0; k < max - min; k++) {
            int r = loom_gb_rule(gb, NULL);
            loom_gb_alt(gb, r);
            loom_gb_add_ref(gb, r, x);
            if (tail >= 0) loom_gb_add_ref(gb, r, tail);
            loom_gb_alt(gb, r);
            tail = r;
        }
    }
    int r = loom_gb_rule(gb, NULL);
    loom_gb_alt(gb, r);
    for (int k = 0; k < min; k++)
        loom_gb_add_ref(gb, r, x);
    if (tail >= 0) loom_gb_add_ref(gb, r, tail);
    return r;
}
int loom_gb_lit_rule(loom_gb_t *gb, const char *s, size_t n) {
    int r = loom_gb_rule(gb, NULL);
    loom_gb_alt(gb, r);
    loom_gb_add_lit(gb, r, s, n);
    return r;
}

int loom_gb_utf8_char(loom_gb_t *gb, const loom_gb_set_t *ascii_ok) {
    int r = loom_gb_rule(gb, NULL);
    loom_gb_set_t a = {{0}}, cont = {{0}}, s;
    if (ascii_ok) {
        a = *ascii_ok;
        for (unsigned c = 0x80; c < 256; c++)
            a.b[c >> 3] = (uint8_t)(a.b[c >> 3] & ~(1u << (c & 7)));
    } else {
        loom_gb_set_range(&a, 0x20, 0x7F);
    }
    loom_gb_set_range(&cont, 0x80, 0xBF);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &a);
    /* 2 bytes: C2..DF cont */
    memset(&s, 0, sizeof s);
    loom_gb_set_range(&s, 0xC2, 0xDF);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &s);
    loom_gb_add_set(gb, r, &cont);
    /* 3 bytes: E0 A0..BF cont | E1..EC cont cont | ED 80..9F cont | EE..EF cont cont */
    loom_gb_set_t e0 = {{0}}, a0bf = {{0}}, e1ec = {{0}}, ed = {{0}}, x809f = {{0}}, eeef = {{0}};
    loom_gb_set_add(&e0, 0xE0);
    loom_gb_set_range(&a0bf, 0xA0, 0xBF);
    loom_gb_set_range(&e1ec, 0xE1, 0xEC);
    loom_gb_set_add(&ed, 0xED);
    loom_gb_set_range(&x809f, 0x80, 0x9F);
    loom_gb_set_range(&eeef, 0xEE, 0xEF);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &e0);
    loom_gb_add_set(gb, r, &a0bf);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &e1ec);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &ed);
    loom_gb_add_set(gb, r, &x809f);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &eeef);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_add_set(gb, r, &cont);
    /* 4 bytes: F0 90..BF cont cont | F1..F3 cont cont cont | F4 80..8F cont cont */
    loom_gb_set_t f0 = {{0}}, x90bf = {{0}}, f1f3 = {{0}}, f4 = {{0}}, x808f = {{0}};
    loom_gb_set_add(&f0, 0xF0);
    loom_gb_set_range(&x90bf, 0x90, 0xBF);
    loom_gb_set_range(&f1f3, 0xF1, 0xF3);
    loom_gb_set_add(&f4, 0xF4);
    loom_gb_set_range(&x808f, 0x80, 0x8F);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &f0);
    loom_gb_add_set(gb, r, &x90bf);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &f1f3);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_alt(gb, r);
    loom_gb_add_set(gb, r, &f4);
    loom_gb_add_set(gb, r, &x808f);
    loom_gb_add_set(gb, r, &cont);
    loom_gb_add_set(gb, r, &cont);
    return r;
}

/* ------------------------------------------------------------------------ */
/* Compiled grammar                                                         */

typedef struct mask_entry {
    uint32_t key[KEY_DEPTH];
    uint8_t depth, trunc;
    uint8_t rej_mode; /* ids lists rejected tokens (others accepted) */
    int32_t *ids;
    int n_ids;
    int32_t *unc; /* sorted-vocabulary indices to check against the full stack */
    int n_unc;
} mask_entry_t;

typedef struct {
    uint32_t pos;
    int32_t parent;
} lg_node_t;

typedef struct {
    lg_node_t *v;
    int n, cap;
} lg_arena_t;

typedef struct {
    int32_t *v;
    int n, cap;
} ivec_t;

typedef struct {
    int32_t *top;
    int n, cap;
    int flags;
} lg_set_t;

/* A "flat" state of a token walk: every stack is one frame over the walk's
 * base (the nodes that existed when it started), so it can be stored by
 * value and its transitions memoized: a string body or a digit run then
 * costs one table lookup per byte. */
typedef struct {
    int n, flags, off, len; /* tops; their chains are fpool[off .. off+len) */
    uint32_t hash;
    int32_t next[256]; /* flat state after the byte; -1 unknown, -2 not flat */
} lg_flat_t;

#define MAX_FLAT   2048
#define FLAT_CHAIN 3 /* frames above the base a memoized stack may have */

/* A closure's visited (pos, parent) pairs are scanned linearly while few;
 * past SEEN_LINEAR they also go in an open-addressed table (stamped with
 * a generation, so starting a closure clears nothing): a deep chain of
 * rules visits thousands of nodes, and the scan was quadratic in them. */
#define SEEN_LINEAR 64
#define SEEN_BITS   13 /* 8192 slots: at most half full under MAX_STATE_STACKS */

/* Scratch for closure and token walks. */
typedef struct {
    ivec_t work, visited;
    uint64_t *seen_key; /* (1 << SEEN_BITS), allocated at the first large closure */
    uint32_t *seen_gen; /* a slot holds a key of this closure when it equals gen */
    uint32_t gen;
    int seen_on;        /* this closure's pairs are in the table */
    lg_set_t *sets; /* per depth */
    int *mark;      /* arena size after sets[d] was made */
    uint8_t *unc;
    int *flat;    /* flat state id of sets[d], or -1 */
    uint8_t *mat; /* sets[d].top holds its nodes (a flat state may not) */
    int depth_cap;
    lg_flat_t *ft;
    int n_ft;
    lg_node_t *fpool; /* the stacks of the flat states, by value */
    int n_fpool, cap_fpool;
    lg_node_t *fscr; /* an encoding being built */
    int cap_fscr;
    int text_mode; /* token elements match their text (checks of decoded text) */
} lg_walk_t;

struct loom_grammar {
    int refs;
    int n_rules;
    char **names;
    uint32_t *elems;
    int n_elems;
    int32_t *rule_alt0; /* alternatives of rule r: alt_pos[rule_alt0[r] .. rule_alt0[r+1]) */
    int32_t *alt_pos;
    loom_gb_set_t *sets;
    int n_sets;
    int32_t *elem_rule;
    loom_gb_set_t *follow; /* bytes that may follow each rule */
    int root;
    gb_tok_t *toks; /* K_TOK elements' ids and text rules */
    int n_toks;
    /* mask cache, for one vocabulary */
    const loom_grammar_vocab_t *cv;
    mask_entry_t **tab;
    uint32_t tab_cap, tab_n;
    lg_arena_t parena;
    lg_walk_t pwalk;
};

struct loom_grammar_vocab {
    int n_vocab;
    size_t n_words;
    char **bytes; /* per id, NULL = never allowed; into pool, in sorted order */
    char *pool;
    uint32_t *len;
    int32_t *sorted; /* ids with bytes, sorted by bytes */
    int n_sorted;
    uint32_t *eligible;     /* bitset of the sorted ids */
    uint16_t *lcp;          /* lcp[i]: common prefix of sorted tokens i-1 and i (capped at 65535) */
    int32_t group_end[256]; /* first sorted index whose first byte is above b */
    int32_t *eos;
    int n_eos;
    int max_len;
};

struct loom_grammar_matcher {
    loom_grammar_t *g;
    const loom_grammar_vocab_t *v;
    lg_arena_t arena;
    int live_n, compact_at;
    lg_set_t cur, tmp;
    lg_walk_t walk;
    int terminated;
    int n_accepted;
    uint32_t *tmp_mask;
    uint8_t *res;
    int res_cap;
};

static void ivec_push(ivec_t *v, int32_t x) {
    if (v->n == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 64;
        v->v = loom_xrealloc(v->v, (size_t)v->cap * sizeof *v->v);
    }
    v->v[v->n++] = x;
}

static void set_push(lg_set_t *s, int32_t x) {
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 16;
        s->top = loom_xrealloc(s->top, (size_t)s->cap * sizeof *s->top);
    }
    s->top[s->n++] = x;
}

static void set_copy(lg_set_t *dst, const lg_set_t *src) {
    dst->n = 0;
    for (int i = 0; i < src->n; i++)
        set_push(dst, src->top[i]);
    dst->flags = src->flags;
}

static inline int32_t node_new(lg_arena_t *a, uint32_t pos, int32_t parent) {
    if (a->n == a->cap) {
        a->cap = a->cap ? a->cap * 2 : 1024;
        a->v = loom_xrealloc(a->v, (size_t)a->cap * sizeof *a->v);
    }
    a->v[a->n].pos = pos;
    a->v[a->n].parent = parent;
    return a->n++;
}

static void walk_free(lg_walk_t *w) {
    free(w->work.v);
    free(w->visited.v);
    free(w->seen_key);
    free(w->seen_gen);
    for (int d = 0; d < w->depth_cap; d++)
        free(w->sets[d].top);
    free(w->sets);
    free(w->mark);
    free(w->unc);
    free(w->flat);
    free(w->mat);
    free(w->ft);
    free(w->fpool);
    free(w->fscr);
    memset(w, 0, sizeof *w);
}

static void walk_reserve(lg_walk_t *w, int depth) {
    if (depth + 1 <= w->depth_cap) return;
    int nc = depth + 1;
    w->sets = loom_xrealloc(w->sets, (size_t)nc * sizeof *w->sets);
    memset(w->sets + w->depth_cap, 0, (size_t)(nc - w->depth_cap) * sizeof *w->sets);
    w->mark = loom_xrealloc(w->mark, (size_t)nc * sizeof *w->mark);
    w->unc = loom_xrealloc(w->unc, (size_t)nc);
    w->flat = loom_xrealloc(w->flat, (size_t)nc * sizeof *w->flat);
    w->mat = loom_xrealloc(w->mat, (size_t)nc);
    w->depth_cap = nc;
}

static inline uint64_t seen_key(uint32_t pos, int32_t parent) {
    return (uint64_t)pos << 32 | (uint32_t)parent;
}

/* Inserts key unless present; returns whether it was present. */
static int seen_insert(lg_walk_t *w, uint64_t key) {
    const uint32_t mask = (1u << SEEN_BITS) - 1;
    uint32_t i = (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - SEEN_BITS));
    for (;; i = (i + 1) & mask) {
        if (w->seen_gen[i] != w->gen) {
            w->seen_gen[i] = w->gen;
            w->seen_key[i] = key;
            return 0;
        }
        if (w->seen_key[i] == key) return 1;
    }
}

/* Moves this closure's visited pairs into the table (a fresh generation). */
static void seen_start(lg_walk_t *w, const lg_arena_t *a) {
    if (!w->seen_key) {
        w->seen_key = loom_xmalloc(sizeof *w->seen_key << SEEN_BITS);
        w->seen_gen = loom_xcalloc((size_t)1 << SEEN_BITS, sizeof *w->seen_gen);
    }
    if (++w->gen == 0) { /* wrapped: forget every stamp */
        memset(w->seen_gen, 0, sizeof *w->seen_gen << SEEN_BITS);
        w->gen = 1;
    }
    for (int i = 0; i < w->visited.n; i++) {
        const lg_node_t *o = &a->v[w->visited.v[i]];
        seen_insert(w, seen_key(o->pos, o->parent));
    }
    w->seen_on = 1;
}

/* Closes the nodes queued in w->work into out (tops at byte sets + flags).
 * Returns -1 when the state grows past MAX_STATE_STACKS. */
static int closure(const loom_grammar_t *g, lg_arena_t *a, lg_walk_t *w, lg_set_t *out) {
    w->visited.n = 0;
    w->seen_on = 0;
    while (w->work.n) {
        int32_t id = w->work.v[--w->work.n];
        uint32_t pos = a->v[id].pos;
        int32_t parent = a->v[id].parent;
        int seen = 0;
        if (w->seen_on) {
            seen = seen_insert(w, seen_key(pos, parent));
        } else {
            for (int i = 0; i < w->visited.n; i++) {
                const lg_node_t *o = &a->v[w->visited.v[i]];
                if (o->pos == pos && o->parent == parent) {
                    seen = 1;
                    break;
                }
            }
        }
        if (seen) continue;
        if (w->visited.n >= MAX_STATE_STACKS) return -1;
        ivec_push(&w->visited, id);
        if (!w->seen_on && w->visited.n >= SEEN_LINEAR) seen_start(w, a);
        uint32_t e = g->elems[pos];
        int kind = (int)EL_KIND(e);
        if (kind == K_TOK && w->text_mode) { /* the token written out: its text */
            kind = K_REF;
            e = EL(K_REF, g->toks[EL_VAL(e)].rule);
        }
        switch (kind) {
        case K_TOK:
        case K_SET:
            set_push(out, id);
            break;
        case K_REF: {
            int r = (int)EL_VAL(e);
            int32_t ret =
                EL_KIND(g->elems[pos + 1]) == K_END ? parent : node_new(a, pos + 1, parent);
            for (int k = g->rule_alt0[r]; k < g->rule_alt0[r + 1]; k++)
                ivec_push(&w->work, node_new(a, (uint32_t)g->alt_pos[k], ret));
            break;
        }
        default: /* END */
            if (parent == P_ROOT)
                out->flags |= F_ACCEPT;
            else if (parent == P_UNK)
                out->flags |= F_ESC;
            else
                ivec_push(&w->work, parent);
            break;
        }
    }
    return 0;
}

/* out = the state after byte c from in. */
static int advance(const loom_grammar_t *g, lg_arena_t *a, lg_walk_t *w, const lg_set_t *in,
                   unsigned c, lg_set_t *out) {
    out->n = 0;
    out->flags = 0;
    w->work.n = 0;
    for (int i = 0; i < in->n; i++) {
        const lg_node_t *nd = &a->v[in->top[i]];
        uint32_t e = g->elems[nd->pos];
        if (EL_KIND(e) == K_SET && loom_gb_set_has(&g->sets[EL_VAL(e)], c)) {
            uint32_t pos = nd->pos + 1;
            int32_t parent = nd->parent;
            ivec_push(&w->work, node_new(a, pos, parent));
        }
    }
    return closure(g, a, w, out);
}

/* out = the state after special token id from in (the stacks at its element). */
static int advance_token(const loom_grammar_t *g, lg_arena_t *a, lg_walk_t *w, const lg_set_t *in,
                         int32_t id, lg_set_t *out) {
    out->n = 0;
    out->flags = 0;
    w->work.n = 0;
    for (int i = 0; i < in->n; i++) {
        const lg_node_t *nd = &a->v[in->top[i]];
        uint32_t e = g->elems[nd->pos];
        if (EL_KIND(e) == K_TOK && g->toks[EL_VAL(e)].id == id)
            ivec_push(&w->work, node_new(a, nd->pos + 1, nd->parent));
    }
    return closure(g, a, w, out);
}

/* The initial state: the root's alternatives over ROOT. */
static int initial_state(const loom_grammar_t *g, lg_arena_t *a, lg_walk_t *w, lg_set_t *out) {
    out->n = 0;
    out->flags = 0;
    w->work.n = 0;
    for (int k = g->rule_alt0[g->root]; k < g->rule_alt0[g->root + 1]; k++)
        ivec_push(&w->work, node_new(a, (uint32_t)g->alt_pos[k], P_ROOT));
    return closure(g, a, w, out);
}

/* ------------------------------------------------------------------------ */
/* Finishing: checks and flattening                                         */

static loom_status_t gb_check_refs(loom_gb_t *gb, loom_err_t *err) {
    for (int i = 0; i < gb->n_rules; i++) {
        if (!gb->rules[i].defined)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "grammar: undefined rule '%s'",
                                gb->rules[i].name);
    }
    return LOOM_OK;
}

static int set_empty(const loom_gb_set_t *s) {
    for (int i = 0; i < 32; i++)
        if (s->b[i]) return 0;
    return 1;
}

/* Left recursion: some rule reached from r reaches itself without consuming
 * a byte. Depth-first on an explicit stack of (rule, alternative, element)
 * frames, at most one per rule (stk: 3 x n_rules ints): a chain of
 * thousands of rules must not exhaust the thread's stack. state: 0 unseen,
 * 1 on the stack, 2 done. */
static int left_dfs(const loom_gb_t *gb, const uint8_t *nullable, int r, uint8_t *state, int *culprit,
                    int *stk) {
    int sp = 1;
    stk[0] = r, stk[1] = 0, stk[2] = 0;
    state[r] = 1;
    while (sp > 0) {
        int *f = &stk[3 * (sp - 1)];
        const gb_rule_t *R = &gb->rules[f[0]];
        if (f[1] >= R->n_alts) { /* every alternative seen */
            state[f[0]] = 2;
            sp--;
            continue;
        }
        const gb_alt_t *A = &R->alts[f[1]];
        if (f[2] >= A->n || EL_KIND(A->e[f[2]]) != K_REF) { /* this alternative consumes a byte here */
            f[1]++, f[2] = 0;
            continue;
        }
        int x = (int)EL_VAL(A->e[f[2]]);
        if (state[x] == 1) {
            *culprit = x;
            return 1;
        }
        if (nullable[x]) f[2]++; /* what follows x may come first too */
        else f[1]++, f[2] = 0;
        if (state[x] == 0) {
            state[x] = 1;
            int *nf = &stk[3 * sp++];
            nf[0] = x, nf[1] = 0, nf[2] = 0;
        }
    }
    return 0;
}

static void set_or(loom_gb_set_t *d, const loom_gb_set_t *s) {
    for (int b = 0; b < 32; b++) d->b[b] |= s->b[b];
}

typedef struct {
    int *from, *to;
    int n, cap;
} edges_t;

static void edge_add(edges_t *e, int from, int to) {
    if (e->n == e->cap) {
        e->cap = e->cap ? e->cap * 2 : 256;
        e->from = loom_xrealloc(e->from, (size_t)e->cap * sizeof *e->from);
        e->to = loom_xrealloc(e->to, (size_t)e->cap * sizeof *e->to);
    }
    e->from[e->n] = from, e->to[e->n++] = to;
}

/* sets[to] |= sets[from] along every edge until nothing changes: a worklist
 * of the rules whose set grew (each grows at most 256 times). */
static void propagate(loom_gb_set_t *sets, int n, const edges_t *e) {
    int *e0 = loom_xcalloc((size_t)n + 2, sizeof *e0), *out = loom_xmalloc(((size_t)e->n + 1) * sizeof *out);
    for (int i = 0; i < e->n; i++) e0[e->from[i] + 1]++;
    for (int x = 0; x < n; x++) e0[x + 1] += e0[x];
    int *fill = loom_xmalloc(((size_t)n + 1) * sizeof *fill);
    memcpy(fill, e0, (size_t)n * sizeof *fill);
    for (int i = 0; i < e->n; i++) out[fill[e->from[i]]++] = e->to[i];
    int *queue = loom_xmalloc(((size_t)n + 1) * sizeof *queue); /* a ring: each rule in it at most once */
    uint8_t *in = loom_xcalloc((size_t)n + 1, 1);
    int head = 0, len = 0;
    for (int x = 0; x < n; x++)
        if (e0[x + 1] > e0[x]) queue[len++] = x, in[x] = 1;
    while (len > 0) {
        int x = queue[head];
        head = (head + 1) % n, len--;
        in[x] = 0;
        for (int o = e0[x]; o < e0[x + 1]; o++) {
            loom_gb_set_t *d = &sets[out[o]];
            int grew = 0;
            for (int b = 0; b < 32; b++) {
                uint8_t nb = (uint8_t)(d->b[b] | sets[x].b[b]);
                if (nb != d->b[b]) d->b[b] = nb, grew = 1;
            }
            if (grew && !in[out[o]]) {
                queue[(head + len) % n] = out[o], len++;
                in[out[o]] = 1;
            }
        }
    }
    free(in);
    free(queue);
    free(fill);
    free(out);
    free(e0);
}

/* Nullable and productive rules, in time linear in the grammar (a fixpoint
 * over all rules took a pass per level of a deep schema: quadratic). Each
 * alternative counts the references it still waits for; a rule that becomes
 * nullable (productive) pays its occurrences, and an alternative whose count
 * reaches 0 makes its rule so. A byte set makes an alternative never
 * nullable; an empty one, never productive. */
static void nullable_productive(const loom_gb_t *gb, uint8_t *nullable, uint8_t *productive) {
    int n = gb->n_rules, n_alts = 0, n_occ = 0;
    for (int r = 0; r < n; r++) {
        n_alts += gb->rules[r].n_alts;
        for (int a = 0; a < gb->rules[r].n_alts; a++)
            for (int i = 0; i < gb->rules[r].alts[a].n; i++) n_occ += EL_KIND(gb->rules[r].alts[a].e[i]) == K_REF;
    }
    int *alt_rule = loom_xmalloc(((size_t)n_alts + 1) * sizeof *alt_rule);
    int *need_nul = loom_xmalloc(((size_t)n_alts + 1) * sizeof *need_nul); /* -1: never */
    int *need_prod = loom_xmalloc(((size_t)n_alts + 1) * sizeof *need_prod);
    int *occ0 = loom_xcalloc((size_t)n + 2, sizeof *occ0); /* occurrences of rule x: occ[occ0[x] .. occ0[x+1]) */
    int *occ = loom_xmalloc(((size_t)n_occ + 1) * sizeof *occ);
    int *queue = loom_xmalloc(((size_t)n * 2 + 1) * sizeof *queue);
    for (int r = 0, k = 0; r < n; r++)
        for (int a = 0; a < gb->rules[r].n_alts; a++, k++) {
            const gb_alt_t *A = &gb->rules[r].alts[a];
            alt_rule[k] = r;
            need_nul[k] = need_prod[k] = 0;
            for (int i = 0; i < A->n; i++) {
                uint32_t e = A->e[i];
                if (EL_KIND(e) == K_TOK) {
                    need_nul[k] = -1;
                } else if (EL_KIND(e) == K_SET) {
                    need_nul[k] = -1;
                    if (set_empty(&gb->sets[EL_VAL(e)])) need_prod[k] = -1;
                } else {
                    occ0[EL_VAL(e) + 1]++;
                    if (need_nul[k] >= 0) need_nul[k]++;
                    if (need_prod[k] >= 0) need_prod[k]++;
                }
            }
        }
    for (int x = 0; x < n; x++) occ0[x + 1] += occ0[x];
    int *fill = loom_xmalloc(((size_t)n + 1) * sizeof *fill);
    memcpy(fill, occ0, (size_t)n * sizeof *fill);
    for (int r = 0, k = 0; r < n; r++)
        for (int a = 0; a < gb->rules[r].n_alts; a++, k++)
            for (int i = 0; i < gb->rules[r].alts[a].n; i++) {
                uint32_t e = gb->rules[r].alts[a].e[i];
                if (EL_KIND(e) == K_REF) occ[fill[EL_VAL(e)]++] = k;
            }
    for (int pass = 0; pass < 2; pass++) { /* 0: nullable, 1: productive */
        uint8_t *done = pass ? productive : nullable;
        int *need = pass ? need_prod : need_nul;
        int head = 0, tail = 0;
        for (int k = 0; k < n_alts; k++)
            if (need[k] == 0 && !done[alt_rule[k]]) done[alt_rule[k]] = 1, queue[tail++] = alt_rule[k];
        while (head < tail) {
            int x = queue[head++];
            for (int o = occ0[x]; o < occ0[x + 1]; o++) {
                int k = occ[o];
                if (need[k] > 0 && --need[k] == 0 && !done[alt_rule[k]])
                    done[alt_rule[k]] = 1, queue[tail++] = alt_rule[k];
            }
        }
    }
    free(fill);
    free(queue);
    free(occ);
    free(occ0);
    free(need_prod);
    free(need_nul);
    free(alt_rule);
}

/* The error for a compilation past its bounds (sets lim->hit). */
static loom_status_t over_error(loom_grammar_limits_t *lim, int why, size_t bytes, loom_err_t *err) {
    lim->hit = why;
    if (why == LOOM_GRAMMAR_LIMIT_BYTES)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "grammar too large: compiling it passed the limit of %zu bytes (reached %zu)",
                            lim->max_bytes, bytes);
    return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "grammar too slow to compile: it passed its time limit");
}

loom_status_t loom_gb_finish(loom_gb_t **gb_p, int root, loom_grammar_t **out, loom_err_t *err) {
    loom_gb_t *gb = *gb_p;
    if (gb->over) {
        loom_status_t st = over_error(gb->lim, gb->over, gb->bytes, err);
        loom_gb_destroy(gb_p);
        *out = NULL;
        return st;
    }
    loom_status_t st = gb_check_refs(gb, err);
    int n = gb->n_rules;
    uint8_t *nullable = loom_xcalloc((size_t)n, 1);
    uint8_t *productive = loom_xcalloc((size_t)n, 1);
    uint8_t *state = loom_xcalloc((size_t)n, 1);
    loom_grammar_t *g = NULL;
    if (st < 0) goto done;
    nullable_productive(gb, nullable, productive);
    if (!productive[root]) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "grammar: no finite output satisfies it (unsatisfiable, or recursion "
                          "that cannot terminate)");
        goto done;
    }
    int *stk = loom_xmalloc((size_t)n * 3 * sizeof *stk + 3 * sizeof *stk);
    for (int r = 0; r < n; r++) {
        int culprit = -1;
        if (state[r] == 0 && left_dfs(gb, nullable, r, state, &culprit, stk)) {
            free(stk);
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "grammar: rule '%s' is left-recursive (or repeats something that "
                              "can be empty)",
                              gb->rules[culprit].name);
            goto done;
        }
    }
    free(stk);
    /* flatten, keeping only productive alternatives */
    g = loom_xcalloc(1, sizeof *g);
    g->refs = 1;
    g->n_rules = n;
    g->root = root;
    g->names = loom_xcalloc((size_t)n, sizeof *g->names);
    g->rule_alt0 = loom_xcalloc((size_t)n + 1, sizeof *g->rule_alt0);
    int n_alts = 0, n_elems = 0;
    for (int r = 0; r < n; r++) {
        n_alts += gb->rules[r].n_alts;
        for (int a = 0; a < gb->rules[r].n_alts; a++)
            n_elems += gb->rules[r].alts[a].n + 1;
    }
    g->alt_pos = loom_xcalloc((size_t)n_alts + 1, sizeof *g->alt_pos);
    g->elems = loom_xcalloc((size_t)n_elems + 1, sizeof *g->elems);
    g->elem_rule = loom_xcalloc((size_t)n_elems + 1, sizeof *g->elem_rule);
    int ka = 0, ke = 0;
    for (int r = 0; r < n; r++) {
        g->names[r] = loom_xstrdup(gb->rules[r].name);
        g->rule_alt0[r] = ka;
        const gb_rule_t *R = &gb->rules[r];
        for (int a = 0; a < R->n_alts; a++) {
            int prod = 1;
            for (int i = 0; i < R->alts[a].n; i++) {
                uint32_t e = R->alts[a].e[i];
                if (EL_KIND(e) == K_SET   ? set_empty(&gb->sets[EL_VAL(e)])
                    : EL_KIND(e) == K_REF ? !productive[EL_VAL(e)]
                                          : 0)
                    prod = 0;
            }
            if (!prod) continue;
            g->alt_pos[ka++] = ke;
            for (int i = 0; i < R->alts[a].n; i++) {
                g->elem_rule[ke] = r;
                g->elems[ke++] = R->alts[a].e[i];
            }
            g->elem_rule[ke] = r;
            g->elems[ke++] = EL(K_END, 0);
        }
    }
    g->rule_alt0[n] = ka;
    g->n_elems = ke;
    g->n_sets = gb->n_sets;
    g->sets = loom_xcalloc((size_t)gb->n_sets + 1, sizeof *g->sets);
    if (gb->n_sets) memcpy(g->sets, gb->sets, (size_t)gb->n_sets * sizeof *g->sets);
    g->n_toks = gb->n_toks;
    g->toks = loom_xmalloc(((size_t)gb->n_toks + 1) * sizeof *g->toks);
    if (gb->n_toks) memcpy(g->toks, gb->toks, (size_t)gb->n_toks * sizeof *g->toks);
    /* FIRST and FOLLOW sets over bytes: the byte sets each gets directly,
     * then propagated along edges by a worklist (first: from a rule in an
     * alternative's nullable prefix to the alternative's rule; follow: from
     * a rule to one whose occurrence ends its alternative, up to nullables) */
    loom_gb_set_t *first = loom_xcalloc((size_t)n, sizeof *first);
    g->follow = loom_xcalloc((size_t)n, sizeof *g->follow);
    edges_t ed = {0};
    for (int r = 0; r < n; r++)
        for (int k = g->rule_alt0[r]; k < g->rule_alt0[r + 1]; k++)
            for (int p = g->alt_pos[k]; EL_KIND(g->elems[p]) != K_END; p++) {
                uint32_t e = g->elems[p];
                if (EL_KIND(e) == K_SET) {
                    set_or(&first[r], &g->sets[EL_VAL(e)]);
                    break;
                }
                if (EL_KIND(e) == K_TOK) break; /* no byte comes first: the token is taken by id */
                edge_add(&ed, (int)EL_VAL(e), r);
                if (!nullable[EL_VAL(e)]) break;
            }
    propagate(first, n, &ed);
    ed.n = 0;
    for (int r = 0; r < n; r++)
        for (int k = g->rule_alt0[r]; k < g->rule_alt0[r + 1]; k++)
            for (int p = g->alt_pos[k]; EL_KIND(g->elems[p]) != K_END; p++) {
                if (EL_KIND(g->elems[p]) != K_REF) continue;
                int x = (int)EL_VAL(g->elems[p]);
                int q = p + 1;
                for (; EL_KIND(g->elems[q]) != K_END; q++) {
                    uint32_t e = g->elems[q];
                    if (EL_KIND(e) == K_TOK) break; /* no byte follows x here */
                    set_or(&g->follow[x], EL_KIND(e) == K_SET ? &g->sets[EL_VAL(e)] : &first[EL_VAL(e)]);
                    if (EL_KIND(e) == K_SET || !nullable[EL_VAL(e)]) break;
                }
                if (EL_KIND(g->elems[q]) == K_END) edge_add(&ed, r, x);
            }
    propagate(g->follow, n, &ed);
    free(ed.from);
    free(ed.to);
    free(first);
    *out = g;
done:
    free(nullable);
    free(productive);
    free(state);
    loom_gb_destroy(gb_p);
    return st;
}

/* ------------------------------------------------------------------------ */
/* Grammar lifetime and byte checks                                         */

static void cache_clear(loom_grammar_t *g) {
    for (uint32_t i = 0; i < g->tab_cap; i++) {
        if (!g->tab[i]) continue;
        free(g->tab[i]->ids);
        free(g->tab[i]->unc);
        free(g->tab[i]);
    }
    free(g->tab);
    g->tab = NULL;
    g->tab_cap = g->tab_n = 0;
    g->cv = NULL;
}

loom_grammar_t *loom_grammar_ref(loom_grammar_t *g) {
    if (g) g->refs++;
    return g;
}

void loom_grammar_destroy(loom_grammar_t **g_p) {
    if (!g_p || !*g_p) return;
    loom_grammar_t *g = *g_p;
    *g_p = NULL;
    if (--g->refs > 0) return;
    cache_clear(g);
    for (int i = 0; i < g->n_rules; i++)
        free(g->names[i]);
    free(g->names);
    free(g->elems);
    free(g->rule_alt0);
    free(g->alt_pos);
    free(g->sets);
    free(g->elem_rule);
    free(g->follow);
    free(g->toks);
    free(g->parena.v);
    walk_free(&g->pwalk);
    free(g);
}

size_t loom_grammar_bytes(const loom_grammar_t *g) {
    if (!g) return 0;
    size_t n = (size_t)g->n_rules, b = sizeof *g;
    for (size_t i = 0; i < n; i++) b += sizeof *g->names + strlen(g->names[i]) + 1;
    b += ((size_t)g->n_elems + 1) * (sizeof *g->elems + sizeof *g->elem_rule);
    b += (n + 1) * sizeof *g->rule_alt0 + ((size_t)g->rule_alt0[n] + 1) * sizeof *g->alt_pos;
    b += ((size_t)g->n_sets + 1) * sizeof *g->sets + n * sizeof *g->follow;
    b += ((size_t)g->n_toks + 1) * sizeof *g->toks;
    b += (size_t)g->tab_cap * sizeof *g->tab; /* the mask cache, as it has grown so far */
    for (uint32_t i = 0; i < g->tab_cap; i++)
        if (g->tab[i])
            b += sizeof *g->tab[i] + ((size_t)g->tab[i]->n_ids + (size_t)g->tab[i]->n_unc) * sizeof(int32_t);
    b += (size_t)g->parena.cap * sizeof *g->parena.v;
    return b;
}

int loom_grammar_n_rules(const loom_grammar_t *g) {
    return g ? g->n_rules : 0;
}

int loom_grammar_check(const loom_grammar_t *g, const char *s, size_t n) {
    lg_arena_t a = {0};
    lg_walk_t w = {0};
    lg_set_t x = {0}, y = {0};
    int res = LOOM_GRAMMAR_REJECT;
    w.text_mode = 1;
    if (initial_state(g, &a, &w, &x) < 0) goto done;
    for (size_t i = 0; i < n; i++) {
        if (advance(g, &a, &w, &x, (unsigned char)s[i], &y) < 0) goto done;
        lg_set_t t = x;
        x = y;
        y = t;
        if (x.n == 0 && !(x.flags & F_ACCEPT)) goto done;
        if (x.n == 0 && i + 1 < n) goto done;
    }
    res = (x.flags & F_ACCEPT) ? LOOM_GRAMMAR_MATCH
          : x.n                ? LOOM_GRAMMAR_PREFIX
                               : LOOM_GRAMMAR_REJECT;
done:
    free(a.v);
    free(x.top);
    free(y.top);
    walk_free(&w);
    return res;
}

/* ------------------------------------------------------------------------ */
/* Vocabulary                                                               */

typedef struct {
    const unsigned char *b;
    uint32_t len;
    int32_t id;
} sort_item_t;

static int cmp_tokens(const void *pa, const void *pb) {
    const sort_item_t *a = pa, *b = pb;
    int c = memcmp(a->b, b->b, a->len < b->len ? a->len : b->len);
    if (c) return c;
    if (a->len != b->len) return a->len < b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static loom_status_t vocab_finish(loom_grammar_vocab_t *v) {
    v->n_words = ((size_t)v->n_vocab + 31) / 32;
    v->eligible = loom_xcalloc(v->n_words ? v->n_words : 1, sizeof *v->eligible);
    v->sorted = loom_xcalloc((size_t)v->n_vocab + 1, sizeof *v->sorted);
    sort_item_t *it = loom_xmalloc(((size_t)v->n_vocab + 1) * sizeof *it);
    for (int i = 0; i < v->n_vocab; i++) {
        if (!v->bytes[i]) continue;
        it[v->n_sorted].b = (const unsigned char *)v->bytes[i];
        it[v->n_sorted].len = v->len[i];
        it[v->n_sorted++].id = i;
        v->eligible[i / 32] |= 1u << (i % 32);
        if ((int)v->len[i] > v->max_len) v->max_len = (int)v->len[i];
    }
    qsort(it, (size_t)v->n_sorted, sizeof *it, cmp_tokens);
    v->lcp = loom_xcalloc((size_t)v->n_sorted + 1, sizeof *v->lcp);
    for (int i = 0; i < v->n_sorted; i++) {
        v->sorted[i] = it[i].id;
        if (i > 0) {
            uint32_t m = it[i].len < it[i - 1].len ? it[i].len : it[i - 1].len, l = 0;
            while (l < m && l < 65535 && it[i].b[l] == it[i - 1].b[l])
                l++;
            v->lcp[i] = (uint16_t)l;
        }
    }
    for (int b = 0, i = 0; b < 256; b++) {
        while (i < v->n_sorted && it[i].b[0] <= b)
            i++;
        v->group_end[b] = i;
    }
    size_t total = 0;
    for (int i = 0; i < v->n_sorted; i++)
        total += it[i].len;
    v->pool = loom_xmalloc(total + 1);
    for (size_t i = 0, off = 0; i < (size_t)v->n_sorted; i++) {
        int32_t id = it[i].id;
        memcpy(v->pool + off, v->bytes[id], v->len[id]);
        free(v->bytes[id]);
        v->bytes[id] = v->pool + off;
        off += v->len[id];
    }
    free(it);
    return LOOM_OK;
}

loom_status_t loom_grammar_vocab_create_bytes(int n_vocab, const char *const *bytes,
                                              const size_t *lens, loom_grammar_vocab_t **out,
                                              loom_err_t *err) {
    if (n_vocab <= 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "grammar: empty vocabulary");
    loom_grammar_vocab_t *v = loom_xcalloc(1, sizeof *v);
    v->n_vocab = n_vocab;
    v->bytes = loom_xcalloc((size_t)n_vocab, sizeof *v->bytes);
    v->len = loom_xcalloc((size_t)n_vocab, sizeof *v->len);
    for (int i = 0; i < n_vocab; i++) {
        if (!bytes[i] || lens[i] == 0) continue;
        v->bytes[i] = loom_xmalloc(lens[i]);
        memcpy(v->bytes[i], bytes[i], lens[i]);
        v->len[i] = (uint32_t)lens[i];
    }
    vocab_finish(v);
    *out = v;
    return LOOM_OK;
}

loom_status_t loom_grammar_vocab_create(const loom_tokenizer_t *tok, loom_grammar_vocab_t **out,
                                        loom_err_t *err) {
    int n = loom_tokenizer_vocab_size(tok);
    if (n <= 0) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "grammar: empty vocabulary");
    const char **b = loom_xcalloc((size_t)n, sizeof *b);
    size_t *l = loom_xcalloc((size_t)n, sizeof *l);
    for (int i = 0; i < n; i++) {
        if (loom_tokenizer_is_special(tok, i)) continue;
        b[i] = loom_tokenizer_token_bytes(tok, i, &l[i]);
    }
    loom_status_t st = loom_grammar_vocab_create_bytes(n, b, l, out, err);
    free(b);
    free(l);
    if (st < 0) return st;
    int eos = loom_tokenizer_eos_id(tok);
    if (eos >= 0) loom_grammar_vocab_add_eos(*out, eos);
    return LOOM_OK;
}

void loom_grammar_vocab_add_eos(loom_grammar_vocab_t *v, int32_t id) {
    if (!v || id < 0 || id >= v->n_vocab) return;
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] == id) return;
    v->eos = loom_xrealloc(v->eos, (size_t)(v->n_eos + 1) * sizeof *v->eos);
    v->eos[v->n_eos++] = id;
}

void loom_grammar_vocab_destroy(loom_grammar_vocab_t **v_p) {
    if (!v_p || !*v_p) return;
    loom_grammar_vocab_t *v = *v_p;
    free(v->pool);
    free(v->bytes);
    free(v->len);
    free(v->sorted);
    free(v->lcp);
    free(v->eligible);
    free(v->eos);
    free(v);
    *v_p = NULL;
}

int loom_grammar_vocab_size(const loom_grammar_vocab_t *v) {
    return v ? v->n_vocab : 0;
}
size_t loom_grammar_mask_words(const loom_grammar_vocab_t *v) {
    return v ? v->n_words : 0;
}
const char *loom_grammar_vocab_bytes(const loom_grammar_vocab_t *v, int32_t id, size_t *len) {
    if (!v || id < 0 || id >= v->n_vocab || !v->bytes[id]) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = v->len[id];
    return v->bytes[id];
}

static int is_eos(const loom_grammar_vocab_t *v, int32_t id) {
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] == id) return 1;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Token walks                                                              */

enum { T_REJ = 0, T_ACC = 1, T_UNC = 2 };

/* The flat state id of s (interned), or -1 when it is not memoizable: each
 * stack is encoded by value as {chain length k, the node it rests on}
 * followed by its k positions from the top, k <= FLAT_CHAIN frames above
 * the walk's base (nodes below base_n, which a walk never drops). Equal
 * stacks are kept once. */
static int flat_intern(lg_walk_t *w, const lg_arena_t *a, const lg_set_t *s, int base_n) {
    int need = s->n * (FLAT_CHAIN + 1);
    if (need > w->cap_fscr) {
        w->cap_fscr = need * 2 + 16;
        w->fscr = loom_xrealloc(w->fscr, (size_t)w->cap_fscr * sizeof *w->fscr);
    }
    int len = 0, n = 0;
    for (int i = 0; i < s->n; i++) {
        int k = 0, at = len + 1;
        int32_t x = s->top[i];
        while (x >= base_n) {
            if (k == FLAT_CHAIN) return -1;
            w->fscr[at + k].pos = a->v[x].pos;
            w->fscr[at + k].parent = 0;
            k++;
            x = a->v[x].parent;
        }
        w->fscr[len].pos = (uint32_t)k;
        w->fscr[len].parent = x;
        /* drop a stack equal to an earlier one */
        int dup = 0;
        for (int o = 0; o < len && !dup;) {
            int ko = (int)w->fscr[o].pos;
            dup = ko == k &&
                  memcmp(&w->fscr[o], &w->fscr[len], (size_t)(k + 1) * sizeof *w->fscr) == 0;
            o += ko + 1;
        }
        if (dup) continue;
        len += k + 1;
        n++;
    }
    uint32_t h = 2166136261u ^ (uint32_t)s->flags;
    for (int i = 0; i < len; i++) {
        h = (h ^ w->fscr[i].pos) * 16777619u;
        h = (h ^ (uint32_t)w->fscr[i].parent) * 16777619u;
    }
    for (int f = 0; f < w->n_ft; f++) {
        const lg_flat_t *F = &w->ft[f];
        if (F->hash == h && F->len == len && F->flags == s->flags &&
            memcmp(&w->fpool[F->off], w->fscr, (size_t)len * sizeof *w->fscr) == 0)
            return f;
    }
    if (w->n_ft == MAX_FLAT) return -1;
    if (!w->ft) w->ft = loom_xmalloc(MAX_FLAT * sizeof *w->ft);
    if (w->n_fpool + len > w->cap_fpool) {
        w->cap_fpool = (w->n_fpool + len) * 2 + 64;
        w->fpool = loom_xrealloc(w->fpool, (size_t)w->cap_fpool * sizeof *w->fpool);
    }
    lg_flat_t *F = &w->ft[w->n_ft];
    F->n = n;
    F->len = len;
    F->flags = s->flags;
    F->off = w->n_fpool;
    F->hash = h;
    for (int i = 0; i < 256; i++)
        F->next[i] = -1;
    if (len) memcpy(&w->fpool[w->n_fpool], w->fscr, (size_t)len * sizeof *w->fscr);
    w->n_fpool += len;
    return w->n_ft++;
}

/* Makes the nodes of the flat state at depth d (extends that depth's mark). */
static void flat_materialize(lg_walk_t *w, lg_arena_t *a, int d) {
    if (w->mat[d]) return;
    const lg_flat_t *F = &w->ft[w->flat[d]];
    lg_set_t *S = &w->sets[d];
    S->n = 0;
    S->flags = F->flags;
    for (int o = F->off; o < F->off + F->len;) {
        int k = (int)w->fpool[o].pos;
        int32_t x = w->fpool[o].parent;
        for (int j = k; j >= 1; j--)
            x = node_new(a, w->fpool[o + j].pos, x);
        set_push(S, x);
        o += k + 1;
    }
    w->mat[d] = 1;
    w->mark[d] = a->n;
}

/* Classifies the tokens at sorted indices items[0..n) (ascending; NULL:
 * the whole sorted vocabulary) from the state s0 (whose nodes are in a):
 * res[i] = T_*. esc_follow: bytes that may follow the bottom rule when it
 * ends into unknown context (NULL when the stack is known to the root). */
static void walk_tokens(const loom_grammar_t *g, const loom_grammar_vocab_t *v, lg_arena_t *a,
                        lg_walk_t *w, const lg_set_t *s0, const loom_gb_set_t *esc_follow,
                        const int32_t *items, int n, uint8_t *res) {
    walk_reserve(w, v->max_len + 1);
    int base_n = a->n;
    w->n_ft = 0;
    w->n_fpool = 0;
    set_copy(&w->sets[0], s0);
    w->mark[0] = a->n;
    w->unc[0] = 0;
    w->mat[0] = 1;
    w->flat[0] = flat_intern(w, a, &w->sets[0], base_n);
    int have = 0, dead_depth = 1 << 30, dead_res = T_REJ;
    unsigned dead_byte = 0;
    const unsigned char *prev = NULL;
    uint32_t prev_len = 0;
    for (int it = 0; it < n; it++) {
        int32_t id = v->sorted[items ? items[it] : it];
        const unsigned char *t = (const unsigned char *)v->bytes[id];
        uint32_t L = v->len[id];
        int l = 0;
        if (!items) {
            l = it > 0 ? v->lcp[it] : 0;
            if (l >= dead_depth) {
                /* the whole run sharing the dead prefix: one tight scan */
                int end = it + 1;
                if (dead_depth == 1) {
                    end = v->group_end[dead_byte];
                } else {
                    while (end < n && v->lcp[end] >= dead_depth)
                        end++;
                }
                memset(res + it, dead_res, (size_t)(end - it));
                it = end - 1;
                continue;
            }
        } else if (prev) {
            uint32_t m = L < prev_len ? L : prev_len;
            while ((uint32_t)l < m && t[l] == prev[l])
                l++;
        }
        prev = t;
        prev_len = L;
        if (l >= dead_depth) {
            res[it] = (uint8_t)dead_res;
            continue;
        }
        dead_depth = 1 << 30;
        int d = l < have ? l : have;
        a->n = w->mark[d];
        int dead = 0;
        while ((uint32_t)d < L) {
            unsigned c = t[d];
            int fs = w->flat[d];
            lg_set_t *T = &w->sets[d + 1];
            int tn, tflags;
            int sflags = fs >= 0 && !w->mat[d] ? w->ft[fs].flags : w->sets[d].flags;
            int nx = fs >= 0 ? w->ft[fs].next[c] : -1;
            if (nx >= 0) { /* memoized */
                w->flat[d + 1] = nx;
                w->mat[d + 1] = 0;
                tn = w->ft[nx].n;
                tflags = w->ft[nx].flags;
            } else {
                if (fs >= 0) flat_materialize(w, a, d);
                if (advance(g, a, w, &w->sets[d], c, T) < 0) T->n = 0, T->flags = 0;
                w->mat[d + 1] = 1;
                w->flat[d + 1] = flat_intern(w, a, T, base_n);
                if (fs >= 0) w->ft[fs].next[c] = w->flat[d + 1] >= 0 ? w->flat[d + 1] : -2;
                tn = T->n;
                tflags = T->flags;
            }
            w->unc[d + 1] = (uint8_t)(w->unc[d] || ((sflags & F_ESC) && esc_follow &&
                                                    loom_gb_set_has(esc_follow, c)));
            w->mark[d + 1] = a->n;
            d++;
            if (tn == 0 && !(tflags & F_ESC) && ((uint32_t)d < L || !(tflags & F_ACCEPT))) {
                dead = 1;
                break;
            }
        }
        have = d;
        if (dead) {
            dead_depth = d;
            dead_byte = t[0];
            dead_res = w->unc[d] ? T_UNC : T_REJ;
            res[it] = (uint8_t)dead_res;
        } else {
            res[it] = T_ACC;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Mask cache                                                               */

static uint32_t key_hash(const uint32_t *key, int depth, int trunc) {
    uint64_t h = 1469598103934665603ull ^ (uint64_t)(depth * 2 + trunc);
    for (int i = 0; i < depth; i++)
        h = (h ^ key[i]) * 1099511628211ull;
    return (uint32_t)(h ^ (h >> 32));
}

static mask_entry_t *cache_find(loom_grammar_t *g, const uint32_t *key, int depth, int trunc,
                                uint32_t *slot) {
    if (!g->tab_cap) {
        *slot = 0;
        return NULL;
    }
    uint32_t i = key_hash(key, depth, trunc) & (g->tab_cap - 1);
    while (g->tab[i]) {
        mask_entry_t *e = g->tab[i];
        if (e->depth == depth && e->trunc == trunc &&
            memcmp(e->key, key, (size_t)depth * sizeof *key) == 0) {
            *slot = i;
            return e;
        }
        i = (i + 1) & (g->tab_cap - 1);
    }
    *slot = i;
    return NULL;
}

static void cache_insert(loom_grammar_t *g, mask_entry_t *e) {
    if ((g->tab_n + 1) * 2 > g->tab_cap) {
        uint32_t oc = g->tab_cap;
        mask_entry_t **old = g->tab;
        g->tab_cap = oc ? oc * 2 : 64;
        g->tab = loom_xcalloc(g->tab_cap, sizeof *g->tab);
        for (uint32_t i = 0; i < oc; i++) {
            if (!old[i]) continue;
            uint32_t s = key_hash(old[i]->key, old[i]->depth, old[i]->trunc) & (g->tab_cap - 1);
            while (g->tab[s])
                s = (s + 1) & (g->tab_cap - 1);
            g->tab[s] = old[i];
        }
        free(old);
    }
    uint32_t s = key_hash(e->key, e->depth, e->trunc) & (g->tab_cap - 1);
    while (g->tab[s])
        s = (s + 1) & (g->tab_cap - 1);
    g->tab[s] = e;
    g->tab_n++;
}

/* The entry for the stack whose top is node id in arena a. */
static mask_entry_t *cache_get(loom_grammar_t *g, const loom_grammar_vocab_t *v,
                               const lg_arena_t *a, int32_t id, uint8_t **res, int *res_cap) {
    if (g->cv != v) {
        cache_clear(g);
        g->cv = v;
    }
    uint32_t key[KEY_DEPTH];
    int depth = 0, trunc = 0;
    for (int32_t x = id; x >= 0; x = a->v[x].parent) {
        if (depth == KEY_DEPTH) {
            trunc = 1;
            break;
        }
        key[depth++] = a->v[x].pos;
    }
    uint32_t slot;
    mask_entry_t *e = cache_find(g, key, depth, trunc, &slot);
    if (e) return e;
    /* compute: rebuild the known frames over UNKNOWN (or ROOT) */
    lg_arena_t *pa = &g->parena;
    pa->n = 0;
    int32_t parent = trunc ? P_UNK : P_ROOT;
    for (int i = depth - 1; i >= 0; i--)
        parent = node_new(pa, key[i], parent);
    lg_set_t s0 = {0};
    set_push(&s0, parent);
    if (*res_cap < v->n_sorted) {
        *res = loom_xrealloc(*res, (size_t)v->n_sorted + 1);
        *res_cap = v->n_sorted;
    }
    const loom_gb_set_t *follow = trunc ? &g->follow[g->elem_rule[key[depth - 1]]] : NULL;
    walk_tokens(g, v, pa, &g->pwalk, &s0, follow, NULL, v->n_sorted, *res);
    free(s0.top);
    int n_acc = 0, n_unc = 0;
    for (int i = 0; i < v->n_sorted; i++) {
        n_acc += (*res)[i] == T_ACC;
        n_unc += (*res)[i] == T_UNC;
    }
    int n_rej = v->n_sorted - n_acc - n_unc;
    e = loom_xcalloc(1, sizeof *e);
    memcpy(e->key, key, sizeof key);
    e->depth = (uint8_t)depth;
    e->trunc = (uint8_t)trunc;
    e->rej_mode = n_rej < n_acc;
    int want = e->rej_mode ? T_REJ : T_ACC;
    e->ids = loom_xmalloc((size_t)(e->rej_mode ? n_rej : n_acc) * sizeof *e->ids + 1);
    e->unc = loom_xmalloc((size_t)n_unc * sizeof *e->unc + 1);
    for (int i = 0; i < v->n_sorted; i++) {
        if ((*res)[i] == want) e->ids[e->n_ids++] = v->sorted[i];
        if ((*res)[i] == T_UNC) e->unc[e->n_unc++] = i;
    }
    cache_insert(g, e);
    return e;
}

/* ------------------------------------------------------------------------ */
/* Matcher                                                                  */

loom_status_t loom_grammar_matcher_create(loom_grammar_t *g, const loom_grammar_vocab_t *v,
                                          loom_grammar_matcher_t **out, loom_err_t *err) {
    if (!g || !v)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "grammar: no grammar or vocabulary");
    loom_grammar_matcher_t *m = loom_xcalloc(1, sizeof *m);
    m->g = loom_grammar_ref(g);
    m->v = v;
    m->tmp_mask = loom_xcalloc(v->n_words + 1, sizeof *m->tmp_mask);
    loom_grammar_matcher_reset(m);
    *out = m;
    return LOOM_OK;
}

void loom_grammar_matcher_destroy(loom_grammar_matcher_t **m_p) {
    if (!m_p || !*m_p) return;
    loom_grammar_matcher_t *m = *m_p;
    loom_grammar_destroy(&m->g);
    free(m->arena.v);
    free(m->cur.top);
    free(m->tmp.top);
    walk_free(&m->walk);
    free(m->tmp_mask);
    free(m->res);
    free(m);
    *m_p = NULL;
}

void loom_grammar_matcher_reset(loom_grammar_matcher_t *m) {
    m->arena.n = 0;
    m->terminated = 0;
    m->n_accepted = 0;
    initial_state(m->g, &m->arena, &m->walk,
                  &m->cur); /* the root state is small: cannot overflow */
    m->live_n = m->arena.n;
    m->compact_at = m->live_n * 2 + 4096;
}

/* Copies the live stacks into a fresh arena when the old one has grown. */
static void compact(loom_grammar_matcher_t *m) {
    lg_arena_t na = {0};
    int32_t *map = loom_xmalloc((size_t)m->arena.n * sizeof *map + 1);
    for (int i = 0; i < m->arena.n; i++)
        map[i] = -3;
    ivec_t chain = {0};
    for (int i = 0; i < m->cur.n; i++) {
        /* copy the chain: collect it top-down, create it from the bottom */
        chain.n = 0;
        int32_t x = m->cur.top[i];
        while (x >= 0 && map[x] == -3)
            ivec_push(&chain, x), x = m->arena.v[x].parent;
        int32_t below = x >= 0 ? map[x] : x;
        while (chain.n > 0) {
            int32_t y = chain.v[--chain.n];
            below = map[y] = node_new(&na, m->arena.v[y].pos, below);
        }
    }
    free(chain.v);
    for (int i = 0; i < m->cur.n; i++)
        m->cur.top[i] = map[m->cur.top[i]];
    free(map);
    free(m->arena.v);
    m->arena = na;
    m->live_n = na.n;
    m->compact_at = m->live_n * 2 + 4096;
}

static int matcher_bytes(loom_grammar_matcher_t *m, const unsigned char *s, size_t n) {
    lg_set_t *x = &m->tmp;
    set_copy(x, &m->cur);
    lg_set_t y = {0};
    int ok = 1;
    for (size_t i = 0; i < n; i++) {
        if (advance(m->g, &m->arena, &m->walk, x, s[i], &y) < 0) {
            ok = 0;
            break;
        }
        lg_set_t t = *x;
        *x = y;
        y = t;
        if (x->n == 0 && (i + 1 < n || !(x->flags & F_ACCEPT))) {
            ok = 0;
            break;
        }
    }
    free(y.top);
    if (!ok) {
        m->arena.n = m->live_n;
        return 0;
    }
    set_copy(&m->cur, x);
    m->live_n = m->arena.n;
    if (m->arena.n > m->compact_at) compact(m);
    return 1;
}

/* Advances over a special token where some stack's top is its element;
 * 0 (nothing changed) where none is. */
static int matcher_token(loom_grammar_matcher_t *m, int32_t id) {
    lg_set_t y = {0};
    int ok = advance_token(m->g, &m->arena, &m->walk, &m->cur, id, &y) == 0 &&
             (y.n > 0 || (y.flags & F_ACCEPT));
    if (ok) {
        set_copy(&m->cur, &y);
        m->live_n = m->arena.n;
        if (m->arena.n > m->compact_at) compact(m);
    } else {
        m->arena.n = m->live_n;
    }
    free(y.top);
    return ok;
}

loom_status_t loom_grammar_matcher_accept_bytes(loom_grammar_matcher_t *m, const char *s,
                                                size_t n) {
    if (m->terminated) return LOOM_ERR_INVALID_ARGUMENT;
    return matcher_bytes(m, (const unsigned char *)s, n) ? LOOM_OK : LOOM_ERR_INVALID_ARGUMENT;
}

loom_status_t loom_grammar_matcher_accept_token(loom_grammar_matcher_t *m, int32_t id) {
    const loom_grammar_vocab_t *v = m->v;
    if (m->terminated || id < 0 || id >= v->n_vocab) return LOOM_ERR_INVALID_ARGUMENT;
    if (m->g->n_toks && matcher_token(m, id)) { /* (before EOS: the mask allows it at its element) */
        m->n_accepted++;
        return LOOM_OK;
    }
    if (is_eos(v, id)) {
        if (!(m->cur.flags & F_ACCEPT)) return LOOM_ERR_INVALID_ARGUMENT;
        m->terminated = 1;
        m->n_accepted++;
        return LOOM_OK;
    }
    if (!v->bytes[id]) return LOOM_ERR_INVALID_ARGUMENT;
    if (!matcher_bytes(m, (const unsigned char *)v->bytes[id], v->len[id]))
        return LOOM_ERR_INVALID_ARGUMENT;
    m->n_accepted++;
    return LOOM_OK;
}

loom_status_t loom_grammar_matcher_copy(loom_grammar_matcher_t *dst, const loom_grammar_matcher_t *src) {
    if (dst->g != src->g || dst->v != src->v) return LOOM_ERR_INVALID_ARGUMENT;
    if (dst->arena.cap < src->arena.n) {
        dst->arena.cap = src->arena.n;
        dst->arena.v = loom_xrealloc(dst->arena.v, (size_t)dst->arena.cap * sizeof *dst->arena.v);
    }
    if (src->arena.n) memcpy(dst->arena.v, src->arena.v, (size_t)src->arena.n * sizeof *dst->arena.v);
    dst->arena.n = src->arena.n;
    dst->live_n = src->live_n;
    dst->compact_at = src->compact_at;
    set_copy(&dst->cur, &src->cur);
    dst->terminated = src->terminated;
    dst->n_accepted = src->n_accepted;
    return LOOM_OK;
}

loom_status_t loom_grammar_matcher_replay(loom_grammar_matcher_t *m, const int32_t *ids, int n) {
    loom_grammar_matcher_reset(m);
    for (int i = 0; i < n; i++)
        LOOM_CHECK(loom_grammar_matcher_accept_token(m, ids[i]));
    return LOOM_OK;
}

int loom_grammar_matcher_can_finish(const loom_grammar_matcher_t *m) {
    return !m->terminated && (m->cur.flags & F_ACCEPT) != 0;
}
int loom_grammar_matcher_is_terminated(const loom_grammar_matcher_t *m) {
    return m->terminated;
}
int loom_grammar_matcher_n_accepted(const loom_grammar_matcher_t *m) {
    return m->n_accepted;
}

static void mask_set_ids(uint32_t *mask, const int32_t *ids, int n) {
    for (int i = 0; i < n; i++)
        mask[ids[i] >> 5] |= 1u << (ids[i] & 31);
}
static void mask_clear_ids(uint32_t *mask, const int32_t *ids, int n) {
    for (int i = 0; i < n; i++)
        mask[ids[i] >> 5] &= ~(1u << (ids[i] & 31));
}

void loom_grammar_matcher_fill_mask(loom_grammar_matcher_t *m, uint32_t *mask) {
    const loom_grammar_vocab_t *v = m->v;
    size_t nw = v->n_words;
    memset(mask, 0, nw * sizeof *mask);
    if (m->terminated) return;
    int wrote = 0; /* mask holds something */
    for (int i = 0; i < m->cur.n; i++) {
        int32_t top = m->cur.top[i];
        if (EL_KIND(m->g->elems[m->arena.v[top].pos]) == K_TOK) continue; /* below */
        mask_entry_t *e = cache_get(m->g, v, &m->arena, top, &m->res, &m->res_cap);
        if (e->rej_mode) {
            uint32_t *dst = wrote ? m->tmp_mask : mask;
            memcpy(dst, v->eligible, nw * sizeof *dst);
            mask_clear_ids(dst, e->ids, e->n_ids);
            for (int k = 0; k < e->n_unc; k++) {
                int32_t id = v->sorted[e->unc[k]];
                dst[id >> 5] &= ~(1u << (id & 31));
            }
            if (wrote)
                for (size_t k = 0; k < nw; k++)
                    mask[k] |= dst[k];
        } else {
            mask_set_ids(mask, e->ids, e->n_ids);
        }
        wrote = 1;
        if (e->n_unc == 0) continue;
        /* the uncertain ones, against this stack in full */
        if (m->res_cap < e->n_unc) {
            m->res = loom_xrealloc(m->res, (size_t)e->n_unc + 1);
            m->res_cap = e->n_unc;
        }
        lg_set_t s0 = {0};
        set_push(&s0, top);
        int keep = m->arena.n;
        walk_tokens(m->g, v, &m->arena, &m->walk, &s0, NULL, e->unc, e->n_unc, m->res);
        m->arena.n = keep;
        free(s0.top);
        for (int k = 0; k < e->n_unc; k++) {
            int32_t id = v->sorted[e->unc[k]];
            if (m->res[k] == T_ACC) mask[id >> 5] |= 1u << (id & 31);
        }
    }
    if (m->cur.flags & F_ACCEPT) mask_set_ids(mask, v->eos, v->n_eos);
    /* a special token's element allows its id alone */
    for (int i = 0; m->g->n_toks && i < m->cur.n; i++) {
        uint32_t e = m->g->elems[m->arena.v[m->cur.top[i]].pos];
        int32_t id = EL_KIND(e) == K_TOK ? m->g->toks[EL_VAL(e)].id : -1;
        if (id >= 0 && id < v->n_vocab) mask[id >> 5] |= 1u << (id & 31);
    }
}

/* ------------------------------------------------------------------------ */
/* Cache of compiled grammars                                               */

typedef struct {
    uint64_t hash;
    int kind;
    char *spec;
    size_t len;
    loom_grammar_t *g;
    uint64_t used;
} gcache_entry_t;

struct loom_grammar_cache {
    gcache_entry_t *e;
    int n, cap;
    size_t max_bytes; /* 0: no bound but the entry count */
    uint64_t tick, hits, misses;
};

void loom_grammar_cache_set_max_bytes(loom_grammar_cache_t *c, size_t max_bytes) { c->max_bytes = max_bytes; }

/* The entries' bytes: spec copies and grammars as they are now (their mask
 * caches grow as requests use them). */
size_t loom_grammar_cache_bytes(const loom_grammar_cache_t *c) {
    size_t b = 0;
    for (int i = 0; i < c->n; i++) b += c->e[i].len + 1 + loom_grammar_bytes(c->e[i].g);
    return b;
}

static void cache_drop(loom_grammar_cache_t *c, int i) {
    free(c->e[i].spec);
    loom_grammar_destroy(&c->e[i].g);
    c->e[i] = c->e[--c->n];
}

static int cache_lru(const loom_grammar_cache_t *c) {
    int slot = 0;
    for (int i = 1; i < c->n; i++)
        if (c->e[i].used < c->e[slot].used) slot = i;
    return slot;
}

loom_grammar_cache_t *loom_grammar_cache_create(int capacity) {
    loom_grammar_cache_t *c = loom_xcalloc(1, sizeof *c);
    c->cap = capacity > 0 ? capacity : 64;
    c->e = loom_xcalloc((size_t)c->cap, sizeof *c->e);
    return c;
}

void loom_grammar_cache_destroy(loom_grammar_cache_t **c_p) {
    if (!c_p || !*c_p) return;
    loom_grammar_cache_t *c = *c_p;
    for (int i = 0; i < c->n; i++) {
        free(c->e[i].spec);
        loom_grammar_destroy(&c->e[i].g);
    }
    free(c->e);
    free(c);
    *c_p = NULL;
}

static uint64_t spec_hash(int kind, const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull ^ (uint64_t)kind;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

loom_status_t loom_grammar_cache_get(loom_grammar_cache_t *c, loom_grammar_kind_t kind,
                                     const char *spec, size_t len, loom_grammar_t **out,
                                     loom_err_t *err) {
    if (loom_grammar_cache_lookup(c, kind, spec, len, out)) return LOOM_OK;
    c->misses++;
    loom_grammar_t *g = NULL;
    LOOM_CHECK(loom_grammar_compile(kind, spec, len, &g, err));
    loom_grammar_cache_put(c, kind, spec, len, g);
    *out = g;
    return LOOM_OK;
}

static int gcache_find(const loom_grammar_cache_t *c, uint64_t h, int kind, const char *spec, size_t len) {
    for (int i = 0; i < c->n; i++) {
        const gcache_entry_t *e = &c->e[i];
        if (e->hash == h && e->kind == kind && e->len == len && (len == 0 || memcmp(e->spec, spec, len) == 0))
            return i;
    }
    return -1;
}

int loom_grammar_cache_lookup(loom_grammar_cache_t *c, loom_grammar_kind_t kind, const char *spec, size_t len,
                              loom_grammar_t **out) {
    int i = gcache_find(c, spec_hash((int)kind, spec, len), (int)kind, spec, len);
    c->tick++;
    if (i < 0) return 0;
    c->e[i].used = c->tick;
    c->hits++;
    *out = loom_grammar_ref(c->e[i].g);
    return 1;
}

void loom_grammar_cache_put(loom_grammar_cache_t *c, loom_grammar_kind_t kind, const char *spec, size_t len,
                            loom_grammar_t *g) {
    uint64_t h = spec_hash((int)kind, spec, len);
    if (gcache_find(c, h, (int)kind, spec, len) >= 0) return; /* compiled twice at once: one copy is enough */
    size_t need = len + 1 + loom_grammar_bytes(g);
    if (c->max_bytes && need > c->max_bytes) return; /* never fits: used, not kept */
    while (c->n == c->cap) cache_drop(c, cache_lru(c)); /* evict the least recently used */
    if (c->max_bytes)
        while (c->n > 0 && loom_grammar_cache_bytes(c) + need > c->max_bytes) cache_drop(c, cache_lru(c));
    int slot = c->n++;
    c->tick++;
    gcache_entry_t *e = &c->e[slot];
    e->hash = h;
    e->kind = (int)kind;
    e->spec = loom_xmalloc(len + 1);
    if (len) memcpy(e->spec, spec, len);
    e->len = len;
    e->g = loom_grammar_ref(g);
    e->used = c->tick;
}

void loom_grammar_cache_miss(loom_grammar_cache_t *c) { c->misses++; }

void loom_grammar_cache_stats(const loom_grammar_cache_t *c, uint64_t *hits, uint64_t *misses) {
    if (hits) *hits = c->hits;
    if (misses) *misses = c->misses;
}

loom_status_t loom_grammar_compile_limited(loom_grammar_kind_t kind, const char *spec, size_t len,
                                           loom_grammar_limits_t *lim, loom_grammar_t **out, loom_err_t *err) {
    lim->hit = 0;
    tl_limits = lim;
    loom_status_t st = loom_grammar_compile(kind, spec, len, out, err);
    tl_limits = NULL;
    if (st == LOOM_OK && lim->max_bytes && loom_grammar_bytes(*out) > lim->max_bytes) {
        size_t b = loom_grammar_bytes(*out);
        loom_grammar_destroy(out);
        st = over_error(lim, LOOM_GRAMMAR_LIMIT_BYTES, b, err);
    } else if (st == LOOM_OK && lim->deadline_ns && loom_now_ns() > lim->deadline_ns) {
        loom_grammar_destroy(out);
        st = over_error(lim, LOOM_GRAMMAR_LIMIT_TIME, 0, err);
    }
    return st;
}

loom_status_t loom_grammar_compile(loom_grammar_kind_t kind, const char *spec, size_t len,
                                   loom_grammar_t **out, loom_err_t *err) {
    switch (kind) {
    case LOOM_GRAMMAR_JSON_OBJECT:
        return loom_grammar_compile_json_object(out, err);
    case LOOM_GRAMMAR_JSON_SCHEMA:
        return loom_grammar_compile_json_schema(spec, len, out, err);
    case LOOM_GRAMMAR_REGEX:
        return loom_grammar_compile_regex(spec, len, out, err);
    case LOOM_GRAMMAR_CHOICE:
        return loom_grammar_compile_choice(spec, len, out, err);
    case LOOM_GRAMMAR_EBNF:
        return loom_grammar_compile_ebnf(spec, len, out, err);
    case LOOM_GRAMMAR_TOOL_CALLS:
        return loom_grammar_compile_tool_calls(spec, len, out, err);
    }
    return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "grammar: unknown kind %d", (int)kind);
}
