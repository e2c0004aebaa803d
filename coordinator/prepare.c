/* The preparation pool (see prepare.h): a mutex-guarded job queue, n
 * threads, a done queue and a pipe that wakes the reactor. */
#include "coordinator/prepare.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "coordinator/lora_serve.h"

struct loom_prep {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    loom_prep_job_t *queue, *queue_tail; /* QUEUED, FIFO */
    loom_prep_job_t *done, *done_tail;   /* DONE, FIFO */
    loom_prep_job_t **running;           /* per thread: its RUNNING job (NULL: idle) */
    int n_queued, n_running;
    int stop;
    pthread_t *threads;
    int n_threads;
    int pipe_r, pipe_w;
};

/* An adapter load: the test hook's sleep (cut short when cancelled), then
 * the read, the checks and the digest. */
static void run_lora(loom_prep_job_t *j) {
    for (long left = j->lora.delay_ms; left > 0 && !atomic_load(&j->cancelled); left -= 10) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    uint64_t t0 = loom_now_ns();
    j->status = loom_lora_serve_validate(j->lora.name, j->lora.path, &j->lora.cfg, j->lora.max_rank, j->lora.digest,
                                         &j->lora.rank, &j->err);
    j->lora.read_s = (double)(loom_now_ns() - t0) * 1e-9;
}

static void run_job(loom_prep_job_t *j) {
    uint64_t t0 = loom_now_ns();
    j->queued_s = (double)(t0 - j->t_submit) * 1e-9;
    j->status = LOOM_OK;
    if (atomic_load(&j->cancelled)) {
        j->status = loom_err_set(&j->err, LOOM_ERR_CANCELLED, "cancelled while queued");
        return;
    }
    if (j->lim.deadline_ns && t0 > j->lim.deadline_ns) {
        j->lim.hit = LOOM_GRAMMAR_LIMIT_TIME;
        j->status = loom_err_set(&j->err, LOOM_ERR_INVALID_ARGUMENT,
                                 "grammar too slow to compile: its time limit passed while it was queued");
        return;
    }
    if (j->lora.name) {
        run_lora(j);
        return;
    }
    if (j->kind) {
        j->lim.stop = &j->cancelled;
        j->status = loom_grammar_compile_limited((loom_grammar_kind_t)j->kind, j->spec, j->len, &j->lim, &j->grammar,
                                                 &j->err);
        j->compile_s = (double)(loom_now_ns() - t0) * 1e-9;
        if (j->status < 0) return;
    }
    if (j->tok && j->prompt) {
        uint64_t t1 = loom_now_ns();
        int cap = 0;
        j->status = loom_tokenizer_encode(j->tok, j->prompt, strlen(j->prompt), j->add_bos, j->parse_special, &j->ids,
                                          &j->n_ids, &cap, &j->err);
        j->tokenize_s = (double)(loom_now_ns() - t1) * 1e-9;
    }
    if (j->kv.whole && j->status == LOOM_OK && !atomic_load(&j->cancelled)) {
        uint64_t t1 = loom_now_ns();
        j->kv.have = j->kv.whole(j->kv.conn, j->kv.hashes, j->kv.n);
        j->kv.read_s = (double)(loom_now_ns() - t1) * 1e-9;
    }
}

