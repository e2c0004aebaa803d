/* Chat templates (chat_template.h): detection by substrings of the Jinja
 * text, and one renderer per family written from that family's template. */
#include "common/chat_template.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* Python's str.strip() / Jinja's trim for the ASCII whitespace it removes. */
static int is_strip_space(unsigned char c) {
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

/* Where message text lies in the rendered prompt: [start, end) byte pairs,
 * in order (NULL when the caller does not ask). */
typedef struct spans {
    size_t *v;
    size_t n, cap; /* pairs */
} spans_t;

static void spans_add(spans_t *sp, size_t start, size_t end) {
    if (!sp || end <= start) return;
    if (sp->n && sp->v[2 * sp->n - 1] == start) { /* adjacent: one span */
        sp->v[2 * sp->n - 1] = end;
        return;
    }
    if (sp->n == sp->cap) {
        sp->cap = sp->cap ? 2 * sp->cap : 8;
        sp->v = loom_xrealloc(sp->v, 2 * sp->cap * sizeof *sp->v);
    }
    sp->v[2 * sp->n] = start;
    sp->v[2 * sp->n + 1] = end;
    sp->n++;
}

/* Appends s stripped; rel holds n_rel spans of message text in s's own
 * offsets, recorded where they land (clipped by the strip). */
static void sb_stripped_spans(loom_sbuf_t *b, const char *s, size_t n, spans_t *sp, const size_t *rel, int n_rel) {
    size_t lead = 0;
    while (lead < n && is_strip_space((unsigned char)s[lead])) lead++;
    while (n > lead && is_strip_space((unsigned char)s[n - 1])) n--;
    size_t base = b->len, len = n - lead;
    loom_sbuf_add(b, s + lead, len);
    for (int i = 0; i < n_rel; i++) {
        size_t a = rel[2 * i] > lead ? rel[2 * i] - lead : 0, e = rel[2 * i + 1] > lead ? rel[2 * i + 1] - lead : 0;
        spans_add(sp, base + LOOM_MIN(a, len), base + LOOM_MIN(e, len));
    }
}

/* Message text: appended, stripped or not, and recorded as a span. */
static void sb_content(loom_sbuf_t *b, const char *s, int strip, spans_t *sp) {
    size_t n = strlen(s);
    if (strip) {
        size_t rel[2] = {0, n};
        sb_stripped_spans(b, s, n, sp, rel, 1);
        return;
    }
    size_t base = b->len;
    loom_sbuf_add(b, s, n);
    spans_add(sp, base, b->len);
}

/* ---- families ---- */

static const struct {
    loom_chat_family_t family;
    const char *name, *bos, *eos;
} k_families[] = {
    {LOOM_CHAT_LLAMA2, "llama2", "<s>", "</s>"},
    {LOOM_CHAT_LLAMA3, "llama3", "<|begin_of_text|>", "<|eot_id|>"},
    {LOOM_CHAT_CHATML, "chatml", "", ""},
    {LOOM_CHAT_MISTRAL, "mistral", "<s>", "</s>"},
    {LOOM_CHAT_QWEN3, "qwen3", "", ""},
    {LOOM_CHAT_GEMMA, "gemma", "<bos>", "<eos>"},
    {LOOM_CHAT_PHI3, "phi3", "", "<|endoftext|>"},
};

const char *loom_chat_family_name(loom_chat_family_t f) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_families); i++)
        if (k_families[i].family == f) return k_families[i].name;
    return "none";
}

loom_chat_family_t loom_chat_family_from_name(const char *name) {
    for (size_t i = 0; name && i < LOOM_ARRAY_LEN(k_families); i++)
        if (!strcmp(k_families[i].name, name)) return k_families[i].family;
    return LOOM_CHAT_NONE;
}

