/* The bench's workloads and arrival times (bench.h):
 *   random             token-id prompts of uniform random lengths (exact
 *                      output lengths with ignore_eos);
 *   sharegpt           the first human turn of each conversation of a
 *                      ShareGPT-format JSON file, the reply's length as the
 *                      output length (about 4 bytes a token) unless given;
 *   prefix_repetition  a few shared prefixes, each followed by a random
 *                      suffix: what a prefix cache is for;
 *   multiturn          chats: sessions of several turns over a few shared
 *                      system prompts, each turn's prompt the whole
 *                      conversation so far (built by the run, bench.h).
 * The same seed gives the same prompts and arrivals at every rate. Text
 * prompts (a chat endpoint) render each id as a word of a fixed list, so a
 * prompt of N ids is about N tokens in any tokenizer. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/bench/bench.h"
#include "common/util.h"

typedef struct rng {
    uint64_t s;
} rng_t;

static uint64_t rng_next(rng_t *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_uniform(rng_t *r) { /* [0, 1) */
    return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

static int rng_range(rng_t *r, int lo, int hi) { /* [lo, hi] */
    return lo + (int)(rng_next(r) % (uint64_t)(hi - lo + 1));
}

static double rng_normal(rng_t *r) { /* Box-Muller */
    double u = 1.0 - rng_uniform(r), v = rng_uniform(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* Gamma(shape k, scale 1): Marsaglia and Tsang; k < 1 through k + 1. */
static double rng_gamma(rng_t *r, double k) {
    if (k < 1.0) return rng_gamma(r, k + 1.0) * pow(1.0 - rng_uniform(r), 1.0 / k);
    double d = k - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = rng_normal(r), v = 1.0 + c * x;
        if (v <= 0) continue;
        v = v * v * v;
        double u = 1.0 - rng_uniform(r);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v)) return d * v;
    }
}

void bench_arrivals(int n, double rate, double burstiness, uint64_t seed, double *t) {
    rng_t r = {seed ^ 0x5bd1e995u};
    double at = 0;
    for (int i = 0; i < n; i++) {
        if (i > 0 && isfinite(rate))
            at +=
                isfinite(burstiness) ? rng_gamma(&r, burstiness) / (rate * burstiness) : 1.0 / rate;
        t[i] = at;
    }
    /* the whole run spans n/rate, whatever the draws were (as vLLM does) */
    if (n > 1 && isfinite(rate) && t[n - 1] > 0)
        for (int i = 0; i < n; i++)
            t[i] *= (n / rate) / t[n - 1];
}

static const char *const k_words[64] = {
    "the",  "of",    "and",   "to",   "in",   "is",    "you",   "that",  "it",   "he",    "was",
    "for",  "on",    "are",   "as",   "with", "his",   "they",  "at",    "be",   "this",  "have",
    "from", "or",    "one",   "had",  "by",   "word",  "but",   "not",   "what", "all",   "were",
    "we",   "when",  "your",  "can",  "said", "there", "use",   "an",    "each", "which", "she",
    "do",   "how",   "their", "if",   "will", "up",    "other", "about", "out",  "many",  "then",
    "them", "these", "so",    "some", "her",  "would", "make",  "like",  "time"};

static char *ids_to_text(const int32_t *ids, int n) {
    loom_sbuf_t b = {0};
    for (int i = 0; i < n; i++) {
        if (i) loom_sbuf_add(&b, " ", 1);
        loom_sbuf_str(&b, k_words[(uint32_t)ids[i] % 64u]);
    }
    if (!b.p) loom_sbuf_add(&b, "", 0);
    return b.p;
}

/* float ranges: 0.4f is a hair over 0.4, so round the bounds with a little slack */
static int len_lo(int mean, float range) {
    return LOOM_MAX(1, (int)floor(mean * (1.0 - range) + 1e-6));
}
static int len_hi(int mean, float range) {
    return LOOM_MAX(1, (int)ceil(mean * (1.0 + range) - 1e-6));
}

static int32_t *random_ids(rng_t *r, int n, int vocab) {
    int32_t *ids = loom_xmalloc((size_t)LOOM_MAX(n, 1) * sizeof *ids);
    for (int k = 0; k < n; k++)
        ids[k] = (int32_t)rng_range(r, 3, vocab - 1);
    return ids;
}

