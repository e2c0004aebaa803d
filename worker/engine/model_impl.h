/* The engine's internals, shared by the blocks (worker/engine/) and the
 * families (worker/arch/); worker/model.h is the public face. The
 * structs a shard is made of -- its layers, its feed-forward blocks, the
 * loader's state, one step's device metadata -- and the functions of each
 * block, one prefix a module:
 *   load.c    loom_load_*      checkpoint reads, uploads, TP slices, linears
 *   check.c   loom_check_*     tensor names against the family's table
 *   kv.c      loom_kvpool_*    the paged KV pool (its layout lives there only)
 *   linear.c  loom_blk_linear* every projection of every family
 *   attn.c    loom_blk_attn*   qkv -> bias -> q/k norm -> RoPE + KV write -> attention -> o
 *   ffn.c     loom_blk_ffn*    the dense gated MLP
 *   moe.c     loom_blk_moe*    Mixture-of-Experts blocks
 *   lora.c    loom_blk_lora    adapter slots, their preparation and deltas
 *   attn_dp.c loom_blk_attn_dp data-parallel attention around an attention block
 *   attn_mla.c, attn_mla_mha.c  DeepSeek's MLA, absorbed over the latent or decompressed
 * See docs/architecture.md (the engine's source map). */
#ifndef LOOM_MODEL_IMPL_H
#define LOOM_MODEL_IMPL_H

#include "worker/model.h"
#include "worker/engine/arch.h"

/* The feed-forward block of a layer: the dense gated MLP
 * down(act(gate(x)) * up(x)), or a Mixture of Experts (Mixtral, Qwen3-MoE):
 * a router picks n_experts_per_tok experts per token and the block's output
 * is their MLPs' outputs weighted by the router. The layer loop calls
 * loom_blk_ffn() and does not look inside. */
typedef struct loom_ffn {
    loom_weight_t w13; /* dense: (2*hidden, dim): gate rows then up rows */
    loom_weight_t w2;  /* dense: (dim, hidden): this rank's input columns */
    int moe;              /* a Mixture of Experts: the fields below, not w13 / w2 */
    loom_weight_t router; /* (n_experts, dim), float, replicated on every rank */
    loom_weight_t *e13;   /* (n_experts) each (2*moe_hn, dim); only the held experts are loaded */
    loom_weight_t *e2;    /* (n_experts) each (dim, moe_hn) */
    /* Qwen2-MoE's shared expert, added to every token scaled by
     * sigmoid(shared_gate . x); TP-sliced as a dense MLP in both modes */
    loom_weight_t s13;    /* (2*shared_hn, dim) */
    loom_weight_t s2;     /* (dim, shared_hn) */
    loom_weight_t sgate;  /* (1, dim), float, replicated */
    /* the backend's tables of the E experts for its batched expert GEMV
     * (loom_backend_moe_table), used by decode steps of up to dev_n tokens */
    void *t13, *t2;
    int dev_n;
    int swiglu_clamp; /* GPT-OSS: the experts' activation is the clamped SwiGLU (swiglu_alpha/limit) */
    /* GPT-OSS: the router's bias (n_experts), and each expert's biases: of
     * its gate then up rows (n_experts, 2*moe_hn), and of its down rows
     * (n_experts, dim; on the rank whose slice starts at 0, so it is added
     * once). NULL for the other families. */
    float *rbias, *b13, *b2;
    /* DeepSeek (worker/moe_ds.c routes): e_score_correction_bias (n_experts) on the host, or NULL; the
     * shared experts (s13, s2) are added ungated */
    float *ds_bias;
    float *d_ds_bias; /* its device copy, where the backend routes DeepSeek's decode steps (loom_op_moe_route_ds) */
} loom_ffn_t;

