/* Sampling controls: request -> step-plan rows (see sampling_params.h). */
#include "coordinator/sampling_params.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "coordinator/structured.h"

struct loom_sparams {
    float min_p, presence, frequency, repetition;
    int32_t *bias_ids; /* (n_bias) */
    float *bias_values;
    int n_bias;
    int32_t *allowed; /* (n_allowed) ascending, distinct */
    int n_allowed;
    int32_t **bad;    /* (n_bad) token sequences of the bad words, both spellings */
    int *bad_len;
    int n_bad;
    int min_tokens;
    int32_t *end_ids; /* (n_end) EOS and stop ids: banned while fewer than min_tokens are generated */
    int n_end;
    int logprobs, top_logprobs;
    loom_guide_t *guide; /* constrained decoding (structured.h), owned */
};

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static int in_vocab(int32_t id, const loom_model_config_t *mcfg) {
    return id >= 0 && id < mcfg->vocab_size;
}

static void add_bad(loom_sparams_t *p, const int32_t *ids, int n) {
    if (n <= 0) return;
    for (int i = 0; i < p->n_bad; i++) /* the two spellings often tokenize alike */
        if (p->bad_len[i] == n && !memcmp(p->bad[i], ids, (size_t)n * sizeof *ids)) return;
    p->bad = loom_xrealloc(p->bad, (size_t)(p->n_bad + 1) * sizeof *p->bad);
    p->bad_len = loom_xrealloc(p->bad_len, (size_t)(p->n_bad + 1) * sizeof *p->bad_len);
    p->bad[p->n_bad] = loom_xmalloc((size_t)n * sizeof(int32_t));
    memcpy(p->bad[p->n_bad], ids, (size_t)n * sizeof(int32_t));
    p->bad_len[p->n_bad++] = n;
}

