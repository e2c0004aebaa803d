/* Grammar engine tests: each construct accepts and rejects the right byte
 * strings; bad specs are clear errors; the token mask of a state equals a
 * brute-force check of every token; a matcher rebuilt from its token ids
 * (re-prefill) is in the same state; and a property test: generated schemas
 * x random walks over allowed tokens (stories260K and a byte-level
 * tokenizer) always finish in output that Python's jsonschema validates.
 *
 *   test_grammar --gen-dir DIR --work-dir DIR [--python PY] [--n-schemas N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/grammar.h"
#include "common/tokenizer.h"
#include "common/util.h"
#include "tests/test.h"

static const char *g_gen_dir = NULL, *g_work_dir = "/tmp", *g_python = "python3";
static int g_n_schemas = 200;

static loom_grammar_t *compile(loom_grammar_kind_t k, const char *spec) {
    loom_grammar_t *g = NULL;
    loom_err_t err = {0};
    loom_status_t st = loom_grammar_compile(k, spec, spec ? strlen(spec) : 0, &g, &err);
    if (st < 0) fprintf(stderr, "  compile failed: %s\n", err.msg);
    return g;
}

static int check(loom_grammar_t *g, const char *s) {
    return loom_grammar_check(g, s, strlen(s));
}

static void expect_error(loom_grammar_kind_t k, const char *spec, const char *needle) {
    loom_grammar_t *g = NULL;
    loom_err_t err = {0};
    loom_status_t st = loom_grammar_compile(k, spec, strlen(spec), &g, &err);
    CHECKF(st < 0 && g == NULL, "spec %s compiled", spec);
    CHECKF(strstr(err.msg, needle) != NULL, "error '%s' lacks '%s'", err.msg, needle);
    loom_grammar_destroy(&g);
}

static void test_regex(void) {
    loom_grammar_t *g = compile(LOOM_GRAMMAR_REGEX, "a[bc]+d?");
    REQUIRE(g);
    CHECK(check(g, "abc") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "abcd") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "ab") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "a") == LOOM_GRAMMAR_PREFIX);
    CHECK(check(g, "ad") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "abcde") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);
    loom_grammar_destroy(&g); /* safe twice */
    g = compile(LOOM_GRAMMAR_REGEX, "^(?:\\d{2,3}|x[^0-9a]*)-(yes|no)\\.$");
    REQUIRE(g);
    CHECK(check(g, "12-yes.") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "123-no.") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "1-no.") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "1234-no.") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "xbc\xc3\xa9-no.") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "xb1-no.") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "12-maybe.") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);
    g = compile(LOOM_GRAMMAR_REGEX, "\\w+@\\w+\\.(com|org)");
    REQUIRE(g);
    CHECK(check(g, "bob@example.org") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "bob@example.net") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);
    g = compile(LOOM_GRAMMAR_REGEX, "a.c");
    REQUIRE(g);
    CHECK(check(g, "a\xe2\x82\xac"
                   "c") == LOOM_GRAMMAR_MATCH); /* a€c: one character */
    CHECK(check(g, "a\nc") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);
    expect_error(LOOM_GRAMMAR_REGEX, "a(?=b)", "lookaround");
    expect_error(LOOM_GRAMMAR_REGEX, "(a", "missing ')'");
    expect_error(LOOM_GRAMMAR_REGEX, "a)", "unbalanced");
    expect_error(LOOM_GRAMMAR_REGEX, "*a", "quantifier");
    expect_error(LOOM_GRAMMAR_REGEX, "(a)\\1", "backreferences");
    expect_error(LOOM_GRAMMAR_REGEX, "[z-a]", "out of order");
    expect_error(LOOM_GRAMMAR_REGEX, "(a*)*", "left-recursive");
}

static void test_ebnf(void) {
    const char *gr = "root ::= expr\n"
                     "expr ::= term (\"+\" term)*   # sums\n"
                     "term ::= num | \"(\" expr \")\"\n"
                     "num  ::= [0-9]+\n";
    loom_grammar_t *g = compile(LOOM_GRAMMAR_EBNF, gr);
    REQUIRE(g);
    CHECK(check(g, "1+2") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "(1+(22+3))+4") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "(1+") == LOOM_GRAMMAR_PREFIX);
    CHECK(check(g, "1++2") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "()") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);
    g = compile(LOOM_GRAMMAR_EBNF, "root ::= \"a\"{2,3} [^\\n]? \"\\u00e9\"");
    REQUIRE(g);
    CHECK(check(g, "aa\xc3\xa9") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "aaaz\xc3\xa9") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "a\xc3\xa9") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);
    expect_error(LOOM_GRAMMAR_EBNF, "root ::= foo", "undefined rule 'foo'");
    expect_error(LOOM_GRAMMAR_EBNF, "root ::= \"a", "syntax error at line 1");
    expect_error(LOOM_GRAMMAR_EBNF, "root ::= a\na ::= a \"x\" | \"y\"", "left-recursive");
    expect_error(LOOM_GRAMMAR_EBNF, "start ::= \"x\"", "no rule named 'root'");
    expect_error(LOOM_GRAMMAR_EBNF, "root ::= \"x\"\nroot ::= \"y\"", "defined twice");
    expect_error(LOOM_GRAMMAR_EBNF, "root ::= (\"x\"", "missing ')'");
    expect_error(LOOM_GRAMMAR_EBNF, "root ::= r\nr ::= \"(\" r \")\"", "no finite output");
    expect_error(LOOM_GRAMMAR_EBNF, "::= \"x\"", "expected 'name ::='");
    expect_error(LOOM_GRAMMAR_EBNF, "root ::= \"x\" \n junk", "undefined rule 'junk'");
}

