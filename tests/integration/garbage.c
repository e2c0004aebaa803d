/* Sends hostile input to a running coordinator's two sockets and checks that
 * it is refused and that the coordinator still serves afterwards.
 *
 *   garbage --api tcp://127.0.0.1:P --control tcp://127.0.0.1:P+1 [--worker-id ID]
 * Exit status 0 when every refusal came back as expected and Health answers. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include "common/cli.h"
#include "common/request_limits.h"
#include "common/util.h"
#include "proto/wire.h"
#include "tests/test.h"

static void *g_ctx;

/* Raw TCP: bytes that are not even ZMTP. */
static void raw_tcp(const char *addr) {
    const char *p = strrchr(addr, ':');
    int port = p ? atoi(p + 1) : 0;
    unsigned long long rng = 42;
    for (int i = 0; i < 20; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
            char buf[4096];
            size_t n = 1 + (size_t)(i * 397) % sizeof buf;
            for (size_t j = 0; j < n; j++) buf[j] = (char)(test_randf(&rng, 128.0f));
            if (i % 4 == 0) memcpy(buf, "\xff\0\0\0\0\0\0\0\x01\x7f", n < 10 ? n : 10); /* a ZMTP-looking greeting */
            ssize_t w = write(fd, buf, n);
            (void)w;
        }
        close(fd);
    }
}

static void *dealer(const char *addr, const char *id) {
    void *z = zmq_socket(g_ctx, ZMQ_DEALER);
    int zero = 0, to = 3000;
    zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z, ZMQ_RCVTIMEO, &to, sizeof to);
    if (id) zmq_setsockopt(z, ZMQ_ROUTING_ID, id, strlen(id));
    zmq_connect(z, addr);
    return z;
}

/* Receives one reply frame; returns its length or -1 on timeout. */
static int recv_reply(void *z, uint8_t *buf, size_t cap) {
    return zmq_recv(z, buf, cap, 0);
}

static void expect_api_error(void *z, const char *what, Loom__V1__StatusCode code) {
    uint8_t buf[65536];
    int n = recv_reply(z, buf, sizeof buf);
    CHECKF(n > 0, "%s: no reply", what);
    if (n <= 0) return;
    loom_err_t err;
    Loom__V1__Reply *r = loom_wire_unpack_reply(buf, (size_t)n, &err);
    CHECKF(r != NULL, "%s: unreadable reply: %s", what, err.msg);
    if (!r) return;
    CHECKF(r->code == code, "%s: code %d, expected %d (%s)", what, r->code, code, r->message);
    CHECKF(r->message && r->message[0], "%s: no message", what);
    fprintf(stderr, "  %s -> %s: %s\n", what, loom_wire_code_name(r->code), r->message);
    protobuf_c_message_free_unpacked(&r->base, NULL);
}

/* Reads replies (skipping a stream's chunks) until one with a non-OK code
 * comes; checks it is `code` and its message holds `needle`. */
