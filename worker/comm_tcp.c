/* The tcp comm backend: a worker's TP group and pipeline links over TCP, for
 * workers on different hosts; also the data-plane listener every worker opens
 * at start-up.
 *
 * Link setup. Each link is dialled by one side (the lower tp rank dials the
 * higher; stage s dials stage s + 1) and accepted by the other. Every
 * listener exists before any create starts and the kernel completes a connect
 * from its backlog, so a worker first dials all its links and sends a hello on
 * each, then accepts its inbound links, then reads the acks of the links it
 * dialled. No step waits on another worker's progress: no deadlock.
 *
 *   hello: u32 magic "LMH1" | u16 version | u16 kind (1 tp, 2 pipeline, 3 ack)
 *          | i32 tp rank | u16 name length | u16 id length | name | worker id
 *
 * The acceptor checks magic, version, comm name (the grid epoch) and that the
 * worker id is the peer expected for that kind and rank and not connected yet.
 * Anything else (a stranger, garbage, a previous epoch) is logged and closed,
 * and create goes on. The answer is a hello of kind ack with the acceptor's
 * own name and id, which the dialler checks the same way.
 *
 * Authentication (version 2, when the coordinator handed out the epoch's
 * secret K in Assign): the dialler's hello ends with a random nonce nD; the
 * ack ends with the acceptor's nonce nA and HMAC-SHA256(K, "ack" nD nA name
 * dialler acceptor); the dialler checks it and answers HMAC-SHA256(K, "dial"
 * nA nD name dialler acceptor). The acceptor gives the link its slot only
 * once that proof is right, so a peer without K is dropped before any frame
 * is read, and an impostor's hello cannot take the slot of the real peer.
 * Nonces make every proof fresh: a recorded handshake does not replay.
 * Encryption (cfg->encrypt, with K): each link and direction gets the key
 * HMAC-SHA256(K, "enc" nD nA name dialler acceptor direction), and every
 * frame's payload travels as ChaCha20-Poly1305 (IETF) ciphertext and tag,
 * the header as associated data, the frame's seq as nonce (each key sends
 * at most 2^32 frames: a new epoch brings new keys). Without it frames are
 * in clear (docs/operations.md#security).
 *
 * Data. Sockets are non-blocking with TCP_NODELAY. Every message is a frame:
 *
 *   u32 magic "LMF1" | u16 op | u16 version | u32 seq | u32 0 | u64 bytes | payload
 *
 * seq counts frames per link and direction. All-reduce is a full mesh: each
 * rank sends its buffer to every peer, receives every peer's, and sums in rank
 * order; gather sends to rank 0; barrier is a full mesh of empty frames;
 * send_next/recv_prev are one frame on the pipeline link (the socket buffers
 * give the few messages of slack pipelining needs).
 *
 * Waiting: every call drives its sends and receives from one loop: ~2 µs of
 * non-blocking retries, then poll() on the sockets and an eventfd that
 * loom_comm_abort makes readable.
 *
 * Failure: a peer that closes its socket (or dies: the kernel closes it) fails
 * the waiting call with LOOM_ERR_UNAVAILABLE at once. Abort, a lost peer, a
 * timeout and a garbled stream all abort the comm: the flag, the eventfd, and
 * shutdown() of every socket, so each peer's next wait fails too and the abort
 * spreads through the grid. A frame of the right op but another size than
 * expected is LOOM_ERR_PROTOCOL and is skipped: the stream stays usable. */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/comm_impl.h"
#include "worker/comm_util.h"
#include "worker/tcp_io.h"

#define TCP_VERSION           1
#define TCP_VERSION_AUTH      2 /* hellos carry nonces and HMACs */
#define NONCE_BYTES           LOOM_TCP_NONCE_BYTES
#define MAC_BYTES             crypto_auth_hmacsha256_BYTES
_Static_assert(MAC_BYTES == LOOM_TCP_MAC_BYTES, "tcp_io.h's MAC size is HMAC-SHA256's");
_Static_assert(crypto_aead_chacha20poly1305_IETF_NPUBBYTES == LOOM_TCP_NPUB_BYTES &&
                   crypto_aead_chacha20poly1305_IETF_ABYTES == LOOM_TCP_TAG_BYTES &&
                   crypto_aead_chacha20poly1305_IETF_KEYBYTES == LOOM_TCP_KEY_BYTES,
               "tcp_io.h's frame sizes are ChaCha20-Poly1305 (IETF)'s");
#define TAG_BYTES             crypto_aead_chacha20poly1305_IETF_ABYTES
#define HELLO_MAGIC           0x31484d4cu /* "LMH1" */
#define FRAME_MAGIC           0x31464d4cu /* "LMF1" */
#define HELLO_HDR             16
#define HELLO_STR_MAX         1024
#define HELLO_MAX             (HELLO_HDR + 2 * HELLO_STR_MAX + NONCE_BYTES + MAC_BYTES)
#define FRAME_HDR             24
#define TCP_CREATE_DEFAULT_MS 30000
#define TCP_MAX_PENDING       32 /* inbound connections not yet given a link, held at once */
#define TCP_MAX_PER_SOURCE    8  /* of those, from one source address */
#define TCP_HANDSHAKE_MS      3000 /* a connection's hello must arrive within this */
#define TCP_MAX_BYTES         ((size_t)1 << 40)

enum { LINK_TP = 1, LINK_PIPE = 2, LINK_ACK = 3 };
enum { OP_ALLREDUCE = 1, OP_GATHER = 2, OP_BARRIER = 3, OP_PIPE = 4 };

static const char *op_name(unsigned op) {
    switch (op) {
    case OP_ALLREDUCE:
        return "all-reduce";
    case OP_GATHER:
        return "gather";
    case OP_BARRIER:
        return "barrier";
    case OP_PIPE:
        return "pipeline message";
    }
    return "?";
}

struct loom_comm_listener {
    int fd;
    char addr[320]; /* "tcp://host:port" */
};

typedef struct tcp_link {
    int fd;              /* -1 when absent */
    uint32_t sseq, rseq; /* frames sent and received */
    char peer[48];       /* for messages: "tp rank 2", "next stage" */
    uint8_t nonce[NONCE_BYTES]; /* a dialled link: the nonce of its hello */
    int enc;                    /* frames are encrypted */
    uint8_t skey[32], rkey[32]; /* ChaCha20-Poly1305 keys: sending, receiving */
    uint8_t *sc, *rc;           /* (max_bytes + TAG_BYTES): ciphertext out and in */
} tcp_link_t;

/* One frame out and/or one frame in on a link, advanced without blocking. */
typedef struct xfer {
    tcp_link_t *link;
    int sending, receiving;
    uint8_t shdr[FRAME_HDR];
    const uint8_t *sbuf;
    size_t slen, soff; /* soff counts the header too */
    unsigned rop;
    size_t rexpect;
    uint8_t *rbuf; /* NULL: the payload is read and dropped */
    uint8_t *rdst; /* encrypted link: where rbuf's ciphertext is decrypted to */
    uint8_t rhdr[FRAME_HDR];
    size_t rhoff;
    uint64_t rlen, roff;
    uint64_t rgot; /* bytes the peer announced */
    int rmismatch;
} xfer_t;

