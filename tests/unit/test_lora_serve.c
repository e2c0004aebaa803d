/* Tests for the LoRA serving options: --lora-modules in both forms, the
 * start-up checks (--max-cpu-loras below --max-loras, ranks), adapters
 * validated and registered (a missing directory, a rank above the limit
 * named), and a request's model mapped to the base or an adapter. */
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/model_config.h"
#include "common/util.h"
#include "coordinator/lora_serve.h"
#include "tests/test.h"

static char g_tmp[256];
static loom_model_config_t g_cfg; /* stories260K: dim 64 */

/* An adapter of stories260K with q_proj of layer 0 only, rank R. */
static void write_adapter(const char *dir, int r, float value) {
    mkdir(dir, 0755);
    char p[512];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    FILE *f = fopen(p, "w");
    REQUIRE(f != NULL);
    fprintf(f,
            "{\"peft_type\":\"LORA\",\"r\":%d,\"lora_alpha\":%d,\"target_modules\":[\"q_proj\"],"
            "\"bias\":\"none\"}",
            r, 2 * r);
    fclose(f);
    size_t n = (size_t)r * 64, nb = n * 4;
    char h[512];
    int hl = snprintf(
        h, sizeof h,
        "{\"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight\":{\"dtype\":\"F32\","
        "\"shape\":[%d,64],\"data_offsets\":[0,%zu]},"
        "\"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight\":{\"dtype\":\"F32\","
        "\"shape\":[64,%d],\"data_offsets\":[%zu,%zu]}}",
        r, nb, r, nb, 2 * nb);
    while (hl % 8)
        h[hl++] = ' ';
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    f = fopen(p, "wb");
    REQUIRE(f != NULL);
    uint64_t len = (uint64_t)hl;
    fwrite(&len, 8, 1, f);
    fwrite(h, 1, (size_t)hl, f);
    float *w = loom_xmalloc(nb);
    for (size_t i = 0; i < n; i++)
        w[i] = value;
    fwrite(w, 4, n, f);
    fwrite(w, 4, n, f);
    free(w);
    fclose(f);
}

