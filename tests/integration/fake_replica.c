/* A fake replica for the router's tests: a loom.v1 ROUTER that answers as
 * told, without a model.
 *
 *   fake_replica --listen tcp://127.0.0.1:P --mode MODE [--model-name N --vocab V --context C
 *                --weights-digest D --tokenizer-digest D --log PATH]
 *
 * garbage: every request gets a reply frame of junk bytes. The other modes
 * answer Health ready, ListModels with the given model, Stats zeros, and a
 * Generate as follows:
 *   model         one final chunk: id 1, "x", finish length, usage
 *   bad-ids       a chunk with id vocab + 5 (outside the vocabulary)
 *   empty-final   a final chunk with no ids, no finish reason, no usage
 *   slow          nothing: the stream stalls (Health and the rest are answered)
 *   invalid       INVALID_ARGUMENT, as a replica refuses a bad request
 * --log appends "generate <id>" and "cancel <target id>" per request seen,
 * so a test can tell what reached this replica. Runs until killed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/cli.h"
#include "common/util.h"
#include "proto/wire.h"

static void reply(void *s, zmq_msg_t *id, Loom__V1__Reply *r) {
    size_t len;
    void *buf = loom_wire_pack_reply(r, &len);
    zmq_send(s, zmq_msg_data(id), zmq_msg_size(id), ZMQ_SNDMORE);
    zmq_send(s, buf, len, 0);
    free(buf);
}

int main(int argc, char **argv) {
    const char *listen = NULL, *mode = "garbage", *name = "other-model", *log_path = NULL,
               *wdigest = "", *tdigest = "";
    int vocab = 32000, context = 2048;
    loom_opt_t opts[] = {
        {"listen", LOOM_OPT_STR, &listen, "ADDR", "bind here", 1, 0, NULL},
        {"mode", LOOM_OPT_STR, &mode, "MODE", "garbage or model", 1, 0, NULL},
        {"model-name", LOOM_OPT_STR, &name, "NAME", "model id in ListModels", 1, 0, NULL},
        {"vocab", LOOM_OPT_INT, &vocab, "N", "vocabulary size in ListModels", 1, 1 << 24, NULL},
        {"context", LOOM_OPT_INT, &context, "N", "context length in ListModels", 1, 1 << 24, NULL},
        {"weights-digest", LOOM_OPT_STR, &wdigest, "D",
         "weights digest in ListModels (default none)", 1, 0, NULL},
        {"tokenizer-digest", LOOM_OPT_STR, &tdigest, "D",
         "tokenizer digest in ListModels (default none)", 1, 0, NULL},
        {"log", LOOM_OPT_STR, &log_path, "PATH",
         "append the Generate and Cancel requests seen here", 1, 0, NULL},
    };
    int rc = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts),
                            "fake_replica --listen ADDR --mode MODE",
                            "A fake loom.v1 replica for the router's tests.");
    if (rc) return rc < 0 ? 2 : 0;
    if (!listen) return 2;
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_ROUTER);
    if (zmq_bind(s, listen) != 0) {
        fprintf(stderr, "cannot bind %s\n", listen);
        return 1;
    }
    int garbage = !strcmp(mode, "garbage");
    for (;;) {
        zmq_msg_t f[3];
        int n = 0, more = 1;
        while (more && n < 3) {
            zmq_msg_init(&f[n]);
            if (zmq_msg_recv(&f[n], s, 0) < 0) return 1;
            more = zmq_msg_more(&f[n]);
            n++;
        }
        if (n == 3) {
            loom_err_t err;
            Loom__V1__Request *rq =
                loom_wire_unpack_request(zmq_msg_data(&f[2]), zmq_msg_size(&f[2]), &err);
            if (garbage) {
                static const char junk[] = "\x12\x34not a loom reply\xff\xfe";
                zmq_send(s, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), ZMQ_SNDMORE);
                zmq_send(s, junk, sizeof junk - 1, 0);
            } else if (rq) {
                Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
                r.request_id = rq->request_id;
                Loom__V1__HealthReply h = LOOM__V1__HEALTH_REPLY__INIT;
                Loom__V1__ModelInfo mi = LOOM__V1__MODEL_INFO__INIT;
                Loom__V1__ModelInfo *mp = &mi;
                Loom__V1__ListModelsReply lm = LOOM__V1__LIST_MODELS_REPLY__INIT;
                Loom__V1__StatsReply st = LOOM__V1__STATS_REPLY__INIT;
                Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
                Loom__V1__Usage usage = LOOM__V1__USAGE__INIT;
                int32_t id1 = 1;
                if (log_path && (rq->body_case == LOOM__V1__REQUEST__BODY_GENERATE ||
                                 (rq->body_case == LOOM__V1__REQUEST__BODY_CANCEL && rq->cancel))) {
                    FILE *lf = fopen(log_path, "a");
                    if (lf) {
                        if (rq->body_case == LOOM__V1__REQUEST__BODY_GENERATE)
                            fprintf(lf, "generate %llu\n", (unsigned long long)rq->request_id);
                        else
                            fprintf(lf, "cancel %llu\n",
                                    (unsigned long long)rq->cancel->target_request_id);
                        fclose(lf);
                    }
                }
                switch (rq->body_case) {
                case LOOM__V1__REQUEST__BODY_HEALTH:
                    h.ready = 1;
                    h.state = (char *)"ready";
                    r.body_case = LOOM__V1__REPLY__BODY_HEALTH;
                    r.health = &h;
                    break;
                case LOOM__V1__REQUEST__BODY_LIST_MODELS:
                    mi.id = (char *)name;
                    mi.vocab_size = (uint32_t)vocab;
                    mi.context_length = (uint32_t)context;
                    mi.weights_digest = (char *)wdigest;
                    mi.tokenizer_digest = (char *)tdigest;
                    lm.models = &mp;
                    lm.n_models = 1;
                    r.body_case = LOOM__V1__REPLY__BODY_MODELS;
                    r.models = &lm;
                    break;
                case LOOM__V1__REQUEST__BODY_GENERATE:
                    r.body_case = LOOM__V1__REPLY__BODY_CHUNK;
                    r.chunk = &ch;
                    ch.ids = &id1;
                    ch.n_ids = 1;
                    ch.text = (char *)"x";
                    if (!strcmp(mode, "bad-ids")) {
                        id1 = vocab + 5;
                    } else if (!strcmp(mode, "empty-final")) {
                        ch.ids = NULL;
                        ch.n_ids = 0;
                        ch.text = (char *)"";
                        ch.final = 1;
                    } else if (!strcmp(mode, "invalid")) {
                        ch.ids = NULL;
                        ch.n_ids = 0;
                        ch.text = (char *)"";
                        ch.final = 1;
                        ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_ERROR;
                        r.code = loom_wire_status_code(LOOM_ERR_INVALID_ARGUMENT);
                        r.message = (char *)"max_tokens must be positive (from the fake replica)";
                    } else { /* model */
                        ch.final = 1;
                        ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_LENGTH;
                        usage.completion_tokens = 1;
                        ch.usage = &usage;
                    }
                    break;
                case LOOM__V1__REQUEST__BODY_CANCEL: {
                    static Loom__V1__CancelReply cr = LOOM__V1__CANCEL_REPLY__INIT;
                    r.body_case = LOOM__V1__REPLY__BODY_CANCEL;
                    r.cancel = &cr;
                    break;
                }
                default:
                    r.body_case = LOOM__V1__REPLY__BODY_STATS;
                    r.stats = &st;
                    break;
                }
                if (!(rq->body_case == LOOM__V1__REQUEST__BODY_GENERATE && !strcmp(mode, "slow")))
                    reply(s, &f[0], &r); /* slow: a Generate is never answered */
            }
            if (rq) protobuf_c_message_free_unpacked(&rq->base, NULL);
        }
        for (int k = 0; k < n; k++)
            zmq_msg_close(&f[k]);
    }
}
