/* The ZAP handler (common/zap.h): one thread answering ZeroMQ's
 * authentication requests from its allow-lists, and watching the keyed
 * sockets' monitors for handshakes that fail before ZAP is asked (a peer
 * with no key, or one that expects another server key).
 *
 * Threads: loom_zap_create/secure/start/stop run on the owner's thread; the
 * handler thread owns the ZAP socket and the monitor sockets once started.
 * The domains are fixed before start; their allow-lists are swapped by the
 * handler thread only. The counters are atomics. */
#include "common/zap.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "common/log.h"
#include "common/util.h"

#define ZAP_ENDPOINT   "inproc://zeromq.zap.01"
#define ZAP_DOMAINS    4
#define ZAP_FDS        256  /* accepted connections remembered for log lines */
#define ZAP_QUIET_NS   (10ull * 1000000000ull) /* one log line per peer and reason per 10 s */
#define ZAP_RELOAD_NS  (1000000000ull)

/* Log lines said lately, by peer and reason (rate limits). */
typedef struct quiet {
    char what[160];
    uint64_t last_ns;
} quiet_t;

typedef struct zap_domain {
    char name[32];
    char what[32];
    char path[1024];
    loom_allow_t allow;
    struct timespec mtime;
    uint64_t checked_ns;
    void *monitor; /* PAIR end of the socket's monitor */
    int fail_pending; /* a handshake failed: the next disconnect names the peer */
    struct {
        int fd;
        char addr[64];
    } fds[ZAP_FDS];
} zap_domain_t;

struct loom_zap {
    void *zctx;
    void *rep;
    pthread_t thread;
    int started;
    atomic_int stop;
    atomic_ulong admitted, refused;
    int n;
    zap_domain_t d[ZAP_DOMAINS];
    quiet_t quiet[32]; /* the ZAP thread's refusals */
    int quiet_next;
    quiet_t id_quiet[32]; /* the owner thread's: refusals of loom_zap_identity_ok */
    int id_quiet_next;
};

/* Whether to log now about `what` (rate limit per peer and reason). */
static int loud_in(quiet_t *q, size_t n, int *next, const char *what) {
    uint64_t now = loom_now_ns();
    for (size_t i = 0; i < n; i++)
        if (!strcmp(q[i].what, what)) {
            if (now - q[i].last_ns < ZAP_QUIET_NS) return 0;
            q[i].last_ns = now;
            return 1;
        }
    int i = (*next)++ % (int)n;
    snprintf(q[i].what, sizeof q[i].what, "%.159s", what);
    q[i].last_ns = now;
    return 1;
}

static int loud(loom_zap_t *z, const char *what) {
    return loud_in(z->quiet, LOOM_ARRAY_LEN(z->quiet), &z->quiet_next, what);
}

loom_status_t loom_zap_create(void *zctx, loom_zap_t **out, loom_err_t *err) {
    *out = NULL;
    if (!zmq_has("curve"))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "this libzmq was built without CURVE security");
    loom_zap_t *z = loom_xcalloc(1, sizeof *z);
    z->zctx = zctx;
    atomic_init(&z->stop, 0);
    atomic_init(&z->admitted, 0);
    atomic_init(&z->refused, 0);
    *out = z;
    return LOOM_OK;
}

static loom_status_t load_domain(zap_domain_t *d, loom_err_t *err) {
    struct stat st;
    if (stat(d->path, &st) != 0)
        return loom_err_set(err, LOOM_ERR_IO, "the %s allow-list %s: %s", d->what, d->path, strerror(errno));
    loom_allow_t a;
    LOOM_CHECK(loom_allow_load(d->path, &a, err));
    loom_allow_free(&d->allow);
    d->allow = a;
    d->mtime = st.st_mtim;
    return LOOM_OK;
}

