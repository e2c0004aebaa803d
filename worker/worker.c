/* loom-worker: one cell of the grid. Registers with the coordinator, loads
 * only its shard, joins its data-plane groups, then executes step plans.
 *
 * Threads: the reactor (main thread) owns the coordinator socket and the
 * timers (heartbeats, coordinator liveness); the compute thread owns the
 * backend, the model and the comm, and runs loads and steps. They talk over
 * an inproc PAIR: the reactor hands over decoded control messages, the
 * compute thread hands back packed replies. Abort (a peer died) is the one
 * cross-thread call: the reactor aborts the comm so a blocked step returns.
 *
 * States (worker_state_t, the reactor's standing with the coordinator):
 *   REGISTERING  no slot yet: Register every 2 s until a coordinator answers
 *   STANDBY      the coordinator refused a slot (RESOURCE_EXHAUSTED: the grid
 *                is full; NOT_FOUND: it forgot us): Register every 250 ms, so
 *                a spare takes a lost worker's place fast
 *   IN_GRID      the coordinator holds a slot for us: heartbeats every 200 ms;
 *                Assign, KvConfig and StepPlan go to the compute thread
 *   ORPHANED     the coordinator left (Shutdown) or fell silent: the comm is
 *                aborted, the weights kept; Register every 500 ms (to the
 *                address etcd now gives, with --etcd), naming the shard held
 * Within IN_GRID the compute thread walks each epoch e through
 *   LOADING ─Loaded▶ LOADED ─KvConfig▶ JOINING ─Ready▶ SERVING ─Abort▶ ABORTED
 * and a new Assign starts the next epoch (for the same shard it keeps the
 * weights and rebuilds only the KV pool and the comm). The reactor sees
 * that walk through two counters: joined_epoch (the last epoch Ready was
 * sent for) and aborted_epoch (plans of this epoch or older fail fast):
 * SERVING iff joined_epoch > aborted_epoch (the health file's "serving").
 *
 * Transitions:
 *   REGISTERING, STANDBY, ORPHANED --any message but an Error--> IN_GRID
 *   REGISTERING, IN_GRID, ORPHANED --Error RESOURCE_EXHAUSTED or NOT_FOUND--> STANDBY
 *   any --Shutdown--> ORPHANED;  IN_GRID --silence past --coordinator-timeout--> ORPHANED
 *   any --another Error (the coordinator refused this worker)--> exit
 *
 * Invariants:
 *   - Heartbeats go out only IN_GRID; Register only outside it.
 *   - Leaving the grid (ORPHANED) sets aborted_epoch to UINT64_MAX, and only
 *     the next Assign clears it (to 0: that coordinator's epochs count
 *     afresh), whatever states come between; so left_grid() says, in
 *     STANDBY or IN_GRID too, that the next Assign starts afresh and that
 *     the coordinator's address should be looked up again.
 *   - An Assign from another coordinator incarnation than the last Assign's
 *     forgets the old epochs; an Abort from another incarnation is ignored. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include <cjson/cJSON.h>

#include "common/cli.h"
#include "common/cpu_check.h"
#include "common/endpoint.h"
#include "common/etcd.h"
#include "common/keys.h"
#include "common/log.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cpu/backend_cpu.h"
#include "proto/wire.h"
#include "worker/comm.h"
#include "worker/kv_host.h"
#include "worker/kv_offload.h"
#include "worker/kv_pd.h"
#include "worker/logits_proc.h"
#include "worker/lora_orders.h"
#include "worker/model.h"
#include "worker/mtp_rows.h"

/* The reactor's state: the block at the top of this file. */
typedef enum {
    WORKER_REGISTERING = 0,
    WORKER_STANDBY,
    WORKER_IN_GRID,
    WORKER_ORPHANED,
} worker_state_t;

#define HEARTBEAT_MS 200
#define WAIT_LOG_MS 5000 /* unanswered this long: say so (with the address) and dial afresh */
#define STANDBY_RETRY_MS 250 /* a spare asks for a free slot this often: it takes a lost worker's place that fast */
#define REGISTER_RETRY_MS 2000 /* REGISTERING: no coordinator answered yet */
#define ORPHAN_RETRY_MS 500    /* ORPHANED: the next coordinator may be starting */
#define LORA_POLL_MS 2 /* with LoRA loads under way the compute thread looks at them this often */

/* Assign.mtp on the last stage: DeepSeek's MTP module beside the target,
 * TP-sliced like a decoder layer, and its step's scratch (mtp_step). */
typedef struct {
    loom_model_t *model;
    float *h;                   /* (max_tokens, dim) host: the target's final-normed rows */
    int32_t *in_ids;            /* (max_tokens) */
    int32_t *rows, *seq;        /* (max_seqs) MTP logit rows and their sequences */
    int32_t *drafts;            /* (max_seqs) per plan sequence, for StepResult.mtp_drafts */
    size_t n_drafts;
    loom_sampling_t *greedy;    /* (max_seqs) */
    uint64_t *steps;            /* (max_seqs) zeros: greedy needs no noise */
    Loom__V1__SampleParams plain;
    Loom__V1__SampleParams **plain_ptrs; /* (max_seqs) -> plain: pack_parts without logprobs */
} worker_mtp_t;

typedef struct worker {
    /* options */
    const char *coord_addr, *device, *data_host, *trace_path, *dump_path, *health_path;
    const char *etcd_url, *cluster;
    loom_etcd_t *etcd;      /* with --etcd: finds a new coordinator after the last one left */
    int coord_from_etcd;    /* the coordinator's address came from etcd (no --coordinator) */
    /* reactor: the shard of the last Assign handed to the compute thread */
    int has_shard;
    uint32_t shard_stage, shard_n_stages, shard_tp_rank, shard_tp_size;
    char shard_model_dir[1024];
    int etcd_ttl, coord_wait_s;
    char coord_buf[256];
    FILE *dump;
    char id[128];
    int threads, coord_timeout_ms;
    const char *buckets_opt;
    int decode_buckets; /* loom_model_options_t.decode_buckets */

    void *zctx, *ctl, *pipe_r, *pipe_c; /* coordinator DEALER; PAIR ends (reactor, compute) */
    loom_comm_listener_t *listener;
    pthread_t compute;

    pthread_mutex_t comm_mu; /* guards `comm` between the compute thread and aborts */
    loom_comm_t *comm;
    _Atomic uint64_t aborted_epoch; /* plans of this epoch or older fail fast */
    uint64_t incarnation; /* reactor: the coordinator process of the last Assign (0: none yet) */
    uint64_t assigned_epoch;                  /* reactor: the epoch of the last Assign */
    uint64_t left_epoch, left_incarnation;    /* reactor: the grid it left last (Register.left_*) */
    _Atomic uint64_t busy_ns, comm_ns, steps, padded_steps;
    _Atomic uint64_t joined_epoch; /* the last epoch this worker sent Ready for */

    /* compute thread state */
    loom_model_config_t cfg;
    loom_st_t *st;
    loom_backend_t *be;
    loom_model_t *model;
    worker_mtp_t mtp;
    loom_lora_orders_t *lora; /* LoRA load orders (NULL: the engine has no adapter slots) */
    Loom__V1__Assign *assign; /* the current assignment (owned) */
    char model_dir[1024];
    int max_tokens, max_seqs, n_blocks, block_size;
    uint64_t epoch;
    /* sampling scratch */
    loom_sample_part_t *parts;
    int32_t *cand_ids;
    float *cand_keys;
    loom_sampling_t *sp;
    uint64_t *steps_buf;
    int *kk;                 /* (max_seqs) each logit row's candidate count */
    uint8_t *gather_send, *gather_recv;
    size_t gather_cap;
    int32_t *ids;
    /* a TP group's last stage: (max_seqs) the sampled ids as floats, summed
     * over the group (share_ids); ids_shared: this step's are in every rank's ids */
    float *share_dev, *share_host;
    int ids_shared;
    int32_t *dp_copy;        /* data-parallel attention: the step's copies in this rank's ids (sources, then
                                destinations) */
    /* the step whose sampled ids w->ids holds (0: none): a plan sent ahead
     * of that step's result reads its tokens there (StepPlan.prev_rows) */
    uint64_t ids_step, ids_epoch;
    int ids_n;
    float *edit_row; /* one logit row edited on the host (logits_proc.h) */
    size_t edit_cap;
    loom_logprobs_t lp; /* the rows' log probabilities (logits_proc.h) */
    loom_prompt_lp_t plp; /* the plan's prompt logprobs (logits_proc.h) */
    float *emb;         /* (n_emb floats) the step's embedding sums (last stage, TP rank 0) */
    size_t n_emb, cap_emb;
    /* trace: (step, begin_ns, end_ns) of recent steps */
    uint64_t (*trace)[3];
    int n_trace, cap_trace;
    loom_kv_offload_t kv_tier; /* the directory tier (KvConfig.kv_offload_dir) */
    loom_kv_host_t kv_host;    /* the host-memory tier (KvConfig.kv_host_slots) */
    loom_kv_pd_t kv_pd;        /* transport tcp: the KV service, the pulls (KvConfig.kv_xfer) */
    /* the step's pulls: per source, failed (1), why (malloc'd) */
    int *pull_failed, cap_pull_src;
    char **pull_why;
    uint32_t *pull_failed_ids;
    int n_pull_failed;
} worker_t;

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

/* ---- small helpers ------------------------------------------------------ */

static int send_ctl(worker_t *w, Loom__V1__ControlMsg *m) {
    size_t len;
    void *buf = loom_wire_pack_control(m, &len);
    int rc = zmq_send(w->ctl, buf, len, ZMQ_DONTWAIT);
    free(buf);
    return rc;
}

/* compute -> reactor: a packed control message to forward */
static void post(worker_t *w, Loom__V1__ControlMsg *m) {
    size_t len;
    void *buf = loom_wire_pack_control(m, &len);
    zmq_send(w->pipe_c, buf, len, 0);
    free(buf);
}

/* An error; epoch: the epoch a join failed in (the coordinator plans again), 0 otherwise. */
static void post_join_error(worker_t *w, uint64_t epoch, loom_status_t code, const char *msg) {
    Loom__V1__Error e = LOOM__V1__ERROR__INIT;
    e.code = code;
    e.message = (char *)msg;
    e.epoch = epoch;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_ERROR;
    m.error = &e;
    post(w, &m);
}

static void post_error(worker_t *w, loom_status_t code, const char *msg) {
    post_join_error(w, 0, code, msg);
}

/* The model's layer hook: a layer waits for its part of the step's KV loads. */
static void kv_layer_wait(void *ctx, int layer) { loom_kv_offload_wait_layer(ctx, layer); }

static void post_result(worker_t *w, uint64_t epoch, uint64_t step_id, const int32_t *ids, size_t n,
                        loom_status_t code, const char *msg, double compute_s, double comm_s,
                        const loom_logprobs_t *lp) {
    Loom__V1__StepResult r = LOOM__V1__STEP_RESULT__INIT;
    if (lp && lp->n_lp) {
        r.logprobs = lp->lp;
        r.n_logprobs = (size_t)lp->n_lp;
        r.n_top = lp->n_top;
        r.n_n_top = (size_t)lp->n_lp;
        r.top_ids = lp->top_ids;
        r.top_logprobs = lp->top_lps;
        r.n_top_ids = r.n_top_logprobs = (size_t)lp->n_tops;
    }
    if (code == LOOM_OK && w->plp.n) {
        r.prompt_logprobs = w->plp.lp;
        r.n_prompt_logprobs = (size_t)w->plp.n;
        r.prompt_ranks = w->plp.rank;
        r.n_prompt_ranks = (size_t)w->plp.n;
        r.prompt_n_top = w->plp.n_top;
        r.n_prompt_n_top = (size_t)w->plp.n;
        r.prompt_top_ids = w->plp.top_ids;
        r.prompt_top_logprobs = w->plp.top_lps;
        r.n_prompt_top_ids = r.n_prompt_top_logprobs = (size_t)w->plp.n_tops;
    }
    if (code == LOOM_OK && w->mtp.n_drafts) {
        r.mtp_drafts = w->mtp.drafts;
        r.n_mtp_drafts = w->mtp.n_drafts;
    }
    if (code == LOOM_OK && w->n_emb) {
        r.embeddings = w->emb;
        r.n_embeddings = w->n_emb;
    }
    if (code == LOOM_OK && w->n_pull_failed) {
        r.kv_pull_failed = w->pull_failed_ids;
        r.n_kv_pull_failed = (size_t)w->n_pull_failed;
        r.kv_pull_errors = w->pull_why;
        r.n_kv_pull_errors = (size_t)w->n_pull_failed;
    }
    r.epoch = epoch;
    r.step_id = step_id;
    r.ids = (int32_t *)ids;
    r.n_ids = n;
    r.code = code;
    r.message = (char *)(msg ? msg : "");
    r.compute_s = compute_s;
    r.comm_s = comm_s;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_RESULT;
    m.result = &r;
    post(w, &m);
}

