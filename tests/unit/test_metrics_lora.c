/* Tests for the LoRA metrics: loom_lora_* and vLLM's vllm:lora_requests_info
 * rendered only with adapters enabled, their values, label escaping, and the
 * adapter list copied in (the caller's array may change afterwards). */
#include <stdlib.h>
#include <string.h>

#include "coordinator/metrics.h"
#include "tests/test.h"

static char *render(loom_metrics_t *m) {
    size_t len = 0;
    char *text = loom_metrics_render(m, &len);
    CHECK(text != NULL && strlen(text) == len);
    return text ? text : calloc(1, 1);
}

static void test_off_by_default(void) {
    loom_metrics_t *m = loom_metrics_create("base", 1, 2048);
    char *text = render(m);
    CHECK(!strstr(text, "loom_lora_"));
    CHECK(!strstr(text, "vllm:lora_requests_info"));
    free(text);
    loom_metrics_destroy(&m);
    loom_metrics_destroy(&m); /* safe twice */
}

static void test_values(void) {
    loom_metrics_t *m = loom_metrics_create("base", 1, 2048);
    loom_metrics_lora_adapter_t ad[3] = {
        {.name = "a", .requests = 5, .running = 2, .waiting = 0},
        {.name = "b\"x", .requests = 1, .running = 0, .waiting = 3},
        {.name = "c", .requests = 7, .running = 1, .waiting = 1},
    };
    loom_metrics_lora_t l = {.max_loras = 2,
                             .resident = 2,
                             .loading = 0,
                             .loads = 4,
                             .evictions = 2,
                             .load_failures = 1,
                             .load_seconds = 0.5,
                             .n_adapters = 3,
                             .adapters = ad};
    loom_metrics_set_lora(m, &l);
    strcpy(ad[0].name, "changed"); /* copied: the render must not see this */
    char *text = render(m);
    CHECK(strstr(text, "loom_lora_max_adapters{model_name=\"base\"} 2\n") != NULL);
    CHECK(strstr(text, "loom_lora_resident_adapters{model_name=\"base\"} 2\n") != NULL);
    CHECK(strstr(text, "loom_lora_loading_adapters{model_name=\"base\"} 0\n") != NULL);
    CHECK(strstr(text, "loom_lora_registered_adapters{model_name=\"base\"} 3\n") != NULL);
    CHECK(strstr(text, "loom_lora_loads_total{model_name=\"base\"} 4\n") != NULL);
    CHECK(strstr(text, "loom_lora_evictions_total{model_name=\"base\"} 2\n") != NULL);
    CHECK(strstr(text, "loom_lora_load_failures_total{model_name=\"base\"} 1\n") != NULL);
    CHECK(strstr(text, "loom_lora_load_seconds_total{model_name=\"base\"} 0.5\n") != NULL);
    CHECK(strstr(text, "# TYPE loom_lora_requests_total counter\n") != NULL);
    CHECK(strstr(text, "loom_lora_requests_total{model_name=\"base\",lora_name=\"a\"} 5\n") !=
          NULL);
    CHECK(strstr(text, "loom_lora_requests_total{model_name=\"base\",lora_name=\"b\\\"x\"} 1\n") !=
          NULL);
    CHECK(strstr(text, "loom_lora_requests_running{model_name=\"base\",lora_name=\"c\"} 1\n") !=
          NULL);
    CHECK(
        strstr(text, "loom_lora_requests_waiting{model_name=\"base\",lora_name=\"b\\\"x\"} 3\n") !=
        NULL);
    CHECK(!strstr(text, "changed"));
    CHECK(strstr(text, "# TYPE vllm:lora_requests_info gauge\n") != NULL);
    const char *info = "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a,c\","
                       "waiting_lora_adapters=\"b\\\"x,c\"} ";
    const char *p = strstr(text, info);
    CHECK(p != NULL);
    if (p) CHECK(strtod(p + strlen(info), NULL) > 1.6e9); /* a Unix time */
    free(text);

    /* fewer adapters, none running: empty label values */
    ad[0] = (loom_metrics_lora_adapter_t){.name = "a", .requests = 5};
    l.n_adapters = 1;
    loom_metrics_set_lora(m, &l);
    text = render(m);
    CHECK(strstr(text, "running_lora_adapters=\"\",waiting_lora_adapters=\"\"} ") != NULL);
    CHECK(!strstr(text, "lora_name=\"c\""));
    free(text);

    /* LoRA turned off again: nothing rendered */
    l = (loom_metrics_lora_t){0};
    loom_metrics_set_lora(m, &l);
    text = render(m);
    CHECK(!strstr(text, "loom_lora_"));
    free(text);
    loom_metrics_destroy(&m);
}

int main(void) {
    RUN(test_off_by_default);
    RUN(test_values);
    return test_summary();
}
