/* What the gateway's files (http.c, parse.c, render.c, routes.c) share:
 * limits, the daemon, connection and request structs, and the functions
 * one file calls in another. Not a public interface: see http.h. */
#ifndef LOOM_GATEWAY_IMPL_H
#define LOOM_GATEWAY_IMPL_H

#include "gateway/http.h"


#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
/* before microhttpd.h, which needs struct sockaddr_in complete */
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include "client/loom_client.h"
#include "common/chat_template.h"
#include "common/reasoning.h"
#include "common/request_limits.h"
#include "common/json.h"
#include "common/etcd.h"
#include "common/log.h"
#include "common/tokenizer.h"
#include "common/util.h"
#include "gateway/http_guard.h"
#include "gateway/http_parse.h"
#include "gateway/http_tls.h"
#include "gateway/tool_calls.h"
#include "gateway/tool_stream.h"

#define DEFAULT_BIND "127.0.0.1:8000"
#define DEFAULT_MAX_BODY ((size_t)2 << 20)
#define DEFAULT_MAX_CONNECTIONS 256
#define DEFAULT_IDLE_TIMEOUT_S 60
#define DEFAULT_REQUEST_TIMEOUT_MS 300000
#define SLICE_MS 100           /* longest wait before checking the peer and the stop flag */
#define CANCEL_WAIT_MS 2000    /* how long an abandoned request waits for its cancel to land */
#define PROBE_TIMEOUT_MS 3000  /* Health and ListModels: the reactor answers at once when it runs */
#define LORA_LOAD_TIMEOUT_MS 300000 /* a runtime adapter load: its read, off the reactor, grows with its size */
#define MAX_STOP LOOM_MAX_STOP /* as the coordinator (common/request_limits.h) */
#define COMPLETIONS_DEFAULT_MAX_TOKENS 16 /* OpenAI's default for /v1/completions */
#define SSE_BLOCK 4096
#define OVERFLOW_CONNECTIONS 64 /* connections over the limit that still get a 503 */
#define MAX_REQUEST_ID 128
#define MAX_STOP_IDS LOOM_MAX_STOP_IDS
#define MAX_LOGIT_BIAS LOOM_MAX_LOGIT_BIAS
#define MAX_BAD_WORDS LOOM_MAX_BAD_WORDS
#define MAX_TOP_LOGPROBS 20 /* as kernels/sampling.h LOOM_MAX_TOP_LOGPROBS */
#define MAX_CHOICES 64 /* n x prompts of one request */
#define MAX_ALLOWED_IDS LOOM_MAX_ALLOWED_IDS
#define RETRY_AFTER_S "1"
#define DEFAULT_HEADER_TIMEOUT_S 10 /* headers complete this long after accept (or the last response) */
#define DEFAULT_BODY_TIMEOUT_S 60   /* the body complete this long after the headers */
#define PROBE_MAX_CONNECTIONS 16    /* the probe listener: /health, /metrics, /version only */
#define PROBE_OVERFLOW_CONNECTIONS 16
#define DEFAULT_RESPONSES_STORE 1024                 /* stored responses kept (LRU) */
#define DEFAULT_RESPONSES_STORE_BYTES ((size_t)64 << 20) /* and their bytes */

typedef struct resp_ctx resp_ctx_t;     /* one Responses API request (responses.c) */
typedef struct resp_store resp_store_t; /* stored responses (responses.c) */


/* One libmicrohttpd daemon: the traffic listener (--http) or the probe
 * listener (--probe-listen). Each has its own connection slots. */
typedef struct listener {
    loom_http_t *h;
    int probe;
    atomic_int n_conns; /* open connections, over-limit ones included */
    int max_conns;
} listener_t;