/* ---- compute thread: loading -------------------------------------------- */

static loom_status_t tp_allreduce(void *ctx, float *buf, int64_t n, loom_err_t *err) {
    worker_t *w = ctx;
    return loom_comm_allreduce(w->comm, buf, n, err);
}

static int same_shard(const Loom__V1__Assign *a, const Loom__V1__Assign *b) {
    return a && b && !strcmp(a->model_dir, b->model_dir) && a->stage == b->stage &&
           a->n_stages == b->n_stages && a->tp_rank == b->tp_rank && a->tp_size == b->tp_size &&
           a->layer_begin == b->layer_begin && a->layer_end == b->layer_end &&
           !strcmp(a->weight_dtype, b->weight_dtype) &&
           !strcmp(a->quantization, b->quantization) &&
           !strcmp(a->kv_cache_dtype, b->kv_cache_dtype) && a->expert_parallel == b->expert_parallel &&
           a->max_loras == b->max_loras && a->max_lora_rank == b->max_lora_rank &&
           a->max_tokens == b->max_tokens &&
           a->max_seqs == b->max_seqs && a->mtp == b->mtp && a->dp_attention == b->dp_attention &&
           a->mla_disable == b->mla_disable;
}

static void mtp_unload(worker_t *w) {
    worker_mtp_t *t = &w->mtp;
    loom_model_destroy(&t->model);
    free(t->h);
    free(t->in_ids);
    free(t->rows);
    free(t->seq);
    free(t->drafts);
    free(t->greedy);
    free(t->steps);
    free(t->plain_ptrs);
    memset(t, 0, sizeof *t);
}

/* Assign.mtp: module 0 as a one-layer model over the same checkpoint, this
 * rank's slice of it (worker/model.h, opt.mtp). */
static loom_status_t mtp_load(worker_t *w, const loom_shard_spec_t *target, const loom_model_options_t *target_opt,
                              loom_err_t *err) {
    worker_mtp_t *t = &w->mtp;
    loom_shard_spec_t spec = {.tp_rank = target->tp_rank, .tp_size = target->tp_size,
                              .layer_begin = w->cfg.n_layers, .layer_end = w->cfg.n_layers + 1,
                              .has_embed = 1, .has_head = 1};
    loom_model_options_t mo = *target_opt;
    mo.mtp = 1;
    mo.embed_from = w->model; /* the target's table where this shard holds it (stage 0 too) */
    mo.decode_buckets = -1;
    mo.max_loras = 0;
    LOOM_CHECK(loom_model_load(w->be, &w->cfg, w->st, &spec, &mo, &t->model, err));
    size_t T = (size_t)target_opt->max_tokens, S = (size_t)target_opt->max_seqs;
    t->h = loom_xmalloc(T * (size_t)w->cfg.dim * sizeof(float));
    t->in_ids = loom_xmalloc(T * sizeof(int32_t));
    t->rows = loom_xmalloc(S * sizeof(int32_t));
    t->seq = loom_xmalloc(S * sizeof(int32_t));
    t->drafts = loom_xmalloc(S * sizeof(int32_t));
    t->greedy = loom_xcalloc(S, sizeof *t->greedy);
    t->steps = loom_xcalloc(S, sizeof *t->steps);
    t->plain_ptrs = loom_xmalloc(S * sizeof *t->plain_ptrs);
    loom__v1__sample_params__init(&t->plain);
    for (size_t i = 0; i < S; i++) {
        t->greedy[i] = (loom_sampling_t){.temperature = 0.0f, .top_p = 1.0f};
        t->plain_ptrs[i] = &t->plain;
    }
    LOOM_INFO("MTP module loaded as the speculative draft: %.1f MB of weights (%s)",
              (double)loom_model_weight_bytes(t->model) / 1e6,
              target->has_embed ? "the embedding shared with the target" : "its own copy of the embedding");
    return LOOM_OK;
}

static void unload(worker_t *w) {
    if (w->be) loom_backend_graph_drop(w->be); /* TP decode graphs hold the comm's collectives */
    pthread_mutex_lock(&w->comm_mu);
    loom_comm_destroy(&w->comm);
    pthread_mutex_unlock(&w->comm_mu);
    mtp_unload(w);
    loom_lora_orders_destroy(&w->lora); /* its cache reads the model */
    loom_kv_host_free(&w->kv_host); /* the backend's host memory */
    loom_kv_offload_free(&w->kv_tier);
    loom_kv_pd_release(&w->kv_pd); /* its service reads the pool; its staging is the backend's */
    loom_model_destroy(&w->model);
    if (w->share_dev) loom_backend_free(w->be, w->share_dev);
    w->share_dev = NULL;
    loom_backend_destroy(&w->be);
    loom_st_close(&w->st);
    w->n_blocks = 0;
}

/* A LoRA load order was decided: the coordinator tallies every worker's. */
static void lora_report(void *ctx, uint64_t epoch, int slot, const uint8_t digest[32], loom_status_t status,
                        const char *msg, double seconds) {
    worker_t *w = ctx;
    if (status < 0) LOOM_WARN("LoRA adapter for slot %d failed to load: %s", slot, msg);
    Loom__V1__LoraLoaded l = LOOM__V1__LORA_LOADED__INIT;
    l.epoch = epoch;
    l.slot = (uint32_t)(slot < 0 ? 0 : slot);
    l.digest = (ProtobufCBinaryData){32, (uint8_t *)digest};
    l.code = status;
    l.message = (char *)msg;
    l.seconds = seconds;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_LORA_LOADED;
    m.lora_loaded = &l;
    post(w, &m);
}

static void handle_lora_load(worker_t *w, Loom__V1__ControlMsg *m) {
    const Loom__V1__LoraLoad *o = m->lora_load;
    static const uint8_t zero[32];
    const uint8_t *digest = o->digest.len == 32 ? o->digest.data : zero;
    if (!w->model || o->epoch != w->epoch || o->epoch <= atomic_load(&w->aborted_epoch))
        lora_report(w, o->epoch, (int)o->slot, digest, LOOM_ERR_UNAVAILABLE, "this worker is not serving that epoch",
                    0.0);
    else if (!w->lora)
        lora_report(w, o->epoch, (int)o->slot, digest, LOOM_ERR_INVALID_ARGUMENT,
                    "this worker's engine has no LoRA slots (Assign.max_loras 0)", 0.0);
    else if (o->digest.len != 32 || !o->path || !o->path[0])
        lora_report(w, o->epoch, (int)o->slot, digest, LOOM_ERR_INVALID_ARGUMENT,
                    "a LoRA load order without an adapter path and a 32-byte digest", 0.0);
    else
        loom_lora_orders_add(w->lora, o->epoch, (int)o->slot, o->path, digest);
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

static loom_status_t load(worker_t *w, const Loom__V1__Assign *a, loom_err_t *err) {
    unload(w);
    snprintf(w->model_dir, sizeof w->model_dir, "%s", a->model_dir);
    LOOM_CHECK(loom_model_config_load(a->model_dir, &w->cfg, err));
    LOOM_CHECK(loom_st_open_dir(a->model_dir, &w->st, err));
    LOOM_CHECK(loom_model_map_tensor_names(&w->cfg, w->st, err));
    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .n_threads = w->threads};
    if (!loom_device_parse(w->device, &bc.kind, &bc.device_index))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "unknown device '%s'", w->device);
    bc.weight_dtype = !strcmp(a->weight_dtype, "bf16") ? LOOM_DT_BF16
                      : !strcmp(a->weight_dtype, "f16") ? LOOM_DT_F16
                                                         : LOOM_DT_F32;
    loom_quant_spec_t quant;
    if (!loom_quant_spec_parse(a->quantization, &quant))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "unknown quantization '%s'", a->quantization);
    LOOM_CHECK(loom_backend_create(&bc, &w->be, err));
    loom_dtype_t kv_dtype;
    LOOM_CHECK(loom_backend_kv_resolve(w->be, a->kv_cache_dtype, &kv_dtype, err));
    loom_shard_spec_t spec = {.tp_rank = (int)a->tp_rank, .tp_size = (int)a->tp_size,
                              .layer_begin = (int)a->layer_begin, .layer_end = (int)a->layer_end,
                              .has_embed = a->stage == 0, .has_head = a->stage + 1 == a->n_stages,
                              .dp_attention = a->dp_attention};
    loom_model_options_t mo = {.max_tokens = (int)a->max_tokens, .max_seqs = (int)a->max_seqs,
                               .max_logits = (int)a->max_seqs, .allreduce = tp_allreduce,
                               .allreduce_ctx = w,
                               /* nccl steps are stream-ordered (handle_step): TP decode steps record graphs */
                               .allreduce_in_graphs = a->comm && !strcmp(a->comm->backend, "nccl"),
                               .decode_buckets = w->decode_buckets, .quant = quant,
                               .kv_dtype = kv_dtype, .expert_parallel = a->expert_parallel,
                               .max_loras = (int)a->max_loras,
                               .max_lora_rank = a->max_lora_rank ? (int)a->max_lora_rank : 16,
                               .mla_disable = a->mla_disable};
    LOOM_CHECK(loom_model_load(w->be, &w->cfg, w->st, &spec, &mo, &w->model, err));
    if (a->mtp && spec.has_head) LOOM_CHECK(mtp_load(w, &spec, &mo, err));
    if (mo.max_loras > 0)
        LOOM_CHECK(loom_lora_orders_create(w->model, &w->cfg, spec.layer_begin, spec.layer_end, mo.max_lora_rank,
                                           (int)a->max_cpu_loras, lora_report, w, &w->lora, err));
    w->max_tokens = (int)a->max_tokens;
    w->max_seqs = (int)a->max_seqs;
    /* sampling scratch: one part per row, LOOM_SAMPLE_MAX_CAND candidates each */
    free(w->parts);
    free(w->cand_ids);
    free(w->cand_keys);
    free(w->sp);
    free(w->steps_buf);
    free(w->kk);
    free(w->ids);
    /* per logit row: a step has at most max_seqs (the model refuses more) */
    size_t rows = (size_t)w->max_seqs;
    w->parts = loom_xcalloc(rows, sizeof *w->parts);
    w->cand_ids = loom_xmalloc(rows * LOOM_SAMPLE_MAX_CAND * sizeof(int32_t));
    w->cand_keys = loom_xmalloc(rows * LOOM_SAMPLE_MAX_CAND * sizeof(float));
    for (size_t i = 0; i < rows; i++) {
        w->parts[i].ids = w->cand_ids + i * LOOM_SAMPLE_MAX_CAND;
        w->parts[i].keys = w->cand_keys + i * LOOM_SAMPLE_MAX_CAND;
    }
    w->sp = loom_xmalloc(rows * sizeof *w->sp);
    w->steps_buf = loom_xmalloc(rows * sizeof *w->steps_buf);
    w->kk = loom_xmalloc(rows * sizeof *w->kk);
    w->ids = loom_xmalloc(rows * sizeof *w->ids);
    w->ids_step = 0;
    free(w->share_host);
    w->share_host = NULL;
    if (spec.tp_size > 1 && spec.has_head) { /* share_ids: mtp, and plans sent ahead */
        w->share_dev = loom_backend_alloc(w->be, rows * sizeof(float));
        if (!w->share_dev) return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for the sampled ids");
        w->share_host = loom_xmalloc(rows * sizeof(float));
    }
    return LOOM_OK;
}

/* Bytes of one row's serialized sampling part for k candidates. */
static size_t part_bytes(int k) {
    return 12 + 8 * (size_t)k;
}

