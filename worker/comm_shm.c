/* The shm comm backend: a worker's TP group and its pipeline links in POSIX
 * shared memory, for workers that are processes of one host.
 *
 * Segments, named from cfg->name (comm_util.h: loom_comm_shm_name) and
 * unlinked by every member as soon as all have attached, so nothing is left in
 * /dev/shm even if processes are killed later:
 *   TP group  "/loom-<name>-tp-<id of rank 0>~<hash>"
 *             header | members | tp_ctl per rank | tp_size x 2 slots of max_bytes
 *   link      "/loom-<name>-pp-<sender id>-<receiver id>~<hash>"
 *             header | members (0 sender, 1 receiver) | ring_ctl | 4 slots
 * Every member opens with O_CREAT and the same size; a zero-filled segment is
 * the initial state (counters 0, no abort), so there is no init step to race.
 * The first member records the geometry, the others check it.
 *
 * TP protocol. Collectives are numbered k = 0, 1, 2, ... identically on every
 * rank; op k uses slot k % 2 of each rank. seq[r] counts the ops rank r has
 * published, done[r] the ops it has finished reading. Rank r runs op k as:
 *   1. wait done[j] >= k - 1 for all j: slot k % 2 was last read in op k - 2;
 *   2. copy its data and {bytes, kind} into its slot, then seq[r] = k + 1;
 *   3. wait seq[j] >= k + 1 for the ranks it reads (all for all-reduce and
 *      barrier, every rank for the gather root, none for other gather ranks);
 *   4. read (rank-order sum, or copy), then done[r] = k + 1.
 * Step 1 only waits after a gather: finishing op k - 1 needed every seq[j] >=
 * k, and a rank publishes op k - 1 only after finishing op k - 2. So an
 * all-reduce costs one wait, for the slowest rank.
 *
 * Link protocol: head counts messages written, tail messages taken. The sender
 * waits for head - tail < 4, the receiver for head != tail.
 *
 * Waiting: spin, then FUTEX_WAIT (shared, not PRIVATE) in slices of 50 ms.
 * A decode all-reduce mostly waits tens of µs for the other rank to finish
 * its half of the layer; a futex sleep there costs the waiter its wake-up
 * (~70 µs in a VM, docs/data-plane.md) and the publisher a FUTEX_WAKE (~35
 * µs), which a fixed 2 µs spin paid in nearly every all-reduce. A long spin
 * loses where the cores are shared: with other jobs, the peer is descheduled
 * for milliseconds and the spinner burns its own share of its core; with
 * the peer on the same core, the spin holds off the very peer it waits for.
 * So a waiter spins 100 µs (loom_comm_spin_ns) while most of those spins
 * catch the peer, and 2 µs once most run out (spin_learn); every 64th wait
 * spins long again to find out whether they would catch it. Between slices
 * a waiter checks its own abort flag, the abort word of every segment it
 * maps, the deadline (timeout_ms), and whether the process it waits for
 * still exists or has left (destroy). A publisher skips FUTEX_WAKE while the
 * segment's sleeper count is 0.
 *
 * Failure: loom_comm_abort sets the local flag and the abort word of each of
 * this comm's segments and wakes every futex word. A waiter that finds a
 * segment aborted aborts its own comm too, so an abort spreads through the
 * grid link by link. A timeout, a peer that is gone and a disagreement about
 * the collective also abort: the group's counters are no longer in step. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdalign.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/comm_impl.h"
#include "worker/comm_util.h"

#define SHM_MAGIC             0x314d48534d4f4f4cull /* "LOOMSHM1" */
#define SHM_RING              4                     /* pipeline messages in flight per link */
#define SHM_CREATE_DEFAULT_MS 30000
#define SHM_MAX_BYTES         ((size_t)1 << 40)
#define SHM_SPIN_DEFAULT_NS   100000 /* a waiter's longest spin ($LOOM_COMM_SPIN_US) */
#define SHM_SPIN_MIN_NS       2000   /* its shortest, while most long spins run out */
#define SHM_SPIN_MISSES       4      /* spin_learn's score from which spins are short */

enum { OP_ALLREDUCE = 1, OP_GATHER = 2, OP_BARRIER = 3 };

