/* The KV block chain hash, shared by the coordinator's KV ledger (which
 * names cached blocks by it) and the router's prefix index (which predicts
 * them): both must compute the same value, so it lives here, apart from
 * either process's code. */
#ifndef LOOM_BLOCK_HASH_H
#define LOOM_BLOCK_HASH_H

#include <stdint.h>

/* Hash of a full block given the hash of the block before it (0 for the
 * first). Never 0. */
uint64_t loom_kv_chain_hash(uint64_t parent, const int32_t *tokens, int n);

#endif
