/* The marked call syntaxes, read from the whole text: the plain reference
 * of what tool_marked.c reads incrementally (the tests hold the two to
 * agree), and the pieces both share. With B, E, CB,
 * CE and S for DeepSeek's markers <｜tool▁calls▁begin｜>,
 * <｜tool▁calls▁end｜>, <｜tool▁call▁begin｜>, <｜tool▁call▁end｜> and
 * <｜tool▁sep｜>:
 *
 *   deepseek_v3      after any content, B CB function S NAME\n```json\nARGS\n``` CE ... E
 *   deepseek_v31     after any content, B CB NAME S ARGS CE ... E
 *   pythonic         the whole answer a Python list of calls,
 *                    [get_weather(city="Oslo"), now()], keyword arguments of
 *                    Python literals (strings, numbers, True/False/None,
 *                    lists, tuples, dicts)
 *   llama4_pythonic  the same, maybe between <|python_start|> and <|python_end|>
 *   qwen3_coder      after any content, blocks <tool_call>\n<function=NAME>\n
 *                    <parameter=KEY>\nVALUE\n</parameter>...</function>\n</tool_call>;
 *                    a VALUE is typed by the tool's schema (integer, number,
 *                    boolean, object, array: read as JSON; else a string)
 *   openai           GPT-OSS harmony, after any content, messages
 *                    [<|start|>assistant]<|channel|>commentary to=functions.NAME
 *                    [<|constrain|>]json<|message|>ARGS<|call|>, the recipient
 *                    (to=functions.NAME) also before the channel; the last
 *                    <|call|>, a stop token, may be missing; a final message
 *                    after the calls is content
 *
 * ARGS is a JSON object; a call's arguments are its JSON text less the
 * whitespace between tokens (pythonic: the literals converted to JSON). */
#ifndef LOOM_TOOL_PARSERS_H
#define LOOM_TOOL_PARSERS_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "gateway/tool_calls.h"

/* DeepSeek V3 / V3.1's markers (fullwidth bars and U+2581 in their names) */
#define DS_CALLS_BEGIN                                                                             \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "begin\xef\xbd\x9c>"
#define DS_CALLS_END                                                                               \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "end\xef\xbd\x9c>"
#define DS_CALL_BEGIN                                                                              \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "begin\xef\xbd\x9c>"
#define DS_CALL_END                                                                                \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "end\xef\xbd\x9c>"
#define DS_SEP                                                                                     \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "sep\xef\xbd\x9c>"

typedef struct loom_tp_call {
    char *name, *args; /* malloc'ed */
} loom_tp_call_t;

/* 1 for the syntaxes above (read by tool_stream_impl.h's marked reader). */
int loom_tp_held(loom_toolfmt_t f);

/* Where the calls begin in text[0..len): the offset of the start marker
 * (len: not there); *maybe: how many trailing bytes may still begin it. */
size_t loom_tp_find_start(loom_toolfmt_t f, const char *text, size_t len, size_t *maybe);

/* Parses text (from the start marker) into calls of functions in tools;
 * returns their number (> 0) and *calls (malloc'ed, free with
 * loom_tp_calls_free), *end the bytes they took (what follows is content);
 * -1 when it is not calls. */
int loom_tp_parse(loom_toolfmt_t f, const cJSON *tools, const char *text, size_t len,
                  loom_tp_call_t **calls, size_t *end);
void loom_tp_calls_free(loom_tp_call_t *calls, int n);

/* The pieces the streaming reader shares with loom_tp_parse:
 * qwen3_coder's parameter key's value v[0, n) as JSON, typed by the tool's
 * parameters schema, appended to out; a whole Python literal (a number,
 * True, False, None, ...) as JSON appended to out (-1: not one); a harmony
 * call header at s[*at]: 1 (*at past its <|message|>, the recipient's name
 * at s[*name_at], *name_len bytes), 0 when it is none, -1 when s[0, n) ends
 * before that is known. */
void loom_tp_coder_value(const cJSON *params, const char *key, const char *v, size_t n, loom_sbuf_t *out);
int loom_tp_py_literal(const char *s, size_t n, loom_sbuf_t *out);
int loom_tp_harmony_header(const char *s, size_t n, size_t *at, size_t *name_at, size_t *name_len);

#endif
