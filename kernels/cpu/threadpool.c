/* Fork-join thread pool (see threadpool.h).
 *
 * State: a job is (fn, ctx, n_tasks). `claim` packs (n_tasks << 32 | next
 * task index); threads claim tasks with one fetch_add and a claim that finds
 * next >= n_tasks fails. `done` counts finished tasks; the caller returns when
 * it reaches n_tasks, and only then may it publish the next job. So a thread
 * that holds a claimed task always reads the fn/ctx of the job the task
 * belongs to (it reads them after claiming), even if it woke up late.
 *
 * Sleeping: workers wait for `gen` (bumped per job) to change, spinning for
 * spin_ns and then in FUTEX_WAIT on `gen`; the caller waits for `done` the
 * same way. The n_sleeping / caller_waiting flags let the other side skip
 * the wake syscall when nobody sleeps (seq_cst store/load pairs, so either
 * the sleeper sees the new value or the waker sees the flag). */
#include "kernels/cpu/threadpool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/util.h"

#define DEFAULT_SPIN_NS 50000L

struct worker {
    loom_threadpool_t *pool;
    int id;
    pthread_t thread;
};

struct loom_threadpool {
    int n_threads;
    struct worker *workers; /* (n_threads - 1) */
    _Atomic long spin_ns;   /* read by idle workers, set by the owner */

    alignas(64) _Atomic(loom_task_fn) fn;
    _Atomic(void *) ctx;
    _Atomic uint32_t gen;        /* futex word of idle workers */
    _Atomic uint32_t n_sleeping; /* workers inside FUTEX_WAIT on gen */
    _Atomic int stop;

    alignas(64) _Atomic uint64_t claim; /* (n_tasks << 32) | next task */
    alignas(64) _Atomic uint32_t done;  /* futex word of the caller */
    _Atomic uint32_t caller_waiting;
};

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr, int n) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Spins until *addr != val or spin_ns pass; returns the last value read. */
static uint32_t spin_while_equal(_Atomic uint32_t *addr, uint32_t val, long spin_ns) {
    uint32_t v = atomic_load_explicit(addr, memory_order_acquire);
    if (v != val || spin_ns <= 0) return v;
    uint64_t deadline = loom_now_ns() + (uint64_t)spin_ns;
    for (unsigned i = 1;; i++) {
        cpu_relax();
        v = atomic_load_explicit(addr, memory_order_acquire);
        if (v != val) return v;
        if ((i & 63) == 0 && loom_now_ns() > deadline) return v;
    }
}

/* Claims the next task of the current job; 0 when none is left. */
static int claim_task(loom_threadpool_t *pool, int *task) {
    uint64_t w = atomic_fetch_add_explicit(&pool->claim, 1, memory_order_acq_rel);
    uint32_t next = (uint32_t)w, n = (uint32_t)(w >> 32);
    if (next >= n) return 0;
    *task = (int)next;
    return 1;
}

static void run_claimed(loom_threadpool_t *pool, int task, int thread) {
    loom_task_fn fn = atomic_load_explicit(&pool->fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&pool->ctx, memory_order_relaxed);
    uint32_t n = (uint32_t)(atomic_load_explicit(&pool->claim, memory_order_relaxed) >> 32);
    fn(ctx, task, thread);
    uint32_t d = atomic_fetch_add_explicit(&pool->done, 1, memory_order_seq_cst) + 1;
    if (d == n && atomic_load_explicit(&pool->caller_waiting, memory_order_seq_cst))
        futex_wake(&pool->done, 1);
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    loom_threadpool_t *pool = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g = spin_while_equal(&pool->gen, seen,
                                      atomic_load_explicit(&pool->spin_ns, memory_order_relaxed));
        while (g == seen) {
            atomic_fetch_add_explicit(&pool->n_sleeping, 1, memory_order_seq_cst);
            if (atomic_load_explicit(&pool->gen, memory_order_seq_cst) == seen)
                futex_wait(&pool->gen, seen);
            atomic_fetch_sub_explicit(&pool->n_sleeping, 1, memory_order_seq_cst);
            g = atomic_load_explicit(&pool->gen, memory_order_acquire);
        }
        seen = g;
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) break;
        int task;
        while (claim_task(pool, &task))
            run_claimed(pool, task, w->id);
    }
    return NULL;
}

