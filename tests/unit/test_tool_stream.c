/* Tests of the streaming tool-call reader (gateway/tool_stream.c):
 * answers of every family and mode, fed whole, a byte at a time, split at
 * every byte boundary and in random token-like pieces, give the same
 * events, and they rebuild what the unstreamed parse
 * (loom_tools_parse_output) returns and what each case expects: content,
 * each call's name and arguments. Also the fallbacks: text that is not
 * calls goes out whole as content; a call that breaks after it started. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "common/reasoning.h"
#include "gateway/tool_parsers.h"
#include "gateway/tool_stream.h"
#include "tests/test.h"

#define MAX_CALLS 4

/* What a run's events add up to. */
typedef struct {
    loom_sbuf_t content;
    int n;
    char names[MAX_CALLS][64];
    loom_sbuf_t args[MAX_CALLS];
    int n_args_events[MAX_CALLS];
    size_t call_at[MAX_CALLS]; /* bytes fed when the call started */
    size_t fed;
    int order_ok;
} got_t;

static void on_event(void *ctx, const loom_tse_t *e) {
    got_t *g = ctx;
    switch (e->kind) {
    case LOOM_TSE_CONTENT:
        if (!e->len) g->order_ok = 0; /* no empty events */
        loom_sbuf_add(&g->content, e->text, e->len);
        break;
    case LOOM_TSE_CALL:
        if (e->index != g->n || g->n == MAX_CALLS) {
            g->order_ok = 0;
            return;
        }
        snprintf(g->names[g->n], sizeof g->names[0], "%s", e->name);
        g->call_at[g->n] = g->fed;
        loom_sbuf_add(&g->args[g->n], "", 0);
        g->n++;
        break;
    case LOOM_TSE_ARGS:
        if (e->index != g->n - 1 || !e->len) { /* only the latest call grows */
            g->order_ok = 0;
            return;
        }
        loom_sbuf_add(&g->args[e->index], e->text, e->len);
        g->n_args_events[e->index]++;
        break;
    }
}

static void got_free(got_t *g) {
    free(g->content.p);
    for (int i = 0; i < MAX_CALLS; i++) free(g->args[i].p);
}

typedef struct {
    loom_toolfmt_t family;
    const char *choice; /* the request's tool_choice and parallel_tool_calls, or "" */
    const char *text;
    int complete;       /* 0: cut by the budget */
    int verdict;        /* LOOM_TS_* (LOOM_TS_CALLS: n calls) */
    const char *content;
    int n;
    const char *names[2], *args[2];
    int held; /* bit i: call i's arguments come before its name (held, then in one piece) */
} case_t;

#define CHATML LOOM_TOOLFMT_HERMES
#define LLAMA3 LOOM_TOOLFMT_LLAMA3_JSON
#define MISTRAL LOOM_TOOLFMT_MISTRAL
#define GRANITE LOOM_TOOLFMT_GRANITE
#define DSV3 LOOM_TOOLFMT_DEEPSEEK_V3
#define DSV31 LOOM_TOOLFMT_DEEPSEEK_V31
#define PYTHONIC LOOM_TOOLFMT_PYTHONIC
#define LLAMA4 LOOM_TOOLFMT_LLAMA4_PYTHONIC
#define CODER LOOM_TOOLFMT_QWEN3_CODER
#define HARMONY LOOM_TOOLFMT_OPENAI
#define DS_B "<｜tool▁calls▁begin｜>"
#define DS_E "<｜tool▁calls▁end｜>"
#define DS_CB "<｜tool▁call▁begin｜>"
#define DS_CE "<｜tool▁call▁end｜>"
#define DS_S "<｜tool▁sep｜>"
#define NAMED ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}"
#define REQUIRED ", \"tool_choice\": \"required\""
#define SINGLE ", \"parallel_tool_calls\": false"

