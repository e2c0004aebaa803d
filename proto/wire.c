/* Pack/unpack with magic and version checks; step plan validation. */
#include "proto/wire.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define UNPACK(type, fn, data, len, err, body_case_expr)                                            \
    do {                                                                                           \
        if ((len) > LOOM_MAX_MSG_BYTES) {                                                          \
            loom_err_set(err, LOOM_ERR_FORMAT, "message of %zu bytes is too large", (size_t)(len)); \
            return NULL;                                                                           \
        }                                                                                          \
        type *m_ = fn(NULL, (len), (const uint8_t *)(data));                                       \
        if (!m_) {                                                                                 \
            loom_err_set(err, LOOM_ERR_FORMAT, "malformed message (%zu bytes): not a Loom protobuf", \
                         (size_t)(len));                                                           \
            return NULL;                                                                           \
        }                                                                                          \
        if (m_->magic != LOOM_PROTO_MAGIC) {                                                       \
            loom_err_set(err, LOOM_ERR_FORMAT, "message without the Loom magic (got 0x%08x)",     \
                         m_->magic);                                                               \
            goto bad_;                                                                             \
        }                                                                                          \
        if (m_->version != LOOM_PROTO_VERSION) {                                                   \
            loom_err_set(err, LOOM_ERR_PROTOCOL,                                                   \
                         "peer speaks Loom protocol version %u, this build speaks %u", m_->version, \
                         LOOM_PROTO_VERSION);                                                      \
            goto bad_;                                                                             \
        }                                                                                          \
        if ((body_case_expr) == 0) {                                                               \
            loom_err_set(err, LOOM_ERR_FORMAT, "message with no body");                            \
            goto bad_;                                                                             \
        }                                                                                          \
        return m_;                                                                                 \
    bad_:                                                                                          \
        protobuf_c_message_free_unpacked(&m_->base, NULL);                                         \
        return NULL;                                                                               \
    } while (0)

Loom__V1__ControlMsg *loom_wire_unpack_control(const void *data, size_t len, loom_err_t *err) {
    UNPACK(Loom__V1__ControlMsg, loom__v1__control_msg__unpack, data, len, err, m_->body_case);
}

Loom__V1__Request *loom_wire_unpack_request(const void *data, size_t len, loom_err_t *err) {
    UNPACK(Loom__V1__Request, loom__v1__request__unpack, data, len, err, m_->body_case);
}

Loom__V1__Reply *loom_wire_unpack_reply(const void *data, size_t len, loom_err_t *err) {
    UNPACK(Loom__V1__Reply, loom__v1__reply__unpack, data, len, err, 1);
}

#define PACK(fn_size, fn_pack, m, len)                                                             \
    do {                                                                                           \
        (m)->magic = LOOM_PROTO_MAGIC;                                                             \
        (m)->version = LOOM_PROTO_VERSION;                                                         \
        size_t n_ = fn_size(m);                                                                    \
        uint8_t *buf_ = loom_xmalloc(n_ ? n_ : 1);                                                 \
        *(len) = fn_pack(m, buf_);                                                                 \
        return buf_;                                                                               \
    } while (0)

void *loom_wire_pack_control(Loom__V1__ControlMsg *m, size_t *len) {
    PACK(loom__v1__control_msg__get_packed_size, loom__v1__control_msg__pack, m, len);
}
void *loom_wire_pack_request(Loom__V1__Request *m, size_t *len) {
    PACK(loom__v1__request__get_packed_size, loom__v1__request__pack, m, len);
}
void *loom_wire_pack_reply(Loom__V1__Reply *m, size_t *len) {
    PACK(loom__v1__reply__get_packed_size, loom__v1__reply__pack, m, len);
}

