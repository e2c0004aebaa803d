/* Fake workers for grid tests (see fake_worker.h). */
#include "tests/unit/fake_worker.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include "common/status.h"
#include "common/util.h"

#define FAKE_HEARTBEAT_MS 100

fake_worker_t *fake_create(void *zctx, const char *ctl_addr, const char *id) {
    fake_worker_t *f = loom_xcalloc(1, sizeof *f);
    snprintf(f->id, sizeof f->id, "%s", id);
    f->heartbeats = f->auto_load = f->auto_ready = f->auto_step = f->auto_register = 1;
    f->kv_budget = 64 * 1024;
    f->kv_block_bytes = 1024;
    f->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    LOOM_ASSERT(f->listen_fd >= 0 && bind(f->listen_fd, (struct sockaddr *)&a, sizeof a) == 0 &&
                listen(f->listen_fd, 16) == 0 && getsockname(f->listen_fd, (struct sockaddr *)&a, &len) == 0);
    snprintf(f->data_addr, sizeof f->data_addr, "tcp://127.0.0.1:%d", ntohs(a.sin_port));
    f->sock = zmq_socket(zctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(f->sock, ZMQ_ROUTING_ID, f->id, strlen(f->id));
    LOOM_ASSERT(zmq_connect(f->sock, ctl_addr) == 0);
    return f;
}

void fake_destroy(fake_worker_t **f_p) {
    if (!f_p || !*f_p) return;
    fake_worker_t *f = *f_p;
    *f_p = NULL;
    if (f->listen_fd >= 0) close(f->listen_fd);
    zmq_close(f->sock);
    free(f);
}

void fake_close_data_plane(fake_worker_t *f) {
    if (f->listen_fd >= 0) close(f->listen_fd);
    f->listen_fd = -1;
}

void fake_send(fake_worker_t *f, Loom__V1__ControlMsg *m) {
    size_t len;
    void *buf = loom_wire_pack_control(m, &len);
    zmq_send(f->sock, buf, len, ZMQ_DONTWAIT);
    free(buf);
}

void fake_register_as(fake_worker_t *f, const char *worker_id) {
    Loom__V1__Register r = LOOM__V1__REGISTER__INIT;
    r.worker_id = (char *)worker_id;
    r.host = "fakehost";
    r.host_id = "fake-boot/fake-ns";
    r.device = "cpu";
    r.data_addr = f->data_addr;
    r.pid = (uint32_t)getpid();
    r.has_shard = f->has_shard;
    r.shard_stage = f->stage;
    r.shard_n_stages = f->n_stages;
    r.shard_tp_rank = f->tp_rank;
    r.shard_tp_size = f->tp_size;
    r.shard_model_dir = f->model_dir;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_REGISTER;
    m.register_ = &r;
    fake_send(f, &m);
}

void fake_register(fake_worker_t *f) { fake_register_as(f, f->id); }

void fake_send_loaded(fake_worker_t *f, uint64_t epoch) {
    Loom__V1__Loaded l = LOOM__V1__LOADED__INIT;
    uint8_t tp_id[8], next_id[8];
    memset(tp_id, 'T', sizeof tp_id);
    memset(next_id, 'N', sizeof next_id);
    memcpy(tp_id, f->id, LOOM_MIN(strlen(f->id), sizeof tp_id));
    memcpy(next_id, f->id, LOOM_MIN(strlen(f->id), sizeof next_id));
    l.epoch = epoch;
    l.weight_bytes = 1000;
    l.kv_block_bytes = f->kv_block_bytes;
    l.kv_budget = f->kv_budget;
    l.kv_cache_dtype = "f32";
    l.tp_group_id = (ProtobufCBinaryData){sizeof tp_id, tp_id};
    l.next_group_id = (ProtobufCBinaryData){sizeof next_id, next_id};
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_LOADED;
    m.loaded = &l;
    fake_send(f, &m);
}

void fake_send_ready(fake_worker_t *f, uint64_t epoch) {
    Loom__V1__Ready r = LOOM__V1__READY__INIT;
    r.epoch = epoch;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_READY;
    m.ready = &r;
    fake_send(f, &m);
}

void fake_send_result(fake_worker_t *f, uint64_t epoch, uint64_t step_id, int n_ids, int code) {
    int32_t ids[64];
    for (int i = 0; i < n_ids && i < 64; i++) ids[i] = 7;
    Loom__V1__StepResult r = LOOM__V1__STEP_RESULT__INIT;
    r.epoch = epoch;
    r.step_id = step_id;
    r.ids = ids;
    r.n_ids = (size_t)LOOM_MIN(n_ids, 64);
    r.code = code;
    r.message = code ? "fake failure" : "";
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_RESULT;
    m.result = &r;
    fake_send(f, &m);
}

static void on_msg(fake_worker_t *f, const Loom__V1__ControlMsg *m) {
    switch (m->body_case) {
    case LOOM__V1__CONTROL_MSG__BODY_ASSIGN: {
        const Loom__V1__Assign *a = m->assign;
        f->n_assign++;
        f->epoch = a->epoch;
        f->incarnation = a->incarnation;
        f->has_shard = 1;
        f->stage = a->stage;
        f->n_stages = a->n_stages;
        f->tp_rank = a->tp_rank;
        f->tp_size = a->tp_size;
        snprintf(f->model_dir, sizeof f->model_dir, "%s", a->model_dir);
        if (f->auto_load) fake_send_loaded(f, a->epoch);
        break;
    }
    case LOOM__V1__CONTROL_MSG__BODY_KV_CONFIG:
        f->n_kv++;
        if (f->auto_ready) fake_send_ready(f, m->kv_config->epoch);
        break;
    case LOOM__V1__CONTROL_MSG__BODY_STEP:
        f->n_step++;
        f->last_step_id = m->step->step_id;
        f->last_step_epoch = m->step->epoch;
        /* the last stage's TP rank 0 answers, as a real grid's would carry the ids */
        if (f->auto_step && f->stage + 1 == f->n_stages && f->tp_rank == 0)
            fake_send_result(f, m->step->epoch, m->step->step_id, (int)m->step->n_logit_rows, 0);
        break;
    case LOOM__V1__CONTROL_MSG__BODY_ABORT:
        f->n_abort++;
        f->abort_epoch = m->abort->epoch;
        f->abort_incarnation = m->abort->incarnation;
        break;
    case LOOM__V1__CONTROL_MSG__BODY_SHUTDOWN: f->n_shutdown++; break;
    case LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT: f->n_heartbeat++; break;
    case LOOM__V1__CONTROL_MSG__BODY_ERROR:
        f->n_error++;
        f->last_error_code = m->error->code;
        if (f->auto_register && m->error->code == LOOM_ERR_NOT_FOUND) fake_register(f);
        break;
    default: break;
    }
}

void fake_poll(fake_worker_t *f) {
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, f->sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            break;
        }
        loom_err_t err = {0};
        Loom__V1__ControlMsg *m = loom_wire_unpack_control(zmq_msg_data(&msg), zmq_msg_size(&msg), &err);
        zmq_msg_close(&msg);
        LOOM_ASSERT(m != NULL);
        on_msg(f, m);
        protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    uint64_t now = loom_now_ns();
    if (f->heartbeats && now - f->last_hb_ns >= FAKE_HEARTBEAT_MS * 1000000ull) {
        f->last_hb_ns = now;
        Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
        Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
        m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
        m.heartbeat = &hb;
        fake_send(f, &m);
    }
}
