/* Reference sampling: per-shard reduction and the merge (see sampling.h). */
#include "kernels/sampling.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

double loom_sample_uniform(uint64_t seed, uint64_t step, uint64_t id) {
    uint64_t h = splitmix64(seed ^ splitmix64(step ^ splitmix64(id + 0x632be59bd9b4e019ull)));
    return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0); /* (0, 1) */
}

static float gumbel(uint64_t seed, uint64_t step, uint64_t id) {
    return (float)-log(-log(loom_sample_uniform(seed, step, id)));
}

loom_sample_mode_t loom_sample_mode(const loom_sampling_t *s, int vocab_size) {
    if (!(s->temperature > 0.0f)) return LOOM_SAMPLE_GREEDY;
    int has_k = s->top_k > 0 && s->top_k < vocab_size;
    int has_p = s->top_p > 0.0f && s->top_p < 1.0f;
    int has_min_p = s->min_p > 0.0f;
    return has_k || has_p || has_min_p ? LOOM_SAMPLE_FILTERED : LOOM_SAMPLE_GUMBEL;
}

int loom_sample_k(const loom_sampling_t *s, int vocab_size) {
    if (loom_sample_mode(s, vocab_size) != LOOM_SAMPLE_FILTERED) return 1;
    int k = s->top_k > 0 ? s->top_k : LOOM_SAMPLE_MAX_CAND;
    if (k > LOOM_SAMPLE_MAX_CAND) k = LOOM_SAMPLE_MAX_CAND;
    return k < vocab_size ? k : vocab_size;
}

/* Candidate order: larger key first, ties to the smaller id. */
static int better(float ka, int32_t ia, float kb, int32_t ib) {
    return ka > kb || (ka == kb && ia < ib);
}

/* Keeps the best k (key, id) pairs in a min-heap whose root is the worst kept. */
static void heap_sift_down(float *keys, int32_t *ids, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && better(keys[w], ids[w], keys[l], ids[l])) w = l;
        if (r < n && better(keys[w], ids[w], keys[r], ids[r])) w = r;
        if (w == i) return;
        float tk = keys[i];
        keys[i] = keys[w];
        keys[w] = tk;
        int32_t ti = ids[i];
        ids[i] = ids[w];
        ids[w] = ti;
        i = w;
    }
}

static void heap_push(float *keys, int32_t *ids, int *n, int k, float key, int32_t id) {
    if (*n < k) { /* sift up */
        int i = (*n)++;
        keys[i] = key;
        ids[i] = id;
        while (i > 0) {
            int p = (i - 1) / 2;
            if (!better(keys[p], ids[p], keys[i], ids[i])) break;
            float tk = keys[i];
            keys[i] = keys[p];
            keys[p] = tk;
            int32_t ti = ids[i];
            ids[i] = ids[p];
            ids[p] = ti;
            i = p;
        }
    } else if (better(key, id, keys[0], ids[0])) {
        keys[0] = key;
        ids[0] = id;
        heap_sift_down(keys, ids, *n, 0);
    }
}

/* Heap to best-first order (heap sort: repeatedly move the worst to the end). */
static void heap_sort_best_first(float *keys, int32_t *ids, int n) {
    for (int end = n - 1; end > 0; end--) {
        float tk = keys[0];
        keys[0] = keys[end];
        keys[end] = tk;
        int32_t ti = ids[0];
        ids[0] = ids[end];
        ids[end] = ti;
        heap_sift_down(keys, ids, end, 0);
    }
}

