/* loom-router: a loom.v1 endpoint (and, with --http, the OpenAI-compatible
 * gateway) in front of many replicas, routing by cached prefix and load. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "common/reasoning.h"
#include "gateway/http.h"
#include "gateway/tool_calls.h"
#include "router/probe.h"
#include "router/router.h"

#define MAX_STATIC 64

static loom_router_t *g_router;

static void on_signal(int sig) {
    (void)sig;
    if (g_router) loom_router_stop(g_router);
}

int main(int argc, char **argv) {
    loom_log_init("router");
    loom_router_config_t c = {.listen = "tcp://127.0.0.1:5550",
                              .cluster = "default",
                              .max_retries = 3,
                              .probe_interval_ms = 200,
                              .replica_timeout_ms = 1500,
                              .stall_timeout_ms = 30000,
                              .request_timeout_ms = 600000,
                              .lambda = 1.0,
                              .tier_token_cost = 0.05,
                              .index_capacity = 1 << 18,
                              .tokenizer_threads = 2,
                              .pd_min_prompt_tokens = 64};
    /* --replica is repeatable: take them out before the table parse */
    const char *replicas[MAX_STATIC], *prefills[MAX_STATIC];
    int n_rep = 0, n_pre = 0;
    char **args = loom_xcalloc((size_t)argc + 1, sizeof *args);
    int nargs = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        /* --replica and --prefill-replica, each as "--x ADDR" or "--x=ADDR" */
        int pre = i > 0 && !strncmp(a, "--prefill-replica", 17) && (a[17] == 0 || a[17] == '=');
        int bare = pre ? a[17] == 0 : i > 0 && !strcmp(a, "--replica");
        int eq = pre ? a[17] == '=' : i > 0 && !strncmp(a, "--replica=", 10);
        if (bare) {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: --%sreplica needs an address\n", pre ? "prefill-" : "");
                free(args);
                return 2;
            }
            a = argv[++i];
        } else if (eq) {
            a = strchr(a, '=') + 1;
        } else {
            args[nargs++] = argv[i];
            continue;
        }
        if (pre && n_pre < MAX_STATIC) {
            if (strncmp(a, "tcp://", 6) && strncmp(a, "ipc://", 6)) {
                fprintf(stderr, "error: --prefill-replica expects tcp://HOST:PORT or ipc://PATH, got '%s'\n", a);
                free(args);
                return 2;
            }
            prefills[n_pre++] = a;
            continue;
        }
        if (n_rep == MAX_STATIC || pre) {
            fprintf(stderr, "error: at most %d --replica\n", MAX_STATIC);
            free(args);
            return 2;
        }
        if (strncmp(a, "tcp://", 6) && strncmp(a, "ipc://", 6)) {
            fprintf(stderr, "error: --replica expects tcp://HOST:PORT or ipc://PATH, got '%s'\n",
                    a);
            free(args);
            return 2;
        }
        replicas[n_rep++] = a;
    }
    const char *policy = "prefix", *http_bind = NULL, *chat_template = NULL, *log_format = NULL,
               *dummy = NULL, *tool_parser = NULL, *reasoning_parser = NULL, *probe_bind = NULL;
    int trust_request_template = 0;
    const char *env_key = getenv("LOOM_API_KEY"), *env_replica_key = getenv("LOOM_REPLICA_API_KEY");
    float lambda = 1.0f, tier_cost = 0.05f;
    int pd = 0;
    uint64_t cache_bytes = 0;
    int cache_ttl_s = 300;
    int max_body = 2 << 20, http_conns = 256, http_timeout = 60;
    int responses_store = 1024, responses_store_mb = 64;
    loom_opt_t opts[] = {
        {"listen", LOOM_OPT_STR, &c.listen, "ADDR",
         "client API address (default tcp://127.0.0.1:5550)", 1, 0, NULL},
        {"replica", LOOM_OPT_STR, &dummy, "ADDR",
         "a replica's client API, tcp://HOST:PORT (repeatable)", 1, 0, NULL},
        {"pd", LOOM_OPT_FLAG, &pd, NULL,
         "prefill/decode disaggregation: each request's prefill runs on a --prefill-replica (max_tokens 1, "
         "kv_transfer_params do_remote_decode), then the request goes to a --replica with the params it "
         "answered, which loads the prompt's blocks instead of computing them; with --etcd, the replicas "
         "registered with --kv-transfer-config kv_role kv_producer prefill (docs/disaggregation.md)",
         1, 0, NULL},
        {"prefill-replica", LOOM_OPT_STR, &dummy, "ADDR",
         "--pd: a prefill replica's client API (repeatable); the --replica ones decode", 1, 0, NULL},
        {"pd-min-prompt-tokens", LOOM_OPT_INT, &c.pd_min_prompt_tokens, "N",
         "--pd: prompts shorter than this (known with --model) skip the prefill replicas (default 64)", 0,
         1 << 24, NULL},
        {"etcd", LOOM_OPT_STR, &c.etcd_url, "URL",
         "also take replicas from etcd: the coordinators of clusters NAME, NAME-* and NAME/* (see "
         "--cluster); they join and leave as they come and go",
         1, 0, NULL},
        {"cluster", LOOM_OPT_STR, &c.cluster, "NAME",
         "replica clusters' name in etcd (default 'default')", 1, 0, NULL},
        {"model", LOOM_OPT_STR, &c.model_dir, "DIR",
         "the model's directory, for its tokenizer: prefix routing on the replicas' block hashes, "
         "and continuing a stream on another replica when one fails (without it: prefix routing on "
         "text, failover before the first token only)",
         1, 0, NULL},
        {"served-model-name", LOOM_OPT_STR, &c.model_name, "NAME",
         "the model id every replica must serve; others are refused at join (default: the --model "
         "directory's name, else the first replica's)",
         1, 0, NULL},
        {"policy", LOOM_OPT_STR, &policy, "NAME",
         "prefix (cached prefix against load), round-robin, least-loaded, session (requests with "
         "the same session key -- loom.v1 session, HTTP X-Session-Id or the OpenAI user field, "
         "else the tag -- stick to one replica) (default prefix)",
         1, 0, NULL},
        {"prefix-lambda", LOOM_OPT_FLOAT, &lambda, "W",
         "prefix policy: tokens of load worth one uncached prompt token (default 1)", 0, 1000,
         NULL},
        {"prefix-tier-cost", LOOM_OPT_FLOAT, &tier_cost, "F",
         "prefix policy: a prompt token a replica reads from its KV offload tier, as a fraction of "
         "computing it (default 0.05)",
         0, 1, NULL},
        {"max-retries", LOOM_OPT_INT, &c.max_retries, "N",
         "re-sends of a request to other replicas when its replica fails (default 3)", 0, 64, NULL},
        {"probe-interval-ms", LOOM_OPT_INT, &c.probe_interval_ms, "MS",
         "Health and Stats to each replica this often (default 200)", 10, 60000, NULL},
        {"replica-timeout-ms", LOOM_OPT_INT, &c.replica_timeout_ms, "MS",
         "a replica silent this long is down: its streams move on (default 1500)", 50, 600000,
         NULL},
        {"stall-timeout-ms", LOOM_OPT_INT, &c.stall_timeout_ms, "MS",
         "a stream with no chunk for this long moves to another replica (default 30000)", 100,
         86400000, NULL},
        {"request-timeout-ms", LOOM_OPT_INT, &c.request_timeout_ms, "MS",
         "no request lives longer: DEADLINE_EXCEEDED (default 600000)", 100, 86400000, NULL},
        {"prefix-index-blocks", LOOM_OPT_INT, &c.index_capacity, "N",
         "block hashes the prefix index keeps, about 40 bytes each (default 262144)", 16, 1 << 28,
         NULL},
        {"tokenizer-threads", LOOM_OPT_INT, &c.tokenizer_threads, "N",
         "threads that tokenize prompts, off the reactor (0: the reactor does; default 2)", 0, 16,
         NULL},
        {"response-cache-bytes", LOOM_OPT_U64, &cache_bytes, "N",
         "keep whole answers of deterministic requests (temperature 0, or a seed) in a cache of at "
         "most N bytes, and answer the same request again from it; a request opts out with "
         "no_cache (HTTP: Cache-Control: no-cache, or \"loom_cache\": false) (default 0: no cache)",
         0, (double)(1ll << 40), NULL},
        {"response-cache-ttl", LOOM_OPT_INT, &cache_ttl_s, "S",
         "a cached answer lives this long (0: until evicted; default 300)", 0, 86400 * 7, NULL},
        {"tenants", LOOM_OPT_STR, &c.tenants_path, "FILE",
         "per-API-key limits, JSON: {\"default\": {LIMITS}, \"tenants\": {\"KEY\": {\"name\": N, "
         "LIMITS}}} with LIMITS requests_per_s, burst, tokens_per_min, max_concurrent; over a limit: "
         "RESOURCE_EXHAUSTED (HTTP 429) with a retry-after. Keys listed are accepted as API keys",
         1, 0, NULL},
        {"api-key", LOOM_OPT_STR, &c.api_key, "KEY",
         "require this key from clients (or set LOOM_API_KEY)", 1, 0, NULL},
        {"replica-api-key", LOOM_OPT_STR, &c.replica_api_key, "KEY",
         "send this key to the replicas (or set LOOM_REPLICA_API_KEY)", 1, 0, NULL},
        {"replica-server-key", LOOM_OPT_STR, &c.replica_server_key, "KEY",
         "the replicas' coordinator public key (a file or the Z85 key; or LOOM_REPLICA_SERVER_KEY): the "
         "router is then a CURVE client of every replica, its KV events too; needs --replica-secret",
         1, 0, NULL},
        {"replica-secret", LOOM_OPT_STR, &c.replica_secret, "KEY",
         "the router's own CURVE secret key towards replicas (from 'loom keygen'; or "
         "LOOM_REPLICA_SECRET); its public key must be in each replica coordinator's --client-keys",
         1, 0, NULL},
        {"curve-secret", LOOM_OPT_STR, &c.curve_secret, "FILE",
         "the router's CURVE secret key as the server of --listen (or LOOM_CURVE_SECRET: a file or the "
         "Z85 key); needs --client-keys",
         1, 0, NULL},
        {"client-keys", LOOM_OPT_STR, &c.client_keys, "FILE",
         "allow-list of client public keys ('NAME KEY' lines): --listen then takes only these clients, "
         "encrypted (or LOOM_CLIENT_KEYS); required when --listen is not a loopback address",
         1, 0, NULL},
        {"insecure-api", LOOM_OPT_FLAG, &c.insecure_api, NULL,
         "serve a --listen bound to a non-loopback address without client keys (anyone who reaches it "
         "may use it)",
         1, 0, NULL},
        {"probe-listen", LOOM_OPT_STR, &probe_bind, "HOST:PORT",
         "serve GET /health (liveness: the reactor turns) and /ready (a replica is up) here, on a socket and thread "
         "of their own: probes stay answered while the traffic ports are flooded (docs/operations.md)",
         1, 0, NULL},
        {"http", LOOM_OPT_STR, &http_bind, "HOST:PORT",
         "also serve the OpenAI-compatible HTTP API, /health and /metrics here (port 0: any free "
         "port)",
         1, 0, NULL},
        {"chat-template", LOOM_OPT_STR, &chat_template, "FILE|NAME",
         "Jinja chat template for /v1/chat/completions: a file, its text, or a template Loom ships "
         "(chatml) (default: the model's; needs --model)",
         1, 0, NULL},
        {"trust-request-chat-template", LOOM_OPT_FLAG, &trust_request_template, NULL,
         "render a request's own chat_template (default: refused with 400)", 1, 0, NULL},
        {"tool-call-parser", LOOM_OPT_STR, &tool_parser, "NAME",
         "the model's tool-call syntax: " LOOM_TOOL_PARSER_NAMES " (default: detected from the chat template)",
         1, 0, NULL},
        {"reasoning-parser", LOOM_OPT_STR, &reasoning_parser, "NAME",
         "split the reasoning off chat answers: " LOOM_REASONING_PARSER_NAMES " (default: none)", 1, 0, NULL},
        {"max-body-bytes", LOOM_OPT_INT, &max_body, "N",
         "largest HTTP request body; larger gets 413 (default 2097152)", 1024, 1 << 30, NULL},
        {"responses-store", LOOM_OPT_INT, &responses_store, "N",
         "/v1/responses: stored responses kept for previous_response_id and GET /v1/responses/{id}, least "
         "recently used dropped first (default 1024; 0: none stored)",
         0, 1 << 20, NULL},
        {"responses-store-mb", LOOM_OPT_INT, &responses_store_mb, "MB",
         "and at most this many MiB of them (default 64)", 1, 1 << 20, NULL},
        {"http-max-connections", LOOM_OPT_INT, &http_conns, "N",
         "most simultaneous HTTP connections (default 256)", 1, 65536, NULL},
        {"http-timeout-s", LOOM_OPT_INT, &http_timeout, "S",
         "close an HTTP connection idle this long (default 60)", 1, 86400, NULL},
        {"log-format", LOOM_OPT_STR, &log_format, "FMT",
         "log lines as text or json (default text, or LOOM_LOG_FORMAT)", 1, 0, NULL},
    };
    int r = loom_cli_parse(
        nargs, args, 1, opts, (int)LOOM_ARRAY_LEN(opts),
        "loom-router --replica ADDR [--replica ADDR ...] | --etcd URL --cluster NAME [options]",
        "The Loom router: one client endpoint (loom.v1 over ZeroMQ, and OpenAI HTTP with --http) "
        "in\n"
        "front of many replicas, each a coordinator with its grid. Routes by cached prefix and "
        "load\n"
        "(or round robin, least loaded, session), and moves a stream to another replica when its\n"
        "replica fails. See docs/scale-out.md.");
    if (r) {
        free(args);
        return r < 0 ? 2 : 0;
    }
    free(args);
    if (log_format && loom_log_set_format_name(log_format) < 0) {
        fprintf(stderr, "error: --log-format must be text or json, got '%s'\n", log_format);
        return 2;
    }
    int p = loom_policy_parse(policy);
    if (p < 0) {
        fprintf(stderr,
                "error: --policy must be prefix, round-robin, least-loaded or session, got '%s'\n",
                policy);
        return 2;
    }
    c.policy = (loom_policy_t)p;
    c.response_cache_bytes = (size_t)cache_bytes;
    c.response_cache_ttl_ms = cache_ttl_s * 1000;
    c.lambda = lambda;
    c.tier_token_cost = tier_cost;
    if (!n_rep && !c.etcd_url) {
        fprintf(stderr, "error: give replicas with --replica ADDR or --etcd URL (see --help)\n");
        return 2;
    }
    c.replicas = replicas;
    c.n_replicas = n_rep;
    if (pd ? !n_pre && !c.etcd_url : n_pre > 0) {
        fprintf(stderr, "error: %s\n", pd ? "--pd needs a --prefill-replica, or --etcd (whose replicas with kv_role "
                                              "kv_producer prefill)"
                                         : "--prefill-replica is for --pd (prefill/decode disaggregation)");
        return 2;
    }
    c.pd = pd;
    c.prefill_replicas = prefills;
    c.n_prefill_replicas = n_pre;
    if (!c.api_key && env_key && env_key[0]) c.api_key = env_key;
    if (!c.replica_api_key && env_replica_key && env_replica_key[0]) c.replica_api_key = env_replica_key;
    if ((chat_template || tool_parser || reasoning_parser) && !http_bind) {
        fprintf(stderr, "error: --chat-template, --tool-call-parser and --reasoning-parser only matter with --http\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    loom_err_t err = {0};
    if (loom_router_create(&c, &g_router, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    loom_http_t *http = NULL;
    if (http_bind) {
        loom_http_endpoint_t ep = {.zmq_context = loom_router_zmq_context(g_router),
                                   .inproc_addr = loom_router_inproc_addr(g_router),
                                   .metrics = loom_router_metrics,
                                   .metrics_ctx = g_router};
        loom_http_config_t hc = {.bind = http_bind,
                                 .api_key = c.api_key,
                                 .model_dir = c.model_dir,
                                 .chat_template = chat_template,
                                 .trust_request_chat_template = trust_request_template,
                                 .tool_call_parser = tool_parser,
                                 .reasoning_parser = reasoning_parser,
                                 .max_body_bytes = (size_t)max_body,
                                 .max_connections = http_conns,
                                 .idle_timeout_s = http_timeout,
                                 .forward_api_keys = c.tenants_path != NULL,
                                 .responses_store_max = responses_store ? responses_store : -1,
                                 .responses_store_bytes = (size_t)responses_store_mb << 20};
        if (loom_http_start_at(&ep, &hc, &http, &err) < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            loom_router_destroy(&g_router);
            return 1;
        }
    }
    loom_probe_t *probe = NULL;
    if (probe_bind && loom_probe_start(probe_bind, loom_router_probe_state, g_router, &probe, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        loom_http_stop(&http);
        loom_router_destroy(&g_router);
        return 1;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    int rc = loom_router_run(g_router);
    loom_http_drain(http, 2000);
    loom_http_stop(&http);
    loom_probe_stop(&probe);
    loom_router_destroy(&g_router);
    return rc;
}
