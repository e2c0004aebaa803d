/* The HTTP gateway (http.h): OpenAI-compatible completions and chat over
 * libmicrohttpd, translated into loom.v1 Generate requests on in-process
 * clients of the reactor.
 *
 * Threads: MHD runs one thread per connection, so the access handler and
 * the SSE reader may block. Each connection owns one loom_client_t, made
 * on its first request that needs the coordinator and closed with the
 * connection; clients are never shared. Besides that, threads share only
 * the read-only config, the chat template, the metrics (thread-safe) and
 * the served model's info (cached under a mutex).
 *
 * A generation request, per HTTP request:
 *   RECEIVING   body chunks appended (bounded: too big -> 413 when it ends)
 *   SUBMITTED   Generate sent (active = 1); waiting for the first chunk or
 *               a refusal, which becomes an HTTP status (400/404/429/503)
 *   STREAMING   stream: true; the SSE reader turns chunks into events
 *   COLLECTING  stream: false; chunks are gathered into one JSON body
 *   DONE        the final chunk was seen (active = 0)
 * While active, a peer that goes away (a failed write, or a peek at the
 * socket while waiting) or a stopping gateway abandons the request: it is
 * cancelled on the coordinator, the cancel is awaited briefly, and the
 * connection's client is closed.
 *
 * Every request has an id: the client's X-Request-Id when it is 1 to 128
 * printable ASCII characters, else a generated one. It is echoed in the
 * X-Request-Id response header, ends the completion id, goes to the
 * coordinator as the request's tag, and names the request in every log
 * line (the connection thread's log request id).
 *
 * Connections beyond --http-max-connections are accepted (up to
 * OVERFLOW_CONNECTIONS more, libmicrohttpd's own limit) and answered 503
 * with Retry-After, then closed, instead of being reset.
 *
 * Two listeners (listener_t), each a daemon with its own slots: --http
 * (traffic, HTTPS with --tls-cert) and --probe-listen (/health, /metrics,
 * /version only, plain HTTP). Every connection's socket is watched by
 * http_guard.c, which closes it when its headers or body miss their
 * deadline. Request bodies are strict JSON (loom_http_parse_json_body);
 * chat prompts are tokenized here with the messages' text as plain text. */
#include "gateway/gateway_impl.h"

/* ---- small helpers ---- */


/* Text from a chunk without NUL bytes (which JSON strings here cannot hold). */
char *text_dup(const char *s, size_t n) {
    char *o = loom_xmalloc(n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i]) o[k++] = s[i];
    o[k] = '\0';
    return o;
}

uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* ---- responses ---- */

enum MHD_Result respond(req_t *q, unsigned status, const char *ctype, char *body, size_t len) {
    struct MHD_Response *r = MHD_create_response_from_buffer_with_free_callback(len, body, free);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (q->allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, q->allow);
    if (q->www_auth) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (q->xid[0]) MHD_add_response_header(r, "X-Request-Id", q->xid);
    if (q->ignored[0]) MHD_add_response_header(r, "X-Loom-Ignored-Fields", q->ignored);
    if (q->close_after || status == MHD_HTTP_SERVICE_UNAVAILABLE)
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, RETRY_AFTER_S);
    else if (status == MHD_HTTP_TOO_MANY_REQUESTS && q->retry_after_ms > 0) {
        char ra[16]; /* whole seconds, rounded up */
        snprintf(ra, sizeof ra, "%d", (q->retry_after_ms + 999) / 1000);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    if (q->close_after) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ok = MHD_queue_response(q->mc, status, r);
    MHD_destroy_response(r);
    q->status = status;
    return ok;
}

enum MHD_Result respond_json(req_t *q, unsigned status, cJSON *j) {
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!s) return MHD_NO;
    return respond(q, status, "application/json", s, strlen(s));
}

cJSON *error_obj(const char *msg, const char *type, const char *param, const char *code) {
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", type);
    if (param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "error", e);
    return root;
}


enum MHD_Result respond_error(req_t *q, unsigned status, const char *type, const char *param,
                                     const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return respond_json(q, status, error_obj(msg, type, param, code));
}

/* How a coordinator status reads over HTTP. */
void status_http(loom_status_t s, unsigned *http, const char **type, const char **code) {
    switch (s) {
    case LOOM_ERR_INVALID_ARGUMENT: *http = 400, *type = "invalid_request_error", *code = NULL; break;
    case LOOM_ERR_NOT_FOUND: *http = 404, *type = "invalid_request_error", *code = "model_not_found"; break;
    case LOOM_ERR_RESOURCE_EXHAUSTED: *http = 429, *type = "rate_limit_error", *code = "rate_limit_exceeded"; break;
    case LOOM_ERR_UNAVAILABLE: *http = 503, *type = "server_error", *code = "service_unavailable"; break;
    case LOOM_ERR_UNAUTHENTICATED: *http = 401, *type = "invalid_request_error", *code = "invalid_api_key"; break;
    case LOOM_ERR_DEADLINE_EXCEEDED: *http = 504, *type = "server_error", *code = "timeout"; break;
    default: *http = 500, *type = "server_error", *code = "internal_error"; break;
    }
}

enum MHD_Result respond_status(req_t *q, loom_status_t s, const char *msg) {
    unsigned http;
    const char *type, *code;
    status_http(s, &http, &type, &code);
    return respond_error(q, http, type, s == LOOM_ERR_NOT_FOUND ? "model" : NULL, code, "%s",
                         msg && msg[0] ? msg : loom_status_str(s));
}

/* ---- the connection's client ---- */

static int peer_gone(req_t *q) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(q->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    char b;
    ssize_t r = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* MHD closes a connection idle for the timeout even when the wait was ours;
 * re-arming the timeout from zero restarts its clock. */
void refresh_timeout(req_t *q) {
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, q->h->idle_timeout_s);
}

static const char *bearer(const req_t *q);

loom_status_t ensure_client(req_t *q, loom_err_t *err) {
    const char *key = q->h->api_key;
    if (q->h->forward_api_keys) {
        if (q->route == R_COMPLETIONS || q->route == R_CHAT || q->route == R_RESPONSES)
            key = bearer(q); /* the router checks it, and finds its tenant */
        const char *had = q->conn->client_key;
        if (q->conn->client && !((had && key && !strcmp(had, key)) || (!had && !key)))
            loom_client_close(&q->conn->client); /* another key on this connection */
        if (!q->conn->client) {
            free(q->conn->client_key);
            q->conn->client_key = key ? loom_xstrdup(key) : NULL;
        }
    }
    if (q->conn->client) return LOOM_OK;
    loom_client_options_t o = {.timeout_ms = q->h->request_timeout_ms, .api_key = key,
                               .zmq_context = q->h->zctx};
    return loom_client_connect(q->h->inproc, &o, &q->conn->client, err);
}

/* A short-lived client for one unary call (Health, ListModels). Its short
 * timeout bounds how long a connection thread can be stuck in a call that
 * cannot notice the gateway stopping (the reactor is gone by then). */
loom_status_t probe_client(const loom_http_t *h, loom_client_t **c, loom_err_t *err) {
    loom_client_options_t o = {.timeout_ms = PROBE_TIMEOUT_MS, .api_key = h->api_key, .zmq_context = h->zctx};
    return loom_client_connect(h->inproc, &o, c, err);
}

