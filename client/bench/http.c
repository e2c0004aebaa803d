/* The bench's OpenAI-compatible transport: streaming /v1/completions or
 * /v1/chat/completions over libcurl's multi interface (every request its
 * own easy handle, connections reused), Server-Sent Events parsed line by
 * line as the spec has them ("data:" with or without a space, CRLF or LF,
 * several data lines per event, comments), each event's JSON read with
 * cJSON wherever its keys are and however it is spaced. A chunk whose
 * first choice carries text (completions: text; chat: delta.content) is a
 * token; usage may come in any chunk (OpenAI sends it last, with
 * stream_options.include_usage); Loom's final chunk also has "timings".
 * Nothing here depends on Loom's way of writing JSON, so the same load
 * generator measures vLLM, llama-server or any other such server. */
#include <curl/curl.h>
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/bench/bench.h"
#include "common/util.h"

typedef struct hreq {
    struct http_tr *t;
    uint64_t handle;
    CURL *easy;
    char *body;
    loom_sbuf_t line; /* bytes of the current line */
    loom_sbuf_t data; /* data lines of the current event */
    loom_sbuf_t err;  /* the body of a non-200 answer */
    long status;
    int prompt_tokens, completion_tokens, cached_tokens, has_timings, failed;
    loom_timings_t timings;
    char fail_msg[300];
} hreq_t;

typedef struct hevent {
    bench_event_t ev;
    char *text;
} hevent_t;

typedef struct http_tr {
    CURLM *multi;
    struct curl_slist *headers;
    char url[1024], models_url[1024], model[256];
    int chat;
    long timeout_ms;
    uint64_t next_handle;
    hreq_t **reqs;
    int n_reqs, cap_reqs;
    hevent_t *events; /* FIFO: decoded, not yet returned */
    int ev_head, n_events, cap_events;
    char *cur_text; /* the text of the event last returned */
} http_tr_t;

static loom_status_t status_from_http(long code) {
    switch (code) {
    case 400:
        return LOOM_ERR_INVALID_ARGUMENT;
    case 401:
    case 403:
        return LOOM_ERR_UNAUTHENTICATED;
    case 404:
        return LOOM_ERR_NOT_FOUND;
    case 429:
        return LOOM_ERR_RESOURCE_EXHAUSTED;
    case 503:
        return LOOM_ERR_UNAVAILABLE;
    case 504:
        return LOOM_ERR_DEADLINE_EXCEEDED;
    default:
        return LOOM_ERR_INTERNAL;
    }
}

static void push(http_tr_t *t, const bench_event_t *ev, const char *text, size_t len) {
    if (t->ev_head > 0 && t->n_events == t->cap_events) {
        memmove(t->events, t->events + t->ev_head,
                (size_t)(t->n_events - t->ev_head) * sizeof *t->events);
        t->n_events -= t->ev_head;
        t->ev_head = 0;
    }
    if (t->n_events == t->cap_events) {
        t->cap_events = t->cap_events ? 2 * t->cap_events : 64;
        t->events = loom_xrealloc(t->events, (size_t)t->cap_events * sizeof *t->events);
    }
    hevent_t *e = &t->events[t->n_events++];
    e->ev = *ev;
    e->text = NULL;
    if (text) {
        e->text = loom_xmalloc(len + 1);
        memcpy(e->text, text, len);
        e->text[len] = '\0';
        e->ev.text_len = len;
    }
}

/* A message from an error body: error.message, error (a string), message or detail; else the raw
 * text. */
static void error_message(const char *body, size_t len, char *out, size_t n) {
    out[0] = '\0';
    cJSON *j = body ? cJSON_ParseWithLength(body, len) : NULL;
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    const cJSON *m = cJSON_IsObject(e) ? cJSON_GetObjectItemCaseSensitive(e, "message") : e;
    if (!cJSON_IsString(m)) m = cJSON_GetObjectItemCaseSensitive(j, "message");
    if (!cJSON_IsString(m)) m = cJSON_GetObjectItemCaseSensitive(j, "detail");
    if (cJSON_IsString(m))
        snprintf(out, n, "%s", m->valuestring);
    else if (body)
        snprintf(out, n, "%.*s", (int)LOOM_MIN(len, n - 1), body);
    cJSON_Delete(j);
    for (char *p = out; *p; p++)
        if (*p == '\n' || *p == '\r') *p = ' ';
}

