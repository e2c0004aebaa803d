/* The Responses API (/v1/responses, GET and DELETE /v1/responses/{id}).
 *
 * A request is mapped onto the chat-completions path: input items become
 * chat messages (instructions a system turn first), function tools and
 * tool_choice the chat's, text.format a response_format, max_output_tokens
 * max_completion_tokens. The chat body so built is handed to
 * handle_generate, so chat templates, grammar-forced tool calls and
 * structured output all apply; only the rendering differs (the hooks in
 * render.c call resp_stream_chunk and resp_finish).
 *
 * Streamed, a response is a sequence of events, each with a
 * sequence_number: response.created, response.in_progress, then per output
 * item output_item.added, (message) content_part.added, output_text.delta...,
 * output_text.done, content_part.done, or (function call)
 * function_call_arguments.delta..., function_call_arguments.done, then
 * output_item.done; last response.completed (response.incomplete when the
 * token budget cut it), or error + response.failed when the stream broke.
 *
 * Log probabilities (include "message.output_text.logprobs", top_logprobs
 * N: the chat's logprobs and top_logprobs) go on the message's output_text
 * part, and streamed on each output_text.delta with its tokens: those of
 * the answer (a reasoning parser's reasoning tokens left out, counted per
 * chunk as reasoning_tokens are), none while tools are on (as the chat's
 * streamed logprobs).
 *
 * Stored responses (store, default true) live in a bounded LRU (count and
 * bytes): the response object, for GET, and the conversation as chat
 * messages (instructions left out, as OpenAI), which previous_response_id
 * continues. */
#include "gateway/gateway_impl.h"

/* ---- the store ---- */

typedef struct resp_entry {
    struct resp_entry *prev, *next; /* most recently used first */
    char id[64];
    char *response; /* the response object (JSON) */
    char *convo;    /* the conversation: a JSON array of chat messages */
    size_t bytes;
} resp_entry_t;

struct resp_store {
    pthread_mutex_t mu;
    resp_entry_t *head, *tail;
    int n, max_n;
    size_t bytes, max_bytes;
};

resp_store_t *resp_store_create(int max_entries, size_t max_bytes) {
    resp_store_t *s = loom_xcalloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    s->max_n = max_entries;
    s->max_bytes = max_bytes;
    return s;
}

static void entry_unlink(resp_store_t *s, resp_entry_t *e) {
    if (e->prev) e->prev->next = e->next;
    else s->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else s->tail = e->prev;
    e->prev = e->next = NULL;
    s->n--;
    s->bytes -= e->bytes;
}

static void entry_push(resp_store_t *s, resp_entry_t *e) {
    e->prev = NULL;
    e->next = s->head;
    if (s->head) s->head->prev = e;
    s->head = e;
    if (!s->tail) s->tail = e;
    s->n++;
    s->bytes += e->bytes;
}

static void entry_free(resp_entry_t *e) {
    free(e->response);
    free(e->convo);
    free(e);
}

