/* Prefill/decode disaggregation through a shared directory tier
 * (docs/disaggregation.md): vLLM's kv_transfer_params on a replica started
 * with --kv-transfer-config. A request with do_remote_decode runs its
 * prefill with its blocks written through to the tier and answers with the
 * params the decode side is to be given; a request with do_remote_prefill
 * names the prefill's blocks (their chain hashes) and loads them from the
 * tier at admission instead of computing them. */
#ifndef LOOM_COORDINATOR_KV_TRANSFER_H
#define LOOM_COORDINATOR_KV_TRANSFER_H

#include <stdint.h>

#include "common/status.h"
#include "coordinator/kv_connector.h"

/* --kv-transfer-config, vLLM's JSON: kv_connector "LoomConnector", kv_role
 * kv_producer | kv_consumer | kv_both, kv_load_failure_policy recompute |
 * fail (also accepted inside kv_connector_extra_config). */
typedef struct loom_kv_transfer_config {
    int producer, consumer;
    loom_kv_load_policy_t policy;
} loom_kv_transfer_config_t;

loom_status_t loom_kv_transfer_config_parse(const char *json, loom_kv_transfer_config_t *out, loom_err_t *err);

typedef struct loom_kv_transfer_req {
    int remote_decode;  /* do_remote_decode: this is the prefill */
    int remote_prefill; /* do_remote_prefill: the decode of a prefill done elsewhere */
    char engine_id[64]; /* remote_engine_id */
    int n_blocks;       /* remote_block_ids (chain hashes) */
    uint64_t *blocks;   /* owned */
} loom_kv_transfer_req_t;

/* Parses a request's kv_transfer_params and checks it against this replica
 * (cfg, its engine id) and the prompt: the blocks named must be the chain
 * hashes of the prompt's first blocks (block_size tokens each, never the
 * block of its last position), chained from seed (0: the base model; a LoRA
 * adapter's, loom_sched_lora_seed: its blocks are its own). INVALID_ARGUMENT
 * with a message naming the field otherwise. */
loom_status_t loom_kv_transfer_parse(const char *json, const loom_kv_transfer_config_t *cfg, const char *engine_id,
                                     const int32_t *prompt, int n_prompt, int block_size, uint64_t seed,
                                     loom_kv_transfer_req_t *out, loom_err_t *err);
void loom_kv_transfer_req_free(loom_kv_transfer_req_t *r);

/* "loom-<tier id hex>": replicas that share a directory tier and a model
 * and grid have one engine id (the blocks' names agree). */
void loom_kv_transfer_engine_id(uint64_t tier_id, char out[64]);

/* The params for the decode side of a prefill of this prompt (malloc'd
 * JSON): vLLM's fields, remote_block_ids the hex chain hashes of the
 * prompt's blocks the decode may load, chained from seed (as above). */
char *loom_kv_transfer_params(const char *engine_id, const int32_t *prompt, int n_prompt, int block_size,
                              uint64_t seed, const char *host, int port, uint64_t request_id, int tp_size);

#endif
