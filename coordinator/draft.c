/* The coordinator's in-process draft model: a loom_local with one KV slot
 * per sequence it drafts for (worker/local.h loom_local_propose), run by a
 * thread of its own (see draft.h): reservations on the reactor, forwards on
 * the thread, a FIFO of jobs between them and a pipe back. */
#include "coordinator/draft.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/spec.h"
#include "common/util.h"
#include "kernels/quant.h"
#include "worker/local.h"

/* One sequence's drafts: reserved on the reactor, proposed on the thread. */
typedef struct draft_entry {
    uint64_t id; /* the sequence's */
    int slot, k;
    int window;    /* a probe's: the catch-up reads at most this many tokens (0: all) */
    int32_t *hist; /* a copy of its tokens (the sequence may be freed meanwhile) */
    int n_hist;
    int tok;       /* its first draft's index in mb->tokens */
    int32_t out[LOOM_SPEC_MAX_K];
    int n_out;     /* drafts proposed: k, or 0 when the forward failed */
} draft_entry_t;

/* One step's reservations. */
typedef struct draft_job {
    loom_microbatch_t *mb;
    draft_entry_t *e;
    int n, cap;
    _Atomic int voided; /* its step failed unsent: nothing is written back */
    double seconds;     /* the forwards' time */
    struct draft_job *next;
} draft_job_t;

struct loom_coord_draft {
    loom_local_t *model; /* the thread's (open and close: before it starts, after it stops) */
    const loom_sched_t *sched; /* attached to (whether a step is a probe of its gate) */
    int ctx;             /* positions per slot */
    long delay_ms;       /* LOOM_TEST_DRAFT_DELAY_MS */
    _Atomic long errors;
    /* the reactor's */
    int n_slots;
    uint64_t *owner; /* (n_slots) the sequence id a slot follows */
    uint8_t *busy;   /* (n_slots) */
    int n_busy;
    draft_job_t *building; /* the step being scheduled's reservations */
    /* shared, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    draft_job_t *queue, *queue_tail; /* submitted, FIFO */
    draft_job_t *running;
    draft_job_t *done, *done_tail;   /* proposed, FIFO */
    _Atomic int stop;
    pthread_t thread;
    int started;
    int pipe_r, pipe_w;
};

static void job_free(draft_job_t *j) {
    for (int i = 0; i < j->n; i++) free(j->e[i].hist);
    free(j->e);
    free(j);
}

static void free_list(draft_job_t *j) {
    for (draft_job_t *next; j; j = next) {
        next = j->next;
        job_free(j);
    }
}

/* ---- the thread --------------------------------------------------------------- */

