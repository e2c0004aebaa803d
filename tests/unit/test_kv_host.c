/* The host-memory KV tier's worker half (worker/kv_host.c) on the CPU
 * backend with stories260K, in both pool layouts (block-contiguous and
 * layer-major, as the CUDA pool is) and f32 and int8 caches: a prompt's
 * blocks saved into host slots and loaded into other blocks hold the same
 * bytes, and a decode step reading the loaded blocks gives the same logits
 * as one reading the originals; a load naming a slot that holds another
 * block, a slot out of range and moves without a tier are refused; with
 * the directory below (test_spill), a slot written down to it before a
 * later save of the step reuses the slot, both loaded back in one step
 * (one from the directory, one from the slot), and the same moves in the
 * other order refused; the directory tier's loads layer by layer
 * (test_dir_layer_loads). */
#include "worker/kv_host.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kv_tier.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "tests/test.h"

enum { BS = 16, NB = 8, PROMPT = 40 };

static loom_model_config_t g_cfg;
static loom_st_t *g_st;

/* stories260K on the CPU backend with a pool of NB blocks of BS tokens,
 * block-contiguous or layer-major, with this KV dtype (NULL: failed). */
static loom_model_t *open_model(loom_backend_t **be, int layer_major, loom_dtype_t kv) {
    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CPU,
                                .weight_dtype = LOOM_DT_F32, .n_threads = 1};
    loom_shard_spec_t spec = {.tp_rank = 0, .tp_size = 1, .layer_begin = 0, .layer_end = g_cfg.n_layers,
                              .has_embed = 1, .has_head = 1};
    loom_model_options_t mo = {.max_tokens = PROMPT, .max_seqs = 1, .max_logits = 1, .kv_dtype = kv,
                               .kv_layer_major = layer_major};
    loom_model_t *m = NULL;
    loom_err_t err = {0};
    CHECKF(loom_backend_create(&bc, be, &err) == LOOM_OK, "%s", err.msg);
    CHECKF(loom_model_load(*be, &g_cfg, g_st, &spec, &mo, &m, &err) == LOOM_OK, "%s", err.msg);
    CHECKF(loom_model_alloc_kv(m, NB, BS, &err) == LOOM_OK, "%s", err.msg);
    return m;
}

/* One step of n tokens at positions from p0 through the block table bt. */
static void step(loom_model_t *m, const int32_t *toks, int n, int p0, const int32_t *bt, int nbt, float *logits) {
    int32_t pos[PROMPT], slots[PROMPT], seq[PROMPT] = {0}, row = n - 1;
    for (int i = 0; i < n; i++) {
        pos[i] = p0 + i;
        slots[i] = bt[pos[i] / BS] * BS + pos[i] % BS;
    }
    loom_step_batch_t b = {.n_tokens = n, .tokens = toks, .pos = pos, .slots = slots, .tok_seq = seq, .n_seqs = 1,
                           .block_tables = bt, .max_blocks = nbt, .n_logits = 1, .logit_rows = &row};
    loom_err_t err = {0};
    CHECKF(loom_model_forward(m, &b, &err) == LOOM_OK, "%s", err.msg);
    loom_model_download_logits(m, logits, 1);
}

/* The prompt (PROMPT tokens of a fixed pattern) run through block table bt. */
static void prefill(loom_model_t *m, const int32_t *bt, float *logits) {
    int32_t toks[PROMPT];
    for (int i = 0; i < PROMPT; i++) toks[i] = 1 + (i * 37) % (g_cfg.vocab_size - 1);
    step(m, toks, PROMPT, 0, bt, 3, logits);
}

static void rm_tree(const char *dir) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

