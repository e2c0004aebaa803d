/* The grid lifecycle: the coordinator's side of the control plane. One grid
 * is tp x pp worker slots (slot = stage * tp + tp_rank) on one ROUTER socket.
 * It knows no requests, tokens or tokenizer: it forms the grid, keeps it
 * alive, carries step plans out and step results back, and reports through
 * a few callbacks (ready, failed, a step done or dropped).
 *
 * States (loom_grid_state):
 *   WAITING  slots not all filled; workers register into free slots. With
 *            probes out (loom_grid_probing) every slot is filled but the
 *            last epoch failed: each member's data-plane listener is being
 *            probed (a TCP connect, PROBE_MS at most) to learn who is alive.
 *   LOADING  every slot filled; Assign (epoch e) sent; waiting for Loaded
 *            from every slot
 *   JOINING  the KV pool is sized (the smallest worker decides); KvConfig
 *            (with the comm-group ids the Loaded messages carried) sent;
 *            waiting for Ready from every slot
 *   READY    serving: step plans go out, up to pp micro-batches in flight
 *
 * Transitions:
 *   WAITING --last free slot registered--> LOADING (epoch e+1, Assign to all)
 *   WAITING(probing) --every member answered--> LOADING (epoch e+1)
 *   WAITING(probing) --a member refused/timed out--> WAITING (its slot freed)
 *   LOADING --Loaded of epoch e from all--> JOINING (or stays LOADING with
 *            last_failure set when no memory is left for the KV cache)
 *   JOINING --Ready of epoch e from all--> READY (callback on_ready)
 *   any    --a member lost (missed heartbeats, its etcd key gone, it
 *            registered again)--> WAITING, the slot freed
 *   any    --a step failed, a result out of order or malformed, a worker's
 *            Error while READY--> WAITING with probes out
 *   JOINING --a worker's UNAVAILABLE Error naming epoch e (its join failed:
 *            a peer's link dropped or timed out)--> WAITING with probes out,
 *            so the same workers join again under epoch e+1 (other join
 *            errors are deterministic: reported, the grid stays JOINING)
 *   Each of the last two aborts epoch e (Abort to every member; in-flight
 *   micro-batches go back through on_step_failed, then on_failed).
 *
 * Invariants:
 *   - A slot's worker id equals the ZeroMQ routing id its messages come on;
 *     a message from a routing id without a slot is answered NOT_FOUND
 *     ("register first") and changes nothing. The routing id of a taken slot
 *     cannot be taken over by a second connection (no ZMQ_ROUTER_HANDOVER:
 *     libzmq drops the newcomer while the first is connected; ZMTP
 *     heartbeats reap the connection of a dead worker within the heartbeat
 *     timeout, so a restarted worker gets through). When peers authenticate
 *     (CURVE, ZAP), loom_grid_peer_allowed binds a slot to the identity that
 *     registered it: a message from another identity is refused.
 *   - Loaded/Ready/StepResult of an epoch other than the current one, or in
 *     a state that does not wait for them, are leftovers and are dropped.
 *   - Step plans leave only in READY; step results come back in plan order
 *     (a FIFO of at most pp entries); every planned micro-batch is answered
 *     exactly once, by on_step_done or on_step_failed.
 *   - Every Assign and Abort carries the coordinator's incarnation (random
 *     per process, never 0): a worker assigned by a new incarnation forgets
 *     the epochs (and aborts) of the old coordinator, and ignores an Abort of
 *     another incarnation.
 *   - A Register from the process that already holds a slot (same pid, data
 *     address and host) is a retry: answered with a heartbeat, nothing else
 *     changes. From a new process with the same id, or from the same one
 *     saying it left this coordinator's current epoch (Register.left_grid,
 *     left_incarnation and left_epoch: it found this coordinator silent, e.g.
 *     paused past --coordinator-timeout-ms, and aborted its data plane), it
 *     is a restart: the slot is lost (the epoch aborted) and
 *     registered afresh. Taking that one for a retry wedged the grid: the
 *     worker drops plans of the epochs it left, the coordinator waited for
 *     their results forever.
 *   - A worker that registers naming the shard it holds (has_shard, same
 *     grid shape and model) gets that slot when it is free, so a restarted
 *     coordinator gives every worker its own weights back. */
#ifndef LOOM_GRID_H
#define LOOM_GRID_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "coordinator/sched.h"
#include "common/zap.h"
#include "loom/v1/control.pb-c.h"

typedef enum { LOOM_GRID_WAITING = 0, LOOM_GRID_LOADING, LOOM_GRID_JOINING, LOOM_GRID_READY } loom_grid_state_t;

