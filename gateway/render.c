/* The gateway's response rendering (gateway_impl.h): loom.v1 chunks into
 * OpenAI JSON bodies and SSE events (choices, logprobs, usage, timings,
 * tool calls). */
#include "gateway/gateway_impl.h"

/* ---- response bodies ---- */

/* The completion id: the request id after OpenAI's prefix. */
void new_id(req_t *q) {
    snprintf(q->id, sizeof q->id, "%s-%.*s", q->chat ? "chatcmpl" : "cmpl", (int)(sizeof q->id - 10), q->xid);
}

/* The client's X-Request-Id when it is 1..MAX_REQUEST_ID printable ASCII
 * characters; otherwise a fresh one (24 hex digits). */
void take_request_id(req_t *q) {
    const char *x = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, "X-Request-Id");
    size_t n = 0;
    if (x) {
        while (x[n] && n <= MAX_REQUEST_ID && x[n] >= 0x20 && x[n] <= 0x7e) n++;
        if (n > 0 && n <= MAX_REQUEST_ID && !x[n]) {
            memcpy(q->xid, x, n + 1);
            return;
        }
    }
    uint64_t k = atomic_fetch_add(&q->h->n_ids, 1);
    uint64_t a = mix64(q->h->id_salt + k), b = mix64(a ^ 0x5bd1e995u);
    snprintf(q->xid, sizeof q->xid, "%016llx%08llx", (unsigned long long)a, (unsigned long long)(b >> 32));
}

const char *finish_name(loom_finish_t f) {
    return f == LOOM_FINISH_LENGTH ? "length" : "stop";
}

cJSON *usage_obj(const loom_chunk_t *ch) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", ch->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", ch->completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)ch->prompt_tokens + ch->completion_tokens);
    cJSON *d = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "cached_tokens", ch->cached_tokens);
    cJSON_AddItemToObject(u, "prompt_tokens_details", d);
    return u;
}

/* The coordinator's timings plus the gateway's own send time (ms). */
static cJSON *timings_obj(const req_t *q) {
    const loom_timings_t *t = &q->timings;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "queue_ms", t->queue_ms);
    double gw_tok_ms = (double)q->tok_ns * 1e-6; /* before the coordinator saw the request */
    cJSON_AddNumberToObject(o, "tokenize_ms", t->tokenize_ms); /* holds the gateway's (gateway_tokenize_ns) */
    cJSON_AddNumberToObject(o, "prefill_ms", t->prefill_ms);
    cJSON_AddNumberToObject(o, "decode_ms", t->decode_ms);
    cJSON_AddNumberToObject(o, "detokenize_ms", t->detokenize_ms);
    cJSON_AddNumberToObject(o, "send_ms", t->send_ms + (double)q->send_ns * 1e-6);
    cJSON_AddNumberToObject(o, "ttft_ms", t->ttft_ms + gw_tok_ms);
    cJSON_AddNumberToObject(o, "total_ms", t->total_ms + gw_tok_ms);
    return o;
}

void take_timings(req_t *q, const loom_chunk_t *ch) {
    if (!ch->has_timings) return;
    q->timings = ch->timings;
    q->has_timings = 1;
}

cJSON *head_obj(const req_t *q, const char *object) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", q->id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)q->created);
    cJSON_AddStringToObject(o, "model", q->model);
    return o;
}

static void sse_event(req_t *q, cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    loom_sbuf_str(&q->out, "data: ");
    if (s) loom_sbuf_str(&q->out, s);
    loom_sbuf_str(&q->out, "\n\n");
    free(s);
}

