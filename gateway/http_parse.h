/* The HTTP gateway's request parsing without sockets: the strict JSON body
 * reader and the whole parse of a generation request (fields, sampling
 * parameters, messages through the chat template and the tokenizer), as
 * the access handler runs them. For the fuzz targets and unit tests. */
#ifndef LOOM_HTTP_PARSE_H
#define LOOM_HTTP_PARSE_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "common/chat_template.h"
#include "common/tokenizer.h"

/* See http.c. NULL with a message for the client written to msg. */
cJSON *loom_http_parse_json_body(const char *body, size_t len, char *msg, size_t cap);

/* Parses a /v1/completions (chat = 0) or /v1/chat/completions (chat = 1)
 * body as the gateway does before it submits: 0 when it would be
 * submitted, -1 when it would be answered 400 (msg says why). tmpl and tok
 * may be NULL (no template: chat is refused; no tokenizer: chat prompts
 * are not tokenized). special_in_content as --chat-special-tokens-in-content. */
int loom_http_parse_generate(const char *body, size_t len, int chat,
                             const loom_chat_template_t *tmpl, const loom_tokenizer_t *tok,
                             int special_in_content, char *msg, size_t cap);

#endif