static void test_modules(void) {
    loom_lora_serve_opts_t o;
    loom_lora_serve_opts_init(&o);
    CHECK(o.max_loras == 1 && o.max_lora_rank == 16 && !o.enable);
    loom_err_t err = {0};
    CHECK(loom_lora_serve_add_module(&o, "a=/x/a", &err) == LOOM_OK);
    CHECK(loom_lora_serve_add_module(
              &o, "{\"name\":\"b\",\"path\":\"/x/b\",\"base_model_name\":\"m\"}", &err) == LOOM_OK);
    CHECK(loom_lora_serve_add_module(&o, "{\"name\":\"c\",\"path\":\"/x/c\"}", &err) == LOOM_OK);
    REQUIRE(o.n_modules == 3);
    CHECK(!strcmp(o.modules[0].name, "a") && !strcmp(o.modules[0].path, "/x/a") &&
          !o.modules[0].base[0]);
    CHECK(!strcmp(o.modules[1].name, "b") && !strcmp(o.modules[1].path, "/x/b") &&
          !strcmp(o.modules[1].base, "m"));
    CHECK(!strcmp(o.modules[2].name, "c") && !o.modules[2].base[0]);
    CHECK(loom_lora_serve_add_module(&o, "nopath", &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.msg, "name=path") != NULL);
    CHECK(loom_lora_serve_add_module(&o, "=/x", &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_lora_serve_add_module(&o, "a=", &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_lora_serve_add_module(&o, "{\"name\":\"d\"}", &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_lora_serve_add_module(&o, "{\"name\":", &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(o.n_modules == 3);

    /* adapters need --enable-lora */
    CHECK(loom_lora_serve_check(&o, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.msg, "--enable-lora") != NULL);
    o.enable = 1;
    CHECK(loom_lora_serve_check(&o, &err) == LOOM_OK);
    CHECK(o.max_cpu_loras == 1); /* defaults to --max-loras */
    o.max_loras = 2, o.max_cpu_loras = 1;
    CHECK(loom_lora_serve_check(&o, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.msg, "--max-cpu-loras 1 must be at least --max-loras 2") != NULL);
    o.max_cpu_loras = 4;
    CHECK(loom_lora_serve_check(&o, &err) == LOOM_OK);
    o.max_lora_rank = 48;
    CHECK(loom_lora_serve_check(&o, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.msg, "--max-lora-rank 48") != NULL);
    o.max_lora_rank = 64, o.max_loras = 0;
    CHECK(loom_lora_serve_check(&o, &err) == LOOM_ERR_INVALID_ARGUMENT);
    o.max_loras = 33;
    CHECK(loom_lora_serve_check(&o, &err) == LOOM_ERR_INVALID_ARGUMENT);
    o.max_loras = 2;
    CHECK(loom_lora_serve_add_module(&o, "a=/y/a", &err) == LOOM_OK);
    CHECK(loom_lora_serve_check(&o, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.msg, "the name a is given twice") != NULL);
}

static void test_take_args(void) {
    char *argv[] = {"loom-coordinator",
                    "--model",
                    "m",
                    "--enable-lora",
                    "--lora-modules",
                    "a=/x/a",
                    "{\"name\":\"b\",\"path\":\"/x/b\"}",
                    "--tp",
                    "2",
                    "--max-loras=2",
                    "--lora-modules=c=/x/c",
                    "--max-lora-rank",
                    "64",
                    "--max-cpu-loras",
                    "3",
                    "--allow-runtime-lora-updating",
                    "--pp",
                    "1",
                    NULL};
    int argc = (int)(sizeof argv / sizeof argv[0]) - 1;
    loom_lora_serve_opts_t o;
    loom_lora_serve_opts_init(&o);
    loom_err_t err = {0};
    REQUIRE(loom_lora_serve_take_args(&argc, argv, &o, &err) == LOOM_OK);
    CHECK(argc == 7);
    const char *rest[] = {"loom-coordinator", "--model", "m", "--tp", "2", "--pp", "1"};
    for (int i = 0; i < 7 && i < argc; i++)
        CHECK(!strcmp(argv[i], rest[i]));
    CHECK(argv[argc] == NULL);
    CHECK(o.enable && o.allow_runtime_updating && o.max_loras == 2 && o.max_lora_rank == 64 &&
          o.max_cpu_loras == 3);
    REQUIRE(o.n_modules == 3);
    CHECK(!strcmp(o.modules[0].name, "a") && !strcmp(o.modules[1].name, "b") &&
          !strcmp(o.modules[2].path, "/x/c"));

    char *bad1[] = {"x", "--max-loras", "two", NULL};
    argc = 3;
    CHECK(loom_lora_serve_take_args(&argc, bad1, &o, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.msg, "--max-loras") != NULL);
    char *bad2[] = {"x", "--lora-modules", "--tp", "1", NULL};
    argc = 4;
    CHECK(loom_lora_serve_take_args(&argc, bad2, &o, &err) == LOOM_ERR_INVALID_ARGUMENT);
    char *bad3[] = {"x", "--enable-lora=1", NULL};
    argc = 2;
    CHECK(loom_lora_serve_take_args(&argc, bad3, &o, &err) == LOOM_ERR_INVALID_ARGUMENT);
}

static void test_register_and_select(void) {
    char a[512], b[512], big[512];
    snprintf(a, sizeof a, "%s/a", g_tmp);
    snprintf(b, sizeof b, "%s/b", g_tmp);
    snprintf(big, sizeof big, "%s/big", g_tmp);
    write_adapter(a, 8, 0.01f);
    write_adapter(b, 8, 0.02f);
    write_adapter(big, 128, 0.01f);

    loom_lora_serve_opts_t o;
    loom_lora_serve_opts_init(&o);
    o.enable = 1, o.max_loras = 2, o.max_lora_rank = 64;
    loom_err_t err = {0};
    char arg[600];
    snprintf(arg, sizeof arg, "a=%s", a);
    REQUIRE(loom_lora_serve_add_module(&o, arg, &err) == LOOM_OK);
    snprintf(arg, sizeof arg, "{\"name\":\"b\",\"path\":\"%s\"}", b);
    REQUIRE(loom_lora_serve_add_module(&o, arg, &err) == LOOM_OK);
    REQUIRE(loom_lora_serve_check(&o, &err) == LOOM_OK);
    loom_lora_slots_t *s = NULL;
    REQUIRE(loom_lora_slots_create(o.max_loras, 8, &s, &err) == LOOM_OK);
    REQUIRE(loom_lora_serve_register(&o, &g_cfg, s, &err) == LOOM_OK);
    const loom_lora_entry_t *ea = loom_lora_slots_find(s, "a"), *eb = loom_lora_slots_find(s, "b");
    REQUIRE(ea && eb);
    CHECK(ea->rank == 8 && memcmp(ea->digest, eb->digest, 32) != 0 && !strcmp(ea->path, a));

    /* a model names the base, an adapter, or base:adapter */
    const char *aliases[] = {"stories", NULL};
    int id = 7;
    CHECK(loom_lora_serve_select(s, "stories260K", aliases, "stories260K", &id, &err) == LOOM_OK &&
          id == -1);
    CHECK(loom_lora_serve_select(s, "stories260K", aliases, "stories", &id, &err) == LOOM_OK &&
          id == -1);
    CHECK(loom_lora_serve_select(s, "stories260K", aliases, "", &id, &err) == LOOM_OK && id == -1);
    CHECK(loom_lora_serve_select(s, "stories260K", aliases, "a", &id, &err) == LOOM_OK &&
          id == ea->id);
    CHECK(loom_lora_serve_select(s, "stories260K", aliases, "stories260K:b", &id, &err) ==
              LOOM_OK &&
          id == eb->id);
    CHECK(loom_lora_serve_select(s, "stories260K", aliases, "other:b", &id, &err) ==
          LOOM_ERR_NOT_FOUND);
    CHECK(loom_lora_serve_select(s, "stories260K", aliases, "x", &id, &err) == LOOM_ERR_NOT_FOUND);
    CHECK(!strcmp(err.msg, "The model `x` does not exist."));
    CHECK(loom_lora_serve_select(NULL, "stories260K", NULL, "a", &id, &err) == LOOM_ERR_NOT_FOUND);

    /* the metrics from the registry: a admitted once (after its load), b never */
    int slot = -1, pend[4];
    CHECK(loom_lora_slots_acquire(s, ea->id, &slot) == 0);
    CHECK(loom_lora_slots_pending(s, pend, 4) == 1);
    loom_lora_slots_loaded(s, pend[0], LOOM_OK, 0.25);
    CHECK(loom_lora_slots_acquire(s, ea->id, &slot) == 1);
    loom_metrics_lora_adapter_t buf[4];
    loom_metrics_lora_t ml;
    loom_lora_serve_metrics(s, NULL, buf, 4, &ml);
    CHECK(ml.max_loras == 2 && ml.resident == 1 && ml.loading == 0 && ml.loads == 1 &&
          ml.n_adapters == 2);
    CHECK(ml.load_seconds > 0.2 && ml.load_seconds < 0.3);
    CHECK(!strcmp(buf[0].name, "a") && buf[0].requests == 1 && buf[0].running == 1 &&
          buf[0].waiting == 0);
    CHECK(!strcmp(buf[1].name, "b") && buf[1].requests == 0 && buf[1].running == 0);
    loom_lora_serve_metrics(s, NULL, buf, 1, &ml); /* a short buffer: the rest left out */
    CHECK(ml.n_adapters == 1);
    loom_lora_slots_release(s, slot);
    loom_lora_serve_metrics(NULL, NULL, buf, 4, &ml);
    CHECK(ml.max_loras == 0 && ml.n_adapters == 0); /* LoRA off: nothing rendered */

    /* a runtime load validates the same way */
    uint8_t dig[32];
    int rank = 0;
    CHECK(loom_lora_serve_validate("big", big, &g_cfg, 64, dig, &rank, &err) != LOOM_OK);
    CHECK(strstr(err.msg, "big") && strstr(err.msg, "rank 128 is greater than max_lora_rank 64"));
    CHECK(loom_lora_serve_validate("big", big, &g_cfg, 128, dig, &rank, &err) == LOOM_OK &&
          rank == 128);
    loom_lora_slots_destroy(&s);

    /* a start-up adapter that does not exist ends the start-up, named */
    char missing[600];
    snprintf(missing, sizeof missing, "gone=%s/nothing", g_tmp);
    REQUIRE(loom_lora_serve_add_module(&o, missing, &err) == LOOM_OK);
    REQUIRE(loom_lora_slots_create(o.max_loras, 8, &s, &err) == LOOM_OK);
    CHECK(loom_lora_serve_register(&o, &g_cfg, s, &err) != LOOM_OK);
    CHECK(strstr(err.msg, "LoRA adapter gone") != NULL);
    loom_lora_slots_destroy(&s);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

int main(void) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/loom_test_lora_serve_XXXXXX");
    if (!mkdtemp(g_tmp)) return 2;
    loom_err_t err = {0};
    if (loom_model_config_load(LOOM_MODELS_DIR_DEFAULT "/stories260K", &g_cfg, &err) != LOOM_OK) {
        fprintf(stderr, "stories260K: %s\n", err.msg);
        return 2;
    }
    RUN(test_modules);
    RUN(test_take_args);
    RUN(test_register_and_select);
    nftw(g_tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
