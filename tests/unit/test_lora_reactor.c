/* vLLM's runtime adapter load through the reactor's LoRA state
 * (coordinator/lora_reactor.h) and the preparation pool that reads the
 * adapter (coordinator/prepare.h): _begin's checks refuse with vLLM's
 * texts and fill no job; an adapter read on the pool is registered when its
 * job comes back; two loads of one name both begun before either is back:
 * the first registered, the second told the name is taken; a bad directory
 * comes back named and registers nothing. */
#include <ftw.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/model_config.h"
#include "common/util.h"
#include "coordinator/lora_reactor.h"
#include "coordinator/prepare.h"
#include "tests/test.h"

static char g_tmp[256];
static loom_model_config_t g_cfg; /* stories260K: dim 64 */

/* An adapter of stories260K with q_proj of layer 0 only, rank R, every weight VALUE. */
static void write_adapter(const char *dir, int r, float value) {
    mkdir(dir, 0755);
    char p[512];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    FILE *f = fopen(p, "w");
    REQUIRE(f != NULL);
    fprintf(f, "{\"peft_type\":\"LORA\",\"r\":%d,\"lora_alpha\":%d,\"target_modules\":[\"q_proj\"],\"bias\":\"none\"}",
            r, 2 * r);
    fclose(f);
    size_t n = (size_t)r * 64, nb = n * 4;
    char h[512];
    int hl = snprintf(h, sizeof h,
                      "{\"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight\":{\"dtype\":\"F32\","
                      "\"shape\":[%d,64],\"data_offsets\":[0,%zu]},"
                      "\"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight\":{\"dtype\":\"F32\","
                      "\"shape\":[64,%d],\"data_offsets\":[%zu,%zu]}}",
                      r, nb, r, nb, 2 * nb);
    while (hl % 8) h[hl++] = ' ';
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    f = fopen(p, "wb");
    REQUIRE(f != NULL);
    uint64_t len = (uint64_t)hl;
    fwrite(&len, 8, 1, f);
    fwrite(h, 1, (size_t)hl, f);
    float *w = loom_xmalloc(nb);
    for (size_t i = 0; i < n; i++) w[i] = value;
    fwrite(w, 4, n, f);
    fwrite(w, 4, n, f);
    free(w);
    fclose(f);
}

/* Waits for the pool's fd (up to ms) and takes one job. */
static loom_prep_job_t *wait_take(loom_prep_t *p, int ms) {
    uint64_t end = loom_now_ns() + (uint64_t)ms * 1000000ull;
    for (;;) {
        loom_prep_job_t *j = loom_prep_take(p);
        if (j || loom_now_ns() > end) return j;
        struct pollfd pf = {.fd = loom_prep_fd(p), .events = POLLIN};
        poll(&pf, 1, 50);
    }
}

static void reactor(int allow, loom_lora_reactor_t **r) {
    loom_lora_serve_opts_t o;
    loom_lora_serve_opts_init(&o);
    o.enable = 1;
    o.allow_runtime_updating = allow;
    loom_err_t err = {0};
    REQUIRE(loom_lora_serve_check(&o, &err) == LOOM_OK);
    REQUIRE(loom_lora_reactor_create(&o, &g_cfg, "stories260K", r, &err) == LOOM_OK);
}

