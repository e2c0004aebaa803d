/* Worker-to-worker KV transfer (worker/kv_xfer.h): slices of heads packed
 * and unpacked on odd shapes, padded pieces and scales, a TP=1 block split
 * into two TP=2 halves and put back together; the handshake's field check;
 * the service on loopback: reads of held blocks give their slices, a read
 * of a transfer not held or a block outside the hold is refused as unknown
 * blocks, a hold that ends while its blocks stream fails the read (the
 * fence), done reaches the service's callback; a service that does not hold
 * the secret (a forged host), a dialler without it, one of another model or
 * layer count are refused naming why; a dialler without the secret, or of
 * another version, spoken by hand, hears nothing of the service's identity;
 * encrypted connections read the same bytes, fail a read on a flipped byte
 * or a replayed record (a man in the middle) while the service serves on,
 * and are refused when one side only encrypts; a service of another
 * version is refused naming both. */
#include "worker/kv_xfer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "worker/comm_util.h"
#include "worker/tcp_io.h"
#include "tests/test.h"

/* A span of fmt filled with a pattern of (block, byte) */
static void fill(const loom_kv_span_fmt_t *f, int block, uint8_t *span) {
    size_t n = loom_kv_span_bytes(f);
    for (size_t i = 0; i < n; i++) span[i] = (uint8_t)(i * 7 + (size_t)block * 31 + 1);
}

static size_t span_bytes(const loom_kv_span_fmt_t *f) { return loom_kv_span_bytes(f); }

/* Byte offset of (layer, piece 0..3, token, head, byte) in a span. */
static size_t at(const loom_kv_span_fmt_t *f, int l, int piece, int t, int h, size_t b) {
    size_t base = (size_t)l * 2 * (f->codes + f->scales);
    if (piece < 2) return base + (size_t)piece * f->codes + ((size_t)t * f->n_heads + h) * f->head_bytes + b;
    return base + 2 * f->codes + (size_t)(piece - 2) * f->scales + ((size_t)t * f->n_heads + h) * 4 + b;
}

static void test_slices(void) {
    /* 3 layers, 5 tokens, 4 heads of 6 bytes, pieces padded to 128, scales padded to 96 */
    loom_kv_span_fmt_t f = {.n_layers = 3, .block_size = 5, .n_heads = 4, .head_bytes = 6, .codes = 128,
                            .scales = 96};
    CHECK(loom_kv_slice_bytes(&f, 2) == 3 * 2 * 5 * 2 * (6 + 4));
    uint8_t *span = malloc(span_bytes(&f)), *back = calloc(1, span_bytes(&f));
    fill(&f, 3, span);
    size_t sb = loom_kv_slice_bytes(&f, 2);
    uint8_t *slice = malloc(sb);
    loom_kv_slice_pack(&f, span, 1, 2, slice);
    loom_kv_slice_unpack(&f, slice, 1, 2, back);
    int bad = 0, untouched = 1;
    for (int l = 0; l < 3; l++)
        for (int p = 0; p < 4; p++)
            for (int t = 0; t < 5; t++)
                for (int h = 0; h < 4; h++)
                    for (size_t b = 0; b < (p < 2 ? 6u : 4u); b++) {
                        size_t o = at(&f, l, p, t, h, b);
                        if (h >= 1 && h < 3) bad += back[o] != span[o];
                        else untouched &= back[o] == 0;
                    }
    CHECK(bad == 0 && untouched);
    /* a TP=1 block (4 heads) into two TP=2 blocks (2 heads, unpadded pieces) and back */
    loom_kv_span_fmt_t half = {.n_layers = 3, .block_size = 5, .n_heads = 2, .head_bytes = 6, .codes = 5 * 2 * 6,
                               .scales = 5 * 2 * 4};
    uint8_t *r0 = calloc(1, span_bytes(&half)), *r1 = calloc(1, span_bytes(&half));
    uint8_t *whole = calloc(1, span_bytes(&f));
    loom_kv_slice_pack(&f, span, 0, 2, slice);
    loom_kv_slice_unpack(&half, slice, 0, 2, r0);
    loom_kv_slice_pack(&f, span, 2, 2, slice);
    loom_kv_slice_unpack(&half, slice, 0, 2, r1);
    CHECK(r0[at(&half, 2, 1, 4, 1, 5)] == span[at(&f, 2, 1, 4, 1, 5)]);
    CHECK(r1[at(&half, 1, 3, 2, 0, 3)] == span[at(&f, 1, 3, 2, 2, 3)]);
    loom_kv_slice_pack(&half, r0, 0, 2, slice);
    loom_kv_slice_unpack(&f, slice, 0, 2, whole);
    loom_kv_slice_pack(&half, r1, 0, 2, slice);
    loom_kv_slice_unpack(&f, slice, 2, 2, whole);
    bad = 0;
    for (int l = 0; l < 3; l++)
        for (int p = 0; p < 4; p++)
            for (int t = 0; t < 5; t++)
                for (int h = 0; h < 4; h++)
                    for (size_t b = 0; b < (p < 2 ? 6u : 4u); b++)
                        bad += whole[at(&f, l, p, t, h, b)] != span[at(&f, l, p, t, h, b)];
    CHECK(bad == 0);
    free(span), free(back), free(slice), free(r0), free(r1), free(whole);
}

static loom_kv_ident_t ident(void) {
    loom_kv_ident_t id = {.model = 0x1234, .n_layers = 3, .layer_begin = 0, .layer_end = 3, .block_size = 5,
                          .layout = LOOM_KV_LAYOUT_CONTIGUOUS, .n_kv_heads = 4, .head_dim = 3, .kv_head_begin = 0,
                          .kv_head_end = 4, .tp_size = 1, .pp_size = 1};
    memcpy(id.dtype, "bf16", 5);
    return id;
}

static loom_kv_ident_t latent_ident(void) {
    loom_kv_ident_t id = ident();
    id.layout = LOOM_KV_LAYOUT_LATENT, id.n_kv_heads = 1, id.head_dim = 576, id.kv_head_end = 1;
    return id;
}