static void test_delay(const loom_coord_draft_t *d) {
    if (d->delay_ms <= 0) return;
    struct timespec ts = {.tv_sec = d->delay_ms / 1000, .tv_nsec = (d->delay_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void run_job(loom_coord_draft_t *d, draft_job_t *j) {
    uint64_t t0 = loom_now_ns();
    for (int i = 0; i < j->n && !atomic_load(&j->voided) && !atomic_load(&d->stop); i++) {
        draft_entry_t *e = &j->e[i];
        test_delay(d);
        loom_err_t err = {0};
        int n = loom_local_propose_window(d->model, e->slot, e->hist, e->n_hist, e->k, e->window, e->out, &err);
        if (n < 0) {
            if (atomic_fetch_add(&d->errors, 1) == 0)
                LOOM_WARN("speculative draft: %s (the step verifies placeholder drafts)", err.msg);
            loom_local_forget(d->model, e->slot);
            n = 0;
        }
        e->n_out = LOOM_MIN(n, e->k);
    }
    j->seconds = (double)(loom_now_ns() - t0) * 1e-9;
}

static void *thread_main(void *arg) {
    loom_coord_draft_t *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->queue && !atomic_load(&d->stop)) pthread_cond_wait(&d->cv, &d->mu);
        if (atomic_load(&d->stop)) break;
        draft_job_t *j = d->queue;
        d->queue = j->next;
        if (!d->queue) d->queue_tail = NULL;
        j->next = NULL;
        d->running = j;
        pthread_mutex_unlock(&d->mu);
        run_job(d, j);
        pthread_mutex_lock(&d->mu);
        d->running = NULL;
        if (d->done_tail) d->done_tail->next = j;
        else d->done = j;
        d->done_tail = j;
        char one = 1;
        if (write(d->pipe_w, &one, 1) < 0 && errno != EAGAIN) LOOM_WARN("speculative draft: cannot wake the reactor");
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* ---- open / destroy ------------------------------------------------------------- */

static loom_status_t start_thread(loom_coord_draft_t *d, loom_err_t *err) {
    int fds[2];
    if (pipe(fds) != 0) return loom_err_set(err, LOOM_ERR_INTERNAL, "speculative draft: pipe: %s", strerror(errno));
    d->pipe_r = fds[0], d->pipe_w = fds[1];
    fcntl(d->pipe_r, F_SETFL, O_NONBLOCK);
    fcntl(d->pipe_w, F_SETFL, O_NONBLOCK);
    if (pthread_create(&d->thread, NULL, thread_main, d) != 0)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "speculative draft: cannot start its thread");
    d->started = 1;
    return LOOM_OK;
}

loom_status_t loom_coord_draft_open(const loom_coord_draft_options_t *o,
                                    const loom_model_config_t *target,
                                    const loom_tokenizer_t *target_tok, loom_coord_draft_t **out,
                                    loom_err_t *err) {
    *out = NULL;
    loom_local_options_t lo = {.model_dir = o->model_dir,
                               .n_threads = o->n_threads,
                               .device = o->device,
                               .ctx = o->ctx,
                               .no_tokenizer = 1,
                               .n_slots = LOOM_MAX(o->max_seqs, 1)};
    if (o->quantization && !loom_quant_spec_parse(o->quantization, &lo.quant))
        return loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "--speculative-quantization: unknown scheme '%s' (int8, fp8, q4, q4_min, q4:G ...)",
            o->quantization);
    uint64_t t0 = loom_now_ns();
    loom_local_t *l = NULL;
    loom_err_t e = {0};
    if (loom_local_open(&lo, &l, &e) < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the draft model %s cannot be loaded: %s", o->model_dir, e.msg);
    loom_status_t st = loom_local_check_draft(loom_local_config(l), target, o->model_dir, err);
    if (st == LOOM_OK) st = loom_local_check_draft_tokenizer(o->model_dir, target_tok, err);
    if (st < 0) {
        loom_local_close(&l);
        return st;
    }
    loom_coord_draft_t *d = loom_xcalloc(1, sizeof *d);
    d->model = l;
    d->ctx = loom_local_ctx(l);
    d->n_slots = loom_local_slots(l);
    d->owner = loom_xcalloc((size_t)d->n_slots, sizeof *d->owner);
    d->busy = loom_xcalloc((size_t)d->n_slots, sizeof *d->busy);
    d->pipe_r = d->pipe_w = -1;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    const char *delay = getenv("LOOM_TEST_DRAFT_DELAY_MS");
    d->delay_ms = delay ? strtol(delay, NULL, 10) : 0;
    if (d->delay_ms > 0) LOOM_WARN("test hook: the draft sleeps %ld ms before each sequence's drafts", d->delay_ms);
    if ((st = start_thread(d, err)) < 0) {
        loom_coord_draft_destroy(&d);
        return st;
    }
    char q[64] = "as stored";
    if (lo.quant.quant != LOOM_QUANT_NONE) loom_quant_spec_name(&lo.quant, q, sizeof q);
    LOOM_INFO("speculative draft: %s (%s, %.1f MB) in the coordinator, %d sequence slot(s) of %d "
              "positions, "
              "loaded in %.2f s",
              o->model_dir, q, (double)loom_model_weight_bytes(loom_local_model(l)) / 1e6,
              d->n_slots, d->ctx, (double)(loom_now_ns() - t0) * 1e-9);
    if (d->ctx < o->ctx)
        LOOM_WARN("the draft model's context is %d positions, the coordinator's %d: longer "
                  "sequences are decoded "
                  "without drafts past it",
                  d->ctx, o->ctx);
    *out = d;
    return LOOM_OK;
}

void loom_coord_draft_destroy(loom_coord_draft_t **d_p) {
    if (!d_p || !*d_p) return;
    loom_coord_draft_t *d = *d_p;
    *d_p = NULL;
    if (d->started) {
        pthread_mutex_lock(&d->mu);
        atomic_store(&d->stop, 1); /* a running job stops after its current sequence */
        pthread_cond_broadcast(&d->cv);
        pthread_mutex_unlock(&d->mu);
        pthread_join(d->thread, NULL);
    }
    free_list(d->queue);
    free_list(d->done);
    if (d->building) job_free(d->building);
    if (d->pipe_r >= 0) close(d->pipe_r);
    if (d->pipe_w >= 0) close(d->pipe_w);
    pthread_cond_destroy(&d->cv);
    pthread_mutex_destroy(&d->mu);
    loom_local_close(&d->model);
    free(d->owner);
    free(d->busy);
    free(d);
}

/* ---- the reactor's half ------------------------------------------------------------ */

static int find_slot(const loom_coord_draft_t *d, uint64_t id) {
    for (int i = 0; i < d->n_slots; i++)
        if (d->busy[i] && d->owner[i] == id) return i;
    return -1;
}

/* The scheduler's drafter: reserves q's drafts (see draft.h). The count is
 * what loom_local_propose will return: k, cut where the slot's context
 * ends; 0 when every slot follows another sequence. */
static int draft_reserve(void *ctx, const loom_seq_t *q, int k, int32_t *out) {
    loom_coord_draft_t *d = ctx;
    k = LOOM_MIN(k, d->ctx - q->n_tokens); /* drafts 0..k-2 go in at n_tokens.., and the history must fit */
    if (q->n_tokens < 1 || k <= 0) return 0;
    int slot = find_slot(d, q->id);
    if (slot < 0) {
        for (int i = 0; i < d->n_slots && slot < 0; i++)
            if (!d->busy[i]) slot = i;
        if (slot < 0) return 0;
        d->busy[slot] = 1;
        d->owner[slot] = q->id;
        d->n_busy++;
    }
    draft_job_t *j = d->building;
    if (!j) j = d->building = loom_xcalloc(1, sizeof *j);
    if (j->n == j->cap) {
        j->cap = j->cap ? 2 * j->cap : 8;
        j->e = loom_xrealloc(j->e, (size_t)j->cap * sizeof *j->e);
    }
    draft_entry_t *e = &j->e[j->n++];
    *e = (draft_entry_t){.id = q->id, .slot = slot, .k = k, .n_hist = q->n_tokens,
                         .window = d->sched && loom_sched_spec_probing(d->sched) ? LOOM_SPEC_GATE_PROBE_WINDOW : 0};
    e->hist = loom_xmalloc((size_t)q->n_tokens * sizeof *e->hist);
    memcpy(e->hist, q->tokens, (size_t)q->n_tokens * sizeof *e->hist);
    /* valid ids until the drafts replace them (a failed forward leaves them) */
    for (int i = 0; i < k; i++) out[i] = q->tokens[q->n_tokens - 1];
    return k;
}

static void draft_forget(void *ctx, const loom_seq_t *q) {
    loom_coord_draft_t *d = ctx;
    int slot = find_slot(d, q->id);
    if (slot < 0) return;
    d->busy[slot] = 0;
    d->n_busy--;
    /* the slot keeps its KV: a next sequence with the same prefix (a chat's
     * next turn, a shared system prompt) reuses it */
}

void loom_coord_draft_attach(loom_coord_draft_t *d, loom_sched_t *s) {
    d->sched = s;
    loom_sched_set_drafter(s, draft_reserve, draft_forget, d);
}

int loom_coord_draft_submit(loom_coord_draft_t *d, loom_microbatch_t *mb) {
    draft_job_t *j = d->building;
    d->building = NULL;
    if (!j) return 0;
    /* the reservations were made in the order of mb's speculating sequences */
    int e = 0;
    for (int si = 0; si < mb->n_seqs; si++) {
        if (mb->spec_n[si] <= 0) continue;
        LOOM_ASSERT(e < j->n && j->e[e].id == mb->seqs[si]->id && j->e[e].k == mb->spec_n[si]);
        j->e[e++].tok = mb->logit_rows[mb->spec_row0[si]] + 1;
    }
    LOOM_ASSERT(e == j->n);
    j->mb = mb;
    pthread_mutex_lock(&d->mu);
    if (d->queue_tail) d->queue_tail->next = j;
    else d->queue = j;
    d->queue_tail = j;
    pthread_cond_signal(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return 1;
}

int loom_coord_draft_fd(const loom_coord_draft_t *d) { return d->pipe_r; }

int loom_coord_draft_take(loom_coord_draft_t *d, loom_microbatch_t **mb) {
    *mb = NULL;
    char buf[64];
    while (read(d->pipe_r, buf, sizeof buf) > 0) {}
    pthread_mutex_lock(&d->mu);
    draft_job_t *j = d->done;
    if (j) {
        d->done = j->next;
        if (!d->done) d->done_tail = NULL;
    }
    pthread_mutex_unlock(&d->mu);
    if (!j) return 0;
    if (!atomic_load(&j->voided)) {
        for (int i = 0; i < j->n; i++) {
            const draft_entry_t *e = &j->e[i];
            memcpy(j->mb->tokens + e->tok, e->out, (size_t)e->n_out * sizeof *e->out);
        }
        j->mb->draft_s += j->seconds;
        *mb = j->mb;
    }
    job_free(j);
    return 1;
}

void loom_coord_draft_void(loom_coord_draft_t *d, const loom_microbatch_t *mb) {
    pthread_mutex_lock(&d->mu);
    draft_job_t *lists[3] = {d->queue, d->running, d->done};
    for (int i = 0; i < 3; i++)
        for (draft_job_t *j = lists[i]; j; j = j->next) /* the running job's next is NULL */
            if (j->mb == mb) atomic_store(&j->voided, 1);
    pthread_mutex_unlock(&d->mu);
}

int loom_coord_draft_busy(const loom_coord_draft_t *d) { return d->n_busy; }
long loom_coord_draft_errors(const loom_coord_draft_t *d) { return atomic_load(&d->errors); }
loom_local_counters_t loom_coord_draft_counters(const loom_coord_draft_t *d) { return loom_local_counters(d->model); }
