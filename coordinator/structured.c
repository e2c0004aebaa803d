/* Constrained decoding in the coordinator (see structured.h). */
#include "coordinator/structured.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar.h"
#include "common/log.h"
#include "common/util.h"

#define GRAMMAR_CACHE_CAPACITY 64

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

struct loom_structured {
    const loom_tokenizer_t *tok;
    const loom_model_config_t *mcfg;
    /* The vocabulary index (tens of ms on a 128k vocabulary) is built at
     * start-up on its own thread, so the first constrained request does not
     * stall the reactor; the reactor joins it before its first use, and only
     * then reads vocab (or indexer_err). */
    loom_grammar_vocab_t *vocab;
    pthread_t indexer;
    int indexer_running; /* started, not joined yet */
    loom_status_t indexer_st;
    loom_err_t indexer_err;
    loom_grammar_cache_t *cache;
    loom_structured_stats_t stats;
};

struct loom_guide {
    loom_structured_t *s;
    loom_grammar_t *grammar;
    loom_grammar_matcher_t *m;
    loom_grammar_matcher_t *dm; /* speculative rows: a copy of m advanced through the drafts (NULL until needed) */
    int dm_n;                   /* drafts dm has accepted past m (0: a fresh copy is due) */
    int dm_bad;                 /* the grammar refused one of this step's drafts */
    uint32_t *mask; /* (words) over the model's vocabulary */
    size_t words;   /* ceil(vocab_size / 32): the model's rows, which may be longer than the tokenizer's */
    size_t tok_words; /* the grammar's mask words (the tokenizer's vocabulary) */
    int broken; /* the matcher refused a token: the output can no longer match */
    /* a reasoning model's answer: the grammar holds after the marker */
    char *after;      /* the marker, or several separated by '\n' (NULL: the grammar holds from the first token) */
    int start;        /* out[start..] are fed to the matcher, after tail bytes (-1: the marker not seen yet) */
    char *tail;       /* the bytes of out[start - 1] after the marker */
    size_t n_tail;
    int fed;          /* out[start..fed) accepted by the matcher */
    loom_sbuf_t dec;  /* out[0..n_dec) decoded, while looking for the marker */
    int n_dec;
    char *text;
    size_t n_text, cap_text;
};

/* The vocabulary index with the model's end-of-sequence ids; on the
 * indexer thread or, when that could not start, on first use. */
static loom_status_t build_vocab(loom_structured_t *s, loom_err_t *err) {
    uint64_t t0 = loom_now_ns();
    LOOM_CHECK(loom_grammar_vocab_create(s->tok, &s->vocab, err));
    for (int i = 0; i < s->mcfg->n_eos; i++) loom_grammar_vocab_add_eos(s->vocab, s->mcfg->eos_ids[i]);
    LOOM_INFO("constrained decoding: vocabulary of %d tokens indexed in %.1f ms", loom_grammar_vocab_size(s->vocab),
              (double)(loom_now_ns() - t0) * 1e-6);
    return LOOM_OK;
}

static void *index_vocab(void *arg) {
    loom_structured_t *s = arg;
    s->indexer_st = build_vocab(s, &s->indexer_err);
    return NULL;
}

static void join_indexer(loom_structured_t *s) {
    if (!s->indexer_running) return;
    pthread_join(s->indexer, NULL);
    s->indexer_running = 0;
}

loom_structured_t *loom_structured_create(const loom_tokenizer_t *tok, const loom_model_config_t *mcfg,
                                          size_t cache_bytes) {
    loom_structured_t *s = loom_xcalloc(1, sizeof *s);
    s->tok = tok;
    s->mcfg = mcfg;
    s->cache = loom_grammar_cache_create(GRAMMAR_CACHE_CAPACITY);
    loom_grammar_cache_set_max_bytes(s->cache, cache_bytes);
    if (tok && pthread_create(&s->indexer, NULL, index_vocab, s) == 0) s->indexer_running = 1;
    return s;
}