static void handle_assign(worker_t *w, Loom__V1__ControlMsg *m) {
    Loom__V1__Assign *a = m->assign;
    loom_err_t err = {0};
    uint64_t t0 = loom_now_ns();
    int keep = w->model && same_shard(w->assign, a);
    if (!keep) {
        LOOM_INFO("assigned stage %u/%u, tp rank %u/%u, layers [%u, %u) of %s (epoch %llu)", a->stage,
                  a->n_stages, a->tp_rank, a->tp_size, a->layer_begin, a->layer_end, a->model_dir,
                  (unsigned long long)a->epoch);
        if (load(w, a, &err) < 0) {
            LOOM_ERROR("loading failed: %s", err.msg);
            char msg[700];
            snprintf(msg, sizeof msg, "worker %s failed to load its shard: %s", w->id, err.msg);
            post_error(w, err.code, msg);
            unload(w);
            protobuf_c_message_free_unpacked(&m->base, NULL);
            return;
        }
    } else {
        LOOM_INFO("re-assigned the same shard (epoch %llu): keeping the weights", (unsigned long long)a->epoch);
        pthread_mutex_lock(&w->comm_mu);
        loom_comm_destroy(&w->comm);
        pthread_mutex_unlock(&w->comm_mu);
    }
    w->epoch = a->epoch;
    if (w->lora) loom_lora_orders_forget(w->lora); /* the old epoch's orders */
    if (w->assign) protobuf_c_message_free_unpacked(&w->assign->base, NULL);
    /* keep the whole message alive: Assign points into it */
    w->assign = a;
    m->assign = NULL;
    m->body_case = LOOM__V1__CONTROL_MSG__BODY__NOT_SET;
    protobuf_c_message_free_unpacked(&m->base, NULL);

    int bs = (int)a->block_size > 0 ? (int)a->block_size : 16;
    w->block_size = bs;
    Loom__V1__Loaded l = LOOM__V1__LOADED__INIT;
    l.epoch = a->epoch;
    l.weight_bytes = loom_model_weight_bytes(w->model) + (w->mtp.model ? loom_model_weight_bytes(w->mtp.model) : 0);
    l.bytes_read = loom_st_bytes_read(w->st);
    /* the MTP module's latent cache follows the same block ids: one layer more per block */
    l.kv_block_bytes = loom_model_kv_block_bytes(w->model, bs) +
                       (w->mtp.model ? loom_model_kv_block_bytes(w->mtp.model, bs) : 0);
    l.kv_cache_dtype = (char *)loom_kv_dtype_name(loom_model_kv_dtype(w->model));
    size_t free_mem = loom_backend_mem_free(w->be);
    l.kv_budget = a->kv_memory > 0 ? a->kv_memory : (uint64_t)((double)free_mem * a->kv_fraction);
    uint64_t scratch = (uint64_t)loom_model_kv_scratch_blocks(w->model) * l.kv_block_bytes;
    l.kv_budget = l.kv_budget > scratch ? l.kv_budget - scratch : 0;
    l.load_s = (double)(loom_now_ns() - t0) * 1e-9;
    /* group ids for backends that need one member to make them (nccl) */
    uint8_t tp_id[LOOM_COMM_ID_BYTES], next_id[LOOM_COMM_ID_BYTES];
    size_t tp_len = 0, next_len = 0;
    const char *backend = a->comm ? a->comm->backend : "shm";
    if ((a->tp_rank == 0 && loom_comm_make_id(backend, tp_id, &tp_len, &err) < 0) ||
        (a->stage + 1 < a->n_stages && loom_comm_make_id(backend, next_id, &next_len, &err) < 0)) {
        post_error(w, err.code, err.msg);
        return;
    }
    l.tp_group_id = (ProtobufCBinaryData){tp_len, tp_id};
    l.next_group_id = (ProtobufCBinaryData){next_len, next_id};
    LOOM_INFO("shard ready: %.1f MB of weights, %.1f MB read from the checkpoint, KV budget %.1f MB "
              "(%.1f KB per block)",
              (double)l.weight_bytes / 1e6, (double)l.bytes_read / 1e6, (double)l.kv_budget / 1e6,
              (double)l.kv_block_bytes / 1e3);
    Loom__V1__ControlMsg r = LOOM__V1__CONTROL_MSG__INIT;
    r.body_case = LOOM__V1__CONTROL_MSG__BODY_LOADED;
    r.loaded = &l;
    post(w, &r);
}

/* The join of the current epoch is called off: the coordinator aborted it. */
static int join_cancelled(void *ctx) {
    worker_t *w = ctx;
    return atomic_load(&w->aborted_epoch) >= w->epoch;
}

