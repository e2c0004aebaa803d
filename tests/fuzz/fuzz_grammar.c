/* Fuzz target: the grammar compiler of constrained decoding. Byte 0 picks
 * the spec kind (JSON Schema, any JSON object, regex, choice, GBNF, tool
 * calls with special tokens); the
 * rest is the spec. A spec that compiles is run as a matcher over the
 * stories260K vocabulary for a few steps, each picking an allowed token
 * (chosen by the input's bytes): the mask's tokens are accepted, a token
 * outside it is refused and leaves the mask as it was, and a replay of the
 * accepted ids gives the same mask. */
#include <string.h>

#include "common/grammar.h"
#include "common/util.h"
#include "tests/fuzz/fuzz.h"

static loom_grammar_vocab_t *g_vocab;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    loom_tokenizer_t *tok = fuzz_tokenizer();
    loom_err_t err = {0};
    if (tok && loom_grammar_vocab_create(tok, &g_vocab, &err) < 0) g_vocab = NULL;
    loom_tokenizer_destroy(&tok);
    return 0;
}

static int mask_has(const uint32_t *m, int id) {
    return (int)(m[id / 32] >> (id % 32) & 1u);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static const loom_grammar_kind_t kinds[] = {LOOM_GRAMMAR_JSON_SCHEMA, LOOM_GRAMMAR_JSON_OBJECT,
                                                LOOM_GRAMMAR_REGEX,       LOOM_GRAMMAR_CHOICE,
                                                LOOM_GRAMMAR_EBNF,        LOOM_GRAMMAR_TOOL_CALLS};
    loom_grammar_kind_t kind = kinds[data[0] % 6];
    const char *spec = (const char *)data + 1;
    size_t len = size - 1;
    loom_grammar_t *g = NULL;
    loom_err_t err = {0};
    if (loom_grammar_compile(kind, spec, len, &g, &err) < 0) {
        FUZZ_ASSERT(err.msg[0]);
        return 0;
    }
    (void)loom_grammar_check(g, spec, len);
    (void)loom_grammar_check(g, "{}", 2);
    if (!g_vocab) {
        loom_grammar_destroy(&g);
        return 0;
    }
    loom_grammar_matcher_t *m = NULL, *r = NULL;
    FUZZ_ASSERT(loom_grammar_matcher_create(g, g_vocab, &m, &err) == LOOM_OK);
    FUZZ_ASSERT(loom_grammar_matcher_create(g, g_vocab, &r, &err) == LOOM_OK);
    size_t words = loom_grammar_mask_words(g_vocab);
    int n_vocab = loom_grammar_vocab_size(g_vocab);
    uint32_t *mask = loom_xmalloc(words * sizeof *mask), *again = loom_xmalloc(words * sizeof *again);
    int32_t ids[16];
    int n = 0;
    for (int step = 0; step < 16 && !loom_grammar_matcher_is_terminated(m); step++) {
        loom_grammar_matcher_fill_mask(m, mask);
        int n_set = 0, pick = -1, refused = -1;
        for (int id = 0; id < n_vocab; id++) n_set += mask_has(mask, id);
        if (n_set == 0) break;
        int k = (int)(data[(size_t)step % size] * 131u % (unsigned)n_set);
        for (int id = 0; id < n_vocab; id++) {
            if (mask_has(mask, id) && k-- == 0) pick = id;
            if (!mask_has(mask, id) && refused < 0) refused = id;
        }
        if (refused >= 0) { /* refused, and the state is unchanged */
            FUZZ_ASSERT(loom_grammar_matcher_accept_token(m, refused) < 0);
            loom_grammar_matcher_fill_mask(m, again);
            FUZZ_ASSERT(!memcmp(mask, again, words * sizeof *mask));
        }
        FUZZ_ASSERT(loom_grammar_matcher_accept_token(m, pick) == LOOM_OK);
        ids[n++] = pick;
    }
    if (!loom_grammar_matcher_is_terminated(m)) {
        FUZZ_ASSERT(loom_grammar_matcher_replay(r, ids, n) == LOOM_OK);
        loom_grammar_matcher_fill_mask(m, mask);
        loom_grammar_matcher_fill_mask(r, again);
        FUZZ_ASSERT(!memcmp(mask, again, words * sizeof *mask));
    }
    free(mask);
    free(again);
    loom_grammar_matcher_destroy(&m);
    loom_grammar_matcher_destroy(&r);
    loom_grammar_destroy(&g);
    return 0;
}