typedef struct loom_layer {
    float *attn_norm;   /* (dim) */
    loom_weight_t wqkv; /* (qkv_dim, dim): this rank's q heads, then k heads, then v heads */
    float *bqkv;        /* (qkv_dim) the same rows' biases (Qwen2), or NULL */
    float *q_norm;      /* (hd) per-head RMSNorm gain of q (Qwen3), or NULL */
    float *k_norm;      /* (hd) the same for k */
    float *sinks;       /* (n_heads) GPT-OSS: this rank's heads' attention sinks, or NULL */
    float *bo;          /* (dim) GPT-OSS: o_proj's bias, on TP rank 0 only (added once), or NULL */
    int window;         /* attention window in positions; 0 = full attention */
    loom_weight_t wo;   /* (dim, n_heads*hd): this rank's input columns */
    float *ffn_norm;    /* (dim) */
    float *post_attn_norm; /* (dim) Gemma: norm of the attention output before the residual add, or NULL */
    float *post_ffn_norm;  /* (dim) Gemma: the same for the feed-forward output */
    const float *inv_freq; /* RoPE table of this layer (Gemma's sliding layers have their own) */
    loom_ffn_t ffn;
    loom_kv_layer_t kv; /* (n_blocks, B, n_kv_heads, hd) K and V in opt.kv_dtype */
    /* MLA (worker/engine/attn_mla.c): the latent's projection, (z_dim, dim): q_a_proj (or this rank's
     * q_proj rows) then kv_a_proj_with_mqa; q_norm / k_norm above hold q_a_layernorm / kv_a_layernorm */
    loom_weight_t wkv_a;
    /* MLA with LOOM_MLA_O_SPLIT: W_UV of each of this rank's heads, (v, kv_lora + rope) with zero rope
     * columns, and their grouped-GEMV table; wo is then o_proj's slice (dim, n_heads * v) */
    loom_weight_t *mla_uv;
    void *mla_uv_table;
    /* MLA decompressed (opt.mla_disable, attn_mla_mha.c): q_a_proj (q_lora_rank, dim) alone (wkv_a is then
     * kv_a_proj_with_mqa alone, wqkv the q heads from it), and kv_b_proj's k and v heads of this rank
     * (n_heads (qk + v), kv_lora + rope) */
    loom_weight_t mla_q_a, mla_kv_b;
    /* MLA's decompressed prefill (opt.mla_prefill_rows, attn_mla.c): this rank's query heads unabsorbed,
     * (n_heads qk, z_dim) from z; each head's K (nope from W_UK, the cached roped rope key) and V
     * (W_UV) from a cache row, (n_heads qk, head_dim) and (n_heads v, head_dim) */
    loom_weight_t mla_dq, mla_dk, mla_dv;
} loom_layer_t;

struct loom_model {
    loom_backend_t *be;
    const loom_arch_t *arch; /* the family: its tensor names, layer and head (worker/arch/) */
    loom_model_config_t cfg;
    loom_shard_spec_t spec;
    loom_shard_dims_t dims;
    loom_model_options_t opt;
    int qkv_dim; /* (n_heads + 2 * n_kv_heads) * hd */
    void (*layer_wait)(void *ctx, int layer); /* loom_model_set_layer_wait */
    void *layer_wait_ctx;

    /* weights (device) */
    float *embed;         /* (vocab, dim), first stage */
    int embed_borrowed;   /* embed is opt.embed_from's (not freed here) */
    loom_layer_t *layers; /* (dims.n_layers) */
    float *final_norm;    /* (dim), last stage */
    loom_weight_t lm_head; /* (dims.vocab, dim), last stage */
    /* opt.mtp: the MTP module's input stage */
    float *mtp_enorm, *mtp_hnorm;      /* (dim) each */
    loom_weight_t mtp_eh_e, mtp_eh_h;  /* (dim, dim) each: eh_proj's embedding and hidden halves */
    float *mtp_in;                     /* (max_tokens, dim) activations: the caller's h rows */
    float *mla_dec;      /* MLA's decompressed prefill: its scratch (attn_mla.c), allocated on first use */
    int mla_dec_chunk;   /* context tokens decompressed at a time */
    int32_t *mla_dec_pos; /* (max_tokens) host: a chunk's query positions before their upload */
    int32_t *mla_sel;                  /* MLA split: (max_tokens * n_heads) device, pair p reads head p % n_heads */
    const int32_t *mtp_pos;            /* host positions of the step's rows (a row at 0 reads no embedding) */
    int mtp_n;                         /* the step's rows before padding */
    float *inv_freq;       /* (hd / 2) */
    float *inv_freq_local; /* (hd / 2) Gemma 3's sliding layers: rope_local_base_freq, unscaled; or NULL */
    size_t weight_bytes;
    size_t matmul_bytes; /* of the matmul weights */
    size_t expert_bytes; /* of them, the held experts' (a token reads k/E of these) */
    int n_quantized;     /* matmul weights stored quantized */

    /* KV pool; with decode buckets one more block, after the n_blocks the
     * plans address, takes the padding rows' keys and values */
    int n_blocks, block_size;
    int scratch_block; /* -1 when decode steps are not padded */
    int last_pad;      /* rows the last forward padded */
    void *kv_mem;