typedef struct loom_comm_tcp {
    loom_comm_t base;
    atomic_int aborted;
    int wake_fd; /* eventfd: readable once aborted */
    int timeout_ms;
    uint64_t spin_ns;
    tcp_link_t *tp; /* (tp_size); tp[tp_rank].fd == -1 */
    tcp_link_t next, prev;
    uint8_t *scratch; /* (tp_size, max_bytes): all-reduce parts from the peers */
    const float **srcs;
    xfer_t *xf;         /* (tp_size) */
    struct pollfd *pfd; /* (tp_size + 1) */
} loom_comm_tcp_t;

/* ---- little-endian encoding -------------------------------------------- */

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) {
    return (uint16_t)(p[0] | p[1] << 8);
}
static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* ---- socket helpers ------------------------------------------------------ */

static void set_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* "tcp://host:port", "host:port" or "[v6]:port" into host and port. */
static int parse_addr(const char *addr, char *host, size_t host_cap, char *port, size_t port_cap) {
    if (!strncmp(addr, "tcp://", 6)) addr += 6;
    const char *colon;
    if (addr[0] == '[') {
        const char *end = strchr(addr, ']');
        if (!end || end[1] != ':') return 0;
        if ((size_t)(end - addr - 1) >= host_cap) return 0;
        memcpy(host, addr + 1, (size_t)(end - addr - 1));
        host[end - addr - 1] = '\0';
        colon = end + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon || (size_t)(colon - addr) >= host_cap || colon == addr) return 0;
        memcpy(host, addr, (size_t)(colon - addr));
        host[colon - addr] = '\0';
    }
    if (!colon[1] || strlen(colon + 1) >= port_cap) return 0;
    snprintf(port, port_cap, "%s", colon + 1);
    return 1;
}

void loom_tcp_peer_name(int fd, char *out, size_t cap) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    char host[64], serv[16];
    if (getpeername(fd, (struct sockaddr *)&ss, &len) == 0 &&
        getnameinfo((struct sockaddr *)&ss, len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0)
        snprintf(out, cap, "%s:%s", host, serv);
    else
        snprintf(out, cap, "?");
}

/* Blocking-style I/O on a non-blocking socket, bounded by deadline (create only). */
loom_status_t loom_tcp_write_full(int fd, const void *buf, size_t len, uint64_t deadline,
                                const char *what, loom_err_t *err) {
    const uint8_t *p = buf;
    while (len) {
        ssize_t w = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            p += w;
            len -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp %s: send: %s", what,
                                strerror(errno));
        if (loom_comm_expired(deadline))
            return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp %s: timed out sending", what);
        struct pollfd pf = {fd, POLLOUT, 0};
        poll(&pf, 1, loom_comm_ms_left(deadline, 1000));
    }
    return LOOM_OK;
}

loom_status_t loom_tcp_read_full(int fd, void *buf, size_t len, uint64_t deadline, const char *what,
                               loom_err_t *err) {
    uint8_t *p = buf;
    while (len) {
        ssize_t r = recv(fd, p, len, MSG_DONTWAIT);
        if (r > 0) {
            p += r;
            len -= (size_t)r;
            continue;
        }
        if (r == 0)
            return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp %s: connection closed by the peer",
                                what);
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp %s: recv: %s", what,
                                strerror(errno));
        if (loom_comm_expired(deadline))
            return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp %s: timed out waiting for the peer",
                                what);
        struct pollfd pf = {fd, POLLIN, 0};
        poll(&pf, 1, loom_comm_ms_left(deadline, 1000));
    }
    return LOOM_OK;
}

/* Connects to addr, retrying (a listener may not be up yet) until deadline. */
loom_status_t loom_tcp_dial(const char *addr, uint64_t deadline, int *fd_out, loom_err_t *err) {
    char host[256], port[16];
    *fd_out = -1;
    if (!addr || !parse_addr(addr, host, sizeof host, port, sizeof port))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tcp: bad data address '%s'",
                            addr ? addr : "(null)");
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    int last_errno = 0;
    for (;;) {
        struct addrinfo *res = NULL;
        int gai = getaddrinfo(host, port, &hints, &res);
        if (gai != 0) {
            last_errno = 0;
            if (loom_comm_expired(deadline))
                return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp: cannot resolve '%s': %s", host,
                                    gai_strerror(gai));
        }
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            if (fd < 0) {
                last_errno = errno;
                continue;
            }
            int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
            if (rc != 0 && errno == EINPROGRESS) {
                struct pollfd pf = {fd, POLLOUT, 0};
                poll(&pf, 1, loom_comm_ms_left(deadline, 5000));
                int soerr = 0;
                socklen_t len = sizeof soerr;
                if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0) soerr = errno;
                if (soerr == 0 && !(pf.revents & POLLOUT)) soerr = ETIMEDOUT;
                rc = soerr ? -1 : 0;
                errno = soerr;
            }
            if (rc == 0) {
                freeaddrinfo(res);
                set_nodelay(fd);
                *fd_out = fd;
                return LOOM_OK;
            }
            last_errno = errno;
            close(fd);
        }
        if (res) freeaddrinfo(res);
        if (loom_comm_expired(deadline))
            return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp: cannot connect to %s: %s", addr,
                                last_errno ? strerror(last_errno) : "timed out");
        sleep_ms(LOOM_MIN(20, loom_comm_ms_left(deadline, 20)));
    }
}

/* ---- listener ------------------------------------------------------------ */

loom_status_t loom_comm_listener_create(const char *host, int port, loom_comm_listener_t **out,
                                        loom_err_t *err) {
    *out = NULL;
    if (!host || !*host) host = "127.0.0.1";
    if (port < 0 || port > 65535)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tcp listener: bad port %d", port);
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host, portstr, &hints, &res);
    if (gai != 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tcp listener: cannot resolve '%s': %s",
                            host, gai_strerror(gai));
    int fd = -1, last_errno = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) break;
        last_errno = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp listener: cannot listen on %s:%d: %s",
                            host, port, strerror(last_errno));
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    char serv[NI_MAXSERV];
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 ||
        getnameinfo((struct sockaddr *)&ss, len, NULL, 0, serv, sizeof serv, NI_NUMERICSERV) != 0) {
        int e = errno;
        close(fd);
        return loom_err_set(err, LOOM_ERR_IO, "tcp listener: getsockname: %s", strerror(e));
    }
    /* A wildcard address is no use to a peer: advertise the host name. */
    char shown[256];
    if (!strcmp(host, "0.0.0.0") || !strcmp(host, "::")) {
        if (gethostname(shown, sizeof shown) != 0) snprintf(shown, sizeof shown, "127.0.0.1");
        shown[sizeof shown - 1] = '\0';
    } else {
        snprintf(shown, sizeof shown, "%s", host);
    }
    loom_comm_listener_t *l = loom_xcalloc(1, sizeof *l);
    l->fd = fd;
    if (strchr(shown, ':'))
        snprintf(l->addr, sizeof l->addr, "tcp://[%s]:%s", shown, serv);
    else
        snprintf(l->addr, sizeof l->addr, "tcp://%s:%s", shown, serv);
    *out = l;
    return LOOM_OK;
}

const char *loom_comm_listener_addr(const loom_comm_listener_t *l) {
    return l->addr;
}

int loom_comm_listener_fd(const loom_comm_listener_t *l) { return l->fd; }

