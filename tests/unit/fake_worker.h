/* In-process fake workers for grid tests: each is a ZeroMQ DEALER that
 * speaks the real control protocol (Register, Loaded, Ready, StepResult,
 * heartbeats) without a model, and a TCP listener standing in for its data
 * plane (the grid probes it). What each fake received is counted. */
#ifndef LOOM_TEST_FAKE_WORKER_H
#define LOOM_TEST_FAKE_WORKER_H

#include <stdint.h>

#include "proto/wire.h"

typedef struct fake_worker {
    void *sock;
    char id[64];
    int listen_fd; /* the "data plane" (-1: closed, so probes are refused) */
    char data_addr[64];
    /* behaviour */
    int heartbeats;   /* send heartbeats (a silent fake is lost) */
    int auto_load;    /* answer Assign with Loaded */
    int auto_ready;   /* answer KvConfig with Ready */
    int auto_step;    /* answer StepPlan with a result (ids = 7 per row) */
    int auto_register; /* answer NOT_FOUND ("register first") with a Register */
    uint64_t kv_budget, kv_block_bytes;
    /* what it was told */
    int n_assign, n_kv, n_step, n_abort, n_shutdown, n_error, n_heartbeat;
    int last_error_code;
    uint64_t epoch, incarnation, abort_epoch, abort_incarnation;
    int has_shard;
    uint32_t stage, n_stages, tp_rank, tp_size;
    char model_dir[256];
    uint64_t last_step_id, last_step_epoch;
    uint64_t last_hb_ns;
} fake_worker_t;

/* Connects a fake with routing id `id` to the grid's control address. */
fake_worker_t *fake_create(void *zctx, const char *ctl_addr, const char *id);
void fake_destroy(fake_worker_t **f_p);
void fake_send(fake_worker_t *f, Loom__V1__ControlMsg *m);
void fake_register(fake_worker_t *f);           /* with its shard when it holds one */
void fake_register_as(fake_worker_t *f, const char *worker_id); /* claiming another id */
void fake_send_loaded(fake_worker_t *f, uint64_t epoch);
void fake_send_ready(fake_worker_t *f, uint64_t epoch);
void fake_send_result(fake_worker_t *f, uint64_t epoch, uint64_t step_id, int n_ids, int code);
void fake_close_data_plane(fake_worker_t *f);
/* Reads what arrived, answers as configured, sends heartbeats when due. */
void fake_poll(fake_worker_t *f);

#endif
