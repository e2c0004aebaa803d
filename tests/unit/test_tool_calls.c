/* Tests of tool calling's request reading, the parsers' names and
 * detection, the forced call's grammar in each model's syntax and output
 * parsing (gateway/tool_calls.c). */
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/grammar.h"
#include "common/tokenizer.h"
#include "common/util.h"
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
        {", \"tool_choice\": \"required\", \"parallel_tool_calls\": false", 1, LOOM_TOOLS_REQUIRED, "\"max\":1"},
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
        int rc = loom_tools_parse(r, LOOM_TOOLFMT_HERMES, &t, &param, msg, sizeof msg);
        CHECKF((rc == 0) == cases[c].ok, "case %zu: rc %d (%s)", c, rc, msg);
        if (rc == 0) {
            CHECKF(t.mode == cases[c].mode, "case %zu: mode %d", c, t.mode);
            if (cases[c].want) CHECKF(t.schema && strstr(t.schema, cases[c].want), "case %zu: schema %s", c, t.schema);
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

static cJSON *parse_out(loom_toolfmt_t f, const loom_tools_t *t0, const char *text, char **rest) {
    loom_tools_t t = *t0;
    t.fmt = f;
    return loom_tools_parse_output(&t, text, strlen(text), 7, rest);
}

static void test_parse_output(void) {
    cJSON *r = req("");
    loom_tools_t t;
    const char *param;
    char msg[256];
    CHECK(loom_tools_parse(r, LOOM_TOOLFMT_HERMES, &t, &param, msg, sizeof msg) == 0);
    char *rest = NULL;
    const char *hermes = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    cJSON *c = parse_out(LOOM_TOOLFMT_HERMES, &t, hermes, &rest);
    CHECK(one_call(c, "get_weather", "{\"city\":\"Paris\"}") && rest && !strcmp(rest, "Let me look."));
    cJSON_Delete(c);
    free(rest);
    const char *llama = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
    c = parse_out(LOOM_TOOLFMT_LLAMA3_JSON, &t, llama, &rest);
    CHECK(one_call(c, "get_weather", "{\"city\":\"Oslo\"}") && !rest);
    cJSON_Delete(c);
    const char *mistral = "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]";
    c = parse_out(LOOM_TOOLFMT_MISTRAL, &t, mistral, &rest);
    CHECK(c && cJSON_GetArraySize(c) == 2);
    if (c) { /* distinct ids */
        const char *a = cJSON_GetObjectItem(cJSON_GetArrayItem(c, 0), "id")->valuestring;
        const char *b = cJSON_GetObjectItem(cJSON_GetArrayItem(c, 1), "id")->valuestring;
        CHECK(strncmp(a, "call_", 5) == 0 && strcmp(a, b) != 0);
    }
    cJSON_Delete(c);
    /* not calls: plain text, an unknown function, broken JSON; a hermes
     * block is no call to a mistral model */
    static const char *const none[] = {"Once upon a time", "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
                                       "<tool_call>{\"name\": \"now\", </tool_call>"};
    for (size_t i = 0; i < 3; i++) {
        c = parse_out(LOOM_TOOLFMT_HERMES, &t, none[i], &rest);
        CHECKF(!c && !rest, "text %zu read as a call", i);
    }
    c = parse_out(LOOM_TOOLFMT_MISTRAL, &t, hermes, &rest);
    CHECK(!c && !rest);
    loom_tools_free(&t);
    cJSON_Delete(r);
}

static void test_names(void) {
    static const char *const names[] = {"hermes", "llama3_json", "mistral", "granite", "deepseek_v3", "deepseek_v31",
                                        "pythonic", "llama4_pythonic", "qwen3_coder", "openai"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        loom_toolfmt_t f = loom_toolfmt_from_name(names[i]);
        CHECKF(f != LOOM_TOOLFMT_NONE && !strcmp(loom_toolfmt_name(f), names[i]), "%s", names[i]);
        CHECK(strstr(LOOM_TOOL_PARSER_NAMES, names[i]) != NULL);
    }
    CHECK(loom_toolfmt_from_name("hermes2") == LOOM_TOOLFMT_NONE && loom_toolfmt_from_name(NULL) == LOOM_TOOLFMT_NONE);
    /* markers the families' templates carry */
    CHECK(loom_toolfmt_detect("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}") == LOOM_TOOLFMT_HERMES);
    CHECK(loom_toolfmt_detect("{{- '[TOOL_CALLS] [' }}") == LOOM_TOOLFMT_MISTRAL);
    CHECK(loom_toolfmt_detect("{{- '<|python_tag|>' }}") == LOOM_TOOLFMT_LLAMA3_JSON);
    CHECK(loom_toolfmt_detect("<|start_header_id|>{\"name\": function name, \"parameters\": ...") ==
          LOOM_TOOLFMT_LLAMA3_JSON);
    CHECK(loom_toolfmt_detect("{{ '<|tool_call|>' }}") == LOOM_TOOLFMT_GRANITE);
    CHECK(loom_toolfmt_detect("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
                              "tool['function']['name'] + '\\n' + '```json' }}") == LOOM_TOOLFMT_DEEPSEEK_V3);
    CHECK(loom_toolfmt_detect("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
                              "'<｜tool▁sep｜>' + tool['function']['arguments'] }}") == LOOM_TOOLFMT_DEEPSEEK_V31);
    CHECK(loom_toolfmt_detect("[func_name1(params_name1=params_value1, params_name2=params_value2...)]") ==
          LOOM_TOOLFMT_PYTHONIC);
    CHECK(loom_toolfmt_detect("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + k }}") ==
          LOOM_TOOLFMT_QWEN3_CODER);
    CHECK(loom_toolfmt_detect("{{- \"<|start|>assistant to=\" }}{{- \"functions.\" + tool_call.name + "
                              "\"<|channel|>commentary \" }}{{- \"<|call|>\" }}") == LOOM_TOOLFMT_OPENAI);
    CHECK(loom_toolfmt_detect("{{ messages }}") == LOOM_TOOLFMT_NONE && loom_toolfmt_detect(NULL) == LOOM_TOOLFMT_NONE);
    /* the pythonic and qwen3_coder syntaxes are forced in their own form */
    for (loom_toolfmt_t f = LOOM_TOOLFMT_PYTHONIC; f <= LOOM_TOOLFMT_QWEN3_CODER; f++) {
        cJSON *r = req(", \"tool_choice\": \"required\"");
        loom_tools_t t;
        const char *param = NULL;
        char msg[256] = "";
        CHECKF(loom_tools_parse(r, f, &t, &param, msg, sizeof msg) == 0 && t.schema &&
                   strstr(t.schema, f == LOOM_TOOLFMT_QWEN3_CODER ? "\"syntax\":\"qwen3_coder\""
                                                                  : "\"syntax\":\"pythonic\""),
               "%s: %s", loom_toolfmt_name(f), msg);
        loom_tools_free(&t);
        cJSON_Delete(r);
    }
}

/* The forced call's grammar accepts the model's own call syntax and only
 * it, and what it accepts parses back into the call. */
static void test_forced_grammar(void) {
    static const struct {
        loom_toolfmt_t f;
        const char *choice, *ok, *bad;
        const char *name, *args;
    } cases[] = {
        {LOOM_TOOLFMT_HERMES, ", \"tool_choice\": \"required\"",
         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
         "\"Lima\"}}\n</tool_call>",
         "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}]", "get_weather",
         "{\"city\":\"Lima\"}"},
        {LOOM_TOOLFMT_MISTRAL, ", \"tool_choice\": \"required\"",
         "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}]",
         "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>", "now", "{}"},
        {LOOM_TOOLFMT_LLAMA3_JSON, ", \"tool_choice\": \"required\"",
         "{\"name\": \"now\", \"parameters\": {}}", "{\"name\": \"now\", \"arguments\": {}}", "now",
         "{}"},
        {LOOM_TOOLFMT_GRANITE,
         ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}",
         "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}]",
         "<|tool_call|>[{\"name\": \"now\", \"arguments\": {}}]", "get_weather",
         "{\"city\":\"x\"}"},
        {LOOM_TOOLFMT_DEEPSEEK_V3, ", \"tool_choice\": \"required\"",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"
         "\"city\": \"x\"}\n```"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"
         "\"town\": \"x\"}\n```"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         "get_weather", "{\"city\":\"x\"}"},
        {LOOM_TOOLFMT_DEEPSEEK_V31,
         ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"now\"}}",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><"
         "｜tool▁calls▁end｜>",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>",
         "now", "{}"},
        {LOOM_TOOLFMT_HERMES,
         ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}",
         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}\n</tool_call>",
         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>", "get_weather",
         "{\"city\":\"x\"}"},
        {LOOM_TOOLFMT_PYTHONIC, ", \"tool_choice\": \"required\"", "[get_weather(city=\"Lima\")]",
         "[get_weather(town=\"Lima\")]", "get_weather", "{\"city\":\"Lima\"}"},
        {LOOM_TOOLFMT_PYTHONIC,
         ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"now\"}}",
         "[now()]", "[get_weather(city=\"x\")]", "now", "{}"},
        {LOOM_TOOLFMT_LLAMA4_PYTHONIC, ", \"tool_choice\": \"required\"",
         "[get_weather(city=\"a\\\"b\\n\")]", "[get_weather(city='x')]", "get_weather",
         "{\"city\":\"a\\\"b\\n\"}"},
        {LOOM_TOOLFMT_QWEN3_CODER, ", \"tool_choice\": \"required\"",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</"
         "function>\n</tool_call>",
         "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", "get_weather",
         "{\"city\":\"Lima\"}"},
        {LOOM_TOOLFMT_QWEN3_CODER,
         ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"now\"}}",
         "<tool_call>\n<function=now>\n</function>\n</tool_call>",
         "<tool_call>\n<function=now>\n<parameter=city>\nx\n</parameter>\n</function>\n</"
         "tool_call>",
         "now", "{}"},
        {LOOM_TOOLFMT_OPENAI, ", \"tool_choice\": \"required\"",
         "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": "
         "\"x\"}",
         "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}",
         "get_weather", "{\"city\":\"x\"}"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cJSON *r = req(cases[i].choice);
        loom_tools_t t;
        const char *param;
        char msg[256];
        REQUIRE(loom_tools_parse(r, cases[i].f, &t, &param, msg, sizeof msg) == 0 && t.schema);
        loom_grammar_t *g = NULL;
        loom_err_t err = {0};
        CHECKF(loom_grammar_compile(LOOM_GRAMMAR_TOOL_CALLS, t.schema, strlen(t.schema), &g, &err) == LOOM_OK,
               "case %zu: %s", i, err.msg);
        if (g) {
            CHECKF(loom_grammar_check(g, cases[i].ok, strlen(cases[i].ok)) == LOOM_GRAMMAR_MATCH, "case %zu: %s", i,
                   cases[i].ok);
            CHECKF(loom_grammar_check(g, cases[i].bad, strlen(cases[i].bad)) != LOOM_GRAMMAR_MATCH, "case %zu: %s", i,
                   cases[i].bad);
        }
        loom_grammar_destroy(&g);
        char *rest = NULL;
        cJSON *c = loom_tools_parse_output(&t, cases[i].ok, strlen(cases[i].ok), 3, &rest);
        CHECKF(one_call(c, cases[i].name, cases[i].args) && !rest, "case %zu parses back", i);
        cJSON_Delete(c);
        free(rest);
        loom_tools_free(&t);
        cJSON_Delete(r);
    }
    /* parallel calls, hermes: blocks one after another */
    cJSON *r = req(", \"tool_choice\": \"required\"");
    loom_tools_t t;
    const char *param;
    char msg[256];
    REQUIRE(loom_tools_parse(r, LOOM_TOOLFMT_HERMES, &t, &param, msg, sizeof msg) == 0);
    loom_grammar_t *g = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_grammar_compile(LOOM_GRAMMAR_TOOL_CALLS, t.schema, strlen(t.schema), &g, &err) == LOOM_OK);
    const char *two = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": "
                      "\"now\", \"arguments\": {}}\n</tool_call>";
    CHECK(loom_grammar_check(g, two, strlen(two)) == LOOM_GRAMMAR_MATCH);
    loom_grammar_destroy(&g);
    loom_tools_free(&t);
    cJSON_Delete(r);
}

