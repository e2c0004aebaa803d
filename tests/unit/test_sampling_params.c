/* Tests of the coordinator's sampling controls (coordinator/sampling_params.c):
 * validation naming the field, the plan rows it fills from a sequence's
 * tokens (distinct ids with output counts, bad-word prefixes, min_tokens
 * bans, sorted allow-list), and the checks on a StepResult's logprobs. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/model_config.h"
#include "common/util.h"
#include "common/tokenizer.h"
#include "coordinator/sampling_params.h"
#include "coordinator/structured.h"
#include "tests/test.h"

static loom_tokenizer_t *g_tok;
static loom_model_config_t g_cfg;

static int has(const int32_t *a, size_t n, int32_t v) {
    for (size_t i = 0; i < n; i++)
        if (a[i] == v) return 1;
    return 0;
}

static void test_validation(void) {
    static const struct {
        float pres, freq, rep, min_p;
        int32_t bias_id;
        float bias;
        uint32_t min_tokens, max_tokens, top;
        const char *want;
    } cases[] = {
        {3, 0, 0, 0, -1, 0, 0, 0, 0, "presence_penalty"}, {0, -2.5f, 0, 0, -1, 0, 0, 0, 0, "frequency_penalty"},
        {0, 0, -1, 0, -1, 0, 0, 0, 0, "repetition_penalty"}, {0, 0, 0, 1.5f, -1, 0, 0, 0, 0, "min_p"},
        {0, 0, 0, 0, 100000, 1, 0, 0, 0, "logit_bias"}, {0, 0, 0, 0, 5, 200, 0, 0, 0, "logit_bias"},
        {0, 0, 0, 0, -1, 0, 9, 4, 0, "min_tokens"}, {0, 0, 0, 0, -1, 0, 0, 0, 21, "top_logprobs"},
    };
    for (size_t c = 0; c < LOOM_ARRAY_LEN(cases); c++) {
        Loom__V1__SamplingParams sp = LOOM__V1__SAMPLING_PARAMS__INIT;
        sp.presence_penalty = cases[c].pres;
        sp.frequency_penalty = cases[c].freq;
        sp.repetition_penalty = cases[c].rep;
        sp.min_p = cases[c].min_p;
        Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
        g.sampling = &sp;
        int32_t id = cases[c].bias_id;
        float b = cases[c].bias;
        if (id >= 0) {
            g.logit_bias_ids = &id;
            g.logit_bias_values = &b;
            g.n_logit_bias_ids = g.n_logit_bias_values = 1;
        }
        g.min_tokens = cases[c].min_tokens;
        g.max_tokens = cases[c].max_tokens;
        g.logprobs = cases[c].top > 0;
        g.top_logprobs = cases[c].top;
        loom_sparams_t *p = NULL;
        loom_err_t err = {0};
        CHECKF(loom_sparams_create(&g, g_tok, &g_cfg, &p, &err) == LOOM_ERR_INVALID_ARGUMENT && !p &&
                   strstr(err.msg, cases[c].want),
               "case %zu: %s", c, err.msg);
    }
    /* nothing asked: no controls at all */
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    loom_sparams_t *p = (loom_sparams_t *)&g;
    loom_err_t err = {0};
    CHECK(loom_sparams_create(&g, g_tok, &g_cfg, &p, &err) == LOOM_OK && p == NULL);
}

