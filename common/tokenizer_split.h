/* Pre-tokenizer splits of the byte-level BPE families, matched by hand
 * instead of by a regex engine. Each supported pattern is recognized from
 * its exact regex text in tokenizer.json; loom_split_next() then returns
 * where the next match ends, with the leftmost-first alternation and
 * backtracking semantics of the regex (Oniguruma / HF tokenizers: \s is the
 * White_Space property, \p{..} general categories, (?i:) folds ASCII). */
#ifndef LOOM_TOKENIZER_SPLIT_H
#define LOOM_TOKENIZER_SPLIT_H

#include <stddef.h>

typedef enum {
    LOOM_SPLIT_NONE,   /* unknown pattern, or no regex split */
    LOOM_SPLIT_GPT2,   /* 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    LOOM_SPLIT_LLAMA3, /* (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^..]+[\r\n]*|... */
    LOOM_SPLIT_QWEN2,  /* as Llama 3 with \p{N} one digit at a time */
    LOOM_SPLIT_TEKKEN, /* Mistral-Nemo: case-aware letter runs, single digits */
} loom_split_t;

/* The split whose regex is exactly `regex`, or LOOM_SPLIT_NONE. */
loom_split_t loom_split_recognize(const char *regex);

/* End of the match that starts at s[i] (i < n); always > i. Every character
 * is covered by some alternative, so matches tile the text. */
size_t loom_split_next(loom_split_t kind, const unsigned char *s, size_t n, size_t i);

#endif