static void test_ident(void) {
    loom_kv_ident_t a = ident(), b = ident();
    char msg[256];
    CHECK(!loom_kv_ident_mismatch(&a, &b, msg, sizeof msg));
    b.tp_size = 2, b.tp_rank = 1, b.kv_head_begin = 2, b.layout = LOOM_KV_LAYOUT_LAYER_MAJOR; /* may differ */
    CHECK(!loom_kv_ident_mismatch(&a, &b, msg, sizeof msg));
    memcpy(b.dtype, "f32", 4);
    CHECK(loom_kv_ident_mismatch(&a, &b, msg, sizeof msg) && strstr(msg, "kv_dtype: bf16 here, f32 there"));
    b = ident(), b.block_size = 16;
    CHECK(loom_kv_ident_mismatch(&a, &b, msg, sizeof msg) && strstr(msg, "block_size: 5 here, 16 there"));
    b = ident(), b.head_dim = 8;
    CHECK(loom_kv_ident_mismatch(&a, &b, msg, sizeof msg) && strstr(msg, "head_dim"));
    b = ident(), b.pp_size = 2;
    CHECK(loom_kv_ident_mismatch(&a, &b, msg, sizeof msg) && strstr(msg, "pp_size"));
    b = ident(), b.layout = LOOM_KV_LAYOUT_LATENT;
    CHECK(loom_kv_ident_mismatch(&a, &b, msg, sizeof msg) &&
          strstr(msg, "layout: per-head K and V here, the latent KV (MLA) there"));
    /* latent (MLA): one replicated head on every rank; TP may differ, the row's width may not */
    loom_kv_ident_t la = latent_ident(), lb = latent_ident();
    lb.tp_size = 2, lb.tp_rank = 1;
    CHECK(!loom_kv_ident_mismatch(&la, &lb, msg, sizeof msg));
    CHECK(loom_kv_ident_mismatch(&la, &a, msg, sizeof msg) &&
          strstr(msg, "layout: the latent KV (MLA) here, per-head K and V there"));
    lb = latent_ident(), lb.head_dim = 512;
    CHECK(loom_kv_ident_mismatch(&la, &lb, msg, sizeof msg) &&
          strstr(msg, "head_dim: a latent row (kv_lora_rank + qk_rope_head_dim) of 576 here, 512 there"));
}

/* The latent layout: one array a layer (codes, then scales), a slice of its one head is the whole block. */
static void test_latent_slices(void) {
    loom_kv_span_fmt_t f = {.n_layers = 2, .block_size = 3, .n_heads = 1, .head_bytes = 10, .codes = 30,
                            .scales = 12, .latent = 1};
    CHECK(loom_kv_span_bytes(&f) == 2 * (30 + 12) && loom_kv_slice_bytes(&f, 1) == 2 * 3 * (10 + 4));
    uint8_t span[84], slice[84], back[84] = {0};
    fill(&f, 5, span);
    loom_kv_slice_pack(&f, span, 0, 1, slice);
    CHECK(!memcmp(slice, span, sizeof span)); /* unpadded: the span itself */
    /* padded pieces (a pool's alignment) into an unpadded span and back */
    loom_kv_span_fmt_t pad = f;
    pad.codes = 64, pad.scales = 16;
    uint8_t padded[2 * 80] = {0};
    loom_kv_slice_unpack(&pad, slice, 0, 1, padded);
    CHECK(padded[80 + 64 + 11] == span[42 + 30 + 11] && padded[80 + 29] == span[42 + 29] && padded[80 + 30] == 0);
    loom_kv_slice_pack(&pad, padded, 0, 1, slice);
    loom_kv_slice_unpack(&f, slice, 0, 1, back);
    CHECK(!memcmp(back, span, sizeof span));
}

typedef struct served {
    loom_kv_span_fmt_t fmt;
    uint64_t done;
    int reads, peeks;
    uint8_t *pool; /* blocks 0..7 in place (peek), NULL: none */
    loom_kv_service_t *svc;
    uint64_t unhold_on_read; /* a read ends this hold (the lease ending mid-stream), 0: none */
} served_t;

static const void *peek_block(void *ctx, int32_t block) {
    served_t *s = ctx;
    if (!s->pool || block >= 8) return NULL;
    s->peeks++;
    return s->pool + (size_t)block * span_bytes(&s->fmt);
}

static loom_status_t read_block(void *ctx, int32_t block, void *host, loom_err_t *err) {
    served_t *s = ctx;
    (void)err;
    s->reads++;
    if (s->unhold_on_read) loom_kv_service_unhold(s->svc, s->unhold_on_read);
    fill(&s->fmt, block, host);
    return LOOM_OK;
}

/* A read's slices copied out of the connection's memory. */
static loom_status_t pull_read(loom_kv_pull_t *c, uint64_t transfer, const int32_t *blocks, int n, int h0, int nh,
                               void *out, size_t bytes, uint64_t dl, loom_err_t *err) {
    const void *slices = NULL;
    loom_status_t st = loom_kv_pull_read(c, transfer, blocks, n, h0, nh, bytes, &slices, dl, err);
    if (st == LOOM_OK) memcpy(out, slices, bytes);
    return st;
}

static void on_done(void *ctx, uint64_t id) { ((served_t *)ctx)->done = id; }

static const uint8_t K[] = "a secret both replicas hold, 32b";
static const uint8_t K2[] = "another secret, held by a forger";

static loom_kv_service_t *service(served_t *sv, const uint8_t *secret, size_t len) {
    loom_kv_service_config_t c = {.host = "127.0.0.1", .ident = ident(), .fmt = sv->fmt, .secret = secret,
                                  .secret_len = len, .read = read_block, .peek = peek_block, .done = on_done,
                                  .ctx = sv, .hold_wait_ms = 50};
    loom_kv_service_t *s = NULL;
    loom_err_t err = {0};
    CHECK(loom_kv_service_create(&c, &s, &err) == LOOM_OK);
    return s;
}