static void handle_kv_config(worker_t *w, Loom__V1__ControlMsg *m) {
    Loom__V1__KvConfig *k = m->kv_config;
    loom_err_t err = {0};
    const Loom__V1__Assign *a = w->assign;
    if (!w->model || !a || k->epoch != w->epoch) {
        LOOM_WARN("KV config for epoch %llu ignored (current %llu)", (unsigned long long)k->epoch,
                  (unsigned long long)w->epoch);
        goto done;
    }
    loom_kv_pd_stop(&w->kv_pd); /* its service reads the pool: gone before the pool moves */
    if ((int)k->n_blocks != loom_model_kv_blocks(w->model) || w->block_size != loom_model_kv_block_size(w->model)) {
        if (loom_model_alloc_kv(w->model, (int)k->n_blocks, w->block_size, &err) < 0) goto fail;
    }
    if (w->mtp.model && ((int)k->n_blocks != loom_model_kv_blocks(w->mtp.model) ||
                         w->block_size != loom_model_kv_block_size(w->mtp.model))) {
        if (loom_model_alloc_kv(w->mtp.model, (int)k->n_blocks, w->block_size, &err) < 0) goto fail;
    }
    w->n_blocks = (int)k->n_blocks;
    if (loom_kv_offload_config(&w->kv_tier, w->be, w->model, k->kv_offload_dir, k->kv_offload_id, k->kv_offload_max_bytes,
                               (int)(a->stage * a->tp_size + a->tp_rank), &err) < 0)
        goto fail;
    loom_model_set_layer_wait(w->model, w->kv_tier.dir[0] ? kv_layer_wait : NULL, &w->kv_tier);
    if (loom_kv_host_config(&w->kv_host, w->be, w->model, (int)k->kv_host_slots, &err) < 0) goto fail;

    /* data plane: the TP group and the pipeline neighbours */
    const Loom__V1__CommSetup *cs = a->comm;
    size_t n_tp = cs ? cs->n_tp_group : 0;
    if (n_tp != a->tp_size) {
        loom_err_set(&err, LOOM_ERR_FORMAT, "comm setup lists %zu TP peers for tp size %u", n_tp, a->tp_size);
        goto fail;
    }
    loom_comm_peer_t *peers = loom_xcalloc(n_tp, sizeof *peers);
    for (size_t i = 0; i < n_tp; i++) {
        peers[i].worker_id = cs->tp_group[i]->worker_id;
        peers[i].data_addr = cs->tp_group[i]->data_addr;
    }
    loom_comm_peer_t prev = {0}, next = {0};
    if (cs->prev) prev = (loom_comm_peer_t){cs->prev->worker_id, cs->prev->data_addr};
    if (cs->next) next = (loom_comm_peer_t){cs->next->worker_id, cs->next->data_addr};
    size_t gather = (size_t)w->max_seqs * (part_bytes(LOOM_SAMPLE_MAX_CAND) + loom_logprobs_max_extra_bytes());
    size_t hidden = (size_t)w->max_tokens * (size_t)w->cfg.dim * sizeof(float);
    loom_comm_config_t cc = {.version = LOOM_COMM_CONFIG_VERSION, .backend = cs->backend, .name = cs->name,
                             .self_id = w->id, .tp_rank = (int)a->tp_rank, .tp_size = (int)a->tp_size,
                             .tp_group = peers, .prev = cs->prev ? &prev : NULL, .next = cs->next ? &next : NULL,
                             .max_bytes = gather > hidden ? gather : hidden, .timeout_ms = 0,
                             .listener = w->listener,
                             .tp_group_id = k->tp_group_id.len ? k->tp_group_id.data : NULL,
                             .prev_group_id = k->prev_group_id.len ? k->prev_group_id.data : NULL,
                             .next_group_id = k->next_group_id.len ? k->next_group_id.data : NULL,
                             .cuda_device = loom_backend_device_index(w->be),
                             .cuda_stream = loom_backend_stream(w->be),
                             .auth_secret = a->data_secret.len ? a->data_secret.data : NULL,
                             .auth_secret_len = a->data_secret.len,
                             .encrypt = a->data_encrypt && !strcmp(cs->backend, "tcp"),
                             .cancelled = join_cancelled, .cancel_ctx = w};
    if (w->gather_cap < gather) {
        free(w->gather_send);
        free(w->gather_recv);
        w->gather_send = loom_xmalloc(gather);
        w->gather_recv = loom_xmalloc(gather * a->tp_size);
        w->gather_cap = gather;
    }
    loom_comm_t *c = NULL;
    loom_status_t s = loom_comm_create(&cc, &c, &err);
    free(peers);
    if (s < 0) goto fail;
    loom_backend_graph_drop(w->be); /* recorded against the old comm's communicators */
    pthread_mutex_lock(&w->comm_mu);
    loom_comm_destroy(&w->comm);
    w->comm = c;
    pthread_mutex_unlock(&w->comm_mu);
    LOOM_INFO("joined the data plane (%s, %zu TP peers%s%s), KV pool of %u blocks", loom_comm_backend(c), n_tp,
              cs->prev ? ", previous stage" : "", cs->next ? ", next stage" : "", k->n_blocks);
    char xfer_addr[320] = "";
    if (k->kv_xfer) { /* transport tcp */
        loom_kv_ident_t id;
        loom_kv_span_fmt_t fmt;
        char host[256] = "127.0.0.1";
        const char *la = loom_comm_listener_addr(w->listener), *hs = strncmp(la, "tcp://", 6) ? la : la + 6;
        const char *colon = strrchr(hs, ':');
        if (colon && colon > hs) snprintf(host, sizeof host, "%.*s", (int)(colon - hs), hs);
        if (host[0] == '[') { /* [v6] */
            memmove(host, host + 1, strlen(host));
            host[strlen(host) - 1] = '\0';
        }
        /* data-parallel attention: each rank's pool holds its own sequences' latent blocks, not the grid's */
        const char *no = a->dp_attention && a->tp_size > 1 ? "data-parallel attention's partitioned KV pools"
                         : w->mtp.model                     ? "the MTP module's latent cache"
                                                            : NULL;
        if (no) {
            loom_err_set(&err, LOOM_ERR_UNSUPPORTED, "transport tcp: %s are not moved this way", no);
            goto fail;
        }
        if (!loom_kv_pd_ident(w->model, k->kv_xfer_model, (int)a->tp_rank, (int)a->tp_size, (int)a->stage,
                              (int)a->n_stages, (int)a->layer_begin, (int)a->layer_end, &id, &fmt)) {
            loom_err_set(&err, LOOM_ERR_UNSUPPORTED, "transport tcp: decompressed MLA's KV (--disable-mla: V rows "
                         "narrower than K's) is not moved this way");
            goto fail;
        }
        if (loom_kv_pd_config(&w->kv_pd, (int)k->kv_xfer, w->epoch, w->model, w->be, &id, &fmt,
                              k->kv_xfer_secret.data, k->kv_xfer_secret.len, host, &err) < 0)
            goto fail;
        loom_kv_pd_addr(&w->kv_pd, xfer_addr, sizeof xfer_addr);
    }
    Loom__V1__Ready rd = LOOM__V1__READY__INIT;
    rd.epoch = w->epoch;
    rd.n_blocks = k->n_blocks;
    rd.kv_xfer_addr = xfer_addr;
    Loom__V1__ControlMsg r = LOOM__V1__CONTROL_MSG__INIT;
    r.body_case = LOOM__V1__CONTROL_MSG__BODY_READY;
    r.ready = &rd;
    post(w, &r);
    atomic_store(&w->joined_epoch, w->epoch);
    goto done;
fail:
    LOOM_ERROR("joining failed: %s", err.msg);
    post_join_error(w, k->epoch, err.code ? err.code : LOOM_ERR_INTERNAL, err.msg);
done:
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

/* ---- compute thread: steps ------------------------------------------------ */

/* Serializes rows' parts as [max_z, sum_exp, n, ids[k], keys[k]] with k per
 * row, each followed by its logprob part when the row asks for logprobs. */
static size_t pack_parts(const worker_t *w, Loom__V1__SampleParams *const *sp, const loom_sample_part_t *parts,
                         const int *k, int rows, uint8_t *out) {
    uint8_t *p = out;
    for (int r = 0; r < rows; r++) {
        memcpy(p, &parts[r].max_z, 4);
        memcpy(p + 4, &parts[r].sum_exp, 4);
        int32_t n = parts[r].n;
        memcpy(p + 8, &n, 4);
        memcpy(p + 12, parts[r].ids, (size_t)k[r] * 4);
        memcpy(p + 12 + (size_t)k[r] * 4, parts[r].keys, (size_t)k[r] * 4);
        p += part_bytes(k[r]);
        p = loom_logprobs_pack(&w->lp, r, sp[r], k[r], p);
    }
    return (size_t)(p - out);
}

static const uint8_t *unpack_part(const uint8_t *p, int k, loom_sample_part_t *part) {
    memcpy(&part->max_z, p, 4);
    memcpy(&part->sum_exp, p + 4, 4);
    int32_t n;
    memcpy(&n, p + 8, 4);
    part->n = n < 0 ? 0 : n > k ? k : n;
    part->ids = (int32_t *)(uintptr_t)(p + 12);
    part->keys = (float *)(uintptr_t)(p + 12 + (size_t)k * 4);
    return p + part_bytes(k);
}

static void trace_step(worker_t *w, uint64_t step, uint64_t t0, uint64_t t1) {
    if (!w->trace_path) return;
    if (w->n_trace == w->cap_trace) {
        w->cap_trace = w->cap_trace ? 2 * w->cap_trace : 1024;
        w->trace = loom_xrealloc(w->trace, (size_t)w->cap_trace * sizeof *w->trace);
    }
    w->trace[w->n_trace][0] = step;
    w->trace[w->n_trace][1] = t0;
    w->trace[w->n_trace][2] = t1;
    w->n_trace++;
}

/* Debugging aid: appends this shard's logits of a step to the dump file as
 * [step_id u64][rows i32][vocab_begin i32][vocab_len i32][rows x vocab_len f32]. */
static void dump_logits(worker_t *w, uint64_t step_id, int rows) {
    const loom_shard_dims_t *d = loom_model_dims(w->model);
    size_t n = (size_t)rows * (size_t)d->vocab;
    float *buf = loom_xmalloc(n * sizeof *buf);
    loom_model_download_logits(w->model, buf, rows);
    int32_t hdr[3] = {rows, d->vocab_begin, d->vocab};
    fwrite(&step_id, sizeof step_id, 1, w->dump);
    fwrite(hdr, sizeof hdr, 1, w->dump);
    fwrite(buf, sizeof *buf, n, w->dump);
    fflush(w->dump);
    free(buf);
}

/* The plan's embedding ranges (checked by loom_wire_check_plan): one sum of
 * final-normed hidden rows each. The hidden states are replicated on every
 * TP rank after the last all-reduce, so rank 0 answers alone. */
static void pool_embeddings(worker_t *w, const Loom__V1__StepPlan *p) {
    size_t dim = (size_t)w->cfg.dim, need = p->n_embed_begin * dim;
    if (need > w->cap_emb) {
        w->emb = loom_xrealloc(w->emb, need * sizeof(float));
        w->cap_emb = need;
    }
    for (size_t i = 0; i < p->n_embed_begin; i++)
        loom_model_pool_hidden(w->model, p->embed_begin[i], p->embed_end[i], w->emb + i * dim);
    w->n_emb = need;
}

/* The plan's prompt logprobs (last stage), in batches of the model's logit
 * rows: the head at those positions, this shard's parts, the prompt
 * tokens' logits summed across the TP group, the parts gathered and merged
 * on TP rank 0 (logits_proc.h). After the sampled rows are done. */
static loom_status_t prompt_logprobs(worker_t *w, const Loom__V1__StepPlan *p, loom_err_t *err) {
    const loom_shard_dims_t *d = loom_model_dims(w->model);
    int tp = (int)w->assign->tp_size, rank0 = w->assign->tp_rank == 0;
    int total = (int)p->n_prompt_lp_rows, cap = loom_model_max_logits(w->model);
    loom_prompt_lp_reset(&w->plp, total);
    for (int b0 = 0; b0 < total; b0 += cap) {
        int n = LOOM_MIN(cap, total - b0);
        const uint32_t *tops = p->prompt_lp_top + b0;
        loom_model_head_rows(w->model, p->prompt_lp_rows + b0, n);
        float *host = loom_prompt_lp_batch(&w->plp, n, d->vocab);
        float *dev = loom_model_logits(w->model);
        loom_backend_download(w->be, host, dev, (size_t)n * (size_t)d->vocab * sizeof(float));
        loom_prompt_lp_parts(&w->plp, n, d->vocab_begin, d->vocab, tops, p->prompt_lp_ids + b0);
        if (tp > 1) { /* each token has one owner: the sum is its logit, on every shard */
            loom_backend_upload(w->be, dev, w->plp.target, (size_t)n * sizeof(float));
            LOOM_CHECK(loom_comm_allreduce(w->comm, dev, n, err));
            loom_backend_download(w->be, w->plp.target, dev, (size_t)n * sizeof(float));
        }
        loom_prompt_lp_count(&w->plp, n, d->vocab);
        if (tp == 1) {
            loom_prompt_lp_merge(&w->plp, n, tops, NULL, 0, 1);
            continue;
        }
        size_t bytes = loom_prompt_lp_bytes(tops, n);
        LOOM_ASSERT(bytes <= w->gather_cap);
        loom_prompt_lp_pack(&w->plp, n, tops, w->gather_send);
        LOOM_CHECK(loom_comm_gather(w->comm, w->gather_send, bytes, rank0 ? w->gather_recv : NULL, err));
        if (rank0) loom_prompt_lp_merge(&w->plp, n, tops, w->gather_recv, bytes, tp);
    }
    return LOOM_OK;
}

/* Rank 0 merged the step's samples into its w->ids: the TP group learns
 * them as a sum (ids < 2^24 are exact), into every rank's w->ids. Inside
 * the caller's loom_comm_step_begin/end. */
static loom_status_t share_ids(worker_t *w, int rows, loom_err_t *err) {
    int rank0 = w->assign->tp_rank == 0;
    for (int r = 0; r < rows; r++) w->share_host[r] = rank0 ? (float)w->ids[r] : 0.0f;
    loom_backend_upload(w->be, w->share_dev, w->share_host, (size_t)rows * sizeof(float));
    LOOM_CHECK(loom_comm_allreduce(w->comm, w->share_dev, rows, err));
    loom_backend_download(w->be, w->share_host, w->share_dev, (size_t)rows * sizeof(float));
    for (int r = 0; r < rows; r++) w->ids[r] = (int32_t)w->share_host[r];
    w->ids_shared = 1;
    return LOOM_OK;
}

/* Assign.mtp: the MTP module's rows for the step's tokens, after the
 * target's (mtp_rows.h says which token each reads), and, per sequence
 * with logit rows, its greedy draft from the last accepted row (rank 0
 * keeps them for the result). The module's cache rows of rejected drafts
 * are rewritten by the next step, as the target's are. */
static loom_status_t mtp_step(worker_t *w, const Loom__V1__StepPlan *p, loom_err_t *err) {
    worker_mtp_t *t = &w->mtp;
    const Loom__V1__Assign *a = w->assign;
    int n = (int)p->n_tokens, rows = (int)p->n_logit_rows, tp = (int)a->tp_size, rank0 = a->tp_rank == 0;
    int vocab = w->cfg.vocab_size;
    t->n_drafts = 0;
    LOOM_CHECK(loom_comm_step_begin(w->comm, n, err));
    loom_status_t s = LOOM_OK;
    if (rows && tp > 1 && !w->ids_shared) s = share_ids(w, rows, err);
    int nm = 0;
    if (s == LOOM_OK) {
        const int32_t *sampled = w->ids;
        loom_mtp_step_t ms = {.tokens = p->tokens, .tok_seq = p->tok_seq, .n_tokens = n, .n_seqs = (int)p->n_seqs,
                              .logit_rows = p->logit_rows, .sampled = sampled, .n_logits = rows,
                              .next = p->n_mtp_next ? p->mtp_next : NULL};
        nm = loom_mtp_rows(&ms, t->in_ids, t->rows, t->seq);
        loom_model_normed_rows(w->model, 0, n, t->h);
        loom_backend_upload(w->be, loom_model_mtp_input(t->model), t->h, (size_t)n * w->cfg.dim * sizeof(float));
        if (p->n_copy_src) loom_model_copy_blocks(t->model, p->copy_src, p->copy_dst, (int)p->n_copy_src);
        loom_step_batch_t b = {.n_tokens = n, .tokens = t->in_ids, .pos = p->pos, .slots = p->slots,
                               .tok_seq = p->tok_seq, .n_seqs = (int)p->n_seqs, .block_tables = p->block_tables,
                               .max_blocks = (int)p->max_blocks, .n_logits = nm, .logit_rows = t->rows};
        s = loom_model_forward(t->model, &b, err);
    }
    loom_err_t end_err = {0};
    loom_status_t end = loom_comm_step_end(w->comm, &end_err);
    if (s >= 0 && end < 0) s = end, *err = end_err;
    if (s < 0 || nm == 0) return s;
    loom_model_sample_parts(t->model, nm, t->greedy, t->steps, w->parts);
    for (uint32_t i = 0; i < p->n_seqs; i++) t->drafts[i] = -1;
    if (tp == 1) {
        for (int r = 0; r < nm; r++) t->drafts[t->seq[r]] = loom_sample_merge(&w->parts[r], 1, vocab, &t->greedy[r], 0);
    } else { /* the head is vocabulary-sliced: rank 0 merges the ranks' candidates, as for the target */
        for (int r = 0; r < nm; r++) w->kk[r] = loom_sample_k(&t->greedy[r], vocab);
        size_t bytes = pack_parts(w, t->plain_ptrs, w->parts, w->kk, nm, w->gather_send);
        LOOM_CHECK(loom_comm_gather(w->comm, w->gather_send, bytes, rank0 ? w->gather_recv : NULL, err));
        if (!rank0) return LOOM_OK;
        LOOM_ASSERT(tp <= LOOM_SAMPLE_MAX_PARTS);
        const uint8_t *base[LOOM_SAMPLE_MAX_PARTS];
        loom_sample_part_t merged[LOOM_SAMPLE_MAX_PARTS];
        for (int q = 0; q < tp; q++) base[q] = w->gather_recv + (size_t)q * bytes;
        for (int r = 0; r < nm; r++) {
            for (int q = 0; q < tp; q++) base[q] = unpack_part(base[q], w->kk[r], &merged[q]);
            t->drafts[t->seq[r]] = loom_sample_merge(merged, tp, vocab, &t->greedy[r], 0);
        }
    }
    t->n_drafts = p->n_seqs;
    return LOOM_OK;
}

/* Overlapped scheduling: the plan's tokens that are the ids this worker
 * sampled in step p->prev_step, which must be the step it ran last. Only a
 * worker that both embeds and samples has them: one stage, of one TP rank
 * or of a group that shares its ids (Assign.share_sampled_ids). */
static loom_status_t prev_tokens(worker_t *w, Loom__V1__StepPlan *p, loom_err_t *err) {
    const Loom__V1__Assign *a = w->assign;
    if (a->n_stages != 1 || (a->tp_size != 1 && !a->share_sampled_ids))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "step %llu reads sampled ids ahead, which needs one stage of one TP rank or of a "
                            "group sharing its ids",
                            (unsigned long long)p->step_id);
    if (!w->ids_step || w->ids_step != p->prev_step || w->ids_epoch != p->epoch)
        return loom_err_set(err, LOOM_ERR_INTERNAL,
                            "step %llu reads the ids of step %llu, which is not the step this worker ran last",
                            (unsigned long long)p->step_id, (unsigned long long)p->prev_step);
    for (size_t i = 0; i < p->n_prev_rows; i++) {
        int r = p->prev_rows[i];
        if (r < 0) continue;
        if (r >= w->ids_n)
            return loom_err_set(err, LOOM_ERR_FORMAT, "step %llu reads row %d of step %llu, which sampled %d",
                                (unsigned long long)p->step_id, r, (unsigned long long)p->prev_step, w->ids_n);
        p->tokens[i] = w->ids[r];
    }
    return LOOM_OK;
}

/* Transport tcp: the plan's pulls into this shard's pool, before the
 * layers. A source that failed on any TP rank (gathered to rank 0) is
 * reported (StepResult.kv_pull_failed); the step still runs. */
