/* The host cache of prepared LoRA adapters and its preparation thread
 * (lora_cache.h). One mutex guards the entry list; the thread drops it while
 * it reads and prepares, so request, poll and get never wait on a file. */
#include "worker/lora_cache.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "common/util.h"

typedef enum { E_QUEUED = 0, E_PREPARING, E_READY, E_FAILED } entry_state_t;

typedef struct entry {
    struct entry *next;
    entry_state_t state;
    int reported; /* poll returned its outcome */
    uint8_t digest[32];
    char path[1024];
    char msg[512];
    uint64_t last_used;
    loom_lora_prepared_t *prep; /* READY */
} entry_t;

struct loom_lora_cache {
    const loom_model_t *m;
    const loom_model_config_t *cfg;
    int layer_begin, layer_end, max_rank, capacity;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int stop;
    uint64_t tick;
    entry_t *head;
    long delay_ms; /* test hook LOOM_TEST_LORA_PREPARE_DELAY_MS: each preparation sleeps first */
};

static entry_t *find(loom_lora_cache_t *c, const uint8_t digest[32]) {
    for (entry_t *e = c->head; e; e = e->next)
        if (!memcmp(e->digest, digest, 32)) return e;
    return NULL;
}

static void unlink_entry(loom_lora_cache_t *c, entry_t *x) {
    for (entry_t **p = &c->head; *p; p = &(*p)->next)
        if (*p == x) {
            *p = x->next;
            return;
        }
}

static void free_entry(entry_t *e) {
    loom_lora_prepared_destroy(&e->prep);
    free(e);
}

/* Reads and prepares one adapter (no lock held). */
static loom_status_t prepare(loom_lora_cache_t *c, const char *path, const uint8_t digest[32],
                             loom_lora_prepared_t **out, loom_err_t *err) {
    loom_lora_adapter_t *a = NULL;
    loom_status_t st =
        loom_lora_load(path, c->cfg, c->max_rank, c->layer_begin, c->layer_end, &a, err);
    if (st != LOOM_OK) return st;
    if (memcmp(a->digest, digest, 32))
        st =
            loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                         "the adapter in %s is not the one registered (its content changed)", path);
    else
        st = loom_model_lora_prepare(c->m, a, out, err);
    loom_lora_destroy(&a);
    return st;
}

static void *run(void *arg) {
    loom_lora_cache_t *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        entry_t *e = NULL;
        while (!c->stop) {
            for (entry_t *x = c->head; x; x = x->next)
                if (x->state == E_QUEUED)
                    e = x; /* the list is newest first: the oldest order wins */
            if (e) break;
            pthread_cond_wait(&c->cv, &c->mu);
        }
        if (c->stop) break;
        e->state = E_PREPARING;
        char path[1024];
        uint8_t digest[32];
        memcpy(path, e->path, sizeof path);
        memcpy(digest, e->digest, 32);
        pthread_mutex_unlock(&c->mu);
        for (long left = c->delay_ms; left > 0; left -= 10) { /* the test hook: a slow disk or a busy machine */
            struct timespec ts = {0, 10 * 1000000L};
            nanosleep(&ts, NULL);
        }
        loom_err_t err = {0};
        loom_lora_prepared_t *prep = NULL;
        loom_status_t st = prepare(c, path, digest, &prep, &err);
        pthread_mutex_lock(&c->mu);
        /* E stays in the list: only the owner removes entries, and never a PREPARING one */
        if (st == LOOM_OK) {
            e->prep = prep;
            e->state = E_READY;
        } else {
            snprintf(e->msg, sizeof e->msg, "%s", err.msg);
            e->state = E_FAILED;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

loom_status_t loom_lora_cache_create(const loom_model_t *m, const loom_model_config_t *cfg,
                                     int layer_begin, int layer_end, int max_rank, int capacity,
                                     loom_lora_cache_t **out, loom_err_t *err) {
    if (capacity < 1)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "LoRA host cache: capacity %d (at least 1)", capacity);
    loom_lora_cache_t *c = loom_xcalloc(1, sizeof *c);
    c->m = m, c->cfg = cfg, c->layer_begin = layer_begin, c->layer_end = layer_end;
    c->max_rank = max_rank, c->capacity = capacity;
    const char *delay = getenv("LOOM_TEST_LORA_PREPARE_DELAY_MS");
    c->delay_ms = delay ? strtol(delay, NULL, 10) : 0;
    if (c->delay_ms > 0) LOOM_WARN("test hook: each LoRA adapter preparation sleeps %ld ms first", c->delay_ms);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    if (pthread_create(&c->thread, NULL, run, c)) {
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "LoRA host cache: cannot start its thread");
    }
    *out = c;
    return LOOM_OK;
}

