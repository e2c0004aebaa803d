/* Tests of the reasoning splitters (common/reasoning.c): hand-written
 * outputs of each parser's format, whole and fed in two pieces split at
 * every byte and one byte at a time, give the same reasoning and content. */
#include <stdlib.h>
#include <string.h>

#include "common/reasoning.h"
#include "tests/test.h"

typedef struct {
    const char *parser, *text, *reasoning, *content; /* NULL: none */
} case_t;

static const case_t k_cases[] = {
    /* deepseek_r1: the template opened <think>; the output starts inside */
    {"deepseek_r1", "Let me think.\nOK.</think>\n\nThe answer is 4.", "Let me think.\nOK.",
     "\n\nThe answer is 4."},
    {"deepseek_r1", "<think>echoed</think>Hi", "echoed", "Hi"},
    {"deepseek_r1", "still thinking </thi", "still thinking </thi", NULL},
    {"deepseek_r1", "</think>", NULL, NULL},
    /* qwen3: <think> at the very start, or no reasoning */
    {"qwen3", "<think>\nhmm\n</think>\n\n{\"a\": 1}", "\nhmm\n", "\n\n{\"a\": 1}"},
    {"qwen3", "Plain answer </think> stays", NULL, "Plain answer </think> stays"},
    {"qwen3", "<thin", NULL, "<thin"},
    {"qwen3", "<think>cut short", "cut short", NULL},
    /* granite */
    {"granite", "Here is my thought process: add them. Here is my response: 4", " add them. ",
     " 4"},
    {"granite", "Here's my thought process:x Here's my response:y", "x ", "y"},
    {"granite", "Here is my thought process:x Here's my response:y", "x ", "y"},
    {"granite", "Here's my thought process: x. Here is my response: y", " x. ", " y"},
    {"granite", "Just 4.", NULL, "Just 4."},
    /* openai (GPT-OSS harmony) */
    {"openai",
     "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Done.",
     "Think.", "Done."},
    {"openai", "Hello", NULL, "Hello"},
    /* a tool call after the analysis: its header stays for the tool-call parser */
    {"openai",
     "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
     "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Oslo\"}",
     "Need weather.",
     "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
     "{\"city\": \"Oslo\"}"},
    {"openai", "<|channel|>analysis<|message|>Hm.<|end|><|start|>assist", "Hm.", "<|start|>assist"},
    {"openai", "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>",
     "Hm.", NULL},
};

static int same(const char *a, const char *want) {
    if (!want) return a == NULL;
    return a && !strcmp(a, want);
}

/* Feeds text cut at the given points; returns reasoning and content (NULL when empty). */
static void fed(loom_reasoning_t r, const char *text, const size_t *cuts, int n, char **reason,
                char **content) {
    loom_rsplit_t *s = loom_rsplit_create(r);
    loom_sbuf_t rb = {0}, cb = {0};
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        loom_rsplit_feed(s, text + at, cuts[i] - at, &rb, &cb);
        at = cuts[i];
    }
    loom_rsplit_finish(s, &rb, &cb);
    loom_rsplit_destroy(&s);
    loom_rsplit_destroy(&s); /* twice is safe */
    *reason = rb.len ? rb.p : (free(rb.p), NULL);
    *content = cb.len ? cb.p : (free(cb.p), NULL);
}

static void test_cases(void) {
    for (size_t c = 0; c < sizeof k_cases / sizeof k_cases[0]; c++) {
        const case_t *k = &k_cases[c];
        loom_reasoning_t r = loom_reasoning_from_name(k->parser);
        REQUIRE(r != LOOM_REASONING_NONE && !strcmp(loom_reasoning_name(r), k->parser));
        size_t len = strlen(k->text);
        char *reason, *content;
        loom_reasoning_split(r, k->text, len, &reason, &content);
        CHECKF(same(reason, k->reasoning) && same(content, k->content), "case %zu whole: [%s] [%s]",
               c, reason ? reason : "(none)", content ? content : "(none)");
        free(reason);
        free(content);
        for (size_t cut = 0; cut <= len; cut++) { /* two pieces */
            size_t cuts[2] = {cut, len};
            fed(r, k->text, cuts, 2, &reason, &content);
            CHECKF(same(reason, k->reasoning) && same(content, k->content),
                   "case %zu cut at %zu: [%s] [%s]", c, cut, reason ? reason : "(none)",
                   content ? content : "(none)");
            free(reason);
            free(content);
        }
        size_t *each = malloc((len + 1) * sizeof *each); /* one byte at a time */
        for (size_t i = 0; i < len; i++)
            each[i] = i + 1;
        fed(r, k->text, each, (int)len, &reason, &content);
        CHECKF(same(reason, k->reasoning) && same(content, k->content), "case %zu bytewise", c);
        free(reason);
        free(content);
        free(each);
    }
}