void loom_comm_listener_destroy(loom_comm_listener_t **l_p) {
    if (!l_p || !*l_p) return;
    close((*l_p)->fd);
    free(*l_p);
    *l_p = NULL;
}

/* ---- failure ------------------------------------------------------------- */

static void tcp_abort(loom_comm_t *base) {
    loom_comm_tcp_t *c = (loom_comm_tcp_t *)base;
    if (atomic_exchange(&c->aborted, 1)) return;
    uint64_t one = 1;
    if (c->wake_fd >= 0 && write(c->wake_fd, &one, sizeof one) < 0)
        LOOM_WARN("tcp comm: eventfd write failed");
    /* shutdown (not close: another thread may be polling these fds) makes
     * every peer's next read see the end of the stream. */
    for (int r = 0; c->tp && r < base->tp_size; r++)
        if (c->tp[r].fd >= 0) shutdown(c->tp[r].fd, SHUT_RDWR);
    if (c->next.fd >= 0) shutdown(c->next.fd, SHUT_RDWR);
    if (c->prev.fd >= 0) shutdown(c->prev.fd, SHUT_RDWR);
}

static loom_status_t tcp_fail(loom_comm_tcp_t *c, loom_err_t *err, loom_status_t code,
                              const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static loom_status_t tcp_fail(loom_comm_tcp_t *c, loom_err_t *err, loom_status_t code,
                              const char *fmt, ...) {
    int was_aborted = atomic_load(&c->aborted);
    tcp_abort(&c->base);
    if (was_aborted) return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp comm: aborted");
    va_list ap;
    va_start(ap, fmt);
    loom_err_setv(err, code, fmt, ap);
    va_end(ap);
    return code;
}

static loom_status_t tcp_check(loom_comm_tcp_t *c, loom_err_t *err) {
    if (atomic_load_explicit(&c->aborted, memory_order_relaxed))
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp comm: aborted");
    return LOOM_OK;
}

/* ---- frames -------------------------------------------------------------- */

static void xfer_init(xfer_t *x, tcp_link_t *link) {
    memset(x, 0, sizeof *x);
    x->link = link;
}

void loom_tcp_frame_nonce(uint8_t n[LOOM_TCP_NPUB_BYTES], uint64_t seq) {
    memset(n, 0, LOOM_TCP_NPUB_BYTES);
    put64(n, seq);
}

static void xfer_send_frame(xfer_t *x, unsigned op, const void *buf, size_t bytes) {
    uint8_t *h = x->shdr;
    tcp_link_t *l = x->link;
    uint32_t seq = l->sseq++;
    put32(h, FRAME_MAGIC);
    put16(h + 4, (uint16_t)op);
    put16(h + 6, TCP_VERSION);
    put32(h + 8, seq);
    put32(h + 12, 0);
    put64(h + 16, bytes);
    x->sending = 1;
    x->sbuf = buf;
    x->slen = bytes;
    x->soff = 0;
    if (l->enc) { /* the payload as ciphertext + tag; the header (plaintext length) authenticated */
        uint8_t n[crypto_aead_chacha20poly1305_IETF_NPUBBYTES];
        loom_tcp_frame_nonce(n, seq);
        unsigned long long clen = 0;
        crypto_aead_chacha20poly1305_ietf_encrypt(l->sc, &clen, buf, bytes, h, FRAME_HDR, NULL, n, l->skey);
        x->sbuf = l->sc;
        x->slen = (size_t)clen;
    }
}

static void xfer_recv_frame(xfer_t *x, unsigned op, void *buf, size_t bytes) {
    x->receiving = 1;
    x->rop = op;
    x->rexpect = bytes;
    x->rbuf = buf;
    x->rdst = NULL;
}

static loom_status_t link_lost(loom_comm_tcp_t *c, const tcp_link_t *l, const char *why,
                               loom_err_t *err) {
    return tcp_fail(c, err, LOOM_ERR_UNAVAILABLE, "tcp %s: %s", l->peer, why);
}

static loom_status_t xfer_send_some(loom_comm_tcp_t *c, xfer_t *x, loom_err_t *err) {
    while (x->sending) {
        struct iovec iov[2];
        int n = 0;
        if (x->soff < FRAME_HDR) iov[n++] = (struct iovec){x->shdr + x->soff, FRAME_HDR - x->soff};
        size_t poff = x->soff > FRAME_HDR ? x->soff - FRAME_HDR : 0;
        if (x->slen > poff) iov[n++] = (struct iovec){(void *)(x->sbuf + poff), x->slen - poff};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(x->link->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return LOOM_OK;
            if (errno == EINTR) continue;
            return link_lost(c, x->link,
                             errno == EPIPE || errno == ECONNRESET ? "connection closed by the peer"
                                                                   : strerror(errno),
                             err);
        }
        x->soff += (size_t)w;
        if (x->soff == FRAME_HDR + x->slen) x->sending = 0;
    }
    return LOOM_OK;
}

/* Checks a received frame header; a bad one means the stream is garbled. */
static loom_status_t frame_check(loom_comm_tcp_t *c, xfer_t *x, loom_err_t *err) {
    const uint8_t *h = x->rhdr;
    tcp_link_t *l = x->link;
    if (get32(h) != FRAME_MAGIC || get16(h + 6) != TCP_VERSION)
        return tcp_fail(c, err, LOOM_ERR_PROTOCOL, "tcp %s: garbled frame header", l->peer);
    unsigned op = get16(h + 4);
    if (op != x->rop)
        return tcp_fail(c, err, LOOM_ERR_PROTOCOL,
                        "tcp %s: the peer sent a %s while this side runs a %s", l->peer,
                        op_name(op), op_name(x->rop));
    if (get32(h + 8) != l->rseq)
        return tcp_fail(c, err, LOOM_ERR_PROTOCOL, "tcp %s: frame %u arrived, %u expected", l->peer,
                        get32(h + 8), l->rseq);
    uint64_t bytes = get64(h + 16);
    if (bytes > c->base.max_bytes)
        return tcp_fail(c, err, LOOM_ERR_PROTOCOL,
                        "tcp %s: a frame of %llu bytes exceeds max_bytes %zu", l->peer,
                        (unsigned long long)bytes, c->base.max_bytes);
    l->rseq++;
    x->rlen = x->rgot = bytes;
    if (bytes != x->rexpect) {
        x->rmismatch = 1;
        x->rbuf = NULL;
    }
    if (l->enc) { /* ciphertext and tag into the link's buffer, decrypted once complete */
        x->rlen = bytes + TAG_BYTES;
        if (!x->rmismatch) {
            x->rdst = x->rbuf ? x->rbuf : l->rc; /* an empty frame: its tag is checked in place */
            x->rbuf = l->rc;
        }
    }
    return LOOM_OK;
}

static loom_status_t xfer_recv_some(loom_comm_tcp_t *c, xfer_t *x, loom_err_t *err) {
    uint8_t sink[16384];
    while (x->receiving) {
        uint8_t *dst;
        size_t want;
        if (x->rhoff < FRAME_HDR) {
            dst = x->rhdr + x->rhoff;
            want = FRAME_HDR - x->rhoff;
        } else if (x->rbuf) {
            dst = x->rbuf + x->roff;
            want = (size_t)(x->rlen - x->roff);
        } else {
            dst = sink;
            want = (size_t)LOOM_MIN(x->rlen - x->roff, (uint64_t)sizeof sink);
        }
        ssize_t r = recv(x->link->fd, dst, want, MSG_DONTWAIT);
        if (r == 0) return link_lost(c, x->link, "connection closed by the peer", err);
        if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return LOOM_OK;
            if (errno == EINTR) continue;
            return link_lost(c, x->link,
                             errno == ECONNRESET ? "connection reset by the peer" : strerror(errno),
                             err);
        }
        if (x->rhoff < FRAME_HDR) {
            x->rhoff += (size_t)r;
            if (x->rhoff == FRAME_HDR)
                LOOM_CHECK(frame_check(c, x, err));
            else
                continue;
        } else {
            x->roff += (uint64_t)r;
        }
        if (x->roff == x->rlen) {
            x->receiving = 0;
            if (x->rdst) {
                uint8_t n[crypto_aead_chacha20poly1305_IETF_NPUBBYTES];
                loom_tcp_frame_nonce(n, x->link->rseq - 1);
                if (crypto_aead_chacha20poly1305_ietf_decrypt(x->rdst, NULL, NULL, x->rbuf, x->rlen, x->rhdr,
                                                              FRAME_HDR, n, x->link->rkey) != 0)
                    return tcp_fail(c, err, LOOM_ERR_PROTOCOL,
                                    "tcp %s: a frame failed its authentication tag (tampered with, or not "
                                    "from this epoch's peer)",
                                    x->link->peer);
            }
        }
    }
    return LOOM_OK;
}

