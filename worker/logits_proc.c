/* The worker's side of the sampling controls (see logits_proc.h). */
#include "worker/logits_proc.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/sampling.h"

static void edits_of(const Loom__V1__SampleParams *sp, loom_logit_edits_t *e) {
    *e = (loom_logit_edits_t){.allowed = sp->allowed_ids, .n_allowed = (int)sp->n_allowed_ids,
                              .banned = sp->banned_ids, .n_banned = (int)sp->n_banned_ids,
                              .bias_ids = sp->bias_ids, .bias = sp->bias_values, .n_bias = (int)sp->n_bias_ids,
                              .seen_ids = sp->seen_ids, .out_counts = sp->out_counts, .n_seen = (int)sp->n_seen_ids,
                              .repetition = sp->repetition_penalty, .frequency = sp->frequency_penalty,
                              .presence = sp->presence_penalty};
}

static loom_status_t check_ids(const int32_t *ids, size_t n, int vocab_size, int ascending, const char *what,
                               int row, loom_err_t *err) {
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= vocab_size)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: %s id %d is outside the vocabulary [0, %d)",
                                row, what, ids[i], vocab_size);
        if (ascending && i > 0 && ids[i] <= ids[i - 1])
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: %s ids are not strictly ascending", row,
                                what);
    }
    return LOOM_OK;
}

static loom_status_t check_row(const Loom__V1__SampleParams *sp, int vocab_size, int r, loom_err_t *err) {
    if (sp->n_bias_ids != sp->n_bias_values || sp->n_seen_ids != sp->n_out_counts)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: bias or count arrays of unequal length", r);
    LOOM_CHECK(check_ids(sp->allowed_ids, sp->n_allowed_ids, vocab_size, 1, "allowed", r, err));
    LOOM_CHECK(check_ids(sp->banned_ids, sp->n_banned_ids, vocab_size, 0, "banned", r, err));
    LOOM_CHECK(check_ids(sp->bias_ids, sp->n_bias_ids, vocab_size, 0, "bias", r, err));
    LOOM_CHECK(check_ids(sp->seen_ids, sp->n_seen_ids, vocab_size, 1, "seen", r, err));
    for (size_t i = 0; i < sp->n_bias_values; i++)
        if (!isfinite(sp->bias_values[i]))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: a logit bias is not finite", r);
    for (size_t i = 0; i < sp->n_out_counts; i++)
        if (sp->out_counts[i] < 0)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: a negative token count", r);
    if (sp->n_grammar_mask && sp->n_grammar_mask != ((size_t)vocab_size + 31) / 32)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: grammar mask of %zu words for a vocabulary of %d",
                            r, sp->n_grammar_mask, vocab_size);
    LOOM_CHECK(check_ids(sp->grammar_ids, sp->n_grammar_ids, vocab_size, 1, "grammar", r, err));
    if (!isfinite(sp->repetition_penalty) || sp->repetition_penalty < 0.0f || !isfinite(sp->frequency_penalty) ||
        !isfinite(sp->presence_penalty) || !(sp->min_p >= 0.0f && sp->min_p <= 1.0f))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: a penalty or min_p out of range", r);
    return LOOM_OK;
}

/* The grammar's allowed tokens (control.proto grammar_mask / grammar_ids)
 * on this rank's slice: every other token is -inf. */
static void apply_grammar(float *row, int n, int lo, const Loom__V1__SampleParams *sp) {
    if (sp->n_grammar_mask) {
        const uint32_t *m = sp->grammar_mask;
        for (int i = 0; i < n; i++) {
            uint32_t id = (uint32_t)(lo + i);
            if (!(m[id >> 5] >> (id & 31) & 1u)) row[i] = -INFINITY;
        }
        return;
    }
    size_t j = 0; /* ascending ids: one merge walk */
    for (int i = 0; i < n; i++) {
        while (j < sp->n_grammar_ids && sp->grammar_ids[j] < lo + i) j++;
        if (j == sp->n_grammar_ids || sp->grammar_ids[j] != lo + i) row[i] = -INFINITY;
    }
}