/* Nothing that may still be a marker goes out early; the rest does. */
static void test_holding(void) {
    loom_rsplit_t *s = loom_rsplit_create(LOOM_REASONING_DEEPSEEK_R1);
    loom_sbuf_t rb = {0}, cb = {0};
    loom_rsplit_feed(s, "abc</th", 7, &rb, &cb);
    CHECK(rb.len == 3 && !memcmp(rb.p, "abc", 3) && cb.len == 0 && !loom_rsplit_in_content(s));
    loom_rsplit_feed(s, "ink>x", 5, &rb, &cb);
    CHECK(rb.len == 3 && cb.len == 1 && cb.p[0] == 'x' && loom_rsplit_in_content(s));
    loom_rsplit_destroy(&s);
    free(rb.p);
    free(cb.p);
    CHECK(loom_rsplit_create(LOOM_REASONING_NONE) == NULL);
    CHECK(loom_reasoning_from_name("deepseek") == LOOM_REASONING_NONE);
    CHECK(!strcmp(loom_reasoning_end_marker(LOOM_REASONING_QWEN3), "</think>"));
}

/* The markers a grammar starts after (loom_reasoning_end_marker, '\n'
 * between the ways it is written) are the splitter's: each ends the
 * reasoning where the splitter ends it. Granite's are both spellings. */
static void test_guide_markers(void) {
    static const struct {
        loom_reasoning_t r;
        const char *open;
        int n_ways;
    } parsers[] = {
        {LOOM_REASONING_DEEPSEEK_R1, "", 1},
        {LOOM_REASONING_QWEN3, "<think>", 1},
        {LOOM_REASONING_GRANITE, "Here is my thought process:", 2},
        {LOOM_REASONING_OPENAI, "<|channel|>analysis<|message|>", 1},
    };
    for (size_t i = 0; i < LOOM_ARRAY_LEN(parsers); i++) {
        const char *all = loom_reasoning_end_marker(parsers[i].r);
        REQUIRE(all && all[0]);
        int ways = 0;
        for (const char *m = all; *m;) {
            size_t n = strcspn(m, "\n");
            CHECKF(n > 0, "%s: an empty marker", loom_reasoning_name(parsers[i].r));
            char text[256];
            snprintf(text, sizeof text, "%sthink%.*sanswer", parsers[i].open, (int)n, m);
            char *reason, *content;
            loom_reasoning_split(parsers[i].r, text, strlen(text), &reason, &content);
            CHECKF(same(reason, "think") && same(content, "answer"), "%s: '%.*s' ends [%s] [%s]",
                   loom_reasoning_name(parsers[i].r), (int)n, m, reason ? reason : "(none)", content ? content : "(none)");
            free(reason);
            free(content);
            ways++;
            m += n + (m[n] == '\n');
        }
        CHECKF(ways == parsers[i].n_ways, "%s: %d ways", loom_reasoning_name(parsers[i].r), ways);
    }
    CHECK(strstr(loom_reasoning_end_marker(LOOM_REASONING_GRANITE), "Here's my response:") != NULL);
    /* GPT-OSS's grammar starts at the final channel whether or not an
       analysis message came first */
    const char *hm = loom_reasoning_end_marker(LOOM_REASONING_OPENAI);
    CHECK(strstr("<|end|><|start|>assistant<|channel|>final<|message|>", hm) != NULL);
    CHECK(strstr("<|channel|>final<|message|>", hm) != NULL);
}

int main(void) {
    RUN(test_cases);
    RUN(test_holding);
    RUN(test_guide_markers);
    return test_summary();
}
