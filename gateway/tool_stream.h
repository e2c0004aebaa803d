/* Tool calls read from a chat answer as it is generated: fed the decoded
 * text piece by piece, it says what can go to the client now, content
 * text, a call's start (index and name) and pieces of its arguments' JSON
 * text, and at the end whether the answer was calls after all. The
 * unstreamed parse (loom_tools_parse_output) is this reader fed the whole
 * answer at once, so the two agree by construction.
 *
 * What is a call, per syntax (tool_calls.h), whatever the mode (a forced
 * call is the model's own syntax too):
 *   hermes        <tool_call> ws {call} ws </tool_call> blocks anywhere in
 *                 the text; the text around them is content, less any
 *                 whitespace that runs up to a block or follows one
 *   llama3_json, mistral, granite  at the start (after whitespace, an
 *                 optional <|python_tag|>, [TOOL_CALLS] or <|tool_call|>) a
 *                 JSON array of calls, or one call object (llama3_json:
 *                 several, separated by ';'); text after them is content
 *   deepseek_v3, deepseek_v31, pythonic, llama4_pythonic, qwen3_coder,
 *   openai        the marked syntaxes of tool_parsers.h, read by
 *                 tool_marked.c the same way (a call starts once its name
 *                 is read, its arguments' JSON grows as it comes)
 * A call object has a "name" (the first, a string naming one of the tools)
 * and "arguments" or "parameters" (the first of them, an object); other
 * members are ignored, in any order. Its arguments are the object's JSON
 * text as generated, less the whitespace between tokens (strings and
 * numbers are kept byte for byte). JSON is read strictly (RFC 8259).
 *
 * Events and holding back. Content goes out as soon as it cannot be the
 * start of a call (a suffix that may be "<tool_call>" or whitespace that
 * may precede one is held). A call's text is held until its name is read
 * and found in tools and its arguments object has begun: then the call
 * starts (LOOM_TSE_CALL) and the arguments stream as they grow
 * (LOOM_TSE_ARGS; their concatenation is the call's arguments). If the
 * answer turns out not to be calls (bad JSON, an unknown function, a
 * second call with parallel_tool_calls false, an unclosed block, cut by the
 * budget) everything held goes out as content, and the rest of the text
 * too: loom_tstream_finish says LOOM_TS_TEXT (no call had started: the
 * content is the whole answer, as unstreamed) or LOOM_TS_BROKEN (a call had
 * started; its pieces stay sent, unstreamed the answer is text). */
#ifndef LOOM_TOOL_STREAM_H
#define LOOM_TOOL_STREAM_H

#include <stddef.h>

#include "gateway/tool_calls.h"

typedef enum {
    LOOM_TSE_CONTENT, /* text: content */
    LOOM_TSE_CALL,    /* index, name: a call starts (its arguments so far "") */
    LOOM_TSE_ARGS,    /* index, text: the next piece of the call's arguments */
} loom_tse_kind_t;

typedef struct {
    loom_tse_kind_t kind;
    int index;
    const char *name; /* CALL (valid during the callback) */
    const char *text; /* CONTENT, ARGS: not NUL-terminated */
    size_t len;
} loom_tse_t;

typedef void (*loom_tse_fn)(void *ctx, const loom_tse_t *e);

typedef enum {
    LOOM_TS_BROKEN = -1, /* calls started, but the answer is not calls */
    LOOM_TS_TEXT = 0,    /* no calls: everything went out as content */
    LOOM_TS_CALLS = 1,   /* the calls are complete (loom_tstream_finish: returns their number) */
} loom_ts_verdict_t;

typedef struct loom_tstream loom_tstream_t;

/* t (borrowed, outlives the reader) must not be mode OFF. */
loom_tstream_t *loom_tstream_create(const loom_tools_t *t, loom_tse_fn emit, void *ctx);
void loom_tstream_destroy(loom_tstream_t **self_p);

/* The next piece of the answer (NUL bytes are dropped). */
void loom_tstream_feed(loom_tstream_t *s, const char *text, size_t len);

/* The answer ended: complete when the model stopped on its own (not cut
 * by the budget). Sends what is still held; returns the number of calls
 * (> 0), LOOM_TS_TEXT or LOOM_TS_BROKEN. */
int loom_tstream_finish(loom_tstream_t *s, int complete);

#endif