loom_status_t loom_logits_process(loom_backend_t *be, float *logits, int n_rows, int vocab_begin, int vocab_len,
                                  int vocab_size, Loom__V1__SampleParams *const *sp, float **buf, size_t *cap,
                                  loom_err_t *err) {
    for (int r = 0; r < n_rows; r++) LOOM_CHECK(check_row(sp[r], vocab_size, r, err));
    size_t row_bytes = (size_t)vocab_len * sizeof(float);
    for (int r = 0; r < n_rows; r++) {
        loom_logit_edits_t e;
        edits_of(sp[r], &e);
        if (!loom_logits_edits_active(&e) && !sp[r]->grammar) continue;
        if (*cap < (size_t)vocab_len) { /* once per shard: the row size never changes */
            free(*buf);
            *buf = loom_xmalloc(row_bytes);
            *cap = (size_t)vocab_len;
        }
        float *dev = logits + (size_t)r * (size_t)vocab_len;
        loom_backend_download(be, *buf, dev, row_bytes);
        loom_logits_edit(*buf, vocab_len, vocab_begin, &e);
        if (sp[r]->grammar) apply_grammar(*buf, vocab_len, vocab_begin, sp[r]);
        loom_backend_upload(be, dev, *buf, row_bytes);
    }
    return LOOM_OK;
}

/* ---- log probabilities ---- */

void loom_logprobs_free(loom_logprobs_t *l) {
    free(l->raw);
    free(l->slot);
    free(l->parts);
    free(l->ids);
    free(l->vals);
    free(l->cand_raw);
    free(l->lp);
    free(l->n_top);
    free(l->top_ids);
    free(l->top_lps);
    *l = (loom_logprobs_t){0};
}

static void grow_rows(loom_logprobs_t *l, int rows) {
    if (rows <= l->cap_rows) return;
    loom_logprobs_free(l);
    size_t n = (size_t)rows;
    l->slot = loom_xmalloc(n * sizeof *l->slot);
    l->parts = loom_xcalloc(n, sizeof *l->parts);
    l->ids = loom_xmalloc(n * LOOM_MAX_TOP_LOGPROBS * sizeof *l->ids);
    l->vals = loom_xmalloc(n * LOOM_MAX_TOP_LOGPROBS * sizeof *l->vals);
    l->cand_raw = loom_xmalloc(n * LOOM_SAMPLE_MAX_CAND * sizeof *l->cand_raw);
    l->lp = loom_xmalloc(n * sizeof *l->lp);
    l->n_top = loom_xmalloc(n * sizeof *l->n_top);
    l->top_ids = loom_xmalloc(n * LOOM_MAX_TOP_LOGPROBS * sizeof *l->top_ids);
    l->top_lps = loom_xmalloc(n * LOOM_MAX_TOP_LOGPROBS * sizeof *l->top_lps);
    l->cap_rows = rows;
}

