/* Chat templates: turns a list of chat messages into the one prompt string a
 * chat model was trained on. Loom does not run Jinja; it recognises the
 * families users meet by distinctive substrings of the model's template
 * (tokenizer_config.json "chat_template") and renders them in C:
 *
 *   llama2   <s>[INST] <<SYS>>\nsys\n<</SYS>>\n\nuser [/INST] answer </s>
 *   llama3   <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ntext<|eot_id|>
 *   chatml   <|im_start|>role\ntext<|im_end|>\n            (Qwen, Yi, many others)
 *   mistral  <s>[INST] sys\n\nuser [/INST]answer</s>
 *   qwen3    chatml, with <think>reasoning</think> dropped from turns before the last user message
 *   gemma    <bos><start_of_turn>user\nsys\n\ntext<end_of_turn>\n<start_of_turn>model\n...
 *   phi3     <|system|>\ntext<|end|>\n<|user|>\ntext<|end|>\n<|assistant|>\n
 *
 * The rendered text contains the special tokens as text; the coordinator
 * parses them (raw_prompt) and adds no BOS of its own. The renderer also
 * says where the messages' own text lies (loom_chat_render_spans), so that
 * special-token text a client writes in a message stays plain text. */
#ifndef LOOM_CHAT_TEMPLATE_H
#define LOOM_CHAT_TEMPLATE_H

#include <stddef.h>

#include "common/status.h"

typedef enum {
    LOOM_CHAT_NONE = 0, /* no template, or one Loom does not recognise */
    LOOM_CHAT_LLAMA2,
    LOOM_CHAT_LLAMA3,
    LOOM_CHAT_CHATML,
    LOOM_CHAT_MISTRAL,
    LOOM_CHAT_QWEN3,
    LOOM_CHAT_GEMMA,
    LOOM_CHAT_PHI3,
} loom_chat_family_t;

/* "llama2, llama3, chatml, mistral, ...": for messages that list the choices. */
#define LOOM_CHAT_FAMILY_NAMES "llama2, llama3, chatml, mistral, qwen3, gemma, phi3"

typedef struct loom_chat_template {
    loom_chat_family_t family;
    char *bos, *eos;       /* the model's bos_token / eos_token strings ("" when it has none; chatml:
                              "" unless the model's ChatML template writes bos_token) */
    char *default_system;  /* chatml only: the system turn a template adds when there is none (Qwen), or NULL */
    int no_system;         /* gemma: the template refuses a system message (Gemma 1 and 2's raise
                              'System role not supported'; Gemma 3's folds it into the first user turn) */
} loom_chat_template_t;

typedef struct loom_chat_msg {
    const char *role;    /* system, user, assistant ("developer" is read as system) */
    const char *content; /* UTF-8 text */
} loom_chat_msg_t;

const char *loom_chat_family_name(loom_chat_family_t f); /* "llama2", ..., "none" */
/* The family named NAME (as given to --chat-template); LOOM_CHAT_NONE if unknown. */
loom_chat_family_t loom_chat_family_from_name(const char *name);
/* The family of a Jinja template text, by its distinctive substrings;
 * LOOM_CHAT_NONE when none matches. */
loom_chat_family_t loom_chat_detect(const char *template_text);

/* A template of a given family. bos/eos NULL take the family's usual tokens
 * (<s>/</s> for llama2 and mistral, <|begin_of_text|>/<|eot_id|> for llama3,
 * none for chatml); default_system may be NULL. */
loom_chat_template_t *loom_chat_template_create(loom_chat_family_t family, const char *bos, const char *eos,
                                                const char *default_system);
void loom_chat_template_destroy(loom_chat_template_t **t_p);

/* A template from a model's Jinja text: the family detected from it (or the
 * override NAME when not NULL), with ChatML's built-in default system turn
 * taken from the text when it has one. Returns INVALID_ARGUMENT naming the
 * options when the override is unknown or the text is not recognised, and
 * *out = NULL (LOOM_OK) when there is neither text nor override. */
loom_status_t loom_chat_template_from_text(const char *template_text, const char *override_name, const char *bos,
                                           const char *eos, loom_chat_template_t **out, loom_err_t *err);

/* The same from a model directory: tokenizer_config.json's chat_template
 * (a string, or a list of {name, template} where "default" wins), else the
 * file chat_template.jinja; bos_token/eos_token from tokenizer_config.json
 * (strings or {"content": ...}; null means none; absent means the family's
 * usual ones). A missing tokenizer_config.json is no error. */
loom_status_t loom_chat_template_load(const char *model_dir, const char *override_name, loom_chat_template_t **out,
                                      loom_err_t *err);

/* Renders messages (and, when add_generation_prompt, the header that makes
 * the model answer as the assistant) into a malloc'ed, NUL-terminated
 * string. INVALID_ARGUMENT with a message a client can act on when the
 * conversation breaks the family's rules (llama2/mistral: one optional
 * leading system message, then user and assistant alternating, starting
 * with user) or a role is unknown. */
loom_status_t loom_chat_render(const loom_chat_template_t *t, const loom_chat_msg_t *msgs, int n_msgs,
                               int add_generation_prompt, char **out, size_t *out_len, loom_err_t *err);

/* The same, also returning where the messages' own text lies in the
 * prompt: *plain is a malloc'ed array of *n_plain [start, end) byte pairs
 * (plain[2i], plain[2i+1]), in order and disjoint; NULL when there are
 * none. Special-token text inside them came from the client, not from the
 * template: loom_tokenizer_encode_spans encodes it as plain text. */
loom_status_t loom_chat_render_spans(const loom_chat_template_t *t, const loom_chat_msg_t *msgs, int n_msgs,
                                     int add_generation_prompt, char **out, size_t *out_len, size_t **plain,
                                     size_t *n_plain, loom_err_t *err);

#endif
