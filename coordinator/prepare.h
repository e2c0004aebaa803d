/* Per-request work that grows with its input, off the reactor: grammar
 * compilation, long-prompt tokenizing and a runtime LoRA adapter's read
 * (vLLM's /v1/load_lora_adapter: its directory checked against the model and
 * its content digested) run on a small pool of threads and come back to the
 * reactor through a done queue and a pipe it polls (STYLE.md: compute on its
 * own threads, results handed back).
 *
 * A job's states:
 *   QUEUED   submitted by the reactor, waiting for a thread
 *   RUNNING  a thread compiles its grammar (within its loom_grammar_limits:
 *            a deadline and a byte bound) and tokenizes its prompt, or
 *            reads its adapter
 *   DONE     on the done queue, the pipe readable; loom_prep_take hands it
 *            to the reactor, which frees it with loom_prep_job_free
 * Every submitted job comes back exactly once. loom_prep_cancel (its request
 * was cancelled, its client left) marks it: a QUEUED job is not run, a
 * RUNNING one stops at its next bound check, and it comes back with
 * cancelled set (an adapter's read is not interrupted). Jobs share nothing
 * but the read-only tokenizer. */
#ifndef LOOM_PREPARE_H
#define LOOM_PREPARE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/grammar.h"
#include "common/model_config.h"
#include "common/status.h"
#include "common/tokenizer.h"

typedef struct loom_prep loom_prep_t;

typedef struct loom_prep_job {
    /* in (set before loom_prep_submit) */
    void *ctx;                  /* the submitter's */
    int kind;                   /* grammar kind (0: no grammar to compile) */
    char *spec;                 /* owned copy */
    size_t len;
    loom_grammar_limits_t lim;  /* deadline_ns, max_bytes */
    const loom_tokenizer_t *tok; /* non-NULL: tokenize prompt */
    char *prompt;               /* owned copy */
    int add_bos, parse_special;
    /* an adapter load (name non-NULL; then no grammar and no prompt): the
     * directory read and checked as loom_lora_serve_validate does */
    struct {
        char *name, *path;       /* owned copies */
        loom_model_config_t cfg; /* the base model's */
        int max_rank;            /* --max-lora-rank */
        long delay_ms;           /* test hook LOOM_TEST_LORA_LOAD_DELAY_MS: sleep first */
        uint8_t digest[32];      /* out: the content digest */
        int rank;                /* out: the largest rank */
        double read_s;           /* out */
    } lora;
    /* a remote prefill's blocks in a KV tier (kv.whole non-NULL; the ids
     * are in ids already): how many of kv.hashes, from the first, are whole
     * (kv.whole reads their files, off the reactor) */
    struct {
        int (*whole)(void *conn, const uint64_t *hashes, int n);
        void *conn;
        uint64_t *hashes; /* owned */
        int n;
        int have;  /* out */
        double read_s; /* out */
    } kv;
    /* out */
    loom_grammar_t *grammar; /* compiled (NULL on failure or without kind) */
    int32_t *ids;            /* the prompt's tokens (owned) */
    int n_ids;
    loom_status_t status;
    loom_err_t err;
    double compile_s, tokenize_s, queued_s;
    _Atomic int cancelled;
    uint64_t t_submit;
    struct loom_prep_job *next;
} loom_prep_job_t;

loom_status_t loom_prep_create(int n_threads, loom_prep_t **out, loom_err_t *err);
/* Stops the threads (cancelling what runs) and frees every job left. */
void loom_prep_destroy(loom_prep_t **p_p);
/* Readable when a job is done: poll it, then loom_prep_take until NULL. */
int loom_prep_fd(const loom_prep_t *p);
/* Takes ownership of j. */
void loom_prep_submit(loom_prep_t *p, loom_prep_job_t *j);
/* The next done job (NULL: none); the caller owns it. */
loom_prep_job_t *loom_prep_take(loom_prep_t *p);
/* Thread-safe; the job still comes back through loom_prep_take. */
void loom_prep_cancel(loom_prep_job_t *j);
void loom_prep_job_free(loom_prep_job_t **j_p);
/* Jobs queued or running. */
int loom_prep_pending(const loom_prep_t *p);

#endif