static void test_json_schema(void) {
    const char *tool =
        "{\"type\":\"object\",\"properties\":{"
        "\"location\":{\"type\":\"string\"},"
        "\"unit\":{\"enum\":[\"celsius\",\"fahrenheit\"]},"
        "\"days\":{\"type\":\"integer\"},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2}},"
        "\"required\":[\"location\",\"unit\"],\"additionalProperties\":false}";
    loom_grammar_t *g = compile(LOOM_GRAMMAR_JSON_SCHEMA, tool);
    REQUIRE(g);
    CHECK(check(g, "{\"location\":\"Paris\",\"unit\":\"celsius\"}") == LOOM_GRAMMAR_MATCH);
    CHECK(
        check(g, "{ \"location\" : \"P\\\"a\\u00e9\" ,\n \"unit\":\"fahrenheit\", \"days\": -3}") ==
        LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "{\"location\":\"x\",\"unit\":\"celsius\",\"tags\":[\"a\",\"b\"]}") ==
          LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "{\"location\":\"x\",\"unit\":\"celsius\",\"tags\":[\"a\",\"b\",\"c\"]}") ==
          LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "{\"unit\":\"celsius\"}") == LOOM_GRAMMAR_REJECT); /* required */
    CHECK(check(g, "{\"location\":\"x\",\"unit\":\"kelvin\"}") == LOOM_GRAMMAR_REJECT); /* enum */
    CHECK(check(g, "{\"location\":\"x\",\"unit\":\"celsius\",\"other\":1}") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "{\"location\":\"x\",\"unit\":\"celsius\",\"days\":1.5}") ==
          LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "{\"location\":\"a\nb\",\"unit\":\"celsius\"}") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "{\"location\":\"x\",\"unit\":\"celsius\",\"days\":012}") ==
          LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);

    const char *tree = "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{"
                       "\"v\":{\"type\":[\"number\",\"null\"]},"
                       "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},"
                       "\"required\":[\"v\"]}},\"$ref\":\"#/$defs/node\"}";
    g = compile(LOOM_GRAMMAR_JSON_SCHEMA, tree);
    REQUIRE(g);
    CHECK(check(g, "{\"v\":1,\"kids\":[{\"v\":null},{\"v\":2.5e3,\"kids\":[{\"v\":0}]}]}") ==
          LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "{\"v\":1,\"kids\":[{\"kids\":[]}]}") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);

    g = compile(
        LOOM_GRAMMAR_JSON_SCHEMA,
        "{\"type\":\"object\",\"properties\":{\"d\":{\"type\":\"string\",\"format\":\"date\"},"
        "\"u\":{\"type\":\"string\",\"format\":\"uuid\"},\"e\":{\"type\":\"string\",\"format\":"
        "\"email\"},"
        "\"t\":{\"type\":\"string\",\"format\":\"date-time\"},"
        "\"p\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d+$\"},"
        "\"s\":{\"type\":\"string\",\"minLength\":2,\"maxLength\":3},"
        "\"c\":{\"const\":{\"k\":[1,true]}},\"o\":{\"anyOf\":[{\"type\":\"boolean\"},{\"type\":"
        "\"null\"}]},"
        "\"a\":{\"type\":\"array\",\"minItems\":1,\"maxItems\":2}},"
        "\"required\":[\"d\",\"u\",\"e\",\"t\",\"p\",\"s\",\"c\",\"o\",\"a\"]}");
    REQUIRE(g);
    CHECK(check(g, "{\"d\":\"2024-02-28\",\"u\":\"123e4567-e89b-12d3-a456-426614174000\","
                   "\"e\":\"a.b@ex.com\",\"t\":\"2024-01-01T10:00:00Z\",\"p\":\"AB-12\",\"s\":"
                   "\"\xc3\xa9t\","
                   "\"c\":{\"k\":[1,true]},\"o\":null,\"a\":[{}]}") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "{\"d\":\"2024-13-01\"") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "{\"d\":\"2024-02-28\",\"u\":\"123e4567\"}") == LOOM_GRAMMAR_REJECT);
    CHECK(
        check(
            g,
            "{\"d\":\"2024-02-28\",\"u\":\"123e4567-e89b-12d3-a456-426614174000\","
            "\"e\":\"a.b@ex.com\",\"t\":\"2024-01-01T10:00:00Z\",\"p\":\"AB-12\",\"s\":\"abcd\"") ==
        LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);

    g = compile(LOOM_GRAMMAR_JSON_OBJECT, NULL);
    REQUIRE(g);
    CHECK(check(g, "{\"a\":[1,{\"b\":null},\"x\"],\"c\":-0.5E+2}") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "{}") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "[1]") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "{\"a\":1,}") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);

    g = compile(LOOM_GRAMMAR_CHOICE, "[\"yes\",\"no\",\"not sure\"]");
    REQUIRE(g);
    CHECK(check(g, "no") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "not sure") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "not") == LOOM_GRAMMAR_PREFIX);
    CHECK(check(g, "nope") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&g);

    expect_error(LOOM_GRAMMAR_JSON_SCHEMA, "{\"type\":\"object\",", "not valid JSON");
    expect_error(LOOM_GRAMMAR_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":0}",
                 "unsupported keyword 'minimum'");
    expect_error(
        LOOM_GRAMMAR_JSON_SCHEMA,
        "{\"$defs\":{\"a\":{\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":\"#/$defs/a\"}},"
        "\"required\":[\"x\"]}},\"$ref\":\"#/$defs/a\"}",
        "recursion that cannot terminate");
    expect_error(LOOM_GRAMMAR_JSON_SCHEMA, "{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}",
                 "unsatisfiable");
    expect_error(LOOM_GRAMMAR_JSON_SCHEMA, "{\"enum\":[]}", "unsatisfiable");
    expect_error(LOOM_GRAMMAR_JSON_SCHEMA, "{\"$ref\":\"#/$defs/none\"}", "does not resolve");
    expect_error(LOOM_GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"hostname\"}",
                 "format 'hostname'");
    expect_error(LOOM_GRAMMAR_JSON_SCHEMA, "{\"type\":\"strin\"}", "unknown type 'strin'");
    expect_error(LOOM_GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\",\"pattern\":\"(a\"}", "pattern");
    expect_error(LOOM_GRAMMAR_CHOICE, "[]", "non-empty");
    expect_error(LOOM_GRAMMAR_CHOICE, "[1]", "strings");
}

/* ---- token-level tests ------------------------------------------------ */

typedef struct {
    uint64_t s;
} rng_t;
static uint32_t rnd(rng_t *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return (uint32_t)(r->s >> 11);
}

static int mask_has(const uint32_t *m, int id) {
    return (m[id >> 5] >> (id & 31)) & 1;
}

/* The mask must equal: token allowed iff prefix+token is still a prefix or
 * sentence (by the byte-level check), EOS iff prefix is a sentence. */
static int brute_force_equal(loom_grammar_t *g, const loom_grammar_vocab_t *v, const char *prefix,
                             size_t plen, const uint32_t *mask, int eos) {
    int n = loom_grammar_vocab_size(v), bad = 0;
    char *buf = malloc(plen + 1024);
    memcpy(buf, prefix, plen);
    for (int id = 0; id < n; id++) {
        size_t l;
        const char *b = loom_grammar_vocab_bytes(v, id, &l);
        int want;
        if (id == eos)
            want = loom_grammar_check(g, prefix, plen) == LOOM_GRAMMAR_MATCH;
        else if (!b || l > 1000)
            want = 0;
        else {
            memcpy(buf + plen, b, l);
            want = loom_grammar_check(g, buf, plen + l) != LOOM_GRAMMAR_REJECT;
        }
        if (want != mask_has(mask, id)) {
            if (bad < 5)
                fprintf(stderr, "  mask mismatch: token %d '%.*s' want %d after '%.*s'\n", id,
                        (int)l, b ? b : "", want, (int)plen, prefix);
            bad++;
        }
    }
    free(buf);
    return bad == 0;
}

