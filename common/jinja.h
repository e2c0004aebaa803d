/* Loom's Jinja engine: chat templates as Hugging Face ships them, run the way
 * transformers' apply_chat_template runs them (a sandboxed, immutable jinja2
 * environment with trim_blocks, lstrip_blocks and loop controls). A template
 * is compiled once and rendered many times, from any thread. See
 * docs/chat-templates.md for the subset it runs and its limits. */
#ifndef LOOM_JINJA_H
#define LOOM_JINJA_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/status.h"

typedef struct loom_jinja loom_jinja_t; /* a compiled template, immutable, thread-safe to render */

typedef struct loom_jinja_limits {
    size_t max_output;  /* bytes of output (0: 1 MiB default)                          */
    uint64_t max_steps; /* evaluation steps: loop iterations + node evaluations (0: 10M) */
    int max_depth;      /* macro/call recursion depth (0: 64)                           */
} loom_jinja_limits_t;

/* Compiles SRC (LEN bytes; NAME used in messages). A syntax error returns
 * LOOM_ERR_INVALID_ARGUMENT with err->msg "NAME:LINE:COL: what" (1-based). */
loom_status_t loom_jinja_compile(const char *src, size_t len, const char *name, loom_jinja_t **out,
                                 loom_err_t *err);
void loom_jinja_destroy(loom_jinja_t **t_p);

/* Renders with VARS (a cJSON object: messages, tools, add_generation_prompt,
 * bos_token, ...; read only). On success *out is a malloc'd NUL-terminated
 * string (caller frees) of *out_len bytes.
 * raise_exception(msg) returns LOOM_ERR_INVALID_ARGUMENT with err->msg exactly msg;
 * a limit exceeded returns LOOM_ERR_RESOURCE_EXHAUSTED naming the limit;
 * a runtime type error (e.g. calling a method on none) returns
 * LOOM_ERR_INVALID_ARGUMENT "NAME:LINE:COL: what". */
loom_status_t loom_jinja_render(const loom_jinja_t *t, const cJSON *vars,
                                const loom_jinja_limits_t *lim, char **out, size_t *out_len,
                                loom_err_t *err);

/* A byte range [begin, end) of the output. */
typedef struct loom_jinja_span {
    size_t begin, end;
} loom_jinja_span_t;

/* As loom_jinja_render, and also reports the byte spans of the output that
 * came from string values taken from VARS (data), as opposed to template
 * literals. Data is every string (and object key) nested inside a top-level
 * array or object of VARS (messages, tools, documents, ...); top-level
 * strings (bos_token, eos_token, date_string, ...) are configuration and
 * are not marked. *spans is a malloc'd array (caller frees; NULL when
 * *n_spans is 0) of *n_spans sorted, disjoint, non-adjacent spans. A data
 * string keeps its mark through concatenation, slicing, strip/trim, split,
 * upper/lower, join and the filters that pass a value through; filters that
 * rewrite text (replace, tojson, format, title, indent, escape) drop it. */
loom_status_t loom_jinja_render_spans(const loom_jinja_t *t, const cJSON *vars,
                                      const loom_jinja_limits_t *lim, char **out, size_t *out_len,
                                      loom_jinja_span_t **spans, size_t *n_spans, loom_err_t *err);

#endif