static void round_trip(int layer_major, loom_dtype_t kv) {
    loom_backend_t *be = NULL;
    loom_err_t err = {0};
    loom_model_t *m = open_model(&be, layer_major, kv);
    if (!m) return;
    CHECK(loom_model_kv_block_contiguous(m) == !layer_major);
    const int vocab = g_cfg.vocab_size;
    float *a = malloc((size_t)vocab * sizeof *a), *b = malloc((size_t)vocab * sizeof *b);
    int32_t orig[3] = {2, 5, 7}, moved[3] = {0, 1, 3};
    prefill(m, orig, a);

    loom_kv_host_t h = {0};
    CHECKF(loom_kv_host_config(&h, be, m, 4, &err) == LOOM_OK, "%s", err.msg);
    uint64_t hashes[3] = {0x11, 0x22, 0x33};
    int32_t slots[3] = {3, 0, 2};
    CHECKF(loom_kv_host_step(&h, m, NULL, orig, hashes, slots, 3, moved, hashes, slots, 3, &err) == LOOM_OK, "%s",
           err.msg);
    /* the same bytes in the loaded blocks as in the originals */
    size_t span = loom_model_kv_block_bytes(m, BS);
    char *x = malloc(span), *y = malloc(span);
    int same = 1, nonzero = 0;
    for (int i = 0; i < 3; i++) {
        loom_model_kv_block_xfer(m, orig[i], x, 1);
        loom_model_kv_block_xfer(m, moved[i], y, 1);
        same &= !memcmp(x, y, span);
        for (size_t j = 0; j < span; j++) nonzero |= x[j] != 0;
    }
    CHECK(same && nonzero);
    /* a decode step over the loaded blocks: the logits of one over the originals */
    int32_t next = 7;
    step(m, &next, 1, PROMPT, orig, 3, a);
    step(m, &next, 1, PROMPT, moved, 3, b);
    CHECK(!memcmp(a, b, (size_t)vocab * sizeof *a));
    /* refusals: a slot holding another block, a slot out of range, no tier */
    uint64_t wrong = 0x22;
    int32_t blk = 4, slot = 3, far = 9;
    CHECK(loom_kv_host_step(&h, m, NULL, NULL, NULL, NULL, 0, &blk, &wrong, &slot, 1, &err) == LOOM_ERR_FORMAT &&
          strstr(err.msg, "host slot 3"));
    CHECK(loom_kv_host_step(&h, m, NULL, &blk, &wrong, &far, 1, NULL, NULL, NULL, 0, &err) == LOOM_ERR_FORMAT);
    /* a save and a load of one slot in one step: the load reads what the save wrote */
    CHECK(loom_kv_host_step(&h, m, NULL, &blk, &wrong, &slot, 1, &blk, &wrong, &slot, 1, &err) == LOOM_OK);
    loom_kv_host_free(&h);
    CHECK(loom_kv_host_step(&h, m, NULL, &blk, &wrong, &slot, 1, NULL, NULL, NULL, 0, &err) ==
          LOOM_ERR_INVALID_ARGUMENT);
    free(x);
    free(y);
    free(a);
    free(b);
    loom_model_destroy(&m);
    loom_backend_destroy(&be);
}

/* Whether blocks a and b of m hold the same bytes (and a some nonzero). */
static int same_block(loom_model_t *m, int a, int b) {
    size_t span = loom_model_kv_block_bytes(m, BS);
    char *x = malloc(span), *y = malloc(span);
    loom_model_kv_block_xfer(m, a, x, 1);
    loom_model_kv_block_xfer(m, b, y, 1);
    int nonzero = 0;
    for (size_t j = 0; j < span; j++) nonzero |= x[j] != 0;
    int same = nonzero && !memcmp(x, y, span);
    free(x);
    free(y);
    return same;
}