static void test_service(void) {
    served_t sv = {.fmt = {.n_layers = 3, .block_size = 5, .n_heads = 4, .head_bytes = 6, .codes = 128, .scales = 0}};
    sv.pool = malloc(8 * span_bytes(&sv.fmt)); /* blocks 0..7 read in place, 9 through read */
    for (int b = 0; b < 8; b++) fill(&sv.fmt, b, sv.pool + (size_t)b * span_bytes(&sv.fmt));
    loom_kv_service_t *s = service(&sv, K, sizeof K - 1);
    if (!s) return;
    int32_t held[3] = {7, 2, 9};
    loom_kv_service_hold(s, 0xabc, held, 3);
    loom_kv_ident_t ours = ident(), theirs;
    ours.tp_size = 2, ours.tp_rank = 1, ours.kv_head_begin = 2; /* another TP: allowed */
    loom_err_t err = {0};
    loom_kv_pull_t *pc = NULL;
    uint64_t dl = loom_comm_deadline(10000);
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) == LOOM_OK);
    CHECK(theirs.tp_size == 1 && theirs.kv_head_end == 4);
    size_t one = loom_kv_slice_bytes(&sv.fmt, 2);
    uint8_t *got = malloc(2 * one), *want = malloc(one), *span = malloc(span_bytes(&sv.fmt));
    int32_t two[2] = {9, 7};
    CHECK(pull_read(pc, 0xabc, two, 2, 2, 2, got, 2 * one, dl, &err) == LOOM_OK);
    fill(&sv.fmt, 9, span);
    loom_kv_slice_pack(&sv.fmt, span, 2, 2, want);
    CHECK(!memcmp(got, want, one));
    fill(&sv.fmt, 7, span);
    loom_kv_slice_pack(&sv.fmt, span, 2, 2, want);
    CHECK(!memcmp(got + one, want, one));
    CHECK(sv.peeks == 1 && sv.reads == 1); /* 7 in place, 9 read */
    /* unknown blocks: another transfer, a block outside the hold */
    CHECK(pull_read(pc, 0xabd, two, 2, 2, 2, got, 2 * one, dl, &err) == LOOM_ERR_NOT_FOUND &&
          strstr(err.msg, "unknown blocks"));
    int32_t stray[2] = {7, 8};
    CHECK(pull_read(pc, 0xabc, stray, 2, 2, 2, got, 2 * one, dl, &err) == LOOM_ERR_NOT_FOUND &&
          strstr(err.msg, "block 8"));
    CHECK(pull_read(pc, 0xabc, two, 2, 3, 2, got, 2 * one, dl, &err) == LOOM_ERR_INVALID_ARGUMENT);
    /* the fence: the hold ends while its blocks stream: the read fails */
    int32_t late[2] = {3, 9};
    loom_kv_service_hold(s, 0xdef, late, 2);
    sv.svc = s;
    sv.unhold_on_read = 0xdef;
    CHECK(pull_read(pc, 0xdef, late, 2, 0, 2, got, 2 * one, dl, &err) == LOOM_ERR_NOT_FOUND &&
          strstr(err.msg, "while its blocks were read"));
    sv.unhold_on_read = 0;
    CHECK(loom_kv_pull_done(pc, 0xabc, dl, &err) == LOOM_OK && sv.done == 0xabc);
    loom_kv_pull_close(&pc);
    loom_kv_service_unhold(s, 0xabc);
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) == LOOM_OK);
    CHECK(pull_read(pc, 0xabc, two, 2, 0, 2, got, 2 * one, dl, &err) == LOOM_ERR_NOT_FOUND);
    loom_kv_pull_close(&pc);
    /* a dialler without the secret, or of another model / layer count */
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, NULL, 0, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) ==
              LOOM_ERR_UNAUTHENTICATED && !pc && strstr(err.msg, "wants a secret"));
    loom_kv_ident_t other = ident();
    other.model = 0x9999;
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &other, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) ==
              LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "model: digest"));
    other = ident();
    other.n_layers = 4;
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &other, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) ==
              LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "n_layers: 4 here, 3 there"));
    /* by hand: a dialler without K hears the acceptor's hello (and proof) and nothing more, its identity
     * least of all; one of another version is told the service's */
    for (int forged_proof = 0; forged_proof < 3; forged_proof++) {
        uint64_t before = 0, after = 0, nb = 0;
        loom_kv_service_counts(s, &before, &nb, NULL);
        int fd = -1;
        CHECK(loom_tcp_dial(loom_kv_service_addr(s), dl, &fd, &err) == LOOM_OK);
        uint8_t hello[24] = {'L', 'M', 'K', '1', LOOM_KV_XFER_VERSION, 0, forged_proof == 1 ? 1 : 0, 0};
        if (forged_proof == 2) hello[4] = 1; /* version 1 */
        memset(hello + 8, 0x5a, 16);
        uint8_t got_raw[256];
        size_t n_raw = 0;
        CHECK(loom_tcp_write_full(fd, hello, forged_proof == 2 ? 8 : 24, dl, "test", &err) == LOOM_OK);
        if (forged_proof == 1) { /* the answer and its proof, then a wrong proof of ours */
            CHECK(loom_tcp_read_full(fd, got_raw, 24 + 32, dl, "test", &err) == LOOM_OK);
            n_raw = 56;
            uint8_t wrong[32] = {0};
            CHECK(loom_tcp_write_full(fd, wrong, sizeof wrong, dl, "test", &err) == LOOM_OK);
        }
        for (;;) { /* whatever else comes before the service closes */
            struct pollfd pf = {fd, POLLIN, 0};
            if (poll(&pf, 1, 3000) <= 0) break;
            ssize_t r = read(fd, got_raw + n_raw, sizeof got_raw - n_raw);
            if (r <= 0) break;
            n_raw += (size_t)r;
        }
        close(fd);
        /* no proof: the hello alone (24 bytes); a wrong one: nothing after the answer; another version: the head */
        CHECK(n_raw == (forged_proof == 0 ? 24u : forged_proof == 1 ? 56u : 8u));
        if (forged_proof == 2) CHECK(got_raw[4] == LOOM_KV_XFER_VERSION && got_raw[5] == 0);
        CHECK(!memmem(got_raw, n_raw, "bf16", 4)); /* the identity's dtype is nowhere */
        for (int i = 0; i < 200; i++) { /* the refusal counted once the connection's thread ends */
            loom_kv_service_counts(s, &after, &nb, NULL);
            if (after > before) break;
            usleep(10000);
        }
        CHECK(after >= before + 1); /* (an earlier refusal may be counted meanwhile) */
    }
    /* a forged host: a listener that does not hold K */
    served_t fv = sv;
    fv.reads = fv.peeks = 0;
    fv.pool = NULL;
    loom_kv_service_t *forged = service(&fv, K2, sizeof K2 - 1);
    if (forged) {
        loom_kv_service_hold(forged, 0xabc, held, 3);
        CHECK(loom_kv_pull_open(loom_kv_service_addr(forged), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) ==
                  LOOM_ERR_UNAUTHENTICATED && strstr(err.msg, "does not hold the secret"));
        CHECK(fv.reads == 0 && fv.peeks == 0);
        loom_kv_service_destroy(&forged);
    }
    uint64_t refused = 0, blocks = 0;
    loom_kv_service_counts(s, &refused, &blocks, NULL);
    CHECK(blocks == 2 && refused >= 3); /* the fenced read is not counted */
    loom_kv_service_destroy(&s);
    loom_kv_service_destroy(&s);
    free(got), free(want), free(span), free(sv.pool);
}