typedef struct loom_grid loom_grid_t;

typedef struct loom_grid_callbacks {
    void *ctx;
    /* The grid became READY (epoch loom_grid_epoch, loom_grid_n_blocks KV blocks). */
    void (*on_ready)(void *ctx, loom_grid_t *g);
    /* The epoch was aborted (why: what happened). In-flight micro-batches were
     * handed back through on_step_failed first. */
    void (*on_failed)(void *ctx, loom_grid_t *g, const char *why);
    /* A micro-batch ran: its result holds one sampled id per logit row (ids
     * checked against the vocabulary) and the rows' logprobs; step_s from plan
     * sent to result received. Returns < 0 with err filled when the result is
     * unusable: the micro-batch then goes back through on_step_failed and the
     * epoch is aborted with err. */
    int (*on_step_done)(void *ctx, loom_microbatch_t *mb, const Loom__V1__StepResult *r, double step_s, char *err,
                        size_t err_n);
    /* A micro-batch did not run (its epoch was aborted). */
    void (*on_step_failed)(void *ctx, loom_microbatch_t *mb);
    /* Worker WORKER (its slot, 0 .. n_slots-1) answered a LoRA load order of
     * the current epoch (loom_grid_send_lora_load). NULL: not asked for. */
    void (*on_lora_loaded)(void *ctx, loom_grid_t *g, int worker, const Loom__V1__LoraLoaded *l);
    /* Transport tcp: a worker's KV service was told a transfer was read
     * (KvRead of the current epoch). NULL: not asked for. */
    void (*on_kv_read)(void *ctx, uint64_t transfer);
} loom_grid_callbacks_t;

typedef struct loom_grid_config {
    const char *control;      /* ROUTER bind address for workers, e.g. tcp://127.0.0.1:5556 */
    const char *model_dir;    /* as workers should open it (absolute) */
    const char *model_name;   /* published with the plan */
    const char *kv_role;      /* --kv-transfer-config's kv_role, published in etcd for loom-router --pd (NULL: none) */
    int n_layers, vocab_size; /* of the model */
    int tp, pp;
    const char *comm;         /* auto, shm, tcp, nccl */
    const char *weight_dtype, *quantization, *kv_cache_dtype;
    int max_num_seqs, max_batched_tokens, block_size, num_kv_blocks, max_model_len;
    uint64_t kv_memory;
    float kv_fraction;
    int heartbeat_timeout_ms;
    /* a step in flight longer than step_timeout_ms + its tokens x
     * step_token_us fails the epoch as a lost worker would (0: no bound) */
    int step_timeout_ms, step_token_us;
    /* etcd membership (etcd_url NULL: heartbeats only) */
    const char *etcd_url, *cluster, *advertise_host, *api_addr; /* api_addr: published for clients */
    /* Called once with the control socket before it binds (CURVE set-up);
     * sets *ctl_zap to the ZAP handler that authenticates its peers, or NULL
     * when the plane is not keyed. NULL: nothing to do. */
    loom_status_t (*secure_ctl)(void *ctx, void *ctl, loom_zap_t **ctl_zap, loom_err_t *err);
    void *secure_ctx;
    int encrypt_data; /* tcp data plane: encrypt every frame (Assign.data_encrypt) */
    int expert_parallel; /* MoE layers: TP ranks split the experts (Assign.expert_parallel) */
    int max_loras;       /* engine adapter slots (Assign.max_loras; 0: LoRA off) */
    int max_lora_rank;   /* their largest rank (Assign.max_lora_rank) */
    int max_cpu_loras;   /* prepared adapters a worker keeps (Assign.max_cpu_loras) */
    int mtp;             /* the last stage runs DeepSeek's MTP module as the draft (Assign.mtp) */
    int dp_attention;    /* each TP rank runs attention for its own sequences (Assign.dp_attention) */
    int mla_disable;     /* DeepSeek's MLA decompressed: per-head K and V in the pool (Assign.mla_disable) */
    int ahead;           /* steps more that may be in flight, planned ahead (--async-scheduling) */
    int etcd_ttl;
    struct loom_metrics *metrics; /* per-stage busy/comm from heartbeats (NULL: none) */
    /* the directory tier (NULL: none): sent to the workers in KvConfig with
     * the tier identity, a hash of kv_tier_seed (the model's and tokenizer's
     * digests) and of what the pool's bytes mean: KV dtype, block size, grid
     * shape, each shard's block bytes, the layout */
    const char *kv_offload_dir;
    uint64_t kv_offload_max_bytes, kv_tier_seed;
    /* the host-memory tier (0: none): bytes each worker keeps for offloaded
     * blocks; as many slots as the largest worker's blocks fit, sent in
     * KvConfig.kv_host_slots */
    uint64_t kv_host_bytes;
    /* transport tcp (KvConfig.kv_xfer: 1 serve, 2 pull, 4 no shared memory; 0: off) and the
     * secret both replicas hold (none: insecure) */
    int kv_xfer;
    const uint8_t *kv_xfer_secret;
    size_t kv_xfer_secret_len;
} loom_grid_config_t;