int loom_structured_lookup(loom_structured_t *s, int kind, const char *spec, size_t len, loom_grammar_t **out) {
    *out = NULL;
    if (kind < LOOM_GRAMMAR_JSON_OBJECT || kind > LOOM_GRAMMAR_TOOL_CALLS) return 0;
    if (loom_grammar_cache_lookup(s->cache, (loom_grammar_kind_t)kind, spec, len, out)) return 1;
    loom_grammar_cache_miss(s->cache);
    return 0;
}

void loom_structured_put(loom_structured_t *s, int kind, const char *spec, size_t len, loom_grammar_t *gr) {
    loom_grammar_cache_put(s->cache, (loom_grammar_kind_t)kind, spec, len, gr);
}

size_t loom_structured_cache_bytes(const loom_structured_t *s) { return loom_grammar_cache_bytes(s->cache); }

void loom_structured_destroy(loom_structured_t **s_p) {
    if (!s_p || !*s_p) return;
    loom_structured_t *s = *s_p;
    join_indexer(s);
    loom_grammar_vocab_destroy(&s->vocab);
    loom_grammar_cache_destroy(&s->cache);
    free(s);
    *s_p = NULL;
}

void loom_structured_stats(const loom_structured_t *s, loom_structured_stats_t *out) {
    *out = s->stats;
}

static loom_status_t ensure_vocab(loom_structured_t *s, loom_err_t *err) {
    join_indexer(s); /* at once unless a request arrived within the start-up's first milliseconds */
    if (s->vocab) return LOOM_OK;
    if (s->indexer_st < 0) {
        if (err) *err = s->indexer_err;
        return s->indexer_st;
    }
    return build_vocab(s, err);
}

loom_status_t loom_guide_create(loom_structured_t *s, int kind, const char *spec, size_t len, const char *after,
                                loom_guide_t **out, loom_err_t *err) {
    *out = NULL;
    if (kind < LOOM_GRAMMAR_JSON_OBJECT || kind > LOOM_GRAMMAR_TOOL_CALLS)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "guide_kind %d is not one of 1 to 6", kind);
    loom_grammar_t *gr = NULL;
    LOOM_CHECK(loom_grammar_cache_get(s->cache, (loom_grammar_kind_t)kind, spec, len, &gr, err));
    loom_status_t st = loom_guide_create_from(s, gr, after, out, err);
    loom_grammar_destroy(&gr);
    return st;
}

loom_status_t loom_guide_create_from(loom_structured_t *s, loom_grammar_t *grammar, const char *after,
                                     loom_guide_t **out, loom_err_t *err) {
    *out = NULL;
    loom_grammar_t *gr = loom_grammar_ref(grammar);
    loom_status_t st = ensure_vocab(s, err);
    loom_grammar_matcher_t *m = NULL;
    if (st == LOOM_OK) st = loom_grammar_matcher_create(gr, s->vocab, &m, err);
    if (st < 0) {
        loom_grammar_destroy(&gr);
        return st;
    }
    loom_guide_t *g = loom_xcalloc(1, sizeof *g);
    g->s = s;
    g->grammar = gr;
    g->m = m;
    g->words = ((size_t)s->mcfg->vocab_size + 31) / 32;
    g->tok_words = loom_grammar_mask_words(s->vocab);
    g->mask = loom_xmalloc(LOOM_MAX(g->words, g->tok_words) * sizeof *g->mask);
    g->after = after && after[0] ? loom_xstrdup(after) : NULL;
    g->start = g->after ? -1 : 0;
    *out = g;
    return LOOM_OK;
}

void loom_guide_destroy(loom_guide_t **g_p) {
    if (!g_p || !*g_p) return;
    loom_guide_t *g = *g_p;
    loom_grammar_matcher_destroy(&g->m);
    loom_grammar_matcher_destroy(&g->dm);
    loom_grammar_destroy(&g->grammar);
    free(g->mask);
    free(g->text);
    free(g->after);
    free(g->tail);
    free(g->dec.p);
    free(g);
    *g_p = NULL;
}

/* The length of the marker in after (one, or several separated by '\n')
 * that t[0, end) ends with; 0 when none does. */