loom_chat_family_t loom_chat_detect(const char *t) {
    if (!t) return LOOM_CHAT_NONE;
    /* Most specific first: a Llama 3 or ChatML template never holds [INST],
     * and Llama 2's is the [INST] template with a <<SYS>> block. */
    if (strstr(t, "<|start_header_id|>") && strstr(t, "<|end_header_id|>")) return LOOM_CHAT_LLAMA3;
    if (strstr(t, "<|im_start|>") && strstr(t, "<|im_end|>"))
        return strstr(t, "<think>") && strstr(t, "</think>") ? LOOM_CHAT_QWEN3 : LOOM_CHAT_CHATML;
    if (strstr(t, "<start_of_turn>") && strstr(t, "<end_of_turn>")) return LOOM_CHAT_GEMMA;
    if (strstr(t, "<|user|>") && strstr(t, "<|assistant|>") && strstr(t, "<|end|>")) return LOOM_CHAT_PHI3;
    if (strstr(t, "[INST]") && strstr(t, "<<SYS>>")) return LOOM_CHAT_LLAMA2;
    if (strstr(t, "[INST]") && strstr(t, "[/INST]")) return LOOM_CHAT_MISTRAL;
    return LOOM_CHAT_NONE;
}

/* ChatML templates like Qwen2's write a fixed system turn when the
 * conversation has none: '<|im_start|>system\nYou are a helpful
 * assistant.<|im_end|>\n'. Finds such a literal (text up to <|im_end|> with
 * no quote or Jinja syntax in it) and returns its text, \n unescaped. */
static char *chatml_default_system(const char *t) {
    static const char *const heads[] = {"<|im_start|>system\\n", "<|im_start|>system\n"};
    for (size_t h = 0; h < LOOM_ARRAY_LEN(heads); h++) {
        for (const char *p = strstr(t, heads[h]); p; p = strstr(p + 1, heads[h])) {
            const char *s = p + strlen(heads[h]);
            const char *e = strstr(s, "<|im_end|>");
            if (!e || e == s) continue;
            size_t n = (size_t)(e - s);
            if (memchr(s, '\'', n) || memchr(s, '"', n) || memchr(s, '{', n) || memchr(s, '}', n) ||
                memchr(s, '+', n))
                continue;
            loom_sbuf_t b = {0};
            for (size_t i = 0; i < n; i++) {
                if (s[i] == '\\' && i + 1 < n && s[i + 1] == 'n') {
                    loom_sbuf_add(&b, "\n", 1);
                    i++;
                } else {
                    loom_sbuf_add(&b, &s[i], 1);
                }
            }
            return b.p;
        }
    }
    return NULL;
}

loom_chat_template_t *loom_chat_template_create(loom_chat_family_t family, const char *bos, const char *eos,
                                                const char *default_system) {
    LOOM_ASSERT(family != LOOM_CHAT_NONE);
    const char *dbos = "", *deos = "";
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_families); i++)
        if (k_families[i].family == family) {
            dbos = k_families[i].bos;
            deos = k_families[i].eos;
        }
    loom_chat_template_t *t = loom_xcalloc(1, sizeof *t);
    t->family = family;
    t->bos = loom_xstrdup(bos ? bos : dbos);
    t->eos = loom_xstrdup(eos ? eos : deos);
    t->default_system = default_system ? loom_xstrdup(default_system) : NULL;
    return t;
}

void loom_chat_template_destroy(loom_chat_template_t **t_p) {
    if (!t_p || !*t_p) return;
    loom_chat_template_t *t = *t_p;
    free(t->bos);
    free(t->eos);
    free(t->default_system);
    free(t);
    *t_p = NULL;
}