/* Drives xs[0..n) until every frame is out and in: spins briefly, then polls
 * the sockets and the abort eventfd. */
static loom_status_t tcp_run(loom_comm_tcp_t *c, xfer_t *xs, int n, uint64_t deadline,
                             loom_err_t *err) {
    uint64_t t0 = 0;
    for (unsigned round = 0;; round++) {
        int pending = 0;
        for (int i = 0; i < n; i++) {
            if (xs[i].sending) LOOM_CHECK(xfer_send_some(c, &xs[i], err));
            if (xs[i].receiving) LOOM_CHECK(xfer_recv_some(c, &xs[i], err));
            pending += xs[i].sending || xs[i].receiving;
        }
        if (!pending) return LOOM_OK;
        LOOM_CHECK(tcp_check(c, err));
        uint64_t now = loom_now_ns();
        if (round == 0) t0 = now;
        if (now - t0 < c->spin_ns) {
            loom_comm_cpu_relax();
            continue;
        }
        if (loom_comm_expired(deadline))
            return tcp_fail(c, err, LOOM_ERR_UNAVAILABLE, "tcp comm: timed out after %d ms",
                            c->timeout_ms);
        int np = 0;
        c->pfd[np++] = (struct pollfd){c->wake_fd, POLLIN, 0};
        for (int i = 0; i < n; i++) {
            short ev = (short)((xs[i].receiving ? POLLIN : 0) | (xs[i].sending ? POLLOUT : 0));
            if (ev) c->pfd[np++] = (struct pollfd){xs[i].link->fd, ev, 0};
        }
        if (poll(c->pfd, (nfds_t)np, loom_comm_ms_left(deadline, LOOM_COMM_SLICE_MS)) < 0 &&
            errno != EINTR)
            return tcp_fail(c, err, LOOM_ERR_INTERNAL, "tcp comm: poll: %s", strerror(errno));
    }
}

/* ---- operations ---------------------------------------------------------- */

static loom_status_t mismatch_error(const xfer_t *xs, int n, size_t bytes, const char *what,
                                    loom_err_t *err) {
    for (int i = 0; i < n; i++)
        if (xs[i].rmismatch)
            return loom_err_set(err, LOOM_ERR_PROTOCOL, "tcp %s: %s sent %llu bytes, %zu expected",
                                what, xs[i].link->peer, (unsigned long long)xs[i].rgot, bytes);
    return LOOM_OK;
}

static loom_status_t tcp_allreduce(loom_comm_t *base, float *buf, int64_t n, loom_err_t *err) {
    loom_comm_tcp_t *c = (loom_comm_tcp_t *)base;
    LOOM_CHECK(tcp_check(c, err));
    size_t bytes = (size_t)n * sizeof(float);
    int nx = 0;
    for (int j = 0; j < base->tp_size; j++) {
        if (j == base->tp_rank) continue;
        xfer_t *x = &c->xf[nx++];
        xfer_init(x, &c->tp[j]);
        xfer_send_frame(x, OP_ALLREDUCE, buf, bytes);
        xfer_recv_frame(x, OP_ALLREDUCE, c->scratch + (size_t)j * base->max_bytes, bytes);
    }
    LOOM_CHECK(tcp_run(c, c->xf, nx, loom_comm_deadline(c->timeout_ms), err));
    LOOM_CHECK(mismatch_error(c->xf, nx, bytes, "all-reduce", err));
    for (int j = 0; j < base->tp_size; j++)
        c->srcs[j] =
            j == base->tp_rank ? buf : (const float *)(c->scratch + (size_t)j * base->max_bytes);
    loom_comm_sum_ranks(buf, c->srcs, base->tp_size, n);
    return LOOM_OK;
}

static loom_status_t tcp_gather(loom_comm_t *base, const void *send, size_t bytes, void *recv,
                                loom_err_t *err) {
    loom_comm_tcp_t *c = (loom_comm_tcp_t *)base;
    LOOM_CHECK(tcp_check(c, err));
    int nx = 0;
    if (base->tp_rank == 0) {
        if (!recv)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "tcp gather: tp rank 0 needs a receive buffer");
        if (bytes) memcpy(recv, send, bytes);
        for (int j = 1; j < base->tp_size; j++) {
            xfer_t *x = &c->xf[nx++];
            xfer_init(x, &c->tp[j]);
            xfer_recv_frame(x, OP_GATHER, (uint8_t *)recv + (size_t)j * bytes, bytes);
        }
    } else {
        xfer_init(&c->xf[0], &c->tp[0]);
        xfer_send_frame(&c->xf[nx++], OP_GATHER, send, bytes);
    }
    LOOM_CHECK(tcp_run(c, c->xf, nx, loom_comm_deadline(c->timeout_ms), err));
    return mismatch_error(c->xf, nx, bytes, "gather", err);
}

static loom_status_t tcp_barrier(loom_comm_t *base, loom_err_t *err) {
    loom_comm_tcp_t *c = (loom_comm_tcp_t *)base;
    LOOM_CHECK(tcp_check(c, err));
    int nx = 0;
    for (int j = 0; j < base->tp_size; j++) {
        if (j == base->tp_rank) continue;
        xfer_t *x = &c->xf[nx++];
        xfer_init(x, &c->tp[j]);
        xfer_send_frame(x, OP_BARRIER, NULL, 0);
        xfer_recv_frame(x, OP_BARRIER, NULL, 0);
    }
    return tcp_run(c, c->xf, nx, loom_comm_deadline(c->timeout_ms), err);
}