static const char *op_name(uint32_t kind) {
    switch (kind) {
    case OP_ALLREDUCE:
        return "all-reduce";
    case OP_GATHER:
        return "gather";
    case OP_BARRIER:
        return "barrier";
    }
    return "?";
}

/* At offset 0 of every segment. */
typedef struct seg_hdr {
    _Atomic uint64_t magic, size, n_members; /* set by the first member, checked by the rest */
    _Atomic uint32_t joined;                 /* futex: members attached so far */
    _Atomic uint32_t abort;                  /* futex: nonzero once any member aborted */
    _Atomic uint32_t sleepers;               /* members inside FUTEX_WAIT */
} seg_hdr_t;

typedef struct seg_member {
    _Atomic int32_t pid;
    _Atomic uint32_t left;  /* set by destroy: this member will publish nothing more */
    _Atomic uint64_t pidns; /* inode of /proc/self/ns/pid; pids compare only within one */
} seg_member_t;

typedef struct tp_meta {
    uint64_t bytes;
    uint32_t kind;
} tp_meta_t;

typedef struct tp_ctl {
    alignas(64) _Atomic uint32_t seq; /* futex: ops this rank has published */
    _Atomic uint32_t done;            /* futex: ops this rank has finished reading */
    tp_meta_t meta[2];                /* of the data in each slot; written before seq */
} tp_ctl_t;

typedef struct ring_ctl {
    alignas(64) _Atomic uint32_t head; /* futex: messages written by the sender */
    alignas(64) _Atomic uint32_t tail; /* futex: messages taken by the receiver */
    alignas(64) uint64_t bytes[SHM_RING];
} ring_ctl_t;

#define MEMBERS_OFF ((sizeof(seg_hdr_t) + 63) & ~(size_t)63)

/* One mapped segment, as this process sees it. */
typedef struct shm_seg {
    char name[LOOM_COMM_SHM_NAME_MAX + 16];
    const char *what; /* for messages: "tp group", "link to the next stage", ... */
    int opened;       /* the name was opened (so this process may have created it) */
    uint8_t *base;    /* NULL when the segment is absent */
    size_t size;
    seg_hdr_t *hdr;
    seg_member_t *members;
    int n_members, self;
} shm_seg_t;

typedef struct loom_comm_shm {
    loom_comm_t base;
    atomic_int aborted;
    int timeout_ms;         /* per call; 0 = none */
    uint64_t spin_ns;       /* the longest spin */
    atomic_int spin_score;  /* long spins that ran out minus those that caught, of late */
    _Atomic uint32_t waits; /* short-spin waits, for the periodic longest spin */
    uint64_t pidns;
    size_t stride; /* bytes between slots: max_bytes rounded up to 64 */

    shm_seg_t tp;     /* present when tp_size > 1 */
    tp_ctl_t *ctl;    /* (tp_size) */
    uint8_t *tp_data; /* (tp_size, 2, stride) */
    uint32_t op;      /* collectives this rank has run, modulo 2^32 like the counters */
    const float **srcs;

    shm_seg_t out, in; /* links to the next and from the previous stage */
    ring_ctl_t *out_ring, *in_ring;
    uint8_t *out_data, *in_data; /* (SHM_RING, stride) */
    uint32_t sent, taken;
} loom_comm_shm_t;

static size_t align_up(size_t x, size_t a) {
    return (x + a - 1) / a * a;
}

