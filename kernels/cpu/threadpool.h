/* A fork-join thread pool for the CPU backend's ops. parallel_for hands out
 * task indices [0, n_tasks) to the workers and the calling thread, and
 * returns when every task has run exactly once. Idle workers spin briefly
 * (ops come in quick succession during decode) and then sleep on a futex, so
 * a pool that is not in use costs no CPU. One caller at a time. */
#ifndef LOOM_THREADPOOL_H
#define LOOM_THREADPOOL_H

/* One task: `task` in [0, n_tasks); `thread` in [0, n_threads) names the
 * thread running it (0 is the caller), for per-thread scratch. */
typedef void (*loom_task_fn)(void *ctx, int task, int thread);

typedef struct loom_threadpool loom_threadpool_t;

/* n_threads >= 1 counts the caller: n_threads - 1 workers are started.
 * Returns NULL when threads cannot be created. */
loom_threadpool_t *loom_threadpool_create(int n_threads);
void loom_threadpool_destroy(loom_threadpool_t **pool_p); /* safe on NULL and twice */
int loom_threadpool_size(const loom_threadpool_t *pool);

/* Runs fn(ctx, t, thread) for every t in [0, n_tasks) and waits for all of
 * them. Tasks are claimed dynamically, so uneven tasks balance. With one
 * thread (or one task) it runs inline with no synchronization. */
void loom_parallel_for(loom_threadpool_t *pool, int n_tasks, loom_task_fn fn, void *ctx);

/* How long idle workers and a waiting caller spin before sleeping (default
 * 50 us). 0 sleeps at once. */
void loom_threadpool_set_spin_ns(loom_threadpool_t *pool, long spin_ns);

#endif
