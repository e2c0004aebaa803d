/* `loom generate`, `loom health` and `loom stats`: talk to a running
 * coordinator through the C client. Exit codes: 0 ok, 1 other failure,
 * 2 usage, 3 refused by the server (bad request, overloaded, unknown model,
 * bad API key), 4 server unavailable, 130 interrupted. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/commands.h"
#include "client/loom_client.h"
#include "common/cli.h"
#include "common/request_limits.h"
#include "common/util.h"

#define EXIT_USAGE 2
#define EXIT_REFUSED 3
#define EXIT_UNAVAILABLE 4
#define EXIT_INTERRUPTED 130

static int exit_code(loom_status_t s) {
    switch (s) {
    case LOOM_OK: return 0;
    case LOOM_ERR_INVALID_ARGUMENT:
    case LOOM_ERR_RESOURCE_EXHAUSTED:
    case LOOM_ERR_NOT_FOUND:
    case LOOM_ERR_UNAUTHENTICATED: return EXIT_REFUSED;
    case LOOM_ERR_UNAVAILABLE:
    case LOOM_ERR_DEADLINE_EXCEEDED: return EXIT_UNAVAILABLE;
    default: return 1;
    }
}

/* "host:port" means tcp://host:port; anything with a scheme is used as is. */
static void endpoint(const char *addr, char *out, size_t n) {
    snprintf(out, n, "%s%s", strstr(addr, "://") ? "" : "tcp://", addr);
}

static int connect_or_report(const char *addr, int timeout_ms, const char *api_key, const char *cmd,
                             loom_client_t **c) {
    if (!addr) addr = getenv("LOOM_ADDR");
    if (!addr || !addr[0]) {
        fprintf(stderr, "error: --addr is required (or set LOOM_ADDR); see loom %s --help\n", cmd);
        return EXIT_USAGE;
    }
    char ep[256];
    endpoint(addr, ep, sizeof ep);
    loom_client_options_t o = {.timeout_ms = timeout_ms, .api_key = api_key};
    loom_err_t err = {0};
    if (loom_client_connect(ep, &o, c, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return err.code == LOOM_ERR_INVALID_ARGUMENT ? EXIT_USAGE : exit_code(err.code);
    }
    return 0;
}

/* Every value given to a repeatable option, in order ("--stop a --stop=b").
 * Walks argv the way loom_cli_parse does, so option values are skipped. */
static int collect_repeated(int argc, char **argv, int first, const loom_opt_t *opts, int n_opts,
                            const char *name, const char **out, int max) {
    int n = 0;
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0) continue;
        const char *nm = a + 2, *eq = strchr(nm, '=');
        size_t len = eq ? (size_t)(eq - nm) : strlen(nm);
        const loom_opt_t *o = NULL;
        for (int j = 0; j < n_opts; j++)
            if (strlen(opts[j].name) == len && !strncmp(opts[j].name, nm, len)) o = &opts[j];
        if (!o || o->kind == LOOM_OPT_FLAG) continue;
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (v && !strcmp(o->name, name)) {
            if (n == max) return -1;
            out[n++] = v;
        }
    }
    return n;
}

/* SIGINT asks the stream to cancel; a second one ends the process. */
static volatile sig_atomic_t g_interrupted;

static void on_sigint(int sig) {
    (void)sig;
    g_interrupted = 1;
}

typedef struct gen_out {
    double t_send, t_first, t_end;
    int print_ids;
    int32_t *ids;
    int n_ids, cap_ids;
    int printed_text, ends_with_newline;
    loom_chunk_t last; /* the final chunk's scalar fields */
} gen_out_t;

