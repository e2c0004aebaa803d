/* The grid lifecycle (see grid.h for its states, transitions and
 * invariants): worker slots, epochs, liveness (heartbeats, data-plane probes,
 * etcd membership) and the in-flight step queue, on the control socket. */
#include "coordinator/grid.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <cjson/cJSON.h>

#include "common/etcd.h"
#include "common/log.h"
#include "common/shard.h"
#include "common/util.h"
#include "coordinator/metrics.h"
#include "coordinator/sampling_params.h"
#include "coordinator/security.h"
#include "common/zap.h"
#include "proto/wire.h"
#include "proto/zapi.h"

#define PROBE_MS 1000       /* a member's data-plane listener that does not answer a connect this long is gone */
#define HEARTBEAT_SEND_MS 500
#define LIVENESS_CHECK_MS 100
#define ASSIGN_LOST_MS 3000 /* a worker still reporting an older epoch this long after its Assign never got it */
#define MAX_FRAMES 8

static const char *state_names[] = {"waiting_for_workers", "loading", "joining", "ready"};

typedef struct worker_slot {
    int used;
    char id[128], host[128], host_id[128], device[32], data_addr[128];
    char kv_xfer_addr[128]; /* its KV service (Ready.kv_xfer_addr; "" : none) */
    char user_id[128]; /* the authenticated identity that registered the slot ("" when none) */
    uint32_t pid;
    uint64_t last_seen_ns;
    uint64_t assign_sent_ns; /* when the current epoch's Assign went out (0: none) */
    int loaded, ready;
    uint64_t kv_block_bytes, kv_budget, weight_bytes, bytes_read;
    char kv_dtype[16]; /* the worker's KV pool dtype, from Loaded */
    uint8_t tp_group_id[128], next_group_id[128]; /* opaque comm-group ids this worker made */
    size_t tp_group_len, next_group_len;
    double busy_s, comm_s;
    uint64_t steps;
} worker_slot_t;

typedef struct inflight {
    loom_microbatch_t *mb;
    uint64_t step_id, t_sent;
    uint64_t deadline; /* t_sent + the step's bound (0: none) */
} inflight_t;

/* A worker key that left etcd, handed from the watch thread to the reactor. */
typedef struct gone_key {
    char id[128];
    struct gone_key *next;
} gone_key_t;

struct loom_grid {
    loom_grid_config_t cfg;
    loom_grid_callbacks_t cb;
    void *ctl;
    char ctl_addr[256];

    worker_slot_t *slots;
    int n_slots;
    loom_grid_state_t state;
    uint64_t epoch, incarnation;
    int n_blocks;
    char kv_dtype[16];       /* the workers' KV dtype ("mixed" if they differ) */
    uint64_t kv_block_bytes; /* the largest worker's bytes per block */
    uint64_t kv_tier_id;     /* the directory tier's identity (loom_grid_kv_tier_id) */
    int kv_host_slots;       /* the host tier's slots per worker (0: none) */
    char last_failure[512];

    int probing;   /* probes of the members' data planes are out (state WAITING) */
    int *probe_fd; /* per slot: a probe's socket, -1: none, -2: failed at once */
    uint64_t probe_deadline;

    inflight_t *inflight; /* FIFO, at most pp + cfg.ahead entries */
    uint64_t t_done;      /* when the latest step's result came */
    int n_inflight;
    Loom__V1__SampleParams *sp; /* step plan scratch, max_num_seqs entries */
    Loom__V1__SampleParams **sp_ptrs;
    int32_t *mtp_next; /* cfg.mtp: plan scratch, max_num_seqs entries */
    loom_zap_t *ctl_zap; /* authenticates the control plane's peers (NULL: not keyed) */
    loom_sparams_arena_t sp_arena; /* the plan rows' control arrays */

    uint64_t last_hb_sent, last_check, last_tick;
    uint64_t n_step_timeouts; /* steps failed for their deadline */

    /* etcd membership (optional) */
    loom_etcd_t *etcd;
    loom_etcd_keeper_t *etcd_keeper;
    loom_etcd_watch_t *etcd_watch;
    pthread_mutex_t gone_mu;
    gone_key_t *gone;
    char etcd_prefix[300];
};

/* ---- sending ---------------------------------------------------------------- */