static loom_tokenizer_t *load_tok(const char *dir) {
    loom_tokenizer_t *t = NULL;
    loom_err_t err = {0};
    if (loom_tokenizer_load(dir, &t, &err) < 0)
        fprintf(stderr, "  tokenizer %s: %s\n", dir, err.msg);
    return t;
}

/* Picks an allowed token: EOS half the time when allowed; else prefers
 * one-byte structural tokens (so walks end), else any allowed token. */
static int pick(rng_t *r, const loom_grammar_vocab_t *v, const uint32_t *mask, int eos,
                int *scratch) {
    int n = loom_grammar_vocab_size(v), k = 0, ks = 0;
    if (eos >= 0 && mask_has(mask, eos) && rnd(r) % 2) return eos;
    for (int id = 0; id < n; id++) {
        if (!mask_has(mask, id) || id == eos) continue;
        scratch[k++] = id;
    }
    if (k == 0) return eos >= 0 && mask_has(mask, eos) ? eos : -1;
    if (rnd(r) % 10 < 7) {
        for (int i = 0; i < k; i++) {
            size_t l;
            const char *b = loom_grammar_vocab_bytes(v, scratch[i], &l);
            if (l == 1 && strchr("\"}],0", b[0])) scratch[n + ks++] = scratch[i];
        }
        if (ks) return scratch[n + (int)(rnd(r) % (uint32_t)ks)];
    }
    return scratch[rnd(r) % (uint32_t)k];
}

static const char *TOKENIZER_GRAMMARS[][2] = {
    {"json_schema",
     "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":5},"
     "\"n\":{\"type\":\"integer\"},\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"n\"]}"},
    {"regex", "(ab|a[0-9]{1,3}|\\w+ [a-c]*)!"},
    {"ebnf", "root ::= \"[\" item (\",\" item)* \"]\"\nitem ::= [a-z]+ | \"\\\"\" [^\"]* \"\\\"\""},
    {"json_object", NULL},
};

static loom_grammar_kind_t kind_of(const char *name) {
    return strcmp(name, "json_schema") == 0 ? LOOM_GRAMMAR_JSON_SCHEMA
           : strcmp(name, "regex") == 0     ? LOOM_GRAMMAR_REGEX
           : strcmp(name, "ebnf") == 0      ? LOOM_GRAMMAR_EBNF
                                            : LOOM_GRAMMAR_JSON_OBJECT;
}

static void masks_vs_brute_force(loom_tokenizer_t *tok) {
    loom_grammar_vocab_t *v = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_grammar_vocab_create(tok, &v, &err) == LOOM_OK);
    int eos = loom_tokenizer_eos_id(tok);
    int n = loom_grammar_vocab_size(v);
    uint32_t *mask = calloc(loom_grammar_mask_words(v), 4);
    uint32_t *mask2 = calloc(loom_grammar_mask_words(v), 4);
    int *scratch = calloc((size_t)n * 2, sizeof *scratch);
    rng_t r = {0x9E3779B97F4A7C15ull};
    for (size_t gi = 0; gi < sizeof TOKENIZER_GRAMMARS / sizeof *TOKENIZER_GRAMMARS; gi++) {
        loom_grammar_t *g = compile(kind_of(TOKENIZER_GRAMMARS[gi][0]), TOKENIZER_GRAMMARS[gi][1]);
        REQUIRE(g);
        for (int walk = 0; walk < 3; walk++) {
            loom_grammar_matcher_t *m = NULL, *m2 = NULL;
            REQUIRE(loom_grammar_matcher_create(g, v, &m, &err) == LOOM_OK);
            REQUIRE(loom_grammar_matcher_create(g, v, &m2, &err) == LOOM_OK);
            char text[4096];
            size_t tl = 0;
            int32_t ids[256];
            int n_ids = 0;
            for (int step = 0; step < 40; step++) {
                loom_grammar_matcher_fill_mask(m, mask);
                CHECKF(brute_force_equal(g, v, text, tl, mask, eos), "grammar %s step %d",
                       TOKENIZER_GRAMMARS[gi][0], step);
                int id = pick(&r, v, mask, eos, scratch);
                if (id < 0 || id == eos) break;
                /* a token outside the mask is refused and leaves the state as it was */
                for (int probe = 0; probe < n; probe++) {
                    if (!mask_has(mask, probe) && probe != eos) {
                        CHECK(loom_grammar_matcher_accept_token(m, probe) ==
                              LOOM_ERR_INVALID_ARGUMENT);
                        break;
                    }
                }
                REQUIRE(loom_grammar_matcher_accept_token(m, id) == LOOM_OK);
                size_t l;
                const char *b = loom_grammar_vocab_bytes(v, id, &l);
                if (tl + l >= sizeof text) break;
                memcpy(text + tl, b, l);
                tl += l;
                ids[n_ids++] = id;
            }
            /* re-prefill: rebuild from the ids, same mask */
            REQUIRE(loom_grammar_matcher_replay(m2, ids, n_ids) == LOOM_OK);
            loom_grammar_matcher_fill_mask(m, mask);
            loom_grammar_matcher_fill_mask(m2, mask2);
            CHECK(memcmp(mask, mask2, loom_grammar_mask_words(v) * 4) == 0);
            CHECK(loom_grammar_matcher_n_accepted(m2) == n_ids);
            /* a copy (speculative drafts): the same mask, advanced alone */
            loom_grammar_matcher_t *m3 = NULL;
            REQUIRE(loom_grammar_matcher_create(g, v, &m3, &err) == LOOM_OK);
            REQUIRE(loom_grammar_matcher_copy(m3, m2) == LOOM_OK);
            loom_grammar_matcher_fill_mask(m3, mask2);
            CHECK(memcmp(mask, mask2, loom_grammar_mask_words(v) * 4) == 0);
            int next = pick(&r, v, mask, eos, scratch);
            if (next >= 0 && next != eos && n_ids < 256) {
                REQUIRE(loom_grammar_matcher_accept_token(m3, next) == LOOM_OK);
                CHECK(loom_grammar_matcher_n_accepted(m3) == n_ids + 1 && loom_grammar_matcher_n_accepted(m2) == n_ids);
                loom_grammar_matcher_fill_mask(m2, mask2);
                CHECK(memcmp(mask, mask2, loom_grammar_mask_words(v) * 4) == 0); /* the source stays put */
                ids[n_ids] = next;
                REQUIRE(loom_grammar_matcher_replay(m, ids, n_ids + 1) == LOOM_OK);
                loom_grammar_matcher_fill_mask(m, mask);
                loom_grammar_matcher_fill_mask(m3, mask2);
                CHECK(memcmp(mask, mask2, loom_grammar_mask_words(v) * 4) == 0);
            }
            loom_grammar_matcher_destroy(&m3);
            loom_grammar_matcher_destroy(&m);
            loom_grammar_matcher_destroy(&m2);
        }
        loom_grammar_destroy(&g);
    }
    free(mask);
    free(mask2);
    free(scratch);
    loom_grammar_vocab_destroy(&v);
}