/* A latent service: a TP=2 rank (kv_head 0 of 1, replicated) reads whole blocks; a per-head puller and a latent
 * one of another row width are refused naming the field. */
static void test_latent_service(void) {
    served_t sv = {.fmt = {.n_layers = 2, .block_size = 3, .n_heads = 1, .head_bytes = 10, .codes = 32,
                           .scales = 12, .latent = 1}};
    loom_kv_service_config_t c = {.host = "127.0.0.1", .ident = latent_ident(), .fmt = sv.fmt, .secret = K,
                                  .secret_len = sizeof K - 1, .read = read_block, .done = on_done, .ctx = &sv,
                                  .hold_wait_ms = 50};
    loom_kv_service_t *s = NULL;
    loom_err_t err = {0};
    CHECK(loom_kv_service_create(&c, &s, &err) == LOOM_OK);
    if (!s) return;
    int32_t held[2] = {4, 1};
    loom_kv_service_hold(s, 0x77, held, 2);
    loom_kv_ident_t ours = latent_ident(), theirs;
    ours.tp_size = 2, ours.tp_rank = 1;
    loom_kv_pull_t *pc = NULL;
    uint64_t dl = loom_comm_deadline(10000);
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) == LOOM_OK);
    CHECK(theirs.layout == LOOM_KV_LAYOUT_LATENT && theirs.kv_head_end == 1);
    const size_t one = loom_kv_slice_bytes(&sv.fmt, 1);
    uint8_t got[2 * 2 * 3 * 14], span[2 * 44], want[2 * 3 * 14];
    CHECK(sizeof got == 2 * one);
    CHECK(pull_read(pc, 0x77, held, 2, 0, 1, got, 2 * one, dl, &err) == LOOM_OK);
    for (int i = 0; i < 2; i++) {
        fill(&sv.fmt, held[i], span);
        loom_kv_slice_pack(&sv.fmt, span, 0, 1, want);
        CHECK(!memcmp(got + (size_t)i * one, want, one));
    }
    CHECK(pull_read(pc, 0x77, held, 2, 0, 2, got, 2 * one, dl, &err) == LOOM_ERR_INVALID_ARGUMENT);
    loom_kv_pull_close(&pc);
    loom_kv_ident_t per_head = ident();
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &per_head, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) ==
              LOOM_ERR_INVALID_ARGUMENT &&
          strstr(err.msg, "layout: per-head K and V here, the latent KV (MLA) there"));
    loom_kv_ident_t wide = latent_ident();
    wide.head_dim = 640;
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &wide, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) ==
              LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "latent row") && strstr(err.msg, "640 here, 576 there"));
    uint64_t refused = 0, blocks = 0;
    loom_kv_service_counts(s, &refused, &blocks, NULL);
    CHECK(blocks == 2 && sv.reads == 2);
    loom_kv_service_destroy(&s);
}

/* Op 3 by hand (kv_xfer.h's wire) naming `name`: the first status's code, its message in msg. */
static int32_t raw_shm_read(int fd, const char *name, uint64_t transfer, const int32_t *blocks, int n, char *msg,
                            size_t cap) {
    uint8_t req[512], *p = req;
    const uint32_t head[4] = {3, (uint32_t)transfer, (uint32_t)(transfer >> 32), (uint32_t)n};
    for (int i = 0; i < 4; i++, p += 4) memcpy(p, &head[i], 4); /* little-endian host */
    const uint32_t heads[2] = {0, 2};
    memcpy(p, heads, 8), p += 8;
    *p++ = (uint8_t)strlen(name);
    memcpy(p, name, strlen(name)), p += strlen(name);
    memcpy(p, blocks, (size_t)n * 4), p += (size_t)n * 4;
    loom_err_t err = {0};
    uint64_t dl = loom_comm_deadline(5000);
    uint8_t st[6];
    if (loom_tcp_write_full(fd, req, (size_t)(p - req), dl, "test", &err) < 0 ||
        loom_tcp_read_full(fd, st, 6, dl, "test", &err) < 0)
        return 1;
    size_t len = (size_t)(st[4] | st[5] << 8);
    char m[600] = "";
    if (len >= sizeof m || loom_tcp_read_full(fd, m, len, dl, "test", &err) < 0) return 1;
    snprintf(msg, cap, "%s", m);
    int32_t code;
    memcpy(&code, st, 4);
    return code;
}

