/* The worker's half of the directory tier (kv_offload.h). */
#include "worker/kv_offload.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_tier.h"
#include "common/log.h"
#include "common/util.h"

void loom_kv_offload_free(loom_kv_offload_t *o) {
    LOOM_ASSERT(!o->load);
    if (o->stage) loom_backend_host_free(o->be, o->stage);
    o->stage = NULL;
}

loom_status_t loom_kv_offload_config(loom_kv_offload_t *o, loom_backend_t *be, const loom_model_t *m, const char *dir,
                                     uint64_t tier_id, uint64_t max_bytes, int shard, loom_err_t *err) {
    loom_kv_offload_free(o);
    memset(o, 0, sizeof *o);
    if (!dir || !*dir) return LOOM_OK;
    if (!loom_model_kv_block_contiguous(m)) { /* layer-major: a block goes through a host span, packed */
        o->be = be;
        o->stage = loom_backend_host_alloc(be, loom_model_kv_block_bytes(m, loom_model_kv_block_size(m)));
        if (!o->stage) return loom_err_set(err, LOOM_ERR_NOMEM, "no host memory for the KV tier's staging block");
    }
    if (strlen(dir) >= sizeof o->dir)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--kv-offloading-dir is too long");
    snprintf(o->dir, sizeof o->dir, "%s", dir);
    o->tier_id = tier_id;
    o->max_bytes = max_bytes;
    o->shard = shard;
    o->bytes = loom_kv_tier_trim(dir, max_bytes);
    LOOM_INFO("KV offload: directory tier %s (shard %d, %zu bytes a block, %.1f MB there)", dir, shard,
              loom_model_kv_block_bytes(m, loom_model_kv_block_size(m)), (double)o->bytes / 1e6);
    return LOOM_OK;
}

void loom_kv_offload_put(loom_kv_offload_t *o, uint64_t hash, const void *src, size_t span) {
    if (o->broken || !o->dir[0]) return;
    loom_err_t err = {0};
    if (loom_kv_tier_write(o->dir, o->tier_id, hash, o->shard, src, span, &err) < 0) {
        LOOM_WARN("KV offload: %s; no more blocks are saved to %s (the tier only serves what it has)", err.msg, o->dir);
        o->broken = 1;
        return;
    }
    o->bytes += loom_kv_tier_file_bytes(span);
}

loom_status_t loom_kv_offload_get(loom_kv_offload_t *o, uint64_t hash, void *dst, size_t span, loom_err_t *err) {
    if (!o->dir[0])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the plan loads a KV block from the directory but this worker has no directory tier");
    loom_status_t s = loom_kv_tier_read(o->dir, o->tier_id, hash, o->shard, dst, span, err);
    if (s < 0) {
        char why[sizeof err->msg];
        snprintf(why, sizeof why, "%s", err->msg);
        return loom_err_set(err, s, "KV block %016llx (shard %d) could not be loaded: %s", (unsigned long long)hash,
                            o->shard, why);
    }
    return LOOM_OK;
}

void loom_kv_offload_put_block(loom_kv_offload_t *o, loom_model_t *m, int block, uint64_t hash) {
    if (o->broken || !o->dir[0]) return;
    size_t span = loom_model_kv_block_bytes(m, loom_model_kv_block_size(m));
    if (!o->stage) {
        loom_kv_offload_put(o, hash, loom_model_kv_block_ptr(m, block), span);
        return;
    }
    loom_backend_xfer_begin(o->be);
    loom_model_kv_block_xfer(m, block, o->stage, 1);
    loom_backend_xfer_end(o->be);
    loom_kv_offload_put(o, hash, o->stage, span);
}

