/* Tokenizer throughput: encode and decode MB/s on ~10 MB of generated
 * English-like text (words, punctuation, numbers, newlines), for each
 * tokenizer directory given on the command line.
 *
 *   bench_tokenizer DIR [DIR...] [--mb 10] [--reps 3]
 *   e.g. bench_tokenizer ../shared/models/stories260K build/tests/tokenizer_gen/llama3
 *
 * Encode is measured two ways: one call over the whole text, and the text cut
 * into ~2 KB requests (the request path: per-call setup included). Decode
 * covers loom_tokenizer_decode of each request's ids and the streaming
 * detokenizer fed one id at a time. MB/s counts text bytes (input for
 * encode, output for decode). Each figure is the best of --reps runs
 * (default 3), since the machine may be shared. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"
#include "common/util.h"

static const char *const WORDS[] = {
    "the",       "a",           "and",       "to",         "of",       "was",      "she",
    "he",        "it",          "in",        "that",       "with",     "for",      "they",
    "little",    "big",         "day",       "time",       "once",     "upon",     "happy",
    "friend",    "played",      "park",      "ball",       "mom",      "said",     "looked",
    "wanted",    "because",     "very",      "tree",       "house",    "garden",   "dog",
    "cat",       "bird",        "sun",       "water",      "together", "learned",  "important",
    "remember",  "beautiful",   "suddenly",  "everyone",   "tomorrow", "computer", "network",
    "inference", "distributed", "tokenizer", "throughput", "latency",
};

/* Deterministic English-like text of about `bytes` bytes. */
static char *make_text(size_t bytes, size_t *len_out) {
    char *t = loom_xmalloc(bytes + 64);
    size_t len = 0;
    unsigned long long rng = 42;
    int words_in_sentence = 0;
    while (len < bytes) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        unsigned r = (unsigned)(rng >> 33);
        const char *w = WORDS[r % LOOM_ARRAY_LEN(WORDS)];
        if (words_in_sentence == 0) {
            len += (size_t)sprintf(t + len, "%c%s", w[0] - 32, w + 1);
        } else if (r % 41 == 0) {
            len += (size_t)sprintf(t + len, " %u", r % 100000);
        } else {
            len += (size_t)sprintf(t + len, " %s", w);
        }
        words_in_sentence++;
        if (r % 13 == 0 && words_in_sentence > 3) {
            t[len++] = ',';
        } else if (words_in_sentence > 6 && r % 7 == 0) {
            static const char ends[] = ".!?.";
            t[len++] = ends[(r >> 8) % 4];
            t[len++] = (r >> 12) % 5 == 0 ? '\n' : ' ';
            if (t[len - 1] == ' ') len--;
            if ((r >> 16) % 9 == 0) t[len++] = '\n';
            words_in_sentence = 0;
        }
    }
    t[len] = 0;
    *len_out = len;
    return t;
}

/* Seconds taken by each measured step, best over the repetitions. */
typedef struct {
    double whole, requests, decode, stream;
} timings_t;

static double best(double a, double b) {
    return a < b ? a : b;
}

static void bench_dir(const char *dir, const char *text, size_t len, int reps) {
    loom_err_t err = {0};
    loom_tokenizer_t *tok = NULL;
    if (loom_tokenizer_load(dir, &tok, &err) != LOOM_OK) {
        fprintf(stderr, "%s: %s\n", dir, err.msg);
        return;
    }
    const double mb = (double)len / 1e6;
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0, total_tokens = 0;
    size_t n_req = 0, tokens_req = 0, dec_bytes = 0;
    size_t piece_cap = loom_tokenizer_max_piece_len(tok) + 256;
    char *piece = loom_xmalloc(piece_cap);
    timings_t t = {1e30, 1e30, 1e30, 1e30};
    for (int rep = 0; rep < reps; rep++) {
        /* One call over everything. */
        double t0 = loom_now_s();
        if (loom_tokenizer_encode(tok, text, len, 0, 1, &ids, &n_ids, &cap, &err) != LOOM_OK) {
            fprintf(stderr, "%s: encode: %s\n", dir, err.msg);
            break;
        }
        t.whole = best(t.whole, loom_now_s() - t0);
        total_tokens = n_ids;

        /* ~2 KB requests, cut at spaces so words stay whole. */
        n_req = tokens_req = dec_bytes = 0;
        double t_req = 0, t_dec = 0, t_stream = 0;
        for (size_t at = 0; at < len;) {
            size_t end = at + 2048 < len ? at + 2048 : len;
            while (end < len && text[end] != ' ')
                end++;
            t0 = loom_now_s();
            loom_tokenizer_encode(tok, text + at, end - at, 1, 1, &ids, &n_ids, &cap, &err);
            t_req += loom_now_s() - t0;
            tokens_req += (size_t)n_ids;
            t0 = loom_now_s();
            char *s = loom_tokenizer_decode(tok, ids, n_ids, 1, NULL);
            t_dec += loom_now_s() - t0;
            dec_bytes += strlen(s);
            free(s);
            t0 = loom_now_s();
            loom_detok_t d;
            loom_detok_init(&d, tok, 1, 1);
            for (int i = 0; i < n_ids; i++)
                loom_detok_push(&d, ids[i], piece, piece_cap);
            loom_detok_flush(&d, piece, piece_cap);
            t_stream += loom_now_s() - t0;
            n_req++;
            at = end;
        }
        t.requests = best(t.requests, t_req);
        t.decode = best(t.decode, t_dec);
        t.stream = best(t.stream, t_stream);
    }
    if (t.requests < 1e30) {
        printf("%s (vocab %d)\n", dir, loom_tokenizer_vocab_size(tok));
        printf("  encode, one call:      %7.2f MB/s  %6.2f M tokens/s  (%d tokens, %.2f "
               "bytes/token)\n",
               mb / t.whole, total_tokens / t.whole / 1e6, total_tokens,
               (double)len / total_tokens);
        printf("  encode, %zu x ~2 KB:  %7.2f MB/s  %6.2f M tokens/s\n", n_req, mb / t.requests,
               (double)tokens_req / t.requests / 1e6);
        printf("  decode (whole):        %7.2f MB/s  %6.2f M tokens/s\n",
               (double)dec_bytes / 1e6 / t.decode, (double)tokens_req / t.decode / 1e6);
        printf("  decode (streaming):    %7.2f MB/s  %6.2f M tokens/s\n",
               (double)dec_bytes / 1e6 / t.stream, (double)tokens_req / t.stream / 1e6);
    }
    free(piece);
    free(ids);
    loom_tokenizer_destroy(&tok);
}

int main(int argc, char **argv) {
    double mb = 10;
    int reps = 3;
    const char *dirs[16];
    int n_dirs = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mb") == 0 && i + 1 < argc)
            mb = atof(argv[++i]);
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (n_dirs < 16)
            dirs[n_dirs++] = argv[i];
    }
    if (n_dirs == 0 || mb <= 0 || reps < 1) {
        fprintf(stderr, "usage: %s TOKENIZER_DIR [DIR...] [--mb 10] [--reps 3]\n", argv[0]);
        return 2;
    }
    size_t len;
    char *text = make_text((size_t)(mb * 1e6), &len);
    printf("text: %.1f MB of generated English-like text\n", (double)len / 1e6);
    for (int i = 0; i < n_dirs; i++)
        bench_dir(dirs[i], text, len, reps);
    free(text);
    return 0;
}