void resp_store_destroy(resp_store_t **s_p) {
    if (!s_p || !*s_p) return;
    resp_store_t *s = *s_p;
    *s_p = NULL;
    while (s->head) {
        resp_entry_t *e = s->head;
        entry_unlink(s, e);
        entry_free(e);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static resp_entry_t *entry_find(resp_store_t *s, const char *id) {
    for (resp_entry_t *e = s->head; e; e = e->next)
        if (!strcmp(e->id, id)) return e;
    return NULL;
}

/* Keeps a response (takes response and convo), evicting the least recently
 * used ones over the bounds; one alone over the byte bound is not kept. */
static void store_put(resp_store_t *s, const char *id, char *response, char *convo) {
    resp_entry_t *e = loom_xcalloc(1, sizeof *e);
    snprintf(e->id, sizeof e->id, "%s", id);
    e->response = response;
    e->convo = convo;
    e->bytes = sizeof *e + strlen(response) + strlen(convo);
    if (s->max_n <= 0 || e->bytes > s->max_bytes) {
        entry_free(e);
        return;
    }
    pthread_mutex_lock(&s->mu);
    resp_entry_t *old = entry_find(s, id);
    if (old) {
        entry_unlink(s, old);
        entry_free(old);
    }
    entry_push(s, e);
    while (s->n > s->max_n || s->bytes > s->max_bytes) {
        resp_entry_t *t = s->tail;
        entry_unlink(s, t);
        entry_free(t);
    }
    pthread_mutex_unlock(&s->mu);
}

/* Copies of a stored response's parts (NULL: unknown id). */
static int store_get(resp_store_t *s, const char *id, char **response, char **convo) {
    pthread_mutex_lock(&s->mu);
    resp_entry_t *e = entry_find(s, id);
    if (e) {
        entry_unlink(s, e); /* now the most recently used */
        entry_push(s, e);
        if (response) *response = loom_xstrdup(e->response);
        if (convo) *convo = loom_xstrdup(e->convo);
    }
    pthread_mutex_unlock(&s->mu);
    return e != NULL;
}

static int store_delete(resp_store_t *s, const char *id) {
    pthread_mutex_lock(&s->mu);
    resp_entry_t *e = entry_find(s, id);
    if (e) {
        entry_unlink(s, e);
        entry_free(e);
    }
    pthread_mutex_unlock(&s->mu);
    return e != NULL;
}

/* ---- one response ---- */

enum { ITEM_NONE, ITEM_MESSAGE, ITEM_CALL, ITEM_REASONING };

struct resp_ctx {
    char id[64];
    long long created_at;
    int store;
    cJSON *echo;  /* the request fields the response object repeats */
    cJSON *convo; /* the conversation so far as chat messages (without instructions) */
    /* the output as it streams */
    long long seq;    /* the next event's sequence_number */
    cJSON *output;    /* finished output items */
    int open;         /* the item being streamed: ITEM_NONE, ITEM_MESSAGE, ITEM_CALL, ITEM_REASONING */
    char item_id[80]; /* its id */
    loom_sbuf_t text; /* its text (message) or arguments (call) */
    char call_id[64];
    char *call_name;
    loom_sbuf_t content; /* the whole answer's content, for the stored conversation */
    cJSON *calls;        /* the answer's calls as chat tool_calls, for the stored conversation */
    /* --reasoning-parser: the output's reasoning split off (common/reasoning.h) */
    loom_rsplit_t *rs;
    long long reasoning_tokens; /* tokens of the chunks that came before the answer began */
    /* logprobs, streamed: the open message's entries, and those of tokens whose text has not gone out yet */
    cJSON *lp_msg, *lp_pending;
};

void resp_free(req_t *q) {
    resp_ctx_t *r = q->resp;
    if (!r) return;
    q->resp = NULL;
    cJSON_Delete(r->echo);
    cJSON_Delete(r->convo);
    cJSON_Delete(r->output);
    cJSON_Delete(r->calls);
    free(r->text.p);
    free(r->content.p);
    free(r->call_name);
    loom_rsplit_destroy(&r->rs);
    cJSON_Delete(r->lp_msg);
    cJSON_Delete(r->lp_pending);
    free(r);
}

/* A fresh id: prefix + 32 hex digits. */
static void fresh_id(loom_http_t *h, const char *prefix, char *out, size_t cap) {
    uint64_t k = atomic_fetch_add(&h->n_ids, 1);
    uint64_t a = mix64(h->id_salt + k), b = mix64(a ^ 0x2545f4914f6cdd1dull);
    snprintf(out, cap, "%s%016llx%016llx", prefix, (unsigned long long)a, (unsigned long long)b);
}

static cJSON *echo_or(const resp_ctx_t *r, const char *k, cJSON *dflt) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(r->echo, k);
    if (x && !cJSON_IsNull(x)) {
        cJSON_Delete(dflt);
        return cJSON_Duplicate(x, 1);
    }
    return dflt;
}

/* The response object (takes output and usage; usage NULL: null). */
static cJSON *resp_object(const req_t *q, const char *status, cJSON *output, cJSON *usage, const char *incomplete,
                          cJSON *error) {
    const resp_ctx_t *r = q->resp;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", r->id);
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddNumberToObject(o, "created_at", (double)r->created_at);
    cJSON_AddStringToObject(o, "status", status);
    cJSON_AddFalseToObject(o, "background");
    cJSON_AddItemToObject(o, "error", error ? error : cJSON_CreateNull());
    if (incomplete) {
        cJSON *d = cJSON_AddObjectToObject(o, "incomplete_details");
        cJSON_AddStringToObject(d, "reason", incomplete);
    } else {
        cJSON_AddNullToObject(o, "incomplete_details");
    }
    cJSON_AddItemToObject(o, "instructions", echo_or(r, "instructions", cJSON_CreateNull()));
    cJSON_AddItemToObject(o, "max_output_tokens", echo_or(r, "max_output_tokens", cJSON_CreateNull()));
    cJSON_AddNullToObject(o, "max_tool_calls");
    cJSON_AddStringToObject(o, "model", q->model);
    cJSON_AddItemToObject(o, "output", output ? output : cJSON_CreateArray());
    cJSON_AddItemToObject(o, "parallel_tool_calls", echo_or(r, "parallel_tool_calls", cJSON_CreateTrue()));
    cJSON_AddItemToObject(o, "previous_response_id", echo_or(r, "previous_response_id", cJSON_CreateNull()));
    cJSON *reasoning = cJSON_AddObjectToObject(o, "reasoning");
    const cJSON *rq = cJSON_GetObjectItemCaseSensitive(r->echo, "reasoning");
    const cJSON *effort = cJSON_IsObject(rq) ? cJSON_GetObjectItemCaseSensitive(rq, "effort") : NULL;
    cJSON_AddItemToObject(reasoning, "effort", cJSON_IsString(effort) ? cJSON_CreateString(effort->valuestring)
                                                                      : cJSON_CreateNull());
    cJSON_AddNullToObject(reasoning, "summary");
    cJSON_AddStringToObject(o, "service_tier", "default");
    cJSON_AddBoolToObject(o, "store", r->store);
    cJSON_AddItemToObject(o, "temperature", echo_or(r, "temperature", cJSON_CreateNumber(1.0)));
    cJSON *text = cJSON_AddObjectToObject(o, "text");
    const cJSON *tq = cJSON_GetObjectItemCaseSensitive(r->echo, "text");
    const cJSON *fmt = cJSON_IsObject(tq) ? cJSON_GetObjectItemCaseSensitive(tq, "format") : NULL;
    if (cJSON_IsObject(fmt)) {
        cJSON_AddItemToObject(text, "format", cJSON_Duplicate(fmt, 1));
    } else {
        cJSON *f = cJSON_AddObjectToObject(text, "format");
        cJSON_AddStringToObject(f, "type", "text");
    }
    cJSON_AddItemToObject(o, "tool_choice", echo_or(r, "tool_choice", cJSON_CreateString("auto")));
    cJSON_AddItemToObject(o, "tools", echo_or(r, "tools", cJSON_CreateArray()));
    cJSON_AddItemToObject(o, "top_logprobs", echo_or(r, "top_logprobs", cJSON_CreateNull()));
    cJSON_AddItemToObject(o, "top_p", echo_or(r, "top_p", cJSON_CreateNumber(1.0)));
    cJSON_AddItemToObject(o, "truncation", echo_or(r, "truncation", cJSON_CreateString("disabled")));
    cJSON_AddItemToObject(o, "usage", usage ? usage : cJSON_CreateNull());
    cJSON_AddItemToObject(o, "user", echo_or(r, "user", cJSON_CreateNull()));
    cJSON_AddItemToObject(o, "metadata", echo_or(r, "metadata", cJSON_CreateObject()));
    return o;
}

static cJSON *resp_usage(const resp_ctx_t *r, const loom_chunk_t *ch) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "input_tokens", ch->prompt_tokens);
    cJSON *d = cJSON_AddObjectToObject(u, "input_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", ch->cached_tokens);
    cJSON_AddNumberToObject(u, "output_tokens", ch->completion_tokens);
    d = cJSON_AddObjectToObject(u, "output_tokens_details");
    cJSON_AddNumberToObject(d, "reasoning_tokens", (double)r->reasoning_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)ch->prompt_tokens + ch->completion_tokens);
    return u;
}

/* (takes logprobs: the output_text part's [{token, logprob, bytes,
 * top_logprobs}], NULL: none) */
static cJSON *message_item(const char *id, const char *status, const char *text, cJSON *logprobs) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", id);
    cJSON_AddStringToObject(m, "type", "message");
    cJSON_AddStringToObject(m, "status", status);
    cJSON_AddStringToObject(m, "role", "assistant");
    cJSON *content = cJSON_AddArrayToObject(m, "content");
    if (text) {
        cJSON *p = cJSON_CreateObject();
        cJSON_AddStringToObject(p, "type", "output_text");
        cJSON_AddStringToObject(p, "text", text);
        cJSON_AddArrayToObject(p, "annotations");
        cJSON_AddItemToObject(p, "logprobs", logprobs ? logprobs : cJSON_CreateArray());
        cJSON_AddItemToArray(content, p);
    } else {
        cJSON_Delete(logprobs);
    }
    return m;
}

