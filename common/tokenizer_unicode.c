/* Lookups over the generated Unicode tables, and NFC normalization
 * (canonical decomposition, canonical ordering, canonical composition, with
 * Hangul done algorithmically). Text without any character that NFC can
 * touch is copied through unchanged, which is the common case. */
#include "common/tokenizer_unicode.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

enum {
    SBASE = 0xAC00,
    LBASE = 0x1100,
    VBASE = 0x1161,
    TBASE = 0x11A7,
    LCOUNT = 19,
    VCOUNT = 21,
    TCOUNT = 28,
    NCOUNT = VCOUNT * TCOUNT,
    SCOUNT = LCOUNT * NCOUNT,
};

unsigned loom_uc_class_slow(uint32_t cp) {
    if (cp > 0x10FFFF) return 0;
    int lo = 0, hi = loom_uc_class_n - 1; /* the last range starting at or before cp */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (loom_uc_class_start[mid] <= cp)
            lo = mid;
        else
            hi = mid - 1;
    }
    return loom_uc_class_bits[lo];
}

size_t loom_utf8_put(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Index of the range [first[i], last[i]] holding cp, or -1. */
static int range_find(const uint32_t *first, const uint32_t *last, int n, uint32_t cp) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < first[mid])
            hi = mid - 1;
        else if (cp > last[mid])
            lo = mid + 1;
        else
            return mid;
    }
    return -1;
}

int loom_uc_nfc_unsafe(uint32_t cp) {
    if (cp < 0x300) return 0; /* nothing below the combining diacritics block */
    return range_find(loom_uc_nfc_unsafe_first, loom_uc_nfc_unsafe_last, loom_uc_nfc_unsafe_n,
                      cp) >= 0;
}

static unsigned ccc_of(uint32_t cp) {
    if (cp < 0x300) return 0;
    int i = range_find(loom_uc_ccc_first, loom_uc_ccc_last, loom_uc_ccc_n, cp);
    return i < 0 ? 0 : loom_uc_ccc_value[i];
}

/* Writes the full canonical decomposition of cp to out (room for 4);
 * returns its length. */
static size_t decompose(uint32_t cp, uint32_t *out) {
    if (cp >= SBASE && cp < SBASE + SCOUNT) {
        uint32_t s = cp - SBASE;
        size_t k = 0;
        out[k++] = LBASE + s / NCOUNT;
        out[k++] = VBASE + (s % NCOUNT) / TCOUNT;
        if (s % TCOUNT) out[k++] = TBASE + s % TCOUNT;
        return k;
    }
    int lo = 0, hi = loom_uc_decomp_n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (loom_uc_decomp_cp[mid] < cp) {
            lo = mid + 1;
        } else if (loom_uc_decomp_cp[mid] > cp) {
            hi = mid - 1;
        } else {
            uint32_t ix = loom_uc_decomp_index[mid];
            size_t k = ix >> 16;
            memcpy(out, loom_uc_decomp_data + (ix & 0xFFFF), k * sizeof *out);
            return k;
        }
    }
    out[0] = cp;
    return 1;
}

/* The primary composite of (a, b), or 0 when there is none. */
static uint32_t compose(uint32_t a, uint32_t b) {
    if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
    if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE &&
        b < TBASE + TCOUNT)
        return a + (b - TBASE);
    uint64_t key = ((uint64_t)a << 21) | b;
    int lo = 0, hi = loom_uc_comp_n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        uint64_t k = ((uint64_t)loom_uc_comp_first[mid] << 21) | loom_uc_comp_second[mid];
        if (k < key)
            lo = mid + 1;
        else if (k > key)
            hi = mid - 1;
        else
            return loom_uc_comp_result[mid];
    }
    return 0;
}

static void out_reserve(char **out, size_t *out_len, size_t *cap, size_t more) {
    if (*out_len + more > *cap) {
        *cap = (*out_len + more) * 2 + 64;
        *out = loom_xrealloc(*out, *cap);
    }
}