/* The shared-memory path (both in this process: one host): its slices equal the socket's, the service counts
 * them; shm off on either side gives the socket; names that are not the dialler's object are refused with
 * UNAVAILABLE, the connection and the service going on. */
static void test_shm(void) {
    served_t sv = {.fmt = {.n_layers = 3, .block_size = 5, .n_heads = 4, .head_bytes = 6, .codes = 128, .scales = 96}};
    sv.pool = malloc(8 * span_bytes(&sv.fmt));
    for (int b = 0; b < 8; b++) fill(&sv.fmt, b, sv.pool + (size_t)b * span_bytes(&sv.fmt));
    loom_kv_service_t *s = service(&sv, K, sizeof K - 1);
    if (!s) return;
    int32_t held[3] = {7, 2, 9};
    loom_kv_service_hold(s, 0xabc, held, 3);
    loom_kv_ident_t ours = ident(), theirs;
    loom_err_t err = {0};
    uint64_t dl = loom_comm_deadline(10000);
    loom_kv_pull_t *tcp = NULL, *shm = NULL;
    const size_t one = loom_kv_slice_bytes(&sv.fmt, 3);
    uint8_t *a = malloc(3 * one), *b = malloc(3 * one), *span = malloc(span_bytes(&sv.fmt)), *want = malloc(one);
    char msg[600];
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &tcp, &theirs,
                            &err) == LOOM_OK && !loom_kv_pull_shm(tcp));
    if (tcp) {
        CHECK(pull_read(tcp, 0xabc, held, 3, 1, 3, a, 3 * one, dl, &err) == LOOM_OK);
        /* the socket-only connection may not name an object at all */
        CHECK(raw_shm_read(loom_kv_pull_fd(tcp), "/loom-kv-00000000000000000000000000000000", 0xabc, held, 3, msg,
                           sizeof msg) == LOOM_ERR_UNAVAILABLE && strstr(msg, "did not agree"));
        loom_kv_pull_close(&tcp);
    }
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_AUTO, 0, dl, &shm, &theirs,
                            &err) == LOOM_OK && loom_kv_pull_shm(shm));
    if (!shm) goto out;
    CHECK(pull_read(shm, 0xabc, held, 3, 1, 3, b, 3 * one, dl, &err) == LOOM_OK);
    CHECK(!memcmp(a, b, 3 * one));
    fill(&sv.fmt, 9, span); /* read, not peeked: through the service's span */
    loom_kv_slice_pack(&sv.fmt, span, 1, 3, want);
    CHECK(!memcmp(b + 2 * one, want, one));
    /* a second read on the connection reuses its object */
    CHECK(pull_read(shm, 0xabc, held, 2, 1, 3, b, 2 * one, dl, &err) == LOOM_OK && !memcmp(a, b, 2 * one));
    uint64_t refused = 0, blocks = 0, blocks_shm = 0;
    loom_kv_service_counts(s, &refused, &blocks, &blocks_shm);
    CHECK(blocks == 8 && blocks_shm == 5);
    /* forged names on the shm connection: not ours, ours but unknown, an object open to others */
    const int fd = loom_kv_pull_fd(shm);
    CHECK(raw_shm_read(fd, "/etc-passwd", 0xabc, held, 3, msg, sizeof msg) == LOOM_ERR_UNAVAILABLE &&
          strstr(msg, "is not a KV transfer object's name"));
    CHECK(raw_shm_read(fd, "/loom-kv-../../../../etc/passwd0000000000000", 0xabc, held, 3, msg, sizeof msg) ==
              LOOM_ERR_UNAVAILABLE && strstr(msg, "is not a KV transfer object's name"));
    CHECK(raw_shm_read(fd, "/loom-kv-00000000000000000000000000000000", 0xabc, held, 3, msg, sizeof msg) ==
              LOOM_ERR_UNAVAILABLE && strstr(msg, "No such file"));
    char open_name[64];
    snprintf(open_name, sizeof open_name, "/loom-kv-%032x", (unsigned)getpid());
    int ofd = shm_open(open_name, O_RDWR | O_CREAT | O_EXCL, 0644);
    CHECK(ofd >= 0);
    if (ofd >= 0) {
        CHECK(fchmod(ofd, 0644) == 0 && ftruncate(ofd, 1 << 20) == 0);
        CHECK(raw_shm_read(fd, open_name, 0xabc, held, 3, msg, sizeof msg) == LOOM_ERR_UNAVAILABLE &&
              strstr(msg, "open to other users"));
        close(ofd);
        shm_unlink(open_name);
    }
    /* the connection still reads through its own object (the service did not fall over) */
    CHECK(pull_read(shm, 0xabc, held, 3, 1, 3, b, 3 * one, dl, &err) == LOOM_OK && !memcmp(a, b, 3 * one));
    CHECK(loom_kv_pull_shm(shm));
    loom_kv_service_counts(s, &refused, &blocks, &blocks_shm);
    CHECK(blocks == 11 && blocks_shm == 8);
out:
    free(a), free(b), free(span), free(want);
    loom_kv_pull_close(&shm);
    /* a service with shm off: an auto dialler reads over the socket */
    loom_kv_service_destroy(&s);
    loom_kv_service_config_t c = {.host = "127.0.0.1", .ident = ident(), .fmt = sv.fmt, .secret = K,
                                  .secret_len = sizeof K - 1, .read = read_block, .ctx = &sv, .hold_wait_ms = 50,
                                  .shm = LOOM_KV_SHM_OFF};
    CHECK(loom_kv_service_create(&c, &s, &err) == LOOM_OK);
    if (s) {
        CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_AUTO, 0, dl, &shm,
                                &theirs, &err) == LOOM_OK && !loom_kv_pull_shm(shm));
        loom_kv_pull_close(&shm);
        loom_kv_service_destroy(&s);
    }
    free(sv.pool);
}

