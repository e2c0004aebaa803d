/* Constrained decoding in the coordinator: one grammar matcher per
 * constrained request (common/grammar.h), its allowed-token mask shipped in
 * each step plan row (control.proto SampleParams grammar_mask / grammar_ids)
 * and applied by the last stage on each TP rank's vocabulary slice
 * (worker/logits_proc.c) before sampling.
 *
 * The sequence's tokens are the truth: before each mask the matcher is
 * brought to the sequence's output (the new tokens accepted, or a replay when
 * the output is shorter than what the matcher saw), so preemption,
 * re-prefill, prefix-cache hits and worker failover need no extra state.
 * The final text is checked byte-wise against the grammar: a request that
 * ends on anything but a complete match reports finish_reason length.
 *
 * Everything here runs on the coordinator's reactor thread (grammars and
 * matchers are not thread-safe); a grammar the cache lacks is compiled on
 * the preparation pool (prepare.h) and handed in with loom_structured_put. */
#ifndef LOOM_STRUCTURED_H
#define LOOM_STRUCTURED_H

#include <stddef.h>
#include <stdint.h>

#include "common/grammar.h"
#include "common/model_config.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "loom/v1/control.pb-c.h"

typedef struct loom_structured loom_structured_t; /* server-wide: vocabulary and grammar cache */
typedef struct loom_guide loom_guide_t;           /* one request's matcher */

/* Cheap: the vocabulary is built on the first constrained request.
 * cache_bytes bounds the grammar cache (0: only its entry count). */
loom_structured_t *loom_structured_create(const loom_tokenizer_t *tok, const loom_model_config_t *mcfg,
                                          size_t cache_bytes);

/* The cached grammar of (kind, spec): 1 and a new reference, or 0 (compile
 * it elsewhere, then loom_structured_put and loom_guide_create_from). */
int loom_structured_lookup(loom_structured_t *s, int kind, const char *spec, size_t len, loom_grammar_t **out);
void loom_structured_put(loom_structured_t *s, int kind, const char *spec, size_t len, loom_grammar_t *gr);
/* A guide over a compiled grammar (the guide takes its own reference);
 * after as for loom_guide_create. */
loom_status_t loom_guide_create_from(loom_structured_t *s, loom_grammar_t *gr, const char *after, loom_guide_t **out,
                                     loom_err_t *err);
/* The grammar cache's bytes now, for logs and tests. */
size_t loom_structured_cache_bytes(const loom_structured_t *s);
void loom_structured_destroy(loom_structured_t **s_p);

/* kind: api.proto guide_kind (1..6, loom_grammar_kind_t). Bad specs are
 * INVALID_ARGUMENT / UNSUPPORTED with the compiler's message. after (NULL
 * or "": none): a reasoning model's end-of-reasoning marker (or several,
 * '\n' between them: the first to come counts); the output is
 * free up to its first occurrence (rows unconstrained) and the grammar
 * holds from the byte after it, the rest of the token that ends the marker
 * included; the text check reads what follows the marker too. */
loom_status_t loom_guide_create(loom_structured_t *s, int kind, const char *spec, size_t len, const char *after,
                                loom_guide_t **out, loom_err_t *err);
void loom_guide_destroy(loom_guide_t **g_p);

/* Fills sp's grammar fields for the token after out[0..n_out) followed by
 * drafts[0..n_drafts) (a speculative verify row; 0 drafts: an ordinary
 * row). The matcher itself only ever follows out: the drafts advance a
 * copy of it, so rejected drafts leave nothing behind. A draft the grammar
 * refuses makes the later rows EOS-only (never used: the row before masks
 * that draft out, so the target rejects it). alloc gives memory that lives
 * until the plan is sent. */
void loom_guide_fill_row(loom_guide_t *g, const int32_t *out, int n_out, const int32_t *drafts, int n_drafts,
                         void *(*alloc)(void *ctx, size_t bytes), void *ctx, Loom__V1__SampleParams *sp);

/* The text sent so far: appended piece by piece, checked at the end. */
void loom_guide_text_append(loom_guide_t *g, const char *text, size_t n);
/* 1 when the text sent so far is a complete sentence of the grammar. */
int loom_guide_text_complete(const loom_guide_t *g);

/* Counters for the tests and /metrics: masks computed, their encodings,
 * and tokens the matcher refused (a worker that did not apply a mask). */
typedef struct loom_structured_stats {
    uint64_t masks, bitset_rows, list_rows, refused;
} loom_structured_stats_t;
void loom_structured_stats(const loom_structured_t *s, loom_structured_stats_t *out);

#endif