static void spill(int layer_major) {
    loom_backend_t *be = NULL;
    loom_err_t err = {0};
    loom_model_t *m = open_model(&be, layer_major, LOOM_DT_F32);
    if (!m) return;
    float *logits = malloc((size_t)g_cfg.vocab_size * sizeof *logits);
    int32_t orig[3] = {2, 5, 7};
    prefill(m, orig, logits);
    char dir[] = "/tmp/loom_kv_spill_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    loom_kv_offload_t o = {0};
    CHECKF(loom_kv_offload_config(&o, be, m, dir, 0x77, 1ull << 30, 0, &err) == LOOM_OK, "%s", err.msg);
    loom_kv_host_t h = {0};
    CHECKF(loom_kv_host_config(&h, be, m, 1, &err) == LOOM_OK, "%s", err.msg);
    /* block 2 (0xA) into the only slot */
    int32_t blk0 = 2, slot0 = 0;
    uint64_t ha = 0xA, hb = 0xB;
    CHECKF(loom_kv_host_step(&h, m, &o, &blk0, &ha, &slot0, 1, NULL, NULL, NULL, 0, &err) == LOOM_OK, "%s", err.msg);
    /* the other order first: block 5 (0xB) into the slot, then the slot's
     * 0xA down to the directory: refused (the slot holds 0xB by then) */
    int32_t bad_blocks[2] = {5, -1}, bad_slots[2] = {0, 0};
    uint64_t bad_hashes[2] = {0xB, 0xA};
    CHECK(loom_kv_host_step(&h, m, &o, bad_blocks, bad_hashes, bad_slots, 2, NULL, NULL, NULL, 0, &err) ==
              LOOM_ERR_FORMAT &&
          strstr(err.msg, "holds"));
    /* the plan's order: 0xA written down from the slot, then 0xB into it;
     * loads: 0xA from the directory into block 0, 0xB from the slot into 1 */
    int32_t save_blocks[2] = {-1, 5}, save_slots[2] = {0, 0};
    uint64_t save_hashes[2] = {0xA, 0xB};
    int32_t load_blocks[2] = {0, 1}, load_slots[2] = {-1, 0};
    uint64_t load_hashes[2] = {0xA, 0xB};
    CHECKF(loom_kv_host_step(&h, m, &o, save_blocks, save_hashes, save_slots, 2, load_blocks, load_hashes, load_slots,
                             2, &err) == LOOM_OK,
           "%s", err.msg);
    CHECK(same_block(m, 2, 0) && same_block(m, 5, 1));
    CHECK(h.hash[0] == hb);
    /* a pool block straight to the directory (no slot free of pins), loaded back */
    int32_t blk7 = 7, blk3 = 3, lower = -1;
    uint64_t hc = 0xC;
    CHECKF(loom_kv_host_step(&h, m, &o, &blk7, &hc, &lower, 1, &blk3, &hc, &lower, 1, &err) == LOOM_OK, "%s",
           err.msg);
    CHECK(same_block(m, 7, 3));
    /* no slots (a size that holds no block) over the directory: its moves still run */
    loom_kv_host_t none = {0};
    int32_t blk2 = 2, blk6 = 6;
    uint64_t hd = 0xD;
    CHECKF(loom_kv_host_step(&none, m, &o, &blk2, &hd, &lower, 1, &blk6, &hd, &lower, 1, &err) == LOOM_OK, "%s",
           err.msg);
    CHECK(same_block(m, 2, 6));
    CHECK(loom_kv_host_step(&none, m, &o, &blk2, &hd, &slot0, 1, NULL, NULL, NULL, 0, &err) == LOOM_ERR_FORMAT);
    /* without a directory: the spill and the directory load are refused */
    CHECK(loom_kv_host_step(&h, m, NULL, save_blocks, save_hashes, save_slots, 1, NULL, NULL, NULL, 0, &err) ==
          LOOM_ERR_FORMAT);
    CHECK(loom_kv_host_step(&h, m, NULL, NULL, NULL, NULL, 0, load_blocks, load_hashes, load_slots, 1, &err) ==
          LOOM_ERR_FORMAT);
    loom_kv_host_free(&h);
    loom_kv_offload_free(&o);
    rm_tree(dir);
    free(logits);
    loom_model_destroy(&m);
    loom_backend_destroy(&be);
}

/* The load thread's gate: layer l is read once l < allowed. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int allowed;
} gate_t;

static void gate_hook(void *ctx, int layer) {
    gate_t *g = ctx;
    pthread_mutex_lock(&g->mu);
    while (layer >= g->allowed) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static void gate_open(gate_t *g, int allowed) {
    pthread_mutex_lock(&g->mu);
    g->allowed = allowed;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void wait_layer(void *ctx, int layer) { loom_kv_offload_wait_layer(ctx, layer); }

/* Whether layer l's part of blocks a and b (the contiguous span is
 * layer-major) holds the same bytes. */
static int same_layer(loom_model_t *m, int a, int b, int l) {
    size_t lb = loom_model_kv_block_bytes(m, BS) / (size_t)loom_model_dims(m)->n_layers;
    return !memcmp((char *)loom_model_kv_block_ptr(m, a) + (size_t)l * lb,
                   (char *)loom_model_kv_block_ptr(m, b) + (size_t)l * lb, lb);
}

