/* The directory tier's coordinator half (kv_tier_dir.h). */
#include "coordinator/kv_tier_dir.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/kv_tier.h"
#include "common/util.h"

/* Files read through recently: a waiting request asked again each step
 * (it waits for memory) must not read its blocks each time. A file whose
 * size and modification time are those it had when it was read through is
 * taken as whole (writers never change a file in place: they rename). */
#define VERIFIED 4096
/* Blocks queued for the checker thread or checked lately. */
#define CHECKS 1024
/* A block found not whole is a miss this long before it is checked again. */
#define BAD_NS 1000000000ull

typedef struct {
    uint64_t key;   /* hash ^ shard mix (0: empty) */
    int64_t mtime_ns;
    int64_t size;
} verified_t;

/* A block's check: QUEUED by match, RUNNING on the checker thread, DONE
 * (ok: every shard's file whole, now in verified). */
enum { CHECK_FREE = 0, CHECK_QUEUED, CHECK_RUNNING, CHECK_DONE };

typedef struct {
    uint64_t hash;
    uint64_t seq;         /* queue order */
    uint64_t deadline_ns; /* a request waits for it until then */
    uint64_t done_ns;
    int state, ok;
} check_t;

typedef struct {
    loom_kv_connector_t base; /* first: the connector's address is the tier's */
    char *dir;
    uint64_t tier_id;
    int n_shards;
    uint64_t *shard_bytes;
    uint64_t grid_gen; /* set_grid's count: a check of another grid is dropped */
    verified_t verified[VERIFIED];
    /* the checker (start_checks; off: match reads through itself). mu
     * guards verified, checks and the grid; the thread reads files outside it */
    int checking;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    int pipe_fd[2];
    uint64_t timeout_ns, next_seq;
    long delay_ms; /* LOOM_TEST_KV_CHECK_DELAY_MS */
    check_t checks[CHECKS];
    /* the last match's request and whether it should wait (waiting) */
    uint64_t wait_id;
    int wait;
} dir_conn_t;

static uint64_t verified_key(uint64_t hash, int shard) {
    uint64_t k = hash ^ ((uint64_t)(shard + 1) * 0x9e3779b97f4a7c15ull);
    return k ? k : 1;
}

static int stat_of(const dir_conn_t *d, uint64_t hash, int shard, int64_t *mtime_ns, int64_t *size) {
    char path[4096];
    loom_kv_tier_path(path, sizeof path, d->dir, d->tier_id, hash, shard);
    struct stat st;
    if (stat(path, &st) != 0) return -1;
    *mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec;
    *size = (int64_t)st.st_size;
    return 0;
}

static void remember(dir_conn_t *d, uint64_t hash, int shard) {
    uint64_t k = verified_key(hash, shard);
    int64_t mt, sz;
    if (stat_of(d, hash, shard, &mt, &sz) == 0) d->verified[k % VERIFIED] = (verified_t){.key = k, .mtime_ns = mt, .size = sz};
}

/* One shard's file of block `hash` is known whole: read through before and
 * the same size and time since; its time is refreshed (about to be loaded:
 * the last the LRU trim takes). Under mu when checking. */
static int shard_known(dir_conn_t *d, uint64_t hash, int shard) {
    uint64_t k = verified_key(hash, shard);
    const verified_t *v = &d->verified[k % VERIFIED];
    int64_t mt, sz;
    if (!(v->key == k && stat_of(d, hash, shard, &mt, &sz) == 0 && mt == v->mtime_ns && sz == v->size)) return 0;
    char path[4096];
    loom_kv_tier_path(path, sizeof path, d->dir, d->tier_id, hash, shard);
    utimensat(AT_FDCWD, path, NULL, 0);
    remember(d, hash, shard); /* its new time */
    return 1;
}

/* One shard's file of block `hash` is there and whole: known, else read
 * through (its checksum) and remembered. */
static int shard_whole(dir_conn_t *d, uint64_t hash, int shard) {
    if (shard_known(d, hash, shard)) return 1;
    if (!loom_kv_tier_check(d->dir, d->tier_id, hash, shard, (size_t)d->shard_bytes[shard])) return 0;
    remember(d, hash, shard);
    return 1;
}

/* Every shard's file of block `hash` is there and whole. */
static int block_whole(dir_conn_t *d, uint64_t hash) {
    for (int sh = 0; sh < d->n_shards; sh++)
        if (!shard_whole(d, hash, sh)) return 0;
    return 1;
}

static int block_known(dir_conn_t *d, uint64_t hash) {
    for (int sh = 0; sh < d->n_shards; sh++)
        if (!shard_known(d, hash, sh)) return 0;
    return 1;
}

/* ---- the checker thread ---------------------------------------------------------------------- */

