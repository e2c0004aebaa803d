/* Fuzz target: tokenizer.json text through the loader; when it loads, a
 * few texts (and the input itself) are encoded, with and without special
 * tokens and with plain-text spans, then decoded at once and streamed. */
#include <string.h>

#include "tests/fuzz/fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    return 0;
}

static void round_trip(const loom_tokenizer_t *tok, const char *text, size_t len) {
    int32_t *ids = NULL;
    int n = 0, cap = 0, vocab = loom_tokenizer_vocab_size(tok);
    loom_err_t err = {0};
    for (int special = 0; special < 2; special++) {
        if (loom_tokenizer_encode(tok, text, len, special, special, &ids, &n, &cap, &err) < 0)
            continue;
        for (int i = 0; i < n; i++)
            FUZZ_ASSERT(ids[i] >= 0 && ids[i] < vocab);
        size_t out_len = 0;
        free(loom_tokenizer_decode(tok, ids, n, special, &out_len));
        loom_detok_t d;
        loom_detok_init(&d, tok, special, 1);
        size_t cap_out =
            loom_tokenizer_max_piece_len(tok) + 256; /* enough for one token (tokenizer.h) */
        char *buf = malloc(cap_out);
        for (int i = 0; i < n; i++)
            FUZZ_ASSERT(loom_detok_push(&d, ids[i], buf, cap_out) < cap_out);
        FUZZ_ASSERT(loom_detok_flush(&d, buf, cap_out) < cap_out);
        free(buf);
    }
    size_t spans[2] = {len / 4, len / 2};
    if (spans[0] < spans[1] &&
        loom_tokenizer_encode_spans(tok, text, len, 0, spans, 1, &ids, &n, &cap, &err) == LOOM_OK)
        for (int i = 0; i < n; i++)
            FUZZ_ASSERT(ids[i] >= 0 && ids[i] < vocab);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_tokenizer_t *tok = NULL;
    loom_err_t err = {0};
    if (loom_tokenizer_load_json((const char *)data, size, NULL, 0, &tok, &err) < 0) return 0;
    static const char *texts[] = {"Once upon a time",     " hello  world\n\t",
                                  "<s>[INST] hi </s>",    "caf\xc3\xa9 \xe2\x80\x94",
                                  "\xff\xfe broken \xc3", ""};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        round_trip(tok, texts[i], strlen(texts[i]));
    round_trip(tok, (const char *)data, size < 4096 ? size : 4096);
    for (int id = -1; id < 8; id++) {
        (void)loom_tokenizer_piece(tok, id);
        (void)loom_tokenizer_is_special(tok, id);
    }
    loom_tokenizer_destroy(&tok);
    return 0;
}
