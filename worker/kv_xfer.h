/* Worker-to-worker KV transfer for prefill/decode disaggregation
 * (docs/disaggregation.md, transport tcp): the KV service a prefill worker
 * runs on a listener of its own, and the pull a decode worker makes.
 *
 * A connection: the dialler (decode) sends a hello, the acceptor (prefill)
 * answers; a hello carries only the version, flags and a nonce. With a
 * secret (both replicas' kv_connector_extra_config.secret_file) the answer
 * ends with HMAC-SHA256(K, "kv ack", nD, nA, "loom-kv") and the dialler's
 * proof HMAC-SHA256(K, "kv dial", nA, nD, "loom-kv") follows: comm_tcp.c's
 * challenge (loom_tcp_mac), so a listener without K is refused by the
 * dialler and a dialler without K by the listener, before anything else is
 * said. Only then are the identities (loom_kv_ident_t) exchanged, the
 * dialler's first, and the acceptor says whether they agree; a mismatch
 * names the field (both sides log it; the pull fails). A side of another
 * version is refused naming both versions (the acceptor answers such a
 * hello with its own head, then closes).
 *
 *   hello:  u32 "LMK1" | u16 version | u16 flags (1: authenticated, 2: shm, 4: encrypt) | nonce
 *   answer: hello (the acceptor's) | [mac]
 *   proof:  [mac] (authenticated only)
 *   ident:  the dialler's identity (72 bytes), then the acceptor's
 *   verdict: u32 status (0 or a loom status) | u16 length | message
 *   host:   u8 length | host id (verdict 0 and both hellos flagged shm only)
 *   read:   u32 op 1 | u64 transfer | u32 n | u32 h0 | u32 h1 | i32 block ids (n)
 *           -> u32 status | u16 length | message | n slices (status 0) | status
 *              (the fence: the blocks were still held once streamed)
 *   shm read: u32 op 3 | u64 transfer | u32 n | u32 h0 | u32 h1 | u8 length | object name | i32 block ids (n)
 *           -> u32 status | u16 length | message | status (the fence); status 0: the n slices are in the
 *              object from byte 0; UNAVAILABLE: the object could not be used (the dialler reads over op 1)
 *   done:   u32 op 2 | u64 transfer -> u32 status | u16 0
 *
 * Encrypted (both hellos flagged encrypt; one flagged alone is refused
 * after the proofs, naming it; it needs the secret): from the identities on,
 * every message above travels in sealed records, u32 length | ChaCha20-
 * Poly1305 (IETF) ciphertext | tag (the length as associated data, at most
 * 1 MiB a record), each direction under its own key (loom_tcp_frame_keys
 * over both nonces and "loom-kv", as the data plane's links derive theirs)
 * with its record count as nonce: a record changed, dropped, replayed or
 * moved fails the read. The shared-memory path's slices are not sealed.
 *
 * Shared memory on one host: a side that may use it flags its hello
 * (kv_connector_extra_config.shm "auto", the default; "off" never does);
 * when both do, the acceptor sends its host id (the kernel's boot id and
 * the host name) after the verdict, so after the proof, and the dialler
 * compares it with its own. On the same host the dialler makes a POSIX
 * shared memory object ("/loom-kv-" and 32 random hex digits, mode 0600)
 * sized for the read, its pages reserved (posix_fallocate: no room, the
 * socket), and names it in op 3; the acceptor opens it (only
 * such a name, a regular object of its own user, mode 0600), keeps it
 * mapped for the connection and packs the slices straight into it; the
 * dialler unlinks it once the first answer says it is mapped there and
 * reuses it for the connection's later reads, making a larger one when a
 * read needs more. Flags a side does not know are ignored (a peer of the
 * same version without the shm flag reads over TCP).
 *
 * A slice is a block's heads [h0, h1) of the acceptor's shard, packed
 * layout-free (loom_kv_slice_pack): so the two sides may differ in TP
 * (a decode rank reads the heads it holds from each prefill rank holding
 * them) and in layout (block-contiguous or layer-major). DeepSeek's latent
 * KV (MLA, layout latent) is one "head" per layer and token, the latent
 * row (kv_lora_rank + qk_rope_head_dim values) that is both K and V, the
 * same on every TP rank (replicated): a slice is the whole block, read from
 * any one rank of the acceptor's; both sides must be latent. The acceptor
 * serves only blocks held under the transfer id (loom_kv_service_hold:
 * the prefill's coordinator holds them until done or its lease ends). It
 * serves up to 8 connections at once, a thread each (an idle one closes
 * after 2 s, or at once when all 8 serve and a dialler waits: one makes
 * room); beyond them the listener waits for one to end. */
