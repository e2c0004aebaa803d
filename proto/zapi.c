/* Multipart receive and loom.v1 Reply sending on ZeroMQ sockets (zapi.h). */
#include "proto/zapi.h"

#include <errno.h>
#include <stdlib.h>

#include "common/log.h"
#include "proto/wire.h"

int loom_zapi_recv_frames(void *sock, zmq_msg_t *frames, int max) {
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t extra, *f = n < max ? &frames[n] : &extra;
        zmq_msg_init(f);
        if (zmq_msg_recv(f, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(f);
            break;
        }
        more = zmq_msg_more(f);
        if (n < max) n++;
        else zmq_msg_close(f);
    }
    return n;
}

int loom_zapi_send_reply(void *sock, const void *rid, size_t rid_len, Loom__V1__Reply *r) {
    size_t len;
    void *buf = loom_wire_pack_reply(r, &len);
    int rc = zmq_send(sock, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    int gone = rc < 0 && errno == EHOSTUNREACH;
    if (rc >= 0) rc = zmq_send(sock, buf, len, ZMQ_DONTWAIT);
    if (rc < 0 && !gone) LOOM_WARN("could not send a reply: %s", zmq_strerror(errno));
    free(buf);
    return gone ? -1 : 0;
}

int loom_zapi_reply_error(void *sock, const void *rid, size_t rid_len, uint64_t request_id, loom_status_t code,
                          const char *msg) {
    return loom_zapi_reply_error_retry(sock, rid, rid_len, request_id, code, msg, 0);
}

int loom_zapi_reply_error_retry(void *sock, const void *rid, size_t rid_len, uint64_t request_id,
                                loom_status_t code, const char *msg, uint32_t retry_after_ms) {
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.retry_after_ms = retry_after_ms;
    r.request_id = request_id;
    r.code = loom_wire_status_code(code);
    r.message = (char *)msg;
    Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
    ch.final = 1;
    ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_ERROR;
    r.body_case = LOOM__V1__REPLY__BODY_CHUNK;
    r.chunk = &ch;
    return loom_zapi_send_reply(sock, rid, rid_len, &r);
}
