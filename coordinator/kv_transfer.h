/* Prefill/decode disaggregation through a shared directory tier
 * (docs/disaggregation.md): vLLM's kv_transfer_params on a replica started
 * with --kv-transfer-config. A request with do_remote_decode runs its
 * prefill with its blocks written through to the tier and answers with the
 * params the decode side is to be given; a request with do_remote_prefill
 * names the prefill's blocks (their chain hashes) and loads them from the
 * tier at admission instead of computing them. */
#ifndef LOOM_COORDINATOR_KV_TRANSFER_H
#define LOOM_COORDINATOR_KV_TRANSFER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "coordinator/kv_connector.h"

/* How the blocks move from the prefill side to the decode side. */
typedef enum {
    LOOM_KV_TRANSPORT_DIR = 0, /* through the directory tier both sides mount (--kv-offloading-dir) */
    LOOM_KV_TRANSPORT_TCP,     /* pulled worker to worker over the data plane's TCP (no directory) */
} loom_kv_transport_t;

#define LOOM_KV_LEASE_MS_DEFAULT 30000
#define LOOM_KV_SECRET_MIN 16 /* bytes a transfer secret must have at least */
#define LOOM_KV_SECRET_MAX 256

/* --kv-transfer-config, vLLM's JSON: kv_connector "LoomConnector", kv_role
 * kv_producer | kv_consumer | kv_both, kv_load_failure_policy recompute |
 * fail (also accepted inside kv_connector_extra_config). In
 * kv_connector_extra_config: transport "dir" (the default) | "tcp",
 * lease_ms (tcp: how long a prefill holds its blocks for a decode that
 * never reads them; default 30000), secret_file (tcp: the secret both sides
 * hold, at least LOOM_KV_SECRET_MIN bytes) or insecure true (tcp without a
 * secret: refused unless asked for by name), shm "auto" | "off", encrypt
 * (tcp: every message sealed, as with --encrypt-data-plane; needs the secret). */
typedef struct loom_kv_transfer_config {
    int producer, consumer;
    loom_kv_load_policy_t policy;
    loom_kv_transport_t transport;
    int lease_ms;
    char secret_file[1024]; /* "" : none */
    int insecure;
    int shm_off;            /* shm "off": transport tcp moves blocks over the socket even on one host */
    int encrypt;            /* encrypt true: transport tcp seals its messages (as --encrypt-data-plane does) */
    uint8_t secret[LOOM_KV_SECRET_MAX]; /* secret_file's bytes (loom_kv_transfer_read_secret) */
    size_t secret_len;
} loom_kv_transfer_config_t;

loom_status_t loom_kv_transfer_config_parse(const char *json, loom_kv_transfer_config_t *out, loom_err_t *err);

/* Reads cfg->secret_file into cfg->secret (trailing newlines cut; nothing
 * to do without one), or an error naming the file (missing, shorter than
 * LOOM_KV_SECRET_MIN, longer than LOOM_KV_SECRET_MAX). */
loom_status_t loom_kv_transfer_read_secret(loom_kv_transfer_config_t *cfg, loom_err_t *err);

typedef struct loom_kv_transfer_req {
    int remote_decode;  /* do_remote_decode: this is the prefill */
    int remote_prefill; /* do_remote_prefill: the decode of a prefill done elsewhere */
    char engine_id[64]; /* remote_engine_id */
    int n_blocks;       /* the prefill's blocks: remote_block_ids (dir) or remote_block_hashes (tcp) */
    uint64_t *blocks;   /* owned: their chain hashes */
    /* transport tcp: where and what to pull */
    int32_t *pool_blocks;   /* owned (n_blocks): remote_block_ids, the prefill's pool block ids */
    char addrs[1024];       /* the prefill's ranks' KV services, comma-separated: loom_remote_ranks, else
                               remote_host:remote_port */
    uint64_t transfer_id;   /* loom_transfer_id: the prefill's hold */
    int tp_size;            /* the prefill's TP */
} loom_kv_transfer_req_t;

/* Parses a request's kv_transfer_params and checks it against this replica
 * (cfg, its engine id; transport tcp: not compared, the workers' handshake
 * checks what must agree) and the prompt: the blocks named must be the chain
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

/* The params of a prefill on transport tcp (malloc'd JSON): remote_block_ids
 * the n pool block ids it holds (ints, as vLLM's), remote_block_hashes their
 * chain hashes (hex, chained from seed: the forgery check),
 * loom_transfer_id the hold's id (hex), remote_host/remote_port the KV
 * service of the prefill's rank 0 and loom_remote_ranks every rank's
 * (addrs: "tcp://host:port" comma-separated in rank order; "" : none). */
char *loom_kv_transfer_params_tcp(const char *engine_id, const int32_t *prompt, const int32_t *blocks, int n,
                                  int block_size, uint64_t seed, const char *addrs, uint64_t request_id,
                                  uint64_t transfer_id, int tp_size);

#endif