/* The served model (ListModels once, then cached). */
loom_status_t served_model(req_t *q, loom_model_info_t *m, loom_err_t *err) {
    loom_http_t *h = q->h;
    pthread_mutex_lock(&h->mu);
    int have = h->have_model;
    if (have) *m = h->model;
    pthread_mutex_unlock(&h->mu);
    if (have) return LOOM_OK;
    loom_client_t *c = NULL;
    LOOM_CHECK(probe_client(h, &c, err));
    int n = 0;
    loom_status_t st = loom_client_list_models(c, m, 1, &n, err);
    loom_client_close(&c);
    if (st < 0) return st;
    if (n < 1) return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "the coordinator lists no model");
    pthread_mutex_lock(&h->mu);
    h->model = *m;
    h->have_model = 1;
    pthread_mutex_unlock(&h->mu);
    return LOOM_OK;
}

/* The next chunk of q's request: 1 (a failure of the client itself comes as
 * a final chunk with its status), or 0 when the request must be abandoned
 * (the peer left or the gateway is stopping). */
int next_chunk(req_t *q, loom_chunk_t *ch) {
    loom_client_t *c = q->conn->client;
    for (;;) {
        if (atomic_load(&q->h->stopping)) {
            if (!q->active) return 0;
            /* the coordinator is going away: the stream ends with an error, not in silence */
            q->active = 0;
            *ch = (loom_chunk_t){.request_id = q->gen_id, .text = "", .final = 1, .finish = LOOM_FINISH_ERROR,
                                 .status = LOOM_ERR_UNAVAILABLE, .message = "the coordinator is shutting down"};
            return 1;
        }
        uint64_t now = loom_now_ns();
        if (now - q->last_peek_ns >= (uint64_t)SLICE_MS * 1000000u) {
            q->last_peek_ns = now;
            if (peer_gone(q)) return 0;
        }
        int got = 0;
        loom_err_t err = {0};
        if (loom_client_poll(c, SLICE_MS, ch, &got, &err) < 0) {
            snprintf(q->fail_msg, sizeof q->fail_msg, "%s", err.msg);
            *ch = (loom_chunk_t){.request_id = q->gen_id, .text = "", .final = 1, .finish = LOOM_FINISH_ERROR,
                                 .status = err.code < 0 ? err.code : LOOM_ERR_INTERNAL, .message = q->fail_msg};
            return 1;
        }
        if (got && ch->request_id == q->gen_id) {
            if (ch->final) q->active = 0;
            return 1;
        }
    }
}

/* Cancels q's request on the coordinator and waits a little for the
 * confirmation, then closes the connection's client so that nothing of
 * this request is left for the next one. */
static void abandon(req_t *q) {
    if (!q->active) return;
    q->active = 0;
    loom_client_t *c = q->conn->client;
    if (!c) return;
    if (!atomic_load(&q->h->stopping)) {
        loom_err_t err = {0};
        if (loom_client_cancel(c, q->gen_id, &err) == LOOM_OK) {
            uint64_t deadline = loom_now_ns() + (uint64_t)CANCEL_WAIT_MS * 1000000u;
            while (loom_now_ns() < deadline && !atomic_load(&q->h->stopping)) {
                loom_chunk_t ch;
                int got = 0;
                if (loom_client_poll(c, SLICE_MS, &ch, &got, &err) < 0) break;
                if (got && ch.request_id == q->gen_id && ch.final) break;
            }
        }
        LOOM_DEBUG("http: %s %s: the client went away; request %llu cancelled", q->method, q->path,
                   (unsigned long long)q->gen_id);
    }
    loom_client_close(&q->conn->client);
}

/* ---- several choices: n > 1 and batched prompts ---- */

typedef struct choice {
    uint64_t gen_id;
    int done;
    loom_sbuf_t text;
    cJSON *lp;
    size_t lp_offset;
    cJSON *plp; /* prompt_logprobs */
    loom_finish_t finish;
    int prompt_tokens, completion_tokens, cached_tokens;
    loom_rsplit_t *rs; /* streamed chat with --reasoning-parser: this choice's reasoning split off */
} choice_t;

/* The cached tokens of one prompt's n choices: those whose KV was not
 * computed for the request. The choices after the first prefilled fork
 * from it or hit the blocks it wrote, so each says at least what the
 * first one found; the least of them is the prompt's. */
static int group_cached(const choice_t *cs, int n) {
    int m = cs[0].cached_tokens;
    for (int j = 1; j < n; j++)
        m = LOOM_MIN(m, cs[j].cached_tokens);
    return m;
}

/* Cancels every unfinished choice and drops the connection's client (what
 * abandon does for one). */
static void abandon_multi(req_t *q, choice_t *cs, int n) {
    loom_client_t *c = q->conn->client;
    q->active = 0;
    if (!c) return;
    loom_err_t err = {0};
    for (int i = 0; i < n; i++)
        if (cs[i].gen_id && !cs[i].done) loom_client_cancel(c, cs[i].gen_id, &err);
    loom_client_close(&q->conn->client);
}

/* Each (prompt i, choice j) is one generation on the coordinator, with the
 * seed (when given) mixed with j so that the n choices differ and a seed
 * still gives the same answer; they run concurrently (the prefix cache
 * shares the prompt's full blocks once computed). Answered without
 * streaming; usage counts each prompt once. */