    /* activations (device), sized for opt.max_tokens */
    float *x;      /* (T, dim) residual stream */
    float *xb;     /* (T, dim) normed input */
    float *xb2;    /* (T, dim) projection output before all-reduce */
    float *qkv;    /* (T, qkv_dim) */
    float *att;    /* (T, n_heads*hd) */
    float *gu;     /* (T, 2*hidden) */
    float *hb;     /* (T, hidden) */
    float *xl;     /* (max_logits, dim) */
    float *logits; /* (max_logits, vocab) */
    float *mla_z;  /* (T, z_dim) MLA: the latent projection (loom_blk_attn_mla_zdim) */
    /* data-parallel attention (spec.dp_attention, attn_dp.c) */
    float *dp_xb, *dp_xb2; /* (T, dim) this rank's rows of xb, and their attention output */
    float *dp_one;         /* (T) 1.0: the scatter's weights */
    int32_t *dp_host;      /* host: the step's sub-batch metadata (loom_blk_attn_dp_batch) */
    size_t dp_host_cap;
    int *dp_seq_map;       /* host (n_seqs): each sequence's index in the sub-batch, -1: another rank's */
    int dp_seq_cap;

    /* step metadata: host staging and its device copy */
    int *sample_k; /* (max_logits) candidates per row */
    int32_t *meta_host;
    int32_t *meta_dev;
    size_t meta_cap; /* int32 entries */

    /* Mixture of Experts. With plain TP every rank holds every expert, its
     * intermediate rows [moe_hb, moe_hb+moe_hn) sliced like a dense MLP's;
     * with expert parallelism it holds whole experts [expert_begin,
     * expert_end). Either way the rank's partial sums meet in the MLP's
     * all-reduce. Routing runs on the host (the CPU backend's memory). */
    int expert_begin, expert_end;
    int moe_hb, moe_hn;
    int shared_hb, shared_hn; /* the shared expert's slice of shared_expert_intermediate_size */
    float *sgl;     /* (T) shared-expert gate logits (device) */
    float *h_sg;    /* (T) host: the same */
    float *rl;      /* (T, n_experts) router logits (device) */
    float *xg;      /* (T k, dim) the routed rows, grouped by expert, then their outputs (device) */
    float *mgu;     /* (T k, 2 moe_hn) their gate/up rows (device) */
    float *mhb;     /* (T k, moe_hn) their activations (device) */
    int32_t *d_rows; /* (T k) token of each routed row (device) */
    int32_t
        *d_pos;  /* (T k) row of xg of each (token, choice), -1: another rank's expert (device) */
    float *d_pw; /* (T k) its weight (device) */
    int32_t *d_sel;   /* (T k) decode on the device: the chosen experts */
    float *d_w;       /* (T k) and their weights */
    int32_t *d_ident; /* (T k) 0, 1, 2, ...: pair p's output is row p */
    int moe_device_n; /* every MoE layer runs decode steps of up to this many tokens without the
                         host */
    int32_t *h_pos;   /* (T k) host: d_pos */
    float *h_pw;      /* (T k) host: d_pw */
    int32_t *h_fill;  /* (T) host: choices of each token placed so far */
    float *h_probs;   /* (T, n_experts) host: router probabilities */
    int32_t *h_sel; /* (T, k) chosen experts */
    float *h_w;     /* (T, k) their weights */
    int32_t *h_cnt; /* (n_experts + 1) CSR offsets of the rows routed to each expert */
    int32_t *h_rows; /* (T * k) token of each routed row, grouped by expert */
    float *h_rw;     /* (T * k) its router weight */

    /* LoRA adapter slots (lora.c): lora_tab (n_layers, LOOM_LORA_N_TARGETS,
     * max_loras) each slot's A (r, in) and Bt (r, out) for one projection,
     * in lora_mem[slot] (device; rank up to opt.max_lora_rank) */
    loom_lora_op_slot_t *lora_tab;
    float **lora_mem;
    struct loom_blk_adapters {
        const int32_t *d_row_slot; /* (T) adapter slot of each row, -1 none (device) */
    } lora_step;
};

/* ---- loading ------------------------------------------------------------ */

typedef struct loom_loader {
    loom_model_t *m;
    loom_st_t *st;
    float *tmp; /* host staging for one fused matrix */
    size_t tmp_cap;
    int64_t rotary_rows; /* partial rotary: the first rows of the linear being loaded are q and k heads */
} loom_loader_t;