static loom_status_t read_quiet(void *ctx, int32_t block, void *host, loom_err_t *err) {
    (void)err;
    fill(&((served_t *)ctx)->fmt, block, host);
    return LOOM_OK;
}

/* Connections served at once: a puller stalled in the middle of a 32 MiB read (it reads nothing of it) while
 * another is served; at most 8 at once, the ninth waiting until one ends. */
static void test_concurrent(void) {
    served_t sv = {.fmt = {.n_layers = 4, .block_size = 16, .n_heads = 8, .head_bytes = 2048,
                           .codes = 16 * 8 * 2048, .scales = 0}};
    loom_kv_service_config_t c = {.host = "127.0.0.1", .ident = ident(), .fmt = sv.fmt, .secret = K,
                                  .secret_len = sizeof K - 1, .read = read_quiet, .ctx = &sv, .hold_wait_ms = 50,
                                  .shm = LOOM_KV_SHM_OFF};
    loom_kv_service_t *s = NULL;
    loom_err_t err = {0};
    CHECK(loom_kv_service_create(&c, &s, &err) == LOOM_OK);
    if (!s) return;
    int32_t blocks[16];
    for (int i = 0; i < 16; i++) blocks[i] = i;
    loom_kv_service_hold(s, 0x51, blocks, 16);
    loom_kv_ident_t ours = ident(), theirs;
    uint64_t dl = loom_comm_deadline(10000);
    loom_kv_pull_t *stalled = NULL, *other = NULL;
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &stalled, &theirs,
                            &err) == LOOM_OK);
    if (!stalled) goto out;
    /* op 1 for all 16 blocks (32 MiB, beyond the sockets' buffers), then nothing read */
    uint8_t req[24 + 16 * 4], *q = req;
    const uint32_t head[6] = {1, 0x51, 0, 16, 0, 8};
    for (int i = 0; i < 6; i++, q += 4) memcpy(q, &head[i], 4);
    memcpy(q, blocks, sizeof blocks);
    CHECK(loom_tcp_write_full(loom_kv_pull_fd(stalled), req, sizeof req, dl, "test", &err) == LOOM_OK);
    struct pollfd under_way = {loom_kv_pull_fd(stalled), POLLIN, 0}; /* its answer has begun: the read is under way */
    CHECK(poll(&under_way, 1, 10000) == 1);
    const size_t one = loom_kv_slice_bytes(&sv.fmt, 2);
    uint8_t *got = malloc(2 * one), *span = malloc(span_bytes(&sv.fmt)), *want = malloc(one);
    uint64_t t0 = loom_now_ns();
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &other, &theirs,
                            &err) == LOOM_OK);
    CHECK(other && pull_read(other, 0x51, blocks + 5, 2, 3, 2, got, 2 * one, dl, &err) == LOOM_OK);
    CHECK(loom_now_ns() - t0 < 10000000000ull); /* served while the other read hangs (its deadline: 30 s) */
    fill(&sv.fmt, 6, span);
    loom_kv_slice_pack(&sv.fmt, span, 3, 2, want);
    CHECK(!memcmp(got + one, want, one));
    struct pollfd pf = {loom_kv_pull_fd(stalled), POLLIN, 0};
    CHECK(poll(&pf, 1, 0) == 1 && (pf.revents & POLLIN)); /* its read was under way */
    loom_kv_pull_close(&other);
    loom_kv_pull_close(&stalled);
    free(got), free(span), free(want);
    uint8_t *want2 = malloc(one);
    /* eight reads at once, each stalled: a ninth's handshake waits (its deadline passes) until one of them ends */
    loom_kv_pull_t *eight[8] = {0}, *ninth = NULL;
    for (int i = 0; i < 8; i++) {
        CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &eight[i],
                                &theirs, &err) == LOOM_OK);
        if (eight[i]) loom_tcp_write_full(loom_kv_pull_fd(eight[i]), req, sizeof req, dl, "test", &err);
    }
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0,
                            loom_comm_deadline(300), &ninth, &theirs, &err) == LOOM_ERR_UNAVAILABLE && !ninth);
    loom_kv_pull_close(&eight[0]);
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0,
                            loom_comm_deadline(10000), &ninth, &theirs, &err) == LOOM_OK);
    for (int i = 1; i < 8; i++) loom_kv_pull_close(&eight[i]);
    loom_kv_pull_close(&ninth);
    /* eight idle connections: a ninth dialler takes the slot of one of them (one only), which is closed */
    for (int i = 0; i < 8; i++)
        CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &eight[i],
                                &theirs, &err) == LOOM_OK);
    CHECK(loom_kv_pull_open(loom_kv_service_addr(s), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0,
                            loom_comm_deadline(10000), &ninth, &theirs, &err) == LOOM_OK);
    int closed = 0;
    for (int i = 0; i < 8; i++) {
        struct pollfd e = {eight[i] ? loom_kv_pull_fd(eight[i]) : -1, POLLIN, 0};
        closed += poll(&e, 1, 0) == 1;
    }
    CHECK(closed == 1);
    CHECK(ninth && pull_read(ninth, 0x51, blocks, 1, 0, 2, want2, one, dl, &err) == LOOM_OK);
    loom_kv_pull_close(&ninth);
    for (int i = 0; i < 8; i++) loom_kv_pull_close(&eight[i]);
    free(want2);
out:
    loom_kv_pull_close(&stalled);
    loom_kv_service_destroy(&s);
}

/* A man in the middle for one connection: forwards both ways, flipping one
 * byte of a stream at an offset or sending one sealed record of the
 * service's twice (offset 0: neither). */
typedef struct proxy {
    int lfd;
    char addr[64], target[320];
    size_t flip_a2d, flip_d2a; /* the byte at this offset of the service's (dialler's) stream */
    size_t replay_a2d;         /* the service's record that starts here, sent again right after itself */
    pthread_t thread;
} proxy_t;