const char *loom_wire_method(Loom__V1__Request__BodyCase body) {
    switch (body) {
    case LOOM__V1__REQUEST__BODY_GENERATE: return "loom.v1.Generate";
    case LOOM__V1__REQUEST__BODY_CANCEL: return "loom.v1.Cancel";
    case LOOM__V1__REQUEST__BODY_HEALTH: return "loom.v1.Health";
    case LOOM__V1__REQUEST__BODY_LIST_MODELS: return "loom.v1.ListModels";
    case LOOM__V1__REQUEST__BODY_STATS: return "loom.v1.Stats";
    case LOOM__V1__REQUEST__BODY_EMBED: return "loom.v1.Embed";
    case LOOM__V1__REQUEST__BODY_LOAD_LORA_ADAPTER: return "loom.v1.LoadLoraAdapter";
    case LOOM__V1__REQUEST__BODY_UNLOAD_LORA_ADAPTER: return "loom.v1.UnloadLoraAdapter";
    default: return "";
    }
}

loom_status_t loom_wire_check_plan(const Loom__V1__StepPlan *p, const loom_plan_limits_t *lim,
                                   loom_err_t *err) {
    size_t n = p->n_tokens;
    if (n == 0 || n > (size_t)lim->max_tokens)
        return loom_err_set(err, LOOM_ERR_FORMAT, "plan with %zu tokens (limit %d)", n, lim->max_tokens);
    if (p->n_pos != n || p->n_slots != n || p->n_tok_seq != n)
        return loom_err_set(err, LOOM_ERR_FORMAT, "plan arrays disagree: %zu tokens, %zu positions, %zu slots, %zu seq ids",
                            n, p->n_pos, p->n_slots, p->n_tok_seq);
    if (p->n_seqs == 0 || p->n_seqs > (uint32_t)lim->max_seqs || p->max_blocks == 0 ||
        (uint64_t)p->max_blocks * (uint64_t)lim->block_size > (uint64_t)lim->max_pos + (uint64_t)lim->block_size)
        return loom_err_set(err, LOOM_ERR_FORMAT, "plan with %u sequences of %u blocks is out of range", p->n_seqs,
                            p->max_blocks);
    if (p->n_block_tables != (size_t)p->n_seqs * p->max_blocks)
        return loom_err_set(err, LOOM_ERR_FORMAT, "block tables hold %zu ids, expected %u x %u", p->n_block_tables,
                            p->n_seqs, p->max_blocks);
    if (p->n_sampling != p->n_logit_rows || p->n_logit_rows > n)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%zu logit rows with %zu sampling parameters", p->n_logit_rows,
                            p->n_sampling);
    if (p->n_copy_src != p->n_copy_dst)
        return loom_err_set(err, LOOM_ERR_FORMAT, "block copies: %zu sources, %zu destinations", p->n_copy_src,
                            p->n_copy_dst);
    for (size_t i = 0; i < n; i++) {
        if (p->tokens[i] < 0 || p->tokens[i] >= lim->vocab_size || p->pos[i] < 0 || p->pos[i] >= lim->max_pos ||
            p->slots[i] < 0 || (int64_t)p->slots[i] >= (int64_t)lim->n_blocks * lim->block_size || p->tok_seq[i] < 0 ||
            (uint32_t)p->tok_seq[i] >= p->n_seqs || (uint32_t)(p->pos[i] / lim->block_size) >= p->max_blocks)
            return loom_err_set(err, LOOM_ERR_FORMAT, "plan token %zu is out of range", i);
    }
    for (size_t i = 0; i < p->n_block_tables; i++)
        if (p->block_tables[i] < -1 || p->block_tables[i] >= lim->n_blocks)
            return loom_err_set(err, LOOM_ERR_FORMAT, "block id %d out of range", p->block_tables[i]);
    if (p->n_prev_rows && p->n_prev_rows != n)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%zu previous-step rows for %zu tokens", p->n_prev_rows, n);
    for (size_t i = 0; i < p->n_prev_rows; i++)
        if (p->prev_rows[i] < -1 || p->prev_rows[i] >= lim->max_seqs)
            return loom_err_set(err, LOOM_ERR_FORMAT, "previous-step row %d out of range", p->prev_rows[i]);
    for (size_t i = 0; i < p->n_logit_rows; i++)
        if (p->logit_rows[i] < 0 || (size_t)p->logit_rows[i] >= n)
            return loom_err_set(err, LOOM_ERR_FORMAT, "logit row %d out of range", p->logit_rows[i]);
    for (size_t i = 0; i < p->n_sampling; i++) {
        const Loom__V1__SampleParams *s = p->sampling[i];
        if (!s || !(s->temperature >= 0.0f && s->temperature <= 1e4f) || s->top_k < 0 ||
            !(s->top_p >= 0.0f && s->top_p <= 1.0f))
            return loom_err_set(err, LOOM_ERR_FORMAT, "sampling parameters %zu out of range", i);
    }
    for (size_t i = 0; i < p->n_copy_src; i++)
        if (p->copy_src[i] < 0 || p->copy_src[i] >= lim->n_blocks || p->copy_dst[i] < 0 ||
            p->copy_dst[i] >= lim->n_blocks)
            return loom_err_set(err, LOOM_ERR_FORMAT, "block copy %zu out of range", i);
    if (p->n_kv_save_blocks != p->n_kv_save_hashes || p->n_kv_load_blocks != p->n_kv_load_hashes)
        return loom_err_set(err, LOOM_ERR_FORMAT, "KV moves: %zu saves with %zu hashes, %zu loads with %zu hashes",
                            p->n_kv_save_blocks, p->n_kv_save_hashes, p->n_kv_load_blocks, p->n_kv_load_hashes);
    if (p->n_kv_save_after_blocks != p->n_kv_save_after_hashes)
        return loom_err_set(err, LOOM_ERR_FORMAT, "KV moves: %zu saves after the step with %zu hashes",
                            p->n_kv_save_after_blocks, p->n_kv_save_after_hashes);
    for (size_t i = 0; i < p->n_kv_save_after_blocks; i++)
        if (p->kv_save_after_blocks[i] < 0 || p->kv_save_after_blocks[i] >= lim->n_blocks)
            return loom_err_set(err, LOOM_ERR_FORMAT, "KV save %zu after the step: block %d out of range", i,
                                p->kv_save_after_blocks[i]);
    for (size_t i = 0; i < p->n_kv_load_blocks; i++)
        if (p->kv_load_blocks[i] < 0 || p->kv_load_blocks[i] >= lim->n_blocks)
            return loom_err_set(err, LOOM_ERR_FORMAT, "KV load %zu: block %d out of range", i, p->kv_load_blocks[i]);
    if ((p->n_kv_save_slots && p->n_kv_save_slots != p->n_kv_save_blocks) ||
        (p->n_kv_load_slots && p->n_kv_load_slots != p->n_kv_load_blocks) ||
        (p->n_kv_save_after_slots && p->n_kv_save_after_slots != p->n_kv_save_after_blocks))
        return loom_err_set(err, LOOM_ERR_FORMAT, "KV moves: host slots for %zu/%zu/%zu of %zu/%zu/%zu blocks",
                            p->n_kv_save_slots, p->n_kv_load_slots, p->n_kv_save_after_slots, p->n_kv_save_blocks,
                            p->n_kv_load_blocks, p->n_kv_save_after_blocks);
    /* block -1: a host slot written down to the directory (a spill) */
    for (size_t i = 0; i < p->n_kv_save_blocks; i++)
        if (p->kv_save_blocks[i] >= lim->n_blocks || p->kv_save_blocks[i] < -1 ||
            (p->kv_save_blocks[i] == -1 && (!p->n_kv_save_slots || p->kv_save_slots[i] < 0)))
            return loom_err_set(err, LOOM_ERR_FORMAT, "KV save %zu: block %d out of range", i, p->kv_save_blocks[i]);
    if (p->n_kv_pull_remote != p->n_kv_pull_blocks || p->n_kv_pull_source != p->n_kv_pull_blocks ||
        p->n_kv_pull_transfer != p->n_kv_pull_addrs)
        return loom_err_set(err, LOOM_ERR_FORMAT, "KV pulls: %zu blocks, %zu remote ids, %zu sources; %zu addresses "
                            "with %zu transfers", p->n_kv_pull_blocks, p->n_kv_pull_remote, p->n_kv_pull_source,
                            p->n_kv_pull_addrs, p->n_kv_pull_transfer);
    for (size_t i = 0; i < p->n_kv_pull_blocks; i++)
        if (p->kv_pull_blocks[i] < 0 || p->kv_pull_blocks[i] >= lim->n_blocks || p->kv_pull_remote[i] < 0 ||
            p->kv_pull_source[i] >= p->n_kv_pull_addrs)
            return loom_err_set(err, LOOM_ERR_FORMAT, "KV pull %zu: block %d, remote %d, source %u out of range", i,
                                p->kv_pull_blocks[i], p->kv_pull_remote[i], p->kv_pull_source[i]);
    for (size_t i = 0; i < p->n_kv_pull_addrs; i++)
        if (!p->kv_pull_addrs[i] || !p->kv_pull_addrs[i][0] || strlen(p->kv_pull_addrs[i]) > 4096)
            return loom_err_set(err, LOOM_ERR_FORMAT, "KV pull source %zu: no address", i);
    if (p->n_embed_begin != p->n_embed_end || p->n_embed_begin > p->n_tokens)
        return loom_err_set(err, LOOM_ERR_FORMAT, "embedding ranges: %zu begins, %zu ends", p->n_embed_begin,
                            p->n_embed_end);
    for (size_t i = 0; i < p->n_embed_begin; i++)
        if (p->embed_begin[i] < 0 || p->embed_end[i] <= p->embed_begin[i] || (size_t)p->embed_end[i] > p->n_tokens)
            return loom_err_set(err, LOOM_ERR_FORMAT, "embedding range %zu out of range", i);
    if (p->n_prompt_lp_ids != p->n_prompt_lp_rows || p->n_prompt_lp_top != p->n_prompt_lp_rows ||
        p->n_prompt_lp_rows > p->n_tokens)
        return loom_err_set(err, LOOM_ERR_FORMAT, "prompt logprobs: %zu rows, %zu ids, %zu top sizes",
                            p->n_prompt_lp_rows, p->n_prompt_lp_ids, p->n_prompt_lp_top);
    for (size_t i = 0; i < p->n_prompt_lp_rows; i++)
        if (p->prompt_lp_rows[i] < 0 || (size_t)p->prompt_lp_rows[i] >= p->n_tokens || p->prompt_lp_ids[i] < 0 ||
            p->prompt_lp_ids[i] >= lim->vocab_size || p->prompt_lp_top[i] > 20)
            return loom_err_set(err, LOOM_ERR_FORMAT, "prompt logprob row %zu out of range", i);
    if (p->n_mtp_next && p->n_mtp_next != p->n_seqs)
        return loom_err_set(err, LOOM_ERR_FORMAT, "plan with %zu MTP next tokens for %u sequences", p->n_mtp_next,
                            p->n_seqs);
    for (size_t i = 0; i < p->n_mtp_next; i++)
        if (p->mtp_next[i] < -1 || p->mtp_next[i] >= lim->vocab_size)
            return loom_err_set(err, LOOM_ERR_FORMAT, "MTP next token %zu out of range", i);
    if (p->n_seq_lora && p->n_seq_lora != p->n_seqs)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%zu adapter slots for %u sequences", p->n_seq_lora, p->n_seqs);
    for (size_t i = 0; i < p->n_seq_lora; i++)
        if (p->seq_lora[i] < -1 || p->seq_lora[i] >= lim->max_loras)
            return loom_err_set(err, LOOM_ERR_FORMAT, "sequence %zu names adapter slot %d; this worker has %d", i,
                                p->seq_lora[i], lim->max_loras);
    if (lim->n_dp > 1 ? p->n_seq_dp_rank != p->n_seqs : p->n_seq_dp_rank != 0)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%zu data-parallel attention ranks for %u sequences (%s)",
                            p->n_seq_dp_rank, p->n_seqs, lim->n_dp > 1 ? "one each" : "none without it");
    for (size_t i = 0; i < p->n_seq_dp_rank; i++)
        if (p->seq_dp_rank[i] < 0 || p->seq_dp_rank[i] >= lim->n_dp)
            return loom_err_set(err, LOOM_ERR_FORMAT, "sequence %zu is on data-parallel attention rank %d of %d", i,
                                p->seq_dp_rank[i], lim->n_dp);
    for (size_t i = 0; i < p->n_copy_src && lim->n_dp > 1; i++) /* a copy stays in one rank's partition */
        if (p->copy_src[i] / (lim->n_blocks / lim->n_dp) != p->copy_dst[i] / (lim->n_blocks / lim->n_dp))
            return loom_err_set(err, LOOM_ERR_FORMAT, "block copy %zu crosses data-parallel attention ranks", i);
    return LOOM_OK;
}