/* Appends s as a JSON string literal (NUL bytes dropped). */
static void sb_json_str(loom_sbuf_t *b, const char *s, size_t n) {
    loom_sbuf_add(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        loom_sbuf_add(b, s + run, i - run);
        run = i + 1;
        char esc[8];
        if (c == '"' || c == '\\') snprintf(esc, sizeof esc, "\\%c", c);
        else if (c == '\n') snprintf(esc, sizeof esc, "\\n");
        else if (c == '\t') snprintf(esc, sizeof esc, "\\t");
        else if (c == '\r') snprintf(esc, sizeof esc, "\\r");
        else if (c) snprintf(esc, sizeof esc, "\\u%04x", c);
        else esc[0] = '\0';
        loom_sbuf_str(b, esc);
    }
    loom_sbuf_add(b, s + run, n - run);
    loom_sbuf_add(b, "\"", 1);
}

/* One streamed chunk: text (or a chat delta), with finish_reason in the
 * last one. Written by hand, not through cJSON: this runs once per token,
 * and the part before the choice is the same for the whole stream. */
void sse_choice(req_t *q, const char *text, size_t len, int role, const char *finish) {
    if (!q->prefix.len) {
        cJSON *o = head_obj(q, q->chat ? "chat.completion.chunk" : "text_completion");
        char *head = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (!head) return;
        loom_sbuf_str(&q->prefix, "data: ");
        loom_sbuf_add(&q->prefix, head, strlen(head) - 1); /* without the closing brace */
        loom_sbuf_str(&q->prefix, ",\"choices\":[{\"index\":");
        free(head);
    }
    loom_sbuf_t *b = &q->out;
    loom_sbuf_add(b, q->prefix.p, q->prefix.len);
    loom_sbuf_printf(b, "%d,", q->choice);
    if (q->chat) {
        loom_sbuf_str(b, "\"delta\":{");
        if (role) loom_sbuf_str(b, text ? "\"role\":\"assistant\"," : "\"role\":\"assistant\"");
        if (text) {
            loom_sbuf_str(b, "\"content\":");
            sb_json_str(b, text, len);
        }
        loom_sbuf_str(b, "}");
    } else {
        loom_sbuf_str(b, "\"text\":");
        sb_json_str(b, text ? text : "", text ? len : 0);
    }
    loom_sbuf_str(b, ",\"logprobs\":");
    loom_sbuf_str(b, q->lp_json ? q->lp_json : "null");
    loom_sbuf_str(b, ",\"finish_reason\":");
    if (finish) {
        loom_sbuf_str(b, "\"");
        loom_sbuf_str(b, finish);
        loom_sbuf_str(b, "\"}]");
        if (q->has_timings) { /* Loom's extension: where the request's time went */
            cJSON *tj = timings_obj(q);
            char *t = cJSON_PrintUnformatted(tj);
            cJSON_Delete(tj);
            if (t) {
                loom_sbuf_str(b, ",\"timings\":");
                loom_sbuf_str(b, t);
                free(t);
            }
        }
    } else {
        loom_sbuf_str(b, "null}]");
    }
    loom_sbuf_str(b, q->include_usage ? ",\"usage\":null}\n\n" : "}\n\n");
}

/* A token's text as it continues the output (a SentencePiece space kept),
 * NUL bytes left out (JSON strings here cannot hold them). */
static char *token_text(const req_t *q, int32_t id) {
    if (!q->h->tok) return loom_xstrdup("");
    char buf[1024];
    loom_detok_t d;
    loom_detok_init(&d, q->h->tok, 0, 0);
    size_t n = loom_detok_push(&d, id, buf, sizeof buf);
    n += loom_detok_flush(&d, buf + n, sizeof buf - n);
    return text_dup(buf, n);
}

static double clamp_lp(float lp) {
    return lp > -9999.0f ? (double)lp : -9999.0; /* as vLLM: -inf is not JSON */
}

static cJSON *bytes_arr(const char *t) {
    cJSON *a = cJSON_CreateArray();
    for (const unsigned char *c = (const unsigned char *)t; *c; c++) cJSON_AddItemToArray(a, cJSON_CreateNumber(*c));
    return a;
}

cJSON *arr_of(cJSON *o, const char *k) {
    cJSON *a = cJSON_GetObjectItemCaseSensitive(o, k);
    return a ? a : cJSON_AddArrayToObject(o, k);
}