loom_status_t loom_zap_secure(loom_zap_t *z, void *sock, const char *domain, const char *what,
                              const loom_keypair_t *kp, const char *allow_path, loom_err_t *err) {
    LOOM_ASSERT(!z->started && z->n < ZAP_DOMAINS);
    zap_domain_t *d = &z->d[z->n];
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", domain);
    snprintf(d->what, sizeof d->what, "%s", what);
    snprintf(d->path, sizeof d->path, "%s", allow_path);
    for (int i = 0; i < ZAP_FDS; i++) d->fds[i].fd = -1;
    LOOM_CHECK(load_domain(d, err));
    if (d->allow.n == 0) LOOM_WARN("the %s allow-list %s lists no key: no %s can connect", what, allow_path, what);
    int one = 1;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->secret_z85, LOOM_KEY_Z85) != 0 ||
        zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, domain, strlen(domain)) != 0) {
        loom_allow_free(&d->allow);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot make the %s socket a CURVE server: %s", what,
                            zmq_strerror(errno));
    }
    char ep[96];
    snprintf(ep, sizeof ep, "inproc://loom-zap-monitor-%p-%d", (void *)z, z->n);
    if (zmq_socket_monitor(sock, ep,
                           ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) == 0) {
        d->monitor = zmq_socket(z->zctx, ZMQ_PAIR);
        int zero = 0;
        zmq_setsockopt(d->monitor, ZMQ_LINGER, &zero, sizeof zero);
        if (zmq_connect(d->monitor, ep) != 0) {
            zmq_close(d->monitor);
            d->monitor = NULL;
        }
    }
    z->n++;
    return LOOM_OK;
}

/* Re-reads an allow-list whose file changed; a broken new file keeps the
 * old list (and says so). */
static void maybe_reload(loom_zap_t *z, zap_domain_t *d) {
    uint64_t now = loom_now_ns();
    if (now - d->checked_ns < ZAP_RELOAD_NS) return;
    d->checked_ns = now;
    struct stat st;
    if (stat(d->path, &st) != 0) return;
    if (st.st_mtim.tv_sec == d->mtime.tv_sec && st.st_mtim.tv_nsec == d->mtime.tv_nsec) return;
    loom_err_t err = {0};
    if (load_domain(d, &err) < 0) {
        if (loud(z, d->path)) LOOM_ERROR("%s; keeping the previous %s allow-list", err.msg, d->what);
        d->mtime = st.st_mtim;
        return;
    }
    LOOM_INFO("reloaded the %s allow-list %s: %d key(s)", d->what, d->path, d->allow.n);
}

static zap_domain_t *find_domain(loom_zap_t *z, const char *name, size_t len) {
    for (int i = 0; i < z->n; i++)
        if (strlen(z->d[i].name) == len && !memcmp(z->d[i].name, name, len)) return &z->d[i];
    return NULL;
}

/* One ZAP request: version, request id, domain, address, identity,
 * mechanism, credentials. */
