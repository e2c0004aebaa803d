/* Compares the engine with the independent reference (llama_ref.py):
 * per-position logits of the prompt (prefilled in chunks) and of every
 * greedy decode step, and the greedy ids themselves.
 *
 *   check_ref --model DIR --ids 1,2,3 --ref-logits FILE --ref-greedy 4,5,6
 *             [--tol 1e-4] [--chunk N] [--threads N]
 * FILE holds float32 logits of (n_ids + n_greedy) positions, row-major. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "worker/local.h"

static int parse_ids(const char *s, int32_t **out) {
    int n = 0, cap = 16;
    int32_t *v = loom_xmalloc((size_t)cap * sizeof *v);
    while (s && *s) {
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s) break;
        if (n == cap) v = loom_xrealloc(v, (size_t)(cap *= 2) * sizeof *v);
        v[n++] = (int32_t)x;
        s = *end == ',' ? end + 1 : end;
    }
    *out = v;
    return n;
}

/* max |a - b| / max |b| over one row */
static double rel_err(const float *a, const float *b, int n) {
    double md = 0, mb = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= md)) md = d; /* NaN propagates */
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return mb > 0 ? md / mb : md;
}

typedef struct gen_ctx {
    loom_model_t *model;
    float *logits; /* (n_greedy, vocab) captured per step */
    int32_t *ids;
    int n, cap, vocab;
} gen_ctx_t;

static int on_token(void *p, int32_t id) {
    gen_ctx_t *g = p;
    if (g->n < g->cap) {
        loom_model_download_logits(g->model, g->logits + (size_t)g->n * g->vocab, 1);
        g->ids[g->n++] = id;
    }
    return 0;
}

int main(int argc, char **argv) {
    loom_log_init("check_ref");
    loom_log_set_level(LOOM_LOG_WARN);
    const char *model = NULL, *ids_s = NULL, *logits_path = NULL, *greedy_s = NULL;
    float tol = 1e-4f;
    int chunk = 7, threads = 2;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR", "model directory", 1, 0, NULL},
        {"ids", LOOM_OPT_STR, &ids_s, "IDS", "prompt ids, comma-separated", 1, 0, NULL},
        {"ref-logits", LOOM_OPT_STR, &logits_path, "FILE", "reference logits (float32)", 1, 0, NULL},
        {"ref-greedy", LOOM_OPT_STR, &greedy_s, "IDS", "reference greedy ids", 1, 0, NULL},
        {"tol", LOOM_OPT_FLOAT, &tol, "X", "relative error bound per position (default 1e-4)", 0, 1, NULL},
        {"chunk", LOOM_OPT_INT, &chunk, "N", "prefill chunk (default 7)", 1, 4096, NULL},
        {"threads", LOOM_OPT_INT, &threads, "N", "CPU threads (default 2)", 1, 64, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "check_ref [options]",
                           "Compares the engine against llama_ref.py output.");
    if (r) return r < 0 ? 2 : 0;
    if (!model || !ids_s || !logits_path || !greedy_s) {
        fprintf(stderr, "check_ref: --model, --ids, --ref-logits and --ref-greedy are required\n");
        return 2;
    }
    int32_t *ids, *ref_greedy;
    int n = parse_ids(ids_s, &ids), ng = parse_ids(greedy_s, &ref_greedy);
    loom_err_t err = {0};
    loom_local_options_t lo = {.model_dir = model, .n_threads = threads, .chunk = chunk, .no_tokenizer = 1};
    loom_local_t *l = NULL;
    if (loom_local_open(&lo, &l, &err) < 0) {
        fprintf(stderr, "check_ref: %s\n", err.msg);
        return 1;
    }
    int vocab = loom_local_config(l)->vocab_size;
    size_t rows = (size_t)n + (size_t)ng;
    float *ref = loom_xmalloc(rows * vocab * sizeof(float));
    FILE *f = fopen(logits_path, "rb");
    if (!f || fread(ref, sizeof(float), rows * vocab, f) != rows * vocab) {
        fprintf(stderr, "check_ref: cannot read %zu x %d logits from %s\n", rows, vocab, logits_path);
        return 1;
    }
    fclose(f);

    float *got = loom_xmalloc((size_t)n * vocab * sizeof(float));
    gen_ctx_t g = {.model = loom_local_model(l), .vocab = vocab, .cap = ng,
                   .logits = loom_xmalloc((size_t)ng * vocab * sizeof(float)),
                   .ids = loom_xmalloc((size_t)ng * sizeof(int32_t))};
    loom_sampling_t greedy = {.temperature = 0};
    if (loom_local_generate(l, ids, n, ng, &greedy, 1, on_token, &g, got, NULL, &err) < 0) {
        fprintf(stderr, "check_ref: %s\n", err.msg);
        return 1;
    }
    int fails = 0;
    double worst = 0;
    for (int p = 0; p < n; p++) {
        double e = rel_err(got + (size_t)p * vocab, ref + (size_t)p * vocab, vocab);
        if (!(e <= worst)) worst = e;
        if (!(e <= tol) && fails++ < 5) fprintf(stderr, "prompt position %d: relative error %.3g > %.3g\n", p, e, tol);
    }
    int same = g.n == ng;
    for (int i = 0; i < g.n && i < ng; i++) {
        if (g.ids[i] != ref_greedy[i]) {
            if (same) fprintf(stderr, "greedy id %d: got %d, reference %d\n", i, g.ids[i], ref_greedy[i]);
            same = 0;
        }
        /* compare decode-step logits while the sequences agree */
        if (same) {
            double e = rel_err(g.logits + (size_t)i * vocab, ref + (size_t)(n - 1 + i) * vocab, vocab);
            if (!(e <= worst)) worst = e;
            if (!(e <= tol) && fails++ < 5) fprintf(stderr, "decode step %d: relative error %.3g > %.3g\n", i, e, tol);
        }
    }
    printf("check_ref: %d prompt positions, %d greedy ids %s, worst relative error %.3g (bound %.1g)\n", n,
           ng, same ? "identical" : "DIFFERENT", worst, (double)tol);
    free(ref);
    free(got);
    free(g.logits);
    free(g.ids);
    free(ids);
    free(ref_greedy);
    loom_local_close(&l);
    return fails || !same ? 1 : 0;
}