loom_status_t loom_chat_template_from_text(const char *text, const char *override_name, const char *bos,
                                           const char *eos, loom_chat_template_t **out, loom_err_t *err) {
    *out = NULL;
    loom_chat_family_t detected = text ? loom_chat_detect(text) : LOOM_CHAT_NONE, family = detected;
    if (override_name) {
        family = loom_chat_family_from_name(override_name);
        if (family == LOOM_CHAT_NONE)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "unknown chat template '%s'; choose one of %s",
                                override_name, LOOM_CHAT_FAMILY_NAMES);
    } else if (!text) {
        return LOOM_OK;
    } else if (family == LOOM_CHAT_NONE) {
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "the model's chat template is not one Loom recognises (it knows %s); "
                            "start the coordinator with --chat-template NAME to choose one",
                            LOOM_CHAT_FAMILY_NAMES);
    }
    char *sys = family == LOOM_CHAT_CHATML && detected == LOOM_CHAT_CHATML ? chatml_default_system(text) : NULL;
    /* ChatML (Qwen3 included) and Phi-3 templates rarely write BOS; those that do name bos_token */
    if ((family == LOOM_CHAT_CHATML || family == LOOM_CHAT_QWEN3 || family == LOOM_CHAT_PHI3) &&
        !(detected == family && strstr(text, "bos_token")))
        bos = "";
    *out = loom_chat_template_create(family, bos, eos, sys);
    free(sys);
    (*out)->no_system = family == LOOM_CHAT_GEMMA && detected == family && strstr(text, "System role not supported");
    return LOOM_OK;
}

/* A special-token field of tokenizer_config.json: "<s>", {"content": "<s>", ...},
 * null (none: ""), or absent (NULL: the family's usual token). */
static const char *token_field(const cJSON *root, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!v) return NULL;
    if (cJSON_IsString(v)) return v->valuestring;
    if (cJSON_IsObject(v)) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
        if (cJSON_IsString(c)) return c->valuestring;
    }
    return "";
}

loom_status_t loom_chat_template_load(const char *model_dir, const char *override_name, loom_chat_template_t **out,
                                      loom_err_t *err) {
    *out = NULL;
    char path[4096];
    char *data = NULL, *jinja = NULL;
    size_t len = 0;
    cJSON *root = NULL;
    const char *text = NULL, *bos = NULL, *eos = NULL;
    loom_status_t st = LOOM_OK;
    if (!loom_path_join(path, sizeof path, model_dir, "tokenizer_config.json"))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "model directory path is too long");
    FILE *f = fopen(path, "rb");
    if (f) {
        fclose(f);
        LOOM_CHECK(loom_read_file(path, &data, &len, err));
        root = cJSON_ParseWithLength(data, len);
        if (!cJSON_IsObject(root)) {
            st = loom_err_set(err, LOOM_ERR_FORMAT, "%s: not a JSON object", path);
            goto done;
        }
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
        if (cJSON_IsString(ct)) {
            text = ct->valuestring;
        } else if (cJSON_IsArray(ct)) {
            const cJSON *e;
            cJSON_ArrayForEach(e, ct) {
                const cJSON *name = cJSON_GetObjectItemCaseSensitive(e, "name");
                const cJSON *tt = cJSON_GetObjectItemCaseSensitive(e, "template");
                if (!cJSON_IsString(tt)) continue;
                if (!text || (cJSON_IsString(name) && !strcmp(name->valuestring, "default"))) text = tt->valuestring;
            }
        }
        bos = token_field(root, "bos_token");
        eos = token_field(root, "eos_token");
    }
    if (!text && loom_path_join(path, sizeof path, model_dir, "chat_template.jinja")) {
        f = fopen(path, "rb");
        if (f) {
            fclose(f);
            size_t jl;
            st = loom_read_file(path, &jinja, &jl, err);
            if (st < 0) goto done;
            text = jinja;
        }
    }
    st = loom_chat_template_from_text(text, override_name, bos, eos, out, err);
done:
    cJSON_Delete(root);
    free(data);
    free(jinja);
    return st;
}

/* ---- rendering ---- */

typedef enum { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_OTHER } role_t;

static role_t role_of(const char *r) {
    if (!strcmp(r, "system") || !strcmp(r, "developer")) return ROLE_SYSTEM;
    if (!strcmp(r, "user")) return ROLE_USER;
    if (!strcmp(r, "assistant")) return ROLE_ASSISTANT;
    return ROLE_OTHER;
}

static const char *role_name(role_t r) {
    return r == ROLE_SYSTEM ? "system" : r == ROLE_USER ? "user" : "assistant";
}