static void send_to_worker(loom_grid_t *g, const worker_slot_t *w, const void *buf, size_t len) {
    zmq_send(g->ctl, w->id, strlen(w->id), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(g->ctl, buf, len, ZMQ_DONTWAIT);
}

static void send_ctl(loom_grid_t *g, const worker_slot_t *w, Loom__V1__ControlMsg *m) {
    size_t len;
    void *buf = loom_wire_pack_control(m, &len);
    send_to_worker(g, w, buf, len);
    free(buf);
}

static void send_ctl_to_id(loom_grid_t *g, const void *rid, size_t rid_len, Loom__V1__ControlMsg *m) {
    size_t len;
    void *buf = loom_wire_pack_control(m, &len);
    zmq_send(g->ctl, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(g->ctl, buf, len, ZMQ_DONTWAIT);
    free(buf);
}

static void refuse_worker(loom_grid_t *g, const void *rid, size_t rid_len, loom_status_t code, const char *msg) {
    Loom__V1__Error e = LOOM__V1__ERROR__INIT;
    e.code = code;
    e.message = (char *)msg;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_ERROR;
    m.error = &e;
    send_ctl_to_id(g, rid, rid_len, &m);
}

/* ---- slots ------------------------------------------------------------------ */

static int count_used(const loom_grid_t *g) {
    int n = 0;
    for (int i = 0; i < g->n_slots; i++) n += g->slots[i].used;
    return n;
}

static int count_ready(const loom_grid_t *g) {
    int n = 0;
    for (int i = 0; i < g->n_slots; i++) n += g->slots[i].used && g->slots[i].ready;
    return n;
}

static int slot_of(const loom_grid_t *g, const void *rid, size_t len) {
    for (int i = 0; i < g->n_slots; i++)
        if (g->slots[i].used && strlen(g->slots[i].id) == len && !memcmp(g->slots[i].id, rid, len)) return i;
    return -1;
}

int loom_grid_peer_allowed(const loom_grid_t *g, int slot, const char *user_id) {
    if (slot < 0 || slot >= g->n_slots || !g->slots[slot].used) return 0;
    return !strcmp(g->slots[slot].user_id, user_id ? user_id : "");
}

static void fill_peer(Loom__V1__CommPeer *p, const worker_slot_t *w) {
    loom__v1__comm_peer__init(p);
    p->worker_id = (char *)w->id;
    p->data_addr = (char *)w->data_addr;
}

/* ---- epochs ----------------------------------------------------------------- */

/* Writes the grid plan to /loom/<cluster>/plan for operators and tools. */
static void publish_plan(loom_grid_t *g, const char *backend) {
    if (!g->etcd) return;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "epoch", (double)g->epoch);
    cJSON_AddStringToObject(j, "model", g->cfg.model_name);
    cJSON_AddNumberToObject(j, "tp", g->cfg.tp);
    cJSON_AddNumberToObject(j, "pp", g->cfg.pp);
    cJSON_AddStringToObject(j, "data_plane", backend);
    cJSON *ws = cJSON_AddArrayToObject(j, "workers");
    for (int i = 0; i < g->n_slots; i++) {
        int lb, ln;
        loom_split_range(g->cfg.n_layers, g->cfg.pp, i / g->cfg.tp, &lb, &ln);
        cJSON *w = cJSON_CreateObject();
        cJSON_AddStringToObject(w, "id", g->slots[i].id);
        cJSON_AddNumberToObject(w, "stage", i / g->cfg.tp);
        cJSON_AddNumberToObject(w, "tp_rank", i % g->cfg.tp);
        cJSON_AddNumberToObject(w, "layer_begin", lb);
        cJSON_AddNumberToObject(w, "layer_end", lb + ln);
        cJSON_AddStringToObject(w, "host", g->slots[i].host);
        cJSON_AddStringToObject(w, "device", g->slots[i].device);
        cJSON_AddItemToArray(ws, w);
    }
    char *text = cJSON_PrintUnformatted(j);
    char key[400];
    snprintf(key, sizeof key, "%splan", g->etcd_prefix);
    loom_err_t err = {0};
    if (loom_etcd_put(g->etcd, key, text, strlen(text), loom_etcd_keeper_lease(g->etcd_keeper), &err) < 0)
        LOOM_WARN("could not publish the plan to etcd: %s", err.msg);
    free(text);
    cJSON_Delete(j);
}

/* Every slot is filled: plan the grid and send each worker its Assign. */
static void start_epoch(loom_grid_t *g) {
    g->epoch++;
    int tp = g->cfg.tp, pp = g->cfg.pp;
    int same_host = 1;
    for (int i = 1; i < g->n_slots; i++)
        if (strcmp(g->slots[i].host_id, g->slots[0].host_id) != 0 || !g->slots[i].host_id[0]) same_host = 0;
    int all_gpu = 1;
    for (int i = 0; i < g->n_slots; i++) all_gpu &= !strncmp(g->slots[i].device, "cuda", 4);
    const char *backend = strcmp(g->cfg.comm, "auto") ? g->cfg.comm : all_gpu ? "nccl" : same_host ? "shm" : "tcp";
    char name[128];
    snprintf(name, sizeof name, "loom-%d-%llx-e%llu", (int)getpid(), (unsigned long long)g->incarnation,
             (unsigned long long)g->epoch);
    uint8_t data_secret[32]; /* this epoch's data-plane secret (coordinator/security.h) */
    loom_coord_epoch_secret(data_secret, sizeof data_secret);
    LOOM_INFO("plan (epoch %llu): %d pipeline stage(s) x %d tensor-parallel rank(s), data plane %s",
              (unsigned long long)g->epoch, pp, tp, backend);
    Loom__V1__CommPeer *peers = loom_xcalloc((size_t)g->n_slots, sizeof *peers);
    Loom__V1__CommPeer **tp_ptrs = loom_xcalloc((size_t)tp, sizeof *tp_ptrs);
    for (int i = 0; i < g->n_slots; i++) fill_peer(&peers[i], &g->slots[i]);
    for (int st = 0; st < pp; st++) {
        int lb, ln;
        loom_split_range(g->cfg.n_layers, pp, st, &lb, &ln);
        for (int r = 0; r < tp; r++) {
            worker_slot_t *w = &g->slots[st * tp + r];
            int same = 0; /* workers of this host share its memory */
            for (int j = 0; j < g->n_slots; j++) same += !strcmp(g->slots[j].host_id, w->host_id);
            LOOM_INFO("  stage %d layers [%d, %d) tp rank %d -> worker %s (%s, %s, pid %u)", st, lb, lb + ln, r, w->id,
                      w->host, w->device, w->pid);
            for (int k = 0; k < tp; k++) tp_ptrs[k] = &peers[st * tp + k];
            Loom__V1__CommSetup cs = LOOM__V1__COMM_SETUP__INIT;
            cs.backend = (char *)backend;
            cs.name = name;
            cs.tp_group = tp_ptrs;
            cs.n_tp_group = (size_t)tp;
            cs.prev = st > 0 ? &peers[(st - 1) * tp + r] : NULL;
            cs.next = st + 1 < pp ? &peers[(st + 1) * tp + r] : NULL;
            Loom__V1__Assign a = LOOM__V1__ASSIGN__INIT;
            a.model_dir = (char *)g->cfg.model_dir;
            a.stage = (uint32_t)st;
            a.n_stages = (uint32_t)pp;
            a.tp_rank = (uint32_t)r;
            a.tp_size = (uint32_t)tp;
            a.layer_begin = (uint32_t)lb;
            a.layer_end = (uint32_t)(lb + ln);
            a.comm = &cs;
            a.max_tokens = (uint32_t)g->cfg.max_batched_tokens;
            a.max_seqs = (uint32_t)g->cfg.max_num_seqs;
            a.block_size = (uint32_t)g->cfg.block_size;
            a.weight_dtype = (char *)g->cfg.weight_dtype;
            a.quantization = (char *)(g->cfg.quantization ? g->cfg.quantization : "none");
            a.kv_cache_dtype = (char *)(g->cfg.kv_cache_dtype ? g->cfg.kv_cache_dtype : "auto");
            a.epoch = g->epoch;
            a.incarnation = g->incarnation;
            a.data_secret.data = data_secret;
            a.data_secret.len = sizeof data_secret;
            a.data_encrypt = g->cfg.encrypt_data != 0;
            a.expert_parallel = g->cfg.expert_parallel != 0;
            a.mtp = g->cfg.mtp != 0;
            a.dp_attention = g->cfg.dp_attention != 0;
            a.share_sampled_ids = g->cfg.ahead > 0 && a.tp_size > 1 && a.n_stages == 1;
            a.mla_disable = g->cfg.mla_disable != 0;
            a.max_loras = (uint32_t)(g->cfg.max_loras > 0 ? g->cfg.max_loras : 0);
            a.max_lora_rank = (uint32_t)(g->cfg.max_loras > 0 ? (g->cfg.max_lora_rank > 0 ? g->cfg.max_lora_rank : 16) : 0);
            a.max_cpu_loras = (uint32_t)(g->cfg.max_cpu_loras > 0 ? g->cfg.max_cpu_loras : 0);
            a.kv_memory = g->cfg.kv_memory;
            a.kv_fraction = g->cfg.kv_fraction / (float)(same > 0 ? same : 1);
            Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
            m.body_case = LOOM__V1__CONTROL_MSG__BODY_ASSIGN;
            m.assign = &a;
            w->loaded = w->ready = 0;
            w->assign_sent_ns = loom_now_ns();
            send_ctl(g, w, &m);
        }
    }
    free(peers);
    free(tp_ptrs);
    g->state = LOOM_GRID_LOADING;
    publish_plan(g, backend);
}

/* ---- liveness probes -------------------------------------------------------- */

/* Starts a non-blocking connect to a worker's data-plane listener
 * ("tcp://host:port" or "tcp://[v6]:port"), which lives as long as the
 * worker process. Returns the socket, or -1 when the connect failed at once
 * (or the address cannot be read: the worker sent it, so that is its loss). */
static int probe_connect(const char *addr) {
    char host[256], port[16];
    if (strncmp(addr, "tcp://", 6) != 0) return -1;
    const char *h = addr + 6, *colon = strrchr(h, ':');
    if (!colon || colon == h || strlen(colon + 1) >= sizeof port) return -1;
    size_t hl = (size_t)(colon - h);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') h++, hl -= 2;
    if (hl >= sizeof host) return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    snprintf(port, sizeof port, "%s", colon + 1);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0 || !res) return -1;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static void probes_stop(loom_grid_t *g) {
    for (int i = 0; i < g->n_slots; i++) {
        if (g->probe_fd[i] >= 0) close(g->probe_fd[i]);
        g->probe_fd[i] = -1;
    }
    g->probing = 0;
}

/* After a failure of a full grid: probe every member; probes_poll decides. */
static void probes_start(loom_grid_t *g) {
    for (int i = 0; i < g->n_slots; i++) g->probe_fd[i] = -2; /* -2: failed at once */
    for (int i = 0; i < g->n_slots; i++) {
        int fd = probe_connect(g->slots[i].data_addr);
        if (fd >= 0) g->probe_fd[i] = fd;
    }
    g->probing = 1;
    g->probe_deadline = loom_now_ns() + PROBE_MS * 1000000ull;
}

/* Frees the slot of a worker found dead (no epoch to abort: it is aborted). */
static void exclude_worker(loom_grid_t *g, int i, const char *why) {
    worker_slot_t *w = &g->slots[i];
    LOOM_ERROR("worker %s (stage %d, tp rank %d, pid %u) is gone: its data plane at %s %s; excluded from the "
               "next plan",
               w->id, i / g->cfg.tp, i % g->cfg.tp, w->pid, w->data_addr, why);
    snprintf(g->last_failure, sizeof g->last_failure, "worker %s is gone: its data plane %s", w->id, why);
    w->used = 0;
}

/* Settles the probes once each answered or PROBE_MS passed. */
static void probes_poll(loom_grid_t *g) {
    if (!g->probing) return;
    int pending = 0, gone = 0;
    for (int i = 0; i < g->n_slots; i++) {
        int fd = g->probe_fd[i];
        if (fd == -1) continue;
        int soerr = ECONNREFUSED;
        if (fd >= 0) {
            struct pollfd pf = {fd, POLLOUT, 0};
            if (poll(&pf, 1, 0) <= 0) {
                pending++;
                continue;
            }
            socklen_t len = sizeof soerr;
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0) soerr = errno;
            close(fd);
        }
        g->probe_fd[i] = -1;
        if (soerr) {
            char why[160];
            snprintf(why, sizeof why, "refused a connection (%s)", strerror(soerr));
            exclude_worker(g, i, why);
            gone++;
        }
    }
    if (pending && loom_now_ns() < g->probe_deadline) return;
    for (int i = 0; i < g->n_slots; i++)
        if (g->probe_fd[i] >= 0) {
            char why[80];
            snprintf(why, sizeof why, "did not answer a connection within %d ms", PROBE_MS);
            exclude_worker(g, i, why);
            gone++;
        }
    probes_stop(g);
    if (count_used(g) == g->n_slots) start_epoch(g); /* every member is alive: rebuild with them */
    else LOOM_INFO("waiting for %d worker(s) to take the free place(s) (%d of %d registered)", gone, count_used(g),
                   g->n_slots);
}