static loom_status_t tcp_send_next(loom_comm_t *base, const void *buf, size_t bytes,
                                   loom_err_t *err) {
    loom_comm_tcp_t *c = (loom_comm_tcp_t *)base;
    if (c->next.fd < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tcp send_next: this worker has no next stage");
    LOOM_CHECK(tcp_check(c, err));
    xfer_t x;
    xfer_init(&x, &c->next);
    xfer_send_frame(&x, OP_PIPE, buf, bytes);
    return tcp_run(c, &x, 1, loom_comm_deadline(c->timeout_ms), err);
}

static loom_status_t tcp_recv_prev(loom_comm_t *base, void *buf, size_t bytes, loom_err_t *err) {
    loom_comm_tcp_t *c = (loom_comm_tcp_t *)base;
    if (c->prev.fd < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tcp recv_prev: this worker has no previous stage");
    LOOM_CHECK(tcp_check(c, err));
    xfer_t x;
    xfer_init(&x, &c->prev);
    xfer_recv_frame(&x, OP_PIPE, buf, bytes);
    LOOM_CHECK(tcp_run(c, &x, 1, loom_comm_deadline(c->timeout_ms), err));
    return mismatch_error(&x, 1, bytes, "recv_prev", err);
}

static void link_free(tcp_link_t *l) {
    if (l->fd >= 0) close(l->fd);
    free(l->sc);
    free(l->rc);
    sodium_memzero(l->skey, sizeof l->skey);
    sodium_memzero(l->rkey, sizeof l->rkey);
}

static void tcp_destroy(loom_comm_t *base) {
    loom_comm_tcp_t *c = (loom_comm_tcp_t *)base;
    for (int r = 0; c->tp && r < base->tp_size; r++) link_free(&c->tp[r]);
    link_free(&c->next);
    link_free(&c->prev);
    if (c->wake_fd >= 0) close(c->wake_fd);
    free(c->tp);
    free(c->scratch);
    free(c->srcs);
    free(c->xf);
    free(c->pfd);
    free(c);
}

static const loom_comm_ops_t tcp_ops = {
    .name = "tcp",
    .destroy = tcp_destroy,
    .allreduce = tcp_allreduce,
    .gather = tcp_gather,
    .barrier = tcp_barrier,
    .send_next = tcp_send_next,
    .recv_prev = tcp_recv_prev,
    .abort = tcp_abort,
};

/* ---- link setup ---------------------------------------------------------- */

/* auth: a version-2 hello, `tail` (NONCE_BYTES, or NONCE_BYTES + MAC_BYTES
 * for an ack) appended. */
static size_t hello_encode(uint8_t *out, unsigned kind, int rank, const char *name,
                           const char *id, const uint8_t *tail, size_t tail_len) {
    size_t nl = strlen(name), il = strlen(id);
    put32(out, HELLO_MAGIC);
    put16(out + 4, tail ? TCP_VERSION_AUTH : TCP_VERSION);
    put16(out + 6, (uint16_t)kind);
    put32(out + 8, (uint32_t)rank);
    put16(out + 12, (uint16_t)nl);
    put16(out + 14, (uint16_t)il);
    memcpy(out + HELLO_HDR, name, nl);
    memcpy(out + HELLO_HDR + nl, id, il);
    if (tail) memcpy(out + HELLO_HDR + nl + il, tail, tail_len);
    return HELLO_HDR + nl + il + (tail ? tail_len : 0);
}

void loom_tcp_mac(const uint8_t *secret, size_t secret_len, const char *tag, const uint8_t *n1, const uint8_t *n2,
                  const char *const *strs, int n_strs, uint8_t out[LOOM_TCP_MAC_BYTES]) {
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, secret, secret_len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)tag, strlen(tag) + 1);
    crypto_auth_hmacsha256_update(&st, n1, NONCE_BYTES);
    crypto_auth_hmacsha256_update(&st, n2, NONCE_BYTES);
    for (int i = 0; i < n_strs; i++)
        crypto_auth_hmacsha256_update(&st, (const uint8_t *)strs[i], strlen(strs[i]) + 1);
    crypto_auth_hmacsha256_final(&st, out);
}

void loom_tcp_frame_keys(const uint8_t *secret, size_t secret_len, const uint8_t *nd, const uint8_t *na,
                         const char *const *strs, int n_strs, int dialler_side, uint8_t skey[LOOM_TCP_KEY_BYTES],
                         uint8_t rkey[LOOM_TCP_KEY_BYTES]) {
    uint8_t d2a[MAC_BYTES], a2d[MAC_BYTES];
    loom_tcp_mac(secret, secret_len, "enc d2a", nd, na, strs, n_strs, d2a);
    loom_tcp_mac(secret, secret_len, "enc a2d", nd, na, strs, n_strs, a2d);
    memcpy(skey, dialler_side ? d2a : a2d, LOOM_TCP_KEY_BYTES);
    memcpy(rkey, dialler_side ? a2d : d2a, LOOM_TCP_KEY_BYTES);
    sodium_memzero(d2a, sizeof d2a);
    sodium_memzero(a2d, sizeof a2d);
}

/* The proof of one side: HMAC-SHA256 under the epoch secret of a tag, both
 * nonces (this side's peer's first), the comm name and both ids. */
static void link_mac(const loom_comm_config_t *cfg, const char *tag, const uint8_t *n1, const uint8_t *n2,
                     const char *dialler, const char *acceptor, uint8_t out[MAC_BYTES]) {
    const char *strs[3] = {cfg->name, dialler, acceptor};
    loom_tcp_mac(cfg->auth_secret, cfg->auth_secret_len, tag, n1, n2, strs, 3, out);
}

static int auth_on(const loom_comm_config_t *cfg) {
    return cfg->auth_secret && cfg->auth_secret_len > 0;
}

/* An authenticated link's frame keys ("d2a": dialler to acceptor), and its
 * ciphertext buffers, when frames are encrypted. */
static void link_keys(const loom_comm_config_t *cfg, tcp_link_t *l, int dialler_side, const uint8_t *nd,
                      const uint8_t *na, const char *dialler, const char *acceptor) {
    if (!cfg->encrypt || !auth_on(cfg)) return;
    const char *strs[3] = {cfg->name, dialler, acceptor};
    loom_tcp_frame_keys(cfg->auth_secret, cfg->auth_secret_len, nd, na, strs, 3, dialler_side, l->skey, l->rkey);
    l->sc = loom_xmalloc(cfg->max_bytes + TAG_BYTES);
    l->rc = loom_xmalloc(cfg->max_bytes + TAG_BYTES);
    l->enc = 1;
}

/* A hello's fixed part; returns the total length, or 0 when it is not one. */
static size_t hello_len(const uint8_t *h) {
    unsigned v = get16(h + 4);
    if (get32(h) != HELLO_MAGIC || (v != TCP_VERSION && v != TCP_VERSION_AUTH)) return 0;
    if (get16(h + 12) > HELLO_STR_MAX || get16(h + 14) > HELLO_STR_MAX) return 0;
    size_t tail = v == TCP_VERSION ? 0 : get16(h + 6) == LINK_ACK ? NONCE_BYTES + MAC_BYTES : NONCE_BYTES;
    return HELLO_HDR + get16(h + 12) + get16(h + 14) + tail;
}

static int str_is(const uint8_t *p, size_t len, const char *s) {
    return s && strlen(s) == len && !memcmp(p, s, len);
}

