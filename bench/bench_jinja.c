/* bench_jinja [TEMPLATE_DIR] [RENDERS] [LLAMA3_TOKENIZER_DIR QWEN3_TOKENIZER_DIR]:
 * time of one chat-template render (common/jinja.h) of a 16-turn
 * conversation with 20 tools through the Llama 3.1 and Qwen3 templates,
 * each compiled once; prints p50/p99 µs per render and the output size.
 * Given the two models' tokenizer directories (tokenizer.json), it also
 * times tokenizing the rendered prompt (special tokens parsed, as a chat
 * request is), the cost the render sits beside. TEMPLATE_DIR defaults to
 * ../shared/chat_templates. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "common/jinja.h"
#include "common/tokenizer.h"

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static double cpu_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) n = 0;
    fclose(f);
    if (b) b[n] = '\0';
    *len = (size_t)n;
    return b;
}

/* 20 tools with two or three typed parameters each. */
static cJSON *make_tools(void) {
    cJSON *tools = cJSON_CreateArray();
    for (int i = 0; i < 20; i++) {
        char name[32], desc[128];
        snprintf(name, sizeof name, "tool_%02d", i);
        snprintf(desc, sizeof desc,
                 "Tool number %d: looks something up and returns a JSON object with the result.",
                 i);
        cJSON *t = cJSON_CreateObject(), *f = cJSON_AddObjectToObject(t, "function");
        cJSON_AddStringToObject(t, "type", "function");
        cJSON_AddStringToObject(f, "name", name);
        cJSON_AddStringToObject(f, "description", desc);
        cJSON *p = cJSON_AddObjectToObject(f, "parameters");
        cJSON_AddStringToObject(p, "type", "object");
        cJSON *props = cJSON_AddObjectToObject(p, "properties");
        cJSON *q = cJSON_AddObjectToObject(props, "query");
        cJSON_AddStringToObject(q, "type", "string");
        cJSON_AddStringToObject(q, "description", "What to look for, in plain words.");
        cJSON *l = cJSON_AddObjectToObject(props, "limit");
        cJSON_AddStringToObject(l, "type", "integer");
        cJSON_AddStringToObject(l, "description", "How many results at most.");
        if (i % 2) {
            cJSON *u = cJSON_AddObjectToObject(props, "unit");
            cJSON_AddStringToObject(u, "type", "string");
            cJSON *e = cJSON_AddArrayToObject(u, "enum");
            cJSON_AddItemToArray(e, cJSON_CreateString("metric"));
            cJSON_AddItemToArray(e, cJSON_CreateString("imperial"));
        }
        cJSON *req = cJSON_AddArrayToObject(p, "required");
        cJSON_AddItemToArray(req, cJSON_CreateString("query"));
        cJSON_AddItemToArray(tools, t);
    }
    return tools;
}

/* 16 turns after a system prompt: user/assistant pairs, every fourth
 * assistant turn a tool call answered by a tool result. */