/* ---- failures --------------------------------------------------------------- */

/* Aborts the current epoch: in-flight micro-batches go back to the caller,
 * which decides what its requests do (wait for the grid or fail). */
static void fail_grid(loom_grid_t *g, const char *why) {
    snprintf(g->last_failure, sizeof g->last_failure, "%s", why);
    LOOM_ERROR("grid failure (epoch %llu): %s", (unsigned long long)g->epoch, why);
    Loom__V1__Abort ab = LOOM__V1__ABORT__INIT;
    ab.epoch = g->epoch;
    ab.reason = (char *)why;
    ab.incarnation = g->incarnation;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_ABORT;
    m.abort = &ab;
    for (int i = 0; i < g->n_slots; i++)
        if (g->slots[i].used) send_ctl(g, &g->slots[i], &m);
    int n = g->n_inflight;
    g->n_inflight = 0;
    for (int i = 0; i < n; i++)
        if (g->cb.on_step_failed) g->cb.on_step_failed(g->cb.ctx, g->inflight[i].mb);
    if (g->cb.on_failed) g->cb.on_failed(g->cb.ctx, g, why);
    for (int i = 0; i < g->n_slots; i++) g->slots[i].loaded = g->slots[i].ready = 0;
    probes_stop(g);
    g->state = LOOM_GRID_WAITING;
    if (count_used(g) == g->n_slots) probes_start(g); /* who of them is still alive? then rebuild */
}

static void lose_worker(loom_grid_t *g, int i, const char *why) {
    worker_slot_t *w = &g->slots[i];
    char msg[512];
    snprintf(msg, sizeof msg, "worker %s (stage %d, tp rank %d, pid %u) %s", w->id, i / g->cfg.tp, i % g->cfg.tp,
             w->pid, why);
    w->used = 0;
    fail_grid(g, msg);
    LOOM_INFO("waiting for a worker to take its place (%d of %d registered)", count_used(g), g->n_slots);
}

/* ---- load -> join -> ready ------------------------------------------------------ */

/* The directory tier's identity: what must be equal for a block file of
 * one replica to be valid KV for another (the file names carry it). */
static uint64_t kv_tier_id(const loom_grid_t *g) {
    int32_t v[8] = {g->cfg.block_size, g->cfg.tp, g->cfg.pp, g->cfg.n_layers, 1 /* block-contiguous layout */};
    uint64_t h = loom_kv_chain_hash(g->cfg.kv_tier_seed, v, 5);
    int32_t dt[4] = {0};
    memcpy(dt, g->kv_dtype, LOOM_MIN(sizeof dt, strlen(g->kv_dtype)));
    h = loom_kv_chain_hash(h, dt, 4);
    for (int i = 0; i < g->n_slots; i++) {
        int32_t b[2] = {(int32_t)(g->slots[i].kv_block_bytes & 0x7fffffff), (int32_t)(g->slots[i].kv_block_bytes >> 31)};
        h = loom_kv_chain_hash(h, b, 2);
    }
    return h;
}

static void all_loaded(loom_grid_t *g) {
    uint64_t nb = UINT64_MAX;
    for (int i = 0; i < g->n_slots; i++) {
        worker_slot_t *w = &g->slots[i];
        uint64_t b = w->kv_block_bytes ? w->kv_budget / w->kv_block_bytes : UINT64_MAX;
        if (b < nb) nb = b;
    }
    int per_seq = (g->cfg.max_model_len + g->cfg.block_size - 1) / g->cfg.block_size;
    uint64_t cap = (uint64_t)g->cfg.max_num_seqs * (uint64_t)per_seq;
    if (nb > cap) nb = cap; /* more could never be used */
    if (g->cfg.num_kv_blocks > 0) nb = (uint64_t)g->cfg.num_kv_blocks;
    if (nb > INT32_MAX / 1024) nb = INT32_MAX / 1024;
    if (nb < 1) {
        char msg[256];
        snprintf(msg, sizeof msg, "no memory left for the KV cache after the weights (raise --kv-fraction or "
                                  "--kv-cache-memory)");
        LOOM_ERROR("%s", msg);
        snprintf(g->last_failure, sizeof g->last_failure, "%s", msg);
        return;
    }
    g->n_blocks = (int)nb;
    snprintf(g->kv_dtype, sizeof g->kv_dtype, "%s", g->slots[0].kv_dtype);
    g->kv_block_bytes = 0;
    for (int i = 0; i < g->n_slots; i++) {
        if (strcmp(g->slots[i].kv_dtype, g->kv_dtype)) snprintf(g->kv_dtype, sizeof g->kv_dtype, "mixed");
        g->kv_block_bytes = LOOM_MAX(g->kv_block_bytes, g->slots[i].kv_block_bytes);
    }
    if (g->n_blocks < per_seq)
        LOOM_WARN("the KV pool (%d blocks) holds %d tokens, less than the context length %d: longer requests "
                  "will be refused",
                  g->n_blocks, g->n_blocks * g->cfg.block_size, g->cfg.max_model_len);
    LOOM_INFO("KV pool: %d blocks of %d tokens per worker, %s (the smallest worker decides)", g->n_blocks,
              g->cfg.block_size, g->kv_dtype);
    g->kv_tier_id = kv_tier_id(g);
    g->kv_host_slots = 0;
    if (g->cfg.kv_host_bytes && g->kv_block_bytes) {
        uint64_t n = g->cfg.kv_host_bytes / g->kv_block_bytes;
        g->kv_host_slots = (int)LOOM_MIN(n, (uint64_t)INT32_MAX / 2);
        if (n == 0)
            LOOM_WARN("--kv-offloading-size %.3f GB holds no KV block of %llu bytes: no host tier",
                      (double)g->cfg.kv_host_bytes / 1e9, (unsigned long long)g->kv_block_bytes);
        else
            LOOM_INFO("KV offload: host tier of %d blocks per worker (%.2f GB)", g->kv_host_slots,
                      (double)g->kv_host_slots * (double)g->kv_block_bytes / 1e9);
    }
    for (int i = 0; i < g->n_slots; i++) {
        int st = i / g->cfg.tp, r = i % g->cfg.tp;
        const worker_slot_t *lead = &g->slots[st * g->cfg.tp]; /* TP rank 0 made the group's id */
        Loom__V1__KvConfig k = LOOM__V1__KV_CONFIG__INIT;
        k.epoch = g->epoch;
        k.n_blocks = (uint32_t)g->n_blocks;
        k.tp_group_id = (ProtobufCBinaryData){lead->tp_group_len, (uint8_t *)lead->tp_group_id};
        k.next_group_id = (ProtobufCBinaryData){g->slots[i].next_group_len, (uint8_t *)g->slots[i].next_group_id};
        if (g->cfg.kv_offload_dir) {
            k.kv_offload_dir = (char *)g->cfg.kv_offload_dir;
            k.kv_offload_id = g->kv_tier_id;
            k.kv_offload_max_bytes = g->cfg.kv_offload_max_bytes;
        }
        k.kv_host_slots = (uint32_t)g->kv_host_slots;
        k.kv_xfer = (uint32_t)g->cfg.kv_xfer;
        k.kv_xfer_secret = (ProtobufCBinaryData){g->cfg.kv_xfer_secret_len, (uint8_t *)g->cfg.kv_xfer_secret};
        k.kv_xfer_model = g->cfg.kv_tier_seed;
        if (st > 0) {
            const worker_slot_t *prev = &g->slots[(st - 1) * g->cfg.tp + r];
            k.prev_group_id = (ProtobufCBinaryData){prev->next_group_len, (uint8_t *)prev->next_group_id};
        }
        Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
        m.body_case = LOOM__V1__CONTROL_MSG__BODY_KV_CONFIG;
        m.kv_config = &k;
        send_ctl(g, &g->slots[i], &m);
    }
    g->state = LOOM_GRID_JOINING;
}