typedef struct pending {
    int fd;
    size_t have, need; /* need: HELLO_HDR until the header is read, then the whole hello */
    uint8_t buf[HELLO_MAX];
    tcp_link_t *link;         /* authenticating: the link its hello claims; its proof comes next */
    uint8_t nd[NONCE_BYTES], na[NONCE_BYTES]; /* the dialler's and our nonce */
    uint8_t expect[MAC_BYTES]; /* the proof that peer must send */
    uint64_t since;            /* accepted at (loom_now_ns) */
    char src[96];              /* the source address, without its port */
} pending_t;

/* Inbound connections being accepted: the table and what was refused. */
typedef struct admit {
    pending_t *pend;
    int np;
    int need;                       /* expected inbound links still missing */
    int n_idle, n_evicted, n_bad;   /* closed: past the handshake deadline, to make room, refused */
} admit_t;

/* Matches a complete hello to an expected inbound link; NULL (with *why) if
 * it is not one. */
static tcp_link_t *hello_match(loom_comm_tcp_t *c, const loom_comm_config_t *cfg, const uint8_t *h,
                               const char **why) {
    size_t nl = get16(h + 12), il = get16(h + 14);
    const uint8_t *name = h + HELLO_HDR, *id = name + nl;
    unsigned kind = get16(h + 6);
    int rank = (int)get32(h + 8);
    if ((get16(h + 4) == TCP_VERSION_AUTH) != auth_on(cfg)) {
        *why = auth_on(cfg) ? "hello without the data-plane authentication this epoch requires"
                            : "hello with authentication this comm does not use";
        return NULL;
    }
    if (!str_is(name, nl, cfg->name)) {
        *why = "hello for another comm (an old grid epoch?)";
        return NULL;
    }
    if (kind == LINK_TP && rank >= 0 && rank < cfg->tp_rank &&
        str_is(id, il, cfg->tp_group[rank].worker_id)) {
        if (c->tp[rank].fd < 0) return &c->tp[rank];
        *why = "tp rank already connected";
        return NULL;
    }
    if (kind == LINK_PIPE && cfg->prev && rank == cfg->tp_rank &&
        str_is(id, il, cfg->prev->worker_id)) {
        if (c->prev.fd < 0) return &c->prev;
        *why = "previous stage already connected";
        return NULL;
    }
    *why = "hello from a worker that is not an expected peer";
    return NULL;
}

static void pending_drop(admit_t *ad, int i) {
    close(ad->pend[i].fd);
    ad->pend[i] = ad->pend[ad->np - 1];
    ad->np--;
}

/* Hands a pending connection's socket to its link. */
static void pending_admit(admit_t *ad, int i, tcp_link_t *l) {
    l->fd = ad->pend[i].fd;
    ad->pend[i].fd = -1;
    ad->pend[i] = ad->pend[ad->np - 1];
    ad->np--;
    ad->need--;
}

/* Unidentified: it has not sent a hello that names an expected peer yet. */
static int pending_unidentified(const pending_t *p) {
    return p->link == NULL;
}

/* How readily a pending connection gives up its place: an idle one (no byte
 * yet) first, then one half way through its hello, a claimed one (its hello
 * named an expected peer, its proof is due) last; the oldest first within a
 * rank. Returns the index, -1 when there is none. from: only the unidentified
 * ones of that source (NULL: any). */
static int pending_victim(const admit_t *ad, const char *from) {
    int best = -1, best_rank = 0;
    for (int i = 0; i < ad->np; i++) {
        const pending_t *p = &ad->pend[i];
        if (from && (strcmp(p->src, from) || !pending_unidentified(p))) continue;
        int rank = p->link ? 2 : p->have ? 1 : 0;
        if (best < 0 || rank < best_rank || (rank == best_rank && p->since < ad->pend[best].since)) {
            best = i;
            best_rank = rank;
        }
    }
    return best;
}

/* Reads what a pending connection sent; a complete hello gets its ack, a
 * complete proof its link. Drops the connection on anything else. */
static void pending_read(loom_comm_tcp_t *c, const loom_comm_config_t *cfg, admit_t *ad, int i,
                         uint64_t deadline) {
    pending_t *p = &ad->pend[i];
    ssize_t r = recv(p->fd, p->buf + p->have, p->need - p->have, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        pending_drop(ad, i);
        return;
    }
    if (r < 0) return;
    p->have += (size_t)r;
    if (p->have < p->need) return;
    char who[96];
    loom_tcp_peer_name(p->fd, who, sizeof who);
    if (p->link) { /* the proof after our ack */
        tcp_link_t *l = p->link;
        if (sodium_memcmp(p->buf, p->expect, MAC_BYTES) != 0) {
            LOOM_WARN("tcp comm '%s': refused a connection from %s claiming the %s: it does not hold "
                      "this epoch's data-plane secret",
                      cfg->name, who, l->peer);
            ad->n_bad++;
            pending_drop(ad, i);
            return;
        }
        if (l->fd >= 0) {
            LOOM_WARN("tcp comm '%s': refused a connection from %s: the %s is already connected", cfg->name, who,
                      l->peer);
            ad->n_bad++;
            pending_drop(ad, i);
            return;
        }
        link_keys(cfg, l, 0, p->nd, p->na,
                  l == &c->prev ? cfg->prev->worker_id : cfg->tp_group[l - c->tp].worker_id, cfg->self_id);
        pending_admit(ad, i, l);
        return;
    }
    if (p->need == HELLO_HDR) {
        p->need = hello_len(p->buf);
        if (!p->need || get16(p->buf + 6) == LINK_ACK) {
            LOOM_DEBUG("tcp comm '%s': refused a connection from %s: not a Loom data-plane hello", cfg->name, who);
            ad->n_bad++;
            pending_drop(ad, i);
            return;
        }
        if (p->have < p->need) return;
    }
    const char *why = "";
    tcp_link_t *l = hello_match(c, cfg, p->buf, &why);
    if (!l) {
        LOOM_WARN("tcp comm '%s': refused a connection from %s: %s", cfg->name, who, why);
        ad->n_bad++;
        pending_drop(ad, i);
        return;
    }
    uint8_t ack[HELLO_MAX], tail[NONCE_BYTES + MAC_BYTES];
    const char *dialler = l == &c->prev ? cfg->prev->worker_id : cfg->tp_group[l - c->tp].worker_id;
    if (auth_on(cfg)) {
        const uint8_t *nd = p->buf + p->need - NONCE_BYTES;
        randombytes_buf(tail, NONCE_BYTES);
        memcpy(p->nd, nd, NONCE_BYTES);
        memcpy(p->na, tail, NONCE_BYTES);
        link_mac(cfg, "ack", nd, tail, dialler, cfg->self_id, tail + NONCE_BYTES);
        link_mac(cfg, "dial", tail, nd, dialler, cfg->self_id, p->expect);
    }
    size_t len = hello_encode(ack, LINK_ACK, cfg->tp_rank, cfg->name, cfg->self_id, auth_on(cfg) ? tail : NULL,
                              sizeof tail);
    loom_err_t werr;
    if (loom_tcp_write_full(p->fd, ack, len, deadline, l->peer, &werr) < 0) {
        LOOM_WARN("tcp comm '%s': %s", cfg->name, werr.msg);
        pending_drop(ad, i);
        return;
    }
    set_nodelay(p->fd);
    if (auth_on(cfg)) { /* the slot is its once the proof is right */
        p->link = l;
        p->have = 0;
        p->need = MAC_BYTES;
        return;
    }
    pending_admit(ad, i, l);
}

