/* Limits on one generation request that both of the coordinator's APIs
 * enforce: the HTTP gateway refuses a request over them with a 400 before
 * it is sent on, and the ZeroMQ API (coordinator/server.c) with
 * INVALID_ARGUMENT, so a request the gateway accepts is never refused
 * behind it. vLLM sets no count limit on stop strings; these bound the work
 * stop matching does per generated token (every string is looked for in the
 * text held back) and the size of a request's fixed arrays. */
#ifndef LOOM_REQUEST_LIMITS_H
#define LOOM_REQUEST_LIMITS_H

#define LOOM_MAX_STOP 64      /* stop strings in one request */
#define LOOM_MAX_STOP_LEN 256 /* bytes of one stop string */
#define LOOM_MAX_STOP_IDS 64  /* stop_token_ids in one request */
#define LOOM_MAX_LOGIT_BIAS 1024 /* logit_bias entries */
#define LOOM_MAX_ALLOWED_IDS 131072 /* allowed_token_ids */
#define LOOM_MAX_BAD_WORDS 64 /* bad_words */

#endif