static void grid_ready(loom_grid_t *g) {
    g->state = LOOM_GRID_READY;
    g->last_failure[0] = '\0';
    if (g->cb.on_ready) g->cb.on_ready(g->cb.ctx, g);
}

/* ---- control messages --------------------------------------------------------- */

static void on_register(loom_grid_t *g, const void *rid, size_t rid_len, const char *user_id,
                        const Loom__V1__Register *r) {
    int i = slot_of(g, rid, rid_len);
    if (i >= 0) { /* a known worker registering again (restarted, same id) */
        worker_slot_t *w = &g->slots[i];
        if (!loom_grid_peer_allowed(g, i, user_id)) {
            refuse_worker(g, rid, rid_len, LOOM_ERR_UNAUTHENTICATED,
                          "registration refused: this worker id is held by another identity");
            LOOM_WARN("refused a registration as worker %.*s from another identity", (int)rid_len, (const char *)rid);
            return;
        }
        /* left_grid naming this coordinator's current epoch: the worker left
         * it (it found us silent); naming another grid: a retry */
        int left = r->left_grid && r->left_incarnation == g->incarnation && r->left_epoch == g->epoch;
        if (!left && w->pid == r->pid && r->data_addr && !strcmp(w->data_addr, r->data_addr) && r->host_id &&
            !strcmp(w->host_id, r->host_id)) {
            /* the same process again (its retry crossed our answer): it holds the slot */
            w->last_seen_ns = loom_now_ns();
            Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
            Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
            m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
            m.heartbeat = &hb;
            send_ctl(g, w, &m);
            return;
        }
        /* left_grid: the same process, but it found this coordinator silent
         * (paused, or cut off) and aborted its data plane: its epoch is gone */
        lose_worker(g, i, left ? "left the grid (it found this coordinator silent) and registered again"
                                       : "registered again");
    }
    if (!r->worker_id || strlen(r->worker_id) != rid_len || memcmp(r->worker_id, rid, rid_len) != 0 ||
        rid_len >= sizeof g->slots[0].id || !r->data_addr || !r->data_addr[0]) {
        refuse_worker(g, rid, rid_len, LOOM_ERR_INVALID_ARGUMENT,
                      "registration refused: worker id must match the connection's routing id and a data "
                      "address is required");
        LOOM_WARN("refused a malformed registration");
        return;
    }
    i = 0;
    if (r->has_shard && r->shard_n_stages == (uint32_t)g->cfg.pp && r->shard_tp_size == (uint32_t)g->cfg.tp &&
        r->shard_stage < (uint32_t)g->cfg.pp && r->shard_tp_rank < (uint32_t)g->cfg.tp && r->shard_model_dir &&
        !strcmp(r->shard_model_dir, g->cfg.model_dir))
        i = (int)(r->shard_stage * (uint32_t)g->cfg.tp + r->shard_tp_rank); /* it holds these weights already */
    if (g->slots[i].used)
        for (i = 0; i < g->n_slots && g->slots[i].used; i++) {}
    if (i == g->n_slots) {
        char msg[256];
        snprintf(msg, sizeof msg, "the grid is full (%d workers for tp %d x pp %d)", g->n_slots, g->cfg.tp, g->cfg.pp);
        refuse_worker(g, rid, rid_len, LOOM_ERR_RESOURCE_EXHAUSTED, msg);
        LOOM_DEBUG("worker %s stands by: %s", r->worker_id, msg);
        return;
    }
    worker_slot_t *w = &g->slots[i];
    memset(w, 0, sizeof *w);
    w->used = 1;
    snprintf(w->id, sizeof w->id, "%s", r->worker_id);
    snprintf(w->user_id, sizeof w->user_id, "%s", user_id ? user_id : "");
    snprintf(w->host, sizeof w->host, "%s", r->host ? r->host : "");
    snprintf(w->host_id, sizeof w->host_id, "%s", r->host_id ? r->host_id : "");
    snprintf(w->device, sizeof w->device, "%s", r->device ? r->device : "");
    snprintf(w->data_addr, sizeof w->data_addr, "%s", r->data_addr);
    w->pid = r->pid;
    w->last_seen_ns = loom_now_ns();
    LOOM_INFO("worker %s registered (%s, %s, pid %u, data plane %s): %d of %d", w->id, w->host, w->device, w->pid,
              w->data_addr, count_used(g), g->n_slots);
    if (count_used(g) == g->n_slots && g->state == LOOM_GRID_WAITING && !g->probing) start_epoch(g);
}

static void on_result(loom_grid_t *g, int wi, const Loom__V1__StepResult *r) {
    if (r->epoch != g->epoch || g->state != LOOM_GRID_READY) return; /* a leftover of an aborted epoch */
    if (r->code != LOOM_OK) {
        char msg[700];
        snprintf(msg, sizeof msg, "step %llu failed on worker %s: %s", (unsigned long long)r->step_id,
                 g->slots[wi].id, r->message);
        fail_grid(g, msg);
        return;
    }
    if (g->n_inflight == 0 || g->inflight[0].step_id != r->step_id) {
        char msg[256];
        snprintf(msg, sizeof msg, "worker %s returned step %llu out of order", g->slots[wi].id,
                 (unsigned long long)r->step_id);
        fail_grid(g, msg);
        return;
    }
    inflight_t f = g->inflight[0];
    memmove(g->inflight, g->inflight + 1, (size_t)(--g->n_inflight) * sizeof *g->inflight);
    const char *bad = NULL;
    char msg[256];
    if (r->n_ids != (size_t)f.mb->n_logits) {
        snprintf(msg, sizeof msg, "worker %s returned %zu ids for %d rows", g->slots[wi].id, r->n_ids, f.mb->n_logits);
        bad = msg;
    }
    for (size_t i = 0; !bad && i < r->n_ids; i++)
        if (r->ids[i] < 0 || r->ids[i] >= g->cfg.vocab_size) bad = "a worker returned a token id outside the vocabulary";
    if (bad) {
        if (g->cb.on_step_failed) g->cb.on_step_failed(g->cb.ctx, f.mb);
        fail_grid(g, bad);
        return;
    }
    /* a step planned ahead waited for the one before it: its own time starts as that one's ended */
    uint64_t now = loom_now_ns(), t_start = g->cfg.ahead && g->t_done > f.t_sent ? g->t_done : f.t_sent;
    g->t_done = now;
    double step_s = (double)(now - t_start) * 1e-9;
    if (g->cb.on_step_done && g->cb.on_step_done(g->cb.ctx, f.mb, r, step_s, msg, sizeof msg) < 0) {
        if (g->cb.on_step_failed) g->cb.on_step_failed(g->cb.ctx, f.mb);
        fail_grid(g, msg);
    }
}

