/* Fuzz target: an HTTP request body as the gateway parses it (strict JSON,
 * the fields of /v1/completions or /v1/chat/completions, sampling
 * parameters, messages through a chat template and the tokenizer), without
 * sockets (gateway/http_parse.h). The first byte picks the route, the
 * template (none, the shipped chatml, or one that reads every variable) and
 * --chat-special-tokens-in-content; the rest is the body. */
#include <string.h>

#include "common/json.h"
#include "gateway/http_parse.h"
#include "tests/fuzz/fuzz.h"

static loom_tokenizer_t *g_tok;
static loom_chat_template_t *g_tmpl[2];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    g_tok = fuzz_tokenizer();
    loom_err_t err = {0};
    loom_chat_template_opts_t o = {.trust_request = 1, .max_output = 1 << 16, .max_steps = 100000};
    if (loom_chat_template_from_text(loom_chat_template_shipped("chatml"), NULL, "chatml", &o, g_tok, &g_tmpl[0],
                                     &err) < 0 ||
        loom_chat_template_from_text("{{ bos_token }}{% for m in messages %}{{ m.role }}{{ m.content }}{{ m.tool_calls "
                                     "| tojson }}{% endfor %}{{ tools | tojson }}{{ documents }}{{ add_generation_prompt "
                                     "}}{{ continue_final_message }}{{ reasoning_effort }}",
                                     "{\"bos_token\": \"<s>\"}", "all", &o, g_tok, &g_tmpl[1], &err) < 0)
        __builtin_trap();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    char msg[1024];
    msg[0] = '\0';
    cJSON *root = loom_http_parse_json_body(body, len, msg, sizeof msg);
    if (root) {
        FUZZ_ASSERT(cJSON_IsObject(root));
        char path[64];
        FUZZ_ASSERT(!loom_json_find_duplicate(root, path, sizeof path));
        cJSON_Delete(root);
    } else {
        FUZZ_ASSERT(msg[0]);
    }
    int chat = data[0] & 1, special = (data[0] >> 1) & 1;
    const loom_chat_template_t *tmpl = (data[0] >> 2) & 1 ? NULL : g_tmpl[(data[0] >> 3) & 1];
    msg[0] = '\0';
    if (loom_http_parse_generate(body, len, chat, tmpl, g_tok, special, msg, sizeof msg) < 0)
        FUZZ_ASSERT(msg[0]);
    return 0;
}
