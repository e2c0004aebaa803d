/* `loom bench`: the serving load generator, a peer of `vllm bench serve`.
 * It sends a dataset's requests (random token ids, a ShareGPT file,
 * repeated prefixes, or multi-turn chats whose every turn resends the
 * conversation so far) at a rate with Poisson or gamma-distributed gaps, up
 * to a concurrency, over the loom.v1 ZeroMQ API or to any OpenAI-compatible
 * server (/v1/completions or /v1/chat/completions), and reports TTFT, TPOT,
 * ITL and end-to-end latency, throughput and goodput for one rate or a
 * sweep, a JSON result with vLLM's keys, plots, and where the time went on
 * a Loom server (the stage breakdown from the timings of each final chunk).
 * This file reads the options; client/bench/ has the parts (bench.h). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/bench/bench.h"
#include "client/commands.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"

#define EXIT_USAGE 2
#define EXIT_UNAVAILABLE 4
#define MAX_RATES 32

static int parse_rate(const char *s, double *rate) {
    if (!strcmp(s, "inf") || !strcmp(s, "Inf") || !strcmp(s, "INF")) {
        *rate = INFINITY;
        return 0;
    }
    char *end = NULL;
    errno = 0;
    double x = strtod(s, &end);
    if (errno || end == s || *end || !(x > 0) || !isfinite(x)) return -1;
    *rate = x;
    return 0;
}

static int parse_rates(const char *list, double *rates, int max) {
    char buf[512];
    if (snprintf(buf, sizeof buf, "%s", list) >= (int)sizeof buf) return -1;
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        if (n == max || parse_rate(tok, &rates[n]) < 0) return -1;
        n++;
    }
    return n > 0 ? n : -1;
}

/* "ttft:500 tpot:50" (spaces or commas): vLLM's --goodput objectives in ms. */
static int parse_goodput(const char *s, bench_goodput_t *g) {
    *g = (bench_goodput_t){-1, -1, -1, 0};
    char buf[256];
    if (snprintf(buf, sizeof buf, "%s", s) >= (int)sizeof buf) return -1;
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        char *colon = strchr(tok, ':'), *end = NULL;
        if (!colon) return -1;
        *colon = '\0';
        errno = 0;
        double v = strtod(colon + 1, &end);
        if (errno || end == colon + 1 || *end || !(v >= 0) || !isfinite(v)) return -1;
        if (!strcmp(tok, "ttft")) g->ttft_ms = v;
        else if (!strcmp(tok, "tpot")) g->tpot_ms = v;
        else if (!strcmp(tok, "e2el")) g->e2el_ms = v;
        else return -1;
        g->any = 1;
    }
    return g->any ? 0 : -1;
}

static int parse_percentiles(const char *s, double *p, int max) {
    char buf[256];
    if (snprintf(buf, sizeof buf, "%s", s) >= (int)sizeof buf) return -1;
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        char *end = NULL;
        double v = strtod(tok, &end);
        if (n == max || end == tok || *end || !(v > 0 && v <= 100)) return -1;
        p[n++] = v;
    }
    return n > 0 ? n : -1;
}

static int check_metric_list(const char *s) {
    char buf[128];
    if (snprintf(buf, sizeof buf, "%s", s) >= (int)sizeof buf) return -1;
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save), n++)
        if (strcmp(tok, "ttft") && strcmp(tok, "tpot") && strcmp(tok, "itl") && strcmp(tok, "e2el")) return -1;
    return n > 0 ? 0 : -1;
}

/* vLLM's `--goodput ttft:500 tpot:50` takes several words: joined into one argument here. */
static char **join_goodput_words(int argc, char **argv, int *argc_out, char **joined) {
    char **out = loom_xcalloc((size_t)argc + 1, sizeof *out);
    int n = 0;
    *joined = NULL;
    for (int i = 0; i < argc; i++) {
        out[n++] = argv[i];
        if (strcmp(argv[i], "--goodput") != 0 || i + 1 >= argc) continue;
        loom_sbuf_t b = {0};
        loom_sbuf_str(&b, argv[++i]);
        while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0 && strchr(argv[i + 1], ':')) {
            loom_sbuf_add(&b, " ", 1);
            loom_sbuf_str(&b, argv[++i]);
        }
        free(*joined);
        *joined = b.p;
        out[n++] = b.p;
    }
    *argc_out = n;
    return out;
}