/* {type: reasoning, content: [{type: reasoning_text, text}]} (text NULL: no content yet) */
static cJSON *reasoning_item(const char *id, const char *status, const char *text) {
    cJSON *it = cJSON_CreateObject();
    cJSON_AddStringToObject(it, "id", id);
    cJSON_AddStringToObject(it, "type", "reasoning");
    if (status) cJSON_AddStringToObject(it, "status", status);
    cJSON_AddArrayToObject(it, "summary");
    cJSON *content = cJSON_AddArrayToObject(it, "content");
    if (text) {
        cJSON *c = cJSON_CreateObject();
        cJSON_AddStringToObject(c, "type", "reasoning_text");
        cJSON_AddStringToObject(c, "text", text);
        cJSON_AddItemToArray(content, c);
    }
    return it;
}

static cJSON *call_item(const char *id, const char *status, const char *call_id, const char *name,
                        const char *arguments) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "id", id);
    cJSON_AddStringToObject(c, "type", "function_call");
    cJSON_AddStringToObject(c, "status", status);
    cJSON_AddStringToObject(c, "call_id", call_id);
    cJSON_AddStringToObject(c, "name", name);
    cJSON_AddStringToObject(c, "arguments", arguments);
    return c;
}

/* The chat tool call a function_call item stands for, in the stored
 * conversation. */
static void keep_call(resp_ctx_t *r, const char *call_id, const char *name, const char *arguments) {
    if (!r->calls) r->calls = cJSON_CreateArray();
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "id", call_id);
    cJSON_AddStringToObject(c, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(c, "function");
    cJSON_AddStringToObject(fn, "name", name);
    cJSON_AddStringToObject(fn, "arguments", arguments);
    cJSON_AddItemToArray(r->calls, c);
}

/* The reasoning of a finished answer, split off by the server's reasoning
 * parser (common/reasoning.h): *reasoning (malloc'ed, NULL: none) becomes a
 * reasoning item ({type: reasoning, content: [{type: reasoning_text}]})
 * ahead of the message; *text is left the answer. (Streamed: the chunks
 * go through resp_ctx_t.rs as they come, resp_stream_chunk.) */
static void reasoning_split(const req_t *q, char **text, char **reasoning) {
    *reasoning = NULL;
    if (!q->h->reasoning) return;
    char *answer = NULL;
    loom_reasoning_split(q->h->reasoning, *text, strlen(*text), reasoning, &answer);
    free(*text);
    *text = answer ? answer : loom_xstrdup("");
}

/* Stores the finished response and the conversation it ends. */
static void keep_response(req_t *q, const cJSON *response) {
    resp_ctx_t *r = q->resp;
    if (!r->store || !q->h->rstore) return;
    cJSON *convo = r->convo ? cJSON_Duplicate(r->convo, 1) : cJSON_CreateArray();
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "assistant");
    char *content = text_dup(r->content.p ? r->content.p : "", r->content.len);
    if (r->calls) {
        if (content[0]) cJSON_AddStringToObject(m, "content", content);
        cJSON_AddItemToObject(m, "tool_calls", cJSON_Duplicate(r->calls, 1));
    } else {
        cJSON_AddStringToObject(m, "content", content);
    }
    free(content);
    cJSON_AddItemToArray(convo, m);
    char *rs = cJSON_PrintUnformatted(response), *cs = cJSON_PrintUnformatted(convo);
    cJSON_Delete(convo);
    if (rs && cs) store_put(q->h->rstore, r->id, rs, cs);
    else free(rs), free(cs);
}

/* ---- streamed ---- */

static cJSON *ev_new(req_t *q, const char *type) {
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "type", type);
    cJSON_AddNumberToObject(e, "sequence_number", (double)q->resp->seq++);
    return e;
}

/* "event: TYPE" and "data: {...}" (the type again inside, as OpenAI). */
static void ev_send(req_t *q, cJSON *e) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(e, "type");
    char *s = cJSON_PrintUnformatted(e);
    loom_sbuf_printf(&q->out, "event: %s\ndata: ", t->valuestring);
    if (s) loom_sbuf_str(&q->out, s);
    loom_sbuf_str(&q->out, "\n\n");
    free(s);
    cJSON_Delete(e);
}

static void ev_response(req_t *q, const char *type, cJSON *response) {
    cJSON *e = ev_new(q, type);
    cJSON_AddItemToObject(e, "response", response);
    ev_send(q, e);
}

static int out_index(const resp_ctx_t *r) { return r->output ? cJSON_GetArraySize(r->output) : 0; }

static void part_event(req_t *q, const char *type, const char *part_type, const char *text) {
    resp_ctx_t *r = q->resp;
    cJSON *e = ev_new(q, type);
    cJSON_AddStringToObject(e, "item_id", r->item_id);
    cJSON_AddNumberToObject(e, "output_index", out_index(r));
    cJSON_AddNumberToObject(e, "content_index", 0);
    cJSON *p = cJSON_AddObjectToObject(e, "part");
    cJSON_AddStringToObject(p, "type", part_type);
    cJSON_AddStringToObject(p, "text", text);
    if (!strcmp(part_type, "output_text")) cJSON_AddArrayToObject(p, "annotations");
    ev_send(q, e);
}

