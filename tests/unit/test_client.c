/* The C client and the `loom generate|health|stats|bench` commands against a
 * fake coordinator: a ROUTER thread on tcp://127.0.0.1:* that speaks loom.v1,
 * streams chunks, honours Cancel, refuses bad requests, and misbehaves on
 * purpose (another protocol version, garbage bytes, silence). */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "client/loom_client.h"
#include "common/log.h"
#include "common/util.h"
#include "proto/wire.h"
#include "tests/test.h"

/* The commands under test (declared in client/commands.h by the integrator). */
int loom_cmd_generate(int argc, char **argv);
int loom_cmd_health(int argc, char **argv);
int loom_cmd_stats(int argc, char **argv);
int loom_cmd_bench(int argc, char **argv);

#define FAKE_CONTEXT 4096
#define FAKE_VOCAB 512
#define MAX_STREAMS 256

/* ---- the fake coordinator ---- */

typedef struct stream {
    unsigned char ident[256];
    size_t ident_len;
    uint64_t id;
    int total, sent, cancelled, n_prompt;
    uint64_t interval_ns, next_ns;
} stream_t;

/* What the fake saw of the last Generate, and counters over all of them. */
typedef struct seen {
    char prompt[64], model[64], api_key[64], stop[4][16], tag[64];
    int32_t stop_ids[4];
    int n_stop_ids;
    int n_stop, max_tokens, top_k, ignore_eos, priority, keep_special, has_seed, n_prompt_ids;
    float temperature, top_p;
    uint64_t seed, request_id;
    int n_generate, n_id_prompts, min_id, max_id, min_max_tokens, max_max_tokens, all_ignore_eos;
    int n_cancels;
    uint64_t last_cancel_target;
    char health_api_key[64];
} seen_t;

typedef struct fake {
    void *ctx, *sock;
    char endpoint[128];
    pthread_t thread;
    atomic_int stop;
    pthread_mutex_t mu;
    seen_t seen;
    stream_t streams[MAX_STREAMS];
    int n_streams;
} fake_t;

static void fake_send_raw(fake_t *f, const stream_t *to, const void *buf, size_t len) {
    zmq_send(f->sock, to->ident, to->ident_len, ZMQ_SNDMORE);
    zmq_send(f->sock, buf, len, 0);
}

static void fake_send(fake_t *f, const stream_t *to, Loom__V1__Reply *r) {
    size_t len = 0;
    void *buf = loom_wire_pack_reply(r, &len);
    fake_send_raw(f, to, buf, len);
    free(buf);
}

static void fake_error(fake_t *f, const stream_t *to, uint64_t id, Loom__V1__StatusCode code, const char *msg) {
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = id;
    r.code = code;
    r.message = (char *)msg;
    fake_send(f, to, &r);
}

/* One chunk of a stream: token k is id 100+k with text "t<k> "; the last
 * token's chunk is final. A cancelled stream ends with an empty final chunk. */
static void fake_stream_step(fake_t *f, stream_t *s) {
    Loom__V1__Usage usage = LOOM__V1__USAGE__INIT;
    Loom__V1__Timings timings = LOOM__V1__TIMINGS__INIT;
    Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = s->id;
    r.body_case = LOOM__V1__REPLY__BODY_CHUNK;
    r.chunk = &ch;
    int32_t id = 100 + s->sent;
    char text[32];
    if (s->cancelled) {
        ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_CANCELLED;
        ch.final = 1;
    } else if (s->total > 0) {
        snprintf(text, sizeof text, "t%d ", s->sent);
        ch.ids = &id;
        ch.n_ids = 1;
        ch.text = text;
        s->sent++;
        if (s->sent == s->total) {
            ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_LENGTH;
            ch.final = 1;
        }
    } else {
        ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_LENGTH;
        ch.final = 1;
    }
    if (ch.final) {
        usage.prompt_tokens = (uint32_t)s->n_prompt;
        usage.completion_tokens = (uint32_t)s->sent;
        usage.cached_tokens = 1;
        ch.usage = &usage;
        if (!s->cancelled) { /* a cancelled stream ends without timings */
            timings = (Loom__V1__Timings){.base = timings.base, .queue_ms = 1.5, .tokenize_ms = 0.25,
                                          .prefill_ms = 2.5, .decode_ms = 10, .detokenize_ms = 0.125,
                                          .send_ms = 0.5, .ttft_ms = 4.25, .total_ms = 14.25};
            ch.timings = &timings;
        }
    }
    fake_send(f, s, &r);
    if (ch.final) s->total = -1; /* done */
}

static void fake_tick(fake_t *f) {
    uint64_t now = loom_now_ns();
    for (int i = 0; i < f->n_streams; i++) {
        stream_t *s = &f->streams[i];
        if (now < s->next_ns) continue;
        s->next_ns = now + s->interval_ns;
        fake_stream_step(f, s);
    }
    int k = 0;
    for (int i = 0; i < f->n_streams; i++)
        if (f->streams[i].total >= 0) f->streams[k++] = f->streams[i];
    f->n_streams = k;
}

static void copy_str(char *dst, size_t n, const char *src) {
    snprintf(dst, n, "%s", src ? src : "");
}

