/* Tests for the safetensors reader: the stories260K checkpoint, half-precision
 * conversion, sharded checkpoints, and many malformed files built here (each
 * must fail with a message naming the file, and none may crash). */
#include <ftw.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/safetensors.h"
#include "common/util.h"
#include "tests/test.h"

static char g_tmp[256];

static void tmp_path(char *out, size_t n, const char *name) {
    loom_path_join(out, n, g_tmp, name);
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(2);
    }
    if (n && fwrite(p, 1, n, f) != n) {
        perror(path);
        exit(2);
    }
    fclose(f);
}

/* A safetensors image: length word, header padded with spaces to 8 bytes, data. */
static unsigned char *st_image(const char *header, const void *data, size_t ndata, size_t *len) {
    size_t h = strlen(header), padded = (h + 7) & ~(size_t)7;
    *len = 8 + padded + ndata;
    unsigned char *buf = loom_xmalloc(*len);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, header, h);
    memset(buf + 8 + h, ' ', padded - h);
    if (ndata) memcpy(buf + 8 + padded, data, ndata);
    return buf;
}

static void write_st(const char *path, const char *header, const void *data, size_t ndata) {
    size_t len;
    unsigned char *img = st_image(header, data, ndata, &len);
    write_bytes(path, img, len);
    free(img);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void make_dir(const char *name, char *out, size_t n) {
    tmp_path(out, n, name);
    nftw(out, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    mkdir(out, 0755);
}

/* ---- the real checkpoint -------------------------------------------------------------------- */

static void test_stories260k(void) {
    char dir[512];
    loom_path_join(dir, sizeof dir, test_models_dir(), "stories260K");
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    loom_status_t s = loom_st_open_dir(dir, &st, &err);
    CHECKF(s == LOOM_OK, "%s", err.msg);
    REQUIRE(st);
    CHECK(loom_st_count(st) == 47); /* embed + 5 layers x 9 + final norm */
    for (int i = 0; i < loom_st_count(st); i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        CHECK(loom_st_find(st, t->name) == t);
        CHECK(t->dtype == LOOM_DT_F32);
        CHECK(strstr(t->file, "model.safetensors") != NULL);
    }
    CHECK(loom_st_at(st, -1) == NULL && loom_st_at(st, 47) == NULL);
    CHECK(loom_st_find(st, "model.layers.9.self_attn.q_proj.weight") == NULL);

    const struct {
        const char *name;
        int n_dims;
        int64_t shape[2];
    } known[] = {
        {"model.embed_tokens.weight", 2, {512, 64}},
        {"model.layers.0.self_attn.q_proj.weight", 2, {64, 64}},
        {"model.layers.0.self_attn.k_proj.weight", 2, {32, 64}},
        {"model.layers.0.self_attn.v_proj.weight", 2, {32, 64}},
        {"model.layers.4.mlp.down_proj.weight", 2, {64, 172}},
        {"model.layers.2.mlp.gate_proj.weight", 2, {172, 64}},
        {"model.layers.3.input_layernorm.weight", 1, {64}},
        {"model.norm.weight", 1, {64}},
    };
    for (size_t i = 0; i < LOOM_ARRAY_LEN(known); i++) {
        const loom_st_tensor_t *t = NULL;
        s = loom_st_get(st, known[i].name, known[i].n_dims, known[i].shape, &t, &err);
        CHECKF(s == LOOM_OK && t, "%s: %s", known[i].name, err.msg);
    }

    /* Slices agree with the full tensor: rows (column-parallel) and cols (row-parallel). */
    const loom_st_tensor_t *t = NULL;
    s = loom_st_get(st, "model.layers.4.mlp.down_proj.weight", 2, (int64_t[]){64, 172}, &t, &err);
    REQUIRE(s == LOOM_OK);
    float *full = malloc(64 * 172 * sizeof *full), *part = malloc(64 * 172 * sizeof *part);
    float *raw = malloc(64 * 172 * sizeof *raw);
    memcpy(raw, t->data, t->nbytes);
    uint64_t before = loom_st_bytes_read(st);
    CHECK(loom_st_read_f32(st, t, 0, 64, 0, 172, full, &err) == LOOM_OK);
    CHECK(loom_st_bytes_read(st) - before == 64 * 172 * 4);
    CHECK(!memcmp(full, raw, t->nbytes));
    float sum = 0;
    for (int i = 0; i < 64 * 172; i++)
        sum += fabsf(full[i]);
    CHECK(sum > 0); /* real weights, not zeros */

    CHECK(loom_st_read_f32(st, t, 16, 16, 0, 172, part, &err) == LOOM_OK);
    CHECK(!memcmp(part, full + 16 * 172, 16 * 172 * sizeof *part));
    CHECK(loom_st_read_f32(st, t, 0, 64, 86, 43, part, &err) == LOOM_OK);
    int same = 1;
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < 43; c++)
            same &= part[r * 43 + c] == full[r * 172 + 86 + c];
    CHECK(same);
    CHECK(loom_st_read_f32(st, t, 5, 7, 3, 11, part, &err) == LOOM_OK);
    same = 1;
    for (int r = 0; r < 7; r++)
        for (int c = 0; c < 11; c++)
            same &= part[r * 11 + c] == full[(5 + r) * 172 + 3 + c];
    CHECK(same);
    CHECK(loom_st_bytes_read(st) - before == (64 * 172 + 16 * 172 + 64 * 43 + 7 * 11) * 4);

    /* A 1-D tensor is one row. */
    t = loom_st_find(st, "model.norm.weight");
    REQUIRE(t);
    CHECK(loom_st_read_f32(st, t, 0, 1, 10, 20, part, &err) == LOOM_OK);
    CHECK(!memcmp(part, (const float *)t->data + 10, 20 * sizeof(float)));
    CHECK(loom_st_read_f32(st, t, 1, 1, 0, 1, part, &err) == LOOM_ERR_INVALID_ARGUMENT);

    free(full);
    free(part);
    free(raw);
    loom_st_close(&st);
    CHECK(st == NULL);
    loom_st_close(&st); /* twice is fine */
    loom_st_close(NULL);

    /* The file opened directly gives the same tensors. */
    char path[600];
    loom_path_join(path, sizeof path, dir, "model.safetensors");
    s = loom_st_open_file(path, &st, &err);
    CHECKF(s == LOOM_OK, "%s", err.msg);
    CHECK(loom_st_count(st) == 47);
    loom_st_close(&st);
}

/* Tensor-parallel ranks load their shards on several threads at once. */
typedef struct reader {
    loom_st_t *st;
    const loom_st_tensor_t *t;
    int rank, fails;
} reader_t;

static void *reader_main(void *arg) {
    reader_t *r = arg;
    float buf[128 * 64];
    for (int it = 0; it < 50; it++)
        r->fails += loom_st_read_f32(r->st, r->t, r->rank * 128, 128, 0, 64, buf, NULL) != LOOM_OK;
    return NULL;
}

static void test_threads(void) {
    char dir[512];
    loom_path_join(dir, sizeof dir, test_models_dir(), "stories260K");
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_st_open_dir(dir, &st, &err) == LOOM_OK);
    const loom_st_tensor_t *t = loom_st_find(st, "model.embed_tokens.weight");
    REQUIRE(t);
    reader_t r[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        r[i] = (reader_t){st, t, i, 0};
        pthread_create(&th[i], NULL, reader_main, &r[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(r[i].fails == 0);
    }
    CHECK(loom_st_bytes_read(st) == 4ull * 50 * 128 * 64 * 4);
    loom_st_close(&st);
}

/* ---- conversions ---------------------------------------------------------------------------- */

static void test_half_conversion(void) {
    /* Every F16 and BF16 bit pattern, as [256, 256] tensors, then an F32 [3, 5]. */
    size_t nd = 2 * 65536 * 2 + 15 * 4;
    unsigned char *data = loom_xmalloc(nd);
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        memcpy(data + 2 * i, &h, 2);
        memcpy(data + 131072 + 2 * i, &h, 2);
    }
    float f32[15];
    unsigned long long rng = 7;
    for (int i = 0; i < 15; i++)
        f32[i] = test_randf(&rng, 3.0f);
    memcpy(data + 262144, f32, sizeof f32);
    const char *header =
        "{\"__metadata__\":{\"format\":\"pt\"},"
        "\"h\":{\"dtype\":\"F16\",\"shape\":[256,256],\"data_offsets\":[0,131072]},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[256,256],"
        "\"data_offsets\":[131072,262144]},"
        "\"f\":{\"dtype\":\"F32\",\"shape\":[3,5],\"data_offsets\":[262144,262204]}}";
    char path[512];
    tmp_path(path, sizeof path, "half.safetensors");
    write_st(path, header, data, nd);
    free(data);

    loom_st_t *st = NULL;
    loom_err_t err = {0};
    CHECKF(loom_st_open_file(path, &st, &err) == LOOM_OK, "%s", err.msg);
    REQUIRE(st);
    CHECK(loom_st_count(st) == 3);
    float *out = malloc(65536 * sizeof *out);
    const char *names[2] = {"h", "b"};
    for (int k = 0; k < 2; k++) {
        const loom_st_tensor_t *t = NULL;
        REQUIRE(loom_st_get(st, names[k], 2, (int64_t[]){256, 256}, &t, &err) == LOOM_OK);
        CHECK(t->dtype == (k ? LOOM_DT_BF16 : LOOM_DT_F16) && t->nbytes == 131072);
        REQUIRE(loom_st_read_f32(st, t, 0, 256, 0, 256, out, &err) == LOOM_OK);
        long bad = 0;
        for (uint32_t i = 0; i < 65536; i++) {
            float want = k ? loom_bf16_to_f32((uint16_t)i) : loom_f16_to_f32((uint16_t)i);
            int ok = isnan(want) ? isnan(out[i]) : !memcmp(&out[i], &want, 4);
            if (!ok && bad++ < 5)
                fprintf(stderr, "  %s 0x%04x: got %g want %g\n", names[k], i, (double)out[i],
                        (double)want);
        }
        CHECKF(bad == 0, "%s: %ld patterns converted wrongly", names[k], bad);

        /* Odd offsets and widths exercise the vector body and the scalar tail. */
        REQUIRE(loom_st_read_f32(st, t, 3, 5, 7, 21, out, &err) == LOOM_OK);
        bad = 0;
        for (int r = 0; r < 5; r++)
            for (int c = 0; c < 21; c++) {
                uint16_t h = (uint16_t)((3 + r) * 256 + 7 + c);
                float want = k ? loom_bf16_to_f32(h) : loom_f16_to_f32(h);
                float got = out[r * 21 + c];
                bad += isnan(want) ? !isnan(got) : got != want;
            }
        CHECK(bad == 0);
    }
    const loom_st_tensor_t *t = loom_st_find(st, "f");
    REQUIRE(t);
    CHECK(loom_st_read_f32(st, t, 1, 2, 1, 3, out, &err) == LOOM_OK);
    CHECK(out[0] == f32[6] && out[2] == f32[8] && out[3] == f32[11] && out[5] == f32[13]);
    CHECK(loom_st_bytes_read(st) == 2 * (131072 + 5 * 21 * 2) + 6 * 4);
    free(out);
    loom_st_close(&st);
}

/* ---- malformed files ------------------------------------------------------------------------ */

/* Opens header+data written to bad.safetensors; expects `code` and a message
 * naming the file and containing `want`. */
static void expect_bad(int line, const char *header, size_t ndata, loom_status_t code,
                       const char *want) {
    char path[512];
    tmp_path(path, sizeof path, "bad.safetensors");
    unsigned char *data = loom_xcalloc(1, ndata + 1);
    write_st(path, header, data, ndata);
    free(data);
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    loom_status_t s = loom_st_open_file(path, &st, &err);
    CHECKF(s == code && st == NULL, "line %d: got %s (%s)", line, loom_status_str(s), err.msg);
    CHECKF(strstr(err.msg, path) != NULL, "line %d: message does not name the file: %s", line,
           err.msg);
    CHECKF(strstr(err.msg, want) != NULL, "line %d: message '%s' lacks '%s'", line, err.msg, want);
    loom_st_close(&st);
}

#define BAD(header, ndata, want) expect_bad(__LINE__, header, ndata, LOOM_ERR_FORMAT, want)

static void test_bad_headers(void) {
    BAD("{", 0, "not valid JSON");
    BAD("", 0, "not valid JSON");
    BAD("{\"a\":1} x", 0, "not valid JSON");
    BAD("[1, 2]", 0, "not an object");
    BAD("\"str\"", 0, "not an object");
    BAD("{\"a\":[1]}", 0, "not a JSON object");
    BAD("{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "missing \"dtype\"");
    BAD("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "missing \"shape\"");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "missing \"data_offsets\"");
    BAD("{\"a\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "dtype must be a string");
    BAD("{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
        "unknown dtype 'F33'");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8,
        "shape must be an array");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "shape[0]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,2.5],\"data_offsets\":[0,8]}}", 8, "shape[1]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8, "shape[0]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", 8,
        "9 dimensions");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,8]}}",
        8, "too many elements");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,8]}}", 8, "shape[0]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, "[begin, end]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,16]}}", 16, "[begin, end]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[\"0\",\"8\"]}}", 8,
        "[begin, end]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":{\"b\":0}}}", 8, "[begin, end]");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "begin after end");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
        "past the data section");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,12]}}", 12,
        "span 12 bytes, but F32 [2] needs 8");
    BAD("{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,8]}}", 12,
        "span 8 bytes, but BF16 [2, 3] needs 12");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
        16, "'a' appears twice");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
        12, "overlap");

    /* Exact text of a few. */
    char path[512], want[1024];
    tmp_path(path, sizeof path, "bad.safetensors");
    snprintf(want, sizeof want, "%s: tensor 'w': unknown dtype 'Q4'", path);
    BAD("{\"w\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, want);
    snprintf(want, sizeof want,
             "%s: tensor 'w': data_offsets end 16 is past the data section (8 bytes; file "
             "truncated?)",
             path);
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, want);

    /* Accepted edge cases: metadata, empty tensors sharing an offset, no tensors. */
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    write_st(path,
             "{\"__metadata__\":{\"format\":\"pt\",\"x\":\"y\"},"
             "\"e\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[0,0]},"
             "\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
             "\"z\":{\"dtype\":\"I8\",\"shape\":[0],\"data_offsets\":[0,0]}}",
             "\0\0\x80\x3f", 4);
    CHECKF(loom_st_open_file(path, &st, &err) == LOOM_OK, "%s", err.msg);
    CHECK(loom_st_count(st) == 3);
    CHECK(loom_st_find(st, "__metadata__") == NULL);
    const loom_st_tensor_t *t = loom_st_find(st, "s");
    float v = 0;
    CHECK(t && t->n_dims == 0 && loom_st_read_f32(st, t, 0, 1, 0, 1, &v, &err) == LOOM_OK &&
          v == 1);
    loom_st_close(&st);
    write_st(path, "{}", NULL, 0);
    CHECKF(loom_st_open_file(path, &st, &err) == LOOM_OK, "%s", err.msg);
    CHECK(loom_st_count(st) == 0);
    loom_st_close(&st);
}