static void close_item(req_t *q) {
    resp_ctx_t *r = q->resp;
    if (r->open == ITEM_NONE) return;
    char *t = text_dup(r->text.p ? r->text.p : "", r->text.len);
    cJSON *item, *e;
    if (r->open == ITEM_MESSAGE) {
        e = ev_new(q, "response.output_text.done");
        cJSON_AddStringToObject(e, "item_id", r->item_id);
        cJSON_AddNumberToObject(e, "output_index", out_index(r));
        cJSON_AddNumberToObject(e, "content_index", 0);
        cJSON_AddStringToObject(e, "text", t);
        cJSON *lp = r->lp_msg ? r->lp_msg : cJSON_CreateArray();
        r->lp_msg = NULL;
        cJSON_Delete(r->lp_pending); /* (tokens of text the splitter kept back: in lp already) */
        r->lp_pending = NULL;
        cJSON_AddItemToObject(e, "logprobs", cJSON_Duplicate(lp, 1));
        ev_send(q, e);
        part_event(q, "response.content_part.done", "output_text", t);
        item = message_item(r->item_id, "completed", t, lp);
    } else if (r->open == ITEM_REASONING) {
        e = ev_new(q, "response.reasoning_text.done");
        cJSON_AddStringToObject(e, "item_id", r->item_id);
        cJSON_AddNumberToObject(e, "output_index", out_index(r));
        cJSON_AddNumberToObject(e, "content_index", 0);
        cJSON_AddStringToObject(e, "text", t);
        ev_send(q, e);
        part_event(q, "response.content_part.done", "reasoning_text", t);
        item = reasoning_item(r->item_id, "completed", t);
    } else {
        e = ev_new(q, "response.function_call_arguments.done");
        cJSON_AddStringToObject(e, "item_id", r->item_id);
        cJSON_AddNumberToObject(e, "output_index", out_index(r));
        cJSON_AddStringToObject(e, "name", r->call_name);
        cJSON_AddStringToObject(e, "arguments", t);
        ev_send(q, e);
        item = call_item(r->item_id, "completed", r->call_id, r->call_name, t);
        keep_call(r, r->call_id, r->call_name, t);
    }
    free(t);
    e = ev_new(q, "response.output_item.done");
    cJSON_AddNumberToObject(e, "output_index", out_index(r));
    cJSON_AddItemToObject(e, "item", cJSON_Duplicate(item, 1));
    ev_send(q, e);
    if (!r->output) r->output = cJSON_CreateArray();
    cJSON_AddItemToArray(r->output, item);
    r->open = ITEM_NONE;
    r->text.len = 0;
}

static void open_message(req_t *q) {
    resp_ctx_t *r = q->resp;
    close_item(q);
    fresh_id(q->h, "msg_", r->item_id, sizeof r->item_id);
    r->open = ITEM_MESSAGE;
    cJSON *e = ev_new(q, "response.output_item.added");
    cJSON_AddNumberToObject(e, "output_index", out_index(r));
    cJSON_AddItemToObject(e, "item", message_item(r->item_id, "in_progress", NULL, NULL));
    ev_send(q, e);
    part_event(q, "response.content_part.added", "output_text", "");
}

static void text_delta(req_t *q, const char *text, size_t len) {
    resp_ctx_t *r = q->resp;
    if (!len) return;
    if (r->open != ITEM_MESSAGE) open_message(q);
    loom_sbuf_add(&r->text, text, len);
    loom_sbuf_add(&r->content, text, len);
    char *d = text_dup(text, len);
    cJSON *e = ev_new(q, "response.output_text.delta");
    cJSON_AddStringToObject(e, "item_id", r->item_id);
    cJSON_AddNumberToObject(e, "output_index", out_index(r));
    cJSON_AddNumberToObject(e, "content_index", 0);
    cJSON_AddStringToObject(e, "delta", d);
    cJSON_AddItemToObject(e, "logprobs", r->lp_pending ? r->lp_pending : cJSON_CreateArray());
    r->lp_pending = NULL;
    ev_send(q, e);
    free(d);
}

/* A streamed chunk's log probabilities (the answer's tokens), for the next
 * output_text.delta and the message. */
static void stream_logprobs(req_t *q, const loom_chunk_t *ch) {
    resp_ctx_t *r = q->resp;
    if (!q->logprobs || !ch->has_logprobs || ch->n_ids <= 0 || q->tools.mode != LOOM_TOOLS_OFF) return;
    if (r->rs && !loom_rsplit_in_content(r->rs)) return; /* reasoning tokens */
    cJSON *lp = cJSON_CreateObject();
    add_logprobs(q, lp, ch);
    cJSON *entries = cJSON_DetachItemFromObjectCaseSensitive(lp, "content");
    cJSON_Delete(lp);
    if (!r->lp_msg) r->lp_msg = cJSON_CreateArray();
    if (!r->lp_pending) r->lp_pending = cJSON_CreateArray();
    cJSON *it;
    while (entries && (it = cJSON_DetachItemFromArray(entries, 0))) {
        cJSON_AddItemToArray(r->lp_msg, cJSON_Duplicate(it, 1));
        cJSON_AddItemToArray(r->lp_pending, it);
    }
    cJSON_Delete(entries);
}

/* A streamed piece of reasoning: a reasoning item opened on the first. */
static void reasoning_delta(req_t *q, const char *text, size_t len) {
    resp_ctx_t *r = q->resp;
    if (!len) return;
    if (r->open != ITEM_REASONING) {
        close_item(q);
        fresh_id(q->h, "rs_", r->item_id, sizeof r->item_id);
        r->open = ITEM_REASONING;
        cJSON *e = ev_new(q, "response.output_item.added");
        cJSON_AddNumberToObject(e, "output_index", out_index(r));
        cJSON_AddItemToObject(e, "item", reasoning_item(r->item_id, "in_progress", NULL));
        ev_send(q, e);
        part_event(q, "response.content_part.added", "reasoning_text", "");
    }
    loom_sbuf_add(&r->text, text, len);
    char *d = text_dup(text, len);
    cJSON *e = ev_new(q, "response.reasoning_text.delta");
    cJSON_AddStringToObject(e, "item_id", r->item_id);
    cJSON_AddNumberToObject(e, "output_index", out_index(r));
    cJSON_AddNumberToObject(e, "content_index", 0);
    cJSON_AddStringToObject(e, "delta", d);
    ev_send(q, e);
    free(d);
}

/* A streamed tool-calling answer's events (tool_stream.h) as output items. */
static void resp_tool_event(void *ctx, const loom_tse_t *te) {
    req_t *q = ctx;
    resp_ctx_t *r = q->resp;
    if (te->kind == LOOM_TSE_CONTENT) {
        text_delta(q, te->text, te->len);
        return;
    }
    if (te->kind == LOOM_TSE_CALL) {
        close_item(q);
        loom_tools_call_id(call_seed(q), te->index, r->call_id, sizeof r->call_id);
        snprintf(r->item_id, sizeof r->item_id, "fc_%s", r->call_id + (strncmp(r->call_id, "call_", 5) ? 0 : 5));
        free(r->call_name);
        r->call_name = loom_xstrdup(te->name);
        r->open = ITEM_CALL;
        cJSON *e = ev_new(q, "response.output_item.added");
        cJSON_AddNumberToObject(e, "output_index", out_index(r));
        cJSON_AddItemToObject(e, "item", call_item(r->item_id, "in_progress", r->call_id, r->call_name, ""));
        ev_send(q, e);
        return;
    }
    if (r->open != ITEM_CALL || !te->len) return;
    loom_sbuf_add(&r->text, te->text, te->len);
    char *d = text_dup(te->text, te->len);
    cJSON *e = ev_new(q, "response.function_call_arguments.delta");
    cJSON_AddStringToObject(e, "item_id", r->item_id);
    cJSON_AddNumberToObject(e, "output_index", out_index(r));
    cJSON_AddStringToObject(e, "delta", d);
    ev_send(q, e);
    free(d);
}

