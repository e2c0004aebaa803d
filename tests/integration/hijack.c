/* A hostile peer on a coordinator's control port: it connects with a
 * worker's routing id (optionally with CURVE keys of its own), registers,
 * heartbeats, and answers every step plan it is sent with token id 1, so a
 * successful hijack changes the output. It prints what it received.
 *
 *   hijack --control tcp://127.0.0.1:P --id worker-0 --seconds S
 *          [--silent] [--curve-server-key FILE --curve-secret FILE]
 * --silent never registers: it only takes the connection over and answers.
 * Prints "hijack: N message(s), M step plan(s), K token(s) chosen" and exits 0. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/cli.h"
#include "common/keys.h"
#include "common/util.h"
#include "proto/wire.h"

static void send_msg(void *z, Loom__V1__ControlMsg *m) {
    size_t len;
    void *buf = loom_wire_pack_control(m, &len);
    zmq_send(z, buf, len, ZMQ_DONTWAIT);
    free(buf);
}

int main(int argc, char **argv) {
    const char *control = NULL, *id = "worker-0", *server = NULL, *secret = NULL;
    int seconds = 5, silent = 0;
    loom_opt_t opts[] = {
        {"control", LOOM_OPT_STR, &control, "ADDR", "the coordinator's control address", 1, 0, NULL},
        {"id", LOOM_OPT_STR, &id, "ID", "routing id and worker id to claim (default worker-0)", 1, 0, NULL},
        {"silent", LOOM_OPT_FLAG, &silent, NULL, "never register: only heartbeat on a taken-over connection", 1, 0, NULL},
        {"seconds", LOOM_OPT_INT, &seconds, "S", "how long to try (default 5)", 1, 600, NULL},
        {"curve-server-key", LOOM_OPT_STR, &server, "FILE", "connect with CURVE: the server's public key", 1, 0, NULL},
        {"curve-secret", LOOM_OPT_STR, &secret, "FILE", "connect with CURVE: this peer's secret key", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "hijack --control ADDR [options]",
                           "Tries to take over a worker's control connection.");
    if (r) return r < 0 ? 2 : 0;
    if (!control) {
        fprintf(stderr, "hijack: --control is required\n");
        return 2;
    }
    void *ctx = zmq_ctx_new();
    void *z = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z, ZMQ_ROUTING_ID, id, strlen(id));
    loom_err_t err = {0};
    int keyed = 0;
    /* only the flags: never the keys this process may find in its environment */
    if ((server || secret) && loom_keys_client(z, server ? server : "-", secret ? secret : "-", &keyed, &err) < 0) {
        fprintf(stderr, "hijack: %s\n", err.msg);
        return 2;
    }
    zmq_connect(z, control);
    unsigned long msgs = 0, plans = 0, chosen = 0;
    uint64_t end = loom_now_ns() + (uint64_t)seconds * 1000000000ull, last_reg = 0, last_hb = 0;
    while (loom_now_ns() < end) {
        uint64_t now = loom_now_ns();
        if (!silent && now - last_reg > 300000000ull) { /* register again and again: take any slot that frees */
            last_reg = now;
            Loom__V1__Register reg = LOOM__V1__REGISTER__INIT;
            reg.worker_id = (char *)id;
            reg.host = "hijack";
            reg.device = "cpu";
            reg.data_addr = "tcp://127.0.0.1:1";
            reg.pid = (uint32_t)getpid();
            Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
            m.body_case = LOOM__V1__CONTROL_MSG__BODY_REGISTER;
            m.register_ = &reg;
            send_msg(z, &m);
        }
        if (now - last_hb > 100000000ull) {
            last_hb = now;
            Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
            Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
            m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
            m.heartbeat = &hb;
            send_msg(z, &m);
        }
        zmq_pollitem_t it = {z, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 20) <= 0) continue;
        zmq_msg_t f;
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, z, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&f);
            continue;
        }
        msgs++;
        Loom__V1__ControlMsg *m = loom_wire_unpack_control(zmq_msg_data(&f), zmq_msg_size(&f), &err);
        zmq_msg_close(&f);
        if (!m) continue;
        if (m->body_case == LOOM__V1__CONTROL_MSG__BODY_ASSIGN && !silent) {
            /* a slot was given: play a loaded worker, so the grid goes on with it */
            Loom__V1__Loaded l = LOOM__V1__LOADED__INIT;
            uint8_t group[8] = {'h', 'i', 'j', 'a', 'c', 'k', 0, 0};
            l.epoch = m->assign->epoch;
            l.weight_bytes = 1000;
            l.kv_block_bytes = 4096;
            l.kv_budget = 64ull << 20;
            l.kv_cache_dtype = "f32";
            l.tp_group_id = (ProtobufCBinaryData){sizeof group, group};
            l.next_group_id = (ProtobufCBinaryData){sizeof group, group};
            Loom__V1__ControlMsg out = LOOM__V1__CONTROL_MSG__INIT;
            out.body_case = LOOM__V1__CONTROL_MSG__BODY_LOADED;
            out.loaded = &l;
            send_msg(z, &out);
        } else if (m->body_case == LOOM__V1__CONTROL_MSG__BODY_KV_CONFIG && !silent) {
            Loom__V1__Ready rd = LOOM__V1__READY__INIT;
            rd.epoch = m->kv_config->epoch;
            Loom__V1__ControlMsg out = LOOM__V1__CONTROL_MSG__INIT;
            out.body_case = LOOM__V1__CONTROL_MSG__BODY_READY;
            out.ready = &rd;
            send_msg(z, &out);
        } else if (m->body_case == LOOM__V1__CONTROL_MSG__BODY_STEP) {
            plans++;
            Loom__V1__StepResult res = LOOM__V1__STEP_RESULT__INIT;
            res.epoch = m->step->epoch;
            res.step_id = m->step->step_id;
            int32_t ids[4096];
            size_t n = m->step->n_logit_rows < 4096 ? m->step->n_logit_rows : 4096;
            for (size_t i = 0; i < n; i++) ids[i] = 1;
            res.n_ids = n;
            res.ids = ids;
            chosen += n;
            Loom__V1__ControlMsg out = LOOM__V1__CONTROL_MSG__INIT;
            out.body_case = LOOM__V1__CONTROL_MSG__BODY_RESULT;
            out.result = &res;
            send_msg(z, &out);
        }
        protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    printf("hijack: %lu message(s), %lu step plan(s), %lu token(s) chosen (%s)\n", msgs, plans, chosen,
           keyed ? "with a CURVE key" : "no key");
    zmq_close(z);
    zmq_ctx_term(ctx);
    return 0;
}