loom_status_t loom_kv_offload_get_block(loom_kv_offload_t *o, loom_model_t *m, int block, uint64_t hash,
                                        loom_err_t *err) {
    size_t span = loom_model_kv_block_bytes(m, loom_model_kv_block_size(m));
    if (!o->stage) return loom_kv_offload_get(o, hash, loom_model_kv_block_ptr(m, block), span, err);
    loom_status_t s = loom_kv_offload_get(o, hash, o->stage, span, err);
    if (s < 0) return s;
    loom_backend_xfer_begin(o->be);
    loom_model_kv_block_xfer(m, block, o->stage, 0);
    loom_backend_xfer_end(o->be);
    return LOOM_OK;
}

static void save_all(loom_kv_offload_t *o, loom_model_t *m, const int32_t *blocks, const uint64_t *hashes, size_t n) {
    for (size_t i = 0; i < n && !o->broken; i++) loom_kv_offload_put_block(o, m, blocks[i], hashes[i]);
}

/* Over the bound: the least recently used files go. After the step's loads,
 * so none of its own blocks goes before it is read. */
static void trim(loom_kv_offload_t *o) {
    if (o->bytes > o->max_bytes) o->bytes = loom_kv_tier_trim(o->dir, o->max_bytes);
}

void loom_kv_offload_trim(loom_kv_offload_t *o) {
    if (o->dir[0]) trim(o);
}

void loom_kv_offload_save(loom_kv_offload_t *o, loom_model_t *m, const int32_t *blocks, const uint64_t *hashes,
                          size_t n) {
    if (!n || !o->dir[0]) return;
    save_all(o, m, blocks, hashes, n);
    trim(o);
}

/* ---- loads, layer by layer on a thread of their own ----------------------------------------- */

/* The step's loads: every block's file is opened (headers checked) before
 * the step; a thread then reads layer 0 of every block, then layer 1, ...,
 * each file in order (its checksum fed as it goes), and publishes how many
 * layers are in; the forward waits for layer l before running it
 * (loom_kv_offload_wait_layer, through the model's layer hook); the
 * checksums are checked when the thread is done (loom_kv_offload_finish). */
struct loom_kv_load {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_layers, ready; /* layers in for every block (under mu) */
    size_t n, layer_bytes;
    char **dst;
    loom_kv_tier_reader_t *r;
    loom_status_t status;
    loom_err_t err;
    void (*hook)(void *ctx, int layer);
    void *hook_ctx;
};

static void *load_main(void *arg) {
    struct loom_kv_load *L = arg;
    for (int l = 0; l < L->n_layers; l++) {
        if (L->hook) L->hook(L->hook_ctx, l);
        for (size_t i = 0; i < L->n && L->status == LOOM_OK; i++)
            if (loom_kv_tier_read_next(&L->r[i], L->dst[i] + (size_t)l * L->layer_bytes, L->layer_bytes, &L->err) < 0)
                L->status = L->err.code;
        pthread_mutex_lock(&L->mu);
        L->ready = L->status == LOOM_OK ? l + 1 : L->n_layers; /* a failure: no one waits on it (the step fails) */
        pthread_cond_broadcast(&L->cv);
        pthread_mutex_unlock(&L->mu);
        if (L->status != LOOM_OK) break;
    }
    return NULL;
}

static void load_free(struct loom_kv_load *L) {
    pthread_mutex_destroy(&L->mu);
    pthread_cond_destroy(&L->cv);
    free(L->dst);
    free(L->r);
    free(L);
}

/* Opens the files (a missing or bad one: the error, nothing started) and
 * starts the thread. */