static enum MHD_Result handle_multi(req_t *q, gen_t *g) {
    int n_prompts = g->n_batch > 1 ? g->n_batch : 1, n = n_prompts * g->n;
    if (q->h->max_queue > 0 && n > q->h->max_queue) /* never queued whole: a 429 would be retried forever */
        return respond_error(q, 400, "invalid_request_error", g->n > 1 ? "n" : "prompt", NULL,
                             "n x prompts is %d requests, more than this server's waiting queue ever holds (%d, "
                             "--max-queue)", n, q->h->max_queue);
    choice_t *cs = loom_xcalloc((size_t)n, sizeof *cs);
    enum MHD_Result res;
    loom_err_t err = {0};
    q->active = 1;
    q->counted = 1;
    atomic_fetch_add(&q->h->generating, 1);
    for (int i = 0; i < n; i++) {
        loom_gen_params_t p = g->p;
        int pi = i / g->n, j = i % g->n;
        if (g->n_batch > 1) {
            p.prompt = g->batch_text[pi];
            p.prompt_ids = g->batch_ids[pi];
            p.n_prompt_ids = g->batch_n_ids[pi];
        }
        if (p.has_seed && j > 0) p.seed ^= mix64((uint64_t)j);
        if (q->echo) add_echo(q, &cs[i].text, p.prompt, p.prompt_ids, p.n_prompt_ids);
        if (loom_client_submit(q->conn->client, &p, &cs[i].gen_id, &err) < 0) {
            abandon_multi(q, cs, i);
            res = respond_status(q, err.code, err.msg);
            goto done;
        }
    }
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    int left = n;
    loom_status_t fail = LOOM_OK;
    char fail_msg[600] = "";
    while (left > 0) {
        if (atomic_load(&q->h->stopping) || peer_gone(q)) {
            abandon_multi(q, cs, n);
            res = MHD_NO;
            goto done;
        }
        loom_chunk_t ch;
        int got = 0;
        if (loom_client_poll(q->conn->client, SLICE_MS, &ch, &got, &err) < 0) {
            abandon_multi(q, cs, n);
            res = respond_status(q, err.code, err.msg);
            goto done;
        }
        if (!got) continue;
        int i = 0;
        while (i < n && cs[i].gen_id != ch.request_id) i++;
        if (i == n || cs[i].done) continue;
        choice_t *c = &cs[i];
        if (ch.n_prompt_ids > 0) {
            if (q->echo && q->logprobs) {
                if (!c->lp) c->lp = cJSON_CreateObject();
                add_echo_logprobs(q, c->lp, &ch, c->text.len);
                c->lp_offset = q->lp_offset;
            }
            if (q->prompt_lp >= 0 && !c->plp) c->plp = prompt_lp_json(q, &ch);
        }
        loom_sbuf_add(&c->text, ch.text, ch.text_len);
        if (q->logprobs && ch.has_logprobs) {
            if (!c->lp) c->lp = cJSON_CreateObject();
            q->lp_offset = c->lp_offset;
            add_logprobs(q, c->lp, &ch);
            c->lp_offset = q->lp_offset;
        }
        if (!ch.final) continue;
        c->done = 1;
        left--;
        c->finish = ch.finish;
        c->prompt_tokens = ch.prompt_tokens;
        c->completion_tokens = ch.completion_tokens;
        c->cached_tokens = ch.cached_tokens;
        if (ch.status != LOOM_OK && fail == LOOM_OK) {
            fail = ch.status;
            snprintf(fail_msg, sizeof fail_msg, "%s", ch.message ? ch.message : "");
        }
    }
    q->active = 0;
    refresh_timeout(q);
    if (fail != LOOM_OK) {
        res = respond_status(q, fail, fail_msg);
        goto done;
    }
    cJSON *o = head_obj(q, q->chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    loom_chunk_t usage = {0};
    for (int i = 0; i < n; i++) {
        cJSON *c = cJSON_CreateObject();
        cJSON_AddNumberToObject(c, "index", i);
        char *t = text_dup(cs[i].text.p ? cs[i].text.p : "", cs[i].text.len);
        if (q->chat) {
            cJSON *m = cJSON_AddObjectToObject(c, "message");
            cJSON_AddStringToObject(m, "role", "assistant");
            if (q->h->reasoning) { /* each choice's reasoning split off, as for one */
                char *reasoning = NULL, *answer = NULL;
                loom_reasoning_split(q->h->reasoning, t, strlen(t), &reasoning, &answer);
                free(t);
                t = answer ? answer : loom_xstrdup("");
                if (reasoning) cJSON_AddStringToObject(m, "reasoning_content", reasoning);
                else cJSON_AddNullToObject(m, "reasoning_content");
                free(reasoning);
            }
            cJSON_AddStringToObject(m, "content", t);
        } else {
            cJSON_AddStringToObject(c, "text", t);
        }
        free(t);
        if (q->logprobs) {
            cJSON *lp = cs[i].lp ? cs[i].lp : cJSON_CreateObject();
            cs[i].lp = NULL;
            if (q->chat) {
                arr_of(lp, "content");
                cJSON_AddNullToObject(lp, "refusal");
            } else {
                arr_of(lp, "tokens"), arr_of(lp, "token_logprobs"), arr_of(lp, "top_logprobs"),
                    arr_of(lp, "text_offset");
            }
            cJSON_AddItemToObject(c, "logprobs", lp);
        } else {
            cJSON_AddNullToObject(c, "logprobs");
        }
        cJSON_AddStringToObject(c, "finish_reason", finish_name(cs[i].finish));
        if (q->prompt_lp >= 0 && !q->chat) {
            cJSON_AddItemToObject(c, "prompt_logprobs", cs[i].plp ? cs[i].plp : cJSON_CreateArray());
            cs[i].plp = NULL;
        }
        cJSON_AddItemToArray(choices, c);
        if (i % g->n == 0) { /* the prompt once per prompt */
            usage.prompt_tokens += cs[i].prompt_tokens;
            usage.cached_tokens += group_cached(cs + i, g->n);
        }
        usage.completion_tokens += cs[i].completion_tokens;
    }
    if (q->prompt_lp >= 0 && q->chat) { /* one prompt: the response's */
        cJSON_AddItemToObject(o, "prompt_logprobs", cs[0].plp ? cs[0].plp : cJSON_CreateArray());
        cs[0].plp = NULL;
    }
    cJSON_AddItemToObject(o, "usage", usage_obj(&usage));
    res = respond_json(q, MHD_HTTP_OK, o);
done:
    for (int i = 0; i < n; i++) {
        free(cs[i].text.p);
        cJSON_Delete(cs[i].lp);
        cJSON_Delete(cs[i].plp);
    }
    free(cs);
    return res;
}

/* Several choices streamed (stream with n > 1 or batched prompts): the
 * generations run as handle_multi's, and each chunk goes out as it comes
 * with its choice's index (as vLLM streams them); the usage chunk, when
 * asked for, follows the last choice's finish. */
typedef struct multi_stream {
    choice_t *cs;
    int n, n_per, left;
    loom_chunk_t usage;
} multi_stream_t;

static void multi_stream_free(req_t *q) {
    multi_stream_t *ms = q->ms;
    if (!ms) return;
    q->ms = NULL;
    for (int i = 0; i < ms->n; i++) {
        loom_rsplit_destroy(&ms->cs[i].rs);
        free(ms->cs[i].text.p);
        cJSON_Delete(ms->cs[i].lp);
        cJSON_Delete(ms->cs[i].plp);
    }
    free(ms->cs);
    free(ms);
}

/* One chunk of choice i into SSE events in q->out. */
static void multi_stream_chunk(req_t *q, int i, const loom_chunk_t *ch) {
    multi_stream_t *ms = q->ms;
    choice_t *c = &ms->cs[i];
    q->choice = i;
    if (ch->text_len > 0 || (q->logprobs && ch->has_logprobs && ch->n_ids > 0)) {
        if (q->logprobs && ch->has_logprobs) {
            cJSON *lp = cJSON_CreateObject();
            q->lp_offset = c->lp_offset;
            add_logprobs(q, lp, ch);
            c->lp_offset = q->lp_offset;
            q->lp_json = cJSON_PrintUnformatted(lp);
            cJSON_Delete(lp);
        }
        if (q->chat && q->h->reasoning) {
            if (!c->rs) c->rs = loom_rsplit_create(q->h->reasoning);
            sse_split_choice(q, c->rs, ch->text, ch->text_len, 0);
        } else {
            sse_choice(q, ch->text, ch->text_len, 0, NULL);
        }
        free(q->lp_json);
        q->lp_json = NULL;
    }
    if (ch->final && ch->status == LOOM_OK && c->rs) sse_split_choice(q, c->rs, NULL, 0, 1);
    if (!ch->final) return;
    c->done = 1;
    ms->left--;
    c->cached_tokens = ch->cached_tokens;
    if (i % ms->n_per == 0) ms->usage.prompt_tokens += ch->prompt_tokens; /* the prompt once per prompt */
    ms->usage.completion_tokens += ch->completion_tokens;
    if (ch->status != LOOM_OK) {
        /* one choice broke: the others are cancelled, an error event and [DONE] end the stream */
        unsigned http;
        const char *type, *code;
        status_http(ch->status, &http, &type, &code);
        cJSON *e = error_obj(ch->message && ch->message[0] ? ch->message : loom_status_str(ch->status), type, NULL,
                             code);
        char *s = cJSON_PrintUnformatted(e);
        cJSON_Delete(e);
        loom_sbuf_printf(&q->out, "data: %s\n\n", s ? s : "{}");
        free(s);
        LOOM_WARN("http: %s %s: stream %s failed: %s", q->method, q->path, q->id, ch->message);
        abandon_multi(q, ms->cs, ms->n);
        loom_sbuf_str(&q->out, "data: [DONE]\n\n");
        q->finished = 1;
        return;
    }
    sse_choice(q, NULL, 0, 0, finish_name(ch->finish));
    if (ms->left > 0) return;
    q->active = 0;
    q->finished = 1;
    ms->usage.cached_tokens = 0;
    for (int p = 0; p < ms->n; p += ms->n_per)
        ms->usage.cached_tokens += group_cached(ms->cs + p, ms->n_per);
    if (q->include_usage) {
        cJSON *o = head_obj(q, q->chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddArrayToObject(o, "choices");
        cJSON_AddItemToObject(o, "usage", usage_obj(&ms->usage));
        char *s = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        loom_sbuf_printf(&q->out, "data: %s\n\n", s ? s : "{}");
        free(s);
    }
    loom_sbuf_str(&q->out, "data: [DONE]\n\n");
}

/* The next chunk of any of the choices (0: the peer left or the gateway
 * stops; the caller abandons them). */
static int multi_next_chunk(req_t *q, loom_chunk_t *ch, int *which) {
    multi_stream_t *ms = q->ms;
    for (;;) {
        if (atomic_load(&q->h->stopping)) return 0;
        uint64_t now = loom_now_ns();
        if (now - q->last_peek_ns >= (uint64_t)SLICE_MS * 1000000u) {
            q->last_peek_ns = now;
            if (peer_gone(q)) return 0;
        }
        int got = 0;
        loom_err_t err = {0};
        if (loom_client_poll(q->conn->client, SLICE_MS, ch, &got, &err) < 0) {
            snprintf(q->fail_msg, sizeof q->fail_msg, "%s", err.msg);
            int i = 0;
            while (i < ms->n && ms->cs[i].done) i++;
            *which = i < ms->n ? i : 0;
            *ch = (loom_chunk_t){.request_id = ms->cs[*which].gen_id, .text = "", .final = 1,
                                 .finish = LOOM_FINISH_ERROR, .status = err.code < 0 ? err.code : LOOM_ERR_INTERNAL,
                                 .message = q->fail_msg};
            return 1;
        }
        if (!got) continue;
        for (int i = 0; i < ms->n; i++)
            if (ms->cs[i].gen_id == ch->request_id && !ms->cs[i].done) {
                *which = i;
                return 1;
            }
    }
}

static ssize_t multi_sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    req_t *q = cls;
    while (q->out_off >= q->out.len) {
        q->out.len = q->out_off = 0;
        if (q->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        uint64_t t = loom_now_ns();
        loom_chunk_t ch;
        int i = 0;
        if (!multi_next_chunk(q, &ch, &i)) {
            abandon_multi(q, q->ms->cs, q->ms->n);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        multi_stream_chunk(q, i, &ch);
        if (loom_now_ns() - t > 1000000000ull) refresh_timeout(q);
    }
    size_t n = LOOM_MIN(max, q->out.len - q->out_off);
    memcpy(buf, q->out.p + q->out_off, n);
    q->out_off += n;
    return (ssize_t)n;
}

static enum MHD_Result handle_multi_stream(req_t *q, gen_t *g) {
    int n_prompts = g->n_batch > 1 ? g->n_batch : 1;
    if (q->h->max_queue > 0 && n_prompts * g->n > q->h->max_queue) /* as handle_multi */
        return respond_error(q, 400, "invalid_request_error", g->n > 1 ? "n" : "prompt", NULL,
                             "n x prompts is %d requests, more than this server's waiting queue ever holds (%d, "
                             "--max-queue)", n_prompts * g->n, q->h->max_queue);
    multi_stream_t *ms = loom_xcalloc(1, sizeof *ms);
    ms->n_per = g->n;
    ms->n = ms->left = n_prompts * g->n;
    ms->cs = loom_xcalloc((size_t)ms->n, sizeof *ms->cs);
    q->ms = ms;
    loom_err_t err = {0};
    q->active = 1;
    q->counted = 1;
    atomic_fetch_add(&q->h->generating, 1);
    for (int i = 0; i < ms->n; i++) {
        loom_gen_params_t p = g->p;
        int pi = i / g->n, j = i % g->n;
        if (g->n_batch > 1) {
            p.prompt = g->batch_text[pi];
            p.prompt_ids = g->batch_ids[pi];
            p.n_prompt_ids = g->batch_n_ids[pi];
        }
        if (p.has_seed && j > 0) p.seed ^= mix64((uint64_t)j);
        if (q->echo) add_echo(q, &ms->cs[i].text, p.prompt, p.prompt_ids, p.n_prompt_ids);
        if (loom_client_submit(q->conn->client, &p, &ms->cs[i].gen_id, &err) < 0) {
            abandon_multi(q, ms->cs, i);
            return respond_status(q, err.code, err.msg);
        }
    }
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    for (int i = 0; i < ms->n; i++) { /* each choice opens: the role (chat), the echo (completions) */
        q->choice = i;
        if (q->chat) sse_choice(q, "", 0, 1, NULL);
        if (ms->cs[i].text.len) sse_choice(q, ms->cs[i].text.p, ms->cs[i].text.len, 0, NULL);
        ms->cs[i].lp_offset = ms->cs[i].text.len;
    }
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, SSE_BLOCK, multi_sse_read, q, NULL);
    if (!r) {
        abandon_multi(q, ms->cs, ms->n);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no");
    MHD_add_response_header(r, "X-Request-Id", q->xid);
    if (q->ignored[0]) MHD_add_response_header(r, "X-Loom-Ignored-Fields", q->ignored);
    refresh_timeout(q);
    enum MHD_Result res = MHD_queue_response(q->mc, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    q->status = MHD_HTTP_OK;
    return res;
}

/* ---- generation ---- */

enum MHD_Result handle_generate(req_t *q) {
    loom_http_t *h = q->h;
    q->chat = q->route == R_CHAT || q->route == R_RESPONSES;
    char msg[600];
    cJSON *root = loom_http_parse_json_body(q->body.p, q->body.len, msg, sizeof msg);
    if (!root) return respond_error(q, 400, "invalid_request_error", NULL, NULL, "%s", msg);
    enum MHD_Result res;
    gen_t g = {0};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    if (q->chat && !h->tmpl) {
        res = respond_error(q, 400, "invalid_request_error", "messages", "no_chat_template",
                            "this model has no chat template; start the coordinator with --chat-template FILE or "
                            "a template Loom ships (%s), or use /v1/completions",
                            LOOM_CHAT_SHIPPED_NAMES);
        goto done;
    }
    if (parse_common(q, root, &g, &e) < 0 ||
        (q->chat ? parse_messages(h->tmpl, h->tok, h->special_in_content, root, &g, &e) : parse_prompt(root, &g, &e)) <
            0) {
        res = respond_error(q, 400, "invalid_request_error", e.param[0] ? e.param : NULL, NULL, "%s", e.msg);
        goto done;
    }
    if (q->chat) {
        guide_after_reasoning(h, &g);
        keep_reasoning_markers(h, &g);
    }
    if (ensure_client(q, &err) < 0 || served_model(q, &mi, &err) < 0) {
        res = respond_status(q, err.code, err.msg);
        goto done;
    }
    char why[400];
    loom_status_t why_st = LOOM_OK;
    int which = model_lookup(q, &mi, g.p.model, &why_st, why, sizeof why); /* the base, or a LoRA adapter */
    if (which < 0) {
        res = respond_status(q, why_st, why);
        goto done;
    }
    if (which == 0) {
        res = respond_error(q, 404, "invalid_request_error", "model", "model_not_found", "%s", why);
        goto done;
    }
    snprintf(q->model, sizeof q->model, "%s", which == 2 ? g.p.model : mi.id);
    q->created = (long long)time(NULL);
    new_id(q);
    if (atomic_load(&q->h->draining)) {
        res = respond_status(q, LOOM_ERR_UNAVAILABLE, "draining: this coordinator is shutting down and admits no "
                                                      "new requests");
        goto done;
    }
    g.p.tag = q->xid;
    const char *session = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, "X-Session-Id");
    if (session && session[0]) g.p.session = session;
    const char *cc = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CACHE_CONTROL);
    if (cc && (strcasestr(cc, "no-cache") || strcasestr(cc, "no-store"))) g.p.no_cache = 1;
    if (g.tools.mode != LOOM_TOOLS_OFF && g.n > 1) {
        res = respond_error(q, 400, "invalid_request_error", "n", NULL, "tools are answered with n = 1 only");
        goto done;
    }
    if (g.n > 1 || g.n_batch > 1) {
        if (q->stream && (q->prompt_lp >= 0 || (q->echo && q->logprobs))) {
            res = respond_error(q, 400, "invalid_request_error", g.n > 1 ? "n" : "prompt", NULL,
                                "n > 1 and batched prompts are streamed without prompt logprobs: set stream to "
                                "false, or leave out prompt_logprobs and echo with logprobs");
            goto done;
        }
        res = q->stream ? handle_multi_stream(q, &g) : handle_multi(q, &g);
        goto done;
    }
    if (loom_client_submit(q->conn->client, &g.p, &q->gen_id, &err) < 0) {
        res = respond_status(q, err.code, err.msg);
        goto done;
    }
    q->active = 1;
    q->counted = 1;
    q->tok_ns = g.tok_ns;
    keep_tools(q, &g);
    if (q->chat && h->reasoning) q->rs = loom_rsplit_create(h->reasoning);
    atomic_fetch_add(&q->h->generating, 1);
    if (q->echo) add_echo(q, &q->text, g.p.prompt, g.p.prompt_ids, g.p.n_prompt_ids); /* the choice starts so */
    cJSON_Delete(root);
    root = NULL;
    gen_free(&g);
    memset(&g, 0, sizeof g);
    /* no client timeout while the coordinator works: silence is ours, not the peer's */
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);

    loom_chunk_t ch;
    if (!next_chunk(q, &ch)) {
        abandon(q);
        return MHD_NO;
    }
    if (ch.final && ch.status != LOOM_OK) {
        refresh_timeout(q);
        q->retry_after_ms = ch.retry_after_ms;
        return respond_status(q, ch.status, ch.message);
    }
    if (q->stream) {
        if (q->resp) resp_stream_begin(q);
        else if (q->chat) sse_choice(q, "", 0, 1, NULL);
        if (q->text.len || ch.n_prompt_ids > 0) { /* echo, with the prompt's logprobs when asked */
            if (q->logprobs && ch.n_prompt_ids > 0) {
                cJSON *lp = cJSON_CreateObject();
                add_echo_logprobs(q, lp, &ch, q->text.len);
                q->lp_json = cJSON_PrintUnformatted(lp);
                cJSON_Delete(lp);
            }
            sse_choice(q, q->text.p, q->text.len, 0, NULL);
            free(q->lp_json);
            q->lp_json = NULL;
        }
        stream_chunk(q, &ch);
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, SSE_BLOCK, sse_read, q, NULL);
        if (!r) {
            abandon(q);
            return MHD_NO;
        }
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        MHD_add_response_header(r, "X-Request-Id", q->xid);
        if (q->ignored[0]) MHD_add_response_header(r, "X-Loom-Ignored-Fields", q->ignored);
        refresh_timeout(q);
        res = MHD_queue_response(q->mc, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        q->status = MHD_HTTP_OK;
        return res;
    }
    for (;;) {
        uint64_t t0 = loom_now_ns();
        if (ch.n_prompt_ids > 0) {
            if (q->echo && q->logprobs) {
                if (!q->lp_acc) q->lp_acc = cJSON_CreateObject();
                add_echo_logprobs(q, q->lp_acc, &ch, q->text.len);
            }
            if (q->prompt_lp >= 0 && !q->plp) q->plp = prompt_lp_json(q, &ch);
        }
        loom_sbuf_add(&q->text, ch.text, ch.text_len);
        if (q->resp) resp_collect_chunk(q, &ch);
        if (q->logprobs && ch.has_logprobs) {
            if (!q->lp_acc) q->lp_acc = cJSON_CreateObject();
            add_logprobs(q, q->lp_acc, &ch);
        }
        q->send_ns += loom_now_ns() - t0;
        if (ch.final) break;
        if (!next_chunk(q, &ch)) {
            abandon(q);
            return MHD_NO;
        }
    }
    refresh_timeout(q);
    if (ch.status != LOOM_OK) return respond_status(q, ch.status, ch.message);
    return finish_collected(q, &ch);
done:
    cJSON_Delete(root);
    gen_free(&g);
    return res;
}

/* ---- MHD callbacks ---- */

/* The request's Bearer key (NULL: none). */
static const char *bearer(const req_t *q) {
    const char *a = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!a || strncasecmp(a, "Bearer ", 7) != 0) return NULL;
    a += 7;
    while (*a == ' ') a++;
    return a[0] ? a : NULL;
}

