/* A worker's side of transport tcp (kv_pd.h). */
#include "worker/kv_pd.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/dtype.h"
#include "common/log.h"
#include "common/shard.h"
#include "common/util.h"
#include "worker/comm_util.h"

#define PULL_TIMEOUT_MS 30000
#define KEEP_MS 1000 /* a kept connection unused this long is closed, not reused (the service's idle limit: 2 s) */

static const char *kv_dtype_name(loom_dtype_t t) {
    switch (t) {
    case LOOM_DT_F32: return "f32";
    case LOOM_DT_BF16: return "bf16";
    case LOOM_DT_F16: return "f16";
    case LOOM_DT_I8: return "int8";
    default: return loom_dtype_name(t);
    }
}

int loom_kv_pd_ident(loom_model_t *m, uint64_t model, int tp_rank, int tp_size, int stage, int n_stages,
                     int layer_begin, int layer_end, loom_kv_ident_t *id, loom_kv_span_fmt_t *fmt) {
    size_t codes = 0, scales = 0;
    const int arrays = loom_model_kv_span_pieces(m, &codes, &scales);
    if (!arrays) return 0;
    const loom_model_config_t *c = loom_model_config(m);
    const loom_shard_dims_t *d = loom_model_dims(m);
    const loom_dtype_t dt = loom_model_kv_dtype(m);
    memset(id, 0, sizeof *id);
    id->model = model;
    snprintf(id->dtype, sizeof id->dtype, "%s", kv_dtype_name(dt));
    id->n_layers = (uint32_t)c->n_layers;
    id->layer_begin = (uint32_t)layer_begin;
    id->layer_end = (uint32_t)layer_end;
    id->block_size = (uint32_t)loom_model_kv_block_size(m);
    /* latent (MLA): one KV head, the latent row, on every rank (kv_head_begin 0: replicated) */
    id->layout = arrays == 1                        ? LOOM_KV_LAYOUT_LATENT
                 : loom_model_kv_block_contiguous(m) ? LOOM_KV_LAYOUT_CONTIGUOUS
                                                     : LOOM_KV_LAYOUT_LAYER_MAJOR;
    id->n_kv_heads = (uint32_t)c->n_kv_heads;
    id->head_dim = (uint32_t)c->head_dim;
    id->kv_head_begin = (uint32_t)d->kv_head_begin;
    id->kv_head_end = (uint32_t)(d->kv_head_begin + d->n_kv_heads);
    id->tp_size = (uint32_t)tp_size;
    id->tp_rank = (uint32_t)tp_rank;
    id->pp_size = (uint32_t)n_stages;
    id->pp_stage = (uint32_t)stage;
    *fmt = (loom_kv_span_fmt_t){.n_layers = d->n_layers, .block_size = (int)id->block_size,
                                .n_heads = d->n_kv_heads,
                                .head_bytes = (size_t)c->head_dim * loom_dtype_size(dt), .codes = codes,
                                .scales = scales, .latent = arrays == 1};
    return 1;
}

static size_t span_bytes(const loom_kv_span_fmt_t *f) { return loom_kv_span_bytes(f); }

/* kv_connector_extra_config.shm: LOOM_KV_PD_NO_SHM in the mode is "off". */
static int shm_mode(const loom_kv_pd_t *p) { return p->mode & LOOM_KV_PD_NO_SHM ? LOOM_KV_SHM_OFF : LOOM_KV_SHM_AUTO; }

/* The service's read: the pool is host memory (the CPU backend's) the
 * service may read beside the steps (a held block is written by none of
 * them); a block-contiguous one with one copy, a layer-major one (the
 * latent layout) packed a layer at a time (loom_model_kv_block_xfer:
 * memcpy on the CPU backend, which has no transfer stream). */
static loom_status_t serve_read(void *ctx, int32_t block, void *host, loom_err_t *err) {
    loom_kv_pd_t *p = ctx;
    if (p->serve_delay_ms > 0) usleep((useconds_t)p->serve_delay_ms * 1000u); /* a test's: a kill lands mid-read */
    if (block < 0 || block >= loom_model_kv_blocks(p->model))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "block %d is not one of this pool's", block);
    const void *src = loom_model_kv_block_ptr(p->model, block);
    if (src) memcpy(host, src, span_bytes(&p->fmt));
    else loom_model_kv_block_xfer(p->model, block, host, 1);
    return LOOM_OK;
}

