/* The model directory's digests (common/model_digest.h): what the router
 * compares at join, so a replica with other weights under the same name is
 * refused. */
#include "common/model_digest.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "common/util.h"

#define DIGEST_BYTES 16
#define SAMPLE_BYTES 256

static void put_u64(crypto_generichash_state *h, uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    crypto_generichash_update(h, b, sizeof b);
}

static void put_str(crypto_generichash_state *h, const char *s) {
    put_u64(h, strlen(s));
    crypto_generichash_update(h, (const uint8_t *)s, strlen(s));
}

/* A file's bytes, length first (an absent file: length 0). */
static void put_file(crypto_generichash_state *h, const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        put_u64(h, 0);
        return;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    put_u64(h, n > 0 ? (uint64_t)n : 0);
    uint8_t buf[65536];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, f)) > 0)
        crypto_generichash_update(h, buf, got);
    fclose(f);
}

static void hex(const uint8_t *d, char out[LOOM_DIGEST_HEX]) {
    int n = snprintf(out, LOOM_DIGEST_HEX, "b2:");
    for (int i = 0; i < DIGEST_BYTES; i++)
        n += snprintf(out + n, (size_t)(LOOM_DIGEST_HEX - n), "%02x", d[i]);
}

static int by_name(const void *a, const void *b) {
    const loom_st_tensor_t *x = *(const loom_st_tensor_t *const *)a,
                           *y = *(const loom_st_tensor_t *const *)b;
    return strcmp(x->name, y->name);
}

loom_status_t loom_model_digest(const char *dir, char weights[LOOM_DIGEST_HEX],
                                char tokenizer[LOOM_DIGEST_HEX], loom_err_t *err) {
    weights[0] = tokenizer[0] = '\0';
    if (sodium_init() < 0)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "libsodium did not initialise");
    crypto_generichash_state h;
    uint8_t d[DIGEST_BYTES];
    crypto_generichash_init(&h, NULL, 0, DIGEST_BYTES);
    put_str(&h, "loom tokenizer digest v1");
    put_file(&h, dir, "tokenizer.json");
    put_file(&h, dir, "tokenizer_config.json");
    crypto_generichash_final(&h, d, sizeof d);
    hex(d, tokenizer);
    loom_st_t *st = NULL;
    LOOM_CHECK(loom_st_open_dir(dir, &st, err));
    int n = loom_st_count(st);
    const loom_st_tensor_t **ts = loom_xcalloc((size_t)(n > 0 ? n : 1), sizeof *ts);
    for (int i = 0; i < n; i++)
        ts[i] = loom_st_at(st, i);
    qsort(ts, (size_t)n, sizeof *ts, by_name);
    /* each file's data section starts at the lowest data address of its tensors */
    const char **files = loom_xcalloc((size_t)(n > 0 ? n : 1), sizeof *files);
    const uint8_t **bases = loom_xcalloc((size_t)(n > 0 ? n : 1), sizeof *bases);
    int n_files = 0;
    for (int i = 0; i < n; i++) {
        int f = 0;
        while (f < n_files && strcmp(files[f], ts[i]->file))
            f++;
        if (f == n_files) {
            files[n_files] = ts[i]->file;
            bases[n_files++] = ts[i]->data;
        } else if ((const uint8_t *)ts[i]->data < bases[f]) {
            bases[f] = ts[i]->data;
        }
    }
    crypto_generichash_init(&h, NULL, 0, DIGEST_BYTES);
    put_str(&h, "loom weights digest v1");
    put_file(&h, dir, "config.json");
    put_u64(&h, (uint64_t)n);
    for (int i = 0; i < n; i++) {
        const loom_st_tensor_t *t = ts[i];
        int f = 0;
        while (strcmp(files[f], t->file))
            f++;
        const uint8_t *base = bases[f];
        put_str(&h, t->name);
        put_str(&h, loom_dtype_name(t->dtype));
        put_u64(&h, (uint64_t)t->n_dims);
        for (int k = 0; k < t->n_dims; k++)
            put_u64(&h, (uint64_t)t->shape[k]);
        put_u64(&h, t->nbytes);
        put_u64(&h, (uint64_t)((const uint8_t *)t->data - base));
        const uint8_t *p = t->data;
        if (t->nbytes <= 3 * SAMPLE_BYTES) {
            crypto_generichash_update(&h, p, t->nbytes);
        } else {
            size_t mid = (t->nbytes / 2) & ~(size_t)(SAMPLE_BYTES - 1);
            crypto_generichash_update(&h, p, SAMPLE_BYTES);
            crypto_generichash_update(&h, p + mid, SAMPLE_BYTES);
            crypto_generichash_update(&h, p + t->nbytes - SAMPLE_BYTES, SAMPLE_BYTES);
        }
    }
    crypto_generichash_final(&h, d, sizeof d);
    hex(d, weights);
    free(ts);
    free(files);
    free(bases);
    loom_st_close(&st);
    return LOOM_OK;
}
