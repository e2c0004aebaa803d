/* Request read deadlines for the HTTP gateway (http_guard.h). */
#include "gateway/http_guard.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

#define GUARD_TICK_MS 100

typedef enum { SLOT_HEADERS, SLOT_BODY, SLOT_SERVING, SLOT_CUT } slot_state_t;

struct loom_http_slot {
    int fd; /* our duplicate of the connection's socket */
    slot_state_t state;
    uint64_t since_ns; /* when the current state began */
    loom_http_slot_t *prev, *next;
};

struct loom_http_guard {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int stop;
    uint64_t header_ns, body_ns; /* 0: no deadline */
    loom_http_slot_t *head;
    uint64_t n_closed;
};

static void *watchdog(void *arg) {
    loom_http_guard_t *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += GUARD_TICK_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        if (g->stop) break;
        uint64_t now = loom_now_ns();
        for (loom_http_slot_t *s = g->head; s; s = s->next) {
            uint64_t limit = s->state == SLOT_HEADERS ? g->header_ns
                             : s->state == SLOT_BODY  ? g->body_ns
                                                      : 0;
            if (!limit || now - s->since_ns < limit) continue;
            LOOM_DEBUG("http: closing a connection that sent no complete request %s within %.1f s",
                       s->state == SLOT_HEADERS ? "header" : "body", (double)limit / 1e9);
            shutdown(s->fd, SHUT_RDWR);
            s->state = SLOT_CUT;
            g->n_closed++;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

loom_http_guard_t *loom_http_guard_create(int header_timeout_ms, int body_timeout_ms) {
    loom_http_guard_t *g = loom_xcalloc(1, sizeof *g);
    g->header_ns = header_timeout_ms > 0 ? (uint64_t)header_timeout_ms * 1000000u : 0;
    g->body_ns = body_timeout_ms > 0 ? (uint64_t)body_timeout_ms * 1000000u : 0;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    if (pthread_create(&g->thread, NULL, watchdog, g) != 0) {
        pthread_cond_destroy(&g->cv);
        pthread_mutex_destroy(&g->mu);
        free(g);
        return NULL;
    }
    return g;
}

void loom_http_guard_destroy(loom_http_guard_t **g_p) {
    if (!g_p || !*g_p) return;
    loom_http_guard_t *g = *g_p;
    *g_p = NULL;
    pthread_mutex_lock(&g->mu);
    g->stop = 1;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
    pthread_join(g->thread, NULL);
    while (g->head) {
        loom_http_slot_t *s = g->head;
        g->head = s->next;
        close(s->fd);
        free(s);
    }
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

loom_http_slot_t *loom_http_guard_add(loom_http_guard_t *g, int fd) {
    if (!g || fd < 0) return NULL;
    int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup_fd < 0) {
        LOOM_WARN("http: cannot watch a connection's deadlines: %s", strerror(errno));
        return NULL;
    }
    loom_http_slot_t *s = loom_xcalloc(1, sizeof *s);
    s->fd = dup_fd;
    s->state = SLOT_HEADERS;
    s->since_ns = loom_now_ns();
    pthread_mutex_lock(&g->mu);
    s->next = g->head;
    if (g->head) g->head->prev = s;
    g->head = s;
    pthread_mutex_unlock(&g->mu);
    return s;
}

static void set_state(loom_http_guard_t *g, loom_http_slot_t *s, slot_state_t st) {
    if (!g || !s) return;
    pthread_mutex_lock(&g->mu);
    if (s->state != SLOT_CUT) {
        s->state = st;
        s->since_ns = loom_now_ns();
    }
    pthread_mutex_unlock(&g->mu);
}

void loom_http_guard_headers_done(loom_http_guard_t *g, loom_http_slot_t *s) {
    set_state(g, s, SLOT_BODY);
}
void loom_http_guard_serving(loom_http_guard_t *g, loom_http_slot_t *s) {
    set_state(g, s, SLOT_SERVING);
}
void loom_http_guard_next(loom_http_guard_t *g, loom_http_slot_t *s) {
    set_state(g, s, SLOT_HEADERS);
}

void loom_http_guard_remove(loom_http_guard_t *g, loom_http_slot_t **s_p) {
    if (!g || !s_p || !*s_p) return;
    loom_http_slot_t *s = *s_p;
    *s_p = NULL;
    pthread_mutex_lock(&g->mu);
    if (s->prev)
        s->prev->next = s->next;
    else
        g->head = s->next;
    if (s->next) s->next->prev = s->prev;
    pthread_mutex_unlock(&g->mu);
    close(s->fd);
    free(s);
}

uint64_t loom_http_guard_n_closed(loom_http_guard_t *g) {
    if (!g) return 0;
    pthread_mutex_lock(&g->mu);
    uint64_t n = g->n_closed;
    pthread_mutex_unlock(&g->mu);
    return n;
}