static int loom_bench_main(int argc, char **argv) {
    const char *addr = NULL, *rate_s = NULL, *rates_s = NULL, *json = NULL, *plot = NULL, *api = NULL;
    const char *stage_plot = NULL, *api_key = NULL, *url = NULL, *backend = NULL, *endpoint = NULL, *model_name = NULL;
    const char *dataset = "random", *dataset_path = NULL, *goodput_s = NULL, *pct_metrics = "ttft,tpot,itl";
    const char *pcts_s = "99", *result_file = NULL, *curve_server = NULL, *curve_secret = NULL;
    int num_requests = 100, prompt_len = 128, output_len = 128, vocab = 0, max_conc = 0, timeout_s = 300;
    int sharegpt_out = 0, pre_len = 256, suf_len = 256, n_prefixes = 10, pre_out = 128, save_detailed = 0;
    int no_ignore_eos = 0, save_result = 0, range_seen = 0;
    int mt_sessions = 50, mt_turns = 5, mt_sys_len = 128, mt_n_sys = 1, mt_user = 32, mt_out = 32, mt_seen = 0, n_seen = 0;
    float mt_think = 0.5f;
    float prompt_range = 0, output_range = 0, temperature = 0, range_ratio = 0, burstiness = 1;
    uint64_t seed = 0;
    loom_opt_t opts[] = {
        LOOM_CMD_OPT_ADDR(addr),
        {"backend", LOOM_OPT_STR, &backend, "NAME", "openai (/v1/completions), openai-chat (/v1/chat/completions), or loom (the ZeroMQ API; the default)", 1, 0, NULL},
        {"endpoint-type", LOOM_OPT_STR, &backend, "NAME", "the same as --backend (vLLM's newer name)", 1, 0, NULL},
        {"base-url", LOOM_OPT_STR, &url, "URL", "an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (implies --backend openai)", 1, 0, NULL},
        {"url", LOOM_OPT_STR, &url, "URL", "the same as --base-url", 1, 0, NULL},
        {"endpoint", LOOM_OPT_STR, &endpoint, "PATH", "the path under --base-url (default /v1/completions, or /v1/chat/completions)", 1, 0, NULL},
        {"api", LOOM_OPT_STR, &api, "zmq|http", "zmq: --backend loom; http: --backend openai", 1, 0, NULL},
        {"model", LOOM_OPT_STR, &model_name, "NAME", "the model name to send (default: the first of GET /v1/models)", 1, 0, NULL},
        {"dataset-name", LOOM_OPT_STR, &dataset, "NAME", "random (default), sharegpt (needs --dataset-path), prefix_repetition or multiturn", 1, 0, NULL},
        {"dataset-path", LOOM_OPT_STR, &dataset_path, "FILE", "a ShareGPT-format JSON file: a list of {\"conversations\": [{\"value\": PROMPT}, {\"value\": REPLY}]}", 1, 0, NULL},
        {"sharegpt-output-len", LOOM_OPT_INT, &sharegpt_out, "N", "output tokens of every ShareGPT request (default: the reply's length)", 1, 1e7, NULL},
        {"rate", LOOM_OPT_STR, &rate_s, "R", "requests/s (Poisson or gamma arrivals), or inf: all at once (default inf)", 1, 0, NULL},
        {"request-rate", LOOM_OPT_STR, &rate_s, "R", "the same as --rate", 1, 0, NULL},
        {"rates", LOOM_OPT_STR, &rates_s, "LIST", "a sweep, e.g. \"1,2,4,8,inf\" (one run per rate)", 1, 0, NULL},
        {"burstiness", LOOM_OPT_FLOAT, &burstiness, "F", "gaps between arrivals are gamma-distributed with this shape: 1 Poisson (default), < 1 burstier, > 1 more even", 0.001, 1000, NULL},
        {"num-requests", LOOM_OPT_INT, &num_requests, "N", "requests per rate (default 100)", 1, 1e6, &n_seen},
        {"num-prompts", LOOM_OPT_INT, &num_requests, "N", "the same as --num-requests", 1, 1e6, &n_seen},
        {"max-concurrency", LOOM_OPT_INT, &max_conc, "C", "most requests in flight, 0 = no limit (default 0)", 0, 1e6, NULL},
        {"seed", LOOM_OPT_U64, &seed, "S", "seed for lengths, prompts and arrivals (default 0)", 1, 0, NULL},
        {"prompt-len", LOOM_OPT_INT, &prompt_len, "N", "random: mean prompt length in tokens (default 128)", 1, 1e7, NULL},
        {"random-input-len", LOOM_OPT_INT, &prompt_len, "N", "the same as --prompt-len", 1, 1e7, NULL},
        {"prompt-len-range", LOOM_OPT_FLOAT, &prompt_range, "FRAC", "random: prompt lengths uniform in N*(1 +- FRAC) (default 0)", 0, 1, NULL},
        {"output-len", LOOM_OPT_INT, &output_len, "N", "random: mean output length in tokens (default 128)", 1, 1e7, NULL},
        {"random-output-len", LOOM_OPT_INT, &output_len, "N", "the same as --output-len", 1, 1e7, NULL},
        {"output-len-range", LOOM_OPT_FLOAT, &output_range, "FRAC", "random: output lengths uniform in N*(1 +- FRAC) (default 0)", 0, 1, NULL},
        {"random-range-ratio", LOOM_OPT_FLOAT, &range_ratio, "FRAC", "sets both --prompt-len-range and --output-len-range", 0, 1, &range_seen},
        {"prefix-repetition-prefix-len", LOOM_OPT_INT, &pre_len, "N", "prefix_repetition: tokens of each shared prefix (default 256)", 1, 1e7, NULL},
        {"prefix-repetition-suffix-len", LOOM_OPT_INT, &suf_len, "N", "prefix_repetition: random tokens after the prefix (default 256)", 0, 1e7, NULL},
        {"prefix-repetition-num-prefixes", LOOM_OPT_INT, &n_prefixes, "N", "prefix_repetition: distinct prefixes (default 10)", 1, 1e6, NULL},
        {"prefix-repetition-output-len", LOOM_OPT_INT, &pre_out, "N", "prefix_repetition: output tokens (default 128)", 1, 1e7, NULL},
        {"multiturn-sessions", LOOM_OPT_INT, &mt_sessions, "N", "multiturn: chat sessions; they start at --request-rate sessions/s (default 50)", 1, 1e5, &mt_seen},
        {"multiturn-turns", LOOM_OPT_INT, &mt_turns, "T", "multiturn: turns per session, each sent only after the previous one ended; --num-requests is sessions x turns (default 5, at most 64)", 1, BENCH_MAX_TURNS, &mt_seen},
        {"multiturn-system-len", LOOM_OPT_INT, &mt_sys_len, "N", "multiturn: tokens of the system prompt each session starts with (default 128)", 0, 1e7, &mt_seen},
        {"multiturn-num-system", LOOM_OPT_INT, &mt_n_sys, "K", "multiturn: distinct system prompts the sessions share (default 1)", 1, 1e5, &mt_seen},
        {"multiturn-user-len", LOOM_OPT_INT, &mt_user, "N", "multiturn: new user tokens per turn (default 32)", 1, 1e7, &mt_seen},
        {"multiturn-output-len", LOOM_OPT_INT, &mt_out, "N", "multiturn: output tokens per turn; the next turn's prompt holds them (default 32)", 1, 1e7, &mt_seen},
        {"multiturn-think-s", LOOM_OPT_FLOAT, &mt_think, "S", "multiturn: mean seconds (exponential) between a turn's end and the session's next turn (default 0.5)", 0, 3600, &mt_seen},
        {"vocab", LOOM_OPT_INT, &vocab, "V", "random prompt ids are drawn from [3, V) (default: the model's vocabulary)", 4, 1e8, NULL},
        {"temperature", LOOM_OPT_FLOAT, &temperature, "T", "sampling temperature (default 0: greedy)", 0, 100, NULL},
        {"no-ignore-eos", LOOM_OPT_FLAG, &no_ignore_eos, NULL, "let the model stop at EOS (by default ignore_eos is sent, so output lengths are exact)", 0, 0, NULL},
        {"goodput", LOOM_OPT_STR, &goodput_s, "KEY:MS ...", "service-level objectives (ttft, tpot, e2el in ms): request_goodput counts the requests that meet all", 1, 0, NULL},
        {"percentile-metrics", LOOM_OPT_STR, &pct_metrics, "LIST", "metrics whose percentiles go in the JSON (of ttft,tpot,itl,e2el; default ttft,tpot,itl)", 1, 0, NULL},
        {"metric-percentiles", LOOM_OPT_STR, &pcts_s, "LIST", "the percentiles, e.g. \"25,50,99\" (default 99)", 1, 0, NULL},
        {"json", LOOM_OPT_STR, &json, "FILE", "write the results as JSON (an object; an array for --rates)", 1, 0, NULL},
        {"save-result", LOOM_OPT_FLAG, &save_result, NULL, "write the JSON result (to --result-filename, default loom-bench.json)", 0, 0, NULL},
        {"result-filename", LOOM_OPT_STR, &result_file, "FILE", "the same as --json", 1, 0, NULL},
        {"save-detailed", LOOM_OPT_FLAG, &save_detailed, NULL, "add the per-request lists to the JSON (input_lens, output_lens, ttfts, itls, generated_texts, errors, ...)", 0, 0, NULL},
        {"plot", LOOM_OPT_STR, &plot, "FILE.png", "plot TTFT/TPOT p50/p99 against the achieved rate (gnuplot)", 1, 0, NULL},
        {"stage-plot", LOOM_OPT_STR, &stage_plot, "FILE.png", "plot the server-side stage breakdown (mean per stage, stacked, per rate; p50/p99 per stage) (gnuplot)", 1, 0, NULL},
        {"timeout-s", LOOM_OPT_INT, &timeout_s, "N", "cap on the whole run; unfinished requests fail (default 300)", 1, 1e6, NULL},
        LOOM_CMD_OPT_API_KEY(api_key),
        LOOM_CMD_OPT_CURVE(curve_server, curve_secret),
        LOOM_CMD_OPT_CURVE(curve_server, curve_secret),
    };
    int r = loom_cli_parse(argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts),
                           "loom bench (--addr ADDR | --base-url URL [--backend openai|openai-chat]) [options]",
                           "Load-tests a Loom coordinator or any OpenAI-compatible server (vLLM, llama-server, ...)\n"
                           "like vLLM's `vllm bench serve`: a dataset's prompts arrive at a Poisson or gamma rate, up\n"
                           "to a concurrency; reports TTFT, TPOT, ITL and end-to-end latency, throughput and goodput\n"
                           "per rate, and on a Loom server where the time went (tokenize, queue, prefill, decode).\n"
                           "--dataset-name multiturn runs chats: sessions arrive at --request-rate, each turn's prompt\n"
                           "is the whole conversation so far (system prompt, earlier prompts, the answers received)\n"
                           "plus new user tokens, sent after the previous turn ended; requests carry the session as\n"
                           "their key (loom.v1 session, the OpenAI user field), and the report adds per-turn counts\n"
                           "and the prefix-cache hit rate the server reports.\n"
                           "Exit codes: 0 all requests succeeded, 1 some failed, 2 usage, 4 server unavailable.");
    if (r) return r < 0 ? EXIT_USAGE : 0;
    if (range_seen) prompt_range = output_range = range_ratio;
    loom_cmd_curve_env(curve_server, curve_secret);
    double rates[MAX_RATES];
    int n_rates = 1, sweep = rates_s != NULL;
    rates[0] = INFINITY;
    if (rate_s && rates_s) {
        fprintf(stderr, "error: give --rate or --rates, not both\n");
        return EXIT_USAGE;
    }
    if (rate_s && parse_rate(rate_s, &rates[0]) < 0) {
        fprintf(stderr, "error: --rate expects a positive number of requests/s or inf, got '%s'\n", rate_s);
        return EXIT_USAGE;
    }
    if (rates_s && (n_rates = parse_rates(rates_s, rates, MAX_RATES)) < 0) {
        fprintf(stderr, "error: --rates expects up to %d comma-separated positive numbers or inf, got '%s'\n",
                MAX_RATES, rates_s);
        return EXIT_USAGE;
    }
    bench_goodput_t slo = {-1, -1, -1, 0};
    if (goodput_s && parse_goodput(goodput_s, &slo) < 0) {
        fprintf(stderr, "error: --goodput expects KEY:MS pairs with KEY ttft, tpot or e2el and MS >= 0, e.g. "
                        "'ttft:500 tpot:50', got '%s'\n", goodput_s);
        return EXIT_USAGE;
    }
    double pcts[BENCH_MAX_PCT];
    int n_pcts = parse_percentiles(pcts_s, pcts, BENCH_MAX_PCT);
    if (n_pcts < 0) {
        fprintf(stderr, "error: --metric-percentiles expects up to %d comma-separated numbers in (0, 100], got '%s'\n",
                BENCH_MAX_PCT, pcts_s);
        return EXIT_USAGE;
    }
    if (check_metric_list(pct_metrics) < 0) {
        fprintf(stderr, "error: --percentile-metrics expects a comma-separated list of ttft, tpot, itl, e2el, got '%s'\n",
                pct_metrics);
        return EXIT_USAGE;
    }
    if (result_file) json = result_file;
    if (save_result && !json) json = "loom-bench.json";

    /* the transport: --backend, else --api, else a URL means HTTP */
    int http = 0, chat = 0;
    if (backend) {
        if (!strcmp(backend, "openai") || !strcmp(backend, "vllm")) http = 1;
        else if (!strcmp(backend, "openai-chat")) http = chat = 1;
        else if (strcmp(backend, "loom") && strcmp(backend, "zmq")) {
            fprintf(stderr, "error: --backend must be openai, openai-chat or loom, got '%s'\n", backend);
            return EXIT_USAGE;
        }
    }
    if (api) {
        if (strcmp(api, "zmq") && strcmp(api, "http")) {
            fprintf(stderr, "error: --api must be zmq or http, got '%s'\n", api);
            return EXIT_USAGE;
        }
        if (backend && http != !strcmp(api, "http")) {
            fprintf(stderr, "error: --api %s contradicts --backend %s\n", api, backend);
            return EXIT_USAGE;
        }
        http = !strcmp(api, "http");
    } else if (!backend && url) {
        http = 1;
    }
    if (http) {
        if (!url || !url[0]) {
            fprintf(stderr, "error: an HTTP backend needs --base-url http://HOST:PORT (the server's address)\n");
            return EXIT_USAGE;
        }
        addr = url;
    } else {
        if (url) {
            fprintf(stderr, "error: --base-url is for an HTTP backend; the ZeroMQ API takes --addr\n");
            return EXIT_USAGE;
        }
        if (endpoint) {
            fprintf(stderr, "error: --endpoint is for an HTTP backend\n");
            return EXIT_USAGE;
        }
        if (!addr) addr = getenv("LOOM_ADDR");
        if (!addr || !addr[0]) {
            fprintf(stderr, "error: --addr is required (or set LOOM_ADDR, or give --base-url); see loom bench --help\n");
            return EXIT_USAGE;
        }
    }
    bench_ds_kind_t kind;
    if (!strcmp(dataset, "random")) kind = BENCH_DS_RANDOM;
    else if (!strcmp(dataset, "sharegpt")) kind = BENCH_DS_SHAREGPT;
    else if (!strcmp(dataset, "prefix_repetition") || !strcmp(dataset, "prefix-repetition"))
        kind = BENCH_DS_PREFIX_REPETITION;
    else if (!strcmp(dataset, "multiturn") || !strcmp(dataset, "multi-turn"))
        kind = BENCH_DS_MULTITURN;
    else {
        fprintf(stderr, "error: --dataset-name must be random, sharegpt, prefix_repetition or multiturn, got '%s'\n",
                dataset);
        return EXIT_USAGE;
    }
    if (mt_seen && kind != BENCH_DS_MULTITURN) {
        fprintf(stderr, "error: the --multiturn-* options are for --dataset-name multiturn\n");
        return EXIT_USAGE;
    }
    int n_arrivals = num_requests; /* the requests, or the chats' first turns */
    if (kind == BENCH_DS_MULTITURN) {
        if ((long long)mt_sessions * mt_turns > 1000000) {
            fprintf(stderr, "error: --multiturn-sessions x --multiturn-turns is %lld requests, over 1000000\n",
                    (long long)mt_sessions * mt_turns);
            return EXIT_USAGE;
        }
        if (n_seen && num_requests != mt_sessions * mt_turns) {
            fprintf(stderr, "error: with --dataset-name multiturn the requests are --multiturn-sessions x "
                            "--multiturn-turns (%d x %d); leave out --num-requests\n", mt_sessions, mt_turns);
            return EXIT_USAGE;
        }
        num_requests = mt_sessions * mt_turns;
        n_arrivals = mt_sessions;
    }
    if (kind == BENCH_DS_SHAREGPT && !dataset_path) {
        fprintf(stderr, "error: --dataset-name sharegpt needs --dataset-path FILE\n");
        return EXIT_USAGE;
    }
    if (kind != BENCH_DS_SHAREGPT && dataset_path) {
        fprintf(stderr, "error: --dataset-path is for --dataset-name sharegpt\n");
        return EXIT_USAGE;
    }

    /* Probe first, with a short timeout: is anyone there, and what does it serve? */
    loom_err_t err = {0};
    bench_transport_t t;
    bench_model_t model = {.id = "unknown"};
    int probe_ms = LOOM_MIN(timeout_s, 10) * 1000;
    loom_status_t s = http ? bench_http_open(addr, endpoint, chat, probe_ms, api_key, model_name, &t, &err)
                           : bench_zmq_open(addr, probe_ms, api_key, &t, &err);
    if (s < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return EXIT_USAGE;
    }
    s = t.model ? t.model(t.self, &model, &err) : LOOM_OK;
    t.close(t.self);
    if (s < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return s == LOOM_ERR_UNAVAILABLE ? EXIT_UNAVAILABLE : 1;
    }
    if (model_name) snprintf(model.id, sizeof model.id, "%s", model_name);
    if (!vocab) vocab = model.vocab_size;
    if (!vocab && chat) vocab = 67; /* text prompts only use the id to pick a word */
    long long mt_longest = (long long)mt_sys_len + (long long)mt_turns * (mt_user + mt_out);
    int longest = kind == BENCH_DS_MULTITURN          ? (int)LOOM_MIN(mt_longest, INT32_MAX)
                  : kind == BENCH_DS_PREFIX_REPETITION ? pre_len + suf_len + pre_out
                                                     : (int)ceil(prompt_len * (1.0 + prompt_range) - 1e-6) +
                                                           (int)ceil(output_len * (1.0 + output_range) - 1e-6);
    if (kind != BENCH_DS_SHAREGPT && model.context_length > 0 && longest > model.context_length) {
        fprintf(stderr, "error: prompts and outputs reach %d tokens, over the context length %d of %s%s\n", longest,
                model.context_length, model.id,
                kind == BENCH_DS_MULTITURN ? " (the last turn holds the system prompt and every turn's user and "
                                             "output tokens: shorten them or use fewer --multiturn-turns)"
                                           : "");
        return EXIT_USAGE;
    }
    bench_ds_cfg_t dcfg = {.kind = kind, .num_requests = num_requests, .vocab = vocab, .seed = seed,
                           .want_text = chat, .input_len = prompt_len, .output_len = output_len,
                           .input_range = prompt_range, .output_range = output_range, .path = dataset_path,
                           .sharegpt_output_len = sharegpt_out, .prefix_len = pre_len, .suffix_len = suf_len,
                           .num_prefixes = n_prefixes, .sessions = mt_sessions, .turns = mt_turns,
                           .system_len = mt_sys_len, .num_system = mt_n_sys, .user_len = mt_user,
                           .think_s = mt_think};
    if (kind == BENCH_DS_PREFIX_REPETITION) dcfg.output_len = pre_out;
    /* a chat resends its answers: over HTTP they come back as text, so its prompts are text */
    if (kind == BENCH_DS_MULTITURN) {
        dcfg.output_len = mt_out;
        dcfg.want_text = chat || http;
    }
    bench_item_t *items = NULL;
    char msg[512];
    if (bench_dataset_load(&dcfg, &items, msg, sizeof msg) < 0) {
        fprintf(stderr, "error: %s\n", msg);
        bench_dataset_free(items, num_requests);
        return EXIT_USAGE;
    }

    int run_ms = (int)LOOM_MIN((double)timeout_s * 1000, 1e9);
    s = http ? bench_http_open(addr, endpoint, chat, run_ms, api_key, model.id, &t, &err)
             : bench_zmq_open(addr, run_ms, api_key, &t, &err);
    if (s < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        bench_dataset_free(items, num_requests);
        return EXIT_USAGE;
    }
    int lo = items[0].prompt_len, hi = lo, olo = items[0].output_len, ohi = olo;
    for (int i = 1; i < num_requests; i++) {
        lo = LOOM_MIN(lo, items[i].prompt_len), hi = LOOM_MAX(hi, items[i].prompt_len);
        olo = LOOM_MIN(olo, items[i].output_len), ohi = LOOM_MAX(ohi, items[i].output_len);
    }
    if (kind == BENCH_DS_MULTITURN)
        printf("loom bench: %s at %s (%s), multiturn dataset, %d sessions x %d turns per rate (%d requests), "
               "%d system prompt(s) of %d tokens, %d user and %d output tokens a turn, think %.2g s, vocab %d\n",
               model.id, addr, t.name, mt_sessions, mt_turns, num_requests, mt_n_sys, mt_sys_len, mt_user, mt_out,
               mt_think, vocab);
    else
        printf("loom bench: %s at %s (%s), %s dataset, %d requests per rate, prompt %d..%d tokens, output %d..%d "
               "tokens, vocab %d\n",
               model.id, addr, t.name, dataset, num_requests, lo, hi, olo, ohi, vocab);
    fflush(stdout);

    bench_run_cfg_t rcfg = {.num_requests = num_requests, .max_concurrency = max_conc, .ignore_eos = !no_ignore_eos,
                            .temperature = temperature, .seed = seed, .deadline = loom_now_s() + timeout_s,
                            .text_prompts = kind == BENCH_DS_MULTITURN && http, .chat = kind == BENCH_DS_MULTITURN};
    bench_report_cfg_t rep = {.backend = t.name, .endpoint = http ? endpoint ? endpoint
                                                                             : chat ? "/v1/chat/completions"
                                                                                    : "/v1/completions"
                                                                  : "loom.v1.Generate",
                              .model = model.id, .base_url = addr, .dataset = dataset, .num_requests = num_requests,
                              .max_concurrency = max_conc, .save_detailed = save_detailed, .prompt_len = prompt_len,
                              .output_len = output_len, .prompt_range = prompt_range, .output_range = output_range,
                              .temperature = temperature, .burstiness = burstiness, .seed = seed, .pcts = pcts,
                              .n_pcts = n_pcts, .percentile_metrics = pct_metrics, .goodput = &slo};
    bench_result_t *res = loom_xcalloc((size_t)n_rates, sizeof *res);
    bench_rec_t **kept = loom_xcalloc((size_t)n_rates, sizeof *kept);
    int *n_kept = loom_xcalloc((size_t)n_rates, sizeof *n_kept);
    double *arrivals = loom_xmalloc((size_t)n_arrivals * sizeof *arrivals);
    int rc = 0, any_failed = 0;
    for (int i = 0; i < n_rates; i++) {
        res[i].rate = rates[i];
        if (loom_now_s() >= rcfg.deadline) {
            res[i].skipped = 1;
            continue;
        }
        bench_arrivals(n_arrivals, rates[i], burstiness, seed, arrivals);
        bench_rec_t *recs = loom_xcalloc((size_t)num_requests, sizeof *recs);
        for (int k = 0; k < num_requests; k++) /* a chat's later turns are due when the turn before ends */
            recs[k] = (bench_rec_t){.item = &items[k],
                                    .t_arrival = kind == BENCH_DS_MULTITURN
                                                     ? (items[k].turn == 0 ? arrivals[items[k].session] : 0)
                                                     : arrivals[k]};
        double duration = 0;
        s = bench_run(&t, &rcfg, recs, num_requests, &res[i].peak_in_flight, &duration, &err);
        if (s == LOOM_OK) bench_compute(recs, num_requests, duration, pcts, n_pcts, &slo, &res[i]);
        if (s == LOOM_OK && save_detailed) {
            kept[i] = recs;
            n_kept[i] = num_requests;
        } else {
            bench_recs_reset(recs, num_requests);
            free(recs);
        }
        if (s < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            rc = 1;
            n_rates = i;
            break;
        }
        any_failed |= res[i].failed > 0;
        bench_print_result(&res[i], &rep);
    }
    t.close(t.self);
    if (sweep && n_rates > 0) bench_print_sweep(res, n_rates);
    if (json && n_rates > 0 &&
        bench_write_json(json, res, n_rates, sweep, &rep, save_detailed ? kept : NULL, n_kept) < 0)
        rc = 1;
    if (plot && n_rates > 0 && bench_write_plot(plot, res, n_rates, model.id) < 0) rc = 1;
    if (stage_plot && n_rates > 0 && bench_write_stage_plot(stage_plot, res, n_rates, model.id) < 0) rc = 1;
    for (int i = 0; i < n_rates; i++)
        if (kept[i]) {
            bench_recs_reset(kept[i], n_kept[i]);
            free(kept[i]);
        }
    free(kept);
    free(n_kept);
    free(arrivals);
    free(res);
    bench_dataset_free(items, num_requests);
    return rc ? rc : any_failed ? 1 : 0;
}

int loom_cmd_bench(int argc, char **argv) {
    char *joined = NULL;
    int n = 0;
    char **args = join_goodput_words(argc, argv, &n, &joined);
    int rc = loom_bench_main(n, args);
    free(args);
    free(joined);
    return rc;
}

#ifdef LOOM_BENCH_SERVE_MAIN
/* `loom_bench_serve ARGS` runs `loom bench ARGS`. */
int main(int argc, char **argv) {
    loom_log_init("loom-bench");
    char **args = loom_xcalloc((size_t)argc + 2, sizeof *args);
    args[0] = argv[0];
    args[1] = "bench";
    for (int i = 1; i < argc; i++) args[i + 1] = argv[i];
    int rc = loom_cmd_bench(argc + 1, args);
    free(args);
    return rc;
}
#endif