struct loom_http {
    loom_http_metrics_fn metrics_fn; /* /metrics of the endpoint */
    loom_http_liveness_fn liveness_fn; /* /health's check without a round trip (NULL: none) */
    void *liveness_ctx;
    int max_queue; /* the endpoint's --max-queue (0: unknown) */
    void *metrics_ctx;
    struct MHD_Daemon *daemon;
    void *zctx;
    char inproc[128];
    char bind[256];
    char *api_key;
    int forward_api_keys; /* loom_http_config_t.forward_api_keys */
    loom_chat_template_t *tmpl; /* NULL: this model has no chat template */
    loom_toolfmt_t tool_fmt;    /* the model's tool-call syntax (--tool-call-parser or the template's) */
    loom_reasoning_t reasoning; /* --reasoning-parser (NONE: the output is all content) */
    size_t max_body;
    unsigned idle_timeout_s;
    int request_timeout_ms;
    int port;
    long long started; /* unix time, the "created" of the model object */
    loom_gen_defaults_t gen; /* defaults for fields a request leaves out (--generation-config) */
    atomic_int serving, stopping;
    loom_tokenizer_t *tok; /* /tokenize and /detokenize (NULL: no model directory) */
    atomic_int draining, generating; /* refuse new generations; generation requests not yet completed */
    atomic_uint_fast64_t n_ids;
    uint64_t id_salt;
    pthread_mutex_t mu; /* guards have_model, model */
    int have_model;
    loom_model_info_t model;
    /* the probe listener, the read deadlines, TLS */
    listener_t traffic, probe;
    struct MHD_Daemon *probe_daemon;
    int probe_port;
    loom_http_guard_t *guard;
    loom_http_tls_t tls; /* empty: plain HTTP */
    int per_ip;          /* MHD's per-client-address cap on the traffic listener (0: none) */
    int special_in_content; /* --chat-special-tokens-in-content: message text may write control tokens */
    resp_store_t *rstore;   /* stored responses for previous_response_id and GET /v1/responses/{id} */
};

/* One per TCP connection (MHD's socket context). */
typedef struct conn {
    loom_client_t *client;
    char *client_key; /* forward_api_keys: the key the client was made with */
    int over_limit; /* accepted beyond --http-max-connections: answered 503 */
    int probe;      /* on the probe listener */
    loom_http_slot_t *slot; /* its read deadlines (NULL: unguarded) */
} conn_t;

typedef enum {
    R_NONE,
    R_HEALTH,
    R_METRICS,
    R_MODELS,
    R_MODEL,
    R_COMPLETIONS,
    R_CHAT,
    R_TOKENIZE,
    R_DETOKENIZE,
    R_VERSION,
    R_EMBEDDINGS,
    R_RESPONSES, /* POST /v1/responses */
    R_RESPONSE,  /* GET or DELETE /v1/responses/{id} */
    R_LORA_LOAD,  /* POST /v1/load_lora_adapter */
    R_LORA_UNLOAD /* POST /v1/unload_lora_adapter */
} route_t;

/* One per HTTP request (MHD's con_cls). */
typedef struct req {
    loom_http_t *h;
    struct MHD_Connection *mc;
    conn_t *conn;
    route_t route;
    char method[16], path[256];
    unsigned status;
    uint64_t t0;
    const char *allow;    /* Allow header of a 405 */
    int www_auth;         /* WWW-Authenticate header of a 401 */
    int close_after;      /* Retry-After and Connection: close (over the connection limit) */
    int retry_after_ms;   /* a router's tenant limit said when to try again (Retry-After on a 429) */
    char xid[MAX_REQUEST_ID + 1]; /* X-Request-Id */
    char ignored[256];    /* X-Loom-Ignored-Fields: unknown request fields, comma-separated */
    /* the body */
    loom_sbuf_t body;
    int too_big;
    size_t discarded;
    /* the generation */
    int chat, stream, include_usage, active, finished;
    int counted; /* counted in h->generating */
    uint64_t gen_id, last_peek_ns;
    char id[64], model[256];
    long long created;
    loom_sbuf_t out; /* SSE bytes not yet handed to MHD */
    loom_sbuf_t prefix; /* "data: {...,"choices":[{"index":0," of every chunk of this stream */
    size_t out_off;
    loom_sbuf_t text; /* the completion, when not streaming */
    /* logprobs: asked for (completions: logprobs N; chat: logprobs + top_logprobs N) */
    int logprobs, top_logprobs;
    cJSON *lp_acc;    /* the collected logprobs object, when not streaming */
    size_t lp_offset; /* text_offset of the next token (completions) */
    char *lp_json;    /* this chunk's logprobs for sse_choice (NULL: null) */
    int echo;         /* completions: the prompt's text starts each choice */
    int prompt_lp;    /* vLLM's prompt_logprobs: its top size, -1 not asked */
    cJSON *plp;       /* the collected prompt_logprobs list */
    char fail_msg[600];
    /* timings: the coordinator's, and the gateway's own time handing chunks on */
    loom_timings_t timings;
    int has_timings;
    uint64_t send_ns;
    uint64_t tok_ns; /* the gateway's tokenization of a chat prompt (before the coordinator's clock) */
    loom_tools_t tools; /* chat: tools, tool_choice (tool_calls.h); mode OFF: none */
    cJSON *tools_req;   /* the request's tools array, kept for parsing the output */
    loom_tstream_t *ts; /* a streamed tool-calling answer, read as it comes (tool_stream.h) */
    loom_rsplit_t *rs;  /* chat with --reasoning-parser: the output's reasoning split off (reasoning.h) */
    resp_ctx_t *resp;   /* /v1/responses: rendered as a response, not a chat completion (responses.c) */
    int choice;         /* the index of the choice sse_choice writes (several streamed: n > 1) */
    struct multi_stream *ms; /* several choices streamed (http.c); NULL: one */
} req_t;


