/* Tool calling for /v1/chat/completions: the request's tools and
 * tool_choice read (the chat template lists the tools and renders the
 * history's calls and results), the forced call (tool_choice "required" or
 * a named function) as a grammar in the model's own call syntax, and the
 * model's output parsed back into OpenAI tool_calls.
 *
 * The call syntax (vLLM's --tool-call-parser names), picked by name or
 * detected from the chat template's markers:
 *   hermes       <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, anywhere in the text
 *   llama3_json  at the start, an optional <|python_tag|>, then {"name": ..., "parameters": {...}}
 *                (several separated by ';')
 *   mistral      at the start, [TOOL_CALLS] then a JSON array [{"name": ..., "arguments": {...}}]
 *   granite      at the start, <|tool_call|> then a JSON array of the same
 *   deepseek_v3, deepseek_v31, pythonic, llama4_pythonic, qwen3_coder, openai  marked syntaxes (tool_parsers.h)
 * A forced call's output is that syntax, its arguments held to the tool's
 * schema by the grammar engine (grammar kind LOOM_GRAMMAR_TOOL_CALLS): JSON,
 * Python literals (pythonic) or typed parameter blocks (qwen3_coder). */
#ifndef LOOM_TOOL_CALLS_H
#define LOOM_TOOL_CALLS_H

#include <cjson/cJSON.h>
#include <stdint.h>

struct loom_tokenizer;

typedef enum {
    LOOM_TOOLS_OFF = 0, /* no tools, or tool_choice "none" */
    LOOM_TOOLS_AUTO,    /* the model may call: its output is parsed */
    LOOM_TOOLS_REQUIRED,
    LOOM_TOOLS_NAMED,
} loom_tools_mode_t;

typedef enum {
    LOOM_TOOLFMT_NONE = 0,
    LOOM_TOOLFMT_HERMES,
    LOOM_TOOLFMT_LLAMA3_JSON,
    LOOM_TOOLFMT_MISTRAL,
    LOOM_TOOLFMT_GRANITE,
    LOOM_TOOLFMT_DEEPSEEK_V3,
    LOOM_TOOLFMT_DEEPSEEK_V31,
    LOOM_TOOLFMT_PYTHONIC,
    LOOM_TOOLFMT_LLAMA4_PYTHONIC,
    LOOM_TOOLFMT_QWEN3_CODER,
    LOOM_TOOLFMT_OPENAI,
} loom_toolfmt_t;

/* For messages that list the choices. */
#define LOOM_TOOL_PARSER_NAMES "hermes, llama3_json, mistral, granite, deepseek_v3, deepseek_v31, pythonic, llama4_pythonic, qwen3_coder, openai"

const char *loom_toolfmt_name(loom_toolfmt_t f);
/* The parser named NAME (vLLM's names); LOOM_TOOLFMT_NONE when unknown. */
loom_toolfmt_t loom_toolfmt_from_name(const char *name);
/* The syntax a chat template teaches, by its markers; LOOM_TOOLFMT_NONE
 * when it shows none. */
loom_toolfmt_t loom_toolfmt_detect(const char *template_text);

#define LOOM_TOOLS_MAX_KEEP 8

typedef struct loom_tools {
    loom_tools_mode_t mode;
    int parallel;
    const cJSON *tools; /* the request's array (borrowed) */
    const char *named;  /* LOOM_TOOLS_NAMED: the function */
    loom_toolfmt_t fmt; /* the model's call syntax */
    char *schema;       /* owned: REQUIRED / NAMED: the forced output's grammar spec (LOOM_GRAMMAR_TOOL_CALLS) */
    /* the syntax's markers that are one token of the model's tokenizer
     * (loom_tools_set_tokenizer): a forced call writes that token */
    int32_t mark_ids[LOOM_TOOLS_MAX_KEEP];
    const char *mark_text[LOOM_TOOLS_MAX_KEEP];
    int n_marks;
    /* those that are special tokens: kept in the output's text for the parser */
    int32_t keep_ids[LOOM_TOOLS_MAX_KEEP];
    int n_keep;
} loom_tools_t;

/* Reads tools, tool_choice and parallel_tool_calls of a chat request. -1
 * with a message (naming the field in *param) on bad input. */
int loom_tools_parse(const cJSON *req, loom_toolfmt_t fmt, loom_tools_t *t, const char **param, char *msg,
                     size_t cap);
void loom_tools_free(loom_tools_t *t);
/* With the model's tokenizer: a forced call's grammar takes each of the
 * syntax's markers that is one token (a special token, as Mistral's
 * [TOOL_CALLS] or harmony's <|channel|>, or an added one, as Qwen's
 * <tool_call>) as that token id, as the model writes it unconstrained, not
 * spelled with other tokens; the special ones go to keep_ids, to be written
 * into the text though special tokens are skipped. */
void loom_tools_set_tokenizer(loom_tools_t *t, const struct loom_tokenizer *tok);

/* Parses output into an OpenAI tool_calls array (ids from
 * loom_tools_call_id); NULL when it is not calls (then all of it is
 * content). *rest: the content besides the calls (malloc'ed, may be NULL).
 * What is a call and what arguments and content are: tool_stream.h (this
 * is its reader fed the whole output). */
cJSON *loom_tools_parse_output(const loom_tools_t *t, const char *text, size_t len,
                               unsigned long long id_seed, char **rest);

/* Call index's id, "call_" + hex of id_seed + the index. */
void loom_tools_call_id(unsigned long long id_seed, int index, char *buf, size_t cap);

#endif
