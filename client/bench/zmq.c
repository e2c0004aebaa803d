/* The bench's loom.v1 transport: one ZeroMQ connection carries every
 * request; chunks come back tagged with their request id. */
#include <stdio.h>
#include <string.h>

#include "client/bench/bench.h"
#include "common/util.h"

static loom_status_t zmq_submit(void *self, const bench_req_t *r, uint64_t *handle,
                                loom_err_t *err) {
    loom_gen_params_t p = {.prompt = r->prompt_text,
                           .prompt_ids = r->prompt_ids,
                           .n_prompt_ids = r->n_prompt,
                           .max_tokens = r->max_tokens,
                           .temperature = r->temperature,
                           .seed = r->seed,
                           .has_seed = 1,
                           .ignore_eos = r->ignore_eos,
                           .session = r->session};
    return loom_client_submit(self, &p, handle, err);
}

static loom_status_t zmq_poll_event(void *self, int timeout_ms, bench_event_t *ev, int *got,
                                    loom_err_t *err) {
    loom_chunk_t ch;
    LOOM_CHECK(loom_client_poll(self, timeout_ms, &ch, got, err));
    if (!*got) return LOOM_OK;
    *ev = (bench_event_t){.handle = ch.request_id,
                          .n_tokens = ch.n_ids,
                          .ids = ch.ids,
                          .final = ch.final,
                          .text = ch.text,
                          .text_len = ch.text_len,
                          .status = ch.status,
                          .prompt_tokens = ch.prompt_tokens,
                          .completion_tokens = ch.completion_tokens,
                          .cached_tokens = ch.final ? ch.cached_tokens : -1,
                          .timings = ch.timings,
                          .has_timings = ch.has_timings};
    snprintf(ev->message, sizeof ev->message, "%s", ch.message ? ch.message : "");
    return LOOM_OK;
}

static loom_status_t zmq_cancel(void *self, uint64_t handle, loom_err_t *err) {
    return loom_client_cancel(self, handle, err);
}

static loom_status_t zmq_model(void *self, bench_model_t *m, loom_err_t *err) {
    loom_model_info_t info;
    int n = 0;
    LOOM_CHECK(loom_client_list_models(self, &info, 1, &n, err));
    if (n < 1)
        return loom_err_set(err, LOOM_ERR_NOT_FOUND, "NOT_FOUND: the server lists no models");
    snprintf(m->id, sizeof m->id, "%s", info.id);
    m->context_length = info.context_length;
    m->vocab_size = info.vocab_size;
    return LOOM_OK;
}

static void zmq_close_transport(void *self) {
    loom_client_t *c = self;
    loom_client_close(&c);
}

loom_status_t bench_zmq_open(const char *addr, int timeout_ms, const char *api_key,
                             bench_transport_t *t, loom_err_t *err) {
    char ep[256];
    snprintf(ep, sizeof ep, "%s%s", strstr(addr, "://") ? "" : "tcp://", addr);
    loom_client_options_t o = {.timeout_ms = timeout_ms, .api_key = api_key};
    loom_client_t *c = NULL;
    LOOM_CHECK(loom_client_connect(ep, &o, &c, err));
    *t = (bench_transport_t){.name = "zmq",
                             .self = c,
                             .submit = zmq_submit,
                             .poll = zmq_poll_event,
                             .cancel = zmq_cancel,
                             .model = zmq_model,
                             .close = zmq_close_transport};
    return LOOM_OK;
}