/* Takes a new connection into the table. Admission never refuses the
 * newcomer: when its source already holds TCP_MAX_PER_SOURCE unidentified
 * places, or the table is full, the connection that gives up its place most
 * readily (pending_victim) is closed instead, so idle sockets cannot crowd
 * out a peer that connects after them, and a peer whose hello named it (its
 * proof due) is never pushed out by its own host's strangers. The newcomer is read at once: a peer sends
 * its hello right after connecting, so it is identified before the next
 * newcomer can push it out. */
static void pending_add(loom_comm_tcp_t *c, const loom_comm_config_t *cfg, admit_t *ad, int fd, uint64_t deadline) {
    pending_t p = {.fd = fd, .need = HELLO_HDR, .since = loom_now_ns()};
    char who[96];
    loom_tcp_peer_name(fd, who, sizeof who);
    char *colon = strrchr(who, ':');
    if (colon) *colon = '\0';
    snprintf(p.src, sizeof p.src, "%s", who);
    int same = 0;
    for (int i = 0; i < ad->np; i++) same += pending_unidentified(&ad->pend[i]) && !strcmp(ad->pend[i].src, p.src);
    int victim = same >= TCP_MAX_PER_SOURCE ? pending_victim(ad, p.src)
                 : ad->np == TCP_MAX_PENDING ? pending_victim(ad, NULL)
                                            : -1;
    if (victim >= 0) {
        LOOM_DEBUG("tcp comm '%s': closed a connection from %s to make room for a newer one", cfg->name,
                   ad->pend[victim].src);
        ad->n_evicted++;
        pending_drop(ad, victim);
    }
    ad->pend[ad->np++] = p;
    pending_read(c, cfg, ad, ad->np - 1, deadline);
}

/* Closes the unidentified connections that are past the handshake deadline;
 * returns the ms until the next one is due (at most cap). */
static int pending_expire(const loom_comm_config_t *cfg, admit_t *ad, int cap) {
    uint64_t now = loom_now_ns(), limit = (uint64_t)TCP_HANDSHAKE_MS * 1000000ull;
    int next = cap;
    for (int i = ad->np - 1; i >= 0; i--) {
        if (!pending_unidentified(&ad->pend[i])) continue;
        uint64_t age = now - ad->pend[i].since;
        if (age >= limit) {
            LOOM_DEBUG("tcp comm '%s': closed a connection from %s: no hello within %d ms", cfg->name,
                       ad->pend[i].src, TCP_HANDSHAKE_MS);
            ad->n_idle++;
            pending_drop(ad, i);
        } else if ((int)((limit - age) / 1000000ull) + 1 < next) {
            next = (int)((limit - age) / 1000000ull) + 1;
        }
    }
    return next;
}

/* Accepts until every expected inbound link has said hello (and, with the
 * epoch's secret, proved it). */
static loom_status_t accept_links(loom_comm_tcp_t *c, const loom_comm_config_t *cfg, int need,
                                  uint64_t deadline, loom_err_t *err) {
    int lfd = cfg->listener->fd;
    admit_t ad = {.pend = loom_xcalloc(TCP_MAX_PENDING, sizeof(pending_t)), .need = need};
    struct pollfd pfd[TCP_MAX_PENDING + 1];
    loom_status_t st = LOOM_OK;
    while (ad.need > 0) {
        if (loom_comm_expired(deadline)) {
            char missing[256] = "";
            size_t len = 0;
            for (int r = 0; r < cfg->tp_rank && len < sizeof missing; r++)
                if (c->tp[r].fd < 0)
                    len += (size_t)snprintf(missing + len, sizeof missing - len, " tp rank %d", r);
            if (cfg->prev && c->prev.fd < 0 && len < sizeof missing)
                snprintf(missing + len, sizeof missing - len, " previous stage");
            st = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp comm '%s': timed out waiting for:%s",
                              cfg->name, missing);
            break;
        }
        if (cfg->cancelled && cfg->cancelled(cfg->cancel_ctx)) {
            st = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "tcp comm '%s': the join was called off", cfg->name);
            break;
        }
        int wait_ms = pending_expire(cfg, &ad, loom_comm_ms_left(deadline, 200));
        pfd[0] = (struct pollfd){lfd, POLLIN, 0};
        for (int i = 0; i < ad.np; i++)
            pfd[i + 1] = (struct pollfd){ad.pend[i].fd, POLLIN, 0};
        int np = ad.np;
        if (poll(pfd, (nfds_t)np + 1, wait_ms) < 0 && errno != EINTR) {
            st = loom_err_set(err, LOOM_ERR_INTERNAL, "tcp comm: poll: %s", strerror(errno));
            break;
        }
        /* Read the pending ones first, from the last: pfd[i + 1] matches
         * pend[i] as long as only entries at i or above have moved. */
        for (int i = np - 1; i >= 0; i--)
            if (pfd[i + 1].revents) pending_read(c, cfg, &ad, i, deadline);
        if (pfd[0].revents) {
            for (;;) {
                int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0) break;
                pending_add(c, cfg, &ad, fd, deadline);
            }
        }
    }
    for (int i = 0; i < ad.np; i++)
        close(ad.pend[i].fd);
    if (ad.n_idle || ad.n_evicted || ad.n_bad || ad.np)
        LOOM_WARN("tcp comm '%s': closed %d unidentified connection(s) while joining: %d sent no hello within "
                  "%d ms, %d made room for newer ones, %d were refused (not a Loom hello, not an expected peer or "
                  "no proof of the epoch's secret), %d were still pending when the links were complete",
                  cfg->name, ad.n_idle + ad.n_evicted + ad.n_bad + ad.np, ad.n_idle, TCP_HANDSHAKE_MS,
                  ad.n_evicted, ad.n_bad, ad.np);
    free(ad.pend);
    return st;
}