/* NFC of a segment of well-formed characters (no ill-formed bytes inside). */
static void nfc_segment(const unsigned char *s, size_t n, char **out, size_t *out_len,
                        size_t *cap) {
    /* A decomposition has at most 4 code points and comes from a character
     * of at least 2 bytes (3 from 2 is the densest), so 2n + 4 is room. */
    uint32_t stack_buf[128];
    size_t room = 2 * n + 4;
    uint32_t *heap = room > LOOM_ARRAY_LEN(stack_buf) ? loom_xmalloc(room * sizeof *heap) : NULL;
    uint32_t *buf = heap ? heap : stack_buf;
    size_t len = 0;
    for (size_t i = 0; i < n;) {
        size_t l;
        uint32_t cp = loom_utf8_next(s, n, i, &l);
        i += l;
        len += decompose(cp, buf + len);
    }
    /* Canonical ordering: stable insertion sort of each run of non-starters. */
    for (size_t i = 1; i < len; i++) {
        unsigned c = ccc_of(buf[i]);
        if (!c) continue;
        uint32_t x = buf[i];
        size_t j = i;
        while (j > 0 && ccc_of(buf[j - 1]) > c) {
            buf[j] = buf[j - 1];
            j--;
        }
        buf[j] = x;
    }
    /* Canonical composition. */
    if (len > 0) {
        size_t starter = 0, kept = 1;
        unsigned last_class = ccc_of(buf[0]) ? 256 : 0;
        for (size_t i = 1; i < len; i++) {
            uint32_t ch = buf[i];
            unsigned c = ccc_of(ch);
            uint32_t comp = compose(buf[starter], ch);
            if (comp && (last_class < c || last_class == 0)) {
                buf[starter] = comp;
                continue;
            }
            if (c == 0) starter = kept;
            last_class = c;
            buf[kept++] = ch;
        }
        len = kept;
    }
    out_reserve(out, out_len, cap, len * 4);
    for (size_t i = 0; i < len; i++)
        *out_len += loom_utf8_put(buf[i], *out + *out_len);
    free(heap);
}

void loom_uc_nfc_append(const char *text, size_t n, char **out, size_t *out_len, size_t *cap) {
    const unsigned char *s = (const unsigned char *)text;
    size_t copied = 0; /* s[copied..i) is pending verbatim copy */
    size_t i = 0;
    while (i < n) {
        size_t l = 1;
        uint32_t cp = s[i];
        if (cp >= 0x80) cp = loom_utf8_next(s, n, i, &l);
        if (cp == 0xFFFFFFFFu || !loom_uc_nfc_unsafe(cp)) {
            i += l;
            continue;
        }
        /* The segment to normalize starts at the last safe character before
         * cp (a starter NFC cannot merge with what precedes it) and ends
         * before the next safe character or ill-formed byte. */
        size_t seg = i;
        while (seg > copied) {
            size_t p = seg - 1;
            while (p > copied && (s[p] & 0xC0) == 0x80)
                p--;
            size_t pl;
            uint32_t pc = loom_utf8_next(s, n, p, &pl);
            if (pc == 0xFFFFFFFFu || p + pl != seg) break;
            seg = p;
            if (!loom_uc_nfc_unsafe(pc)) break;
        }
        size_t end = i + l;
        while (end < n) {
            size_t nl;
            uint32_t nc = loom_utf8_next(s, n, end, &nl);
            if (nc == 0xFFFFFFFFu || !loom_uc_nfc_unsafe(nc)) break;
            end += nl;
        }
        if (seg > copied) {
            out_reserve(out, out_len, cap, seg - copied);
            memcpy(*out + *out_len, s + copied, seg - copied);
            *out_len += seg - copied;
        }
        nfc_segment(s + seg, end - seg, out, out_len, cap);
        copied = i = end;
    }
    out_reserve(out, out_len, cap, n - copied + 1);
    memcpy(*out + *out_len, s + copied, n - copied);
    *out_len += n - copied;
}
