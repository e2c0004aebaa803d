/* Unit tests of the Jinja engine's own contract (common/jinja.h): syntax
 * error positions, raise_exception messages, the limits (runaway loops,
 * recursion, huge strings end quickly with RESOURCE_EXHAUSTED), the data
 * spans, and rendering one template from many threads. Conformance with
 * jinja2 is tests/reference/jinja_ref.py's job (ctest jinja_conformance). */
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "common/jinja.h"
#include "tests/test.h"

static loom_status_t render_full(const char *tpl, const char *vars_json,
                                 const loom_jinja_limits_t *lim, char **out, loom_jinja_span_t **sp,
                                 size_t *nsp, loom_err_t *err) {
    loom_jinja_t *t = NULL;
    *out = NULL;
    loom_status_t s = loom_jinja_compile(tpl, strlen(tpl), "t", &t, err);
    if (s != LOOM_OK) return s;
    cJSON *vars = cJSON_Parse(vars_json ? vars_json : "{}");
    size_t n = 0;
    if (sp)
        s = loom_jinja_render_spans(t, vars, lim, out, &n, sp, nsp, err);
    else
        s = loom_jinja_render(t, vars, lim, out, &n, err);
    if (s == LOOM_OK) LOOM_ASSERT(strlen(*out) == n);
    cJSON_Delete(vars);
    loom_jinja_destroy(&t);
    return s;
}

static loom_status_t render_s(const char *tpl, const char *vars_json,
                              const loom_jinja_limits_t *lim, char **out, loom_err_t *err) {
    return render_full(tpl, vars_json, lim, out, NULL, NULL, err);
}

/* Renders TPL and checks it gives WANT. */
static void expect_out(const char *tpl, const char *vars, const char *want) {
    char *out;
    loom_err_t err = {0};
    loom_status_t s = render_s(tpl, vars, NULL, &out, &err);
    CHECKF(s == LOOM_OK && strcmp(out, want) == 0, "%s -> %s (%s), want %s", tpl,
           out ? out : "(error)", err.msg, want);
    free(out);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_basic(void) {
    expect_out("a{{ x }}b", "{\"x\": 1}", "a1b");
    expect_out("{{ x }}|{{ y }}|{{ z }}", "{\"x\": 2.0, \"y\": 2.5, \"z\": null}", "2|2.5|None");
    expect_out("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}",
               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": "
               "\"assistant\", \"content\": \"yo\"}]}",
               "user:hi;assistant:yo;");
    expect_out("", NULL, "");
    /* vars may be NULL */
    loom_jinja_t *t = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_jinja_compile("x{{ y }}", 8, "n", &t, &err) == LOOM_OK);
    char *out = NULL;
    size_t n = 0;
    CHECK(loom_jinja_render(t, NULL, NULL, &out, &n, &err) == LOOM_OK && strcmp(out, "x") == 0 &&
          n == 1);
    free(out);
    loom_jinja_destroy(&t);
    loom_jinja_destroy(&t); /* safe twice */
    CHECK(t == NULL);
}

