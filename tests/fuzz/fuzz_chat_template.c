/* Fuzz target: chat-template input. The first byte picks the template (the
 * shipped chatml, or the input itself read as a template) and
 * add_generation_prompt; the rest, split at NUL bytes, is messages (each
 * one's first byte picks its role) rendered with their plain spans, which
 * must lie in order inside the prompt and each spell a special token, and
 * tokenized with them. */
#include <string.h>

#include "common/chat_template.h"
#include "tests/fuzz/fuzz.h"

#define MAX_MSGS 64

static loom_tokenizer_t *g_tok;
static loom_chat_template_t *g_chatml;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    g_tok = fuzz_tokenizer();
    loom_err_t err = {0};
    loom_chat_template_opts_t o = {.max_output = 1 << 16, .max_steps = 100000};
    if (loom_chat_template_from_text(loom_chat_template_shipped("chatml"), NULL, "chatml", &o,
                                     g_tok, &g_chatml, &err) < 0)
        __builtin_trap();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    char *text = malloc(size + 1);
    memcpy(text, data, size);
    text[size] = '\0';
    loom_chat_template_t *own = NULL, *t = g_chatml;
    loom_err_t err = {0};
    loom_chat_template_opts_t o = {.max_output = 1 << 16, .max_steps = 100000};
    if (data[0] & 2) { /* the input (up to its first NUL) as a template */
        if (loom_chat_template_from_text(text + 1, "{\"bos_token\": \"<s>\"}", "fuzz", &o, g_tok,
                                         &own, &err) < 0)
            FUZZ_ASSERT(err.msg[0]);
        if (!own) {
            free(text);
            return 0;
        }
        t = own;
    }
    static const char *const roles[] = {"system", "user", "assistant", "tool"};
    cJSON *req = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(req, "messages");
    cJSON_AddBoolToObject(req, "add_generation_prompt", data[0] & 1);
    size_t at = 1;
    for (int n = 0; at < size && n < MAX_MSGS; n++) {
        size_t end = at;
        while (end < size && data[end])
            end++;
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", roles[data[at] & 3]);
        cJSON_AddStringToObject(m, "content", end > at ? text + at + 1 : "");
        cJSON_AddItemToArray(msgs, m);
        at = end + 1;
    }
    char *out = NULL;
    size_t len = 0, *plain = NULL, n_plain = 0;
    const char *param = NULL;
    loom_status_t st =
        loom_chat_template_render(t, req, &out, &len, &plain, &n_plain, &param, &err);
    if (st == LOOM_OK) {
        FUZZ_ASSERT(strlen(out) == len);
        size_t prev = 0;
        for (size_t i = 0; i < n_plain; i++) {
            size_t a = plain[2 * i], b = plain[2 * i + 1];
            FUZZ_ASSERT(a >= prev && a < b && b <= len);
            prev = b;
        }
        int32_t *ids = NULL;
        int n_ids = 0, cap = 0;
        if (len)
            FUZZ_ASSERT(loom_tokenizer_encode_spans(g_tok, out, len, 0, plain, n_plain, &ids,
                                                    &n_ids, &cap, &err) == LOOM_OK);
        free(ids);
    } else {
        FUZZ_ASSERT(err.msg[0] && param);
    }
    free(out);
    free(plain);
    cJSON_Delete(req);
    loom_chat_template_destroy(&own);
    free(text);
    return 0;
}
