/* The command-line flags of `vllm serve` (its engine and server arguments),
 * so that a flag Loom does not implement is refused as "a vLLM flag Loom
 * does not support" rather than as a typo. Names are without the dashes. */
#ifndef LOOM_VLLM_FLAGS_H
#define LOOM_VLLM_FLAGS_H

#include <stddef.h>

/* 1 when name[0..len) is one of vLLM's flags (long or short), else 0. */
int loom_vllm_flag_known(const char *name, size_t len);

#endif