static int int_item(const cJSON *o, const char *key, int dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? (int)v->valuedouble : dflt;
}

static double num_item(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

/* One SSE event's data. */
static void on_sse_data(hreq_t *r, const char *data, size_t len) {
    http_tr_t *t = r->t;
    if (r->failed) return;
    if (len == 6 && !memcmp(data, "[DONE]", 6)) return;
    cJSON *j = cJSON_ParseWithLength(data, len);
    if (!cJSON_IsObject(j)) {
        r->failed = 1;
        snprintf(r->fail_msg, sizeof r->fail_msg,
                 "INTERNAL: the stream sent an event that is not a JSON object: %.80s", data);
        cJSON_Delete(j);
        return;
    }
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    if (e && !cJSON_IsNull(e)) {
        char msg[256];
        error_message(data, len, msg, sizeof msg);
        r->failed = 1;
        snprintf(r->fail_msg, sizeof r->fail_msg,
                 "UNAVAILABLE: the stream ended with an error: %.200s", msg);
        cJSON_Delete(j);
        return;
    }
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(j, "usage");
    if (cJSON_IsObject(u)) {
        r->prompt_tokens = int_item(u, "prompt_tokens", r->prompt_tokens);
        r->completion_tokens = int_item(u, "completion_tokens", r->completion_tokens);
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens_details");
        if (cJSON_IsObject(d)) r->cached_tokens = int_item(d, "cached_tokens", r->cached_tokens);
    }
    const cJSON *tm = cJSON_GetObjectItemCaseSensitive(j, "timings");
    if (cJSON_IsObject(tm) && cJSON_GetObjectItemCaseSensitive(tm, "total_ms")) {
        r->timings = (loom_timings_t){num_item(tm, "queue_ms"),      num_item(tm, "tokenize_ms"),
                                      num_item(tm, "prefill_ms"),    num_item(tm, "decode_ms"),
                                      num_item(tm, "detokenize_ms"), num_item(tm, "send_ms"),
                                      num_item(tm, "ttft_ms"),       num_item(tm, "total_ms")};
        r->has_timings = 1;
    }
    const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "choices"), 0);
    const cJSON *txt = NULL;
    if (cJSON_IsObject(c0))
        txt = t->chat ? cJSON_GetObjectItemCaseSensitive(
                            cJSON_GetObjectItemCaseSensitive(c0, "delta"), "content")
                      : cJSON_GetObjectItemCaseSensitive(c0, "text");
    if (cJSON_IsString(txt) && txt->valuestring[0]) {
        bench_event_t ev = {.handle = r->handle, .n_tokens = 1};
        push(t, &ev, txt->valuestring, strlen(txt->valuestring));
    }
    cJSON_Delete(j);
}

/* One line of the stream (without its end of line). */
static void on_line(hreq_t *r, const char *s, size_t n) {
    if (n == 0) { /* the end of an event */
        if (r->data.len) on_sse_data(r, r->data.p, r->data.len);
        r->data.len = 0;
        return;
    }
    if (s[0] == ':' || n < 5 || memcmp(s, "data:", 5) != 0)
        return; /* a comment, event:, id:, retry: */
    s += 5, n -= 5;
    if (n && *s == ' ') s++, n--;
    if (r->data.len) loom_sbuf_add(&r->data, "\n", 1);
    loom_sbuf_add(&r->data, s, n);
}