static uint64_t pid_namespace(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* Offsets of the control block and the data; returns the segment size. */
static size_t seg_layout(int n_members, size_t ctl_bytes, size_t data_bytes, size_t *ctl_off,
                         size_t *data_off) {
    size_t off = MEMBERS_OFF + align_up((size_t)n_members * sizeof(seg_member_t), 64);
    *ctl_off = off;
    *data_off = align_up(off + ctl_bytes, 4096);
    return *data_off + data_bytes;
}

static void shm_abort(loom_comm_t *base);

/* Aborts the comm (so the peers learn of it) and fails with code. */
static loom_status_t shm_fail(loom_comm_shm_t *c, loom_err_t *err, loom_status_t code,
                              const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static loom_status_t shm_fail(loom_comm_shm_t *c, loom_err_t *err, loom_status_t code,
                              const char *fmt, ...) {
    shm_abort(&c->base);
    va_list ap;
    va_start(ap, fmt);
    loom_err_setv(err, code, fmt, ap);
    va_end(ap);
    return code;
}

/* LOOM_OK unless this comm or one of its segments was aborted. */
static loom_status_t shm_check(loom_comm_shm_t *c, loom_err_t *err) {
    if (atomic_load_explicit(&c->aborted, memory_order_relaxed))
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "shm comm: aborted");
    const shm_seg_t *segs[] = {&c->tp, &c->out, &c->in};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(segs); i++) {
        if (segs[i]->base && atomic_load_explicit(&segs[i]->hdr->abort, memory_order_relaxed)) {
            shm_abort(&c->base);
            return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "shm comm: aborted by a peer (%s)",
                                segs[i]->what);
        }
    }
    return LOOM_OK;
}

/* 1 while member j may still publish: its process exists and it has not left.
 * Errs towards 1 when it cannot tell (another pid namespace). */