static void expect_raw(int line, const unsigned char *bytes, size_t n, loom_status_t code,
                       const char *want) {
    char path[512];
    tmp_path(path, sizeof path, "raw.safetensors");
    write_bytes(path, bytes, n);
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    loom_status_t s = loom_st_open_file(path, &st, &err);
    CHECKF(s == code && !st, "line %d: got %s (%s)", line, loom_status_str(s), err.msg);
    CHECKF(strstr(err.msg, path) && strstr(err.msg, want), "line %d: '%s' lacks '%s'", line,
           err.msg, want);
    loom_st_close(&st);
}

static void test_bad_lengths(void) {
    unsigned char b[64] = {0};
    expect_raw(__LINE__, b, 0, LOOM_ERR_FORMAT, "too short");
    expect_raw(__LINE__, b, 7, LOOM_ERR_FORMAT, "too short");
    b[5] = 1; /* 2^40 */
    expect_raw(__LINE__, b, 16, LOOM_ERR_FORMAT, "absurd");
    memset(b, 0xff, 8);
    expect_raw(__LINE__, b, 16, LOOM_ERR_FORMAT, "absurd");
    memset(b, 0, sizeof b);
    b[0] = 200;
    memcpy(b + 8, "{}", 2);
    expect_raw(__LINE__, b, 64, LOOM_ERR_FORMAT, "runs past the end");
    b[0] = 2;
    b[9] = '\0'; /* NUL inside the header */
    expect_raw(__LINE__, b, 10, LOOM_ERR_FORMAT, "not valid JSON");

    loom_st_t *st = NULL;
    loom_err_t err = {0};
    char path[512];
    tmp_path(path, sizeof path, "does-not-exist.safetensors");
    CHECK(loom_st_open_file(path, &st, &err) == LOOM_ERR_IO && !st);
    CHECK(strstr(err.msg, path) != NULL);
    CHECK(loom_st_open_file(g_tmp, &st, &err) == LOOM_ERR_IO && !st); /* a directory */
}

