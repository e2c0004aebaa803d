/* BPE tokenizer from a Hugging Face tokenizer.json: loading, encoding,
 * decoding and streaming detokenization. See common/tokenizer.h for the
 * families supported and docs/tokenizer.md for the rules.
 *
 * Encoding of one text, in order:
 *   1. split on added tokens that are matched before normalization (longest
 *      match first; lstrip/rstrip trim the neighbouring text);
 *   2. normalize each remaining section (NFC, Prepend, Replace);
 *   3. split again on added tokens matched after normalization;
 *   4. pre-tokenize into words (a hand-written matcher for each supported
 *      split regex, or the SentencePiece "▁" word boundaries);
 *   5. BPE each word: symbols start as bytes (byte-level) or characters
 *      (SentencePiece) and the lowest-ranked adjacent pair is merged until
 *      none is left (a heap keyed by (rank, position));
 *   6. unknown symbols become <0xNN> byte tokens (byte_fallback) or unk.
 * Vocabulary and merges are open-addressing hash tables; all per-call memory
 * lives in one workspace that grows with the input, so no allocation happens
 * per token or per word. */
#include "common/tokenizer.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer_split.h"
#include "common/tokenizer_unicode.h"
#include "common/util.h"

#define MAX_TOKEN_ID (1 << 24) /* ids beyond this are treated as a corrupt file */
#define MAX_TEXT_LEN ((size_t)1 << 30)
#define MAX_SPLITS   4  /* Split pre-tokenizers in a Sequence */
#define MAX_CROSS    64 /* merges across a word start checked one by one (Gemma 3 has 1) */
#define META         "\xE2\x96\x81" /* U+2581 "▁", SentencePiece's space */

/* ------------------------------------------------------------------------ */
/* String arena: load-time strings, freed all at once.                      */

typedef struct arena_block {
    struct arena_block *next;
    size_t used, cap;
    char data[];
} arena_block_t;

typedef struct {
    arena_block_t *head;
} arena_t;