/* How a float linear's input columns [c0, c0+nc) of cols are read and
 * quantized: the scheme (a 4-bit group that does not divide cols falls back
 * to int8, logged), and the columns [rc0, rc0+rnc) to read: per-channel
 * schemes (int8, fp8) quantize whole rows before taking the columns, so
 * every grid gets the same scales; 4-bit groups are local, so a rank
 * quantizes only its columns, which must be whole groups. */
typedef struct float_cols {
    loom_quant_spec_t q;
    int64_t cols, c0, nc;
    int whole_rows;
    int64_t rc0, rnc;
} loom_float_cols_t;


/* One stored linear (its name without ".weight") and the block of its rows
 * (output features) this shard takes. */
typedef struct lin_part {
    const char *prefix;
    int64_t rows, r0, nr;
} loom_lin_part_t;


/* Per-request low-rank deltas (LoRA adapters) for one step: the adapter
 * slot of every row (struct loom_model's lora_step); every projection
 * takes them (loom_blk_linear). */
typedef struct loom_blk_adapters loom_blk_adapters_t;

/* Device pointers and sizes of one step's ops (see loom_model_forward). */
typedef struct loom_step_ops {
    int n, nl, max_blocks, max_ctx;
    const int32_t *d_tok, *d_pos, *d_slots, *d_seq, *d_rows, *d_bt;
    const int32_t *h_pos, *h_seq; /* host copies of d_pos and d_seq (n each): for choices made between ops */
    const loom_blk_adapters_t *adapters; /* the step's low-rank deltas per row: NULL when no row has one */
    /* data-parallel attention (attn_dp.c): this rank's sub-batch, whose ops the attention block runs on
     * (NULL: none); its tokens' rows of the batch (dp->n of them), and each batch row's index among them
     * or -1 (n) */
    const struct loom_step_ops *dp;
    const int32_t *d_dp_rows, *d_dp_at;
    int local; /* these are a sub-batch's ops: the attention's o_proj is not all-reduced (attn_dp.c is) */
} loom_step_ops_t;

/* ---- attn_dp.c: data-parallel attention ---------------------------------- */
/* This rank's share of a step (spec.dp_attention): its tokens and sequences, the most position, and the
 * int32 entries of its metadata, built in the model's host buffer dp_host. */
typedef struct loom_dp_batch {
    int n, n_seqs, max_pos;
    size_t n_meta;
} loom_dp_batch_t;
/* Picks the batch's sequences this rank owns (b->seq_dp_rank) and translates their slots and block ids
 * from the plan's (rank r's partition [r n_blocks, (r + 1) n_blocks)) to its pool's; an id of theirs
 * outside its partition is refused. */
loom_status_t loom_blk_attn_dp_batch(loom_model_t *m, const loom_step_batch_t *b, loom_dp_batch_t *dp,
                                     loom_err_t *err);



/* ---- load.c: the loader ---------------------------------------------- */
float *loom_load_staging(loom_loader_t *L, size_t n);
loom_status_t loom_load_check_finite(const float *x, size_t n, const char *name, const char *file, loom_err_t *err);
/* Rows [r0, r0+nr) x cols [c0, c0+nc) of a (rows, cols) tensor (cols 0: a vector of rows) into dst. */
loom_status_t loom_load_read_block(loom_loader_t *L, const char *name, int64_t rows, int64_t cols, int64_t r0,
                                   int64_t nr, int64_t c0, int64_t nc, float *dst, loom_err_t *err);
/* Elements [e0, e0+ne) of a 1-D tensor of n elements into dst. */
loom_status_t loom_load_read_slice(loom_loader_t *L, const char *name, int64_t n, int64_t e0, int64_t ne, float *dst,
                                   loom_err_t *err);
loom_status_t loom_load_upload_host(loom_loader_t *L, const float *h, size_t n, float **out, const char *what,
                                    loom_err_t *err);
loom_status_t loom_load_upload_vec_add(loom_loader_t *L, const char *name, int64_t n, float add, float **out,
                                       loom_err_t *err);
loom_status_t loom_load_upload_weight(loom_loader_t *L, loom_weight_t *w, int64_t rows, int64_t cols,
                                      const char *what, loom_err_t *err);
loom_status_t loom_load_upload_qweight(loom_loader_t *L, loom_weight_t *w, const loom_qtensor_t *t,
                                       const char *what, loom_err_t *err);