static const void *serve_peek(void *ctx, int32_t block) {
    loom_kv_pd_t *p = ctx;
    return p->serve_delay_ms > 0 ? NULL : loom_model_kv_block_ptr(p->model, block);
}

static void serve_done(void *ctx, uint64_t transfer) {
    loom_kv_pd_t *p = ctx;
    pthread_mutex_lock(&p->done_mu);
    if (p->n_done < LOOM_KV_PD_DONE_MAX) p->done[p->n_done++] = transfer;
    pthread_mutex_unlock(&p->done_mu);
}

void loom_kv_pd_init(loom_kv_pd_t *p) {
    if (p->init) return;
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->done_mu, NULL);
    p->init = 1;
}

static void conns_close(loom_kv_pd_t *p) {
    for (int i = 0; i < LOOM_KV_PD_CONNS; i++) loom_kv_pull_close(&p->conns[i].c);
}

void loom_kv_pd_stop(loom_kv_pd_t *p) {
    loom_kv_pd_init(p);
    conns_close(p); /* the services they reach may be gone or another epoch's */
    pthread_mutex_lock(&p->mu);
    loom_kv_service_destroy(&p->svc);
    p->mode = 0;
    pthread_mutex_unlock(&p->mu);
}

loom_status_t loom_kv_pd_config(loom_kv_pd_t *p, int mode, uint64_t epoch, loom_model_t *m, loom_backend_t *be,
                                const loom_kv_ident_t *id, const loom_kv_span_fmt_t *fmt, const uint8_t *secret,
                                size_t secret_len, const char *host, loom_err_t *err) {
    loom_kv_pd_stop(p);
    if (!mode) return LOOM_OK;
    if (secret_len > sizeof p->secret)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "KV transfer secret of %zu bytes", secret_len);
    if (p->stage && be != p->be) {
        loom_backend_host_free(p->be, p->stage);
        p->stage = NULL;
    }
    p->model = m;
    p->be = be;
    p->ident = *id;
    p->fmt = *fmt;
    p->secret_len = secret_len;
    if (secret_len) memcpy(p->secret, secret, secret_len);
    if (!p->stage) p->stage = loom_backend_host_alloc(be, LOOM_MAX(span_bytes(fmt), (size_t)64));
    else {
        loom_backend_host_free(be, p->stage);
        p->stage = loom_backend_host_alloc(be, LOOM_MAX(span_bytes(fmt), (size_t)64));
    }
    loom_kv_service_t *svc = NULL;
    const char *delay = getenv("LOOM_TEST_KV_SERVE_DELAY_MS");
    p->serve_delay_ms = delay ? atoi(delay) : 0;
    if (mode & LOOM_KV_PD_SERVE) {
        if (strcmp(loom_backend_name(be), "cpu"))
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "transport tcp: serving a KV pool in device memory "
                                "(%s) is not built; the prefill side runs on the cpu backend", loom_backend_name(be));
        loom_kv_service_config_t c = {.host = host, .ident = *id, .fmt = *fmt, .secret = secret,
                                      .secret_len = secret_len, .read = serve_read, .peek = serve_peek,
                                      .done = serve_done, .ctx = p,
                                      .shm = mode & LOOM_KV_PD_NO_SHM ? LOOM_KV_SHM_OFF : LOOM_KV_SHM_AUTO,
                                      .encrypt = !!(mode & LOOM_KV_PD_ENCRYPT)};
        LOOM_CHECK(loom_kv_service_create(&c, &svc, err));
    }
    pthread_mutex_lock(&p->mu);
    p->svc = svc;
    p->mode = mode;
    p->epoch = epoch;
    pthread_mutex_unlock(&p->mu);
    if (svc) LOOM_INFO("KV transfer service on %s (transport tcp)", loom_kv_service_addr(svc));
    return LOOM_OK;
}

const char *loom_kv_pd_addr(loom_kv_pd_t *p, char *out, size_t cap) {
    loom_kv_pd_init(p);
    pthread_mutex_lock(&p->mu);
    snprintf(out, cap, "%s", p->svc ? loom_kv_service_addr(p->svc) : "");
    pthread_mutex_unlock(&p->mu);
    return out;
}