static char *arena_alloc(arena_t *a, size_t n) {
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 60000 ? n : 60000;
        arena_block_t *b = loom_xmalloc(sizeof *b + cap);
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
    }
    char *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static char *arena_strndup(arena_t *a, const char *s, size_t n) {
    char *p = arena_alloc(a, n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

static void arena_free(arena_t *a) {
    while (a->head) {
        arena_block_t *next = a->head->next;
        free(a->head);
        a->head = next;
    }
}

/* ------------------------------------------------------------------------ */
/* Hashing                                                                  */

static uint64_t hash_bytes(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0x100000001B3ull;
        h ^= h >> 29;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0x100000001B3ull;
    h ^= h >> 32;
    h *= 0xD6E8FEB86659FD93ull;
    h ^= h >> 32;
    return h;
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

static size_t table_size_for(size_t n) {
    size_t s = 16;
    while (s < n * 2)
        s <<= 1;
    return s;
}

/* String -> id map over keys owned elsewhere (per-id pointer and length). */
typedef struct {
    uint64_t *slots; /* (hash high 32 bits << 32) | (id + 1); 0 = empty */
    size_t mask;
    const char *const *kptr;
    const uint32_t *klen;
} strmap_t;

static void strmap_init(strmap_t *m, size_t n, const char *const *kptr, const uint32_t *klen) {
    size_t size = table_size_for(n);
    m->slots = loom_xcalloc(size, sizeof *m->slots);
    m->mask = size - 1;
    m->kptr = kptr;
    m->klen = klen;
}

static int32_t strmap_get(const strmap_t *m, const char *key, size_t len) {
    if (!m->slots) return -1;
    uint64_t h = hash_bytes(key, len);
    uint64_t tag = h >> 32;
    for (size_t i = h & m->mask;; i = (i + 1) & m->mask) {
        uint64_t e = m->slots[i];
        if (!e) return -1;
        if ((e >> 32) == tag) {
            int32_t id = (int32_t)(e & 0xFFFFFFFFu) - 1;
            if (m->klen[id] == len && memcmp(m->kptr[id], key, len) == 0) return id;
        }
    }
}

/* Inserts id under its key (kptr[id], klen[id]); replaces an existing id
 * with the same key when `replace`. */
static void strmap_put(strmap_t *m, int32_t id, bool replace) {
    const char *key = m->kptr[id];
    size_t len = m->klen[id];
    uint64_t h = hash_bytes(key, len);
    uint64_t tag = h >> 32;
    for (size_t i = h & m->mask;; i = (i + 1) & m->mask) {
        uint64_t e = m->slots[i];
        if (!e) {
            m->slots[i] = (tag << 32) | (uint32_t)(id + 1);
            return;
        }
        int32_t other = (int32_t)(e & 0xFFFFFFFFu) - 1;
        if ((e >> 32) == tag && m->klen[other] == len && memcmp(m->kptr[other], key, len) == 0) {
            if (replace) m->slots[i] = (tag << 32) | (uint32_t)(id + 1);
            return;
        }
    }
}

/* (a, b) -> (rank, value) map: merges (token pair -> rank, merged token) and
 * the added-token trie's edges ((node, byte) -> child). */
typedef struct {
    uint64_t key; /* UINT64_MAX = empty */
    int32_t rank;
    int32_t value;
} pair_entry_t;

typedef struct {
    pair_entry_t *slots;
    size_t mask, count;
} pairmap_t;

static void pairmap_init(pairmap_t *m, size_t n) {
    size_t size = table_size_for(n);
    m->slots = loom_xmalloc(size * sizeof *m->slots);
    for (size_t i = 0; i < size; i++)
        m->slots[i].key = UINT64_MAX;
    m->mask = size - 1;
    m->count = 0;
}

static inline uint64_t pair_key(int32_t a, int32_t b) {
    return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}

static inline const pair_entry_t *pairmap_get(const pairmap_t *m, uint64_t key) {
    for (size_t i = hash_u64(key) & m->mask;; i = (i + 1) & m->mask) {
        const pair_entry_t *e = &m->slots[i];
        if (e->key == key) return e;
        if (e->key == UINT64_MAX) return NULL;
    }
}

/* Inserts or overwrites; the caller keeps count * 2 <= size. */
static pair_entry_t *pairmap_put(pairmap_t *m, uint64_t key) {
    for (size_t i = hash_u64(key) & m->mask;; i = (i + 1) & m->mask) {
        pair_entry_t *e = &m->slots[i];
        if (e->key == key) return e;
        if (e->key == UINT64_MAX) {
            e->key = key;
            m->count++;
            return e;
        }
    }
}

static void pairmap_grow(pairmap_t *m) {
    pairmap_t bigger;
    pairmap_init(&bigger, (m->mask + 1));
    for (size_t i = 0; i <= m->mask; i++) {
        if (m->slots[i].key == UINT64_MAX) continue;
        pair_entry_t *e = pairmap_put(&bigger, m->slots[i].key);
        e->rank = m->slots[i].rank;
        e->value = m->slots[i].value;
    }
    free(m->slots);
    *m = bigger;
}

/* ------------------------------------------------------------------------ */
/* The tokenizer                                                            */

enum { FAMILY_SENTENCEPIECE, FAMILY_BYTE_LEVEL };

enum { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER };

enum {
    TOK_MODEL = 1,   /* in model.vocab */
    TOK_ADDED = 2,   /* in added_tokens */
    TOK_SPECIAL = 4, /* added token with special = true */
    TOK_BYTE = 8,    /* a <0xNN> token of the ByteFallback decoder */
};

typedef struct {
    int32_t id;
    bool lstrip, rstrip, special, normalized;
} added_token_t;

/* Byte trie over added-token contents; node 0 is the root. */
typedef struct {
    pairmap_t edges;   /* (node, byte) -> child node in .value */
    int32_t *terminal; /* node -> index into added[], or -1 */
    int n_nodes, cap;
    uint8_t first[32]; /* bitmap of first bytes */
    int n_tokens;
} trie_t;

typedef enum { NORM_PREPEND, NORM_REPLACE, NORM_NFC } norm_kind_t;

typedef struct {
    norm_kind_t kind;
    char *a; /* prepend text, or the string replaced */
    char *b; /* replacement */
    size_t a_len, b_len;
} norm_op_t;

struct loom_tokenizer {
    int family;
    int n_vocab; /* largest id + 1 */
    arena_t arena;

    /* Per id (holes have piece == NULL). */
    char **piece; /* as stored in the vocabulary */
    uint32_t *piece_len;
    char **text; /* decoded bytes */
    uint32_t *text_len;
    const char **key; /* the form BPE works on: the piece (SentencePiece) or its bytes */
    uint32_t *key_len;
    uint8_t *flags;

    strmap_t model_map;    /* key -> id, model vocabulary only */
    strmap_t piece_map;    /* piece -> id, everything */
    pairmap_t merges;      /* (left id, right id) -> (rank, merged id) */
    int32_t ascii_id[128]; /* id of the one-character token for ASCII, -1 if none */
    int32_t byte_id[256];  /* byte-level: id of the token for a byte; SentencePiece: <0xNN> */
    int32_t unk_id;
    bool byte_fallback, fuse_unk, ignore_merges;

    /* Normalizer. */
    norm_op_t *norm;
    int n_norm;

    /* Pre-tokenizer: regex splits applied in order, each to the pieces of
     * the one before; a piece of the last is a BPE word. */
    loom_split_t splits[MAX_SPLITS];
    bool split_gaps[MAX_SPLITS]; /* keep the text between matches (Isolated) */
    int n_splits;
    bool metaspace;       /* Metaspace pre-tokenizer */
    bool metaspace_split; /* ... splitting into "▁" words */
    int prepend_scheme;
    bool byte_level_prefix_space; /* ByteLevel add_prefix_space */
    bool sp_word_split; /* BPE per word is exact: merges cross "x▁" boundaries only in cross[] */
    const char **cross; /* results of the merges that do (when few), to check per boundary */
    uint32_t *cross_len;
    int n_cross;

    /* Added tokens. */
    added_token_t *added;
    int n_added;
    trie_t trie_raw;  /* matched before normalization */
    trie_t trie_norm; /* matched after normalization */

    /* Decoder. */
    int strip_start; /* leading spaces the decoder strips */
    bool cleanup;    /* clean_up_tokenization_spaces from the config */
    bool byte_runs;  /* has TOK_BYTE tokens: runs of them are decoded whole */

    int32_t bos_id, eos_id;
    int add_bos;
    size_t max_piece_len;
};

/* ------------------------------------------------------------------------ */
/* Byte-level (GPT-2) byte <-> code point table                             */

static void byte_level_table(uint32_t byte_to_cp[256]) {
    int n = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        byte_to_cp[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
    }
}

/* cp -> byte for the byte-level alphabet, -1 if cp is not in it. */
static int byte_level_byte(const uint32_t byte_to_cp[256], uint32_t cp) {
    if (cp < 256) return byte_to_cp[cp] == cp ? (int)cp : -1;
    if (cp >= 256 + 68) return -1; /* 68 bytes are remapped */
    for (int b = 0; b < 256; b++)
        if (byte_to_cp[b] == cp) return b;
    return -1;
}

/* ------------------------------------------------------------------------ */
/* UTF-8 output: a sink that validates (U+FFFD for ill-formed input, as the
 * WHATWG decoder does: one per maximal invalid subpart) and strips leading
 * spaces.                                                                  */

typedef struct {
    char *buf;
    size_t len, cap;
    bool grow; /* realloc when full; else drop what does not fit in cap - 1 */
    bool full;
    int strip;                /* leading spaces still to drop */
    unsigned char (*held)[4]; /* clean-up stages (NULL: no clean-up) */
    unsigned char *n_held;
} sink_t;

static void sink_put(sink_t *k, const unsigned char *c, size_t n) {
    if (k->full) return;
    if (k->len + n + 1 > k->cap) {
        if (!k->grow) {
            k->full = true;
            return;
        }
        k->cap = (k->len + n + 1) * 2;
        k->buf = loom_xrealloc(k->buf, k->cap);
    }
    memcpy(k->buf + k->len, c, n);
    k->len += n;
}

/* clean_up_tokenization_spaces, as transformers applies it to a decoded
 * text: these replacements, each over the whole text (leftmost,
 * non-overlapping), one after the other. Each is a stage that holds the
 * bytes that may still start a match (fewer than 4) and passes the rest to
 * the next stage, so a stream gives the same text as the whole string. */
static const char *const CLEANUP_FROM[LOOM_DETOK_CLEANUP_STAGES] = {
    " .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're"};
static const uint8_t CLEANUP_LEN[LOOM_DETOK_CLEANUP_STAGES] = {2, 2, 2, 2, 3, 4, 3, 3, 4, 4};

static void cleanup_feed(sink_t *k, int stage, unsigned char c) {
    if (stage == LOOM_DETOK_CLEANUP_STAGES) {
        sink_put(k, &c, 1);
        return;
    }
    const char *pat = CLEANUP_FROM[stage];
    size_t plen = CLEANUP_LEN[stage];
    unsigned char *h = k->held[stage];
    h[k->n_held[stage]++] = c;
    while (k->n_held[stage] > 0) {
        size_t n = k->n_held[stage];
        if (memcmp(h, pat, n) == 0) {
            if (n < plen) return;
            k->n_held[stage] = 0; /* a match: the pattern less its leading space */
            for (size_t i = 1; i < plen - (pat[plen - 1] == ' '); i++)
                cleanup_feed(k, stage + 1, (unsigned char)pat[i]);
            return;
        }
        unsigned char first = h[0]; /* no match starts here: pass the first byte on */
        memmove(h, h + 1, n - 1);
        k->n_held[stage]--;
        cleanup_feed(k, stage + 1, first);
    }
}

/* End of text: held bytes cannot match any more; they go through the later stages. */
static void cleanup_flush(sink_t *k) {
    if (!k->held) return;
    for (int stage = 0; stage < LOOM_DETOK_CLEANUP_STAGES; stage++) {
        unsigned char h[4];
        size_t n = k->n_held[stage];
        memcpy(h, k->held[stage], n);
        k->n_held[stage] = 0;
        for (size_t i = 0; i < n; i++)
            cleanup_feed(k, stage + 1, h[i]);
    }
}

static void sink_char(sink_t *k, const unsigned char *c, size_t n) {
    if (k->strip > 0) {
        if (n == 1 && c[0] == ' ') {
            k->strip--;
            return;
        }
        k->strip = 0;
    }
    if (!k->held) {
        sink_put(k, c, n);
        return;
    }
    /* Fast paths. Every pattern starts with a space followed by one of
     * ".?!,'n" and only spaces are ever removed, so with no stage holding
     * anything but a space in the first, a character other than those (and
     * other than a space) passes every stage unchanged, with that space. */
    bool others_idle = true;
    for (int i = 1; i < LOOM_DETOK_CLEANUP_STAGES && others_idle; i++)
        others_idle = k->n_held[i] == 0;
    if (others_idle && k->n_held[0] == 0 && c[0] != ' ') {
        sink_put(k, c, n);
        return;
    }
    if (others_idle && k->n_held[0] == 1 && !strchr(" .?!,'n", c[0])) {
        k->n_held[0] = 0;
        sink_put(k, (const unsigned char *)" ", 1);
        sink_put(k, c, n);
        return;
    }
    for (size_t i = 0; i < n; i++)
        cleanup_feed(k, 0, c[i]);
}

typedef struct {
    unsigned char b[4];
    int n;    /* bytes held */
    int need; /* continuation bytes still expected */
    unsigned lo, hi;
} utf8_state_t;

static const unsigned char REPLACEMENT[3] = {0xEF, 0xBF, 0xBD};

static void utf8_reset(utf8_state_t *u) {
    u->n = u->need = 0;
    u->lo = 0x80;
    u->hi = 0xBF;
}

static void utf8_feed(utf8_state_t *u, unsigned c, sink_t *k) {
    for (;;) {
        if (u->need == 0) {
            unsigned char b = (unsigned char)c;
            if (c < 0x80) {
                sink_char(k, &b, 1);
            } else if (c >= 0xC2 && c <= 0xDF) {
                u->need = 1;
            } else if (c >= 0xE0 && c <= 0xEF) {
                if (c == 0xE0) u->lo = 0xA0;
                if (c == 0xED) u->hi = 0x9F;
                u->need = 2;
            } else if (c >= 0xF0 && c <= 0xF4) {
                if (c == 0xF0) u->lo = 0x90;
                if (c == 0xF4) u->hi = 0x8F;
                u->need = 3;
            } else {
                sink_char(k, REPLACEMENT, 3);
            }
            if (u->need) u->b[u->n++] = b;
            return;
        }
        if (c < u->lo || c > u->hi) { /* the held bytes are a maximal invalid subpart */
            utf8_reset(u);
            sink_char(k, REPLACEMENT, 3);
            continue; /* reprocess c */
        }
        u->lo = 0x80;
        u->hi = 0xBF;
        u->b[u->n++] = (unsigned char)c;
        if (--u->need == 0) {
            sink_char(k, u->b, (size_t)u->n);
            utf8_reset(u);
        }
        return;
    }
}

static void utf8_flush(utf8_state_t *u, sink_t *k) {
    if (u->n) {
        utf8_reset(u);
        sink_char(k, REPLACEMENT, 3);
    }
}

/* ------------------------------------------------------------------------ */
/* Accessors                                                                */

int loom_tokenizer_vocab_size(const loom_tokenizer_t *tok) {
    return tok ? tok->n_vocab : 0;
}
int loom_tokenizer_bos_id(const loom_tokenizer_t *tok) {
    return tok ? tok->bos_id : -1;
}
int loom_tokenizer_eos_id(const loom_tokenizer_t *tok) {
    return tok ? tok->eos_id : -1;
}
int loom_tokenizer_add_bos(const loom_tokenizer_t *tok) {
    return tok ? tok->add_bos : 0;
}
size_t loom_tokenizer_max_piece_len(const loom_tokenizer_t *tok) {
    return tok ? tok->max_piece_len : 0;
}

int loom_tokenizer_is_special(const loom_tokenizer_t *tok, int32_t id) {
    if (!tok || id < 0 || id >= tok->n_vocab) return 0;
    return (tok->flags[id] & TOK_SPECIAL) != 0;
}

const char *loom_tokenizer_piece(const loom_tokenizer_t *tok, int32_t id) {
    if (!tok || id < 0 || id >= tok->n_vocab) return NULL;
    return tok->piece[id];
}

const char *loom_tokenizer_token_bytes(const loom_tokenizer_t *tok, int32_t id, size_t *len) {
    if (!tok || id < 0 || id >= tok->n_vocab || !tok->text[id]) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = tok->text_len[id];
    return tok->text[id];
}

int32_t loom_tokenizer_token_id(const loom_tokenizer_t *tok, const char *piece) {
    if (!tok || !piece) return -1;
    return strmap_get(&tok->piece_map, piece, strlen(piece));
}

/* ------------------------------------------------------------------------ */
/* Destruction                                                              */

static void trie_free(trie_t *t) {
    free(t->edges.slots);
    free(t->terminal);
    memset(t, 0, sizeof *t);
}

void loom_tokenizer_destroy(loom_tokenizer_t **tok_p) {
    if (!tok_p || !*tok_p) return;
    loom_tokenizer_t *t = *tok_p;
    free(t->piece);
    free(t->piece_len);
    free(t->text);
    free(t->text_len);
    free(t->key);
    free(t->key_len);
    free(t->flags);
    free(t->model_map.slots);
    free(t->piece_map.slots);
    free(t->merges.slots);
    free(t->norm);
    free(t->added);
    free(t->cross);
    free(t->cross_len);
    trie_free(&t->trie_raw);
    trie_free(&t->trie_norm);
    arena_free(&t->arena);
    free(t);
    *tok_p = NULL;
}

/* ------------------------------------------------------------------------ */
/* Loading                                                                  */

/* Context for the loader: where errors are reported. */
typedef struct {
    const char *what; /* file name for messages */
    loom_err_t *err;
} load_ctx_t;

static const char *json_str(const cJSON *obj, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* A boolean field; `dflt` when absent or null. */
static bool json_bool(const cJSON *obj, const char *name, bool dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (cJSON_IsBool(v)) return cJSON_IsTrue(v);
    return dflt;
}

/* A token named by a string or by an object with "content" (the config's
 * bos_token / eos_token forms). */
static const char *json_token_name(const cJSON *v) {
    if (cJSON_IsString(v)) return v->valuestring;
    if (cJSON_IsObject(v)) return json_str(v, "content");
    return NULL;
}

static const char *type_of(const cJSON *obj) {
    const char *t = json_str(obj, "type");
    return t ? t : "(no type)";
}

static bool json_id(const cJSON *v, int32_t *id) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0 && d < MAX_TOKEN_ID) || d != (double)(int32_t)d) return false;
    *id = (int32_t)d;
    return true;
}

static void trie_add(trie_t *t, const char *s, size_t n, int32_t added_index) {
    if (n == 0) return;
    if (!t->edges.slots) {
        pairmap_init(&t->edges, 64);
        t->cap = 64;
        t->terminal = loom_xmalloc((size_t)t->cap * sizeof *t->terminal);
        t->terminal[0] = -1;
        t->n_nodes = 1;
    }
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if ((t->edges.count + 1) * 2 > t->edges.mask + 1) pairmap_grow(&t->edges);
        uint64_t key = ((uint64_t)(uint32_t)node << 8) | c;
        const pair_entry_t *e = pairmap_get(&t->edges, key);
        if (e) {
            node = e->value;
            continue;
        }
        if (t->n_nodes == t->cap) {
            t->cap *= 2;
            t->terminal = loom_xrealloc(t->terminal, (size_t)t->cap * sizeof *t->terminal);
        }
        int32_t child = t->n_nodes++;
        t->terminal[child] = -1;
        pair_entry_t *ne = pairmap_put(&t->edges, key);
        ne->value = child;
        ne->rank = 0;
        node = child;
    }
    if (t->terminal[node] < 0) t->n_tokens++;
    t->terminal[node] = added_index; /* a later duplicate wins, as in HF */
    t->first[(unsigned char)s[0] >> 3] |= (uint8_t)(1u << ((unsigned char)s[0] & 7));
}