#ifndef LOOM_WORKER_KV_XFER_H
#define LOOM_WORKER_KV_XFER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define LOOM_KV_XFER_VERSION 2

/* What one side's KV is: the fields the two sides must agree on, and those
 * that may differ (TP, layout). */
typedef struct loom_kv_ident {
    uint64_t model;                /* the weights' and tokenizer's digests (the coordinator's tier seed) */
    char dtype[8];                 /* the KV element type: "f32", "bf16", "int8", "fp8" */
    uint32_t n_layers;             /* the model's */
    uint32_t layer_begin, layer_end; /* the shard's */
    uint32_t block_size;
    uint32_t layout;               /* LOOM_KV_LAYOUT_* */
    uint32_t n_kv_heads, head_dim; /* the model's KV heads; the head's size */
    uint32_t kv_head_begin, kv_head_end; /* the shard's KV heads */
    uint32_t tp_size, tp_rank, pp_size, pp_stage;
} loom_kv_ident_t;

enum { LOOM_KV_LAYOUT_CONTIGUOUS = 0, LOOM_KV_LAYOUT_LAYER_MAJOR = 1, LOOM_KV_LAYOUT_LATENT = 2 };

/* The first field that must agree and does not, written into msg as
 * "<field>: <ours> here, <theirs> there" (returns 1); 0 when they agree.
 * TP and the per-head layouts (block-contiguous, layer-major) may differ;
 * the pipeline (pp_size and the stage's layers) may not, nor latent (MLA)
 * against per-head K and V, nor the latent row's width (head_dim). */
int loom_kv_ident_mismatch(const loom_kv_ident_t *ours, const loom_kv_ident_t *theirs, char *msg, size_t cap);

/* A block as loom_model_kv_block_xfer packs it on the host, per layer: K
 * codes, V codes, K scales, V scales, each (block_size, n_heads, ...) token
 * major, each piece `codes` (or `scales`) bytes apart (padding included).
 * Latent (MLA): per layer one piece of codes, then one of scales (K is V). */
typedef struct loom_kv_span_fmt {
    int n_layers, block_size, n_heads;
    size_t head_bytes;    /* one head's codes: head_dim x the element's size */
    size_t codes, scales; /* piece strides; scales 0: none (one float per token and head otherwise) */
    int latent;           /* 1: one array a layer (the latent layout), 0: K and V */
} loom_kv_span_fmt_t;

/* Bytes of one block's span (all its layers). */
size_t loom_kv_span_bytes(const loom_kv_span_fmt_t *f);
/* Bytes of one block's slice of n heads: per layer K codes, V codes,
 * K scales, V scales (latent: codes, scales), each (block_size, n) packed. */
size_t loom_kv_slice_bytes(const loom_kv_span_fmt_t *f, int n);
/* Heads [h0, h0 + n) of a span into a slice, and a slice into heads
 * [h0, h0 + n) of a span (the rest of the span untouched). */
void loom_kv_slice_pack(const loom_kv_span_fmt_t *f, const void *span, int h0, int n, void *slice);
void loom_kv_slice_unpack(const loom_kv_span_fmt_t *f, const void *slice, int h0, int n, void *span);

/* ---- the service (prefill side) ---- */

typedef struct loom_kv_service loom_kv_service_t;

/* The shared-memory path (kv_connector_extra_config.shm): used on one host
 * when both sides allow it (auto), or never (off). */
enum { LOOM_KV_SHM_AUTO = 0, LOOM_KV_SHM_OFF = 1 };

/* Reads one pool block into host (its packed span, loom_model_kv_block_xfer):
 * called on the connections' threads, several at once (a thread each, at
 * most 8: the listener waits beyond them); the caller serializes it with
 * its pool's other users where they could write a held block. */
typedef loom_status_t (*loom_kv_read_fn)(void *ctx, int32_t block, void *host, loom_err_t *err);
/* A decode side reported a transfer read (its blocks may be freed). */
typedef void (*loom_kv_done_fn)(void *ctx, uint64_t transfer);