loom_status_t loom_logprobs_capture(loom_logprobs_t *l, loom_backend_t *be, const float *logits, int n_rows,
                                    int vocab_begin, int vocab_len, Loom__V1__SampleParams *const *sp,
                                    loom_err_t *err) {
    int n_lp = 0;
    for (int r = 0; r < n_rows; r++) {
        if (sp[r]->top_logprobs > LOOM_MAX_TOP_LOGPROBS)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: top_logprobs %u is over %d", r,
                                sp[r]->top_logprobs, LOOM_MAX_TOP_LOGPROBS);
        n_lp += sp[r]->logprobs != 0;
    }
    if (n_lp == 0) return LOOM_OK;
    grow_rows(l, n_rows);
    l->any = 1;
    size_t need = (size_t)n_lp * (size_t)vocab_len;
    if (need > l->cap_raw) {
        free(l->raw);
        l->raw = loom_xmalloc(need * sizeof *l->raw);
        l->cap_raw = need;
    }
    l->vocab_begin = vocab_begin;
    l->vocab_len = vocab_len;
    int s = 0;
    for (int r = 0; r < n_rows; r++) {
        l->slot[r] = -1;
        if (!sp[r]->logprobs) continue;
        float *row = l->raw + (size_t)s * (size_t)vocab_len;
        loom_backend_download(be, row, logits + (size_t)r * (size_t)vocab_len, (size_t)vocab_len * sizeof(float));
        l->parts[r] = (loom_lp_part_t){.ids = l->ids + (size_t)r * LOOM_MAX_TOP_LOGPROBS,
                                       .vals = l->vals + (size_t)r * LOOM_MAX_TOP_LOGPROBS};
        loom_logprob_shard(row, vocab_len, vocab_begin, (int)sp[r]->top_logprobs, &l->parts[r]);
        l->slot[r] = s++;
    }
    return LOOM_OK;
}

void loom_logprobs_candidates(loom_logprobs_t *l, int r, const loom_sample_part_t *part) {
    if (!l->slot || l->slot[r] < 0) return;
    const float *row = l->raw + (size_t)l->slot[r] * (size_t)l->vocab_len;
    float *out = l->cand_raw + (size_t)r * LOOM_SAMPLE_MAX_CAND;
    for (int j = 0; j < part->n; j++) {
        int i = part->ids[j] - l->vocab_begin;
        out[j] = i >= 0 && i < l->vocab_len ? row[i] : -INFINITY;
    }
}

size_t loom_logprobs_extra_bytes(const Loom__V1__SampleParams *sp, int k) {
    return sp->logprobs ? 12 + 8 * (size_t)sp->top_logprobs + 4 * (size_t)k : 0;
}

size_t loom_logprobs_max_extra_bytes(void) {
    return 12 + 8 * (size_t)LOOM_MAX_TOP_LOGPROBS + 4 * (size_t)LOOM_SAMPLE_MAX_CAND;
}

/* [max, sum_exp, n, ids[top], vals[top], cand_raw[k]] */
uint8_t *loom_logprobs_pack(const loom_logprobs_t *l, int r, const Loom__V1__SampleParams *sp, int k, uint8_t *p) {
    if (!sp->logprobs) return p;
    const loom_lp_part_t *lp = &l->parts[r];
    size_t top = sp->top_logprobs;
    int32_t n = lp->n;
    memcpy(p, &lp->max, 4);
    memcpy(p + 4, &lp->sum_exp, 4);
    memcpy(p + 8, &n, 4);
    memcpy(p + 12, lp->ids, top * 4);
    memcpy(p + 12 + top * 4, lp->vals, top * 4);
    memcpy(p + 12 + top * 8, l->cand_raw + (size_t)r * LOOM_SAMPLE_MAX_CAND, (size_t)k * 4);
    return p + loom_logprobs_extra_bytes(sp, k);
}

const uint8_t *loom_logprobs_unpack(const uint8_t *p, const Loom__V1__SampleParams *sp, int k, loom_lp_part_t *lp,
                                    const float **cand_raw) {
    if (!sp->logprobs) return p;
    size_t top = sp->top_logprobs;
    int32_t n;
    memcpy(&lp->max, p, 4);
    memcpy(&lp->sum_exp, p + 4, 4);
    memcpy(&n, p + 8, 4);
    lp->n = n < 0 ? 0 : n > (int32_t)top ? (int)top : n;
    lp->ids = (int32_t *)(uintptr_t)(p + 12);
    lp->vals = (float *)(uintptr_t)(p + 12 + top * 4);
    *cand_raw = (const float *)(uintptr_t)(p + 12 + top * 8);
    return p + loom_logprobs_extra_bytes(sp, k);
}