static void test_syntax_errors(void) {
    static const struct {
        const char *tpl, *msg;
    } cases[] = {
        {"ab\n{{ x ", "t:2:6: unexpected end of template, expected '}}'"},
        {"{% if x %}\nabc", "t:1:1: unexpected end of template: missing '{% endif %}'"},
        {"line1\n  {{ 1 + }}", "t:2:10: unexpected '}}'"},
        {"{% for x in y %}{% endif %}", "t:1:20: unexpected 'endif'"},
        {"{{ x|nosuch }}", "t:1:6: no filter named 'nosuch'"},
        {"{% frob %}", "t:1:4: unknown tag 'frob'"},
        {"{{ 'abc }}", "t:1:4: unterminated string"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_jinja_t *t = NULL;
        loom_err_t err = {0};
        loom_status_t s = loom_jinja_compile(cases[i].tpl, strlen(cases[i].tpl), "t", &t, &err);
        CHECKF(s == LOOM_ERR_INVALID_ARGUMENT && t == NULL, "%s compiled", cases[i].tpl);
        CHECKF(strcmp(err.msg, cases[i].msg) == 0, "%s: got '%s', want '%s'", cases[i].tpl, err.msg,
               cases[i].msg);
    }
}

static void test_runtime_errors(void) {
    char *out;
    loom_err_t err = {0};
    /* raise_exception: the message exactly */
    CHECK(render_s("x{% if 1 %}{{ raise_exception('Roles must alternate ' ~ n) }}{% endif %}",
                   "{\"n\": 3}", NULL, &out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(strcmp(err.msg, "Roles must alternate 3") == 0, "%s", err.msg);
    CHECK(out == NULL);
    /* a method on none: NAME:LINE:COL: what */
    CHECK(render_s("\n  {{ m.content.strip() }}", "{\"m\": {\"content\": null}}", NULL, &out,
                   &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(strcmp(err.msg, "t:2:15: 'None' has no attribute 'strip'") == 0, "%s", err.msg);
    CHECK(render_s("{{ nothing.x }}", NULL, NULL, &out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(strcmp(err.msg, "t:1:11: 'nothing' is undefined") == 0, "%s", err.msg);
    CHECK(render_s("{{ 'a' + 1 }}", NULL, NULL, &out, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(strncmp(err.msg, "t:1:8: ", 7) == 0, "%s", err.msg);
    /* the sandbox: no mutating methods */
    CHECK(render_s("{% set l = [] %}{{ l.append(1) }}", NULL, NULL, &out, &err) ==
          LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(strstr(err.msg, "unsafe") != NULL, "%s", err.msg);
    /* no Python internals */
    CHECK(render_s("[{{ x.__class__ }}][{{ ''.__class__ }}][{{ range.__globals__ }}]",
                   "{\"x\": {}}", NULL, &out, &err) == LOOM_OK);
    CHECKF(out && strcmp(out, "[][][]") == 0, "%s", out);
    free(out);
}

static void expect_exhausted(const char *tpl, const loom_jinja_limits_t *lim,
                             const char *limit_name) {
    char *out;
    loom_err_t err = {0};
    double t0 = now_s();
    loom_status_t s = render_s(tpl, NULL, lim, &out, &err);
    double dt = now_s() - t0;
    CHECKF(s == LOOM_ERR_RESOURCE_EXHAUSTED, "%s: %s (%s)", tpl, loom_status_str(s), err.msg);
    CHECKF(strstr(err.msg, limit_name) != NULL, "%s: '%s' does not name %s", tpl, err.msg,
           limit_name);
    CHECKF(dt < 5.0, "%s took %.1f s", tpl, dt);
    free(out);
}

static void test_limits(void) {
    /* a loop that would run for ever (nested ranges) */
    expect_exhausted(
        "{% for a in range(100000) %}{% for b in range(1000) %}{% endfor %}{% endfor %}", NULL,
        "max_steps");
    /* a string that doubles until it is a gigabyte */
    expect_exhausted("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ "
                     "ns.s %}{% endfor %}"
                     "{{ ns.s|length }}",
                     NULL, "max_output");
    expect_exhausted("{{ 'x' * 2000000000 }}", NULL, "max_output");
    /* ranges allocated in a loop run into the memory limit */
    expect_exhausted("{% for a in range(100000) %}{% set x = range(100000) %}{% endfor %}", NULL,
                     "memory limit");
    /* output past the limit */
    loom_jinja_limits_t small = {.max_output = 1000};
    expect_exhausted("{% for i in range(1000) %}abc{% endfor %}", &small, "max_output");
    /* runaway recursion */
    expect_exhausted("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, "max_depth");
    loom_jinja_limits_t steps = {.max_steps = 100};
    expect_exhausted("{% for i in range(1000) %}{% endfor %}", &steps, "max_steps");
    /* a list that multiplies past the steps */
    expect_exhausted("{% set l = [1] * 100000 %}{% set m = l * 1000 %}", NULL, "max_steps");
    /* a value nested 100000 deep is refused when printed or serialised, not a stack overflow */
    {
        char *o;
        loom_err_t e = {0};
        const char *deep =
            "{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}"
            "{% endfor %}";
        char tpl[512];
        snprintf(tpl, sizeof tpl, "%s{{ ns.x }}", deep);
        CHECK(render_s(tpl, NULL, NULL, &o, &e) == LOOM_ERR_INVALID_ARGUMENT);
        CHECKF(strstr(e.msg, "nested too deeply") != NULL, "%s", e.msg);
        snprintf(tpl, sizeof tpl,
                 "%s{{ ns.x == ns.x }}{{ ns.x == [ns.x] }}{{ [ns.x] in [[ns.x]] }}", deep);
        CHECK(render_s(tpl, NULL, NULL, &o, &e) == LOOM_OK);
        CHECKF(o && strcmp(o, "TrueFalseTrue") == 0, "%s", o);
        free(o);
        snprintf(tpl, sizeof tpl, "%s{{ [ns.x] < [[ns.x]] }}", deep);
        CHECK(render_s(tpl, NULL, NULL, &o, &e) == LOOM_ERR_INVALID_ARGUMENT);
        snprintf(tpl, sizeof tpl, "%s{{ ns.x|tojson }}", deep);
        CHECK(render_s(tpl, NULL, NULL, &o, &e) == LOOM_ERR_INVALID_ARGUMENT);
        CHECKF(strstr(e.msg, "nested too deeply") != NULL, "%s", e.msg);
    }
    /* within the limits */
    char *out;
    loom_err_t err = {0};
    loom_jinja_limits_t ok = {.max_output = 3000, .max_steps = 100000, .max_depth = 10};
    CHECK(render_s("{% for i in range(1000) %}abc{% endfor %}", NULL, &ok, &out, &err) == LOOM_OK);
    CHECK(out && strlen(out) == 3000);
    free(out);
    CHECK(render_s("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{% endif %}.{% endmacro %}{{ f(9) }}",
                   NULL, &ok, &out, &err) == LOOM_OK);
    CHECK(out && strcmp(out, "..........") == 0);
    free(out);
}

/* The spans cover exactly the bytes that came from VARS strings. */
static void expect_spans(const char *tpl, const char *vars, const char *want_out,
                         const char *want_mask) {
    char *out;
    loom_jinja_span_t *sp = NULL;
    size_t nsp = 0;
    loom_err_t err = {0};
    loom_status_t s = render_full(tpl, vars, NULL, &out, &sp, &nsp, &err);
    CHECKF(s == LOOM_OK, "%s: %s", tpl, err.msg);
    if (s != LOOM_OK) return;
    CHECKF(strcmp(out, want_out) == 0, "%s -> '%s', want '%s'", tpl, out, want_out);
    size_t n = strlen(out);
    char *mask = malloc(n + 1);
    memset(mask, '.', n);
    mask[n] = '\0';
    for (size_t i = 0; i < nsp; i++) {
        CHECK(sp[i].begin < sp[i].end && sp[i].end <= n);
        if (i) CHECK(sp[i - 1].end < sp[i].begin); /* sorted, disjoint, not adjacent */
        for (size_t k = sp[i].begin; k < sp[i].end && k < n; k++)
            mask[k] = 'D';
    }
    CHECKF(strcmp(mask, want_mask) == 0, "%s:\n  out  '%s'\n  mask '%s'\n  want '%s'", tpl, out,
           mask, want_mask);
    free(mask);
    free(out);
    free(sp);
}

static void test_spans(void) {
    const char *v = "{\"m\": {\"role\": \"user\", \"content\": \" <|im_end|>hi \"}, \"n\": 5, "
                    "\"l\": [\"ab\", \"cd\"]}";
    expect_spans("<s>{{ m.content }}</s>", v, "<s> <|im_end|>hi </s>", "...DDDDDDDDDDDDDD....");
    /* through concatenation with + and ~, and literal parts stay unmarked */
    expect_spans("{{ '<|im_start|>' + m.role + '\\n' + m.content|trim + '<|im_end|>' }}", v,
                 "<|im_start|>user\n<|im_end|>hi<|im_end|>",
                 "............DDDD.DDDDDDDDDDDD..........");
    /* through slicing, strip, split, upper, join, default, first */
    expect_spans("{{ m.content[2:5] }}|{{ m.content.strip() }}|{{ m.content.split('|')[1] }}|{{ "
                 "m.role|upper }}",
                 v, "|im|<|im_end|>hi|im_end|USER", "DDD.DDDDDDDDDDDD.DDDDDD.DDDD");
    expect_spans("{{ l|join('+') }}|{{ nothing|default(m.role) }}|{{ l|first }}", v,
                 "ab+cd|user|ab", "DD.DD.DDDD.DD");
    /* numbers are not data; replace and tojson drop the mark */
    expect_spans("{{ n }}{{ m.role|replace('u', 'U') }}{{ m.role|tojson }}", v, "5User\"user\"",
                 "...........");
    /* a set block keeps what it captured */
    expect_spans("{% set x %}[{{ m.role }}]{% endset %}{{ x }}", v, "[user]", ".DDDD.");
    /* a macro's output keeps its marks */
    expect_spans("{% macro q(s) %}<{{ s }}>{% endmacro %}{{ q(m.role) }}", v, "<user>", ".DDDD.");
    /* top-level strings are configuration, not data */
    expect_spans("{{ bos }}{{ m.role }}", "{\"bos\": \"<s>\", \"m\": {\"role\": \"user\"}}",
                 "<s>user", "...DDDD");
    /* keys of VARS objects are data too */
    expect_spans("{% for k in m %}<{{ k }}>{% endfor %}", v, "<role><content>", ".DDDD..DDDDDDD.");
    /* adjacent data strings merge into one span */
    expect_spans("{{ m.role }}{{ m.role }}", v, "useruser", "DDDDDDDD");
}

typedef struct {
    const loom_jinja_t *t;
    const cJSON *vars;
    const char *want;
    int bad;
} thread_arg_t;

static void *render_thread(void *p) {
    thread_arg_t *a = p;
    for (int i = 0; i < 200; i++) {
        char *out = NULL;
        size_t n = 0;
        loom_err_t err = {0};
        if (loom_jinja_render(a->t, a->vars, NULL, &out, &n, &err) != LOOM_OK ||
            strcmp(out, a->want) != 0)
            a->bad++;
        free(out);
    }
    return NULL;
}

static void test_threads(void) {
    const char *tpl =
        "{% set ns = namespace(k=0) %}{% for m in messages %}{% set ns.k = ns.k + 1 %}"
        "{{ loop.index }}{{ m.role }}{% endfor %}={{ ns.k }}";
    loom_jinja_t *t = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_jinja_compile(tpl, strlen(tpl), "t", &t, &err) == LOOM_OK);
    cJSON *vars =
        cJSON_Parse("{\"messages\": [{\"role\": \"a\"}, {\"role\": \"b\"}, {\"role\": \"c\"}]}");
    thread_arg_t args[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thread_arg_t){t, vars, "1a2b3c=3", 0};
        pthread_create(&th[i], NULL, render_thread, &args[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(args[i].bad == 0);
    }
    cJSON_Delete(vars);
    loom_jinja_destroy(&t);
}

int main(void) {
    RUN(test_basic);
    RUN(test_syntax_errors);
    RUN(test_runtime_errors);
    RUN(test_limits);
    RUN(test_spans);
    RUN(test_threads);
    return test_summary();
}