/* Appends the chunk's tokens to a logprobs object: completions' {tokens,
 * token_logprobs, top_logprobs, text_offset}, or chat's {content: [...]}. */
void add_logprobs(req_t *q, cJSON *lp, const loom_chunk_t *ch) {
    size_t top = 0;
    for (int i = 0; i < ch->n_ids; i++) {
        char *t = token_text(q, ch->ids[i]);
        int nt = (int)LOOM_MIN(ch->n_top[i], (uint32_t)q->top_logprobs);
        if (q->chat) {
            cJSON *it = cJSON_CreateObject();
            cJSON_AddStringToObject(it, "token", t);
            cJSON_AddNumberToObject(it, "logprob", clamp_lp(ch->logprobs[i]));
            cJSON_AddItemToObject(it, "bytes", bytes_arr(t));
            cJSON *tl = cJSON_AddArrayToObject(it, "top_logprobs");
            for (int j = 0; j < nt; j++) {
                char *tt = token_text(q, ch->top_ids[top + (size_t)j]);
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "token", tt);
                cJSON_AddNumberToObject(e, "logprob", clamp_lp(ch->top_logprobs[top + (size_t)j]));
                cJSON_AddItemToObject(e, "bytes", bytes_arr(tt));
                cJSON_AddItemToArray(tl, e);
                free(tt);
            }
            cJSON_AddItemToArray(arr_of(lp, "content"), it);
        } else {
            cJSON_AddItemToArray(arr_of(lp, "tokens"), cJSON_CreateString(t));
            cJSON_AddItemToArray(arr_of(lp, "token_logprobs"), cJSON_CreateNumber(clamp_lp(ch->logprobs[i])));
            cJSON *d = cJSON_CreateObject();
            for (int j = 0; j < nt; j++) {
                char *tt = token_text(q, ch->top_ids[top + (size_t)j]);
                if (!cJSON_GetObjectItemCaseSensitive(d, tt)) /* two ids may read alike: the likelier stays */
                    cJSON_AddNumberToObject(d, tt, clamp_lp(ch->top_logprobs[top + (size_t)j]));
                free(tt);
            }
            cJSON_AddItemToArray(arr_of(lp, "top_logprobs"), d);
            cJSON_AddItemToArray(arr_of(lp, "text_offset"), cJSON_CreateNumber((double)q->lp_offset));
            q->lp_offset += strlen(t);
        }
        top += ch->n_top[i];
        free(t);
    }
}

/* vLLM's prompt_logprobs from the chunk that carries them: null for the
 * first prompt token, then per token {"id": {logprob, rank, decoded_token}},
 * the prompt's token first, then the q->prompt_lp most likely. */
cJSON *prompt_lp_json(const req_t *q, const loom_chunk_t *ch) {
    cJSON *a = cJSON_CreateArray();
    if (ch->n_prompt_ids > 0) cJSON_AddItemToArray(a, cJSON_CreateNull());
    size_t top = 0;
    for (int i = 1; i < ch->n_prompt_ids; i++) {
        cJSON *d = cJSON_CreateObject();
        char key[16];
        int32_t id = ch->prompt_ids[i];
        char *t = token_text(q, id);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "logprob", clamp_lp(ch->prompt_logprobs[i - 1]));
        cJSON_AddNumberToObject(e, "rank", ch->prompt_ranks[i - 1]);
        cJSON_AddStringToObject(e, "decoded_token", t);
        free(t);
        snprintf(key, sizeof key, "%d", (int)id);
        cJSON_AddItemToObject(d, key, e);
        int nt = (int)LOOM_MIN(ch->prompt_n_top[i - 1], (uint32_t)LOOM_MAX(q->prompt_lp, 0));
        for (int j = 0; j < nt; j++) {
            int32_t tid = ch->prompt_top_ids[top + (size_t)j];
            if (tid == id) continue; /* already there, with its rank */
            snprintf(key, sizeof key, "%d", (int)tid);
            char *tt = token_text(q, tid);
            cJSON *te = cJSON_CreateObject();
            cJSON_AddNumberToObject(te, "logprob", clamp_lp(ch->prompt_top_logprobs[top + (size_t)j]));
            cJSON_AddNumberToObject(te, "rank", j + 1);
            cJSON_AddStringToObject(te, "decoded_token", tt);
            free(tt);
            cJSON_AddItemToObject(d, key, te);
        }
        top += ch->prompt_n_top[i - 1];
        cJSON_AddItemToArray(a, d);
    }
    return a;
}

