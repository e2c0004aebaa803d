/* Tool calling for /v1/chat/completions: the request's tools rendered with
 * the chat family's conventions, the history's tool calls and results
 * rendered likewise, the forced call (tool_choice "required" or a named
 * function) as a JSON Schema for the grammar engine, and the model's output
 * parsed back into OpenAI tool_calls.
 *
 *   chatml (Hermes, Qwen)  tools in <tools></tools> in the system turn; calls
 *                          <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>;
 *                          results in a user turn as <tool_response>...</tool_response>
 *   llama3                 tools as JSON in the first user turn (Llama 3.1's
 *                          tools_in_user_message); a call is {"name": ..., "parameters": {...}}
 *   mistral                [AVAILABLE_TOOLS] [...] [/AVAILABLE_TOOLS] before the last user
 *                          text; calls [TOOL_CALLS] [{"name": ..., "arguments": {...}}];
 *                          results [TOOL_RESULTS] {"content": ...} [/TOOL_RESULTS]
 *
 * A forced call's output is plain JSON: a named function's arguments object,
 * or for "required" an array of {"name", "arguments"} objects (one unless
 * parallel_tool_calls). */
#ifndef LOOM_TOOL_CALLS_H
#define LOOM_TOOL_CALLS_H

#include <cjson/cJSON.h>

#include "common/chat_template.h"

typedef enum {
    LOOM_TOOLS_OFF = 0, /* no tools, or tool_choice "none" */
    LOOM_TOOLS_AUTO,    /* the model may call: its output is parsed */
    LOOM_TOOLS_REQUIRED,
    LOOM_TOOLS_NAMED,
} loom_tools_mode_t;

typedef struct loom_tools {
    loom_tools_mode_t mode;
    int parallel;
    const cJSON *tools; /* the request's array (borrowed) */
    const char *named;  /* LOOM_TOOLS_NAMED: the function */
    char *render;       /* owned: the tools as the family writes them in the prompt */
    char *schema;       /* owned: REQUIRED / NAMED: the forced output's JSON Schema */
} loom_tools_t;

/* Reads tools, tool_choice and parallel_tool_calls of a chat request. -1
 * with a message (naming the field in *param) on bad input. */
int loom_tools_parse(const cJSON *req, loom_chat_family_t family, loom_tools_t *t, const char **param, char *msg,
                     size_t cap);
void loom_tools_free(loom_tools_t *t);

/* The text an assistant message with tool_calls, or a tool message, stands
 * for in the family's prompt (malloc'ed), or NULL with a message. */
char *loom_tools_render_calls(loom_chat_family_t family, const cJSON *tool_calls, const char *content, char *msg,
                              size_t cap);
char *loom_tools_render_result(loom_chat_family_t family, const char *content);

/* Parses output into an OpenAI tool_calls array (ids from
 * loom_tools_call_id); NULL when it is not calls (then all of it is
 * content). *rest: the content besides the calls (malloc'ed, may be NULL).
 * What is a call and what arguments and content are: tool_stream.h (this
 * is its reader fed the whole output). */
cJSON *loom_tools_parse_output(const loom_tools_t *t, loom_chat_family_t family, const char *text, size_t len,
                               unsigned long long id_seed, char **rest);

/* Call index's id, "call_" + hex of id_seed + the index. */
void loom_tools_call_id(unsigned long long id_seed, int index, char *buf, size_t cap);

#endif
