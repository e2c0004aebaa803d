/* Worker-to-worker KV transfer: the service, the pull and the slice format
 * (kv_xfer.h). */
#include "worker/kv_xfer.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/comm.h"
#include "worker/comm_util.h"
#include "worker/tcp_io.h"

#define KV_MAGIC 0x314b4d4cu /* "LMK1" */
#define IDENT_BYTES 72
#define HELLO_HEAD 8 /* magic, version, flags: what tells another version apart */
#define HELLO_BYTES (HELLO_HEAD + LOOM_TCP_NONCE_BYTES)
#define OP_READ 1
#define OP_DONE 2
#define OP_READ_SHM 3
#define HANDSHAKE_MS 3000 /* the hello to the verdict, either side */
#define DIAL_MS 1000      /* a dial to a service refused this long: the service is gone */
#define REQUEST_MS 30000
#define IDLE_MS 2000 /* a connection with no request for this long is closed */
#define IDLE_POLL_MS 100 /* how often an idle connection looks whether a dialler waits for a slot */
#define MAX_READ_BLOCKS 65536
#define MAX_CONNS 8 /* connections served at once; beyond them the listener waits (its backlog holds the dialler) */
#define MSG_MAX 512

/* ---- little-endian fields ---- */

static uint8_t *put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
    return p + 4;
}
static uint8_t *put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
    return p + 8;
}
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }

static void ident_encode(const loom_kv_ident_t *id, uint8_t *p) {
    p = put64(p, id->model);
    memcpy(p, id->dtype, 8);
    p += 8;
    const uint32_t v[14] = {id->n_layers, id->layer_begin, id->layer_end, id->block_size, id->layout,
                            id->n_kv_heads, id->head_dim, id->kv_head_begin, id->kv_head_end, id->tp_size,
                            id->tp_rank, id->pp_size, id->pp_stage, 0};
    for (int i = 0; i < 14; i++) p = put32(p, v[i]);
}

static void ident_decode(const uint8_t *p, loom_kv_ident_t *id) {
    memset(id, 0, sizeof *id);
    id->model = get64(p);
    memcpy(id->dtype, p + 8, 8);
    id->dtype[7] = '\0';
    p += 16;
    uint32_t *f[13] = {&id->n_layers, &id->layer_begin, &id->layer_end, &id->block_size, &id->layout,
                       &id->n_kv_heads, &id->head_dim, &id->kv_head_begin, &id->kv_head_end, &id->tp_size,
                       &id->tp_rank, &id->pp_size, &id->pp_stage};
    for (int i = 0; i < 13; i++) *f[i] = get32(p + 4 * i);
}

int loom_kv_ident_mismatch(const loom_kv_ident_t *a, const loom_kv_ident_t *b, char *msg, size_t cap) {
    if (a->model != b->model) {
        snprintf(msg, cap, "model: digest %016llx here, %016llx there (another model or tokenizer)",
                 (unsigned long long)a->model, (unsigned long long)b->model);
        return 1;
    }
    if (strncmp(a->dtype, b->dtype, 8)) {
        snprintf(msg, cap, "kv_dtype: %.8s here, %.8s there", a->dtype, b->dtype);
        return 1;
    }
    const int la = a->layout == LOOM_KV_LAYOUT_LATENT, lb = b->layout == LOOM_KV_LAYOUT_LATENT;
    if (la != lb) {
        snprintf(msg, cap, "layout: %s here, %s there", la ? "the latent KV (MLA)" : "per-head K and V",
                 lb ? "the latent KV (MLA)" : "per-head K and V");
        return 1;
    }
    if (la && a->head_dim != b->head_dim) {
        snprintf(msg, cap, "head_dim: a latent row (kv_lora_rank + qk_rope_head_dim) of %u here, %u there",
                 a->head_dim, b->head_dim);
        return 1;
    }
    const struct {
        const char *name;
        uint32_t x, y;
    } f[] = {{"n_layers", a->n_layers, b->n_layers},       {"block_size", a->block_size, b->block_size},
             {"n_kv_heads", a->n_kv_heads, b->n_kv_heads}, {"head_dim", a->head_dim, b->head_dim},
             {"pp_size", a->pp_size, b->pp_size},          {"pp_stage", a->pp_stage, b->pp_stage},
             {"layer_begin", a->layer_begin, b->layer_begin}, {"layer_end", a->layer_end, b->layer_end}};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++)
        if (f[i].x != f[i].y) {
            snprintf(msg, cap, "%s: %u here, %u there", f[i].name, f[i].x, f[i].y);
            return 1;
        }
    return 0;
}

/* ---- slices ---- */

/* Arrays a layer keeps: K and V, or the latent row alone. */
static size_t kv_arrays(const loom_kv_span_fmt_t *f) { return f->latent ? 1 : 2; }

size_t loom_kv_span_bytes(const loom_kv_span_fmt_t *f) {
    return (size_t)f->n_layers * kv_arrays(f) * (f->codes + f->scales);
}

size_t loom_kv_slice_bytes(const loom_kv_span_fmt_t *f, int n) {
    size_t per = (size_t)f->block_size * (size_t)n;
    return (size_t)f->n_layers * kv_arrays(f) * per * (f->head_bytes + (f->scales ? sizeof(float) : 0));
}

/* Moves heads [h0, h0 + n) between a span and a slice (to_slice 1: span -> slice). */
static void slice_move(const loom_kv_span_fmt_t *f, uint8_t *span, int h0, int n, uint8_t *slice, int to_slice) {
    const size_t B = (size_t)f->block_size, H = (size_t)f->n_heads, A = kv_arrays(f);
    for (int l = 0; l < f->n_layers; l++) {
        uint8_t *layer = span + (size_t)l * A * (f->codes + f->scales);
        for (size_t kv = 0; kv < A; kv++) { /* K codes, V codes (latent: the rows) */
            uint8_t *piece = layer + kv * f->codes;
            for (size_t t = 0; t < B; t++) {
                uint8_t *at = piece + (t * H + (size_t)h0) * f->head_bytes;
                size_t len = (size_t)n * f->head_bytes;
                if (to_slice) memcpy(slice, at, len);
                else memcpy(at, slice, len);
                slice += len;
            }
        }
        if (!f->scales) continue;
        for (size_t kv = 0; kv < A; kv++) { /* K scales, V scales (latent: the rows') */
            uint8_t *piece = layer + A * f->codes + kv * f->scales;
            for (size_t t = 0; t < B; t++) {
                uint8_t *at = piece + (t * H + (size_t)h0) * sizeof(float);
                size_t len = (size_t)n * sizeof(float);
                if (to_slice) memcpy(slice, at, len);
                else memcpy(at, slice, len);
                slice += len;
            }
        }
    }
}

void loom_kv_slice_pack(const loom_kv_span_fmt_t *f, const void *span, int h0, int n, void *slice) {
    LOOM_ASSERT(h0 >= 0 && n >= 0 && h0 + n <= f->n_heads);
    slice_move(f, (uint8_t *)(uintptr_t)span, h0, n, slice, 1);
}