static loom_status_t kv_pulls(worker_t *w, const Loom__V1__StepPlan *p, loom_err_t *err) {
    int n_src = (int)p->n_kv_pull_addrs;
    if (w->cap_pull_src < n_src) {
        w->cap_pull_src = n_src;
        w->pull_failed = loom_xrealloc(w->pull_failed, (size_t)n_src * sizeof *w->pull_failed);
        w->pull_why = loom_xrealloc(w->pull_why, (size_t)n_src * sizeof *w->pull_why);
        w->pull_failed_ids = loom_xrealloc(w->pull_failed_ids, (size_t)n_src * sizeof *w->pull_failed_ids);
    }
    char **why = loom_xcalloc((size_t)n_src, sizeof *why);
    loom_kv_pd_pull(&w->kv_pd, p->kv_pull_blocks, p->kv_pull_remote, p->kv_pull_source, (int)p->n_kv_pull_blocks,
                    p->kv_pull_addrs, p->kv_pull_transfer, n_src, w->pull_failed, why);
    const int tp = (int)w->assign->tp_size, rank0 = w->assign->tp_rank == 0;
    if (tp > 1) { /* rank 0, which reports, learns which sources failed on any rank (host buffers: any backend) */
        uint8_t *mine = loom_xmalloc((size_t)n_src), *all = rank0 ? loom_xmalloc((size_t)n_src * tp) : NULL;
        for (int i = 0; i < n_src; i++) mine[i] = (uint8_t)w->pull_failed[i];
        loom_status_t st = loom_comm_gather(w->comm, mine, (size_t)n_src, all, err);
        for (int r = 1; st == LOOM_OK && rank0 && r < tp; r++)
            for (int i = 0; i < n_src; i++) w->pull_failed[i] |= all[(size_t)r * n_src + i];
        free(mine);
        free(all);
        if (st < 0) {
            for (int i = 0; i < n_src; i++) free(why[i]);
            free(why);
            return st;
        }
    }
    w->n_pull_failed = 0;
    for (int i = 0; i < n_src; i++) {
        if (w->pull_failed[i]) {
            w->pull_failed_ids[w->n_pull_failed] = (uint32_t)i;
            w->pull_why[w->n_pull_failed++] = why[i] ? why[i] : loom_xstrdup("the pull failed on another TP rank");
        } else {
            free(why[i]);
        }
    }
    free(why);
    return LOOM_OK;
}