static cJSON *make_messages(void) {
    cJSON *msgs = cJSON_CreateArray(), *m;
    m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "system");
    cJSON_AddStringToObject(
        m, "content", "You are a helpful assistant. Use the tools when they help; answer briefly.");
    cJSON_AddItemToArray(msgs, m);
    for (int turn = 0; turn < 8; turn++) {
        char text[256];
        m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        snprintf(text, sizeof text,
                 "Question %d: what can you tell me about topic %d, and how does it compare with "
                 "the last one?",
                 turn, turn * 7);
        cJSON_AddStringToObject(m, "content", text);
        cJSON_AddItemToArray(msgs, m);
        m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "assistant");
        if (turn % 4 == 3) {
            cJSON_AddStringToObject(m, "content", "");
            cJSON *calls = cJSON_AddArrayToObject(m, "tool_calls"), *c = cJSON_CreateObject();
            cJSON_AddStringToObject(c, "id", "call12345");
            cJSON_AddStringToObject(c, "type", "function");
            cJSON *f = cJSON_AddObjectToObject(c, "function");
            cJSON_AddStringToObject(f, "name", "tool_03");
            cJSON *args = cJSON_AddObjectToObject(f, "arguments");
            cJSON_AddStringToObject(args, "query", "topic comparison");
            cJSON_AddNumberToObject(args, "limit", 5);
            cJSON_AddItemToArray(calls, c);
            cJSON_AddItemToArray(msgs, m);
            m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "tool");
            cJSON_AddStringToObject(m, "tool_call_id", "call12345");
            cJSON_AddStringToObject(m, "content",
                                    "{\"results\": [\"a\", \"b\", \"c\"], \"count\": 3}");
            cJSON_AddItemToArray(msgs, m);
            m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "assistant");
        }
        snprintf(
            text, sizeof text,
            "Answer %d: topic %d is much like the previous one, with a few differences in detail.",
            turn, turn * 7);
        cJSON_AddStringToObject(m, "content", text);
        cJSON_AddItemToArray(msgs, m);
    }
    return msgs;
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "../shared/chat_templates";
    int n = argc > 2 ? atoi(argv[2]) : 2000;
    if (n < 10) n = 10;
    static const char *files[] = {"llama-3.1-8b-instruct.jinja", "qwen3-0.6b.jinja"};
    static const char *bos[] = {"<|begin_of_text|>", ""};
    static const char *eos[] = {"<|eot_id|>", "<|im_end|>"};
    cJSON *tools = make_tools(), *msgs = make_messages();
    /* wall time, and the thread's CPU time (which a busy shared machine does not inflate) */
    printf("%-30s %8s %8s %8s %12s %12s %10s\n", "template", "p50 us", "p99 us", "mean us",
           "cpu p50 us", "cpu p99 us", "out bytes");
    int rc = 0;
    for (int k = 0; k < 2; k++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, files[k]);
        size_t len;
        char *src = read_file(path, &len);
        if (!src) {
            fprintf(stderr, "cannot read %s\n", path);
            return 1;
        }
        loom_jinja_t *t = NULL;
        loom_err_t err = {0};
        if (loom_jinja_compile(src, len, files[k], &t, &err) != LOOM_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        cJSON *vars = cJSON_CreateObject();
        cJSON_AddItemReferenceToObject(vars, "messages", msgs);
        cJSON_AddItemReferenceToObject(vars, "tools", tools);
        cJSON_AddNullToObject(vars, "documents");
        cJSON_AddTrueToObject(vars, "add_generation_prompt");
        cJSON_AddStringToObject(vars, "bos_token", bos[k]);
        cJSON_AddStringToObject(vars, "eos_token", eos[k]);
        cJSON_AddStringToObject(vars, "date_string", "26 Jul 2024");
        double *us = malloc((size_t)n * sizeof *us), *cpu = malloc((size_t)n * sizeof *cpu),
               sum = 0;
        size_t out_len = 0;
        char *last = NULL;
        for (int i = -n / 10; i < n; i++) { /* the first tenth warms up */
            char *out = NULL;
            double t0 = now_us(), c0 = cpu_us();
            loom_status_t s = loom_jinja_render(t, vars, NULL, &out, &out_len, &err);
            double dt = now_us() - t0, dc = cpu_us() - c0;
            if (s != LOOM_OK) {
                fprintf(stderr, "%s: %s\n", files[k], err.msg);
                rc = 1;
                break;
            }
            free(last);
            last = out;
            if (i >= 0) {
                us[i] = dt;
                cpu[i] = dc;
                sum += dt;
            }
        }
        qsort(us, (size_t)n, sizeof *us, cmp_d);
        qsort(cpu, (size_t)n, sizeof *cpu, cmp_d);
        printf("%-30s %8.1f %8.1f %8.1f %12.1f %12.1f %10zu\n", files[k], us[n / 2],
               us[(size_t)n * 99 / 100], sum / n, cpu[n / 2], cpu[(size_t)n * 99 / 100], out_len);
        if (argc > 4 && last) { /* the same prompt through the model's tokenizer */
            loom_tokenizer_t *tok = NULL;
            if (loom_tokenizer_load(argv[3 + k], &tok, &err) != LOOM_OK) {
                fprintf(stderr, "%s: %s\n", argv[3 + k], err.msg);
                rc = 1;
            } else {
                int32_t *ids = NULL;
                int n_ids = 0, cap = 0, nt = n / 10 > 20 ? n / 10 : 20;
                if (nt > n) nt = n;
                for (int i = -nt / 10; i < nt; i++) {
                    double t0 = now_us(), c0 = cpu_us();
                    if (loom_tokenizer_encode(tok, last, out_len, 0, 1, &ids, &n_ids, &cap, &err) != LOOM_OK) {
                        fprintf(stderr, "encode: %s\n", err.msg);
                        rc = 1;
                        break;
                    }
                    if (i >= 0) {
                        us[i] = now_us() - t0;
                        cpu[i] = cpu_us() - c0;
                    }
                }
                qsort(us, (size_t)nt, sizeof *us, cmp_d);
                qsort(cpu, (size_t)nt, sizeof *cpu, cmp_d);
                printf("%-30s %8.1f %8.1f %8s %12.1f %12.1f %10d tokens\n", "  tokenize the same prompt", us[nt / 2],
                       us[(size_t)nt * 99 / 100], "", cpu[nt / 2], cpu[(size_t)nt * 99 / 100], n_ids);
                free(ids);
                loom_tokenizer_destroy(&tok);
            }
        }
        free(last);
        free(us);
        free(cpu);
        cJSON_Delete(vars);
        loom_jinja_destroy(&t);
        free(src);
    }
    cJSON_Delete(tools);
    cJSON_Delete(msgs);
    return rc;
}