void loom_kv_slice_unpack(const loom_kv_span_fmt_t *f, const void *slice, int h0, int n, void *span) {
    LOOM_ASSERT(h0 >= 0 && n >= 0 && h0 + n <= f->n_heads);
    slice_move(f, span, h0, n, (uint8_t *)(uintptr_t)slice, 0);
}

/* ---- handshake pieces ---- */

#define HELLO_AUTH 1 /* hello flags: the side holds a secret */
#define HELLO_SHM 2  /* the side moves reads through shared memory when both are on one host (op 3) */
#define HELLO_ENC 4  /* the side seals every message after the proofs (both must) */
#define HOST_ID_MAX 255
#define SHM_PREFIX "/loom-kv-"
#define SHM_NAME_LEN (sizeof SHM_PREFIX - 1 + 32) /* the prefix and 16 random bytes in hex */

static void hello_encode(uint8_t *h, int flags, const uint8_t *nonce) {
    uint8_t *p = put32(h, KV_MAGIC);
    p[0] = LOOM_KV_XFER_VERSION & 0xff;
    p[1] = LOOM_KV_XFER_VERSION >> 8;
    p[2] = (uint8_t)flags;
    p[3] = 0;
    memcpy(p + 4, nonce, LOOM_TCP_NONCE_BYTES);
}

/* A hello's head: 0 when it is one of this version (*flags set), -1 when it
 * is no KV transfer hello, else the version it speaks. Flags a side does not
 * know are ignored. */
static int hello_head(const uint8_t *h, int *flags) {
    if (get32(h) != KV_MAGIC) return -1;
    const int v = h[4] | h[5] << 8;
    if (v != LOOM_KV_XFER_VERSION) return v ? v : -1;
    *flags = h[6];
    return 0;
}

/* This host's identity for the shared-memory path: the kernel's boot id
 * and the host name ("" when the boot id cannot be read: no shm). Two
 * containers on one kernel share the boot id but mostly not the name, nor
 * then a /dev/shm; where they do share the name and not /dev/shm, the
 * service cannot open the object and the read falls back to TCP. */
static void host_id(char *out, size_t cap) {
    char boot[64] = "", host[128] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = '\0';
        fclose(f);
    }
    boot[strcspn(boot, "\r\n")] = '\0';
    if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    if (boot[0]) snprintf(out, cap, "%s/%s", boot, host);
    else if (cap) out[0] = '\0';
}

static void kv_mac(const uint8_t *secret, size_t len, const char *tag, const uint8_t *n1, const uint8_t *n2,
                   uint8_t out[LOOM_TCP_MAC_BYTES]) {
    const char *strs[1] = {"loom-kv"};
    loom_tcp_mac(secret, len, tag, n1, n2, strs, 1, out);
}

/* A connection's messages after the proofs: on the socket as they are or,
 * encrypted, each write a sealed record of at most REC_MAX bytes
 *
 *   u32 length | ChaCha20-Poly1305 (IETF) ciphertext (length) | tag
 *
 * the length as associated data, the direction's record count as nonce
 * (loom_tcp_frame_nonce) under the direction's key (loom_tcp_frame_keys
 * over both nonces and "loom-kv"): a record changed, dropped, replayed or
 * moved fails its tag. Reads take the records' bytes as one stream. */
#define REC_MAX (1u << 20)
typedef struct kv_chan {
    int fd, enc;
    uint8_t skey[LOOM_TCP_KEY_BYTES], rkey[LOOM_TCP_KEY_BYTES];
    uint64_t sseq, rseq;
    uint8_t *sbuf, *rbuf;  /* a sealed record going, one coming (4 + REC_MAX + the tag) */
    uint8_t *plain;        /* a record's plaintext ... */
    size_t plen, poff;     /* ... its length and what of it was read */
} kv_chan_t;

static void chan_keys(kv_chan_t *ch, const uint8_t *secret, size_t secret_len, const uint8_t *nd, const uint8_t *na,
                      int dialler_side) {
    const char *strs[1] = {"loom-kv"};
    loom_tcp_frame_keys(secret, secret_len, nd, na, strs, 1, dialler_side, ch->skey, ch->rkey);
    ch->sbuf = loom_xmalloc(4 + REC_MAX + LOOM_TCP_TAG_BYTES);
    ch->rbuf = loom_xmalloc(REC_MAX + LOOM_TCP_TAG_BYTES);
    ch->plain = loom_xmalloc(REC_MAX);
    ch->enc = 1;
}

static void chan_free(kv_chan_t *ch) {
    sodium_memzero(ch->skey, sizeof ch->skey);
    sodium_memzero(ch->rkey, sizeof ch->rkey);
    free(ch->sbuf);
    free(ch->rbuf);
    free(ch->plain);
    ch->sbuf = ch->rbuf = ch->plain = NULL;
    ch->enc = 0;
}

static loom_status_t chan_write(kv_chan_t *ch, const void *buf, size_t len, uint64_t deadline, const char *what,
                                loom_err_t *err) {
    if (!ch->enc) return loom_tcp_write_full(ch->fd, buf, len, deadline, what, err);
    const uint8_t *p = buf;
    do {
        const size_t n = len < REC_MAX ? len : REC_MAX;
        uint8_t nonce[LOOM_TCP_NPUB_BYTES];
        loom_tcp_frame_nonce(nonce, ch->sseq++);
        put32(ch->sbuf, (uint32_t)n);
        crypto_aead_chacha20poly1305_ietf_encrypt(ch->sbuf + 4, NULL, p, n, ch->sbuf, 4, NULL, nonce, ch->skey);
        LOOM_CHECK(loom_tcp_write_full(ch->fd, ch->sbuf, 4 + n + LOOM_TCP_TAG_BYTES, deadline, what, err));
        p += n;
        len -= n;
    } while (len);
    return LOOM_OK;
}

static loom_status_t chan_read(kv_chan_t *ch, void *buf, size_t len, uint64_t deadline, const char *what,
                               loom_err_t *err) {
    if (!ch->enc) return loom_tcp_read_full(ch->fd, buf, len, deadline, what, err);
    uint8_t *p = buf;
    while (len) {
        if (ch->poff == ch->plen) { /* the next record: straight into buf when it wants all of it */
            uint8_t h[4], nonce[LOOM_TCP_NPUB_BYTES];
            LOOM_CHECK(loom_tcp_read_full(ch->fd, h, 4, deadline, what, err));
            const size_t n = get32(h);
            if (n > REC_MAX) return loom_err_set(err, LOOM_ERR_PROTOCOL, "%s: a sealed record of %zu bytes", what, n);
            LOOM_CHECK(loom_tcp_read_full(ch->fd, ch->rbuf, n + LOOM_TCP_TAG_BYTES, deadline, what, err));
            loom_tcp_frame_nonce(nonce, ch->rseq++);
            uint8_t *dst = len >= n ? p : ch->plain;
            if (crypto_aead_chacha20poly1305_ietf_decrypt(dst, NULL, NULL, ch->rbuf, n + LOOM_TCP_TAG_BYTES, h, 4,
                                                          nonce, ch->rkey) != 0)
                return loom_err_set(err, LOOM_ERR_PROTOCOL,
                                    "%s: a message failed its authentication tag (tampered with, replayed or out "
                                    "of order)", what);
            if (dst == p) {
                p += n;
                len -= n;
                continue;
            }
            ch->plen = n;
            ch->poff = 0;
        }
        const size_t k = len < ch->plen - ch->poff ? len : ch->plen - ch->poff;
        memcpy(p, ch->plain + ch->poff, k);
        ch->poff += k;
        p += k;
        len -= k;
    }
    return LOOM_OK;
}