/* Applies the normalizer to s[0..n) into *out (growing). */
static void normalize(const loom_tokenizer_t *tok, const char *s, size_t n, char **out,
                      size_t *out_len, size_t *cap, char **tmp, size_t *tmp_cap);

static loom_status_t parse_normalizer(loom_tokenizer_t *tok, const cJSON *nj, load_ctx_t *c) {
    if (!nj || cJSON_IsNull(nj)) return LOOM_OK;
    const cJSON *list = NULL;
    const char *type = type_of(nj);
    if (strcmp(type, "Sequence") == 0) {
        list = cJSON_GetObjectItemCaseSensitive(nj, "normalizers");
        if (!cJSON_IsArray(list))
            return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: normalizer Sequence has no list",
                                c->what);
    }
    int n = list ? cJSON_GetArraySize(list) : 1;
    tok->norm = loom_xcalloc((size_t)n + 1, sizeof *tok->norm);
    for (int i = 0; i < n; i++) {
        const cJSON *o = list ? cJSON_GetArrayItem(list, i) : nj;
        const char *t = type_of(o);
        norm_op_t *op = &tok->norm[tok->n_norm];
        if (strcmp(t, "Prepend") == 0) {
            const char *p = json_str(o, "prepend");
            if (!p)
                return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: Prepend without text", c->what);
            op->kind = NORM_PREPEND;
            op->a_len = strlen(p);
            op->a = arena_strndup(&tok->arena, p, op->a_len);
        } else if (strcmp(t, "Replace") == 0) {
            const cJSON *pat = cJSON_GetObjectItemCaseSensitive(o, "pattern");
            const char *from = json_str(pat, "String");
            const char *to = json_str(o, "content");
            if (!from || !to || !*from)
                return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                                    "%s: normalizer Replace supports only a plain String pattern",
                                    c->what);
            op->kind = NORM_REPLACE;
            op->a_len = strlen(from);
            op->a = arena_strndup(&tok->arena, from, op->a_len);
            op->b_len = strlen(to);
            op->b = arena_strndup(&tok->arena, to, op->b_len);
        } else if (strcmp(t, "NFC") == 0) {
            op->kind = NORM_NFC;
        } else {
            return loom_err_set(
                c->err, LOOM_ERR_UNSUPPORTED,
                "%s: normalizer \"%s\" is not supported (Prepend, Replace, NFC are)", c->what, t);
        }
        tok->n_norm++;
    }
    return LOOM_OK;
}

/* True when no text the normalizer produces can contain pat: a Replace of
 * pat comes after every Prepend and no later Replace writes it back (NFC
 * cannot produce an ASCII string it was not given). */
static bool normalizer_removes(const loom_tokenizer_t *tok, const char *pat) {
    bool removed = false;
    for (int k = 0; k < tok->n_norm; k++) {
        const norm_op_t *op = &tok->norm[k];
        if (op->kind == NORM_REPLACE && strcmp(op->a, pat) == 0)
            removed = !strstr(op->b, pat);
        else if (op->kind == NORM_REPLACE && strstr(op->b, pat))
            removed = false;
        else if (op->kind == NORM_PREPEND && strstr(op->a, pat))
            removed = false;
        else if (op->kind == NORM_NFC && (unsigned char)pat[0] >= 0x80)
            removed = false;
    }
    return removed;
}

/* A Split pre-tokenizer: a known regex with behavior Isolated (matches and
 * the text between them are pieces) or Removed + invert (only the matches
 * are), or a String that the normalizer has already removed (a no-op). */
static loom_status_t parse_split(loom_tokenizer_t *tok, const cJSON *o, load_ctx_t *c) {
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(o, "pattern");
    const char *re = json_str(pat, "Regex");
    const char *str = json_str(pat, "String");
    const char *behavior = json_str(o, "behavior");
    bool invert = json_bool(o, "invert", false);
    if (str && *str && normalizer_removes(tok, str)) return LOOM_OK;
    if (!re)
        return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                            "%s: Split pre-tokenizer on a String the normalizer keeps is not "
                            "supported (only Regex patterns are)",
                            c->what);
    bool isolated = (!behavior || strcmp(behavior, "Isolated") == 0) && !invert;
    bool removed_inverted = behavior && strcmp(behavior, "Removed") == 0 && invert;
    if (!isolated && !removed_inverted)
        return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                            "%s: Split pre-tokenizer supports behavior Isolated (invert false) "
                            "and Removed (invert true) only",
                            c->what);
    if (tok->n_splits == MAX_SPLITS)
        return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED, "%s: more than %d Split pre-tokenizers",
                            c->what, MAX_SPLITS);
    loom_split_t kind = loom_split_recognize(re);
    if (kind == LOOM_SPLIT_NONE)
        return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                            "%s: unknown pre-tokenizer split pattern %.300s (known: GPT-2, "
                            "Llama 3, Qwen2, Mistral tekken, o200k, DeepSeek V3)",
                            c->what, re);
    tok->splits[tok->n_splits] = kind;
    tok->split_gaps[tok->n_splits] = isolated;
    tok->n_splits++;
    return LOOM_OK;
}

static loom_status_t parse_pre_tokenizer(loom_tokenizer_t *tok, const cJSON *pj, load_ctx_t *c) {
    tok->family = FAMILY_SENTENCEPIECE;
    if (!pj || cJSON_IsNull(pj)) return LOOM_OK;
    const char *type = type_of(pj);
    const cJSON *list = NULL;
    if (strcmp(type, "Sequence") == 0) {
        list = cJSON_GetObjectItemCaseSensitive(pj, "pretokenizers");
        if (!cJSON_IsArray(list))
            return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: pre_tokenizer Sequence has no list",
                                c->what);
    }
    int n = list ? cJSON_GetArraySize(list) : 1;
    for (int i = 0; i < n; i++) {
        const cJSON *o = list ? cJSON_GetArrayItem(list, i) : pj;
        const char *t = type_of(o);
        if (strcmp(t, "Split") == 0 && tok->family == FAMILY_SENTENCEPIECE && !tok->metaspace) {
            LOOM_CHECK(parse_split(tok, o, c));
        } else if (strcmp(t, "ByteLevel") == 0 && tok->family == FAMILY_SENTENCEPIECE &&
                   !tok->metaspace) {
            tok->family = FAMILY_BYTE_LEVEL;
            tok->byte_level_prefix_space = json_bool(o, "add_prefix_space", false);
            if (json_bool(o, "use_regex", true)) {
                if (tok->n_splits)
                    return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                                        "%s: Split followed by ByteLevel with use_regex is not "
                                        "supported",
                                        c->what);
                tok->splits[tok->n_splits] = LOOM_SPLIT_GPT2;
                tok->split_gaps[tok->n_splits++] = true;
            }
        } else if (strcmp(t, "Metaspace") == 0 && n == 1 && !tok->n_splits) {
            const char *rep = json_str(o, "replacement");
            if (rep && strcmp(rep, META) != 0)
                return loom_err_set(
                    c->err, LOOM_ERR_UNSUPPORTED,
                    "%s: Metaspace replacement other than \"" META "\" is not supported", c->what);
            tok->metaspace = true;
            tok->metaspace_split = json_bool(o, "split", true);
            const char *scheme = json_str(o, "prepend_scheme");
            if (scheme) {
                tok->prepend_scheme = strcmp(scheme, "first") == 0   ? PREPEND_FIRST
                                      : strcmp(scheme, "never") == 0 ? PREPEND_NEVER
                                                                     : PREPEND_ALWAYS;
            } else {
                tok->prepend_scheme =
                    json_bool(o, "add_prefix_space", true) ? PREPEND_ALWAYS : PREPEND_NEVER;
            }
        } else {
            return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                                "%s: pre_tokenizer \"%s\" is not supported here (supported: "
                                "Metaspace; ByteLevel; Sequence of Splits and ByteLevel)",
                                c->what, t);
        }
    }
    if (tok->n_splits && tok->family != FAMILY_BYTE_LEVEL)
        return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                            "%s: a Split pre-tokenizer without ByteLevel is not supported",
                            c->what);
    return LOOM_OK;
}

/* Reads the decoder into strip_start; the per-token texts follow from the
 * family. Returns flags for the SentencePiece decoders found. */
static loom_status_t parse_decoder(loom_tokenizer_t *tok, const cJSON *dj, bool *replace_meta,
                                   bool *byte_fallback, load_ctx_t *c) {
    *replace_meta = *byte_fallback = false;
    tok->strip_start = 0;
    if (!dj || cJSON_IsNull(dj)) {
        if (tok->family == FAMILY_SENTENCEPIECE) { /* the usual Llama decoder */
            *replace_meta = *byte_fallback = true;
            tok->strip_start = 1;
        }
        return LOOM_OK;
    }
    const cJSON *list = NULL;
    if (strcmp(type_of(dj), "Sequence") == 0) {
        list = cJSON_GetObjectItemCaseSensitive(dj, "decoders");
        if (!cJSON_IsArray(list))
            return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: decoder Sequence has no list",
                                c->what);
    }
    int n = list ? cJSON_GetArraySize(list) : 1;
    for (int i = 0; i < n; i++) {
        const cJSON *o = list ? cJSON_GetArrayItem(list, i) : dj;
        const char *t = type_of(o);
        if (strcmp(t, "Replace") == 0) {
            const char *from = json_str(cJSON_GetObjectItemCaseSensitive(o, "pattern"), "String");
            const char *to = json_str(o, "content");
            if (!from || !to || strcmp(from, META) != 0 || strcmp(to, " ") != 0)
                return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                                    "%s: decoder Replace other than \"" META
                                    "\" -> \" \" is not supported",
                                    c->what);
            *replace_meta = true;
        } else if (strcmp(t, "ByteFallback") == 0) {
            *byte_fallback = true;
        } else if (strcmp(t, "Fuse") == 0) {
            /* concatenation is what decode does anyway */
        } else if (strcmp(t, "Strip") == 0) {
            const char *content = json_str(o, "content");
            const cJSON *start = cJSON_GetObjectItemCaseSensitive(o, "start");
            const cJSON *stop = cJSON_GetObjectItemCaseSensitive(o, "stop");
            if (!content || strcmp(content, " ") != 0 || (cJSON_IsNumber(stop) && stop->valueint))
                return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                                    "%s: decoder Strip supports only leading spaces", c->what);
            tok->strip_start = cJSON_IsNumber(start) ? LOOM_MAX(0, start->valueint) : 0;
        } else if (strcmp(t, "Metaspace") == 0) {
            *replace_meta = true;
            const char *scheme = json_str(o, "prepend_scheme");
            bool prefix =
                scheme ? strcmp(scheme, "never") != 0 : json_bool(o, "add_prefix_space", true);
            if (prefix) tok->strip_start = 1;
        } else if (strcmp(t, "ByteLevel") == 0) {
            if (tok->family != FAMILY_BYTE_LEVEL)
                return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                                    "%s: ByteLevel decoder without a ByteLevel pre-tokenizer",
                                    c->what);
        } else {
            return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED, "%s: decoder \"%s\" is not supported",
                                c->what, t);
        }
    }
    return LOOM_OK;
}