typedef struct loom_kv_service_config {
    const char *host;          /* the address to listen on ("" : 127.0.0.1); port 0: any */
    int port;
    loom_kv_ident_t ident;
    loom_kv_span_fmt_t fmt;
    const uint8_t *secret;     /* NULL or empty: unauthenticated (insecure: true) */
    size_t secret_len;
    loom_kv_read_fn read;
    /* (optional) the block's span where it can be read in place (a
     * block-contiguous pool in host memory), packed from there without the
     * copy read makes; NULL: read. */
    const void *(*peek)(void *ctx, int32_t block);
    loom_kv_done_fn done;
    void *ctx;
    int hold_wait_ms;          /* a read of a transfer not held yet waits this long for its hold (0: 2000) */
    int shm;                   /* LOOM_KV_SHM_*: whether it offers the shared-memory path */
    int encrypt;               /* 1: every message after the proofs sealed (needs the secret; dialler must agree) */
} loom_kv_service_config_t;

loom_status_t loom_kv_service_create(const loom_kv_service_config_t *cfg, loom_kv_service_t **out, loom_err_t *err);
/* "tcp://host:port" it listens on. */
const char *loom_kv_service_addr(const loom_kv_service_t *s);
/* Blocks held under a transfer id (from the coordinator), and their end. */
void loom_kv_service_hold(loom_kv_service_t *s, uint64_t transfer, const int32_t *blocks, int n);
void loom_kv_service_unhold(loom_kv_service_t *s, uint64_t transfer);
/* Connections refused (authentication, handshake), blocks served so far
 * and of those the ones through shared memory (blocks_shm may be NULL). */
void loom_kv_service_counts(loom_kv_service_t *s, uint64_t *refused, uint64_t *blocks, uint64_t *blocks_shm);
void loom_kv_service_destroy(loom_kv_service_t **s_p);

/* ---- the pull (decode side) ---- */

typedef struct loom_kv_pull loom_kv_pull_t;

/* Dials addr, proves the secret (NULL: none), checks the acceptor's proof
 * and the identities: *out the open connection, *theirs the acceptor's
 * identity; shm LOOM_KV_SHM_AUTO: reads go through shared memory when the
 * acceptor offers it from this host; encrypt 1: every message after the
 * proofs sealed (needs the secret; the acceptor must agree). UNAUTHENTICATED
 * when the peer does not prove the secret (or wants one we do not have),
 * INVALID_ARGUMENT naming the field on a mismatch (encrypt on one side
 * only included), UNAVAILABLE when it cannot be reached: dials refused for
 * 1 s (the service is gone) or a handshake not done in 3 s (not a KV
 * service), whatever deadline allows. */
loom_status_t loom_kv_pull_open(const char *addr, const loom_kv_ident_t *ours, const uint8_t *secret,
                                size_t secret_len, int shm, int encrypt, uint64_t deadline, loom_kv_pull_t **out,
                                loom_kv_ident_t *theirs, loom_err_t *err);
/* Whether the connection's reads go through shared memory (it falls back to
 * the socket for good when the acceptor cannot use the object). */
int loom_kv_pull_shm(const loom_kv_pull_t *c);
/* Whether the connection's messages are sealed (encrypt). */
int loom_kv_pull_sealed(const loom_kv_pull_t *c);
/* The connection's socket (tests speak the wire through it). */
int loom_kv_pull_fd(const loom_kv_pull_t *c);
/* Reads heads [h0, h0 + n_heads) (the acceptor's shard's) of blocks: *slices
 * the n_blocks slices of loom_kv_slice_bytes(fmt of the acceptor, n_heads)
 * (bytes in all), in the connection's memory until its next read or close. */
loom_status_t loom_kv_pull_read(loom_kv_pull_t *c, uint64_t transfer, const int32_t *blocks, int n_blocks, int h0,
                                int n_heads, size_t bytes, const void **slices, uint64_t deadline, loom_err_t *err);
/* Tells the acceptor the transfer is read. */
loom_status_t loom_kv_pull_done(loom_kv_pull_t *c, uint64_t transfer, uint64_t deadline, loom_err_t *err);
/* Closes the connection (its shared memory unlinked if still linked); safe twice. */
void loom_kv_pull_close(loom_kv_pull_t **c_p);

#endif
