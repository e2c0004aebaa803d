/* The floor under bench/bench_router.sh: a proxy that only moves frames,
 * for one client connection. It binds a ROUTER for the client, connects a
 * DEALER to one replica, and forwards [method, request] one way and
 * [reply] the other, with no parsing, routing, bookkeeping or protobuf: the
 * latency it adds is what the ZeroMQ hop itself costs on this machine, the
 * part of loom-router's added latency no router logic can remove.
 *
 *   null_proxy --listen tcp://127.0.0.1:P --replica tcp://127.0.0.1:Q */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include "common/cli.h"

static volatile sig_atomic_t stop;

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

/* Moves one multipart message from `from` to `to`, after an optional
 * routing frame (`head`); drops the first `skip` frames. 0 when none was
 * waiting. */
static int forward(void *from, void *to, const void *head, size_t head_len, int skip,
                   unsigned char *id, size_t *id_len) {
    zmq_msg_t m;
    int more = 1, k = 0;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, from, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m);
        return 0;
    }
    if (head) zmq_send(to, head, head_len, ZMQ_SNDMORE);
    for (;;) {
        more = zmq_msg_more(&m);
        if (k < skip) {
            if (id && zmq_msg_size(&m) <= 255) {
                memcpy(id, zmq_msg_data(&m), zmq_msg_size(&m));
                *id_len = zmq_msg_size(&m);
            }
            zmq_msg_close(&m);
        } else {
            zmq_msg_send(&m, to, more ? ZMQ_SNDMORE : 0);
        }
        k++;
        if (!more) break;
        zmq_msg_init(&m);
        zmq_msg_recv(&m, from, 0);
    }
    return 1;
}

int main(int argc, char **argv) {
    char *listen = NULL, *replica = NULL;
    loom_opt_t opts[] = {
        {"listen", LOOM_OPT_STR, &listen, "ADDR", "the client side, a ROUTER (required)", 0, 0,
         NULL},
        {"replica", LOOM_OPT_STR, &replica, "ADDR", "the one replica, through a DEALER (required)",
         0, 0, NULL},
    };
    int r =
        loom_cli_parse(argc, argv, 1, opts, 2, "null_proxy --listen ADDR --replica ADDR",
                       "Forwards one client's frames to one replica and back, doing nothing else.");
    if (r) return r < 0 ? 2 : 0;
    if (!listen || !replica) {
        fprintf(stderr, "null_proxy: --listen and --replica are required (see --help)\n");
        return 2;
    }
    void *ctx = zmq_ctx_new(), *front = zmq_socket(ctx, ZMQ_ROUTER),
         *back = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(front, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(back, ZMQ_LINGER, &zero, sizeof zero);
    const char *bad = zmq_bind(front, listen) != 0      ? listen
                      : zmq_connect(back, replica) != 0 ? replica
                                                        : NULL;
    if (bad) {
        fprintf(stderr, "null_proxy: %s: %s\n", bad, zmq_strerror(zmq_errno()));
        return 1;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    unsigned char id[256];
    size_t id_len = 0;
    zmq_pollitem_t items[2] = {{front, 0, ZMQ_POLLIN, 0}, {back, 0, ZMQ_POLLIN, 0}};
    while (!stop) {
        if (zmq_poll(items, 2, 100) < 0) continue;
        if (items[0].revents & ZMQ_POLLIN)
            while (forward(front, back, NULL, 0, 1, id, &id_len)) {
            }
        if (items[1].revents & ZMQ_POLLIN)
            while (id_len && forward(back, front, id, id_len, 0, NULL, NULL)) {
            }
    }
    zmq_close(front);
    zmq_close(back);
    zmq_ctx_term(ctx);
    return 0;
}
