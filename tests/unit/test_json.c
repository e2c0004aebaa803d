/* Strict JSON (common/json.c): trailing bytes and duplicate keys at any
 * depth, as the HTTP gateway and the model files need them refused. */
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "tests/test.h"

static cJSON *parse(const char *s, size_t *bad_at) {
    return loom_json_parse_strict(s, strlen(s), bad_at);
}

static void test_trailing(void) {
    size_t at = 0;
    cJSON *j = parse("{\"a\": 1} \n\t", &at);
    CHECK(j && at == 11);
    cJSON_Delete(j);
    CHECK(!parse("{\"a\": 1} x", &at) && at == 9);
    CHECK(!parse("{\"a\": 1}{\"a\": 2}", &at) && at == 8);
    CHECK(!parse("[1] [2]", &at) && at == 4);
    j = loom_json_parse_strict("{}\0junk", 7, &at);
    CHECK(!j && at == 2); /* an embedded NUL is not the end */
}

static void dup(const char *s, int want, const char *want_path) {
    size_t at;
    cJSON *j = parse(s, &at);
    REQUIRE(j);
    char path[64] = "unset";
    int got = loom_json_find_duplicate(j, path, sizeof path);
    CHECKF(got == want, "%s: %d", s, got);
    if (want_path) CHECKF(!strcmp(path, want_path), "%s: path %s, want %s", s, path, want_path);
    cJSON_Delete(j);
}

static void test_duplicates(void) {
    dup("{\"a\": 1, \"b\": 2}", 0, "");
    dup("{\"a\": 1, \"a\": 2}", 1, "a");
    dup("{\"a\": {\"x\": 1, \"y\": {\"z\": 0, \"z\": 0}}}", 1, "a.y.z");
    dup("{\"messages\": [{\"role\": \"user\"}, {\"role\": \"user\", \"content\": \"\", \"role\": "
        "\"system\"}]}",
        1, "messages[1].role");
    dup("[[{\"k\": 1}], [{\"k\": 1, \"k\": 1}]]", 1, "[1][0].k");
    dup("{\"a\": [1, 1, 1], \"A\": 1}", 0,
        ""); /* keys are case-sensitive; equal array items are fine */
    dup("{\"\": 1, \"\": 2}", 1, "");
    /* a large object: duplicates found by sorting, not pairwise */
    size_t n = 50000;
    char *s = malloc(n * 16 + 64);
    size_t k = 0;
    s[k++] = '{';
    for (size_t i = 0; i < n; i++)
        k += (size_t)sprintf(s + k, "%s\"k%zu\": 0", i ? ", " : "", i);
    k += (size_t)sprintf(s + k, "}");
    dup(s, 0, "");
    k--;
    k += (size_t)sprintf(s + k, ", \"k777\": 1}");
    dup(s, 1, "k777");
    free(s);
    /* a long path is cut, not overrun */
    char deep[512];
    k = 0;
    for (int i = 0; i < 40; i++)
        k += (size_t)sprintf(deep + k, "{\"abcdef\": ");
    k += (size_t)sprintf(deep + k, "{\"x\": 1, \"x\": 2}");
    for (int i = 0; i < 40; i++)
        deep[k++] = '}';
    deep[k] = '\0';
    size_t at;
    cJSON *j = parse(deep, &at);
    REQUIRE(j);
    char path[16];
    CHECK(loom_json_find_duplicate(j, path, sizeof path) == 1 && strlen(path) == sizeof path - 1);
    cJSON_Delete(j);
}

int main(void) {
    RUN(test_trailing);
    RUN(test_duplicates);
    return test_summary();
}