/* echo with logprobs (completions): the prompt's tokens open the logprobs
 * object as OpenAI's legacy API has them, the first with null logprob and
 * top_logprobs; text_offset counts from 0 over the prompt's tokens, and the
 * generated tokens' go on from echo_len, the echoed text's length (as vLLM). */
void add_echo_logprobs(req_t *q, cJSON *lp, const loom_chunk_t *ch, size_t echo_len) {
    size_t top = 0, off = 0;
    for (int i = 0; i < ch->n_prompt_ids; i++) {
        char *t = token_text(q, ch->prompt_ids[i]);
        cJSON_AddItemToArray(arr_of(lp, "tokens"), cJSON_CreateString(t));
        cJSON_AddItemToArray(arr_of(lp, "text_offset"), cJSON_CreateNumber((double)off));
        off += strlen(t);
        free(t);
        if (i == 0) {
            cJSON_AddItemToArray(arr_of(lp, "token_logprobs"), cJSON_CreateNull());
            cJSON_AddItemToArray(arr_of(lp, "top_logprobs"), cJSON_CreateNull());
            continue;
        }
        cJSON_AddItemToArray(arr_of(lp, "token_logprobs"), cJSON_CreateNumber(clamp_lp(ch->prompt_logprobs[i - 1])));
        cJSON *d = cJSON_CreateObject();
        int nt = (int)LOOM_MIN(ch->prompt_n_top[i - 1], (uint32_t)q->top_logprobs);
        for (int j = 0; j < nt; j++) {
            char *tt = token_text(q, ch->prompt_top_ids[top + (size_t)j]);
            if (!cJSON_GetObjectItemCaseSensitive(d, tt))
                cJSON_AddNumberToObject(d, tt, clamp_lp(ch->prompt_top_logprobs[top + (size_t)j]));
            free(tt);
        }
        top += ch->prompt_n_top[i - 1];
        cJSON_AddItemToArray(arr_of(lp, "top_logprobs"), d);
    }
    q->lp_offset = echo_len;
}

/* The request's tools outlive its JSON body: copied for parsing the output. */
void keep_tools(req_t *q, gen_t *g) {
    if (g->tools.mode == LOOM_TOOLS_OFF) return;
    q->tools = g->tools;
    memset(&g->tools, 0, sizeof g->tools);
    q->tools_req = cJSON_Duplicate(q->tools.tools, 1);
    q->tools.tools = q->tools_req;
    if (q->tools.named) { /* the same name, inside the copy */
        const cJSON *t;
        cJSON_ArrayForEach(t, q->tools_req) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
            if (cJSON_IsString(nm) && !strcmp(nm->valuestring, q->tools.named)) q->tools.named = nm->valuestring;
        }
    }
}

/* The seed of this completion's call ids (FNV-1a of its id): the same
 * streamed or not. */
unsigned long long call_seed(const req_t *q) {
    unsigned long long seed = 1469598103934665603ull;
    for (const char *p = q->id; *p; p++) seed = (seed ^ (unsigned char)*p) * 1099511628211ull;
    return seed;
}

/* The OpenAI tool_calls of a finished chat answer (NULL: none, the text is
 * the content). A forced call (required, named) that the budget cut short
 * stays text with finish length; auto and required finish as "tool_calls",
 * a named function as "stop" (as OpenAI). */