Loom__V1__StatusCode loom_wire_status_code(loom_status_t s) {
    switch (s) {
    case LOOM_OK: return LOOM__V1__STATUS_CODE__OK;
    case LOOM_ERR_INVALID_ARGUMENT:
    case LOOM_ERR_FORMAT:
    case LOOM_ERR_PROTOCOL:
    case LOOM_ERR_UNSUPPORTED: return LOOM__V1__STATUS_CODE__INVALID_ARGUMENT;
    case LOOM_ERR_NOT_FOUND: return LOOM__V1__STATUS_CODE__NOT_FOUND;
    case LOOM_ERR_RESOURCE_EXHAUSTED:
    case LOOM_ERR_NOMEM: return LOOM__V1__STATUS_CODE__RESOURCE_EXHAUSTED;
    case LOOM_ERR_UNAVAILABLE:
    case LOOM_ERR_IO: return LOOM__V1__STATUS_CODE__UNAVAILABLE;
    case LOOM_ERR_CANCELLED: return LOOM__V1__STATUS_CODE__CANCELLED;
    case LOOM_ERR_DEADLINE_EXCEEDED: return LOOM__V1__STATUS_CODE__DEADLINE_EXCEEDED;
    case LOOM_ERR_UNAUTHENTICATED: return LOOM__V1__STATUS_CODE__UNAUTHENTICATED;
    case LOOM_ERR_INTERNAL: return LOOM__V1__STATUS_CODE__INTERNAL;
    }
    return LOOM__V1__STATUS_CODE__UNKNOWN;
}