/* Llama 2 and Mistral: [INST] turns. An optional leading system message,
 * then user/assistant alternating from user. Llama 2 wraps the system text
 * in <<SYS>>, strips every turn and starts each user turn with BOS; Mistral
 * prepends the system text to the first user turn and writes BOS once. */
static loom_status_t render_inst(const loom_chat_template_t *t, const loom_chat_msg_t *m, int n, loom_sbuf_t *b,
                                 spans_t *sp, loom_err_t *err) {
    int llama2 = t->family == LOOM_CHAT_LLAMA2;
    const char *sys = NULL;
    int start = 0;
    if (n > 0 && role_of(m[0].role) == ROLE_SYSTEM) {
        sys = m[0].content;
        start = 1;
    }
    if (n - start < 1)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the conversation needs a user message after the system message");
    if (!llama2) loom_sbuf_str(b, t->bos);
    for (int i = start; i < n; i++) {
        int j = i - start;
        role_t r = role_of(m[i].role);
        role_t want = j % 2 == 0 ? ROLE_USER : ROLE_ASSISTANT;
        if (r != want)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "messages[%d] has role '%s' but the %s chat template needs '%s' there: after an "
                                "optional first system message, roles must alternate user/assistant/user/...",
                                i, m[i].role, loom_chat_family_name(t->family), role_name(want));
        const char *c = m[i].content;
        if (r == ROLE_USER) {
            if (llama2) {
                loom_sbuf_t content = {0};
                size_t rel[4];
                int n_rel = 0;
                if (j == 0 && sys) {
                    loom_sbuf_str(&content, "<<SYS>>\n");
                    rel[2 * n_rel] = content.len;
                    loom_sbuf_str(&content, sys);
                    rel[2 * n_rel + 1] = content.len;
                    n_rel++;
                    loom_sbuf_str(&content, "\n<</SYS>>\n\n");
                }
                rel[2 * n_rel] = content.len;
                loom_sbuf_str(&content, c);
                rel[2 * n_rel + 1] = content.len;
                n_rel++;
                loom_sbuf_str(b, t->bos);
                loom_sbuf_str(b, "[INST] ");
                sb_stripped_spans(b, content.p, content.len, sp, rel, n_rel);
                loom_sbuf_str(b, " [/INST]");
                free(content.p);
            } else {
                loom_sbuf_str(b, "[INST] ");
                if (j == 0 && sys) {
                    sb_content(b, sys, 0, sp);
                    loom_sbuf_str(b, "\n\n");
                }
                sb_content(b, c, 0, sp);
                loom_sbuf_str(b, " [/INST]");
            }
        } else if (llama2) {
            loom_sbuf_str(b, " ");
            sb_content(b, c, 1, sp);
            loom_sbuf_str(b, " ");
            loom_sbuf_str(b, t->eos);
        } else {
            sb_content(b, c, 0, sp);
            loom_sbuf_str(b, t->eos);
        }
    }
    return LOOM_OK;
}