static void *thread_main(void *arg) {
    loom_prep_t *p = arg;
    int me = -1;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < p->n_threads; i++)
        if (pthread_equal(p->threads[i], pthread_self())) me = i;
    for (;;) {
        while (!p->queue && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
        if (p->stop) break;
        loom_prep_job_t *j = p->queue;
        p->queue = j->next;
        if (!p->queue) p->queue_tail = NULL;
        j->next = NULL;
        p->n_queued--;
        p->n_running++;
        if (me >= 0) p->running[me] = j;
        pthread_mutex_unlock(&p->mu);
        run_job(j);
        pthread_mutex_lock(&p->mu);
        if (me >= 0) p->running[me] = NULL;
        p->n_running--;
        if (p->done_tail) p->done_tail->next = j;
        else p->done = j;
        p->done_tail = j;
        char one = 1;
        if (write(p->pipe_w, &one, 1) < 0 && errno != EAGAIN) LOOM_WARN("prepare: cannot wake the reactor");
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

loom_status_t loom_prep_create(int n_threads, loom_prep_t **out, loom_err_t *err) {
    *out = NULL;
    loom_prep_t *p = loom_xcalloc(1, sizeof *p);
    int fds[2];
    if (pipe(fds) != 0) {
        free(p);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "prepare: pipe: %s", strerror(errno));
    }
    p->pipe_r = fds[0], p->pipe_w = fds[1];
    fcntl(p->pipe_r, F_SETFL, O_NONBLOCK);
    fcntl(p->pipe_w, F_SETFL, O_NONBLOCK);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->n_threads = n_threads > 0 ? n_threads : 1;
    p->threads = loom_xcalloc((size_t)p->n_threads, sizeof *p->threads);
    p->running = loom_xcalloc((size_t)p->n_threads, sizeof *p->running);
    pthread_mutex_lock(&p->mu); /* the threads find their index once they are all made */
    for (int i = 0; i < p->n_threads; i++)
        if (pthread_create(&p->threads[i], NULL, thread_main, p) != 0) {
            p->n_threads = i;
            pthread_mutex_unlock(&p->mu);
            loom_prep_destroy(&p);
            return loom_err_set(err, LOOM_ERR_INTERNAL, "prepare: cannot start a thread");
        }
    pthread_mutex_unlock(&p->mu);
    *out = p;
    return LOOM_OK;
}

void loom_prep_destroy(loom_prep_t **p_p) {
    if (!p_p || !*p_p) return;
    loom_prep_t *p = *p_p;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    for (int i = 0; i < p->n_threads; i++)
        if (p->running[i]) loom_prep_cancel(p->running[i]);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    loom_prep_job_t *lists[2] = {p->queue, p->done};
    for (int i = 0; i < 2; i++)
        for (loom_prep_job_t *j = lists[i], *next; j; j = next) {
            next = j->next;
            loom_prep_job_free(&j);
        }
    close(p->pipe_r);
    close(p->pipe_w);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p->running);
    free(p);
    *p_p = NULL;
}

int loom_prep_fd(const loom_prep_t *p) { return p->pipe_r; }

void loom_prep_submit(loom_prep_t *p, loom_prep_job_t *j) {
    j->t_submit = loom_now_ns();
    j->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->queue_tail) p->queue_tail->next = j;
    else p->queue = j;
    p->queue_tail = j;
    p->n_queued++;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

loom_prep_job_t *loom_prep_take(loom_prep_t *p) {
    char buf[64];
    while (read(p->pipe_r, buf, sizeof buf) > 0) {}
    pthread_mutex_lock(&p->mu);
    loom_prep_job_t *j = p->done;
    if (j) {
        p->done = j->next;
        if (!p->done) p->done_tail = NULL;
        j->next = NULL;
    }
    pthread_mutex_unlock(&p->mu);
    return j;
}

void loom_prep_cancel(loom_prep_job_t *j) { atomic_store(&j->cancelled, 1); }

void loom_prep_job_free(loom_prep_job_t **j_p) {
    if (!j_p || !*j_p) return;
    loom_prep_job_t *j = *j_p;
    loom_grammar_destroy(&j->grammar);
    free(j->spec);
    free(j->prompt);
    free(j->ids);
    free(j->kv.hashes);
    free(j->lora.name);
    free(j->lora.path);
    free(j);
    *j_p = NULL;
}

int loom_prep_pending(const loom_prep_t *p) {
    loom_prep_t *q = (loom_prep_t *)p;
    pthread_mutex_lock(&q->mu);
    int n = q->n_queued + q->n_running;
    pthread_mutex_unlock(&q->mu);
    return n;
}