static int authorized(const req_t *q, int *given) {
    const char *key = q->h->api_key;
    const char *a = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    *given = a != NULL;
    if (!key) return 1;
    if (q->h->forward_api_keys && (q->route == R_COMPLETIONS || q->route == R_CHAT || q->route == R_RESPONSES) &&
        bearer(q))
        return 1; /* the router decides */
    if (!a || strncasecmp(a, "Bearer ", 7) != 0) return 0;
    a += 7;
    while (*a == ' ') a++;
    return loom_secret_equal(key, strlen(key), a, strlen(a));
}

static const struct {
    const char *path;
    route_t route;
    int post, open;
} k_routes[] = {
    {"/v1/completions", R_COMPLETIONS, 1, 0},
    {"/v1/chat/completions", R_CHAT, 1, 0},
    {"/v1/models", R_MODELS, 0, 0},
    {"/health", R_HEALTH, 0, 1},
    {"/metrics", R_METRICS, 0, 1},
    {"/tokenize", R_TOKENIZE, 1, 0},
    {"/detokenize", R_DETOKENIZE, 1, 0},
    {"/version", R_VERSION, 0, 1},
    {"/v1/embeddings", R_EMBEDDINGS, 1, 0},
    {"/v1/responses", R_RESPONSES, 1, 0},
    {"/v1/load_lora_adapter", R_LORA_LOAD, 1, 0},
    {"/v1/unload_lora_adapter", R_LORA_UNLOAD, 1, 0},
};