/* Reads and checks the acceptor's answer on a link this worker dialled. */
static loom_status_t read_ack(tcp_link_t *l, const loom_comm_config_t *cfg, const char *peer_id,
                              uint64_t deadline, loom_err_t *err) {
    uint8_t h[HELLO_MAX];
    loom_status_t st = loom_tcp_read_full(l->fd, h, HELLO_HDR, deadline, l->peer, err);
    if (st == LOOM_ERR_UNAVAILABLE && err && strstr(err->msg, "closed"))
        return loom_err_set(
            err, LOOM_ERR_UNAVAILABLE,
            "tcp %s: the peer closed the connection before answering (it refused the hello for "
            "comm '%s', or its own create failed)",
            l->peer, cfg->name);
    LOOM_CHECK(st);
    size_t len = hello_len(h);
    if (!len || get16(h + 6) != LINK_ACK)
        return loom_err_set(err, LOOM_ERR_PROTOCOL,
                            "tcp %s: the peer did not answer with a Loom ack", l->peer);
    LOOM_CHECK(loom_tcp_read_full(l->fd, h + HELLO_HDR, len - HELLO_HDR, deadline, l->peer, err));
    size_t nl = get16(h + 12), il = get16(h + 14);
    if (!str_is(h + HELLO_HDR, nl, cfg->name) || !str_is(h + HELLO_HDR + nl, il, peer_id))
        return loom_err_set(err, LOOM_ERR_PROTOCOL,
                            "tcp %s: answered by '%.*s' in comm '%.*s', expected '%s' in '%s'",
                            l->peer, (int)il, (const char *)h + HELLO_HDR + nl, (int)nl,
                            (const char *)h + HELLO_HDR, peer_id, cfg->name);
    if (!auth_on(cfg)) return LOOM_OK;
    if (get16(h + 4) != TCP_VERSION_AUTH)
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                            "tcp %s: the peer answered without the data-plane authentication this epoch requires",
                            l->peer);
    const uint8_t *na = h + HELLO_HDR + nl + il, *mac = na + NONCE_BYTES;
    uint8_t want[MAC_BYTES], proof[MAC_BYTES];
    link_mac(cfg, "ack", l->nonce, na, cfg->self_id, peer_id, want);
    if (sodium_memcmp(want, mac, MAC_BYTES) != 0)
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                            "tcp %s: refused the peer at the other end: it does not hold this epoch's data-plane "
                            "secret",
                            l->peer);
    link_mac(cfg, "dial", na, l->nonce, cfg->self_id, peer_id, proof);
    LOOM_CHECK(loom_tcp_write_full(l->fd, proof, MAC_BYTES, deadline, l->peer, err));
    link_keys(cfg, l, 1, l->nonce, na, cfg->self_id, peer_id);
    return LOOM_OK;
}

static loom_status_t dial_link(tcp_link_t *l, const loom_comm_config_t *cfg, unsigned kind,
                               const char *addr, uint64_t deadline, loom_err_t *err) {
    LOOM_CHECK(loom_tcp_dial(addr, deadline, &l->fd, err));
    uint8_t hello[HELLO_MAX];
    if (auth_on(cfg)) randombytes_buf(l->nonce, NONCE_BYTES);
    size_t len = hello_encode(hello, kind, cfg->tp_rank, cfg->name, cfg->self_id,
                              auth_on(cfg) ? l->nonce : NULL, NONCE_BYTES);
    return loom_tcp_write_full(l->fd, hello, len, deadline, l->peer, err);
}

static int id_ok(const char *s) {
    return s && *s && strlen(s) <= HELLO_STR_MAX;
}

loom_status_t loom_comm_tcp_create(const loom_comm_config_t *cfg, loom_comm_t **out,
                                   loom_err_t *err) {
    *out = NULL;
    if (!id_ok(cfg->name) || !id_ok(cfg->self_id))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tcp comm: name and self_id are required (at most %d bytes)",
                            HELLO_STR_MAX);
    for (int r = 0; r < cfg->tp_size && cfg->tp_size > 1; r++) {
        if (!cfg->tp_group || !id_ok(cfg->tp_group[r].worker_id) ||
            (r > cfg->tp_rank && !cfg->tp_group[r].data_addr))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "tcp comm: tp group entry %d is incomplete", r);
    }
    if ((cfg->prev && !id_ok(cfg->prev->worker_id)) ||
        (cfg->next && (!id_ok(cfg->next->worker_id) || !cfg->next->data_addr)))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tcp comm: a pipeline peer is incomplete");
    int need = (cfg->tp_size > 1 ? cfg->tp_rank : 0) + (cfg->prev ? 1 : 0);
    if (need && !cfg->listener)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tcp comm: a listener is required to accept %d link(s)", need);
    if (auth_on(cfg) && sodium_init() < 0)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "tcp comm: libsodium failed to start");
    if (cfg->encrypt && !auth_on(cfg))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "tcp comm: encrypted frames need the epoch's data-plane secret");
    if (cfg->max_bytes > TCP_MAX_BYTES)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "tcp comm: max_bytes %zu is too large",
                            cfg->max_bytes);

    loom_comm_tcp_t *c = loom_xcalloc(1, sizeof *c);
    loom_comm_base_init(&c->base, &tcp_ops, cfg);
    atomic_init(&c->aborted, 0);
    c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 0;
    c->spin_ns = loom_comm_spin_ns(2000);
    c->tp = loom_xcalloc((size_t)cfg->tp_size, sizeof *c->tp);
    for (int r = 0; r < cfg->tp_size; r++) {
        c->tp[r].fd = -1;
        snprintf(c->tp[r].peer, sizeof c->tp[r].peer, "link to tp rank %d", r);
    }
    c->next.fd = c->prev.fd = -1;
    snprintf(c->next.peer, sizeof c->next.peer, "link to the next stage");
    snprintf(c->prev.peer, sizeof c->prev.peer, "link from the previous stage");
    c->srcs = loom_xcalloc((size_t)cfg->tp_size, sizeof *c->srcs);
    c->xf = loom_xcalloc((size_t)cfg->tp_size, sizeof *c->xf);
    c->pfd = loom_xcalloc((size_t)cfg->tp_size + 1, sizeof *c->pfd);
    c->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    loom_status_t st = LOOM_OK;
    if (c->wake_fd < 0) {
        st = loom_err_set(err, LOOM_ERR_IO, "tcp comm: eventfd: %s", strerror(errno));
        goto fail;
    }
    if (cfg->tp_size > 1 && cfg->max_bytes) {
        c->scratch = malloc((size_t)cfg->tp_size * cfg->max_bytes);
        if (!c->scratch) {
            st = loom_err_set(err, LOOM_ERR_NOMEM, "tcp comm: %zu bytes of receive buffers",
                              (size_t)cfg->tp_size * cfg->max_bytes);
            goto fail;
        }
    }
    uint64_t deadline =
        loom_comm_deadline(cfg->timeout_ms > 0 ? cfg->timeout_ms : TCP_CREATE_DEFAULT_MS);

    /* 1. Dial: higher tp ranks and the next stage. */
    if (cfg->tp_size > 1) {
        for (int r = cfg->tp_rank + 1; r < cfg->tp_size; r++) {
            st = dial_link(&c->tp[r], cfg, LINK_TP, cfg->tp_group[r].data_addr, deadline, err);
            if (st < 0) goto fail;
        }
    }
    if (cfg->next) {
        st = dial_link(&c->next, cfg, LINK_PIPE, cfg->next->data_addr, deadline, err);
        if (st < 0) goto fail;
    }
    /* 2. Accept: lower tp ranks and the previous stage. */
    if (need) {
        st = accept_links(c, cfg, need, deadline, err);
        if (st < 0) goto fail;
    }
    /* 3. The acks of the links dialled in step 1. */
    if (cfg->tp_size > 1) {
        for (int r = cfg->tp_rank + 1; r < cfg->tp_size; r++) {
            st = read_ack(&c->tp[r], cfg, cfg->tp_group[r].worker_id, deadline, err);
            if (st < 0) goto fail;
        }
    }
    if (cfg->next) {
        st = read_ack(&c->next, cfg, cfg->next->worker_id, deadline, err);
        if (st < 0) goto fail;
    }
    LOOM_DEBUG("tcp comm '%s': tp rank %d of %d up (%s%s)", cfg->name, cfg->tp_rank, cfg->tp_size,
               cfg->prev ? "prev " : "", cfg->next ? "next" : "");
    *out = &c->base;
    return LOOM_OK;

fail:
    tcp_destroy(&c->base);
    return st;
}