void loom_sample_shard(const float *logits, int n, int id_offset, int vocab_size,
                       const loom_sampling_t *s, uint64_t step, int k, loom_sample_part_t *out) {
    loom_sample_mode_t mode = loom_sample_mode(s, vocab_size);
    out->n = 0;
    out->sum_exp = 0.0f;
    out->max_z = -INFINITY;
    if (n <= 0 || k <= 0) return;
    if (mode == LOOM_SAMPLE_GREEDY || mode == LOOM_SAMPLE_GUMBEL) {
        float inv_t = mode == LOOM_SAMPLE_GUMBEL ? 1.0f / s->temperature : 1.0f;
        float best = -INFINITY;
        int32_t best_id = id_offset;
        for (int i = 0; i < n; i++) {
            float z = logits[i] * inv_t;
            float key = mode == LOOM_SAMPLE_GUMBEL ? z + gumbel(s->seed, step, (uint64_t)(id_offset + i)) : z;
            if (z > out->max_z) out->max_z = z;
            if (key > best) { /* strict: ties keep the smaller id */
                best = key;
                best_id = id_offset + i;
            }
        }
        out->ids[0] = best_id;
        out->keys[0] = best;
        out->n = 1;
        return;
    }
    /* Filtered: top-k of z, plus max and sum of exp over the whole shard. */
    float inv_t = 1.0f / s->temperature;
    float m = -INFINITY;
    for (int i = 0; i < n; i++) {
        float z = logits[i] * inv_t;
        if (z > m) m = z;
    }
    double sum = 0.0;
    int cnt = 0;
    for (int i = 0; i < n; i++) {
        float z = logits[i] * inv_t;
        sum += exp((double)(z - m));
        heap_push(out->keys, out->ids, &cnt, k, z, id_offset + i);
    }
    heap_sort_best_first(out->keys, out->ids, cnt);
    out->n = cnt;
    out->max_z = m;
    out->sum_exp = (float)sum;
}

int32_t loom_sample_merge(const loom_sample_part_t *parts, int n_parts, int vocab_size,
                          const loom_sampling_t *s, uint64_t step) {
    loom_sample_mode_t mode = loom_sample_mode(s, vocab_size);
    if (mode != LOOM_SAMPLE_FILTERED) {
        float best = -INFINITY;
        int32_t best_id = -1;
        for (int p = 0; p < n_parts; p++) {
            if (parts[p].n < 1) continue;
            if (best_id < 0 || better(parts[p].keys[0], parts[p].ids[0], best, best_id)) {
                best = parts[p].keys[0];
                best_id = parts[p].ids[0];
            }
        }
        return best_id < 0 ? 0 : best_id;
    }
    /* Merge the shards' candidate lists (each best first) into the global top-k. */
    int total = 0;
    for (int p = 0; p < n_parts; p++) total += parts[p].n;
    int k = loom_sample_k(s, vocab_size);
    if (k > total) k = total;
    if (k <= 0 || n_parts > LOOM_SAMPLE_MAX_PARTS) return 0;
    float keys[LOOM_SAMPLE_MAX_CAND];
    int32_t ids[LOOM_SAMPLE_MAX_CAND];
    int cur[LOOM_SAMPLE_MAX_PARTS] = {0};
    for (int j = 0; j < k; j++) {
        int bp = -1;
        for (int p = 0; p < n_parts; p++) {
            if (cur[p] >= parts[p].n) continue;
            if (bp < 0 || better(parts[p].keys[cur[p]], parts[p].ids[cur[p]], parts[bp].keys[cur[bp]],
                                 parts[bp].ids[cur[bp]]))
                bp = p;
        }
        keys[j] = parts[bp].keys[cur[bp]];
        ids[j] = parts[bp].ids[cur[bp]];
        cur[bp]++;
    }
    /* The nucleus is cut on probabilities renormalised over the top-k when
     * top-k is set (as Hugging Face and vLLM do), else over the whole
     * vocabulary: M = max, S = sum of exp(z - M). */
    double M = -INFINITY, S = 0.0;
    for (int p = 0; p < n_parts; p++)
        if (parts[p].max_z > M) M = parts[p].max_z;
    if (s->min_p > 0.0f) { /* drop p < min_p * p_max, i.e. z < M + log(min_p); the list is best first */
        double cut = M + log((double)s->min_p);
        int j = 1; /* the best candidate always survives */
        while (j < k && (double)keys[j] >= cut) j++;
        k = j;
    }
    if ((s->top_k > 0 && s->top_k < vocab_size) || s->min_p > 0.0f) {
        for (int j = 0; j < k; j++) S += exp((double)keys[j] - M);
    } else {
        for (int p = 0; p < n_parts; p++)
            if (parts[p].n > 0) S += (double)parts[p].sum_exp * exp((double)parts[p].max_z - M);
    }
    int keep = k;
    if (s->top_p > 0.0f && s->top_p < 1.0f && S > 0.0) {
        double cum = 0.0;
        for (int j = 0; j < k; j++) {
            cum += exp((double)keys[j] - M) / S;
            if (cum >= (double)s->top_p) {
                keep = j + 1;
                break;
            }
        }
    }
    float best = -INFINITY;
    int32_t best_id = ids[0];
    for (int j = 0; j < keep; j++) {
        float key = keys[j] + gumbel(s->seed, step, (uint64_t)ids[j]);
        if (key > best) {
            best = key;
            best_id = ids[j];
        }
    }
    return best_id;
}