static const case_t k_cases[] = {
    /* chatml (Hermes, Qwen) */
    {CHATML, "", "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     1, 1, "Let me look.", 1, {"get_weather"}, {"{\"city\":\"Paris\"}"}, 0},
    {CHATML, "",
     "<tool_call>{\"arguments\": {\"city\": \"a b\\\"}\", \"n\": [1, 2.5e3, -0.1e-2, true, null]}, \"id\": 3, \"name\": "
     "\"get_weather\"}</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\nDone.",
     1, 2, "Done.", 2, {"get_weather", "now"}, {"{\"city\":\"a b\\\"}\",\"n\":[1,2.5e3,-0.1e-2,true,null]}", "{}"}, 1},
    {CHATML, "",
     "  Hi <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Z\xc3\xbcrich </tool_call> \\u00e9\\n\", "
     "\"o\": {\"x\": [[], {}], \"y\": false}}}</tool_call>  and  more <tool \n",
     1, 1, "  Hi and  more <tool \n", 1, {"get_weather"},
     {"{\"city\":\"Z\xc3\xbcrich </tool_call> \\u00e9\\n\",\"o\":{\"x\":[[],{}],\"y\":false}}"}, 0},
    {CHATML, "", "<tool_call>{\"name\": \"now\", \"parameters\": {\"a\":0}, \"arguments\": {}}</tool_call>", 1, 1, "", 1,
     {"now"}, {"{\"a\":0}"}, 0},
    {CHATML, "", "Once upon a time <tool", 1, LOOM_TS_TEXT, "Once upon a time <tool", 0, {0}, {0}, 0},
    {CHATML, "", "  \n", 1, LOOM_TS_TEXT, "  \n", 0, {0}, {0}, 0},
    {CHATML, "", "Sure <tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>", 1, LOOM_TS_TEXT,
     "Sure <tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>", 0, {0}, {0}, 0},
    {CHATML, "", "<tool_call>{\"name\": \"now\", </tool_call> ok", 1, LOOM_TS_TEXT,
     "<tool_call>{\"name\": \"now\", </tool_call> ok", 0, {0}, {0}, 0},
    {CHATML, "", "<tool_call>{\"name\": \"now\"}</tool_call>", 1, LOOM_TS_TEXT, "<tool_call>{\"name\": \"now\"}</tool_call>",
     0, {0}, {0}, 0},
    {CHATML, "", "<tool_call>{\"name\": \"now\", \"arguments\": [1]}</tool_call>", 1, LOOM_TS_TEXT,
     "<tool_call>{\"name\": \"now\", \"arguments\": [1]}</tool_call>", 0, {0}, {0}, 0},
    /* started, then broken: the pieces stay, the rest goes out as content */
    {CHATML, "", "<tool_call>{\"name\": \"now\", \"arguments\": {\"a\": 01}}</tool_call>", 1, LOOM_TS_BROKEN,
     "1}}</tool_call>", 1, {"now"}, {"{\"a\":0"}, 0},
    {CHATML, "", "<tool_call>{\"name\": \"now\", \"arguments\": {}}", 1, LOOM_TS_BROKEN, "", 1, {"now"}, {"{}"}, 0},
    {CHATML, SINGLE, "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"now\", "
     "\"arguments\": {}}</tool_call>", 1, LOOM_TS_BROKEN, "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>", 1,
     {"now"}, {"{}"}, 0},
    {CHATML, "", "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     0, LOOM_TS_BROKEN, "Let me look.", 1, {"get_weather"}, {"{\"city\":\"Paris\"}"}, 0},
    {CHATML, "", "Let me look.\n<tool_call>\n{\"name\": \"get_weather\"", 0, LOOM_TS_TEXT,
     "Let me look.\n<tool_call>\n{\"name\": \"get_weather\"", 0, {0}, {0}, 0},
    /* llama3 */
    {LLAMA3, "", "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", 1, 1, "", 1, {"get_weather"},
     {"{\"city\":\"Oslo\"}"}, 0},
    {LLAMA3, "", " <|python_tag|>{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": "
     "{\"city\": \"x\"}}\n", 1, 2, "", 2, {"now", "get_weather"}, {"{}", "{\"city\":\"x\"}"}, 0},
    {LLAMA3, "", "{\"name\": \"now\", \"parameters\": {}} and then text", 1, 1, "and then text", 1, {"now"}, {"{}"}, 0},
    {LLAMA3, "", "{I think}", 1, LOOM_TS_TEXT, "{I think}", 0, {0}, {0}, 0},
    {LLAMA3, "", "\n\nThe weather is nice.", 1, LOOM_TS_TEXT, "\n\nThe weather is nice.", 0, {0}, {0}, 0},
    /* mistral */
    {MISTRAL, "", "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}, {\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Rome\"}}]", 1, 2, "", 2, {"now", "get_weather"}, {"{}", "{\"city\":\"Rome\"}"}, 0},
    {MISTRAL, "", "[TOOLS] hi", 1, LOOM_TS_TEXT, "[TOOLS] hi", 0, {0}, {0}, 0},
    {MISTRAL, "", "[TOOL_CALLS] [1]", 1, LOOM_TS_TEXT, "[TOOL_CALLS] [1]", 0, {0}, {0}, 0},
    /* granite */
    {GRANITE, "", "<|tool_call|>[{\"name\": \"now\", \"arguments\": {}}]", 1, 1, "", 1, {"now"}, {"{}"}, 0},
    {GRANITE, "", "<|tool_call|>nope", 1, LOOM_TS_TEXT, "<|tool_call|>nope", 0, {0}, {0}, 0},
    /* the marked syntaxes (tool_parsers.h): a call starts once its name is read, arguments stream as JSON */
    {DSV3, "", "Sure." DS_B DS_CB "function" DS_S "get_weather\n```json\n{\"city\": \"Oslo\"}\n```" DS_CE DS_E, 1, 1,
     "Sure.", 1, {"get_weather"}, {"{\"city\":\"Oslo\"}"}, 0},
    {DSV3, "", DS_B DS_CB "function" DS_S "now\n```json\n{}\n```" DS_CE "\n" DS_CB "function" DS_S
     "get_weather\n```json\n{\"city\": \"a b\"}\n```" DS_CE DS_E " ok", 1, 2, "ok", 2, {"now", "get_weather"},
     {"{}", "{\"city\":\"a b\"}"}, 0},
    {DSV3, "", "x" DS_B DS_CB "function" DS_S "rm\n```json\n{}\n```" DS_CE DS_E, 1, LOOM_TS_TEXT,
     "x" DS_B DS_CB "function" DS_S "rm\n```json\n{}\n```" DS_CE DS_E, 0, {0}, {0}, 0},
    {DSV3, "", "Hi <｜tool▁ca", 1, LOOM_TS_TEXT, "Hi <｜tool▁ca", 0, {0}, {0}, 0},
    {DSV3, "", DS_B DS_CB "function" DS_S "now\n```json\n{}\n```" DS_CE, 1, LOOM_TS_BROKEN, "", 1, {"now"}, {"{}"}, 0},
    {DSV3, "", DS_B DS_CB "function" DS_S "get_weather\n```json\n{\"city\": \"Oslo\"}\n```" DS_CE DS_E, 0,
     LOOM_TS_BROKEN, "", 1, {"get_weather"}, {"{\"city\":\"Oslo\"}"}, 0},
    {DSV31, "", DS_B DS_CB "now" DS_S "{ }" DS_CE DS_E, 1, 1, "", 1, {"now"}, {"{}"}, 0},
    {DSV31, "", "I will call." DS_B DS_CB "get_weather" DS_S "{\"city\": \"Lima\\n\", \"days\": [1, 2]}" DS_CE DS_CB
     "now" DS_S "{}" DS_CE DS_E, 1, 2, "I will call.", 2, {"get_weather", "now"},
     {"{\"city\":\"Lima\\n\",\"days\":[1,2]}", "{}"}, 0},
    {DSV31, "", DS_B DS_CB "now" DS_S "[1]" DS_CE DS_E, 1, LOOM_TS_BROKEN, "[1]" DS_CE DS_E, 1, {"now"}, {""}, 0},
    {DSV31, "", DS_B DS_CB "rm" DS_S "{}" DS_CE DS_E, 1, LOOM_TS_TEXT, DS_B DS_CB "rm" DS_S "{}" DS_CE DS_E, 0, {0},
     {0}, 0},
    {PYTHONIC, "", " [get_weather(city='Oslo', n=[1, -2.5e3, True, None, {'k': \"v\\n\"}]), now()]\n", 1, 2, "", 2,
     {"get_weather", "now"}, {"{\"city\":\"Oslo\",\"n\":[1,-2.5e3,true,null,{\"k\":\"v\\n\"}]}", "{}"}, 0},
    {PYTHONIC, "", "[get_weather(city=\"Zurich \\\"old\\\" town\\\\ \\q\", t=(1, +2.50, 007, .5,), d={\"a\": False, },)]",
     1, 1, "", 1, {"get_weather"},
     {"{\"city\":\"Zurich \\\"old\\\" town\\\\ \\\\q\",\"t\":[1,2.50,7,0.5],\"d\":{\"a\":false}}"}, 0},
    {PYTHONIC, "", "Hello [now()]", 1, LOOM_TS_TEXT, "Hello [now()]", 0, {0}, {0}, 0},
    /* a keyword longer than any function name; a value that is no literal (the pieces before it stay sent) */
    {PYTHONIC, "", "[get_weather(city_of_the_place_whose_weather_the_user_asked_about_in_the_message_above='Oslo')]",
     1, 1, "", 1, {"get_weather"}, {"{\"city_of_the_place_whose_weather_the_user_asked_about_in_the_message_above\":\"Oslo\"}"},
     0},
    {PYTHONIC, "", "[get_weather(city='Oslo', n=functions.None)]", 1, LOOM_TS_BROKEN, ")]", 1, {"get_weather"},
     {"{\"city\":\"Oslo\",\"n\":"}, 0},
    {PYTHONIC, "", "[Note](https://x)", 1, LOOM_TS_TEXT, "[Note](https://x)", 0, {0}, {0}, 0},
    {LLAMA4, "", "<|python_start|>[get_weather(city=\"Rome\")]<|python_end|>", 1, 1, "", 1, {"get_weather"},
     {"{\"city\":\"Rome\"}"}, 0},
    {LLAMA4, "", " [now()]", 1, 1, "", 1, {"now"}, {"{}"}, 0},
    {CODER, "", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
     "<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
     1, 2, "Let me check.\n", 2, {"get_weather", "now"}, {"{\"city\":\"New York\",\"n\":\"5\"}", "{}"}, 0},
    /* typed by the schema: days (integer) and opts (object) read as JSON, a city of two lines with a tab */
    {CODER, "", "<tool_call>\n<function=get_weather>\n<parameter=days>\n 3 \n</parameter>\n<parameter=opts>\n{\"a\": "
     "[1, 2]}\n</parameter>\n<parameter=city>\n\nSao \"Paulo\"\n\tBR\n\n</parameter>\n<parameter=bad>\nx</par\n"
     "</parameter>\n</function>\n</tool_call>\nDone.",
     1, 1, "Done.", 1, {"get_weather"},
     {"{\"days\":3,\"opts\":{\"a\":[1,2]},\"city\":\"\\nSao \\\"Paulo\\\"\\n\\tBR\\n\",\"bad\":\"x</par\"}"}, 0},
    {CODER, "", "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
     1, 1, "", 1, {"get_weather"}, {"{\"days\":\"three\"}"}, 0},
    {CODER, "", "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n</tool_call>", 1,
     LOOM_TS_BROKEN, "</tool_call>", 1, {"get_weather"}, {"{\"city\":\"x\""}, 0},
    {CODER, "", "<tool_call>\n<function=rm>\n</function>\n</tool_call>", 1, LOOM_TS_TEXT,
     "<tool_call>\n<function=rm>\n</function>\n</tool_call>", 0, {0}, {0}, 0},
    {CODER, "", "Use <tool_call> blocks.", 1, LOOM_TS_TEXT, "Use <tool_call> blocks.", 0, {0}, {0}, 0},
    /* openai (GPT-OSS harmony): the recipient after the channel or before it */
    {HARMONY, "", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}"
     "<|call|>", 1, 1, "", 1, {"get_weather"}, {"{\"city\":\"Oslo\"}"}, 0},
    {HARMONY, "", "Checking.<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
     "{\"city\": \"a to=functions.b\"}<|call|><|start|>assistant<|channel|>commentary to=functions.now "
     "<|constrain|>json<|message|>{}", 1, 2, "Checking.", 2, {"get_weather", "now"},
     {"{\"city\":\"a to=functions.b\"}", "{}"}, 0},
    {HARMONY, "", " to=functions.now<|channel|>commentary json<|message|>{}<|call|>"
     "<|start|>assistant<|channel|>final<|message|>Done.", 1, 1, "Done.", 1, {"now"}, {"{}"}, 0},
    {HARMONY, SINGLE, "<|channel|>commentary to=functions.now json<|message|>{}<|call|>"
     "<|channel|>commentary to=functions.now json<|message|>{}<|call|>", 1, LOOM_TS_BROKEN,
     "<|channel|>commentary to=functions.now json<|message|>{}<|call|>", 1, {"now"}, {"{}"}, 0},
    {HARMONY, "", "<|channel|>commentary to=functions.rm json<|message|>{}<|call|>", 1, LOOM_TS_TEXT,
     "<|channel|>commentary to=functions.rm json<|message|>{}<|call|>", 0, {0}, {0}, 0},
    {HARMONY, "", "<|channel|>commentary to=functions.now json<|message|>{\"a\": 1", 1, LOOM_TS_BROKEN, "", 1, {"now"},
     {"{\"a\":1"}, 0},
    {HARMONY, "", "<|channel|>commentary to=functions.now json<|message|>{}", 0, LOOM_TS_BROKEN, "", 1, {"now"}, {"{}"},
     0},
    {HARMONY, "", "Plain <|channel|>comm", 1, LOOM_TS_TEXT, "Plain <|channel|>comm", 0, {0}, {0}, 0},
    {LLAMA4, "", "<|python_sta", 1, LOOM_TS_TEXT, "<|python_sta", 0, {0}, {0}, 0},
    {LLAMA4, "", "<|python_start|>now()", 1, LOOM_TS_TEXT, "<|python_start|>now()", 0, {0}, {0}, 0},
    {PYTHONIC, "", "[get_weather('Oslo')]", 1, LOOM_TS_BROKEN, "'Oslo')]", 1, {"get_weather"}, {"{"}, 0},
    {PYTHONIC, "", "[now()] and more", 1, LOOM_TS_BROKEN, " and more", 1, {"now"}, {"{}"}, 0},
    {PYTHONIC, "", "[now(), rm()]", 1, LOOM_TS_BROKEN, ", rm()]", 1, {"now"}, {"{}"}, 0},
    {PYTHONIC, SINGLE, "[now(), now()]", 1, LOOM_TS_BROKEN, ", now()]", 1, {"now"}, {"{}"}, 0},
    /* required and named: what the grammar forces, in the model's own syntax */
    {CHATML, REQUIRED, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\", \"unit\": \"c\"}}\n</tool_call>",
     1, 1, "", 1, {"get_weather"}, {"{\"city\":\"Lima\",\"unit\":\"c\"}"}, 0},
    {LLAMA3, REQUIRED, "[ {\"name\":\"now\",\"arguments\":{ }} , {\"arguments\":{\"zone\":\"UTC\"},\"name\":\"now\"} ]", 1,
     2, "", 2, {"now", "now"}, {"{}", "{\"zone\":\"UTC\"}"}, 2},
    {CHATML, REQUIRED, "[]", 1, LOOM_TS_TEXT, "[]", 0, {0}, {0}, 0},
    {MISTRAL, REQUIRED SINGLE, "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}, {\"name\": \"now\", \"arguments\": {}}]", 1,
     LOOM_TS_BROKEN, ", {\"name\": \"now\", \"arguments\": {}}]", 1, {"now"}, {"{}"}, 0},
    {CHATML, NAMED, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}\n</tool_call>", 1, 1,
     "", 1, {"get_weather"}, {"{\"city\":\"Lima\"}"}, 0},
    {MISTRAL, NAMED, "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\" : 1.5e-3 , \"u\":\"c\" }}]  ", 1,
     1, "", 1, {"get_weather"},
     {"{\"city\":1.5e-3,\"u\":\"c\"}"}, 0},
    {CHATML, NAMED, "not json", 1, LOOM_TS_TEXT, "not json", 0, {0}, {0}, 0},
};