cJSON *tool_calls_of(req_t *q, const char *text, size_t len, const loom_chunk_t *ch, char **rest,
                     const char **finish) {
    *rest = NULL;
    if (q->tools.mode == LOOM_TOOLS_OFF || ch->finish != LOOM_FINISH_STOP) return NULL;
    cJSON *calls = loom_tools_parse_output(&q->tools, text, len, call_seed(q), rest);
    if (calls) *finish = q->tools.mode == LOOM_TOOLS_NAMED ? "stop" : "tool_calls";
    return calls;
}

/* An event of a streamed tool-calling answer (tool_stream.h) as OpenAI
 * streams it: content as a content delta; a call's start as
 * {index, id, type, function: {name, arguments: ""}}, then its arguments
 * piece by piece as {index, function: {arguments}}. */
static void tool_event(void *ctx, const loom_tse_t *e) {
    req_t *q = ctx;
    if (e->kind == LOOM_TSE_CONTENT) {
        sse_choice(q, e->text, e->len, 0, NULL);
        return;
    }
    cJSON *o = head_obj(q, "chat.completion.chunk"), *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *choice = cJSON_CreateObject(), *delta = cJSON_AddObjectToObject(choice, "delta");
    cJSON_AddNumberToObject(choice, "index", 0);
    cJSON *call = cJSON_CreateObject();
    cJSON_AddNumberToObject(call, "index", e->index);
    if (e->kind == LOOM_TSE_CALL) {
        char id[48];
        loom_tools_call_id(call_seed(q), e->index, id, sizeof id);
        cJSON_AddStringToObject(call, "id", id);
        cJSON_AddStringToObject(call, "type", "function");
    }
    cJSON *fn = cJSON_AddObjectToObject(call, "function");
    if (e->kind == LOOM_TSE_CALL) {
        cJSON_AddStringToObject(fn, "name", e->name);
        cJSON_AddStringToObject(fn, "arguments", "");
    } else {
        char *piece = text_dup(e->text, e->len);
        cJSON_AddStringToObject(fn, "arguments", piece);
        free(piece);
    }
    cJSON_AddItemToArray(cJSON_AddArrayToObject(delta, "tool_calls"), call);
    cJSON_AddNullToObject(choice, "logprobs");
    cJSON_AddNullToObject(choice, "finish_reason");
    cJSON_AddItemToArray(choices, choice);
    if (q->include_usage) cJSON_AddNullToObject(o, "usage");
    sse_event(q, o);
}

/* A streamed tool-calling answer's text, as it comes (NULL at the end:
 * what is still held goes out, and finish becomes tool_calls or, for a
 * named function, stop when the answer was calls). */
static void stream_tool_text(req_t *q, const loom_chunk_t *ch, const char **finish) {
    if (!q->ts) q->ts = loom_tstream_create(&q->tools, tool_event, q);
    if (!finish) {
        loom_tstream_feed(q->ts, ch->text, ch->text_len);
        return;
    }
    if (loom_tstream_finish(q->ts, ch->finish == LOOM_FINISH_STOP) > 0)
        *finish = q->tools.mode == LOOM_TOOLS_NAMED ? "stop" : "tool_calls";
}

/* A streamed piece of reasoning: {"delta": {"reasoning_content": ...}}. */
static void sse_reasoning(req_t *q, const char *text, size_t len) {
    if (!len) return;
    cJSON *o = head_obj(q, "chat.completion.chunk"), *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *choice = cJSON_CreateObject(), *delta = cJSON_AddObjectToObject(choice, "delta");
    cJSON_AddNumberToObject(choice, "index", q->choice);
    char *piece = text_dup(text, len);
    cJSON_AddStringToObject(delta, "reasoning_content", piece);
    free(piece);
    cJSON_AddNullToObject(choice, "logprobs");
    cJSON_AddNullToObject(choice, "finish_reason");
    cJSON_AddItemToArray(choices, choice);
    if (q->include_usage) cJSON_AddNullToObject(o, "usage");
    sse_event(q, o);
}

/* Several choices streamed with a reasoning parser: choice q->choice's
 * text through its own splitter rs (final: what rs still holds goes out). */
