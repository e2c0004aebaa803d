/* Comm dispatch: picks the backend and times every call. */
#include "worker/comm_impl.h"

#include <string.h>

#include "common/util.h"

loom_status_t loom_comm_create(const loom_comm_config_t *cfg, loom_comm_t **out, loom_err_t *err) {
    *out = NULL;
    if (cfg->version != LOOM_COMM_CONFIG_VERSION)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "comm config version %d, expected %d",
                            cfg->version, LOOM_COMM_CONFIG_VERSION);
    if (cfg->tp_size < 1 || cfg->tp_rank < 0 || cfg->tp_rank >= cfg->tp_size)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "comm: tp rank %d of %d", cfg->tp_rank,
                            cfg->tp_size);
    const char *b = cfg->backend ? cfg->backend : "shm";
    if (!strcmp(b, "shm")) return loom_comm_shm_create(cfg, out, err);
    if (!strcmp(b, "tcp")) return loom_comm_tcp_create(cfg, out, err);
#ifdef LOOM_HAVE_NCCL
    if (!strcmp(b, "nccl")) return loom_comm_nccl_create(cfg, out, err);
#endif
    return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "comm backend '%s' is not available in this build", b);
}

void loom_comm_base_init(loom_comm_t *base, const loom_comm_ops_t *ops, const loom_comm_config_t *cfg) {
    base->ops = ops;
    base->tp_rank = cfg->tp_rank;
    base->tp_size = cfg->tp_size;
    base->max_bytes = cfg->max_bytes;
    base->seconds = 0.0;
}

loom_status_t loom_comm_make_id(const char *backend, uint8_t id[LOOM_COMM_ID_BYTES], size_t *len,
                                loom_err_t *err) {
    *len = 0;
#ifdef LOOM_HAVE_NCCL
    if (backend && !strcmp(backend, "nccl")) return loom_comm_nccl_make_id(id, len, err);
#else
    if (backend && !strcmp(backend, "nccl"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "this worker was built without NCCL");
#endif
    (void)id;
    return LOOM_OK;
}

void loom_comm_destroy(loom_comm_t **c_p) {
    if (!c_p || !*c_p) return;
    loom_comm_t *c = *c_p;
    *c_p = NULL;
    c->ops->destroy(c);
}

int loom_comm_tp_rank(const loom_comm_t *c) { return c->tp_rank; }
int loom_comm_tp_size(const loom_comm_t *c) { return c->tp_size; }
const char *loom_comm_backend(const loom_comm_t *c) { return c->ops->name; }
double loom_comm_seconds(const loom_comm_t *c) { return c->seconds; }
void loom_comm_abort(loom_comm_t *c) {
    if (c) c->ops->abort(c);
}

#define TIMED(c, call)                                                                             \
    do {                                                                                           \
        uint64_t t0_ = loom_now_ns();                                                              \
        loom_status_t s_ = (call);                                                                 \
        (c)->seconds += (double)(loom_now_ns() - t0_) * 1e-9;                                      \
        return s_;                                                                                 \
    } while (0)

int loom_comm_stream_ordered(const loom_comm_t *c) { return c->ops->step_begin != NULL; }
loom_status_t loom_comm_step_begin(loom_comm_t *c, int64_t tokens, loom_err_t *err) {
    return c->ops->step_begin ? c->ops->step_begin(c, tokens, err) : LOOM_OK;
}
/* not timed: it waits for the whole forward pass, the all-reduces only a
 * part of it (loom_comm_seconds then counts the enqueueing alone) */
loom_status_t loom_comm_step_end(loom_comm_t *c, loom_err_t *err) {
    return c->ops->step_end ? c->ops->step_end(c, err) : LOOM_OK;
}

loom_status_t loom_comm_allreduce(loom_comm_t *c, float *buf, int64_t n, loom_err_t *err) {
    if (c->tp_size == 1 || n <= 0) return LOOM_OK;
    if ((size_t)n * sizeof(float) > c->max_bytes)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "all-reduce of %lld floats exceeds the comm's %zu bytes",
                            (long long)n, c->max_bytes);
    TIMED(c, c->ops->allreduce(c, buf, n, err));
}

loom_status_t loom_comm_gather(loom_comm_t *c, const void *send, size_t bytes, void *recv, loom_err_t *err) {
    if (bytes > c->max_bytes)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "gather of %zu bytes exceeds the comm's %zu", bytes,
                            c->max_bytes);
    if (c->tp_size == 1) {
        if (recv && recv != send) memcpy(recv, send, bytes);
        return LOOM_OK;
    }
    TIMED(c, c->ops->gather(c, send, bytes, recv, err));
}

loom_status_t loom_comm_barrier(loom_comm_t *c, loom_err_t *err) {
    if (c->tp_size == 1) return LOOM_OK;
    TIMED(c, c->ops->barrier(c, err));
}

loom_status_t loom_comm_send_next(loom_comm_t *c, const void *buf, size_t bytes, loom_err_t *err) {
    if (bytes > c->max_bytes)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "send of %zu bytes exceeds the comm's %zu", bytes,
                            c->max_bytes);
    TIMED(c, c->ops->send_next(c, buf, bytes, err));
}

loom_status_t loom_comm_recv_prev(loom_comm_t *c, void *buf, size_t bytes, loom_err_t *err) {
    if (bytes > c->max_bytes)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "recv of %zu bytes exceeds the comm's %zu", bytes,
                            c->max_bytes);
    TIMED(c, c->ops->recv_prev(c, buf, bytes, err));
}