loom_status_t loom_wire_status_from_code(Loom__V1__StatusCode c) {
    switch (c) {
    case LOOM__V1__STATUS_CODE__OK: return LOOM_OK;
    case LOOM__V1__STATUS_CODE__CANCELLED: return LOOM_ERR_CANCELLED;
    case LOOM__V1__STATUS_CODE__INVALID_ARGUMENT: return LOOM_ERR_INVALID_ARGUMENT;
    case LOOM__V1__STATUS_CODE__DEADLINE_EXCEEDED: return LOOM_ERR_DEADLINE_EXCEEDED;
    case LOOM__V1__STATUS_CODE__NOT_FOUND: return LOOM_ERR_NOT_FOUND;
    case LOOM__V1__STATUS_CODE__RESOURCE_EXHAUSTED: return LOOM_ERR_RESOURCE_EXHAUSTED;
    case LOOM__V1__STATUS_CODE__UNAVAILABLE: return LOOM_ERR_UNAVAILABLE;
    case LOOM__V1__STATUS_CODE__UNAUTHENTICATED: return LOOM_ERR_UNAUTHENTICATED;
    case LOOM__V1__STATUS_CODE__INTERNAL: return LOOM_ERR_INTERNAL;
    default: return LOOM_ERR_INTERNAL;
    }
}

const char *loom_wire_code_name(Loom__V1__StatusCode c) {
    switch (c) {
    case LOOM__V1__STATUS_CODE__OK: return "OK";
    case LOOM__V1__STATUS_CODE__CANCELLED: return "CANCELLED";
    case LOOM__V1__STATUS_CODE__UNKNOWN: return "UNKNOWN";
    case LOOM__V1__STATUS_CODE__INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case LOOM__V1__STATUS_CODE__DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case LOOM__V1__STATUS_CODE__NOT_FOUND: return "NOT_FOUND";
    case LOOM__V1__STATUS_CODE__RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case LOOM__V1__STATUS_CODE__INTERNAL: return "INTERNAL";
    case LOOM__V1__STATUS_CODE__UNAVAILABLE: return "UNAVAILABLE";
    case LOOM__V1__STATUS_CODE__UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
    }
}