loom_threadpool_t *loom_threadpool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    loom_threadpool_t *pool = loom_aligned_alloc(sizeof *pool);
    if (!pool) return NULL;
    *pool = (loom_threadpool_t){.n_threads = 1};
    atomic_init(&pool->spin_ns, DEFAULT_SPIN_NS);
    atomic_init(&pool->fn, NULL);
    atomic_init(&pool->ctx, NULL);
    atomic_init(&pool->gen, 0);
    atomic_init(&pool->n_sleeping, 0);
    atomic_init(&pool->stop, 0);
    atomic_init(&pool->claim, 0);
    atomic_init(&pool->done, 0);
    atomic_init(&pool->caller_waiting, 0);
    if (n_threads > 1) {
        pool->workers = calloc((size_t)n_threads - 1, sizeof *pool->workers);
        if (!pool->workers) goto fail_workers;
        for (int i = 1; i < n_threads; i++) {
            struct worker *w = &pool->workers[i - 1];
            w->pool = pool;
            w->id = i;
            if (pthread_create(&w->thread, NULL, worker_main, w) != 0) goto fail_threads;
            pool->n_threads = i + 1;
        }
    }
    return pool;

fail_threads:
    loom_threadpool_destroy(&pool);
    return NULL;
fail_workers:
    loom_aligned_free(pool);
    return NULL;
}

void loom_threadpool_destroy(loom_threadpool_t **pool_p) {
    if (!pool_p || !*pool_p) return;
    loom_threadpool_t *pool = *pool_p;
    *pool_p = NULL;
    atomic_store_explicit(&pool->stop, 1, memory_order_release);
    atomic_fetch_add_explicit(&pool->gen, 1, memory_order_seq_cst);
    futex_wake(&pool->gen, INT_MAX);
    for (int i = 1; i < pool->n_threads; i++)
        pthread_join(pool->workers[i - 1].thread, NULL);
    free(pool->workers);
    loom_aligned_free(pool);
}

int loom_threadpool_size(const loom_threadpool_t *pool) {
    return pool ? pool->n_threads : 1;
}

void loom_threadpool_set_spin_ns(loom_threadpool_t *pool, long spin_ns) {
    if (pool)
        atomic_store_explicit(&pool->spin_ns, spin_ns < 0 ? 0 : spin_ns, memory_order_relaxed);
}

void loom_parallel_for(loom_threadpool_t *pool, int n_tasks, loom_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!pool || pool->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t, 0);
        return;
    }
    uint32_t n = (uint32_t)n_tasks;
    atomic_store_explicit(&pool->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->claim, (uint64_t)n << 32, memory_order_release);
    atomic_fetch_add_explicit(&pool->gen, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&pool->n_sleeping, memory_order_seq_cst))
        futex_wake(&pool->gen, INT_MAX);

    int task;
    while (claim_task(pool, &task))
        run_claimed(pool, task, 0);

    /* Wait for the workers' last tasks: spin, then sleep until the last one wakes us. */
    uint64_t deadline = 0;
    for (unsigned i = 0;; i++) {
        uint32_t d = atomic_load_explicit(&pool->done, memory_order_acquire);
        if (d == n) return;
        if ((i & 63) == 0) {
            uint64_t now = loom_now_ns();
            if (i == 0)
                deadline =
                    now + (uint64_t)atomic_load_explicit(&pool->spin_ns, memory_order_relaxed);
            else if (now > deadline)
                break;
        }
        cpu_relax();
    }
    for (;;) {
        atomic_store_explicit(&pool->caller_waiting, 1, memory_order_seq_cst);
        uint32_t d = atomic_load_explicit(&pool->done, memory_order_seq_cst);
        if (d != n) futex_wait(&pool->done, d);
        atomic_store_explicit(&pool->caller_waiting, 0, memory_order_relaxed);
        if (atomic_load_explicit(&pool->done, memory_order_acquire) == n) return;
    }
}