/* The directory tier's loads run layer by layer on a thread of their own:
 * with the thread held before layer 1, layer 0 of every block is in and
 * layer 1 is not; a forward waiting per layer (the model's layer hook) then
 * gives the logits of one over the original blocks; a file corrupted past
 * its header is found at the end (the step fails, the file is deleted); a
 * missing file fails at once. */
static void test_dir_layer_loads(void) {
    loom_backend_t *be = NULL;
    loom_err_t err = {0};
    loom_model_t *m = open_model(&be, 0, LOOM_DT_F32);
    if (!m) return;
    const int n_layers = loom_model_dims(m)->n_layers, vocab = g_cfg.vocab_size;
    CHECK(n_layers >= 3);
    float *a = malloc((size_t)vocab * sizeof *a), *b = malloc((size_t)vocab * sizeof *b);
    int32_t orig[3] = {2, 5, 7}, moved[3] = {0, 1, 3}, next = 7;
    prefill(m, orig, a);
    step(m, &next, 1, PROMPT, orig, 3, a);
    char dir[] = "/tmp/loom_kv_layers_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    loom_kv_offload_t o = {0};
    CHECKF(loom_kv_offload_config(&o, be, m, dir, 0x99, 1ull << 30, 0, &err) == LOOM_OK, "%s", err.msg);
    uint64_t hashes[3] = {0x41, 0x42, 0x43};
    CHECKF(loom_kv_offload_step(&o, m, orig, hashes, 3, NULL, NULL, 0, &err) == LOOM_OK, "%s", err.msg);
    size_t span = loom_model_kv_block_bytes(m, BS);
    for (int i = 0; i < 3; i++) memset(loom_model_kv_block_ptr(m, moved[i]), 0, span);

    gate_t g = {.allowed = 1};
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.cv, NULL);
    o.layer_hook = gate_hook;
    o.layer_hook_ctx = &g;
    CHECKF(loom_kv_offload_step(&o, m, NULL, NULL, 0, moved, hashes, 3, &err) == LOOM_OK, "%s", err.msg);
    loom_kv_offload_wait_layer(&o, 0);
    CHECK(loom_kv_offload_layers_ready(&o) == 1);
    CHECK(same_layer(m, orig[0], moved[0], 0) && same_layer(m, orig[2], moved[2], 0));
    CHECK(!same_layer(m, orig[0], moved[0], 1) && !same_layer(m, orig[2], moved[2], 1));
    gate_open(&g, 2);
    loom_kv_offload_wait_layer(&o, 1);
    CHECK(loom_kv_offload_layers_ready(&o) == 2 && same_layer(m, orig[1], moved[1], 1));
    gate_open(&g, n_layers);
    loom_model_set_layer_wait(m, wait_layer, &o);
    step(m, &next, 1, PROMPT, moved, 3, b);
    CHECKF(loom_kv_offload_finish(&o, &err) == LOOM_OK, "%s", err.msg);
    CHECK(!memcmp(a, b, (size_t)vocab * sizeof *a));
    CHECK(o.loads == 3 && loom_kv_offload_layers_ready(&o) == -1);

    /* one file's payload corrupted: found when the loads end, the file deleted */
    char path[4200];
    loom_kv_tier_path(path, sizeof path, dir, 0x99, hashes[1], 0);
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    if (f) {
        fseek(f, -5, SEEK_END);
        int c = fgetc(f);
        fseek(f, -5, SEEK_END);
        fputc(c ^ 0x5a, f);
        fclose(f);
    }
    o.layer_hook = NULL;
    CHECKF(loom_kv_offload_step(&o, m, NULL, NULL, 0, moved, hashes, 3, &err) == LOOM_OK, "%s", err.msg);
    step(m, &next, 1, PROMPT, moved, 3, b);
    CHECK(loom_kv_offload_finish(&o, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "checksum"));
    CHECK(access(path, F_OK) != 0);
    /* that file gone: the loads fail before they start */
    CHECK(loom_kv_offload_step(&o, m, NULL, NULL, 0, moved, hashes, 3, &err) == LOOM_ERR_NOT_FOUND && !o.load);
    CHECK(loom_kv_offload_finish(&o, &err) == LOOM_OK);
    loom_model_set_layer_wait(m, NULL, NULL);
    pthread_mutex_destroy(&g.mu);
    pthread_cond_destroy(&g.cv);
    rm_tree(dir);
    free(a);
    free(b);
    loom_model_destroy(&m);
    loom_backend_destroy(&be);
}