static void fake_generate(fake_t *f, stream_t *from, const Loom__V1__Request *q) {
    const Loom__V1__GenerateRequest *g = q->generate;
    pthread_mutex_lock(&f->mu);
    seen_t *sn = &f->seen;
    copy_str(sn->prompt, sizeof sn->prompt, g->prompt);
    copy_str(sn->model, sizeof sn->model, g->model);
    copy_str(sn->api_key, sizeof sn->api_key, q->api_key);
    sn->n_stop = (int)g->n_stop;
    for (size_t i = 0; i < g->n_stop && i < 4; i++) copy_str(sn->stop[i], sizeof sn->stop[i], g->stop[i]);
    sn->max_tokens = (int)g->max_tokens;
    sn->temperature = g->sampling ? g->sampling->temperature : -1;
    sn->top_p = g->sampling ? g->sampling->top_p : -1;
    sn->top_k = g->sampling ? g->sampling->top_k : -1;
    sn->seed = g->sampling ? g->sampling->seed : 0;
    sn->has_seed = g->sampling ? g->sampling->has_seed : 0;
    sn->ignore_eos = g->ignore_eos;
    sn->priority = g->priority;
    sn->keep_special = g->keep_special;
    copy_str(sn->tag, sizeof sn->tag, g->tag);
    sn->n_stop_ids = (int)g->n_stop_token_ids;
    for (size_t i = 0; i < g->n_stop_token_ids && i < 4; i++) sn->stop_ids[i] = g->stop_token_ids[i];
    sn->n_prompt_ids = (int)g->n_prompt_ids;
    sn->request_id = q->request_id;
    sn->n_generate++;
    if (g->n_prompt_ids) {
        if (!sn->n_id_prompts) {
            sn->min_id = INT32_MAX;
            sn->max_id = INT32_MIN;
            sn->min_max_tokens = INT32_MAX;
            sn->max_max_tokens = 0;
            sn->all_ignore_eos = 1;
        }
        sn->n_id_prompts++;
        for (size_t i = 0; i < g->n_prompt_ids; i++) {
            sn->min_id = LOOM_MIN(sn->min_id, g->prompt_ids[i]);
            sn->max_id = LOOM_MAX(sn->max_id, g->prompt_ids[i]);
        }
        sn->min_max_tokens = LOOM_MIN(sn->min_max_tokens, (int)g->max_tokens);
        sn->max_max_tokens = LOOM_MAX(sn->max_max_tokens, (int)g->max_tokens);
        sn->all_ignore_eos &= g->ignore_eos;
    }
    pthread_mutex_unlock(&f->mu);

    const char *p = g->prompt;
    if (!strcmp(p, "bad")) {
        fake_error(f, from, q->request_id, LOOM__V1__STATUS_CODE__INVALID_ARGUMENT,
                   "prompt is 600 tokens + max_tokens 100 exceeds the context length 512");
        return;
    }
    if (!strcmp(p, "busy")) {
        fake_error(f, from, q->request_id, LOOM__V1__STATUS_CODE__RESOURCE_EXHAUSTED, "the waiting queue is full");
        return;
    }
    if (!strcmp(p, "silent")) return;
    if (!strcmp(p, "version")) {
        Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
        r.magic = LOOM_PROTO_MAGIC;
        r.version = 2;
        r.request_id = q->request_id;
        r.code = LOOM__V1__STATUS_CODE__OK;
        uint8_t buf[256];
        size_t len = loom__v1__reply__pack(&r, buf);
        fake_send_raw(f, from, buf, len);
        return;
    }
    if (!strcmp(p, "garbage")) {
        static const unsigned char junk[] = {0xff, 0xfe, 0x00, 0x13, 0x37, 0x08, 0x96, 0x01, 0xde, 0xad};
        fake_send_raw(f, from, junk, sizeof junk);
    }
    if (f->n_streams == MAX_STREAMS) {
        fake_error(f, from, q->request_id, LOOM__V1__STATUS_CODE__RESOURCE_EXHAUSTED, "fake: too many streams");
        return;
    }
    stream_t *s = &f->streams[f->n_streams++];
    *s = *from;
    s->id = q->request_id;
    s->total = !strcmp(p, "slow") ? 100000 : (int)g->max_tokens;
    s->n_prompt = g->n_prompt_ids ? (int)g->n_prompt_ids : (int)strlen(p);
    s->interval_ns = (!strcmp(p, "slow") ? 5 : 1) * 1000000ull;
    s->next_ns = 0;
}