static void on_loaded(loom_grid_t *g, worker_slot_t *w, const Loom__V1__Loaded *l) {
    if (l->epoch != g->epoch || g->state != LOOM_GRID_LOADING) return;
    w->loaded = 1;
    w->kv_block_bytes = l->kv_block_bytes;
    w->kv_budget = l->kv_budget;
    snprintf(w->kv_dtype, sizeof w->kv_dtype, "%s", l->kv_cache_dtype);
    w->weight_bytes = l->weight_bytes;
    w->bytes_read = l->bytes_read;
    w->tp_group_len = LOOM_MIN(l->tp_group_id.len, sizeof w->tp_group_id);
    if (w->tp_group_len) memcpy(w->tp_group_id, l->tp_group_id.data, w->tp_group_len);
    w->next_group_len = LOOM_MIN(l->next_group_id.len, sizeof w->next_group_id);
    if (w->next_group_len) memcpy(w->next_group_id, l->next_group_id.data, w->next_group_len);
    LOOM_INFO("worker %s loaded its shard in %.2f s: %.1f MB of weights (%.1f MB read)", w->id, l->load_s,
              (double)w->weight_bytes / 1e6, (double)w->bytes_read / 1e6);
    int all = 1;
    for (int i = 0; i < g->n_slots; i++) all &= g->slots[i].loaded;
    if (all) all_loaded(g);
}

static void on_heartbeat(loom_grid_t *g, int wi, const Loom__V1__Heartbeat *hb) {
    worker_slot_t *w = &g->slots[wi];
    /* the current epoch's Assign went out a while ago but the worker says it
     * never got it: it was lost with a connection libzmq closed (a worker
     * stopped past the ZMTP heartbeat timeout comes back on a new one, and
     * the grid would wait for its Loaded forever). It registers again. */
    if (g->state != LOOM_GRID_WAITING && w->assign_sent_ns && (hb->assigned_epoch || hb->assigned_incarnation) &&
        (hb->assigned_epoch != g->epoch || hb->assigned_incarnation != g->incarnation) &&
        loom_now_ns() - w->assign_sent_ns > ASSIGN_LOST_MS * 1000000ull) {
        char why[200];
        snprintf(why, sizeof why, "never got its assignment of epoch %llu (it reports epoch %llu): lost with its "
                                  "connection; it registers again",
                 (unsigned long long)g->epoch, (unsigned long long)hb->assigned_epoch);
        lose_worker(g, wi, why);
        return;
    }
    w->busy_s = hb->busy_s;
    w->comm_s = hb->comm_s;
    w->steps = hb->steps;
    if (!g->cfg.metrics) return;
    int stage = wi / g->cfg.tp;
    double busy = 0, comm = 0;
    uint64_t steps = 0;
    for (int r = 0; r < g->cfg.tp; r++) {
        const worker_slot_t *x = &g->slots[stage * g->cfg.tp + r];
        busy += x->busy_s;
        comm += x->comm_s;
        steps += x->steps;
    }
    loom_metrics_set_stage(g->cfg.metrics, stage, busy, comm, steps);
}

static void on_control(loom_grid_t *g, const void *rid, size_t rid_len, const char *user_id, const void *data,
                       size_t len) {
    loom_err_t err = {0};
    Loom__V1__ControlMsg *m = loom_wire_unpack_control(data, len, &err);
    if (!m) {
        LOOM_WARN("refused a control message (%zu bytes): %s", len, err.msg);
        refuse_worker(g, rid, rid_len, err.code, err.msg);
        return;
    }
    int wi = slot_of(g, rid, rid_len);
    if (m->body_case == LOOM__V1__CONTROL_MSG__BODY_REGISTER) {
        on_register(g, rid, rid_len, user_id, m->register_);
        goto done;
    }
    if (wi < 0) {
        refuse_worker(g, rid, rid_len, LOOM_ERR_NOT_FOUND, "unknown worker: register first");
        goto done;
    }
    if (!loom_grid_peer_allowed(g, wi, user_id)) {
        refuse_worker(g, rid, rid_len, LOOM_ERR_UNAUTHENTICATED, "this worker id is held by another identity");
        LOOM_WARN("refused a message as worker %s from another identity", g->slots[wi].id);
        goto done;
    }
    worker_slot_t *w = &g->slots[wi];
    w->last_seen_ns = loom_now_ns();
    switch (m->body_case) {
    case LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT: on_heartbeat(g, wi, m->heartbeat); break;
    case LOOM__V1__CONTROL_MSG__BODY_LOADED: on_loaded(g, w, m->loaded); break;
    case LOOM__V1__CONTROL_MSG__BODY_READY:
        if (m->ready->epoch != g->epoch || g->state != LOOM_GRID_JOINING) break;
        w->ready = 1;
        snprintf(w->kv_xfer_addr, sizeof w->kv_xfer_addr, "%s", m->ready->kv_xfer_addr ? m->ready->kv_xfer_addr : "");
        if (count_ready(g) == g->n_slots) grid_ready(g);
        break;
    case LOOM__V1__CONTROL_MSG__BODY_RESULT: on_result(g, wi, m->result); break;
    case LOOM__V1__CONTROL_MSG__BODY_KV_READ:
        if (m->kv_read->epoch == g->epoch && g->state == LOOM_GRID_READY && g->cb.on_kv_read)
            g->cb.on_kv_read(g->cb.ctx, m->kv_read->transfer);
        break;
    case LOOM__V1__CONTROL_MSG__BODY_LORA_LOADED:
        /* another epoch's answer: its engines are gone, the order is moot */
        if (m->lora_loaded->epoch == g->epoch && g->state == LOOM_GRID_READY && g->cb.on_lora_loaded)
            g->cb.on_lora_loaded(g->cb.ctx, g, wi, m->lora_loaded);
        break;
    case LOOM__V1__CONTROL_MSG__BODY_ERROR: {
        char msg[700];
        snprintf(msg, sizeof msg, "worker %s reported: %s", w->id, m->error->message);
        LOOM_ERROR("%s", msg);
        snprintf(g->last_failure, sizeof g->last_failure, "%.500s", msg);
        /* a join of this epoch that failed for a passing cause (a peer's link
         * dropped, a deadline passed: UNAVAILABLE): plan again with the same
         * workers rather than stay joining; a deterministic one (a setting the
         * workers cannot honour) would only fail again, so it stays reported */
        if (g->state == LOOM_GRID_READY || (g->state == LOOM_GRID_JOINING && m->error->epoch == g->epoch &&
                                            m->error->code == LOOM_ERR_UNAVAILABLE))
            fail_grid(g, msg);
        break;
    }
    default:
        LOOM_WARN("worker %s sent an unexpected message (%d); ignored", w->id, (int)m->body_case);
        break;
    }
done:
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

void loom_grid_on_readable(loom_grid_t *g) {
    for (int burst = 0; burst < 256; burst++) {
        zmq_msg_t f[MAX_FRAMES];
        int n = loom_zapi_recv_frames(g->ctl, f, MAX_FRAMES);
        if (n == 0) break;
        if (n == 2 && !loom_zap_identity_ok(g->ctl_zap, &f[1], zmq_msg_data(&f[0]), zmq_msg_size(&f[0]))) {
            /* keyed plane: the routing id is not the name of the peer's key (logged by the check) */
        } else if (n == 2) {
            /* the peer's authenticated identity (set by a ZAP handler; NULL without one) */
            const char *user_id = zmq_msg_gets(&f[1], "User-Id");
            on_control(g, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), user_id, zmq_msg_data(&f[1]),
                       zmq_msg_size(&f[1]));
        } else {
            LOOM_WARN("refused a control message of %d frames", n - 1);
        }
        for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
    }
}

/* ---- step plans ----------------------------------------------------------------- */

/* Fills a step plan from a micro-batch: what every worker needs to run it
 * (tokens, positions, KV slots and block tables, per-row sampling). */
