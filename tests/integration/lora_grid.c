/* A TP x PP grid of one model in one process, for test_lora.py: every cell
 * loads its shard (with a LoRA adapter in engine slot 0 when one is given),
 * the TP ranks of a stage run on threads whose all-reduce is a barrier and
 * a sum, the stages hand the hidden states on, and the last stage's vocab
 * shards are merged for a greedy pick. Prints the generated ids, so a
 * sharded adapter can be compared with the merged weights on one shard.
 *
 *   lora_grid MODEL_DIR TP PP N_TOKENS PROMPT [ADAPTER_DIR [MAX_RANK]] */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"
#include "common/util.h"
#include "worker/model.h"

#define BLOCK 16
#define MAX_TP 8

typedef struct grid grid_t;

typedef struct cell {
    grid_t *g;
    int tp;
    loom_backend_t *be;
    loom_model_t *m;
    loom_status_t s;
    loom_err_t err;
} cell_t;

struct grid {
    int tp, pp;
    pthread_barrier_t bar;
    float *sum;             /* the all-reduce's buffer */
    int64_t sum_cap;        /* its floats */
    float *parts[MAX_TP];   /* each rank's contribution */
    const loom_step_batch_t *b;
    cell_t *stage;          /* the stage running */
};

/* Every rank posts its buffer; rank 0 sums in rank order; all copy the sum. */
static loom_status_t allreduce(void *ctx, float *buf, int64_t n, loom_err_t *err) {
    cell_t *c = ctx;
    grid_t *g = c->g;
    if (n > g->sum_cap) return loom_err_set(err, LOOM_ERR_INTERNAL, "all-reduce of %lld floats", (long long)n);
    g->parts[c->tp] = buf;
    pthread_barrier_wait(&g->bar);
    if (c->tp == 0) {
        for (int64_t i = 0; i < n; i++) {
            float acc = 0;
            for (int r = 0; r < g->tp; r++) acc += g->parts[r][i];
            g->sum[i] = acc;
        }
    }
    pthread_barrier_wait(&g->bar);
    memcpy(buf, g->sum, (size_t)n * sizeof(float));
    pthread_barrier_wait(&g->bar);
    return LOOM_OK;
}

static void *run_cell(void *p) {
    cell_t *c = p;
    c->s = loom_model_forward(c->m, c->g->b, &c->err);
    return NULL;
}