/* The directory tier on its own, in either pool layout (a layer-major pool
 * through the staging span): blocks saved to files and loaded into other
 * blocks hold the same bytes and give the same logits. */
static void dir_round_trip(int layer_major, loom_dtype_t kv) {
    loom_backend_t *be = NULL;
    loom_err_t err = {0};
    loom_model_t *m = open_model(&be, layer_major, kv);
    if (!m) return;
    const int vocab = g_cfg.vocab_size;
    int32_t orig[3] = {2, 5, 7}, moved[3] = {0, 1, 3}, next = 7;
    float *a = malloc((size_t)vocab * sizeof *a), *b = malloc((size_t)vocab * sizeof *b);
    prefill(m, orig, a);
    step(m, &next, 1, PROMPT, orig, 3, a);
    char dir[] = "/tmp/loom_kv_dirrt_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    loom_kv_offload_t o = {0};
    CHECKF(loom_kv_offload_config(&o, be, m, dir, 0x55, 1ull << 30, 0, &err) == LOOM_OK, "%s", err.msg);
    CHECK(!o.stage == !layer_major);
    uint64_t hashes[3] = {0x61, 0x62, 0x63};
    loom_model_set_layer_wait(m, wait_layer, &o); /* the contiguous pool's loads run beside the forward */
    CHECKF(loom_kv_offload_step(&o, m, orig, hashes, 3, moved, hashes, 3, &err) == LOOM_OK, "%s", err.msg);
    CHECK(!o.load == !!layer_major); /* a layer-major pool's loads are done before the step */
    step(m, &next, 1, PROMPT, moved, 3, b);
    CHECKF(loom_kv_offload_finish(&o, &err) == LOOM_OK, "%s", err.msg);
    CHECK(same_block(m, 2, 0) && same_block(m, 5, 1) && same_block(m, 7, 3));
    CHECK(!memcmp(a, b, (size_t)vocab * sizeof *a));
    loom_kv_offload_free(&o);
    rm_tree(dir);
    free(a);
    free(b);
    loom_model_destroy(&m);
    loom_backend_destroy(&be);
}

static void test_spill(void) { spill(0); }
static void test_spill_layer_major(void) { spill(1); }
static void test_dir_block_contiguous(void) { dir_round_trip(0, LOOM_DT_F32); }
static void test_dir_layer_major(void) { dir_round_trip(1, LOOM_DT_F32); }
static void test_dir_layer_major_int8(void) { dir_round_trip(1, LOOM_DT_I8); }
static void test_block_contiguous(void) { round_trip(0, LOOM_DT_F32); }
static void test_layer_major(void) { round_trip(1, LOOM_DT_F32); }
static void test_layer_major_int8(void) { round_trip(1, LOOM_DT_I8); }
static void test_block_contiguous_int8(void) { round_trip(0, LOOM_DT_I8); }

int main(void) {
    loom_err_t err = {0};
    if (loom_model_config_load(LOOM_MODELS_DIR_DEFAULT "/stories260K", &g_cfg, &err) != LOOM_OK ||
        loom_st_open_dir(LOOM_MODELS_DIR_DEFAULT "/stories260K", &g_st, &err) != LOOM_OK) {
        fprintf(stderr, "stories260K: %s\n", err.msg);
        return 1;
    }
    RUN(test_block_contiguous);
    RUN(test_layer_major);
    RUN(test_block_contiguous_int8);
    RUN(test_layer_major_int8);
    RUN(test_spill);
    RUN(test_spill_layer_major);
    RUN(test_dir_block_contiguous);
    RUN(test_dir_layer_major);
    RUN(test_dir_layer_major_int8);
    RUN(test_dir_layer_loads);
    loom_st_close(&g_st);
    return test_summary();
}