static int on_chunk(void *ctx, const loom_chunk_t *ch) {
    gen_out_t *o = ctx;
    double now = loom_now_s();
    if (ch->n_ids > 0 && o->t_first == 0) o->t_first = now;
    if (ch->text_len) {
        fwrite(ch->text, 1, ch->text_len, stdout);
        fflush(stdout);
        o->printed_text = 1;
        o->ends_with_newline = ch->text[ch->text_len - 1] == '\n';
    }
    if (o->print_ids && ch->n_ids > 0) {
        if (o->n_ids + ch->n_ids > o->cap_ids) {
            o->cap_ids = LOOM_MAX(2 * o->cap_ids, o->n_ids + ch->n_ids);
            o->ids = loom_xrealloc(o->ids, (size_t)o->cap_ids * sizeof *o->ids);
        }
        memcpy(o->ids + o->n_ids, ch->ids, (size_t)ch->n_ids * sizeof *ch->ids);
        o->n_ids += ch->n_ids;
    }
    if (ch->final) {
        o->t_end = now;
        o->last = *ch;
        o->last.ids = NULL;
        o->last.text = NULL;
        o->last.message = NULL;
    }
    return g_interrupted != 0;
}

static const char *finish_name(loom_finish_t f) {
    switch (f) {
    case LOOM_FINISH_STOP: return "stop";
    case LOOM_FINISH_LENGTH: return "length";
    case LOOM_FINISH_CANCELLED: return "cancelled";
    case LOOM_FINISH_ERROR: return "error";
    default: return "none";
    }
}