/* Routes a request on its first call; a body over the limit is refused
 * then, before it is read (MHD closes the connection after the answer). */
static enum MHD_Result on_headers(req_t *q, const char *url) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_routes); i++)
        if (!strcmp(url, k_routes[i].path)) q->route = k_routes[i].route;
    if (q->route == R_NONE && !strncmp(url, "/v1/models/", 11) && url[11]) q->route = R_MODEL;
    if (q->route == R_NONE && !strncmp(url, "/v1/responses/", 14) && url[14]) q->route = R_RESPONSE;
    int post = q->route == R_COMPLETIONS || q->route == R_CHAT || q->route == R_TOKENIZE || q->route == R_DETOKENIZE ||
               q->route == R_EMBEDDINGS || q->route == R_RESPONSES || q->route == R_LORA_LOAD ||
               q->route == R_LORA_UNLOAD;
    if (post && !strcmp(q->method, "POST")) {
        const char *cl = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            unsigned long long n = strtoull(cl, &end, 10);
            if (*end == '\0' && n > q->h->max_body)
                return respond_error(q, 413, "invalid_request_error", NULL, "request_too_large",
                                     "the request body is %llu bytes; this server accepts at most %zu", n,
                                     q->h->max_body);
        }
    }
    return MHD_YES;
}

