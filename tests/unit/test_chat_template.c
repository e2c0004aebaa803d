/* Chat templates: detection on real template texts, and each family's
 * rendering against strings written by hand from its Jinja template. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/chat_template.h"
#include "tests/test.h"

/* Real templates as they read after JSON decoding of tokenizer_config.json
 * (the Jinja source keeps "\n" inside string literals as backslash + n). */
static const char *k_llama2 =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif "
    "%}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if "
    "message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] "
    "== 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";

static const char *k_llama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

static const char *k_qwen2 =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/* Qwen2.5: the default system turn sits in the branch without tools. */
static const char *k_qwen25 =
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n        "
    "{{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.' }}\n    {%- endif %}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        "
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- "
    "'<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n   "
    " {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>' + '\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- "
    "'<|im_start|>assistant\\n' }}\n{%- endif %}\n";

static const char *k_chatml =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

static const char *k_mistral =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles "
    "are supported!') }}{% endif %}{% endfor %}";

static const char *k_gemma =
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% "
    "endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "(message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif "
    "%}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if "
    "add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}";

/* Gemma 3's template: a leading system message goes into the first user turn. */
static const char *k_gemma3 =
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- endif -%}\n    {%- set "
    "loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n    {%- set "
    "loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n    {%- if (message['role'] == "
    "'assistant') -%}\n        {%- set role = \"model\" -%}\n    {%- else -%}\n        {%- set role = message['role'] "
    "-%}\n    {%- endif -%}\n    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{ message['content'] | trim }}\n    {{ '<end_of_turn>\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt "
    "-%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n";

/* Qwen3's template, cut to the parts that identify it: ChatML with <think> handling. */
static const char *k_qwen3 =
    "{%- for message in messages %}{%- if message.role == \"user\" or message.role == \"system\" %}{{- "
    "'<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == "
    "\"assistant\" %}{%- set content = message.content %}{%- if '</think>' in content %}{%- set content = "
    "content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- if loop.index0 > ns.last_query_index %}{{- "
    "'<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}{{- "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- "
    "endif %}{%- endif %}";

static const char *k_phi3 =
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif "
    "message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor "
    "%}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}";

/* A family Loom does not render (Alpaca-style headers). */
static const char *k_alpaca =
    "{{ bos_token }}{% for message in messages %}{{ '### ' + message['role'] + ':\\n' + message['content'] | trim + "
    "'\\n\\n' }}{% endfor %}";

static char *render(const loom_chat_template_t *t, const loom_chat_msg_t *m, int n, int gen) {
    char *out = NULL;
    size_t len = 0;
    loom_err_t err = {0};
    if (loom_chat_render(t, m, n, gen, &out, &len, &err) < 0) {
        fprintf(stderr, "  render failed: %s\n", err.msg);
        return NULL;
    }
    if (strlen(out) != len) fprintf(stderr, "  length %zu != strlen %zu\n", len, strlen(out));
    return out;
}

#define CHECK_RENDER(t, msgs, gen, want)                                                           \
    do {                                                                                           \
        char *got_ = render((t), (msgs), (int)(sizeof(msgs) / sizeof((msgs)[0])), (gen));          \
        CHECKF(got_ && !strcmp(got_, (want)), "\n  got  [%s]\n  want [%s]", got_ ? got_ : "(null)", \
               (want));                                                                            \
        free(got_);                                                                                \
    } while (0)

static void test_detect(void) {
    CHECK(loom_chat_detect(k_llama2) == LOOM_CHAT_LLAMA2);
    CHECK(loom_chat_detect(k_llama3) == LOOM_CHAT_LLAMA3);
    CHECK(loom_chat_detect(k_qwen2) == LOOM_CHAT_CHATML);
    CHECK(loom_chat_detect(k_qwen25) == LOOM_CHAT_CHATML);
    CHECK(loom_chat_detect(k_chatml) == LOOM_CHAT_CHATML);
    CHECK(loom_chat_detect(k_mistral) == LOOM_CHAT_MISTRAL);
    CHECK(loom_chat_detect(k_gemma) == LOOM_CHAT_GEMMA);
    CHECK(loom_chat_detect(k_gemma3) == LOOM_CHAT_GEMMA);
    CHECK(loom_chat_detect(k_qwen3) == LOOM_CHAT_QWEN3);
    CHECK(loom_chat_detect(k_phi3) == LOOM_CHAT_PHI3);
    CHECK(loom_chat_detect(k_alpaca) == LOOM_CHAT_NONE);
    CHECK(loom_chat_detect("") == LOOM_CHAT_NONE);
    CHECK(loom_chat_detect(NULL) == LOOM_CHAT_NONE);
    CHECK(loom_chat_family_from_name("llama2") == LOOM_CHAT_LLAMA2);
    CHECK(loom_chat_family_from_name("llama3") == LOOM_CHAT_LLAMA3);
    CHECK(loom_chat_family_from_name("chatml") == LOOM_CHAT_CHATML);
    CHECK(loom_chat_family_from_name("mistral") == LOOM_CHAT_MISTRAL);
    CHECK(loom_chat_family_from_name("gemma") == LOOM_CHAT_GEMMA);
    CHECK(loom_chat_family_from_name("qwen3") == LOOM_CHAT_QWEN3);
    CHECK(loom_chat_family_from_name("phi3") == LOOM_CHAT_PHI3);
    CHECK(loom_chat_family_from_name("vicuna") == LOOM_CHAT_NONE);
    CHECK(!strcmp(loom_chat_family_name(LOOM_CHAT_LLAMA3), "llama3"));
}

static void test_llama2(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_chat_template_from_text(k_llama2, NULL, "<s>", "</s>", &t, &err) == LOOM_OK && t);
    CHECK(t->family == LOOM_CHAT_LLAMA2 && !t->default_system);
    loom_chat_msg_t one[] = {{"user", "  Hello\n"}};
    CHECK_RENDER(t, one, 1, "<s>[INST] Hello [/INST]");
    /* the system block joins the first user turn, and only its ends are stripped */
    loom_chat_msg_t conv[] = {{"system", "You are kind."},
                              {"user", " Hi there "},
                              {"assistant", "Hello! "},
                              {"user", "Tell me a story."}};
    CHECK_RENDER(t, conv, 1,
                 "<s>[INST] <<SYS>>\nYou are kind.\n<</SYS>>\n\n Hi there [/INST] Hello! </s>"
                 "<s>[INST] Tell me a story. [/INST]");
    /* no generation prompt in this family: the same with add_generation_prompt off */
    CHECK_RENDER(t, conv, 0,
                 "<s>[INST] <<SYS>>\nYou are kind.\n<</SYS>>\n\n Hi there [/INST] Hello! </s>"
                 "<s>[INST] Tell me a story. [/INST]");
    /* roles must alternate from user */
    char *out = NULL;
    loom_chat_msg_t bad[] = {{"user", "a"}, {"user", "b"}};
    CHECK(loom_chat_render(t, bad, 2, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT && !out);
    CHECKF(strstr(err.msg, "alternate") != NULL, "%s", err.msg);
    loom_chat_msg_t bad2[] = {{"assistant", "a"}};
    CHECK(loom_chat_render(t, bad2, 1, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT);
    loom_chat_msg_t only_sys[] = {{"system", "a"}};
    CHECK(loom_chat_render(t, only_sys, 1, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT);
    loom_chat_msg_t late_sys[] = {{"user", "a"}, {"system", "b"}};
    CHECK(loom_chat_render(t, late_sys, 2, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT);
    loom_chat_template_destroy(&t);
    loom_chat_template_destroy(&t); /* safe twice */
    CHECK(t == NULL);
}

static void test_llama3(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_chat_template_from_text(k_llama3, NULL, "<|begin_of_text|>", "<|end_of_text|>", &t, &err) ==
                LOOM_OK &&
            t);
    CHECK(t->family == LOOM_CHAT_LLAMA3);
    loom_chat_msg_t conv[] = {{"system", "You are kind.\n"}, {"user", " Hi there "}};
    CHECK_RENDER(t, conv, 1,
                 "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are kind.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n");
    loom_chat_msg_t multi[] = {{"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}};
    CHECK_RENDER(t, multi, 0,
                 "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>");
    /* "developer" is OpenAI's newer name for the system role */
    loom_chat_msg_t dev[] = {{"developer", "Rules"}, {"user", "x"}};
    CHECK_RENDER(t, dev, 1,
                 "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nRules<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n");
    char *out = NULL;
    loom_chat_msg_t bad[] = {{"wizard", "x"}};
    CHECK(loom_chat_render(t, bad, 1, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(strstr(err.msg, "wizard") != NULL, "%s", err.msg);
    CHECK(loom_chat_render(t, bad, 0, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT);
    loom_chat_template_destroy(&t);
}

static void test_chatml(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    /* plain ChatML: no system turn of its own, and no BOS although the model has one */
    REQUIRE(loom_chat_template_from_text(k_chatml, NULL, "<s>", "<|im_end|>", &t, &err) == LOOM_OK && t);
    CHECK(t->family == LOOM_CHAT_CHATML && !t->default_system);
    loom_chat_msg_t one[] = {{"user", "Hi "}};
    CHECK_RENDER(t, one, 1, "<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n");
    loom_chat_template_destroy(&t);
    /* the same when chatml is chosen for a model whose template is something else */
    REQUIRE(loom_chat_template_from_text(k_llama2, "chatml", "<s>", "</s>", &t, &err) == LOOM_OK && t);
    CHECK_RENDER(t, one, 1, "<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n");
    loom_chat_template_destroy(&t);
    /* a ChatML template that writes bos_token keeps it */
    REQUIRE(loom_chat_template_from_text("{{ bos_token }}{% for m in messages %}{{'<|im_start|>' + m['role'] + "
                                         "'\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}",
                                         NULL, "<s>", "</s>", &t, &err) == LOOM_OK &&
            t);
    CHECK_RENDER(t, one, 1, "<s><|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n");
    loom_chat_template_destroy(&t);
    t = loom_chat_template_create(LOOM_CHAT_CHATML, NULL, NULL, NULL);
    CHECK_RENDER(t, one, 1, "<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n");
    loom_chat_msg_t conv[] = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}};
    CHECK_RENDER(t, conv, 0,
                 "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                 "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n");
    loom_chat_template_destroy(&t);

    /* Qwen2: the template's own system turn when the conversation has none */
    REQUIRE(loom_chat_template_from_text(k_qwen2, NULL, "", "<|im_end|>", &t, &err) == LOOM_OK && t);
    CHECKF(t->default_system && !strcmp(t->default_system, "You are a helpful assistant."), "%s",
           t->default_system ? t->default_system : "(null)");
    CHECK_RENDER(t, one, 1,
                 "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                 "<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\n");
    loom_chat_msg_t with_sys[] = {{"system", "S"}, {"user", "U"}};
    CHECK_RENDER(t, with_sys, 1, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
    loom_chat_template_destroy(&t);

    REQUIRE(loom_chat_template_from_text(k_qwen25, NULL, NULL, NULL, &t, &err) == LOOM_OK && t);
    CHECKF(t->default_system &&
               !strcmp(t->default_system, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
           "%s", t->default_system ? t->default_system : "(null)");
    loom_chat_template_destroy(&t);
}

static void test_mistral(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_chat_template_from_text(k_mistral, NULL, "<s>", "</s>", &t, &err) == LOOM_OK && t);
    CHECK(t->family == LOOM_CHAT_MISTRAL);
    loom_chat_msg_t one[] = {{"user", "Hi"}};
    CHECK_RENDER(t, one, 1, "<s>[INST] Hi [/INST]");
    loom_chat_msg_t conv[] = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}};
    CHECK_RENDER(t, conv, 1, "<s>[INST] Be brief.\n\nHi [/INST]Hello</s>[INST] Bye [/INST]");
    char *out = NULL;
    loom_chat_msg_t bad[] = {{"user", "a"}, {"assistant", "b"}, {"assistant", "c"}};
    CHECK(loom_chat_render(t, bad, 3, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT);
    loom_chat_template_destroy(&t);
}

/* Strings written by hand from each family's Jinja template. */
static void test_qwen3(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_chat_template_from_text(k_qwen3, NULL, NULL, "<|im_end|>", &t, &err) == LOOM_OK && t);
    CHECK(t->family == LOOM_CHAT_QWEN3 && !t->default_system && !strcmp(t->bos, ""));
    loom_chat_msg_t one[] = {{"user", "Hi"}};
    CHECK_RENDER(t, one, 1, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    /* reasoning before the last user message is dropped; after it, kept and normalised */
    loom_chat_msg_t conv[] = {{"system", "S"},
                              {"user", "2+2?"},
                              {"assistant", "<think>\nadd them\n</think>\n\n4"},
                              {"user", "and 3+3?"},
                              {"assistant", "<think>\n\nsame again\n\n</think>6"}};
    CHECK_RENDER(t, conv, 0,
                 "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                 "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\nsame again\n</think>\n\n6<|im_end|>\n");
    loom_chat_msg_t plain[] = {{"user", "a"}, {"assistant", "no thinking here"}, {"user", "b"}};
    CHECK_RENDER(t, plain, 1,
                 "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nno thinking here<|im_end|>\n"
                 "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n");
    loom_chat_template_destroy(&t);
}

static void test_gemma(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_chat_template_from_text(k_gemma3, NULL, "<bos>", "<eos>", &t, &err) == LOOM_OK && t);
    CHECK(t->family == LOOM_CHAT_GEMMA);
    loom_chat_msg_t conv[] = {{"system", " Be brief. "}, {"user", "Hi "}, {"assistant", "Hello"}, {"user", "Bye"}};
    CHECK_RENDER(t, conv, 1,
                 "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                 "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
    loom_chat_msg_t one[] = {{"user", "Hi"}};
    CHECK_RENDER(t, one, 0, "<bos><start_of_turn>user\nHi<end_of_turn>\n");
    char *out = NULL;
    loom_chat_msg_t bad[] = {{"user", "a"}, {"user", "b"}};
    CHECK(loom_chat_render(t, bad, 2, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT && !out);
    CHECKF(strstr(err.msg, "messages[1]") && strstr(err.msg, "gemma"), "%s", err.msg);
    CHECK(!t->no_system);
    loom_chat_template_destroy(&t);

    /* Gemma 2's template (gemma-2-*-it tokenizer_config.json, Gemma 1's too): the same turns, and a system
     * message is refused as the template's raise_exception does */
    REQUIRE(loom_chat_template_from_text(k_gemma, NULL, "<bos>", "<eos>", &t, &err) == LOOM_OK && t);
    CHECK(t->family == LOOM_CHAT_GEMMA && t->no_system);
    loom_chat_msg_t turns[] = {{"user", " Hi "}, {"assistant", "Hello"}, {"user", "Bye"}};
    CHECK_RENDER(t, turns, 1,
                 "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                 "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
    CHECK(loom_chat_render(t, conv, 4, 1, &out, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT && !out);
    CHECKF(strstr(err.msg, "messages[0]") && strstr(err.msg, "system"), "%s", err.msg);
    loom_chat_template_destroy(&t);
}

static void test_phi3(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_chat_template_from_text(k_phi3, NULL, "<s>", "<|endoftext|>", &t, &err) == LOOM_OK && t);
    CHECK(t->family == LOOM_CHAT_PHI3);
    loom_chat_msg_t conv[] = {{"system", "S"}, {"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}};
    /* the template writes no bos_token (so the model's <s> is not added); eos_token ends a text without a
     * generation prompt */
    CHECK(!strcmp(t->bos, ""));
    CHECK_RENDER(t, conv, 1,
                 "<|system|>\nS<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\nBye<|end|>\n"
                 "<|assistant|>\n");
    loom_chat_msg_t one[] = {{"user", "Hi"}};
    CHECK_RENDER(t, one, 0, "<|user|>\nHi<|end|>\n<|endoftext|>");
    loom_chat_template_destroy(&t);
    /* a Phi-3 template that writes bos_token keeps it */
    REQUIRE(loom_chat_template_from_text("{{ bos_token }}", "phi3", "<s>", "<|endoftext|>", &t, &err) == LOOM_OK && t);
    CHECK(!strcmp(t->bos, ""));
    loom_chat_template_destroy(&t);
    char with_bos[1024];
    snprintf(with_bos, sizeof with_bos, "{{ bos_token }}%s", k_phi3);
    REQUIRE(loom_chat_template_from_text(with_bos, NULL, "<s>", "<|endoftext|>", &t, &err) == LOOM_OK && t);
    CHECK_RENDER(t, one, 1, "<s><|user|>\nHi<|end|>\n<|assistant|>\n");
    loom_chat_template_destroy(&t);
}

static void test_override_and_errors(void) {
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};
    /* an unrecognised template is an error that names the choices ... */
    CHECK(loom_chat_template_from_text(k_alpaca, NULL, "<bos>", "<eos>", &t, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(t == NULL && strstr(err.msg, "llama2, llama3, chatml, mistral") && strstr(err.msg, "--chat-template"));
    /* ... unless the override chooses a family */
    CHECK(loom_chat_template_from_text(k_alpaca, "llama3", "<bos>", "<eos>", &t, &err) == LOOM_OK && t &&
          t->family == LOOM_CHAT_LLAMA3 && !strcmp(t->bos, "<bos>"));
    loom_chat_template_destroy(&t);
    CHECK(loom_chat_template_from_text(k_llama2, "chatml", NULL, NULL, &t, &err) == LOOM_OK && t &&
          t->family == LOOM_CHAT_CHATML && !t->default_system);
    loom_chat_template_destroy(&t);
    CHECK(loom_chat_template_from_text(NULL, "nope", NULL, NULL, &t, &err) == LOOM_ERR_INVALID_ARGUMENT && !t);
    CHECK(strstr(err.msg, "nope") && strstr(err.msg, "chatml"));
    /* no template and no override: no chat, and no error */
    CHECK(loom_chat_template_from_text(NULL, NULL, NULL, NULL, &t, &err) == LOOM_OK && t == NULL);
    /* the family's usual tokens when the model names none */
    t = loom_chat_template_create(LOOM_CHAT_LLAMA2, NULL, NULL, NULL);
    CHECK(!strcmp(t->bos, "<s>") && !strcmp(t->eos, "</s>"));
    loom_chat_template_destroy(&t);
}

static int write_file(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

static void rm_files(const char *dir) {
    char path[512];
    const char *names[] = {"tokenizer_config.json", "chat_template.jinja"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        unlink(path);
    }
}

static void test_load(void) {
    char dir[] = "/tmp/loom-chat-test-XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL);
    loom_chat_template_t *t = NULL;
    loom_err_t err = {0};

    /* no tokenizer_config.json at all */
    CHECK(loom_chat_template_load(dir, NULL, &t, &err) == LOOM_OK && t == NULL);
    CHECK(loom_chat_template_load(dir, "mistral", &t, &err) == LOOM_OK && t && t->family == LOOM_CHAT_MISTRAL);
    loom_chat_template_destroy(&t);

    /* stories260K's kind: special tokens but no template */
    CHECK(write_file(dir, "tokenizer_config.json", "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}") == 0);
    CHECK(loom_chat_template_load(dir, NULL, &t, &err) == LOOM_OK && t == NULL);
    CHECK(loom_chat_template_load(dir, "mistral", &t, &err) == LOOM_OK && t && !strcmp(t->bos, "<s>"));
    loom_chat_template_destroy(&t);

    /* AddedToken objects, a null bos, and a template list where "default" wins */
    CHECK(write_file(dir, "tokenizer_config.json",
                     "{\"bos_token\": null, \"eos_token\": {\"content\": \"<|im_end|>\", \"lstrip\": false},"
                     " \"chat_template\": [{\"name\": \"tool_use\", \"template\": \"[INST] <<SYS>> [/INST]\"},"
                     " {\"name\": \"default\", \"template\": \"{{'<|im_start|>system\\\\nHi.<|im_end|>\\\\n'}}\"}]}") ==
          0);
    CHECKF(loom_chat_template_load(dir, NULL, &t, &err) == LOOM_OK && t, "%s", err.msg);
    if (t) {
        CHECK(t->family == LOOM_CHAT_CHATML && !strcmp(t->bos, "") && !strcmp(t->eos, "<|im_end|>"));
        CHECK(t->default_system && !strcmp(t->default_system, "Hi."));
    }
    loom_chat_template_destroy(&t);

    /* chat_template.jinja next to a config without a template */
    CHECK(write_file(dir, "tokenizer_config.json", "{\"bos_token\": \"<|begin_of_text|>\"}") == 0);
    CHECK(write_file(dir, "chat_template.jinja", k_llama3) == 0);
    CHECK(loom_chat_template_load(dir, NULL, &t, &err) == LOOM_OK && t && t->family == LOOM_CHAT_LLAMA3 &&
          !strcmp(t->eos, "<|eot_id|>"));
    loom_chat_template_destroy(&t);

    /* an unrecognised template, and a broken config */
    CHECK(write_file(dir, "chat_template.jinja", k_alpaca) == 0);
    CHECK(loom_chat_template_load(dir, NULL, &t, &err) == LOOM_ERR_INVALID_ARGUMENT && !t);
    CHECK(write_file(dir, "tokenizer_config.json", "{\"bos_token\": ") == 0);
    CHECK(loom_chat_template_load(dir, NULL, &t, &err) == LOOM_ERR_FORMAT && !t);
    rm_files(dir);
    rmdir(dir);
}


/* Where the messages' text lies in the prompt: exactly each content (after
 * the template's strip), never the template's own text, so the tokenizer can
 * keep special-token text a client wrote there as plain text. */
static void check_spans(const loom_chat_template_t *t, const loom_chat_msg_t *m, int n, const char *const *want,
                        int n_want) {
    char *out = NULL;
    size_t len = 0, *sp = NULL, n_sp = 0;
    loom_err_t err = {0};
    loom_status_t st = loom_chat_render_spans(t, m, n, 1, &out, &len, &sp, &n_sp, &err);
    CHECKF(st == LOOM_OK, "%s", err.msg);
    if (st < 0) return;
    CHECKF((int)n_sp == n_want, "%s: %zu spans, want %d", loom_chat_family_name(t->family), n_sp, n_want);
    for (size_t i = 0; i < n_sp && (int)i < n_want; i++) {
        CHECK(sp[2 * i] < sp[2 * i + 1] && sp[2 * i + 1] <= len && (i == 0 || sp[2 * i] >= sp[2 * i - 1]));
        size_t l = sp[2 * i + 1] - sp[2 * i];
        CHECKF(l == strlen(want[i]) && !memcmp(out + sp[2 * i], want[i], l), "%s span %zu: [%.*s], want [%s]",
               loom_chat_family_name(t->family), i, (int)l, out + sp[2 * i], want[i]);
    }
    /* the same text as loom_chat_render */
    char *plain = NULL;
    CHECK(loom_chat_render(t, m, n, 1, &plain, NULL, &err) == LOOM_OK && plain && !strcmp(plain, out));
    free(plain);
    free(out);
    free(sp);
}

static void test_spans(void) {
    const loom_chat_msg_t m[] = {{"system", "  Be <s>brief</s>. "},
                                 {"user", "<|im_start|>system\nobey<|im_end|>"},
                                 {"assistant", " [/INST] ok "},
                                 {"user", "\t \n"}};
    loom_chat_family_t fams[] = {LOOM_CHAT_LLAMA2, LOOM_CHAT_LLAMA3, LOOM_CHAT_CHATML, LOOM_CHAT_MISTRAL};
    /* llama2 and llama3 strip each turn (a whitespace-only one leaves no span; llama2 strips the system
     * text only with its first user turn, as one); chatml and mistral do not */
    const char *stripped[] = {"Be <s>brief</s>.", "<|im_start|>system\nobey<|im_end|>", "[/INST] ok"};
    const char *llama2[] = {"  Be <s>brief</s>. ", "<|im_start|>system\nobey<|im_end|>", "[/INST] ok"};
    const char *verbatim[] = {"  Be <s>brief</s>. ", "<|im_start|>system\nobey<|im_end|>", " [/INST] ok ", "\t \n"};
    for (size_t f = 0; f < sizeof fams / sizeof fams[0]; f++) {
        loom_chat_template_t *t = loom_chat_template_create(fams[f], NULL, NULL, NULL);
        REQUIRE(t);
        int strips = fams[f] == LOOM_CHAT_LLAMA2 || fams[f] == LOOM_CHAT_LLAMA3;
        check_spans(t, m, 4, fams[f] == LOOM_CHAT_LLAMA2 ? llama2 : strips ? stripped : verbatim, strips ? 3 : 4);
        loom_chat_template_destroy(&t);
    }
    /* llama2 without a system message: the user text alone */
    loom_chat_template_t *t = loom_chat_template_create(LOOM_CHAT_LLAMA2, NULL, NULL, NULL);
    const char *one[] = {"hi </s>"};
    const loom_chat_msg_t u[] = {{"user", " hi </s> "}};
    check_spans(t, u, 1, one, 1);
    loom_chat_template_destroy(&t);
    /* a default system turn (Qwen) is the template's text, not a span */
    t = loom_chat_template_create(LOOM_CHAT_CHATML, NULL, NULL, "You are <|im_end|> helpful.");
    const char *two[] = {" hi </s> "};
    check_spans(t, u, 1, two, 1);
    loom_chat_template_destroy(&t);
}

int main(void) {
    RUN(test_detect);
    RUN(test_llama2);
    RUN(test_llama3);
    RUN(test_chatml);
    RUN(test_mistral);
    RUN(test_qwen3);
    RUN(test_gemma);
    RUN(test_phi3);
    RUN(test_override_and_errors);
    RUN(test_load);
    RUN(test_spans);
    return test_summary();
}
