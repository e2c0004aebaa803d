/* `loom perplexity`: how much a storage scheme (weight dtype, weight
 * quantization, KV cache dtype) costs in quality. Loads the model twice in
 * this process — the reference (f32 weights, f32 KV) and the scheme — runs
 * both over the same windows of a text, and reports the scheme's perplexity,
 * the mean KL divergence KL(reference || scheme) of the next-token
 * distributions, and how often both pick the same most likely token.
 *
 * Windows: the text is tokenized once (with BOS) and cut into windows of
 * --ctx tokens starting every --stride tokens (default ctx / 2); each window
 * is a fresh sequence from position 0. Every token after the first is scored
 * once, in the first window that holds it at a position >= 1: the first
 * window scores all its targets, later ones only those past the previous
 * window's end, so every scored token but the first window's sees at least
 * ctx - stride tokens of context. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/commands.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "kernels/quant.h"
#include "worker/local.h"

typedef struct ppl_sums {
    double nll, nll_ref, kl;
    long scored, agree;
} ppl_sums_t;

/* log-softmax of one row in double: out[v] = x[v] - logsumexp(x). */
static void log_softmax(const float *x, int n, double *out) {
    double m = -INFINITY;
    for (int v = 0; v < n; v++)
        m = x[v] > m ? x[v] : m;
    double s = 0.0;
    for (int v = 0; v < n; v++)
        s += exp((double)x[v] - m);
    double lse = m + log(s);
    for (int v = 0; v < n; v++)
        out[v] = (double)x[v] - lse;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int v = 1; v < n; v++)
        if (x[v] > x[b]) b = v;
    return b;
}

/* Adds the rows [j0, j1) of one window: row j predicts target[j]. */
static void score_rows(const float *ref, const float *sch, const int32_t *target, int j0, int j1,
                       int vocab, double *lp_ref, double *lp_sch, ppl_sums_t *s) {
    for (int j = j0; j < j1; j++) {
        const float *r = ref + (size_t)j * vocab, *q = sch + (size_t)j * vocab;
        log_softmax(r, vocab, lp_ref);
        log_softmax(q, vocab, lp_sch);
        double kl = 0.0;
        for (int v = 0; v < vocab; v++) {
            double p = exp(lp_ref[v]);
            if (p > 0.0) kl += p * (lp_ref[v] - lp_sch[v]);
        }
        s->kl += kl > 0.0 ? kl : 0.0; /* rounding can leave a tiny negative for identical rows */
        s->nll -= lp_sch[target[j]];
        s->nll_ref -= lp_ref[target[j]];
        s->agree += argmax(r, vocab) == argmax(q, vocab);
        s->scored++;
    }
}