/* Bytes of a record read and not yet taken (the socket may show nothing). */
static int chan_pending(const kv_chan_t *ch) { return ch->poff < ch->plen; }

/* u32 status | u16 length | message */
static loom_status_t send_status(kv_chan_t *ch, int32_t code, const char *msg, uint64_t deadline, loom_err_t *err) {
    uint8_t h[6 + MSG_MAX];
    size_t n = msg ? strlen(msg) : 0;
    if (n > MSG_MAX) n = MSG_MAX;
    put32(h, (uint32_t)code);
    h[4] = (uint8_t)n;
    h[5] = (uint8_t)(n >> 8);
    if (n) memcpy(h + 6, msg, n);
    return chan_write(ch, h, 6 + n, deadline, "kv transfer", err);
}

static loom_status_t recv_status(kv_chan_t *ch, int32_t *code, char *msg, size_t cap, uint64_t deadline,
                                 loom_err_t *err) {
    uint8_t h[6];
    char m[MSG_MAX + 1];
    LOOM_CHECK(chan_read(ch, h, 6, deadline, "kv transfer", err));
    size_t n = (size_t)(h[4] | h[5] << 8);
    if (n > MSG_MAX) return loom_err_set(err, LOOM_ERR_PROTOCOL, "kv transfer: a message of %zu bytes", n);
    if (n) LOOM_CHECK(chan_read(ch, m, n, deadline, "kv transfer", err));
    m[n] = '\0';
    *code = (int32_t)get32(h);
    snprintf(msg, cap, "%.*s", (int)(cap > 0 ? cap - 1 : 0), m);
    return LOOM_OK;
}

/* ---- the service ---- */

typedef struct hold {
    uint64_t id;
    int n;
    int32_t *blocks;
} hold_t;

/* A connection's thread: fd -1 once it closes its socket (under mu), done once it ends. */
typedef struct conn_slot {
    pthread_t thread;
    int used, done, fd;
    loom_kv_service_t *s;
} conn_slot_t;

/* The listener's thread accepts; each connection runs on a thread of its
 * own, at most MAX_CONNS at once. mu guards the holds, the counts and the
 * slots; the pool reads (cfg.read, cfg.peek) run on the connections'
 * threads, several at once, without it. */
struct loom_kv_service {
    loom_kv_service_config_t cfg;
    uint8_t secret[256];
    char host[HOST_ID_MAX + 1]; /* host_id ("" : the shared-memory path not offered) */
    loom_comm_listener_t *listener;
    int lfd, wake[2];
    char addr[320];
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t held_cv;
    hold_t *holds;
    int n_holds, cap_holds;
    uint64_t refused, served, served_shm;
    pthread_cond_t slot_cv;       /* a connection ended */
    conn_slot_t slots[MAX_CONNS];
    int n_conns;                  /* slots whose connection has not ended */
    int yielded;                  /* an idle connection closed for the dialler waiting (until it is accepted) */
    int stopping;
};

/* One connection's state on the service's side. */
typedef struct conn {
    int fd;
    kv_chan_t ch;               /* fd's messages after the proofs */
    char peer[96];
    int shm;                    /* both hellos offered shared memory and the host id went */
    void *span, *slices;        /* one block's span (read); one slice (the TCP path) */
    char shm_name[SHM_NAME_LEN + 1]; /* the dialler's object, mapped (op 3); "" : none */
    uint8_t *shm_map;
    size_t shm_size;
} conn_t;

static void conn_shm_drop(conn_t *c) {
    if (c->shm_map) munmap(c->shm_map, c->shm_size);
    c->shm_map = NULL;
    c->shm_size = 0;
    c->shm_name[0] = '\0';
}

/* The dialler's object named by op 3, at least `bytes` long, mapped (the
 * connection's when the name is the one it mapped last): one of this
 * transport's names, a regular object of this process's user with no
 * access for others (mode 0600, as the dialler makes it: whoever else
 * could name it could not have made it; whoever could resize it under us
 * is this user already). 0, or why not in msg. */
