/* Loom's C client: the gRPC-like API over ZeroMQ (proto/loom/v1/api.proto).
 * One client = one DEALER connection. Requests are asynchronous underneath
 * (many Generate streams can be in flight on one client); the blocking
 * calls below are built on loom_client_submit + loom_client_poll.
 * A client is not thread-safe: use one per thread. */
#ifndef LOOM_CLIENT_H
#define LOOM_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct loom_client loom_client_t;

typedef struct loom_client_options {
    int timeout_ms;      /* no reply for this long -> LOOM_ERR_UNAVAILABLE (default 30000) */
    const char *api_key; /* sent with every request when set */
    void *zmq_context;   /* share a context (needed for inproc:// addresses); NULL: own one */
    /* CURVE (a coordinator started with --client-keys): the server's public
     * key and this client's secret key, each a key file or the 40 Z85
     * characters; NULL: $LOOM_CURVE_SERVER_KEY and $LOOM_CURVE_SECRET.
     * Neither: a plain connection. Not used for inproc:// addresses. */
    const char *curve_server_key;
    const char *curve_secret;
} loom_client_options_t;

/* Connects to "tcp://host:port" (or ipc://, inproc:// with a shared context).
 * Connecting does not wait for the server; the first call does. */
loom_status_t loom_client_connect(const char *addr, const loom_client_options_t *opt,
                                  loom_client_t **out, loom_err_t *err);
void loom_client_close(loom_client_t **c_p); /* safe on NULL and twice */

typedef struct loom_gen_params {
    const char *prompt;         /* text, or NULL to send prompt_ids */
    const int32_t *prompt_ids;
    int n_prompt_ids;
    int max_tokens;             /* 0: up to the context length */
    float temperature;          /* 0: greedy */
    float top_p;                /* 0 or 1: off */
    int top_k;                  /* 0: off */
    uint64_t seed;
    int has_seed;
    const char *const *stop;    /* stop strings (not emitted) */
    int n_stop;
    int ignore_eos;
    int priority;
    int keep_special;           /* keep special tokens in the text */
    /* special tokens kept in the text even so (a tool-call parser's markers), at most 16 */
    const int32_t *keep_special_ids;
    int n_keep_special_ids;
    int raw_prompt;             /* prompt already formatted (chat template): parse special tokens, no BOS */
    const char *model;          /* NULL: the served model */
    const char *tag;            /* the caller's id for the coordinator's log lines (NULL: none) */
    const int32_t *stop_token_ids; /* generating one ends the request (not in the text) */
    int n_stop_token_ids;
    /* sampling controls (api.proto SamplingParams / GenerateRequest); zero: off */
    float min_p;
    float presence_penalty, frequency_penalty; /* [-2, 2] */
    float repetition_penalty;                  /* 0 or 1: off */
    const int32_t *logit_bias_ids;             /* (n_logit_bias) */
    const float *logit_bias_values;
    int n_logit_bias;
    const int32_t *allowed_token_ids;          /* (n_allowed_token_ids) only these may be generated */
    int n_allowed_token_ids;
    const char *const *bad_words;              /* (n_bad_words) never generated */
    int n_bad_words;
    int min_tokens;                            /* EOS and stops end nothing before this many tokens */
    int include_stop_str_in_output;
    int logprobs;                              /* chunks carry their tokens' log probabilities */
    int top_logprobs;                          /* and the most likely tokens', at most 20 */
    const char *session;        /* affinity key for a router's session policy (NULL: none) */
    const char *kv_transfer_params; /* vLLM's kv_transfer_params, a JSON object (NULL: none) */
    int guide_kind;                            /* constrained decoding: api.proto guide_kind, 0 off */
    const char *guide_spec;                    /* its spec (schema, regex, choice array, grammar) */
    const char *guide_after;                   /* the guide holds after this marker (a reasoning model's
                                                  answer); NULL: from the first token */
    int no_speculation;                        /* never speculate for this request */
    int prompt_logprobs;                       /* the first chunk carries the prompt's logprobs */
    int prompt_top_logprobs;                   /* and the most likely tokens' at each position, at most 20 */
    int no_cache;                              /* a router's response cache neither answers nor keeps it */
    uint64_t gateway_tokenize_ns;              /* time the sender spent tokenizing prompt_ids (counted in the
                                                  request's tokenize stage) */
} loom_gen_params_t;

typedef enum {
    LOOM_FINISH_NONE = 0,
    LOOM_FINISH_STOP = 1,
    LOOM_FINISH_LENGTH = 2,
    LOOM_FINISH_CANCELLED = 3,
    LOOM_FINISH_ERROR = 4,
} loom_finish_t;

/* Where a request's time went (milliseconds; see Timings in api.proto). */
typedef struct loom_timings {
    double queue_ms, tokenize_ms, prefill_ms, decode_ms, detokenize_ms, send_ms, ttft_ms, total_ms;
} loom_timings_t;

