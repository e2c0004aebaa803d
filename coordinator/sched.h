/* The token-level scheduler: continuous batching over a paged KV cache.
 *
 * Each call to loom_sched_schedule builds one micro-batch from sequences
 * that are not already in flight: running decodes first (arrival order),
 * then running prefills continued in chunks, then admissions from the
 * waiting queue (priority, then FCFS), all within max_batched_tokens and
 * max_num_seqs. With pipeline parallelism the caller keeps up to n_micro
 * micro-batches in flight; each takes about 1/n_micro of the sequences.
 *
 * Sequence states:
 *   WAITING ──admit (blocks for its first chunk)──▶ RUNNING
 *   RUNNING ──preempted (out of blocks; youngest first)──▶ WAITING (recompute:
 *            its KV is dropped, its tokens kept; the prefix cache usually
 *            gives most of it back on readmission)
 *   RUNNING/WAITING ──loom_sched_finish──▶ FINISHED (blocks released; when in
 *            flight, released once its micro-batch completes)
 * KV fork (the n choices of one request, or any requests with one prompt): a
 * waiting sequence that has generated nothing and whose prompt equals that of
 * a running sequence still in its prefill (the leader) is parked: it stays
 * WAITING and is passed over by admission, which goes on to the sequences
 * behind it. Once the leader's prompt is computed, the parked one is admitted
 * as a fork: it retains the leader's full prompt blocks, gets a fresh block
 * into which the block holding position n_prompt - 1 is copied (the step's
 * copy_src/copy_dst), and starts at n_computed = n_prompt - 1, so its first
 * step runs just the last prompt token for its own logits (its sampling
 * stream is its own). A leader preempted, finished or windowed (n_dropped >
 * 0) before that leads no one: the parked sequences are admitted as usual
 * (prefix cache), and the first of them may lead the others.
 * Invariants: a sequence is in at most one micro-batch in flight (more with
 * some planned ahead: loom_sched_schedule_ahead); tokens
 * [0, n_computed) have KV in the blocks of its table; only full blocks are
 * ever shared, and a shared block about to be written is copied first.
 * With a sliding window (cfg.window > 0: every layer attends to the latest
 * `window` positions) the first n_dropped entries of a table are -1: those
 * blocks lie wholly before the window of the sequence's next token, so no
 * query reads them again, and they went back to the ledger (kept in the
 * prefix cache when registered). Tokens [0, n_computed) still count as
 * computed; a preempted sequence recomputes from position 0.
 * Data-parallel attention (cfg.n_dp > 1): the ledger has one partition a
 * rank; a sequence admitted without blocks is bound to one (bind_rank in
 * sched.c) and every block of its table, every prefix hit and fork it
 * takes, lies in that partition; making room for it preempts only
 * sequences bound to the same rank. */
#ifndef LOOM_SCHED_H
#define LOOM_SCHED_H

#include <stdint.h>

#include "common/spec.h"
#include "common/status.h"
#include "coordinator/kv_connector.h"
#include "coordinator/kv_ledger.h"
#include "coordinator/lora_slots.h"
#include "kernels/sampling.h"

typedef enum { LOOM_SEQ_WAITING = 0, LOOM_SEQ_RUNNING, LOOM_SEQ_FINISHED } loom_seq_state_t;

/* An embedding sequence's pooling: nothing is sampled for it; its prefill
 * asks the last stage for the final-normed hidden state of its last token,
 * or for the sum over all its tokens (mean: the prefix cache is not used,
 * every token must run). */
typedef enum { LOOM_POOL_NONE = 0, LOOM_POOL_LAST, LOOM_POOL_MEAN } loom_pooling_t;

