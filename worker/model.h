/* One shard of a Llama-family model on a backend: the layers of one pipeline
 * stage, sliced for one tensor-parallel rank, with its paged KV cache.
 * `loom run` uses a single shard holding everything; a worker holds one cell
 * of the grid. The forward pass runs a whole step (decode tokens and prefill
 * chunks of many sequences) as one batch per layer.
 *
 * Tensor parallelism (Megatron style): q/k/v and gate/up are column-parallel
 * (split by heads / by intermediate rows), o and down are row-parallel and
 * followed by an all-reduce. KV heads are replicated when there are fewer of
 * them than TP ranks. The LM head is vocab-parallel. */
#ifndef LOOM_MODEL_H
#define LOOM_MODEL_H

#include <stdint.h>

#include "common/lora.h"
#include "common/model_config.h"
#include "common/shard.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/quant.h"

/* All-reduce hook for tensor parallelism (NULL when tp_size == 1). */
typedef loom_status_t (*loom_allreduce_fn)(void *ctx, float *buf, int64_t n, loom_err_t *err);

typedef struct loom_model loom_model_t;

typedef enum {
    LOOM_MLA_O_AUTO = 0,
    LOOM_MLA_O_FOLDED, /* one matrix o' = W_o W_UV (dim, heads x (kv_lora + rope)) */
    LOOM_MLA_O_SPLIT,  /* W_UV per head (v, kv_lora + rope) on the grouped GEMV, then o_proj (dim, heads x v) */
} loom_mla_o_t;

typedef struct loom_model_options {
    int max_tokens;   /* most tokens in one step (prefill chunk + decodes) */
    int max_seqs;     /* most sequences in one step */
    int max_logits;   /* most rows that need logits in one step */
    /* Decode steps padded up to a batch-size bucket (1, 2, 4, then multiples
     * of 8) so that a handful of recorded graphs serve every batch size:
     * 0 where the backend records graphs, 1 always, -1 never. */
    int decode_buckets;
    /* KV cache elements: F32 (the zero value), BF16, I8 or F8_E4M3, as far
     * as the backend has kernels (loom_backend_kv_supported) */
    loom_dtype_t kv_dtype;
    /* 1: the layer-major KV layout even where the backend reads the
     * block-contiguous one (kv.c); for measuring the two against each other */
    int kv_layer_major;
    loom_allreduce_fn allreduce;
    void *allreduce_ctx;
    /* The hook only enqueues its collective on the backend's stream during
     * a forward pass (the nccl data plane's stream-ordered steps), so decode
     * steps with TP may be recorded into the backend's graphs too. */
    int allreduce_in_graphs;
    /* Matmul weights (q/k/v, o, gate/up, down, LM head) quantized on load
     * (quant NONE: the backend's float dtype); linears the checkpoint
     * already stores quantized are used as stored (docs/model-format.md). */
    loom_quant_spec_t quant;
    /* Mixture-of-Experts layers: the stage's TP ranks split the experts
     * (whole experts per rank) instead of slicing each expert */
    int expert_parallel;
    /* LoRA: adapter slots held at once (0: none) and their largest rank
     * (0: 16); see loom_model_lora_install */
    int max_loras;
    int max_lora_rank;
    /* DeepSeek-V3's MTP module as a draft (docs/speculative.md, MTP): the
     * shard is layer num_hidden_layers (spec layers [n_layers, n_layers + 1),
     * embedding and head); its input is eh_proj([enorm(embed(token)) ;
     * hnorm(h)]), h the rows the caller writes to loom_model_mtp_input()
     * before each forward, and its head is shared_head.norm and
     * shared_head.head (the target's lm_head when absent) */
    int mtp;
    /* opt.mtp: read the embedding table of this model (the target, on the
     * same backend, with its embedding) instead of loading a copy; it must
     * outlive this one. NULL: load it. */
    const struct loom_model *embed_from;
    /* MLA (DeepSeek): how a head's latent output reaches the residual,
     * worker/engine/attn_mla.c; AUTO picks the smaller in weights */
    loom_mla_o_t mla_o;
    /* MLA (DeepSeek) decompressed (`--disable-mla`, vLLM's VLLM_MLA_DISABLE):
     * per-head K (nope + rope) and V (v_head_dim) in the cache, the heads
     * split across TP ranks, ordinary paged attention for prefill and decode
     * (worker/engine/attn_mla_mha.c); backends with loom_backend_kv_v_dim
     * only. Ignored for the other families. */
    int mla_disable;
    /* MLA (DeepSeek) over the latent cache: a sequence with at least this
     * many consecutive rows in a step (a prefill chunk) attends decompressed,
     * per-head K and V from the cached latent, in context chunks merged by
     * log-sum-exp (worker/engine/attn_mla.c); fewer rows (decodes, a
     * speculative verify) stay absorbed. 0: LOOM_MLA_PREFILL_ROWS, else
     * the default (LOOM_MLA_PREFILL_ROWS_DEFAULT); < 0: always absorbed. The
     * CPU backend only (others: absorbed); the loaded model holds the
     * resolved value (0: absorbed). */
    int mla_prefill_rows;
} loom_model_options_t;

