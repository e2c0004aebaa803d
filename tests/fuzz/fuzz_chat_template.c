/* Fuzz target: chat-template input. The first byte picks the family and
 * add_generation_prompt; the rest, split at NUL bytes, is messages (each
 * one's first byte picks its role) rendered with their spans, which must
 * cover exactly message text, and tokenized with them. The whole input is
 * also read as a Jinja template text for family detection. */
#include <string.h>

#include "common/chat_template.h"
#include "tests/fuzz/fuzz.h"

#define MAX_MSGS 64

static loom_tokenizer_t *g_tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    g_tok = fuzz_tokenizer();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    char *text = malloc(size + 1);
    memcpy(text, data, size);
    text[size] = '\0';
    /* detection reads the text up to its first NUL */
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    if (loom_chat_template_from_text(text + 1, NULL, "<s>", "</s>", &t, &err) == LOOM_OK)
        loom_chat_template_destroy(&t);

    static const char *roles[] = {"system", "user", "assistant", "developer", "tool"};
    loom_chat_family_t fam = (loom_chat_family_t)(1 + data[0] % 4);
    int gen = (data[0] >> 2) & 1;
    t = loom_chat_template_create(fam, NULL, NULL,
                                  (data[0] >> 3) & 1 ? "You are <|im_start|> helpful." : NULL);
    loom_chat_msg_t m[MAX_MSGS];
    int n = 0;
    for (size_t at = 1; at < size && n < MAX_MSGS;) {
        size_t l = strlen(text + at);
        m[n].role = roles[(unsigned char)text[at] % 5];
        m[n].content = l ? text + at + 1 : "";
        n++;
        at += l + 1;
    }
    char *out = NULL, *plain_out = NULL;
    size_t len = 0, *sp = NULL, n_sp = 0;
    if (loom_chat_render_spans(t, m, n, gen, &out, &len, &sp, &n_sp, &err) == LOOM_OK) {
        FUZZ_ASSERT(out && strlen(out) == len);
        FUZZ_ASSERT(loom_chat_render(t, m, n, gen, &plain_out, NULL, &err) == LOOM_OK &&
                    !strcmp(plain_out, out));
        for (size_t i = 0; i < n_sp; i++) {
            FUZZ_ASSERT(sp[2 * i] < sp[2 * i + 1] && sp[2 * i + 1] <= len);
            FUZZ_ASSERT(i == 0 || sp[2 * i] >= sp[2 * i - 1]);
            /* each span is a piece of some message's content */
            size_t sl = sp[2 * i + 1] - sp[2 * i];
            int found = 0;
            for (int k = 0; k < n && !found; k++) {
                const char *c = m[k].content;
                found = memmem(c, strlen(c), out + sp[2 * i], sl) != NULL;
            }
            FUZZ_ASSERT(found);
        }
        if (g_tok) {
            int32_t *ids = NULL;
            int n_ids = 0, cap = 0;
            FUZZ_ASSERT(loom_tokenizer_encode_spans(g_tok, out, len, 0, sp, n_sp, &ids, &n_ids,
                                                    &cap, &err) == LOOM_OK);
            free(ids);
        }
    } else {
        FUZZ_ASSERT(err.msg[0]);
    }
    free(out);
    free(plain_out);
    free(sp);
    loom_chat_template_destroy(&t);
    free(text);
    return 0;
}