static void test_masks_stories(void) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/stories260K", test_models_dir());
    loom_tokenizer_t *tok = load_tok(dir);
    REQUIRE(tok);
    masks_vs_brute_force(tok);
    loom_tokenizer_destroy(&tok);
}

static void test_masks_bytelevel(void) {
    REQUIRE(g_gen_dir);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/llama3", g_gen_dir);
    loom_tokenizer_t *tok = load_tok(dir);
    REQUIRE(tok);
    masks_vs_brute_force(tok);
    loom_tokenizer_destroy(&tok);
}

/* ---- property test ------------------------------------------------------ */

typedef struct {
    char *p;
    size_t n, cap;
} sb_t;
static void sb_put(sb_t *b, const char *s) {
    size_t l = strlen(s);
    if (b->n + l + 1 > b->cap) {
        b->cap = (b->n + l + 1) * 2;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, l + 1);
    b->n += l;
}

static void gen_schema(rng_t *r, sb_t *b, int depth) {
    int k = (int)(rnd(r) % (depth >= 3 ? 9 : 12));
    char buf[128];
    switch (k) {
    case 0:
        sb_put(b, "{\"type\":\"integer\"}");
        break;
    case 1:
        sb_put(b, "{\"type\":\"number\"}");
        break;
    case 2:
        sb_put(b, "{\"type\":\"boolean\"}");
        break;
    case 3:
        sb_put(b, "{\"type\":\"null\"}");
        break;
    case 4: {
        int f = (int)(rnd(r) % 8);
        const char *fmts[] = {"date", "date-time", "uuid", "email", "time"};
        if (f < 5) {
            snprintf(buf, sizeof buf, "{\"type\":\"string\",\"format\":\"%s\"}", fmts[f]);
        } else if (f == 5) {
            snprintf(buf, sizeof buf, "{\"type\":\"string\",\"pattern\":\"^[a-z]{2,4}-[0-9]+$\"}");
        } else {
            int lo = (int)(rnd(r) % 3);
            snprintf(buf, sizeof buf, "{\"type\":\"string\",\"minLength\":%d,\"maxLength\":%d}", lo,
                     lo + (int)(rnd(r) % 4));
        }
        sb_put(b, buf);
        break;
    }
    case 5:
        sb_put(b, "{\"type\":\"string\"}");
        break;
    case 6:
        sb_put(b, rnd(r) % 2 ? "{\"enum\":[\"red\",\"green\",1,null]}" : "{\"const\":\"fixed\"}");
        break;
    case 7:
        sb_put(b, "{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\",\"maxLength\":3},{"
                  "\"type\":\"null\"}]}");
        break;
    case 8:
        sb_put(b, "{\"$ref\":\"#/$defs/node\"}");
        break;
    case 9:
    case 10: {
        int np = 1 + (int)(rnd(r) % 4);
        sb_put(b, "{\"type\":\"object\",\"properties\":{");
        char req[256] = "";
        for (int i = 0; i < np; i++) {
            snprintf(buf, sizeof buf, "%s\"p%d\":", i ? "," : "", i);
            sb_put(b, buf);
            gen_schema(r, b, depth + 1);
            if (rnd(r) % 2) {
                size_t l = strlen(req);
                snprintf(req + l, sizeof req - l, "%s\"p%d\"", l ? "," : "", i);
            }
        }
        sb_put(b, "},\"required\":[");
        sb_put(b, req);
        sb_put(b, rnd(r) % 4 ? "],\"additionalProperties\":false}" : "]}");
        break;
    }
    default: {
        int lo = (int)(rnd(r) % 2), hi = lo + (int)(rnd(r) % 3);
        snprintf(buf, sizeof buf, "{\"type\":\"array\",\"minItems\":%d,%s\"items\":", lo,
                 rnd(r) % 2 ? "" : (snprintf(buf + 100, 28, "\"maxItems\":%d,", hi), buf + 100));
        sb_put(b, buf);
        gen_schema(r, b, depth + 1);
        sb_put(b, "}");
        break;
    }
    }
}

static void json_quote(FILE *f, const char *s, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void property_walks(loom_tokenizer_t *tok, const char *label, int n_schemas, uint64_t seed) {
    loom_grammar_vocab_t *v = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_grammar_vocab_create(tok, &v, &err) == LOOM_OK);
    int eos = loom_tokenizer_eos_id(tok), n = loom_grammar_vocab_size(v);
    uint32_t *mask = calloc(loom_grammar_mask_words(v), 4);
    int *scratch = calloc((size_t)n * 2, sizeof *scratch);
    char path[1024];
    snprintf(path, sizeof path, "%s/grammar_walks_%s.jsonl", g_work_dir, label);
    FILE *f = fopen(path, "w");
    REQUIRE(f);
    rng_t r = {seed};
    int finished = 0, walks = 0;
    char *text = malloc(1 << 16);
    for (int si = 0; si < n_schemas; si++) {
        sb_t b = {0};
        sb_put(
            &b,
            "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"}"
            ","
            "\"kids\":{\"type\":\"array\",\"maxItems\":2,\"items\":{\"$ref\":\"#/$defs/node\"}}},"
            "\"required\":[\"v\"],\"additionalProperties\":false}},\"type\":\"object\","
            "\"properties\":{\"root\":");
        gen_schema(&r, &b, 0);
        sb_put(&b, "},\"required\":[\"root\"],\"additionalProperties\":false}");
        loom_grammar_t *g = NULL;
        loom_status_t st = loom_grammar_compile_json_schema(b.p, b.n, &g, &err);
        CHECKF(st == LOOM_OK, "schema %s: %s", b.p, err.msg);
        if (st < 0) {
            free(b.p);
            continue;
        }
        for (int w = 0; w < 2; w++) {
            loom_grammar_matcher_t *m = NULL;
            REQUIRE(loom_grammar_matcher_create(g, v, &m, &err) == LOOM_OK);
            size_t tl = 0;
            int done = 0;
            walks++;
            for (int step = 0; step < 400 && tl < (1 << 15); step++) {
                loom_grammar_matcher_fill_mask(m, mask);
                int id = pick(&r, v, mask, eos, scratch);
                CHECKF(id >= 0, "dead end in a live state (schema %s)", b.p);
                if (id < 0) break;
                CHECK(loom_grammar_matcher_accept_token(m, id) == LOOM_OK);
                if (id == eos) {
                    done = 1;
                    break;
                }
                size_t l;
                const char *bytes = loom_grammar_vocab_bytes(v, id, &l);
                memcpy(text + tl, bytes, l);
                tl += l;
            }
            if (done) {
                finished++;
                fprintf(f, "{\"schema\":%s,\"output\":", b.p);
                json_quote(f, text, tl);
                fprintf(f, "}\n");
            }
            loom_grammar_matcher_destroy(&m);
        }
        loom_grammar_destroy(&g);
        free(b.p);
    }
    fclose(f);
    free(text);
    fprintf(stderr, "  %s: %d of %d walks finished\n", label, finished, walks);
    CHECKF(finished * 10 >= walks * 7, "only %d of %d walks finished", finished, walks);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s %s/tests/reference/validate_json_schema.py %s", g_python,
             LOOM_SOURCE_DIR, path);
    int rc = system(cmd);
    CHECKF(rc == 0,
           "validator failed (rc %d) on %s (it needs python3-jsonschema: scripts/setup-debian.sh)",
           rc, path);
    free(mask);
    free(scratch);
    loom_grammar_vocab_destroy(&v);
}