static size_t on_write(char *p, size_t size, size_t nmemb, void *ud) {
    hreq_t *r = ud;
    size_t n = size * nmemb;
    if (!r->status) curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &r->status);
    if (r->status != 200) {
        if (r->err.len < 4096) loom_sbuf_add(&r->err, p, n);
        return n;
    }
    for (size_t i = 0; i < n; i++) {
        if (p[i] != '\n') {
            loom_sbuf_add(&r->line, p + i, 1);
            continue;
        }
        size_t len = r->line.len;
        if (len && r->line.p[len - 1] == '\r') len--;
        on_line(r, r->line.p ? r->line.p : "", len);
        r->line.len = 0;
    }
    return n;
}

static void drop(http_tr_t *t, int i) {
    hreq_t *r = t->reqs[i];
    curl_multi_remove_handle(t->multi, r->easy);
    curl_easy_cleanup(r->easy);
    free(r->body);
    free(r->line.p);
    free(r->data.p);
    free(r->err.p);
    free(r);
    t->reqs[i] = t->reqs[--t->n_reqs];
}

static void finish(http_tr_t *t, int i, loom_status_t st, const char *msg) {
    hreq_t *r = t->reqs[i];
    bench_event_t ev = {.handle = r->handle,
                        .final = 1,
                        .status = st,
                        .prompt_tokens = r->prompt_tokens,
                        .completion_tokens = r->completion_tokens,
                        .cached_tokens = r->cached_tokens,
                        .timings = r->timings,
                        .has_timings = r->has_timings};
    snprintf(ev.message, sizeof ev.message, "%s", msg ? msg : "");
    push(t, &ev, NULL, 0);
    drop(t, i);
}

/* Transfers that ended: their final events. */
static void reap(http_tr_t *t) {
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(t->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        int i = 0;
        while (i < t->n_reqs && t->reqs[i]->easy != m->easy_handle)
            i++;
        if (i == t->n_reqs) continue;
        hreq_t *r = t->reqs[i];
        CURLcode rc = m->data.result;
        char msg[400];
        if (rc != CURLE_OK) {
            snprintf(msg, sizeof msg, "%s", curl_easy_strerror(rc));
            finish(t, i,
                   rc == CURLE_OPERATION_TIMEDOUT ? LOOM_ERR_DEADLINE_EXCEEDED
                                                  : LOOM_ERR_UNAVAILABLE,
                   msg);
        } else if (r->status != 200) {
            char body[256];
            error_message(r->err.p, r->err.len, body, sizeof body);
            loom_status_t st = status_from_http(r->status);
            snprintf(msg, sizeof msg, "HTTP %ld: %s", r->status, body);
            finish(t, i, st, msg);
        } else {
            if (r->line.len)
                on_line(r, r->line.p, r->line.len); /* a last line without its newline */
            on_line(r, "", 0);
            if (r->failed) {
                /* the message names its status first */
                loom_status_t st =
                    strncmp(r->fail_msg, "INTERNAL", 8) ? LOOM_ERR_UNAVAILABLE : LOOM_ERR_INTERNAL;
                snprintf(msg, sizeof msg, "%s", strchr(r->fail_msg, ':') + 2);
                finish(t, i, st, msg);
            } else {
                finish(t, i, LOOM_OK, NULL);
            }
        }
    }
}

static CURL *new_easy(http_tr_t *t, const char *url) {
    CURL *e = curl_easy_init();
    LOOM_ASSERT(e);
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, t->headers);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, LOOM_MIN(t->timeout_ms, 10000L));
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, t->timeout_ms);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    return e;
}