static void on_request(loom_zap_t *z) {
    zmq_msg_t f[8];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t extra, *m = n < 8 ? &f[n] : &extra;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, z->rep, 0) < 0) {
            zmq_msg_close(m);
            break;
        }
        more = zmq_msg_more(m);
        if (n < 8) n++;
        else zmq_msg_close(m);
    }
    if (n < 6) { /* not a ZAP request: answer nothing sensible, but answer (REP) */
        for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
        zmq_send(z->rep, "", 0, 0);
        return;
    }
    const char *status = "400", *text = "refused", *user = "";
    char addr[64] = "?", why[1300] = "";
    size_t al = zmq_msg_size(&f[3]) < sizeof addr - 1 ? zmq_msg_size(&f[3]) : sizeof addr - 1;
    memcpy(addr, zmq_msg_data(&f[3]), al);
    addr[al] = 0;
    zap_domain_t *d = find_domain(z, zmq_msg_data(&f[2]), zmq_msg_size(&f[2]));
    int is_curve = zmq_msg_size(&f[5]) == 5 && !memcmp(zmq_msg_data(&f[5]), "CURVE", 5);
    if (!d) {
        snprintf(why, sizeof why, "an unknown ZAP domain");
    } else if (!is_curve || n < 7 || zmq_msg_size(&f[6]) != 32) {
        snprintf(why, sizeof why, "no CURVE key");
    } else {
        maybe_reload(z, d);
        const char *name = loom_allow_find(&d->allow, zmq_msg_data(&f[6]));
        if (name) {
            status = "200";
            text = "OK";
            user = name;
        } else {
            char k[41] = "";
            zmq_z85_encode(k, zmq_msg_data(&f[6]), 32);
            snprintf(why, sizeof why, "its key %.8s... is not in the %s allow-list %s", k, d->what, d->path);
        }
    }
    if (status[0] == '2') {
        atomic_fetch_add(&z->admitted, 1);
    } else {
        atomic_fetch_add(&z->refused, 1);
        char tag[160];
        snprintf(tag, sizeof tag, "%.60s %.90s", addr, why);
        if (loud(z, tag))
            LOOM_WARN("refused a %s connection from %s: %s", d ? d->what : "peer", addr, why);
    }
    zmq_send(z->rep, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), ZMQ_SNDMORE);
    zmq_send(z->rep, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
    zmq_send(z->rep, status, 3, ZMQ_SNDMORE);
    zmq_send(z->rep, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(z->rep, user, strlen(user), ZMQ_SNDMORE);
    zmq_send(z->rep, "", 0, 0);
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

/* One monitor event: accepted connections are remembered by fd with their
 * peer address, so a handshake that fails can be logged with it. */
static void on_monitor(loom_zap_t *z, zap_domain_t *d) {
    zmq_msg_t ev, ep;
    zmq_msg_init(&ev);
    zmq_msg_init(&ep);
    if (zmq_msg_recv(&ev, d->monitor, 0) < 0) goto done;
    if (zmq_msg_more(&ev)) zmq_msg_recv(&ep, d->monitor, 0);
    if (zmq_msg_size(&ev) < 6) goto done;
    uint16_t event;
    uint32_t value;
    memcpy(&event, zmq_msg_data(&ev), 2);
    memcpy(&value, (uint8_t *)zmq_msg_data(&ev) + 2, 4);
    int fd = (int)value;
    if (event == ZMQ_EVENT_ACCEPTED) {
        struct sockaddr_storage sa;
        socklen_t len = sizeof sa;
        char host[64] = "?";
        if (getpeername(fd, (struct sockaddr *)&sa, &len) == 0) {
            if (sa.ss_family == AF_INET)
                inet_ntop(AF_INET, &((struct sockaddr_in *)&sa)->sin_addr, host, sizeof host);
            else if (sa.ss_family == AF_INET6)
                inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&sa)->sin6_addr, host, sizeof host);
            int port = sa.ss_family == AF_INET ? ntohs(((struct sockaddr_in *)&sa)->sin_port)
                                               : ntohs(((struct sockaddr_in6 *)&sa)->sin6_port);
            size_t hl = strlen(host);
            snprintf(host + hl, sizeof host - hl, ":%d", port);
        }
        int slot = fd >= 0 ? fd % ZAP_FDS : 0;
        d->fds[slot].fd = fd;
        snprintf(d->fds[slot].addr, sizeof d->fds[slot].addr, "%s", host);
    } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL || event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
        d->fail_pending = 1;
    } else if (event == ZMQ_EVENT_DISCONNECTED) {
        int slot = fd >= 0 ? fd % ZAP_FDS : 0;
        const char *who = d->fds[slot].fd == fd ? d->fds[slot].addr : "an unknown address";
        if (d->fail_pending) {
            atomic_fetch_add(&z->refused, 1);
            char tag[160];
            snprintf(tag, sizeof tag, "handshake %.40s", who);
            char *colon = strrchr(tag, ':'); /* one line per host, whatever its port */
            if (colon) *colon = 0;
            if (loud(z, tag))
                LOOM_WARN("refused a %s connection from %s: the CURVE handshake failed (the peer has no key, "
                          "or expects another server key)",
                          d->what, who);
        }
        d->fail_pending = 0;
        d->fds[slot].fd = -1;
    }
done:
    zmq_msg_close(&ev);
    zmq_msg_close(&ep);
}