static const char *k_req =
    "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}, "
    "\"opts\": {\"type\": \"object\"}}}}},"
    "{\"type\": \"function\", \"function\": {\"name\": \"now\"}}]%s}";

/* A marked syntax's answer read whole by loom_tp_parse (the plain
 * reference of tool_parsers.c) gives what the streamed events add up to:
 * the calls, and as content the text before the start marker and after the
 * calls (less the whitespace that follows them). */
static void check_reference(const loom_tools_t *t, const case_t *c, const got_t *g, int v, size_t ci) {
    if (!loom_tp_held(c->family) || !c->complete) return;
    size_t len = strlen(c->text), maybe = 0, end = 0;
    size_t at = loom_tp_find_start(c->family, c->text, len, &maybe);
    loom_tp_call_t *calls = NULL;
    int n = at < len ? loom_tp_parse(c->family, t->tools, c->text + at, len - at, &calls, &end) : -1;
    if (v <= 0) {
        CHECKF(n <= 0 || (!t->parallel && n > 1), "case %zu: not calls streamed, %d whole", ci, n);
    } else {
        CHECKF(n == g->n, "case %zu: %d calls whole, %d streamed", ci, n, g->n);
        for (int i = 0; i < n && i < g->n; i++)
            CHECKF(!strcmp(calls[i].name, g->names[i]) && !strcmp(calls[i].args, g->args[i].p),
                   "case %zu call %d: whole %s(%s), streamed %s(%s)", ci, i, calls[i].name, calls[i].args, g->names[i],
                   g->args[i].p);
        size_t rest = at + end;
        while (rest < len && strchr(" \t\r\n", c->text[rest])) rest++;
        loom_sbuf_t want = {0};
        loom_sbuf_add(&want, c->text, at);
        loom_sbuf_add(&want, c->text + rest, len - rest);
        loom_sbuf_add(&want, "", 0);
        CHECKF(!strcmp(want.p, g->content.p), "case %zu: content whole '%s', streamed '%s'", ci, want.p, g->content.p);
        free(want.p);
    }
    if (n > 0) loom_tp_calls_free(calls, n);
}