static int peer_alive(const loom_comm_shm_t *c, const shm_seg_t *s, int j) {
    const seg_member_t *m = &s->members[j];
    if (atomic_load(&m->left)) return 0;
    int32_t pid = atomic_load(&m->pid);
    uint64_t ns = atomic_load(&m->pidns);
    if (pid <= 0 || ns == 0 || ns != c->pidns) return 1;
    if (kill(pid, 0) != 0) return errno != ESRCH;
    /* A killed process that its parent has not reaped yet still answers kill(). */
    char path[64], stat_line[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno != ENOENT;
    ssize_t n = read(fd, stat_line, sizeof stat_line - 1);
    close(fd);
    if (n <= 0) return 1;
    stat_line[n] = '\0';
    const char *paren = strrchr(stat_line, ')'); /* "pid (comm) S ..." and comm may hold ')' */
    if (!paren || paren[1] != ' ') return 1;
    return paren[2] != 'Z' && paren[2] != 'X';
}

/* Scores a long spin: -1 when it caught the peer, +1 when it ran out, kept
 * in [0, 2 * SHM_SPIN_MISSES]. While the score is under SHM_SPIN_MISSES (more
 * catches than misses of late) a waiter spins the longest, else the
 * shortest: past half the spins running out, spinning costs more CPU than
 * the wake-ups it saves (the peer is descheduled, or needs this very core).
 * A probe that catches the peer puts the long spins back on trial. */
static void spin_learn(loom_comm_shm_t *c, int caught) {
    int score = atomic_load_explicit(&c->spin_score, memory_order_relaxed);
    if (caught)
        score = score >= SHM_SPIN_MISSES ? SHM_SPIN_MISSES - 1 : LOOM_MAX(0, score - 1);
    else
        score = LOOM_MIN(2 * SHM_SPIN_MISSES, score + 1);
    atomic_store_explicit(&c->spin_score, score, memory_order_relaxed);
}

/* shm_wait past its spin: FUTEX_WAIT in slices, checking for aborts, the
 * deadline and the peer's death between them. */
static loom_status_t shm_sleep(loom_comm_shm_t *c, const shm_seg_t *s, _Atomic uint32_t *w,
                               uint32_t target, int peer, uint64_t deadline, const char *what,
                               loom_err_t *err) {
    uint64_t last_check = loom_now_ns();
    for (;;) {
        LOOM_CHECK(shm_check(c, err));
        if (loom_comm_expired(deadline))
            return shm_fail(c, err, LOOM_ERR_UNAVAILABLE, "shm %s: timed out waiting for %s",
                            s->what, what);
        if (peer >= 0 && loom_now_ns() - last_check >= (uint64_t)LOOM_COMM_SLICE_MS * 1000000ull) {
            last_check = loom_now_ns();
            if (!peer_alive(c, s, peer)) {
                /* It may have published just before leaving. */
                if (loom_comm_reached(atomic_load(w), target)) return LOOM_OK;
                return shm_fail(c, err, LOOM_ERR_UNAVAILABLE,
                                "shm %s: member %d (pid %d) is gone while waiting for %s", s->what,
                                peer, (int)atomic_load(&s->members[peer].pid), what);
            }
        }
        atomic_fetch_add(&s->hdr->sleepers, 1);
        uint32_t v = atomic_load(w);
        if (!loom_comm_reached(v, target)) {
            int ms = loom_comm_ms_left(deadline, LOOM_COMM_SLICE_MS);
            if (ms > 0) loom_comm_futex_wait(w, v, ms);
        }
        atomic_fetch_sub(&s->hdr->sleepers, 1);
        if (loom_comm_reached(atomic_load_explicit(w, memory_order_acquire), target))
            return LOOM_OK;
    }
}

/* Waits until *w has reached target. peer is the member expected to move it
 * (-1: anyone); what names the wait in messages. */
static loom_status_t shm_wait(loom_comm_shm_t *c, const shm_seg_t *s, _Atomic uint32_t *w,
                              uint32_t target, int peer, uint64_t deadline, const char *what,
                              loom_err_t *err) {
    if (loom_comm_reached(atomic_load_explicit(w, memory_order_acquire), target)) return LOOM_OK;
    uint64_t t0 = loom_now_ns(), spin = c->spin_ns;
    /* Every 64th wait spins the longest whatever the score, so a spin cut
     * short by a bad stretch comes back once waits are short again. */
    if (atomic_load_explicit(&c->spin_score, memory_order_relaxed) >= SHM_SPIN_MISSES &&
        (atomic_fetch_add_explicit(&c->waits, 1, memory_order_relaxed) & 63) != 63)
        spin = LOOM_MIN(spin, SHM_SPIN_MIN_NS);
    for (unsigned i = 1;; i++) {
        loom_comm_cpu_relax();
        if (loom_comm_reached(atomic_load_explicit(w, memory_order_acquire), target)) {
            if (spin > SHM_SPIN_MIN_NS) spin_learn(c, 1);
            return LOOM_OK;
        }
        if ((i & 31) == 0 && loom_now_ns() - t0 >= spin) break;
    }
    if (spin > SHM_SPIN_MIN_NS) spin_learn(c, 0);
    return shm_sleep(c, s, w, target, peer, deadline, what, err);
}

/* Stores v into *w and wakes its sleepers, if the segment has any. The
 * seq_cst store and load pair with the waiter's increment of sleepers and
 * re-read of *w: one of the two sides always sees the other. */
static void shm_publish(const shm_seg_t *s, _Atomic uint32_t *w, uint32_t v) {
    atomic_store(w, v);
    if (atomic_load(&s->hdr->sleepers)) loom_comm_futex_wake(w);
}

/* Every futex word of the segment, woken on abort and when a member leaves. */
static void seg_wake_all(loom_comm_shm_t *c, const shm_seg_t *s) {
    loom_comm_futex_wake(&s->hdr->joined);
    loom_comm_futex_wake(&s->hdr->abort);
    if (s == &c->tp && c->ctl) {
        for (int r = 0; r < c->base.tp_size; r++) {
            loom_comm_futex_wake(&c->ctl[r].seq);
            loom_comm_futex_wake(&c->ctl[r].done);
        }
    }
    ring_ctl_t *ring = s == &c->out ? c->out_ring : s == &c->in ? c->in_ring : NULL;
    if (ring) {
        loom_comm_futex_wake(&ring->head);
        loom_comm_futex_wake(&ring->tail);
    }
}

/* Opens (creating if needed) and maps a segment, then counts this member in. */
static loom_status_t seg_open(loom_comm_shm_t *c, shm_seg_t *s, const char *const *parts,
                              int n_parts, size_t size, int n_members, int self, const char *what,
                              loom_err_t *err) {
    loom_comm_shm_name(s->name, parts, n_parts);
    s->what = what;
    s->n_members = n_members;
    s->self = self;
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return loom_err_set(err, LOOM_ERR_IO, "shm %s: shm_open(%s): %s", what, s->name,
                            strerror(errno));
    s->opened = 1;
    struct stat st;
    if (fstat(fd, &st) != 0 || (st.st_size != 0 && (size_t)st.st_size != size)) {
        close(fd);
        return loom_err_set(
            err, LOOM_ERR_PROTOCOL,
            "shm %s: %s exists with %lld bytes, expected %zu (a stale segment, or members "
            "disagree on tp_size/max_bytes)",
            what, s->name, (long long)st.st_size, size);
    }
    /* Same size from every member, so racing ftruncates agree. fallocate
     * reserves the pages now: a full /dev/shm is an error here, not SIGBUS
     * at the first write. */
    int rc = ftruncate(fd, (off_t)size);
    if (rc == 0)
        rc = posix_fallocate(fd, 0, (off_t)size);
    else
        rc = errno;
    if (rc != 0) {
        close(fd);
        return loom_err_set(err, rc == ENOSPC ? LOOM_ERR_RESOURCE_EXHAUSTED : LOOM_ERR_IO,
                            "shm %s: cannot size %s to %zu bytes: %s", what, s->name, size,
                            strerror(rc));
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return loom_err_set(err, LOOM_ERR_NOMEM, "shm %s: mmap of %zu bytes: %s", what, size,
                            strerror(errno));
    s->base = p;
    s->size = size;
    s->hdr = p;
    s->members = (seg_member_t *)(s->base + MEMBERS_OFF);

    const uint64_t geom[3] = {SHM_MAGIC, size, (uint64_t)n_members};
    _Atomic uint64_t *fields[3] = {&s->hdr->magic, &s->hdr->size, &s->hdr->n_members};
    for (int i = 0; i < 3; i++) {
        uint64_t expect = 0;
        if (!atomic_compare_exchange_strong(fields[i], &expect, geom[i]) && expect != geom[i])
            return loom_err_set(
                err, LOOM_ERR_PROTOCOL,
                "shm %s: %s has another layout (stale, or members disagree on the group)", what,
                s->name);
    }
    seg_member_t *me = &s->members[self];
    atomic_store(&me->pidns, c->pidns);
    atomic_store(&me->pid, (int32_t)getpid());
    atomic_fetch_add(&s->hdr->joined, 1);
    loom_comm_futex_wake(&s->hdr->joined);
    return LOOM_OK;
}

/* The join barrier: returns once every member has attached. */
static loom_status_t seg_join(loom_comm_shm_t *c, shm_seg_t *s, uint64_t deadline,
                              loom_err_t *err) {
    uint32_t n = (uint32_t)s->n_members;
    loom_status_t st =
        shm_wait(c, s, &s->hdr->joined, n, -1, deadline, "every member to attach", err);
    if (st < 0) {
        if (err) {
            size_t len = strlen(err->msg);
            snprintf(err->msg + len, sizeof err->msg - len, " (%u of %u attached to %s)",
                     atomic_load(&s->hdr->joined), n, s->name);
        }
        return st;
    }
    if (atomic_load(&s->hdr->joined) != n)
        return shm_fail(c, err, LOOM_ERR_PROTOCOL, "shm %s: %u members attached to %s, expected %u",
                        s->what, atomic_load(&s->hdr->joined), s->name, n);
    return LOOM_OK;
}

static void seg_unlink(shm_seg_t *s) {
    if (s->opened && shm_unlink(s->name) != 0 && errno != ENOENT)
        LOOM_WARN("shm: shm_unlink(%s): %s", s->name, strerror(errno));
    s->opened = 0;
}

static void seg_unmap(shm_seg_t *s) {
    if (s->base) munmap(s->base, s->size);
    s->base = NULL;
}

static void shm_abort(loom_comm_t *base) {
    loom_comm_shm_t *c = (loom_comm_shm_t *)base;
    if (atomic_exchange(&c->aborted, 1)) return;
    shm_seg_t *segs[] = {&c->tp, &c->out, &c->in};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(segs); i++) {
        if (!segs[i]->base) continue;
        atomic_store(&segs[i]->hdr->abort, 1);
        seg_wake_all(c, segs[i]);
    }
}

static void shm_destroy(loom_comm_t *base) {
    loom_comm_shm_t *c = (loom_comm_shm_t *)base;
    shm_seg_t *segs[] = {&c->tp, &c->out, &c->in};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(segs); i++) {
        shm_seg_t *s = segs[i];
        if (s->base) {
            /* Peers waiting for this member fail now instead of at their timeout. */
            atomic_store(&s->members[s->self].left, 1);
            seg_wake_all(c, s);
        }
        seg_unlink(s);
        seg_unmap(s);
    }
    free(c->srcs);
    free(c);
}

