/* Tests for a worker's host cache of prepared LoRA adapters: preparation on
 * its thread, readiness reported once, the least recently used dropped past
 * the capacity, an adapter whose content changed or whose directory is gone
 * failed with the problem named, and a failed one tried again; and the load
 * orders on top of it (worker/lora_orders.c): installed at once from the
 * cache or when prepared, failures reported with the problem, a slot out of
 * range refused, an old epoch's orders forgotten, and an adapter prepared
 * while the cached ones were used again installed, not dropped. */
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/lora.h"
#include "common/safetensors.h"
#include "common/util.h"
#include "kernels/backend.h"
#include "tests/test.h"
#include "worker/lora_cache.h"
#include "worker/lora_orders.h"
#include "worker/model.h"

static char g_tmp[256];

/* An adapter of stories260K (dim 64) on q_proj of layer 0, rank 8, every
 * weight VALUE. */
static void write_adapter(const char *dir, float value) {
    mkdir(dir, 0755);
    char p[512];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    FILE *f = fopen(p, "w");
    REQUIRE(f != NULL);
    fputs("{\"peft_type\":\"LORA\",\"r\":8,\"lora_alpha\":16,\"target_modules\":[\"q_proj\"],"
          "\"bias\":\"none\"}",
          f);
    fclose(f);
    const size_t n = 8 * 64, nb = n * 4;
    char h[512];
    int hl = snprintf(
        h, sizeof h,
        "{\"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight\":{\"dtype\":\"F32\","
        "\"shape\":[8,64],\"data_offsets\":[0,%zu]},"
        "\"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight\":{\"dtype\":\"F32\","
        "\"shape\":[64,8],\"data_offsets\":[%zu,%zu]}}",
        nb, nb, 2 * nb);
    while (hl % 8)
        h[hl++] = ' ';
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    f = fopen(p, "wb");
    REQUIRE(f != NULL);
    uint64_t len = (uint64_t)hl;
    fwrite(&len, 8, 1, f);
    fwrite(h, 1, (size_t)hl, f);
    float w[8 * 64];
    for (size_t i = 0; i < n; i++)
        w[i] = value;
    fwrite(w, 4, n, f);
    fwrite(w, 4, n, f);
    fclose(f);
}

static void digest_of(const loom_model_config_t *cfg, const char *dir, uint8_t out[32]) {
    loom_lora_adapter_t *a = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_lora_load(dir, cfg, 16, 0, 0, &a, &err) == LOOM_OK);
    memcpy(out, a->digest, 32);
    loom_lora_destroy(&a);
}

/* Polls until N outcomes came back (5 s at most). */
static int wait_done(loom_lora_cache_t *c, loom_lora_cache_done_t *d, int n) {
    int got = 0;
    for (int i = 0; i < 5000 && got < n; i++) {
        got += loom_lora_cache_poll(c, d + got, n - got);
        if (got < n) usleep(1000);
    }
    return got;
}

static loom_model_config_t g_cfg;
static loom_model_t *g_m;