void loom_kv_pd_hold(loom_kv_pd_t *p, uint64_t epoch, uint64_t transfer, const int32_t *blocks, int n, int release) {
    loom_kv_pd_init(p);
    pthread_mutex_lock(&p->mu);
    if (p->svc && p->epoch == epoch) {
        if (release) loom_kv_service_unhold(p->svc, transfer);
        else loom_kv_service_hold(p->svc, transfer, blocks, n);
    }
    pthread_mutex_unlock(&p->mu);
}

int loom_kv_pd_take_done(loom_kv_pd_t *p, uint64_t *ids, int cap, uint64_t *epoch) {
    loom_kv_pd_init(p);
    pthread_mutex_lock(&p->done_mu);
    int n = LOOM_MIN(p->n_done, cap);
    memcpy(ids, p->done, (size_t)n * sizeof *ids);
    memmove(p->done, p->done + n, (size_t)(p->n_done - n) * sizeof *p->done);
    p->n_done -= n;
    pthread_mutex_unlock(&p->done_mu);
    pthread_mutex_lock(&p->mu);
    *epoch = p->epoch;
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* Writes heads [h0, h0 + n) of a slice of the acceptor's into pool block `block`. */
static void fill_block(loom_kv_pd_t *p, int32_t block, const uint8_t *slice, int h0, int n) {
    void *direct = loom_model_kv_block_ptr(p->model, block);
    if (direct) { /* block-contiguous: the pool's host memory */
        loom_kv_slice_unpack(&p->fmt, slice, h0, n, direct);
        return;
    }
    if (n < p->fmt.n_heads) { /* the block's other heads kept: read it first (a whole block, the latent's: not) */
        loom_backend_xfer_begin(p->be);
        loom_model_kv_block_xfer(p->model, block, p->stage, 1);
        loom_backend_xfer_end(p->be);
    }
    loom_kv_slice_unpack(&p->fmt, slice, h0, n, p->stage);
    loom_backend_xfer_begin(p->be);
    loom_model_kv_block_xfer(p->model, block, p->stage, 0);
    loom_backend_xfer_end(p->be);
}

/* The connections kept to the services read last (their shared memory
 * stays mapped on both sides, their buffers warm): one reused when it was
 * used within KEEP_MS and its socket shows nothing (the service closes one
 * idle for 2 s, or to make room for another dialler). */
static void conn_drop(loom_kv_pd_t *p, loom_kv_pull_t *c) {
    for (int i = 0; i < LOOM_KV_PD_CONNS; i++)
        if (p->conns[i].c == c) {
            loom_kv_pull_close(&p->conns[i].c);
            return;
        }
    loom_kv_pull_close(&c);
}

/* A connection to addr: a kept one (reuse 1, *reused 1) or a new one, kept. */
static loom_status_t conn_get(loom_kv_pd_t *p, const char *addr, uint64_t deadline, int reuse, loom_kv_pull_t **out,
                              loom_kv_ident_t *them, int *reused, loom_err_t *err) {
    const uint64_t now = loom_now_ns();
    int slot = 0;
    *reused = 0;
    for (int i = 0; i < LOOM_KV_PD_CONNS; i++) {
        loom_kv_pd_conn_t *k = &p->conns[i];
        if (k->c && now - k->used > (uint64_t)KEEP_MS * 1000000ull) loom_kv_pull_close(&k->c); /* stale by now */
        if (k->c && !strcmp(k->addr, addr)) {
            struct pollfd pf = {loom_kv_pull_fd(k->c), POLLIN, 0};
            if (reuse && poll(&pf, 1, 0) == 0) { /* nothing to read: not closed by the service */
                k->used = now;
                *out = k->c;
                *them = k->them;
                *reused = 1;
                return LOOM_OK;
            }
            loom_kv_pull_close(&k->c);
        }
        if (!k->c || (p->conns[slot].c && k->used < p->conns[slot].used)) slot = i; /* a free one, or the oldest */
    }
    loom_kv_pd_conn_t *k = &p->conns[slot];
    loom_kv_pull_close(&k->c);
    LOOM_CHECK(loom_kv_pull_open(addr, &p->ident, p->secret, p->secret_len, shm_mode(p),
                                 !!(p->mode & LOOM_KV_PD_ENCRYPT), deadline, &k->c, &k->them,
                                 err));
    snprintf(k->addr, sizeof k->addr, "%s", addr);
    k->used = now;
    *out = k->c;
    *them = k->them;
    return LOOM_OK;
}

/* One source: every rank of the prefill holding some of this shard's heads
 * is read for them (a connection each, kept for the next steps' pulls); 0,
 * or an error. */
static loom_status_t pull_source(loom_kv_pd_t *p, const int32_t *blocks, const int32_t *remote,
                                 const uint32_t *source, int n, uint32_t src, const char *addrs, uint64_t transfer,
                                 loom_err_t *err) {
    int nb = 0;
    for (int i = 0; i < n; i++) nb += source[i] == src;
    if (nb == 0) return LOOM_OK; /* nothing to read here (the decode side had it): only done follows */
    int32_t *local = loom_xmalloc((size_t)(nb ? nb : 1) * sizeof *local);
    int32_t *theirs_ids = loom_xmalloc((size_t)(nb ? nb : 1) * sizeof *local);
    for (int i = 0, j = 0; i < n; i++)
        if (source[i] == src) {
            local[j] = blocks[i];
            theirs_ids[j++] = remote[i];
        }
    const int mine0 = (int)p->ident.kv_head_begin, mine1 = (int)p->ident.kv_head_end, nh = mine1 - mine0;
    uint8_t *covered = loom_xcalloc((size_t)(nh > 0 ? nh : 1), 1);
    uint64_t deadline = loom_comm_deadline(PULL_TIMEOUT_MS);
    loom_status_t st = LOOM_OK;
    char addr[512];
    /* the latent KV is the same on every prefill rank: decode rank r starts at rank r mod their count, so a
     * TP decode group spreads its reads (per-head KV: rank order, each rank's heads where they are) */
    int n_addr = 1, start = 0;
    for (const char *c = addrs; *c; c++) n_addr += *c == ',';
    if (p->ident.layout == LOOM_KV_LAYOUT_LATENT) start = (int)(p->ident.tp_rank % (uint32_t)n_addr);
    for (int k = 0; k < n_addr && st == LOOM_OK; k++) {
        const char *a = addrs;
        for (int skip = (start + k) % n_addr; skip > 0; skip--) a = strchr(a, ',') + 1;
        const char *end = strchr(a, ',');
        size_t len = end ? (size_t)(end - a) : strlen(a);
        if (!len) continue;
        snprintf(addr, sizeof addr, "%.*s", (int)LOOM_MIN(len, sizeof addr - 1), a);
        int need = 0;
        for (int h = 0; h < nh; h++) need |= !covered[h];
        if (!need) break;
        loom_kv_pull_t *c = NULL;
        loom_kv_ident_t them;
        int reused = 0;
        if ((st = conn_get(p, addr, deadline, 1, &c, &them, &reused, err)) < 0) break;
        /* the heads this rank holds that we hold and have not read: one range (both sides' ranges are) */
        int lo = LOOM_MAX(mine0, (int)them.kv_head_begin), hi = LOOM_MIN(mine1, (int)them.kv_head_end);
        while (lo < hi && covered[lo - mine0]) lo++;
        int top = lo;
        while (top < hi && !covered[top - mine0]) top++;
        if (lo >= top) continue;
        loom_kv_span_fmt_t tf = p->fmt; /* the acceptor's slices: its head count, the same pieces otherwise */
        size_t one = loom_kv_slice_bytes(&tf, top - lo), all = one * (size_t)nb;
        const void *slices = NULL;
        uint64_t t0 = loom_now_ns();
        st = loom_kv_pull_read(c, transfer, theirs_ids, nb, lo - (int)them.kv_head_begin, top - lo, all, &slices,
                               deadline, err);
        if (st == LOOM_ERR_UNAVAILABLE && reused) { /* a kept connection the service had closed meanwhile: once
                                                      * more on a new one (not after the service's refusal) */
            conn_drop(p, c);
            *err = (loom_err_t){0};
            if ((st = conn_get(p, addr, deadline, 0, &c, &them, &reused, err)) < 0) break;
            st = loom_kv_pull_read(c, transfer, theirs_ids, nb, lo - (int)them.kv_head_begin, top - lo, all,
                                   &slices, deadline, err);
        }
        if (st < 0) {
            conn_drop(p, c);
            break;
        }
        for (int i = 0; i < nb; i++)
            fill_block(p, local[i], (const uint8_t *)slices + one * (size_t)i, lo - mine0, top - lo);
        for (int h = lo; h < top; h++) covered[h - mine0] = 1;
        const int via_shm = loom_kv_pull_shm(c);
        if (via_shm) p->pulled_shm += (uint64_t)nb;
        LOOM_INFO("KV pull of transfer %016llx: %d blocks, heads [%d, %d), %.1f MB from %s over %s in %.1f ms%s",
                  (unsigned long long)transfer, nb, lo, top, (double)all / 1e6, addr,
                  via_shm ? (loom_kv_pull_sealed(c) ? "shared memory (its messages sealed)" : "shared memory")
                          : loom_kv_pull_sealed(c) ? "tcp (sealed)" : "tcp",
                  (double)(loom_now_ns() - t0) * 1e-6,
                  reused ? " (a kept connection)" : "");
    }
    for (int h = 0; st == LOOM_OK && h < nh; h++)
        if (!covered[h])
            st = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "no rank of the prefill (%s) holds KV head %d", addrs,
                              mine0 + h);
    if (st == LOOM_OK) p->pulled += (uint64_t)nb;
    free(covered);
    free(local);
    free(theirs_ids);
    return st;
}