/* ---- TP collectives ---------------------------------------------------- */

static uint8_t *tp_slot(const loom_comm_shm_t *c, int rank, uint32_t k) {
    return c->tp_data + ((size_t)rank * 2 + (k & 1)) * c->stride;
}

/* Steps 1-2: waits for this rank's slot to be free, fills and publishes it. */
static loom_status_t tp_begin(loom_comm_shm_t *c, uint32_t kind, const void *data, size_t bytes,
                              uint64_t deadline, loom_err_t *err) {
    LOOM_CHECK(shm_check(c, err));
    uint32_t k = c->op;
    int self = c->base.tp_rank;
    /* For k < 2 the target wraps to -1 or 0, which the zeroed counters have
     * reached; the modular comparison keeps this right when k wraps too. */
    for (int j = 0; j < c->base.tp_size; j++)
        if (j != self)
            LOOM_CHECK(shm_wait(c, &c->tp, &c->ctl[j].done, k - 1, j, deadline,
                                "a rank to finish reading", err));
    tp_ctl_t *me = &c->ctl[self];
    if (bytes) memcpy(tp_slot(c, self, k), data, bytes);
    me->meta[k & 1] = (tp_meta_t){.bytes = bytes, .kind = kind};
    shm_publish(&c->tp, &me->seq, k + 1);
    return LOOM_OK;
}