typedef struct loom_seq {
    uint64_t id;
    void *user;              /* the caller's request record */
    int32_t *tokens;         /* (n_tokens) prompt then generated */
    int n_tokens, cap_tokens;
    int n_prompt;
    int max_tokens;          /* most tokens to generate */
    int n_computed;          /* tokens whose KV is cached */
    int *blocks;             /* block table; -1 for the n_dropped leading blocks */
    int n_blocks, cap_blocks;
    int n_dropped;           /* leading blocks released behind the sliding window */
    int n_hashed;            /* full blocks whose chain hash is known */
    uint64_t chain;          /* chain hash of block n_hashed - 1 */
    loom_sampling_t sampling;
    const struct loom_sparams *sparams; /* the caller's sampling controls (sampling_params.h), NULL: none */
    int priority;
    uint64_t arrival;        /* admission order, kept across preemption */
    loom_seq_state_t state;
    int in_flight;           /* micro-batches in flight holding it (more than one: planned ahead) */
    int finish_pending;      /* finished while in flight */
    int cached_tokens;       /* prompt tokens served by the prefix cache or forked (first admission) */
    int forked;              /* admitted as a fork of a running sequence's prompt (first admission) */
    uint64_t prompt_hash;    /* of tokens [0, n_prompt): finds a running twin to fork from */
    int admitted_once;
    int n_preempted;
    int heap_pos, run_pos;   /* positions in the waiting heap / running array */
    uint64_t t_arrival_ns, t_first_token_ns, t_admitted_ns;
    loom_pooling_t embed;    /* LOOM_POOL_NONE: a generation */
    int spec_off;            /* 1: never speculate for this sequence (the request said so) */
    int spec_drafted, spec_accepted; /* its drafted tokens verified, and accepted */
    int n_steps;             /* steps that produced its tokens */
    uint64_t step_offset;    /* sampling steps already taken before its prompt ended (a continued
                                request: GenerateRequest.sample_step_offset) */
    loom_spec_adapt_t spec_adapt; /* its measured acceptance (adaptive K) */
    int32_t mtp_draft;       /* method MTP: the workers' draft for its next step (loom_sched_mtp_drafts) */
    int mtp_draft_for;       /* ... valid while n_steps equals this (0: none) */
    uint64_t t_step_ns;      /* when its last step completed (the speculation gate's clock) */
    /* prompt logprobs (vLLM's prompt_logprobs): each prefill chunk asks the
     * last stage for the logprob of every prompt token after the first and
     * the prompt_lp_top most likely at its position. Such a sequence skips
     * the prefix cache (cached positions would have none); a re-prefill
     * after preemption recomputes them (the caller keeps them by position). */
    int prompt_lp, prompt_lp_top;
    /* LoRA (loom_sched_seq_set_lora): the adapter's registry id (-1: the
     * base model), the engine slot it holds a pin on while admitted (-1:
     * none), and the seed of its block chain hash (from the adapter's
     * content digest; 0 for the base model) */
    int lora_id, lora_slot;
    uint64_t lora_seed;
    int dp_rank; /* data-parallel attention: the rank whose KV partition holds its blocks (bound at admission
                    while it has none; -1: not yet) */
    int kv_save; /* a KV connector saves the blocks its steps fill (write-through for this one: a remote decode's
                    prefill) */
    struct loom_seq_pull *pull; /* transport tcp: its prompt's blocks a prefill replica holds (NULL: none) */
} loom_seq_t;

/* Transport tcp (loom_sched_seq_set_pull): a decode's first blocks, held by
 * a prefill replica, to be filled from there at its first admission. */
typedef struct loom_seq_pull {
    int n;            /* blocks */
    int32_t *remote;  /* (n) the prefill's pool block ids */
    char *addrs;      /* its ranks' KV services, comma-separated in rank order */
    uint64_t transfer;
    int tried;        /* planned once: a later admission (after a failure, a preemption) computes them */
} loom_seq_pull_t;

typedef struct loom_sched_config {
    int max_num_seqs;        /* running sequences at most */
    int max_batched_tokens;  /* tokens per micro-batch at most */
    int max_queue;           /* waiting sequences at most (beyond: RESOURCE_EXHAUSTED) */
    int max_model_len;       /* prompt + generated tokens at most */
    int n_micro;             /* micro-batches in flight (pipeline stages) */
    int block_size;
    int n_blocks;
    int prefix_cache;
    int window;              /* every layer's sliding window in positions (0: none) */
    /* data-parallel attention: the ledger's partitions, one a TP rank
     * (n_blocks is their sum; 0 or 1: one pool). A sequence is bound to one
     * at admission (bind_rank in sched.c); its blocks, prefix hits, forks
     * and the preemptions that make room for it stay in that partition. */
    int n_dp;
    int ahead;               /* micro-batches more that may be planned ahead (loom_sched_schedule_ahead) */
} loom_sched_config_t;

/* One micro-batch, ready to be sent as a step plan. Arrays are owned by the
 * scheduler and valid until the batch is completed or failed. */