static void test_cache(void) {
    const loom_model_config_t *cfg = &g_cfg;
    loom_model_t *m = g_m;
    char a[512], b[512], gone[512];
    snprintf(a, sizeof a, "%s/a", g_tmp);
    snprintf(b, sizeof b, "%s/b", g_tmp);
    snprintf(gone, sizeof gone, "%s/gone", g_tmp);
    write_adapter(a, 0.01f);
    write_adapter(b, 0.02f);
    uint8_t da[32], db[32];
    digest_of(cfg, a, da);
    digest_of(cfg, b, db);

    loom_lora_cache_t *c = NULL;
    loom_err_t err = {0};
    CHECK(loom_lora_cache_create(m, cfg, 0, cfg->n_layers, 16, 0, &c, &err) ==
          LOOM_ERR_INVALID_ARGUMENT);
    REQUIRE(loom_lora_cache_create(m, cfg, 0, cfg->n_layers, 16, 1, &c, &err) == LOOM_OK);
    loom_lora_cache_done_t d[4];
    loom_lora_cache_request(c, a, da);
    loom_lora_cache_request(c, a, da); /* under way: nothing more */
    REQUIRE(wait_done(c, d, 1) == 1);
    CHECK(d[0].status == LOOM_OK && !memcmp(d[0].digest, da, 32));
    CHECK(loom_lora_cache_poll(c, d, 4) == 0); /* reported once */
    const loom_lora_prepared_t *p = loom_lora_cache_get(c, da);
    REQUIRE(p != NULL);
    CHECK(loom_lora_prepared_bytes(p) > 0);
    CHECK(loom_model_lora_install(m, 1, p, &err) == LOOM_OK);
    loom_lora_cache_request(c, a, da); /* READY: nothing happens */
    CHECK(loom_lora_cache_poll(c, d, 4) == 0);

    /* capacity 1: b's readiness drops a, the least recently used */
    loom_lora_cache_request(c, b, db);
    REQUIRE(wait_done(c, d, 1) == 1);
    CHECK(d[0].status == LOOM_OK && !memcmp(d[0].digest, db, 32));
    CHECK(loom_lora_cache_count(c) == 1);
    CHECK(loom_lora_cache_get(c, da) == NULL && loom_lora_cache_get(c, db) != NULL);

    /* the content on disk is not the registered one; a missing directory */
    loom_lora_cache_request(c, b, da);
    loom_lora_cache_request(c, gone, db); /* db is READY: nothing happens */
    REQUIRE(wait_done(c, d, 1) == 1);
    CHECK(d[0].status != LOOM_OK && strstr(d[0].msg, "is not the one registered") != NULL);
    uint8_t dg[32];
    memset(dg, 7, sizeof dg);
    loom_lora_cache_request(c, gone, dg);
    REQUIRE(wait_done(c, d, 1) == 1);
    CHECK(d[0].status != LOOM_OK && strstr(d[0].msg, "gone") != NULL);
    /* a failed order is forgotten: asked again, it is tried again (and now the files are there) */
    write_adapter(gone, 0.01f); /* same content as a */
    loom_lora_cache_request(c, gone, da);
    REQUIRE(wait_done(c, d, 1) == 1);
    CHECK(d[0].status == LOOM_OK && loom_lora_cache_get(c, da) != NULL);
    loom_lora_cache_destroy(&c);
    loom_lora_cache_destroy(&c); /* safe twice */

    /* destroyed with an order under way */
    REQUIRE(loom_lora_cache_create(m, cfg, 0, cfg->n_layers, 16, 2, &c, &err) == LOOM_OK);
    loom_lora_cache_request(c, a, da);
    loom_lora_cache_destroy(&c);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

typedef struct {
    int n;
    uint64_t epoch[8];
    int slot[8];
    loom_status_t status[8];
    char msg[8][256];
} reports_t;

static void on_report(void *ctx, uint64_t epoch, int slot, const uint8_t digest[32], loom_status_t status,
                      const char *msg, double seconds) {
    (void)digest;
    reports_t *r = ctx;
    CHECK(seconds >= 0.0);
    if (r->n >= 8) return;
    r->epoch[r->n] = epoch, r->slot[r->n] = slot, r->status[r->n] = status;
    snprintf(r->msg[r->n], sizeof r->msg[0], "%s", msg);
    r->n++;
}

/* Polls the orders until N reports came (5 s at most). */
static int wait_reports(loom_lora_orders_t *o, reports_t *r, int n) {
    for (int i = 0; i < 5000 && r->n < n; i++) {
        loom_lora_orders_poll(o);
        if (r->n < n) usleep(1000);
    }
    return r->n;
}

static void test_orders(void) {
    const loom_model_config_t *cfg = &g_cfg;
    char a[512], gone[512];
    snprintf(a, sizeof a, "%s/oa", g_tmp);
    snprintf(gone, sizeof gone, "%s/ogone", g_tmp);
    write_adapter(a, 0.03f);
    uint8_t da[32], dg[32];
    digest_of(cfg, a, da);
    memset(dg, 9, sizeof dg);
    reports_t r = {0};
    loom_lora_orders_t *o = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_lora_orders_create(g_m, cfg, 0, cfg->n_layers, 16, 1, on_report, &r, &o, &err) == LOOM_OK);
    /* prepared on the cache's thread, installed by poll */
    loom_lora_orders_add(o, 3, 0, a, da);
    CHECK(r.n == 0 && loom_lora_orders_pending(o) == 1);
    REQUIRE(wait_reports(o, &r, 1) == 1);
    CHECK(r.epoch[0] == 3 && r.slot[0] == 0 && r.status[0] == LOOM_OK);
    CHECK(loom_lora_orders_pending(o) == 0);
    /* the cache holds it: installed at once */
    loom_lora_orders_add(o, 3, 1, a, da);
    CHECK(r.n == 2 && r.slot[1] == 1 && r.status[1] == LOOM_OK);
    /* a slot the engine does not have */
    loom_lora_orders_add(o, 3, 2, a, da);
    CHECK(r.n == 3 && r.status[2] == LOOM_ERR_INVALID_ARGUMENT && strstr(r.msg[2], "out of range") != NULL);
    /* a directory that is gone: the failure names it */
    loom_lora_orders_add(o, 4, 1, gone, dg);
    REQUIRE(wait_reports(o, &r, 4) == 4);
    CHECK(r.epoch[3] == 4 && r.slot[3] == 1 && r.status[3] < 0 && strstr(r.msg[3], "ogone") != NULL);
    /* a new epoch: the old one's order is dropped unreported */
    loom_lora_orders_add(o, 5, 1, gone, dg);
    CHECK(loom_lora_orders_pending(o) == 1);
    loom_lora_orders_forget(o);
    CHECK(loom_lora_orders_pending(o) == 0);
    for (int i = 0; i < 50; i++) {
        loom_lora_orders_poll(o);
        usleep(1000);
    }
    CHECK(r.n == 4);
    loom_lora_orders_destroy(&o);
    loom_lora_orders_destroy(&o); /* safe twice */
}