static void plan_fill(loom_grid_t *g, const loom_microbatch_t *mb, Loom__V1__StepPlan *p) {
    p->epoch = g->epoch;
    p->step_id = mb->id;
    p->tokens = mb->tokens;
    p->n_tokens = (size_t)mb->n_tokens;
    p->pos = mb->pos;
    p->n_pos = (size_t)mb->n_tokens;
    p->slots = mb->slots;
    p->n_slots = (size_t)mb->n_tokens;
    p->tok_seq = mb->tok_seq;
    p->n_tok_seq = (size_t)mb->n_tokens;
    p->n_seqs = (uint32_t)mb->n_seqs;
    p->max_blocks = (uint32_t)mb->max_blocks;
    p->block_tables = mb->block_tables;
    p->n_block_tables = (size_t)mb->n_seqs * (size_t)mb->max_blocks;
    p->logit_rows = mb->logit_rows;
    p->n_logit_rows = (size_t)mb->n_logits;
    for (int i = 0; i < mb->n_logits; i++) {
        Loom__V1__SampleParams *sp = &g->sp[i];
        loom__v1__sample_params__init(sp);
        sp->temperature = mb->sampling[i].temperature;
        sp->top_k = mb->sampling[i].top_k;
        sp->top_p = mb->sampling[i].top_p;
        sp->seed = mb->sampling[i].seed;
        sp->step = mb->steps[i];
        g->sp_ptrs[i] = sp;
    }
    loom_sparams_fill_plan(&g->sp_arena, mb, g->sp_ptrs);
    p->sampling = g->sp_ptrs;
    p->n_sampling = (size_t)mb->n_logits;
    p->copy_src = mb->copy_src;
    p->copy_dst = mb->copy_dst;
    p->n_copy_src = p->n_copy_dst = (size_t)mb->n_copies;
    p->embed_begin = mb->embed_begin;
    p->embed_end = mb->embed_end;
    p->n_embed_begin = p->n_embed_end = (size_t)mb->n_embeds;
    p->prompt_lp_rows = mb->plp_rows;
    p->prompt_lp_ids = mb->plp_ids;
    p->prompt_lp_top = mb->plp_top;
    p->n_prompt_lp_rows = p->n_prompt_lp_ids = p->n_prompt_lp_top = (size_t)mb->n_plp;
    if (g->cfg.mtp) { /* the token after each sequence's chunk, where it is not this step's to sample */
        for (int i = 0; i < mb->n_seqs; i++) {
            const loom_seq_t *q = mb->seqs[i];
            int after = q->n_computed + mb->chunk[i];
            g->mtp_next[i] = after < q->n_tokens ? q->tokens[after] : -1;
        }
        p->mtp_next = g->mtp_next;
        p->n_mtp_next = (size_t)mb->n_seqs;
    }
    p->kv_save_blocks = mb->save_block;
    p->kv_save_hashes = mb->save_hash;
    p->n_kv_save_blocks = p->n_kv_save_hashes = (size_t)mb->n_saves;
    p->kv_load_blocks = mb->load_block;
    p->kv_load_hashes = mb->load_hash;
    p->n_kv_load_blocks = p->n_kv_load_hashes = (size_t)mb->n_loads;
    p->kv_save_after_blocks = mb->save_after_block;
    p->kv_save_after_hashes = mb->save_after_hash;
    p->n_kv_save_after_blocks = p->n_kv_save_after_hashes = (size_t)mb->n_saves_after;
    if (mb->save_slot) { /* the host tier's slots */
        p->kv_save_slots = mb->save_slot;
        p->n_kv_save_slots = (size_t)mb->n_saves;
        p->kv_load_slots = mb->load_slot;
        p->n_kv_load_slots = (size_t)mb->n_loads;
        p->kv_save_after_slots = mb->save_after_slot;
        p->n_kv_save_after_slots = (size_t)mb->n_saves_after;
    }
    p->kv_pull_blocks = mb->pull_block;
    p->kv_pull_remote = mb->pull_remote;
    p->kv_pull_source = mb->pull_src;
    p->n_kv_pull_blocks = p->n_kv_pull_remote = p->n_kv_pull_source = (size_t)mb->n_pulls;
    p->kv_pull_addrs = (char **)mb->pull_addrs;
    p->kv_pull_transfer = mb->pull_transfer;
    p->n_kv_pull_addrs = p->n_kv_pull_transfer = (size_t)mb->n_pull_srcs;
    p->seq_lora = mb->seq_lora;
    p->n_seq_lora = mb->any_lora ? (size_t)mb->n_seqs : 0;
    if (g->cfg.dp_attention) {
        p->seq_dp_rank = mb->seq_dp_rank;
        p->n_seq_dp_rank = (size_t)mb->n_seqs;
    }
    if (mb->n_prev) { /* planned ahead: some tokens are the previous step's samples */
        p->prev_rows = mb->prev_rows;
        p->n_prev_rows = (size_t)mb->n_tokens;
        p->prev_step = mb->prev_step;
    }
}

int loom_grid_can_send(const loom_grid_t *g) {
    return g->state == LOOM_GRID_READY && g->n_inflight < g->cfg.pp + g->cfg.ahead;
}

void loom_grid_send_plan(loom_grid_t *g, loom_microbatch_t *mb) {
    LOOM_ASSERT(loom_grid_can_send(g));
    Loom__V1__StepPlan p = LOOM__V1__STEP_PLAN__INIT;
    plan_fill(g, mb, &p);
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_STEP;
    m.step = &p;
    size_t len;
    void *buf = loom_wire_pack_control(&m, &len);
    for (int i = 0; i < g->n_slots; i++) send_to_worker(g, &g->slots[i], buf, len);
    free(buf);
    uint64_t now = loom_now_ns(), bound = 0;
    if (g->cfg.step_timeout_ms > 0)
        bound = (uint64_t)g->cfg.step_timeout_ms * 1000000ull +
                (uint64_t)(mb->n_tokens > 0 ? mb->n_tokens : 0) * (uint64_t)g->cfg.step_token_us * 1000ull;
    g->inflight[g->n_inflight++] =
        (inflight_t){.mb = mb, .step_id = mb->id, .t_sent = now, .deadline = bound ? now + bound : 0};
}

int loom_grid_n_inflight(const loom_grid_t *g) { return g->n_inflight; }

void loom_grid_send_lora_load(loom_grid_t *g, int slot, const char *name, const char *path,
                              const uint8_t digest[32]) {
    LOOM_ASSERT(g->state == LOOM_GRID_READY);
    Loom__V1__LoraLoad l = LOOM__V1__LORA_LOAD__INIT;
    l.epoch = g->epoch;
    l.slot = (uint32_t)slot;
    l.name = (char *)name;
    l.path = (char *)path;
    l.digest = (ProtobufCBinaryData){32, (uint8_t *)digest};
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_LORA_LOAD;
    m.lora_load = &l;
    for (int i = 0; i < g->n_slots; i++) send_ctl(g, &g->slots[i], &m);
}

/* ---- timers and etcd ------------------------------------------------------------ */

/* Watch thread: a worker's key left etcd (lease expired or revoked). */
static void on_etcd_event(void *ctx, const loom_etcd_event_t *ev) {
    loom_grid_t *g = ctx;
    if (ev->type != LOOM_ETCD_DELETE) return;
    size_t pl = strlen(g->etcd_prefix) + strlen("workers/");
    if (strlen(ev->key) <= pl) return;
    gone_key_t *k = loom_xcalloc(1, sizeof *k);
    snprintf(k->id, sizeof k->id, "%s", ev->key + pl);
    pthread_mutex_lock(&g->gone_mu);
    k->next = g->gone;
    g->gone = k;
    pthread_mutex_unlock(&g->gone_mu);
}

/* Acts on workers whose etcd key went away. A worker that is still
 * heartbeating only lost its link to etcd, and is kept. */
static void etcd_drain(loom_grid_t *g) {
    if (!g->etcd) return;
    pthread_mutex_lock(&g->gone_mu);
    gone_key_t *k = g->gone;
    g->gone = NULL;
    pthread_mutex_unlock(&g->gone_mu);
    while (k) {
        gone_key_t *next = k->next;
        int i = slot_of(g, k->id, strlen(k->id));
        if (i >= 0) {
            uint64_t age_ms = (loom_now_ns() - g->slots[i].last_seen_ns) / 1000000ull;
            if (age_ms > 500) lose_worker(g, i, "left etcd (its lease expired)");
            else LOOM_WARN("worker %s left etcd but is still heartbeating: kept", k->id);
        }
        free(k);
        k = next;
    }
}