static loom_status_t load_start(loom_kv_offload_t *o, const loom_model_t *m, const int32_t *blocks,
                                const uint64_t *hashes, size_t n, size_t span, loom_err_t *err) {
    struct loom_kv_load *L = loom_xcalloc(1, sizeof *L);
    L->n_layers = loom_model_dims(m)->n_layers;
    LOOM_ASSERT(L->n_layers > 0 && span % (size_t)L->n_layers == 0);
    L->layer_bytes = span / (size_t)L->n_layers; /* the contiguous span is layer-major: layer l at l * span / layers */
    L->n = n;
    L->dst = loom_xcalloc(n, sizeof *L->dst);
    L->r = loom_xcalloc(n, sizeof *L->r);
    L->hook = o->layer_hook;
    L->hook_ctx = o->layer_hook_ctx;
    pthread_mutex_init(&L->mu, NULL);
    pthread_cond_init(&L->cv, NULL);
    loom_status_t s = LOOM_OK;
    size_t opened = 0;
    for (; opened < n; opened++) {
        L->dst[opened] = loom_model_kv_block_ptr(m, blocks[opened]);
        if (!L->dst[opened])
            s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "KV load into block %d: not a block of this pool",
                             blocks[opened]);
        else
            s = loom_kv_tier_open(&L->r[opened], o->dir, o->tier_id, hashes[opened], o->shard, span, err);
        if (s < 0) break;
    }
    if (s == LOOM_OK && pthread_create(&L->thread, NULL, load_main, L) != 0)
        s = loom_err_set(err, LOOM_ERR_INTERNAL, "cannot start the KV load thread");
    if (s < 0) {
        loom_err_t ignore = {0};
        for (size_t i = 0; i < opened; i++) loom_kv_tier_close(&L->r[i], &ignore); /* unread: nothing said */
        load_free(L);
        return s;
    }
    o->load = L;
    o->loads += n;
    return LOOM_OK;
}

void loom_kv_offload_wait_layer(loom_kv_offload_t *o, int layer) {
    struct loom_kv_load *L = o->load;
    if (!L) return;
    pthread_mutex_lock(&L->mu);
    if (L->ready <= layer) o->layer_waits++;
    while (L->ready <= layer) pthread_cond_wait(&L->cv, &L->mu);
    pthread_mutex_unlock(&L->mu);
}

int loom_kv_offload_layers_ready(loom_kv_offload_t *o) {
    struct loom_kv_load *L = o->load;
    if (!L) return -1;
    pthread_mutex_lock(&L->mu);
    int r = L->ready;
    pthread_mutex_unlock(&L->mu);
    return r;
}

loom_status_t loom_kv_offload_finish(loom_kv_offload_t *o, loom_err_t *err) {
    struct loom_kv_load *L = o->load;
    if (!L) return LOOM_OK;
    pthread_join(L->thread, NULL);
    o->load = NULL;
    loom_status_t s = L->status;
    if (s < 0 && err) *err = L->err;
    for (size_t i = 0; i < L->n; i++) {
        loom_err_t e = {0};
        if (loom_kv_tier_close(&L->r[i], &e) < 0 && s == LOOM_OK) {
            s = e.code;
            if (err) *err = e;
        }
    }
    load_free(L);
    trim(o); /* after the loads: none of the step's own blocks goes before it is read */
    return s;
}

loom_status_t loom_kv_offload_step(loom_kv_offload_t *o, loom_model_t *m, const int32_t *save_blocks,
                                   const uint64_t *save_hashes, size_t n_save, const int32_t *load_blocks,
                                   const uint64_t *load_hashes, size_t n_load, loom_err_t *err) {
    if (!n_save && !n_load) return LOOM_OK;
    if (!o->dir[0])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the plan moves KV blocks but this worker has no tier");
    LOOM_ASSERT(!o->load); /* the last step's loads finished */
    save_all(o, m, save_blocks, save_hashes, n_save);
    loom_status_t s = LOOM_OK;
    if (o->stage) { /* layer-major: block by block through the staging span, before the step */
        for (size_t i = 0; i < n_load && s == LOOM_OK; i++)
            s = loom_kv_offload_get_block(o, m, load_blocks[i], load_hashes[i], err);
    } else if (n_load) {
        s = load_start(o, m, load_blocks, load_hashes, n_load, loom_model_kv_block_bytes(m, loom_model_kv_block_size(m)),
                       err);
        if (s == LOOM_OK) return LOOM_OK; /* trimmed when the loads end */
    }
    trim(o);
    return s;
}