static int conn_shm(conn_t *c, const char *name, size_t bytes, char *msg, size_t cap) {
    int ours = strlen(name) == SHM_NAME_LEN && !strncmp(name, SHM_PREFIX, sizeof SHM_PREFIX - 1);
    for (size_t i = sizeof SHM_PREFIX - 1; ours && i < SHM_NAME_LEN; i++)
        ours = (name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f');
    if (!ours) {
        snprintf(msg, cap, "shm: '%.80s' is not a KV transfer object's name", name);
        return -1;
    }
    if (strcmp(name, c->shm_name)) { /* another object: the one mapped stays until this one is */
        int fd = shm_open(name, O_RDWR, 0);
        if (fd < 0) {
            snprintf(msg, cap, "shm: %s: %s", name, strerror(errno));
            return -1;
        }
        struct stat st;
        const char *bad = fstat(fd, &st) != 0                 ? "cannot be examined"
                          : !S_ISREG(st.st_mode)              ? "is not a shared memory object"
                          : st.st_uid != geteuid()            ? "belongs to another user"
                          : (st.st_mode & 077) != 0           ? "is open to other users (not mode 0600)"
                          : st.st_size <= 0                   ? "is empty"
                                                              : NULL;
        void *map = bad ? MAP_FAILED : mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        const int e = errno;
        close(fd);
        if (bad || map == MAP_FAILED) {
            snprintf(msg, cap, "shm: %s %s", name, bad ? bad : strerror(e));
            return -1;
        }
        conn_shm_drop(c);
        c->shm_map = map;
        c->shm_size = (size_t)st.st_size;
        memcpy(c->shm_name, name, SHM_NAME_LEN + 1); /* its length checked above */
    }
    if (c->shm_size < bytes) {
        snprintf(msg, cap, "shm: %s holds %zu bytes, the read needs %zu", name, c->shm_size, bytes);
        return -1;
    }
    return 0;
}

static int held_locked(loom_kv_service_t *s, uint64_t id, const int32_t *blocks, int n) {
    for (int i = 0; i < s->n_holds; i++) {
        if (s->holds[i].id != id) continue;
        for (int j = 0; j < n; j++) {
            int in = 0;
            for (int k = 0; k < s->holds[i].n && !in; k++) in = s->holds[i].blocks[k] == blocks[j];
            if (!in) return -1 - j;
        }
        return 1;
    }
    return 0;
}

/* 1: every block is held under id; 0: no such hold (after waiting for it); -1 - j: block j is not the hold's. */
static int held(loom_kv_service_t *s, uint64_t id, const int32_t *blocks, int n) {
    uint64_t deadline = loom_now_ns() + (uint64_t)s->cfg.hold_wait_ms * 1000000ull;
    pthread_mutex_lock(&s->mu);
    int r;
    while ((r = held_locked(s, id, blocks, n)) == 0 && loom_now_ns() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->held_cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
    return r;
}

/* One read (op 1, or op 3 into the dialler's shared memory): the blocks'
 * slices, or a status naming what is wrong. */
static loom_status_t serve_read(loom_kv_service_t *s, conn_t *c, int shm, loom_err_t *err) {
    kv_chan_t *ch = &c->ch;
    uint8_t h[20];
    char name[SHM_NAME_LEN + 2] = "";
    uint64_t deadline = loom_comm_deadline(REQUEST_MS);
    LOOM_CHECK(chan_read(ch, h, 20, deadline, "kv transfer", err));
    uint64_t id = get64(h);
    uint32_t n = get32(h + 8), h0 = get32(h + 12), h1 = get32(h + 16);
    const loom_kv_span_fmt_t *f = &s->cfg.fmt;
    if (n > MAX_READ_BLOCKS) return loom_err_set(err, LOOM_ERR_PROTOCOL, "kv transfer: a read of %u blocks", n);
    if (shm) { /* u8 length | name: one byte more than ours is enough to tell a name that is not */
        uint8_t len;
        LOOM_CHECK(chan_read(ch, &len, 1, deadline, "kv transfer", err));
        char skip[256];
        LOOM_CHECK(chan_read(ch, skip, len, deadline, "kv transfer", err));
        snprintf(name, sizeof name, "%.*s", (int)len, skip);
        for (char *q = name; *q; q++)
            if ((unsigned char)*q < 0x20 || (unsigned char)*q > 0x7e) *q = '?'; /* logged below */
    }
    int32_t *blocks = loom_xmalloc((size_t)(n ? n : 1) * sizeof *blocks);
    uint8_t *raw = loom_xmalloc((size_t)(n ? n : 1) * 4);
    loom_status_t st = chan_read(ch, raw, (size_t)n * 4, deadline, "kv transfer", err);
    for (uint32_t i = 0; i < n; i++) blocks[i] = (int32_t)get32(raw + 4 * i);
    free(raw);
    char msg[MSG_MAX];
    if (st < 0) goto out;
    if (h0 >= h1 || h1 > (uint32_t)f->n_heads) {
        snprintf(msg, sizeof msg, "heads [%u, %u) are not within this shard's %d", h0, h1, f->n_heads);
        st = send_status(ch, LOOM_ERR_INVALID_ARGUMENT, msg, deadline, err);
        goto out;
    }
    int r = held(s, id, blocks, (int)n);
    if (r <= 0) {
        if (r == 0)
            snprintf(msg, sizeof msg, "unknown blocks: transfer %016llx is not held here (read already, its lease "
                     "ended, or never made)", (unsigned long long)id);
        else
            snprintf(msg, sizeof msg, "unknown blocks: block %d is not one transfer %016llx holds", blocks[-1 - r],
                     (unsigned long long)id);
        LOOM_WARN("kv service: refused a read from %s: %s", c->peer, msg);
        st = send_status(ch, LOOM_ERR_NOT_FOUND, msg, deadline, err);
        goto out;
    }
    const int nh = (int)(h1 - h0);
    const size_t one = loom_kv_slice_bytes(f, nh);
    if (shm && (!c->shm || conn_shm(c, name, one * n, msg, sizeof msg) < 0)) {
        /* UNAVAILABLE: the dialler reads over the socket instead */
        if (!c->shm) snprintf(msg, sizeof msg, "shm: this connection did not agree on the shared-memory path");
        LOOM_WARN("kv service: refused a shared-memory read from %s: %s", c->peer, msg);
        st = send_status(ch, LOOM_ERR_UNAVAILABLE, msg, deadline, err);
        goto out;
    }
    /* TCP: streamed, each block's slice goes while the next is packed; shm: packed into the dialler's object (a
     * block that cannot be read then closes the connection: the puller fails) */
    if ((st = send_status(ch, LOOM_OK, NULL, deadline, err)) < 0) goto out;
    for (uint32_t i = 0; i < n && st == LOOM_OK; i++) {
        loom_err_t rerr = {0};
        const void *src = s->cfg.peek ? s->cfg.peek(s->cfg.ctx, blocks[i]) : NULL;
        if (!src && s->cfg.read(s->cfg.ctx, blocks[i], c->span, &rerr) < 0) {
            st = loom_err_set(err, LOOM_ERR_INTERNAL, "block %d could not be read: %.300s", blocks[i], rerr.msg);
            goto out;
        }
        if (shm) {
            loom_kv_slice_pack(f, src ? src : c->span, (int)h0, nh, c->shm_map + (size_t)i * one);
            continue;
        }
        loom_kv_slice_pack(f, src ? src : c->span, (int)h0, nh, c->slices);
        st = chan_write(ch, c->slices, one, deadline, "kv transfer", err);
    }
    int still = 0;
    if (st == LOOM_OK) {
        /* the fence: still held once streamed, so nothing overwrote them meanwhile (the worker hears of a
         * release before any step that may reuse the blocks) */
        pthread_mutex_lock(&s->mu);
        still = held_locked(s, id, blocks, (int)n) == 1;
        if (still) { /* counted before the dialler hears it: its next look at the counts sees them */
            s->served += n;
            if (shm) s->served_shm += n;
        }
        pthread_mutex_unlock(&s->mu);
        st = send_status(ch, still ? LOOM_OK : LOOM_ERR_NOT_FOUND,
                         still ? NULL : "unknown blocks: the hold ended while its blocks were read (its lease)",
                         deadline, err);
    }
out:
    free(blocks);
    return st;
}

/* The handshake as acceptor: 1 when the dialler may read, 0 when refused
 * (logged). Nothing of this side's identity goes before the dialler's proof. */
static int accept_handshake(loom_kv_service_t *s, conn_t *c) {
    const int fd = c->fd;
    uint64_t deadline = loom_comm_deadline(HANDSHAKE_MS);
    uint8_t h[HELLO_BYTES], nd[LOOM_TCP_NONCE_BYTES], na[LOOM_TCP_NONCE_BYTES], mac[LOOM_TCP_MAC_BYTES];
    uint8_t id[IDENT_BYTES];
    loom_err_t err = {0};
    loom_kv_ident_t theirs;
    int flags = 0, ours = s->cfg.secret_len > 0, v = -1;
    char msg[MSG_MAX] = "";
    uint8_t ans[HELLO_BYTES + LOOM_TCP_MAC_BYTES];
    randombytes_buf(na, sizeof na);
    hello_encode(ans, (ours ? HELLO_AUTH : 0) | (s->host[0] ? HELLO_SHM : 0) | (s->cfg.encrypt ? HELLO_ENC : 0), na);
    if (loom_tcp_read_full(fd, h, HELLO_HEAD, deadline, "kv transfer hello", &err) < 0 ||
        (v = hello_head(h, &flags)) < 0) {
        snprintf(msg, sizeof msg, "not a KV transfer hello%s%.300s", err.msg[0] ? ": " : "", err.msg);
        goto refuse;
    }
    if (v > 0) { /* another version: our hello tells the dialler which this side speaks */
        loom_tcp_write_full(fd, ans, HELLO_HEAD, deadline, "kv transfer", &err);
        snprintf(msg, sizeof msg, "the dialler speaks KV transfer version %d, this service version %d", v,
                 LOOM_KV_XFER_VERSION);
        goto refuse;
    }
    if (loom_tcp_read_full(fd, nd, sizeof nd, deadline, "kv transfer hello", &err) < 0) goto lost;
    const int auth = flags & HELLO_AUTH, shm = (flags & HELLO_SHM) && s->host[0];
    if (ours) kv_mac(s->secret, s->cfg.secret_len, "kv ack", nd, na, ans + HELLO_BYTES);
    /* the answer goes even to a dialler that does not authenticate as we do, so it can say why it stops */
    if (loom_tcp_write_full(fd, ans, HELLO_BYTES + (ours && auth ? LOOM_TCP_MAC_BYTES : 0), deadline, "kv transfer",
                            &err) < 0)
        goto lost;
    if (auth != ours) {
        snprintf(msg, sizeof msg, "%s", ours ? "the dialler does not authenticate (no secret_file)"
                                             : "the dialler authenticates; this service has no secret");
        goto refuse;
    }
    if (ours) {
        uint8_t want[LOOM_TCP_MAC_BYTES];
        if (loom_tcp_read_full(fd, mac, sizeof mac, deadline, "kv transfer proof", &err) < 0) goto lost;
        kv_mac(s->secret, s->cfg.secret_len, "kv dial", na, nd, want);
        if (sodium_memcmp(mac, want, sizeof want)) {
            snprintf(msg, sizeof msg, "the dialler's proof is wrong (it does not hold the secret)");
            goto refuse;
        }
    }
    if (!!(flags & HELLO_ENC) != s->cfg.encrypt) {
        snprintf(msg, sizeof msg, "encrypt: %s here, %s there (--encrypt-data-plane or kv_connector_extra_config "
                 "encrypt: both replicas or neither)", s->cfg.encrypt ? "on" : "off", s->cfg.encrypt ? "off" : "on");
        goto refuse;
    }
    if (s->cfg.encrypt) chan_keys(&c->ch, s->secret, s->cfg.secret_len, nd, na, 0);
    /* proved: the identities, the dialler's first (sealed when encrypted, as everything after) */
    if (chan_read(&c->ch, id, sizeof id, deadline, "kv transfer identity", &err) < 0) goto lost;
    ident_decode(id, &theirs);
    ident_encode(&s->cfg.ident, id);
    if (chan_write(&c->ch, id, sizeof id, deadline, "kv transfer", &err) < 0) goto lost;
    if (loom_kv_ident_mismatch(&s->cfg.ident, &theirs, msg, sizeof msg)) {
        send_status(&c->ch, LOOM_ERR_INVALID_ARGUMENT, msg, deadline, &err);
        goto refuse;
    }
    if (send_status(&c->ch, LOOM_OK, NULL, deadline, &err) < 0) goto lost;
    if (shm) { /* both offered shared memory: this host's identity, the dialler compares */
        uint8_t hid[1 + HOST_ID_MAX];
        size_t n = strlen(s->host);
        hid[0] = (uint8_t)n;
        memcpy(hid + 1, s->host, n);
        if (chan_write(&c->ch, hid, 1 + n, deadline, "kv transfer", &err) < 0) goto lost;
        c->shm = 1;
    }
    return 1;
refuse:
    LOOM_WARN("kv service: refused %s: %s", c->peer, msg);
    pthread_mutex_lock(&s->mu);
    s->refused++;
    pthread_mutex_unlock(&s->mu);
    return 0;
lost:
    LOOM_WARN("kv service: %s went away in the handshake: %s", c->peer, err.msg);
    return 0;
}

/* One connection: the handshake, then reads and dones until it closes. */
static void serve_conn(loom_kv_service_t *s, conn_t *c) {
    loom_tcp_peer_name(c->fd, c->peer, sizeof c->peer);
    if (!accept_handshake(s, c)) return;
    uint64_t idle_since = loom_now_ns();
    for (;;) { /* an idle connection is closed after IDLE_MS, or at once when a dialler waits for its slot */
        pthread_mutex_lock(&s->mu);
        const int full = s->n_conns >= MAX_CONNS;
        pthread_mutex_unlock(&s->mu);
        struct pollfd p[3] = {{c->fd, POLLIN, 0}, {s->wake[0], POLLIN, 0}, {s->lfd, POLLIN, 0}};
        int r = chan_pending(&c->ch) ? 1 : poll(p, full ? 3 : 2, IDLE_POLL_MS);
        if (chan_pending(&c->ch)) p[0].revents = POLLIN;
        if (r < 0 && errno != EINTR) return;
        if (p[1].revents) return;
        if (full && p[2].revents && !p[0].revents) { /* a dialler waits: one idle connection makes room */
            pthread_mutex_lock(&s->mu);
            const int yield = !s->yielded;
            s->yielded = 1;
            pthread_mutex_unlock(&s->mu);
            if (yield) return;
        }
        if (!p[0].revents) {
            if (loom_now_ns() - idle_since >= (uint64_t)IDLE_MS * 1000000ull) return;
            continue;
        }
        uint8_t op[4];
        loom_err_t err = {0};
        if (chan_read(&c->ch, op, 4, loom_comm_deadline(REQUEST_MS), "kv transfer", &err) < 0) {
            if (c->ch.enc && err.msg[0]) LOOM_WARN("kv service: %s: %s: closed", c->peer, err.msg); /* a bad record */
            return;
        }
        if (get32(op) == OP_READ || get32(op) == OP_READ_SHM) {
            if (serve_read(s, c, get32(op) == OP_READ_SHM, &err) < 0) {
                LOOM_WARN("kv service: a read from %s failed: %s", c->peer, err.msg);
                return;
            }
        } else if (get32(op) == OP_DONE) {
            uint8_t id[8];
            uint64_t deadline = loom_comm_deadline(REQUEST_MS);
            if (chan_read(&c->ch, id, 8, deadline, "kv transfer", &err) < 0) return;
            if (s->cfg.done) s->cfg.done(s->cfg.ctx, get64(id));
            if (send_status(&c->ch, LOOM_OK, NULL, deadline, &err) < 0) return;
        } else {
            LOOM_WARN("kv service: %s sent op %u: closed", c->peer, get32(op));
            return;
        }
        idle_since = loom_now_ns();
    }
}

static void *conn_main(void *arg) {
    conn_slot_t *slot = arg;
    loom_kv_service_t *s = slot->s;
    conn_t c = {.fd = slot->fd, .ch = {.fd = slot->fd}};
    size_t span = loom_kv_span_bytes(&s->cfg.fmt);
    c.span = loom_xmalloc(span ? span : 1);
    c.slices = loom_xmalloc(span ? span : 1); /* a slice is at most the span's heads, packed */
    serve_conn(s, &c);
    chan_free(&c.ch);
    conn_shm_drop(&c);
    free(c.span);
    free(c.slices);
    pthread_mutex_lock(&s->mu);
    slot->fd = -1; /* before the close: destroy shuts down only sockets still open */
    pthread_mutex_unlock(&s->mu);
    close(c.fd);
    pthread_mutex_lock(&s->mu);
    slot->done = 1;
    s->n_conns--;
    pthread_cond_broadcast(&s->slot_cv);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* A free slot (its ended thread joined), waiting while all MAX_CONNS serve; NULL when stopping. Under mu. */
static conn_slot_t *slot_take_locked(loom_kv_service_t *s) {
    for (;;) {
        if (s->stopping) return NULL;
        for (int i = 0; i < MAX_CONNS; i++) {
            conn_slot_t *c = &s->slots[i];
            if (c->used && c->done) {
                pthread_join(c->thread, NULL);
                c->used = 0;
            }
            if (!c->used) return c;
        }
        pthread_cond_wait(&s->slot_cv, &s->mu);
    }
}

static void *service_main(void *arg) {
    loom_kv_service_t *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        conn_slot_t *slot = slot_take_locked(s); /* the listener waits while MAX_CONNS connections are served */
        pthread_mutex_unlock(&s->mu);
        if (!slot) break;
        struct pollfd p[2] = {{s->lfd, POLLIN, 0}, {s->wake[0], POLLIN, 0}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) break;
        if (p[1].revents) break;
        if (!p[0].revents) continue;
        int fd = accept4(s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) continue;
        /* the answers are small writes back to back (a status, then the fence): not held for the dialler's ack */
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        pthread_mutex_lock(&s->mu);
        s->yielded = 0;
        int ok = !s->stopping;
        if (ok) {
            *slot = (conn_slot_t){.used = 1, .fd = fd, .s = s};
            if (pthread_create(&slot->thread, NULL, conn_main, slot) != 0) {
                LOOM_WARN("kv service: no thread for a connection: closed");
                slot->used = 0;
                ok = 0;
            } else {
                s->n_conns++;
            }
        }
        pthread_mutex_unlock(&s->mu);
        if (!ok) close(fd);
    }
    return NULL;
}

loom_status_t loom_kv_service_create(const loom_kv_service_config_t *cfg, loom_kv_service_t **out, loom_err_t *err) {
    *out = NULL;
    if (cfg->secret_len > sizeof ((loom_kv_service_t *)0)->secret)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "kv service: a secret of %zu bytes", cfg->secret_len);
    if (cfg->encrypt && !cfg->secret_len)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv service: encrypt needs a secret (secret_file): the keys come from it");
    if (sodium_init() < 0) return loom_err_set(err, LOOM_ERR_INTERNAL, "kv service: libsodium did not start");
    loom_comm_listener_t *l = NULL;
    LOOM_CHECK(loom_comm_listener_create(cfg->host && cfg->host[0] ? cfg->host : "127.0.0.1", cfg->port, &l, err));
    loom_kv_service_t *s = loom_xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    if (!s->cfg.hold_wait_ms) s->cfg.hold_wait_ms = 2000;
    if (cfg->secret_len) memcpy(s->secret, cfg->secret, cfg->secret_len);
    s->cfg.secret = NULL;
    if (cfg->shm != LOOM_KV_SHM_OFF) host_id(s->host, sizeof s->host);
    snprintf(s->addr, sizeof s->addr, "%s", loom_comm_listener_addr(l));
    s->listener = l;
    s->lfd = loom_comm_listener_fd(l);
    if (pipe2(s->wake, O_CLOEXEC) != 0) {
        loom_comm_listener_destroy(&s->listener);
        free(s);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "kv service: pipe: %s", strerror(errno));
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->held_cv, NULL);
    pthread_cond_init(&s->slot_cv, NULL);
    if (pthread_create(&s->thread, NULL, service_main, s) != 0) {
        s->thread = 0;
        loom_kv_service_destroy(&s);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "kv service: cannot start its thread");
    }
    *out = s;
    return LOOM_OK;
}

