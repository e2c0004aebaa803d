/* Command-line plumbing in common/: option parsing with vLLM's forms
 * (-tp, refused vLLM flags), host:port addresses, generation_config.json
 * defaults, the CPU instruction-set check with its test override, and the
 * text of progress lines. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/cpu_check.h"
#include "common/endpoint.h"
#include "common/gen_defaults.h"
#include "common/progress.h"
#include "common/util.h"
#include "common/vllm_flags.h"

static int failures;

#define EXPECT(cond, ...)                                                      \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: FAILED: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, "\n");                                             \
            failures++;                                                        \
        }                                                                      \
    } while (0)

static void test_parse(void) {
    int tp = 1, pp = 1, flag = 0;
    const char *name = NULL;
    loom_opt_t opts[] = {
        {"tensor-parallel-size", LOOM_OPT_INT, &tp, "N", "", 1, 64, NULL},
        {"tp", LOOM_OPT_INT, &tp, "N", "", 1, 64, NULL},
        {"pp", LOOM_OPT_INT, &pp, "N", "", 1, 64, NULL},
        {"name", LOOM_OPT_STR, &name, "S", "", 1, 0, NULL},
        {"enable-prefix-caching", LOOM_OPT_FLAG, &flag, NULL, "", 1, 0, NULL},
    };
    char *a1[] = {"x", "-tp", "4", "--pp=2", "--name", "-v", "--enable-prefix-caching", NULL};
    EXPECT(loom_cli_parse_vllm(7, a1, 1, opts, 5, "u", "d") == 0, "single-dash long names parse");
    EXPECT(tp == 4 && pp == 2 && flag == 1, "tp %d pp %d flag %d", tp, pp, flag);
    EXPECT(name && !strcmp(name, "-v"), "a value may start with a dash: %s", name ? name : "(null)");
    char *a2[] = {"x", "--tensor-parallel-size", "3", NULL};
    EXPECT(loom_cli_parse(3, a2, 1, opts, 5, "u", "d") == 0 && tp == 3, "the long form, tp %d", tp);
    char *a3[] = {"x", "--gpu-memory-utilization", "0.9", NULL};
    EXPECT(loom_cli_parse_vllm(3, a3, 1, opts, 5, "u", "d") == -1, "an unimplemented vLLM flag is refused");
    char *a4[] = {"x", "-tp", "0", NULL};
    EXPECT(loom_cli_parse_vllm(3, a4, 1, opts, 5, "u", "d") == -1, "range checks apply to -tp");
    char *a5[] = {"x", "positional", NULL};
    EXPECT(loom_cli_parse(2, a5, 1, opts, 5, "u", "d") == -1, "positionals are refused");
    char *a6[] = {"x", "-", NULL};
    EXPECT(loom_cli_parse(2, a6, 1, opts, 5, "u", "d") == -1, "a lone dash is refused");
    EXPECT(loom_vllm_flag_known("gpu-memory-utilization", 22), "vLLM's list has gpu-memory-utilization");
    EXPECT(loom_vllm_flag_known("tp", 2) && !loom_vllm_flag_known("frobnicate", 10), "vLLM's list");
}

static void test_endpoint(void) {
    char out[64];
    EXPECT(loom_endpoint_normalize("127.0.0.1:5555", out, sizeof out) == 0 && !strcmp(out, "tcp://127.0.0.1:5555"),
           "%s", out);
    EXPECT(loom_endpoint_normalize("tcp://h:1", out, sizeof out) == 0 && !strcmp(out, "tcp://h:1"), "%s", out);
    EXPECT(loom_endpoint_normalize("ipc:///tmp/x", out, sizeof out) == 0 && !strcmp(out, "ipc:///tmp/x"), "%s", out);
    EXPECT(loom_endpoint_normalize("", out, sizeof out) == -1 && !out[0], "empty is refused");
    char small[8];
    EXPECT(loom_endpoint_normalize("127.0.0.1:5555", small, sizeof small) == -1 && !small[0], "too long is refused");
}

static void write_gen(const char *dir, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
}

static void test_gen_defaults(void) {
    char dir[] = "/tmp/loom-test-gen-XXXXXX";
    EXPECT(mkdtemp(dir) != NULL, "mkdtemp");
    loom_gen_defaults_t g;
    loom_err_t err = {0};
    EXPECT(loom_gen_defaults_load(dir, &g, &err) == LOOM_OK && !g.has_temperature && !g.has_max_tokens,
           "no file: no defaults");
    write_gen(dir, "{\"temperature\":0.6,\"top_p\":0.9,\"top_k\":20,\"max_new_tokens\":7,\"repetition_penalty\":1.1,"
                   "\"eos_token_id\":[1,2]}");
    EXPECT(loom_gen_defaults_load(dir, &g, &err) == LOOM_OK, "%s", err.msg);
    EXPECT(g.has_temperature && g.temperature > 0.59f && g.temperature < 0.61f, "temperature %g", g.temperature);
    EXPECT(g.has_top_p && g.top_p > 0.89f && g.top_p < 0.91f, "top_p %g", g.top_p);
    EXPECT(g.has_top_k && g.top_k == 20 && g.has_max_tokens && g.max_tokens == 7, "top_k %d max %d", g.top_k,
           g.max_tokens);
    EXPECT(strstr(g.ignored, "repetition_penalty") != NULL, "ignored: %s", g.ignored);
    write_gen(dir, "{\"do_sample\":false,\"temperature\":0.7}");
    EXPECT(loom_gen_defaults_load(dir, &g, &err) == LOOM_OK && g.has_temperature && g.temperature == 0.0f,
           "do_sample false is greedy: %g", g.temperature);
    write_gen(dir, "{\"temperature\":7}");
    EXPECT(loom_gen_defaults_load(dir, &g, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "temperature"), "%s", err.msg);
    write_gen(dir, "{\"temperature\":");
    EXPECT(loom_gen_defaults_load(dir, &g, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "not valid JSON"), "%s",
           err.msg);
    char path[512];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    unlink(path);
    rmdir(dir);
}

static void test_cpu_check(void) {
    const char *need = loom_cpu_build_features();
    char missing[512];
    unsetenv("LOOM_CPU_PRETEND_MISSING");
    EXPECT(loom_cpu_missing_features(missing, sizeof missing) == 0, "this build runs here, yet lacks: %s", missing);
    int n_need = 0;
    for (const char *p = need; *p; p++) n_need += (p == need || p[-1] == ' ') && *p != ' ';
    setenv("LOOM_CPU_PRETEND_MISSING", "all", 1);
    EXPECT(loom_cpu_missing_features(missing, sizeof missing) == n_need, "all of '%s' pretended missing: '%s'", need,
           missing);
    if (strstr(need, "avx2")) {
        setenv("LOOM_CPU_PRETEND_MISSING", "fma,avx2", 1);
        int n = loom_cpu_missing_features(missing, sizeof missing);
        EXPECT(n == 1 + (strstr(need, "fma") != NULL) && strstr(missing, "avx2"), "%d: %s", n, missing);
    } else {
        printf("test_cli: this build does not use AVX2 (features: '%s'); the avx2 case is skipped\n", need);
    }
    unsetenv("LOOM_CPU_PRETEND_MISSING");
    printf("test_cli: the build requires: %s\n", need[0] ? need : "(the baseline ISA)");
}

static void test_progress(void) {
    char line[256];
    loom_progress_format(line, sizeof line, "loading", 25000000, 100000000, 2.0, 0);
    EXPECT(!strcmp(line, "loading: 25.0 of ~100.0 MB (25%), 2.0 s, 12.5 MB/s"), "%s", line);
    loom_progress_format(line, sizeof line, "loading", 120000000, 100000000, 4.0, 0);
    EXPECT(strstr(line, "(99%)") != NULL, "an over-run estimate stays below 100%% until done: %s", line);
    loom_progress_format(line, sizeof line, "loading", 120000000, 100000000, 4.0, 1);
    EXPECT(!strcmp(line, "loading: 120.0 of 120.0 MB (100%), 4.0 s, 30.0 MB/s"), "final: %s", line);
    loom_progress_format(line, sizeof line, "reading", 5000000, 0, 1.0, 0);
    EXPECT(!strcmp(line, "reading: 5.0 MB, 1.0 s, 5.0 MB/s"), "no total: %s", line);
}

int main(void) {
    test_progress();
    test_parse();
    test_endpoint();
    test_gen_defaults();
    test_cpu_check();
    if (failures) {
        fprintf(stderr, "test_cli: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_cli: ok\n");
    return 0;
}