static loom_status_t http_submit(void *self, const bench_req_t *br, uint64_t *handle,
                                 loom_err_t *err) {
    http_tr_t *t = self;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "model", t->model);
    if (t->chat) {
        if (!br->prompt_text) {
            cJSON_Delete(o);
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "INVALID_ARGUMENT: a chat endpoint needs text prompts");
        }
        cJSON *msgs = cJSON_AddArrayToObject(o, "messages"), *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", br->prompt_text);
        cJSON_AddItemToArray(msgs, m);
    } else if (br->prompt_text) {
        cJSON_AddStringToObject(o, "prompt", br->prompt_text);
    } else {
        cJSON_AddItemToObject(o, "prompt", cJSON_CreateIntArray(br->prompt_ids, br->n_prompt));
    }
    cJSON_AddNumberToObject(o, "max_tokens", br->max_tokens);
    cJSON_AddNumberToObject(o, "temperature", br->temperature);
    cJSON_AddNumberToObject(o, "seed", (double)(br->seed & ((1ull << 53) - 1)));
    if (br->ignore_eos) cJSON_AddBoolToObject(o, "ignore_eos", 1);
    if (br->session) cJSON_AddStringToObject(o, "user", br->session);
    cJSON_AddBoolToObject(o, "stream", 1);
    cJSON_AddBoolToObject(cJSON_AddObjectToObject(o, "stream_options"), "include_usage", 1);
    hreq_t *r = loom_xcalloc(1, sizeof *r);
    r->t = t;
    r->body = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    LOOM_ASSERT(r->body);
    r->handle = ++t->next_handle;
    r->cached_tokens = -1;
    r->easy = new_easy(t, t->url);
    curl_easy_setopt(r->easy, CURLOPT_POSTFIELDS, r->body);
    curl_easy_setopt(r->easy, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(r->easy, CURLOPT_WRITEDATA, r);
    if (curl_multi_add_handle(t->multi, r->easy) != CURLM_OK) {
        curl_easy_cleanup(r->easy);
        free(r->body);
        free(r);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "INTERNAL: libcurl refused a transfer");
    }
    if (t->n_reqs == t->cap_reqs) {
        t->cap_reqs = t->cap_reqs ? 2 * t->cap_reqs : 64;
        t->reqs = loom_xrealloc(t->reqs, (size_t)t->cap_reqs * sizeof *t->reqs);
    }
    t->reqs[t->n_reqs++] = r;
    *handle = r->handle;
    return LOOM_OK;
}

static int take(http_tr_t *t, bench_event_t *ev) {
    if (t->ev_head == t->n_events) return 0;
    hevent_t *e = &t->events[t->ev_head++];
    free(t->cur_text);
    t->cur_text = e->text;
    *ev = e->ev;
    ev->text = t->cur_text;
    if (t->ev_head == t->n_events) t->ev_head = t->n_events = 0;
    return 1;
}

static loom_status_t http_poll(void *self, int timeout_ms, bench_event_t *ev, int *got,
                               loom_err_t *err) {
    http_tr_t *t = self;
    int running = 0;
    (void)err;
    *got = take(t, ev);
    if (*got) return LOOM_OK;
    curl_multi_perform(t->multi, &running);
    reap(t);
    if ((*got = take(t, ev))) return LOOM_OK;
    int nfds = 0;
    curl_multi_poll(t->multi, NULL, 0, timeout_ms, &nfds);
    curl_multi_perform(t->multi, &running);
    reap(t);
    *got = take(t, ev);
    return LOOM_OK;
}

static loom_status_t http_cancel(void *self, uint64_t handle, loom_err_t *err) {
    http_tr_t *t = self;
    for (int i = 0; i < t->n_reqs; i++)
        if (t->reqs[i]->handle == handle) {
            /* closing the connection is the cancel: an OpenAI server stops generating */
            finish(t, i, LOOM_ERR_CANCELLED, "cancelled");
            return LOOM_OK;
        }
    return loom_err_set(err, LOOM_ERR_NOT_FOUND, "NOT_FOUND: request %llu is not in flight",
                        (unsigned long long)handle);
}

static size_t collect(char *p, size_t size, size_t nmemb, void *ud) {
    loom_sbuf_add(ud, p, size * nmemb);
    return size * nmemb;
}

/* GET /v1/models: the first model's id; max_model_len (vLLM, Loom) and vocab_size (Loom) when
 * present. */