const char *loom_kv_service_addr(const loom_kv_service_t *s) { return s->addr; }

void loom_kv_service_hold(loom_kv_service_t *s, uint64_t id, const int32_t *blocks, int n) {
    pthread_mutex_lock(&s->mu);
    if (s->n_holds == s->cap_holds) {
        s->cap_holds = s->cap_holds ? 2 * s->cap_holds : 8;
        s->holds = loom_xrealloc(s->holds, (size_t)s->cap_holds * sizeof *s->holds);
    }
    hold_t *h = &s->holds[s->n_holds++];
    h->id = id;
    h->n = n;
    h->blocks = loom_xmalloc((size_t)(n ? n : 1) * sizeof *blocks);
    if (n) memcpy(h->blocks, blocks, (size_t)n * sizeof *blocks);
    pthread_cond_broadcast(&s->held_cv);
    pthread_mutex_unlock(&s->mu);
}

void loom_kv_service_unhold(loom_kv_service_t *s, uint64_t id) {
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n_holds; i++)
        if (s->holds[i].id == id) {
            free(s->holds[i].blocks);
            s->holds[i] = s->holds[--s->n_holds];
            break;
        }
    pthread_mutex_unlock(&s->mu);
}

void loom_kv_service_counts(loom_kv_service_t *s, uint64_t *refused, uint64_t *blocks, uint64_t *blocks_shm) {
    pthread_mutex_lock(&s->mu);
    *refused = s->refused;
    *blocks = s->served;
    if (blocks_shm) *blocks_shm = s->served_shm;
    pthread_mutex_unlock(&s->mu);
}