static int die(const char *what, const loom_err_t *e) {
    fprintf(stderr, "error: %s: %s\n", what, e->msg);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: lora_grid MODEL_DIR TP PP N_TOKENS PROMPT [ADAPTER_DIR [MAX_RANK]]\n");
        return 2;
    }
    const char *dir = argv[1], *lora = argc > 6 ? argv[6] : NULL;
    int tp = atoi(argv[2]), pp = atoi(argv[3]), ntok = atoi(argv[4]);
    int max_rank = argc > 7 ? atoi(argv[7]) : 16;
    if (tp < 1 || tp > MAX_TP || pp < 1 || ntok < 1) return 2;
    loom_err_t err = {0};
    loom_model_config_t cfg;
    loom_st_t *st = NULL;
    loom_tokenizer_t *tok = NULL;
    if (loom_model_config_load(dir, &cfg, &err) < 0 || loom_st_open_dir(dir, &st, &err) < 0 ||
        loom_model_map_tensor_names(&cfg, st, &err) < 0 || loom_tokenizer_load(dir, &tok, &err) < 0)
        return die(dir, &err);
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    if (loom_tokenizer_encode(tok, argv[5], strlen(argv[5]), 1, 0, &ids, &n_ids, &cap, &err) < 0)
        return die("prompt", &err);
    const int ctx = n_ids + ntok + 1, max_blocks = (ctx + BLOCK - 1) / BLOCK;

    grid_t g = {.tp = tp, .pp = pp};
    pthread_barrier_init(&g.bar, NULL, (unsigned)tp);
    g.sum_cap = (int64_t)ctx * (cfg.dim > cfg.hidden_dim ? cfg.dim : cfg.hidden_dim);
    g.sum = loom_xmalloc((size_t)g.sum_cap * sizeof(float));
    cell_t *cells = loom_xcalloc((size_t)(tp * pp), sizeof *cells);
    loom_lora_adapter_t *ad = NULL;
    for (int s = 0; s < pp; s++) {
        int lb, ln;
        loom_split_range(cfg.n_layers, pp, s, &lb, &ln);
        if (lora && loom_lora_load(lora, &cfg, max_rank, lb, lb + ln, &ad, &err) < 0) return die(lora, &err);
        for (int r = 0; r < tp; r++) {
            cell_t *c = &cells[s * tp + r];
            c->g = &g;
            c->tp = r;
            loom_shard_spec_t spec = {.tp_rank = r, .tp_size = tp, .layer_begin = lb, .layer_end = lb + ln,
                                      .has_embed = s == 0, .has_head = s == pp - 1};
            loom_model_options_t mo = {.max_tokens = ctx, .max_seqs = 1, .max_logits = 1, .decode_buckets = -1,
                                       .allreduce = allreduce, .allreduce_ctx = c, .max_loras = lora ? 2 : 0,
                                       .max_lora_rank = max_rank};
            loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .n_threads = 1,
                                        .weight_dtype = LOOM_DT_F32};
            if (loom_backend_create(&bc, &c->be, &err) < 0 ||
                loom_model_load(c->be, &cfg, st, &spec, &mo, &c->m, &err) < 0 ||
                loom_model_alloc_kv(c->m, max_blocks, BLOCK, &err) < 0)
                return die("shard", &err);
            if (ad) { /* slot 1: slot 0 stays empty, so the table's stride is exercised */
                loom_lora_prepared_t *prep = NULL;
                if (loom_model_lora_prepare(c->m, ad, &prep, &err) < 0 ||
                    loom_model_lora_install(c->m, 1, prep, &err) < 0)
                    return die(lora, &err);
                loom_lora_prepared_destroy(&prep);
            }
        }
        loom_lora_destroy(&ad);
    }

    int32_t *tokens = loom_xmalloc((size_t)ctx * sizeof(int32_t)), *pos = loom_xmalloc((size_t)ctx * sizeof(int32_t));
    int32_t *tok_seq = loom_xcalloc((size_t)ctx, sizeof(int32_t)), *bt = loom_xmalloc((size_t)max_blocks * sizeof(int32_t));
    for (int i = 0; i < max_blocks; i++) bt[i] = i;
    memcpy(tokens, ids, (size_t)n_ids * sizeof(int32_t));
    int n = n_ids, p0 = 0, vocab = cfg.vocab_size;
    int32_t seq_slot = lora ? 1 : -1;
    float *logits = loom_xmalloc((size_t)vocab * sizeof(float));
    for (int step = 0; step < ntok; step++) {
        for (int i = 0; i < n; i++) pos[i] = p0 + i;
        int32_t row = n - 1;
        loom_step_batch_t b = {.n_tokens = n, .tokens = tokens + p0, .pos = pos, .slots = pos, .tok_seq = tok_seq,
                               .n_seqs = 1, .block_tables = bt, .max_blocks = max_blocks, .n_logits = 1,
                               .logit_rows = &row, .seq_lora = lora ? &seq_slot : NULL};
        g.b = &b;
        for (int s = 0; s < pp; s++) {
            cell_t *stage = &cells[s * tp];
            if (s > 0) /* the previous stage's output is this stage's input, on every rank */
                for (int r = 0; r < tp; r++)
                    memcpy(loom_model_hidden(stage[r].m), loom_model_hidden(cells[(s - 1) * tp].m),
                           (size_t)n * (size_t)cfg.dim * sizeof(float));
            pthread_t th[MAX_TP];
            for (int r = 0; r < tp; r++) pthread_create(&th[r], NULL, run_cell, &stage[r]);
            for (int r = 0; r < tp; r++) pthread_join(th[r], NULL);
            for (int r = 0; r < tp; r++)
                if (stage[r].s < 0) return die("forward", &stage[r].err);
        }
        for (int r = 0; r < tp; r++) { /* the vocab shards of the last stage */
            loom_model_t *m = cells[(pp - 1) * tp + r].m;
            const loom_shard_dims_t *d = loom_model_dims(m);
            loom_model_download_logits(m, logits + d->vocab_begin, 1);
        }
        int best = 0;
        for (int v = 1; v < vocab; v++)
            if (logits[v] > logits[best]) best = v;
        printf("%s%d", step ? " " : "", best);
        p0 += n;
        tokens[p0] = best;
        n = 1;
    }
    printf("\n");
    for (int i = 0; i < tp * pp; i++) {
        loom_model_destroy(&cells[i].m);
        loom_backend_destroy(&cells[i].be);
    }
    free(cells);
    free(g.sum);
    free(tokens);
    free(pos);
    free(tok_seq);
    free(bt);
    free(logits);
    free(ids);
    pthread_barrier_destroy(&g.bar);
    loom_tokenizer_destroy(&tok);
    loom_st_close(&st);
    return 0;
}
