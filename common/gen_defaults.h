/* Default sampling parameters from a model's generation_config.json (vLLM's
 * --generation-config auto|DIR): what a request gets for the fields it does
 * not set. "vllm" (or a directory without the file) leaves the built-in
 * defaults: temperature 1, top_p 1, top_k off, max_tokens per endpoint. */
#ifndef LOOM_GEN_DEFAULTS_H
#define LOOM_GEN_DEFAULTS_H

#include "common/status.h"

typedef struct loom_gen_defaults {
    int has_temperature, has_top_p, has_top_k, has_max_tokens;
    float temperature; /* [0, 2] */
    float top_p;       /* (0, 1] */
    int top_k;         /* 0: off */
    int max_tokens;    /* generation_config's max_new_tokens */
    char ignored[160]; /* keys with a sampling meaning Loom does not apply, e.g. "repetition_penalty" */
} loom_gen_defaults_t;

/* Reads DIR/generation_config.json into *out ({0} when there is none).
 * LOOM_ERR_FORMAT naming the file and key for invalid JSON or a value out
 * of range. */
loom_status_t loom_gen_defaults_load(const char *dir, loom_gen_defaults_t *out, loom_err_t *err);

#endif