void loom_kv_service_destroy(loom_kv_service_t **s_p) {
    if (!s_p || !*s_p) return;
    loom_kv_service_t *s = *s_p;
    *s_p = NULL;
    /* the connections see the wake between requests; one in the middle of a read has its socket shut */
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    for (int i = 0; i < MAX_CONNS; i++)
        if (s->slots[i].used && s->slots[i].fd >= 0) shutdown(s->slots[i].fd, SHUT_RDWR);
    pthread_cond_broadcast(&s->slot_cv);
    pthread_mutex_unlock(&s->mu);
    ssize_t w = write(s->wake[1], "x", 1);
    (void)w;
    if (s->thread) pthread_join(s->thread, NULL);
    for (int i = 0; i < MAX_CONNS; i++)
        if (s->slots[i].used) pthread_join(s->slots[i].thread, NULL);
    loom_comm_listener_destroy(&s->listener);
    close(s->wake[0]);
    close(s->wake[1]);
    for (int i = 0; i < s->n_holds; i++) free(s->holds[i].blocks);
    free(s->holds);
    sodium_memzero(s->secret, sizeof s->secret);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->held_cv);
    pthread_cond_destroy(&s->slot_cv);
    free(s);
}

/* ---- the pull ---- */

struct loom_kv_pull {
    int fd;
    kv_chan_t ch;                     /* fd's messages after the proofs */
    int shm;                          /* reads go through shared memory (op 3) */
    char shm_name[SHM_NAME_LEN + 1];  /* the object; linked until the service has mapped it */
    int shm_linked;
    uint8_t *shm_map;
    size_t shm_size;
    uint8_t *buf;                     /* the TCP path's slices */
    size_t buf_cap;
};