static void fake_handle(fake_t *f) {
    stream_t from = {0};
    unsigned char method[64] = {0};
    zmq_msg_t body;
    int n = zmq_recv(f->sock, from.ident, sizeof from.ident, 0);
    if (n < 0) return;
    from.ident_len = (size_t)LOOM_MIN(n, (int)sizeof from.ident);
    int more = 0;
    size_t ml = sizeof more;
    zmq_getsockopt(f->sock, ZMQ_RCVMORE, &more, &ml);
    if (!more) return;
    n = zmq_recv(f->sock, method, sizeof method - 1, 0);
    if (n < 0) return;
    method[LOOM_MIN(n, (int)sizeof method - 1)] = '\0';
    zmq_msg_init(&body);
    if (zmq_msg_recv(&body, f->sock, 0) < 0) {
        zmq_msg_close(&body);
        return;
    }
    loom_err_t err = {0};
    Loom__V1__Request *q = loom_wire_unpack_request(zmq_msg_data(&body), zmq_msg_size(&body), &err);
    zmq_msg_close(&body);
    if (!q) {
        fake_error(f, &from, 0, LOOM__V1__STATUS_CODE__INVALID_ARGUMENT, err.msg);
        return;
    }
    if (strcmp((const char *)method, loom_wire_method(q->body_case)) != 0) {
        fake_error(f, &from, q->request_id, LOOM__V1__STATUS_CODE__INVALID_ARGUMENT, "method and body disagree");
        loom__v1__request__free_unpacked(q, NULL);
        return;
    }
    Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
    r.request_id = q->request_id;
    switch (q->body_case) {
    case LOOM__V1__REQUEST__BODY_GENERATE: fake_generate(f, &from, q); break;
    case LOOM__V1__REQUEST__BODY_CANCEL: {
        Loom__V1__CancelReply cr = LOOM__V1__CANCEL_REPLY__INIT;
        for (int i = 0; i < f->n_streams; i++)
            if (f->streams[i].id == q->cancel->target_request_id && f->streams[i].ident_len == from.ident_len &&
                !memcmp(f->streams[i].ident, from.ident, from.ident_len)) {
                f->streams[i].cancelled = 1;
                cr.found = 1;
            }
        pthread_mutex_lock(&f->mu);
        f->seen.n_cancels++;
        f->seen.last_cancel_target = q->cancel->target_request_id;
        pthread_mutex_unlock(&f->mu);
        r.body_case = LOOM__V1__REPLY__BODY_CANCEL;
        r.cancel = &cr;
        fake_send(f, &from, &r);
        break;
    }
    case LOOM__V1__REQUEST__BODY_HEALTH: {
        pthread_mutex_lock(&f->mu);
        copy_str(f->seen.health_api_key, sizeof f->seen.health_api_key, q->api_key);
        pthread_mutex_unlock(&f->mu);
        /* A stray reply for a request nobody sent comes first: it must be dropped. */
        Loom__V1__Reply stray = LOOM__V1__REPLY__INIT;
        Loom__V1__HealthReply sh = LOOM__V1__HEALTH_REPLY__INIT;
        stray.request_id = 987654321;
        stray.body_case = LOOM__V1__REPLY__BODY_HEALTH;
        stray.health = &sh;
        fake_send(f, &from, &stray);
        Loom__V1__HealthReply h = LOOM__V1__HEALTH_REPLY__INIT;
        h.ready = 1;
        h.state = "ready";
        h.workers_ready = 2;
        h.workers_expected = 2;
        h.message = "all workers serving";
        r.body_case = LOOM__V1__REPLY__BODY_HEALTH;
        r.health = &h;
        fake_send(f, &from, &r);
        break;
    }
    case LOOM__V1__REQUEST__BODY_STATS: {
        Loom__V1__StatsReply s = LOOM__V1__STATS_REPLY__INIT;
        s.running = 3;
        s.waiting = 1;
        s.preparing = 4;
        s.kv_blocks_total = 100;
        s.kv_blocks_used = 40;
        s.kv_blocks_free = 60;
        s.kv_block_size = 16;
        s.kv_blocks_cached = 7;
        s.prefix_cache_queries = 10;
        s.prefix_cache_hits = 5;
        s.prefix_cache_hit_rate = 0.5;
        s.gen_tokens_per_s = 123.5;
        s.requests_finished = 9;
        s.requests_rejected = 2;
        s.preemptions = 1;
        s.prompt_tokens_total = 1000;
        s.gen_tokens_total = 2000;
        s.steps = 42;
        s.step_ms_mean = 1.5;
        s.ahead_tokens = 7;
        s.ahead_dropped = 2;
        r.body_case = LOOM__V1__REPLY__BODY_STATS;
        r.stats = &s;
        fake_send(f, &from, &r);
        break;
    }
    case LOOM__V1__REQUEST__BODY_LIST_MODELS: {
        Loom__V1__ModelInfo m0 = LOOM__V1__MODEL_INFO__INIT, m1 = LOOM__V1__MODEL_INFO__INIT;
        m0.id = "stories260K";
        m0.context_length = FAKE_CONTEXT;
        m0.vocab_size = FAKE_VOCAB;
        m0.tp = 1;
        m0.pp = 2;
        m1.id = "other";
        m1.context_length = 128;
        m1.vocab_size = 100;
        m1.tp = 2;
        m1.pp = 1;
        Loom__V1__ModelInfo *ms[] = {&m0, &m1};
        Loom__V1__ListModelsReply lm = LOOM__V1__LIST_MODELS_REPLY__INIT;
        lm.models = ms;
        lm.n_models = 2;
        r.body_case = LOOM__V1__REPLY__BODY_MODELS;
        r.models = &lm;
        fake_send(f, &from, &r);
        break;
    }
    default: fake_error(f, &from, q->request_id, LOOM__V1__STATUS_CODE__INVALID_ARGUMENT, "no body"); break;
    }
    loom__v1__request__free_unpacked(q, NULL);
}

static void *fake_main(void *arg) {
    fake_t *f = arg;
    while (!atomic_load(&f->stop)) {
        zmq_pollitem_t it = {.socket = f->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&it, 1, 1) > 0 && (it.revents & ZMQ_POLLIN)) {
            for (int k = 0; k < 64 && !atomic_load(&f->stop); k++) {
                fake_handle(f);
                int ev = 0;
                size_t el = sizeof ev;
                zmq_getsockopt(f->sock, ZMQ_EVENTS, &ev, &el);
                if (!(ev & ZMQ_POLLIN)) break;
            }
        }
        fake_tick(f);
    }
    return NULL;
}

