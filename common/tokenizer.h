/* BPE tokenizer loaded from a Hugging Face tokenizer.json (+ the optional
 * tokenizer_config.json beside it). Two families are supported:
 *  - SentencePiece style (Llama 2, TinyLlama, Mistral v0.1): the "▁" space
 *    normalizer (Prepend + Replace), merges by rank, byte fallback <0xNN>;
 *  - GPT-2 byte-level (Llama 3, Qwen2, Mistral-Nemo): a regex pre-tokenizer
 *    split, bytes mapped to printable code points, merges by rank.
 * Added tokens (special or not) are matched in the text before BPE when asked.
 * Encoding is on the request path, so it avoids per-token allocation. */
#ifndef LOOM_TOKENIZER_H
#define LOOM_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct loom_tokenizer loom_tokenizer_t;

/* Loads DIR/tokenizer.json and, when present, DIR/tokenizer_config.json
 * (add_bos_token, bos/eos token names, chat_template is read elsewhere). */
loom_status_t loom_tokenizer_load(const char *dir, loom_tokenizer_t **out, loom_err_t *err);
/* Same from in-memory JSON texts (config_json may be NULL); for tests. */
loom_status_t loom_tokenizer_load_json(const char *tokenizer_json, size_t len,
                                       const char *config_json, size_t config_len,
                                       loom_tokenizer_t **out, loom_err_t *err);
void loom_tokenizer_destroy(loom_tokenizer_t **tok_p); /* safe on NULL and twice */

int loom_tokenizer_vocab_size(const loom_tokenizer_t *tok); /* largest id + 1 */
int loom_tokenizer_bos_id(const loom_tokenizer_t *tok);     /* -1 if none */
int loom_tokenizer_eos_id(const loom_tokenizer_t *tok);     /* -1 if none */
int loom_tokenizer_add_bos(const loom_tokenizer_t *tok);    /* add_bos_token from the config */
int loom_tokenizer_is_special(const loom_tokenizer_t *tok, int32_t id);
/* The token's string as stored in the vocabulary (e.g. "▁the", "Ġthe", "<0x0A>"); NULL if out of range. */
const char *loom_tokenizer_piece(const loom_tokenizer_t *tok, int32_t id);
/* The token's decoded bytes (the "▁" space and <0xNN> bytes resolved, as
 * decode gives them mid-text); NULL if out of range. *len gets the length. */
const char *loom_tokenizer_token_bytes(const loom_tokenizer_t *tok, int32_t id, size_t *len);
/* Longest decoded text of any single token, in bytes. */
size_t loom_tokenizer_max_piece_len(const loom_tokenizer_t *tok);
/* Id of an exact vocabulary or added-token string, -1 if absent. */
int32_t loom_tokenizer_token_id(const loom_tokenizer_t *tok, const char *piece);

/* Encodes text[0..len). add_bos: prepend BOS when the tokenizer has one and
 * its config says add_bos_token (pass 0 to never add). parse_special: match
 * added tokens written literally in the text ("<|eot_id|>"); otherwise they
 * are encoded as plain text. The ids are written from index 0 of *ids,
 * which is NULL or a malloc'ed buffer of *cap entries, grown as needed (so
 * a caller can reuse one buffer across calls); *n_ids is set to the count. */
loom_status_t loom_tokenizer_encode(const loom_tokenizer_t *tok, const char *text, size_t len,
                                    int add_bos, int parse_special, int32_t **ids, int *n_ids,
                                    int *cap, loom_err_t *err);
/* As encode with parse_special, except over the n_plain byte ranges
 * [plain[2i], plain[2i+1]) of text (in order, disjoint): no special added
 * token is matched that overlaps one, so special-token text there is plain
 * text (a chat message's content inside its template, see
 * loom_chat_render_spans); non-special added tokens match as usual. The
 * text between special tokens is encoded as one piece exactly as encode
 * would, so a text without special-token text in its spans gives the same
 * ids as encode. */
loom_status_t loom_tokenizer_encode_spans(const loom_tokenizer_t *tok, const char *text,
                                          size_t len, int add_bos, const size_t *plain,
                                          size_t n_plain, int32_t **ids, int *n_ids, int *cap,
                                          loom_err_t *err);

/* Decodes ids to a malloc'ed string (as HF's decode with
 * skip_special_tokens=skip_special, then transformers'
 * clean_up_tokenization_spaces when the config asks for it). Invalid UTF-8
 * becomes U+FFFD. The text may contain NUL bytes (a decoded <0x00>): its
 * length is stored in *len when len is not NULL; a NUL follows it. */
char *loom_tokenizer_decode(const loom_tokenizer_t *tok, const int32_t *ids, int n,
                            int skip_special, size_t *len);

/* Incremental detokenizer for streaming: feeds one id at a time and emits
 * only whole UTF-8 characters; bytes of a partial character are held until
 * it completes. `at_start` = 1 when the first fed token starts the text (then
 * the SentencePiece leading space is stripped, as HF does); 0 when the tokens
 * continue a prompt (the space is kept). */
#define LOOM_DETOK_CLEANUP_STAGES 10
#define LOOM_DETOK_RUN            64
typedef struct loom_detok {
    const loom_tokenizer_t *tok;
    int skip_special;
    const int32_t *keep; /* special tokens written even so (loom_detok_keep) */
    int n_keep;
    int at_start;
    int n_pending;
    /* Held bytes: an incomplete UTF-8 character, or with a ByteFallback
     * decoder the <0xNN> run so far (judged whole when it ends, as decode
     * does; a run is judged every LOOM_DETOK_RUN bytes when longer). */
    unsigned char pending[64];
    /* clean_up_tokenization_spaces: bytes each replacement stage holds */
    unsigned char cleanup[LOOM_DETOK_CLEANUP_STAGES][4];
    unsigned char n_cleanup[LOOM_DETOK_CLEANUP_STAGES];
} loom_detok_t;

void loom_detok_init(loom_detok_t *d, const loom_tokenizer_t *tok, int skip_special, int at_start);
/* With skip_special: these special tokens are written all the same (a
 * tool-call parser's markers); ids[] must outlive d. */
void loom_detok_keep(loom_detok_t *d, const int32_t *ids, int n);
/* Appends the newly complete text to out (at most cap-1 bytes, always
 * NUL-terminated; the text itself may hold NULs) and returns its length.
 * cap >= loom_tokenizer_max_piece_len() + 256 is always enough for one token;
 * longer output would be truncated. */
size_t loom_detok_push(loom_detok_t *d, int32_t id, char *out, size_t cap);
/* At the end of a stream: emits held bytes (U+FFFD for an incomplete character). */
size_t loom_detok_flush(loom_detok_t *d, char *out, size_t cap);

#endif