static void *proxy_main(void *arg) {
    proxy_t *x = arg;
    int a = accept(x->lfd, NULL, NULL), b = -1;
    loom_err_t err = {0};
    uint64_t dl = loom_comm_deadline(10000);
    if (a < 0 || loom_tcp_dial(x->target, dl, &b, &err) < 0) goto out;
    static uint8_t buf[1 << 16];
    uint8_t rec[1024];
    size_t off[2] = {0, 0}, rec_len = 0, rec_need = 0;
    int replayed = 0;
    for (;;) {
        struct pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
        if (poll(p, 2, 10000) <= 0) break;
        const int from = p[0].revents ? 0 : 1; /* 1: the service's stream */
        const int src = from ? b : a, dst = from ? a : b;
        ssize_t r = read(src, buf, sizeof buf);
        if (r <= 0) break;
        const size_t n = (size_t)r, o = off[from], flip = from ? x->flip_a2d : x->flip_d2a;
        off[from] += n;
        if (flip && flip >= o && flip < o + n) buf[flip - o] ^= 0x40;
        size_t cut = n;
        if (from && x->replay_a2d && !replayed) {
            for (size_t i = 0; i < n; i++)
                if (o + i >= x->replay_a2d && rec_len < sizeof rec) rec[rec_len++] = buf[i];
            if (rec_len >= 4 && !rec_need)
                rec_need = 4 + (size_t)(rec[0] | rec[1] << 8 | rec[2] << 16 | (uint32_t)rec[3] << 24) + 16;
            if (rec_need && rec_need <= rec_len) cut = x->replay_a2d + rec_need - o;
        }
        if (loom_tcp_write_full(dst, buf, cut, dl, "proxy", &err) < 0) break;
        if (cut < n || (rec_need && rec_need <= rec_len && !replayed && from && x->replay_a2d)) {
            replayed = 1;
            if (loom_tcp_write_full(dst, rec, rec_need, dl, "proxy", &err) < 0 ||
                loom_tcp_write_full(dst, buf + cut, n - cut, dl, "proxy", &err) < 0)
                break;
        }
    }
out:
    if (a >= 0) close(a);
    if (b >= 0) close(b);
    return NULL;
}

/* A listener on loopback (x->lfd, x->addr) and a thread that serves it. */
static int proxy_start_fn(proxy_t *x, const char *target, void *(*fn)(void *)) {
    snprintf(x->target, sizeof x->target, "%s", target);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    x->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (x->lfd < 0 || bind(x->lfd, (struct sockaddr *)&sa, sizeof sa) || listen(x->lfd, 1) ||
        getsockname(x->lfd, (struct sockaddr *)&sa, &len))
        return -1;
    snprintf(x->addr, sizeof x->addr, "tcp://127.0.0.1:%d", ntohs(sa.sin_port));
    return pthread_create(&x->thread, NULL, fn, x);
}

static int proxy_start(proxy_t *x, const char *target) { return proxy_start_fn(x, target, proxy_main); }

static void proxy_stop(proxy_t *x) {
    pthread_join(x->thread, NULL);
    close(x->lfd);
}

/* A service of wire version 1: reads a hello, answers with a version 1 head and closes. */
static void *old_service(void *arg) {
    proxy_t *x = arg;
    int fd = accept(x->lfd, NULL, NULL);
    if (fd < 0) return NULL;
    uint8_t h[24] = {'L', 'M', 'K', '1', 1, 0, 1, 0};
    loom_err_t err = {0};
    uint64_t dl = loom_comm_deadline(5000);
    uint8_t in[24];
    if (loom_tcp_read_full(fd, in, sizeof in, dl, "old", &err) == LOOM_OK)
        loom_tcp_write_full(fd, h, sizeof h, dl, "old", &err);
    close(fd);
    return NULL;
}

/* Encrypted connections (kv_connector_extra_config encrypt, --encrypt-data-plane): reads give the plaintext ones'
 * bytes (slices of more than one sealed record too); a flipped byte either way or a replayed record fails the read
 * and the service serves on; encrypt on one side only, or without a secret, refused naming it. */
