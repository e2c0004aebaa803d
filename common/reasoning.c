/* Reasoning splitters (reasoning.h). States:
 *   START   the output's opening is being matched against the start
 *           markers (held while it may still be one); no match: the
 *           parser's default side (deepseek_r1: reasoning, others: content)
 *   REASON  reasoning text, watching for an end marker (a suffix that may
 *           begin one is held)
 *   CONTENT everything goes out as content
 * Invariant: buf holds exactly the text not yet sent to either side. */
#include "common/reasoning.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    loom_reasoning_t r;
    const char *name;
    const char *starts[3]; /* NULL-terminated */
    const char *ends[4];
    int default_reason; /* no start marker: the output is reasoning */
    const char *guide_after; /* the ends a grammar starts after, '\n' between two (reasoning.h) */
} fmt_t;

static const fmt_t k_fmts[] = {
    {LOOM_REASONING_DEEPSEEK_R1, "deepseek_r1", {"<think>", NULL}, {"</think>", NULL}, 1, "</think>"},
    {LOOM_REASONING_QWEN3, "qwen3", {"<think>", NULL}, {"</think>", NULL}, 0, "</think>"},
    /* Granite 3.2+ writes "Here is"; vLLM's granite parser takes "Here's" as
       well (seen from quantized instances), and so does the grammar */
    {LOOM_REASONING_GRANITE,
     "granite",
     {"Here is my thought process:", "Here's my thought process:", NULL},
     {"Here is my response:", "Here's my response:", NULL},
     0,
     "Here is my response:\nHere's my response:"},
    {LOOM_REASONING_OPENAI,
     "openai",
     {"<|channel|>analysis<|message|>", NULL},
     {"<|end|><|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>",
      "<|end|>", NULL}, /* (bare <|end|>: another message follows, a tool call's) */
     0,
     /* the final channel's header, with or without an analysis message before it */
     "<|channel|>final<|message|>"},
};

enum { S_START, S_REASON, S_CONTENT };

struct loom_rsplit {
    const fmt_t *f;
    int state;
    loom_sbuf_t buf;
};

static const fmt_t *fmt_of(loom_reasoning_t r) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_fmts); i++)
        if (k_fmts[i].r == r) return &k_fmts[i];
    return NULL;
}

const char *loom_reasoning_name(loom_reasoning_t r) {
    const fmt_t *f = fmt_of(r);
    return f ? f->name : "none";
}

loom_reasoning_t loom_reasoning_from_name(const char *name) {
    for (size_t i = 0; name && i < LOOM_ARRAY_LEN(k_fmts); i++)
        if (!strcmp(k_fmts[i].name, name)) return k_fmts[i].r;
    return LOOM_REASONING_NONE;
}

const char *loom_reasoning_end_marker(loom_reasoning_t r) {
    const fmt_t *f = fmt_of(r);
    return f ? f->guide_after : NULL;
}

const char *const *loom_reasoning_token_markers(loom_reasoning_t r) {
    static const char *const none[] = {NULL};
    static const char *const harmony[] = {"<|channel|>", "<|message|>", "<|end|>", "<|start|>", NULL};
    return r == LOOM_REASONING_OPENAI ? harmony : none;
}

loom_rsplit_t *loom_rsplit_create(loom_reasoning_t r) {
    const fmt_t *f = fmt_of(r);
    if (!f) return NULL;
    loom_rsplit_t *s = loom_xcalloc(1, sizeof *s);
    s->f = f;
    s->state = S_START;
    loom_sbuf_add(&s->buf, "", 0);
    return s;
}

void loom_rsplit_destroy(loom_rsplit_t **s_p) {
    loom_rsplit_t *s = s_p ? *s_p : NULL;
    if (!s) return;
    free(s->buf.p);
    free(s);
    *s_p = NULL;
}

int loom_rsplit_in_content(const loom_rsplit_t *s) {
    return s->state == S_CONTENT;
}