int loom_cmd_generate(int argc, char **argv) {
    const char *addr = NULL, *prompt = NULL, *stop = NULL, *api_key = NULL, *model = NULL, *session = NULL;
    const char *curve_server = NULL, *curve_secret = NULL, *lora = NULL;
    int max_tokens = 128, top_k = 40, ignore_eos = 0, priority = 0, timeout_ms = 30000, print_ids = 0;
    int no_spec = 0, no_cache = 0;
    int keep_special = 0, quiet = 0, seed_given = 0;
    float temperature = 0.8f, top_p = 0.95f;
    float min_p = 0.0f, presence = 0.0f, frequency = 0.0f, repetition = 0.0f;
    int min_tokens = 0;
    const char *bias_opt = NULL, *bad_opt = NULL;
    uint64_t seed = 0;
    loom_opt_t opts[] = {
        LOOM_CMD_OPT_ADDR(addr),
        {"prompt", LOOM_OPT_STR, &prompt, "TEXT", "prompt text; the completion (only) is streamed to stdout", 1, 0, NULL},
        {"max-tokens", LOOM_OPT_INT, &max_tokens, "N", "most tokens to generate, 0 = up to the context length (default 128)", 0, 1e9, NULL},
        {"temperature", LOOM_OPT_FLOAT, &temperature, "T", "sampling temperature; 0 = greedy (default 0.8)", 0, 100, NULL},
        {"top-p", LOOM_OPT_FLOAT, &top_p, "P", "nucleus sampling mass, 1 = off (default 0.95)", 0, 1, NULL},
        {"top-k", LOOM_OPT_INT, &top_k, "K", "sample among the K most likely tokens, 0 = off (default 40)", 0, 1e9, NULL},
        {"seed", LOOM_OPT_U64, &seed, "S", "sampling seed (default: the server picks one)", 1, 0, &seed_given},
        {"stop", LOOM_OPT_STR, &stop, "STR", "stop string, not printed; repeat for several", 1, 0, NULL},
        {"min-p", LOOM_OPT_FLOAT, &min_p, "P", "drop tokens less likely than P times the most likely one (default 0: off)", -1e9, 1e9, NULL},
        {"presence-penalty", LOOM_OPT_FLOAT, &presence, "X", "subtracted from every generated token's logit, [-2, 2]", -1e9, 1e9, NULL},
        {"frequency-penalty", LOOM_OPT_FLOAT, &frequency, "X", "subtracted per occurrence in the output, [-2, 2]", -1e9, 1e9, NULL},
        {"repetition-penalty", LOOM_OPT_FLOAT, &repetition, "X", "divides (>0) or multiplies a seen token's logit; 1 = off", -1e9, 1e9, NULL},
        {"logit-bias", LOOM_OPT_STR, &bias_opt, "ID:B", "add B to token ID's logit; repeat for several", 1, 0, NULL},
        {"bad-word", LOOM_OPT_STR, &bad_opt, "STR", "never generate this word; repeat for several", 1, 0, NULL},
        {"min-tokens", LOOM_OPT_INT, &min_tokens, "N", "EOS and stops end nothing before N tokens (default 0)", 0, 1e9, NULL},
        {"ignore-eos", LOOM_OPT_FLAG, &ignore_eos, NULL, "keep generating past the end-of-sequence token", 1, 0, NULL},
        {"no-speculation", LOOM_OPT_FLAG, &no_spec, NULL, "never speculate for this request (same output, one token per step)", 1, 0, NULL},
        {"no-cache", LOOM_OPT_FLAG, &no_cache, NULL, "a loom-router's response cache neither answers nor keeps this request", 1, 0, NULL},
        {"priority", LOOM_OPT_INT, &priority, "N", "scheduling priority, larger runs first (default 0)", -1e6, 1e6, NULL},
        {"keep-special", LOOM_OPT_FLAG, &keep_special, NULL, "keep special tokens (e.g. </s>) in the text", 1, 0, NULL},
        {"model", LOOM_OPT_STR, &model, "NAME", "model to use (default: the served model)", 1, 0, NULL},
        {"lora", LOOM_OPT_STR, &lora, "NAME",
         "a LoRA adapter the server serves (its --lora-modules name): the request's model is NAME", 1, 0, NULL},
        {"session", LOOM_OPT_STR, &session, "KEY", "session key: a loom-router with --policy session keeps a session on one replica", 1, 0, NULL},
        {"timeout-ms", LOOM_OPT_INT, &timeout_ms, "N", "give up when the server is silent this long (default 30000)", 1, 1e9, NULL},
        LOOM_CMD_OPT_API_KEY(api_key),
        LOOM_CMD_OPT_CURVE(curve_server, curve_secret),
        {"ids", LOOM_OPT_FLAG, &print_ids, NULL, "print the generated token ids to stderr", 1, 0, NULL},
        {"quiet", LOOM_OPT_FLAG, &quiet, NULL, "no summary line on stderr", 1, 0, NULL},
    };
    int n_opts = (int)LOOM_ARRAY_LEN(opts);
    int r = loom_cli_parse(argc, argv, 2, opts, n_opts, "loom generate --addr ADDR --prompt TEXT [options]",
                           "Sends the prompt to a Loom coordinator and streams the completion to stdout as it is\n"
                           "generated. A summary (tokens, time to first token, tokens/s, finish reason) goes to\n"
                           "stderr. Exit codes: 0 ok, 1 other error, 2 usage, 3 refused by the server,\n"
                           "4 server unavailable, 130 interrupted.");
    if (r) return r < 0 ? EXIT_USAGE : 0;
    if (lora && model) {
        fprintf(stderr, "error: --lora NAME is the request's model: give --lora or --model, not both\n");
        return EXIT_USAGE;
    }
    if (lora) model = lora;
    /* the same limits as the APIs (common/request_limits.h) */
    static const char *stops[LOOM_MAX_STOP], *bias_strs[LOOM_MAX_LOGIT_BIAS], *bad_words[LOOM_MAX_BAD_WORDS];
    static int32_t bias_ids[LOOM_MAX_LOGIT_BIAS];
    static float bias_values[LOOM_MAX_LOGIT_BIAS];
    int n_stop = collect_repeated(argc, argv, 2, opts, n_opts, "stop", stops, LOOM_MAX_STOP);
    if (n_stop < 0) {
        fprintf(stderr, "error: at most %d --stop strings\n", LOOM_MAX_STOP);
        return EXIT_USAGE;
    }
    int n_bias = collect_repeated(argc, argv, 2, opts, n_opts, "logit-bias", bias_strs, LOOM_MAX_LOGIT_BIAS);
    if (n_bias < 0) {
        fprintf(stderr, "error: at most %d --logit-bias\n", LOOM_MAX_LOGIT_BIAS);
        return EXIT_USAGE;
    }
    int n_bad = collect_repeated(argc, argv, 2, opts, n_opts, "bad-word", bad_words, LOOM_MAX_BAD_WORDS);
    if (n_bad < 0) {
        fprintf(stderr, "error: at most %d --bad-word\n", LOOM_MAX_BAD_WORDS);
        return EXIT_USAGE;
    }
    for (int i = 0; i < n_bias; i++) {
        char *end;
        long id = strtol(bias_strs[i], &end, 10);
        if (end == bias_strs[i] || *end != ':' || id < 0 || id > INT32_MAX) {
            fprintf(stderr, "error: --logit-bias '%s' is not ID:BIAS\n", bias_strs[i]);
            return EXIT_USAGE;
        }
        const char *v = end + 1;
        bias_values[i] = strtof(v, &end);
        if (end == v || *end) {
            fprintf(stderr, "error: --logit-bias '%s' is not ID:BIAS\n", bias_strs[i]);
            return EXIT_USAGE;
        }
        bias_ids[i] = (int32_t)id;
    }
    if (!prompt || !prompt[0]) {
        fprintf(stderr, "error: --prompt is required (see loom generate --help)\n");
        return EXIT_USAGE;
    }
    loom_client_t *c = NULL;
    loom_cmd_curve_env(curve_server, curve_secret);
    int rc = connect_or_report(addr, timeout_ms, api_key, "generate", &c);
    if (rc) return rc;

    loom_gen_params_t p = {.prompt = prompt, .max_tokens = max_tokens, .temperature = temperature,
                           .top_p = top_p, .top_k = top_k, .seed = seed, .has_seed = seed_given,
                           .stop = stops, .n_stop = n_stop, .ignore_eos = ignore_eos,
                           .priority = priority, .keep_special = keep_special, .model = model,
                           .min_p = min_p, .presence_penalty = presence, .frequency_penalty = frequency,
                           .repetition_penalty = repetition, .logit_bias_ids = bias_ids,
                           .logit_bias_values = bias_values, .n_logit_bias = n_bias, .bad_words = bad_words,
                           .n_bad_words = n_bad, .min_tokens = min_tokens, .session = session,
                           .no_speculation = no_spec, .no_cache = no_cache};
    gen_out_t o = {.print_ids = print_ids};
    struct sigaction sa = {.sa_handler = on_sigint, .sa_flags = (int)SA_RESETHAND}, old_sa;
    sigemptyset(&sa.sa_mask);
    g_interrupted = 0;
    sigaction(SIGINT, &sa, &old_sa);
    loom_err_t err = {0};
    o.t_send = loom_now_s();
    loom_status_t s = loom_client_generate(c, &p, on_chunk, &o, &err);
    sigaction(SIGINT, &old_sa, NULL);
    if (o.printed_text || s == LOOM_OK) fputc('\n', stdout);
    fflush(stdout);
    if (print_ids && o.n_ids) {
        fputs("ids:", stderr);
        for (int i = 0; i < o.n_ids; i++) fprintf(stderr, " %d", o.ids[i]);
        fputc('\n', stderr);
    }
    if (s == LOOM_OK || (s == LOOM_ERR_CANCELLED && g_interrupted)) {
        if (!quiet) {
            const loom_chunk_t *f = &o.last;
            double ttft = o.t_first > 0 ? o.t_first - o.t_send : 0, dec = o.t_end - o.t_first;
            fprintf(stderr, "prompt %d tokens", f->prompt_tokens);
            if (f->cached_tokens) fprintf(stderr, " (%d cached)", f->cached_tokens);
            fprintf(stderr, ", completion %d tokens, finish %s; time to first token %.1f ms", f->completion_tokens,
                    s == LOOM_OK ? finish_name(f->finish) : "cancelled (interrupted)", ttft * 1e3);
            if (f->completion_tokens > 1 && o.t_first > 0 && dec > 0)
                fprintf(stderr, ", %.1f tokens/s", (f->completion_tokens - 1) / dec);
            fprintf(stderr, ", %.3f s total\n", o.t_end - o.t_send);
            if (f->spec_draft_tokens > 0 && f->target_steps > 0) {
                fprintf(stderr, "speculative: %d draft tokens, %d accepted (acceptance rate %.1f%%)\n",
                        f->spec_draft_tokens, f->spec_accepted_tokens,
                        100.0 * f->spec_accepted_tokens / f->spec_draft_tokens);
                fprintf(stderr, "tokens per target step: %.2f\n", (double)f->completion_tokens / f->target_steps);
            }
        }
        rc = s == LOOM_OK ? 0 : EXIT_INTERRUPTED;
    } else {
        fprintf(stderr, "error: %s\n", err.msg);
        rc = exit_code(s);
    }
    free(o.ids);
    loom_client_close(&c);
    return rc;
}

