/* The data plane's TCP pieces other modules use (worker/comm_tcp.c defines
 * them): dialling, bounded blocking I/O on a non-blocking socket, and the
 * HMAC proof of the links' challenge, so the KV service (worker/kv_xfer.c)
 * authenticates as the TP and pipeline links do. */
#ifndef LOOM_WORKER_TCP_IO_H
#define LOOM_WORKER_TCP_IO_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define LOOM_TCP_NONCE_BYTES 16
#define LOOM_TCP_MAC_BYTES 32
#define LOOM_TCP_KEY_BYTES 32   /* a ChaCha20-Poly1305 (IETF) key */
#define LOOM_TCP_NPUB_BYTES 12  /* its nonce */
#define LOOM_TCP_TAG_BYTES 16   /* its tag */

/* Connects to "tcp://host:port" (or "host:port", "[v6]:port"), retrying (a
 * listener may not be up yet) until deadline (loom_comm_deadline); TCP_NODELAY,
 * non-blocking. */
loom_status_t loom_tcp_dial(const char *addr, uint64_t deadline, int *fd_out, loom_err_t *err);
/* All of buf out, or in, by deadline; UNAVAILABLE naming `what` otherwise
 * (the peer closed, a socket error, the time passed). */
loom_status_t loom_tcp_write_full(int fd, const void *buf, size_t len, uint64_t deadline, const char *what,
                                  loom_err_t *err);
loom_status_t loom_tcp_read_full(int fd, void *buf, size_t len, uint64_t deadline, const char *what,
                                 loom_err_t *err);
/* "host:port" of the socket's peer (numeric), or "?". */
void loom_tcp_peer_name(int fd, char *out, size_t cap);
/* HMAC-SHA256 under secret of tag (with its NUL), nonces n1 then n2
 * (LOOM_TCP_NONCE_BYTES each) and each string (with its NUL): one side's
 * proof in the links' challenge (comm_tcp.c's header comment). */
void loom_tcp_mac(const uint8_t *secret, size_t secret_len, const char *tag, const uint8_t *n1, const uint8_t *n2,
                  const char *const *strs, int n_strs, uint8_t out[LOOM_TCP_MAC_BYTES]);

/* An authenticated connection's frame keys, one a direction: HMAC-SHA256
 * under secret of "enc d2a" (dialler to acceptor) or "enc a2d", the
 * dialler's nonce nd, the acceptor's na and strs (loom_tcp_mac); skey the
 * one this side sends with, rkey the one it receives with. */
void loom_tcp_frame_keys(const uint8_t *secret, size_t secret_len, const uint8_t *nd, const uint8_t *na,
                         const char *const *strs, int n_strs, int dialler_side, uint8_t skey[LOOM_TCP_KEY_BYTES],
                         uint8_t rkey[LOOM_TCP_KEY_BYTES]);
/* The nonce of a direction's seq-th frame: seq little-endian, zeros after
 * (each key seals each seq once). */
void loom_tcp_frame_nonce(uint8_t n[LOOM_TCP_NPUB_BYTES], uint64_t seq);

#endif
