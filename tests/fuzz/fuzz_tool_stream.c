/* Fuzz target: the streaming tool-call reader (gateway/tool_stream.h)
 * on model output, which nobody controls. The first byte picks the chat
 * family and tool_choice (auto, required, named; parallel calls or not),
 * the second seeds where the text is cut into pieces; the rest is the
 * answer. Fed whole and fed in those pieces, the reader must give the same
 * verdict, the same content and the same calls (names, arguments), with
 * call indexes in order and arguments growing only on the latest call. */
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "gateway/tool_stream.h"
#include "tests/fuzz/fuzz.h"

#define MAX_CALLS 8

typedef struct {
    loom_sbuf_t content, calls; /* calls: "index name\n" + arguments + "\n" per call */
    int n, bad;
} got_t;

static void on_event(void *ctx, const loom_tse_t *e) {
    got_t *g = ctx;
    char head[96];
    switch (e->kind) {
    case LOOM_TSE_CONTENT:
        loom_sbuf_add(&g->content, e->text, e->len);
        break;
    case LOOM_TSE_CALL:
        if (e->index != g->n) g->bad = 1;
        g->n++;
        snprintf(head, sizeof head, "\n%d %.64s\n", e->index, e->name);
        loom_sbuf_add(&g->calls, head, strlen(head));
        break;
    case LOOM_TSE_ARGS:
        if (e->index != g->n - 1) g->bad = 1;
        loom_sbuf_add(&g->calls, e->text, e->len);
        break;
    }
}

static int run(const loom_tools_t *t, const char *text, size_t len, unsigned seed,
               got_t *g) {
    memset(g, 0, sizeof *g);
    loom_sbuf_add(&g->content, "", 0);
    loom_sbuf_add(&g->calls, "", 0);
    loom_tstream_t *s = loom_tstream_create(t, on_event, g);
    for (size_t at = 0; at < len;) {
        size_t n = seed ? 1 + (seed = seed * 1103515245u + 12345u) % 9 : len - at;
        if (n > len - at) n = len - at;
        loom_tstream_feed(s, text + at, n);
        at += n;
    }
    int v = loom_tstream_finish(s, 1);
    loom_tstream_destroy(&s);
    return v;
}

static int same(const loom_sbuf_t *a, const loom_sbuf_t *b) {
    return a->len == b->len && !memcmp(a->p, b->p, a->len);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    static const char *choices[] = {
        "", ", \"tool_choice\": \"required\"",
        ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}"};
    static const loom_toolfmt_t fams[] = {LOOM_TOOLFMT_HERMES,      LOOM_TOOLFMT_LLAMA3_JSON,  LOOM_TOOLFMT_MISTRAL,
                                          LOOM_TOOLFMT_GRANITE,     LOOM_TOOLFMT_DEEPSEEK_V3, LOOM_TOOLFMT_DEEPSEEK_V31,
                                          LOOM_TOOLFMT_PYTHONIC, LOOM_TOOLFMT_LLAMA4_PYTHONIC,
                                          LOOM_TOOLFMT_QWEN3_CODER, LOOM_TOOLFMT_OPENAI};
    loom_toolfmt_t fam = fams[(data[0] + data[1]) % 10];
    char req[768];
    snprintf(req, sizeof req,
             "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
             "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}, {\"type\": "
             "\"function\", \"function\": {\"name\": \"now\", \"parameters\": {\"type\": \"object\"}}}]%s%s}",
             fam >= LOOM_TOOLFMT_PYTHONIC && fam <= LOOM_TOOLFMT_QWEN3_CODER ? "" : choices[(data[0] / 3) % 3], /* (pythonic, qwen3_coder: not forced) */
             (data[0] / 9) & 1 ? ", \"parallel_tool_calls\": false" : "");
    cJSON *o = cJSON_Parse(req);
    loom_tools_t t;
    const char *param = NULL;
    char msg[256];
    if (!o || loom_tools_parse(o, fam, &t, &param, msg, sizeof msg) < 0) __builtin_trap(); /* the request is ours */
    const char *text = (const char *)data + 2;
    size_t len = size - 2;
    got_t whole, cut;
    int v1 = run(&t, text, len, 0, &whole);
    int v2 = run(&t, text, len, 1u + data[1], &cut);
    if (v1 != v2 || whole.bad || cut.bad || whole.n != cut.n || !same(&whole.content, &cut.content) ||
        !same(&whole.calls, &cut.calls))
        __builtin_trap();
    if (v1 > 0 && v1 != whole.n) __builtin_trap(); /* the verdict counts the calls that started */
    free(whole.content.p), free(whole.calls.p), free(cut.content.p), free(cut.calls.p);
    loom_tools_free(&t);
    cJSON_Delete(o);
    return 0;
}