static size_t marker_ending(const char *after, const char *t, size_t end) {
    for (const char *m = after; *m;) {
        size_t n = strcspn(m, "\n");
        if (n && n <= end && !memcmp(t + end - n, m, n)) return n;
        m += n + (m[n] == '\n');
    }
    return 0;
}

/* With a marker: decodes the output's new tokens (dec holds out[0..n_dec)
 * as bytes) and looks for the marker's end among their bytes; found, it
 * sets start and tail and restarts the matcher there. 0 while the marker
 * has not come. */
static int find_start(loom_guide_t *g, const int32_t *out, int n_out) {
    if (n_out < g->n_dec) { /* rolled back */
        g->dec.len = 0;
        g->n_dec = 0;
    }
    for (; g->n_dec < n_out; g->n_dec++) {
        int32_t id = out[g->n_dec];
        size_t n = 0;
        const char *b = loom_tokenizer_token_bytes(g->s->tok, id, &n);
        if (!b) {
            b = loom_tokenizer_piece(g->s->tok, id);
            n = b ? strlen(b) : 0;
        }
        size_t from = g->dec.len;
        loom_sbuf_add(&g->dec, b ? b : "", n);
        for (size_t k = from; k < g->dec.len; k++) {
            if (!marker_ending(g->after, g->dec.p, k + 1)) continue;
            g->n_tail = g->dec.len - (k + 1);
            free(g->tail);
            g->tail = loom_xmalloc(g->n_tail + 1);
            memcpy(g->tail, g->dec.p + k + 1, g->n_tail);
            g->start = g->fed = ++g->n_dec;
            loom_grammar_matcher_reset(g->m);
            if (g->n_tail && loom_grammar_matcher_accept_bytes(g->m, g->tail, g->n_tail) < 0) g->broken = 1;
            return 1;
        }
    }
    return 0;
}

/* Brings the matcher to out[0..n_out): accepts the new tokens, or replays
 * when the output is shorter than what it saw (a rollback). */
static void sync(loom_guide_t *g, const int32_t *out, int n_out) {
    if (g->broken) return;
    if (g->after) {
        if (g->start >= 0 && n_out < g->fed) { /* rolled back: find the marker again */
            g->start = -1;
            g->broken = 0;
            g->dec.len = 0;
            g->n_dec = 0;
        }
        if (g->start < 0 && !find_start(g, out, n_out)) return;
        for (; g->fed < n_out && !g->broken; g->fed++)
            if (loom_grammar_matcher_accept_token(g->m, out[g->fed]) < 0) g->broken = 1;
    } else {
        int have = loom_grammar_matcher_n_accepted(g->m);
        if (have > n_out) {
            if (loom_grammar_matcher_replay(g->m, out, n_out) < 0) g->broken = 1;
        } else {
            for (int i = have; i < n_out && !g->broken; i++)
                if (loom_grammar_matcher_accept_token(g->m, out[i]) < 0) g->broken = 1;
        }
    }
    if (g->broken) {
        g->s->stats.refused++;
        LOOM_WARN("constrained decoding: a sampled token is outside the grammar; the request will end as 'length'");
    }
}

/* The matcher for the row after n_drafts drafts: m itself, or dm brought
 * from m through the drafts (NULL when the grammar refuses one: the row
 * before it masks that draft out, so the target rejects it and this row's
 * sample is never used). Rows of one sequence come in order, so dm usually
 * takes one more draft per row. */
static loom_grammar_matcher_t *draft_matcher(loom_guide_t *g, const int32_t *drafts, int n_drafts) {
    if (n_drafts == 0) {
        g->dm_n = 0;
        g->dm_bad = 0;
        return g->m;
    }
    if (g->dm_bad) return NULL;
    if (!g->dm && loom_grammar_matcher_create(g->grammar, g->s->vocab, &g->dm, NULL) < 0) return NULL;
    if (g->dm_n == 0 || g->dm_n > n_drafts) {
        if (loom_grammar_matcher_copy(g->dm, g->m) < 0) return NULL;
        g->dm_n = 0;
    }
    while (g->dm_n < n_drafts)
        if (loom_grammar_matcher_accept_token(g->dm, drafts[g->dm_n++]) < 0) {
            g->dm_bad = 1;
            return NULL;
        }
    return g->dm;
}