loom_status_t loom_sparams_create(const Loom__V1__GenerateRequest *g, const loom_tokenizer_t *tok,
                                  const loom_model_config_t *mcfg, loom_sparams_t **out, loom_err_t *err) {
    *out = NULL;
    const Loom__V1__SamplingParams *sp = g->sampling;
    float min_p = sp ? sp->min_p : 0.0f, pres = sp ? sp->presence_penalty : 0.0f;
    float freq = sp ? sp->frequency_penalty : 0.0f, rep = sp ? sp->repetition_penalty : 0.0f;
    if (!(min_p >= 0.0f && min_p <= 1.0f))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "min_p %g is outside [0, 1]", (double)min_p);
    if (!(pres >= -2.0f && pres <= 2.0f))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "presence_penalty %g is outside [-2, 2]", (double)pres);
    if (!(freq >= -2.0f && freq <= 2.0f))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "frequency_penalty %g is outside [-2, 2]", (double)freq);
    if (!(rep >= 0.0f && rep <= 10.0f))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "repetition_penalty %g is outside (0, 10]", (double)rep);
    if (g->n_logit_bias_ids != g->n_logit_bias_values)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "logit_bias: %zu ids but %zu values", g->n_logit_bias_ids,
                            g->n_logit_bias_values);
    if (g->n_logit_bias_ids > LOOM_MAX_LOGIT_BIAS)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "logit_bias has %zu entries; at most %d are allowed",
                            g->n_logit_bias_ids, LOOM_MAX_LOGIT_BIAS);
    for (size_t i = 0; i < g->n_logit_bias_ids; i++) {
        if (!in_vocab(g->logit_bias_ids[i], mcfg))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "logit_bias: token id %d is outside the vocabulary [0, %d)",
                                g->logit_bias_ids[i], mcfg->vocab_size);
        if (!(g->logit_bias_values[i] >= -100.0f && g->logit_bias_values[i] <= 100.0f))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "logit_bias: the bias of token %d, %g, is outside [-100, 100]",
                                g->logit_bias_ids[i], (double)g->logit_bias_values[i]);
    }
    if (g->n_allowed_token_ids > LOOM_MAX_ALLOWED_IDS)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "allowed_token_ids has %zu ids; at most %d are allowed",
                            g->n_allowed_token_ids, LOOM_MAX_ALLOWED_IDS);
    for (size_t i = 0; i < g->n_allowed_token_ids; i++)
        if (!in_vocab(g->allowed_token_ids[i], mcfg))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "allowed_token_ids: token id %d is outside the vocabulary [0, %d)",
                                g->allowed_token_ids[i], mcfg->vocab_size);
    if (g->n_bad_words > LOOM_MAX_BAD_WORDS)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%zu bad_words; at most %d are allowed", g->n_bad_words,
                            LOOM_MAX_BAD_WORDS);
    for (size_t i = 0; i < g->n_bad_words; i++)
        if (!g->bad_words[i][0] || strlen(g->bad_words[i]) > 256)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "bad_words[%zu] must be 1 to 256 bytes long", i);
    if (g->max_tokens > 0 && g->min_tokens > g->max_tokens)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "min_tokens %u is more than max_tokens %u", g->min_tokens,
                            g->max_tokens);
    if (g->top_logprobs > LOOM_MAX_TOP_LOGPROBS)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "top_logprobs %u is over the limit of %d", g->top_logprobs,
                            LOOM_MAX_TOP_LOGPROBS);
    int rep_on = rep > 0.0f && rep != 1.0f;
    if (!g->logprobs && min_p == 0.0f && pres == 0.0f && freq == 0.0f && !rep_on && !g->n_logit_bias_ids && !g->n_allowed_token_ids &&
        !g->n_bad_words && !g->min_tokens)
        return LOOM_OK;

    loom_sparams_t *p = loom_xcalloc(1, sizeof *p);
    p->min_p = min_p;
    p->logprobs = g->logprobs;
    p->top_logprobs = g->logprobs ? (int)g->top_logprobs : 0;
    p->presence = pres;
    p->frequency = freq;
    p->repetition = rep_on ? rep : 0.0f;
    if (g->n_logit_bias_ids) {
        p->n_bias = (int)g->n_logit_bias_ids;
        p->bias_ids = loom_xmalloc((size_t)p->n_bias * sizeof *p->bias_ids);
        p->bias_values = loom_xmalloc((size_t)p->n_bias * sizeof *p->bias_values);
        memcpy(p->bias_ids, g->logit_bias_ids, (size_t)p->n_bias * sizeof *p->bias_ids);
        memcpy(p->bias_values, g->logit_bias_values, (size_t)p->n_bias * sizeof *p->bias_values);
    }
    if (g->n_allowed_token_ids) {
        p->allowed = loom_xmalloc(g->n_allowed_token_ids * sizeof *p->allowed);
        memcpy(p->allowed, g->allowed_token_ids, g->n_allowed_token_ids * sizeof *p->allowed);
        qsort(p->allowed, g->n_allowed_token_ids, sizeof *p->allowed, cmp_i32);
        for (size_t i = 0; i < g->n_allowed_token_ids; i++)
            if (!p->n_allowed || p->allowed[p->n_allowed - 1] != p->allowed[i]) p->allowed[p->n_allowed++] = p->allowed[i];
    }
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    for (size_t i = 0; i < g->n_bad_words; i++) {
        const char *w = g->bad_words[i];
        size_t len = strlen(w);
        char *spaced = loom_xmalloc(len + 2);
        spaced[0] = ' ';
        memcpy(spaced + 1, w, len + 1);
        for (int v = 0; v < 2; v++) {
            const char *t = v ? spaced : w;
            if (loom_tokenizer_encode(tok, t, strlen(t), 0, 0, &ids, &n_ids, &cap, err) < 0) {
                free(spaced);
                free(ids);
                loom_sparams_destroy(&p);
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "bad_words[%zu] cannot be tokenized", i);
            }
            add_bad(p, ids, n_ids);
        }
        free(spaced);
    }
    free(ids);
    p->min_tokens = (int)g->min_tokens;
    if (p->min_tokens > 0) {
        p->end_ids = loom_xmalloc((size_t)(mcfg->n_eos + 1 + (int)g->n_stop_token_ids) * sizeof *p->end_ids);
        if (!g->ignore_eos) {
            for (int i = 0; i < mcfg->n_eos; i++) p->end_ids[p->n_end++] = mcfg->eos_ids[i];
            int te = loom_tokenizer_eos_id(tok);
            if (te >= 0 && in_vocab(te, mcfg)) p->end_ids[p->n_end++] = te;
        }
        for (size_t i = 0; i < g->n_stop_token_ids; i++) p->end_ids[p->n_end++] = g->stop_token_ids[i];
    }
    *out = p;
    return LOOM_OK;
}

void loom_sparams_destroy(loom_sparams_t **p_p) {
    if (!p_p || !*p_p) return;
    loom_sparams_t *p = *p_p;
    free(p->bias_ids);
    free(p->bias_values);
    free(p->allowed);
    for (int i = 0; i < p->n_bad; i++) free(p->bad[i]);
    free(p->bad);
    free(p->bad_len);
    free(p->end_ids);
    loom_guide_destroy(&p->guide);
    free(p);
    *p_p = NULL;
}

int loom_sparams_min_tokens(const loom_sparams_t *p) {
    return p ? p->min_tokens : 0;
}