/* Step 3 for rank j: waits for its data and checks it is the same collective
 * (else the group is out of step: abort) and the same size (*mismatch). */
static loom_status_t tp_await(loom_comm_shm_t *c, int j, uint32_t kind, size_t bytes,
                              uint64_t deadline, int *mismatch, loom_err_t *err) {
    uint32_t k = c->op;
    LOOM_CHECK(shm_wait(c, &c->tp, &c->ctl[j].seq, k + 1, j, deadline, op_name(kind), err));
    tp_meta_t m = c->ctl[j].meta[k & 1];
    if (m.kind != kind)
        return shm_fail(c, err, LOOM_ERR_PROTOCOL,
                        "shm %s: tp rank %d runs a %s while rank %d runs a %s", op_name(kind), j,
                        op_name(m.kind), c->base.tp_rank, op_name(kind));
    if (m.bytes != bytes && !*mismatch) {
        *mismatch = 1;
        loom_err_set(err, LOOM_ERR_PROTOCOL,
                     "shm %s: tp rank %d contributes %llu bytes, rank %d %zu", op_name(kind), j,
                     (unsigned long long)m.bytes, c->base.tp_rank, bytes);
    }
    return LOOM_OK;
}

/* Step 4's end: this rank's reads of op k are over. */
static void tp_end(loom_comm_shm_t *c) {
    shm_publish(&c->tp, &c->ctl[c->base.tp_rank].done, c->op + 1);
    c->op++;
}

static loom_status_t shm_allreduce(loom_comm_t *base, float *buf, int64_t n, loom_err_t *err) {
    loom_comm_shm_t *c = (loom_comm_shm_t *)base;
    size_t bytes = (size_t)n * sizeof(float);
    uint64_t deadline = loom_comm_deadline(c->timeout_ms);
    LOOM_CHECK(tp_begin(c, OP_ALLREDUCE, buf, bytes, deadline, err));
    int mismatch = 0;
    for (int j = 0; j < base->tp_size; j++)
        if (j != base->tp_rank)
            LOOM_CHECK(tp_await(c, j, OP_ALLREDUCE, bytes, deadline, &mismatch, err));
    if (!mismatch) {
        /* Every rank sums the same slots in the same order: bitwise equal results. */
        for (int j = 0; j < base->tp_size; j++)
            c->srcs[j] = (const float *)tp_slot(c, j, c->op);
        loom_comm_sum_ranks(buf, c->srcs, base->tp_size, n);
    }
    tp_end(c);
    return mismatch ? LOOM_ERR_PROTOCOL : LOOM_OK;
}