typedef struct loom_microbatch {
    uint64_t id;
    int n_tokens;
    int32_t *tokens, *pos, *slots, *tok_seq; /* (n_tokens) */
    int n_seqs;
    loom_seq_t **seqs;       /* (n_seqs) */
    int *chunk;              /* (n_seqs) tokens scheduled per sequence */
    int max_blocks;
    int32_t *block_tables;   /* (n_seqs, max_blocks), -1 padded */
    int32_t *seq_lora;       /* (n_seqs) engine adapter slot of each sequence, -1: none */
    int any_lora;            /* some sequence of the batch has an adapter */
    int32_t *seq_dp_rank;    /* (n_seqs) the rank owning each sequence's KV (cfg.n_dp > 1) */
    int n_logits;
    int32_t *logit_rows;     /* (n_logits) */
    loom_seq_t **logit_seq;  /* (n_logits) */
    loom_sampling_t *sampling; /* (n_logits) */
    uint64_t *steps;         /* (n_logits) generated-token index */
    int n_copies;
    int32_t *copy_src, *copy_dst; /* block copies to do before the step */
    /* embedding ranges: the hidden states of tokens [embed_begin, embed_end)
     * of this batch are summed for embed_seq, whose positions they are from
     * embed_pos on; embed_final: the range ends the sequence's prompt */
    int n_embeds;
    int32_t *embed_begin, *embed_end, *embed_pos;
    loom_seq_t **embed_seq;
    int *embed_final;
    /* prompt logprobs: for entry i, the logprob of token plp_ids[i] (the
     * prompt of plp_seq[i] at position plp_pos[i] + 1) after batch token
     * plp_rows[i], and the plp_top[i] most likely */
    int n_plp;
    int32_t *plp_rows, *plp_ids, *plp_pos;
    uint32_t *plp_top;
    loom_seq_t **plp_seq;
    int in_use;
    int *spec_n;             /* (n_seqs) drafts verified for the sequence (0: none) */
    int *spec_row0;          /* (n_seqs) its first logit row when spec_n > 0 */
    uint8_t *spec_row;       /* (n_logits) 1: the row belongs to a speculating sequence */
    double draft_s;          /* seconds the drafter took for this batch's drafts (method DRAFT) */
    /* the KV connector's moves, done by the workers before the step's
     * block copies and layers: saves first (blocks leaving the pool, whose
     * ids this very step may reuse), then loads into fresh blocks */
    int n_saves, n_loads, cap_saves, cap_loads;
    int32_t *save_block, *load_block;
    uint64_t *save_hash, *load_hash;
    /* write-through: blocks this step fills, saved after its layers */
    int n_saves_after, cap_saves_after;
    int32_t *save_after_block;
    uint64_t *save_after_hash;
    /* a connector with slots (loom_kv_connector_has_slots: the host tier):
     * each move's slot, filled as the step's plan is closed; NULL else */
    int32_t *save_slot, *load_slot, *save_after_slot;
    int cap_slots;
    /* transport tcp: blocks filled from prefill replicas before the step
     * (StepPlan.kv_pull_*): pool block, the prefill's block id, source;
     * per source its sequence, addresses and transfer id */
    int n_pulls, cap_pulls, n_pull_srcs, cap_pull_srcs;
    int32_t *pull_block, *pull_remote;
    uint32_t *pull_src;
    struct loom_seq **pull_seq;
    const char **pull_addrs;
    uint64_t *pull_transfer;
    int spec_gate;           /* the speculation gate's answer for this batch (-1: not asked) */
    /* planned ahead (loom_sched_schedule_ahead): tokens [0, n_prev) are the
     * ones micro-batch prev_step samples, tokens[t] the id of its logit row
     * prev_rows[t] (StepPlan.prev_rows); with n_prev > 0, prev_rows[t] is -1
     * for the other tokens */
    int n_prev;
    int32_t *prev_rows;      /* (n_tokens) */
    uint64_t prev_step;
} loom_microbatch_t;

#define LOOM_SCHED_MAX_DP 64 /* data-parallel attention ranks at most (the TP ranks' cap) */