static check_t *check_find(dir_conn_t *d, uint64_t hash) {
    for (int i = 0; i < CHECKS; i++)
        if (d->checks[i].state != CHECK_FREE && d->checks[i].hash == hash) return &d->checks[i];
    return NULL;
}

/* A slot for a new check: a free one, else the oldest done one; NULL when
 * every slot is queued or running. */
static check_t *check_slot(dir_conn_t *d) {
    check_t *old = NULL;
    for (int i = 0; i < CHECKS; i++) {
        check_t *e = &d->checks[i];
        if (e->state == CHECK_FREE) return e;
        if (e->state == CHECK_DONE && (!old || e->seq < old->seq)) old = e;
    }
    return old;
}

/* Reads every shard's file of block `hash` through (its checksum) with mu
 * released, and remembers them if the grid is the same after: whether the
 * block is whole. Under mu; the test hook's delay first. */
static int read_through(dir_conn_t *d, uint64_t hash) {
    uint64_t gen = d->grid_gen, tier_id = d->tier_id;
    int n = d->n_shards, ok = n > 0 && n <= 64; /* beyond: not checked, a miss */
    uint64_t bytes[64];
    if (n > 64) n = 64;
    memcpy(bytes, d->shard_bytes, (size_t)LOOM_MAX(n, 0) * sizeof *bytes);
    pthread_mutex_unlock(&d->mu);
    if (d->delay_ms > 0) nanosleep(&(struct timespec){d->delay_ms / 1000, d->delay_ms % 1000 * 1000000}, NULL);
    for (int sh = 0; ok && sh < n; sh++) ok = loom_kv_tier_check(d->dir, tier_id, hash, sh, (size_t)bytes[sh]);
    pthread_mutex_lock(&d->mu);
    if (gen != d->grid_gen) return 0;
    if (ok)
        for (int sh = 0; sh < n; sh++) remember(d, hash, sh);
    return ok;
}