void loom_logprobs_reset_results(loom_logprobs_t *l) {
    l->n_lp = l->n_tops = l->any = 0;
}

void loom_logprobs_finish(loom_logprobs_t *l, const Loom__V1__SampleParams *sp, const loom_lp_part_t *lp,
                          const float *const *cand_raw, const loom_sample_part_t *parts, int n_parts, int32_t id) {
    if (!sp->logprobs) {
        if (l->any) { /* a row without logprobs in a step with some: NaN, no top */
            l->lp[l->n_lp] = NAN;
            l->n_top[l->n_lp++] = 0;
        }
        return;
    }
    double log_z = loom_logprob_log_z(lp, n_parts);
    float raw = -INFINITY; /* the sampled id is a candidate of exactly one shard */
    for (int q = 0; q < n_parts && raw == -INFINITY; q++)
        for (int j = 0; j < parts[q].n; j++)
            if (parts[q].ids[j] == id) {
                raw = cand_raw[q][j];
                break;
            }
    l->lp[l->n_lp] = (float)((double)raw - log_z);
    int n = loom_logprob_top(lp, n_parts, (int)sp->top_logprobs, log_z, l->top_ids + l->n_tops, l->top_lps + l->n_tops);
    l->n_top[l->n_lp++] = (uint32_t)n;
    l->n_tops += n;
}

/* ---- prompt log probabilities ---- */

void loom_prompt_lp_free(loom_prompt_lp_t *l) {
    free(l->host);
    free(l->target);
    free(l->count);
    free(l->parts);
    free(l->ids);
    free(l->vals);
    free(l->lp);
    free(l->rank);
    free(l->n_top);
    free(l->top_ids);
    free(l->top_lps);
    *l = (loom_prompt_lp_t){0};
}

void loom_prompt_lp_reset(loom_prompt_lp_t *l, int n_rows) {
    l->n = l->n_tops = 0;
    if (n_rows <= l->cap_res) return;
    size_t n = (size_t)n_rows;
    l->lp = loom_xrealloc(l->lp, n * sizeof *l->lp);
    l->rank = loom_xrealloc(l->rank, n * sizeof *l->rank);
    l->n_top = loom_xrealloc(l->n_top, n * sizeof *l->n_top);
    l->top_ids = loom_xrealloc(l->top_ids, n * LOOM_MAX_TOP_LOGPROBS * sizeof *l->top_ids);
    l->top_lps = loom_xrealloc(l->top_lps, n * LOOM_MAX_TOP_LOGPROBS * sizeof *l->top_lps);
    l->cap_res = n_rows;
}

float *loom_prompt_lp_batch(loom_prompt_lp_t *l, int n, int vocab_len) {
    size_t need = (size_t)n * (size_t)vocab_len;
    if (need > l->cap_host) {
        free(l->host);
        l->host = loom_xmalloc(need * sizeof *l->host);
        l->cap_host = need;
    }
    if (n > l->cap_batch) {
        size_t b = (size_t)n;
        l->target = loom_xrealloc(l->target, b * sizeof *l->target);
        l->count = loom_xrealloc(l->count, b * sizeof *l->count);
        l->parts = loom_xrealloc(l->parts, b * sizeof *l->parts);
        l->ids = loom_xrealloc(l->ids, b * LOOM_MAX_TOP_LOGPROBS * sizeof *l->ids);
        l->vals = loom_xrealloc(l->vals, b * LOOM_MAX_TOP_LOGPROBS * sizeof *l->vals);
        l->cap_batch = n;
    }
    return l->host;
}