static void test_begin_refuses(void) {
    char a[300], msg[1100];
    snprintf(a, sizeof a, "%s/a", g_tmp);
    loom_lora_reactor_t *r = NULL;
    reactor(0, &r);
    REQUIRE(r != NULL);
    loom_prep_job_t j = {0};
    CHECK(loom_lora_reactor_load_begin(r, "x", a, &j, msg, sizeof msg) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(msg, "--allow-runtime-lora-updating") != NULL && j.lora.name == NULL);
    loom_lora_reactor_destroy(&r);
    reactor(1, &r);
    REQUIRE(r != NULL);
    CHECK(loom_lora_reactor_load_begin(r, "", a, &j, msg, sizeof msg) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(!strcmp(msg, "both 'lora_name' and 'lora_path' must be provided."));
    CHECK(loom_lora_reactor_load_begin(r, "x", NULL, &j, msg, sizeof msg) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_lora_reactor_load_begin(r, "stories260K", a, &j, msg, sizeof msg) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(msg, "served model's name") != NULL && j.lora.name == NULL);
    loom_lora_reactor_destroy(&r);
    loom_lora_reactor_destroy(&r); /* twice: safe */
}

/* Begins a load of NAME from PATH and submits it. */
static void submit(loom_lora_reactor_t *r, loom_prep_t *p, const char *name, const char *path, int tag) {
    char msg[1100];
    loom_prep_job_t *j = loom_xcalloc(1, sizeof *j);
    REQUIRE(loom_lora_reactor_load_begin(r, name, path, j, msg, sizeof msg) == LOOM_OK);
    j->ctx = (void *)(intptr_t)tag;
    loom_prep_submit(p, j);
}

static void test_loads_off_the_reactor(void) {
    char a[300], b[300], msg[1100];
    snprintf(a, sizeof a, "%s/a", g_tmp);
    snprintf(b, sizeof b, "%s/b", g_tmp);
    loom_lora_reactor_t *r = NULL;
    reactor(1, &r);
    REQUIRE(r != NULL);
    loom_lora_slots_t *s = loom_lora_reactor_slots(r);
    loom_prep_t *p = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_prep_create(1, &p, &err) == LOOM_OK);

    /* two loads of one name, both begun (neither registered yet), then one missing directory */
    submit(r, p, "twin", a, 1);
    submit(r, p, "twin", b, 2);
    char gone[300];
    snprintf(gone, sizeof gone, "%s/nothing", g_tmp);
    submit(r, p, "gone", gone, 3);
    CHECK(loom_lora_slots_find(s, "twin") == NULL); /* nothing registered while the reads are out */
    for (int n = 0; n < 3; n++) {
        loom_prep_job_t *j = wait_take(p, 30000);
        REQUIRE(j != NULL);
        int tag = (int)(intptr_t)j->ctx;
        CHECK(tag == n + 1); /* one thread: in order */
        loom_status_t st = loom_lora_reactor_load_end(r, j, msg, sizeof msg);
        if (tag == 1) {
            CHECK(st == LOOM_OK && !strcmp(msg, "Success: LoRA adapter 'twin' added successfully."));
            const loom_lora_entry_t *e = loom_lora_slots_find(s, "twin");
            CHECK(e && !strcmp(e->path, a) && e->rank == 8 && !memcmp(e->digest, j->lora.digest, 32));
        } else if (tag == 2) {
            CHECK(j->status == LOOM_OK); /* its read was fine: the name was taken meanwhile */
            CHECK(st == LOOM_ERR_INVALID_ARGUMENT &&
                  !strcmp(msg, "The lora adapter 'twin' has already been loaded."));
            CHECK(!strcmp(loom_lora_slots_find(s, "twin")->path, a));
        } else {
            CHECK(st < 0 && strstr(msg, "LoRA adapter gone") && strstr(msg, "nothing"));
            CHECK(loom_lora_slots_find(s, "gone") == NULL);
        }
        loom_prep_job_free(&j);
    }
    /* registered: a third load of the name is refused before any read */
    loom_prep_job_t j = {0};
    CHECK(loom_lora_reactor_load_begin(r, "twin", b, &j, msg, sizeof msg) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(msg, "already been loaded") != NULL && j.lora.name == NULL);
    loom_prep_destroy(&p);
    loom_lora_reactor_destroy(&r);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/loom_test_lora_reactor_XXXXXX");
    if (!mkdtemp(g_tmp)) return 2;
    loom_err_t err = {0};
    if (loom_model_config_load(LOOM_MODELS_DIR_DEFAULT "/stories260K", &g_cfg, &err) != LOOM_OK) {
        fprintf(stderr, "stories260K: %s\n", err.msg);
        return 2;
    }
    char a[300], b[300];
    snprintf(a, sizeof a, "%s/a", g_tmp);
    snprintf(b, sizeof b, "%s/b", g_tmp);
    write_adapter(a, 8, 0.01f);
    write_adapter(b, 8, 0.02f);
    RUN(test_begin_refuses);
    RUN(test_loads_off_the_reactor);
    nftw(g_tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