typedef struct loom_chunk {
    uint64_t request_id;
    const int32_t *ids; /* new token ids */
    int n_ids;
    const char *text;   /* new text, whole UTF-8 characters, NUL-terminated */
    size_t text_len;
    loom_finish_t finish;
    int final;
    /* usage, in the final chunk */
    int prompt_tokens, completion_tokens, cached_tokens;
    int spec_draft_tokens, spec_accepted_tokens, target_steps; /* speculative decoding */
    /* in the final chunk of an admitted request (has_timings = 1) */
    loom_timings_t timings;
    int has_timings;
    /* with loom_gen_params_t.logprobs (has_logprobs = 1), per id: its log
     * probability, and n_top[i] (id, logprob) pairs, concatenated over ids */
    int has_logprobs;
    const float *logprobs;
    const uint32_t *n_top;
    const int32_t *top_ids;
    const float *top_logprobs;
    /* with loom_gen_params_t.prompt_logprobs, in the first chunk
     * (n_prompt_ids > 0): the prompt's ids, and for each prompt token after
     * the first (n_prompt_ids - 1 entries) its log probability, its rank
     * (1: the most likely) and prompt_n_top[i] (id, logprob) pairs,
     * concatenated */
    int n_prompt_ids;
    const int32_t *prompt_ids;
    const float *prompt_logprobs;
    const uint32_t *prompt_ranks, *prompt_n_top;
    const int32_t *prompt_top_ids;
    const float *prompt_top_logprobs;
    /* the stream's status in the final chunk (OK unless it failed) */
    loom_status_t status;
    const char *message;
    int retry_after_ms; /* RESOURCE_EXHAUSTED from a router's tenant limits: when to try again (0: not said) */
    const char *kv_transfer_params; /* final chunk of a prefill for a remote decode: the decode's params (JSON) */
} loom_chunk_t;

/* Called for each chunk; return nonzero to cancel the request (the call
 * then returns LOOM_ERR_CANCELLED after the server confirms). */
typedef int (*loom_chunk_fn)(void *ctx, const loom_chunk_t *chunk);

/* Streams one completion; returns when the final chunk arrives. Errors carry
 * the server's status and message (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
 * UNAVAILABLE, ...) or UNAVAILABLE when the server does not answer in time. */
loom_status_t loom_client_generate(loom_client_t *c, const loom_gen_params_t *p, loom_chunk_fn cb,
                                   void *ctx, loom_err_t *err);

/* Asynchronous use: submit returns the request id at once; poll waits up to
 * timeout_ms for the next chunk of any request on this client (returns
 * LOOM_OK with *got = 1 and the chunk, or *got = 0 on timeout). The chunk's
 * pointers are valid until the next poll. */
loom_status_t loom_client_submit(loom_client_t *c, const loom_gen_params_t *p, uint64_t *request_id,
                                 loom_err_t *err);
loom_status_t loom_client_poll(loom_client_t *c, int timeout_ms, loom_chunk_t *chunk, int *got,
                               loom_err_t *err);
/* Asks the server to cancel a request of this client; the stream then ends
 * with a final chunk (finish CANCELLED). */
loom_status_t loom_client_cancel(loom_client_t *c, uint64_t request_id, loom_err_t *err);

typedef struct loom_health {
    int ready;
    char state[32];
    int workers_ready, workers_expected;
    char message[256];
} loom_health_t;
loom_status_t loom_client_health(loom_client_t *c, loom_health_t *h, loom_err_t *err);

typedef struct loom_stats {
    int running, waiting;
    int kv_blocks_total, kv_blocks_used, kv_blocks_free, kv_block_size;
    uint64_t kv_blocks_cached;
    char kv_cache_dtype[16]; /* "f32", "bf16", "int8", "fp8" ("" from an older server) */
    uint64_t kv_block_bytes;
    uint64_t prefix_cache_queries, prefix_cache_hits;
    double prefix_cache_hit_rate;
    double gen_tokens_per_s;
    uint64_t requests_finished, requests_rejected, preemptions;
    uint64_t prompt_tokens_total, gen_tokens_total, steps;
    double step_ms_mean;
    int preparing; /* requests being prepared (grammar, long prompt) off the reactor */
    uint64_t ahead_tokens, ahead_dropped; /* overlapped scheduling: planned ahead, and dropped unseen */
} loom_stats_t;
loom_status_t loom_client_stats(loom_client_t *c, loom_stats_t *s, loom_err_t *err);

typedef struct loom_model_info {
    char id[256];
    int context_length, vocab_size, tp, pp;
    char parent[256]; /* a LoRA adapter: the base model's id ("" for the base model) */
    char root[1024];  /* a LoRA adapter: its directory */
} loom_model_info_t;
/* Fills up to max entries; *n gets the number of models served. */
loom_status_t loom_client_list_models(loom_client_t *c, loom_model_info_t *models, int max, int *n,
                                      loom_err_t *err);

/* vLLM's runtime LoRA updates (docs/lora.md): register adapter NAME from
 * PATH, or unregister it. MSG gets the server's text (vLLM's success
 * message); the error names the problem (updating off, already loaded, not
 * found, a bad adapter). */
loom_status_t loom_client_load_lora_adapter(loom_client_t *c, const char *name, const char *path, char *msg,
                                            size_t cap, loom_err_t *err);
loom_status_t loom_client_unload_lora_adapter(loom_client_t *c, const char *name, char *msg, size_t cap,
                                              loom_err_t *err);

/* Embed: the embeddings of inputs (texts, or token ids when text is NULL),
 * computed together: out->values holds n unit vectors of out->dim floats,
 * in order (free with loom_embed_result_free). */
typedef struct loom_embed_input {
    const char *text;       /* encoded with the model's tokenizer (BOS per its config); NULL: ids */
    const int32_t *ids;
    int n_ids;
} loom_embed_input_t;
typedef struct loom_embed_result {
    int n, dim;
    float *values;          /* (n, dim) */
    int prompt_tokens;      /* of all the inputs */
    char pooling[8];        /* "last" or "mean" */
} loom_embed_result_t;
loom_status_t loom_client_embed(loom_client_t *c, const char *model, const loom_embed_input_t *in, int n,
                                const char *tag, loom_embed_result_t *out, loom_err_t *err);
void loom_embed_result_free(loom_embed_result_t *r);

#endif
