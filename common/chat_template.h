/* Chat templates: the model's own Jinja template turns a chat request into
 * the one prompt string the model was trained on, as vLLM renders it.
 *
 * Where the template comes from (first found): --chat-template (a file, a
 * template text, or a name Loom ships: LOOM_CHAT_SHIPPED_NAMES, the text of
 * docs/templates/NAME.jinja), tokenizer_config.json's "chat_template" (a
 * string, or a list of {name, template}: "default", and "tool_use" when the
 * request has tools), the file chat_template.jinja in the model directory.
 * Every template is compiled once at start-up (common/jinja.h); a syntax
 * error names FILE:LINE:COL.
 *
 * The variables (vLLM's): messages (an assistant's tool_calls with each
 * function.arguments parsed from its JSON string into an object), tools
 * (the request's list of {type: function, function}), documents,
 * add_generation_prompt, continue_final_message, reasoning_effort,
 * bos_token / eos_token / unk_token / pad_token from tokenizer_config.json,
 * and the request's chat_template_kwargs merged on top.
 *
 * The rendered text holds BOS and the template's special tokens as text;
 * it is encoded with no BOS of its own. Special-token text a client writes
 * in message content stays plain text: before rendering, each such token in
 * the request's strings is swapped for a private-use placeholder, and after
 * rendering swapped back and reported as a plain span (encode_spans). */
#ifndef LOOM_CHAT_TEMPLATE_H
#define LOOM_CHAT_TEMPLATE_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "common/status.h"

struct loom_tokenizer;

/* Names that --chat-template takes for a template Loom ships. */
#define LOOM_CHAT_SHIPPED_NAMES "chatml"

typedef struct loom_chat_template loom_chat_template_t;

typedef struct loom_chat_template_opts {
    const char *
        override; /* --chat-template: FILE, a template text or a shipped name (NULL: the model's) */
    int trust_request; /* --trust-request-chat-template: a request's own chat_template is used */
    size_t max_output; /* a render longer than this is refused (0: 8 MiB) */
    unsigned long long
        max_steps; /* a render running longer than this is refused (0: the engine's default) */
} loom_chat_template_opts_t;

/* The shipped template named NAME, or NULL. */
const char *loom_chat_template_shipped(const char *name);

/* Loads and compiles the model's template (model_dir may be NULL: then only
 * the override). *out = NULL (LOOM_OK) when there is none. tok (may be
 * NULL) gives the special tokens kept plain in content. */
loom_status_t loom_chat_template_load(const char *model_dir, const loom_chat_template_opts_t *o,
                                      const struct loom_tokenizer *tok, loom_chat_template_t **out,
                                      loom_err_t *err);
/* The same from a template text and a tokenizer_config.json text (either
 * may be NULL; the config's chat_template is used when text is NULL). */
loom_status_t loom_chat_template_from_text(const char *text, const char *config_json,
                                           const char *name, const loom_chat_template_opts_t *o,
                                           const struct loom_tokenizer *tok,
                                           loom_chat_template_t **out, loom_err_t *err);
void loom_chat_template_destroy(loom_chat_template_t **t_p);

/* The template's source text (the default one; the tool_use one, or the
 * default when there is none) and where it came from. */
const char *loom_chat_template_text(const loom_chat_template_t *t);
const char *loom_chat_template_tool_text(const loom_chat_template_t *t);
const char *loom_chat_template_origin(const loom_chat_template_t *t);

/* Renders a chat request (the parsed body: messages, tools, documents,
 * add_generation_prompt, continue_final_message, chat_template_kwargs,
 * reasoning_effort, chat_template) into a malloc'ed NUL-terminated prompt.
 * plain (may be NULL): *plain gets *n_plain [start, end) byte pairs of
 * client special-token text to encode as plain text (NULL when none).
 * Errors: INVALID_ARGUMENT with *param naming the field (bad messages,
 * kwargs not an object, the template's raise_exception message),
 * RESOURCE_EXHAUSTED (the render outgrew its limits). */
loom_status_t loom_chat_template_render(const loom_chat_template_t *t, const cJSON *req, char **out,
                                        size_t *out_len, size_t **plain, size_t *n_plain,
                                        const char **param, loom_err_t *err);

#endif