/* Feeds text in pieces ending at cuts[0..n) (the last must be strlen). */
static int run_split(const loom_tools_t *t, const case_t *c, const size_t *cuts, int n, got_t *g) {
    memset(g, 0, sizeof *g);
    g->order_ok = 1;
    loom_sbuf_add(&g->content, "", 0);
    loom_tstream_t *s = loom_tstream_create(t, on_event, g);
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        g->fed = cuts[i];
        loom_tstream_feed(s, c->text + at, cuts[i] - at);
        at = cuts[i];
    }
    int v = loom_tstream_finish(s, c->complete);
    loom_tstream_destroy(&s);
    loom_tstream_destroy(&s); /* safe twice */
    return v;
}

static int same(const got_t *a, const got_t *b) {
    if (a->n != b->n || strcmp(a->content.p, b->content.p) != 0) return 0;
    for (int i = 0; i < a->n; i++)
        if (strcmp(a->names[i], b->names[i]) != 0 || strcmp(a->args[i].p, b->args[i].p) != 0) return 0;
    return 1;
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void test_cases(void) {
    for (size_t ci = 0; ci < LOOM_ARRAY_LEN(k_cases); ci++) {
        const case_t *c = &k_cases[ci];
        char buf[1024];
        snprintf(buf, sizeof buf, k_req, c->choice);
        cJSON *r = cJSON_Parse(buf);
        loom_tools_t t;
        const char *param;
        char msg[256];
        REQUIRE(r && loom_tools_parse(r, c->family, &t, &param, msg, sizeof msg) == 0);
        size_t len = strlen(c->text);
        /* whole: against the case and the unstreamed parse */
        got_t whole;
        size_t cut = len;
        int v = run_split(&t, c, &cut, 1, &whole);
        CHECKF(v == c->verdict, "case %zu: verdict %d, expected %d", ci, v, c->verdict);
        CHECKF(whole.order_ok, "case %zu: events out of order", ci);
        CHECKF(!strcmp(whole.content.p, c->content), "case %zu: content '%s', expected '%s'", ci, whole.content.p,
               c->content);
        CHECKF(whole.n == c->n, "case %zu: %d calls, expected %d", ci, whole.n, c->n);
        for (int i = 0; i < whole.n && i < c->n; i++)
            CHECKF(!strcmp(whole.names[i], c->names[i]) && !strcmp(whole.args[i].p, c->args[i]),
                   "case %zu call %d: %s(%s), expected %s(%s)", ci, i, whole.names[i], whole.args[i].p, c->names[i],
                   c->args[i]);
        if (v == LOOM_TS_TEXT) CHECKF(!strcmp(whole.content.p, c->text), "case %zu: text not kept whole", ci);
        check_reference(&t, c, &whole, v, ci);
        if (c->complete) {
            char *rest = NULL;
            cJSON *calls = loom_tools_parse_output(&t, c->text, len, 9, &rest);
            CHECKF((calls != NULL) == (v > 0), "case %zu: unstreamed parse disagrees on calls", ci);
            if (calls && v > 0) {
                CHECKF(cJSON_GetArraySize(calls) == whole.n, "case %zu: unstreamed call count", ci);
                CHECKF(!strcmp(rest ? rest : "", whole.content.p), "case %zu: unstreamed content '%s'", ci, rest);
                for (int i = 0; i < whole.n; i++) {
                    const cJSON *call = cJSON_GetArrayItem(calls, i);
                    const cJSON *fn = cJSON_GetObjectItem(call, "function");
                    char id[48];
                    loom_tools_call_id(9, i, id, sizeof id);
                    CHECKF(!strcmp(cJSON_GetObjectItem(call, "id")->valuestring, id), "case %zu: id", ci);
                    CHECKF(!strcmp(cJSON_GetObjectItem(fn, "name")->valuestring, whole.names[i]) &&
                               !strcmp(cJSON_GetObjectItem(fn, "arguments")->valuestring, whole.args[i].p),
                           "case %zu call %d: unstreamed differs", ci, i);
                    cJSON *parsed = cJSON_Parse(whole.args[i].p); /* the arguments are JSON */
                    CHECKF(cJSON_IsObject(parsed), "case %zu call %d: arguments not an object", ci, i);
                    cJSON_Delete(parsed);
                }
            }
            cJSON_Delete(calls);
            free(rest);
        }
        /* a byte at a time: the same events; arguments in many pieces */
        size_t *cuts = loom_xmalloc((len + 1) * sizeof *cuts);
        for (size_t i = 0; i < len; i++) cuts[i] = i + 1;
        got_t g;
        int vb = run_split(&t, c, cuts, (int)len, &g);
        CHECKF(vb == v && same(&g, &whole) && g.order_ok, "case %zu: byte by byte differs", ci);
        for (int i = 0; i < g.n && v > 0; i++) {
            size_t a = strlen(g.args[i].p);
            CHECKF(a < 3 || (c->held >> i & 1) || g.n_args_events[i] >= 2, "case %zu call %d: arguments in %d piece(s)",
                   ci, i,
                   g.n_args_events[i]);
            CHECKF(g.call_at[i] < len, "case %zu call %d: started only at the end", ci, i);
        }
        got_free(&g);
        /* every boundary, two pieces */
        for (size_t k = 0; k <= len; k++) {
            size_t two[2] = {k, len};
            int vk = run_split(&t, c, two, 2, &g);
            CHECKF(vk == v && same(&g, &whole) && g.order_ok, "case %zu: split at %zu differs: %d %d calls [%s] %s(%s)", ci, k, vk, g.n, g.content.p, g.n ? g.names[0] : "", g.n ? g.args[0].p : "");
            got_free(&g);
        }
        /* token-like random pieces of 1 to 8 bytes */
        uint64_t seed = 0x9e3779b97f4a7c15ull + ci;
        for (int trial = 0; trial < 200; trial++) {
            int n = 0;
            for (size_t at = 0; at < len;) {
                size_t step = 1 + rng_next(&seed) % 8;
                at = LOOM_MIN(len, at + step);
                cuts[n++] = at;
            }
            int vr = run_split(&t, c, cuts, n, &g);
            CHECKF(vr == v && same(&g, &whole) && g.order_ok, "case %zu: random split %d: verdict %d, %d calls, '%s'", ci,
                   trial, vr, g.n, g.content.p);
            got_free(&g);
        }
        free(cuts);
        got_free(&whole);
        loom_tools_free(&t);
        cJSON_Delete(r);
    }
}

/* Content before a call goes out while the call is still being written;
 * only the possible start of "<tool_call>" is held. */
static void test_holds_little(void) {
    char buf[1024];
    snprintf(buf, sizeof buf, k_req, "");
    cJSON *r = cJSON_Parse(buf);
    loom_tools_t t;
    const char *param;
    char msg[256];
    REQUIRE(loom_tools_parse(r, CHATML, &t, &param, msg, sizeof msg) == 0);
    got_t g = {.order_ok = 1};
    loom_tstream_t *s = loom_tstream_create(&t, on_event, &g);
    loom_tstream_feed(s, "Hello there <tool", 17);
    CHECK(!strcmp(g.content.p, "Hello there"));
    loom_tstream_feed(s, "_call>{\"name\": \"now\"", 20);
    CHECK(g.n == 0); /* not before its arguments begin */
    loom_tstream_feed(s, ", \"arguments\": {\"a\"", 19);
    CHECK(g.n == 1 && !strcmp(g.args[0].p, "{\"a\""));
    loom_tstream_feed(s, ": 1}}</tool_call>", 17);
    CHECK(!strcmp(g.args[0].p, "{\"a\":1}"));
    CHECK(loom_tstream_finish(s, 1) == 1 && !strcmp(g.content.p, "Hello there"));
    loom_tstream_destroy(&s);
    got_free(&g);
    loom_tools_free(&t);
    cJSON_Delete(r);
}

/* GPT-OSS with both openai parsers: the reasoning splitter's content feeds
 * the tool-call reader (as the gateway chains them), cut at every byte:
 * analysis text is reasoning, a call after it a call, a final message
 * content. */
static void test_harmony_with_reasoning(void) {
    static const struct {
        const char *text, *reasoning, *content;
        int verdict;
    } cases[] = {
        {"<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
         "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>",
         "Need weather.", "", 1},
        {"<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
         "Easy.", "It is 4.", LOOM_TS_TEXT},
    };
    char buf[1024];
    snprintf(buf, sizeof buf, k_req, "");
    cJSON *r = cJSON_Parse(buf);
    loom_tools_t t;
    const char *param;
    char msg[256];
    REQUIRE(r && loom_tools_parse(r, HARMONY, &t, &param, msg, sizeof msg) == 0);
    for (size_t ci = 0; ci < LOOM_ARRAY_LEN(cases); ci++) {
        size_t len = strlen(cases[ci].text);
        for (size_t k = 0; k <= len; k++) {
            loom_rsplit_t *rs = loom_rsplit_create(LOOM_REASONING_OPENAI);
            got_t g = {0};
            g.order_ok = 1;
            loom_sbuf_add(&g.content, "", 0);
            loom_tstream_t *ts = loom_tstream_create(&t, on_event, &g);
            loom_sbuf_t rb = {0};
            loom_sbuf_add(&rb, "", 0);
            size_t cuts[3] = {0, k, len};
            for (int p = 0; p < 3; p++) {
                loom_sbuf_t cb = {0};
                if (p < 2)
                    loom_rsplit_feed(rs, cases[ci].text + cuts[p], cuts[p + 1] - cuts[p], &rb, &cb);
                else
                    loom_rsplit_finish(rs, &rb, &cb);
                if (cb.len) loom_tstream_feed(ts, cb.p, cb.len);
                free(cb.p);
            }
            int v = loom_tstream_finish(ts, 1);
            CHECKF(v == cases[ci].verdict && !strcmp(rb.p, cases[ci].reasoning) &&
                       !strcmp(g.content.p, cases[ci].content) && g.order_ok,
                   "case %zu split at %zu: verdict %d, reasoning '%s', content '%s'", ci, k, v, rb.p, g.content.p);
            if (v == 1)
                CHECKF(!strcmp(g.names[0], "get_weather") && !strcmp(g.args[0].p, "{\"city\":\"Oslo\"}"),
                       "case %zu split at %zu: call %s(%s)", ci, k, g.names[0], g.args[0].p);
            free(rb.p);
            got_free(&g);
            loom_tstream_destroy(&ts);
            loom_rsplit_destroy(&rs);
        }
    }
    loom_tools_free(&t);
    cJSON_Delete(r);
}

/* The marked syntaxes stream as the JSON ones do: fed a byte at a time,
 * the call starts when its name has been read (by the end of name_end in
 * the text, long before the answer ends), and a long argument goes out in
 * many pieces while it is generated, not at the end. */
static void test_marked_early(void) {
    static const struct {
        loom_toolfmt_t f;
        const char *text, *name_end, *args;
    } cases[] = {
        {DSV3, "Sure." DS_B DS_CB "function" DS_S "get_weather\n```json\n{\"city\": \"Oslo, the capital of Norway\"}\n```"
         DS_CE DS_E, "get_weather\n", "{\"city\":\"Oslo, the capital of Norway\"}"},
        {DSV31, DS_B DS_CB "get_weather" DS_S "{\"city\": \"Oslo, the capital of Norway\"}" DS_CE DS_E,
         "get_weather" DS_S, "{\"city\":\"Oslo, the capital of Norway\"}"},
        {PYTHONIC, "[get_weather(city='Oslo, the capital of Norway')]", "get_weather(",
         "{\"city\":\"Oslo, the capital of Norway\"}"},
        {LLAMA4, "<|python_start|>[get_weather(city='Oslo, the capital of Norway')]<|python_end|>", "get_weather(",
         "{\"city\":\"Oslo, the capital of Norway\"}"},
        {CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo, the capital of Norway\n</parameter>\n"
         "</function>\n</tool_call>", "<function=get_weather>", "{\"city\":\"Oslo, the capital of Norway\"}"},
        {HARMONY, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo, the "
         "capital of Norway\"}<|call|>", "<|message|>", "{\"city\":\"Oslo, the capital of Norway\"}"},
    };
    char buf[1024];
    snprintf(buf, sizeof buf, k_req, "");
    cJSON *r = cJSON_Parse(buf);
    for (size_t ci = 0; ci < LOOM_ARRAY_LEN(cases); ci++) {
        loom_tools_t t;
        const char *param;
        char msg[256];
        REQUIRE(r && loom_tools_parse(r, cases[ci].f, &t, &param, msg, sizeof msg) == 0);
        const char *text = cases[ci].text;
        size_t len = strlen(text), name_end = (size_t)(strstr(text, cases[ci].name_end) - text) + strlen(cases[ci].name_end);
        size_t args_end = (size_t)(strstr(text, "Norway") - text) + strlen("Norway");
        got_t g = {.order_ok = 1};
        loom_sbuf_add(&g.content, "", 0);
        loom_tstream_t *s = loom_tstream_create(&t, on_event, &g);
        int pieces_by_args_end = 0;
        for (size_t i = 0; i < len; i++) {
            g.fed = i + 1;
            loom_tstream_feed(s, text + i, 1);
            if (i + 1 == args_end) pieces_by_args_end = g.n_args_events[0];
        }
        int v = loom_tstream_finish(s, 1);
        CHECKF(v == 1 && g.n == 1 && g.order_ok && !strcmp(g.names[0], "get_weather") &&
                   !strcmp(g.args[0].p, cases[ci].args),
               "case %zu: verdict %d, %d calls, %s", ci, v, g.n, g.n ? g.args[0].p : "");
        CHECKF(g.call_at[0] <= name_end, "case %zu: the call started at byte %zu, its name was read at %zu", ci,
               g.call_at[0], name_end);
        CHECKF(pieces_by_args_end >= 20, "case %zu: %d argument pieces before the argument ended", ci,
               pieces_by_args_end);
        loom_tstream_destroy(&s);
        got_free(&g);
        loom_tools_free(&t);
    }
    cJSON_Delete(r);
}

int main(void) {
    RUN(test_cases);
    RUN(test_holds_little);
    RUN(test_marked_early);
    RUN(test_harmony_with_reasoning);
    return test_summary();
}