/* The token string the post-processor's single-sequence template puts
 * first, when it starts with a special token (the BOS that HF adds). */
static const cJSON *template_first_special(const cJSON *pp, int32_t *id_out) {
    *id_out = -1;
    if (!pp || cJSON_IsNull(pp)) return NULL;
    const char *t = type_of(pp);
    if (strcmp(t, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(pp, "processors");
        const cJSON *it;
        cJSON_ArrayForEach(it, list) {
            const cJSON *r = template_first_special(it, id_out);
            if (r) return r;
        }
        return NULL;
    }
    if (strcmp(t, "TemplateProcessing") != 0) return NULL;
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(pp, "single");
    const cJSON *first = cJSON_GetArrayItem(single, 0);
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(first, "SpecialToken");
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(st, "id");
    if (!cJSON_IsString(name)) return NULL;
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(pp, "special_tokens");
    const cJSON *entry = cJSON_GetObjectItemCaseSensitive(specials, name->valuestring);
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(entry, "ids");
    int32_t id;
    if (cJSON_GetArraySize(ids) == 1 && json_id(cJSON_GetArrayItem(ids, 0), &id)) *id_out = id;
    return name;
}

static bool is_byte_piece(const char *p, size_t n, int *byte) {
    if (n != 6 || p[0] != '<' || p[1] != '0' || p[2] != 'x' || p[5] != '>') return false;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char ch = p[i];
        int d = ch >= '0' && ch <= '9'   ? ch - '0'
                : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
                : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                                         : -1;
        if (d < 0) return false;
        v = v * 16 + d;
    }
    *byte = v;
    return true;
}

/* Decoded bytes of one token, into the arena. */
static void make_text(loom_tokenizer_t *tok, int32_t id, bool replace_meta, bool byte_fallback,
                      const uint32_t byte_to_cp[256]) {
    const char *p = tok->piece[id];
    size_t n = tok->piece_len[id];
    bool added = tok->flags[id] & TOK_ADDED;
    int byte;
    if (tok->family == FAMILY_BYTE_LEVEL) {
        if (!added) {
            char *out = arena_alloc(&tok->arena, n + 1);
            size_t k = 0;
            bool ok = true;
            for (size_t i = 0; i < n && ok;) {
                size_t l;
                uint32_t cp = loom_utf8_next((const unsigned char *)p, n, i, &l);
                int b = cp == 0xFFFFFFFFu ? -1 : byte_level_byte(byte_to_cp, cp);
                if (b < 0) ok = false;
                out[k++] = (char)b;
                i += l;
            }
            if (ok) { /* else: as HF, a token outside the alphabet decodes to itself */
                out[k] = 0;
                tok->text[id] = out;
                tok->text_len[id] = (uint32_t)k;
                return;
            }
        }
        tok->text[id] = (char *)p;
        tok->text_len[id] = (uint32_t)n;
        return;
    }
    if (byte_fallback && is_byte_piece(p, n, &byte)) {
        tok->flags[id] |= TOK_BYTE;
        tok->byte_runs = true;
        char *out = arena_alloc(&tok->arena, 2);
        out[0] = (char)byte;
        out[1] = 0;
        tok->text[id] = out;
        tok->text_len[id] = 1;
        return;
    }
    if (!replace_meta || !strstr(p, META)) {
        tok->text[id] = (char *)p;
        tok->text_len[id] = (uint32_t)n;
        return;
    }
    char *out = arena_alloc(&tok->arena, n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        if (i + 3 <= n && memcmp(p + i, META, 3) == 0) {
            out[k++] = ' ';
            i += 3;
        } else {
            out[k++] = p[i++];
        }
    }
    out[k] = 0;
    tok->text[id] = out;
    tok->text_len[id] = (uint32_t)k;
}

/* Sets a token's piece (first setter wins unless `force`). */
static void set_piece(loom_tokenizer_t *tok, int32_t id, const char *s, size_t n, bool force) {
    if (tok->piece[id] && !force) return;
    tok->piece[id] = arena_strndup(&tok->arena, s, n);
    tok->piece_len[id] = (uint32_t)n;
}

/* Splits a merge given as "a b" or ["a", "b"]. */
static bool merge_parts(const cJSON *m, const char **a, size_t *an, const char **b, size_t *bn) {
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring;
        const char *sp = strchr(s, ' ');
        if (!sp || sp == s) return false;
        *a = s;
        *an = (size_t)(sp - s);
        *b = sp + 1;
        const char *end = strchr(*b, ' ');
        *bn = end ? (size_t)(end - *b) : strlen(*b);
        return *bn > 0;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2) {
        const cJSON *x = cJSON_GetArrayItem(m, 0), *y = cJSON_GetArrayItem(m, 1);
        if (!cJSON_IsString(x) || !cJSON_IsString(y)) return false;
        *a = x->valuestring;
        *an = strlen(*a);
        *b = y->valuestring;
        *bn = strlen(*b);
        return true;
    }
    return false;
}

/* True when the string has a META right after a character that is not META. */
static bool has_inner_meta(const char *s, size_t n) {
    for (size_t i = 1; i + 3 <= n; i++) {
        if (memcmp(s + i, META, 3) != 0) continue;
        if (i < 3 || memcmp(s + i - 3, META, 3) != 0) return true;
    }
    return false;
}