static void test_plan_rows(void) {
    int32_t bad_ids[8];
    int n_bad = 0;
    {
        int32_t *ids = NULL;
        int n = 0, cap = 0;
        loom_err_t err = {0};
        CHECK(loom_tokenizer_encode(g_tok, "Lily", 4, 0, 0, &ids, &n, &cap, &err) == LOOM_OK && n >= 1 && n <= 8);
        memcpy(bad_ids, ids, (size_t)n * sizeof *ids);
        n_bad = n;
        free(ids);
    }
    Loom__V1__SamplingParams sp = LOOM__V1__SAMPLING_PARAMS__INIT;
    sp.presence_penalty = 0.5f;
    sp.frequency_penalty = 0.25f;
    sp.repetition_penalty = 1.2f;
    sp.min_p = 0.1f;
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    g.sampling = &sp;
    int32_t allowed[] = {40, 3, 40, 17, 3};
    g.allowed_token_ids = allowed;
    g.n_allowed_token_ids = 5;
    char *bad[] = {"Lily"};
    g.bad_words = bad;
    g.n_bad_words = 1;
    int32_t stop_id = 7;
    g.stop_token_ids = &stop_id;
    g.n_stop_token_ids = 1;
    g.min_tokens = 4;
    g.logprobs = 1;
    g.top_logprobs = 3;
    loom_sparams_t *p = NULL;
    loom_err_t err = {0};
    CHECK(loom_sparams_create(&g, g_tok, &g_cfg, &p, &err) == LOOM_OK && p);
    CHECK(loom_sparams_min_tokens(p) == 4);

    /* prompt 1 5 5 9, output 9 12 then the bad word's first tokens */
    int32_t toks[16] = {1, 5, 5, 9, 9, 12};
    int n_tok = 6;
    for (int i = 0; i < n_bad - 1; i++) toks[n_tok++] = bad_ids[i];
    loom_seq_t seq = {.tokens = toks, .n_tokens = n_tok, .n_prompt = 4, .sparams = p};
    loom_seq_t *seqs[1] = {&seq};
    loom_microbatch_t mb = {.n_logits = 1, .logit_seq = seqs};
    Loom__V1__SampleParams row = LOOM__V1__SAMPLE_PARAMS__INIT, *rows[1] = {&row};
    loom_sparams_arena_t a = {0};
    loom_sparams_fill_plan(&a, &mb, rows);
    CHECK(row.min_p == 0.1f && row.presence_penalty == 0.5f && row.repetition_penalty == 1.2f);
    CHECK(row.logprobs && row.top_logprobs == 3);
    CHECK(row.n_allowed_ids == 3 && row.allowed_ids[0] == 3 && row.allowed_ids[1] == 17 && row.allowed_ids[2] == 40);
    /* distinct ids of prompt and output, ascending, with output counts */
    CHECK(row.n_seen_ids == row.n_out_counts && row.n_seen_ids >= 4);
    for (size_t i = 1; i < row.n_seen_ids; i++) CHECK(row.seen_ids[i] > row.seen_ids[i - 1]);
    for (size_t i = 0; i < row.n_seen_ids; i++) {
        int want = 0;
        for (int k = 4; k < n_tok; k++) want += toks[k] == row.seen_ids[i];
        CHECKF(row.out_counts[i] == want, "id %d: count %d, want %d", row.seen_ids[i], row.out_counts[i], want);
    }
    CHECK(has(row.seen_ids, row.n_seen_ids, 1) && has(row.seen_ids, row.n_seen_ids, 5));
    /* fewer than min_tokens generated: EOS and the stop id banned; the bad word's last token too */
    CHECK(n_tok - 4 < 4 || !has(row.banned_ids, row.n_banned_ids, stop_id));
    if (n_tok - 4 < 4) CHECK(has(row.banned_ids, row.n_banned_ids, stop_id));
    for (int i = 0; i < g_cfg.n_eos && n_tok - 4 < 4; i++) CHECK(has(row.banned_ids, row.n_banned_ids, g_cfg.eos_ids[i]));
    CHECK(has(row.banned_ids, row.n_banned_ids, bad_ids[n_bad - 1]));

    /* past min_tokens, with the output not ending in the bad word's prefix */
    int32_t toks2[16] = {1, 5, 5, 9, 9, 12, 12, 12, 30};
    loom_seq_t seq2 = {.tokens = toks2, .n_tokens = 9, .n_prompt = 4, .sparams = p};
    seqs[0] = &seq2;
    loom__v1__sample_params__init(&row);
    loom_sparams_fill_plan(&a, &mb, rows);
    CHECK(!has(row.banned_ids, row.n_banned_ids, stop_id));
    if (n_bad > 1) CHECK(!has(row.banned_ids, row.n_banned_ids, bad_ids[n_bad - 1]));
    for (size_t i = 0; i < row.n_seen_ids; i++)
        if (row.seen_ids[i] == 12) CHECK(row.out_counts[i] == 3);
    /* a sequence without controls is left as it was */
    loom_seq_t plain = {.tokens = toks2, .n_tokens = 9, .n_prompt = 4};
    seqs[0] = &plain;
    loom__v1__sample_params__init(&row);
    loom_sparams_fill_plan(&a, &mb, rows);
    CHECK(row.n_seen_ids == 0 && row.n_banned_ids == 0 && !row.logprobs);
    loom_sparams_arena_free(&a);
    loom_sparams_destroy(&p);
    loom_sparams_destroy(&p); /* twice is fine */
    CHECK(p == NULL);
}

