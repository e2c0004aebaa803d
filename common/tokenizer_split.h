/* Pre-tokenizer splits of the byte-level BPE families, matched by hand
 * instead of by a regex engine. Each supported pattern is recognized from
 * its exact regex text in tokenizer.json; loom_split_match() then returns
 * where the match that starts at a given position ends, with the
 * leftmost-first alternation and backtracking semantics of the regex
 * (Oniguruma / HF tokenizers: \s is the White_Space property, \p{..}
 * general categories, (?i:) folds ASCII). */
#ifndef LOOM_TOKENIZER_SPLIT_H
#define LOOM_TOKENIZER_SPLIT_H

#include <stddef.h>

typedef enum {
    LOOM_SPLIT_NONE,    /* unknown pattern, or no regex split */
    LOOM_SPLIT_GPT2,    /* 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    LOOM_SPLIT_LLAMA3,  /* (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^..]+[\r\n]*|... */
    LOOM_SPLIT_QWEN2,   /* as Llama 3 with \p{N} one digit at a time */
    LOOM_SPLIT_TEKKEN,  /* Mistral-Nemo: case-aware letter runs, single digits */
    LOOM_SPLIT_O200K,   /* GPT-4o / gpt-oss: tekken with \p{N}{1,3} and contraction suffixes */
    LOOM_SPLIT_DIGITS3, /* \p{N}{1,3} (DeepSeek V3, first split) */
    LOOM_SPLIT_DS_CJK,  /* [\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+ (DeepSeek V3, second) */
    LOOM_SPLIT_DEEPSEEK_V3, /* [ASCII punct][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|... */
} loom_split_t;

/* The split whose regex is exactly `regex` (a raw CR or LF in it counts as
 * \r or \n), or LOOM_SPLIT_NONE. */
loom_split_t loom_split_recognize(const char *regex);

/* 1 when every character starts a match of the pattern (the matches tile
 * any text, so there are no gaps between them). */
int loom_split_tiles(loom_split_t kind);

/* End of the match that starts exactly at s[i] (i < n), or i when no
 * alternative matches there. s[0..n) is the whole subject: lookaheads see
 * its end, not what follows it. */
size_t loom_split_match(loom_split_t kind, const unsigned char *s, size_t n, size_t i);

#endif