int loom_cmd_health(int argc, char **argv) {
    const char *addr = NULL, *api_key = NULL, *curve_server = NULL, *curve_secret = NULL;
    int timeout_ms = 5000;
    loom_opt_t opts[] = {
        LOOM_CMD_OPT_ADDR(addr),
        {"timeout-ms", LOOM_OPT_INT, &timeout_ms, "N", "give up when the server is silent this long (default 5000)", 1, 1e9, NULL},
        LOOM_CMD_OPT_API_KEY(api_key),
        LOOM_CMD_OPT_CURVE(curve_server, curve_secret),
    };
    int r = loom_cli_parse(argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts), "loom health --addr ADDR [options]",
                           "Asks a Loom coordinator whether it is serving, and which models.\n"
                           "Exit codes: 0 ready, 1 up but not ready, 2 usage, 4 unavailable.");
    if (r) return r < 0 ? EXIT_USAGE : 0;
    loom_client_t *c = NULL;
    loom_cmd_curve_env(curve_server, curve_secret);
    int rc = connect_or_report(addr, timeout_ms, api_key, "health", &c);
    if (rc) return rc;
    loom_err_t err = {0};
    loom_health_t h;
    loom_status_t s = loom_client_health(c, &h, &err);
    if (s < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        loom_client_close(&c);
        return exit_code(s);
    }
    printf("state: %s\nready: %s\nworkers: %d/%d\n", h.state, h.ready ? "yes" : "no", h.workers_ready,
           h.workers_expected);
    if (h.message[0]) printf("message: %s\n", h.message);
    if (h.ready) {
        loom_model_info_t models[8];
        int n = 0;
        if (loom_client_list_models(c, models, (int)LOOM_ARRAY_LEN(models), &n, &err) < 0) {
            fprintf(stderr, "error: listing models: %s\n", err.msg);
        } else {
            for (int i = 0; i < LOOM_MIN(n, (int)LOOM_ARRAY_LEN(models)); i++)
                printf("model: %s (context %d, vocab %d, tp %d, pp %d)\n", models[i].id, models[i].context_length,
                       models[i].vocab_size, models[i].tp, models[i].pp);
            if (n > (int)LOOM_ARRAY_LEN(models)) printf("model: ... and %d more\n", n - (int)LOOM_ARRAY_LEN(models));
        }
    }
    loom_client_close(&c);
    return h.ready ? 0 : 1;
}