/* An RMSNorm gain (Gemma's (1 + w) folded in). */
loom_status_t loom_load_upload_norm(loom_loader_t *L, const char *name, int64_t n, float **out, loom_err_t *err);
void loom_load_rotary_permute_f32(float *h, int64_t nrows, int64_t cols, int hd, int rd, float af);
loom_status_t loom_load_float_cols(loom_loader_t *L, const char *what, int64_t cols, int64_t c0, int64_t nc,
                                   loom_float_cols_t *fc, loom_err_t *err);
loom_status_t loom_load_upload_float_linear(loom_loader_t *L, loom_weight_t *w, const char *what,
                                            const loom_float_cols_t *fc, int64_t rows, loom_err_t *err);
loom_status_t loom_load_linear(loom_loader_t *L, loom_weight_t *w, const char *what, const loom_lin_part_t *parts,
                               int n, int64_t cols, int64_t c0, int64_t nc, loom_err_t *err);
loom_status_t loom_load_align_split(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                                    const loom_model_options_t *opt, int hidden, int *begin, int *len,
                                    loom_err_t *err);
loom_status_t loom_load_align_hidden_split(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                                           const loom_model_options_t *opt, loom_shard_dims_t *d, loom_err_t *err);
void loom_load_scale_embedding(float *h, size_t n, float scale, loom_dtype_t dt);
uint64_t loom_load_read_estimate(const loom_model_config_t *cfg, const loom_st_t *st, const loom_shard_spec_t *spec);
/* The name of a role's tensor in the family's table at global layer gl
 * into buf (loom_arch_tensor_name); a role the family lacks is a bug. */
const char *loom_load_name(loom_loader_t *L, int gl, loom_tn_role_t role, int expert, char *buf, size_t size);

/* ---- linear.c: every projection ---------------------------------------- */
/* Which projection a call is: what an adapter targets. */
typedef enum {
    LOOM_PROJ_QKV,
    LOOM_PROJ_O,
    LOOM_PROJ_GATE_UP,
    LOOM_PROJ_DOWN,
    LOOM_PROJ_ROUTER,
    LOOM_PROJ_EXPERT_GATE_UP,
    LOOM_PROJ_EXPERT_DOWN,
    LOOM_PROJ_SHARED_GATE,
    LOOM_PROJ_SHARED_GATE_UP,
    LOOM_PROJ_SHARED_DOWN,
    LOOM_PROJ_LM_HEAD,
    LOOM_PROJ_MTP_EH, /* the MTP module's eh_proj halves */
} loom_proj_t;

/* One projection y(n, w.rows) = x(n, w.cols) . W^T (+ bias), all-reduced
 * over the TP ranks when row-parallel. */
typedef struct loom_blk_linear {
    const loom_weight_t *w;
    const float *bias; /* (w.rows) added to every row, or NULL */
    int reduce;        /* row-parallel (o, down): all-reduce the partial sums */
    loom_proj_t proj;
    int layer;         /* the shard's layer index; -1 for the LM head */
    int expert;        /* the expert, or -1 */
} loom_blk_linear_t;

loom_status_t loom_blk_allreduce(loom_model_t *m, float *buf, int64_t n, loom_err_t *err);
loom_status_t loom_blk_linear(loom_model_t *m, const loom_blk_adapters_t *ad, const loom_blk_linear_t *lin,
                              float *y, const float *x, int n, loom_err_t *err);
/* The batched expert GEMV (loom_op_moe_gemv) over the backend's table of
 * a layer's experts: lin->w is one of them (their shape and dtype). */
void loom_blk_linear_experts(loom_model_t *m, const loom_blk_adapters_t *ad, const loom_blk_linear_t *lin,
                             float *y, const float *x, int xdiv, const int32_t *sel, int n_pairs,
                             const void *table);

/* ---- lora.c: adapter slots -------------------------------------------- */
/* The slots opt.max_loras asks for (none: nothing), after the layers load. */
loom_status_t loom_model_lora_alloc(loom_model_t *m, loom_err_t *err);
void loom_model_lora_free(loom_model_t *m);
/* y += each row's adapter delta for the projection lin (its parts' column
 * ranges for fused qkv and gate/up); before the row-parallel all-reduce. */
void loom_blk_lora(loom_model_t *m, const loom_blk_adapters_t *ad, const loom_blk_linear_t *lin, float *y,
                   const float *x, int n);