int loom_logits_edits_active(const loom_logit_edits_t *e) {
    if (e->n_allowed > 0 || e->n_banned > 0 || e->n_bias > 0) return 1;
    int rep = e->repetition > 0.0f && e->repetition != 1.0f;
    return e->n_seen > 0 && (rep || e->frequency != 0.0f || e->presence != 0.0f);
}

void loom_logits_edit(float *logits, int n, int id_offset, const loom_logit_edits_t *e) {
    int lo = id_offset, hi = id_offset + n;
#define IN_SLICE(id) ((id) >= lo && (id) < hi)
    if (e->n_allowed > 0) { /* allowed is ascending: one merge walk over the slice */
        int j = 0;
        for (int i = 0; i < n; i++) {
            while (j < e->n_allowed && e->allowed[j] < lo + i) j++;
            if (j == e->n_allowed || e->allowed[j] != lo + i) logits[i] = -INFINITY;
        }
    }
    for (int i = 0; i < e->n_banned; i++)
        if (IN_SLICE(e->banned[i])) logits[e->banned[i] - lo] = -INFINITY;
    for (int i = 0; i < e->n_bias; i++)
        if (IN_SLICE(e->bias_ids[i])) logits[e->bias_ids[i] - lo] += e->bias[i];
    int rep = e->repetition > 0.0f && e->repetition != 1.0f;
    for (int i = 0; i < e->n_seen; i++) {
        int32_t id = e->seen_ids[i];
        if (!IN_SLICE(id)) continue;
        float *x = &logits[id - lo];
        if (rep) *x = *x > 0.0f ? *x / e->repetition : *x * e->repetition;
        int c = e->out_counts[i];
        if (c > 0) *x -= e->frequency * (float)c + e->presence;
    }
#undef IN_SLICE
}

void loom_logprob_shard(const float *logits, int n, int id_offset, int top_n, loom_lp_part_t *out) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        if (logits[i] > m) m = logits[i];
    double sum = 0.0;
    int cnt = 0;
    for (int i = 0; i < n; i++) {
        if (m > -INFINITY) sum += exp((double)logits[i] - (double)m);
        if (top_n > 0) heap_push(out->vals, out->ids, &cnt, top_n, logits[i], id_offset + i);
    }
    heap_sort_best_first(out->vals, out->ids, cnt);
    out->n = cnt;
    out->max = m;
    out->sum_exp = (float)sum;
}

double loom_logprob_log_z(const loom_lp_part_t *parts, int n_parts) {
    double M = -INFINITY, S = 0.0;
    for (int p = 0; p < n_parts; p++)
        if (parts[p].max > M) M = parts[p].max;
    if (M == -INFINITY) return M;
    for (int p = 0; p < n_parts; p++)
        if (parts[p].max > -INFINITY) S += (double)parts[p].sum_exp * exp((double)parts[p].max - M);
    return M + log(S);
}

int loom_logprob_top(const loom_lp_part_t *parts, int n_parts, int top_n, double log_z, int32_t *ids, float *lps) {
    int cur[LOOM_SAMPLE_MAX_PARTS] = {0}, n = 0;
    if (n_parts > LOOM_SAMPLE_MAX_PARTS) return 0;
    while (n < top_n) {
        int bp = -1;
        for (int p = 0; p < n_parts; p++) {
            if (cur[p] >= parts[p].n) continue;
            if (bp < 0 || better(parts[p].vals[cur[p]], parts[p].ids[cur[p]], parts[bp].vals[cur[bp]],
                                 parts[bp].ids[cur[bp]]))
                bp = p;
        }
        if (bp < 0) break;
        ids[n] = parts[bp].ids[cur[bp]];
        lps[n++] = (float)((double)parts[bp].vals[cur[bp]] - log_z);
        cur[bp]++;
    }
    return n;
}
