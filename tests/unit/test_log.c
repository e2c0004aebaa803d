/* Log lines in both formats (common/log.c): fields, escaping, the request
 * id, truncation of long messages; and the constant-time key compare. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/util.h"

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

static const char *str_field(const cJSON *o, const char *k) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(x) ? x->valuestring : NULL;
}

static void test_json_line(void) {
    char line[4096];
    const char *msg = "a \"quoted\" back\\slash, tab\t, newline\n, bell\x07 and caf\xc3\xa9";
    loom_log_format_line(line, sizeof line, LOOM_LOG_JSON, "2026-01-02T03:04:05.678Z", LOOM_LOG_WARN, "worker w-1",
                         "req-\"7\"", msg);
    EXPECT(!strchr(line, '\n'), "a JSON line holds no raw newline: %s", line);
    cJSON *o = cJSON_Parse(line);
    EXPECT(o != NULL, "not JSON: %s", line);
    if (!o) return;
    EXPECT(str_field(o, "ts") && !strcmp(str_field(o, "ts"), "2026-01-02T03:04:05.678Z"), "ts in %s", line);
    EXPECT(str_field(o, "level") && !strcmp(str_field(o, "level"), "warn"), "level in %s", line);
    EXPECT(str_field(o, "component") && !strcmp(str_field(o, "component"), "worker w-1"), "component in %s", line);
    EXPECT(str_field(o, "msg") && !strcmp(str_field(o, "msg"), msg), "msg round trip in %s", line);
    EXPECT(str_field(o, "request_id") && !strcmp(str_field(o, "request_id"), "req-\"7\""), "request_id in %s", line);
    cJSON_Delete(o);

    loom_log_format_line(line, sizeof line, LOOM_LOG_JSON, "2026-01-02T03:04:05.678Z", LOOM_LOG_INFO, "coordinator",
                         NULL, "plain");
    o = cJSON_Parse(line);
    EXPECT(o && !cJSON_GetObjectItemCaseSensitive(o, "request_id"), "no request_id when none: %s", line);
    cJSON_Delete(o);

    /* a message longer than the line: cut, and still one whole JSON object */
    char big[3000];
    memset(big, '"', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    char small[512];
    loom_log_format_line(small, sizeof small, LOOM_LOG_JSON, "2026-01-02T03:04:05.678Z", LOOM_LOG_ERROR, "c", "r1",
                         big);
    o = cJSON_Parse(small);
    EXPECT(o != NULL, "a cut line is still JSON: %s", small);
    EXPECT(o && str_field(o, "request_id") && !strcmp(str_field(o, "request_id"), "r1"), "request_id kept: %s",
           small);
    cJSON_Delete(o);
}

static void test_text_line(void) {
    char line[512];
    loom_log_format_line(line, sizeof line, LOOM_LOG_TEXT, "2026-01-02T03:04:05.678Z", LOOM_LOG_INFO, "coordinator",
                         "abc-1", "hello");
    EXPECT(!strcmp(line, "03:04:05.678 INFO  coordinator [abc-1]: hello"), "text line: '%s'", line);
    loom_log_format_line(line, sizeof line, LOOM_LOG_TEXT, "2026-01-02T03:04:05.678Z", LOOM_LOG_ERROR, "worker",
                         "", "bye");
    EXPECT(!strcmp(line, "03:04:05.678 ERROR worker: bye"), "text line without id: '%s'", line);
}

static void test_format_names(void) {
    EXPECT(loom_log_set_format_name("json") == 0, "json accepted");
    EXPECT(loom_log_set_format_name("text") == 0, "text accepted");
    EXPECT(loom_log_set_format_name("xml") < 0, "xml refused");
    EXPECT(loom_log_set_format_name(NULL) < 0, "NULL refused");
}

static void test_secret_equal(void) {
    const char *k = "sk-secret-key";
    size_t n = strlen(k);
    EXPECT(loom_secret_equal(k, n, "sk-secret-key", n), "equal");
    EXPECT(!loom_secret_equal(k, n, "sk-secret-kex", n), "last byte differs");
    EXPECT(!loom_secret_equal(k, n, "Sk-secret-key", n), "first byte differs");
    EXPECT(!loom_secret_equal(k, n, "sk-secret-ke", n - 1), "a prefix");
    EXPECT(!loom_secret_equal(k, n, "sk-secret-keyy", n + 1), "longer");
    EXPECT(!loom_secret_equal(k, n, "", 0), "empty given");
    EXPECT(!loom_secret_equal(k, n, "sk-secret-key\0", n + 1), "a trailing NUL is a difference");
    EXPECT(loom_secret_equal("", 0, "", 0), "both empty");
    EXPECT(!loom_secret_equal("", 0, "x", 1), "empty secret, something given");
}

int main(void) {
    test_json_line();
    test_text_line();
    test_format_names();
    test_secret_equal();
    if (failures) {
        fprintf(stderr, "test_log: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_log: ok\n");
    return 0;
}
