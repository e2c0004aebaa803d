/* Tests of tool calling's request reading, rendering and output parsing
 * (gateway/tool_calls.c) for the chat families served. */
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "gateway/tool_calls.h"
#include "tests/test.h"

static const char *k_req =
    "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}},"
    "{\"type\": \"function\", \"function\": {\"name\": \"now\"}}]%s}";

static cJSON *req(const char *extra) {
    char buf[1024];
    snprintf(buf, sizeof buf, k_req, extra);
    return cJSON_Parse(buf);
}

static void test_parse_request(void) {
    static const struct {
        const char *extra;
        int ok;
        loom_tools_mode_t mode;
        const char *want; /* in the message or the schema */
    } cases[] = {
        {"", 1, LOOM_TOOLS_AUTO, NULL},
        {", \"tool_choice\": \"none\"", 1, LOOM_TOOLS_OFF, NULL},
        {", \"tool_choice\": \"required\", \"parallel_tool_calls\": false", 1, LOOM_TOOLS_REQUIRED, "\"maxItems\":1"},
        {", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}", 1, LOOM_TOOLS_NAMED,
         "\"city\""},
        {", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"x\"}}", 0, 0, "'x'"},
        {", \"tool_choice\": \"always\"", 0, 0, "always"},
        {", \"parallel_tool_calls\": 1", 0, 0, "boolean"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        cJSON *r = req(cases[c].extra);
        loom_tools_t t;
        const char *param = NULL;
        char msg[256] = "";
        int rc = loom_tools_parse(r, LOOM_CHAT_CHATML, &t, &param, msg, sizeof msg);
        CHECKF((rc == 0) == cases[c].ok, "case %zu: rc %d (%s)", c, rc, msg);
        if (rc == 0) {
            CHECKF(t.mode == cases[c].mode, "case %zu: mode %d", c, t.mode);
            if (cases[c].want) CHECKF(t.schema && strstr(t.schema, cases[c].want), "case %zu: schema %s", c, t.schema);
            if (t.mode != LOOM_TOOLS_OFF) CHECK(t.render && strstr(t.render, "<tools>") && strstr(t.render, "get_weather"));
        } else {
            CHECKF(strstr(msg, cases[c].want) != NULL, "case %zu: %s", c, msg);
        }
        loom_tools_free(&t);
        cJSON_Delete(r);
    }
}

static int one_call(cJSON *calls, const char *name, const char *args) {
    if (!calls || cJSON_GetArraySize(calls) != 1) return 0;
    cJSON *fn = cJSON_GetObjectItem(cJSON_GetArrayItem(calls, 0), "function");
    return !strcmp(cJSON_GetObjectItem(fn, "name")->valuestring, name) &&
           !strcmp(cJSON_GetObjectItem(fn, "arguments")->valuestring, args);
}

static void test_parse_output(void) {
    cJSON *r = req("");
    loom_tools_t t;
    const char *param;
    char msg[256];
    CHECK(loom_tools_parse(r, LOOM_CHAT_CHATML, &t, &param, msg, sizeof msg) == 0);
    char *rest = NULL;
    const char *hermes = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    cJSON *c = loom_tools_parse_output(&t, LOOM_CHAT_CHATML, hermes, strlen(hermes), 7, &rest);
    CHECK(one_call(c, "get_weather", "{\"city\":\"Paris\"}") && rest && !strcmp(rest, "Let me look."));
    cJSON_Delete(c);
    free(rest);
    const char *llama = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
    c = loom_tools_parse_output(&t, LOOM_CHAT_LLAMA3, llama, strlen(llama), 7, &rest);
    CHECK(one_call(c, "get_weather", "{\"city\":\"Oslo\"}") && !rest);
    cJSON_Delete(c);
    const char *mistral = "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]";
    c = loom_tools_parse_output(&t, LOOM_CHAT_MISTRAL, mistral, strlen(mistral), 7, &rest);
    CHECK(c && cJSON_GetArraySize(c) == 2);
    if (c) { /* distinct ids */
        const char *a = cJSON_GetObjectItem(cJSON_GetArrayItem(c, 0), "id")->valuestring;
        const char *b = cJSON_GetObjectItem(cJSON_GetArrayItem(c, 1), "id")->valuestring;
        CHECK(strncmp(a, "call_", 5) == 0 && strcmp(a, b) != 0);
    }
    cJSON_Delete(c);
    /* not calls: plain text, an unknown function, broken JSON */
    static const char *const none[] = {"Once upon a time", "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
                                       "<tool_call>{\"name\": \"now\", </tool_call>"};
    for (size_t i = 0; i < 3; i++) {
        c = loom_tools_parse_output(&t, LOOM_CHAT_CHATML, none[i], strlen(none[i]), 7, &rest);
        CHECKF(!c && !rest, "text %zu read as a call", i);
    }
    loom_tools_free(&t);
    cJSON_Delete(r);
    /* forced: the named function's arguments object; required: the array */
    r = req(", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}");
    CHECK(loom_tools_parse(r, LOOM_CHAT_LLAMA3, &t, &param, msg, sizeof msg) == 0);
    c = loom_tools_parse_output(&t, LOOM_CHAT_LLAMA3, "{\"city\": \"Lima\"}", 16, 1, &rest);
    CHECK(one_call(c, "get_weather", "{\"city\":\"Lima\"}"));
    cJSON_Delete(c);
    loom_tools_free(&t);
    cJSON_Delete(r);
    r = req(", \"tool_choice\": \"required\"");
    CHECK(loom_tools_parse(r, LOOM_CHAT_MISTRAL, &t, &param, msg, sizeof msg) == 0 && strstr(t.render, "[AVAILABLE_TOOLS]"));
    const char *arr = "[{\"name\": \"now\", \"arguments\": {}}]";
    c = loom_tools_parse_output(&t, LOOM_CHAT_MISTRAL, arr, strlen(arr), 1, &rest);
    CHECK(one_call(c, "now", "{}"));
    cJSON_Delete(c);
    loom_tools_free(&t);
    cJSON_Delete(r);
}

static void test_render_history(void) {
    cJSON *calls = cJSON_Parse("[{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"now\", \"arguments\": \"{}\"}}]");
    char msg[256];
    char *h = loom_tools_render_calls(LOOM_CHAT_CHATML, calls, NULL, msg, sizeof msg);
    CHECK(h && !strcmp(h, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"));
    free(h);
    h = loom_tools_render_calls(LOOM_CHAT_LLAMA3, calls, NULL, msg, sizeof msg);
    CHECK(h && !strcmp(h, "{\"name\": \"now\", \"parameters\": {}}"));
    free(h);
    h = loom_tools_render_calls(LOOM_CHAT_MISTRAL, calls, NULL, msg, sizeof msg);
    CHECK(h && !strcmp(h, "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}]"));
    free(h);
    cJSON *bad = cJSON_Parse("[{\"function\": {\"name\": \"now\"}}]");
    CHECK(!loom_tools_render_calls(LOOM_CHAT_CHATML, bad, NULL, msg, sizeof msg) && strstr(msg, "arguments"));
    cJSON_Delete(bad);
    cJSON_Delete(calls);
    h = loom_tools_render_result(LOOM_CHAT_CHATML, "21 C");
    CHECK(!strcmp(h, "<tool_response>\n21 C\n</tool_response>"));
    free(h);
    h = loom_tools_render_result(LOOM_CHAT_MISTRAL, "21 C");
    CHECK(!strcmp(h, "[TOOL_RESULTS] {\"content\":\"21 C\"}[/TOOL_RESULTS]"));
    free(h);
}

int main(void) {
    RUN(test_parse_request);
    RUN(test_parse_output);
    RUN(test_render_history);
    return test_summary();
}
