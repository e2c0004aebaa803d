/* Command-line options: a table of long options ("--name value" or
 * "--name=value"), typed values with range checks, and generated --help. */
#ifndef LOOM_CLI_H
#define LOOM_CLI_H

#include <stdint.h>

typedef enum { LOOM_OPT_FLAG, LOOM_OPT_STR, LOOM_OPT_INT, LOOM_OPT_FLOAT, LOOM_OPT_U64 } loom_opt_kind_t;

typedef struct loom_opt {
    const char *name;  /* without the dashes */
    loom_opt_kind_t kind;
    void *dst;         /* int* for FLAG/INT, const char** for STR, float* for FLOAT, uint64_t* for U64 */
    const char *arg;   /* placeholder shown in help, e.g. "DIR" */
    const char *help;
    double min, max;   /* inclusive range for numbers (ignored when min > max) */
    int *seen;         /* optional: set to 1 when given */
} loom_opt_t;

/* Parses argv[first..argc). Prints a message naming the option and returns
 * -1 on error; returns 1 when --help was asked (after printing usage), 0 on
 * success. Positional arguments are refused. */
int loom_cli_parse(int argc, char **argv, int first, const loom_opt_t *opts, int n_opts,
                   const char *usage, const char *description);
/* The same for commands that take vLLM's spellings (loom serve,
 * loom-coordinator): an unknown option that is one of `vllm serve`'s flags
 * is refused as "vLLM flag --X is not supported by Loom". Both parsers take
 * a long name after one dash as well ("-tp 2"). */
int loom_cli_parse_vllm(int argc, char **argv, int first, const loom_opt_t *opts, int n_opts, const char *usage,
                        const char *description);
void loom_cli_usage(const char *usage, const char *description, const loom_opt_t *opts, int n_opts);

#endif
