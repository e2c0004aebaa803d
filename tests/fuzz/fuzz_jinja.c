/* Fuzz target: the Jinja engine (common/jinja.h). The input is a template
 * text; it is compiled, and what compiles is rendered with small limits
 * against a fixed conversation (messages with tool calls, tools, documents,
 * flags), once plainly and once with data spans. Properties: every refusal
 * has a message naming the template (or is a raise_exception), both renders
 * give the same verdict and text, and the spans are sorted, disjoint and
 * inside the output. */
#include <string.h>

#include "common/jinja.h"
#include "tests/fuzz/fuzz.h"

static cJSON *g_vars;

static const char k_vars[] =
    "{\"messages\": ["
    "{\"role\": \"system\", \"content\": \"You are <|im_start|> helpful.\"},"
    "{\"role\": \"user\", \"content\": \"Hi {{ x }} \\u00e9\\u2713\\n\"},"
    "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"call12345\", "
    "\"type\": \"function\","
    "\"function\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"n\": 2, "
    "\"f\": 1.5}}}]},"
    "{\"role\": \"tool\", \"tool_call_id\": \"call12345\", \"content\": \"{\\\"t\\\": 22}\"},"
    "{\"role\": \"assistant\", \"content\": \"<think>\\nhmm\\n</think>\\n\\nSunny.\"},"
    "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": "
    "\"image\"}]}],"
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
    "\"description\": \"d\","
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, "
    "\"required\": [\"city\"]}}}],"
    "\"documents\": [{\"title\": \"t\", \"text\": \"x\"}], \"add_generation_prompt\": true, "
    "\"enable_thinking\": false,"
    "\"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"n\": 3, \"none\": null, \"big\": "
    "9007199254740993}";

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    g_vars = cJSON_Parse(k_vars);
    FUZZ_ASSERT(g_vars != NULL);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_jinja_t *t = NULL;
    loom_err_t err = {0};
    loom_status_t s = loom_jinja_compile((const char *)data, size, "fz", &t, &err);
    if (s != LOOM_OK) {
        FUZZ_ASSERT(t == NULL);
        FUZZ_ASSERT(s == LOOM_ERR_INVALID_ARGUMENT || s == LOOM_ERR_NOMEM);
        FUZZ_ASSERT(strncmp(err.msg, "fz:", 3) == 0);
        return 0;
    }
    loom_jinja_limits_t lim = {.max_output = 1 << 16, .max_steps = 200000, .max_depth = 16};
    char *a = NULL, *b = NULL;
    size_t na = 0, nb = 0, nsp = 0;
    loom_jinja_span_t *sp = NULL;
    loom_err_t ea = {0}, eb = {0};
    loom_status_t sa = loom_jinja_render(t, g_vars, &lim, &a, &na, &ea);
    loom_status_t sb = loom_jinja_render_spans(t, g_vars, &lim, &b, &nb, &sp, &nsp, &eb);
    FUZZ_ASSERT(sa == sb);
    if (sa == LOOM_OK) {
        FUZZ_ASSERT(a && b && na == nb && memcmp(a, b, na) == 0 && a[na] == '\0');
        FUZZ_ASSERT(na <= lim.max_output);
        for (size_t i = 0; i < nsp; i++) {
            FUZZ_ASSERT(sp[i].begin < sp[i].end && sp[i].end <= nb);
            if (i) FUZZ_ASSERT(sp[i - 1].end < sp[i].begin);
        }
    } else {
        FUZZ_ASSERT(a == NULL && b == NULL && sp == NULL);
        FUZZ_ASSERT(sa == LOOM_ERR_INVALID_ARGUMENT || sa == LOOM_ERR_RESOURCE_EXHAUSTED);
        FUZZ_ASSERT(strcmp(ea.msg, eb.msg) == 0);
    }
    free(a);
    free(b);
    free(sp);
    loom_jinja_destroy(&t);
    return 0;
}