static loom_status_t load_model(loom_tokenizer_t *tok, const cJSON *root, load_ctx_t *c,
                                const uint32_t byte_to_cp[256]) {
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model))
        return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: no \"model\" object", c->what);
    const char *mtype = json_str(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (mtype ? strcmp(mtype, "BPE") != 0 : !cJSON_IsArray(merges))
        return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                            "%s: tokenizer model type \"%s\" is not supported (only BPE)", c->what,
                            mtype ? mtype : "(unknown)");
    if (!cJSON_IsObject(vocab))
        return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: model.vocab is not an object", c->what);
    if (merges && !cJSON_IsArray(merges) && !cJSON_IsNull(merges))
        return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: model.merges is not an array", c->what);
    const char *cont = json_str(model, "continuing_subword_prefix");
    const char *eow = json_str(model, "end_of_word_suffix");
    if ((cont && *cont) || (eow && *eow))
        return loom_err_set(c->err, LOOM_ERR_UNSUPPORTED,
                            "%s: BPE with continuing_subword_prefix / end_of_word_suffix is not "
                            "supported",
                            c->what);
    tok->byte_fallback = json_bool(model, "byte_fallback", false);
    tok->fuse_unk = json_bool(model, "fuse_unk", false);
    tok->ignore_merges = json_bool(model, "ignore_merges", false);

    /* Largest id over vocab and added tokens. */
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsArray(added) && !cJSON_IsNull(added))
        return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: added_tokens is not an array", c->what);
    int32_t max_id = -1, id;
    int n_model = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab) {
        if (!json_id(it, &id))
            return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: bad id for vocab entry \"%.100s\"",
                                c->what, it->string ? it->string : "");
        max_id = LOOM_MAX(max_id, id);
        n_model++;
    }
    int n_added = 0;
    cJSON_ArrayForEach(it, added) {
        if (!json_id(cJSON_GetObjectItemCaseSensitive(it, "id"), &id) || !json_str(it, "content"))
            return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: bad entry in added_tokens", c->what);
        max_id = LOOM_MAX(max_id, id);
        n_added++;
    }
    if (max_id < 0) return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: empty vocabulary", c->what);
    if (n_model == 0) return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: model.vocab is empty", c->what);
    int nv = tok->n_vocab = max_id + 1;
    tok->piece = loom_xcalloc((size_t)nv, sizeof *tok->piece);
    tok->piece_len = loom_xcalloc((size_t)nv, sizeof *tok->piece_len);
    tok->text = loom_xcalloc((size_t)nv, sizeof *tok->text);
    tok->text_len = loom_xcalloc((size_t)nv, sizeof *tok->text_len);
    tok->key = loom_xcalloc((size_t)nv, sizeof *tok->key);
    tok->key_len = loom_xcalloc((size_t)nv, sizeof *tok->key_len);
    tok->flags = loom_xcalloc((size_t)nv, sizeof *tok->flags);

    cJSON_ArrayForEach(it, vocab) {
        json_id(it, &id);
        if (tok->flags[id] & TOK_MODEL) /* two pieces for one id: one of them could never be decoded right */
            return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: vocab id %d is given twice (\"%.100s\" and \"%.100s\")",
                                c->what, (int)id, tok->piece[id] ? tok->piece[id] : "", it->string);
        set_piece(tok, id, it->string, strlen(it->string), false);
        tok->flags[id] |= TOK_MODEL;
    }
    tok->added = loom_xcalloc((size_t)n_added + 1, sizeof *tok->added);
    cJSON_ArrayForEach(it, added) {
        json_id(cJSON_GetObjectItemCaseSensitive(it, "id"), &id);
        const char *content = json_str(it, "content");
        set_piece(tok, id, content, strlen(content), true);
        tok->flags[id] |= TOK_ADDED;
        added_token_t *a = &tok->added[tok->n_added++];
        a->id = id;
        a->special = json_bool(it, "special", false);
        a->lstrip = json_bool(it, "lstrip", false);
        a->rstrip = json_bool(it, "rstrip", false);
        a->normalized = json_bool(it, "normalized", !a->special);
        if (a->special) tok->flags[id] |= TOK_SPECIAL;
    }

    /* Per-token decoded text and BPE key. */
    bool replace_meta, byte_fallback_dec;
    LOOM_CHECK(parse_decoder(tok, cJSON_GetObjectItemCaseSensitive(root, "decoder"), &replace_meta,
                             &byte_fallback_dec, c));
    for (int32_t i = 0; i < nv; i++) {
        if (!tok->piece[i]) continue;
        make_text(tok, i, replace_meta, byte_fallback_dec, byte_to_cp);
        if (tok->family == FAMILY_BYTE_LEVEL && (tok->flags[i] & TOK_MODEL) &&
            tok->text[i] != tok->piece[i]) {
            tok->key[i] = tok->text[i];
            tok->key_len[i] = tok->text_len[i];
        } else {
            tok->key[i] = tok->piece[i];
            tok->key_len[i] = tok->piece_len[i];
        }
    }

    strmap_init(&tok->model_map, (size_t)n_model, tok->key, tok->key_len);
    strmap_init(&tok->piece_map, (size_t)(n_model + n_added), (const char *const *)tok->piece,
                tok->piece_len);
    cJSON_ArrayForEach(it, vocab) {
        json_id(it, &id);
        if (tok->piece_len[id] == strlen(it->string) &&
            memcmp(tok->piece[id], it->string, tok->piece_len[id]) == 0) {
            strmap_put(&tok->model_map, id, false);
            strmap_put(&tok->piece_map, id, false);
        }
    }
    for (int i = 0; i < tok->n_added; i++)
        strmap_put(&tok->piece_map, tok->added[i].id, true);

    for (int i = 0; i < 128; i++) {
        char ch = (char)i;
        tok->ascii_id[i] = strmap_get(&tok->model_map, &ch, 1);
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        if (tok->family == FAMILY_BYTE_LEVEL) {
            char ch = (char)b;
            tok->byte_id[b] = strmap_get(&tok->model_map, &ch, 1);
        } else {
            snprintf(name, sizeof name, "<0x%02X>", b);
            tok->byte_id[b] = strmap_get(&tok->model_map, name, 6);
        }
    }
    const char *unk = json_str(model, "unk_token");
    tok->unk_id = unk ? strmap_get(&tok->piece_map, unk, strlen(unk)) : -1;

    /* Merges: (left, right) -> (rank, merged). A merge whose parts or result
     * are not in the vocabulary is a broken file (HF's tokenizers refuses it
     * too): refused, naming the merge. */
    int n_merges = cJSON_GetArraySize(merges);
    pairmap_init(&tok->merges, (size_t)n_merges);
    tok->sp_word_split = tok->family == FAMILY_SENTENCEPIECE;
    char stack[256];
    int rank = 0;
    cJSON_ArrayForEach(it, merges) {
        const char *a, *b;
        size_t an, bn;
        if (!merge_parts(it, &a, &an, &b, &bn))
            return loom_err_set(c->err, LOOM_ERR_FORMAT, "%s: malformed merge #%d", c->what, rank);
        int32_t ia = strmap_get(&tok->piece_map, a, an);
        int32_t ib = strmap_get(&tok->piece_map, b, bn);
        char *cat = an + bn <= sizeof stack ? stack : loom_xmalloc(an + bn);
        memcpy(cat, a, an);
        memcpy(cat + an, b, bn);
        int32_t ir = strmap_get(&tok->piece_map, cat, an + bn);
        if (ia < 0 || ib < 0 || ir < 0) {
            const char *which = ia < 0 ? a : ib < 0 ? b : cat;
            size_t wn = ia < 0 ? an : ib < 0 ? bn : an + bn;
            loom_status_t st = loom_err_set(c->err, LOOM_ERR_FORMAT,
                                            "%s: merge #%d ('%.*s' '%.*s') names '%.*s', which is not in model.vocab",
                                            c->what, rank, (int)LOOM_MIN(an, 64), a, (int)LOOM_MIN(bn, 64), b,
                                            (int)LOOM_MIN(wn, 128), which);
            if (cat != stack) free(cat);
            return st;
        }
        if (tok->sp_word_split && has_inner_meta(cat, an + bn)) {
            if (tok->n_cross == MAX_CROSS) {
                tok->sp_word_split = false;
            } else {
                if (!tok->cross) {
                    tok->cross = loom_xcalloc(MAX_CROSS, sizeof *tok->cross);
                    tok->cross_len = loom_xcalloc(MAX_CROSS, sizeof *tok->cross_len);
                }
                tok->cross[tok->n_cross] = arena_strndup(&tok->arena, cat, an + bn);
                tok->cross_len[tok->n_cross++] = (uint32_t)(an + bn);
            }
        }
        if (cat != stack) free(cat);
        if (ia >= 0 && ib >= 0 && ir >= 0 && (tok->flags[ia] & TOK_MODEL) &&
            (tok->flags[ib] & TOK_MODEL) && (tok->flags[ir] & TOK_MODEL)) {
            pair_entry_t *e = pairmap_put(&tok->merges, pair_key(ia, ib));
            e->rank = rank; /* a repeated pair keeps its last rank, as HF does */
            e->value = ir;
        }
        rank++;
    }
    return LOOM_OK;
}

static void build_added_tries(loom_tokenizer_t *tok) {
    char *buf = NULL, *tmp = NULL;
    size_t cap = 0, tmp_cap = 0;
    for (int i = 0; i < tok->n_added; i++) {
        added_token_t *a = &tok->added[i];
        const char *s = tok->piece[a->id];
        size_t n = tok->piece_len[a->id];
        if (a->normalized && tok->n_norm > 0) {
            size_t len = 0;
            normalize(tok, s, n, &buf, &len, &cap, &tmp, &tmp_cap);
            trie_add(&tok->trie_norm, buf, len, i);
        } else {
            trie_add(&tok->trie_raw, s, n, i);
        }
    }
    free(buf);
    free(tmp);
}

/* max_piece_len: the longest single-token decode, after UTF-8 repair. */
static void finish_lengths(loom_tokenizer_t *tok) {
    sink_t k = {.buf = NULL, .cap = 0, .grow = true};
    size_t best = 0;
    for (int32_t i = 0; i < tok->n_vocab; i++) {
        if (!tok->piece[i]) continue;
        k.len = 0;
        utf8_state_t u;
        utf8_reset(&u);
        const unsigned char *p = (const unsigned char *)tok->text[i];
        for (uint32_t j = 0; j < tok->text_len[i]; j++)
            utf8_feed(&u, p[j], &k);
        utf8_flush(&u, &k);
        best = LOOM_MAX(best, k.len);
    }
    free(k.buf);
    tok->max_piece_len = best;
}

static void load_config(loom_tokenizer_t *tok, const cJSON *root, const cJSON *cfg) {
    int32_t tmpl_id;
    const cJSON *tmpl_name =
        template_first_special(cJSON_GetObjectItemCaseSensitive(root, "post_processor"), &tmpl_id);
    if (tmpl_name && tmpl_id < 0)
        tmpl_id =
            strmap_get(&tok->piece_map, tmpl_name->valuestring, strlen(tmpl_name->valuestring));
    tok->bos_id = tok->eos_id = -1;
    const char *bos =
        cfg ? json_token_name(cJSON_GetObjectItemCaseSensitive(cfg, "bos_token")) : NULL;
    const char *eos =
        cfg ? json_token_name(cJSON_GetObjectItemCaseSensitive(cfg, "eos_token")) : NULL;
    if (bos) tok->bos_id = strmap_get(&tok->piece_map, bos, strlen(bos));
    if (eos) tok->eos_id = strmap_get(&tok->piece_map, eos, strlen(eos));
    if (!bos && tmpl_id >= 0) tok->bos_id = tmpl_id;
    tok->cleanup =
        cfg && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cfg, "clean_up_tokenization_spaces"));
    const cJSON *ab = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "add_bos_token") : NULL;
    if (cJSON_IsBool(ab))
        tok->add_bos = cJSON_IsTrue(ab);
    else
        tok->add_bos = tmpl_id >= 0 && tmpl_id == tok->bos_id;
}

static loom_status_t load_parsed(const cJSON *root, const cJSON *cfg, loom_tokenizer_t **out,
                                 load_ctx_t *c) {
    uint32_t byte_to_cp[256];
    byte_level_table(byte_to_cp);
    loom_tokenizer_t *tok = loom_xcalloc(1, sizeof *tok);
    loom_status_t s;
    if ((s = parse_normalizer(tok, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), c)) < 0 ||
        (s = parse_pre_tokenizer(tok, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), c)) <
            0 ||
        (s = load_model(tok, root, c, byte_to_cp)) < 0) {
        loom_tokenizer_destroy(&tok);
        return s;
    }
    load_config(tok, root, cfg);
    build_added_tries(tok);
    finish_lengths(tok);
    *out = tok;
    return LOOM_OK;
}

static loom_status_t load_texts(const char *json, size_t len, const char *cfg_json, size_t cfg_len,
                                loom_tokenizer_t **out, const char *what, const char *cfg_what,
                                loom_err_t *err) {
    load_ctx_t c = {.what = what, .err = err};
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not valid JSON", what);
    }
    cJSON *cfg = NULL;
    if (cfg_json) {
        cfg = cJSON_ParseWithLength(cfg_json, cfg_len);
        if (!cfg || !cJSON_IsObject(cfg)) {
            cJSON_Delete(root);
            cJSON_Delete(cfg);
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not valid JSON", cfg_what);
        }
    }
    loom_status_t s = load_parsed(root, cfg, out, &c);
    cJSON_Delete(root);
    cJSON_Delete(cfg);
    return s;
}

loom_status_t loom_tokenizer_load_json(const char *tokenizer_json, size_t len,
                                       const char *config_json, size_t config_len,
                                       loom_tokenizer_t **out, loom_err_t *err) {
    if (!out) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tokenizer: out is NULL");
    *out = NULL;
    if (!tokenizer_json)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tokenizer: no JSON given");
    return load_texts(tokenizer_json, len, config_json, config_len, out, "tokenizer.json",
                      "tokenizer_config.json", err);
}

loom_status_t loom_tokenizer_load(const char *dir, loom_tokenizer_t **out, loom_err_t *err) {
    if (!out) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tokenizer: out is NULL");
    *out = NULL;
    if (!dir) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tokenizer: no directory");
    char path[4096], cfg_path[4096];
    if (!loom_path_join(path, sizeof path, dir, "tokenizer.json") ||
        !loom_path_join(cfg_path, sizeof cfg_path, dir, "tokenizer_config.json"))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tokenizer: path too long: %s", dir);
    char *json = NULL, *cfg = NULL;
    size_t len = 0, cfg_len = 0;
    LOOM_CHECK(loom_read_file(path, &json, &len, err));
    FILE *f = fopen(cfg_path, "rb");
    if (f) {
        fclose(f);
        loom_status_t s = loom_read_file(cfg_path, &cfg, &cfg_len, err);
        if (s < 0) {
            free(json);
            return s;
        }
    }
    loom_status_t s = load_texts(json, len, cfg, cfg_len, out, path, cfg_path, err);
    free(json);
    free(cfg);
    return s;
}

