/* The HTTP gateway: an OpenAI-compatible API (/v1/completions,
 * /v1/chat/completions, /v1/models, ...), /health and /metrics, served by
 * libmicrohttpd with one thread per connection, in front of any loom.v1
 * endpoint served over inproc:// in this process (the coordinator's
 * reactor, the router's). Each connection is an in-process loom.v1 client,
 * so the gateway adds no state of its own to the scheduler. It knows
 * neither process: the coordinator starts it through coordinator/gateway.h.
 * See docs/http-api.md and docs/architecture.md. */
#ifndef LOOM_HTTP_H
#define LOOM_HTTP_H

#include <stddef.h>

#include "common/gen_defaults.h"
#include "common/status.h"

typedef struct loom_http_config {
    const char *bind;          /* "HOST:PORT" or "[V6]:PORT"; port 0 = ephemeral (default "127.0.0.1:8000") */
    const char *api_key;       /* when set, /v1/... needs "Authorization: Bearer KEY" (NULL: open) */
    const char *model_dir;     /* tokenizer_config.json: chat template, bos/eos strings */
    const char *chat_template; /* --chat-template: a template file, text or shipped name overriding the
                                  model's (NULL: the model's; chat_template.h) */
    int trust_request_chat_template; /* a request's own chat_template is rendered (vLLM's flag) */
    const char *tool_call_parser; /* --tool-call-parser NAME (tool_calls.h; NULL: detected from the template) */
    const char *reasoning_parser; /* --reasoning-parser NAME (reasoning.h; NULL: none) */
    size_t max_body_bytes;     /* larger request bodies get 413 (0: 2 MiB) */
    int max_connections;       /* simultaneous connections, one thread each (0: 256) */
    int idle_timeout_s;        /* a connection silent this long is closed (0: 60) */
    int request_timeout_ms;    /* coordinator silence before a request fails with 503 (0: 300000) */
    const loom_gen_defaults_t *gen_defaults; /* --generation-config: sampling defaults (NULL: built-in) */
    const char *probe_bind;    /* "HOST:PORT" of a second listener serving only /health, /metrics and
                                  /version, with slots of its own (NULL: none) */
    const char *tls_cert;      /* PEM certificate chain: serve HTTPS on bind (with tls_key; NULL: plain) */
    const char *tls_key;       /* PEM private key of tls_cert */
    const char *tls_priorities; /* GnuTLS priority string (--ssl-ciphers; NULL: TLS 1.2+, forward secret, AEAD) */
    int header_timeout_s;      /* a request's headers must be complete this long after the connection
                                  opened or its previous response ended (0: 10; < 0: no deadline) */
    int body_timeout_s;        /* its body this long after the headers (0: 60; < 0: no deadline) */
    int max_connections_per_ip; /* connections from one client address on bind (0: no cap but
                                   max_connections) */
    int chat_special_in_content; /* special-token text in chat message content is parsed as control
                                    tokens (0: it is plain text; the template's own tokens are always
                                    special) */
    int forward_api_keys;        /* a router with tenants: the completion routes send each request's own
                                    Bearer key on and leave checking it to the router (whose keys are
                                    api_key and its tenants'); other routes still need api_key */
    int responses_store_max;     /* /v1/responses with store: responses kept for previous_response_id and
                                    GET /v1/responses/{id}, least recently used dropped (0: 1024; < 0: none) */
    size_t responses_store_bytes; /* and at most these bytes of them (0: 64 MiB) */
} loom_http_config_t;

typedef struct loom_http loom_http_t;

/* The loom.v1 endpoint the gateway fronts, served over inproc:// in this
 * process: its ZeroMQ context and address, and what renders its /metrics
 * (malloc'ed text, *len bytes; NULL: 500). */
typedef char *(*loom_http_metrics_fn)(void *ctx, size_t *len);
/* Thread-safe: 1 when the endpoint's reactor is live, else 0 and msg says
 * why ("stalled: ..."): /health answers 503 then without a round trip. */
typedef int (*loom_http_liveness_fn)(void *ctx, char *msg, size_t cap);
typedef struct loom_http_endpoint {
    void *zmq_context;
    const char *inproc_addr;
    loom_http_metrics_fn metrics;
    void *metrics_ctx;
    loom_http_liveness_fn liveness; /* NULL: none (Health alone says) */
    void *liveness_ctx;
    int max_queue; /* the most requests that ever wait at once (0: unknown): more choices are a 400 */
} loom_http_endpoint_t;
/* Loads and compiles the chat template (a syntax error names
 * FILE:LINE:COL; an unknown --tool-call-parser or --reasoning-parser is an
 * error listing the names) and starts serving ep. Requests wait until the endpoint's reactor turns. */
loom_status_t loom_http_start_at(const loom_http_endpoint_t *ep, const loom_http_config_t *cfg, loom_http_t **out,
                                 loom_err_t *err);
/* The bound TCP port (the ephemeral one when 0 was asked for). */
int loom_http_port(const loom_http_t *h);
/* The probe listener's port (0 without one). */
int loom_http_probe_port(const loom_http_t *h);
/* Refuses new generation requests (503) and waits, at most timeout_ms, until
 * the streams in flight have been handed their final events. Safe on NULL. */
void loom_http_drain(loom_http_t *h, int timeout_ms);
/* Stops serving: streams in flight end, every connection's client is
 * closed. Call before loom_server_destroy (whose ZeroMQ context waits for
 * them). Safe on NULL and twice. */
void loom_http_stop(loom_http_t **h_p);

#endif
