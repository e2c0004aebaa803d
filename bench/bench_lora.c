/* Decode throughput with LoRA adapters against the base model, one process:
 * batches of B sequences (B from --batches) decode together after a short
 * prompt, (a) with no adapter, (b) every row on one rank-R all-linear
 * adapter, (c) rows spread over 8 distinct adapters (row i on adapter
 * i mod 8). The three run in one model (8 slots installed), interleaved
 * round by round, so their ratios compare them under the same load.
 *
 * Napkin math for the 76M-matmul benchmark model (dim 768, 12 layers,
 * intermediate 2048, 12/4 heads) at rank 16: an adapter adds 16 x (in + out)
 * floats per projection, 16 x 13568 x 12 = 2.6M floats (10.4 MB f32) per
 * adapter against 302 MB of matmul weights, and 2 x 2.6M FLOPs per row
 * against 151M: a 1.7% FLOP overhead per row, plus the adapters' bytes, which
 * one adapter reads once per step and eight read eight times.
 *
 *   bench_lora --model DIR [--device cpu|cuda:N] [--threads 2] [--batches 1,8,32] [--rank 16] [--prompt 32]
 *              [--tokens 16] [--reps 3] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/util.h"
#include "worker/model.h"

#define N_ADAPTERS 8
#define BLOCK 16
#define MAX_REPS 20

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return ((float)(rng >> 40) / (float)(1 << 24) - 0.5f) * 0.02f;
}

/* A random adapter of rank r on every linear of every layer, in memory. */
static loom_lora_adapter_t *random_adapter(const loom_model_config_t *c, int r) {
    loom_lora_adapter_t *a = loom_xcalloc(1, sizeof *a);
    a->n_layers = c->n_layers;
    a->layer_begin = 0;
    a->layer_end = c->n_layers;
    a->max_r = r;
    a->mod = loom_xcalloc((size_t)c->n_layers * LOOM_LORA_N_TARGETS, sizeof *a->mod);
    int64_t q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t in[LOOM_LORA_N_TARGETS] = {c->dim, c->dim, c->dim, q, c->dim, c->dim, c->hidden_dim};
    int64_t out[LOOM_LORA_N_TARGETS] = {q, kv, kv, c->dim, c->hidden_dim, c->hidden_dim, c->dim};
    for (int l = 0; l < c->n_layers; l++)
        for (int t = 0; t < LOOM_LORA_N_TARGETS; t++) {
            loom_lora_module_t *m = &a->mod[(size_t)l * LOOM_LORA_N_TARGETS + (size_t)t];
            *m = (loom_lora_module_t){.r = r, .scale = 2.0f, .in = in[t], .out = out[t]};
            m->a = loom_xmalloc((size_t)r * (size_t)in[t] * sizeof(float));
            m->b = loom_xmalloc((size_t)out[t] * (size_t)r * sizeof(float));
            for (int64_t i = 0; i < r * in[t]; i++) m->a[i] = frand();
            for (int64_t i = 0; i < r * out[t]; i++) m->b[i] = frand();
            a->n_modules++;
        }
    return a;
}

static void free_adapter(loom_lora_adapter_t *a, int n_mod) {
    for (int i = 0; i < n_mod; i++) {
        free(a->mod[i].a);
        free(a->mod[i].b);
    }
    free(a->mod);
    free(a);
}

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_desc);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Prefills B sequences of P tokens, then times T decode steps of all B; tok/s. */
static double run(loom_backend_t *be, loom_model_t *m, int B, int P, int T, const int32_t *seq_lora, int bps, loom_err_t *err, int *fail) {
    int n = B * P;
    int32_t *tok = loom_xcalloc((size_t)n, sizeof(int32_t)), *pos = loom_xmalloc((size_t)n * sizeof(int32_t));
    int32_t *slots = loom_xmalloc((size_t)n * sizeof(int32_t)), *ts = loom_xmalloc((size_t)n * sizeof(int32_t));
    int32_t *bt = loom_xmalloc((size_t)B * (size_t)bps * sizeof(int32_t)), *rows = loom_xmalloc((size_t)B * sizeof(int32_t));
    for (int s = 0; s < B; s++)
        for (int j = 0; j < bps; j++) bt[s * bps + j] = s * bps + j;
    for (int s = 0; s < B; s++)
        for (int i = 0; i < P; i++) {
            int k = s * P + i;
            tok[k] = 1 + (s * 7 + i) % 100;
            pos[k] = i;
            slots[k] = s * bps * BLOCK + i;
            ts[k] = s;
        }
    for (int s = 0; s < B; s++) rows[s] = s * P + P - 1;
    loom_step_batch_t b = {.n_tokens = n, .tokens = tok, .pos = pos, .slots = slots, .tok_seq = ts, .n_seqs = B,
                           .block_tables = bt, .max_blocks = bps, .n_logits = B, .logit_rows = rows,
                           .seq_lora = seq_lora};
    if (loom_model_forward(m, &b, err) < 0 || loom_backend_synchronize(be, err) < 0) *fail = 1;
    double t0 = loom_now_s();
    for (int t = 0; t < T && !*fail; t++) {
        for (int s = 0; s < B; s++) {
            tok[s] = 1 + (s + t) % 100;
            pos[s] = P + t;
            slots[s] = s * bps * BLOCK + P + t;
            ts[s] = s;
            rows[s] = s;
        }
        b.n_tokens = B;
        if (loom_model_forward(m, &b, err) < 0) *fail = 1;
    }
    if (!*fail && loom_backend_synchronize(be, err) < 0) *fail = 1; /* a device runs the steps asynchronously */
    double dt = loom_now_s() - t0;
    free(tok), free(pos), free(slots), free(ts), free(bt), free(rows);
    return (double)B * T / dt;
}