/* The last call, with the whole body read: answers the request. */
static enum MHD_Result dispatch(req_t *q) {
    const char *url = q->path, *method = q->method;
    loom_http_guard_serving(q->h->guard, q->conn->slot);
    if (q->conn->probe && q->route != R_HEALTH && q->route != R_METRICS && q->route != R_VERSION)
        return respond_error(q, 404, "invalid_request_error", NULL, "not_found",
                             "Invalid URL (%s %.200s): this is the probe listener, serving only /health, /metrics "
                             "and /version",
                             method, url);
    if (q->route == R_NONE)
        return respond_error(q, 404, "invalid_request_error", NULL, "not_found", "Invalid URL (%s %.200s)", method,
                             url);
    int post = 0, open = 0;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_routes); i++)
        if (k_routes[i].route == q->route) {
            post = k_routes[i].post;
            open = k_routes[i].open;
        }
    int is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), is_post = !strcmp(method, "POST");
    int is_delete = q->route == R_RESPONSE && !strcmp(method, "DELETE"); /* a stored response */
    if (post ? !is_post : !is_get && !is_delete) {
        q->allow = post ? "POST" : q->route == R_RESPONSE ? "GET, HEAD, DELETE" : "GET, HEAD";
        return respond_error(q, 405, "invalid_request_error", NULL, "method_not_allowed",
                             "Method %s is not allowed for %.200s (use %s)", method, url, q->allow);
    }
    int given = 0;
    if (!open && !authorized(q, &given)) {
        q->www_auth = 1;
        if (!given)
            return respond_error(q, 401, "invalid_request_error", NULL, "invalid_api_key",
                                 "You didn't provide an API key. You need to provide your API key in an "
                                 "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).");
        return respond_error(q, 401, "invalid_request_error", NULL, "invalid_api_key", "Incorrect API key provided.");
    }
    if (q->too_big)
        return respond_error(q, 413, "invalid_request_error", NULL, "request_too_large",
                             "the request body is over %zu bytes, the most this server accepts", q->h->max_body);
    switch (q->route) {
    case R_COMPLETIONS:
    case R_CHAT: return handle_generate(q);
    case R_HEALTH: return handle_health(q);
    case R_METRICS: return handle_metrics(q);
    case R_MODELS: return handle_models(q, NULL);
    case R_MODEL: return handle_models(q, url + 11);
    case R_TOKENIZE: return handle_tokenize(q);
    case R_DETOKENIZE: return handle_detokenize(q);
    case R_VERSION: return handle_version(q);
    case R_EMBEDDINGS: return handle_embeddings(q);
    case R_RESPONSES: return handle_responses(q);
    case R_RESPONSE: return handle_response(q, url + 14);
    case R_LORA_LOAD: return handle_lora_update(q, 1);
    case R_LORA_UNLOAD: return handle_lora_update(q, 0);
    default: return MHD_NO;
    }
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    listener_t *l = cls;
    loom_http_t *h = l->h;
    req_t *q = *con_cls;
    if (!q) {
        q = loom_xcalloc(1, sizeof *q);
        q->h = h;
        q->prompt_lp = -1;
        q->mc = mc;
        q->t0 = loom_now_ns();
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        q->conn = ci ? ci->socket_context : NULL;
        snprintf(q->method, sizeof q->method, "%s", method);
        snprintf(q->path, sizeof q->path, "%s", url);
        *con_cls = q;
        take_request_id(q);
        loom_log_set_request(q->xid); /* this connection's thread serves this request now */
        if (!q->conn) return MHD_NO;
        loom_http_guard_headers_done(h->guard, q->conn->slot);
        if (q->conn->over_limit) {
            q->close_after = 1;
            return respond_error(q, 503, "server_error", NULL, "service_unavailable",
                                 "too many connections: this %s takes %d at a time; retry after %s s",
                                 l->probe ? "probe listener" : "server", l->max_conns, RETRY_AFTER_S);
        }
        return on_headers(q, url);
    }
    if (q->status) { /* answered already (413 before the body): drop the rest */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (!q->too_big && q->body.len + n > h->max_body) {
            q->too_big = 1;
            q->discarded = q->body.len;
            free(q->body.p);
            q->body = (loom_sbuf_t){0};
        }
        if (q->too_big) {
            q->discarded += n;
            /* reading a huge body only to refuse it is bounded too */
            return q->discarded > 4 * h->max_body + ((size_t)1 << 20) ? MHD_NO : MHD_YES;
        }
        loom_sbuf_add(&q->body, upload, n);
        return MHD_YES;
    }
    return dispatch(q);
}