static void handle_step(worker_t *w, Loom__V1__ControlMsg *m) {
    Loom__V1__StepPlan *p = m->step;
    loom_err_t err = {0};
    uint64_t t0 = loom_now_ns();
    double comm0 = w->comm ? loom_comm_seconds(w->comm) : 0;
    const Loom__V1__Assign *a = w->assign;
    int last = a && a->stage + 1 == a->n_stages, rank0 = a && a->tp_rank == 0;
    loom_status_t s = LOOM_OK;
    loom_logprobs_reset_results(&w->lp);
    w->plp.n = w->plp.n_tops = 0;
    w->n_emb = 0;
    w->mtp.n_drafts = 0;
    w->ids_shared = 0;
    if (!w->model || !w->comm || !a || p->epoch != w->epoch) {
        s = loom_err_set(&err, LOOM_ERR_UNAVAILABLE, "worker %s is not serving epoch %llu", w->id,
                         (unsigned long long)p->epoch);
        goto report;
    }
    if (p->epoch <= atomic_load(&w->aborted_epoch)) {
        s = loom_err_set(&err, LOOM_ERR_UNAVAILABLE, "epoch %llu was aborted", (unsigned long long)p->epoch);
        goto report;
    }
    /* data-parallel attention: the plan's ids address every TP rank's pool, this one's partition among them */
    const int n_dp = a->dp_attention && a->tp_size > 1 ? (int)a->tp_size : 0;
    loom_plan_limits_t lim = {.max_tokens = w->max_tokens, .max_seqs = w->max_seqs,
                              .n_blocks = w->n_blocks * (n_dp ? n_dp : 1), .vocab_size = w->cfg.vocab_size,
                              .max_pos = w->cfg.max_seq_len, .block_size = w->block_size,
                              .max_loras = loom_model_max_loras(w->model), .n_dp = n_dp};
    if ((s = loom_wire_check_plan(p, &lim, &err)) < 0) {
        LOOM_WARN("refused step %llu: %s", (unsigned long long)p->step_id, err.msg);
        goto report;
    }
    if (p->n_prev_rows && (s = prev_tokens(w, p, &err)) < 0) goto report;
    int n = (int)p->n_tokens;
    size_t hidden_bytes = (size_t)n * (size_t)w->cfg.dim * sizeof(float);
    /* the directory tier's loads start first (they run beside the receive
     * and the layers, each layer waiting for its own part) */
    if (p->n_kv_save_slots || p->n_kv_load_slots) { /* the host tier (and the directory below it) */
        if ((s = loom_kv_host_step(&w->kv_host, w->model, &w->kv_tier, p->kv_save_blocks, p->kv_save_hashes,
                                   p->kv_save_slots, p->n_kv_save_slots, p->kv_load_blocks, p->kv_load_hashes,
                                   p->kv_load_slots, p->n_kv_load_slots, &err)) < 0)
            goto report;
    } else if ((s = loom_kv_offload_step(&w->kv_tier, w->model, p->kv_save_blocks, p->kv_save_hashes,
                                         p->n_kv_save_blocks, p->kv_load_blocks, p->kv_load_hashes,
                                         p->n_kv_load_blocks, &err)) < 0) {
        goto report;
    }
    if (p->n_kv_pull_addrs && (s = kv_pulls(w, p, &err)) < 0) goto report;
    if (a->stage > 0 && (s = loom_comm_recv_prev(w->comm, loom_model_hidden(w->model), hidden_bytes, &err)) < 0)
        goto report;
    if (p->n_copy_src) /* a copy may read a block being loaded */
        kv_layer_wait(&w->kv_tier, loom_model_dims(w->model)->n_layers - 1);
    if (p->n_copy_src && n_dp) { /* only the copies of this rank's sequences, in its own ids */
        int nc = (int)p->n_copy_src;
        w->dp_copy = loom_xrealloc(w->dp_copy, (size_t)nc * 2 * sizeof *w->dp_copy);
        int local = loom_model_dp_copies(w->model, p->copy_src, p->copy_dst, nc, w->dp_copy, w->dp_copy + nc);
        if (local) loom_model_copy_blocks(w->model, w->dp_copy, w->dp_copy + nc, local);
    } else if (p->n_copy_src) {
        loom_model_copy_blocks(w->model, p->copy_src, p->copy_dst, (int)p->n_copy_src);
    }
    loom_step_batch_t b = {.n_tokens = n, .tokens = p->tokens, .pos = p->pos, .slots = p->slots,
                           .tok_seq = p->tok_seq, .n_seqs = (int)p->n_seqs, .block_tables = p->block_tables,
                           .max_blocks = (int)p->max_blocks, .n_logits = last ? (int)p->n_logit_rows : 0,
                           .logit_rows = p->logit_rows, .seq_lora = p->n_seq_lora ? p->seq_lora : NULL,
                           .seq_dp_rank = n_dp ? p->seq_dp_rank : NULL};
    /* stream-ordered on nccl: the all-reduces of the pass are only enqueued
     * (and may sit in a decode graph); step_end waits for them under the
     * comm's watchdog, so a dead peer fails the step instead of hanging it */
    if ((s = loom_comm_step_begin(w->comm, n, &err)) < 0) goto report;
    s = loom_model_forward(w->model, &b, &err);
    loom_err_t end_err = {0};
    loom_status_t end = loom_comm_step_end(w->comm, &end_err);
    if (s >= 0 && end < 0) s = end, err = end_err;
    end = loom_kv_offload_finish(&w->kv_tier, &end_err); /* a bad file: the step ran on it, its results go */
    if (s >= 0 && end < 0) s = end, err = end_err;
    if (s < 0) goto report;
    if (loom_model_last_pad(w->model)) atomic_fetch_add(&w->padded_steps, 1);
    loom_kv_offload_save(&w->kv_tier, w->model, p->kv_save_after_blocks, p->kv_save_after_hashes,
                         p->n_kv_save_after_blocks);
    if (p->n_kv_pull_addrs && rank0) /* every rank's pulls landed before the gather and the layers: read */
        loom_kv_pd_done(&w->kv_pd, p->kv_pull_addrs, p->kv_pull_transfer, (int)p->n_kv_pull_addrs, w->pull_failed);
    if (!last) {
        s = loom_comm_send_next(w->comm, loom_model_hidden(w->model), hidden_bytes, &err);
        goto report;
    }
    if (rank0 && p->n_embed_begin) pool_embeddings(w, p);
    int rows = (int)p->n_logit_rows;
    if (rows == 0) goto prompt;
    int vocab = w->cfg.vocab_size;
    int *kk = w->kk;
    if (rows > w->max_seqs) { /* loom_model_forward refuses them first; the buffers below hold max_seqs rows */
        s = loom_err_set(&err, LOOM_ERR_INVALID_ARGUMENT,
                         "step %llu has %d logit rows; this worker holds %d (its Assign's max_seqs)",
                         (unsigned long long)p->step_id, rows, w->max_seqs);
        goto report;
    }
    for (int r = 0; r < rows; r++) {
        const Loom__V1__SampleParams *sp = p->sampling[r];
        w->sp[r] = (loom_sampling_t){.temperature = sp->temperature, .top_k = sp->top_k, .top_p = sp->top_p,
                                     .seed = sp->seed, .min_p = sp->min_p};
        w->steps_buf[r] = sp->step;
        kk[r] = loom_sample_k(&w->sp[r], vocab);
    }
    if (w->dump) dump_logits(w, p->step_id, rows);
    const loom_shard_dims_t *dims = loom_model_dims(w->model);
    if ((s = loom_logprobs_capture(&w->lp, w->be, loom_model_logits(w->model), rows, dims->vocab_begin, dims->vocab,
                                   p->sampling, &err)) < 0)
        goto report;
    if ((s = loom_logits_process(w->be, loom_model_logits(w->model), rows, dims->vocab_begin, dims->vocab, vocab,
                                 p->sampling, &w->edit_row, &w->edit_cap, &err)) < 0)
        goto report;
    loom_model_sample_parts(w->model, rows, w->sp, w->steps_buf, w->parts);
    for (int r = 0; r < rows; r++)
        if (p->sampling[r]->logprobs) loom_logprobs_candidates(&w->lp, r, &w->parts[r]);
    int tp = (int)a->tp_size;
    if (tp == 1) {
        for (int r = 0; r < rows; r++) {
            w->ids[r] = loom_sample_merge(&w->parts[r], 1, vocab, &w->sp[r], w->steps_buf[r]);
            if (!w->lp.any) continue;
            const float *cr = w->lp.cand_raw + (size_t)r * LOOM_SAMPLE_MAX_CAND;
            loom_logprobs_finish(&w->lp, p->sampling[r], &w->lp.parts[r], &cr, &w->parts[r], 1, w->ids[r]);
        }
    } else {
        size_t bytes = pack_parts(w, p->sampling, w->parts, kk, rows, w->gather_send);
        if ((s = loom_comm_gather(w->comm, w->gather_send, bytes, rank0 ? w->gather_recv : NULL, &err)) < 0)
            goto report;
        if (rank0) {
            loom_sample_part_t merged[LOOM_SAMPLE_MAX_PARTS]; /* the coordinator caps --tp at this */
            LOOM_ASSERT(tp <= LOOM_SAMPLE_MAX_PARTS);
            const uint8_t *base[LOOM_SAMPLE_MAX_PARTS];
            for (int q = 0; q < tp; q++) base[q] = w->gather_recv + (size_t)q * bytes;
            loom_lp_part_t lps[LOOM_SAMPLE_MAX_PARTS];
            const float *cand_raw[LOOM_SAMPLE_MAX_PARTS];
            for (int r = 0; r < rows; r++) {
                for (int q = 0; q < tp; q++) {
                    base[q] = unpack_part(base[q], kk[r], &merged[q]);
                    base[q] = loom_logprobs_unpack(base[q], p->sampling[r], kk[r], &lps[q], &cand_raw[q]);
                }
                w->ids[r] = loom_sample_merge(merged, tp, vocab, &w->sp[r], w->steps_buf[r]);
                loom_logprobs_finish(&w->lp, p->sampling[r], lps, cand_raw, merged, tp, w->ids[r]);
            }
        }
        if (a->share_sampled_ids && a->n_stages == 1) { /* the next plan may be sent ahead: every rank embeds them */
            if ((s = loom_comm_step_begin(w->comm, rows, &err)) < 0) goto report;
            s = share_ids(w, rows, &err);
            end = loom_comm_step_end(w->comm, &end_err);
            if (s >= 0 && end < 0) s = end, err = end_err;
            if (s < 0) goto report;
        }
    }
prompt:
    if (w->mtp.model && (s = mtp_step(w, p, &err)) < 0) goto report;
    if (p->n_prompt_lp_rows) s = prompt_logprobs(w, p, &err);
report:;
    if (w->kv_tier.load) { /* a path out before the forward's finish: the pool is not written behind the next step */
        loom_err_t ignore = {0};
        loom_kv_offload_finish(&w->kv_tier, &ignore);
    }
    /* a plan sent ahead names this step: its ids stay in w->ids until then */
    int have_ids = s >= 0 && last && (rank0 || w->ids_shared);
    w->ids_step = have_ids ? p->step_id : 0;
    w->ids_epoch = p->epoch;
    w->ids_n = have_ids ? (int)p->n_logit_rows : 0;
    uint64_t t1 = loom_now_ns();
    double comm_s = w->comm ? loom_comm_seconds(w->comm) - comm0 : 0;
    atomic_fetch_add(&w->busy_ns, t1 - t0);
    atomic_fetch_add(&w->steps, 1);
    atomic_store(&w->comm_ns, (uint64_t)((w->comm ? loom_comm_seconds(w->comm) : 0) * 1e9));
    trace_step(w, p->step_id, t0, t1);
    if (s < 0) {
        if (s != LOOM_ERR_UNAVAILABLE || p->epoch > atomic_load(&w->aborted_epoch))
            LOOM_WARN("step %llu failed: %s", (unsigned long long)p->step_id, err.msg);
        post_result(w, p->epoch, p->step_id, NULL, 0, s, err.msg, (double)(t1 - t0) * 1e-9, comm_s, NULL);
    } else if (last && rank0) {
        post_result(w, p->epoch, p->step_id, w->ids, p->n_logit_rows, LOOM_OK, NULL, (double)(t1 - t0) * 1e-9,
                    comm_s, &w->lp);
    }
    for (int i = 0; i < w->n_pull_failed; i++) free(w->pull_why[i]);
    w->n_pull_failed = 0;
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

/* With LoRA loads under way, waits at most LORA_POLL_MS for a message and
 * installs the adapters prepared meanwhile: 1 when a message is ready. */
static int compute_wait(worker_t *w) {
    if (!w->lora) return 1;
    loom_lora_orders_poll(w->lora);
    if (!loom_lora_orders_pending(w->lora)) return 1;
    zmq_pollitem_t it = {w->pipe_c, 0, ZMQ_POLLIN, 0};
    return zmq_poll(&it, 1, LORA_POLL_MS) != 0; /* an error: let zmq_recv report it */
}

static void *compute_main(void *arg) {
    worker_t *w = arg;
    for (;;) {
        Loom__V1__ControlMsg *m = NULL;
        if (!compute_wait(w)) continue;
        if (zmq_recv(w->pipe_c, &m, sizeof m, 0) != (int)sizeof m) {
            if (errno == EINTR) continue;
            break;
        }
        if (!m) break; /* quit */
        switch (m->body_case) {
        case LOOM__V1__CONTROL_MSG__BODY_ASSIGN: handle_assign(w, m); break;
        case LOOM__V1__CONTROL_MSG__BODY_KV_CONFIG: handle_kv_config(w, m); break;
        case LOOM__V1__CONTROL_MSG__BODY_STEP: handle_step(w, m); break;
        case LOOM__V1__CONTROL_MSG__BODY_LORA_LOAD: handle_lora_load(w, m); break;
        default: protobuf_c_message_free_unpacked(&m->base, NULL); break;
        }
    }
    unload(w);
    return NULL;
}

/* ---- reactor -------------------------------------------------------------- */

/* left: this worker left the grid it was in (its coordinator fell silent
 * or said it left) and serves no epoch, whatever the coordinator thinks. */
static void send_register(worker_t *w, int left) {
    char host[256] = "localhost", host_id[128] = "", mnt[64] = "";
    gethostname(host, sizeof host);
    /* Workers may share memory when they see the same /dev/shm: the same
     * kernel (boot id) and the same mount namespace (containers on one node
     * share the first, not the second). */
    char *boot = NULL;
    if (loom_read_file("/proc/sys/kernel/random/boot_id", &boot, NULL, NULL) == LOOM_OK) {
        boot[strcspn(boot, "\n")] = '\0';
        ssize_t n = readlink("/proc/self/ns/mnt", mnt, sizeof mnt - 1);
        mnt[n > 0 ? n : 0] = '\0';
        snprintf(host_id, sizeof host_id, "%.40s/%.60s", boot, mnt);
        free(boot);
    }
    Loom__V1__Register r = LOOM__V1__REGISTER__INIT;
    r.worker_id = w->id;
    r.host = host;
    r.host_id = host_id;
    r.device = (char *)w->device;
    r.threads = (uint32_t)w->threads;
    r.data_addr = (char *)loom_comm_listener_addr(w->listener);
    r.pid = (uint32_t)getpid();
    r.has_shard = w->has_shard;
    r.shard_stage = w->shard_stage;
    r.shard_n_stages = w->shard_n_stages;
    r.shard_tp_rank = w->shard_tp_rank;
    r.shard_tp_size = w->shard_tp_size;
    r.shard_model_dir = w->shard_model_dir;
    r.left_grid = left != 0;
    if (left) {
        r.left_epoch = w->left_epoch;
        r.left_incarnation = w->left_incarnation;
    }
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_REGISTER;
    m.register_ = &r;
    send_ctl(w, &m);
}

static void send_heartbeat(worker_t *w, uint64_t seq) {
    Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
    hb.seq = seq;
    hb.busy_s = (double)atomic_load(&w->busy_ns) * 1e-9;
    hb.comm_s = (double)atomic_load(&w->comm_ns) * 1e-9;
    hb.steps = atomic_load(&w->steps);
    hb.assigned_epoch = w->assigned_epoch;
    hb.assigned_incarnation = w->incarnation;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    send_ctl(w, &m);
}

static void hand_over(worker_t *w, Loom__V1__ControlMsg *m) {
    zmq_send(w->pipe_r, &m, sizeof m, 0);
}

static void write_trace(worker_t *w) {
    if (!w->trace_path || !w->n_trace) return;
    FILE *f = fopen(w->trace_path, "w");
    if (!f) {
        LOOM_WARN("cannot write trace %s", w->trace_path);
        return;
    }
    const Loom__V1__Assign *a = w->assign;
    int stage = a ? (int)a->stage : 0, rank = a ? (int)a->tp_rank : 0;
    fprintf(f, "[\n");
    for (int i = 0; i < w->n_trace; i++)
        fprintf(f, "{\"name\":\"step %llu\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}%s\n",
                (unsigned long long)w->trace[i][0], stage, rank, (double)w->trace[i][1] / 1e3,
                (double)(w->trace[i][2] - w->trace[i][1]) / 1e3, i + 1 < w->n_trace ? "," : "");
    fprintf(f, "]\n");
    fclose(f);
    LOOM_INFO("wrote %d step spans to %s", w->n_trace, w->trace_path);
}

/* --health-file: rewritten every second (so its age shows the reactor is
 * alive) with one word: serving (joined the current epoch), joining (holds a
 * slot, loading or connecting), standby (the grid is full: waits for a slot)
 * or registering. Written whole and renamed, so a reader never sees half. */
static int write_health(const worker_t *w, worker_state_t ws) {
    const char *state = "registering";
    if (ws == WORKER_IN_GRID)
        state = atomic_load(&w->joined_epoch) > atomic_load(&w->aborted_epoch) ? "serving" : "joining";
    else if (ws == WORKER_STANDBY)
        state = "standby";
    char tmp[1040];
    snprintf(tmp, sizeof tmp, "%s.tmp", w->health_path);
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    int ok = fprintf(f, "%s\n", state) > 0;
    ok = fclose(f) == 0 && ok;
    return ok && rename(tmp, w->health_path) == 0 ? 0 : -1;
}

static loom_status_t etcd_lookup(worker_t *w, char *out, size_t n, loom_err_t *err);

/* The worker left the grid (ORPHANED) and no Assign has come since. */
static int left_grid(const worker_t *w) {
    return atomic_load(&w->aborted_epoch) == UINT64_MAX;
}

static const char *state_name(worker_state_t s) {
    switch (s) {
    case WORKER_REGISTERING: return "registering";
    case WORKER_STANDBY: return "standby";
    case WORKER_IN_GRID: return "in the grid";
    case WORKER_ORPHANED: return "orphaned";
    }
    return "?";
}

static void set_state(worker_state_t *state, worker_state_t to) {
    if (*state != to) LOOM_DEBUG("worker state: %s -> %s", state_name(*state), state_name(to));
    *state = to;
}

static int register_retry_ms(worker_state_t s) {
    return s == WORKER_STANDBY ? STANDBY_RETRY_MS : s == WORKER_ORPHANED ? ORPHAN_RETRY_MS : REGISTER_RETRY_MS;
}

/* The coordinator went away (it said so, or fell silent): leave the grid
 * (abort the data plane), keep the weights, and look for the next one. */
static void coordinator_gone(worker_t *w, const char *why) {
    LOOM_WARN("%s: leaving the grid, keeping the weights; registering with the next coordinator", why);
    w->left_epoch = w->assigned_epoch;
    w->left_incarnation = w->incarnation;
    atomic_store(&w->aborted_epoch, UINT64_MAX);
    pthread_mutex_lock(&w->comm_mu);
    loom_comm_abort(w->comm);
    pthread_mutex_unlock(&w->comm_mu);
}

/* With the address from etcd: a new coordinator may listen elsewhere. */
static void follow_coordinator(worker_t *w) {
    if (!w->etcd || !w->coord_from_etcd) return;
    char addr[256];
    loom_err_t err = {0};
    if (etcd_lookup(w, addr, sizeof addr, &err) < 0 || !strcmp(addr, w->coord_addr)) return;
    LOOM_INFO("the coordinator of cluster '%s' is now at %s (was %s)", w->cluster, addr, w->coord_addr);
    zmq_disconnect(w->ctl, w->coord_addr);
    snprintf(w->coord_buf, sizeof w->coord_buf, "%s", addr);
    w->coord_addr = w->coord_buf;
    if (zmq_connect(w->ctl, w->coord_addr) != 0)
        LOOM_WARN("cannot connect to %s: %s", w->coord_addr, zmq_strerror(errno));
}

static int reactor(worker_t *w) {
    uint64_t last_hb = 0, hb_seq = 0, last_heard = loom_now_ns(), last_register = loom_now_ns(), last_health = 0;
    uint64_t last_wait_log = loom_now_ns();
    int health_ok = 1;
    worker_state_t state = WORKER_REGISTERING;
    send_register(w, 0);
    while (!g_stop) {
        zmq_pollitem_t items[] = {{w->ctl, 0, ZMQ_POLLIN, 0}, {w->pipe_r, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, 50) < 0 && errno != EINTR) break;
        uint64_t now = loom_now_ns();
        if (items[0].revents & ZMQ_POLLIN) {
            zmq_msg_t msg;
            zmq_msg_init(&msg);
            if (zmq_msg_recv(&msg, w->ctl, ZMQ_DONTWAIT) >= 0) {
                loom_err_t err = {0};
                Loom__V1__ControlMsg *m = loom_wire_unpack_control(zmq_msg_data(&msg), zmq_msg_size(&msg), &err);
                if (!m) {
                    LOOM_WARN("refused a control message: %s", err.msg);
                } else {
                    last_heard = now;
                    if (m->body_case != LOOM__V1__CONTROL_MSG__BODY_ERROR) set_state(&state, WORKER_IN_GRID);
                    switch (m->body_case) {
                    case LOOM__V1__CONTROL_MSG__BODY_ASSIGN: {
                        const Loom__V1__Assign *a = m->assign;
                        /* a new coordinator (it left, or a restarted one assigns before its
                         * predecessor's silence was noticed): its epochs count afresh */
                        int fresh = a->incarnation && a->incarnation != w->incarnation && w->incarnation;
                        int orphan = left_grid(w);
                        if (fresh && !orphan)
                            LOOM_INFO("assigned by a new coordinator (incarnation %llx, was %llx): "
                                      "forgetting the epochs of the previous one",
                                      (unsigned long long)a->incarnation, (unsigned long long)w->incarnation);
                        if (orphan || fresh) atomic_store(&w->aborted_epoch, 0);
                        if (a->incarnation) w->incarnation = a->incarnation;
                        w->assigned_epoch = a->epoch;
                        w->has_shard = 1;
                        w->shard_stage = a->stage;
                        w->shard_n_stages = a->n_stages;
                        w->shard_tp_rank = a->tp_rank;
                        w->shard_tp_size = a->tp_size;
                        snprintf(w->shard_model_dir, sizeof w->shard_model_dir, "%s", a->model_dir ? a->model_dir : "");
                        hand_over(w, m);
                        m = NULL;
                        break;
                    }
                    case LOOM__V1__CONTROL_MSG__BODY_KV_HOLD: {
                        const Loom__V1__KvHold *h = m->kv_hold;
                        loom_kv_pd_hold(&w->kv_pd, h->epoch, h->transfer, h->blocks, (int)h->n_blocks, h->release);
                        break;
                    }
                    case LOOM__V1__CONTROL_MSG__BODY_KV_CONFIG:
                    case LOOM__V1__CONTROL_MSG__BODY_STEP:
                    case LOOM__V1__CONTROL_MSG__BODY_LORA_LOAD: hand_over(w, m); m = NULL; break;
                    case LOOM__V1__CONTROL_MSG__BODY_ABORT: {
                        uint64_t e = m->abort->epoch;
                        if (m->abort->incarnation && w->incarnation && m->abort->incarnation != w->incarnation) {
                            LOOM_WARN("ignored an abort of epoch %llu from a previous coordinator",
                                      (unsigned long long)e);
                            break;
                        }
                        LOOM_WARN("abort of epoch %llu: %s", (unsigned long long)e, m->abort->reason);
                        if (e > atomic_load(&w->aborted_epoch)) atomic_store(&w->aborted_epoch, e);
                        pthread_mutex_lock(&w->comm_mu);
                        loom_comm_abort(w->comm);
                        pthread_mutex_unlock(&w->comm_mu);
                        break;
                    }
                    case LOOM__V1__CONTROL_MSG__BODY_SHUTDOWN: {
                        char why[300];
                        snprintf(why, sizeof why, "the coordinator left (%.200s)", m->shutdown->reason);
                        coordinator_gone(w, why);
                        set_state(&state, WORKER_ORPHANED);
                        last_register = 0; /* register again at once */
                        break;
                    }
                    case LOOM__V1__CONTROL_MSG__BODY_ERROR:
                        if (m->error->code == LOOM_ERR_RESOURCE_EXHAUSTED || m->error->code == LOOM_ERR_NOT_FOUND) {
                            /* the grid is full, or forgot us: stand by and register again */
                            if (state != WORKER_STANDBY)
                                LOOM_INFO("standing by: %s (registering again every %d ms)", m->error->message,
                                          STANDBY_RETRY_MS);
                            set_state(&state, WORKER_STANDBY);
                            last_register = now;
                        } else {
                            LOOM_ERROR("coordinator refused this worker: %s", m->error->message);
                            g_stop = 2;
                        }
                        break;
                    default: break; /* heartbeats: liveness only */
                    }
                    if (m) protobuf_c_message_free_unpacked(&m->base, NULL);
                }
            }
            zmq_msg_close(&msg);
        }
        if (items[1].revents & ZMQ_POLLIN) {
            zmq_msg_t msg;
            zmq_msg_init(&msg);
            if (zmq_msg_recv(&msg, w->pipe_r, ZMQ_DONTWAIT) >= 0)
                zmq_send(w->ctl, zmq_msg_data(&msg), zmq_msg_size(&msg), ZMQ_DONTWAIT);
            zmq_msg_close(&msg);
        }
        uint64_t read_ids[16], read_epoch = 0;
        int n_read = loom_kv_pd_take_done(&w->kv_pd, read_ids, 16, &read_epoch);
        for (int i = 0; i < n_read; i++) { /* transport tcp: a decode side read a transfer */
            Loom__V1__KvRead kr = LOOM__V1__KV_READ__INIT;
            kr.epoch = read_epoch;
            kr.transfer = read_ids[i];
            Loom__V1__ControlMsg km = LOOM__V1__CONTROL_MSG__INIT;
            km.body_case = LOOM__V1__CONTROL_MSG__BODY_KV_READ;
            km.kv_read = &kr;
            send_ctl(w, &km);
        }
        if (state == WORKER_IN_GRID && now - last_hb >= HEARTBEAT_MS * 1000000ull) {
            send_heartbeat(w, ++hb_seq);
            last_hb = now;
        }
        /* not (yet) in the grid: the coordinator may have started later, or a slot may free up */
        if (state != WORKER_IN_GRID && now - last_register > (uint64_t)register_retry_ms(state) * 1000000ull) {
            int left = left_grid(w);
            if (left) follow_coordinator(w);
            send_register(w, left);
            last_register = loom_now_ns();
        }
        /* no coordinator answers: say so every few seconds, and dial afresh (a
         * connection the coordinator did not take, e.g. while it still held
         * this id's previous connection, is never read) */
        if (state != WORKER_IN_GRID && now - last_heard > WAIT_LOG_MS * 1000000ull &&
            now - last_wait_log > WAIT_LOG_MS * 1000000ull) {
            LOOM_INFO("waiting for a coordinator at %s: no answer for %.0f s (registering every %d ms)",
                      w->coord_addr, (double)(now - last_heard) * 1e-9, register_retry_ms(state));
            last_wait_log = now;
            zmq_disconnect(w->ctl, w->coord_addr);
            if (zmq_connect(w->ctl, w->coord_addr) != 0)
                LOOM_WARN("cannot connect to %s: %s", w->coord_addr, zmq_strerror(errno));
            last_register = 0;
        }
        if (w->health_path && now - last_health >= 1000000000ull) {
            int ok = write_health(w, state) == 0;
            if (!ok && health_ok) LOOM_WARN("cannot write the health file %s: %s", w->health_path, strerror(errno));
            health_ok = ok;
            last_health = now;
        }
        if (state == WORKER_IN_GRID && now - last_heard > (uint64_t)w->coord_timeout_ms * 1000000ull) {
            char why[300];
            snprintf(why, sizeof why, "no message from the coordinator at %.200s for %d ms", w->coord_addr,
                     w->coord_timeout_ms);
            coordinator_gone(w, why);
            /* a fresh connection: on the old one, unacknowledged data waits out
             * TCP's backed-off retransmissions (tens of seconds after a long
             * network cut) before a new Register can get through */
            zmq_disconnect(w->ctl, w->coord_addr);
            if (zmq_connect(w->ctl, w->coord_addr) != 0)
                LOOM_WARN("cannot connect to %s: %s", w->coord_addr, zmq_strerror(errno));
            set_state(&state, WORKER_ORPHANED);
            last_register = 0;
        }
    }
    return g_stop == 2 ? 1 : 0;
}

/* etcd: finds the coordinator's control address under /loom/<cluster>/coordinator,
 * waiting for it to appear (the coordinator may start later). */
/* One read of /loom/<cluster>/coordinator: its control address. */
static loom_status_t etcd_lookup(worker_t *w, char *out, size_t n, loom_err_t *err) {
    char key[300];
    snprintf(key, sizeof key, "/loom/%s/coordinator", w->cluster);
    char *v = NULL;
    LOOM_CHECK(loom_etcd_get(w->etcd, key, &v, NULL, NULL, err));
    cJSON *j = cJSON_Parse(v);
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(j, "control");
    int ok = cJSON_IsString(c) && c->valuestring[0];
    if (ok) snprintf(out, n, "%s", c->valuestring);
    cJSON_Delete(j);
    free(v);
    if (!ok) return loom_err_set(err, LOOM_ERR_FORMAT, "etcd key %s does not hold a control address", key);
    return LOOM_OK;
}

static loom_status_t etcd_find_coordinator(worker_t *w, loom_err_t *err) {
    uint64_t deadline = loom_now_ns() + (uint64_t)w->coord_wait_s * 1000000000ull;
    int logged = 0;
    for (;;) {
        loom_status_t st = etcd_lookup(w, w->coord_buf, sizeof w->coord_buf, err);
        if (st == LOOM_OK) {
            w->coord_addr = w->coord_buf;
            w->coord_from_etcd = 1;
            LOOM_INFO("found the coordinator of cluster '%s' in etcd: %s", w->cluster, w->coord_addr);
            return LOOM_OK;
        }
        if (st != LOOM_ERR_NOT_FOUND && st != LOOM_ERR_UNAVAILABLE) return st;
        if (loom_now_ns() > deadline || g_stop)
            return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "no coordinator for cluster '%s' in etcd %s after %d s",
                                w->cluster, w->etcd_url, w->coord_wait_s);
        if (logged++ % (WAIT_LOG_MS / 200) == 0)
            LOOM_INFO("waiting for the coordinator of cluster '%s' to appear in etcd %s (key /loom/%s/coordinator)",
                      w->cluster, w->etcd_url, w->cluster);
        usleep(200000);
    }
}

