/* A whole model in this process on one backend, running one sequence at a
 * time: what `loom run`, the reference tests and the decode benchmark use;
 * and, with several sequence slots, the draft model of speculative decoding
 * (loom_local_propose), in `loom run` and in the coordinator. */
#ifndef LOOM_LOCAL_H
#define LOOM_LOCAL_H

#include <stdint.h>

#include "common/model_config.h"
#include "common/spec.h"
#include "common/spec_gate.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "kernels/backend.h"
#include "worker/model.h"

typedef struct loom_local_options {
    const char *model_dir;
    const char *device;      /* "cpu" (default), "cuda:N" */
    int n_threads;           /* 0 = all cores */
    int chunk;               /* prefill chunk in tokens (default 256) */
    int ctx;                 /* context to allocate KV for (0 = the model's maximum) */
    loom_dtype_t weight_dtype; /* F32 default on CPU */
    loom_quant_spec_t quant;   /* matmul weights quantized on load (kernels/quant.h); zero: none */
    const char *kv_cache_dtype; /* auto (NULL), f32, bf16, int8, fp8: see loom_backend_kv_resolve */
    int kv_layer_major;         /* loom_model_options_t.kv_layer_major (benchmarks) */
    int no_tokenizer;        /* skip tokenizer.json (benchmarks on generated models) */
    loom_spec_config_t spec; /* speculative decoding (method OFF, the zero value: none); see common/spec.h */
    /* method DRAFT: the draft model's directory (NULL: the target's own, a
     * quantized self-draft) and its quantization on load */
    const char *draft_model_dir;
    loom_quant_spec_t draft_quant;
    int n_slots; /* sequences whose KV is kept at once, for loom_local_propose (0: 1) */
    const char *lora_dir; /* a PEFT LoRA adapter applied to every sequence, or NULL */
    int max_lora_rank;    /* the largest rank it may have (0: 16) */
    loom_mla_o_t mla_o;   /* loom_model_options_t.mla_o (tests: each way) */
    int mla_disable;      /* loom_model_options_t.mla_disable: DeepSeek's MLA decompressed (--disable-mla) */
    int mla_prefill_rows; /* loom_model_options_t.mla_prefill_rows: MLA's prefill decompressed (0: the default) */
} loom_local_options_t;

typedef struct loom_local loom_local_t;

typedef struct loom_gen_stats {
    int prompt_tokens;
    int gen_tokens;
    double prefill_s; /* prompt in, first token out (time to first token) */
    double decode_s;  /* the remaining tokens */
    double decode_cpu_s; /* the process's CPU time over decode_s (what a loaded machine's waits do not count) */
    loom_spec_stats_t spec; /* target steps and (with speculation) drafts and acceptance */
    loom_spec_gate_t gate;  /* the wall-time gate at the end (common/spec_gate.h) */
    /* method DRAFT: the draft model's forwards in this call (the start-up
     * estimate's, catch-ups and drafting steps) and the tokens they read;
     * the most tokens a catch-up read in a probe of the gate */
    int64_t draft_forwards, draft_tokens;
    int draft_probe_read;
} loom_gen_stats_t;

/* An engine's forwards since it opened and the tokens they read; last_read:
 * the tokens the last loom_local_propose's catch-up read, max_read the most
 * any did. */
typedef struct loom_local_counters {
    int64_t forwards, tokens;
    int last_read, max_read;
} loom_local_counters_t;

/* Called for each generated id; return nonzero to stop. */
typedef int (*loom_token_fn)(void *ctx, int32_t id);

loom_status_t loom_local_open(const loom_local_options_t *opt, loom_local_t **out, loom_err_t *err);
void loom_local_close(loom_local_t **l_p);

const loom_model_config_t *loom_local_config(const loom_local_t *l);
const loom_tokenizer_t *loom_local_tokenizer(const loom_local_t *l); /* NULL with no_tokenizer */
loom_model_t *loom_local_model(loom_local_t *l);
int loom_local_ctx(const loom_local_t *l);