static loom_status_t shm_gather(loom_comm_t *base, const void *send, size_t bytes, void *recv,
                                loom_err_t *err) {
    loom_comm_shm_t *c = (loom_comm_shm_t *)base;
    if (base->tp_rank == 0 && !recv)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "shm gather: tp rank 0 needs a receive buffer");
    uint64_t deadline = loom_comm_deadline(c->timeout_ms);
    LOOM_CHECK(tp_begin(c, OP_GATHER, send, bytes, deadline, err));
    int mismatch = 0;
    if (base->tp_rank == 0) {
        if (bytes) memcpy(recv, send, bytes);
        for (int j = 1; j < base->tp_size; j++) {
            LOOM_CHECK(tp_await(c, j, OP_GATHER, bytes, deadline, &mismatch, err));
            if (bytes && c->ctl[j].meta[c->op & 1].bytes == bytes)
                memcpy((uint8_t *)recv + (size_t)j * bytes, tp_slot(c, j, c->op), bytes);
        }
    }
    tp_end(c);
    return mismatch ? LOOM_ERR_PROTOCOL : LOOM_OK;
}

static loom_status_t shm_barrier(loom_comm_t *base, loom_err_t *err) {
    loom_comm_shm_t *c = (loom_comm_shm_t *)base;
    uint64_t deadline = loom_comm_deadline(c->timeout_ms);
    LOOM_CHECK(tp_begin(c, OP_BARRIER, NULL, 0, deadline, err));
    int mismatch = 0;
    for (int j = 0; j < base->tp_size; j++)
        if (j != base->tp_rank) LOOM_CHECK(tp_await(c, j, OP_BARRIER, 0, deadline, &mismatch, err));
    tp_end(c);
    return LOOM_OK;
}

/* ---- pipeline links ------------------------------------------------------ */

static loom_status_t shm_send_next(loom_comm_t *base, const void *buf, size_t bytes,
                                   loom_err_t *err) {
    loom_comm_shm_t *c = (loom_comm_shm_t *)base;
    if (!c->out.base)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "shm send_next: this worker has no next stage");
    LOOM_CHECK(shm_check(c, err));
    uint64_t deadline = loom_comm_deadline(c->timeout_ms);
    uint32_t h = c->sent;
    LOOM_CHECK(shm_wait(c, &c->out, &c->out_ring->tail, h - (SHM_RING - 1), 1, deadline,
                        "room in the ring (the next stage to take a message)", err));
    if (bytes) memcpy(c->out_data + (h % SHM_RING) * c->stride, buf, bytes);
    c->out_ring->bytes[h % SHM_RING] = bytes;
    shm_publish(&c->out, &c->out_ring->head, h + 1);
    c->sent = h + 1;
    return LOOM_OK;
}

static loom_status_t shm_recv_prev(loom_comm_t *base, void *buf, size_t bytes, loom_err_t *err) {
    loom_comm_shm_t *c = (loom_comm_shm_t *)base;
    if (!c->in.base)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "shm recv_prev: this worker has no previous stage");
    LOOM_CHECK(shm_check(c, err));
    uint64_t deadline = loom_comm_deadline(c->timeout_ms);
    uint32_t t = c->taken;
    LOOM_CHECK(shm_wait(c, &c->in, &c->in_ring->head, t + 1, 0, deadline,
                        "a message from the previous stage", err));
    uint64_t sent = c->in_ring->bytes[t % SHM_RING];
    if (sent == bytes && bytes) memcpy(buf, c->in_data + (t % SHM_RING) * c->stride, bytes);
    shm_publish(&c->in, &c->in_ring->tail, t + 1);
    c->taken = t + 1;
    if (sent != bytes)
        return loom_err_set(err, LOOM_ERR_PROTOCOL,
                            "shm recv_prev: the message has %llu bytes, %zu expected",
                            (unsigned long long)sent, bytes);
    return LOOM_OK;
}

static const loom_comm_ops_t shm_ops = {
    .name = "shm",
    .destroy = shm_destroy,
    .allreduce = shm_allreduce,
    .gather = shm_gather,
    .barrier = shm_barrier,
    .send_next = shm_send_next,
    .recv_prev = shm_recv_prev,
    .abort = shm_abort,
};

static int peer_ok(const loom_comm_peer_t *p) {
    return p && p->worker_id && *p->worker_id;
}