typedef struct perr {
    char param[64];
    char msg[600];
} perr_t;


typedef struct gen {
    loom_gen_params_t p;
    const char *stop[MAX_STOP];
    int32_t stop_ids[MAX_STOP_IDS];
    /* sampling controls */
    int32_t bias_ids[MAX_LOGIT_BIAS];
    float bias_values[MAX_LOGIT_BIAS];
    int32_t *allowed; /* owned */
    const char *bad_words[MAX_BAD_WORDS];
    /* a batch of prompts (n_batch > 1: answered by handle_multi) */
    const char **batch_text; /* (n_batch) a string, or NULL ... */
    int32_t **batch_ids;     /* ... token ids (owned) */
    int *batch_n_ids;
    int n_batch;
    int n;                   /* choices per prompt */
    int echo;
    int prompt_lp;           /* prompt_logprobs: its top size, -1 not asked */
    char *prompt; /* owned: the rendered chat */
    int32_t *ids; /* owned: prompt token ids */
    char *guide_spec; /* owned: the constrained-decoding spec sent to the coordinator */
    char *kv_params;  /* owned: kv_transfer_params as JSON text */
    loom_tools_t tools; /* chat: tools and tool_choice (tool_calls.h), owned */
    /* special tokens kept in the text (p.keep_special_ids): the tool-call
       parser's markers, then the reasoning parser's */
    int32_t keep_ids[2 * LOOM_TOOLS_MAX_KEEP];
    uint64_t tok_ns; /* the gateway's own tokenization of a chat prompt */
} gen_t;

/* Functions one file calls in another, by the file that defines them. */

/* http.c */
char *text_dup(const char *s, size_t n);
uint64_t mix64(uint64_t x);
enum MHD_Result respond(req_t *q, unsigned status, const char *ctype, char *body, size_t len);
enum MHD_Result respond_json(req_t *q, unsigned status, cJSON *j);
cJSON *error_obj(const char *msg, const char *type, const char *param, const char *code);
enum MHD_Result respond_error(req_t *q, unsigned status, const char *type, const char *param, const char *code,
                              const char *fmt, ...) __attribute__((format(printf, 6, 7)));
void status_http(loom_status_t s, unsigned *http, const char **type, const char **code);
enum MHD_Result respond_status(req_t *q, loom_status_t s, const char *msg);
void refresh_timeout(req_t *q);
loom_status_t ensure_client(req_t *q, loom_err_t *err);
loom_status_t probe_client(const loom_http_t *h, loom_client_t **c, loom_err_t *err);
loom_status_t served_model(req_t *q, loom_model_info_t *m, loom_err_t *err);
int next_chunk(req_t *q, loom_chunk_t *ch);
enum MHD_Result handle_generate(req_t *q);