static void out(loom_sbuf_t *to, loom_rsplit_t *s, size_t n) {
    if (n && to) loom_sbuf_add(to, s->buf.p, n);
    loom_sbuf_consume(&s->buf, n);
}

/* Longest suffix of b[0..n) that is a proper prefix of one of the markers. */
static size_t held_suffix(const char *b, size_t n, const char *const *markers) {
    size_t best = 0;
    for (int k = 0; markers[k]; k++) {
        size_t m = strlen(markers[k]);
        for (size_t l = m - 1 < n ? m - 1 : n; l > best; l--)
            if (!memcmp(b + n - l, markers[k], l)) {
                best = l;
                break;
            }
    }
    return best;
}

static void run(loom_rsplit_t *s, loom_sbuf_t *reasoning, loom_sbuf_t *content, int final) {
    for (;;) {
        const char *b = s->buf.p;
        size_t n = s->buf.len;
        if (s->state == S_START) {
            int maybe = 0;
            for (int k = 0; s->f->starts[k]; k++) {
                size_t m = strlen(s->f->starts[k]);
                if (n >= m && !memcmp(b, s->f->starts[k], m)) {
                    out(NULL, s, m);
                    s->state = S_REASON;
                    maybe = -1;
                    break;
                }
                if (n < m && !memcmp(b, s->f->starts[k], n)) maybe = 1;
            }
            if (maybe < 0) continue;
            if (maybe && !final) return;
            s->state = s->f->default_reason ? S_REASON : S_CONTENT;
            continue;
        }
        if (s->state == S_CONTENT) {
            out(content, s, n);
            return;
        }
        /* S_REASON: the earliest end marker */
        size_t at = n, mlen = 0;
        for (int k = 0; s->f->ends[k]; k++) {
            const char *p = memmem(b, n, s->f->ends[k], strlen(s->f->ends[k]));
            if (p &&
                ((size_t)(p - b) < at || ((size_t)(p - b) == at && strlen(s->f->ends[k]) > mlen))) {
                at = (size_t)(p - b);
                mlen = strlen(s->f->ends[k]);
            }
        }
        if (at < n && !final) { /* a longer marker may still match there: wait */
            int longer = 0;
            for (int k = 0; s->f->ends[k]; k++) {
                size_t m = strlen(s->f->ends[k]);
                longer |= m > n - at && !memcmp(b + at, s->f->ends[k], n - at);
            }
            if (longer) {
                out(reasoning, s, at);
                return;
            }
        }
        if (at < n) {
            out(reasoning, s, at);
            out(NULL, s, mlen);
            s->state = S_CONTENT;
            continue;
        }
        out(reasoning, s, final ? n : n - held_suffix(b, n, s->f->ends));
        return;
    }
}

void loom_rsplit_feed(loom_rsplit_t *s, const char *text, size_t len, loom_sbuf_t *reasoning,
                      loom_sbuf_t *content) {
    loom_sbuf_add(&s->buf, text, len);
    run(s, reasoning, content, 0);
}

void loom_rsplit_finish(loom_rsplit_t *s, loom_sbuf_t *reasoning, loom_sbuf_t *content) {
    run(s, reasoning, content, 1);
}

void loom_reasoning_split(loom_reasoning_t r, const char *text, size_t len, char **reasoning,
                          char **content) {
    *reasoning = *content = NULL;
    loom_rsplit_t *s = loom_rsplit_create(r);
    if (!s) {
        if (len) {
            *content = loom_xmalloc(len + 1);
            memcpy(*content, text, len);
            (*content)[len] = 0;
        }
        return;
    }
    loom_sbuf_t rb = {0}, cb = {0};
    loom_rsplit_feed(s, text, len, &rb, &cb);
    loom_rsplit_finish(s, &rb, &cb);
    loom_rsplit_destroy(&s);
    if (rb.len)
        *reasoning = rb.p;
    else
        free(rb.p);
    if (cb.len)
        *content = cb.p;
    else
        free(cb.p);
}