void loom_lora_cache_destroy(loom_lora_cache_t **c_p) {
    if (!c_p || !*c_p) return;
    loom_lora_cache_t *c = *c_p;
    *c_p = NULL;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->thread, NULL);
    while (c->head) {
        entry_t *e = c->head;
        c->head = e->next;
        free_entry(e);
    }
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* Drops the least recently used READY entries beyond the capacity (lock held). */
static void evict(loom_lora_cache_t *c) {
    for (;;) {
        int n = 0;
        entry_t *lru = NULL;
        for (entry_t *e = c->head; e; e = e->next)
            if (e->state == E_READY && e->reported) {
                n++;
                if (!lru || e->last_used < lru->last_used) lru = e;
            }
        if (n <= c->capacity || !lru) return;
        unlink_entry(c, lru);
        free_entry(lru);
    }
}

void loom_lora_cache_request(loom_lora_cache_t *c, const char *path, const uint8_t digest[32]) {
    pthread_mutex_lock(&c->mu);
    entry_t *e = find(c, digest);
    if (e && e->state == E_FAILED && e->reported) { /* tried before and failed: try again */
        unlink_entry(c, e);
        free_entry(e);
        e = NULL;
    }
    if (!e) {
        e = loom_xcalloc(1, sizeof *e);
        memcpy(e->digest, digest, 32);
        snprintf(e->path, sizeof e->path, "%s", path);
        e->next = c->head;
        c->head = e;
        pthread_cond_signal(&c->cv);
    }
    e->last_used = ++c->tick;
    evict(c);
    pthread_mutex_unlock(&c->mu);
}

int loom_lora_cache_poll(loom_lora_cache_t *c, loom_lora_cache_done_t *out, int cap) {
    int n = 0;
    pthread_mutex_lock(&c->mu);
    for (entry_t **p = &c->head; *p && n < cap;) {
        entry_t *e = *p;
        if ((e->state == E_READY || e->state == E_FAILED) && !e->reported) {
            loom_lora_cache_done_t *d = &out[n++];
            memcpy(d->digest, e->digest, 32);
            d->status = e->state == E_READY ? LOOM_OK : LOOM_ERR_INVALID_ARGUMENT;
            snprintf(d->msg, sizeof d->msg, "%s", e->state == E_READY ? "" : e->msg);
            e->reported = 1;
            /* its install follows this poll (lora_orders.c): the most recently
             * used, so the eviction below keeps it even when the others were
             * used while it was prepared */
            e->last_used = ++c->tick;
            if (e->state == E_FAILED) { /* forgotten: a later request tries again */
                *p = e->next;
                free_entry(e);
                continue;
            }
        }
        p = &e->next;
    }
    evict(c);
    pthread_mutex_unlock(&c->mu);
    return n;
}

const loom_lora_prepared_t *loom_lora_cache_get(loom_lora_cache_t *c, const uint8_t digest[32]) {
    pthread_mutex_lock(&c->mu);
    entry_t *e = find(c, digest);
    const loom_lora_prepared_t *p = NULL;
    if (e && e->state == E_READY) {
        e->last_used = ++c->tick;
        p = e->prep;
    }
    pthread_mutex_unlock(&c->mu);
    return p;
}

int loom_lora_cache_count(loom_lora_cache_t *c) {
    int n = 0;
    pthread_mutex_lock(&c->mu);
    for (entry_t *e = c->head; e; e = e->next)
        n += e->state == E_READY;
    pthread_mutex_unlock(&c->mu);
    return n;
}
