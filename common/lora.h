/* LoRA adapters as PEFT ships them: a directory with adapter_config.json and
 * adapter_model.safetensors, whose tensors are
 *   base_model.model.<module>.lora_A.weight  (r, in)
 *   base_model.model.<module>.lora_B.weight  (out, r)
 * A projection y = W x of an adapted module becomes y = W x + scale * B (A x).
 *
 * Reading an adapter checks it against the base model's config: every module
 * must be one the model has (q/k/v/o of attention, gate/up/down of a dense
 * MLP; Phi-3's fused qkv_proj / gate_up_proj are split into their parts,
 * each keeping the whole A and its rows of B), shapes must match, and what
 * Loom does not apply is refused by name (DoRA, modules_to_save, biases,
 * fan_in_fan_out, layer_replication, adapters on MoE experts) rather than
 * silently dropped. Scaling follows PEFT: lora_alpha / r, or
 * lora_alpha / sqrt(r) with use_rslora, with rank_pattern / alpha_pattern
 * overriding r and alpha per module (a key matches the end of the module's
 * name, as a regular expression).
 *
 * An adapter's identity for caches is its content digest (BLAKE2b-256 over
 * the canonical config and every tensor), never its name: a reload under
 * the same name with other weights has another digest. */
#ifndef LOOM_LORA_H
#define LOOM_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "common/model_config.h"
#include "common/status.h"

/* vLLM's allowed --max-lora-rank values. */
#define LOOM_LORA_RANKS "1, 8, 16, 32, 64, 128, 256, 320, 512"
int loom_lora_rank_allowed(int r);

/* The projections an adapter can target, in the order a layer runs them. */
typedef enum {
    LOOM_LORA_Q = 0,
    LOOM_LORA_K,
    LOOM_LORA_V,
    LOOM_LORA_O,
    LOOM_LORA_GATE,
    LOOM_LORA_UP,
    LOOM_LORA_DOWN,
    LOOM_LORA_N_TARGETS
} loom_lora_target_t;

const char *loom_lora_target_name(loom_lora_target_t t); /* "q_proj", ... */

/* One adapted projection of one layer. */
typedef struct loom_lora_module {
    int r;          /* rank; 0: this projection is not adapted */
    float scale;    /* alpha / r, or alpha / sqrt(r) with rsLoRA */
    int64_t in;     /* columns of x (and of A) */
    int64_t out;    /* rows of the projection's output (and of B) */
    float *a;       /* (r, in) */
    float *b;       /* (out, r) */
} loom_lora_module_t;

typedef struct loom_lora_adapter {
    int n_layers;             /* the base model's num_hidden_layers */
    int layer_begin, layer_end; /* the layers loaded (a pipeline stage's); others have r 0 */
    loom_lora_module_t *mod;  /* (n_layers, LOOM_LORA_N_TARGETS) */
    int max_r;                /* the largest rank of any module */
    int n_modules;            /* adapted projections loaded */
    size_t bytes;             /* of A and B, as f32 */
    uint8_t digest[32];       /* BLAKE2b-256 of the canonical config and all tensors */
    char digest_hex[65];
} loom_lora_adapter_t;

/* Reads the adapter in DIR for a model of config CFG, keeping only layers
 * [layer_begin, layer_end) (a pipeline stage's; 0, cfg->n_layers for all).
 * Refuses, naming the key, module or tensor: a missing directory or file,
 * a truncated safetensors, use_dora, modules_to_save, bias other than
 * "none", fan_in_fan_out, layer_replication, a target module the model does
 * not have, adapters on MoE experts, a tensor of the wrong shape or an
 * unknown tensor, and a rank above MAX_RANK ("rank 128 is greater than
 * max_lora_rank 64"). The digest covers every layer, whatever is kept. */
loom_status_t loom_lora_load(const char *dir, const loom_model_config_t *cfg, int max_rank, int layer_begin,
                             int layer_end, loom_lora_adapter_t **out, loom_err_t *err);
void loom_lora_destroy(loom_lora_adapter_t **a_p);

/* The module of LAYER and target T, or NULL when it is not adapted (or not loaded). */
const loom_lora_module_t *loom_lora_module(const loom_lora_adapter_t *a, int layer, loom_lora_target_t t);

/* Copies a tensor-parallel shard of a module: rows [row0, row0+nrows) of B
 * (column-parallel layers keep A whole and split B like W's output rows)
 * and columns [col0, col0+ncols) of A (row-parallel layers split A like W's
 * input columns and keep B whole). a_out is (r, ncols), b_out (nrows, r). */
void loom_lora_slice(const loom_lora_module_t *m, int64_t row0, int64_t nrows, int64_t col0, int64_t ncols,
                     float *a_out, float *b_out);

#endif