/* Binds the control socket on zctx (the caller's context) and, with etcd,
 * claims /loom/<cluster>/coordinator and watches the workers' keys. */
loom_status_t loom_grid_create(const loom_grid_config_t *cfg, void *zctx, const loom_grid_callbacks_t *cb,
                               loom_grid_t **out, loom_err_t *err);
void loom_grid_destroy(loom_grid_t **g_p);

/* The reactor: poll loom_grid_socket for ZMQ_POLLIN, then call
 * loom_grid_on_readable; call loom_grid_tick every loop (liveness checks,
 * heartbeats, probes, etcd events). */
void *loom_grid_socket(loom_grid_t *g);
void loom_grid_on_readable(loom_grid_t *g);
void loom_grid_tick(loom_grid_t *g);

/* Step plans: loom_grid_can_send says READY with a free in-flight place. */
int loom_grid_can_send(const loom_grid_t *g);
void loom_grid_send_plan(loom_grid_t *g, loom_microbatch_t *mb);
int loom_grid_n_inflight(const loom_grid_t *g);

/* LoRA (docs/lora.md): orders every worker of the epoch (READY) to load the
 * adapter in PATH, of content DIGEST, into engine SLOT; each answers through
 * on_lora_loaded. Sent in order with the step plans. */
void loom_grid_send_lora_load(loom_grid_t *g, int slot, const char *name, const char *path,
                              const uint8_t digest[32]);

/* Tells every member the coordinator is going away (they keep their weights). */
void loom_grid_shutdown(loom_grid_t *g, const char *reason);

/* Whether a message from a peer whose authenticated identity is user_id
 * (ZMQ "User-Id" metadata; NULL when the socket does not authenticate) may
 * speak for slot i. The identity is bound to the slot at registration. */
int loom_grid_peer_allowed(const loom_grid_t *g, int slot, const char *user_id);

loom_grid_state_t loom_grid_state(const loom_grid_t *g);
const char *loom_grid_state_name(loom_grid_state_t st);
int loom_grid_probing(const loom_grid_t *g);
int loom_grid_n_slots(const loom_grid_t *g);
int loom_grid_n_registered(const loom_grid_t *g);
int loom_grid_n_ready(const loom_grid_t *g);
uint64_t loom_grid_epoch(const loom_grid_t *g);
uint64_t loom_grid_incarnation(const loom_grid_t *g);
int loom_grid_n_blocks(const loom_grid_t *g);
const char *loom_grid_kv_dtype(const loom_grid_t *g);     /* "mixed" when workers differ */
uint64_t loom_grid_kv_block_bytes(const loom_grid_t *g); /* the largest worker's */
/* The directory tier's identity for this epoch's grid (0 before READY), and
 * the block bytes of slot i (= stage * tp + rank: the tier's shard number). */
uint64_t loom_grid_kv_tier_id(const loom_grid_t *g);
/* Transport tcp: the KV services of the grid's ranks, comma-separated in
 * rank order, into out; 0 when one has none (or out is too small). */
int loom_grid_kv_xfer_addrs(const loom_grid_t *g, char *out, size_t cap);
/* Tells every worker the blocks held under transfer (release 0), or that
 * the hold ended (release 1). Nothing while the grid is not ready. */
void loom_grid_kv_hold(loom_grid_t *g, uint64_t transfer, const int32_t *blocks, int n, int release);
/* The host tier's slots per worker (0: none). */
int loom_grid_kv_host_slots(const loom_grid_t *g);
uint64_t loom_grid_slot_kv_block_bytes(const loom_grid_t *g, int i);
const char *loom_grid_last_failure(const loom_grid_t *g); /* "" when none since the last READY */
/* The worker id in slot i, or NULL when the slot is free. */
const char *loom_grid_slot_worker(const loom_grid_t *g, int i);
const char *loom_grid_bound_addr(const loom_grid_t *g); /* the control endpoint bound */
/* "the grid is not ready (STATE, R of N workers registered)[: last failure: ...]" */
void loom_grid_describe(const loom_grid_t *g, char *out, size_t n);

#endif
