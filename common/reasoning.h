/* Reasoning models: their output split into the reasoning and the answer,
 * as vLLM's --reasoning-parser does (message.reasoning_content and
 * content; delta.reasoning_content when streamed).
 *
 *   deepseek_r1  the output starts inside the reasoning (the template opened
 *                <think>; an echoed <think> is dropped) up to </think>;
 *                with no </think> it is all reasoning
 *   qwen3        <think>reasoning</think> at the very start; output that
 *                does not start so is all content
 *   granite      "Here is my thought process:" reasoning "Here is my
 *                response:" answer (also "Here's ...")
 *   openai       GPT-OSS harmony text: <|channel|>analysis<|message|>
 *                reasoning <|end|>, then the final channel's message (its
 *                header dropped) or another message (a tool call, headers
 *                kept for the tool-call parser)
 *
 * A splitter is fed the decoded text piece by piece and says what may go
 * out now on each side; text that may still be part of a marker is held.
 * Used by the chat gateway and the Responses API alike. */
#ifndef LOOM_REASONING_H
#define LOOM_REASONING_H

#include <stddef.h>

#include "common/util.h"

typedef enum {
    LOOM_REASONING_NONE = 0,
    LOOM_REASONING_DEEPSEEK_R1,
    LOOM_REASONING_QWEN3,
    LOOM_REASONING_GRANITE,
    LOOM_REASONING_OPENAI,
} loom_reasoning_t;

#define LOOM_REASONING_PARSER_NAMES "deepseek_r1, qwen3, granite, openai"

const char *loom_reasoning_name(loom_reasoning_t r);
/* The parser named NAME (vLLM's names); LOOM_REASONING_NONE when unknown. */
loom_reasoning_t loom_reasoning_from_name(const char *name);
/* The marker after which the answer starts ("</think>", ...): where a
 * grammar's constraint begins (GenerateRequest.guide_after). Where the
 * model writes it in more than one way, the ways separated by '\n' (no
 * marker has one): granite's "Here is my response:\nHere's my response:". */
const char *loom_reasoning_end_marker(loom_reasoning_t r);
/* The parser's markers that are single tokens the model's tokenizer may
 * hold as special ones (harmony's <|channel|>, ...): the text the parser
 * reads must keep them (GenerateRequest.keep_special_ids). NULL-terminated;
 * empty for parsers whose markers are ordinary text. */
const char *const *loom_reasoning_token_markers(loom_reasoning_t r);

typedef struct loom_rsplit loom_rsplit_t;
loom_rsplit_t *loom_rsplit_create(loom_reasoning_t r);
void loom_rsplit_destroy(loom_rsplit_t **s_p);
/* The next piece: appends to *reasoning and *content (either may get
 * nothing) what is decided. */
void loom_rsplit_feed(loom_rsplit_t *s, const char *text, size_t len, loom_sbuf_t *reasoning,
                      loom_sbuf_t *content);
/* The end: what is still held goes out. */
void loom_rsplit_finish(loom_rsplit_t *s, loom_sbuf_t *reasoning, loom_sbuf_t *content);
/* 1 once the answer (content) has begun. */
int loom_rsplit_in_content(const loom_rsplit_t *s);

/* The whole output at once: malloc'ed reasoning (NULL: none) and content
 * (NULL: none). */
void loom_reasoning_split(loom_reasoning_t r, const char *text, size_t len, char **reasoning,
                          char **content);

#endif