int main(int argc, char **argv) {
    const char *model = NULL, *batches = "1,8,32", *device = "cpu";
    int threads = 2, rank = 16, P = 32, T = 16, reps = 3;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR", "model directory (config.json, *.safetensors)", 1, 0, NULL},
        {"device", LOOM_OPT_STR, &device, "DEV", "cpu (default) or cuda:N", 1, 0, NULL},
        {"threads", LOOM_OPT_INT, &threads, "N", "CPU threads (default 2)", 1, 1024, NULL},
        {"batches", LOOM_OPT_STR, &batches, "LIST", "decode batch sizes (default 1,8,32)", 1, 0, NULL},
        {"rank", LOOM_OPT_INT, &rank, "R", "adapter rank (default 16)", 1, 512, NULL},
        {"prompt", LOOM_OPT_INT, &P, "N", "prompt tokens per sequence (default 32)", 1, 4096, NULL},
        {"tokens", LOOM_OPT_INT, &T, "N", "decode steps timed (default 16)", 1, 4096, NULL},
        {"reps", LOOM_OPT_INT, &reps, "N", "rounds; medians reported (default 3)", 1, MAX_REPS, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "bench_lora --model DIR [options]",
                           "Decode tokens/s with no adapter, one adapter and 8 adapters mixed in the batch.");
    if (r) return r < 0 ? 2 : 0;
    if (!model) {
        fprintf(stderr, "bench_lora: --model is required\n");
        return 2;
    }
    loom_log_set_level(LOOM_LOG_WARN);
    int bs[16], nb = 0, maxb = 1;
    for (const char *p = batches; *p && nb < 16; p = strchr(p, ',') ? strchr(p, ',') + 1 : p + strlen(p)) {
        bs[nb] = atoi(p);
        if (bs[nb] < 1) return 2;
        if (bs[nb] > maxb) maxb = bs[nb];
        nb++;
    }
    loom_err_t err = {0};
    loom_model_config_t cfg;
    loom_st_t *st = NULL;
    loom_backend_t *be = NULL;
    loom_model_t *m = NULL;
    if (loom_model_config_load(model, &cfg, &err) < 0 || loom_st_open_dir(model, &st, &err) < 0) goto fail;
    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .n_threads = threads,
                                .weight_dtype = LOOM_DT_F32};
    if (!loom_device_parse(device, &bc.kind, &bc.device_index)) {
        fprintf(stderr, "bench_lora: unknown device '%s' (use cpu or cuda:N)\n", device);
        return 2;
    }
    if (loom_backend_create(&bc, &be, &err) < 0) goto fail;
    loom_shard_spec_t spec = {.tp_size = 1, .layer_end = cfg.n_layers, .has_embed = 1, .has_head = 1};
    loom_model_options_t mo = {.max_tokens = maxb * P, .max_seqs = maxb, .max_logits = maxb,
                               .decode_buckets = -1, .max_loras = N_ADAPTERS, .max_lora_rank = rank};
    if (loom_model_load(be, &cfg, st, &spec, &mo, &m, &err) < 0) goto fail;
    int bps = (P + T + BLOCK - 1) / BLOCK;
    if (loom_model_alloc_kv(m, maxb * bps, BLOCK, &err) < 0) goto fail;
    size_t lora_bytes = 0;
    for (int s = 0; s < N_ADAPTERS; s++) {
        loom_lora_adapter_t *a = random_adapter(&cfg, rank);
        loom_lora_prepared_t *p = NULL;
        if (loom_model_lora_prepare(m, a, &p, &err) < 0 || loom_model_lora_install(m, s, p, &err) < 0) goto fail;
        lora_bytes = loom_lora_prepared_bytes(p);
        loom_lora_prepared_destroy(&p);
        free_adapter(a, cfg.n_layers * LOOM_LORA_N_TARGETS);
    }
    printf("model %s on %s: %.1f MB of matmul weights; adapters rank %d on every linear, %.1f MB each; %d threads\n",
           model, device, (double)loom_model_matmul_bytes(m) / 1e6, rank, (double)lora_bytes / 1e6, threads);
    printf("| batch | base tok/s | 1 adapter tok/s | vs base | 8 adapters tok/s | vs base |\n|---|---|---|---|---|---|\n");
    int32_t *one = loom_xmalloc((size_t)maxb * sizeof(int32_t)), *eight = loom_xmalloc((size_t)maxb * sizeof(int32_t));
    for (int i = 0; i < maxb; i++) one[i] = 0, eight[i] = i % N_ADAPTERS;
    int fail = 0;
    for (int k = 0; k < nb; k++) {
        double v[3][MAX_REPS];
        for (int rep = 0; rep < reps; rep++) {
            v[0][rep] = run(be, m, bs[k], P, T, NULL, bps, &err, &fail);
            v[1][rep] = run(be, m, bs[k], P, T, one, bps, &err, &fail);
            v[2][rep] = run(be, m, bs[k], P, T, eight, bps, &err, &fail);
        }
        if (fail) goto fail;
        double b0 = median(v[0], reps), b1 = median(v[1], reps), b8 = median(v[2], reps);
        printf("| %d | %.1f | %.1f | **%.2f** | %.1f | **%.2f** |\n", bs[k], b0, b1, b1 / b0, b8, b8 / b0);
        fflush(stdout);
    }
    free(one);
    free(eight);
    loom_model_destroy(&m);
    loom_backend_destroy(&be);
    loom_st_close(&st);
    return 0;
fail:
    fprintf(stderr, "bench_lora: %s\n", err.msg);
    return 1;
}
