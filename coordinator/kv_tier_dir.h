/* The directory tier's coordinator half (docs/kv-offload.md): a KV
 * connector (kv_connector.h) over the block files of common/kv_tier.h. It
 * answers match with the consecutive blocks whose file is whole for every
 * shard of the grid (read through once, then known by size and time while
 * they stay the same), and offer with whether shard 0's file is missing; the
 * workers write and read the files (the step plan's kv_save_* and
 * kv_load_*), each its own shard's. */
#ifndef LOOM_COORDINATOR_KV_TIER_DIR_H
#define LOOM_COORDINATOR_KV_TIER_DIR_H

#include <stdint.h>

#include "coordinator/kv_connector.h"

loom_kv_connector_t *loom_kv_dir_connector_create(const char *dir, int write_through);
/* The grid it serves (each epoch): the tier identity and each shard's
 * block bytes (n_shards = tp x pp). Until set, it matches nothing. */
void loom_kv_dir_connector_set_grid(loom_kv_connector_t *c, uint64_t tier_id, int n_shards,
                                    const uint64_t *shard_bytes);
/* How many of these blocks, from the first, are whole for every shard:
 * known, else read through here, on the caller's thread, with the tier's
 * lock released during the reads (the server calls it on its preparation
 * pool, so match and the reactor never wait on them). */
int loom_kv_dir_connector_whole(loom_kv_connector_t *c, const uint64_t *hashes, int n);
/* Reads files through on a thread of its own from now on (docs/kv-offload.md
 * "Where the check runs"): match answers from the files already known (read
 * through before, the same size and time since) and queues the checks of
 * the rest of the run whose files are there; waiting is then 1 for the
 * request, while the check of its next block runs and for at most
 * timeout_ms after it was queued (0: never). Returns a descriptor readable
 * when checks finish (poll it, then drain), or -1. LOOM_TEST_KV_CHECK_DELAY_MS=N
 * makes each block's check sleep N ms first (tests). */
int loom_kv_dir_connector_start_checks(loom_kv_connector_t *c, int timeout_ms);
/* Empties the descriptor's wakes; how many checks finished. */
int loom_kv_dir_connector_drain(loom_kv_connector_t *c);
/* Checks queued or running. */
int loom_kv_dir_connector_checking(loom_kv_connector_t *c);

#endif