static void on_completed(void *cls, struct MHD_Connection *mc, void **con_cls, enum MHD_RequestTerminationCode toe) {
    req_t *q = *con_cls;
    if (!q) return;
    if (q->conn) loom_http_guard_next(q->h->guard, q->conn->slot); /* keep-alive: the next headers' clock */
    if (q->active && q->ms) abandon_multi(q, q->ms->cs, q->ms->n);
    else if (q->active) abandon(q); /* a stream cut short: the peer left, timed out, or we are stopping */
    multi_stream_free(q);
    if (q->counted) atomic_fetch_sub(&q->h->generating, 1);
    /* the access log: scrapes and probes only at debug level */
    int quiet = q->route == R_HEALTH || q->route == R_METRICS || q->route == R_VERSION;
    loom_log(quiet ? LOOM_LOG_DEBUG : LOOM_LOG_INFO, "http: %s %s -> %u in %.1f ms%s", q->method, q->path, q->status,
             (double)(loom_now_ns() - q->t0) / 1e6,
             toe == MHD_REQUEST_TERMINATED_COMPLETED_OK ? "" : " (terminated early)");
    loom_log_set_request(NULL);
    free(q->body.p);
    free(q->out.p);
    free(q->prefix.p);
    free(q->text.p);
    cJSON_Delete(q->lp_acc);
    cJSON_Delete(q->plp);
    loom_tools_free(&q->tools);
    cJSON_Delete(q->tools_req);
    loom_tstream_destroy(&q->ts);
    loom_rsplit_destroy(&q->rs);
    resp_free(q);
    free(q);
    *con_cls = NULL;
}

static void on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    listener_t *l = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        conn_t *c = loom_xcalloc(1, sizeof *c);
        c->over_limit = atomic_fetch_add(&l->n_conns, 1) >= l->max_conns;
        c->probe = l->probe;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci) c->slot = loom_http_guard_add(l->h->guard, ci->connect_fd);
        *socket_context = c;
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        conn_t *c = *socket_context;
        if (c) {
            loom_http_guard_remove(l->h->guard, &c->slot);
            loom_client_close(&c->client);
            free(c->client_key);
            atomic_fetch_sub(&l->n_conns, 1);
        }
        free(c);
        *socket_context = NULL;
    }
}

/* libmicrohttpd's own messages: start-up failures are warnings; once
 * serving, they are about single connections (a client that misbehaved or
 * left, which the gateway answers for itself) and go to the debug log. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    loom_http_t *h = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
    loom_log(atomic_load(&h->serving) ? LOOM_LOG_DEBUG : LOOM_LOG_WARN, "http: %s", msg);
}

/* ---- start / stop ---- */

/* "HOST:PORT", "[V6]:PORT", ":PORT" or "PORT" (loopback). */
static loom_status_t resolve_bind(const char *flag, const char *bind, struct sockaddr_storage *ss, socklen_t *len,
                                  int *v6, loom_err_t *err) {
    char host[256] = "127.0.0.1", port[16];
    const char *colon = strrchr(bind, ':');
    const char *p = colon ? colon + 1 : bind;
    if (colon) {
        const char *hs = bind, *he = colon;
        if (*hs == '[' && he > hs && he[-1] == ']') hs++, he--;
        if (he > hs) {
            if ((size_t)(he - hs) >= sizeof host)
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: host name too long in '%s'", flag, bind);
            memcpy(host, hs, (size_t)(he - hs));
            host[he - hs] = '\0';
        }
    }
    char *end;
    long pn = strtol(p, &end, 10);
    if (!*p || *end || pn < 0 || pn > 65535)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s expects HOST:PORT (e.g. 127.0.0.1:8000), got '%s'",
                            flag, bind);
    snprintf(port, sizeof port, "%ld", pn);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, port, &hints, &ai);
    if (rc != 0 || !ai)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: cannot resolve '%s': %s", flag, host,
                            gai_strerror(rc));
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    *len = ai->ai_addrlen;
    *v6 = ai->ai_family == AF_INET6;
    freeaddrinfo(ai);
    return LOOM_OK;
}

/* Starts one listener's daemon on ss. TLS when h->tls holds a certificate
 * (the traffic listener only). */
static struct MHD_Daemon *start_daemon(loom_http_t *h, listener_t *l, struct sockaddr_storage *ss, int v6,
                                       unsigned conn_limit, int tls) {
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL |
                     MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0) | (tls ? MHD_USE_TLS : 0);
    uint16_t port = ss->ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)ss)->sin6_port)
                                               : ntohs(((struct sockaddr_in *)ss)->sin_port);
    struct MHD_OptionItem extra[6];
    int n = 0;
    if (tls) {
        extra[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, h->tls.cert_pem};
        extra[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, h->tls.key_pem};
        extra[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_PRIORITIES, 0, h->tls.priorities};
    }
    if (!l->probe && h->per_ip > 0)
        extra[n++] = (struct MHD_OptionItem){MHD_OPTION_PER_IP_CONNECTION_LIMIT, h->per_ip, NULL};
    extra[n++] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    return MHD_start_daemon(flags, port, NULL, NULL, on_access, l,
                            MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)ss,
                            MHD_OPTION_CONNECTION_LIMIT, conn_limit,
                            MHD_OPTION_CONNECTION_TIMEOUT, h->idle_timeout_s,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, l,
                            MHD_OPTION_ARRAY, extra,
                            MHD_OPTION_END);
}

static int daemon_port(struct MHD_Daemon *d) {
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    return di ? di->port : 0;
}