typedef struct loom_sched_stats {
    int running, waiting;
    uint64_t preemptions;
    uint64_t prefix_queries, prefix_hits; /* in blocks */
    uint64_t scheduled_tokens, batches;
    uint64_t prompt_tokens_computed; /* prompt positions run (prefill, recompute included) */
    uint64_t forks, fork_tokens;     /* sequences admitted as forks; prompt tokens they took over */
    uint64_t tier_queries, tier_hits; /* blocks beyond the prefix cache asked of the connector; loaded */
    uint64_t tier_waits; /* admissions put off while the connector looked for a request's blocks */
    uint64_t pulled_blocks; /* transport tcp: blocks planned to be filled from prefill replicas */
    uint64_t tier_saves;             /* blocks sent to the connector's tier */
    uint64_t lower_hits, lower_saves; /* of those, loaded from and sent to its lower tier (the directory) */
    uint64_t dp_admissions[LOOM_SCHED_MAX_DP]; /* cfg.n_dp > 1: admissions bound to each rank */
    uint64_t ahead_tokens;           /* decode tokens planned ahead of their previous step's result */
    uint64_t ahead_dropped;          /* ... of which dropped unseen: the sequence finished in that step */
} loom_sched_stats_t;

typedef struct loom_sched loom_sched_t;

loom_sched_t *loom_sched_create(const loom_sched_config_t *cfg);
void loom_sched_destroy(loom_sched_t **s_p);
const loom_sched_config_t *loom_sched_config(const loom_sched_t *s);
loom_kv_ledger_t *loom_sched_ledger(loom_sched_t *s);

/* Queues a request. Errors: INVALID_ARGUMENT (empty prompt, prompt +
 * max_tokens over the context, more KV blocks than the pool holds, message
 * with the numbers), RESOURCE_EXHAUSTED (waiting queue full). max_tokens 0
 * means up to the context length. */
loom_status_t loom_sched_add(loom_sched_t *s, uint64_t id, const int32_t *prompt, int n_prompt,
                             int max_tokens, int priority, const loom_sampling_t *sampling,
                             void *user, loom_seq_t **out, loom_err_t *err);

/* Queues an embedding of the prompt (pooling LAST or MEAN): errors as
 * loom_sched_add. The sequence is prefilled, never sampled; the caller
 * finishes it when its final embedding range has completed. */
loom_status_t loom_sched_add_embed(loom_sched_t *s, uint64_t id, const int32_t *prompt, int n_prompt,
                                   loom_pooling_t pooling, int priority, void *user, loom_seq_t **out,
                                   loom_err_t *err);

/* Builds the next micro-batch; NULL when there is nothing to run or every
 * micro-batch slot is in flight. */
loom_microbatch_t *loom_sched_schedule(loom_sched_t *s);

/* Overlapped scheduling (cfg.ahead): builds a micro-batch while prev, the
 * latest one built, is in flight (and up to cfg.ahead - 1 before it, each
 * planned ahead of the one before). Each sequence prev samples a token for
 * (a decode or a prompt's last chunk, no drafts) gets a decode of that
 * token, which only the worker knows until prev completes (mb->prev_rows):
 * unless prev's token is its last by max_tokens or the context, it would
 * speculate, ok(ctx, q) says no (its next step's plan depends on the token:
 * a grammar, penalties, bad words, min_tokens), the row fills a block that a
 * write-through connector saves (under its tokens' hash), or it needs a
 * block and none is free (planning ahead never preempts). A prev that pulls
 * KV from a prefill replica (n_pull_srcs) gets no row planned ahead of it:
 * a failed pull fails prev whole (loom_sched_fail), so none of its
 * sequences may be in a later batch until it reports. The rest of the batch is filled
 * as loom_sched_schedule fills one. Such a sequence is in several
 * micro-batches (in_flight counts them); one that finishes as an earlier one
 * completes (EOS, a stop string, cancelled) gets finish_pending, and its rows
 * of the later batches are dropped unseen as they complete; its blocks go
 * back with the last. Results must
 * complete in the order the batches were built; a failure fails them all
 * (the grid does). NULL: every micro-batch is in flight, or nothing to run. */
typedef int (*loom_sched_ahead_fn)(void *ctx, const loom_seq_t *q);
loom_microbatch_t *loom_sched_schedule_ahead(loom_sched_t *s, loom_microbatch_t *prev, loom_sched_ahead_fn ok,
                                             void *ctx);

/* Called for each sampled token of a completed micro-batch, after the token
 * is appended. The callee may call loom_sched_finish on the sequence. */
typedef void (*loom_sched_token_fn)(void *ctx, loom_seq_t *seq, int32_t id);
/* The micro-batch ran: ids holds one sampled id per logit row. */
void loom_sched_complete(loom_sched_t *s, loom_microbatch_t *mb, const int32_t *ids,
                         loom_sched_token_fn on_token, void *ctx);
/* The micro-batch did not run (a worker failed): its sequences keep their
 * state as before the batch and are no longer in flight. */
void loom_sched_fail(loom_sched_t *s, loom_microbatch_t *mb);