static int count_of(const Loom__V1__SampleParams *row, int32_t id) {
    for (size_t i = 0; i < row->n_seen_ids; i++)
        if (row->seen_ids[i] == id) return row->out_counts[i];
    return -1; /* not seen */
}

/* Verify rows of a speculating sequence: row j sees the drafts before it as
 * output (counts, min_tokens), the fed row and ordinary rows do not. */
static void test_spec_rows(void) {
    Loom__V1__SamplingParams sp = LOOM__V1__SAMPLING_PARAMS__INIT;
    sp.frequency_penalty = 0.5f;
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    g.sampling = &sp;
    g.min_tokens = 4;
    g.max_tokens = 32;
    loom_sparams_t *p = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_sparams_create(&g, g_tok, &g_cfg, &p, &err) == LOOM_OK && p);
    int32_t toks[8] = {1, 5, 5, 9, 9, 12}; /* prompt 1 5 5 9, output 9 12 */
    loom_seq_t seq = {.tokens = toks, .n_tokens = 6, .n_prompt = 4, .sparams = p};
    /* the fed token 12, then the drafts 12 30 12 */
    int32_t mtoks[4] = {12, 12, 30, 12}, rows_at[4] = {0, 1, 2, 3};
    uint64_t steps[4] = {2, 3, 4, 5};
    uint8_t spec_row[4] = {1, 1, 1, 1};
    loom_seq_t *seqs[4] = {&seq, &seq, &seq, &seq};
    loom_microbatch_t mb = {.n_tokens = 4, .tokens = mtoks, .n_logits = 4, .logit_rows = rows_at,
                            .logit_seq = seqs, .steps = steps, .spec_row = spec_row};
    Loom__V1__SampleParams r[4], *rows[4];
    for (int i = 0; i < 4; i++) {
        loom__v1__sample_params__init(&r[i]);
        rows[i] = &r[i];
    }
    loom_sparams_arena_t a = {0};
    loom_sparams_fill_plan(&a, &mb, rows);
    static const int want12[4] = {1, 2, 2, 3}, want30[4] = {-1, -1, 1, 1};
    for (int j = 0; j < 4; j++) {
        CHECKF(count_of(&r[j], 12) == want12[j] && count_of(&r[j], 30) == want30[j], "row %d: counts %d %d", j,
               count_of(&r[j], 12), count_of(&r[j], 30));
        CHECK(count_of(&r[j], 9) == 1);
        /* 2 + j tokens output: EOS banned while fewer than min_tokens */
        int banned = g_cfg.n_eos > 0 && has(r[j].banned_ids, r[j].n_banned_ids, g_cfg.eos_ids[0]);
        CHECKF(banned == (2 + j < 4), "row %d: EOS banned %d", j, banned);
    }
    /* the same rows without the speculation marks: all as the fed row */
    memset(spec_row, 0, sizeof spec_row);
    for (int i = 0; i < 4; i++) loom__v1__sample_params__init(&r[i]);
    loom_sparams_fill_plan(&a, &mb, rows);
    for (int j = 0; j < 4; j++) CHECK(count_of(&r[j], 12) == 1 && count_of(&r[j], 30) == -1);
    loom_sparams_arena_free(&a);
    loom_sparams_destroy(&p);
}