void loom_sparams_set_guide(loom_sparams_t **p, loom_guide_t *guide) {
    if (!*p) *p = loom_xcalloc(1, sizeof **p);
    loom_guide_destroy(&(*p)->guide);
    (*p)->guide = guide;
    (*p)->min_tokens = 0;
    (*p)->n_end = 0;
}

loom_guide_t *loom_sparams_guide(const loom_sparams_t *p) {
    return p ? p->guide : NULL;
}

void loom_sparams_arena_free(loom_sparams_arena_t *a) {
    for (int i = 0; i < a->n; i++) free(a->blocks[i]);
    free(a->blocks);
    *a = (loom_sparams_arena_t){0};
}

static void *arena_alloc(loom_sparams_arena_t *a, size_t bytes) {
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 16;
        a->blocks = loom_xrealloc(a->blocks, (size_t)a->cap * sizeof *a->blocks);
    }
    return a->blocks[a->n++] = loom_xmalloc(bytes ? bytes : 1);
}

static void *arena_alloc_cb(void *ctx, size_t bytes) {
    return arena_alloc(ctx, bytes);
}

static void arena_reset(loom_sparams_arena_t *a) {
    for (int i = 0; i < a->n; i++) free(a->blocks[i]);
    a->n = 0;
}

/* One row: bans (bad words whose prefix ends the output, end ids before
 * min_tokens) and, with a penalty on, the sequence's distinct ids and their
 * output counts. The row samples the token after q's tokens followed by
 * drafts[0..n_drafts) (a speculative verify row; none for an ordinary
 * one), so everything is computed as if the drafts were already output:
 * that is what plain decoding would see if they are accepted, and the row
 * is not used otherwise. out = tokens[n_prompt - step_offset, n_tokens): a
 * continued request's earlier output is the tail of its prompt. */
static void fill_row(loom_sparams_arena_t *a, const loom_sparams_t *p, const loom_seq_t *q, const int32_t *drafts,
                     int n_drafts, Loom__V1__SampleParams *sp) {
    const int32_t *tokens = q->tokens;
    int n_tokens = q->n_tokens;
    if (n_drafts > 0) {
        int32_t *t = arena_alloc(a, (size_t)(n_tokens + n_drafts) * sizeof *t);
        memcpy(t, q->tokens, (size_t)n_tokens * sizeof *t);
        memcpy(t + n_tokens, drafts, (size_t)n_drafts * sizeof *t);
        tokens = t;
        n_tokens += n_drafts;
    }
    int first_out = q->n_prompt - (int)q->step_offset;
    const int32_t *out = tokens + first_out;
    int n_out = n_tokens - first_out;
    int n_committed = q->n_tokens - first_out;
    sp->min_p = p->min_p;
    sp->logprobs = p->logprobs != 0;
    sp->top_logprobs = (uint32_t)p->top_logprobs;
    sp->presence_penalty = p->presence;
    sp->frequency_penalty = p->frequency;
    sp->repetition_penalty = p->repetition;
    sp->bias_ids = p->bias_ids;
    sp->bias_values = p->bias_values;
    sp->n_bias_ids = sp->n_bias_values = (size_t)p->n_bias;
    sp->allowed_ids = p->allowed;
    sp->n_allowed_ids = (size_t)p->n_allowed;

    int n_ban = n_out < p->min_tokens ? p->n_end : 0;
    int32_t *ban = arena_alloc(a, (size_t)(n_ban + p->n_bad) * sizeof *ban);
    if (n_ban) memcpy(ban, p->end_ids, (size_t)n_ban * sizeof *ban);
    for (int i = 0; i < p->n_bad; i++) { /* the last token of a bad word whose other tokens end the output */
        int l = p->bad_len[i] - 1;
        if (l <= n_out && !memcmp(out + n_out - l, p->bad[i], (size_t)l * sizeof *out)) ban[n_ban++] = p->bad[i][l];
    }
    sp->banned_ids = ban;
    sp->n_banned_ids = (size_t)n_ban;
    if (p->guide) loom_guide_fill_row(p->guide, out, n_committed, drafts, n_drafts, arena_alloc_cb, a, sp);

    int rep = p->repetition > 0.0f;
    if (!rep && p->presence == 0.0f && p->frequency == 0.0f) return;
    /* repetition looks at prompt and output, frequency and presence at the output only */
    const int32_t *src = rep ? tokens : out;
    int n = rep ? n_tokens : n_out;
    int32_t *sorted = arena_alloc(a, (size_t)n * sizeof *sorted);
    memcpy(sorted, src, (size_t)n * sizeof *sorted);
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_i32);
    int32_t *seen = arena_alloc(a, (size_t)n * sizeof *seen), *counts = arena_alloc(a, (size_t)n * sizeof *counts);
    int n_seen = 0;
    for (int i = 0; i < n; i++)
        if (!n_seen || seen[n_seen - 1] != sorted[i]) {
            seen[n_seen] = sorted[i];
            counts[n_seen++] = 0;
        }
    for (int i = 0; i < n_out; i++) { /* binary search each output id */
        int lo = 0, hi = n_seen - 1;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (seen[mid] < out[i]) lo = mid + 1;
            else hi = mid;
        }
        counts[lo]++;
    }
    sp->seen_ids = seen;
    sp->out_counts = counts;
    sp->n_seen_ids = sp->n_out_counts = (size_t)n_seen;
}