static void render_llama3(const loom_chat_template_t *t, const loom_chat_msg_t *m, int n, int gen, loom_sbuf_t *b,
                          spans_t *sp) {
    for (int i = 0; i < n; i++) {
        if (i == 0) loom_sbuf_str(b, t->bos);
        loom_sbuf_str(b, "<|start_header_id|>");
        loom_sbuf_str(b, role_name(role_of(m[i].role)));
        loom_sbuf_str(b, "<|end_header_id|>\n\n");
        sb_content(b, m[i].content, 1, sp);
        loom_sbuf_str(b, "<|eot_id|>");
    }
    if (gen) loom_sbuf_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

static void render_chatml(const loom_chat_template_t *t, const loom_chat_msg_t *m, int n, int gen, loom_sbuf_t *b,
                          spans_t *sp) {
    loom_sbuf_str(b, t->bos);
    if (t->default_system && (n == 0 || role_of(m[0].role) != ROLE_SYSTEM)) {
        loom_sbuf_str(b, "<|im_start|>system\n");
        loom_sbuf_str(b, t->default_system);
        loom_sbuf_str(b, "<|im_end|>\n");
    }
    for (int i = 0; i < n; i++) {
        loom_sbuf_str(b, "<|im_start|>");
        loom_sbuf_str(b, role_name(role_of(m[i].role)));
        loom_sbuf_str(b, "\n");
        sb_content(b, m[i].content, 0, sp);
        loom_sbuf_str(b, "<|im_end|>\n");
    }
    if (gen) loom_sbuf_str(b, "<|im_start|>assistant\n");
}

/* Qwen3: ChatML whose assistant turns may hold reasoning in <think>...</think>.
 * As its template: the reasoning of assistant turns before the last user
 * message is dropped (only the text after </think> stays); turns after it
 * keep it, rewritten as "<think>\nREASONING\n</think>\n\nANSWER". The
 * generation prompt leaves the model free to think. */
static void render_qwen3(const loom_chat_template_t *t, const loom_chat_msg_t *m, int n, int gen, loom_sbuf_t *b,
                         spans_t *sp) {
    int last_user = -1;
    for (int i = 0; i < n; i++)
        if (role_of(m[i].role) == ROLE_USER) last_user = i;
    loom_sbuf_str(b, t->bos);
    for (int i = 0; i < n; i++) {
        role_t r = role_of(m[i].role);
        const char *c = m[i].content;
        loom_sbuf_str(b, "<|im_start|>");
        loom_sbuf_str(b, role_name(r));
        loom_sbuf_str(b, "\n");
        const char *end = r == ROLE_ASSISTANT ? strstr(c, "</think>") : NULL;
        if (!end) {
            sb_content(b, c, 0, sp);
        } else {
            const char *after = end + strlen("</think>"), *why = c;
            for (const char *p = strstr(c, "<think>"); p && p < end; p = strstr(p + 1, "<think>"))
                why = p + strlen("<think>");
            for (const char *p = strstr(after, "</think>"); p; p = strstr(p + 1, "</think>"))
                after = p + strlen("</think>"); /* the text after the last </think> */
            while (*after == '\n') after++;
            while (why < end && *why == '\n') why++;
            const char *why_end = end;
            while (why_end > why && why_end[-1] == '\n') why_end--;
            if (i > last_user) {
                loom_sbuf_str(b, "<think>\n");
                size_t base = b->len;
                loom_sbuf_add(b, why, (size_t)(why_end - why));
                spans_add(sp, base, b->len);
                loom_sbuf_str(b, "\n</think>\n\n");
            }
            sb_content(b, after, 0, sp);
        }
        loom_sbuf_str(b, "<|im_end|>\n");
    }
    if (gen) loom_sbuf_str(b, "<|im_start|>assistant\n");
}

/* Gemma: <start_of_turn>user / model turns, alternating from user; a leading
 * system message is folded into the first user turn (Gemma 3's template) or
 * refused (Gemma 1 and 2's, no_system), every text trimmed. */
static loom_status_t render_gemma(const loom_chat_template_t *t, const loom_chat_msg_t *m, int n, int gen,
                                  loom_sbuf_t *b, spans_t *sp, loom_err_t *err) {
    int start = n > 0 && role_of(m[0].role) == ROLE_SYSTEM;
    if (start && t->no_system)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "messages[0] has role '%s' but this gemma chat template does not support a system "
                            "message (Gemma 1 and 2 templates refuse it)",
                            m[0].role);
    if (n - start < 1)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "the conversation needs a user message after the system message");
    loom_sbuf_str(b, t->bos);
    for (int i = start; i < n; i++) {
        role_t r = role_of(m[i].role), want = (i - start) % 2 == 0 ? ROLE_USER : ROLE_ASSISTANT;
        if (r != want)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "messages[%d] has role '%s' but the gemma chat template needs '%s' there: after an "
                                "optional first system message, roles must alternate user/assistant/user/...",
                                i, m[i].role, role_name(want));
        loom_sbuf_str(b, r == ROLE_USER ? "<start_of_turn>user\n" : "<start_of_turn>model\n");
        if (i == start && start) {
            sb_content(b, m[0].content, 1, sp);
            loom_sbuf_str(b, "\n\n");
        }
        sb_content(b, m[i].content, 1, sp);
        loom_sbuf_str(b, "<end_of_turn>\n");
    }
    if (gen) loom_sbuf_str(b, "<start_of_turn>model\n");
    return LOOM_OK;
}