void sse_split_choice(req_t *q, loom_rsplit_t *rs, const char *text, size_t len, int final) {
    loom_sbuf_t r = {0}, c = {0};
    if (len) loom_rsplit_feed(rs, text, len, &r, &c);
    if (final) loom_rsplit_finish(rs, &r, &c);
    sse_reasoning(q, r.p, r.len);
    if (c.len) sse_choice(q, c.p, c.len, 0, NULL);
    free(r.p);
    free(c.p);
}

/* The answer's text (after any reasoning): tool calls read from it, or content. */
static void stream_answer(req_t *q, const loom_chunk_t *ch, const char *text, size_t len) {
    if (q->tools.mode != LOOM_TOOLS_OFF) {
        loom_chunk_t c = *ch;
        c.text = (char *)text;
        c.text_len = len;
        stream_tool_text(q, &c, NULL);
    } else if (len || !q->rs) {
        sse_choice(q, text, len, 0, NULL);
    }
}

/* A chat chunk's text: its reasoning and its answer split (reasoning.h). */
static void stream_text(req_t *q, const loom_chunk_t *ch, int final) {
    if (!q->rs) {
        if (!final) stream_answer(q, ch, ch->text, ch->text_len);
        return;
    }
    loom_sbuf_t r = {0}, c = {0};
    if (final) loom_rsplit_finish(q->rs, &r, &c);
    else loom_rsplit_feed(q->rs, ch->text, ch->text_len, &r, &c);
    sse_reasoning(q, r.p, r.len);
    if (c.len) stream_answer(q, ch, c.p, c.len);
    free(r.p);
    free(c.p);
}