int loom_sparams_plan_ahead(const loom_sparams_t *p, const loom_seq_t *q) {
    if (!p) return 1;
    if (p->guide || p->presence != 0.0f || p->frequency != 0.0f || p->repetition > 0.0f || p->n_bad) return 0;
    int n_out = q->n_tokens - (q->n_prompt - (int)q->step_offset);
    return n_out >= p->min_tokens; /* past min_tokens, the bans are off whatever it samples */
}

void loom_sparams_fill_plan(loom_sparams_arena_t *a, const loom_microbatch_t *mb, Loom__V1__SampleParams *const *sp) {
    arena_reset(a);
    for (int i = 0; i < mb->n_logits; i++) {
        const loom_seq_t *q = mb->logit_seq ? mb->logit_seq[i] : NULL; /* NULL: rows without sequences (tests) */
        if (!q || !q->sparams) continue;
        /* a verify row j of a speculating sequence comes after its drafts 0..j-1,
         * which follow the fed token (row i - j) in the batch */
        int j = mb->spec_row && mb->spec_row[i] ? (int)(mb->steps[i] - (uint64_t)(q->n_tokens - q->n_prompt)) : 0;
        const int32_t *drafts = j > 0 ? mb->tokens + mb->logit_rows[i - j] + 1 : NULL;
        fill_row(a, q->sparams, q, drafts, j > 0 ? j : 0, sp[i]);
    }
}

int loom_lp_view_bind(loom_lp_view_t *v, const loom_microbatch_t *mb, const Loom__V1__StepResult *r, int vocab_size,
                      char *msg, size_t n) {
    v->r = NULL;
    if (!r->n_logprobs && !r->n_n_top && !r->n_top_ids && !r->n_top_logprobs) return 0;
    int rows = mb->n_logits;
    if (r->n_logprobs != (size_t)rows || r->n_n_top != (size_t)rows || r->n_top_ids != r->n_top_logprobs) {
        snprintf(msg, n, "a worker returned logprobs for %zu of %d rows", r->n_logprobs, rows);
        return -1;
    }
    if (rows > v->cap) {
        v->cap = rows;
        v->top_off = loom_xrealloc(v->top_off, (size_t)rows * sizeof *v->top_off);
    }
    size_t off = 0;
    for (int i = 0; i < rows; i++) {
        if (r->n_top[i] > LOOM_MAX_TOP_LOGPROBS || off + r->n_top[i] > r->n_top_ids) {
            snprintf(msg, n, "a worker returned a malformed top_logprobs list");
            return -1;
        }
        v->top_off[i] = (int)off;
        off += r->n_top[i];
    }
    for (size_t i = 0; i < r->n_top_ids; i++)
        if (r->top_ids[i] < 0 || r->top_ids[i] >= vocab_size) {
            snprintf(msg, n, "a worker returned a top_logprobs id outside the vocabulary");
            return -1;
        }
    v->mb = mb;
    v->r = r;
    return 0;
}

void loom_lp_view_unbind(loom_lp_view_t *v) {
    v->r = NULL;
    v->mb = NULL;
}

void loom_lp_view_free(loom_lp_view_t *v) {
    free(v->top_off);
    *v = (loom_lp_view_t){0};
}

const loom_token_lp_t *loom_lp_view_get(loom_lp_view_t *v, const loom_seq_t *seq) {
    if (!v->r) return NULL;
    for (int i = 0; i < v->mb->n_logits; i++) {
        if (v->mb->logit_seq[i] != seq) continue;
        /* a speculating sequence has several rows: the one that sampled its latest token */
        if (v->mb->steps && v->mb->steps[i] != (uint64_t)(seq->n_tokens - seq->n_prompt - 1)) continue;
        if (isnan(v->r->logprobs[i])) return NULL;
        v->cur = (loom_token_lp_t){.logprob = v->r->logprobs[i], .n_top = (int)v->r->n_top[i],
                                   .top_ids = v->r->top_ids + v->top_off[i], .top_lps = v->r->top_logprobs + v->top_off[i]};
        return &v->cur;
    }
    return NULL;
}