int loom_kv_pd_pull(loom_kv_pd_t *p, const int32_t *blocks, const int32_t *remote, const uint32_t *source, int n,
                    char *const *addrs, const uint64_t *transfer, int n_src, int *failed, char **why) {
    int n_failed = 0;
    for (int s = 0; s < n_src; s++) {
        loom_err_t err = {0};
        failed[s] = 0;
        why[s] = NULL;
        if (!(p->mode & LOOM_KV_PD_PULL)) {
            loom_err_set(&err, LOOM_ERR_UNSUPPORTED, "this worker does not pull (transport tcp off)");
        } else if (pull_source(p, blocks, remote, source, n, (uint32_t)s, addrs[s], transfer[s], &err) == LOOM_OK) {
            continue;
        }
        failed[s] = 1;
        why[s] = loom_xstrdup(err.msg);
        p->pull_failures++;
        n_failed++;
        LOOM_WARN("KV pull of transfer %016llx failed: %s", (unsigned long long)transfer[s], err.msg);
    }
    return n_failed;
}

void loom_kv_pd_done(loom_kv_pd_t *p, char *const *addrs, const uint64_t *transfer, int n_src, const int *failed) {
    for (int s = 0; s < n_src; s++) {
        if (failed[s]) continue;
        char addr[512];
        const char *end = strchr(addrs[s], ',');
        size_t len = end ? (size_t)(end - addrs[s]) : strlen(addrs[s]);
        snprintf(addr, sizeof addr, "%.*s", (int)LOOM_MIN(len, sizeof addr - 1), addrs[s]);
        loom_err_t err = {0};
        loom_kv_ident_t them;
        loom_kv_pull_t *c = NULL;
        uint64_t deadline = loom_comm_deadline(5000);
        int reused = 0;
        loom_status_t st = conn_get(p, addr, deadline, 1, &c, &them, &reused, &err);
        if (st == LOOM_OK && (st = loom_kv_pull_done(c, transfer[s], deadline, &err)) < 0 && reused) {
            conn_drop(p, c); /* closed by the service meanwhile: once more on a new one */
            err = (loom_err_t){0};
            if ((st = conn_get(p, addr, deadline, 0, &c, &them, &reused, &err)) == LOOM_OK)
                st = loom_kv_pull_done(c, transfer[s], deadline, &err);
        }
        if (st < 0) {
            LOOM_WARN("KV transfer %016llx: telling the prefill side it was read failed (its lease frees the "
                      "blocks): %s", (unsigned long long)transfer[s], err.msg);
            if (c) conn_drop(p, c);
        }
    }
}

void loom_kv_pd_release(loom_kv_pd_t *p) {
    loom_kv_pd_stop(p);
    if (p->stage) loom_backend_host_free(p->be, p->stage);
    p->stage = NULL;
}

void loom_kv_pd_free(loom_kv_pd_t *p) {
    if (!p->init) return;
    loom_kv_pd_release(p);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->done_mu);
    p->init = 0;
}