loom_status_t loom_comm_shm_create(const loom_comm_config_t *cfg, loom_comm_t **out,
                                   loom_err_t *err) {
    *out = NULL;
    if (!cfg->name || !*cfg->name || !cfg->self_id || !*cfg->self_id)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "shm comm: name and self_id are required");
    if (cfg->tp_size > 1 && (!cfg->tp_group || !peer_ok(&cfg->tp_group[0])))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "shm comm: tp_size %d needs the tp group", cfg->tp_size);
    if ((cfg->prev && !peer_ok(cfg->prev)) || (cfg->next && !peer_ok(cfg->next)))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "shm comm: a pipeline peer has no worker id");
    if (cfg->max_bytes > SHM_MAX_BYTES)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "shm comm: max_bytes %zu is too large",
                            cfg->max_bytes);

    loom_comm_shm_t *c = loom_xcalloc(1, sizeof *c);
    loom_comm_base_init(&c->base, &shm_ops, cfg);
    atomic_init(&c->aborted, 0);
    c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 0;
    c->spin_ns = loom_comm_spin_ns(SHM_SPIN_DEFAULT_NS);
    atomic_init(&c->spin_score, 0);
    c->pidns = pid_namespace();
    c->stride = align_up(cfg->max_bytes ? cfg->max_bytes : 1, 64);
    c->srcs = loom_xcalloc((size_t)cfg->tp_size, sizeof *c->srcs);
    uint64_t deadline =
        loom_comm_deadline(cfg->timeout_ms > 0 ? cfg->timeout_ms : SHM_CREATE_DEFAULT_MS);
    loom_status_t st = LOOM_OK;
    size_t ctl_off, data_off, size;

    /* Open every segment first, then wait for all of them: no order to agree on. */
    if (cfg->tp_size > 1) {
        const char *parts[] = {cfg->name, "tp", cfg->tp_group[0].worker_id};
        size = seg_layout(cfg->tp_size, (size_t)cfg->tp_size * sizeof(tp_ctl_t),
                          (size_t)cfg->tp_size * 2 * c->stride, &ctl_off, &data_off);
        st = seg_open(c, &c->tp, parts, 3, size, cfg->tp_size, cfg->tp_rank, "tp group", err);
        if (c->tp.base) {
            c->ctl = (tp_ctl_t *)(c->tp.base + ctl_off);
            c->tp_data = c->tp.base + data_off;
        }
        if (st < 0) goto fail;
    }
    size = seg_layout(2, sizeof(ring_ctl_t), SHM_RING * c->stride, &ctl_off, &data_off);
    if (cfg->next) {
        const char *parts[] = {cfg->name, "pp", cfg->self_id, cfg->next->worker_id};
        st = seg_open(c, &c->out, parts, 4, size, 2, 0, "link to the next stage", err);
        if (c->out.base) {
            c->out_ring = (ring_ctl_t *)(c->out.base + ctl_off);
            c->out_data = c->out.base + data_off;
        }
        if (st < 0) goto fail;
    }
    if (cfg->prev) {
        const char *parts[] = {cfg->name, "pp", cfg->prev->worker_id, cfg->self_id};
        st = seg_open(c, &c->in, parts, 4, size, 2, 1, "link from the previous stage", err);
        if (c->in.base) {
            c->in_ring = (ring_ctl_t *)(c->in.base + ctl_off);
            c->in_data = c->in.base + data_off;
        }
        if (st < 0) goto fail;
    }
    shm_seg_t *segs[] = {&c->tp, &c->out, &c->in};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(segs); i++) {
        if (!segs[i]->base) continue;
        st = seg_join(c, segs[i], deadline, err);
        if (st < 0) goto fail;
    }
    for (size_t i = 0; i < LOOM_ARRAY_LEN(segs); i++)
        seg_unlink(segs[i]);
    LOOM_DEBUG("shm comm '%s': tp rank %d of %d up (%s%s)", cfg->name, cfg->tp_rank, cfg->tp_size,
               cfg->prev ? "prev " : "", cfg->next ? "next" : "");
    *out = &c->base;
    return LOOM_OK;

fail:
    /* Tell the members already attached, so they fail now rather than at their timeout. */
    shm_abort(&c->base);
    shm_destroy(&c->base);
    return st;
}