/* Turns one coordinator chunk into SSE events in q->out. */
void stream_chunk(req_t *q, const loom_chunk_t *ch) {
    if (q->resp) {
        resp_stream_chunk(q, ch);
        return;
    }
    uint64_t t0 = loom_now_ns();
    if (ch->n_ids > 0 || ch->text_len > 0) {
        /* (not with tools: content may go out a chunk or more after its tokens) */
        cJSON *lp = q->logprobs && ch->has_logprobs && q->tools.mode == LOOM_TOOLS_OFF ? cJSON_CreateObject() : NULL;
        if (lp) {
            add_logprobs(q, lp, ch);
            q->lp_json = cJSON_PrintUnformatted(lp);
            cJSON_Delete(lp);
        }
        stream_text(q, ch, 0);
        free(q->lp_json);
        q->lp_json = NULL;
    }
    q->send_ns += loom_now_ns() - t0;
    if (!ch->final) return;
    take_timings(q, ch);
    q->finished = 1;
    if (ch->status != LOOM_OK) {
        /* the stream broke after it began (a worker lost, the coordinator
         * going away): an error event, then [DONE] so every client stops reading */
        unsigned http;
        const char *type, *code;
        status_http(ch->status, &http, &type, &code);
        sse_event(q, error_obj(ch->message && ch->message[0] ? ch->message : loom_status_str(ch->status), type, NULL,
                               code));
        LOOM_WARN("http: %s %s: stream %s failed: %s", q->method, q->path, q->id, ch->message);
        loom_sbuf_str(&q->out, "data: [DONE]\n\n");
        return;
    }
    const char *finish = finish_name(ch->finish);
    stream_text(q, ch, 1);
    if (q->tools.mode != LOOM_TOOLS_OFF) stream_tool_text(q, ch, &finish);
    sse_choice(q, NULL, 0, 0, finish);
    if (q->include_usage) {
        cJSON *o = head_obj(q, q->chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddArrayToObject(o, "choices");
        cJSON_AddItemToObject(o, "usage", usage_obj(ch));
        sse_event(q, o);
    }
    loom_sbuf_str(&q->out, "data: [DONE]\n\n");
}

ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    req_t *q = cls;
    while (q->out_off >= q->out.len) {
        q->out.len = q->out_off = 0;
        if (q->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        uint64_t t = loom_now_ns();
        loom_chunk_t ch;
        if (!next_chunk(q, &ch)) return MHD_CONTENT_READER_END_WITH_ERROR;
        stream_chunk(q, &ch);
        if (loom_now_ns() - t > 1000000000ull) refresh_timeout(q);
    }
    size_t n = LOOM_MIN(max, q->out.len - q->out_off);
    memcpy(buf, q->out.p + q->out_off, n);
    q->out_off += n;
    return (ssize_t)n;
}

enum MHD_Result finish_collected(req_t *q, const loom_chunk_t *ch) {
    if (q->resp) return resp_finish(q, ch);
    cJSON *o = head_obj(q, q->chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    char *t = text_dup(q->text.p ? q->text.p : "", q->text.len);
    const char *finish = finish_name(ch->finish);
    if (q->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        char *rest = NULL, *reasoning = NULL, *answer = NULL;
        if (q->h->reasoning) { /* the reasoning split off; the rest is the answer */
            loom_reasoning_split(q->h->reasoning, t, strlen(t), &reasoning, &answer);
            free(t);
            t = answer ? answer : loom_xstrdup("");
            if (reasoning) cJSON_AddStringToObject(m, "reasoning_content", reasoning);
            else cJSON_AddNullToObject(m, "reasoning_content");
            free(reasoning);
        }
        cJSON *calls = tool_calls_of(q, t, strlen(t), ch, &rest, &finish);
        if (calls) {
            if (rest) cJSON_AddStringToObject(m, "content", rest);
            else cJSON_AddNullToObject(m, "content");
            cJSON_AddItemToObject(m, "tool_calls", calls);
            free(rest);
        } else {
            cJSON_AddStringToObject(m, "content", t);
        }
    } else {
        cJSON_AddStringToObject(c, "text", t);
    }
    free(t);
    if (q->logprobs) { /* asked for: an object even when no token came */
        cJSON *lp = q->lp_acc ? q->lp_acc : cJSON_CreateObject();
        q->lp_acc = NULL;
        if (q->chat) {
            arr_of(lp, "content");
            cJSON_AddNullToObject(lp, "refusal");
        } else {
            arr_of(lp, "tokens"), arr_of(lp, "token_logprobs"), arr_of(lp, "top_logprobs"), arr_of(lp, "text_offset");
        }
        cJSON_AddItemToObject(c, "logprobs", lp);
    } else {
        cJSON_AddNullToObject(c, "logprobs");
    }
    cJSON_AddStringToObject(c, "finish_reason", finish);
    cJSON *plp = q->prompt_lp >= 0 ? (q->plp ? q->plp : cJSON_CreateArray()) : NULL;
    q->plp = NULL;
    if (plp && !q->chat) cJSON_AddItemToObject(c, "prompt_logprobs", plp); /* vLLM: the choice's */
    cJSON_AddItemToArray(choices, c);
    if (plp && q->chat) cJSON_AddItemToObject(o, "prompt_logprobs", plp); /* vLLM: the response's */
    cJSON_AddItemToObject(o, "usage", usage_obj(ch));
    cJSON *kv = ch->kv_transfer_params ? cJSON_Parse(ch->kv_transfer_params) : NULL;
    if (kv) cJSON_AddItemToObject(o, "kv_transfer_params", kv); /* vLLM: the response's, for the decode side */
    take_timings(q, ch);
    if (q->has_timings) cJSON_AddItemToObject(o, "timings", timings_obj(q));
    return respond_json(q, MHD_HTTP_OK, o);
}

/* The text echo puts before a choice: the prompt string, or its token ids
 * decoded (special tokens left out). */
void add_echo(const req_t *q, loom_sbuf_t *b, const char *text, const int32_t *ids, int n_ids) {
    if (text) {
        loom_sbuf_str(b, text);
    } else if (q->h->tok && n_ids > 0) {
        size_t len = 0;
        char *t = loom_tokenizer_decode(q->h->tok, ids, n_ids, 1, &len);
        if (t) loom_sbuf_add(b, t, len);
        free(t);
    }
}
