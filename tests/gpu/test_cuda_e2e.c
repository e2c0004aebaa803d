/* End to end on a real checkpoint: the same steps through worker/model.c on
 * the CPU backend (the reference) and on cuda:0, compared step by step.
 *
 * Three sequences share the steps the way the coordinator would batch them:
 * a chunked prefill next to another prompt, then decodes (one token per
 * sequence: the CUDA graph path, with the block-table stride growing), a new
 * prompt joining mid-way (a mixed step), and decodes again. Blocks come
 * from a shuffled pool. Both backends are fed the CPU's greedy ids (teacher
 * forcing), so one near-tie cannot derail the rest. Each step checks:
 *   - the logits, within a tolerance tied to the weight dtype;
 *   - the greedy id: equal, or a near tie on the CPU's own logits;
 *   - the device sampling against the host reference on the device's own
 *     logits (greedy and Gumbel): exactly the same ids.
 * Passes when at least --tokens decode steps of the first sequence were
 * compared with no real mismatch. Exit 77 without a GPU.
 *
 * Every model family the CPU runs runs here (tests/gpu/run.sh generates a
 * tiny model of each: sliding windows, soft caps, sinks, GeGLU, the clamped
 * SwiGLU, biased experts); --kv int8 puts both sides' caches in int8.
 * --kv-host moves the first sequence's blocks, once its decodes have begun,
 * out to a host arena (loom_backend_host_alloc: pinned on CUDA) and back
 * into blocks no sequence used (the host KV tier's copies, on the transfer
 * stream on CUDA), and its later steps read those: the logits still match.
 * --kv-dir moves them the same way through the directory KV tier
 * (worker/kv_offload.c: files in a temporary directory, the CUDA pool's
 * layer-major blocks through the tier's pinned staging span).
 * DeepSeek (MLA) on both sides: --disable-mla caches decompressed per-head
 * K and V (V rows narrower than K's); --mla-prefill N attends runs of N or
 * more rows (the prefill chunks) decompressed over the latent cache, the
 * context read --mla-chunk tokens at a time (LOOM_MLA_PREFILL_CHUNK) and
 * the chunks merged by their log-sum-exp.
 *
 *   test_cuda_e2e --model DIR [--dtype f32|bf16|f16] [--kv f32|bf16|int8] [--tokens 40] [--kv-host | --kv-dir]
 *                 [--disable-mla] [--mla-prefill N [--mla-chunk C]] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cuda/backend_cuda.h"
#include "worker/kv_offload.h"
#include "worker/model.h"

#define SKIP_CODE 77
#define N_SEQ     3
#define BLOCK     16
#define MAX_STEP  160

typedef struct seq {
    int32_t toks[1024]; /* prompt then generated */
    int n_prompt, n_tok, n_done; /* tokens known, tokens in the cache */
    int active;
    int32_t *blocks;
} seq_t;

typedef struct side {
    loom_backend_t *be;
    loom_model_t *m;
    float *logits;
} side_t;

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