/* An adapter whose preparation comes back after the other cached adapters
 * were used again (installed into another slot meanwhile) is installed,
 * not dropped as the least recently used at the poll that reports it. */
static void test_prepared_kept_for_install(void) {
    const loom_model_config_t *cfg = &g_cfg;
    char dir[3][512];
    uint8_t dg[3][32];
    for (int i = 0; i < 3; i++) {
        snprintf(dir[i], sizeof dir[i], "%s/k%d", g_tmp, i);
        write_adapter(dir[i], 0.01f * (float)(i + 5));
        digest_of(cfg, dir[i], dg[i]);
    }
    reports_t r = {0};
    loom_lora_orders_t *o = NULL;
    loom_err_t err = {0};
    /* 2 slots, so the cache keeps 2 prepared adapters */
    REQUIRE(loom_lora_orders_create(g_m, cfg, 0, cfg->n_layers, 16, 1, on_report, &r, &o, &err) == LOOM_OK);
    loom_lora_orders_add(o, 1, 0, dir[0], dg[0]);
    REQUIRE(wait_reports(o, &r, 1) == 1);
    loom_lora_orders_add(o, 1, 1, dir[1], dg[1]);
    REQUIRE(wait_reports(o, &r, 2) == 2);
    CHECK(r.status[0] == LOOM_OK && r.status[1] == LOOM_OK);
    /* slot 0 gets a third adapter (prepared on the thread); while it is,
     * slot 1 takes the two cached ones in turn, installed at once */
    loom_lora_orders_add(o, 1, 0, dir[2], dg[2]);
    loom_lora_orders_add(o, 1, 1, dir[0], dg[0]);
    loom_lora_orders_add(o, 1, 1, dir[1], dg[1]);
    CHECK(r.n == 4 && r.status[2] == LOOM_OK && r.status[3] == LOOM_OK);
    REQUIRE(wait_reports(o, &r, 5) == 5);
    CHECK(r.slot[4] == 0 && r.status[4] == LOOM_OK);
    if (r.status[4] != LOOM_OK) fprintf(stderr, "  the third adapter: %s\n", r.msg[4]);
    CHECK(loom_lora_orders_pending(o) == 0);
    loom_lora_orders_destroy(&o);
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/loom_test_lora_cache_XXXXXX");
    if (!mkdtemp(g_tmp)) return 2;
    const char *dir = LOOM_MODELS_DIR_DEFAULT "/stories260K";
    loom_err_t err = {0};
    loom_st_t *st = NULL;
    loom_backend_t *be = NULL;
    loom_backend_config_t bc = {
        .version = LOOM_BACKEND_CONFIG_VERSION, .n_threads = 1, .weight_dtype = LOOM_DT_F32};
    if (loom_model_config_load(dir, &g_cfg, &err) != LOOM_OK ||
        loom_st_open_dir(dir, &st, &err) != LOOM_OK ||
        loom_model_map_tensor_names(&g_cfg, st, &err) != LOOM_OK ||
        loom_backend_create(&bc, &be, &err) != LOOM_OK) {
        fprintf(stderr, "stories260K: %s\n", err.msg);
        return 2;
    }
    loom_shard_spec_t spec = {.tp_rank = 0,
                              .tp_size = 1,
                              .layer_begin = 0,
                              .layer_end = g_cfg.n_layers,
                              .has_embed = 1,
                              .has_head = 1};
    loom_model_options_t mo = {.max_tokens = 16,
                               .max_seqs = 1,
                               .max_logits = 16,
                               .kv_dtype = LOOM_DT_F32,
                               .max_loras = 2,
                               .max_lora_rank = 16};
    if (loom_model_load(be, &g_cfg, st, &spec, &mo, &g_m, &err) != LOOM_OK) {
        fprintf(stderr, "stories260K: %s\n", err.msg);
        return 2;
    }
    RUN(test_cache);
    RUN(test_orders);
    RUN(test_prepared_kept_for_install);
    loom_model_destroy(&g_m);
    loom_backend_destroy(&be);
    loom_st_close(&st);
    nftw(g_tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