static loom_status_t http_model(void *self, bench_model_t *m, loom_err_t *err) {
    http_tr_t *t = self;
    CURL *e = new_easy(t, t->models_url);
    loom_sbuf_t b = {0};
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &b);
    CURLcode rc = curl_easy_perform(e);
    long code = 0;
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(e);
    loom_status_t st = LOOM_OK;
    char msg[256];
    if (rc != CURLE_OK) {
        st = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "UNAVAILABLE: no answer from %s: %s",
                          t->models_url, curl_easy_strerror(rc));
    } else if (code != 200) {
        error_message(b.p, b.len, msg, sizeof msg);
        st = loom_err_set(err, status_from_http(code), "%s: HTTP %ld from %s: %s",
                          loom_status_str(status_from_http(code)), code, t->models_url, msg);
    } else {
        cJSON *j = cJSON_ParseWithLength(b.p ? b.p : "", b.len);
        const cJSON *d0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "data"), 0);
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(d0, "id");
        if (!cJSON_IsString(id)) {
            st = loom_err_set(err, LOOM_ERR_NOT_FOUND,
                              "NOT_FOUND: %s lists no model (a JSON {\"data\": [{\"id\": ...}]})",
                              t->models_url);
        } else {
            snprintf(m->id, sizeof m->id, "%s", id->valuestring);
            m->context_length = int_item(d0, "max_model_len", 0);
            m->vocab_size = int_item(d0, "vocab_size", 0);
            if (!t->model[0]) snprintf(t->model, sizeof t->model, "%s", m->id);
        }
        cJSON_Delete(j);
    }
    free(b.p);
    return st;
}

static void http_close(void *self) {
    http_tr_t *t = self;
    while (t->n_reqs)
        drop(t, t->n_reqs - 1);
    for (int i = t->ev_head; i < t->n_events; i++)
        free(t->events[i].text);
    free(t->events);
    free(t->reqs);
    free(t->cur_text);
    curl_slist_free_all(t->headers);
    curl_multi_cleanup(t->multi);
    free(t);
}

loom_status_t bench_http_open(const char *base_url, const char *endpoint, int chat, int timeout_ms,
                              const char *api_key, const char *model, bench_transport_t *tr,
                              loom_err_t *err) {
    if (strncmp(base_url, "http://", 7) && strncmp(base_url, "https://", 8))
        return loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "INVALID_ARGUMENT: the URL must be http://HOST:PORT (or https://), got '%s'", base_url);
    char base[768];
    if (snprintf(base, sizeof base, "%s", base_url) >= (int)sizeof base)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "INVALID_ARGUMENT: the URL is too long");
    size_t n = strlen(base);
    while (n && base[n - 1] == '/')
        base[--n] = '\0';
    if (n >= 3 && !strcmp(base + n - 3, "/v1")) base[n -= 3] = '\0';
    if (!endpoint) endpoint = chat ? "/v1/chat/completions" : "/v1/completions";
    if (endpoint[0] != '/')
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "INVALID_ARGUMENT: --endpoint must start with /, got '%s'", endpoint);
    static int curl_ready;
    if (!curl_ready) {
        curl_global_init(CURL_GLOBAL_DEFAULT);
        curl_ready = 1;
    }
    http_tr_t *t = loom_xcalloc(1, sizeof *t);
    snprintf(t->url, sizeof t->url, "%s%s", base, endpoint);
    snprintf(t->models_url, sizeof t->models_url, "%s/v1/models", base);
    t->chat = chat;
    t->timeout_ms = timeout_ms > 0 ? timeout_ms : 300000;
    if (model) snprintf(t->model, sizeof t->model, "%s", model);
    t->headers = curl_slist_append(NULL, "Content-Type: application/json");
    t->headers = curl_slist_append(t->headers, "Accept: text/event-stream");
    if (api_key) {
        char h[600];
        snprintf(h, sizeof h, "Authorization: Bearer %.500s", api_key);
        t->headers = curl_slist_append(t->headers, h);
    }
    t->multi = curl_multi_init();
    LOOM_ASSERT(t->multi && t->headers);
    *tr = (bench_transport_t){.name = chat ? "openai-chat" : "openai",
                              .needs_text = chat,
                              .self = t,
                              .submit = http_submit,
                              .poll = http_poll,
                              .cancel = http_cancel,
                              .model = http_model,
                              .close = http_close};
    return LOOM_OK;
}