static void pull_shm_drop(loom_kv_pull_t *c) {
    if (c->shm_map) munmap(c->shm_map, c->shm_size);
    if (c->shm_linked) shm_unlink(c->shm_name);
    c->shm_map = NULL;
    c->shm_size = 0;
    c->shm_linked = 0;
}

/* A new object of at least bytes (a random name, mode 0600), mapped. */
static loom_status_t pull_shm_make(loom_kv_pull_t *c, size_t bytes, loom_err_t *err) {
    pull_shm_drop(c);
    uint8_t r[16];
    randombytes_buf(r, sizeof r);
    char *q = c->shm_name + snprintf(c->shm_name, sizeof c->shm_name, "%s", SHM_PREFIX);
    for (int i = 0; i < 16; i++) q += snprintf(q, 3, "%02x", r[i]);
    int fd = shm_open(c->shm_name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "shm: %s: %s", c->shm_name, strerror(errno));
    c->shm_linked = 1;
    const size_t page = 4096, size = (bytes + page - 1) / page * page;
    void *map = MAP_FAILED;
    /* its pages reserved now: a /dev/shm too small for the read fails here (the socket then), not with SIGBUS
     * in the service's writes */
    int e = ftruncate(fd, (off_t)size) == 0 ? posix_fallocate(fd, 0, (off_t)size) : errno;
    if (e == 0) {
        map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        e = errno;
    }
    close(fd);
    if (map == MAP_FAILED) {
        pull_shm_drop(c);
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "shm: %zu bytes: %s", size, strerror(e));
    }
    c->shm_map = map;
    c->shm_size = size;
    return LOOM_OK;
}

/* The earlier of two deadlines (0: none). */
static uint64_t deadline_min(uint64_t a, uint64_t b) { return !a ? b : !b ? a : LOOM_MIN(a, b); }

loom_status_t loom_kv_pull_open(const char *addr, const loom_kv_ident_t *ours, const uint8_t *secret,
                                size_t secret_len, int shm, int encrypt, uint64_t deadline_all, loom_kv_pull_t **out,
                                loom_kv_ident_t *theirs, loom_err_t *err) {
    *out = NULL;
    /* A service's address is given out once it listens: a dial refused past DIAL_MS is a service gone
     * (the prefill replica died), and a peer silent past HANDSHAKE_MS is not one; the step waiting on
     * the pull must not wait the read's whole deadline for either. */
    const uint64_t deadline = deadline_min(deadline_all, loom_comm_deadline(HANDSHAKE_MS));
    int fd = -1, auth = secret && secret_len > 0, their_flags = 0;
    encrypt = !!encrypt;
    if (encrypt && !auth)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "kv transfer from %s: encrypt needs a secret (secret_file): the keys come from it", addr);
    if (sodium_init() < 0) return loom_err_set(err, LOOM_ERR_INTERNAL, "kv transfer: libsodium did not start");
    LOOM_CHECK(loom_tcp_dial(addr, deadline_min(deadline, loom_comm_deadline(DIAL_MS)), &fd, err));
    loom_kv_pull_t *c = loom_xcalloc(1, sizeof *c);
    c->fd = c->ch.fd = fd;
    uint8_t h[HELLO_BYTES], nd[LOOM_TCP_NONCE_BYTES], na[LOOM_TCP_NONCE_BYTES], mac[LOOM_TCP_MAC_BYTES];
    char what[400], msg[MSG_MAX], host[HOST_ID_MAX + 1] = "";
    if (shm != LOOM_KV_SHM_OFF) host_id(host, sizeof host);
    snprintf(what, sizeof what, "kv transfer from %s", addr);
    randombytes_buf(nd, sizeof nd);
    hello_encode(h, (auth ? HELLO_AUTH : 0) | (host[0] ? HELLO_SHM : 0) | (encrypt ? HELLO_ENC : 0), nd);
    loom_status_t st = loom_tcp_write_full(fd, h, HELLO_BYTES, deadline, what, err);
    if (st == LOOM_OK) st = loom_tcp_read_full(fd, h, HELLO_HEAD, deadline, what, err);
    if (st < 0) goto fail;
    const int v = hello_head(h, &their_flags);
    if (v != 0) {
        if (v < 0)
            st = loom_err_set(err, LOOM_ERR_PROTOCOL, "%s: not a Loom KV service", what);
        else
            st = loom_err_set(err, LOOM_ERR_PROTOCOL,
                              "%s: the service speaks KV transfer version %d, this side version %d: refused", what,
                              v, LOOM_KV_XFER_VERSION);
        goto fail;
    }
    if ((st = loom_tcp_read_full(fd, na, sizeof na, deadline, what, err)) < 0) goto fail;
    if (!!(their_flags & HELLO_AUTH) != auth) {
        st = loom_err_set(err, LOOM_ERR_UNAUTHENTICATED, "%s: %s", what,
                          auth ? "the service does not authenticate (it has no secret_file)"
                               : "the service wants a secret (secret_file) this side does not have");
        goto fail;
    }
    if (auth) {
        uint8_t want[LOOM_TCP_MAC_BYTES];
        if ((st = loom_tcp_read_full(fd, mac, sizeof mac, deadline, what, err)) < 0) goto fail;
        kv_mac(secret, secret_len, "kv ack", nd, na, want);
        if (sodium_memcmp(mac, want, sizeof want)) {
            st = loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                              "%s: the service's proof is wrong (it does not hold the secret): refused", what);
            goto fail;
        }
        kv_mac(secret, secret_len, "kv dial", na, nd, mac);
        if ((st = loom_tcp_write_full(fd, mac, sizeof mac, deadline, what, err)) < 0) goto fail;
    }
    if (!!(their_flags & HELLO_ENC) != encrypt) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "%s: handshake refused, encrypt: %s here, %s there (--encrypt-data-plane or "
                          "kv_connector_extra_config encrypt: both replicas or neither)",
                          what, encrypt ? "on" : "off", encrypt ? "off" : "on");
        goto fail;
    }
    if (encrypt) chan_keys(&c->ch, secret, secret_len, nd, na, 1);
    /* proved: the identities, ours first (sealed when encrypted, as everything after) */
    uint8_t id[IDENT_BYTES];
    ident_encode(ours, id);
    if ((st = chan_write(&c->ch, id, sizeof id, deadline, what, err)) < 0 ||
        (st = chan_read(&c->ch, id, sizeof id, deadline, what, err)) < 0)
        goto fail;
    ident_decode(id, theirs);
    if (loom_kv_ident_mismatch(ours, theirs, msg, sizeof msg)) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: handshake refused, %s", what, msg);
        goto fail;
    }
    int32_t code = 0;
    if ((st = recv_status(&c->ch, &code, msg, sizeof msg, deadline, err)) < 0) goto fail;
    if (code != 0) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: handshake refused, %s", what, msg);
        goto fail;
    }
    int same_host = 0;
    if (host[0] && (their_flags & HELLO_SHM)) { /* both offered: the service's host identity follows */
        uint8_t len;
        char theirs_host[HOST_ID_MAX + 1];
        if ((st = chan_read(&c->ch, &len, 1, deadline, what, err)) < 0 ||
            (st = chan_read(&c->ch, theirs_host, len, deadline, what, err)) < 0)
            goto fail;
        theirs_host[len] = '\0';
        same_host = !strcmp(theirs_host, host);
    }
    c->shm = same_host;
    *out = c;
    return LOOM_OK;