/* parse.c */
int bad(perr_t *e, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
const cJSON *field(const cJSON *o, const char *k);
int opt_int(const cJSON *o, const char *k, double lo, double hi, double *v, perr_t *e);
int opt_bool(const cJSON *o, const char *k, int *v, perr_t *e);
void ignore_field(req_t *q, const char *name);
void gen_free(gen_t *g);
int is_token_id(const cJSON *t);
int parse_common(req_t *q, const cJSON *o, gen_t *g, perr_t *e);
int parse_prompt(const cJSON *o, gen_t *g, perr_t *e);
int parse_messages(const loom_chat_template_t *tmpl, const loom_tokenizer_t *tok, int special_in_content,
                   const cJSON *o, gen_t *g, perr_t *e);
void guide_after_reasoning(const loom_http_t *h, gen_t *g);
void keep_reasoning_markers(const loom_http_t *h, gen_t *g);

/* render.c */
void new_id(req_t *q);
void take_request_id(req_t *q);
const char *finish_name(loom_finish_t f);
cJSON *usage_obj(const loom_chunk_t *ch);
cJSON *head_obj(const req_t *q, const char *object);
void sse_choice(req_t *q, const char *text, size_t len, int role, const char *finish);
void sse_split_choice(req_t *q, loom_rsplit_t *rs, const char *text, size_t len, int final);
cJSON *arr_of(cJSON *o, const char *k);
void add_logprobs(req_t *q, cJSON *lp, const loom_chunk_t *ch);
cJSON *prompt_lp_json(const req_t *q, const loom_chunk_t *ch);
void add_echo_logprobs(req_t *q, cJSON *lp, const loom_chunk_t *ch, size_t echo_len);
void keep_tools(req_t *q, gen_t *g);
void stream_chunk(req_t *q, const loom_chunk_t *ch);
ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max);
enum MHD_Result finish_collected(req_t *q, const loom_chunk_t *ch);
void add_echo(const req_t *q, loom_sbuf_t *b, const char *text, const int32_t *ids, int n_ids);
void take_timings(req_t *q, const loom_chunk_t *ch);
unsigned long long call_seed(const req_t *q);
cJSON *tool_calls_of(req_t *q, const char *text, size_t len, const loom_chunk_t *ch, char **rest, const char **finish);

/* routes.c */
enum MHD_Result handle_models(req_t *q, const char *one);
enum MHD_Result handle_health(req_t *q);
enum MHD_Result handle_version(req_t *q);
enum MHD_Result handle_tokenize(req_t *q);
enum MHD_Result handle_detokenize(req_t *q);
enum MHD_Result handle_metrics(req_t *q);
enum MHD_Result handle_embeddings(req_t *q);

/* lora.c */
int list_models_now(const loom_http_t *h, loom_model_info_t **out, int *n, loom_err_t *err);
/* MODEL in a request: 1 the base model (BASE), 2 a LoRA adapter served now,
 * 0 neither (*ST NOT_FOUND, MSG OpenAI's text), -1 the coordinator did not
 * answer (*ST, MSG). */
int model_lookup(req_t *q, const loom_model_info_t *base, const char *model, loom_status_t *st, char *msg,
                 size_t cap);
cJSON *model_json(const loom_http_t *h, const loom_model_info_t *m);
enum MHD_Result handle_lora_update(req_t *q, int load);

/* responses.c */
resp_store_t *resp_store_create(int max_entries, size_t max_bytes);
void resp_store_destroy(resp_store_t **s_p);
enum MHD_Result handle_responses(req_t *q);
enum MHD_Result handle_response(req_t *q, const char *id);
void resp_stream_begin(req_t *q);
void resp_stream_chunk(req_t *q, const loom_chunk_t *ch);
/* An unstreamed response's chunk as it is collected (its reasoning tokens counted). */
void resp_collect_chunk(req_t *q, const loom_chunk_t *ch);
enum MHD_Result resp_finish(req_t *q, const loom_chunk_t *ch);
void resp_free(req_t *q);

#endif