void resp_stream_begin(req_t *q) {
    ev_response(q, "response.created", resp_object(q, "in_progress", NULL, NULL, NULL, NULL));
    ev_response(q, "response.in_progress", resp_object(q, "in_progress", NULL, NULL, NULL, NULL));
}

/* The answer's text (after any reasoning): tool calls read from it, or content. */
static void stream_answer(req_t *q, const char *text, size_t len) {
    if (!len) return;
    if (q->tools.mode != LOOM_TOOLS_OFF) {
        if (!q->ts) q->ts = loom_tstream_create(&q->tools, resp_tool_event, q);
        loom_tstream_feed(q->ts, text, len);
    } else {
        text_delta(q, text, len);
    }
}

/* With a reasoning parser: a chunk's tokens count as reasoning while the
 * answer has not begun after it (the chunk that ends the reasoning is the
 * answer's). final: what the splitter still holds goes out. */
static void split_chunk(req_t *q, const loom_chunk_t *ch, int final, loom_sbuf_t *reason, loom_sbuf_t *answer) {
    resp_ctx_t *r = q->resp;
    if (!r->rs) r->rs = loom_rsplit_create(q->h->reasoning);
    if (ch->text_len) loom_rsplit_feed(r->rs, ch->text, ch->text_len, reason, answer);
    if (!loom_rsplit_in_content(r->rs) && ch->n_ids > 0) r->reasoning_tokens += ch->n_ids;
    if (final) loom_rsplit_finish(r->rs, reason, answer);
}

void resp_collect_chunk(req_t *q, const loom_chunk_t *ch) {
    if (!q->resp || !q->h->reasoning) return;
    split_chunk(q, ch, 0, NULL, NULL);
}

void resp_stream_chunk(req_t *q, const loom_chunk_t *ch) {
    resp_ctx_t *r = q->resp;
    uint64_t t0 = loom_now_ns();
    if (q->h->reasoning && ch->status == LOOM_OK) {
        loom_sbuf_t rb = {0}, cb = {0};
        split_chunk(q, ch, ch->final, &rb, &cb);
        reasoning_delta(q, rb.p, rb.len);
        stream_logprobs(q, ch);
        stream_answer(q, cb.p, cb.len);
        free(rb.p);
        free(cb.p);
    } else if (ch->text_len > 0 || ch->n_ids > 0) {
        stream_logprobs(q, ch);
        stream_answer(q, ch->text, ch->text_len);
    }
    q->send_ns += loom_now_ns() - t0;
    if (!ch->final) return;
    q->finished = 1;
    if (ch->status != LOOM_OK) {
        /* the stream broke after it began: an error event, then response.failed */
        unsigned http;
        const char *type, *code;
        status_http(ch->status, &http, &type, &code);
        const char *msg = ch->message && ch->message[0] ? ch->message : loom_status_str(ch->status);
        cJSON *e = ev_new(q, "error");
        cJSON_AddStringToObject(e, "code", code ? code : type);
        cJSON_AddStringToObject(e, "message", msg);
        cJSON_AddNullToObject(e, "param");
        ev_send(q, e);
        cJSON *err = cJSON_CreateObject();
        cJSON_AddStringToObject(err, "code", code ? code : "server_error");
        cJSON_AddStringToObject(err, "message", msg);
        cJSON *out = r->output;
        r->output = NULL;
        ev_response(q, "response.failed", resp_object(q, "failed", out, NULL, NULL, err));
        LOOM_WARN("http: %s %s: response %s failed: %s", q->method, q->path, r->id, msg);
        return;
    }
    if (q->tools.mode != LOOM_TOOLS_OFF && q->ts) loom_tstream_finish(q->ts, ch->finish == LOOM_FINISH_STOP);
    if (r->open == ITEM_NONE && !r->output) open_message(q); /* an empty answer is an empty message */
    if (r->open == ITEM_REASONING) open_message(q); /* all reasoning: the message is empty, as unstreamed */
    close_item(q);
    int cut = ch->finish == LOOM_FINISH_LENGTH;
    cJSON *out = r->output;
    r->output = NULL;
    cJSON *o = resp_object(q, cut ? "incomplete" : "completed", out, resp_usage(r, ch), cut ? "max_output_tokens" : NULL,
                           NULL);
    keep_response(q, o);
    ev_response(q, cut ? "response.incomplete" : "response.completed", o);
}

/* ---- not streamed ---- */

/* The answer's log probabilities collected unstreamed (NULL: none): the
 * chat's logprobs.content less the reasoning chunks' tokens, which come
 * first. */
static cJSON *answer_logprobs(req_t *q) {
    if (!q->logprobs || q->tools.mode != LOOM_TOOLS_OFF) return NULL;
    cJSON *entries = q->lp_acc ? cJSON_DetachItemFromObjectCaseSensitive(q->lp_acc, "content") : NULL;
    if (!entries) return NULL;
    for (long long i = 0; i < q->resp->reasoning_tokens && entries->child; i++)
        cJSON_Delete(cJSON_DetachItemFromArray(entries, 0));
    return entries;
}

enum MHD_Result resp_finish(req_t *q, const loom_chunk_t *ch) {
    resp_ctx_t *r = q->resp;
    char *t = text_dup(q->text.p ? q->text.p : "", q->text.len);
    cJSON *output = cJSON_CreateArray();
    char *reasoning = NULL;
    reasoning_split(q, &t, &reasoning);
    size_t len = strlen(t);
    if (reasoning) {
        char id[80];
        fresh_id(q->h, "rs_", id, sizeof id);
        cJSON_AddItemToArray(output, reasoning_item(id, NULL, reasoning));
        free(reasoning);
    }
    const char *content = t, *finish = finish_name(ch->finish);
    char *rest = NULL;
    cJSON *calls = tool_calls_of(q, content, len, ch, &rest, &finish);
    if (calls) content = rest;
    if (!calls || (content && content[0])) {
        char id[80];
        fresh_id(q->h, "msg_", id, sizeof id);
        cJSON_AddItemToArray(output, message_item(id, "completed", content ? content : "", answer_logprobs(q)));
        if (content) loom_sbuf_str(&r->content, content);
    }
    const cJSON *c;
    cJSON_ArrayForEach(c, calls) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
        const char *call_id = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(c, "id"));
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(fn, "name"));
        const char *args = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(fn, "arguments"));
        char id[80];
        if (!call_id) call_id = "";
        snprintf(id, sizeof id, "fc_%s", !strncmp(call_id, "call_", 5) ? call_id + 5 : call_id);
        cJSON_AddItemToArray(output, call_item(id, "completed", call_id, name ? name : "", args ? args : ""));
        keep_call(r, call_id, name ? name : "", args ? args : "");
    }
    cJSON_Delete(calls);
    free(rest);
    free(t);
    take_timings(q, ch);
    int cut = ch->finish == LOOM_FINISH_LENGTH;
    cJSON *o = resp_object(q, cut ? "incomplete" : "completed", output, resp_usage(r, ch),
                           cut ? "max_output_tokens" : NULL, NULL);
    keep_response(q, o);
    return respond_json(q, MHD_HTTP_OK, o);
}