int main(int argc, char **argv) {
    loom_log_init("test_cuda_e2e");
    const char *model = NULL, *dtype = "bf16", *kv = "f32";
    int n_gen = 40, kv_host = 0, kv_dir = 0, mla_disable = 0, mla_prefill = 0, mla_chunk = 0;
    loom_opt_t opts[] = {
        {"disable-mla", LOOM_OPT_FLAG, &mla_disable, NULL, "DeepSeek: decompressed per-head K and V caches", 1, 0,
         NULL},
        {"mla-prefill", LOOM_OPT_INT, &mla_prefill, "N",
         "DeepSeek: runs of N or more rows attend decompressed over the latent cache", 1, 1024, NULL},
        {"mla-chunk", LOOM_OPT_INT, &mla_chunk, "C", "with --mla-prefill: context tokens decompressed at a time", 1,
         4096, NULL},
        {"kv-dir", LOOM_OPT_FLAG, &kv_dir, NULL,
         "move the first sequence's blocks through the directory KV tier into fresh blocks after step 8", 1, 0, NULL},
        {"kv-host", LOOM_OPT_FLAG, &kv_host, NULL,
         "move the first sequence's blocks through a host arena into fresh blocks after step 8", 1, 0, NULL},
        {"model", LOOM_OPT_STR, &model, "DIR", "checkpoint directory", 1, 0, NULL},
        {"dtype", LOOM_OPT_STR, &dtype, "TYPE", "weights on both backends: f32 (exact on the GPU too), bf16, f16", 1,
         0, NULL},
        {"kv", LOOM_OPT_STR, &kv, "TYPE", "KV cache of both backends: f32 (default), bf16 or int8", 1, 0, NULL},
        {"tokens", LOOM_OPT_INT, &n_gen, "N", "decode steps of the first sequence to compare (default 40)", 32, 150,
         NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "test_cuda_e2e --model DIR [options]",
                           "The forward pass on cuda:0 against the CPU backend, step by step.");
    if (r) return r < 0 ? 2 : 0;
    if (!model) {
        fprintf(stderr, "test_cuda_e2e: --model is required\n");
        return 2;
    }
    if (!loom_backend_available(LOOM_DEVICE_CUDA, 0)) {
        printf("skipped: no GPU\n");
        return SKIP_CODE;
    }
    loom_dtype_t dt = !strcmp(dtype, "f32") ? LOOM_DT_F32 : !strcmp(dtype, "f16") ? LOOM_DT_F16 : LOOM_DT_BF16;
    loom_dtype_t kv_dt;
    if (!loom_kv_dtype_parse(kv, &kv_dt) || kv_dt == LOOM_DT_F8_E4M3) { /* the CPU side has no fp8 cache */
        fprintf(stderr, "test_cuda_e2e: --kv %s: f32, bf16 or int8\n", kv);
        return 2;
    }
    if (mla_chunk) { /* read by both models at their first decompressed prefill */
        char v[16];
        snprintf(v, sizeof v, "%d", mla_chunk);
        setenv("LOOM_MLA_PREFILL_CHUNK", v, 1);
    }
    loom_log_set_level(LOOM_LOG_WARN);
    loom_err_t err = {0};
    loom_model_config_t cfg;
    loom_st_t *st = NULL;
    if (loom_model_config_load(model, &cfg, &err) < 0 || loom_st_open_dir(model, &st, &err) < 0) {
        fprintf(stderr, "test_cuda_e2e: %s\n", err.msg);
        return 1;
    }
    const int vocab = cfg.vocab_size;
    seq_t seqs[N_SEQ];
    memset(seqs, 0, sizeof seqs);
    const int prompt_len[N_SEQ] = {33, 13, 7};
    for (int s = 0; s < N_SEQ; s++) {
        seqs[s].n_prompt = seqs[s].n_tok = prompt_len[s];
        for (int i = 0; i < prompt_len[s]; i++) seqs[s].toks[i] = 3 + (int32_t)((i * 7919u + (unsigned)s * 104729u) % (unsigned)(vocab - 3));
    }
    const int ctx = 33 + n_gen + 8;
    if (ctx > cfg.max_seq_len) {
        fprintf(stderr, "test_cuda_e2e: the model's context (%d) is shorter than %d\n", cfg.max_seq_len, ctx);
        return 1;
    }
    /* a shuffled block pool shared by the sequences */
    const int per_seq = (ctx + BLOCK - 1) / BLOCK, n_blocks = N_SEQ * per_seq + 2;
    const int n_alloc = n_blocks + (kv_host || kv_dir ? per_seq : 0); /* --kv-host/--kv-dir: the blocks it loads into */
    int32_t *pool = loom_xmalloc((size_t)n_blocks * sizeof *pool);
    for (int i = 0; i < n_blocks; i++) pool[i] = (i * 37 + 5) % n_blocks;
    for (int s = 0; s < N_SEQ; s++) seqs[s].blocks = pool + s * per_seq;

    side_t sides[2];
    loom_shard_spec_t spec = {.tp_rank = 0, .tp_size = 1, .layer_begin = 0, .layer_end = cfg.n_layers,
                              .has_embed = 1, .has_head = 1};
    /* room for one more row: the device pads decodes of 3 sequences to its bucket of 4 */
    loom_model_options_t mo = {.max_tokens = 128, .max_seqs = N_SEQ + 1, .max_logits = N_SEQ + 1,
                               .kv_dtype = kv_dt, .mla_disable = mla_disable, .mla_prefill_rows = mla_prefill};
    for (int k = 0; k < 2; k++) {
        loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION,
                                    .kind = k ? LOOM_DEVICE_CUDA : LOOM_DEVICE_CPU,
                                    .weight_dtype = dt, .exact_f32 = 1};
        if (loom_backend_create(&bc, &sides[k].be, &err) < 0 ||
            loom_model_load(sides[k].be, &cfg, st, &spec, &mo, &sides[k].m, &err) < 0 ||
            loom_model_alloc_kv(sides[k].m, n_alloc, BLOCK, &err) < 0) {
            fprintf(stderr, "test_cuda_e2e: %s: %s\n", k ? "cuda" : "cpu", err.msg);
            return 1;
        }
        sides[k].logits = loom_xmalloc((size_t)N_SEQ * vocab * sizeof(float));
        if (mla_prefill && loom_model_mla_prefill_rows(sides[k].m) != mla_prefill) {
            fprintf(stderr, "test_cuda_e2e: FAIL: %s keeps the absorbed prefill (--mla-prefill %d not taken)\n",
                    k ? "cuda" : "cpu", mla_prefill);
            return 1;
        }
    }

    const double rel = dt == LOOM_DT_F32 ? 2e-3 : 3e-2, abs_tol = dt == LOOM_DT_F32 ? 1e-3 : 1e-2;
    int32_t tokens[128], pos[128], slots[128], tok_seq[128], rows[N_SEQ], which[N_SEQ];
    int32_t bt[N_SEQ * 64];
    int32_t cand_ids[2][N_SEQ][1024];
    float cand_keys[2][N_SEQ][1024];
    int compared = 0, flips = 0, bad = 0, bad_logits = 0, bad_sampling = 0, a_decodes = 0, steps = 0, padded = 0;
    int moved = 0;
    double worst = 0, worst_rel = 0;
    seqs[0].active = seqs[1].active = 1;
    for (int step = 0; step < MAX_STEP && a_decodes < n_gen; step++) {
        if (step == 5) seqs[2].active = 1; /* a prompt joins the decodes: a mixed step */
        if (kv_host && step == 8) { /* the host tier's round trip: saves, then loads into fresh blocks */
            int nb = (seqs[0].n_done + BLOCK - 1) / BLOCK;
            for (int k = 0; k < 2; k++) {
                size_t span = loom_model_kv_block_bytes(sides[k].m, BLOCK);
                char *arena = loom_backend_host_alloc(sides[k].be, span * (size_t)nb);
                if (!arena) {
                    fprintf(stderr, "test_cuda_e2e: no host memory for %d blocks\n", nb);
                    return 1;
                }
                loom_backend_xfer_begin(sides[k].be);
                for (int j = 0; j < nb; j++)
                    loom_model_kv_block_xfer(sides[k].m, seqs[0].blocks[j], arena + (size_t)j * span, 1);
                for (int j = 0; j < nb; j++)
                    loom_model_kv_block_xfer(sides[k].m, n_blocks + j, arena + (size_t)j * span, 0);
                loom_backend_xfer_end(sides[k].be);
                loom_backend_host_free(sides[k].be, arena);
            }
            for (int j = 0; j < nb; j++) seqs[0].blocks[j] = n_blocks + j;
            moved = nb;
        }
        if (kv_dir && step == 8) { /* the directory tier's round trip: files, then loads into fresh blocks */
            int nb = (seqs[0].n_done + BLOCK - 1) / BLOCK;
            char dir[] = "/tmp/loom_e2e_kvdir_XXXXXX";
            if (!mkdtemp(dir)) {
                fprintf(stderr, "test_cuda_e2e: no temporary directory\n");
                return 1;
            }
            int32_t fresh[64];
            uint64_t hashes[64];
            if (nb > 64) {
                fprintf(stderr, "test_cuda_e2e: %d blocks to move, at most 64\n", nb);
                return 1;
            }
            for (int j = 0; j < nb; j++) fresh[j] = n_blocks + j, hashes[j] = 0x100 + (uint64_t)j;
            for (int k = 0; k < 2; k++) {
                loom_kv_offload_t o = {0};
                loom_err_t e = {0};
                if (loom_kv_offload_config(&o, sides[k].be, sides[k].m, dir, 0xe2e, 1ull << 34, k, &e) < 0 ||
                    loom_kv_offload_step(&o, sides[k].m, seqs[0].blocks, hashes, (size_t)nb, fresh, hashes,
                                         (size_t)nb, &e) < 0 ||
                    loom_kv_offload_finish(&o, &e) < 0) {
                    fprintf(stderr, "test_cuda_e2e: the directory tier's round trip failed: %s\n", e.msg);
                    return 1;
                }
                loom_kv_offload_free(&o);
            }
            char cmd[128];
            snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
            if (system(cmd) != 0) fprintf(stderr, "test_cuda_e2e: could not remove %s\n", dir);
            for (int j = 0; j < nb; j++) seqs[0].blocks[j] = n_blocks + j;
            moved = nb;
        }
        /* plan: sequence 0 prefills in two chunks (20, then the rest); others in one */
        int n = 0, n_seqs = 0, n_logits = 0, max_blocks = 1;
        for (int s = 0; s < N_SEQ; s++) {
            seq_t *q = &seqs[s];
            if (!q->active) continue;
            int take = q->n_tok - q->n_done;
            if (s == 0 && q->n_done == 0) take = 20;
            for (int i = 0; i < take; i++) {
                int p = q->n_done + i;
                tokens[n] = q->toks[p];
                pos[n] = p;
                slots[n] = q->blocks[p / BLOCK] * BLOCK + p % BLOCK;
                tok_seq[n] = n_seqs;
                n++;
            }
            q->n_done += take;
            max_blocks = LOOM_MAX(max_blocks, (q->n_done + BLOCK - 1) / BLOCK);
            if (q->n_done == q->n_tok) {
                rows[n_logits] = n - 1;
                which[n_logits++] = s;
            }
            n_seqs++;
        }
        for (int s = 0, row = 0; s < N_SEQ; s++) {
            if (!seqs[s].active) continue;
            for (int j = 0; j < max_blocks; j++) bt[row * max_blocks + j] = j < per_seq ? seqs[s].blocks[j] : -1;
            row++;
        }
        loom_step_batch_t b = {.n_tokens = n, .tokens = tokens, .pos = pos, .slots = slots, .tok_seq = tok_seq,
                               .n_seqs = n_seqs, .block_tables = bt, .max_blocks = max_blocks,
                               .n_logits = n_logits, .logit_rows = rows};
        loom_sampling_t greedy[N_SEQ], gumbel[N_SEQ];
        uint64_t st_idx[N_SEQ];
        loom_sample_part_t parts[2][2][N_SEQ]; /* side, greedy/gumbel, row */
        for (int k = 0; k < 2; k++) {
            if (loom_model_forward(sides[k].m, &b, &err) < 0) {
                fprintf(stderr, "test_cuda_e2e: step %d on %s: %s\n", step, k ? "cuda" : "cpu", err.msg);
                return 1;
            }
            loom_model_download_logits(sides[k].m, sides[k].logits, n_logits);
        }
        padded += loom_model_last_pad(sides[1].m) > 0;
        steps++;
        for (int i = 0; i < n_logits; i++) {
            greedy[i] = (loom_sampling_t){.temperature = 0};
            gumbel[i] = (loom_sampling_t){.temperature = 0.8f, .seed = 1234 + (uint64_t)which[i]};
            st_idx[i] = (uint64_t)(seqs[which[i]].n_tok - seqs[which[i]].n_prompt);
        }
        /* device sampling (on the device's logits) against the reference on the same logits */
        for (int mode = 0; mode < 2; mode++) {
            const loom_sampling_t *sp = mode ? gumbel : greedy;
            for (int i = 0; i < n_logits; i++)
                for (int k = 0; k < 2; k++)
                    parts[k][mode][i] = (loom_sample_part_t){.ids = cand_ids[k][i], .keys = cand_keys[k][i]};
            loom_model_sample_parts(sides[1].m, n_logits, sp, st_idx, parts[1][mode]);
            for (int i = 0; i < n_logits; i++) {
                loom_sample_shard(sides[1].logits + (size_t)i * vocab, vocab, 0, vocab, &sp[i], st_idx[i], 1,
                                  &parts[0][mode][i]);
                int32_t g = loom_sample_merge(&parts[1][mode][i], 1, vocab, &sp[i], st_idx[i]);
                int32_t h = loom_sample_merge(&parts[0][mode][i], 1, vocab, &sp[i], st_idx[i]);
                if (g != h) {
                    bad_sampling++;
                    fprintf(stderr, "  step %d row %d: device %s sampling gave %d, the reference %d\n", step, i,
                            mode ? "gumbel" : "greedy", g, h);
                }
            }
        }
        for (int i = 0; i < n_logits; i++) {
            const float *lc = sides[0].logits + (size_t)i * vocab, *lg = sides[1].logits + (size_t)i * vocab;
            double mx = 0, d = 0;
            for (int v = 0; v < vocab; v++) {
                mx = fmax(mx, fabs((double)lc[v]));
                d = fmax(d, fabs((double)lg[v] - lc[v]));
            }
            worst = fmax(worst, d);
            worst_rel = fmax(worst_rel, d / fmax(mx, 1e-6));
            double tol = abs_tol + rel * mx;
            if (d > tol) {
                bad_logits++;
                fprintf(stderr, "  step %d row %d: logits differ by %.4g (tolerance %.4g, max |logit| %.3g)\n", step,
                        i, d, tol, mx);
            }
            int ic = argmax(lc, vocab), ig = argmax(lg, vocab);
            compared++;
            if (ic != ig) {
                double gap = (double)lc[ic] - lc[ig];
                if (gap <= 2 * tol) {
                    flips++;
                    fprintf(stderr, "  step %d row %d: near tie: cpu %d, cuda %d (gap %.3g)\n", step, i, ic, ig, gap);
                } else {
                    bad++;
                    fprintf(stderr, "  step %d row %d: MISMATCH: cpu %d, cuda %d (gap %.3g)\n", step, i, ic, ig, gap);
                }
            }
            seq_t *q = &seqs[which[i]];
            q->toks[q->n_tok++] = ic; /* teacher forcing: both continue with the CPU's id */
            if (which[i] == 0 && q->n_tok - q->n_prompt > 1) a_decodes++;
        }
    }
    uint64_t rec = 0, rep = 0;
    loom_cuda_graph_stats(sides[1].be, &rec, &rep);
    printf("e2e %s (%s, kv %s%s%s): %d steps, %d ids compared, %d mismatches, %d near-tie flips, %d sampling "
           "mismatches, max |dlogit| %.3g (%.2g of max |logit|), graphs recorded %llu replayed %llu, "
           "%d steps padded%s\n",
           model, dtype, kv, mla_disable ? ", MLA decompressed" : "",
           mla_prefill ? ", MLA prefill decompressed" : "", steps, compared, bad, flips, bad_sampling, worst, worst_rel,
           (unsigned long long)rec, (unsigned long long)rep, padded,
           !moved ? "" : kv_dir ? ", blocks moved through the directory tier" : ", blocks moved through host memory");
    int ok = bad == 0 && bad_logits == 0 && bad_sampling == 0 && a_decodes >= n_gen && rep > 0 && padded > 0 &&
             (!(kv_host || kv_dir) || moved > 0);
    if (!ok)
        fprintf(stderr, "test_cuda_e2e: FAIL (%d decode steps of sequence 0, %d logit rows out of tolerance%s%s)\n",
                a_decodes, bad_logits, rep > 0 ? "" : ", no graph replayed",
                padded > 0 ? "" : ", no decode step padded");
    for (int k = 0; k < 2; k++) {
        loom_model_destroy(&sides[k].m);
        loom_backend_destroy(&sides[k].be);
        free(sides[k].logits);
    }
    loom_st_close(&st);
    free(pool);
    return ok ? 0 : 1;
}