/* Prefills the prompt (in chunks) then generates up to max_new tokens,
 * with speculation when the options ask for it (the same ids either way),
 * stopping early at an EOS id (unless ignore_eos) or when on_token says so.
 * prompt_logits, when not NULL, receives the logits of every prompt
 * position (n_prompt x vocab). Errors: an empty prompt, or a prompt that
 * does not fit the context, is LOOM_ERR_INVALID_ARGUMENT. */
loom_status_t loom_local_generate(loom_local_t *l, const int32_t *prompt, int n_prompt, int max_new,
                                  const loom_sampling_t *s, int ignore_eos, loom_token_fn on_token,
                                  void *ctx, float *prompt_logits, loom_gen_stats_t *stats,
                                  loom_err_t *err);

/* Runs tokens[0..n) as a new sequence from position 0 (replacing whatever
 * the cache held) and writes the logits of every position to logits
 * (n x vocab, host). n must fit the context: LOOM_ERR_INVALID_ARGUMENT
 * otherwise, or for ids outside the vocabulary. */
loom_status_t loom_local_logits(loom_local_t *l, const int32_t *tokens, int n, float *logits,
                                loom_err_t *err);
/* Method MTP: the module's draft logits for tokens[0..n) run as a new
 * sequence: row t (0 .. n-2) reads the target's final-normed row at t and
 * tokens[t + 1], and guesses tokens[t + 2]; (n - 1) x vocab into logits.
 * n is 2 .. the prefill chunk; LOOM_ERR_INVALID_ARGUMENT otherwise or
 * without method MTP. */
loom_status_t loom_local_mtp_logits(loom_local_t *l, const int32_t *tokens, int n, float *logits,
                                    loom_err_t *err);
/* Greedy drafts for speculative decoding: sequence slot `slot` (0 ..
 * loom_local_slots - 1) catches up with hist[0..n_hist), reusing the KV of
 * the longest prefix of it that the slot already holds (so a slot follows
 * one sequence at the cost of its new tokens, rejected drafts included, and
 * any other history is simply recomputed), then proposes up to k tokens into
 * out. Returns how many (fewer when the context ends; 0 for an empty
 * history), or a negative status (ids outside the vocabulary). The slot
 * shares the weights of every other; slot 0 is also the one
 * loom_local_generate runs on. */
int loom_local_propose(loom_local_t *l, int slot, const int32_t *hist, int n_hist, int k,
                       int32_t *out, loom_err_t *err);
/* The same with a catch-up of at most `window` tokens (0: no limit): when
 * the slot misses more than that of hist, it starts over with the last
 * `window` ids of hist as its sequence (from position 0) and drafts from
 * attention within them; later calls continue that sequence while it
 * stays a run of hist. A draft: what it proposes may differ from the
 * unwindowed drafts, never the target's output. */
int loom_local_propose_window(loom_local_t *l, int slot, const int32_t *hist, int n_hist, int k, int window,
                              int32_t *out, loom_err_t *err);
loom_local_counters_t loom_local_counters(const loom_local_t *l);
/* The slot holds nothing any more (its sequence ended). */
void loom_local_forget(loom_local_t *l, int slot);
int loom_local_slots(const loom_local_t *l);
/* A draft model's config against its target's: INVALID_ARGUMENT naming the
 * difference (vocabulary size, BOS/EOS ids) and dir. */
loom_status_t loom_local_check_draft(const loom_model_config_t *draft,
                                     const loom_model_config_t *target, const char *dir,
                                     loom_err_t *err);
/* A draft directory's tokenizer.json against the target's tokenizer:
 * INVALID_ARGUMENT naming the first token that differs (or the sizes). OK
 * when the directory has no tokenizer.json or target is NULL. */
loom_status_t loom_local_check_draft_tokenizer(const char *dir, const loom_tokenizer_t *target,
                                               loom_err_t *err);
/* The KV cache's element type. */
loom_dtype_t loom_local_kv_dtype(const loom_local_t *l);

#endif