/* Loads this shard's weights from an opened checkpoint: only the slices it
 * owns are read. Progress is logged per layer. */
loom_status_t loom_model_load(loom_backend_t *be, const loom_model_config_t *cfg, loom_st_t *st,
                              const loom_shard_spec_t *spec, const loom_model_options_t *opt,
                              loom_model_t **out, loom_err_t *err);
void loom_model_destroy(loom_model_t **m_p);
/* What loom_model_load checks first, before allocating anything: config.json's
 * layer count and embedding shape against the checkpoint, and that every
 * tensor is one the architecture reads (or allow-listed, e.g.
 * rotary_emb.inv_freq); errors name the tensor. */
loom_status_t loom_model_check_checkpoint(const loom_model_config_t *cfg, const loom_st_t *st, loom_err_t *err);
/* Renames a checkpoint layout's tensors onto the names the loader reads:
 * the text model of a multimodal Gemma 3 (language_model.model.* or
 * model.language_model.* -> model.*, language_model.lm_head.* -> lm_head.*).
 * Call right after opening the checkpoint; nothing to do for other layouts. */
loom_status_t loom_model_map_tensor_names(const loom_model_config_t *cfg, loom_st_t *st, loom_err_t *err);

const loom_shard_dims_t *loom_model_dims(const loom_model_t *m);
const loom_model_config_t *loom_model_config(const loom_model_t *m);
size_t loom_model_weight_bytes(const loom_model_t *m);
/* Bytes of the matmul weights (codes, scales, mins): what a decode step reads. */
size_t loom_model_matmul_bytes(const loom_model_t *m);
/* The matmul bytes one decoded token reads: all of them for a dense model;
 * a Mixture of Experts reads its router and n_experts_per_tok of the
 * n_experts experts of each sparse layer (their expected share). */
size_t loom_model_active_bytes(const loom_model_t *m);
/* The KV cache's element type (opt.kv_dtype). */
loom_dtype_t loom_model_kv_dtype(const loom_model_t *m);
/* Bytes of KV cache one block takes on this shard (all its layers, K and V,
 * with the I8 scales). */
size_t loom_model_kv_block_bytes(const loom_model_t *m, int block_size);
/* Blocks the pool holds beyond the n_blocks plans address (the padding
 * rows' scratch block, see decode_buckets): 0 or 1. */
int loom_model_kv_scratch_blocks(const loom_model_t *m);
/* Allocates the paged KV pool: n_blocks blocks of block_size tokens. */
loom_status_t loom_model_alloc_kv(loom_model_t *m, int n_blocks, int block_size, loom_err_t *err);
int loom_model_kv_blocks(const loom_model_t *m);
/* Whether a block is one contiguous span of loom_model_kv_block_bytes
 * across all layers (kv.c), and where block `block` starts (NULL in the
 * layer-major layout or out of range). */
int loom_model_kv_block_contiguous(const loom_model_t *m);
void *loom_model_kv_block_ptr(const loom_model_t *m, int block);
/* Data-parallel attention (spec.dp_attention): of a plan's block copies,
 * those within this rank's partition, in its pool's ids, into lsrc / ldst
 * (n entries at most); returns how many. */
int loom_model_dp_copies(const loom_model_t *m, const int32_t *src, const int32_t *dst, int n, int32_t *lsrc,
                         int32_t *ldst);
/* Copies KV blocks src[i] -> dst[i] in every layer of the shard, scales
 * included (copy-on-write). */
void loom_model_copy_blocks(loom_model_t *m, const int32_t *src, const int32_t *dst, int n);
int loom_model_kv_block_size(const loom_model_t *m);
/* Called on the forward's thread before each of the shard's layers runs
 * (its index in the shard), so a layer can wait for its KV to arrive (the
 * worker's directory-tier loads, worker/kv_offload.h); NULL: none. Only
 * meaningful where ops run as they are issued (the CPU backend). */
void loom_model_set_layer_wait(loom_model_t *m, void (*fn)(void *ctx, int layer), void *ctx);
/* Enqueues the copies of block `block` to (to_host 1) or from (0) a host
 * span of loom_model_kv_block_bytes (loom_backend_host_alloc's memory),
 * between loom_backend_xfer_begin and _end: one copy in the
 * block-contiguous layout; in the layer-major one, per layer its K codes,
 * V codes and (I8) scales, packed in that order. */
void loom_model_kv_block_xfer(loom_model_t *m, int block, void *host, int to_host);
/* The host span loom_model_kv_block_xfer packs, per layer of the shard: K
 * codes, V codes, K scales, V scales, each piece (B, n_kv_heads, ...) token
 * major: *codes and *scales its pieces' bytes (padding included; *scales 0
 * without scales). Returns the arrays a layer keeps: 2 (K and V), 1 in the
 * latent layout (MLA: one array, its codes then its scales), 0 where V's
 * rows are narrower than K's (decompressed MLA: not packed this way). */
int loom_model_kv_span_pieces(const loom_model_t *m, size_t *codes, size_t *scales);