loom_status_t loom_http_start_at(const loom_http_endpoint_t *ep, const loom_http_config_t *cfg, loom_http_t **out,
                                 loom_err_t *err) {
    *out = NULL;
    const char *bind = cfg->bind && cfg->bind[0] ? cfg->bind : DEFAULT_BIND;
    const char *probe_bind = cfg->probe_bind && cfg->probe_bind[0] ? cfg->probe_bind : NULL;
    struct sockaddr_storage ss, pss;
    socklen_t ss_len, pss_len;
    int v6 = 0, pv6 = 0;
    LOOM_CHECK(resolve_bind("--http", bind, &ss, &ss_len, &v6, err));
    if (probe_bind) LOOM_CHECK(resolve_bind("--probe-listen", probe_bind, &pss, &pss_len, &pv6, err));
    if (!MHD_is_feature_supported(MHD_FEATURE_TLS) && (cfg->tls_cert || cfg->tls_key))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--tls-cert/--tls-key: this libmicrohttpd is built without TLS support");
    loom_http_tls_t tls = {0};
    if (cfg->tls_cert || cfg->tls_key) {
        LOOM_CHECK(loom_http_tls_load(cfg->tls_cert, cfg->tls_key, &tls, err));
        loom_status_t pst = loom_http_tls_priorities(cfg->tls_priorities, &tls, err);
        if (pst < 0) {
            loom_http_tls_free(&tls);
            return pst;
        }
    }
    loom_toolfmt_t tool_fmt = LOOM_TOOLFMT_NONE;
    loom_reasoning_t reasoning = LOOM_REASONING_NONE;
    if (cfg->tool_call_parser && !(tool_fmt = loom_toolfmt_from_name(cfg->tool_call_parser))) {
        loom_http_tls_free(&tls);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--tool-call-parser %s: not one of %s",
                            cfg->tool_call_parser, LOOM_TOOL_PARSER_NAMES);
    }
    if (cfg->reasoning_parser && !(reasoning = loom_reasoning_from_name(cfg->reasoning_parser))) {
        loom_http_tls_free(&tls);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--reasoning-parser %s: not one of %s",
                            cfg->reasoning_parser, LOOM_REASONING_PARSER_NAMES);
    }

    loom_http_t *h = loom_xcalloc(1, sizeof *h);
    h->reasoning = reasoning;
    h->tls = tls;
    h->zctx = ep->zmq_context;
    snprintf(h->inproc, sizeof h->inproc, "%s", ep->inproc_addr);
    h->metrics_fn = ep->metrics;
    h->metrics_ctx = ep->metrics_ctx;
    h->liveness_fn = ep->liveness;
    h->liveness_ctx = ep->liveness_ctx;
    h->max_queue = ep->max_queue;
    snprintf(h->bind, sizeof h->bind, "%s", bind);
    h->api_key = cfg->api_key && cfg->api_key[0] ? loom_xstrdup(cfg->api_key) : NULL;
    h->forward_api_keys = cfg->forward_api_keys;
    h->max_body = cfg->max_body_bytes ? cfg->max_body_bytes : DEFAULT_MAX_BODY;
    h->idle_timeout_s = (unsigned)(cfg->idle_timeout_s > 0 ? cfg->idle_timeout_s : DEFAULT_IDLE_TIMEOUT_S);
    h->request_timeout_ms = cfg->request_timeout_ms > 0 ? cfg->request_timeout_ms : DEFAULT_REQUEST_TIMEOUT_MS;
    h->started = (long long)time(NULL);
    if (cfg->gen_defaults) h->gen = *cfg->gen_defaults;
    h->id_salt = loom_now_ns() ^ ((uint64_t)(uintptr_t)h << 16);
    h->per_ip = cfg->max_connections_per_ip > 0 ? cfg->max_connections_per_ip : 0;
    h->special_in_content = cfg->chat_special_in_content;
    if (cfg->responses_store_max >= 0)
        h->rstore = resp_store_create(cfg->responses_store_max ? cfg->responses_store_max : DEFAULT_RESPONSES_STORE,
                                      cfg->responses_store_bytes ? cfg->responses_store_bytes
                                                                 : DEFAULT_RESPONSES_STORE_BYTES);
    pthread_mutex_init(&h->mu, NULL);
    h->traffic = (listener_t){.h = h, .probe = 0};
    h->traffic.max_conns = cfg->max_connections > 0 ? cfg->max_connections : DEFAULT_MAX_CONNECTIONS;
    h->probe = (listener_t){.h = h, .probe = 1, .max_conns = PROBE_MAX_CONNECTIONS};
    unsigned max_conn = (unsigned)h->traffic.max_conns + OVERFLOW_CONNECTIONS; /* the rest are answered 503 */
    int header_s = cfg->header_timeout_s ? cfg->header_timeout_s : DEFAULT_HEADER_TIMEOUT_S;
    int body_s = cfg->body_timeout_s ? cfg->body_timeout_s : DEFAULT_BODY_TIMEOUT_S;
    h->guard = loom_http_guard_create(header_s > 0 ? header_s * 1000 : 0, body_s > 0 ? body_s * 1000 : 0);
    if (!h->guard) {
        loom_http_stop(&h);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot start the HTTP read-deadline thread");
    }
    if (cfg->model_dir) {
        loom_err_t terr = {0};
        if (loom_tokenizer_load(cfg->model_dir, &h->tok, &terr) < 0)
            LOOM_WARN("http: no tokenizer for /tokenize and /detokenize: %s", terr.msg);
    }
    /* the chat template, compiled once (a syntax error refuses start-up) */
    loom_chat_template_opts_t topt = {.override = cfg->chat_template,
                                      .trust_request = cfg->trust_request_chat_template};
    loom_status_t tst = loom_chat_template_load(cfg->model_dir, &topt, h->tok, &h->tmpl, err);
    if (tst < 0) {
        loom_http_stop(&h);
        return tst;
    }
    h->tool_fmt = tool_fmt ? tool_fmt : loom_toolfmt_detect(loom_chat_template_tool_text(h->tmpl));
    if (!h->tool_fmt) h->tool_fmt = LOOM_TOOLFMT_HERMES;

    /* MHD's threads leave SIGINT/SIGTERM to the main thread */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    errno = 0;
    h->daemon = start_daemon(h, &h->traffic, &ss, v6, max_conn, h->tls.cert_pem != NULL);
    int e = errno;
    if (h->daemon && probe_bind) {
        errno = 0;
        h->probe_daemon =
            start_daemon(h, &h->probe, &pss, pv6, PROBE_MAX_CONNECTIONS + PROBE_OVERFLOW_CONNECTIONS, 0);
        e = errno;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!h->daemon || (probe_bind && !h->probe_daemon)) {
        loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cannot serve HTTP on %s: %s", h->daemon ? probe_bind : bind,
                     e ? strerror(e) : "libmicrohttpd could not start (see the log)");
        loom_http_stop(&h);
        return LOOM_ERR_UNAVAILABLE;
    }
    h->port = daemon_port(h->daemon);
    if (h->probe_daemon) h->probe_port = daemon_port(h->probe_daemon);
    atomic_store(&h->serving, 1);
    LOOM_INFO("HTTP gateway on %s (port %d, %s), chat template: %s, tool calls: %s, reasoning: %s%s", bind, h->port,
              h->tls.cert_pem ? "HTTPS" : "plain HTTP", h->tmpl ? loom_chat_template_origin(h->tmpl) : "none",
              loom_toolfmt_name(h->tool_fmt), loom_reasoning_name(h->reasoning), h->api_key ? ", API key required" : "");
    if (h->probe_daemon)
        LOOM_INFO("HTTP probe listener (/health, /metrics, /version) on %s (port %d)", probe_bind, h->probe_port);
    *out = h;
    return LOOM_OK;
}

int loom_http_port(const loom_http_t *h) { return h ? h->port : 0; }

int loom_http_probe_port(const loom_http_t *h) { return h ? h->probe_port : 0; }

void loom_http_drain(loom_http_t *h, int timeout_ms) {
    if (!h) return;
    atomic_store(&h->draining, 1);
    uint64_t deadline = loom_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (atomic_load(&h->generating) > 0 && loom_now_ns() < deadline) {
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
    }
}

void loom_http_stop(loom_http_t **h_p) {
    if (!h_p || !*h_p) return;
    loom_http_t *h = *h_p;
    *h_p = NULL;
    atomic_store(&h->stopping, 1);
    if (h->probe_daemon) MHD_stop_daemon(h->probe_daemon);
    if (h->daemon) MHD_stop_daemon(h->daemon);
    uint64_t cut = loom_http_guard_n_closed(h->guard);
    if (cut) LOOM_INFO("http: %llu connection(s) were closed for missing their header or body deadline", (unsigned long long)cut);
    loom_http_guard_destroy(&h->guard);
    loom_http_tls_free(&h->tls);
    loom_chat_template_destroy(&h->tmpl);
    loom_tokenizer_destroy(&h->tok);
    resp_store_destroy(&h->rstore);
    pthread_mutex_destroy(&h->mu);
    free(h->api_key);
    free(h);
}