/* Ends a sequence (done, cancelled or failed) and frees it, at once or when
 * its micro-batch completes. The pointer must not be used afterwards. */
void loom_sched_finish(loom_sched_t *s, loom_seq_t *seq);

/* The KV cache is gone (a worker was lost): every running sequence goes back
 * to waiting (its tokens kept, recomputed later) and the ledger starts over
 * with n_blocks blocks (the new grid's pool; with cfg.n_dp > 1 the sum of
 * the ranks', a multiple of n_dp). No micro-batch may be in flight (fail
 * them first). */
void loom_sched_reset_kv(loom_sched_t *s, int n_blocks);
/* Blocks a sequence needs at most (its prompt plus max_tokens). */
int loom_sched_seq_max_blocks(const loom_sched_t *s, const loom_seq_t *q);

/* Running and waiting sequences, for failing them all (e.g. grid lost). */
int loom_sched_n_seqs(const loom_sched_t *s);
loom_seq_t *loom_sched_seq_at(loom_sched_t *s, int i); /* running first, then waiting */
int loom_sched_in_flight(const loom_sched_t *s);       /* micro-batches */

void loom_sched_get_stats(const loom_sched_t *s, loom_sched_stats_t *st);

/* LoRA adapters (coordinator/lora_slots.h). With slots set, admission asks
 * them for the adapter of each waiting sequence that has one: a sequence
 * whose adapter is not READY in a slot is passed over (the sequences
 * behind it go on; it keeps its place at the head of the queue, so it is
 * never starved), one admitted holds a pin on its slot until it finishes
 * or is preempted, so a slot running sequences use is never evicted.
 * loom_sched_seq_set_lora, right after loom_sched_add, gives a sequence
 * its adapter: the chain hash of its first block is seeded with the
 * adapter's content digest, so the prefix cache (and the KV events the
 * router reads) never share blocks across adapters, nor across a reload
 * under one name with other weights. */
void loom_sched_set_lora_slots(loom_sched_t *s, loom_lora_slots_t *slots);

/* A KV connector (coordinator/kv_connector.h; NULL: none, the scheduler's
 * own). At admission, after the prefix cache, the full blocks of the
 * prompt beyond its hit that the connector holds (never the block of the
 * last position) get fresh blocks that the step loads before it runs
 * (mb->load_*), and count as cached (cached_tokens). A cached block about
 * to be evicted is offered to the connector (write-back): mb->save_* of
 * the step that reuses it (or the next), done before that step writes it;
 * with write_through, each block a step fills is offered instead:
 * mb->save_after_*, done after that step's layers. The caller keeps c
 * alive while the scheduler holds it. */
void loom_sched_set_connector(loom_sched_t *s, loom_kv_connector_t *c);
/* Transport tcp, the decode side: q's first n prompt blocks are held by a
 * prefill replica (remote: its block ids; addrs: its ranks' KV services;
 * transfer: its hold). At q's first admission, the blocks beyond its
 * prefix-cache hit (never the block of its last position) get fresh blocks
 * the step fills from there (mb->pull_*) and count as cached; a later
 * admission (the step failed or q was preempted) computes them. The step
 * names the source even when nothing is pulled (the prefix cache held every
 * block, or none was free), so the prefill side hears it may free them.
 * Call right after loom_sched_add. */
void loom_sched_seq_set_pull(loom_sched_t *s, loom_seq_t *q, int n, const int32_t *remote, const char *addrs,
                             uint64_t transfer);

/* q's pull failed (the step that filled it is being failed with
 * loom_sched_fail): its next admission computes the blocks and counts as
 * its first (cached_tokens from the prefix cache alone). */
void loom_sched_pull_failed(loom_sched_t *s, loom_seq_t *q);

/* Delayed free for a worker-to-worker KV transfer (docs/disaggregation.md):
 * a finished prefill's prompt blocks (its full blocks before the one of its
 * last position, as kv_transfer_params name them) each keep one more
 * reference under id until loom_sched_unhold (the decode side read them) or
 * deadline_ns passes (loom_sched_hold_expire: the lease). Held blocks are
 * neither freed nor reused: the sequence may finish and go meanwhile. Call
 * before loom_sched_finish; returns how many blocks it holds (0: none, e.g.
 * a window dropped the first ones), *blocks their ids (valid until the
 * hold ends). id must be new. A new pool (loom_sched_reset_kv) ends every
 * hold: its blocks were the old pool's. */