/* A valid small file: F32, F16 and BF16 tensors. */
static unsigned char *small_image(size_t *len) {
    unsigned char data[4 * 6 + 2 * 8 + 2 * 4];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (unsigned char)(i * 37 + 11);
    return st_image("{\"__metadata__\":{\"format\":\"pt\"},"
                    "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                    "\"b\":{\"dtype\":\"F16\",\"shape\":[2,4],\"data_offsets\":[24,40]},"
                    "\"c\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[40,48]}}",
                    data, sizeof data, len);
}

static void test_truncated(void) {
    size_t len;
    unsigned char *img = small_image(&len);
    char path[512];
    tmp_path(path, sizeof path, "cut.safetensors");
    write_bytes(path, img, len);
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_st_open_file(path, &st, &err) == LOOM_OK);
    loom_st_close(&st);
    /* Every cut fails: inside the length word, the header, the padding and the data. */
    int wrong = 0;
    for (size_t cut = 0; cut < len; cut++) {
        write_bytes(path, img, cut);
        loom_status_t s = loom_st_open_file(path, &st, &err);
        if (s != LOOM_ERR_FORMAT || st || !strstr(err.msg, path)) {
            if (wrong++ < 5)
                fprintf(stderr, "  cut at %zu: %s (%s)\n", cut, loom_status_str(s), err.msg);
            loom_st_close(&st);
        }
    }
    CHECKF(wrong == 0, "%d of %zu truncations were not refused", wrong, len);
    free(img);
}