static void test_property_stories(void) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/stories260K", test_models_dir());
    loom_tokenizer_t *tok = load_tok(dir);
    REQUIRE(tok);
    property_walks(tok, "stories260K", g_n_schemas, 0x1234567ull);
    loom_tokenizer_destroy(&tok);
}

static void test_property_bytelevel(void) {
    REQUIRE(g_gen_dir);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/llama3", g_gen_dir);
    loom_tokenizer_t *tok = load_tok(dir);
    REQUIRE(tok);
    property_walks(tok, "bytelevel", g_n_schemas, 0xABCDEF12ull);
    loom_tokenizer_destroy(&tok);
}

/* Mutated specs: every compile returns a grammar or an error with a message
 * (the sanitizer build checks memory); a grammar that compiled still runs. */
static void test_mutations(void) {
    const char *seeds[][2] = {
        {"s", "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"items\":{\"$ref\":"
              "\"#\"},"
              "\"maxItems\":2},\"b\":{\"type\":\"string\",\"pattern\":\"^x[0-9]+$\"}},\"required\":"
              "[\"b\"]}"},
        {"r", "^(?:[a-f0-9]{2,4}|\\w+\\.(com|org))*x?$"},
        {"e", "root ::= a+ b\na ::= \"x\" | [^a-z]{1,3}\nb ::= (\"y\" a)? \"z\""},
        {"c", "[\"a\",\"bb\",\"\\u00e9\"]"},
    };
    rng_t r = {42};
    int ok = 0, errs = 0;
    for (int k = 0; k < 4; k++) {
        loom_grammar_kind_t kind = seeds[k][0][0] == 's'   ? LOOM_GRAMMAR_JSON_SCHEMA
                                   : seeds[k][0][0] == 'r' ? LOOM_GRAMMAR_REGEX
                                   : seeds[k][0][0] == 'e' ? LOOM_GRAMMAR_EBNF
                                                           : LOOM_GRAMMAR_CHOICE;
        const char *src = seeds[k][1];
        size_t n = strlen(src);
        char buf[512];
        for (int it = 0; it < 400; it++) {
            memcpy(buf, src, n);
            size_t m = n;
            int edits = 1 + (int)(rnd(&r) % 3);
            for (int e = 0; e < edits; e++) {
                size_t at = rnd(&r) % m;
                int op = (int)(rnd(&r) % 3);
                if (op == 0)
                    buf[at] = "{}[]()\"\\|*+?:,$#^-.a0"[rnd(&r) % 22];
                else if (op == 1 && m > 1)
                    memmove(buf + at, buf + at + 1, --m - at);
                else if (m + 1 < sizeof buf) {
                    memmove(buf + at + 1, buf + at, m++ - at);
                    buf[at] = (char)(rnd(&r) & 0xFF);
                }
            }
            loom_grammar_t *g = NULL;
            loom_err_t err = {0};
            loom_status_t st = loom_grammar_compile(kind, buf, m, &g, &err);
            if (st == LOOM_OK) {
                CHECK(g != NULL);
                loom_grammar_check(g, "xyz", 3);
                ok++;
            } else {
                CHECK(g == NULL && err.msg[0] != 0);
                errs++;
            }
            loom_grammar_destroy(&g);
        }
    }
    fprintf(stderr, "  mutations: %d compiled, %d refused\n", ok, errs);
    CHECK(ok > 0 && errs > 0);
}

static void test_cache(void) {
    loom_grammar_cache_t *c = loom_grammar_cache_create(2);
    loom_grammar_t *a = NULL, *b = NULL, *x = NULL;
    loom_err_t err = {0};
    const char *s1 = "{\"type\":\"integer\"}", *s2 = "{\"type\":\"string\"}";
    CHECK(loom_grammar_cache_get(c, LOOM_GRAMMAR_JSON_SCHEMA, s1, strlen(s1), &a, &err) == LOOM_OK);
    CHECK(loom_grammar_cache_get(c, LOOM_GRAMMAR_JSON_SCHEMA, s1, strlen(s1), &b, &err) == LOOM_OK);
    CHECK(a == b);
    loom_grammar_t *y = NULL;
    CHECK(loom_grammar_cache_get(c, LOOM_GRAMMAR_JSON_SCHEMA, "true", 4, &x, &err) == LOOM_OK);
    CHECK(loom_grammar_cache_get(c, LOOM_GRAMMAR_REGEX, "true", 4, &y, &err) == LOOM_OK);
    CHECK(x != y); /* the kind is part of the key */
    CHECK(check(x, "[1]") == LOOM_GRAMMAR_MATCH && check(y, "[1]") == LOOM_GRAMMAR_REJECT);
    loom_grammar_destroy(&x);
    loom_grammar_destroy(&y);
    CHECK(loom_grammar_cache_get(c, LOOM_GRAMMAR_JSON_SCHEMA, s2, strlen(s2), &x, &err) == LOOM_OK);
    loom_grammar_destroy(&x);
    CHECK(loom_grammar_cache_get(c, LOOM_GRAMMAR_JSON_SCHEMA, "{", 1, &x, &err) < 0);
    CHECK(strstr(err.msg, "not valid JSON") != NULL);
    uint64_t hits, misses;
    loom_grammar_cache_stats(c, &hits, &misses);
    CHECK(hits == 1 && misses == 5);
    loom_grammar_cache_destroy(&c); /* a and b outlive the cache */
    CHECK(check(a, "42") == LOOM_GRAMMAR_MATCH);
    loom_grammar_destroy(&a);
    loom_grammar_destroy(&b);
}

/* Writes a chain of n rules, each starting with the next: r0 ::= r1 "a",
 * ..., the last "b" (loop: the last refers back to r0). */