fail:
    chan_free(&c->ch);
    free(c);
    close(fd);
    return st;
}

int loom_kv_pull_shm(const loom_kv_pull_t *c) { return c->shm; }
int loom_kv_pull_fd(const loom_kv_pull_t *c) { return c->fd; }
int loom_kv_pull_sealed(const loom_kv_pull_t *c) { return c->ch.enc; }

/* Sends a read request (op 1, or op 3 naming the object); the first status's code in *code. */
static loom_status_t pull_request(loom_kv_pull_t *c, int shm, uint64_t transfer, const int32_t *blocks, int n,
                                  int h0, int n_heads, uint64_t deadline, int32_t *code, char *msg, size_t cap,
                                  loom_err_t *err) {
    const size_t name = shm ? 1 + strlen(c->shm_name) : 0, len = 24 + name + (size_t)n * 4;
    uint8_t *req = loom_xmalloc(len);
    uint8_t *p = put32(req, shm ? OP_READ_SHM : OP_READ);
    p = put64(p, transfer);
    p = put32(p, (uint32_t)n);
    p = put32(p, (uint32_t)h0);
    p = put32(p, (uint32_t)(h0 + n_heads));
    if (shm) {
        *p = (uint8_t)(name - 1);
        memcpy(p + 1, c->shm_name, name - 1);
        p += name;
    }
    for (int i = 0; i < n; i++) p = put32(p, (uint32_t)blocks[i]);
    loom_status_t st = chan_write(&c->ch, req, len, deadline, "kv transfer read", err);
    free(req);
    LOOM_CHECK(st);
    return recv_status(&c->ch, code, msg, cap, deadline, err);
}

loom_status_t loom_kv_pull_read(loom_kv_pull_t *c, uint64_t transfer, const int32_t *blocks, int n, int h0,
                                int n_heads, size_t bytes, const void **slices, uint64_t deadline, loom_err_t *err) {
    int32_t code = 0;
    char msg[MSG_MAX];
    *slices = NULL;
    if (c->shm && (!c->shm_map || c->shm_size < bytes)) {
        loom_err_t serr = {0};
        if (pull_shm_make(c, bytes ? bytes : 1, &serr) < 0) {
            LOOM_WARN("kv transfer: %s; reading over the socket", serr.msg);
            c->shm = 0;
        }
    }
    if (c->shm) {
        LOOM_CHECK(pull_request(c, 1, transfer, blocks, n, h0, n_heads, deadline, &code, msg, sizeof msg, err));
        if (code == LOOM_ERR_UNAVAILABLE) { /* the service cannot use the object (another /dev/shm): TCP from now */
            LOOM_WARN("kv transfer: the service refused the shared-memory path (%s); reading over the socket", msg);
            pull_shm_drop(c);
            c->shm = 0;
        } else if (code == 0 && c->shm_linked) { /* mapped there: gone from the namespace, kept while mapped */
            shm_unlink(c->shm_name);
            c->shm_linked = 0;
        }
    }
    if (!c->shm) {
        LOOM_CHECK(pull_request(c, 0, transfer, blocks, n, h0, n_heads, deadline, &code, msg, sizeof msg, err));
        if (code == 0) {
            if (bytes > c->buf_cap) {
                free(c->buf);
                c->buf = loom_xmalloc(bytes);
                c->buf_cap = bytes;
            }
            LOOM_CHECK(chan_read(&c->ch, c->buf, bytes, deadline, "kv transfer read", err));
        }
    }
    if (code != 0) return loom_err_set(err, code < 0 ? (loom_status_t)code : LOOM_ERR_PROTOCOL, "kv transfer: %s", msg);
    LOOM_CHECK(recv_status(&c->ch, &code, msg, sizeof msg, deadline, err)); /* the fence: still held once read */
    if (code != 0) return loom_err_set(err, code < 0 ? (loom_status_t)code : LOOM_ERR_PROTOCOL, "kv transfer: %s", msg);
    *slices = c->shm ? (const void *)c->shm_map : (const void *)c->buf;
    return LOOM_OK;
}

loom_status_t loom_kv_pull_done(loom_kv_pull_t *c, uint64_t transfer, uint64_t deadline, loom_err_t *err) {
    uint8_t req[12];
    put64(put32(req, OP_DONE), transfer);
    LOOM_CHECK(chan_write(&c->ch, req, sizeof req, deadline, "kv transfer done", err));
    int32_t code = 0;
    char msg[MSG_MAX];
    LOOM_CHECK(recv_status(&c->ch, &code, msg, sizeof msg, deadline, err));
    return code ? loom_err_set(err, LOOM_ERR_PROTOCOL, "kv transfer done: %s", msg) : LOOM_OK;
}

void loom_kv_pull_close(loom_kv_pull_t **c_p) {
    if (!c_p || !*c_p) return;
    loom_kv_pull_t *c = *c_p;
    *c_p = NULL;
    pull_shm_drop(c);
    chan_free(&c->ch);
    close(c->fd);
    free(c->buf);
    free(c);
}