static int load_sharegpt(const bench_ds_cfg_t *cfg, rng_t *r, bench_item_t *items, char *msg,
                         size_t msg_len) {
    char *data = NULL;
    size_t len = 0;
    loom_err_t err = {0};
    if (loom_read_file(cfg->path, &data, &len, &err) < 0) {
        snprintf(msg, msg_len, "cannot read the dataset %s: %s", cfg->path, err.msg);
        return -1;
    }
    cJSON *j = cJSON_ParseWithLength(data, len);
    free(data);
    if (!j) {
        snprintf(msg, msg_len,
                 "the dataset %s is not JSON (ShareGPT format: a list of {\"conversations\": "
                 "[{\"from\": \"human\", \"value\": ...}, {\"from\": \"gpt\", \"value\": ...}]})",
                 cfg->path);
        return -1;
    }
    if (!cJSON_IsArray(j)) {
        snprintf(msg, msg_len,
                 "the dataset %s is JSON but not a list of conversations (ShareGPT format)",
                 cfg->path);
        cJSON_Delete(j);
        return -1;
    }
    /* the usable conversations: a prompt and a reply, both text */
    int n_all = cJSON_GetArraySize(j), n = 0;
    const cJSON **use = loom_xmalloc((size_t)LOOM_MAX(n_all, 1) * sizeof *use);
    const cJSON *e;
    cJSON_ArrayForEach(e, j) {
        const cJSON *conv = cJSON_GetObjectItemCaseSensitive(e, "conversations");
        if (!cJSON_IsArray(conv)) conv = cJSON_GetObjectItemCaseSensitive(e, "conversation");
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(conv, 0), "value");
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(conv, 1), "value");
        if (cJSON_IsString(q) && cJSON_IsString(a) && q->valuestring[0]) use[n++] = e;
    }
    if (n == 0) {
        snprintf(msg, msg_len,
                 "the dataset %s has no conversation with a prompt and a reply (ShareGPT format: "
                 "\"conversations\": [{\"value\": PROMPT}, {\"value\": REPLY}, ...])",
                 cfg->path);
        free(use);
        cJSON_Delete(j);
        return -1;
    }
    for (int i = n - 1; i > 0;
         i--) { /* the seed's order; then cycled when the file has fewer than asked */
        int k = rng_range(r, 0, i);
        const cJSON *x = use[i];
        use[i] = use[k];
        use[k] = x;
    }
    for (int i = 0; i < cfg->num_requests; i++) {
        const cJSON *conv = cJSON_GetObjectItemCaseSensitive(use[i % n], "conversations");
        if (!cJSON_IsArray(conv))
            conv = cJSON_GetObjectItemCaseSensitive(use[i % n], "conversation");
        const char *q =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(conv, 0), "value")->valuestring;
        const char *a =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(conv, 1), "value")->valuestring;
        items[i].text = loom_xstrdup(q);
        items[i].prompt_len = LOOM_MAX(1, (int)((strlen(q) + 3) / 4));
        items[i].output_len = cfg->sharegpt_output_len > 0
                                  ? cfg->sharegpt_output_len
                                  : LOOM_MAX(1, (int)((strlen(a) + 3) / 4));
    }
    free(use);
    cJSON_Delete(j);
    return 0;
}

