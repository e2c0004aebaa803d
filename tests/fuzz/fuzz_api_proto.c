/* Fuzz target: bytes off the client API socket (loom.v1 Request, as the
 * coordinator reads them, and Reply, as the client library reads them)
 * through the unpackers with their magic/version/body checks. A message
 * that unpacks must pack again and unpack to the same body. */
#include <string.h>

#include "proto/wire.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_quiet();
    return 0;
}

static size_t touch_str(const char *s) {
    return s ? strlen(s) : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_err_t err = {0};
    Loom__V1__Request *rq = loom_wire_unpack_request(data, size, &err);
    if (rq) {
        FUZZ_ASSERT(rq->body_case != LOOM__V1__REQUEST__BODY__NOT_SET);
        (void)loom_wire_method(rq->body_case);
        size_t k = touch_str(rq->api_key);
        if (rq->body_case == LOOM__V1__REQUEST__BODY_GENERATE && rq->generate) {
            const Loom__V1__GenerateRequest *g = rq->generate;
            k += touch_str(g->prompt) + touch_str(g->model);
            for (size_t i = 0; i < g->n_prompt_ids; i++)
                k += (size_t)g->prompt_ids[i];
            for (size_t i = 0; i < g->n_stop; i++)
                k += touch_str(g->stop[i]);
        }
        (void)k;
        size_t len = 0;
        void *buf = loom_wire_pack_request(rq, &len);
        Loom__V1__Request *again = loom_wire_unpack_request(buf, len, &err);
        if (!again) fprintf(stderr, "the packed request does not unpack: %s\n", err.msg);
        FUZZ_ASSERT(fuzz_pb_has_unknown(&rq->base) || (again && again->body_case == rq->body_case &&
                                                       again->request_id == rq->request_id));
        if (again) loom__v1__request__free_unpacked(again, NULL);
        free(buf);
        loom__v1__request__free_unpacked(rq, NULL);
    }
    Loom__V1__Reply *rp = loom_wire_unpack_reply(data, size, &err);
    if (rp) {
        (void)loom_wire_status_from_code(rp->code);
        (void)loom_wire_code_name(rp->code);
        size_t k = touch_str(rp->message);
        if (rp->body_case == LOOM__V1__REPLY__BODY_CHUNK && rp->chunk) {
            for (size_t i = 0; i < rp->chunk->n_ids; i++)
                k += (size_t)rp->chunk->ids[i];
            k += touch_str(rp->chunk->text);
        }
        (void)k;
        size_t len = 0;
        void *buf = loom_wire_pack_reply(rp, &len);
        Loom__V1__Reply *again = loom_wire_unpack_reply(buf, len, &err);
        if (!again) fprintf(stderr, "the packed reply does not unpack: %s\n", err.msg);
        FUZZ_ASSERT(fuzz_pb_has_unknown(&rp->base) ||
                    (again && again->body_case == rp->body_case && again->code == rp->code));
        if (again) loom__v1__reply__free_unpacked(again, NULL);
        free(buf);
        loom__v1__reply__free_unpacked(rp, NULL);
    }
    return 0;
}
