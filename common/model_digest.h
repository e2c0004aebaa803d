/* A model directory's identity, cheap enough to compute at every start: two
 * digests a replica publishes (ListModels) so a router can tell two
 * checkpoints apart that share a name, a vocabulary and a context length. */
#ifndef LOOM_MODEL_DIGEST_H
#define LOOM_MODEL_DIGEST_H

#include <stddef.h>

#include "common/status.h"

#define LOOM_DIGEST_HEX 48 /* "b2:" + 32 hex digits + NUL, rounded up */

/* weights: BLAKE2b-128 over config.json's bytes and, for every tensor of the
 * checkpoint (sharded or not) in name order, its name, dtype, shape, size,
 * offset in its file's data section and three 256-byte samples of its data
 * (first, middle, last; all of it when smaller). tokenizer: BLAKE2b-128 over
 * tokenizer.json's and tokenizer_config.json's bytes (an absent file counts
 * as empty). Both are "b2:" and 32 hex digits. Reads a few pages per tensor:
 * a change inside a tensor that none of its samples touches goes unseen
 * (docs/scale-out.md says what that leaves out). The tokenizer digest is
 * filled first: a directory without weights (a router's tokenizer-only
 * --model) gets it, and the weights' error. */
loom_status_t loom_model_digest(const char *dir, char weights[LOOM_DIGEST_HEX],
                                char tokenizer[LOOM_DIGEST_HEX], loom_err_t *err);

#endif