/* Phi-3 / Phi-4-mini: <|system|>, <|user|>, <|assistant|> turns ended by
 * <|end|>; without a generation prompt the text ends with eos_token. */
static void render_phi3(const loom_chat_template_t *t, const loom_chat_msg_t *m, int n, int gen, loom_sbuf_t *b,
                        spans_t *sp) {
    loom_sbuf_str(b, t->bos);
    for (int i = 0; i < n; i++) {
        role_t r = role_of(m[i].role);
        loom_sbuf_str(b, r == ROLE_SYSTEM ? "<|system|>\n" : r == ROLE_USER ? "<|user|>\n" : "<|assistant|>\n");
        sb_content(b, m[i].content, 0, sp);
        loom_sbuf_str(b, "<|end|>\n");
    }
    loom_sbuf_str(b, gen ? "<|assistant|>\n" : t->eos);
}

loom_status_t loom_chat_render(const loom_chat_template_t *t, const loom_chat_msg_t *msgs, int n_msgs,
                               int add_generation_prompt, char **out, size_t *out_len, loom_err_t *err) {
    return loom_chat_render_spans(t, msgs, n_msgs, add_generation_prompt, out, out_len, NULL, NULL, err);
}

loom_status_t loom_chat_render_spans(const loom_chat_template_t *t, const loom_chat_msg_t *msgs, int n_msgs,
                                     int add_generation_prompt, char **out, size_t *out_len, size_t **plain,
                                     size_t *n_plain, loom_err_t *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (plain) *plain = NULL;
    if (n_plain) *n_plain = 0;
    spans_t spans = {0}, *sp = plain && n_plain ? &spans : NULL;
    if (n_msgs < 1) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "messages must not be empty");
    for (int i = 0; i < n_msgs; i++) {
        if (!msgs[i].role || role_of(msgs[i].role) == ROLE_OTHER)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "messages[%d] has role '%.64s'; the roles Loom supports are system, developer, "
                                "user and assistant",
                                i, msgs[i].role ? msgs[i].role : "(none)");
        if (!msgs[i].content)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "messages[%d] has no content", i);
    }
    loom_sbuf_t b = {0};
    loom_sbuf_add(&b, "", 0);
    switch (t->family) {
    case LOOM_CHAT_LLAMA2:
    case LOOM_CHAT_MISTRAL: {
        loom_status_t st = render_inst(t, msgs, n_msgs, &b, sp, err);
        if (st < 0) {
            free(b.p);
            free(spans.v);
            return st;
        }
        break;
    }
    case LOOM_CHAT_LLAMA3: render_llama3(t, msgs, n_msgs, add_generation_prompt, &b, sp); break;
    case LOOM_CHAT_CHATML: render_chatml(t, msgs, n_msgs, add_generation_prompt, &b, sp); break;
    case LOOM_CHAT_QWEN3: render_qwen3(t, msgs, n_msgs, add_generation_prompt, &b, sp); break;
    case LOOM_CHAT_PHI3: render_phi3(t, msgs, n_msgs, add_generation_prompt, &b, sp); break;
    case LOOM_CHAT_GEMMA: {
        loom_status_t st = render_gemma(t, msgs, n_msgs, add_generation_prompt, &b, sp, err);
        if (st < 0) {
            free(b.p);
            return st;
        }
        break;
    }
    default: LOOM_ASSERT(!"chat template without a family");
    }
    *out = b.p;
    if (out_len) *out_len = b.len;
    if (sp) {
        *plain = spans.v;
        *n_plain = spans.n;
    }
    return LOOM_OK;
}