static void *checker_main(void *arg) {
    dir_conn_t *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        check_t *e = NULL;
        for (int i = 0; i < CHECKS; i++)
            if (d->checks[i].state == CHECK_QUEUED && (!e || d->checks[i].seq < e->seq)) e = &d->checks[i];
        if (d->stop) break;
        if (!e) {
            pthread_cond_wait(&d->cv, &d->mu);
            continue;
        }
        e->state = CHECK_RUNNING;
        uint64_t hash = e->hash, gen = d->grid_gen;
        int ok = read_through(d, hash);
        if (gen != d->grid_gen) continue; /* set_grid cleared the checks: e is not this one's any more */
        e->state = CHECK_DONE;
        e->ok = ok;
        e->done_ns = loom_now_ns();
        char c = 1;
        ssize_t w = write(d->pipe_fd[1], &c, 1); /* full: the reactor has wakes pending */
        (void)w;
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* Queues the checks of blocks [i, last) whose files are there and not
 * queued yet (a file not there is a miss: nothing to wait for); whether the
 * request should wait for block i. Under mu. */
static int queue_checks(dir_conn_t *d, const loom_kv_conn_req_t *r, int i, int last) {
    uint64_t now = loom_now_ns();
    int wait = 0, queued = 0;
    for (int j = i; j < last; j++) {
        uint64_t h = r->block_hashes[j];
        check_t *e = check_find(d, h);
        if (e && e->state == CHECK_DONE) {
            if (!e->ok && now < e->done_ns + BAD_NS) break; /* found not whole lately: a miss */
            if (e->ok && j > i) continue;                  /* checked lately */
            e->state = CHECK_FREE; /* forgotten or changed since, or found bad long ago: again */
        }
        if (!e || e->state == CHECK_FREE) {
            int64_t mt, sz;
            if (stat_of(d, h, 0, &mt, &sz) != 0) break;
            if (!e && !(e = check_slot(d))) break;
            *e = (check_t){.hash = h, .seq = ++d->next_seq, .deadline_ns = now + d->timeout_ns, .state = CHECK_QUEUED};
            queued = 1;
        }
        if (j == i) wait = (e->state == CHECK_QUEUED || e->state == CHECK_RUNNING) && now < e->deadline_ns;
    }
    if (queued) pthread_cond_signal(&d->cv);
    return wait;
}

static int dir_match(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async) {
    dir_conn_t *d = (dir_conn_t *)c;
    *async = 0;
    d->wait_id = r->id;
    d->wait = 0;
    if (d->n_shards == 0) return 0;
    int first = n_local / r->block_size, last = (r->n_tokens - 1) / r->block_size, n = 0;
    if (!d->checking) {
        for (int i = first; i < last && block_whole(d, r->block_hashes[i]); i++) n++;
        return n * r->block_size;
    }
    pthread_mutex_lock(&d->mu);
    for (int i = first; i < last && block_known(d, r->block_hashes[i]); i++) n++;
    if (first + n < last) d->wait = queue_checks(d, r, first + n, last);
    pthread_mutex_unlock(&d->mu);
    return n * r->block_size;
}

static int dir_waiting(loom_kv_connector_t *c, const loom_kv_conn_req_t *r) {
    dir_conn_t *d = (dir_conn_t *)c;
    return d->wait_id == r->id && d->wait;
}

static int dir_offer(loom_kv_connector_t *c, uint64_t hash) {
    dir_conn_t *d = (dir_conn_t *)c;
    if (d->n_shards == 0) return 0;
    char path[4096];
    loom_kv_tier_path(path, sizeof path, d->dir, d->tier_id, hash, 0);
    if (access(path, F_OK) != 0) return 1;
    utimensat(AT_FDCWD, path, NULL, 0); /* used again: the last to go */
    return 0;
}

static void dir_destroy(loom_kv_connector_t *c) {
    dir_conn_t *d = (dir_conn_t *)c;
    if (d->checking) {
        pthread_mutex_lock(&d->mu);
        d->stop = 1;
        pthread_cond_signal(&d->cv);
        pthread_mutex_unlock(&d->mu);
        pthread_join(d->thread, NULL);
        close(d->pipe_fd[0]);
        close(d->pipe_fd[1]);
    }
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    free(d->dir);
    free(d->shard_bytes);
    free(d);
}

static const loom_kv_connector_ops_t dir_ops = {
    .match = dir_match, .waiting = dir_waiting, .offer = dir_offer, .destroy = dir_destroy};

loom_kv_connector_t *loom_kv_dir_connector_create(const char *dir, int write_through) {
    dir_conn_t *d = loom_xcalloc(1, sizeof *d);
    d->base.ops = &dir_ops;
    d->base.tier = "dir";
    d->base.write_through = write_through;
    d->dir = loom_xstrdup(dir);
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    const char *delay = getenv("LOOM_TEST_KV_CHECK_DELAY_MS");
    d->delay_ms = delay ? atol(delay) : 0;
    return &d->base;
}

void loom_kv_dir_connector_set_grid(loom_kv_connector_t *c, uint64_t tier_id, int n_shards,
                                    const uint64_t *shard_bytes) {
    dir_conn_t *d = (dir_conn_t *)c;
    pthread_mutex_lock(&d->mu);
    d->grid_gen++;
    memset(d->checks, 0, sizeof d->checks);
    d->tier_id = tier_id;
    d->n_shards = n_shards;
    d->shard_bytes = loom_xrealloc(d->shard_bytes, (size_t)(n_shards > 0 ? n_shards : 1) * sizeof *d->shard_bytes);
    memset(d->verified, 0, sizeof d->verified); /* another grid: other files */
    memcpy(d->shard_bytes, shard_bytes, (size_t)n_shards * sizeof *shard_bytes);
    pthread_mutex_unlock(&d->mu);
}

int loom_kv_dir_connector_whole(loom_kv_connector_t *c, const uint64_t *hashes, int n) {
    dir_conn_t *d = (dir_conn_t *)c;
    int i = 0;
    pthread_mutex_lock(&d->mu);
    while (d->n_shards > 0 && i < n && (block_known(d, hashes[i]) || read_through(d, hashes[i]))) i++;
    pthread_mutex_unlock(&d->mu);
    return i;
}

int loom_kv_dir_connector_start_checks(loom_kv_connector_t *c, int timeout_ms) {
    dir_conn_t *d = (dir_conn_t *)c;
    if (d->checking) return d->pipe_fd[0];
    if (pipe(d->pipe_fd) != 0) return -1;
    fcntl(d->pipe_fd[0], F_SETFL, O_NONBLOCK);
    fcntl(d->pipe_fd[1], F_SETFL, O_NONBLOCK);
    d->timeout_ns = (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull;
    if (pthread_create(&d->thread, NULL, checker_main, d) != 0) {
        close(d->pipe_fd[0]);
        close(d->pipe_fd[1]);
        return -1;
    }
    d->checking = 1;
    return d->pipe_fd[0];
}

int loom_kv_dir_connector_drain(loom_kv_connector_t *c) {
    dir_conn_t *d = (dir_conn_t *)c;
    char buf[256];
    int n = 0;
    ssize_t got;
    while (d->checking && (got = read(d->pipe_fd[0], buf, sizeof buf)) > 0) n += (int)got;
    return n;
}

int loom_kv_dir_connector_checking(loom_kv_connector_t *c) {
    dir_conn_t *d = (dir_conn_t *)c;
    int n = 0;
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < CHECKS; i++) n += d->checks[i].state == CHECK_QUEUED || d->checks[i].state == CHECK_RUNNING;
    pthread_mutex_unlock(&d->mu);
    return n;
}
