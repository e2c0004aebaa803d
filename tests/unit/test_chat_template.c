/* Tests of chat templates (common/chat_template.c): where the template
 * comes from (tokenizer_config.json as a string or a named list,
 * chat_template.jinja, an override file or a shipped name), the variables a
 * render sees (vLLM's), errors (syntax at start-up with file:line:col,
 * raise_exception, limits, kwargs not an object, an untrusted request
 * template), and client special-token text kept plain through the render. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/chat_template.h"
#include "common/tokenizer.h"
#include "common/util.h"
#include "tests/test.h"

static const char *models_dir(void) {
    const char *d = getenv("LOOM_MODELS_DIR");
    return d && d[0] ? d : LOOM_MODELS_DIR_DEFAULT;
}

static loom_chat_template_t *from(const char *text, const char *config,
                                  const loom_chat_template_opts_t *o, const loom_tokenizer_t *tok) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    loom_status_t st = loom_chat_template_from_text(text, config, "t.jinja", o, tok, &t, &err);
    CHECKF(st == LOOM_OK && t, "compile: %s", err.msg);
    return t;
}

/* Renders request JSON REQ; returns the prompt (malloc'ed) or NULL with *st and err. */
static char *render(const loom_chat_template_t *t, const char *req, loom_status_t *st,
                    const char **param, loom_err_t *err) {
    cJSON *r = cJSON_Parse(req);
    char *out = NULL;
    *st = LOOM_ERR_INTERNAL;
    CHECKF(r != NULL, "bad test JSON: %s", req);
    if (!r) return NULL;
    size_t len;
    *st = loom_chat_template_render(t, r, &out, &len, NULL, NULL, param, err);
    cJSON_Delete(r);
    if (*st == LOOM_OK) CHECK(strlen(out) == len);
    return out;
}

static void expect(const loom_chat_template_t *t, const char *req, const char *want) {
    loom_status_t st;
    const char *param;
    loom_err_t err = {0};
    char *out = render(t, req, &st, &param, &err);
    CHECKF(st == LOOM_OK && out && !strcmp(out, want), "render %s: got [%s] (%s), want [%s]", req,
           out ? out : "", err.msg, want);
    free(out);
}

static void expect_err(const loom_chat_template_t *t, const char *req, loom_status_t want,
                       const char *want_param, const char *want_msg) {
    loom_status_t st;
    const char *param = NULL;
    loom_err_t err = {0};
    char *out = render(t, req, &st, &param, &err);
    CHECKF(st == want && !out, "%s: status %d, want %d", req, st, want);
    CHECKF(!want_param || (param && !strcmp(param, want_param)), "%s: param %s, want %s", req,
           param ? param : "-", want_param);
    CHECKF(strstr(err.msg, want_msg) != NULL, "%s: message [%s] lacks [%s]", req, err.msg,
           want_msg);
    free(out);
}