void loom_prompt_lp_parts(loom_prompt_lp_t *l, int n, int vocab_begin, int vocab_len, const uint32_t *tops,
                          const int32_t *ids) {
    for (int i = 0; i < n; i++) {
        const float *row = l->host + (size_t)i * (size_t)vocab_len;
        l->parts[i] = (loom_lp_part_t){.ids = l->ids + (size_t)i * LOOM_MAX_TOP_LOGPROBS,
                                       .vals = l->vals + (size_t)i * LOOM_MAX_TOP_LOGPROBS};
        loom_logprob_shard(row, vocab_len, vocab_begin, (int)tops[i], &l->parts[i]);
        int j = ids[i] - vocab_begin;
        l->target[i] = j >= 0 && j < vocab_len ? row[j] : 0.0f;
    }
}

void loom_prompt_lp_count(loom_prompt_lp_t *l, int n, int vocab_len) {
    for (int i = 0; i < n; i++) {
        const float *row = l->host + (size_t)i * (size_t)vocab_len;
        float t = l->target[i];
        uint32_t c = 0;
        for (int j = 0; j < vocab_len; j++) c += row[j] >= t;
        l->count[i] = c;
    }
}

/* per row: [max, sum_exp, n, count, ids[top], vals[top]] */
static size_t row_bytes(uint32_t top) { return 16 + 8 * (size_t)top; }

size_t loom_prompt_lp_bytes(const uint32_t *tops, int n) {
    size_t b = 0;
    for (int i = 0; i < n; i++) b += row_bytes(tops[i]);
    return b;
}

void loom_prompt_lp_pack(const loom_prompt_lp_t *l, int n, const uint32_t *tops, uint8_t *out) {
    for (int i = 0; i < n; i++) {
        const loom_lp_part_t *pt = &l->parts[i];
        int32_t k = pt->n;
        memcpy(out, &pt->max, 4);
        memcpy(out + 4, &pt->sum_exp, 4);
        memcpy(out + 8, &k, 4);
        memcpy(out + 12, &l->count[i], 4);
        memcpy(out + 16, pt->ids, (size_t)tops[i] * 4);
        memcpy(out + 16 + (size_t)tops[i] * 4, pt->vals, (size_t)tops[i] * 4);
        out += row_bytes(tops[i]);
    }
}

void loom_prompt_lp_merge(loom_prompt_lp_t *l, int n, const uint32_t *tops, const uint8_t *recv, size_t bytes,
                          int n_parts) {
    LOOM_ASSERT(n_parts >= 1 && n_parts <= LOOM_SAMPLE_MAX_PARTS);
    const uint8_t *base[LOOM_SAMPLE_MAX_PARTS];
    for (int q = 0; q < n_parts && recv; q++) base[q] = recv + (size_t)q * bytes;
    for (int i = 0; i < n; i++) {
        loom_lp_part_t parts[LOOM_SAMPLE_MAX_PARTS];
        uint32_t rank = 0;
        if (!recv) {
            parts[0] = l->parts[i];
            rank = l->count[i];
        } else {
            for (int q = 0; q < n_parts; q++) {
                const uint8_t *p = base[q];
                int32_t k;
                uint32_t c;
                memcpy(&parts[q].max, p, 4);
                memcpy(&parts[q].sum_exp, p + 4, 4);
                memcpy(&k, p + 8, 4);
                memcpy(&c, p + 12, 4);
                parts[q].n = k < 0 ? 0 : k > (int32_t)tops[i] ? (int)tops[i] : k;
                parts[q].ids = (int32_t *)(uintptr_t)(p + 16);
                parts[q].vals = (float *)(uintptr_t)(p + 16 + (size_t)tops[i] * 4);
                rank += c;
                base[q] += row_bytes(tops[i]);
            }
        }
        double log_z = loom_logprob_log_z(parts, n_parts);
        l->lp[l->n] = (float)((double)l->target[i] - log_z);
        l->rank[l->n] = rank;
        int k = loom_logprob_top(parts, n_parts, (int)tops[i], log_z, l->top_ids + l->n_tops, l->top_lps + l->n_tops);
        l->n_top[l->n++] = (uint32_t)k;
        l->n_tops += k;
    }
}
