/* Long-option parsing with typed, range-checked values and generated help. */
#include "common/cli.h"

#include "common/vllm_flags.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void loom_cli_usage(const char *usage, const char *description, const loom_opt_t *opts, int n_opts) {
    printf("usage: %s\n\n%s\n\noptions:\n", usage, description);
    for (int i = 0; i < n_opts; i++) {
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", opts[i].name, opts[i].arg ? " " : "",
                 opts[i].arg ? opts[i].arg : "");
        printf("  %-26s %s\n", left, opts[i].help);
    }
    printf("  %-26s %s\n", "--help", "show this help and exit");
}

static int set_value(const loom_opt_t *o, const char *v) {
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case LOOM_OPT_FLAG: *(int *)o->dst = 1; return 0;
    case LOOM_OPT_STR: *(const char **)o->dst = v; return 0;
    case LOOM_OPT_INT: {
        long x = strtol(v, &end, 10);
        if (errno || end == v || *end || (o->min <= o->max && (x < o->min || x > o->max))) break;
        *(int *)o->dst = (int)x;
        return 0;
    }
    case LOOM_OPT_U64: {
        if (v[0] == '-') break;
        unsigned long long x = strtoull(v, &end, 10);
        if (errno || end == v || *end) break;
        *(uint64_t *)o->dst = (uint64_t)x;
        return 0;
    }
    case LOOM_OPT_FLOAT: {
        double x = strtod(v, &end);
        if (errno || end == v || *end || !isfinite(x) || (o->min <= o->max && (x < o->min || x > o->max)))
            break;
        *(float *)o->dst = (float)x;
        return 0;
    }
    }
    if (o->min <= o->max)
        fprintf(stderr, "error: --%s expects a number in [%g, %g], got '%s'\n", o->name, o->min, o->max, v);
    else
        fprintf(stderr, "error: --%s: invalid value '%s'\n", o->name, v);
    return -1;
}

static int parse(int argc, char **argv, int first, const loom_opt_t *opts, int n_opts, const char *usage,
                 const char *description, int vllm) {
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            loom_cli_usage(usage, description, opts, n_opts);
            return 1;
        }
        /* "-tp 2": a single dash before a long name (vLLM's short forms) */
        int dashes = strncmp(a, "--", 2) == 0 ? 2 : a[0] == '-' && a[1] && a[1] != '-' ? 1 : 0;
        if (!dashes) {
            fprintf(stderr, "error: unexpected argument '%s' (see --help)\n", a);
            return -1;
        }
        const char *name = a + dashes, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const loom_opt_t *o = NULL;
        for (int j = 0; j < n_opts; j++)
            if (strlen(opts[j].name) == len && !strncmp(opts[j].name, name, len)) o = &opts[j];
        if (!o) {
            if (vllm && loom_vllm_flag_known(name, len))
                fprintf(stderr, "error: vLLM flag %.*s is not supported by Loom (see --help for what is)\n",
                        (int)(len + (size_t)dashes), a);
            else
                fprintf(stderr, "error: unknown option '%s' (see --help)\n", a);
            return -1;
        }
        const char *v = NULL;
        if (o->kind == LOOM_OPT_FLAG) {
            if (eq) {
                fprintf(stderr, "error: --%s takes no value\n", o->name);
                return -1;
            }
        } else if (eq) {
            v = eq + 1;
        } else if (i + 1 < argc) {
            v = argv[++i];
        } else {
            fprintf(stderr, "error: --%s needs a value (%s)\n", o->name, o->arg ? o->arg : "value");
            return -1;
        }
        if (set_value(o, v) < 0) return -1;
        if (o->seen) *o->seen = 1;
    }
    return 0;
}

int loom_cli_parse(int argc, char **argv, int first, const loom_opt_t *opts, int n_opts, const char *usage,
                   const char *description) {
    return parse(argc, argv, first, opts, n_opts, usage, description, 0);
}

int loom_cli_parse_vllm(int argc, char **argv, int first, const loom_opt_t *opts, int n_opts, const char *usage,
                        const char *description) {
    return parse(argc, argv, first, opts, n_opts, usage, description, 1);
}
