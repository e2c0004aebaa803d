/* The comm vtable, for comm backend implementations only. */
#ifndef LOOM_COMM_IMPL_H
#define LOOM_COMM_IMPL_H

#include "worker/comm.h"

typedef struct loom_comm_ops {
    const char *name;
    void (*destroy)(loom_comm_t *c);
    loom_status_t (*allreduce)(loom_comm_t *c, float *buf, int64_t n, loom_err_t *err);
    loom_status_t (*gather)(loom_comm_t *c, const void *send, size_t bytes, void *recv, loom_err_t *err);
    loom_status_t (*barrier)(loom_comm_t *c, loom_err_t *err);
    loom_status_t (*send_next)(loom_comm_t *c, const void *buf, size_t bytes, loom_err_t *err);
    loom_status_t (*recv_prev)(loom_comm_t *c, void *buf, size_t bytes, loom_err_t *err);
    void (*abort)(loom_comm_t *c);
    /* optional (NULL: steps are not stream-ordered; comm.h) */
    loom_status_t (*step_begin)(loom_comm_t *c, int64_t tokens, loom_err_t *err);
    loom_status_t (*step_end)(loom_comm_t *c, loom_err_t *err);
} loom_comm_ops_t;

/* Every comm struct begins with this header. */
struct loom_comm {
    const loom_comm_ops_t *ops;
    int tp_rank, tp_size;
    size_t max_bytes;
    double seconds; /* accumulated by the dispatch wrappers */
};

/* Fills the header every backend struct begins with. */
void loom_comm_base_init(loom_comm_t *base, const loom_comm_ops_t *ops, const loom_comm_config_t *cfg);

loom_status_t loom_comm_shm_create(const loom_comm_config_t *cfg, loom_comm_t **out, loom_err_t *err);
loom_status_t loom_comm_tcp_create(const loom_comm_config_t *cfg, loom_comm_t **out, loom_err_t *err);
#ifdef LOOM_HAVE_NCCL
loom_status_t loom_comm_nccl_create(const loom_comm_config_t *cfg, loom_comm_t **out, loom_err_t *err);
loom_status_t loom_comm_nccl_make_id(uint8_t id[LOOM_COMM_ID_BYTES], size_t *len, loom_err_t *err);
#endif

#endif