static void test_variables(void) {
    loom_chat_template_t *t = from(
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %} call {{ c.function.name }}({{ c.function.arguments.city "
        "}}){% endfor %}]"
        "{% endfor %}{% if tools %} tools={{ tools | length }}:{{ tools[0].function.name }}{% "
        "endif %}"
        "{% if add_generation_prompt %}>{% endif %}{% if continue_final_message %}~{% endif %}"
        "{% if enable_thinking is defined %} think={{ enable_thinking }}{% endif %}"
        "{% if reasoning_effort %} effort={{ reasoning_effort }}{% endif %}"
        "{% if documents %} docs={{ documents | length }}{% endif %}{{ eos_token }}{{ unk_token }}",
        "{\"bos_token\": {\"content\": \"<s>\", \"lstrip\": false}, \"eos_token\": \"</s>\", "
        "\"unk_token\": null}",
        NULL, NULL);
    if (!t) return;
    expect(t, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", "<s>[user:hi]></s>");
    expect(
        t,
        "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, "
        "{\"type\": \"text\", \"text\": \"b\"}]}], \"add_generation_prompt\": false}",
        "<s>[user:a\nb]</s>");
    /* arguments reach the template as an object (vLLM parses the JSON string) */
    expect(t,
           "{\"messages\": [{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": "
           "\"c\", \"type\": "
           "\"function\", \"function\": {\"name\": \"w\", \"arguments\": \"{\\\"city\\\": "
           "\\\"Oslo\\\"}\"}}]}], "
           "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"w\"}}]}",
           "<s>[assistant: call w(Oslo)] tools=1:w></s>");
    expect(t,
           "{\"messages\": [{\"role\": \"assistant\", \"content\": \"Hel\"}], "
           "\"continue_final_message\": true}",
           "<s>[assistant:Hel]~</s>");
    expect(t,
           "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": "
           "{\"enable_thinking\": "
           "false, \"bos_token\": \"B\"}, \"reasoning_effort\": \"low\", \"documents\": "
           "[{\"text\": \"d\"}]}",
           "B[user:x]> think=False effort=low docs=1</s>");
    expect_err(
        t,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": [1]}",
        LOOM_ERR_INVALID_ARGUMENT, "chat_template_kwargs", "must be an object");
    expect_err(t, "{\"messages\": []}", LOOM_ERR_INVALID_ARGUMENT, "messages", "non-empty");
    expect_err(t, "{\"messages\": [{\"content\": \"x\"}]}", LOOM_ERR_INVALID_ARGUMENT, "messages",
               "role");
    expect_err(t,
               "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": "
               "{\"name\": \"w\", "
               "\"arguments\": \"{nope\"}}]}]}",
               LOOM_ERR_INVALID_ARGUMENT, "messages", "not JSON");
    expect_err(t,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template\": \"{{ "
               "1 }}\"}",
               LOOM_ERR_INVALID_ARGUMENT, "chat_template", "--trust-request-chat-template");
    loom_chat_template_destroy(&t);
    loom_chat_template_destroy(&t); /* twice is safe */

    loom_chat_template_opts_t o = {.trust_request = 1, .max_output = 4096};
    t = from("{% if messages[0].content == 'boom' %}{{ raise_exception('No ' + messages[0].role + "
             "' here') }}{% endif %}"
             "{% if messages[0].content == 'big' %}{% for i in range(100000) %}xxxxxxxxxx{% endfor "
             "%}{% endif %}"
             "{{ messages[0].content }}",
             NULL, &o, NULL);
    if (!t) return;
    expect_err(t, "{\"messages\": [{\"role\": \"user\", \"content\": \"boom\"}]}",
               LOOM_ERR_INVALID_ARGUMENT, "messages", "No user here");
    expect_err(t, "{\"messages\": [{\"role\": \"user\", \"content\": \"big\"}]}",
               LOOM_ERR_RESOURCE_EXHAUSTED, "messages", "limit");
    expect(t,
           "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"chat_template\": \"<{{ "
           "messages[0].content }}>\"}",
           "<q>");
    expect_err(
        t,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"chat_template\": \"{{ x \"}",
        LOOM_ERR_INVALID_ARGUMENT, "chat_template", "chat_template:1:");
    loom_chat_template_destroy(&t);
}

static void test_sources(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    /* a syntax error names the file, line and column */
    CHECK(loom_chat_template_from_text("ok\n{% for m in messages %}{{ m }", NULL, "tmpl.jinja",
                                       NULL, NULL, &t, &err) == LOOM_ERR_INVALID_ARGUMENT &&
          !t);
    CHECKF(strstr(err.msg, "tmpl.jinja:2:") != NULL, "syntax error message: %s", err.msg);
    /* no template: none, no error */
    CHECK(loom_chat_template_from_text(NULL, "{\"bos_token\": \"<s>\"}", NULL, NULL, NULL, &t,
                                       &err) == LOOM_OK &&
          !t);
    /* a list: default, and tool_use when tools are given */
    t = from(NULL,
             "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T{{ tools | length "
             "}}\"}, {\"name\": "
             "\"default\", \"template\": \"D\"}]}",
             NULL, NULL);
    if (t) {
        expect(t, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", "D");
        expect(t,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
               "\"function\", "
               "\"function\": {\"name\": \"f\"}}]}",
               "T1");
        CHECK(!strcmp(loom_chat_template_text(t), "D"));
    }
    loom_chat_template_destroy(&t);
    /* a model directory: chat_template.jinja; the override wins; the shipped chatml */
    char dir[] = "/tmp/loom-test-tmpl-XXXXXX";
    REQUIRE(mkdtemp(dir));
    char path[512];
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    FILE *f = fopen(path, "w");
    REQUIRE(f);
    fputs("J{{ messages[0].content }}", f);
    fclose(f);
    REQUIRE(loom_chat_template_load(dir, NULL, NULL, &t, &err) == LOOM_OK && t);
    expect(t, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", "Jx");
    CHECK(strstr(loom_chat_template_origin(t), "chat_template.jinja") != NULL);
    loom_chat_template_destroy(&t);
    loom_chat_template_opts_t o = {.override = "chatml"};
    REQUIRE(loom_chat_template_load(dir, &o, NULL, &t, &err) == LOOM_OK && t);
    expect(
        t,
        "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", "
        "\"content\": \"hi\"}]}",
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    loom_chat_template_destroy(&t);
    o.override = "vicuna";
    CHECK(loom_chat_template_load(dir, &o, NULL, &t, &err) == LOOM_ERR_INVALID_ARGUMENT &&
          strstr(err.msg, "chatml"));
    o.override = path;
    REQUIRE(loom_chat_template_load(NULL, &o, NULL, &t, &err) == LOOM_OK && t);
    loom_chat_template_destroy(&t);
    unlink(path);
    rmdir(dir);
    /* the shipped text is docs/templates/chatml.jinja */
    char *doc = NULL;
    size_t len;
    REQUIRE(loom_read_file(LOOM_SOURCE_DIR "/docs/templates/chatml.jinja", &doc, &len, &err) ==
            LOOM_OK);
    CHECK(!strcmp(doc, loom_chat_template_shipped("chatml")));
    CHECK(loom_chat_template_shipped("llama2") == NULL);
    free(doc);
}

/* Client text that spells a special token is plain: its bytes are reported
 * as a plain span, the template's own tokens are not. */
static void test_special_tokens_plain(void) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/stories260K", models_dir());
    loom_tokenizer_t *tok = NULL;
    loom_err_t err = {0};
    if (loom_tokenizer_load(dir, &tok, &err) < 0) {
        printf("skipped: no stories260K tokenizer (%s)\n", err.msg);
        return;
    }
    loom_chat_template_t *t =
        from("{{ bos_token }}{% for m in messages %}<s>{{ m.content | trim }}</s>{% endfor %}",
             "{\"bos_token\": \"<s>\"}", NULL, tok);
    cJSON *r = cJSON_Parse(
        "{\"messages\": [{\"role\": \"user\", \"content\": \"  a</s>b<s> \\ue000 0\\ue001 \"}]}");
    char *out = NULL;
    size_t len, *plain = NULL, n_plain = 0;
    const char *param;
    REQUIRE(t && r);
    REQUIRE(loom_chat_template_render(t, r, &out, &len, &plain, &n_plain, &param, &err) == LOOM_OK);
    const char *want = "<s><s>a</s>b<s> \xEE\x80\x80 0\xEE\x80\x81</s>";
    CHECKF(!strcmp(out, want), "got [%s]", out);
    /* the client's </s>, <s> and U+E000 are plain; the template's are not */
    CHECKF(n_plain == 3 && plain[0] == 7 && plain[1] == 11 && plain[2] == 12 && plain[3] == 15 &&
               plain[4] == 16 && plain[5] == 19,
           "spans: %zu", n_plain);
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    REQUIRE(loom_tokenizer_encode_spans(tok, out, len, 0, plain, n_plain, &ids, &n_ids, &cap,
                                        &err) == LOOM_OK);
    int bos = 0, eos = 0;
    for (int i = 0; i < n_ids; i++) {
        bos += ids[i] == loom_tokenizer_bos_id(tok);
        eos += ids[i] == loom_tokenizer_eos_id(tok);
    }
    CHECKF(bos == 2 && eos == 1, "control tokens: %d BOS, %d EOS", bos, eos);
    free(ids);
    free(plain);
    free(out);
    cJSON_Delete(r);
    loom_chat_template_destroy(&t);
    loom_tokenizer_destroy(&tok);
}

/* Real templates compile (../shared/chat_templates); each renders a short chat. */
static void test_real_templates(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/../chat_templates/index.json", models_dir());
    char *idx = NULL;
    size_t len;
    loom_err_t err = {0};
    if (loom_read_file(path, &idx, &len, &err) < 0) {
        printf("skipped: no chat_templates (%s)\n", err.msg);
        return;
    }
    cJSON *all = cJSON_Parse(idx), *e;
    int n = 0;
    cJSON_ArrayForEach(e, all) {
        cJSON *f;
        cJSON_ArrayForEach(f, cJSON_GetObjectItem(e, "files")) {
            snprintf(path, sizeof path, "%s/../chat_templates/%s", models_dir(),
                     cJSON_GetObjectItem(f, "file")->valuestring);
            char *text = NULL;
            REQUIRE(loom_read_file(path, &text, &len, &err) == LOOM_OK);
            loom_chat_template_t *t = NULL;
            CHECKF(loom_chat_template_from_text(text,
                                                "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}",
                                                path, NULL, NULL, &t, &err) == LOOM_OK,
                   "%s: %s", path, err.msg);
            if (t) {
                cJSON *r = cJSON_Parse(
                    "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}, {\"role\": "
                    "\"assistant\", \"content\": \"Hi\"}, {\"role\": \"user\", \"content\": "
                    "\"Bye\"}]}");
                const cJSON *nm = cJSON_GetObjectItem(f, "name");
                if (cJSON_IsString(nm) &&
                    !strcmp(nm->valuestring, "tool_use")) /* rendered only with tools */
                    cJSON_AddItemToObject(
                        r, "tools",
                        cJSON_Parse("[{\"type\": \"function\", \"function\": {\"name\": "
                                    "\"f\", \"description\": \"d\", \"parameters\": "
                                    "{\"type\": \"object\", \"properties\": {}}}}]"));
                char *out = NULL;
                const char *param;
                CHECKF(loom_chat_template_render(t, r, &out, &len, NULL, NULL, &param, &err) ==
                               LOOM_OK &&
                           strstr(out, "Bye"),
                       "%s: %s", path, err.msg);
                free(out);
                cJSON_Delete(r);
                n++;
            }
            loom_chat_template_destroy(&t);
            free(text);
        }
    }
    printf("  %d real templates compiled and rendered\n", n);
    cJSON_Delete(all);
    free(idx);
}

int main(void) {
    RUN(test_variables);
    RUN(test_sources);
    RUN(test_special_tokens_plain);
    RUN(test_real_templates);
    return test_summary();
}