static fake_t *fake_start(void) {
    fake_t *f = loom_xcalloc(1, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    f->ctx = zmq_ctx_new();
    f->sock = zmq_socket(f->ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(f->sock, ZMQ_SNDHWM, &zero, sizeof zero);
    if (zmq_bind(f->sock, "tcp://127.0.0.1:*") != 0) {
        fprintf(stderr, "fake: bind: %s\n", zmq_strerror(errno));
        exit(1);
    }
    size_t n = sizeof f->endpoint;
    zmq_getsockopt(f->sock, ZMQ_LAST_ENDPOINT, f->endpoint, &n);
    pthread_create(&f->thread, NULL, fake_main, f);
    return f;
}

static void fake_stop(fake_t **fp) {
    fake_t *f = *fp;
    atomic_store(&f->stop, 1);
    pthread_join(f->thread, NULL);
    zmq_close(f->sock);
    zmq_ctx_term(f->ctx);
    pthread_mutex_destroy(&f->mu);
    free(f);
    *fp = NULL;
}

static seen_t fake_seen(fake_t *f) {
    pthread_mutex_lock(&f->mu);
    seen_t s = f->seen;
    pthread_mutex_unlock(&f->mu);
    return s;
}

static fake_t *g_fake;

static loom_client_t *connect_client(int timeout_ms, const char *api_key) {
    loom_client_options_t o = {.timeout_ms = timeout_ms, .api_key = api_key};
    loom_client_t *c = NULL;
    loom_err_t err = {0};
    if (loom_client_connect(g_fake->endpoint, &o, &c, &err) < 0) fprintf(stderr, "connect: %s\n", err.msg);
    return c;
}

/* ---- the library ---- */

typedef struct collect {
    char text[4096];
    size_t len;
    int32_t ids[256];
    int n_ids, n_calls, n_final, cancel_after;
    uint64_t request_id;
    loom_chunk_t final; /* its pointers are not kept; message copied below */
    char final_message[512];
} collect_t;

static int collect_chunk(void *ctx, const loom_chunk_t *ch) {
    collect_t *c = ctx;
    c->n_calls++;
    c->request_id = ch->request_id;
    if (ch->text_len && c->len + ch->text_len < sizeof c->text) {
        memcpy(c->text + c->len, ch->text, ch->text_len);
        c->len += ch->text_len;
        c->text[c->len] = '\0';
    }
    for (int i = 0; i < ch->n_ids && c->n_ids < 256; i++) c->ids[c->n_ids++] = ch->ids[i];
    if (ch->final) {
        c->n_final++;
        c->final = *ch;
        c->final.ids = NULL;
        c->final.text = NULL;
        c->final.message = NULL;
        snprintf(c->final_message, sizeof c->final_message, "%s", ch->message ? ch->message : "");
    }
    return c->cancel_after && c->n_calls >= c->cancel_after;
}

static void test_generate_stream(void) {
    loom_client_t *c = connect_client(5000, "secret");
    REQUIRE(c);
    const char *stops[] = {"\n\n", "END"};
    loom_gen_params_t p = {.prompt = "hello", .max_tokens = 5, .temperature = 0.5f, .top_p = 0.9f, .top_k = 7,
                           .seed = 1234, .has_seed = 1, .stop = stops, .n_stop = 2, .ignore_eos = 1,
                           .priority = 3, .keep_special = 1, .model = "stories260K", .tag = "req-9",
                           .stop_token_ids = (const int32_t[]){7, 11}, .n_stop_token_ids = 2};
    collect_t col = {0};
    loom_err_t err = {0};
    loom_status_t s = loom_client_generate(c, &p, collect_chunk, &col, &err);
    CHECKF(s == LOOM_OK, "%s", err.msg);
    CHECK(!strcmp(col.text, "t0 t1 t2 t3 t4 "));
    CHECK(col.n_calls == 5 && col.n_final == 1);
    CHECK(col.n_ids == 5 && col.ids[0] == 100 && col.ids[4] == 104);
    CHECK(col.final.final && col.final.finish == LOOM_FINISH_LENGTH && col.final.status == LOOM_OK);
    CHECK(col.final.prompt_tokens == 5 && col.final.completion_tokens == 5 && col.final.cached_tokens == 1);
    const loom_timings_t *tm = &col.final.timings;
    CHECK(col.final.has_timings && tm->queue_ms == 1.5 && tm->tokenize_ms == 0.25 && tm->prefill_ms == 2.5 &&
          tm->decode_ms == 10 && tm->detokenize_ms == 0.125 && tm->send_ms == 0.5 && tm->ttft_ms == 4.25 &&
          tm->total_ms == 14.25);
    seen_t sn = fake_seen(g_fake);
    CHECK(!strcmp(sn.tag, "req-9") && sn.n_stop_ids == 2 && sn.stop_ids[0] == 7 && sn.stop_ids[1] == 11);
    CHECK(!strcmp(sn.prompt, "hello") && !strcmp(sn.model, "stories260K") && !strcmp(sn.api_key, "secret"));
    CHECK(sn.max_tokens == 5 && sn.temperature == 0.5f && sn.top_p == 0.9f && sn.top_k == 7);
    CHECK(sn.seed == 1234 && sn.has_seed && sn.ignore_eos && sn.priority == 3 && sn.keep_special);
    CHECK(sn.n_stop == 2 && !strcmp(sn.stop[0], "\n\n") && !strcmp(sn.stop[1], "END"));
    CHECK(sn.request_id == col.request_id);
    uint64_t first = sn.request_id;

    /* Ids grow per client; prompt ids travel as given. */
    int32_t ids[] = {5, 6, 7};
    loom_gen_params_t q = {.prompt_ids = ids, .n_prompt_ids = 3, .max_tokens = 2};
    collect_t col2 = {0};
    s = loom_client_generate(c, &q, collect_chunk, &col2, &err);
    CHECKF(s == LOOM_OK, "%s", err.msg);
    sn = fake_seen(g_fake);
    CHECK(sn.request_id > first && col2.request_id == sn.request_id);
    CHECK(sn.n_prompt_ids == 3 && sn.prompt[0] == '\0' && !sn.has_seed && sn.n_stop == 0);
    CHECK(col2.final.prompt_tokens == 3 && !strcmp(col2.text, "t0 t1 "));

    /* A zero-token stream: one final chunk, no text. */
    loom_gen_params_t z = {.prompt = "empty", .max_tokens = 0};
    collect_t col3 = {0};
    s = loom_client_generate(c, &z, collect_chunk, &col3, &err);
    CHECK(s == LOOM_OK && col3.n_calls == 1 && col3.len == 0 && col3.final.completion_tokens == 0);
    loom_client_close(&c);
    loom_client_close(&c); /* twice is fine */
    CHECK(c == NULL);
}

static void test_refusals(void) {
    loom_client_t *c = connect_client(5000, NULL);
    REQUIRE(c);
    loom_err_t err = {0};
    collect_t col = {0};
    loom_gen_params_t p = {.prompt = "bad", .max_tokens = 100};
    loom_status_t s = loom_client_generate(c, &p, collect_chunk, &col, &err);
    CHECK(s == LOOM_ERR_INVALID_ARGUMENT && err.code == LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(!strcmp(err.msg, "INVALID_ARGUMENT: prompt is 600 tokens + max_tokens 100 exceeds the context length 512"),
           "%s", err.msg);
    CHECK(col.n_final == 1 && col.final.status == LOOM_ERR_INVALID_ARGUMENT && col.final.finish == LOOM_FINISH_ERROR);
    CHECK(strstr(col.final_message, "context length 512") != NULL);

    p.prompt = "busy";
    s = loom_client_generate(c, &p, NULL, NULL, &err);
    CHECK(s == LOOM_ERR_RESOURCE_EXHAUSTED && strstr(err.msg, "RESOURCE_EXHAUSTED: the waiting queue is full"));

    /* Refused before anything is sent. */
    loom_gen_params_t none = {.max_tokens = 1};
    CHECK(loom_client_generate(c, &none, NULL, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_client_cancel(c, 424242, &err) == LOOM_ERR_NOT_FOUND);
    loom_client_close(&c);

    loom_client_options_t o = {.timeout_ms = 100};
    CHECK(loom_client_connect("nonsense", &o, &c, &err) == LOOM_ERR_INVALID_ARGUMENT && !c);
    CHECK(strstr(err.msg, "nonsense") != NULL);
    CHECK(loom_client_connect("", &o, &c, &err) == LOOM_ERR_INVALID_ARGUMENT && !c);
}

static void test_misbehaving_server(void) {
    loom_client_t *c = connect_client(300, NULL);
    REQUIRE(c);
    loom_err_t err = {0};

    /* Another protocol version: a clear error, not a hang. */
    loom_gen_params_t p = {.prompt = "version", .max_tokens = 3};
    double t0 = loom_now_s();
    loom_status_t s = loom_client_generate(c, &p, NULL, NULL, &err);
    CHECK(s == LOOM_ERR_PROTOCOL);
    CHECKF(strstr(err.msg, "version 2") && strstr(err.msg, "speaks 1") && strstr(err.msg, g_fake->endpoint), "%s",
           err.msg);
    CHECK(loom_now_s() - t0 < 0.25);

    /* Garbage before a good stream: dropped, the stream still arrives. */
    p.prompt = "garbage";
    collect_t col = {0};
    s = loom_client_generate(c, &p, collect_chunk, &col, &err);
    CHECKF(s == LOOM_OK, "%s", err.msg);
    CHECK(!strcmp(col.text, "t0 t1 t2 "));

    /* Silence: UNAVAILABLE within the timeout, naming the address. */
    p.prompt = "silent";
    t0 = loom_now_s();
    s = loom_client_generate(c, &p, NULL, NULL, &err);
    double dt = loom_now_s() - t0;
    CHECK(s == LOOM_ERR_UNAVAILABLE);
    CHECKF(strstr(err.msg, "UNAVAILABLE: no reply from") && strstr(err.msg, g_fake->endpoint) &&
               strstr(err.msg, "300 ms"),
           "%s", err.msg);
    CHECKF(dt >= 0.29 && dt < 1.5, "timed out after %.3f s", dt);

    /* The client is still usable; a stray reply for an unknown id is dropped. */
    loom_health_t h;
    s = loom_client_health(c, &h, &err);
    CHECKF(s == LOOM_OK, "%s", err.msg);
    loom_client_close(&c);

    /* Nobody listening at all. */
    loom_client_options_t o = {.timeout_ms = 200};
    CHECK(loom_client_connect("tcp://127.0.0.1:1", &o, &c, &err) == LOOM_OK);
    s = loom_client_health(c, &h, &err);
    CHECK(s == LOOM_ERR_UNAVAILABLE && strstr(err.msg, "tcp://127.0.0.1:1 in 200 ms (is the coordinator running?)"));
    loom_client_close(&c);
}

static void *stop_later(void *arg) {
    usleep(300000);
    fake_stop((fake_t **)arg);
    return NULL;
}

/* The server goes away mid-stream: UNAVAILABLE at once, not at the timeout. */
static void test_server_gone(void) {
    fake_t *f = fake_start();
    loom_client_options_t o = {.timeout_ms = 30000};
    loom_client_t *c = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_client_connect(f->endpoint, &o, &c, &err) == LOOM_OK);
    char endpoint[128];
    snprintf(endpoint, sizeof endpoint, "%s", f->endpoint);
    pthread_t t;
    pthread_create(&t, NULL, stop_later, &f);
    loom_gen_params_t p = {.prompt = "silent", .max_tokens = 3};
    double t0 = loom_now_s();
    loom_status_t s = loom_client_generate(c, &p, NULL, NULL, &err);
    double dt = loom_now_s() - t0;
    pthread_join(t, NULL);
    CHECK(s == LOOM_ERR_UNAVAILABLE);
    CHECKF(strstr(err.msg, "connection to") && strstr(err.msg, endpoint) && strstr(err.msg, "was lost"), "%s",
           err.msg);
    CHECKF(dt >= 0.25 && dt < 3.5, "noticed after %.3f s", dt);
    loom_client_close(&c);
}

static void test_unary(void) {
    loom_client_t *c = connect_client(5000, "k3y");
    REQUIRE(c);
    loom_err_t err = {0};
    loom_health_t h;
    CHECKF(loom_client_health(c, &h, &err) == LOOM_OK, "%s", err.msg);
    CHECK(h.ready && !strcmp(h.state, "ready") && h.workers_ready == 2 && h.workers_expected == 2);
    CHECK(!strcmp(h.message, "all workers serving"));
    CHECK(!strcmp(fake_seen(g_fake).health_api_key, "k3y"));

    loom_stats_t st;
    CHECKF(loom_client_stats(c, &st, &err) == LOOM_OK, "%s", err.msg);
    CHECK(st.running == 3 && st.waiting == 1 && st.kv_blocks_total == 100 && st.kv_blocks_used == 40);
    CHECK(st.kv_blocks_free == 60 && st.kv_block_size == 16 && st.kv_blocks_cached == 7);
    CHECK(st.prefix_cache_queries == 10 && st.prefix_cache_hits == 5 && st.prefix_cache_hit_rate == 0.5);
    CHECK(st.gen_tokens_per_s == 123.5 && st.requests_finished == 9 && st.requests_rejected == 2);
    CHECK(st.preemptions == 1 && st.prompt_tokens_total == 1000 && st.gen_tokens_total == 2000);
    CHECK(st.steps == 42 && st.step_ms_mean == 1.5 && st.preparing == 4);

    loom_model_info_t m[4];
    int n = 0;
    CHECKF(loom_client_list_models(c, m, 4, &n, &err) == LOOM_OK, "%s", err.msg);
    CHECK(n == 2 && !strcmp(m[0].id, "stories260K") && m[0].context_length == FAKE_CONTEXT);
    CHECK(m[0].vocab_size == FAKE_VOCAB && m[0].tp == 1 && m[0].pp == 2 && !strcmp(m[1].id, "other"));
    /* Room for one: n still says how many there are. */
    CHECK(loom_client_list_models(c, m, 1, &n, &err) == LOOM_OK && n == 2);
    loom_client_close(&c);
}

static void test_cancel_by_callback(void) {
    loom_client_t *c = connect_client(5000, NULL);
    REQUIRE(c);
    int before = fake_seen(g_fake).n_cancels;
    loom_gen_params_t p = {.prompt = "slow", .max_tokens = 0};
    collect_t col = {.cancel_after = 3};
    loom_err_t err = {0};
    double t0 = loom_now_s();
    loom_status_t s = loom_client_generate(c, &p, collect_chunk, &col, &err);
    CHECK(s == LOOM_ERR_CANCELLED && err.code == LOOM_ERR_CANCELLED && strstr(err.msg, "CANCELLED"));
    /* No more text after the cancel; the final chunk still comes, with usage. */
    CHECK(col.n_calls == 4 && col.n_final == 1 && !strcmp(col.text, "t0 t1 t2 "));
    CHECK(col.final.finish == LOOM_FINISH_CANCELLED && col.final.status == LOOM_ERR_CANCELLED);
    CHECK(col.final.completion_tokens >= 3 && col.final.prompt_tokens == 4);
    CHECK(!col.final.has_timings);
    CHECK(loom_now_s() - t0 < 2.0);
    seen_t sn = fake_seen(g_fake);
    CHECK(sn.n_cancels == before + 1 && sn.last_cancel_target == col.request_id);
    loom_client_close(&c);
}

static void test_async_interleaved(void) {
    loom_client_t *c = connect_client(400, NULL);
    REQUIRE(c);
    loom_err_t err = {0};
    enum { N = 4 };
    const int lens[N] = {6, 3, 8, 5};
    uint64_t id[N];
    char text[N][256] = {{0}};
    int finals[N] = {0}, order[128], n_order = 0;
    for (int i = 0; i < N; i++) {
        loom_gen_params_t p = {.prompt = "hello", .max_tokens = lens[i]};
        CHECK(loom_client_submit(c, &p, &id[i], &err) == LOOM_OK);
        if (i) CHECK(id[i] > id[i - 1]);
    }
    /* A slow stream cancelled mid-way, and a silent one that times out. */
    uint64_t slow, silent;
    loom_gen_params_t ps = {.prompt = "slow"}, pq = {.prompt = "silent"};
    CHECK(loom_client_submit(c, &ps, &slow, &err) == LOOM_OK);
    CHECK(loom_client_submit(c, &pq, &silent, &err) == LOOM_OK);
    int slow_chunks = 0, slow_final = 0, silent_final = 0, done = 0;
    loom_status_t silent_status = LOOM_OK;
    loom_finish_t slow_finish = LOOM_FINISH_NONE;
    double t0 = loom_now_s();
    while (done < N + 2 && loom_now_s() - t0 < 5) {
        loom_chunk_t ch;
        int got = 0;
        REQUIRE(loom_client_poll(c, 100, &ch, &got, &err) == LOOM_OK);
        if (!got) continue;
        int k = -1;
        for (int i = 0; i < N; i++)
            if (ch.request_id == id[i]) k = i;
        if (k >= 0) {
            strncat(text[k], ch.text, sizeof text[k] - strlen(text[k]) - 1);
            if (n_order < 128) order[n_order++] = k;
            if (ch.final) {
                finals[k]++;
                done++;
                CHECK(ch.status == LOOM_OK && ch.completion_tokens == lens[k]);
            }
        } else if (ch.request_id == slow) {
            if (ch.final) {
                slow_final++;
                slow_finish = ch.finish;
                CHECK(ch.status == LOOM_ERR_CANCELLED);
                done++;
            } else if (++slow_chunks == 2) {
                CHECK(loom_client_cancel(c, slow, &err) == LOOM_OK);
            }
        } else if (ch.request_id == silent) {
            CHECK(ch.final && ch.finish == LOOM_FINISH_ERROR);
            silent_final++;
            silent_status = ch.status;
            CHECKF(strstr(ch.message, "no reply from") != NULL, "%s", ch.message);
            done++;
        } else {
            CHECKF(0, "chunk for unknown request %llu", (unsigned long long)ch.request_id);
        }
    }
    CHECK(done == N + 2);
    for (int i = 0; i < N; i++) {
        char want[256] = {0};
        for (int t = 0; t < lens[i]; t++) snprintf(want + strlen(want), sizeof want - strlen(want), "t%d ", t);
        CHECKF(!strcmp(text[i], want) && finals[i] == 1, "stream %d: '%s'", i, text[i]);
    }
    int switches = 0;
    for (int i = 1; i < n_order; i++) switches += order[i] != order[i - 1];
    CHECKF(switches >= N, "streams did not interleave (%d switches)", switches);
    CHECK(slow_final == 1 && slow_finish == LOOM_FINISH_CANCELLED && slow_chunks >= 2);
    CHECK(silent_final == 1 && silent_status == LOOM_ERR_UNAVAILABLE);

    /* Nothing left: poll times out quietly. */
    loom_chunk_t ch;
    int got = 1;
    t0 = loom_now_s();
    CHECK(loom_client_poll(c, 30, &ch, &got, &err) == LOOM_OK && got == 0);
    CHECK(loom_now_s() - t0 < 0.5);
    loom_client_close(&c);
}

/* ---- the commands ---- */

typedef struct captured {
    int rc;
    char out[8192], err[8192];
} captured_t;

static void read_all(int fd, char *buf, size_t n) {
    lseek(fd, 0, SEEK_SET);
    ssize_t got = read(fd, buf, n - 1);
    buf[got > 0 ? got : 0] = '\0';
}

/* Runs a command in this process with stdout and stderr captured. */
static captured_t run_cmd(int (*cmd)(int, char **), const char *const *args) {
    static captured_t cap;
    char *argv[40];
    int argc = 0;
    for (; args[argc] && argc < 39; argc++) argv[argc] = (char *)args[argc];
    argv[argc] = NULL;
    char po[] = "/tmp/loom_test_client_outXXXXXX", pe[] = "/tmp/loom_test_client_errXXXXXX";
    int fo = mkstemp(po), fe = mkstemp(pe);
    fflush(stdout);
    fflush(stderr);
    int so = dup(1), se = dup(2);
    dup2(fo, 1);
    dup2(fe, 2);
    cap.rc = cmd(argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(so, 1);
    dup2(se, 2);
    close(so);
    close(se);
    read_all(fo, cap.out, sizeof cap.out);
    read_all(fe, cap.err, sizeof cap.err);
    close(fo);
    close(fe);
    unlink(po);
    unlink(pe);
    if (getenv("LOOM_TEST_VERBOSE")) fprintf(stderr, "== %s %s: rc %d\n%s%s", args[0], args[1], cap.rc, cap.out, cap.err);
    return cap;
}

static void test_cmd_generate(void) {
    const char *ep = g_fake->endpoint;
    const char *ok[] = {"loom", "generate", "--addr", ep, "--prompt", "hello", "--max-tokens", "3", "--seed", "7",
                        "--stop", "a", "--stop=b", "--ids", "--temperature", "0", "--priority", "2", NULL};
    captured_t r = run_cmd(loom_cmd_generate, ok);
    CHECKF(r.rc == 0, "rc %d: %s", r.rc, r.err);
    CHECKF(!strcmp(r.out, "t0 t1 t2 \n"), "'%s'", r.out);
    CHECKF(strstr(r.err, "ids: 100 101 102\n") && strstr(r.err, "completion 3 tokens") &&
               strstr(r.err, "finish length") && strstr(r.err, "time to first token"),
           "%s", r.err);
    seen_t sn = fake_seen(g_fake);
    CHECK(sn.n_stop == 2 && !strcmp(sn.stop[0], "a") && !strcmp(sn.stop[1], "b"));
    CHECK(sn.seed == 7 && sn.has_seed && sn.temperature == 0 && sn.priority == 2 && sn.max_tokens == 3);

    /* host:port without a scheme means tcp. */
    const char *bare[] = {"loom", "generate", "--addr", ep + strlen("tcp://"), "--prompt", "hi", "--max-tokens",
                          "1", "--quiet", NULL};
    r = run_cmd(loom_cmd_generate, bare);
    CHECKF(r.rc == 0 && !strcmp(r.out, "t0 \n") && r.err[0] == '\0', "rc %d '%s' '%s'", r.rc, r.out, r.err);

    const char *bad[] = {"loom", "generate", "--addr", ep, "--prompt", "bad", NULL};
    r = run_cmd(loom_cmd_generate, bad);
    CHECK(r.rc == 3);
    CHECKF(strstr(r.err, "error: INVALID_ARGUMENT: prompt is 600 tokens") != NULL, "%s", r.err);

    const char *busy[] = {"loom", "generate", "--addr", ep, "--prompt", "busy", NULL};
    CHECK(run_cmd(loom_cmd_generate, busy).rc == 3);

    const char *silent[] = {"loom", "generate", "--addr", ep, "--prompt", "silent", "--timeout-ms", "200", NULL};
    r = run_cmd(loom_cmd_generate, silent);
    CHECK(r.rc == 4);
    CHECKF(strstr(r.err, "error: UNAVAILABLE: no reply from") != NULL, "%s", r.err);

    const char *version[] = {"loom", "generate", "--addr", ep, "--prompt", "version", NULL};
    r = run_cmd(loom_cmd_generate, version);
    CHECKF(r.rc == 1 && strstr(r.err, "protocol version 2"), "rc %d: %s", r.rc, r.err);

    const char *noprompt[] = {"loom", "generate", "--addr", ep, NULL};
    CHECK(run_cmd(loom_cmd_generate, noprompt).rc == 2);
    const char *unknown[] = {"loom", "generate", "--addr", ep, "--prompt", "x", "--bogus", NULL};
    CHECK(run_cmd(loom_cmd_generate, unknown).rc == 2);
    const char *range[] = {"loom", "generate", "--addr", ep, "--prompt", "x", "--top-p", "2", NULL};
    CHECK(run_cmd(loom_cmd_generate, range).rc == 2);
    const char *help[] = {"loom", "generate", "--help", NULL};
    r = run_cmd(loom_cmd_generate, help);
    CHECK(r.rc == 0 && strstr(r.out, "--max-tokens") && strstr(r.out, "--stop"));
}

static void test_cmd_health_stats(void) {
    const char *ep = g_fake->endpoint;
    const char *h[] = {"loom", "health", "--addr", ep, NULL};
    captured_t r = run_cmd(loom_cmd_health, h);
    CHECKF(r.rc == 0, "rc %d: %s", r.rc, r.err);
    CHECKF(strstr(r.out, "state: ready\n") && strstr(r.out, "workers: 2/2\n") &&
               strstr(r.out, "model: stories260K (context 4096, vocab 512, tp 1, pp 2)"),
           "%s", r.out);
    const char *s[] = {"loom", "stats", "--addr", ep, NULL};
    r = run_cmd(loom_cmd_stats, s);
    CHECKF(r.rc == 0, "rc %d: %s", r.rc, r.err);
    CHECKF(strstr(r.out, "\"running\": 3,") && strstr(r.out, "\"preparing\": 4,") && strstr(r.out, "\"step_ms_mean\": 1.500,\n") &&
               strstr(r.out, "\"ahead_tokens\": 7,\n  \"ahead_dropped\": 2\n}") &&
               strstr(r.out, "\"prefix_cache_hit_rate\": 0.5000"),
           "%s", r.out);
    const char *dead[] = {"loom", "health", "--addr", "tcp://127.0.0.1:1", "--timeout-ms", "100", NULL};
    r = run_cmd(loom_cmd_health, dead);
    CHECK(r.rc == 4 && strstr(r.err, "error: UNAVAILABLE"));
}

static int file_contains(const char *path, const char *needle) {
    char *data = NULL;
    size_t len = 0;
    if (loom_read_file(path, &data, &len, NULL) < 0) return 0;
    int found = strstr(data, needle) != NULL;
    free(data);
    return found;
}

static void test_cmd_bench(void) {
    const char *ep = g_fake->endpoint;
    char json[] = "/tmp/loom_test_bench_XXXXXX";
    int fd = mkstemp(json);
    REQUIRE(fd >= 0);
    close(fd);
    pthread_mutex_lock(&g_fake->mu);
    g_fake->seen.n_id_prompts = 0;
    pthread_mutex_unlock(&g_fake->mu);
    const char *one[] = {"loom", "bench", "--addr", ep, "--num-requests", "12", "--rate", "400", "--prompt-len", "8",
                         "--prompt-len-range", "0.5", "--output-len", "6", "--output-len-range", "0.5", "--seed", "3",
                         "--json", json, "--timeout-s", "30", NULL};
    captured_t r = run_cmd(loom_cmd_bench, one);
    CHECKF(r.rc == 0, "rc %d: %s\n%s", r.rc, r.out, r.err);
    CHECKF(strstr(r.out, "successful requests          12") && strstr(r.out, "TTFT") && strstr(r.out, "TPOT") &&
               strstr(r.out, "ITL") && strstr(r.out, "E2E"),
           "%s", r.out);
    CHECK(file_contains(json, "\"completed\": 12") && file_contains(json, "\"failed\": 0"));
    CHECK(file_contains(json, "\"rate\": 400") && file_contains(json, "\"ttft_ms\": {\"n\": 12"));
    seen_t sn = fake_seen(g_fake);
    CHECK(sn.n_id_prompts == 12 && sn.all_ignore_eos);
    CHECK(sn.min_id >= 3 && sn.max_id < FAKE_VOCAB);
    CHECK(sn.min_max_tokens >= 3 && sn.max_max_tokens <= 9);

    /* A sweep with a plot: an array, one entry per rate. */
    char png[64];
    snprintf(png, sizeof png, "%s.png", json);
    const char *sweep[] = {"loom", "bench", "--addr", ep, "--num-requests", "6", "--rates", "300,inf",
                           "--prompt-len", "4", "--output-len", "4", "--max-concurrency", "3", "--json", json,
                           "--plot", png, "--timeout-s", "30", NULL};
    r = run_cmd(loom_cmd_bench, sweep);
    CHECKF(r.rc == 0, "rc %d: %s\n%s", r.rc, r.out, r.err);
    CHECK(file_contains(json, "[\n") && file_contains(json, "\"rate\": 300") && file_contains(json, "\"rate\": \"inf\""));
    CHECK(file_contains(json, "\"peak_in_flight\": 3"));
    char dat[80], gp[80];
    snprintf(dat, sizeof dat, "%s.dat", json);
    snprintf(gp, sizeof gp, "%s.gp", json);
    CHECK(file_contains(dat, "inf ") && file_contains(gp, "TTFT p99"));
    if (access("/usr/bin/gnuplot", X_OK) == 0) CHECKF(access(png, R_OK) == 0, "%s", r.err);
    unlink(png);
    unlink(dat);
    unlink(gp);

    /* The time cap: unfinished requests fail and are cancelled. */
    int cancels = fake_seen(g_fake).n_cancels;
    const char *capped[] = {"loom", "bench", "--addr", ep, "--num-requests", "2", "--prompt-len", "4",
                            "--output-len", "3000", "--json", json, "--timeout-s", "1", NULL};
    double t0 = loom_now_s();
    r = run_cmd(loom_cmd_bench, capped);
    CHECKF(r.rc == 1, "rc %d: %s", r.rc, r.err);
    CHECK(loom_now_s() - t0 < 5);
    CHECK(file_contains(json, "\"failed\": 2") && file_contains(json, "unfinished at the --timeout-s limit"));
    CHECK(fake_seen(g_fake).n_cancels - cancels == 2);

    const char *toolong[] = {"loom", "bench", "--addr", ep, "--prompt-len", "4000", "--output-len", "200", NULL};
    r = run_cmd(loom_cmd_bench, toolong);
    CHECK(r.rc == 2 && strstr(r.err, "context length 4096"));
    const char *badrate[] = {"loom", "bench", "--addr", ep, "--rate", "-1", NULL};
    CHECK(run_cmd(loom_cmd_bench, badrate).rc == 2);
    const char *http[] = {"loom", "bench", "--addr", ep, "--api", "http", NULL};
    CHECK(run_cmd(loom_cmd_bench, http).rc == 2);
    const char *dead[] = {"loom", "bench", "--addr", "tcp://127.0.0.1:1", "--timeout-s", "1", NULL};
    r = run_cmd(loom_cmd_bench, dead);
    CHECKF(r.rc == 4 && strstr(r.err, "UNAVAILABLE"), "rc %d: %s", r.rc, r.err);
    unlink(json);
}

int main(void) {
    loom_log_init("test_client");
    if (!getenv("LOOM_LOG_LEVEL")) loom_log_set_level(LOOM_LOG_ERROR);
    g_fake = fake_start();
    RUN(test_generate_stream);
    RUN(test_refusals);
    RUN(test_misbehaving_server);
    RUN(test_server_gone);
    RUN(test_unary);
    RUN(test_cancel_by_callback);
    RUN(test_async_interleaved);
    RUN(test_cmd_generate);
    RUN(test_cmd_health_stats);
    RUN(test_cmd_bench);
    fake_stop(&g_fake);
    return test_summary();
}
