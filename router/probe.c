/* The router's probe listener (router/probe.h): one thread, one poll loop
 * over the listening socket, a wake-up pipe and the connections being read.
 * A connection is a request line and headers (at most 2 KB, within 2 s),
 * one answer, then close: nothing a client sends can hold it longer. */
#include "router/probe.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

#define PROBE_CONNS   32
#define PROBE_REQ_MAX 2048
#define PROBE_READ_MS 2000

typedef struct conn {
    int fd;
    uint64_t since;
    size_t have;
    char buf[PROBE_REQ_MAX + 1];
} conn_t;

struct loom_probe {
    int lfd, wake[2], port;
    pthread_t th;
    loom_probe_state_fn state;
    void *ctx;
    conn_t conns[PROBE_CONNS];
    int n;
};

static void conn_drop(loom_probe_t *p, int i) {
    close(p->conns[i].fd);
    p->conns[i] = p->conns[p->n - 1];
    p->n--;
}

static void answer(loom_probe_t *p, int i) {
    conn_t *c = &p->conns[i];
    int live = 0, ready = 0;
    char msg[256] = "";
    int code = 404;
    const char *what = "not found";
    int health = !strncmp(c->buf, "GET /health ", 12) || !strncmp(c->buf, "GET /health?", 12);
    int rdy = !strncmp(c->buf, "GET /ready ", 11) || !strncmp(c->buf, "GET /ready?", 11);
    if (health || rdy) {
        p->state(p->ctx, &live, &ready, msg, sizeof msg);
        int ok = health ? live : live && ready;
        code = ok ? 200 : 503;
        what = ok ? "OK" : "Service Unavailable";
    }
    char body[320], out[640];
    int bl = snprintf(body, sizeof body, "%s\n", code == 404 ? "GET /health or /ready" : msg);
    int ol = snprintf(
        out, sizeof out,
        "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n"
        "\r\n%s",
        code, what, bl, body);
    if (send(c->fd, out, (size_t)ol, MSG_DONTWAIT | MSG_NOSIGNAL) < 0)
        LOOM_DEBUG("probe listener: could not answer: %s", strerror(errno));
    conn_drop(p, i);
}

static void *probe_main(void *arg) {
    loom_probe_t *p = arg;
    struct pollfd pf[PROBE_CONNS + 2];
    for (;;) {
        uint64_t now = loom_now_ns();
        for (int i = p->n - 1; i >= 0; i--)
            if (now - p->conns[i].since > (uint64_t)PROBE_READ_MS * 1000000ull) conn_drop(p, i);
        pf[0] = (struct pollfd){p->wake[0], POLLIN, 0};
        pf[1] = (struct pollfd){p->lfd, POLLIN, 0};
        for (int i = 0; i < p->n; i++)
            pf[i + 2] = (struct pollfd){p->conns[i].fd, POLLIN, 0};
        int n = p->n;
        if (poll(pf, (nfds_t)n + 2, 200) < 0 && errno != EINTR) break;
        if (pf[0].revents) break;
        for (int i = n - 1; i >= 0; i--) {
            if (!pf[i + 2].revents) continue;
            conn_t *c = &p->conns[i];
            ssize_t r = recv(c->fd, c->buf + c->have, PROBE_REQ_MAX - c->have, MSG_DONTWAIT);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                conn_drop(p, i);
                continue;
            }
            if (r < 0) continue;
            c->have += (size_t)r;
            c->buf[c->have] = '\0';
            if (strstr(c->buf, "\r\n\r\n") || strstr(c->buf, "\n\n"))
                answer(p, i);
            else if (c->have == PROBE_REQ_MAX)
                conn_drop(p, i);
        }
        if (pf[1].revents) {
            for (;;) {
                int fd = accept4(p->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0) break;
                if (p->n == PROBE_CONNS) { /* the oldest gives way: a new probe always gets in */
                    int old = 0;
                    for (int i = 1; i < p->n; i++)
                        if (p->conns[i].since < p->conns[old].since) old = i;
                    conn_drop(p, old);
                }
                p->conns[p->n++] = (conn_t){.fd = fd, .since = loom_now_ns()};
            }
        }
    }
    return NULL;
}

loom_status_t loom_probe_start(const char *bind_addr, loom_probe_state_fn state, void *ctx,
                               loom_probe_t **out, loom_err_t *err) {
    *out = NULL;
    char host[256];
    const char *colon = strrchr(bind_addr, ':');
    if (!colon || colon == bind_addr || (size_t)(colon - bind_addr) >= sizeof host || !colon[1])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--probe-listen expects HOST:PORT, got '%s'", bind_addr);
    memcpy(host, bind_addr, (size_t)(colon - bind_addr));
    host[colon - bind_addr] = '\0';
    if (host[0] == '[' && host[strlen(host) - 1] == ']') {
        memmove(host, host + 1, strlen(host));
        host[strlen(host) - 1] = '\0';
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE},
                    *res = NULL;
    int gai = getaddrinfo(host, colon + 1, &hints, &res);
    if (gai != 0 || !res)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--probe-listen %s: %s", bind_addr,
                            gai_strerror(gai));
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        freeaddrinfo(res);
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "--probe-listen %s: %s", bind_addr,
                            strerror(e));
    }
    freeaddrinfo(res);
    loom_probe_t *p = loom_xcalloc(1, sizeof *p);
    p->lfd = fd;
    p->state = state;
    p->ctx = ctx;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char serv[16] = "0";
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
        getnameinfo((struct sockaddr *)&ss, sl, NULL, 0, serv, sizeof serv, NI_NUMERICSERV);
    p->port = atoi(serv);
    if (pipe(p->wake) != 0) {
        close(fd);
        free(p);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "probe listener: pipe: %s", strerror(errno));
    }
    if (pthread_create(&p->th, NULL, probe_main, p) != 0) {
        close(fd);
        close(p->wake[0]);
        close(p->wake[1]);
        free(p);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "probe listener: cannot start its thread");
    }
    LOOM_INFO("probes: GET /health and /ready on %s", bind_addr);
    *out = p;
    return LOOM_OK;
}

int loom_probe_port(const loom_probe_t *p) {
    return p ? p->port : 0;
}

void loom_probe_stop(loom_probe_t **p_p) {
    loom_probe_t *p = *p_p;
    if (!p) return;
    *p_p = NULL;
    if (write(p->wake[1], "x", 1) < 0) LOOM_WARN("probe listener: cannot wake its thread");
    pthread_join(p->th, NULL);
    for (int i = 0; i < p->n; i++)
        close(p->conns[i].fd);
    close(p->lfd);
    close(p->wake[0]);
    close(p->wake[1]);
    free(p);
}