/* One step's batch. All arrays are host memory. */
typedef struct loom_step_batch {
    int n_tokens;
    const int32_t *tokens;       /* (n_tokens) token ids; used by the first stage */
    const int32_t *pos;          /* (n_tokens) positions */
    const int32_t *slots;        /* (n_tokens) KV slot = block * B + offset */
    const int32_t *tok_seq;      /* (n_tokens) row of block_tables */
    int n_seqs;
    const int32_t *block_tables; /* (n_seqs, max_blocks) */
    int max_blocks;
    int n_logits;                /* rows needing logits (last stage) */
    const int32_t *logit_rows;   /* (n_logits) token indices */
    const int32_t *seq_lora;     /* (n_seqs) adapter slot of each sequence, -1 none; NULL: none at all */
    /* spec.dp_attention: (n_seqs) the TP rank owning each sequence; the slots and block ids are then the
     * plan's, rank r's in [r n_blocks, (r + 1) n_blocks) (worker/engine/attn_dp.c) */
    const int32_t *seq_dp_rank;
} loom_step_batch_t;

/* Runs the shard's layers over the batch. On the first stage the input is
 * the token ids; on later stages it is loom_model_hidden(), filled by the
 * caller (received from the previous stage). Afterwards loom_model_hidden()
 * holds the output hidden states (n_tokens, dim) and, on the last stage,
 * loom_model_logits() holds (n_logits, dims.vocab) logits. */
loom_status_t loom_model_forward(loom_model_t *m, const loom_step_batch_t *b, loom_err_t *err);
float *loom_model_hidden(loom_model_t *m); /* device (max_tokens, dim) */
float *loom_model_logits(loom_model_t *m); /* device (max_logits, dims.vocab) */

/* Reduces the last forward's logits to sampling parts (host), one per logit
 * row, with room for loom_sample_k candidates each (see kernels/sampling.h). */
void loom_model_sample_parts(loom_model_t *m, int n_rows, const loom_sampling_t *params,
                             const uint64_t *steps, loom_sample_part_t *parts);
/* Last stage: sums the final-normed hidden states (the LM head's input) of
 * tokens [t0, t1) of the last forward into out (host, dim floats). After
 * the logits are taken (it reuses the head's input buffer). */
void loom_model_pool_hidden(loom_model_t *m, int t0, int t1, float *out);
/* Last stage: the final-normed hidden states of tokens [t0, t1) of the last
 * forward into out (host, (t1 - t0) x dim): what an MTP draft reads. Leaves
 * the logits alone (it reuses the head's input buffer). */
void loom_model_normed_rows(loom_model_t *m, int t0, int t1, float *out);
/* opt.mtp: the (max_tokens, dim) device rows of h, one per token, that the
 * next forward reads; written by the caller (loom_backend_upload). */
float *loom_model_mtp_input(loom_model_t *m);
/* Last stage, after the last forward's logits are used (it overwrites them
 * and the head's input buffer): the LM head at tokens rows[0..n_rows) of
 * that forward (n_rows at most max_logits), into loom_model_logits(). */
void loom_model_head_rows(loom_model_t *m, const int32_t *rows, int n_rows);
int loom_model_max_logits(const loom_model_t *m);
/* Rows the last forward added to reach its bucket (0 when not padded). */
int loom_model_last_pad(const loom_model_t *m);
/* opt.mla_prefill_rows as the model resolved it for its backend: runs of
 * that many rows or more attend decompressed over the latent cache; 0 when
 * prefill stays absorbed (also for models without MLA). */
int loom_model_mla_prefill_rows(const loom_model_t *m);
/* LoRA adapters (docs/lora.md). An adapter read for this shard's layers
 * (loom_lora_load) is prepared on the host, off the compute thread if the
 * caller likes -- cut into this shard's TP layout (column-parallel q, k,
 * v, gate, up: B's rows as W's, with partial rotary's permutation on q and
 * k; row-parallel o, down: A's columns as W's) -- then installed into one
 * of the opt.max_loras slots between steps. A step's sequences name their
 * slot in loom_step_batch_t.seq_lora. Prepare refuses a rank above
 * max_lora_rank and adapters on MoE experts. */
typedef struct loom_lora_prepared loom_lora_prepared_t;
loom_status_t loom_model_lora_prepare(const loom_model_t *m, const loom_lora_adapter_t *a, loom_lora_prepared_t **out,
                                      loom_err_t *err);
void loom_lora_prepared_destroy(loom_lora_prepared_t **p_p);
size_t loom_lora_prepared_bytes(const loom_lora_prepared_t *p);
loom_status_t loom_model_lora_install(loom_model_t *m, int slot, const loom_lora_prepared_t *p, loom_err_t *err);
/* Empties a slot: its rows get no delta. */
void loom_model_lora_clear(loom_model_t *m, int slot);
int loom_model_max_loras(const loom_model_t *m);

/* Downloads the logits of the last forward (n_logits x dims.vocab) to host. */
void loom_model_download_logits(loom_model_t *m, float *dst, int n_rows);

#endif