static char *chain_grammar(int n, int loop) {
    size_t cap = (size_t)n * 40 + 64, len = 0;
    char *gr = malloc(cap);
    if (!gr) return NULL;
    len += (size_t)snprintf(gr + len, cap - len, "root ::= r0\n");
    for (int i = 0; i < n - 1; i++) len += (size_t)snprintf(gr + len, cap - len, "r%d ::= r%d \"a\"\n", i, i + 1);
    snprintf(gr + len, cap - len, loop ? "r%d ::= r0 \"b\" | \"c\"\n" : "r%d ::= \"b\"\n", n - 1);
    return gr;
}

/* A chain of thousands of rules compiles without recursing once per rule
 * (ASan's stack overflowed at 3,000) and finds rules by hash; the chain
 * closed into a loop is refused as left-recursive. Matching such a deep
 * stack is bounded at run time (MAX_STATE_STACKS): a 1,000-rule chain
 * matches. */
static void test_long_chain(void) {
    char *gr = chain_grammar(3200, 0);
    REQUIRE(gr);
    loom_grammar_t *g = compile(LOOM_GRAMMAR_EBNF, gr);
    CHECK(g && loom_grammar_n_rules(g) >= 3200);
    loom_grammar_destroy(&g);
    free(gr);
    gr = chain_grammar(3200, 1);
    REQUIRE(gr);
    expect_error(LOOM_GRAMMAR_EBNF, gr, "left-recursive");
    free(gr);
    enum { N = 1000 };
    gr = chain_grammar(N, 0);
    REQUIRE(gr);
    g = compile(LOOM_GRAMMAR_EBNF, gr);
    REQUIRE(g);
    char want[N + 1];
    want[0] = 'b';
    memset(want + 1, 'a', N - 1);
    want[N] = 0;
    CHECK(check(g, want) == LOOM_GRAMMAR_MATCH);
    want[N - 1] = 0;
    CHECK(check(g, want) == LOOM_GRAMMAR_PREFIX);
    loom_grammar_destroy(&g);
    free(gr);
}

/* The cache's byte bound: entries go, least recently used first, until a new
 * one fits; one larger than the bound is handed out but not kept. */
static void test_cache_bytes(void) {
    loom_grammar_t *a = compile(LOOM_GRAMMAR_REGEX, "[a-z]{1,40}@[a-z]{1,40}\\.(com|org|net)");
    REQUIRE(a);
    size_t one = loom_grammar_bytes(a);
    CHECK(one > 1000);
    loom_grammar_destroy(&a);
    loom_grammar_cache_t *c = loom_grammar_cache_create(64);
    loom_grammar_cache_set_max_bytes(c, one * 5 / 2); /* two such grammars fit, three do not */
    loom_err_t err = {0};
    const char *specs[] = {"[a-z]{1,40}@[a-z]{1,40}\\.(com|org|net)", "[b-z]{1,40}@[a-z]{1,40}\\.(com|org|net)",
                           "[c-z]{1,40}@[a-z]{1,40}\\.(com|org|net)"};
    for (int i = 0; i < 3; i++) {
        loom_grammar_t *g = NULL;
        CHECK(loom_grammar_cache_get(c, LOOM_GRAMMAR_REGEX, specs[i], strlen(specs[i]), &g, &err) == LOOM_OK);
        loom_grammar_destroy(&g);
        CHECKF(loom_grammar_cache_bytes(c) <= one * 5 / 2, "cache holds %zu bytes, bound %zu",
               loom_grammar_cache_bytes(c), one * 5 / 2);
    }
    loom_grammar_t *g = NULL;
    CHECK(loom_grammar_cache_lookup(c, LOOM_GRAMMAR_REGEX, specs[2], strlen(specs[2]), &g) == 1); /* newest kept */
    loom_grammar_destroy(&g);
    CHECK(loom_grammar_cache_lookup(c, LOOM_GRAMMAR_REGEX, specs[0], strlen(specs[0]), &g) == 0); /* oldest gone */
    loom_grammar_cache_set_max_bytes(c, 100); /* smaller than any grammar: used, never kept */
    CHECK(loom_grammar_cache_get(c, LOOM_GRAMMAR_JSON_SCHEMA, "true", 4, &g, &err) == LOOM_OK);
    CHECK(g && check(g, "[1]") == LOOM_GRAMMAR_MATCH);
    loom_grammar_destroy(&g);
    CHECK(loom_grammar_cache_lookup(c, LOOM_GRAMMAR_JSON_SCHEMA, "true", 4, &g) == 0);
    loom_grammar_cache_destroy(&c);
}

/* Compilation bounds: past the byte bound or the deadline (or when stopped
 * from another thread) it fails with a message naming the bound, and hit
 * says which; within them it compiles as usual. */
static void test_limits(void) {
    char *gr = chain_grammar(3000, 0);
    REQUIRE(gr);
    loom_grammar_t *g = NULL;
    loom_err_t err = {0};
    loom_grammar_limits_t lim = {.max_bytes = 20000};
    CHECK(loom_grammar_compile_limited(LOOM_GRAMMAR_EBNF, gr, strlen(gr), &lim, &g, &err) < 0 && !g);
    CHECK(lim.hit == LOOM_GRAMMAR_LIMIT_BYTES);
    CHECKF(strstr(err.msg, "grammar too large") && strstr(err.msg, "20000"), "message: %s", err.msg);
    lim = (loom_grammar_limits_t){.deadline_ns = 1}; /* long past */
    CHECK(loom_grammar_compile_limited(LOOM_GRAMMAR_EBNF, gr, strlen(gr), &lim, &g, &err) < 0 && !g);
    CHECK(lim.hit == LOOM_GRAMMAR_LIMIT_TIME);
    CHECKF(strstr(err.msg, "time limit") != NULL, "message: %s", err.msg);
    lim = (loom_grammar_limits_t){.max_bytes = 64u << 20, .deadline_ns = loom_now_ns() + 60000000000ull};
    CHECK(loom_grammar_compile_limited(LOOM_GRAMMAR_EBNF, gr, strlen(gr), &lim, &g, &err) == LOOM_OK && g);
    CHECK(lim.hit == 0 && loom_grammar_bytes(g) < (64u << 20));
    loom_grammar_destroy(&g);
    /* the bound also holds what the builder makes before the grammar exists */
    lim = (loom_grammar_limits_t){.max_bytes = 100000};
    const char *rep = "[a-z]{0,4096}[0-9]{0,4096}";
    CHECK(loom_grammar_compile_limited(LOOM_GRAMMAR_REGEX, rep, strlen(rep), &lim, &g, &err) < 0 && !g);
    CHECKF(lim.hit == LOOM_GRAMMAR_LIMIT_BYTES, "hit %d: %s", lim.hit, err.msg);
    free(gr);
}