/* ---- the request: Responses fields -> a chat-completions body ---- */

/* A content of text parts ("input_text", "output_text", "text") joined
 * with newlines, or a string. NULL (e set) otherwise. */
static char *content_text(const cJSON *c, const char *what, perr_t *e) {
    if (cJSON_IsString(c)) return loom_xstrdup(c->valuestring);
    if (!cJSON_IsArray(c)) {
        bad(e, "input", "%s must be a string or an array of input_text parts", what);
        return NULL;
    }
    loom_sbuf_t s = {0};
    loom_sbuf_add(&s, "", 0);
    const cJSON *p;
    int k = 0;
    cJSON_ArrayForEach(p, c) {
        const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(p, "type"));
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(p, "text");
        if (!type || (strcmp(type, "input_text") && strcmp(type, "output_text") && strcmp(type, "text")) ||
            !cJSON_IsString(text)) {
            free(s.p);
            bad(e, "input", "%s[%d]: only input_text and output_text parts are supported (got %s)", what, k,
                type ? type : "no type");
            return NULL;
        }
        if (k++) loom_sbuf_str(&s, "\n");
        loom_sbuf_str(&s, text->valuestring);
    }
    return s.p;
}

/* The last message of msgs when it is the assistant's (function calls join it). */
static cJSON *last_assistant(cJSON *msgs) {
    int n = cJSON_GetArraySize(msgs);
    cJSON *m = n ? cJSON_GetArrayItem(msgs, n - 1) : NULL;
    const char *role = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(m, "role"));
    return role && !strcmp(role, "assistant") ? m : NULL;
}

/* input (a string, or an array of message / function_call /
 * function_call_output / reasoning items) appended to msgs as chat
 * messages. */
static int input_messages(const cJSON *input, cJSON *msgs, perr_t *e) {
    if (!input) return bad(e, "input", "input is required");
    if (cJSON_IsString(input)) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", input->valuestring);
        cJSON_AddItemToArray(msgs, m);
        return 0;
    }
    if (!cJSON_IsArray(input) || !input->child)
        return bad(e, "input", "input must be a string or a non-empty array of input items");
    const cJSON *it;
    int i = 0;
    cJSON_ArrayForEach(it, input) {
        char what[48];
        snprintf(what, sizeof what, "input[%d]", i);
        if (!cJSON_IsObject(it)) return bad(e, "input", "%s must be an object", what);
        const cJSON *tj = cJSON_GetObjectItemCaseSensitive(it, "type");
        if (tj && !cJSON_IsString(tj)) return bad(e, "input", "%s.type must be a string", what);
        const char *type = tj ? tj->valuestring : "message";
        if (!strcmp(type, "message")) {
            const char *role = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(it, "role"));
            if (!role || (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system") &&
                          strcmp(role, "developer")))
                return bad(e, "input", "%s.role must be user, assistant, system or developer", what);
            char cw[64];
            snprintf(cw, sizeof cw, "%s.content", what);
            char *text = content_text(cJSON_GetObjectItemCaseSensitive(it, "content"), cw, e);
            if (!text) return -1;
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", !strcmp(role, "developer") ? "system" : role);
            cJSON_AddStringToObject(m, "content", text);
            free(text);
            cJSON_AddItemToArray(msgs, m);
        } else if (!strcmp(type, "function_call")) {
            const char *call_id = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(it, "call_id"));
            const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(it, "name"));
            const char *args = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(it, "arguments"));
            if (!call_id || !name || !args)
                return bad(e, "input", "%s (a function_call) needs string call_id, name and arguments", what);
            cJSON *m = last_assistant(msgs);
            if (!m) {
                m = cJSON_CreateObject();
                cJSON_AddStringToObject(m, "role", "assistant");
                cJSON_AddItemToArray(msgs, m);
            }
            cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
            if (!calls) calls = cJSON_AddArrayToObject(m, "tool_calls");
            cJSON *c = cJSON_CreateObject();
            cJSON_AddStringToObject(c, "id", call_id);
            cJSON_AddStringToObject(c, "type", "function");
            cJSON *fn = cJSON_AddObjectToObject(c, "function");
            cJSON_AddStringToObject(fn, "name", name);
            cJSON_AddStringToObject(fn, "arguments", args);
            cJSON_AddItemToArray(calls, c);
        } else if (!strcmp(type, "function_call_output")) {
            const char *call_id = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(it, "call_id"));
            if (!call_id) return bad(e, "input", "%s (a function_call_output) needs a string call_id", what);
            char cw[64];
            snprintf(cw, sizeof cw, "%s.output", what);
            char *out = content_text(cJSON_GetObjectItemCaseSensitive(it, "output"), cw, e);
            if (!out) return -1;
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "tool");
            cJSON_AddStringToObject(m, "tool_call_id", call_id);
            cJSON_AddStringToObject(m, "content", out);
            free(out);
            cJSON_AddItemToArray(msgs, m);
        } else if (strcmp(type, "reasoning") != 0) { /* reasoning items are not sent back to the model */
            return bad(e, "input", "%s: items of type '%.64s' are not supported (message, function_call, "
                                   "function_call_output and reasoning are)",
                       what, type);
        }
        i++;
    }
    return 0;
}

/* tools: function tools {type, name, description, parameters, strict} as
 * the chat's {type, function: {...}}. */