static int load_multiturn(const bench_ds_cfg_t *cfg, rng_t *r, bench_item_t *items, char *msg,
                          size_t msg_len) {
    if (cfg->sessions < 1 || cfg->turns < 1 || cfg->turns > BENCH_MAX_TURNS ||
        cfg->num_system < 1 || cfg->system_len < 0 || cfg->user_len < 1 || cfg->output_len < 1 ||
        !(cfg->think_s >= 0) || cfg->num_requests != cfg->sessions * cfg->turns) {
        snprintf(msg, msg_len,
                 "multiturn needs sessions >= 1, 1 <= turns <= %d, system prompts >= 1, system "
                 "length >= 0, user and output lengths >= 1, think time >= 0",
                 BENCH_MAX_TURNS);
        return -1;
    }
    int32_t **sys = loom_xcalloc((size_t)cfg->num_system, sizeof *sys);
    for (int p = 0; p < cfg->num_system; p++)
        sys[p] = random_ids(r, cfg->system_len, cfg->vocab);
    for (int s = 0; s < cfg->sessions; s++) {
        const int32_t *pre = sys[rng_range(r, 0, cfg->num_system - 1)];
        for (int k = 0; k < cfg->turns; k++) {
            bench_item_t *it = &items[s * cfg->turns + k];
            int n_pre = k == 0 ? cfg->system_len : 0;
            it->n_ids = n_pre + cfg->user_len;
            it->ids = loom_xmalloc((size_t)it->n_ids * sizeof *it->ids);
            if (n_pre) memcpy(it->ids, pre, (size_t)n_pre * sizeof *pre);
            for (int j = n_pre; j < it->n_ids; j++)
                it->ids[j] = (int32_t)rng_range(r, 3, cfg->vocab - 1);
            it->prompt_len = it->n_ids;
            it->output_len = cfg->output_len;
            it->session = s;
            it->turn = k;
            it->think_s = k > 0 ? -cfg->think_s * log(1.0 - rng_uniform(r)) : 0;
            if (cfg->want_text) it->text = ids_to_text(it->ids, it->n_ids);
        }
    }
    for (int p = 0; p < cfg->num_system; p++)
        free(sys[p]);
    free(sys);
    return 0;
}

int bench_dataset_load(const bench_ds_cfg_t *cfg, bench_item_t **items_out, char *msg,
                       size_t msg_len) {
    rng_t r = {cfg->seed};
    bench_item_t *items = loom_xcalloc((size_t)LOOM_MAX(cfg->num_requests, 1), sizeof *items);
    *items_out = items;
    if (cfg->kind == BENCH_DS_SHAREGPT) return load_sharegpt(cfg, &r, items, msg, msg_len);
    if (cfg->vocab < 4) {
        snprintf(msg, msg_len,
                 "random prompts need a vocabulary size: the server reports none; give --vocab");
        return -1;
    }
    if (cfg->kind == BENCH_DS_MULTITURN) return load_multiturn(cfg, &r, items, msg, msg_len);
    int32_t **prefixes = NULL;
    if (cfg->kind == BENCH_DS_PREFIX_REPETITION) {
        prefixes = loom_xcalloc((size_t)cfg->num_prefixes, sizeof *prefixes);
        for (int p = 0; p < cfg->num_prefixes; p++)
            prefixes[p] = random_ids(&r, cfg->prefix_len, cfg->vocab);
    }
    int plo = len_lo(cfg->input_len, cfg->input_range),
        phi = len_hi(cfg->input_len, cfg->input_range);
    int olo = len_lo(cfg->output_len, cfg->output_range),
        ohi = len_hi(cfg->output_len, cfg->output_range);
    for (int i = 0; i < cfg->num_requests; i++) {
        bench_item_t *it = &items[i];
        if (cfg->kind == BENCH_DS_PREFIX_REPETITION) {
            const int32_t *pre = prefixes[rng_range(&r, 0, cfg->num_prefixes - 1)];
            it->n_ids = cfg->prefix_len + cfg->suffix_len;
            it->ids = loom_xmalloc((size_t)it->n_ids * sizeof *it->ids);
            memcpy(it->ids, pre, (size_t)cfg->prefix_len * sizeof *pre);
            for (int k = cfg->prefix_len; k < it->n_ids; k++)
                it->ids[k] = (int32_t)rng_range(&r, 3, cfg->vocab - 1);
            it->output_len = cfg->output_len;
        } else {
            it->n_ids = rng_range(&r, plo, phi);
            it->output_len = rng_range(&r, olo, ohi);
            it->ids = random_ids(&r, it->n_ids, cfg->vocab);
        }
        it->prompt_len = it->n_ids;
        if (cfg->want_text) it->text = ids_to_text(it->ids, it->n_ids);
    }
    for (int p = 0; prefixes && p < cfg->num_prefixes; p++)
        free(prefixes[p]);
    free(prefixes);
    return 0;
}

void bench_dataset_free(bench_item_t *items, int n) {
    for (int i = 0; items && i < n; i++) {
        free(items[i].ids);
        free(items[i].text);
    }
    free(items);
}