/* Schema nesting, objects and arrays alike, k levels deep. */
static char *nested_schema(int k, int objects) {
    const char *open = objects ? "{\"type\":\"object\",\"properties\":{\"a\":" : "{\"type\":\"array\",\"items\":";
    const char *close = objects ? "}}" : "}";
    size_t cap = (size_t)k * (strlen(open) + strlen(close)) + 32, len = 0;
    char *s = malloc(cap);
    if (!s) return NULL;
    for (int i = 0; i < k; i++) len += (size_t)snprintf(s + len, cap - len, "%s", open);
    len += (size_t)snprintf(s + len, cap - len, "{\"type\":\"integer\"}");
    for (int i = 0; i < k; i++) len += (size_t)snprintf(s + len, cap - len, "%s", close);
    return s;
}

/* The schema compiler recurses once per level, so nesting is bounded (64
 * levels, a clean error naming the bound); the JSON parser's own cap (1,000
 * JSON levels) refuses what lies beyond before the compiler sees it. Under ASan neither
 * overflows the stack. */
static void test_deep_schema(void) {
    for (int objects = 0; objects < 2; objects++) {
        char *s = nested_schema(60, objects);
        REQUIRE(s);
        loom_grammar_t *g = compile(LOOM_GRAMMAR_JSON_SCHEMA, s);
        CHECKF(g != NULL, "60 levels (%s) refused", objects ? "objects" : "arrays");
        loom_grammar_destroy(&g);
        free(s);
        /* an object level is two JSON levels (the schema and its properties) */
        int deep[] = {65, 300, objects ? 495 : 990};
        for (size_t i = 0; i < sizeof deep / sizeof *deep; i++) {
            s = nested_schema(deep[i], objects);
            REQUIRE(s);
            expect_error(LOOM_GRAMMAR_JSON_SCHEMA, s, "nested deeper than 64 levels");
            free(s);
        }
        s = nested_schema(1000, objects);
        REQUIRE(s);
        expect_error(LOOM_GRAMMAR_JSON_SCHEMA, s, "json schema");
        free(s);
    }
    /* a chain of $refs nests the same way */
    enum { R = 1000 };
    size_t cap = (size_t)R * 64 + 64, len = 0;
    char *s = malloc(cap);
    REQUIRE(s);
    len += (size_t)snprintf(s + len, cap - len, "{\"$ref\":\"#/$defs/d0\",\"$defs\":{");
    for (int i = 0; i < R; i++)
        len += (size_t)snprintf(s + len, cap - len, "%s\"d%d\":{\"$ref\":\"#/$defs/d%d\"}", i ? "," : "", i,
                                i + 1 < R ? i + 1 : 0);
    snprintf(s + len, cap - len, "}}");
    loom_grammar_t *g = NULL;
    loom_err_t err = {0};
    loom_status_t st = loom_grammar_compile(LOOM_GRAMMAR_JSON_SCHEMA, s, strlen(s), &g, &err);
    CHECKF(st < 0 && !g, "a %d-long $ref chain compiled", R);
    loom_grammar_destroy(&g);
    free(s);
}

/* ---- Special tokens (a token element): only the id is allowed there. */

/* mask == the tokens accept_token takes from m's state (tried on a copy). */
static int mask_is_accept_set(loom_grammar_matcher_t *m, loom_grammar_matcher_t *scratch,
                              const uint32_t *mask, int n_vocab) {
    int bad = 0;
    for (int id = 0; id < n_vocab; id++) {
        if (loom_grammar_matcher_copy(scratch, m) < 0) return 0;
        int takes = loom_grammar_matcher_accept_token(scratch, id) == LOOM_OK;
        int set = (mask[id >> 5] >> (id & 31)) & 1;
        if (takes != set && bad++ < 4)
            fprintf(stderr, "  token %d: mask %d, accept %d\n", id, set, takes);
    }
    return bad == 0;
}

static int mask_count(const uint32_t *mask, size_t words) {
    int n = 0;
    for (size_t w = 0; w < words; w++)
        n += __builtin_popcount(mask[w]);
    return n;
}

/* Walks the grammar with random allowed tokens from its start, checking each
 * mask against accept_token, a replay and a copy; returns the walk's ids. */
static int special_walk(loom_grammar_t *g, const loom_grammar_vocab_t *v, uint64_t seed,
                        int32_t *ids, int cap) {
    loom_grammar_matcher_t *m = NULL, *scratch = NULL, *re = NULL;
    loom_grammar_matcher_create(g, v, &m, NULL);
    loom_grammar_matcher_create(g, v, &scratch, NULL);
    loom_grammar_matcher_create(g, v, &re, NULL);
    int n_vocab = loom_grammar_vocab_size(v);
    size_t words = loom_grammar_mask_words(v);
    uint32_t *mask = calloc(words, sizeof *mask), *mask2 = calloc(words, sizeof *mask2);
    int n = 0;
    while (n < cap && !loom_grammar_matcher_is_terminated(m)) {
        loom_grammar_matcher_fill_mask(m, mask);
        CHECKF(mask_is_accept_set(m, scratch, mask, n_vocab),
               "step %d: the mask differs from accept_token", n);
        CHECK(loom_grammar_matcher_replay(re, ids, n) == LOOM_OK);
        loom_grammar_matcher_fill_mask(re, mask2);
        CHECKF(!memcmp(mask, mask2, words * sizeof *mask), "step %d: a replay's mask differs", n);
        int k = mask_count(mask, words);
        CHECKF(k > 0, "step %d: nothing allowed", n);
        if (k == 0) break;
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        int pick = (int)((seed >> 33) % (uint64_t)k);
        for (int id = 0; id < n_vocab; id++)
            if (((mask[id >> 5] >> (id & 31)) & 1) && pick-- == 0) {
                CHECK(loom_grammar_matcher_accept_token(m, id) == LOOM_OK);
                ids[n++] = id;
                break;
            }
    }
    free(mask);
    free(mask2);
    loom_grammar_matcher_destroy(&m);
    loom_grammar_matcher_destroy(&scratch);
    loom_grammar_matcher_destroy(&re);
    return n;
}