/* ---- attn.c: the attention block --------------------------------------- */
/* q/k/v (stacked, this rank's heads; biases, partial rotary), q/k norms, the window, o. */
loom_status_t loom_blk_attn_load(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err);
/* xb (normed input) -> xb2: qkv -> bias -> q/k norm -> RoPE + KV write ->
 * attention (window, sinks, soft cap) -> o (+ bias) -> all-reduce. */
loom_status_t loom_blk_attn(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err);
/* The RoPE table (head_dim / 2 frequencies) of a config. */
void loom_blk_attn_rope_table(const loom_model_config_t *c, float *out);

/* ---- attn_mla.c: multi-head latent attention (DeepSeek-V2/V3) ----------- */
/* Columns of the latent projection's output: (q_lora_rank, or this rank's q heads) + kv_lora + rope. */
int loom_blk_attn_mla_zdim(const loom_model_config_t *c, const loom_shard_dims_t *d);
loom_status_t loom_blk_attn_mla_load(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err);
/* xb (normed input) -> xb2, all-reduced. */
loom_status_t loom_blk_attn_mla(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err);
/* opt.mla_prefill_rows resolved for this model and backend (0: prefill stays absorbed). */
int loom_blk_attn_mla_prefill_rows(const loom_model_t *m, const loom_model_options_t *opt);
/* Slot s of a head of hd = other + rope dims: *is_rope = 1 and *idx the rope dim for the RoPE pairs' slots
 * (pair j at j and j + hd/2, j < rope/2; the checkpoint's pair j is (2j, 2j+1) interleaved, else (j, j +
 * rope/2)), else *is_rope = 0 and *idx the other (latent, or nope) dim. */
void loom_blk_attn_mla_slot(int hd, int rope, int interleave, int s, int *is_rope, int *idx);

/* ---- attn_mla_mha.c: MLA decompressed (opt.mla_disable) ---------------- */
/* q and per-head k, v from the latent through kv_b_proj, this rank's heads; the cache per-head K (nope +
 * rope) and V (v_head_dim). */
loom_status_t loom_blk_attn_mla_mha_load(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err);
/* xb (normed input) -> xb2, all-reduced: ordinary paged MHA. */
loom_status_t loom_blk_attn_mla_mha(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err);

/* ---- ffn.c: the feed-forward block ------------------------------------- */
/* The dense gated MLP: gate/up (column-parallel, stacked) and down (row-parallel). */
loom_status_t loom_blk_ffn_load(loom_loader_t *L, int gl, loom_ffn_t *f, loom_err_t *err);
/* xb (normed input) -> xb2, all-reduced: the dense MLP or the layer's MoE block. */
loom_status_t loom_blk_ffn(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err);
/* Closes layer l: x += xb2, and xb = the next layer's attention norm of x
 * (fused), or just the add after the last layer. */
void loom_blk_ffn_residual(loom_model_t *m, const loom_step_ops_t *so, int l);
/* The pre-norm decoder block most families share (Llama's): the layer's
 * attention block ATTN (loom_blk_attn, loom_blk_attn_mla), the residual add
 * fused with the feed-forward norm, the feed-forward block, its residual. */
typedef loom_status_t (*loom_blk_attn_fn)(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err);
loom_status_t loom_blk_prenorm_layer(loom_model_t *m, const loom_step_ops_t *so, int l, loom_blk_attn_fn attn,
                                     loom_err_t *err);
/* Data-parallel attention's block around ATTN: xb's own rows gathered, ATTN on them (so->dp), the output
 * scattered into zeroed rows of xb2 and all-reduced. */
loom_status_t loom_blk_attn_dp(loom_model_t *m, const loom_step_ops_t *so, int l, loom_blk_attn_fn attn,
                               loom_err_t *err);
/* That block's two norms (before attention, before the feed-forward block). */
loom_status_t loom_blk_prenorm_load_norms(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err);

/* ---- moe.c: Mixture-of-Experts blocks ----------------------------------- */
loom_status_t loom_blk_moe_split(loom_model_t *m, loom_err_t *err);
/* Mixtral / Qwen-MoE layout: router, held experts (and a shared expert) */
loom_status_t loom_blk_moe_load(loom_loader_t *L, int gl, loom_ffn_t *f, loom_err_t *err);
loom_status_t loom_blk_moe_tables(loom_model_t *m, loom_err_t *err);
loom_status_t loom_blk_moe(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err);

#endif