static void send_all(loom_grid_t *g, Loom__V1__ControlMsg *m) {
    for (int i = 0; i < g->n_slots; i++)
        if (g->slots[i].used) send_ctl(g, &g->slots[i], m);
}

void loom_grid_tick(loom_grid_t *g) {
    etcd_drain(g);
    probes_poll(g);
    uint64_t now = loom_now_ns();
    /* the reactor itself stood still (paused, descheduled): that time is not
     * the steps' to answer in; their results may be waiting unread */
    if (g->last_tick && now - g->last_tick > 1000000000ull)
        for (int i = 0; i < g->n_inflight; i++)
            if (g->inflight[i].deadline) g->inflight[i].deadline += now - g->last_tick;
    g->last_tick = now;
    if (now - g->last_check >= LIVENESS_CHECK_MS * 1000000ull) {
        g->last_check = now;
        uint64_t limit = (uint64_t)g->cfg.heartbeat_timeout_ms * 1000000ull;
        for (int i = 0; i < g->n_slots; i++)
            if (g->slots[i].used && now - g->slots[i].last_seen_ns > limit) {
                char why[128];
                snprintf(why, sizeof why, "missed heartbeats for %d ms: lost", g->cfg.heartbeat_timeout_ms);
                lose_worker(g, i, why);
            }
        /* results come in plan order: the oldest step bounds them all. A step
         * over its deadline is answered by no one (a worker that heartbeats
         * but computes nothing, a plan lost on a dead connection): re-plan */
        if (g->state == LOOM_GRID_READY && g->n_inflight > 0 && g->inflight[0].deadline &&
            now > g->inflight[0].deadline) {
            char why[256];
            snprintf(why, sizeof why, "step %llu (%d tokens) got no result in %.1f s, past its deadline of %.1f s",
                     (unsigned long long)g->inflight[0].step_id, g->inflight[0].mb->n_tokens,
                     (double)(now - g->inflight[0].t_sent) * 1e-9,
                     (double)(g->inflight[0].deadline - g->inflight[0].t_sent) * 1e-9);
            g->n_step_timeouts++;
            fail_grid(g, why);
        }
    }
    if (now - g->last_hb_sent >= HEARTBEAT_SEND_MS * 1000000ull) {
        g->last_hb_sent = now;
        Loom__V1__Heartbeat hb = LOOM__V1__HEARTBEAT__INIT;
        Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
        m.body_case = LOOM__V1__CONTROL_MSG__BODY_HEARTBEAT;
        m.heartbeat = &hb;
        send_all(g, &m);
    }
}

void loom_grid_shutdown(loom_grid_t *g, const char *reason) {
    Loom__V1__Shutdown sd = LOOM__V1__SHUTDOWN__INIT;
    sd.reason = (char *)reason;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_SHUTDOWN;
    m.shutdown = &sd;
    send_all(g, &m);
}

/* ---- create / destroy -------------------------------------------------------------- */

/* "tcp://HOST:PORT" with HOST replaced by --advertise-host when given. */
static void advertised(const loom_grid_t *g, const char *endpoint, char *out, size_t n) {
    const char *colon = strrchr(endpoint, ':');
    if (!g->cfg.advertise_host || !colon || strncmp(endpoint, "tcp://", 6) != 0) {
        snprintf(out, n, "%s", endpoint);
        return;
    }
    snprintf(out, n, "tcp://%s%s", g->cfg.advertise_host, colon);
}

/* Whether the coordinator key is held by a dead coordinator of this host (a
 * crashed predecessor whose lease has not expired yet). */
static int stale_coordinator_key(loom_grid_t *g, const char *key, const char *host) {
    char *v = NULL;
    loom_err_t err = {0};
    if (loom_etcd_get(g->etcd, key, &v, NULL, NULL, &err) < 0) return 0;
    cJSON *j = cJSON_Parse(v);
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(j, "host");
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(j, "pid");
    int stale = 0;
    if (host[0] && cJSON_IsString(h) && !strcmp(h->valuestring, host) && cJSON_IsNumber(p) && p->valuedouble >= 1 &&
        p->valuedouble < 4194305) {
        pid_t pid = (pid_t)p->valuedouble;
        stale = pid == getpid() || (kill(pid, 0) != 0 && errno == ESRCH);
        if (stale)
            LOOM_WARN("etcd key %s is held by a coordinator of this host that is gone (pid %d): taking it over", key,
                      (int)pid);
    }
    cJSON_Delete(j);
    free(v);
    return stale;
}

/* Claims /loom/<cluster>/coordinator (one coordinator per cluster), so
 * workers can find the control address, and watches the workers' keys. A
 * key left by a crashed coordinator of this host is taken over; a live
 * one's refuses this start. */
static loom_status_t etcd_setup(loom_grid_t *g, loom_err_t *err) {
    const char *cluster = g->cfg.cluster ? g->cfg.cluster : "default";
    snprintf(g->etcd_prefix, sizeof g->etcd_prefix, "/loom/%s/", cluster);
    LOOM_CHECK(loom_etcd_open(g->cfg.etcd_url, 2000, &g->etcd, err));
    /* a wildcard bind (0.0.0.0) is not dialable: publish --advertise-host instead */
    char ctl[300], api[300];
    advertised(g, g->ctl_addr, ctl, sizeof ctl);
    advertised(g, g->cfg.api_addr ? g->cfg.api_addr : "", api, sizeof api);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "control", ctl);
    cJSON_AddStringToObject(j, "api", api);
    cJSON_AddStringToObject(j, "model", g->cfg.model_name);
    if (g->cfg.kv_role) cJSON_AddStringToObject(j, "kv_role", g->cfg.kv_role);
    cJSON_AddNumberToObject(j, "pid", (double)getpid());
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    cJSON_AddStringToObject(j, "host", host);
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    char key[400];
    snprintf(key, sizeof key, "%scoordinator", g->etcd_prefix);
    loom_status_t st = loom_etcd_keeper_start(g->etcd, key, text, strlen(text), g->cfg.etcd_ttl, 1, &g->etcd_keeper, err);
    if (st == LOOM_ERR_RESOURCE_EXHAUSTED && stale_coordinator_key(g, key, host)) {
        loom_err_t derr = {0};
        if (loom_etcd_delete(g->etcd, key, &derr) == LOOM_OK)
            st = loom_etcd_keeper_start(g->etcd, key, text, strlen(text), g->cfg.etcd_ttl, 1, &g->etcd_keeper, err);
        else
            LOOM_WARN("could not remove the stale etcd key %s: %s", key, derr.msg);
    }
    free(text);
    if (st == LOOM_ERR_RESOURCE_EXHAUSTED) {
        char held[sizeof err->msg];
        snprintf(held, sizeof held, "%s", err->msg);
        return loom_err_set(err, st, "another coordinator serves cluster '%s' (%s)", cluster, held);
    }
    LOOM_CHECK(st);
    char prefix[400];
    snprintf(prefix, sizeof prefix, "%sworkers/", g->etcd_prefix);
    LOOM_CHECK(loom_etcd_watch_start(g->etcd, prefix, 0, on_etcd_event, g, &g->etcd_watch, err));
    LOOM_INFO("membership: etcd %s, cluster '%s' (lease TTL %d s)", g->cfg.etcd_url, cluster, g->cfg.etcd_ttl);
    return LOOM_OK;
}

/* The control socket: a ROUTER whose routing ids are the workers' ids. No
 * ZMQ_ROUTER_HANDOVER: a second connection claiming a connected worker's id
 * is ignored by libzmq (never routed to, never read); ZMTP heartbeats reap
 * the connection of a worker that died without closing it, so its restarted
 * process can take its id within the heartbeat timeout. */