int loom_cmd_perplexity(int argc, char **argv) {
    const char *model = NULL, *text_path = NULL, *device = "cpu", *dtype = "f32";
    const char *quantization = "none", *kv_cache_dtype = "auto";
    int ctx = 0, stride = 0, threads = 0, json = 0, quiet = 0;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR", "Hugging Face model directory", 1, 0, NULL},
        {"text", LOOM_OPT_STR, &text_path, "FILE", "UTF-8 text to score", 1, 0, NULL},
        {"quantization", LOOM_OPT_STR, &quantization, "S",
         "weight quantization: none, int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:64, q4_min:128 "
         "(default none)",
         1, 0, NULL},
        {"kv-cache-dtype", LOOM_OPT_STR, &kv_cache_dtype, "TYPE",
         "KV cache elements: auto, f32, bf16, int8 (cpu), fp8 (cuda) (default auto)", 1, 0, NULL},
        {"dtype", LOOM_OPT_STR, &dtype, "TYPE", "weight storage: f32, bf16 or f16 (default f32)", 1,
         0, NULL},
        {"ctx", LOOM_OPT_INT, &ctx, "N",
         "window length in tokens (default: the model's context, at most 512)", 2, 1e9, NULL},
        {"stride", LOOM_OPT_INT, &stride, "N", "tokens between window starts (default ctx / 2)", 1,
         1e9, NULL},
        {"threads", LOOM_OPT_INT, &threads, "N", "CPU threads (default: all cores)", 0, 1024, NULL},
        {"device", LOOM_OPT_STR, &device, "DEV",
         "cpu or cuda:N (default cpu); the reference runs there too", 1, 0, NULL},
        {"json", LOOM_OPT_FLAG, &json, NULL, "print one JSON object instead of text", 1, 0, NULL},
        {"quiet", LOOM_OPT_FLAG, &quiet, NULL, "no log lines on stderr", 1, 0, NULL},
    };
    int r = loom_cli_parse(
        argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts),
        "loom perplexity --model DIR --text FILE [--quantization S] [--kv-cache-dtype T] [--ctx N]",
        "Scores the text with a storage scheme and with the f32 reference (both loaded in this\n"
        "process): perplexity, mean KL(reference || scheme) per token and top-1 agreement.\n"
        "Windows of --ctx tokens every --stride tokens; each token is scored once.");
    if (r) return r < 0 ? 2 : 0;
    if (!model || !text_path) {
        fprintf(stderr, "error: --model and --text are required (see loom perplexity --help)\n");
        return 2;
    }
    loom_quant_spec_t qs;
    if (!loom_quant_spec_parse(quantization, &qs)) {
        fprintf(stderr,
                "error: --quantization must be none, int8, fp8, q4, q4:64, q4:128, q4_min, "
                "q4_min:64 or q4_min:128, "
                "got '%s'\n",
                quantization);
        return 2;
    }
    loom_dtype_t wdt;
    if (!strcmp(dtype, "f32"))
        wdt = LOOM_DT_F32;
    else if (!strcmp(dtype, "bf16"))
        wdt = LOOM_DT_BF16;
    else if (!strcmp(dtype, "f16"))
        wdt = LOOM_DT_F16;
    else {
        fprintf(stderr, "error: --dtype must be f32, bf16 or f16, got '%s'\n", dtype);
        return 2;
    }
    if (quiet || json) loom_log_set_level(LOOM_LOG_WARN);

    loom_err_t err = {0};
    char *text = NULL;
    size_t text_len = 0;
    int rc = 1, n = 0, cap = 0, vocab = 0, windows = 0;
    loom_local_t *ref = NULL, *sch = NULL;
    int32_t *ids = NULL;
    float *lref = NULL, *lsch = NULL;
    double *lp_ref = NULL, *lp_sch = NULL;
    ppl_sums_t s = {0};
    loom_model_config_t mc;
    if (loom_read_file(text_path, &text, &text_len, &err) < 0 ||
        loom_model_config_load(model, &mc, &err) < 0)
        goto fail;
    if (ctx <= 0) ctx = LOOM_MIN(mc.max_seq_len, 512);
    if (ctx > mc.max_seq_len) {
        loom_err_set(&err, LOOM_ERR_INVALID_ARGUMENT, "--ctx %d is over the model's context %d",
                     ctx, mc.max_seq_len);
        goto fail;
    }
    if (stride <= 0) stride = LOOM_MAX(ctx / 2, 1);
    if (stride > ctx) {
        loom_err_set(&err, LOOM_ERR_INVALID_ARGUMENT,
                     "--stride %d is over --ctx %d: tokens would go unscored", stride, ctx);
        goto fail;
    }
    /* the reference: f32 weights and KV (on CUDA the backend keeps weights in
     * bf16 unless told otherwise: the reference is exact on the CPU); one
     * chunk per window */
    loom_local_options_t ro = {.model_dir = model,
                               .device = device,
                               .n_threads = threads,
                               .ctx = ctx,
                               .chunk = ctx,
                               .weight_dtype = LOOM_DT_F32,
                               .kv_cache_dtype = "f32"};
    loom_local_options_t so = ro;
    so.weight_dtype = wdt;
    so.kv_cache_dtype = kv_cache_dtype;
    so.quant = qs;
    if (loom_local_open(&ro, &ref, &err) < 0 || loom_local_open(&so, &sch, &err) < 0) goto fail;

    if (loom_tokenizer_encode(loom_local_tokenizer(ref), text, text_len, 1, 0, &ids, &n, &cap,
                              &err) < 0)
        goto fail;
    if (n < 2) {
        loom_err_set(&err, LOOM_ERR_INVALID_ARGUMENT, "%s gives %d token(s): nothing to score",
                     text_path, n);
        goto fail;
    }
    vocab = mc.vocab_size;
    lref = loom_xmalloc((size_t)ctx * vocab * sizeof(float));
    lsch = loom_xmalloc((size_t)ctx * vocab * sizeof(float));
    lp_ref = loom_xmalloc((size_t)vocab * sizeof(double));
    lp_sch = loom_xmalloc((size_t)vocab * sizeof(double));
    int scored_to = 1; /* targets [1, scored_to) are done */
    uint64_t t0 = loom_now_ns();
    for (int begin = 0; scored_to < n; begin += stride) {
        const int end = LOOM_MIN(begin + ctx, n), len = end - begin;
        if (loom_local_logits(ref, ids + begin, len, lref, &err) < 0 ||
            loom_local_logits(sch, ids + begin, len, lsch, &err) < 0)
            goto fail;
        /* row j predicts ids[begin + j + 1]; score targets [scored_to, end) */
        score_rows(lref, lsch, ids + begin + 1, scored_to - 1 - begin, len - 1, vocab, lp_ref,
                   lp_sch, &s);
        scored_to = end;
        windows++;
    }
    double secs = (double)(loom_now_ns() - t0) * 1e-9;
    const double ppl = exp(s.nll / (double)s.scored), ppl_ref = exp(s.nll_ref / (double)s.scored);
    const double kl = s.kl / (double)s.scored, top1 = (double)s.agree / (double)s.scored;
    const char *kvn = loom_kv_dtype_name(loom_local_kv_dtype(sch));
    char qname[32];
    loom_quant_spec_name(&qs, qname, sizeof qname);
    if (json) {
        printf("{\"model\": \"%s\", \"tokens\": %d, \"scored\": %ld, \"ctx\": %d, \"stride\": %d, "
               "\"windows\": %d, \"dtype\": \"%s\", \"quantization\": \"%s\", \"kv_cache_dtype\": "
               "\"%s\", "
               "\"perplexity\": %.6f, \"reference_perplexity\": %.6f, \"mean_kl\": %.9g, "
               "\"top1_agreement\": %.6f, \"seconds\": %.3f}\n",
               model, n, s.scored, ctx, stride, windows, dtype, qname, kvn, ppl, ppl_ref, kl, top1,
               secs);
    } else {
        printf("%s: %d tokens, %ld scored in %d window(s) of %d (stride %d), %.2f s\n", model, n,
               s.scored, windows, ctx, stride, secs);
        printf("scheme: weights %s, quantization %s, KV %s\n", dtype, qname, kvn);
        printf("perplexity          %.4f (reference f32 weights, f32 KV: %.4f)\n", ppl, ppl_ref);
        printf("mean KL(ref||this)  %.6g nats per token\n", kl);
        printf("top-1 agreement     %.4f (%ld of %ld)\n", top1, s.agree, s.scored);
    }
    rc = 0;
fail:
    if (rc) fprintf(stderr, "error: %s\n", err.msg);
    free(text);
    free(ids);
    free(lref);
    free(lsch);
    free(lp_ref);
    free(lp_sch);
    loom_local_close(&sch);
    loom_local_close(&ref);
    return rc;
}