static void expect_error_among(void *z, const char *what, Loom__V1__StatusCode code, const char *needle) {
    uint8_t buf[65536];
    for (int k = 0; k < 400; k++) {
        int n = recv_reply(z, buf, sizeof buf);
        if (n <= 0) break;
        Loom__V1__Reply *r = loom_wire_unpack_reply(buf, (size_t)n, NULL);
        if (!r) continue;
        if (r->code != LOOM__V1__STATUS_CODE__OK) {
            CHECKF(r->code == code && r->message && strstr(r->message, needle), "%s: code %d (%s)", what, r->code,
                   r->message);
            fprintf(stderr, "  %s -> %s: %s\n", what, loom_wire_code_name(r->code), r->message);
            protobuf_c_message_free_unpacked(&r->base, NULL);
            return;
        }
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    CHECKF(0, "%s: no refusal came", what);
}

/* A Generate whose prompt has byte `bad` at position 3 (protobuf-c cannot
 * pack an embedded NUL itself: the bytes are patched after packing). */
static void send_patched_prompt(void *z, uint64_t id, uint8_t bad) {
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    g.prompt = "QQQQQQQQ";
    g.max_tokens = 2;
    Loom__V1__Request rq = LOOM__V1__REQUEST__INIT;
    rq.request_id = id;
    rq.body_case = LOOM__V1__REQUEST__BODY_GENERATE;
    rq.generate = &g;
    size_t len;
    uint8_t *full = loom_wire_pack_request(&rq, &len);
    uint8_t *at = memmem(full, len, "QQQQQQQQ", 8);
    if (at) at[3] = bad;
    zmq_send(z, "loom.v1.Generate", 16, ZMQ_SNDMORE);
    zmq_send(z, full, len, 0);
    free(full);
}

static void send_request(void *z, const char *method, Loom__V1__Request *rq) {
    size_t len;
    uint8_t *full = loom_wire_pack_request(rq, &len);
    zmq_send(z, method, strlen(method), ZMQ_SNDMORE);
    zmq_send(z, full, len, 0);
    free(full);
}

/* A second connection with a serving worker's routing id: it registers and
 * heartbeats while a request runs, and must receive nothing (no Assign, no
 * step plan, not even an error), and the request must finish. */
static void control_hijack(const char *ctl, const char *api, const char *worker_id) {
    void *z = dealer(ctl, worker_id);
    Loom__V1__Register reg = LOOM__V1__REGISTER__INIT;
    reg.worker_id = (char *)worker_id;
    reg.data_addr = "tcp://127.0.0.1:1";
    reg.pid = 1;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_REGISTER;
    m.register_ = &reg;
    size_t len;
    void *p = loom_wire_pack_control(&m, &len);
    zmq_send(z, p, len, 0);
    free(p);
    Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    p = loom_wire_pack_control(&m, &len);
    zmq_send(z, p, len, 0);
    free(p);
    void *c = dealer(api, NULL);
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    g.prompt = "Once upon a time";
    g.max_tokens = 16;
    Loom__V1__Request rq = LOOM__V1__REQUEST__INIT;
    rq.request_id = 60;
    rq.body_case = LOOM__V1__REQUEST__BODY_GENERATE;
    rq.generate = &g;
    send_request(c, "loom.v1.Generate", &rq);
    int final_ok = 0, chunks = 0;
    uint8_t buf[65536];
    for (int k = 0; k < 100 && !final_ok; k++) {
        int n = recv_reply(c, buf, sizeof buf);
        if (n <= 0) break;
        Loom__V1__Reply *r = loom_wire_unpack_reply(buf, (size_t)n, NULL);
        if (r && r->body_case == LOOM__V1__REPLY__BODY_CHUNK) {
            chunks++;
            if (r->chunk->final) final_ok = r->code == LOOM__V1__STATUS_CODE__OK ? 1 : -1;
        }
        if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    CHECKF(final_ok == 1, "hijack: the request did not finish OK while a peer claimed %s (%d chunks)", worker_id,
           chunks);
    int to = 500;
    zmq_setsockopt(z, ZMQ_RCVTIMEO, &to, sizeof to);
    int got = recv_reply(z, buf, sizeof buf);
    CHECKF(got < 0, "hijack: a second connection as %s received a %d-byte message", worker_id, got);
    fprintf(stderr, "  second connection as %s -> %s; the request %s (%d chunks)\n", worker_id,
            got < 0 ? "received nothing" : "RECEIVED A MESSAGE", final_ok == 1 ? "finished" : "FAILED", chunks);
    zmq_close(c);
    zmq_close(z);
}

/* Text the decoder would cut or could not tokenize, and request ids that
 * collide or name nothing. */
static void api_text_and_ids(const char *addr) {
    void *z = dealer(addr, NULL);
    send_patched_prompt(z, 31, 0x00);
    expect_error_among(z, "embedded NUL", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT, "generate.prompt contains a NUL");
    send_patched_prompt(z, 32, 0xff);
    expect_error_among(z, "invalid UTF-8", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT, "generate.prompt is not valid UTF-8");
    /* the same id twice while the first is in flight */
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    g.prompt = "Once upon a time";
    g.max_tokens = 200;
    g.ignore_eos = 1;
    Loom__V1__Request rq = LOOM__V1__REQUEST__INIT;
    rq.request_id = 40;
    rq.body_case = LOOM__V1__REQUEST__BODY_GENERATE;
    rq.generate = &g;
    send_request(z, "loom.v1.Generate", &rq);
    send_request(z, "loom.v1.Generate", &rq);
    expect_error_among(z, "duplicate request id", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT, "already in flight");
    /* Cancel of an id that is not in flight */
    Loom__V1__CancelRequest cr = LOOM__V1__CANCEL_REQUEST__INIT;
    cr.target_request_id = 4242;
    Loom__V1__Request cq = LOOM__V1__REQUEST__INIT;
    cq.request_id = 41;
    cq.body_case = LOOM__V1__REQUEST__BODY_CANCEL;
    cq.cancel = &cr;
    send_request(z, "loom.v1.Cancel", &cq);
    expect_error_among(z, "cancel of an unknown id", LOOM__V1__STATUS_CODE__NOT_FOUND, "no request 4242");
    cr.target_request_id = 40; /* the stream in flight: found */
    cq.request_id = 42;
    send_request(z, "loom.v1.Cancel", &cq);
    expect_error_among(z, "cancel of the stream", LOOM__V1__STATUS_CODE__CANCELLED, "cancelled");
    zmq_close(z);
}

static void api_garbage(const char *addr) {
    void *z = dealer(addr, NULL);
    uint8_t junk[300];
    unsigned long long rng = 7;
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)(test_randf(&rng, 128.0f) + 128.0f);

    /* one frame only */
    zmq_send(z, junk, 40, 0);
    expect_api_error(z, "single frame", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT);
    /* method + junk */
    zmq_send(z, "loom.v1.Generate", 16, ZMQ_SNDMORE);
    zmq_send(z, junk, sizeof junk, 0);
    expect_api_error(z, "junk body", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT);
    /* a valid request, truncated at every length */
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    g.prompt = "Once upon a time";
    g.max_tokens = 4;
    Loom__V1__Request rq = LOOM__V1__REQUEST__INIT;
    rq.request_id = 5;
    rq.body_case = LOOM__V1__REQUEST__BODY_GENERATE;
    rq.generate = &g;
    size_t len;
    uint8_t *full = loom_wire_pack_request(&rq, &len);
    int refused = 0;
    for (size_t cut = 1; cut < len; cut += 3) {
        zmq_send(z, "loom.v1.Generate", 16, ZMQ_SNDMORE);
        zmq_send(z, full, cut, 0);
        uint8_t buf[65536];
        int n = recv_reply(z, buf, sizeof buf);
        if (n > 0) {
            Loom__V1__Reply *r = loom_wire_unpack_reply(buf, (size_t)n, NULL);
            if (r && r->code != LOOM__V1__STATUS_CODE__OK) refused++;
            /* a truncated body that still parses may start a stream: drain it */
            while (r && r->body_case == LOOM__V1__REPLY__BODY_CHUNK && !r->chunk->final) {
                protobuf_c_message_free_unpacked(&r->base, NULL);
                n = recv_reply(z, buf, sizeof buf);
                r = n > 0 ? loom_wire_unpack_reply(buf, (size_t)n, NULL) : NULL;
            }
            if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
        }
    }
    CHECKF(refused > 0, "no truncated request was refused");
    free(full);
    /* wrong method for the body */
    full = loom_wire_pack_request(&rq, &len);
    zmq_send(z, "loom.v1.Health", 14, ZMQ_SNDMORE);
    zmq_send(z, full, len, 0);
    expect_api_error(z, "method mismatch", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT);
    free(full);
    /* another protocol version */
    full = loom_wire_pack_request(&rq, &len);
    Loom__V1__Request *copy = loom__v1__request__unpack(NULL, len, full);
    copy->version = 99;
    free(full);
    len = loom__v1__request__get_packed_size(copy);
    full = loom_xmalloc(len);
    loom__v1__request__pack(copy, full);
    protobuf_c_message_free_unpacked(&copy->base, NULL);
    zmq_send(z, "loom.v1.Generate", 16, ZMQ_SNDMORE);
    zmq_send(z, full, len, 0);
    expect_api_error(z, "version 99", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT);
    free(full);
    /* bad parameters */
    Loom__V1__SamplingParams sp = LOOM__V1__SAMPLING_PARAMS__INIT;
    sp.temperature = -1;
    g.sampling = &sp;
    full = loom_wire_pack_request(&rq, &len);
    zmq_send(z, "loom.v1.Generate", 16, ZMQ_SNDMORE);
    zmq_send(z, full, len, 0);
    expect_api_error(z, "negative temperature", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT);
    free(full);
    g.sampling = NULL;
    int32_t bad_ids[2] = {1, 1 << 30};
    g.prompt = "";
    g.prompt_ids = bad_ids;
    g.n_prompt_ids = 2;
    full = loom_wire_pack_request(&rq, &len);
    zmq_send(z, "loom.v1.Generate", 16, ZMQ_SNDMORE);
    zmq_send(z, full, len, 0);
    expect_api_error(z, "token id out of range", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT);
    free(full);
    /* stop strings: LOOM_MAX_STOP pass (as the HTTP gateway lets through), one more is refused */
    g.prompt_ids = NULL;
    g.n_prompt_ids = 0;
    g.prompt = "Once upon a time";
    char stop_buf[LOOM_MAX_STOP + 1][16];
    char *stops[LOOM_MAX_STOP + 1];
    for (int i = 0; i <= LOOM_MAX_STOP; i++) {
        snprintf(stop_buf[i], sizeof stop_buf[i], "zq%dx", i);
        stops[i] = stop_buf[i];
    }
    g.stop = stops;
    g.n_stop = LOOM_MAX_STOP + 1;
    rq.request_id = 6;
    send_request(z, "loom.v1.Generate", &rq);
    char want[64];
    snprintf(want, sizeof want, "at most %d are allowed", LOOM_MAX_STOP);
    expect_error_among(z, "too many stop strings", LOOM__V1__STATUS_CODE__INVALID_ARGUMENT, want);
    g.n_stop = LOOM_MAX_STOP;
    rq.request_id = 7;
    send_request(z, "loom.v1.Generate", &rq);
    int done = 0;
    for (int k = 0; k < 400 && !done; k++) {
        uint8_t buf[65536];
        int n = recv_reply(z, buf, sizeof buf);
        Loom__V1__Reply *r = n > 0 ? loom_wire_unpack_reply(buf, (size_t)n, NULL) : NULL;
        if (!r) break;
        CHECKF(r->code == LOOM__V1__STATUS_CODE__OK, "%d stop strings refused: %s", LOOM_MAX_STOP, r->message);
        done = r->code != LOOM__V1__STATUS_CODE__OK ||
               (r->body_case == LOOM__V1__REPLY__BODY_CHUNK && r->chunk->final);
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    CHECKF(done, "%d stop strings: the request did not finish", LOOM_MAX_STOP);
    g.stop = NULL;
    g.n_stop = 0;
    zmq_close(z);
}

static void control_garbage(const char *addr) {
    void *z = dealer(addr, "intruder");
    uint8_t buf[65536];
    /* junk */
    zmq_send(z, "\x01\x02\x03garbage", 10, 0);
    int n = recv_reply(z, buf, sizeof buf);
    CHECKF(n > 0, "control: junk got no refusal");
    /* a StepResult from a worker nobody registered */
    Loom__V1__StepResult res = LOOM__V1__STEP_RESULT__INIT;
    res.epoch = 1;
    res.step_id = 1;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_RESULT;
    m.result = &res;
    size_t len;
    void *p = loom_wire_pack_control(&m, &len);
    zmq_send(z, p, len, 0);
    free(p);
    n = recv_reply(z, buf, sizeof buf);
    CHECKF(n > 0, "control: unregistered result got no refusal");
    if (n > 0) {
        Loom__V1__ControlMsg *r = loom_wire_unpack_control(buf, (size_t)n, NULL);
        CHECK(r && r->body_case == LOOM__V1__CONTROL_MSG__BODY_ERROR);
        if (r) {
            fprintf(stderr, "  unregistered StepResult -> %s\n", r->error->message);
            protobuf_c_message_free_unpacked(&r->base, NULL);
        }
    }
    /* a registration whose id does not match the connection */
    Loom__V1__Register reg = LOOM__V1__REGISTER__INIT;
    reg.worker_id = "somebody-else";
    reg.data_addr = "tcp://127.0.0.1:1";
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_REGISTER;
    m.register_ = &reg;
    p = loom_wire_pack_control(&m, &len);
    zmq_send(z, p, len, 0);
    free(p);
    n = recv_reply(z, buf, sizeof buf);
    CHECKF(n > 0, "control: mismatched registration got no refusal");
    /* a registration into a full grid */
    reg.worker_id = "intruder";
    p = loom_wire_pack_control(&m, &len);
    zmq_send(z, p, len, 0);
    free(p);
    n = recv_reply(z, buf, sizeof buf);
    CHECKF(n > 0, "control: registration into a full grid got no refusal");
    if (n > 0) {
        Loom__V1__ControlMsg *r = loom_wire_unpack_control(buf, (size_t)n, NULL);
        CHECK(r && r->body_case == LOOM__V1__CONTROL_MSG__BODY_ERROR &&
              r->error->code == LOOM_ERR_RESOURCE_EXHAUSTED);
        if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    /* truncated control messages */
    Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    p = loom_wire_pack_control(&m, &len);
    for (size_t cut = 1; cut < len; cut++) zmq_send(z, p, cut, 0);
    free(p);
    zmq_close(z);
}

static void health_still_ok(const char *addr) {
    void *z = dealer(addr, NULL);
    Loom__V1__HealthRequest h = LOOM__V1__HEALTH_REQUEST__INIT;
    Loom__V1__Request rq = LOOM__V1__REQUEST__INIT;
    rq.request_id = 77;
    rq.body_case = LOOM__V1__REQUEST__BODY_HEALTH;
    rq.health = &h;
    size_t len;
    void *p = loom_wire_pack_request(&rq, &len);
    zmq_send(z, "loom.v1.Health", 14, ZMQ_SNDMORE);
    zmq_send(z, p, len, 0);
    free(p);
    uint8_t buf[65536];
    int n = recv_reply(z, buf, sizeof buf);
    CHECKF(n > 0, "health: no answer after the garbage");
    if (n > 0) {
        Loom__V1__Reply *r = loom_wire_unpack_reply(buf, (size_t)n, NULL);
        CHECK(r && r->request_id == 77 && r->body_case == LOOM__V1__REPLY__BODY_HEALTH && r->health->ready);
        if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    zmq_close(z);
}

int main(int argc, char **argv) {
    const char *api = NULL, *control = NULL, *worker = NULL;
    loom_opt_t opts[] = {
        {"api", LOOM_OPT_STR, &api, "ADDR", "coordinator client API", 1, 0, NULL},
        {"control", LOOM_OPT_STR, &control, "ADDR", "coordinator control socket", 1, 0, NULL},
        {"worker-id", LOOM_OPT_STR, &worker, "ID", "a serving worker's id: a second connection claims it", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, 3, "garbage --api ADDR --control ADDR [--worker-id ID]",
                           "Sends hostile input to a coordinator and checks it is refused.");
    if (r) return r < 0 ? 2 : 0;
    if (!api || !control) return 2;
    g_ctx = zmq_ctx_new();
    g_test_name = "garbage";
    raw_tcp(api);
    raw_tcp(control);
    api_garbage(api);
    api_text_and_ids(api);
    control_garbage(control);
    if (worker) control_hijack(control, api, worker);
    health_still_ok(api);
    zmq_ctx_term(g_ctx);
    return test_summary();
}