static void *ctl_socket_open(loom_grid_t *g, void *zctx) {
    void *z = zmq_socket(zctx, ZMQ_ROUTER);
    if (!z) return NULL;
    int zero = 0, unlimited = 0;
    int64_t maxmsg = LOOM_MAX_MSG_BYTES;
    int hb_ivl = LOOM_MIN(1000, g->cfg.heartbeat_timeout_ms / 2), hb_timeout = g->cfg.heartbeat_timeout_ms;
    zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    zmq_setsockopt(z, ZMQ_SNDHWM, &unlimited, sizeof unlimited);
    zmq_setsockopt(z, ZMQ_HEARTBEAT_IVL, &hb_ivl, sizeof hb_ivl);
    zmq_setsockopt(z, ZMQ_HEARTBEAT_TIMEOUT, &hb_timeout, sizeof hb_timeout);
    return z;
}

loom_status_t loom_grid_create(const loom_grid_config_t *cfg, void *zctx, const loom_grid_callbacks_t *cb,
                               loom_grid_t **out, loom_err_t *err) {
    *out = NULL;
    LOOM_ASSERT(cfg->tp > 0 && cfg->pp > 0 && cfg->max_num_seqs > 0 && cfg->block_size > 0);
    loom_grid_t *g = loom_xcalloc(1, sizeof *g);
    loom_status_t st = LOOM_OK;
    g->cfg = *cfg;
    if (!g->cfg.comm) g->cfg.comm = "auto";
    if (!g->cfg.weight_dtype) g->cfg.weight_dtype = "f32";
    if (!g->cfg.model_name) g->cfg.model_name = "";
    if (cb) g->cb = *cb;
    g->n_slots = cfg->tp * cfg->pp;
    g->slots = loom_xcalloc((size_t)g->n_slots, sizeof *g->slots);
    g->inflight = loom_xcalloc((size_t)cfg->pp + (size_t)(cfg->ahead > 0 ? cfg->ahead : 0), sizeof *g->inflight);
    g->probe_fd = loom_xmalloc((size_t)g->n_slots * sizeof *g->probe_fd);
    for (int i = 0; i < g->n_slots; i++) g->probe_fd[i] = -1;
    g->sp = loom_xcalloc((size_t)cfg->max_num_seqs, sizeof *g->sp);
    g->sp_ptrs = loom_xcalloc((size_t)cfg->max_num_seqs, sizeof *g->sp_ptrs);
    g->mtp_next = loom_xcalloc((size_t)cfg->max_num_seqs, sizeof *g->mtp_next);
    pthread_mutex_init(&g->gone_mu, NULL);
    /* the incarnation: never 0 (workers read 0 as "an older coordinator that sent none") */
    uint64_t x = loom_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)g;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    g->incarnation = (x ^ (x >> 31)) | 1;
    g->ctl = ctl_socket_open(g, zctx);
    if (!g->ctl) {
        st = loom_err_set(err, LOOM_ERR_INTERNAL, "cannot create the control socket: %s", zmq_strerror(errno));
        goto fail;
    }
    if (cfg->secure_ctl) {
        st = cfg->secure_ctl(cfg->secure_ctx, g->ctl, &g->ctl_zap, err);
        if (st < 0) goto fail;
    }
    if (zmq_bind(g->ctl, cfg->control) != 0) {
        st = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cannot bind %s: %s", cfg->control, zmq_strerror(errno));
        goto fail;
    }
    size_t len = sizeof g->ctl_addr;
    zmq_getsockopt(g->ctl, ZMQ_LAST_ENDPOINT, g->ctl_addr, &len);
    if (cfg->etcd_url) {
        st = etcd_setup(g, err);
        if (st < 0) goto fail;
    }
    *out = g;
    return LOOM_OK;
fail:
    loom_grid_destroy(&g);
    return st;
}

void loom_grid_destroy(loom_grid_t **g_p) {
    if (!g_p || !*g_p) return;
    loom_grid_t *g = *g_p;
    *g_p = NULL;
    loom_etcd_watch_stop(&g->etcd_watch);
    loom_etcd_keeper_stop(&g->etcd_keeper); /* revokes: the coordinator key goes at once */
    loom_etcd_close(&g->etcd);
    while (g->gone) {
        gone_key_t *k = g->gone;
        g->gone = k->next;
        free(k);
    }
    pthread_mutex_destroy(&g->gone_mu);
    if (g->ctl) zmq_close(g->ctl);
    if (g->probe_fd) probes_stop(g);
    free(g->probe_fd);
    free(g->slots);
    free(g->inflight);
    free(g->sp);
    free(g->sp_ptrs);
    free(g->mtp_next);
    loom_sparams_arena_free(&g->sp_arena);
    free(g);
}

/* ---- accessors -------------------------------------------------------------------- */

void *loom_grid_socket(loom_grid_t *g) { return g->ctl; }
loom_grid_state_t loom_grid_state(const loom_grid_t *g) { return g->state; }
const char *loom_grid_state_name(loom_grid_state_t st) {
    return (unsigned)st < LOOM_ARRAY_LEN(state_names) ? state_names[st] : "unknown";
}
int loom_grid_probing(const loom_grid_t *g) { return g->probing; }
int loom_grid_n_slots(const loom_grid_t *g) { return g->n_slots; }
int loom_grid_n_registered(const loom_grid_t *g) { return count_used(g); }
int loom_grid_n_ready(const loom_grid_t *g) { return count_ready(g); }
uint64_t loom_grid_epoch(const loom_grid_t *g) { return g->epoch; }
uint64_t loom_grid_incarnation(const loom_grid_t *g) { return g->incarnation; }
int loom_grid_n_blocks(const loom_grid_t *g) { return g->n_blocks; }
const char *loom_grid_kv_dtype(const loom_grid_t *g) { return g->kv_dtype; }
uint64_t loom_grid_kv_block_bytes(const loom_grid_t *g) { return g->kv_block_bytes; }
uint64_t loom_grid_kv_tier_id(const loom_grid_t *g) { return g->kv_tier_id; }

int loom_grid_kv_xfer_addrs(const loom_grid_t *g, char *out, size_t cap) {
    size_t n = 0;
    out[0] = '\0';
    for (int r = 0; r < g->cfg.tp; r++) { /* stage 0's ranks (transport tcp is one stage) */
        const char *a = g->slots[r].kv_xfer_addr;
        if (!a[0]) return 0;
        int w = snprintf(out + n, cap - n, "%s%s", r ? "," : "", a);
        if (w < 0 || (size_t)w >= cap - n) return 0;
        n += (size_t)w;
    }
    return 1;
}

void loom_grid_kv_hold(loom_grid_t *g, uint64_t transfer, const int32_t *blocks, int n, int release) {
    if (g->state != LOOM_GRID_READY) return;
    Loom__V1__KvHold h = LOOM__V1__KV_HOLD__INIT;
    h.epoch = g->epoch;
    h.transfer = transfer;
    h.blocks = (int32_t *)blocks;
    h.n_blocks = release ? 0 : (size_t)n;
    h.release = release;
    Loom__V1__ControlMsg m = LOOM__V1__CONTROL_MSG__INIT;
    m.body_case = LOOM__V1__CONTROL_MSG__BODY_KV_HOLD;
    m.kv_hold = &h;
    for (int i = 0; i < g->n_slots; i++) send_ctl(g, &g->slots[i], &m);
}
int loom_grid_kv_host_slots(const loom_grid_t *g) { return g->kv_host_slots; }
uint64_t loom_grid_slot_kv_block_bytes(const loom_grid_t *g, int i) {
    return i >= 0 && i < g->n_slots ? g->slots[i].kv_block_bytes : 0;
}
const char *loom_grid_last_failure(const loom_grid_t *g) { return g->last_failure; }
const char *loom_grid_bound_addr(const loom_grid_t *g) { return g->ctl_addr; }
const char *loom_grid_slot_worker(const loom_grid_t *g, int i) {
    return i >= 0 && i < g->n_slots && g->slots[i].used ? g->slots[i].id : NULL;
}

void loom_grid_describe(const loom_grid_t *g, char *out, size_t n) {
    if (g->last_failure[0])
        snprintf(out, n, "the grid is not ready (%s, %d of %d workers registered): last failure: %s",
                 state_names[g->state], count_used(g), g->n_slots, g->last_failure);
    else
        snprintf(out, n, "the grid is not ready (%s, %d of %d workers registered)", state_names[g->state],
                 count_used(g), g->n_slots);
}