/* ------------------------------------------------------------------------ */
/* Encoding                                                                 */

typedef struct {
    uint32_t rank;
    uint32_t left; /* symbol index of the pair's left side */
    int32_t lid, rid;
    int32_t merged;
} heap_entry_t;

/* Per-call scratch memory; grows, never shrinks during a call. */
typedef struct {
    int32_t *ids;
    int n_ids, cap;
    bool nomem;
    /* symbols of the current word */
    int32_t *sym_id;
    uint32_t *sym_start, *sym_len;
    int32_t *sym_prev, *sym_next;
    size_t sym_cap;
    heap_entry_t *heap;
    size_t heap_n, heap_cap;
    /* normalization output and its scratch */
    char *norm, *norm_tmp;
    size_t norm_cap, norm_tmp_cap;
    /* pre-tokenizer rewriting (Metaspace, prefix space) */
    char *pre;
    size_t pre_cap;
    bool parse_special;
    int last_emitted_unk; /* fuse_unk: the previous output was unk in this section */
    /* encode_spans: special tokens are not matched over these [start, end)
     * byte pairs of the raw text (base). While splitting a section on the
     * normalized-text trie: norm_off is the section's offset in the raw
     * text when it was not rewritten by normalization, else -1 and norm_ok
     * says whether the whole section lies outside the spans. */
    const unsigned char *base;
    const size_t *plain;
    size_t n_plain;
    ptrdiff_t norm_off;
    bool norm_ok;
} enc_t;

/* Whether raw bytes [a, b) overlap one of e's plain spans (binary search:
 * the spans are in order and disjoint). */
static bool overlaps_plain(const enc_t *e, size_t a, size_t b) {
    size_t lo = 0, hi = e->n_plain;
    while (lo < hi) { /* the first span that ends after a */
        size_t mid = lo + (hi - lo) / 2;
        if (e->plain[2 * mid + 1] <= a) lo = mid + 1;
        else hi = mid;
    }
    return lo < e->n_plain && e->plain[2 * lo] < b;
}

static bool grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return true;
    size_t n = *cap ? *cap : 16;
    while (n < need)
        n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q) return false;
    *p = q;
    *cap = n;
    return true;
}

static inline void emit(enc_t *e, int32_t id) {
    if (e->n_ids == e->cap) {
        size_t cap = (size_t)e->cap;
        if (!grow((void **)&e->ids, &cap, (size_t)e->n_ids + 1, sizeof *e->ids) || cap > INT_MAX) {
            e->nomem = true;
            return;
        }
        e->cap = (int)cap;
    }
    e->ids[e->n_ids++] = id;
}

static void heap_push(enc_t *e, heap_entry_t x) {
    if (!grow((void **)&e->heap, &e->heap_cap, e->heap_n + 1, sizeof *e->heap)) {
        e->nomem = true;
        return;
    }
    size_t i = e->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        heap_entry_t *hp = &e->heap[p];
        if (hp->rank < x.rank || (hp->rank == x.rank && hp->left < x.left)) break;
        e->heap[i] = *hp;
        i = p;
    }
    e->heap[i] = x;
}

static heap_entry_t heap_pop(enc_t *e) {
    heap_entry_t top = e->heap[0];
    heap_entry_t x = e->heap[--e->heap_n];
    size_t n = e->heap_n, i = 0;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t r = l + 1, m = l;
        if (r < n && (e->heap[r].rank < e->heap[l].rank ||
                      (e->heap[r].rank == e->heap[l].rank && e->heap[r].left < e->heap[l].left)))
            m = r;
        if (x.rank < e->heap[m].rank || (x.rank == e->heap[m].rank && x.left < e->heap[m].left))
            break;
        e->heap[i] = e->heap[m];
        i = m;
    }
    if (n) e->heap[i] = x;
    return top;
}

static inline void push_pair(const loom_tokenizer_t *tok, enc_t *e, int32_t left) {
    int32_t right = e->sym_next[left];
    if (right < 0) return;
    int32_t a = e->sym_id[left], b = e->sym_id[right];
    if (a < 0 || b < 0) return;
    const pair_entry_t *m = pairmap_get(&tok->merges, pair_key(a, b));
    if (!m) return;
    heap_push(e, (heap_entry_t){.rank = (uint32_t)m->rank,
                                .left = (uint32_t)left,
                                .lid = a,
                                .rid = b,
                                .merged = m->value});
}

/* Emits an unknown piece of text: byte tokens, or unk. */
static void emit_unknown(const loom_tokenizer_t *tok, enc_t *e, const unsigned char *s, size_t n) {
    if (tok->byte_fallback) {
        bool all = true;
        for (size_t i = 0; i < n && all; i++)
            all = tok->byte_id[s[i]] >= 0;
        if (all) {
            for (size_t i = 0; i < n; i++)
                emit(e, tok->byte_id[s[i]]);
            e->last_emitted_unk = 0;
            return;
        }
    }
    if (tok->unk_id < 0) return;
    if (tok->fuse_unk && e->last_emitted_unk) return;
    emit(e, tok->unk_id);
    e->last_emitted_unk = 1;
}

static inline void emit_known(enc_t *e, int32_t id) {
    emit(e, id);
    e->last_emitted_unk = 0;
}

/* Makes room for n symbols in every per-symbol array. */
static bool grow_symbols(enc_t *e, size_t n) {
    size_t cap = e->sym_cap ? e->sym_cap : 64;
    while (cap < n)
        cap *= 2;
    int32_t *id = realloc(e->sym_id, cap * sizeof *id);
    if (id) e->sym_id = id;
    uint32_t *start = realloc(e->sym_start, cap * sizeof *start);
    if (start) e->sym_start = start;
    uint32_t *len = realloc(e->sym_len, cap * sizeof *len);
    if (len) e->sym_len = len;
    int32_t *prev = realloc(e->sym_prev, cap * sizeof *prev);
    if (prev) e->sym_prev = prev;
    int32_t *next = realloc(e->sym_next, cap * sizeof *next);
    if (next) e->sym_next = next;
    if (!id || !start || !len || !prev || !next) {
        e->nomem = true;
        return false;
    }
    e->sym_cap = cap;
    return true;
}

enum { SMALL_WORD = 16 }; /* words up to this many symbols skip the heap */

/* Rank and result of merging symbols a and b; UINT32_MAX when there is none. */
static inline uint32_t pair_rank(const loom_tokenizer_t *tok, int32_t a, int32_t b,
                                 int32_t *merged) {
    if (a < 0 || b < 0) return UINT32_MAX;
    const pair_entry_t *m = pairmap_get(&tok->merges, pair_key(a, b));
    if (!m) return UINT32_MAX;
    *merged = m->value;
    return (uint32_t)m->rank;
}

/* Short words: symbols in a linked list, the rank of each symbol's pair
 * with its successor cached, and a scan for the lowest (leftmost on ties). */
static void merge_small(const loom_tokenizer_t *tok, enc_t *e, int32_t m) {
    uint32_t rank[SMALL_WORD];
    int32_t merged[SMALL_WORD];
    int32_t *next = e->sym_next;
    for (int32_t i = 0; i < m; i++) {
        next[i] = i + 1 < m ? i + 1 : -1;
        rank[i] =
            i + 1 < m ? pair_rank(tok, e->sym_id[i], e->sym_id[i + 1], &merged[i]) : UINT32_MAX;
    }
    for (;;) {
        int32_t k = -1, before_k = -1;
        uint32_t lowest = UINT32_MAX;
        for (int32_t i = 0, prev = -1; i >= 0; prev = i, i = next[i]) {
            if (rank[i] < lowest) {
                lowest = rank[i];
                k = i;
                before_k = prev;
            }
        }
        if (k < 0) return;
        int32_t r = next[k];
        e->sym_id[k] = merged[k];
        e->sym_len[k] += e->sym_len[r];
        next[k] = next[r];
        rank[k] = next[k] >= 0 ? pair_rank(tok, e->sym_id[k], e->sym_id[next[k]], &merged[k])
                               : UINT32_MAX;
        if (before_k >= 0)
            rank[before_k] = pair_rank(tok, e->sym_id[before_k], e->sym_id[k], &merged[before_k]);
    }
}

/* Long words: symbols in a linked list, candidate pairs in a heap keyed by
 * (rank, left position); entries made stale by a merge are skipped. */
static void merge_heap(const loom_tokenizer_t *tok, enc_t *e, int32_t m) {
    for (int32_t i = 0; i < m; i++) {
        e->sym_prev[i] = i - 1;
        e->sym_next[i] = i + 1 < m ? i + 1 : -1;
    }
    e->heap_n = 0;
    for (int32_t i = 0; i + 1 < m; i++)
        push_pair(tok, e, i);
    while (e->heap_n > 0 && !e->nomem) {
        heap_entry_t h = heap_pop(e);
        int32_t l = (int32_t)h.left;
        int32_t r = e->sym_next[l];
        if (e->sym_id[l] != h.lid || r < 0 || e->sym_id[r] != h.rid) continue; /* stale */
        e->sym_id[l] = h.merged;
        e->sym_len[l] += e->sym_len[r];
        e->sym_id[r] = INT32_MIN; /* dead */
        int32_t rn = e->sym_next[r];
        e->sym_next[l] = rn;
        if (rn >= 0) e->sym_prev[rn] = l;
        if (e->sym_prev[l] >= 0) push_pair(tok, e, e->sym_prev[l]);
        push_pair(tok, e, l);
    }
}

static inline void emit_symbol(const loom_tokenizer_t *tok, enc_t *e, const unsigned char *s,
                               int32_t i) {
    if (e->sym_id[i] >= 0)
        emit_known(e, e->sym_id[i]);
    else
        emit_unknown(tok, e, s + e->sym_start[i], e->sym_len[i]);
}

/* BPE over one word; s[0..n) is in the model's key form (raw bytes for
 * byte-level, normalized text for SentencePiece). */
static void bpe_word(const loom_tokenizer_t *tok, enc_t *e, const unsigned char *s, size_t n) {
    if (n == 0) return;
    if (tok->ignore_merges || n == 1) {
        int32_t id = strmap_get(&tok->model_map, (const char *)s, n);
        if (id >= 0) {
            emit_known(e, id);
            return;
        }
    }
    if (n > e->sym_cap && !grow_symbols(e, n)) return;
    /* Initial symbols. */
    int32_t m = 0;
    if (tok->family == FAMILY_BYTE_LEVEL) {
        for (size_t i = 0; i < n; i++, m++) {
            e->sym_id[m] = tok->byte_id[s[i]];
            e->sym_start[m] = (uint32_t)i;
            e->sym_len[m] = 1;
        }
    } else {
        for (size_t i = 0; i < n; m++) {
            size_t l = 1;
            int32_t id;
            if (s[i] < 0x80) {
                id = tok->ascii_id[s[i]];
            } else {
                (void)loom_utf8_next(s, n, i, &l);
                id = strmap_get(&tok->model_map, (const char *)s + i, l);
            }
            e->sym_id[m] = id;
            e->sym_start[m] = (uint32_t)i;
            e->sym_len[m] = (uint32_t)l;
            i += l;
        }
    }
    if (m <= SMALL_WORD)
        merge_small(tok, e, m);
    else
        merge_heap(tok, e, m);
    for (int32_t i = 0; i >= 0; i = e->sym_next[i])
        emit_symbol(tok, e, s, i);
}