void loom_guide_fill_row(loom_guide_t *g, const int32_t *out, int n_out, const int32_t *drafts, int n_drafts,
                         void *(*alloc)(void *ctx, size_t bytes), void *ctx, Loom__V1__SampleParams *sp) {
    sync(g, out, n_out);
    if (g->after && g->start < 0) return; /* still reasoning: this row is free */
    loom_grammar_matcher_t *mt = g->broken ? NULL : draft_matcher(g, drafts, n_drafts);
    sp->grammar = 1;
    g->s->stats.masks++;
    size_t n_set = 0;
    if (mt) {
        loom_grammar_matcher_fill_mask(mt, g->mask);
        /* ids past the tokenizer's vocabulary (padded rows) are never allowed, nor past the model's */
        for (size_t w = g->tok_words; w < g->words; w++) g->mask[w] = 0;
        unsigned tail = (unsigned)(g->s->mcfg->vocab_size % 32);
        if (tail && g->words <= g->tok_words) g->mask[g->words - 1] &= (1u << tail) - 1u;
        for (size_t w = 0; w < g->words; w++) n_set += (size_t)__builtin_popcount(g->mask[w]);
    }
    if (!mt || n_set == 0) { /* nothing is allowed: EOS ends it (the text check reports length) */
        const loom_model_config_t *mc = g->s->mcfg;
        int32_t *ids = alloc(ctx, (size_t)(mc->n_eos + 1) * sizeof *ids);
        size_t k = 0;
        for (int i = 0; i < mc->n_eos; i++)
            if (mc->eos_ids[i] >= 0 && mc->eos_ids[i] < mc->vocab_size) ids[k++] = mc->eos_ids[i];
        qsort(ids, k, sizeof *ids, cmp_i32);
        size_t d = 0; /* distinct */
        for (size_t i = 0; i < k; i++)
            if (!d || ids[d - 1] != ids[i]) ids[d++] = ids[i];
        sp->grammar_ids = ids;
        sp->n_grammar_ids = d;
        g->s->stats.list_rows++;
        return;
    }
    if (n_set < g->words) { /* the id list is smaller than the bitset */
        int32_t *ids = alloc(ctx, n_set * sizeof *ids);
        size_t k = 0;
        for (size_t w = 0; w < g->words; w++)
            for (uint32_t b = g->mask[w]; b; b &= b - 1) ids[k++] = (int32_t)(w * 32 + (size_t)__builtin_ctz(b));
        sp->grammar_ids = ids;
        sp->n_grammar_ids = k;
        g->s->stats.list_rows++;
    } else {
        uint32_t *m = alloc(ctx, g->words * sizeof *m);
        memcpy(m, g->mask, g->words * sizeof *m);
        sp->grammar_mask = m;
        sp->n_grammar_mask = g->words;
        g->s->stats.bitset_rows++;
    }
}

void loom_guide_text_append(loom_guide_t *g, const char *text, size_t n) {
    if (n == 0) return;
    if (g->n_text + n + 1 > g->cap_text) {
        g->cap_text = (g->n_text + n + 1) * 2;
        g->text = loom_xrealloc(g->text, g->cap_text);
    }
    memcpy(g->text + g->n_text, text, n);
    g->n_text += n;
    g->text[g->n_text] = '\0';
}

int loom_guide_text_complete(const loom_guide_t *g) {
    const char *t = g->text ? g->text : "";
    size_t n = g->n_text;
    if (g->after) { /* the answer: what follows the marker's first occurrence */
        size_t end = 0, m = 0;
        while (end < n && !(m = marker_ending(g->after, t, ++end))) {}
        if (!m) return 0;
        t += end;
        n -= end;
    }
    return loom_grammar_check(g->grammar, t, n) == LOOM_GRAMMAR_MATCH;
}