int loom_cmd_stats(int argc, char **argv) {
    const char *addr = NULL, *api_key = NULL, *curve_server = NULL, *curve_secret = NULL;
    int timeout_ms = 5000;
    loom_opt_t opts[] = {
        LOOM_CMD_OPT_ADDR(addr),
        {"timeout-ms", LOOM_OPT_INT, &timeout_ms, "N", "give up when the server is silent this long (default 5000)", 1, 1e9, NULL},
        LOOM_CMD_OPT_API_KEY(api_key),
        LOOM_CMD_OPT_CURVE(curve_server, curve_secret),
    };
    int r = loom_cli_parse(argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts), "loom stats --addr ADDR [options]",
                           "Prints a Loom coordinator's scheduler and KV-cache counters as JSON, one field a line.");
    if (r) return r < 0 ? EXIT_USAGE : 0;
    loom_client_t *c = NULL;
    loom_cmd_curve_env(curve_server, curve_secret);
    int rc = connect_or_report(addr, timeout_ms, api_key, "stats", &c);
    if (rc) return rc;
    loom_err_t err = {0};
    loom_stats_t s;
    loom_status_t st = loom_client_stats(c, &s, &err);
    loom_client_close(&c);
    if (st < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return exit_code(st);
    }
    printf("{\n"
           "  \"running\": %d,\n  \"waiting\": %d,\n  \"preparing\": %d,\n"
           "  \"kv_blocks_total\": %d,\n  \"kv_blocks_used\": %d,\n  \"kv_blocks_free\": %d,\n"
           "  \"kv_blocks_cached\": %llu,\n  \"kv_block_size\": %d,\n"
           "  \"kv_cache_dtype\": \"%s\",\n  \"kv_block_bytes\": %llu,\n"
           "  \"prefix_cache_queries\": %llu,\n  \"prefix_cache_hits\": %llu,\n  \"prefix_cache_hit_rate\": %.4f,\n"
           "  \"gen_tokens_per_s\": %.2f,\n"
           "  \"requests_finished\": %llu,\n  \"requests_rejected\": %llu,\n  \"preemptions\": %llu,\n"
           "  \"prompt_tokens_total\": %llu,\n  \"gen_tokens_total\": %llu,\n"
           "  \"steps\": %llu,\n  \"step_ms_mean\": %.3f,\n"
           "  \"ahead_tokens\": %llu,\n  \"ahead_dropped\": %llu\n"
           "}\n",
           s.running, s.waiting, s.preparing, s.kv_blocks_total, s.kv_blocks_used, s.kv_blocks_free,
           (unsigned long long)s.kv_blocks_cached, s.kv_block_size, s.kv_cache_dtype,
           (unsigned long long)s.kv_block_bytes, (unsigned long long)s.prefix_cache_queries,
           (unsigned long long)s.prefix_cache_hits, s.prefix_cache_hit_rate, s.gen_tokens_per_s,
           (unsigned long long)s.requests_finished, (unsigned long long)s.requests_rejected,
           (unsigned long long)s.preemptions, (unsigned long long)s.prompt_tokens_total,
           (unsigned long long)s.gen_tokens_total, (unsigned long long)s.steps, s.step_ms_mean,
           (unsigned long long)s.ahead_tokens, (unsigned long long)s.ahead_dropped);
    return 0;
}