/* Applies split `level` and those after it to s[0..n), then BPEs each
 * resulting piece. A split sees each piece of the one before as a whole
 * text (its lookaheads stop at the piece's end), as HF's do. */
static void split_words(const loom_tokenizer_t *tok, enc_t *e, const unsigned char *s, size_t n,
                        int level) {
    if (level == tok->n_splits) {
        bpe_word(tok, e, s, n);
        return;
    }
    loom_split_t kind = tok->splits[level];
    bool gaps = tok->split_gaps[level];
    size_t gap = 0; /* start of the text no match has covered */
    for (size_t i = 0; i < n && !e->nomem;) {
        size_t j = loom_split_match(kind, s, n, i);
        if (j == i) { /* nothing matches here: the character joins the gap */
            size_t l;
            (void)loom_utf8_next(s, n, i, &l);
            i += l;
            continue;
        }
        if (gaps && gap < i) split_words(tok, e, s + gap, i - gap, level + 1);
        split_words(tok, e, s + i, j - i, level + 1);
        i = gap = j;
    }
    if (gaps && gap < n && !e->nomem) split_words(tok, e, s + gap, n - gap, level + 1);
}

/* True when some merge that crosses a word start could apply at the word
 * start s[i] ("▁" after another character): its result is in the text with
 * one of its inner word starts at i. Without one, no token can ever span i. */
static bool crossable(const loom_tokenizer_t *tok, const unsigned char *s, size_t n, size_t i) {
    for (int c = 0; c < tok->n_cross; c++) {
        const char *m = tok->cross[c];
        size_t len = tok->cross_len[c];
        for (size_t o = 1; o + 3 <= len; o++) {
            if (memcmp(m + o, META, 3) != 0 || (o >= 3 && memcmp(m + o - 3, META, 3) == 0))
                continue;
            if (o <= i && i - o + len <= n && memcmp(s + i - o, m, len) == 0) return true;
        }
    }
    return false;
}

/* Splits s[0..n) into words and BPEs each. */
static void encode_words(const loom_tokenizer_t *tok, enc_t *e, const unsigned char *s, size_t n) {
    if (tok->n_splits) {
        split_words(tok, e, s, n, 0);
        return;
    }
    bool every_meta = tok->metaspace && tok->metaspace_split;
    if (!every_meta && !tok->sp_word_split) {
        bpe_word(tok, e, s, n);
        return;
    }
    /* Words begin at each "▁" (Metaspace split) or at each "▁" that follows
     * another character (runs of "▁" stay with the word after them). */
    size_t start = 0;
    for (size_t i = 1; i + 3 <= n; i++) {
        if (s[i] != 0xE2 || memcmp(s + i, META, 3) != 0) continue;
        bool after_meta = i >= 3 && memcmp(s + i - 3, META, 3) == 0;
        if (every_meta || (!after_meta && !(tok->n_cross && crossable(tok, s, n, i)))) {
            if (i > start) bpe_word(tok, e, s + start, i - start);
            start = i;
        }
        i += 2;
    }
    bpe_word(tok, e, s + start, n - start);
}

static void normalize(const loom_tokenizer_t *tok, const char *s, size_t n, char **out,
                      size_t *out_len, size_t *cap, char **tmp, size_t *tmp_cap) {
    /* Ops ping-pong between *out and *tmp; the result ends in *out. */
    *out_len = 0;
    if (*cap < n + 1) {
        *cap = n + 1;
        *out = loom_xrealloc(*out, *cap);
    }
    memcpy(*out, s, n);
    *out_len = n;
    for (int k = 0; k < tok->n_norm; k++) {
        const norm_op_t *op = &tok->norm[k];
        size_t len = 0;
        if (op->kind == NORM_NFC) {
            loom_uc_nfc_append(*out, *out_len, tmp, &len, tmp_cap);
        } else if (op->kind == NORM_PREPEND) {
            size_t need = *out_len + op->a_len + 1;
            if (*tmp_cap < need) {
                *tmp_cap = need * 2;
                *tmp = loom_xrealloc(*tmp, *tmp_cap);
            }
            memcpy(*tmp, op->a, op->a_len);
            memcpy(*tmp + op->a_len, *out, *out_len);
            len = *out_len + op->a_len;
        } else {
            /* Replace: the output is at most (n / a_len) * b_len + n. */
            size_t worst = *out_len + (*out_len / op->a_len + 1) * op->b_len + 1;
            if (*tmp_cap < worst) {
                *tmp_cap = worst;
                *tmp = loom_xrealloc(*tmp, *tmp_cap);
            }
            const char *p = *out, *end = *out + *out_len;
            while (p < end) {
                const char *hit = memmem(p, (size_t)(end - p), op->a, op->a_len);
                size_t keep = hit ? (size_t)(hit - p) : (size_t)(end - p);
                memcpy(*tmp + len, p, keep);
                len += keep;
                if (!hit) break;
                memcpy(*tmp + len, op->b, op->b_len);
                len += op->b_len;
                p = hit + op->a_len;
            }
        }
        char *sw = *out;
        *out = *tmp;
        *tmp = sw;
        size_t sc = *cap;
        *cap = *tmp_cap;
        *tmp_cap = sc;
        *out_len = len;
    }
}

/* Whether a special token may be matched at s[i..j) of a text at raw
 * offset off (-1: normalized text, see enc_t). */
static bool special_allowed(const enc_t *e, ptrdiff_t off, size_t i, size_t j) {
    if (!e->parse_special) return false;
    if (!e->n_plain) return true;
    if (off < 0) return e->norm_ok;
    return !overlaps_plain(e, (size_t)off + i, (size_t)off + j);
}

/* Longest allowed added token starting at s[i], or -1; *len its length.
 * off: s's offset in the raw text, or -1 (see special_allowed). */
static int match_added(const loom_tokenizer_t *tok, const enc_t *e, const trie_t *t, const unsigned char *s,
                       size_t n, size_t i, ptrdiff_t off, size_t *len) {
    int best = -1;
    int32_t node = 0;
    for (size_t j = i; j < n; j++) {
        const pair_entry_t *edge = pairmap_get(&t->edges, ((uint64_t)(uint32_t)node << 8) | s[j]);
        if (!edge) break;
        node = edge->value;
        int a = t->terminal[node];
        if (a >= 0 && (!tok->added[a].special || special_allowed(e, off, i, j + 1))) {
            best = a;
            *len = j + 1 - i;
        }
    }
    return best;
}

static inline bool is_space_at(const unsigned char *s, size_t n, size_t i, size_t *len) {
    return (loom_uc_class_at(s, n, i, len) & LOOM_UC_WS) != 0;
}

/* Trims White_Space from the end of s[0..*n). */
static void trim_end(const unsigned char *s, size_t *n) {
    while (*n > 0) {
        size_t p = *n - 1;
        while (p > 0 && (s[p] & 0xC0) == 0x80 && *n - p < 4)
            p--;
        size_t l;
        if (!is_space_at(s, *n, p, &l) || p + l != *n) break;
        *n = p;
    }
}

/* Trims White_Space from the start of s[*i..n). */
static void trim_start(const unsigned char *s, size_t n, size_t *i) {
    size_t l;
    while (*i < n && is_space_at(s, n, *i, &l))
        *i += l;
}

typedef void (*section_fn)(const loom_tokenizer_t *tok, enc_t *e, const unsigned char *s, size_t n,
                           bool first);

/* Splits s[0..n) on the added tokens of trie t: matches are emitted, the
 * text between goes to fn. lstrip/rstrip drop the whitespace next to a
 * match. The text at offset 0 is "first" when the caller's text was. */
static void split_added(const loom_tokenizer_t *tok, enc_t *e, const trie_t *t,
                        const unsigned char *s, size_t n, bool first, section_fn fn) {
    size_t start = 0; /* of the pending text */
    bool strip_next = false;
    ptrdiff_t off = t == &tok->trie_raw ? 0 : e->norm_off; /* the raw trie splits the whole raw text */
    for (size_t i = 0; t->n_tokens > 0 && i < n;) {
        size_t len = 0;
        int a = -1;
        if (t->first[s[i] >> 3] & (1u << (s[i] & 7)))
            a = match_added(tok, e, t, s, n, i, off, &len);
        if (a < 0) {
            i++;
            continue;
        }
        const added_token_t *at = &tok->added[a];
        size_t ts = start, te = i;
        if (strip_next) trim_start(s, te, &ts);
        if (at->lstrip) {
            size_t m = te - ts;
            trim_end(s + ts, &m);
            te = ts + m;
        }
        if (te > ts) fn(tok, e, s + ts, te - ts, first && start == 0);
        emit_known(e, at->id);
        strip_next = at->rstrip;
        i += len;
        start = i;
    }
    size_t ts = start;
    if (strip_next) trim_start(s, n, &ts);
    if (n > ts) fn(tok, e, s + ts, n - ts, first && start == 0);
}

/* A piece of text with no added token in it: the pre-tokenizer's own
 * rewriting (Metaspace, ByteLevel prefix space), then words and BPE. */
static void words_section(const loom_tokenizer_t *tok, enc_t *e, const unsigned char *s, size_t n,
                          bool first) {
    e->last_emitted_unk = 0;
    if (tok->metaspace) {
        if (!grow((void **)&e->pre, &e->pre_cap, n * 3 + 4, 1)) {
            e->nomem = true;
            return;
        }
        size_t k = 0;
        bool starts_meta = s[0] == ' ' || (n >= 3 && memcmp(s, META, 3) == 0);
        if (!starts_meta && (tok->prepend_scheme == PREPEND_ALWAYS ||
                             (tok->prepend_scheme == PREPEND_FIRST && first))) {
            memcpy(e->pre, META, 3);
            k = 3;
        }
        for (size_t i = 0; i < n; i++) {
            if (s[i] == ' ') {
                memcpy(e->pre + k, META, 3);
                k += 3;
            } else {
                e->pre[k++] = (char)s[i];
            }
        }
        encode_words(tok, e, (const unsigned char *)e->pre, k);
        return;
    }
    if (tok->byte_level_prefix_space && s[0] != ' ') {
        if (!grow((void **)&e->pre, &e->pre_cap, n + 1, 1)) {
            e->nomem = true;
            return;
        }
        e->pre[0] = ' ';
        memcpy(e->pre + 1, s, n);
        encode_words(tok, e, (const unsigned char *)e->pre, n + 1);
        return;
    }
    encode_words(tok, e, s, n);
}

