/* Wire helpers: pack/unpack with the magic and protocol version checked,
 * and validation of decoded messages before anything uses them. */
#ifndef LOOM_WIRE_H
#define LOOM_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "loom/v1/api.pb-c.h"
#include "loom/v1/control.pb-c.h"

#define LOOM_PROTO_MAGIC 0x4d4f4f4cu /* "LOOM" */
#define LOOM_PROTO_VERSION 1u
#define LOOM_MAX_MSG_BYTES (64 << 20) /* sockets refuse larger messages */

/* Unpacks a message and checks magic, version and that a body is set.
 * NULL on failure with err saying why (FORMAT: not a Loom message;
 * PROTOCOL: another protocol version). Free with the matching free_unpacked. */
Loom__V1__ControlMsg *loom_wire_unpack_control(const void *data, size_t len, loom_err_t *err);
Loom__V1__Request *loom_wire_unpack_request(const void *data, size_t len, loom_err_t *err);
Loom__V1__Reply *loom_wire_unpack_reply(const void *data, size_t len, loom_err_t *err);

/* Sets magic/version and packs into a malloc'ed buffer (*len bytes). */
void *loom_wire_pack_control(Loom__V1__ControlMsg *m, size_t *len);
void *loom_wire_pack_request(Loom__V1__Request *m, size_t *len);
void *loom_wire_pack_reply(Loom__V1__Reply *m, size_t *len);

/* The method name a request body travels under ("loom.v1.Generate", ...). */
const char *loom_wire_method(Loom__V1__Request__BodyCase body);

/* Refuses (INVALID_ARGUMENT, naming the field, e.g. "generate.prompt") a
 * string field anywhere in the encoded message that holds a NUL byte or is
 * not valid UTF-8: decoded strings are C strings, which would cut at a NUL. */
loom_status_t loom_wire_check_text(const ProtobufCMessageDescriptor *d, const void *data, size_t len,
                                   loom_err_t *err);

/* Checks a step plan's counts and ranges: every per-token array has n
 * entries, block tables n_seqs * max_blocks, sampling one per logit row,
 * ids inside [0, limits). A plan that fails is refused, never executed. */
typedef struct loom_plan_limits {
    int max_tokens, max_seqs, n_blocks, vocab_size, max_pos, block_size;
    int max_loras; /* seq_lora entries are -1 or a slot below this */
    /* data-parallel attention (Assign.dp_attention): the ranks (> 1), whose KV partitions of n_blocks / n_dp
     * each the plan's ids address (n_blocks is their sum); seq_dp_rank is then required. 0: none */
    int n_dp;
} loom_plan_limits_t;
loom_status_t loom_wire_check_plan(const Loom__V1__StepPlan *p, const loom_plan_limits_t *lim,
                                   loom_err_t *err);

/* Status <-> API status code. */
Loom__V1__StatusCode loom_wire_status_code(loom_status_t s);
loom_status_t loom_wire_status_from_code(Loom__V1__StatusCode c);
const char *loom_wire_code_name(Loom__V1__StatusCode c);

#endif