static int map_tools(const cJSON *x, cJSON *chat, perr_t *e) {
    if (!cJSON_IsArray(x)) return bad(e, "tools", "tools must be an array");
    cJSON *out = cJSON_AddArrayToObject(chat, "tools");
    const cJSON *t;
    int i = 0;
    cJSON_ArrayForEach(t, x) {
        const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(t, "type"));
        if (!cJSON_IsObject(t) || !type) return bad(e, "tools", "tools[%d] must be an object with a string type", i);
        if (strcmp(type, "function") != 0)
            return bad(e, "tools",
                       "tools[%d]: tools of type '%.64s' are not supported; this server runs function tools", i,
                       type);
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(t, "name");
        if (!cJSON_IsString(name)) return bad(e, "tools", "tools[%d] (a function) needs a string name", i);
        cJSON *c = cJSON_CreateObject(), *fn = cJSON_CreateObject();
        cJSON_AddStringToObject(c, "type", "function");
        const char *keys[] = {"name", "description", "parameters", "strict"};
        for (size_t k = 0; k < LOOM_ARRAY_LEN(keys); k++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(t, keys[k]);
            if (v && !cJSON_IsNull(v)) cJSON_AddItemToObject(fn, keys[k], cJSON_Duplicate(v, 1));
        }
        cJSON_AddItemToObject(c, "function", fn);
        cJSON_AddItemToArray(out, c);
        i++;
    }
    return 0;
}

/* tool_choice: "auto", "none", "required" or {type: function, name}. */
static int map_tool_choice(const cJSON *x, cJSON *chat, perr_t *e) {
    if (cJSON_IsString(x)) {
        if (strcmp(x->valuestring, "auto") && strcmp(x->valuestring, "none") && strcmp(x->valuestring, "required"))
            return bad(e, "tool_choice", "tool_choice must be auto, none, required or {type: function, name}");
        cJSON_AddStringToObject(chat, "tool_choice", x->valuestring);
        return 0;
    }
    const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(x, "type"));
    const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(x, "name"));
    if (!cJSON_IsObject(x) || !type || strcmp(type, "function") || !name)
        return bad(e, "tool_choice", "tool_choice must be auto, none, required or {type: function, name}");
    cJSON *c = cJSON_AddObjectToObject(chat, "tool_choice");
    cJSON_AddStringToObject(c, "type", "function");
    cJSON_AddStringToObject(cJSON_AddObjectToObject(c, "function"), "name", name);
    return 0;
}

/* text.format: text, json_object or {type: json_schema, name, schema,
 * strict} as the chat's response_format. */
static int map_text(const cJSON *x, cJSON *chat, perr_t *e) {
    if (!cJSON_IsObject(x)) return bad(e, "text", "text must be an object");
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(x, "format");
    if (!f || cJSON_IsNull(f)) return 0;
    const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(f, "type"));
    if (!cJSON_IsObject(f) || !type) return bad(e, "text.format", "text.format must be an object with a string type");
    if (!strcmp(type, "text")) return 0;
    cJSON *rf = cJSON_AddObjectToObject(chat, "response_format");
    if (!strcmp(type, "json_object")) {
        cJSON_AddStringToObject(rf, "type", "json_object");
        return 0;
    }
    if (strcmp(type, "json_schema") != 0)
        return bad(e, "text.format", "text.format.type must be text, json_object or json_schema");
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(f, "schema");
    if (!cJSON_IsObject(schema)) return bad(e, "text.format", "text.format (json_schema) needs a schema object");
    cJSON_AddStringToObject(rf, "type", "json_schema");
    cJSON *js = cJSON_AddObjectToObject(rf, "json_schema");
    const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(f, "name"));
    cJSON_AddStringToObject(js, "name", name ? name : "response");
    cJSON_AddItemToObject(js, "schema", cJSON_Duplicate(schema, 1));
    const cJSON *strict = cJSON_GetObjectItemCaseSensitive(f, "strict");
    if (cJSON_IsBool(strict)) cJSON_AddBoolToObject(js, "strict", cJSON_IsTrue(strict));
    return 0;
}

/* include (an array of strings; "message.output_text.logprobs" asks for
 * the output's log probabilities) and top_logprobs (0 to 20) as the chat's
 * logprobs and top_logprobs. */
static int map_logprobs(const cJSON *o, cJSON *chat, perr_t *e) {
    const cJSON *inc = field(o, "include"), *top = field(o, "top_logprobs"), *x;
    int want = 0;
    if (inc) {
        if (!cJSON_IsArray(inc)) return bad(e, "include", "include must be an array of strings");
        cJSON_ArrayForEach(x, inc) {
            if (!cJSON_IsString(x)) return bad(e, "include", "include must be an array of strings");
            want |= !strcmp(x->valuestring, "message.output_text.logprobs");
        }
    }
    if (top && (!cJSON_IsNumber(top) || top->valuedouble < 0 || top->valuedouble > MAX_TOP_LOGPROBS ||
                top->valuedouble != (double)(int)top->valuedouble))
        return bad(e, "top_logprobs", "top_logprobs must be an integer from 0 to %d", MAX_TOP_LOGPROBS);
    if (!want) return 0;
    cJSON_AddTrueToObject(chat, "logprobs");
    if (top) cJSON_AddNumberToObject(chat, "top_logprobs", top->valuedouble);
    return 0;
}

/* Sampling and other chat fields a Responses request may carry as they are. */
static const char *const k_pass[] = {"model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                     "frequency_penalty", "repetition_penalty", "stop", "logit_bias", "user",
                                     "metadata", "parallel_tool_calls", "service_tier", "priority", "ignore_eos",
                                     "min_tokens", "stop_token_ids", "bad_words", "allowed_token_ids",
                                     "skip_special_tokens", "speculative", "loom_cache"};
/* Echoed in the response object. */
static const char *const k_echo[] = {"instructions", "max_output_tokens", "parallel_tool_calls",
                                     "previous_response_id", "reasoning", "temperature", "text", "tool_choice",
                                     "tools", "top_logprobs", "top_p", "truncation", "user", "metadata"};
/* Accepted and without effect here. */
static const char *const k_accepted[] = {"include", "truncation", "store", "stream", "stream_options", "reasoning",
                                         "top_logprobs", "max_tool_calls", "prompt_cache_key", "safety_identifier",
                                         "instructions", "input", "tools", "tool_choice", "text",
                                         "max_output_tokens", "previous_response_id"};

static int in_list(const char *const *l, size_t n, const char *k) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(l[i], k)) return 1;
    return 0;
}

/* The chat body for a Responses request (NULL with e set, *status the HTTP
 * status: 400, or 404 for an unknown previous_response_id). */
