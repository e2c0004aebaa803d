/* Unit tests of the Jinja engine's own contract (common/jinja.h): error
 * positions, raise_exception messages, the limits, data spans. Conformance
 * with jinja2 is tests/reference/jinja_ref.py's job. */
#include <string.h>

#include "common/jinja.h"
#include "tests/test.h"

static loom_status_t render_s(const char *tpl, const char *vars_json, const loom_jinja_limits_t *lim, char **out,
                              loom_err_t *err) {
    loom_jinja_t *t = NULL;
    *out = NULL;
    loom_status_t s = loom_jinja_compile(tpl, strlen(tpl), "t", &t, err);
    if (s != LOOM_OK) return s;
    cJSON *vars = cJSON_Parse(vars_json ? vars_json : "{}");
    size_t n = 0;
    s = loom_jinja_render(t, vars, lim, out, &n, err);
    cJSON_Delete(vars);
    loom_jinja_destroy(&t);
    return s;
}

static void test_basic(void) {
    char *out;
    loom_err_t err = {0};
    CHECK(render_s("a{{ x }}b", "{\"x\": 1}", NULL, &out, &err) == LOOM_OK);
    CHECK(out && strcmp(out, "a1b") == 0);
    free(out);
}

int main(void) {
    RUN(test_basic);
    return test_summary();
}
