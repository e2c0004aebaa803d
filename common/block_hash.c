/* The KV block chain hash (block_hash.h). */
#include "common/block_hash.h"

uint64_t loom_kv_chain_hash(uint64_t parent, const int32_t *tokens, int n) {
    uint64_t h = parent ^ 0xcbf29ce484222325ull;
    for (int i = 0; i < n; i++) {
        h ^= (uint32_t)tokens[i];
        h *= 0x100000001b3ull;
        h ^= h >> 32;
    }
    h ^= (uint64_t)n * 0x9e3779b97f4a7c15ull;
    h *= 0xbf58476d1ce4e5b9ull;
    return (h ^ (h >> 31)) | 1; /* never 0 */
}