static cJSON *chat_body(req_t *q, const cJSON *o, unsigned *status, perr_t *e) {
    resp_ctx_t *r = q->resp;
    *status = 400;
    cJSON *chat = cJSON_CreateObject(), *msgs = cJSON_CreateArray(), *convo = cJSON_CreateArray();
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        if (in_list(k_pass, LOOM_ARRAY_LEN(k_pass), x->string)) {
            if (!cJSON_IsNull(x)) cJSON_AddItemToObject(chat, x->string, cJSON_Duplicate(x, 1));
        } else if (!strcmp(x->string, "background") || !strcmp(x->string, "prompt") ||
                   !strcmp(x->string, "conversation")) {
            if (!cJSON_IsNull(x) && !cJSON_IsFalse(x)) {
                bad(e, x->string, "%s is not supported by this server", x->string);
                goto fail;
            }
        } else if (!in_list(k_accepted, LOOM_ARRAY_LEN(k_accepted), x->string)) {
            ignore_field(q, x->string);
        }
        if (in_list(k_echo, LOOM_ARRAY_LEN(k_echo), x->string))
            cJSON_AddItemToObject(r->echo, x->string, cJSON_Duplicate(x, 1));
    }
    if ((x = field(o, "stream")) && !cJSON_IsBool(x)) {
        bad(e, "stream", "stream must be a boolean");
        goto fail;
    }
    cJSON_AddBoolToObject(chat, "stream", cJSON_IsTrue(x));
    r->store = 1;
    if ((x = field(o, "store"))) {
        if (!cJSON_IsBool(x)) {
            bad(e, "store", "store must be a boolean");
            goto fail;
        }
        r->store = cJSON_IsTrue(x);
    }
    if ((x = field(o, "reasoning"))) {
        const cJSON *eff = cJSON_IsObject(x) ? field(x, "effort") : NULL;
        if (!cJSON_IsObject(x) || (eff && !cJSON_IsString(eff))) {
            bad(e, "reasoning", "reasoning must be an object {effort, summary}");
            goto fail;
        }
    }
    if ((x = field(o, "truncation")) &&
        (!cJSON_IsString(x) || (strcmp(x->valuestring, "disabled") && strcmp(x->valuestring, "auto")))) {
        bad(e, "truncation", "truncation must be disabled or auto");
        goto fail;
    }
    if ((x = field(o, "instructions"))) {
        if (!cJSON_IsString(x)) {
            bad(e, "instructions", "instructions must be a string");
            goto fail;
        }
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "system");
        cJSON_AddStringToObject(m, "content", x->valuestring);
        cJSON_AddItemToArray(msgs, m);
    }
    if ((x = field(o, "previous_response_id"))) {
        char *prev = NULL;
        if (!cJSON_IsString(x)) {
            bad(e, "previous_response_id", "previous_response_id must be a string");
            goto fail;
        }
        if (!q->h->rstore || !store_get(q->h->rstore, x->valuestring, NULL, &prev)) {
            *status = 404;
            bad(e, "previous_response_id", "Previous response with id '%.100s' not found.", x->valuestring);
            goto fail;
        }
        cJSON *pm = cJSON_Parse(prev);
        free(prev);
        cJSON *m;
        while (pm && (m = cJSON_DetachItemFromArray(pm, 0))) cJSON_AddItemToArray(convo, m);
        cJSON_Delete(pm);
    }
    if (input_messages(field(o, "input"), convo, e) < 0) goto fail;
    cJSON_ArrayForEach(x, convo) cJSON_AddItemToArray(msgs, cJSON_Duplicate(x, 1));
    cJSON_AddItemToObject(chat, "messages", msgs);
    msgs = NULL;
    r->convo = convo;
    convo = NULL;
    if ((x = field(o, "tools")) && map_tools(x, chat, e) < 0) goto fail;
    if ((x = field(o, "tool_choice")) && map_tool_choice(x, chat, e) < 0) goto fail;
    if ((x = field(o, "text")) && map_text(x, chat, e) < 0) goto fail;
    if (map_logprobs(o, chat, e) < 0) goto fail;
    if ((x = field(o, "max_output_tokens"))) {
        if (!cJSON_IsNumber(x) || x->valuedouble < 1 || x->valuedouble != (double)(long long)x->valuedouble) {
            bad(e, "max_output_tokens", "max_output_tokens must be a positive integer");
            goto fail;
        }
        cJSON_AddNumberToObject(chat, "max_completion_tokens", x->valuedouble);
    }
    return chat;
fail:
    cJSON_Delete(chat);
    cJSON_Delete(msgs);
    cJSON_Delete(convo);
    return NULL;
}

enum MHD_Result handle_responses(req_t *q) {
    char msg[600];
    cJSON *root = loom_http_parse_json_body(q->body.p, q->body.len, msg, sizeof msg);
    if (!root) return respond_error(q, 400, "invalid_request_error", NULL, NULL, "%s", msg);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return respond_error(q, 400, "invalid_request_error", NULL, NULL, "the body must be a JSON object");
    }
    resp_ctx_t *r = loom_xcalloc(1, sizeof *r);
    q->resp = r;
    r->echo = cJSON_CreateObject();
    r->created_at = (long long)time(NULL);
    fresh_id(q->h, "resp_", r->id, sizeof r->id);
    perr_t e = {0};
    unsigned status;
    cJSON *chat = chat_body(q, root, &status, &e);
    cJSON_Delete(root);
    if (!chat)
        return respond_error(q, status, "invalid_request_error", e.param[0] ? e.param : NULL,
                             status == 404 ? "previous_response_not_found" : NULL, "%s", e.msg);
    char *body = cJSON_PrintUnformatted(chat);
    cJSON_Delete(chat);
    if (!body) return respond_error(q, 500, "server_error", NULL, "internal_error", "cannot build the request");
    free(q->body.p);
    q->body = (loom_sbuf_t){0};
    loom_sbuf_str(&q->body, body);
    free(body);
    return handle_generate(q);
}

/* GET /v1/responses/{id}: the stored response; DELETE: forgets it. */
enum MHD_Result handle_response(req_t *q, const char *id) {
    char *response = NULL;
    if (!strcmp(q->method, "DELETE")) {
        if (!q->h->rstore || !store_delete(q->h->rstore, id))
            return respond_error(q, 404, "invalid_request_error", NULL, "not_found",
                                 "Response with id '%.100s' not found.", id);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "id", id);
        cJSON_AddStringToObject(o, "object", "response");
        cJSON_AddTrueToObject(o, "deleted");
        return respond_json(q, MHD_HTTP_OK, o);
    }
    if (!q->h->rstore || !store_get(q->h->rstore, id, &response, NULL))
        return respond_error(q, 404, "invalid_request_error", NULL, "not_found", "Response with id '%.100s' not found.",
                             id);
    return respond(q, MHD_HTTP_OK, "application/json", response, strlen(response));
}