int loom_cmd_embed(int argc, char **argv) {
    const char *addr = NULL, *api_key = NULL, *text = NULL;
    int timeout_ms = 30000;
    loom_opt_t opts[] = {
        LOOM_CMD_OPT_ADDR(addr),
        {"text", LOOM_OPT_STR, &text, "TEXT", "the text to embed (required)", 1, 0, NULL},
        {"timeout-ms", LOOM_OPT_INT, &timeout_ms, "N", "give up when the server is silent this long (default 30000)", 1, 1e9, NULL},
        LOOM_CMD_OPT_API_KEY(api_key),
    };
    int r = loom_cli_parse(argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts), "loom embed --addr ADDR --text TEXT [options]",
                           "Prints the embedding of TEXT from a Loom coordinator (its Embed method: the final hidden\n"
                           "state pooled as its --embedding-pooling says, L2-normalised) as JSON:\n"
                           "{\"pooling\", \"prompt_tokens\", \"embedding\": [...]}.");
    if (r) return r < 0 ? EXIT_USAGE : 0;
    if (!text) {
        fprintf(stderr, "error: --text is required (see --help)\n");
        return EXIT_USAGE;
    }
    loom_client_t *c = NULL;
    int rc = connect_or_report(addr, timeout_ms, api_key, "embed", &c);
    if (rc) return rc;
    loom_err_t err = {0};
    loom_embed_input_t in = {.text = text};
    loom_embed_result_t out;
    loom_status_t s = loom_client_embed(c, NULL, &in, 1, NULL, &out, &err);
    loom_client_close(&c);
    if (s < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return exit_code(s);
    }
    printf("{\"pooling\": \"%s\", \"prompt_tokens\": %d, \"embedding\": [", out.pooling, out.prompt_tokens);
    for (int j = 0; j < out.dim; j++) printf("%s%.9g", j ? ", " : "", (double)out.values[j]);
    printf("]}\n");
    loom_embed_result_free(&out);
    return 0;
}