/* Whether the process that holds our etcd key is an earlier one of ours that
 * is gone: same host, and its pid is not running here (or is our own: a
 * container restarted with the same pid). */
static int stale_holder(loom_etcd_t *e, const char *key, const char *host) {
    char *v = NULL;
    loom_err_t err = {0};
    if (loom_etcd_get(e, key, &v, NULL, NULL, &err) < 0) return 0;
    cJSON *j = cJSON_Parse(v);
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(j, "host");
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(j, "pid");
    int stale = 0;
    if (cJSON_IsString(h) && !strcmp(h->valuestring, host) && cJSON_IsNumber(p) && p->valuedouble >= 1 &&
        p->valuedouble < 4194305) {
        pid_t pid = (pid_t)p->valuedouble;
        stale = pid == getpid() || (kill(pid, 0) != 0 && errno == ESRCH);
        if (stale)
            LOOM_WARN("etcd key %s is held by an earlier worker on this host (pid %d, gone): taking it over", key,
                      (int)pid);
    }
    cJSON_Delete(j);
    free(v);
    return stale;
}

/* etcd: holds /loom/<cluster>/workers/<id> under a lease while this worker lives;
 * a key left by an earlier process of ours is taken over, a live holder's
 * lease waited out. */
static loom_status_t etcd_register(worker_t *w, loom_etcd_t *e, loom_etcd_keeper_t **keeper, loom_err_t *err) {
    char key[300], host[128] = "localhost";
    gethostname(host, sizeof host);
    snprintf(key, sizeof key, "/loom/%s/workers/%s", w->cluster, w->id);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", w->id);
    cJSON_AddStringToObject(j, "host", host);
    cJSON_AddStringToObject(j, "device", w->device);
    cJSON_AddStringToObject(j, "data_addr", loom_comm_listener_addr(w->listener));
    cJSON_AddNumberToObject(j, "pid", (double)getpid());
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    loom_status_t st;
    int waiting = 0;
    while ((st = loom_etcd_keeper_start(e, key, text, strlen(text), w->etcd_ttl, 1, keeper, err)) ==
           LOOM_ERR_RESOURCE_EXHAUSTED) {
        if (stale_holder(e, key, host)) {
            /* an earlier process with this id on this host, now gone (restarted
             * within the lease TTL, or etcd kept the key across its restart) */
            loom_err_t derr = {0};
            if (loom_etcd_delete(e, key, &derr) == LOOM_OK) continue;
            LOOM_WARN("could not remove the stale etcd key %s: %s", key, derr.msg);
        }
        if (!waiting++)
            LOOM_WARN("%s: waiting for its lease to expire (another live worker with id '%s' would hold it for "
                      "good)", err->msg, w->id);
        if (g_stop) break;
        sleep(1);
    }
    if (waiting && st == LOOM_OK) LOOM_INFO("registered in etcd as %s", key);
    free(text);
    return st;
}