/* ---- get / read errors ---------------------------------------------------------------------- */

static void test_get_errors(void) {
    char path[512], want[1024];
    tmp_path(path, sizeof path, "get.safetensors");
    unsigned char data[24 + 16] = {0};
    write_st(path,
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
             "\"ids\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[24,40]}}",
             data, sizeof data);
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_st_open_file(path, &st, &err) == LOOM_OK);
    const loom_st_tensor_t *t = (const void *)1;

    CHECK(loom_st_get(st, "nope", 2, (int64_t[]){2, 3}, &t, &err) == LOOM_ERR_NOT_FOUND && !t);
    snprintf(want, sizeof want, "tensor 'nope' not found in %s", path);
    CHECKF(!strcmp(err.msg, want), "%s", err.msg);

    CHECK(loom_st_get(st, "a", 2, (int64_t[]){3, 2}, &t, &err) == LOOM_ERR_FORMAT && !t);
    snprintf(want, sizeof want, "tensor 'a' in %s has shape [2, 3], expected [3, 2]", path);
    CHECKF(!strcmp(err.msg, want), "%s", err.msg);
    CHECK(loom_st_get(st, "a", 1, (int64_t[]){6}, &t, &err) == LOOM_ERR_FORMAT);
    snprintf(want, sizeof want, "tensor 'a' in %s has shape [2, 3], expected [6]", path);
    CHECKF(!strcmp(err.msg, want), "%s", err.msg);

    CHECK(loom_st_get(st, "ids", 1, (int64_t[]){2}, &t, &err) == LOOM_ERR_UNSUPPORTED);
    snprintf(want, sizeof want,
             "tensor 'ids' in %s has dtype I64; Loom reads F32, F16 and BF16 weights", path);
    CHECKF(!strcmp(err.msg, want), "%s", err.msg);

    CHECK(loom_st_get(st, "a", 2, (int64_t[]){2, 3}, &t, &err) == LOOM_OK && t);
    float out[8];
    CHECK(loom_st_read_f32(st, t, 0, 3, 0, 3, out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.msg, "'a'") && strstr(err.msg, path) && strstr(err.msg, "outside"));
    CHECK(loom_st_read_f32(st, t, 0, 2, 1, 3, out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_st_read_f32(st, t, -1, 1, 0, 3, out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_st_read_f32(st, t, 0, 1, 0, -1, out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_st_read_f32(st, t, INT64_MAX, 2, 0, 3, out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_st_read_f32(st, t, 1, INT64_MAX, 0, 3, out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_st_read_f32(st, t, 2, 0, 0, 3, out, &err) == LOOM_OK); /* empty block */
    CHECK(loom_st_bytes_read(st) == 0);
    CHECK(loom_st_read_f32(st, loom_st_find(st, "ids"), 0, 1, 0, 2, out, &err) ==
          LOOM_ERR_UNSUPPORTED);
    loom_st_close(&st);
}

/* ---- directories and sharded checkpoints ---------------------------------------------------- */

static const char *k_shard1 =
    "{\"l0.w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
    "\"l0.b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}";
static const char *k_shard2 =
    "{\"l1.w\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]}}";

static void write_shards(const char *dir, const char *index) {
    char p[600];
    float d1[6] = {1, 2, 3, 4, 5, 6};
    uint16_t d2[4];
    for (int i = 0; i < 4; i++)
        d2[i] = loom_f32_to_bf16((float)(10 + i));
    loom_path_join(p, sizeof p, dir, "model-00001-of-00002.safetensors");
    write_st(p, k_shard1, d1, sizeof d1);
    loom_path_join(p, sizeof p, dir, "model-00002-of-00002.safetensors");
    write_st(p, k_shard2, d2, sizeof d2);
    loom_path_join(p, sizeof p, dir, "model.safetensors.index.json");
    write_bytes(p, index, strlen(index));
}

static void expect_index_error(const char *dir, const char *index, loom_status_t code,
                               const char *want) {
    write_shards(dir, index);
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    loom_status_t s = loom_st_open_dir(dir, &st, &err);
    CHECKF(s == code && !st, "%s: got %s (%s)", index, loom_status_str(s), err.msg);
    CHECKF(strstr(err.msg, want) != NULL, "'%s' lacks '%s'", err.msg, want);
    loom_st_close(&st);
}

static void test_sharded(void) {
    char dir[512];
    make_dir("sharded", dir, sizeof dir);
    write_shards(dir, "{\"metadata\":{\"total_size\":32},\"weight_map\":{"
                      "\"l0.w\":\"model-00001-of-00002.safetensors\","
                      "\"l0.b\":\"model-00001-of-00002.safetensors\","
                      "\"l1.w\":\"model-00002-of-00002.safetensors\"}}");
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    CHECKF(loom_st_open_dir(dir, &st, &err) == LOOM_OK, "%s", err.msg);
    REQUIRE(st);
    CHECK(loom_st_count(st) == 3);
    const loom_st_tensor_t *t = NULL;
    REQUIRE(loom_st_get(st, "l1.w", 2, (int64_t[]){2, 2}, &t, &err) == LOOM_OK);
    CHECK(strstr(t->file, "model-00002-of-00002.safetensors") != NULL);
    float out[4];
    CHECK(loom_st_read_f32(st, t, 1, 1, 0, 2, out, &err) == LOOM_OK && out[0] == 12 &&
          out[1] == 13);
    REQUIRE(loom_st_get(st, "l0.w", 2, (int64_t[]){2, 2}, &t, &err) == LOOM_OK);
    CHECK(strstr(t->file, "model-00001-of-00002.safetensors") != NULL);
    CHECK(loom_st_read_f32(st, t, 0, 2, 1, 1, out, &err) == LOOM_OK && out[0] == 2 && out[1] == 4);
    CHECK(loom_st_bytes_read(st) == 4 + 8);
    CHECK(loom_st_get(st, "l2.w", 2, (int64_t[]){2, 2}, &t, &err) == LOOM_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "model.safetensors.index.json") != NULL, "%s", err.msg);
    loom_st_close(&st);

    expect_index_error(dir,
                       "{\"weight_map\":{\"l0.w\":\"model-00001-of-00002.safetensors\","
                       "\"l9.w\":\"model-00002-of-00002.safetensors\"}}",
                       LOOM_ERR_FORMAT, "tensor 'l9.w' in model-00002-of-00002.safetensors, but");
    expect_index_error(dir,
                       "{\"weight_map\":{\"l0.b\":\"model-00001-of-00002.safetensors\","
                       "\"l0.w\":\"model-00002-of-00002.safetensors\"}}",
                       LOOM_ERR_FORMAT, "but it is in");
    expect_index_error(dir, "{\"weight_map\":{\"l0.w\":\"../model-00001-of-00002.safetensors\"}}",
                       LOOM_ERR_FORMAT, "refusing");
    expect_index_error(dir, "{\"weight_map\":{\"l0.w\":\"/etc/passwd\"}}", LOOM_ERR_FORMAT,
                       "refusing");
    expect_index_error(dir, "{\"weight_map\":{\"l0.w\":\"..\"}}", LOOM_ERR_FORMAT, "refusing");
    expect_index_error(dir, "{\"weight_map\":{\"l0.w\":\"\"}}", LOOM_ERR_FORMAT, "refusing");
    expect_index_error(dir, "{\"weight_map\":{\"l0.w\":\"missing.safetensors\"}}", LOOM_ERR_IO,
                       "missing.safetensors");
    expect_index_error(dir, "{\"weight_map\":{\"l0.w\":3}}", LOOM_ERR_FORMAT, "not a string");
    expect_index_error(dir, "{\"weight_map\":{}}", LOOM_ERR_FORMAT, "weight_map");
    expect_index_error(dir, "{\"weight_map\":[]}", LOOM_ERR_FORMAT, "weight_map");
    expect_index_error(dir, "{\"metadata\":{}}", LOOM_ERR_FORMAT, "weight_map");
    expect_index_error(dir, "{\"weight_map\":", LOOM_ERR_FORMAT, "not valid JSON");

    /* The same name in two shards is refused, naming both. */
    char p[600];
    loom_path_join(p, sizeof p, dir, "model-00003-of-00003.safetensors");
    float two[2] = {0};
    write_st(p, "{\"l0.b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", two,
             sizeof two);
    expect_index_error(dir,
                       "{\"weight_map\":{\"l0.w\":\"model-00001-of-00002.safetensors\","
                       "\"x\":\"model-00003-of-00003.safetensors\"}}",
                       LOOM_ERR_FORMAT, "appears in both");
}

static void test_open_dir_choice(void) {
    char dir[512], p[600];
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    make_dir("empty", dir, sizeof dir);
    CHECK(loom_st_open_dir(dir, &st, &err) == LOOM_ERR_NOT_FOUND && !st);
    char want[700];
    snprintf(want, sizeof want, "no safetensors file in %s", dir);
    CHECKF(!strcmp(err.msg, want), "%s", err.msg);

    /* The only *.safetensors file, whatever its name. */
    loom_path_join(p, sizeof p, dir, "weights.safetensors");
    float one[1] = {42};
    write_st(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", one, 4);
    CHECKF(loom_st_open_dir(dir, &st, &err) == LOOM_OK, "%s", err.msg);
    CHECK(loom_st_find(st, "x") != NULL);
    loom_st_close(&st);

    /* Two of them and no index: ambiguous. */
    loom_path_join(p, sizeof p, dir, "other.safetensors");
    write_st(p, "{}", NULL, 0);
    CHECK(loom_st_open_dir(dir, &st, &err) == LOOM_ERR_FORMAT && !st);
    CHECKF(strstr(err.msg, "2 safetensors files") != NULL, "%s", err.msg);

    /* model.safetensors wins over the others. */
    loom_path_join(p, sizeof p, dir, "model.safetensors");
    write_st(p, "{\"m\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", one, 4);
    CHECKF(loom_st_open_dir(dir, &st, &err) == LOOM_OK, "%s", err.msg);
    CHECK(loom_st_find(st, "m") != NULL && loom_st_find(st, "x") == NULL);
    loom_st_close(&st);

    tmp_path(p, sizeof p, "no-such-dir");
    CHECK(loom_st_open_dir(p, &st, &err) == LOOM_ERR_IO && !st);
    CHECKF(strstr(err.msg, p) != NULL, "%s", err.msg);
}

/* ---- fuzz ----------------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Random mutations of a valid file: each opens or fails cleanly. Opened ones
 * are read in full so a bad offset that slipped through would show. */
static void test_fuzz(void) {
    size_t len;
    unsigned char *img = small_image(&len);
    size_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | img[i];
    unsigned char *mut = loom_xmalloc(len + 64);
    char path[512];
    tmp_path(path, sizeof path, "fuzz.safetensors");
    static const char interesting[] = "0123456789-.e,[]{}\":FBI ";
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    int n_ok = 0, n_bad = 0, n_wrong = 0;
    for (int iter = 0; iter < 2000; iter++) {
        memcpy(mut, img, len);
        size_t n = len;
        int kind = (int)(rng_next(&rng) % 5);
        int edits = 1 + (int)(rng_next(&rng) % 4);
        for (int e = 0; e < edits; e++) {
            uint64_t r = rng_next(&rng);
            switch (kind) {
            case 0:
                mut[r % n] ^= (unsigned char)(1u << (r >> 32) % 8);
                break; /* bit flip */
            case 1:
                mut[r % n] = (unsigned char)(r >> 24);
                break; /* byte anywhere */
            case 2:    /* a JSON-ish character inside the header */
                mut[8 + r % hlen] =
                    (unsigned char)interesting[(r >> 32) % (sizeof interesting - 1)];
                break;
            case 3:
                mut[r % 8] = (unsigned char)(r >> 24);
                break; /* the length word */
            default:
                n = (size_t)(r % (n + 1));
                break; /* truncate */
            }
        }
        write_bytes(path, mut, n);
        loom_st_t *st = NULL;
        loom_err_t err = {0};
        loom_status_t s = loom_st_open_file(path, &st, &err);
        if (s == LOOM_OK) {
            n_ok++;
            for (int i = 0; i < loom_st_count(st); i++) {
                const loom_st_tensor_t *t = loom_st_at(st, i);
                if (t->dtype != LOOM_DT_F32 && t->dtype != LOOM_DT_F16 && t->dtype != LOOM_DT_BF16)
                    continue;
                size_t esz = t->dtype == LOOM_DT_F32 ? 4 : 2;
                int64_t cols = t->n_dims ? t->shape[t->n_dims - 1] : 1;
                int64_t rows = cols ? (int64_t)(t->nbytes / esz) / cols : 0;
                if (t->nbytes / esz > 1024) continue;
                float buf[1024];
                if (loom_st_read_f32(st, t, 0, rows, 0, cols, buf, &err) != LOOM_OK) n_wrong++;
            }
            loom_st_close(&st);
        } else if ((s == LOOM_ERR_FORMAT || s == LOOM_ERR_IO) && !st && strstr(err.msg, path)) {
            n_bad++;
        } else {
            if (n_wrong++ < 5)
                fprintf(stderr, "  iter %d: %s (%s)\n", iter, loom_status_str(s), err.msg);
            loom_st_close(&st);
        }
    }
    fprintf(stderr, "  fuzz: %d opened, %d refused\n", n_ok, n_bad);
    CHECK(n_wrong == 0);
    CHECK(n_bad > 1000);
    free(mut);
    free(img);
}

/* ---- renaming a layout's prefix --------------------------------------------------------------- */

static void test_rename_prefix(void) {
    float data[4] = {1, 2, 3, 4};
    const char *header = "{\"language_model.model.a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                         "\"language_model.model.b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]},"
                         "\"vision.c\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
                         "\"model.b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}";
    char path[512];
    tmp_path(path, sizeof path, "rename.safetensors");
    write_st(path, header, data, sizeof data);
    loom_st_t *st = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_st_open_file(path, &st, &err) == LOOM_OK);
    int n = -1;
    /* language_model.model.b would become model.b, which is taken: refused, naming both, and nothing renamed */
    CHECK(loom_st_rename_prefix(st, "language_model.model.", "model.", &n, &err) == LOOM_ERR_FORMAT);
    CHECKF(strstr(err.msg, "'language_model.model.b'") && strstr(err.msg, "'model.b'"), "%s", err.msg);
    CHECK(loom_st_find(st, "language_model.model.a") && !loom_st_find(st, "model.a"));
    CHECK(loom_st_rename_prefix(st, "nothing.", "x.", &n, &err) == LOOM_OK && n == 0);
    CHECK(loom_st_rename_prefix(st, "vision.", "v.", &n, &err) == LOOM_OK && n == 1);
    const loom_st_tensor_t *t = loom_st_find(st, "v.c");
    float x = 0;
    REQUIRE(t && !loom_st_find(st, "vision.c"));
    CHECK(loom_st_read_f32(st, t, 0, 1, 0, 1, &x, &err) == LOOM_OK && x == 3.0f);
    CHECK(loom_st_find(st, "model.b") && loom_st_count(st) == 4);
    loom_st_close(&st);
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/loom_test_st_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 2;
    }
    RUN(test_stories260k);
    RUN(test_threads);
    RUN(test_half_conversion);
    RUN(test_bad_headers);
    RUN(test_bad_lengths);
    RUN(test_truncated);
    RUN(test_get_errors);
    RUN(test_sharded);
    RUN(test_open_dir_choice);
    RUN(test_fuzz);
    RUN(test_rename_prefix);
    nftw(g_tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