static void test_lp_view(void) {
    loom_seq_t s0 = {0}, s1 = {0};
    loom_seq_t *seqs[2] = {&s0, &s1};
    loom_microbatch_t mb = {.n_logits = 2, .logit_seq = seqs};
    float lps[2] = {-0.5f, NAN};
    uint32_t n_top[2] = {2, 0};
    int32_t top_ids[2] = {4, 9};
    float top_lps[2] = {-0.5f, -1.5f};
    Loom__V1__StepResult r = LOOM__V1__STEP_RESULT__INIT;
    r.logprobs = lps;
    r.n_logprobs = 2;
    r.n_top = n_top;
    r.n_n_top = 2;
    r.top_ids = top_ids;
    r.top_logprobs = top_lps;
    r.n_top_ids = r.n_top_logprobs = 2;
    loom_lp_view_t v = {0};
    char msg[256];
    CHECK(loom_lp_view_bind(&v, &mb, &r, 32000, msg, sizeof msg) == 0);
    const loom_token_lp_t *t = loom_lp_view_get(&v, &s0);
    CHECK(t && t->logprob == -0.5f && t->n_top == 2 && t->top_ids[1] == 9);
    CHECK(loom_lp_view_get(&v, &s1) == NULL); /* NaN: that row did not ask */
    loom_lp_view_unbind(&v);
    CHECK(loom_lp_view_get(&v, &s0) == NULL);
    r.n_logprobs = 1; /* one entry for two rows */
    CHECK(loom_lp_view_bind(&v, &mb, &r, 32000, msg, sizeof msg) < 0 && strstr(msg, "logprobs"));
    r.n_logprobs = 2;
    n_top[1] = 5; /* more top entries than sent */
    CHECK(loom_lp_view_bind(&v, &mb, &r, 32000, msg, sizeof msg) < 0);
    n_top[1] = 0;
    top_ids[0] = 40000; /* outside the vocabulary */
    CHECK(loom_lp_view_bind(&v, &mb, &r, 32000, msg, sizeof msg) < 0);
    loom_lp_view_free(&v);
}

/* Constrained decoding rows (coordinator/structured.c): the encoding, the
 * matcher following the sequence's output (forward and after a rollback),
 * EOS only where the grammar accepts, the end-of-text check. */
static int row_allows(const Loom__V1__SampleParams *r, int32_t id) {
    if (r->n_grammar_mask) return (int)(r->grammar_mask[id / 32] >> (id % 32) & 1u);
    return has(r->grammar_ids, r->n_grammar_ids, id);
}

static void test_guide_rows(void) {
    loom_structured_t *st = loom_structured_create(g_tok, &g_cfg, 0);
    loom_guide_t *gd = NULL;
    loom_err_t err = {0};
    CHECK(loom_guide_create(st, 1 + 3 /* choice */, "{\"x\"", 4, NULL, &gd, &err) < 0 && !gd && err.msg[0]);
    CHECK(loom_guide_create(st, 9, "", 0, NULL, &gd, &err) == LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "guide_kind"));
    const char *spec = "[\"cat\", \"dog\"]";
    CHECK(loom_guide_create(st, 4, spec, strlen(spec), NULL, &gd, &err) == LOOM_OK && gd);
    loom_sparams_t *p = NULL;
    loom_sparams_set_guide(&p, gd);
    CHECK(p && loom_sparams_guide(p) == gd && loom_sparams_min_tokens(p) == 0);
    int32_t toks[16] = {1, 9};
    loom_seq_t seq = {.tokens = toks, .n_tokens = 2, .n_prompt = 2, .sparams = p};
    loom_seq_t *seqs[1] = {&seq};
    loom_microbatch_t mb = {.n_logits = 1, .logit_seq = seqs};
    Loom__V1__SampleParams row = LOOM__V1__SAMPLE_PARAMS__INIT, *rows[1] = {&row};
    loom_sparams_arena_t a = {0};
    int32_t eos = g_cfg.eos_ids[0];
    /* walk: take the last allowed id each step (EOS only once complete) */
    char text[64] = "";
    size_t n_text = 0;
    int done = 0, first_id = -1;
    for (int k = 0; k < 8 && !done; k++) {
        loom__v1__sample_params__init(&row);
        loom_sparams_fill_plan(&a, &mb, rows);
        CHECK(row.grammar);
        CHECKF(row.n_grammar_ids > 0 && row.n_grammar_mask == 0, "step %d: a short list (%zu ids, %zu words)", k,
               row.n_grammar_ids, row.n_grammar_mask);
        if (!row.n_grammar_ids) break;
        for (size_t i = 1; i < row.n_grammar_ids; i++) CHECK(row.grammar_ids[i] > row.grammar_ids[i - 1]);
        int32_t pick = row.grammar_ids[row.n_grammar_ids - 1];
        if (pick == eos && row.n_grammar_ids == 1) {
            done = 1;
            break;
        }
        CHECKF(!row_allows(&row, eos), "step %d: EOS allowed before the end (%s)", k, text);
        size_t l = 0;
        const char *b = loom_tokenizer_token_bytes(g_tok, pick, &l);
        CHECK(b && n_text + l < sizeof text);
        if (!b || n_text + l >= sizeof text) break;
        memcpy(text + n_text, b, l);
        text[n_text += l] = '\0';
        if (first_id < 0) first_id = pick;
        toks[seq.n_tokens++] = pick;
    }
    CHECKF(done && (!strcmp(text, "cat") || !strcmp(text, "dog")), "walked to %s", text);
    /* a rollback (re-prefill with a shorter output): the mask of the first step again */
    Loom__V1__SampleParams first = LOOM__V1__SAMPLE_PARAMS__INIT, *frows[1] = {&first};
    seq.n_tokens = 2;
    loom_sparams_arena_t a2 = {0};
    loom_sparams_fill_plan(&a2, &mb, frows);
    CHECK(first_id >= 0 && row_allows(&first, first_id) && !row_allows(&first, eos));
    /* the text check: "ca" is a prefix, "cat" is complete */
    loom_guide_text_append(gd, "ca", 2);
    CHECK(!loom_guide_text_complete(gd));
    loom_guide_text_append(gd, "t", 1);
    CHECK(loom_guide_text_complete(gd));
    loom_sparams_destroy(&p);

    /* any JSON object: inside a string most of the vocabulary is allowed -> the bitset */
    CHECK(loom_guide_create(st, 1, "", 0, NULL, &gd, &err) == LOOM_OK);
    p = NULL;
    loom_sparams_set_guide(&p, gd);
    static const char *const obj[] = {"{", "\"", "a"}; /* into a key's string body, by single-byte tokens */
    seq = (loom_seq_t){.tokens = toks, .n_tokens = 2, .n_prompt = 2, .sparams = p};
    for (size_t k = 0; k < LOOM_ARRAY_LEN(obj); k++) {
        int32_t found = -1;
        for (int32_t id = 0; id < g_cfg.vocab_size && found < 0; id++) {
            size_t l = 0;
            const char *b = loom_tokenizer_token_bytes(g_tok, id, &l);
            if (b && l == 1 && b[0] == obj[k][0]) found = id;
        }
        CHECK(found >= 0);
        toks[seq.n_tokens++] = found;
    }
    loom__v1__sample_params__init(&row);
    loom_sparams_fill_plan(&a, &mb, rows);
    CHECKF(row.grammar && row.n_grammar_mask == ((size_t)g_cfg.vocab_size + 31) / 32,
           "a string body: %zu mask words, %zu ids", row.n_grammar_mask, row.n_grammar_ids);
    CHECK(!row_allows(&row, eos));
    loom_structured_stats_t stats;
    loom_structured_stats(st, &stats);
    CHECK(stats.masks >= 3 && stats.bitset_rows >= 1 && stats.list_rows >= 3 && stats.refused == 0);
    loom_sparams_arena_free(&a);
    loom_sparams_arena_free(&a2);
    loom_sparams_destroy(&p);
    loom_structured_destroy(&st);
    loom_structured_destroy(&st);
}