/* Copies a path template, replacing "%i" with the worker id. */
static void expand_id(char *out, size_t n, const char *tmpl, const char *id) {
    size_t o = 0;
    for (const char *p = tmpl; *p && o + 1 < n; p++) {
        if (p[0] == '%' && p[1] == 'i') {
            o += (size_t)snprintf(out + o, n - o, "%s", id);
            if (o >= n) o = n - 1;
            p++;
        } else {
            out[o++] = *p;
        }
    }
    out[o] = '\0';
}

int main(int argc, char **argv) {
    loom_cpu_check_or_exit("loom-worker");
    loom_cpu_blas_check(argv); /* early: it may re-execute */
    loom_log_init("worker");
    worker_t w = {.device = "cpu", .data_host = "127.0.0.1", .coord_timeout_ms = 3000, .cluster = "default",
                  .etcd_ttl = 5, .coord_wait_s = 120};
    const char *id = NULL, *log_format = NULL, *curve_server = NULL, *curve_secret = NULL;
    loom_etcd_security_t etcd_sec = {0};
    loom_opt_t opts[] = {
        {"coordinator", LOOM_OPT_STR, &w.coord_addr, "ADDR", "coordinator control address, e.g. 127.0.0.1:5556 or tcp://127.0.0.1:5556 (or find it with --etcd)", 1, 0, NULL},
        {"etcd", LOOM_OPT_STR, &w.etcd_url, "URL", "register in etcd (e.g. http://127.0.0.1:2379) and find the coordinator there", 1, 0, NULL},
        LOOM_ETCD_SECURITY_OPTS(etcd_sec),
        {"cluster", LOOM_OPT_STR, &w.cluster, "NAME", "cluster name in etcd (default 'default')", 1, 0, NULL},
        {"etcd-ttl", LOOM_OPT_INT, &w.etcd_ttl, "S", "etcd lease TTL in seconds (default 5)", 1, 3600, NULL},
        {"coordinator-wait-s", LOOM_OPT_INT, &w.coord_wait_s, "S", "with --etcd: how long to wait for the coordinator to appear (default 120)", 1, 86400, NULL},
        {"device", LOOM_OPT_STR, &w.device, "DEV", "cpu or cuda:N (default cpu)", 1, 0, NULL},
        {"threads", LOOM_OPT_INT, &w.threads, "N", "CPU threads for compute (default: all cores)", 0, 1024, NULL},
        {"id", LOOM_OPT_STR, &id, "NAME", "worker id (default HOST-PID)", 1, 0, NULL},
        {"curve-server-key", LOOM_OPT_STR, &curve_server, "FILE", "the coordinator's CURVE public key: the control plane is then encrypted and authenticated (or LOOM_CURVE_SERVER_KEY: a file or the Z85 key)", 1, 0, NULL},
        {"curve-secret", LOOM_OPT_STR, &curve_secret, "FILE", "this worker's CURVE secret key; its public key must be in the coordinator's --worker-keys under this worker's --id (or LOOM_CURVE_SECRET)", 1, 0, NULL},
        {"data-host", LOOM_OPT_STR, &w.data_host, "ADDR", "address the data plane listens on (default 127.0.0.1)", 1, 0, NULL},
        {"coordinator-timeout-ms", LOOM_OPT_INT, &w.coord_timeout_ms, "MS", "when the coordinator is silent this long, leave the grid (keeping the weights) and register with the next one (default 3000)", 100, 1e9, NULL},
        {"trace", LOOM_OPT_STR, &w.trace_path, "FILE", "write per-step spans as a Chrome trace at exit (%i = worker id)", 1, 0, NULL},
        {"health-file", LOOM_OPT_STR, &w.health_path, "FILE", "rewrite FILE every second with this worker's state: serving, joining, standby or registering (%i = worker id)", 1, 0, NULL},
        {"decode-buckets", LOOM_OPT_STR, &w.buckets_opt, "MODE", "pad decode steps to batch-size buckets (1, 2, 4, 8, 16, ...) so recorded graphs cover every batch: auto (where the device records graphs), on, off", 1, 0, NULL},
        {"log-format", LOOM_OPT_STR, &log_format, "FMT", "log lines as text or json (default text, or LOOM_LOG_FORMAT)", 1, 0, NULL},
        {"dump-logits", LOOM_OPT_STR, &w.dump_path, "FILE", "debugging: write every step's logits (this shard's vocabulary slice) to FILE (%i = worker id)", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "loom-worker --coordinator ADDR [options]",
                           "A Loom worker: registers with the coordinator, loads its shard of the model, joins its\n"
                           "tensor- and pipeline-parallel groups and executes step plans.");
    if (r) return r < 0 ? 2 : 0;
    if (log_format && loom_log_set_format_name(log_format) < 0) {
        fprintf(stderr, "error: --log-format must be text or json, got '%s'\n", log_format);
        return 2;
    }
    if (!w.coord_addr && !w.etcd_url) {
        fprintf(stderr, "error: --coordinator ADDR or --etcd URL is required (see --help)\n");
        return 2;
    }
    char coord_ep[512];
    if (w.coord_addr) {
        if (loom_endpoint_normalize(w.coord_addr, coord_ep, sizeof coord_ep) < 0) {
            fprintf(stderr, "error: --coordinator takes an address like 127.0.0.1:5556 or tcp://127.0.0.1:5556\n");
            return 2;
        }
        w.coord_addr = coord_ep;
    }
    if (w.buckets_opt) {
        if (!strcmp(w.buckets_opt, "auto")) w.decode_buckets = 0;
        else if (!strcmp(w.buckets_opt, "on")) w.decode_buckets = 1;
        else if (!strcmp(w.buckets_opt, "off")) w.decode_buckets = -1;
        else {
            fprintf(stderr, "error: --decode-buckets must be auto, on or off, got '%s'\n", w.buckets_opt);
            return 2;
        }
    }
    loom_device_kind_t kind;
    int dev_index;
    if (!loom_device_parse(w.device, &kind, &dev_index)) {
        fprintf(stderr, "error: --device must be cpu or cuda:N, got '%s'\n", w.device);
        return 2;
    }
    if (!loom_backend_available(kind, dev_index)) {
        fprintf(stderr, "error: device %s is not available on this machine or in this build\n", w.device);
        return 1;
    }
    if (id) {
        snprintf(w.id, sizeof w.id, "%s", id);
    } else {
        char host[64] = "host";
        gethostname(host, sizeof host);
        snprintf(w.id, sizeof w.id, "%s-%d", host, (int)getpid());
    }
    char comp[160];
    snprintf(comp, sizeof comp, "worker %s", w.id);
    loom_log_init(comp);
    if (log_format) loom_log_set_format_name(log_format); /* the flag wins over LOOM_LOG_FORMAT */
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    char dump_file[1024], trace_file[1024], health_file[1024];
    if (w.dump_path) {
        expand_id(dump_file, sizeof dump_file, w.dump_path, w.id);
        if (!(w.dump = fopen(dump_file, "wb"))) {
            fprintf(stderr, "error: cannot open %s for writing\n", dump_file);
            return 1;
        }
    }
    if (w.trace_path) {
        expand_id(trace_file, sizeof trace_file, w.trace_path, w.id);
        w.trace_path = trace_file;
    }
    if (w.health_path) {
        expand_id(health_file, sizeof health_file, w.health_path, w.id);
        w.health_path = health_file;
    }
    loom_err_t err = {0};
    if (loom_comm_listener_create(w.data_host, 0, &w.listener, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    loom_etcd_security_env(&etcd_sec);
    loom_etcd_t *etcd = NULL;
    loom_etcd_keeper_t *keeper = NULL;
    if (w.etcd_url) {
        loom_status_t st = loom_etcd_open(w.etcd_url, 2000, &etcd, &err);
        w.etcd = etcd;
        if (st < 0 || (!w.coord_addr && etcd_find_coordinator(&w, &err) < 0) ||
            etcd_register(&w, etcd, &keeper, &err) < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            loom_etcd_close(&etcd);
            loom_comm_listener_destroy(&w.listener);
            return 1;
        }
    }
    pthread_mutex_init(&w.comm_mu, NULL);
    loom_kv_pd_init(&w.kv_pd);
    w.zctx = zmq_ctx_new();
    w.ctl = zmq_socket(w.zctx, ZMQ_DEALER);
    int zero = 0;
    int64_t maxmsg = LOOM_MAX_MSG_BYTES;
    zmq_setsockopt(w.ctl, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(w.ctl, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    zmq_setsockopt(w.ctl, ZMQ_ROUTING_ID, w.id, strlen(w.id));
    int keyed = 0;
    if (loom_keys_client(w.ctl, curve_server, curve_secret, &keyed, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    if (keyed) LOOM_INFO("control plane: CURVE (encrypted; this worker's key must be listed as '%s')", w.id);
    /* a connect to an unreachable host gives up after 2 s and is retried,
     * instead of waiting out the kernel's SYN retries (about two minutes) */
    int connect_timeout_ms = 2000;
    zmq_setsockopt(w.ctl, ZMQ_CONNECT_TIMEOUT, &connect_timeout_ms, sizeof connect_timeout_ms);
    if (zmq_connect(w.ctl, w.coord_addr) != 0) {
        fprintf(stderr, "error: cannot connect to %s: %s\n", w.coord_addr, zmq_strerror(errno));
        return 1;
    }
    w.pipe_r = zmq_socket(w.zctx, ZMQ_PAIR);
    w.pipe_c = zmq_socket(w.zctx, ZMQ_PAIR);
    zmq_setsockopt(w.pipe_r, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(w.pipe_c, ZMQ_LINGER, &zero, sizeof zero);
    zmq_bind(w.pipe_r, "inproc://compute");
    zmq_connect(w.pipe_c, "inproc://compute");
    LOOM_INFO("registering with %s (device %s, data plane %s)", w.coord_addr, w.device,
              loom_comm_listener_addr(w.listener));
    pthread_create(&w.compute, NULL, compute_main, &w);

    int rc = reactor(&w);

    /* stop the compute thread: abort any blocked comm call, then ask it to quit */
    atomic_store(&w.aborted_epoch, UINT64_MAX);
    pthread_mutex_lock(&w.comm_mu);
    loom_comm_abort(w.comm);
    pthread_mutex_unlock(&w.comm_mu);
    Loom__V1__ControlMsg *quit = NULL;
    zmq_send(w.pipe_r, &quit, sizeof quit, 0);
    pthread_join(w.compute, NULL);
    write_trace(&w);
    uint64_t steps = atomic_load(&w.steps);
    double busy = (double)atomic_load(&w.busy_ns) * 1e-9, comm = (double)atomic_load(&w.comm_ns) * 1e-9;
    LOOM_INFO("summary: %llu steps, %.3f s computing, %.3f s of it in the data plane (%.3f ms per step, %.3f ms "
              "data plane per step); %llu decode steps padded to their batch bucket",
              (unsigned long long)steps, busy, comm, steps ? busy * 1e3 / (double)steps : 0.0,
              steps ? comm * 1e3 / (double)steps : 0.0, (unsigned long long)atomic_load(&w.padded_steps));
    /* drain messages the compute thread left behind */
    Loom__V1__ControlMsg *left;
    while (zmq_recv(w.pipe_c, &left, sizeof left, ZMQ_DONTWAIT) == (int)sizeof left)
        if (left) protobuf_c_message_free_unpacked(&left->base, NULL);
    if (w.assign) protobuf_c_message_free_unpacked(&w.assign->base, NULL);
    free(w.parts);
    free(w.cand_ids);
    free(w.cand_keys);
    free(w.sp);
    free(w.steps_buf);
    free(w.kk);
    free(w.ids);
    free(w.share_host);
    free(w.dp_copy);
    free(w.pull_failed);
    free(w.pull_why);
    free(w.pull_failed_ids);
    loom_kv_pd_free(&w.kv_pd);
    free(w.edit_row);
    loom_logprobs_free(&w.lp);
    loom_prompt_lp_free(&w.plp);
    free(w.emb);
    free(w.gather_send);
    free(w.gather_recv);
    free(w.trace);
    zmq_close(w.ctl);
    zmq_close(w.pipe_r);
    zmq_close(w.pipe_c);
    zmq_ctx_term(w.zctx);
    loom_comm_listener_destroy(&w.listener);
    loom_etcd_keeper_stop(&keeper); /* revokes the lease: the key goes at once */
    loom_etcd_close(&etcd);
    if (w.dump) fclose(w.dump);
    LOOM_INFO("exiting");
    return rc;
}