static void *zap_main(void *arg) {
    loom_zap_t *z = arg;
    while (!atomic_load(&z->stop)) {
        zmq_pollitem_t items[1 + ZAP_DOMAINS];
        int n = 0;
        items[n++] = (zmq_pollitem_t){z->rep, 0, ZMQ_POLLIN, 0};
        for (int i = 0; i < z->n; i++)
            if (z->d[i].monitor) items[n++] = (zmq_pollitem_t){z->d[i].monitor, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(items, n, 100) < 0) {
            if (errno == ETERM) break;
            continue;
        }
        if (items[0].revents & ZMQ_POLLIN) on_request(z);
        for (int i = 0, k = 1; i < z->n; i++)
            if (z->d[i].monitor) {
                if (items[k].revents & ZMQ_POLLIN) on_monitor(z, &z->d[i]);
                k++;
            }
    }
    return NULL;
}

loom_status_t loom_zap_start(loom_zap_t *z, loom_err_t *err) {
    z->rep = zmq_socket(z->zctx, ZMQ_REP);
    int zero = 0;
    zmq_setsockopt(z->rep, ZMQ_LINGER, &zero, sizeof zero);
    if (!z->rep || zmq_bind(z->rep, ZAP_ENDPOINT) != 0)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot bind the ZAP handler at %s: %s", ZAP_ENDPOINT,
                            zmq_strerror(errno));
    if (pthread_create(&z->thread, NULL, zap_main, z) != 0)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot start the ZAP handler thread");
    z->started = 1;
    return LOOM_OK;
}

void loom_zap_stop(loom_zap_t **z_p) {
    if (!z_p || !*z_p) return;
    loom_zap_t *z = *z_p;
    *z_p = NULL;
    atomic_store(&z->stop, 1);
    if (z->started) pthread_join(z->thread, NULL);
    if (z->rep) zmq_close(z->rep);
    for (int i = 0; i < z->n; i++) {
        if (z->d[i].monitor) zmq_close(z->d[i].monitor);
        loom_allow_free(&z->d[i].allow);
    }
    free(z);
}

void loom_zap_counts(loom_zap_t *z, unsigned long *admitted, unsigned long *refused) {
    *admitted = z ? atomic_load(&z->admitted) : 0;
    *refused = z ? atomic_load(&z->refused) : 0;
}

int loom_zap_identity_ok(loom_zap_t *z, zmq_msg_t *msg, const void *rid, size_t rid_len) {
    if (!z) return 1;
    const char *user = zmq_msg_gets(msg, "User-Id");
    if (user && strlen(user) == rid_len && !memcmp(user, rid, rid_len)) return 1;
    atomic_fetch_add(&z->refused, 1);
    const char *addr = zmq_msg_gets(msg, "Peer-Address");
    char what[160];
    snprintf(what, sizeof what, "identity %s %.*s %s", addr ? addr : "?", (int)(rid_len < 64 ? rid_len : 64),
             (const char *)rid, user ? user : "");
    if (loud_in(z->id_quiet, LOOM_ARRAY_LEN(z->id_quiet), &z->id_quiet_next, what)) { /* as docs say: 10 s */
        LOOM_WARN("refused a control message from %s: it speaks as '%.*s' but its key is '%s' in the allow-list",
                  addr ? addr : "?", (int)(rid_len < 64 ? rid_len : 64), (const char *)rid, user ? user : "(none)");
    }
    return 0;
}

loom_status_t loom_zap_api_rule(const char *listen, int keyed, int insecure, const char *who, loom_err_t *err) {
    if (keyed || loom_endpoint_is_local(listen)) return LOOM_OK;
    if (!insecure)
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                            "%s binds %s, which other hosts can reach: give the client keys "
                            "(--curve-secret FILE --client-keys FILE), or --insecure-api to serve it without "
                            "authentication",
                            who, listen);
    LOOM_WARN("*** SECURITY: --insecure-api: %s binds %s without client keys; anyone who reaches "
              "it can send requests and read their output in clear text. ***",
              who, listen);
    return LOOM_OK;
}