/* A section between added tokens matched on the raw text: normalize, then
 * split on the added tokens matched on normalized text. */
static void raw_section(const loom_tokenizer_t *tok, enc_t *e, const unsigned char *s, size_t n,
                        bool first) {
    if (e->n_plain) {
        size_t at = (size_t)(s - e->base);
        e->norm_off = tok->n_norm == 0 ? (ptrdiff_t)at : -1;
        e->norm_ok = !overlaps_plain(e, at, at + n);
    }
    if (tok->n_norm == 0) {
        split_added(tok, e, &tok->trie_norm, s, n, first, words_section);
        return;
    }
    size_t len = 0;
    normalize(tok, (const char *)s, n, &e->norm, &len, &e->norm_cap, &e->norm_tmp,
              &e->norm_tmp_cap);
    if (len > 0)
        split_added(tok, e, &tok->trie_norm, (const unsigned char *)e->norm, len, first,
                    words_section);
}

static loom_status_t encode(const loom_tokenizer_t *tok, const char *text, size_t len, int add_bos,
                            int parse_special, const size_t *plain, size_t n_plain, int32_t **ids,
                            int *n_ids, int *cap, loom_err_t *err);

loom_status_t loom_tokenizer_encode(const loom_tokenizer_t *tok, const char *text, size_t len,
                                    int add_bos, int parse_special, int32_t **ids, int *n_ids,
                                    int *cap, loom_err_t *err) {
    return encode(tok, text, len, add_bos, parse_special, NULL, 0, ids, n_ids, cap, err);
}

loom_status_t loom_tokenizer_encode_spans(const loom_tokenizer_t *tok, const char *text,
                                          size_t len, int add_bos, const size_t *plain,
                                          size_t n_plain, int32_t **ids, int *n_ids, int *cap,
                                          loom_err_t *err) {
    if (n_plain && !plain)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tokenizer_encode: bad arguments");
    for (size_t i = 0; i < n_plain; i++)
        if (plain[2 * i] >= plain[2 * i + 1] || plain[2 * i + 1] > len ||
            (i > 0 && plain[2 * i] < plain[2 * i - 1]))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "tokenizer_encode: plain-text span %zu [%zu, %zu) is empty, out of "
                                "order or beyond the text (%zu bytes)",
                                i, plain[2 * i], plain[2 * i + 1], len);
    return encode(tok, text, len, add_bos, 1, plain, n_plain, ids, n_ids, cap, err);
}

static loom_status_t encode(const loom_tokenizer_t *tok, const char *text, size_t len, int add_bos,
                            int parse_special, const size_t *plain, size_t n_plain, int32_t **ids,
                            int *n_ids, int *cap, loom_err_t *err) {
    if (!tok || !ids || !n_ids || !cap || (!text && len > 0) || *cap < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tokenizer_encode: bad arguments");
    *n_ids = 0;
    if (len > MAX_TEXT_LEN)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tokenizer_encode: text of %zu bytes is too long", len);
    enc_t e = {.ids = *ids, .cap = *cap, .parse_special = parse_special != 0,
               .base = (const unsigned char *)text, .plain = plain, .n_plain = n_plain, .norm_off = -1};
    if (add_bos && tok->add_bos && tok->bos_id >= 0) emit_known(&e, tok->bos_id);
    if (len > 0)
        split_added(tok, &e, &tok->trie_raw, (const unsigned char *)text, len, true, raw_section);
    free(e.sym_id);
    free(e.sym_start);
    free(e.sym_len);
    free(e.sym_prev);
    free(e.sym_next);
    free(e.heap);
    free(e.norm);
    free(e.norm_tmp);
    free(e.pre);
    *ids = e.ids;
    *cap = e.cap;
    if (e.nomem) {
        *n_ids = 0;
        return loom_err_set(err, LOOM_ERR_NOMEM, "tokenizer_encode: out of memory");
    }
    *n_ids = e.n_ids;
    return LOOM_OK;
}

/* ------------------------------------------------------------------------ */
/* Decoding                                                                 */

static inline bool decodes(const loom_tokenizer_t *tok, int32_t id, bool skip_special) {
    if (id < 0 || id >= tok->n_vocab || !tok->piece[id]) return false;
    return !(skip_special && (tok->flags[id] & TOK_SPECIAL));
}

/* The ByteFallback decoder's rule for a run of consecutive <0xNN> tokens:
 * its bytes when they are valid UTF-8, else one U+FFFD per byte. */
static void flush_byte_run(const unsigned char *run, size_t n, utf8_state_t *u, sink_t *k) {
    size_t i = 0, l;
    while (i < n && loom_utf8_next(run, n, i, &l) != 0xFFFFFFFFu)
        i += l;
    for (size_t j = 0; j < n; j++)
        utf8_feed(u, i == n ? run[j] : 0xFF, k); /* 0xFF: never valid, one U+FFFD */
}

char *loom_tokenizer_decode(const loom_tokenizer_t *tok, const int32_t *ids, int n,
                            int skip_special, size_t *len) {
    sink_t k = {.buf = loom_xmalloc(64), .cap = 64, .grow = true};
    k.buf[0] = 0;
    if (len) *len = 0;
    if (!tok || (!ids && n > 0)) return k.buf;
    unsigned char held[LOOM_DETOK_CLEANUP_STAGES][4], n_held[LOOM_DETOK_CLEANUP_STAGES] = {0};
    if (tok->cleanup) {
        k.held = held;
        k.n_held = n_held;
    }
    k.strip = tok->strip_start;
    utf8_state_t u;
    utf8_reset(&u);
    unsigned char *run = NULL;
    size_t n_run = 0, run_cap = 0;
    for (int i = 0; i < n; i++) {
        if (!decodes(tok, ids[i], skip_special)) continue;
        const unsigned char *p = (const unsigned char *)tok->text[ids[i]];
        if (tok->flags[ids[i]] & TOK_BYTE) {
            if (n_run == run_cap) {
                run_cap = run_cap ? 2 * run_cap : 16;
                run = loom_xrealloc(run, run_cap);
            }
            run[n_run++] = p[0];
            continue;
        }
        flush_byte_run(run, n_run, &u, &k);
        n_run = 0;
        for (uint32_t j = 0; j < tok->text_len[ids[i]]; j++)
            utf8_feed(&u, p[j], &k);
        if (tok->byte_runs) utf8_flush(&u, &k); /* each token is a whole string */
    }
    flush_byte_run(run, n_run, &u, &k);
    free(run);
    utf8_flush(&u, &k);
    cleanup_flush(&k);
    k.buf[k.len] = 0;
    if (len) *len = k.len;
    return k.buf;
}

void loom_detok_init(loom_detok_t *d, const loom_tokenizer_t *tok, int skip_special, int at_start) {
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->skip_special = skip_special;
    /* Kept as the number of leading spaces still to strip. */
    d->at_start = at_start && tok ? tok->strip_start : 0;
}

void loom_detok_keep(loom_detok_t *d, const int32_t *ids, int n) {
    d->keep = ids;
    d->n_keep = n;
}

/* Whether d writes token id: decodable, and not a skipped special token. */
static bool detok_writes(const loom_detok_t *d, int32_t id) {
    if (decodes(d->tok, id, d->skip_special)) return true;
    if (!decodes(d->tok, id, false)) return false;
    for (int i = 0; i < d->n_keep; i++)
        if (d->keep[i] == id) return true;
    return false;
}

/* Rebuilds the UTF-8 state from the held bytes (a valid, incomplete
 * prefix), unless they are a byte run. */
static void detok_state(const loom_detok_t *d, utf8_state_t *u) {
    utf8_reset(u);
    if (d->tok->byte_runs) return;
    sink_t none = {.buf = NULL, .cap = 0};
    for (int i = 0; i < d->n_pending; i++)
        utf8_feed(u, d->pending[i], &none);
}

static void detok_save(loom_detok_t *d, const utf8_state_t *u, const sink_t *k) {
    if (!d->tok->byte_runs) {
        d->n_pending = u->n;
        memcpy(d->pending, u->b, (size_t)u->n);
    }
    d->at_start = k->strip;
}

static sink_t detok_sink(loom_detok_t *d, char *out, size_t cap) {
    sink_t k = {.buf = out, .cap = cap, .strip = d->at_start};
    if (d->tok && d->tok->cleanup) {
        k.held = d->cleanup;
        k.n_held = d->n_cleanup;
    }
    return k;
}

size_t loom_detok_push(loom_detok_t *d, int32_t id, char *out, size_t cap) {
    if (!d || !out || cap == 0) return 0;
    out[0] = 0;
    if (!d->tok || !detok_writes(d, id)) return 0;
    const loom_tokenizer_t *tok = d->tok;
    sink_t k = detok_sink(d, out, cap);
    utf8_state_t u;
    detok_state(d, &u);
    const unsigned char *p = (const unsigned char *)tok->text[id];
    if (tok->flags[id] & TOK_BYTE) {
        if (d->n_pending == LOOM_DETOK_RUN) { /* a very long run: emit its whole characters */
            size_t i = 0, l, n = LOOM_DETOK_RUN;
            while (i < n && loom_utf8_next(d->pending, n, i, &l) != 0xFFFFFFFFu)
                i += l;
            if (i == 0 || n - i >= 4) i = n; /* not valid UTF-8: judged as it is */
            flush_byte_run(d->pending, i, &u, &k);
            memmove(d->pending, d->pending + i, n - i);
            d->n_pending = (int)(n - i);
        }
        d->pending[d->n_pending++] = p[0];
    } else {
        if (tok->byte_runs) {
            flush_byte_run(d->pending, (size_t)d->n_pending, &u, &k);
            d->n_pending = 0;
        }
        for (uint32_t j = 0; j < tok->text_len[id]; j++)
            utf8_feed(&u, p[j], &k);
        if (tok->byte_runs) utf8_flush(&u, &k);
    }
    detok_save(d, &u, &k);
    out[k.len] = 0;
    return k.len;
}

size_t loom_detok_flush(loom_detok_t *d, char *out, size_t cap) {
    if (!d || !out || cap == 0) return 0;
    out[0] = 0;
    if (!d->tok) return 0;
    sink_t k = detok_sink(d, out, cap);
    utf8_state_t u;
    detok_state(d, &u);
    if (d->tok->byte_runs) {
        flush_byte_run(d->pending, (size_t)d->n_pending, &u, &k);
        d->n_pending = 0;
    }
    utf8_flush(&u, &k);
    cleanup_flush(&k);
    detok_save(d, &u, &k);
    out[k.len] = 0;
    return k.len;
}