static void test_encrypt(void) {
    served_t sv = {.fmt = {.n_layers = 40, .block_size = 16, .n_heads = 8, .head_bytes = 256, .codes = 32768}};
    loom_kv_service_config_t c = {.host = "127.0.0.1", .ident = ident(), .fmt = sv.fmt, .secret = K,
                                  .secret_len = sizeof K - 1, .read = read_block, .ctx = &sv, .hold_wait_ms = 50};
    loom_kv_service_t *plain = NULL, *sealed = NULL;
    loom_err_t err = {0};
    CHECK(loom_kv_service_create(&c, &plain, &err) == LOOM_OK);
    c.encrypt = 1;
    CHECK(loom_kv_service_create(&c, &sealed, &err) == LOOM_OK);
    c.secret_len = 0;
    loom_kv_service_t *none = NULL;
    CHECK(loom_kv_service_create(&c, &none, &err) == LOOM_ERR_INVALID_ARGUMENT && !none &&
          strstr(err.msg, "encrypt needs a secret"));
    if (!plain || !sealed) return;
    int32_t blocks[3] = {4, 1, 6};
    loom_kv_service_hold(plain, 7, blocks, 3);
    loom_kv_service_hold(sealed, 7, blocks, 3);
    const size_t one = loom_kv_slice_bytes(&sv.fmt, 6), bytes = 3 * one; /* a slice of 2.5 MB: three records */
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    loom_kv_ident_t ours = ident(), theirs;
    uint64_t dl = loom_comm_deadline(20000);
    loom_kv_pull_t *pc = NULL;
    CHECK(loom_kv_pull_open(loom_kv_service_addr(plain), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc,
                            &theirs, &err) == LOOM_OK);
    CHECK(pc && pull_read(pc, 7, blocks, 3, 1, 6, a, bytes, dl, &err) == LOOM_OK);
    loom_kv_pull_close(&pc);
    CHECK(loom_kv_pull_open(loom_kv_service_addr(sealed), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 1, dl, &pc,
                            &theirs, &err) == LOOM_OK);
    memset(b, 0, bytes);
    CHECK(pc && pull_read(pc, 7, blocks, 3, 1, 6, b, bytes, dl, &err) == LOOM_OK);
    CHECK(one > (1u << 20) && !memcmp(a, b, bytes) && theirs.n_layers == 3);
    CHECK(pc && loom_kv_pull_done(pc, 7, dl, &err) == LOOM_OK);
    loom_kv_pull_close(&pc);
    /* encrypt on one side only; on without a secret */
    CHECK(loom_kv_pull_open(loom_kv_service_addr(sealed), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc,
                            &theirs, &err) == LOOM_ERR_INVALID_ARGUMENT &&
          strstr(err.msg, "encrypt: off here, on there"));
    CHECK(loom_kv_pull_open(loom_kv_service_addr(plain), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 1, dl, &pc,
                            &theirs, &err) == LOOM_ERR_INVALID_ARGUMENT &&
          strstr(err.msg, "encrypt: on here, off there"));
    CHECK(loom_kv_pull_open(loom_kv_service_addr(sealed), &ours, NULL, 0, LOOM_KV_SHM_OFF, 1, dl, &pc, &theirs,
                            &err) == LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "encrypt needs a secret"));
    /* in the middle: the service's stream is its hello and proof (56 bytes), the sealed identity (4 + 72 + 16)
     * and verdict (4 + 6 + 16), then the read's status record, its slices', the fence's; the dialler's is its
     * hello and proof (56), its sealed identity (92), then the read */
    const size_t a2d = 56 + 92 + 26, d2a = 56 + 92;
    const struct {
        size_t flip_a2d, flip_d2a, replay_a2d;
    } cases[3] = {{a2d + 26 + 100, 0, 0}, {0, d2a + 10, 0}, {0, 0, a2d}};
    for (int i = 0; i < 3; i++) {
        proxy_t x = {.flip_a2d = cases[i].flip_a2d, .flip_d2a = cases[i].flip_d2a, .replay_a2d = cases[i].replay_a2d};
        if (proxy_start(&x, loom_kv_service_addr(sealed)) != 0) {
            CHECK(!"proxy");
            break;
        }
        CHECK(loom_kv_pull_open(x.addr, &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 1, dl, &pc, &theirs, &err) ==
              LOOM_OK);
        loom_status_t st = pc ? pull_read(pc, 7, blocks, 3, 1, 6, b, bytes, dl, &err) : LOOM_ERR_INTERNAL;
        CHECK(st < 0);
        if (i != 1) CHECK(st == LOOM_ERR_PROTOCOL && strstr(err.msg, "failed its authentication tag"));
        loom_kv_pull_close(&pc);
        proxy_stop(&x);
        /* the service serves on */
        CHECK(loom_kv_pull_open(loom_kv_service_addr(sealed), &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 1, dl, &pc,
                                &theirs, &err) == LOOM_OK);
        memset(b, 0, bytes);
        CHECK(pc && pull_read(pc, 7, blocks, 3, 1, 6, b, bytes, dl, &err) == LOOM_OK && !memcmp(a, b, bytes));
        loom_kv_pull_close(&pc);
    }
    /* a service of another wire version: refused naming both */
    proxy_t old_svc = {0};
    if (proxy_start_fn(&old_svc, "", old_service) == 0) {
        CHECK(loom_kv_pull_open(old_svc.addr, &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0, dl, &pc, &theirs, &err) ==
                  LOOM_ERR_PROTOCOL &&
              strstr(err.msg, "the service speaks KV transfer version 1, this side version 2"));
        proxy_stop(&old_svc);
    }
    loom_kv_service_destroy(&plain);
    loom_kv_service_destroy(&sealed);
    free(a), free(b);
}

/* A pull whose service is gone (nothing listens) or is not a KV service
 * (a listener that never answers) fails within the dial's and the
 * handshake's bounds, not the read's 60 s deadline: a decode step waits on
 * it. */
static void test_gone(void) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&a, sizeof a) == 0 && listen(lfd, 4) == 0 &&
          getsockname(lfd, (struct sockaddr *)&a, &alen) == 0);
    char silent[64], gone[64];
    snprintf(silent, sizeof silent, "tcp://127.0.0.1:%d", ntohs(a.sin_port));
    int dfd = socket(AF_INET, SOCK_STREAM, 0); /* bound, never listening: its port refuses */
    struct sockaddr_in b = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t blen = sizeof b;
    CHECK(dfd >= 0 && bind(dfd, (struct sockaddr *)&b, sizeof b) == 0 &&
          getsockname(dfd, (struct sockaddr *)&b, &blen) == 0);
    snprintf(gone, sizeof gone, "tcp://127.0.0.1:%d", ntohs(b.sin_port));
    const char *addrs[2] = {gone, silent};
    for (int i = 0; i < 2; i++) {
        loom_kv_ident_t ours = ident(), theirs;
        loom_err_t err = {0};
        loom_kv_pull_t *pc = NULL;
        const uint64_t t0 = loom_now_ns();
        loom_status_t st = loom_kv_pull_open(addrs[i], &ours, K, sizeof K - 1, LOOM_KV_SHM_OFF, 0,
                                             loom_comm_deadline(60000), &pc, &theirs, &err);
        const double s = (double)(loom_now_ns() - t0) * 1e-9;
        CHECK(st == LOOM_ERR_UNAVAILABLE && !pc);
        CHECK(s < 15.0); /* the bounds are 1 s and 3 s; the read's deadline 60 s */
        printf("  a pull from %s (%s) failed in %.1f s: %s\n", addrs[i], i ? "silent" : "nothing listens", s,
               err.msg);
    }
    close(lfd);
    close(dfd);
}

int main(void) {
    RUN(test_slices);
    RUN(test_ident);
    RUN(test_latent_slices);
    RUN(test_service);
    RUN(test_latent_service);
    RUN(test_shm);
    RUN(test_concurrent);
    RUN(test_encrypt);
    RUN(test_gone);
    return test_summary();
}
