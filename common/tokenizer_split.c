/* Hand-written matchers for the pre-tokenizer regexes of GPT-2, Llama 3,
 * Qwen2, Mistral tekken, o200k (GPT-4o, gpt-oss) and DeepSeek V3 (see
 * tokenizer_split.h). Each next_* function tries its regex's alternatives in
 * order, as a backtracking engine would, and returns i when none matches. */
#include "common/tokenizer_split.h"

#include <stdbool.h>
#include <string.h>

#include "common/tokenizer_unicode.h"

static const char *const PATTERN_GPT2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char *const PATTERN_LLAMA3 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char *const PATTERN_QWEN2 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char *const PATTERN_TEKKEN =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char *const PATTERN_O200K =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char *const PATTERN_DIGITS3 = "\\p{N}{1,3}";
static const char *const PATTERN_DS_CJK = "[\xE4\xB8\x80-\xE9\xBE\xA5\xE3\x81\x80-\xE3\x82\x9F"
                                          "\xE3\x82\xA0-\xE3\x83\xBF]+";
static const char *const PATTERN_DEEPSEEK_V3 =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
    "[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* End of the run of characters whose class has a bit of `mask`, from i. */
static inline size_t run_end(const unsigned char *s, size_t n, size_t i, unsigned mask) {
    size_t l;
    while (i < n && (loom_uc_class_at(s, n, i, &l) & mask))
        i += l;
    return i;
}

/* [^\s\p{L}\p{N}]: punctuation, symbols, marks, controls, ill-formed bytes. */
static inline bool is_other(unsigned cls) {
    return !(cls & (LOOM_UC_L | LOOM_UC_N | LOOM_UC_WS));
}

/* [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]: ASCII punctuation and symbols. */
static inline bool ispunct_ascii(unsigned char c) {
    return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') ||
           (c >= '{' && c <= '~');
}

