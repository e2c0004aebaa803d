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
/* How many of these blocks, from the first, are whole for every shard. */
int loom_kv_dir_connector_whole(loom_kv_connector_t *c, const uint64_t *hashes, int n);

#endif