/* Pythonic and qwen3_coder forced calls over every kind of value: what the
 * grammar accepts parses back into arguments of the schema's types, and
 * values of the wrong type are refused. */
static void test_forced_typed(void) {
    static const char *tools = "{\"tool_choice\": \"required\", \"tools\": [{\"type\": "
                               "\"function\", \"function\": {\"name\": \"f\", "
                               "\"parameters\": {\"type\": \"object\", \"properties\": {\"n\": "
                               "{\"type\": \"integer\"}, \"x\": {\"type\": "
                               "\"number\"}, \"b\": {\"type\": \"boolean\"}, \"l\": {\"type\": "
                               "\"array\", \"items\": {\"type\": "
                               "\"string\"}}, \"d\": {\"type\": \"object\", \"properties\": "
                               "{\"k\": {\"type\": \"null\"}}, \"required\": "
                               "[\"k\"]}, \"e\": {\"enum\": [\"red\", \"blue\"], \"type\": "
                               "\"string\"}, \"s\": {\"type\": \"string\", "
                               "\"maxLength\": 4}}, \"required\": [\"n\", \"b\"]}}}]}";
    static const struct {
        loom_toolfmt_t f;
        const char *text, *args; /* args NULL: the grammar refuses text */
    } cases[] = {
        {LOOM_TOOLFMT_PYTHONIC,
         "[f(n=3, x=-1.5e2, b=True, l=[\"a\", \"b\"], d={\"k\": None}, e=\"blue\", s=\"ab\")]",
         "{\"n\":3,\"x\":-1.5e2,\"b\":true,\"l\":[\"a\",\"b\"],\"d\":{\"k\":null},\"e\":\"blue\","
         "\"s\":\"ab\"}"},
        {LOOM_TOOLFMT_PYTHONIC, "[f(n=0, b=False), f(n=1, b=True, s=\"\")]",
         "{\"n\":0,\"b\":false}"},
        {LOOM_TOOLFMT_PYTHONIC, "[f(n=3, b=true)]", NULL},
        {LOOM_TOOLFMT_PYTHONIC, "[f(b=True, n=3)]", NULL}, /* the schema's order */
        {LOOM_TOOLFMT_PYTHONIC, "[f(n=3)]", NULL},         /* b is required */
        {LOOM_TOOLFMT_PYTHONIC, "[f(n=3, b=True, e=\"green\")]", NULL},
        {LOOM_TOOLFMT_PYTHONIC, "[f(n=1, b=True, s=\"a\\u00e9\")]",
         NULL}, /* a JSON escape Python reads otherwise */
        {LOOM_TOOLFMT_QWEN3_CODER,
         "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=b>\ntrue\n</"
         "parameter>\n"
         "<parameter=l>\n[\"a\"]\n</parameter>\n<parameter=d>\n{\"k\": "
         "null}\n</parameter>\n<parameter=e>\nred\n"
         "</parameter>\n<parameter=s>\nx y\n</parameter>\n</function>\n</tool_call>",
         "{\"n\":3,\"b\":true,\"l\":[\"a\"],\"d\":{\"k\":null},\"e\":\"red\",\"s\":\"x y\"}"},
        {LOOM_TOOLFMT_QWEN3_CODER,
         "<tool_call>\n<function=f>\n<parameter=n>\nthree\n</parameter>\n<parameter=b>\ntrue\n</"
         "parameter>\n"
         "</function>\n</tool_call>",
         NULL},
        {LOOM_TOOLFMT_QWEN3_CODER,
         "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n<parameter=b>\nfalse\n</"
         "parameter>\n"
         "<parameter=s>\na<b\n</parameter>\n</function>\n</tool_call>",
         NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cJSON *r = cJSON_Parse(tools);
        loom_tools_t t;
        const char *param;
        char msg[256] = "";
        REQUIRE(loom_tools_parse(r, cases[i].f, &t, &param, msg, sizeof msg) == 0 && t.schema);
        loom_grammar_t *g = NULL;
        loom_err_t err = {0};
        REQUIRE(loom_grammar_compile(LOOM_GRAMMAR_TOOL_CALLS, t.schema, strlen(t.schema), &g,
                                     &err) == LOOM_OK);
        int m = loom_grammar_check(g, cases[i].text, strlen(cases[i].text)) == LOOM_GRAMMAR_MATCH;
        CHECKF(m == (cases[i].args != NULL), "case %zu: match %d: %s", i, m, cases[i].text);
        if (cases[i].args) {
            char *rest = NULL;
            cJSON *c = loom_tools_parse_output(&t, cases[i].text, strlen(cases[i].text), 3, &rest);
            cJSON *fn = cJSON_GetObjectItem(cJSON_GetArrayItem(c, 0), "function");
            CHECKF(fn &&
                       !strcmp(cJSON_GetObjectItem(fn, "arguments")->valuestring, cases[i].args) &&
                       !rest,
                   "case %zu: arguments %s", i,
                   fn ? cJSON_GetObjectItem(fn, "arguments")->valuestring : "(none)");
            cJSON_Delete(c);
            free(rest);
        }
        loom_grammar_destroy(&g);
        loom_tools_free(&t);
        cJSON_Delete(r);
    }
    /* two tools' schemas with the same $ref names: each resolves in its own */
    cJSON *two = cJSON_Parse(
        "{\"tool_choice\": \"required\", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
        "\"parameters\": {\"$defs\": {\"c\": {\"type\": \"string\"}}, \"type\": \"object\", \"properties\": "
        "{\"a\": {\"$ref\": \"#/$defs/c\"}}, \"required\": [\"a\"]}}}, {\"type\": \"function\", \"function\": "
        "{\"name\": \"g\", \"parameters\": {\"$defs\": {\"c\": {\"type\": \"integer\"}}, \"type\": \"object\", "
        "\"properties\": {\"a\": {\"$ref\": \"#/$defs/c\"}}, \"required\": [\"a\"]}}}]}");
    for (loom_toolfmt_t f = LOOM_TOOLFMT_HERMES; f <= LOOM_TOOLFMT_PYTHONIC; f += LOOM_TOOLFMT_PYTHONIC - 1) {
        loom_tools_t t;
        const char *param;
        char msg[256] = "";
        REQUIRE(loom_tools_parse(two, f, &t, &param, msg, sizeof msg) == 0 && t.schema);
        loom_grammar_t *g = NULL;
        loom_err_t err = {0};
        REQUIRE(loom_grammar_compile(LOOM_GRAMMAR_TOOL_CALLS, t.schema, strlen(t.schema), &g, &err) == LOOM_OK);
        const char *ok = f == LOOM_TOOLFMT_HERMES
                             ? "<tool_call>\n{\"name\": \"g\", \"arguments\": {\"a\": 1}}\n</tool_call>"
                             : "[f(a=\"s\"), g(a=1)]";
        const char *no = f == LOOM_TOOLFMT_HERMES
                             ? "<tool_call>\n{\"name\": \"g\", \"arguments\": {\"a\": \"s\"}}\n</tool_call>"
                             : "[g(a=\"s\")]";
        CHECKF(loom_grammar_check(g, ok, strlen(ok)) == LOOM_GRAMMAR_MATCH, "%s", ok);
        CHECKF(loom_grammar_check(g, no, strlen(no)) != LOOM_GRAMMAR_MATCH, "%s", no);
        loom_grammar_destroy(&g);
        loom_tools_free(&t);
    }
    cJSON_Delete(two);
    /* what a syntax cannot write is a clear error */
    static const struct {
        loom_toolfmt_t f;
        const char *params, *want;
    } bad[] = {
        {LOOM_TOOLFMT_PYTHONIC,
         "{\"type\": \"object\", \"properties\": {\"a-b\": {\"type\": \"string\"}}}",
         "not a Python identifier"},
        {LOOM_TOOLFMT_QWEN3_CODER,
         "{\"type\": \"object\", \"properties\": {\"a\": {\"enum\": [1, 2]}}}", "needs one 'type'"},
        {LOOM_TOOLFMT_PYTHONIC, "{\"type\": \"array\"}", "object schema"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char body[512];
        snprintf(
            body, sizeof body,
            "{\"tool_choice\": \"required\", \"tools\": [{\"type\": \"function\", \"function\": "
            "{\"name\": \"f\", \"parameters\": %s}}]}",
            bad[i].params);
        cJSON *r = cJSON_Parse(body);
        loom_tools_t t;
        const char *param;
        char msg[256] = "";
        REQUIRE(loom_tools_parse(r, bad[i].f, &t, &param, msg, sizeof msg) == 0 && t.schema);
        loom_grammar_t *g = NULL;
        loom_err_t err = {0};
        CHECKF(loom_grammar_compile(LOOM_GRAMMAR_TOOL_CALLS, t.schema, strlen(t.schema), &g, &err) <
                       0 &&
                   strstr(err.msg, bad[i].want),
               "bad %zu: %s", i, err.msg);
        loom_grammar_destroy(&g);
        loom_tools_free(&t);
        cJSON_Delete(r);
    }
}

/* With a tokenizer that has [TOOL_CALLS] as a special token and <tool_call>
 * as an added ordinary one (stories260K's plus those): a forced call's
 * grammar names each marker's id, so the matcher allows exactly that id
 * first; the special one is kept in the text. */
static void test_special_marker(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/stories260K/tokenizer.json", test_models_dir());
    char *text = NULL;
    size_t len = 0;
    loom_err_t err = {0};
    REQUIRE(loom_read_file(path, &text, &len, &err) == LOOM_OK);
    cJSON *doc = cJSON_ParseWithLength(text, len);
    free(text);
    REQUIRE(doc);
    cJSON *added = cJSON_GetObjectItem(doc, "added_tokens"), *tk = cJSON_CreateObject();
    cJSON_AddNumberToObject(tk, "id", 512);
    cJSON_AddStringToObject(tk, "content", "[TOOL_CALLS]");
    cJSON_AddBoolToObject(tk, "special", 1);
    cJSON_AddItemToArray(added, tk);
    tk = cJSON_CreateObject();
    cJSON_AddNumberToObject(tk, "id", 513);
    cJSON_AddStringToObject(tk, "content", "<tool_call>");
    cJSON_AddBoolToObject(tk, "special", 0);
    cJSON_AddItemToArray(added, tk);
    char *json = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);
    loom_tokenizer_t *tok = NULL;
    REQUIRE(loom_tokenizer_load_json(json, strlen(json), NULL, 0, &tok, &err) == LOOM_OK);
    free(json);
    static const struct {
        loom_toolfmt_t f;
        int keeps;
        int32_t first;
        const char *spec, *out;
    } fmts[] = {{LOOM_TOOLFMT_MISTRAL, 1, 512, "\"special_tokens\":{\"[TOOL_CALLS]\":512}",
                 "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}]"},
                {LOOM_TOOLFMT_HERMES, 0, 513, "\"special_tokens\":{\"<tool_call>\":513}",
                 "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"},
                {LOOM_TOOLFMT_LLAMA3_JSON, 0, -1, NULL, "{\"name\": \"now\", \"parameters\": {}}"}};
    for (size_t k = 0; k < sizeof fmts / sizeof fmts[0]; k++) {
        cJSON *r = req(", \"tool_choice\": \"required\"");
        loom_tools_t t;
        const char *param;
        char msg[256];
        REQUIRE(loom_tools_parse(r, fmts[k].f, &t, &param, msg, sizeof msg) == 0);
        loom_tools_set_tokenizer(&t, tok);
        CHECKF(t.n_keep == fmts[k].keeps && (!t.n_keep || t.keep_ids[0] == 512), "%s: %d kept",
               loom_toolfmt_name(fmts[k].f), t.n_keep);
        CHECKF(fmts[k].spec ? strstr(t.schema, fmts[k].spec) != NULL : !strstr(t.schema, "special_tokens"), "%s",
               t.schema);
        if (fmts[k].first >= 0) {
            loom_grammar_t *g = NULL;
            loom_grammar_vocab_t *v = NULL;
            loom_grammar_matcher_t *m = NULL;
            REQUIRE(loom_grammar_compile(LOOM_GRAMMAR_TOOL_CALLS, t.schema, strlen(t.schema), &g,
                                         &err) == LOOM_OK);
            REQUIRE(loom_grammar_vocab_create(tok, &v, &err) == LOOM_OK);
            REQUIRE(loom_grammar_matcher_create(g, v, &m, &err) == LOOM_OK);
            uint32_t *mask = calloc(loom_grammar_mask_words(v), sizeof *mask);
            loom_grammar_matcher_fill_mask(m, mask);
            int n_set = 0;
            for (size_t w = 0; w < loom_grammar_mask_words(v); w++)
                n_set += __builtin_popcount(mask[w]);
            int32_t first = fmts[k].first;
            CHECKF(n_set == 1 && (mask[first / 32] >> (first % 32) & 1), "%d tokens allowed first", n_set);
            CHECK(loom_grammar_matcher_accept_token(m, first) == LOOM_OK);
            free(mask);
            /* the text the coordinator sends (the marker kept) parses back */
            const char *out = fmts[k].out;
            CHECK(loom_grammar_check(g, out, strlen(out)) == LOOM_GRAMMAR_MATCH);
            char *rest = NULL;
            cJSON *c = loom_tools_parse_output(&t, out, strlen(out), 3, &rest);
            CHECK(one_call(c, "now", "{}") && !rest);
            cJSON_Delete(c);
            free(rest);
            loom_grammar_matcher_destroy(&m);
            loom_grammar_vocab_destroy(&v);
            loom_grammar_destroy(&g);
        }
        loom_tools_free(&t);
        cJSON_Delete(r);
    }
    loom_tokenizer_destroy(&tok);
}

int main(void) {
    RUN(test_parse_request);
    RUN(test_parse_output);
    RUN(test_names);
    RUN(test_forced_grammar);
    RUN(test_forced_typed);
    RUN(test_special_marker);
    return test_summary();
}