int loom_sched_hold(loom_sched_t *s, const loom_seq_t *q, uint64_t id, uint64_t deadline_ns,
                    const int32_t **blocks);
/* The blocks held under id (NULL, *n 0: no such hold). */
const int32_t *loom_sched_held(const loom_sched_t *s, uint64_t id, int *n);
/* Ends the hold: its references go (blocks cached for the prefix cache stay
 * cached). Returns the blocks it held (0: no such hold). */
int loom_sched_unhold(loom_sched_t *s, uint64_t id);
/* Ends the holds whose deadline is <= now_ns, cap at most (call again
 * while it returns cap); their ids in ids; returns how many ended. */
int loom_sched_hold_expire(loom_sched_t *s, uint64_t now_ns, uint64_t *ids, int cap);
/* Blocks held now, all holds together (loom_kv_transfer_held_blocks). */
int loom_sched_held_blocks(const loom_sched_t *s);

/* Told of each block hash sent to the connector's tier (the KV events
 * publisher listens); NULL fn: none. */
typedef void (*loom_sched_tier_fn)(void *ctx, uint64_t hash);
void loom_sched_set_tier_observer(loom_sched_t *s, loom_sched_tier_fn fn, void *ctx);
void loom_sched_seq_set_lora(loom_sched_t *s, loom_seq_t *q, int lora_id, const uint8_t digest[32]);
/* The chain seed of an adapter's blocks (its content digest's first 8
 * bytes, never 0, the base model's): its prefix-cache and KV tier blocks. */
uint64_t loom_sched_lora_seed(const uint8_t digest[32]);

/* Speculative decoding (common/spec.h): with a method set, a decode of a
 * sequence not turned off (spec_off) carries up to K drafts (ngram, or the
 * drafter's) after its last token, with one
 * logit row each (steps g..g+K, so each row samples exactly what decoding
 * would). loom_sched_complete accepts the drafts that equal the sampled ids,
 * emits them and the first differing (or bonus) id in order through
 * on_token (stopping at once when the callee finishes the sequence), keeps
 * their KV and releases the blocks only rejected drafts used. Drafts never
 * cause a preemption, never exceed max_tokens, the token budget or the
 * workers' logit rows (max_num_seqs per step), and back off as the step's
 * decode tokens approach the config's compute knee. */
void loom_sched_set_spec(loom_sched_t *s, const loom_spec_config_t *c);
const loom_spec_stats_t *loom_sched_spec_stats(const loom_sched_t *s);
/* Method DRAFT's proposer: up to k drafts for q (its tokens[0..n_tokens))
 * into out, returning how many (0: none this step). `forget` is called as q
 * is freed. Without a drafter, method DRAFT drafts nothing. */
typedef int (*loom_sched_draft_fn)(void *ctx, const loom_seq_t *q, int k, int32_t *out);
typedef void (*loom_sched_forget_fn)(void *ctx, const loom_seq_t *q);
void loom_sched_set_drafter(loom_sched_t *s, loom_sched_draft_fn propose,
                            loom_sched_forget_fn forget, void *ctx);
/* The batch being built carries the drafts of a probe of the speculation
 * gate, off (common/spec_gate.h): a drafter catches up with a recent
 * window of each sequence only. */
int loom_sched_spec_probing(const loom_sched_t *s);
/* Method MTP (the workers' MTP module drafts): drafts[i] (-1: none) is the
 * draft of mb's sequence i after the step mb ran; call before
 * loom_sched_complete. A sequence's next decode carries it (one draft)
 * when nothing else ran for it in between. */
void loom_sched_mtp_drafts(loom_microbatch_t *mb, const int32_t *drafts);
/* A step of n_tokens took `seconds` on the workers: feeds the measured cost
 * model that adaptive K weighs drafts against (small steps only: the decode
 * regime). A draft model's own time stays out of it: the speculation gate
 * (common/spec_gate.h) times whole cycles itself, a batch of decodes from
 * its sequences' previous completions, so the grid's round trip and the
 * coordinator's own work (the draft's forwards) count there. */
void loom_sched_observe_step(loom_sched_t *s, int n_tokens, double seconds);
/* The clock the speculation gate times cycles with (default loom_now_ns):
 * tests and simulators give it a clock of their own. */
typedef uint64_t (*loom_sched_clock_fn)(void *ctx);
void loom_sched_set_clock(loom_sched_t *s, loom_sched_clock_fn now_ns, void *ctx);

#endif