/* A reasoning model's guide (after "</think>"): rows are free until the
 * marker has come, then the grammar holds; the marker may end inside a
 * token; a rollback before it frees the rows again; the text check reads
 * what follows the marker. */
static int32_t byte_token(char c) {
    for (int32_t id = 0; id < g_cfg.vocab_size; id++) {
        size_t l = 0;
        const char *b = loom_tokenizer_token_bytes(g_tok, id, &l);
        if (b && l == 1 && b[0] == c) return id;
    }
    return -1;
}

static void test_guide_after_reasoning(void) {
    loom_structured_t *st = loom_structured_create(g_tok, &g_cfg, 0);
    loom_guide_t *gd = NULL;
    loom_err_t err = {0};
    const char *spec = "[\"cat\", \"dog\"]";
    REQUIRE(loom_guide_create(st, 4, spec, strlen(spec), "</think>", &gd, &err) == LOOM_OK && gd);
    loom_sparams_t *p = NULL;
    loom_sparams_set_guide(&p, gd);
    int32_t toks[32] = {1, 9};
    loom_seq_t seq = {.tokens = toks, .n_tokens = 2, .n_prompt = 2, .sparams = p};
    loom_seq_t *seqs[1] = {&seq};
    loom_microbatch_t mb = {.n_logits = 1, .logit_seq = seqs};
    Loom__V1__SampleParams row = LOOM__V1__SAMPLE_PARAMS__INIT, *rows[1] = {&row};
    loom_sparams_arena_t a = {0};
    const char *reason = "hm</think>";
    int32_t eos = g_cfg.eos_ids[0], c = byte_token('c'), x = byte_token('x');
    REQUIRE(c >= 0 && x >= 0);
    for (size_t k = 0; reason[k]; k++) {
        loom__v1__sample_params__init(&row);
        loom_sparams_fill_plan(&a, &mb, rows);
        CHECKF(!row.grammar, "reasoning step %zu is constrained", k);
        int32_t id = byte_token(reason[k]);
        REQUIRE(id >= 0);
        toks[seq.n_tokens++] = id;
    }
    loom__v1__sample_params__init(&row);
    loom_sparams_fill_plan(&a, &mb, rows);
    CHECK(row.grammar && row_allows(&row, c) && !row_allows(&row, x) && !row_allows(&row, eos));
    /* a rollback into the reasoning: free again; then the answer's first letter */
    seq.n_tokens -= 3;
    loom__v1__sample_params__init(&row);
    loom_sparams_fill_plan(&a, &mb, rows);
    CHECK(!row.grammar);
    seq.n_tokens += 3;
    toks[seq.n_tokens++] = c;
    loom__v1__sample_params__init(&row);
    loom_sparams_fill_plan(&a, &mb, rows);
    CHECK(row.grammar && row_allows(&row, byte_token('a')) && !row_allows(&row, c));
    /* the text check: the answer after the marker */
    loom_guide_text_append(gd, "hm</think>ca", 12);
    CHECK(!loom_guide_text_complete(gd));
    loom_guide_text_append(gd, "t", 1);
    CHECK(loom_guide_text_complete(gd));
    loom_sparams_destroy(&p);
    /* several markers ('\n' between them): the first to come starts the grammar */
    const char *both = "</a>\n</b>";
    REQUIRE(loom_guide_create(st, 4, spec, strlen(spec), both, &gd, &err) == LOOM_OK);
    loom_sparams_set_guide(&p, gd);
    seq.sparams = p;
    seq.n_tokens = 2;
    for (const char *k = "hm</b>"; *k; k++) {
        loom__v1__sample_params__init(&row);
        loom_sparams_fill_plan(&a, &mb, rows);
        CHECKF(!row.grammar, "reasoning before '%c' is constrained", *k);
        REQUIRE(byte_token(*k) >= 0);
        toks[seq.n_tokens++] = byte_token(*k);
    }
    loom__v1__sample_params__init(&row);
    loom_sparams_fill_plan(&a, &mb, rows);
    CHECK(row.grammar && row_allows(&row, c) && !row_allows(&row, x));
    loom_guide_text_append(gd, "</c>hm</b>do", 12);
    CHECK(!loom_guide_text_complete(gd));
    loom_guide_text_append(gd, "g", 1);
    CHECK(loom_guide_text_complete(gd));
    loom_sparams_destroy(&p);
    REQUIRE(loom_guide_create(st, 4, spec, strlen(spec), both, &gd, &err) == LOOM_OK);
    loom_guide_text_append(gd, "</a>cat", 7);
    CHECK(loom_guide_text_complete(gd));
    loom_guide_destroy(&gd);
    REQUIRE(loom_guide_create(st, 4, spec, strlen(spec), both, &gd, &err) == LOOM_OK);
    loom_guide_text_append(gd, "</c>cat", 7);
    CHECK(!loom_guide_text_complete(gd));
    loom_guide_destroy(&gd);
    /* no marker in the text: never complete */
    REQUIRE(loom_guide_create(st, 4, spec, strlen(spec), "</think>", &gd, &err) == LOOM_OK);
    loom_guide_text_append(gd, "cat", 3);
    CHECK(!loom_guide_text_complete(gd));
    loom_guide_destroy(&gd);
    loom_sparams_arena_free(&a);
    loom_structured_destroy(&st);
}

int main(void) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/stories260K", test_models_dir());
    loom_err_t err = {0};
    if (loom_tokenizer_load(dir, &g_tok, &err) < 0 || loom_model_config_load(dir, &g_cfg, &err) < 0) {
        fprintf(stderr, "cannot load %s: %s\n", dir, err.msg);
        return 1;
    }
    RUN(test_validation);
    RUN(test_plan_rows);
    RUN(test_spec_rows);
    RUN(test_lp_view);
    RUN(test_guide_rows);
    RUN(test_guide_after_reasoning);
    loom_tokenizer_destroy(&g_tok);
    return test_summary();
}