static void test_special_tokens(void) {
    /* id 5 is the special token [TOOL_CALLS] (no bytes); id 12 an ordinary
       token whose bytes spell it; 14 EOS */
    static const char *const pieces[] = {
        "[", "TO", "OL", "_CALLS",       "]", NULL, "{",  "}",          "\"",
        "a", ":",  " ",  "[TOOL_CALLS]", "x", NULL, ", ", "TOOL_CALLS]"};
    enum { NV = sizeof pieces / sizeof pieces[0], SPECIAL = 5, SPELLED = 12, EOS = 14 };
    size_t lens[NV];
    for (int i = 0; i < NV; i++)
        lens[i] = pieces[i] ? strlen(pieces[i]) : 0;
    loom_grammar_vocab_t *v = NULL;
    REQUIRE(loom_grammar_vocab_create_bytes(NV, pieces, lens, &v, NULL) == LOOM_OK);
    loom_grammar_vocab_add_eos(v, EOS);
    const char *spec =
        "{\"begin\": \"[TOOL_CALLS][\", \"end\": \"]\", \"sep\": \", \", \"max\": 0, \"items\": "
        "[{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"string\", \"maxLength\": "
        "3}}, "
        "\"required\": [\"a\"], \"additionalProperties\": false}], "
        "\"special_tokens\": {\"[TOOL_CALLS]\": 5}}";
    loom_grammar_t *g = compile(LOOM_GRAMMAR_TOOL_CALLS, spec);
    REQUIRE(g);
    loom_grammar_matcher_t *m = NULL;
    REQUIRE(loom_grammar_matcher_create(g, v, &m, NULL) == LOOM_OK);
    size_t words = loom_grammar_mask_words(v);
    uint32_t mask[2] = {0};
    REQUIRE(words <= 2);
    /* the start: the special token's id alone, not its text in other tokens */
    loom_grammar_matcher_fill_mask(m, mask);
    CHECKF(mask[0] == 1u << SPECIAL && mask_count(mask, words) == 1, "start mask %08x", mask[0]);
    CHECK(loom_grammar_matcher_accept_token(m, SPELLED) < 0);
    CHECK(loom_grammar_matcher_accept_token(m, 0) < 0);
    CHECK(loom_grammar_matcher_accept_bytes(m, "[TOOL_CALLS]", 12) < 0);
    CHECK(loom_grammar_matcher_n_accepted(m) == 0);
    CHECK(loom_grammar_matcher_accept_token(m, SPECIAL) == LOOM_OK);
    loom_grammar_matcher_fill_mask(m, mask);
    CHECKF(mask[0] == 1u << 0, "after the token: only '[' (mask %08x)", mask[0]);
    /* inside a JSON string the token's text is ordinary text; the token is not */
    CHECK(loom_grammar_matcher_accept_bytes(m, "[{\"a\": \"", 8) == LOOM_OK);
    loom_grammar_matcher_fill_mask(m, mask);
    CHECK(!(mask[0] >> SPECIAL & 1) && (mask[0] >> 13 & 1));
    loom_grammar_matcher_destroy(&m);
    /* decoded text, where the token was written out, matches; without it not */
    CHECK(check(g, "[TOOL_CALLS][{\"a\": \"x\"}]") == LOOM_GRAMMAR_MATCH);
    CHECK(check(g, "[TOOL_CALLS][{\"a\": \"x\"}, {\"a\":\"[TOOL_CALLS]\"}]") ==
          LOOM_GRAMMAR_REJECT); /* maxLength */
    CHECK(check(g, "[{\"a\": \"x\"}]") == LOOM_GRAMMAR_REJECT);
    CHECK(check(g, "[TOOL_") == LOOM_GRAMMAR_PREFIX);
    /* random walks: every mask equals what accept_token takes, replays agree,
       and the walks end (EOS) in output that decodes to a match */
    int32_t ids[80];
    int finished = 0;
    for (int w = 0; w < 12; w++) {
        int n = special_walk(g, v, 77u + (uint64_t)w * 1000003u, ids, 80);
        CHECK(n > 0 && ids[0] == SPECIAL);
        int spelled = 0;
        for (int i = 1; i < n; i++)
            spelled |= ids[i] == SPECIAL;
        CHECKF(!spelled, "walk %d: the special token past the start", w);
        if (n == 0 || ids[n - 1] != EOS) continue;
        finished++;
        loom_sbuf_t text = {0};
        loom_sbuf_add(&text, "", 0);
        for (int i = 0; i + 1 < n; i++)
            loom_sbuf_str(&text, ids[i] == SPECIAL ? "[TOOL_CALLS]" : pieces[ids[i]]);
        CHECKF(check(g, text.p) == LOOM_GRAMMAR_MATCH, "walk %d: %s", w, text.p);
        free(text.p);
    }
    CHECKF(finished >= 6, "only %d of 12 walks finished", finished);
    loom_grammar_destroy(&g);
    /* a token in the middle of the markup, twice per item (the mask cache
       keyed by stack tops must keep the token's element apart) */
    g = compile(LOOM_GRAMMAR_TOOL_CALLS,
                "{\"item_begin\": \"[TOOL_CALLS]{\", \"item_end\": \"}[TOOL_CALLS]\", "
                "\"sep\": \" \", \"max\": 0, \"items\": [{\"const\": \"x\"}], "
                "\"special_tokens\": {\"[TOOL_CALLS]\": 5}}");
    REQUIRE(g);
    for (int w = 0; w < 6; w++) {
        int n = special_walk(g, v, 991u + (uint64_t)w, ids, 60);
        int specials = 0;
        for (int i = 0; i < n; i++)
            specials += ids[i] == SPECIAL;
        CHECKF(n > 0 && specials >= 2 && specials % 2 == 0, "walk %d: %d special tokens in %d", w,
               specials, n);
    }
    CHECK(check(g, "[TOOL_CALLS]{\"x\"}[TOOL_CALLS] [TOOL_CALLS]{\"x\"}[TOOL_CALLS]") ==
          LOOM_GRAMMAR_MATCH);
    loom_grammar_destroy(&g);
    loom_grammar_vocab_destroy(&v);
    /* bad special_tokens */
    expect_error(LOOM_GRAMMAR_TOOL_CALLS, "{\"items\": [{}], \"special_tokens\": [1]}",
                 "special_tokens");
    expect_error(LOOM_GRAMMAR_TOOL_CALLS, "{\"items\": [{}], \"special_tokens\": {\"[X]\": -1}}",
                 "'[X]'");
    expect_error(LOOM_GRAMMAR_TOOL_CALLS, "{\"items\": [{}], \"special_tokens\": {\"\": 3}}",
                 "token id");
    expect_error(LOOM_GRAMMAR_TOOL_CALLS, "{\"items\": [{}], \"syntax\": \"xml\"}", "syntax 'xml'");
}

int main(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--gen-dir") == 0)
            g_gen_dir = argv[i + 1];
        else if (strcmp(argv[i], "--work-dir") == 0)
            g_work_dir = argv[i + 1];
        else if (strcmp(argv[i], "--python") == 0)
            g_python = argv[i + 1];
        else if (strcmp(argv[i], "--n-schemas") == 0)
            g_n_schemas = atoi(argv[i + 1]);
    }
    mkdir(g_work_dir, 0755);
    RUN(test_regex);
    RUN(test_ebnf);
    RUN(test_json_schema);
    RUN(test_cache);
    RUN(test_cache_bytes);
    RUN(test_long_chain);
    RUN(test_limits);
    RUN(test_deep_schema);
    RUN(test_special_tokens);
    RUN(test_mutations);
    RUN(test_masks_stories);
    RUN(test_masks_bytelevel);
    RUN(test_property_stories);
    RUN(test_property_bytelevel);
    return test_summary();
}