static inline int lower_ascii(int c) {
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

/* 's|'t|'re|'ve|'m|'ll|'d (ASCII case-folded when `fold`): the length, or 0. */
static size_t match_contraction(const unsigned char *s, size_t n, size_t i, bool fold) {
    if (s[i] != '\'' || i + 1 >= n) return 0;
    int a = fold ? lower_ascii(s[i + 1]) : s[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (i + 2 >= n) return 0;
    int b = fold ? lower_ascii(s[i + 2]) : s[i + 2];
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* The whitespace alternatives every pattern ends with, at a \s character:
 *   \s*[\r\n]+  (when `newlines`): backtracking makes it end right after the
 *               last \r or \n of the whitespace run;
 *   \s+(?!\S)   the run, less its last character when a non-space follows;
 *   \s+         the whole run (only reached for a run of one). */
static size_t match_spaces(const unsigned char *s, size_t n, size_t i, bool newlines) {
    size_t j = i, last_start = i, after_newline = 0, l;
    while (j < n && (loom_uc_class_at(s, n, j, &l) & LOOM_UC_WS)) {
        if (s[j] == '\r' || s[j] == '\n') after_newline = j + 1;
        last_start = j;
        j += l;
    }
    if (newlines && after_newline) return after_newline;
    if (j == n) return n;
    if (last_start > i) return last_start;
    return j;
}

/* ` ?[^\s\p{L}\p{N}]+` followed by `[trail]*` (trail may be NULL): the end,
 * or 0 when it does not match. */
static size_t match_other(const unsigned char *s, size_t n, size_t i, const char *trail) {
    size_t p = i, l;
    if (s[i] == ' ' && i + 1 < n && is_other(loom_uc_class_at(s, n, i + 1, &l))) p = i + 1;
    if (!is_other(loom_uc_class_at(s, n, p, &l))) return 0;
    size_t j = p;
    while (j < n && is_other(loom_uc_class_at(s, n, j, &l)))
        j += l;
    if (trail)
        while (j < n && s[j] && strchr(trail, s[j]))
            j++;
    return j;
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t next_gpt2(const unsigned char *s, size_t n, size_t i) {
    size_t l, k;
    if ((k = match_contraction(s, n, i, false))) return i + k;
    unsigned c0 = loom_uc_class_at(s, n, i, &l);
    unsigned c1 = 0; /* the class after a leading space */
    if (s[i] == ' ' && i + 1 < n) c1 = loom_uc_class_at(s, n, i + 1, &l);
    if (c1 & LOOM_UC_L) return run_end(s, n, i + 1, LOOM_UC_L);
    if (c0 & LOOM_UC_L) return run_end(s, n, i, LOOM_UC_L);
    if (c1 & LOOM_UC_N) return run_end(s, n, i + 1, LOOM_UC_N);
    if (c0 & LOOM_UC_N) return run_end(s, n, i, LOOM_UC_N);
    if ((k = match_other(s, n, i, NULL))) return k;
    return match_spaces(s, n, i, false);
}

/* Llama 3 (max_digits 3) and Qwen2 (max_digits 1):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max}|
 *  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t next_llama3(const unsigned char *s, size_t n, size_t i, int max_digits) {
    size_t l, l1, k;
    if ((k = match_contraction(s, n, i, true))) return i + k;
    unsigned c0 = loom_uc_class_at(s, n, i, &l);
    bool prefix = !(c0 & (LOOM_UC_L | LOOM_UC_N)) && s[i] != '\r' && s[i] != '\n' && i + l < n;
    if (prefix && (loom_uc_class_at(s, n, i + l, &l1) & LOOM_UC_L))
        return run_end(s, n, i + l, LOOM_UC_L);
    if (c0 & LOOM_UC_L) return run_end(s, n, i, LOOM_UC_L);
    if (c0 & LOOM_UC_N) {
        size_t j = i + l;
        for (int d = 1; d < max_digits && j < n && (loom_uc_class_at(s, n, j, &l1) & LOOM_UC_N);
             d++)
            j += l1;
        return j;
    }
    if ((k = match_other(s, n, i, "\r\n"))) return k;
    return match_spaces(s, n, i, true);
}

/* Tekken's two letter classes: U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and
 * W = [\p{Ll}\p{Lm}\p{Lo}\p{M}]; they overlap in Lm, Lo and M. */
#define TEKKEN_U (LOOM_UC_LU | LOOM_UC_LT | LOOM_UC_LM | LOOM_UC_LO | LOOM_UC_M)
#define TEKKEN_W (LOOM_UC_LL | LOOM_UC_LM | LOOM_UC_LO | LOOM_UC_M)

/* U*W+ from p, or 0. U* first takes the whole U run; if a W character follows
 * (an Ll), W+ takes the W run from there. Otherwise U* gives characters back
 * until W+ can start: the match ends after the last W inside the U run. */
static size_t tekken_u_star_w_plus(const unsigned char *s, size_t n, size_t p) {
    size_t j = p, last_w_end = 0, l;
    while (j < n) {
        unsigned c = loom_uc_class_at(s, n, j, &l);
        if (!(c & TEKKEN_U)) break;
        if (c & TEKKEN_W) last_w_end = j + l;
        j += l;
    }
    if (j < n && (loom_uc_class_at(s, n, j, &l) & TEKKEN_W)) return run_end(s, n, j, TEKKEN_W);
    return last_w_end;
}

/* U+W* from p, or 0. */
static size_t tekken_u_plus_w_star(const unsigned char *s, size_t n, size_t p) {
    size_t j = run_end(s, n, p, TEKKEN_U);
    return j == p ? 0 : run_end(s, n, j, TEKKEN_W);
}

/* Tekken (max_digits 1) and o200k (max_digits 3, with contraction suffixes):
 * [^\r\n\p{L}\p{N}]?U*W+C?|[^\r\n\p{L}\p{N}]?U+W*C?|\p{N}{1,max}|
 *  ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * where C = (?i:'s|'t|'re|'ve|'m|'ll|'d) when `suffix`. The optional prefix
 * is tried taken, then not; the optional C is taken when it is there. */
static size_t next_tekken(const unsigned char *s, size_t n, size_t i, int max_digits, bool suffix) {
    size_t l, l1, k;
    unsigned c0 = loom_uc_class_at(s, n, i, &l);
    bool prefix = !(c0 & (LOOM_UC_L | LOOM_UC_N)) && s[i] != '\r' && s[i] != '\n' && i + l < n;
    k = 0;
    if (prefix) k = tekken_u_star_w_plus(s, n, i + l);
    if (!k) k = tekken_u_star_w_plus(s, n, i);
    if (!k && prefix) k = tekken_u_plus_w_star(s, n, i + l);
    if (!k) k = tekken_u_plus_w_star(s, n, i);
    if (k) return suffix && k < n ? k + match_contraction(s, n, k, true) : k;
    if (c0 & LOOM_UC_N) {
        size_t j = i + l;
        for (int d = 1; d < max_digits && j < n && (loom_uc_class_at(s, n, j, &l1) & LOOM_UC_N);
             d++)
            j += l1;
        return j;
    }
    if ((k = match_other(s, n, i, "\r\n/"))) return k;
    return match_spaces(s, n, i, true);
}

/* \p{N}{1,3} */
static size_t next_digits3(const unsigned char *s, size_t n, size_t i) {
    size_t j = i, l;
    for (int d = 0; d < 3 && j < n && (loom_uc_class_at(s, n, j, &l) & LOOM_UC_N); d++)
        j += l;
    return j;
}

/* [\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+ */
static size_t next_ds_cjk(const unsigned char *s, size_t n, size_t i) {
    size_t j = i, l;
    while (j < n && s[j] >= 0xE3 && s[j] <= 0xE9) {
        uint32_t cp = loom_utf8_next(s, n, j, &l);
        if (!((cp >= 0x4E00 && cp <= 0x9FA5) || (cp >= 0x3040 && cp <= 0x30FF))) break;
        j += l;
    }
    return j;
}

static inline bool is_ascii_alpha(unsigned char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
}

/* DeepSeek V3's third split:
 * [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
 *  ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * Characters that are none of these (a lone digit, a control character)
 * match nothing: they are left in the gaps between matches. */
static size_t next_deepseek_v3(const unsigned char *s, size_t n, size_t i) {
    size_t l, l1, k;
    if (s[i] < 0x80 && ispunct_ascii(s[i]) && i + 1 < n && is_ascii_alpha(s[i + 1])) {
        k = i + 1;
        while (k < n && is_ascii_alpha(s[k]))
            k++;
        return k;
    }
    unsigned c0 = loom_uc_class_at(s, n, i, &l);
    const unsigned word = LOOM_UC_L | LOOM_UC_M, punct = LOOM_UC_P | LOOM_UC_S;
    bool prefix = !(c0 & (LOOM_UC_L | punct)) && s[i] != '\r' && s[i] != '\n' && i + l < n;
    if (prefix && (loom_uc_class_at(s, n, i + l, &l1) & word)) return run_end(s, n, i + l, word);
    if (c0 & word) return run_end(s, n, i, word);
    size_t p = i;
    if (s[i] == ' ' && i + 1 < n && (loom_uc_class_at(s, n, i + 1, &l1) & punct)) p = i + 1;
    if (loom_uc_class_at(s, n, p, &l1) & punct) {
        k = run_end(s, n, p, punct);
        while (k < n && (s[k] == '\r' || s[k] == '\n'))
            k++;
        return k;
    }
    if (c0 & LOOM_UC_WS) return match_spaces(s, n, i, true);
    return i;
}

/* Copies regex into buf with raw CR / LF written as \r / \n; 0 if too long. */
static bool canonical_regex(const char *regex, char *buf, size_t cap) {
    size_t k = 0;
    for (const char *p = regex; *p; p++) {
        if (k + 3 > cap) return false;
        if (*p == '\r' || *p == '\n') {
            buf[k++] = '\\';
            buf[k++] = *p == '\r' ? 'r' : 'n';
        } else {
            buf[k++] = *p;
        }
    }
    buf[k] = 0;
    return true;
}

loom_split_t loom_split_recognize(const char *regex) {
    static const struct {
        const char *const *pattern;
        loom_split_t kind;
    } known[] = {
        {&PATTERN_GPT2, LOOM_SPLIT_GPT2},     {&PATTERN_LLAMA3, LOOM_SPLIT_LLAMA3},
        {&PATTERN_QWEN2, LOOM_SPLIT_QWEN2},   {&PATTERN_TEKKEN, LOOM_SPLIT_TEKKEN},
        {&PATTERN_O200K, LOOM_SPLIT_O200K},   {&PATTERN_DIGITS3, LOOM_SPLIT_DIGITS3},
        {&PATTERN_DS_CJK, LOOM_SPLIT_DS_CJK}, {&PATTERN_DEEPSEEK_V3, LOOM_SPLIT_DEEPSEEK_V3},
    };
    char buf[1024];
    if (!regex || !canonical_regex(regex, buf, sizeof buf)) return LOOM_SPLIT_NONE;
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++)
        if (strcmp(buf, *known[k].pattern) == 0) return known[k].kind;
    return LOOM_SPLIT_NONE;
}

int loom_split_tiles(loom_split_t kind) {
    return kind == LOOM_SPLIT_GPT2 || kind == LOOM_SPLIT_LLAMA3 || kind == LOOM_SPLIT_QWEN2 ||
           kind == LOOM_SPLIT_TEKKEN || kind == LOOM_SPLIT_O200K;
}

size_t loom_split_match(loom_split_t kind, const unsigned char *s, size_t n, size_t i) {
    switch (kind) {
    case LOOM_SPLIT_GPT2:
        return next_gpt2(s, n, i);
    case LOOM_SPLIT_LLAMA3:
        return next_llama3(s, n, i, 3);
    case LOOM_SPLIT_QWEN2:
        return next_llama3(s, n, i, 1);
    case LOOM_SPLIT_TEKKEN:
        return next_tekken(s, n, i, 1, false);
    case LOOM_SPLIT_O200K:
        return next_tekken(s, n, i, 3, true);
    case LOOM_SPLIT_DIGITS3:
        return next_digits3(s, n, i);
    case LOOM_SPLIT_DS_CJK:
        return next_ds_cjk(s, n, i);
    case LOOM_SPLIT_DEEPSEEK_V3:
        return next_deepseek_v3(s, n, i);
    default:
        return i;
    }
}
