/* loom-coordinator: plans the grid, waits for its workers, then serves the
 * client API (and, when asked, the HTTP gateway). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "coordinator/http.h"
#include "coordinator/server.h"
#include "kernels/quant.h"

static loom_server_t *g_server;

static void on_signal(int sig) {
    (void)sig;
    if (g_server) loom_server_stop(g_server);
}

int main(int argc, char **argv) {
    loom_log_init("coordinator");
    loom_server_config_t c = {.tp = 1, .pp = 1, .listen = "tcp://127.0.0.1:5555", .control = "tcp://127.0.0.1:5556",
                              .comm = "auto", .weight_dtype = "f32", .quantization = "none", .max_num_seqs = 64, .max_batched_tokens = 512,
                              .max_queue = 1024, .block_size = 16, .kv_fraction = 0.25f, .prefix_cache = 1,
                              .heartbeat_timeout_ms = 1500, .recovery_timeout_ms = 10000, .cluster = "default",
                              .etcd_ttl = 5};
    int shutdown_timeout_s = 30;
    c.kv_cache_dtype = "auto";
    int no_prefix = 0;
    const char *kv_mem = NULL;
    const char *env_key = getenv("LOOM_API_KEY");
    const char *http_bind = NULL, *chat_template = NULL;
    const char *log_format = NULL;
    int max_body = 2 << 20, http_conns = 256, http_timeout = 60;
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &c.model_dir, "DIR", "Hugging Face model directory (every worker reads it at this path)", 1, 0, NULL},
        {"tp", LOOM_OPT_INT, &c.tp, "N", "tensor-parallel ranks per pipeline stage (default 1)", 1, 64, NULL},
        {"pp", LOOM_OPT_INT, &c.pp, "M", "pipeline stages (default 1)", 1, 64, NULL},
        {"listen", LOOM_OPT_STR, &c.listen, "ADDR", "client API address (default tcp://127.0.0.1:5555)", 1, 0, NULL},
        {"control", LOOM_OPT_STR, &c.control, "ADDR", "address workers register at (default tcp://127.0.0.1:5556)", 1, 0, NULL},
        {"served-model-name", LOOM_OPT_STR, &c.model_name, "NAME", "model id clients use (default: the directory name)", 1, 0, NULL},
        {"comm", LOOM_OPT_STR, &c.comm, "KIND", "data plane: auto (shm on one host, else tcp), shm, tcp", 1, 0, NULL},
        {"dtype", LOOM_OPT_STR, &c.weight_dtype, "TYPE", "weight storage on workers: f32, bf16, f16 (default f32)", 1, 0, NULL},
        {"quantization", LOOM_OPT_STR, &c.quantization, "SCHEME", "quantize matmul weights on load: none, int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:128 (default none)", 1, 0, NULL},
        {"kv-cache-dtype", LOOM_OPT_STR, &c.kv_cache_dtype, "TYPE", "KV cache elements: auto (f32 on CPU, bf16 on CUDA), f32, bf16, int8 (CPU), fp8 (CUDA) (default auto)", 1, 0, NULL},
        {"max-num-seqs", LOOM_OPT_INT, &c.max_num_seqs, "N", "most running sequences (default 64)", 1, 4096, NULL},
        {"max-num-batched-tokens", LOOM_OPT_INT, &c.max_batched_tokens, "N", "most tokens per step (default 512)", 1, 1 << 20, NULL},
        {"max-queue", LOOM_OPT_INT, &c.max_queue, "N", "most waiting requests; beyond: RESOURCE_EXHAUSTED (default 1024)", 0, 1 << 24, NULL},
        {"max-model-len", LOOM_OPT_INT, &c.max_model_len, "N", "context length (default: the model's)", 0, 1 << 24, NULL},
        {"block-size", LOOM_OPT_INT, &c.block_size, "N", "KV cache block size in tokens (default 16)", 1, 1024, NULL},
        {"num-kv-blocks", LOOM_OPT_INT, &c.num_kv_blocks, "N", "KV blocks per worker (default: from memory)", 0, 1 << 28, NULL},
        {"kv-cache-memory", LOOM_OPT_STR, &kv_mem, "BYTES", "KV pool bytes per worker, e.g. 2G, 512M (default: --kv-fraction)", 1, 0, NULL},
        {"kv-fraction", LOOM_OPT_FLOAT, &c.kv_fraction, "F", "fraction of the memory left after weights for KV, shared by a host's workers (default 0.25)", 0.0001, 1, NULL},
        {"no-prefix-cache", LOOM_OPT_FLAG, &no_prefix, NULL, "disable automatic prefix caching", 1, 0, NULL},
        {"heartbeat-timeout-ms", LOOM_OPT_INT, &c.heartbeat_timeout_ms, "MS", "declare a silent worker lost after this long (default 1500)", 200, 600000, NULL},
        {"recovery-timeout-ms", LOOM_OPT_INT, &c.recovery_timeout_ms, "MS", "requests wait this long for a failed grid to be restored, then end with UNAVAILABLE; 0: at once (default 10000: longer than a lost worker's detection plus a spare's registration and load)", 0, 86400000, NULL},
        {"shutdown-timeout", LOOM_OPT_INT, &shutdown_timeout_s, "S", "on SIGTERM/SIGINT: refuse new requests and let those in flight run this long; then their streams end (finish_reason length) and the coordinator exits; a second signal exits at once (default 30)", 0, 86400, NULL},
        {"api-key", LOOM_OPT_STR, &c.api_key, "KEY", "require this key in every request (or set LOOM_API_KEY)", 1, 0, NULL},
        {"ready-file", LOOM_OPT_STR, &c.ready_file, "FILE", "write the API address here once the grid is ready", 1, 0, NULL},
        {"etcd", LOOM_OPT_STR, &c.etcd_url, "URL", "publish membership in etcd, e.g. http://127.0.0.1:2379 (workers can then find this coordinator)", 1, 0, NULL},
        {"cluster", LOOM_OPT_STR, &c.cluster, "NAME", "cluster name in etcd: keys under /loom/NAME/ (default 'default')", 1, 0, NULL},
        {"etcd-ttl", LOOM_OPT_INT, &c.etcd_ttl, "S", "etcd lease TTL in seconds (default 5)", 1, 3600, NULL},
        {"advertise-host", LOOM_OPT_STR, &c.advertise_host, "HOST", "host name others dial, published in etcd when --listen/--control bind 0.0.0.0", 1, 0, NULL},
        {"kv-events", LOOM_OPT_STR, &c.kv_events, "ADDR", "publish prefix-cache events (blocks cached and evicted) and load for loom-router on a ZeroMQ PUB socket here, e.g. tcp://127.0.0.1:5557 (port 0: any free port; routers learn it from Stats) (default off)", 1, 0, NULL},
        {"http", LOOM_OPT_STR, &http_bind, "HOST:PORT", "also serve the OpenAI-compatible HTTP API, /health and /metrics here, e.g. 127.0.0.1:8000 (port 0: any free port; default off)", 1, 0, NULL},
        {"chat-template", LOOM_OPT_STR, &chat_template, "NAME", "chat template for /v1/chat/completions: llama2, llama3, chatml, mistral (default: the model's)", 1, 0, NULL},
        {"max-body-bytes", LOOM_OPT_INT, &max_body, "N", "largest HTTP request body; larger gets 413 (default 2097152)", 1024, 1 << 30, NULL},
        {"http-max-connections", LOOM_OPT_INT, &http_conns, "N", "most simultaneous HTTP connections, one thread each (default 256)", 1, 65536, NULL},
        {"log-format", LOOM_OPT_STR, &log_format, "FMT", "log lines as text or json (one object per line: ts, level, component, msg, request_id) (default text, or LOOM_LOG_FORMAT)", 1, 0, NULL},
        {"http-timeout-s", LOOM_OPT_INT, &http_timeout, "S", "close an HTTP connection idle this long, e.g. a client that stops sending (default 60)", 1, 86400, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "loom-coordinator --model DIR --tp N --pp M [options]",
                           "The Loom coordinator: waits for tp x pp workers to register, plans the grid (layer ranges\n"
                           "per stage, heads per rank), assigns shards, and serves the client API with continuous\n"
                           "batching over a paged KV cache.");
    if (r) return r < 0 ? 2 : 0;
    if (log_format && loom_log_set_format_name(log_format) < 0) {
        fprintf(stderr, "error: --log-format must be text or json, got '%s'\n", log_format);
        return 2;
    }
    if (!c.model_dir) {
        fprintf(stderr, "error: --model is required (see --help)\n");
        return 2;
    }
    if (strcmp(c.comm, "auto") && strcmp(c.comm, "shm") && strcmp(c.comm, "tcp") && strcmp(c.comm, "nccl")) {
        fprintf(stderr, "error: --comm must be auto, shm, tcp or nccl, got '%s'\n", c.comm);
        return 2;
    }
    if (strcmp(c.weight_dtype, "f32") && strcmp(c.weight_dtype, "bf16") && strcmp(c.weight_dtype, "f16")) {
        fprintf(stderr, "error: --dtype must be f32, bf16 or f16, got '%s'\n", c.weight_dtype);
        return 2;
    }
    loom_quant_spec_t quant;
    if (!loom_quant_spec_parse(c.quantization, &quant)) {
        fprintf(stderr, "error: --quantization must be none, int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:64 or q4_min:128, got '%s'\n", c.quantization);
        return 2;
    }
    if (strcmp(c.kv_cache_dtype, "auto") && strcmp(c.kv_cache_dtype, "f32") && strcmp(c.kv_cache_dtype, "bf16") &&
        strcmp(c.kv_cache_dtype, "int8") && strcmp(c.kv_cache_dtype, "fp8")) {
        fprintf(stderr, "error: --kv-cache-dtype must be auto, f32, bf16, int8 or fp8, got '%s'\n", c.kv_cache_dtype);
        return 2;
    }
    if (kv_mem) {
        char *end;
        double v = strtod(kv_mem, &end);
        double mul = *end == 'G' || *end == 'g' ? 1e9 : *end == 'M' || *end == 'm' ? 1e6 : *end == 'K' || *end == 'k' ? 1e3 : 1;
        if (v <= 0 || (*end && end[1]) || (*end && mul == 1)) {
            fprintf(stderr, "error: --kv-cache-memory expects bytes like 512M or 2G, got '%s'\n", kv_mem);
            return 2;
        }
        c.kv_memory = (uint64_t)(v * mul);
    }
    c.prefix_cache = !no_prefix;
    c.shutdown_timeout_ms = shutdown_timeout_s * 1000;
    if (!c.api_key && env_key && env_key[0]) c.api_key = env_key;
    if (c.max_batched_tokens < c.max_num_seqs) c.max_batched_tokens = c.max_num_seqs;

    if (chat_template && !http_bind) {
        fprintf(stderr, "error: --chat-template only matters with --http\n");
        return 2;
    }

    loom_err_t err = {0};
    signal(SIGPIPE, SIG_IGN);
    if (loom_server_create(&c, &g_server, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    loom_http_t *http = NULL;
    if (http_bind) {
        loom_http_config_t hc = {.bind = http_bind, .api_key = c.api_key, .model_dir = c.model_dir,
                                 .chat_template = chat_template, .max_body_bytes = (size_t)max_body,
                                 .max_connections = http_conns, .idle_timeout_s = http_timeout};
        if (loom_http_start(g_server, &hc, &http, &err) < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            loom_server_destroy(&g_server);
            return 1;
        }
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    int rc = loom_server_run(g_server);
    loom_http_drain(http, 2000); /* let the gateway deliver the last events of its streams */
    loom_http_stop(&http); /* before the server: its ZeroMQ context waits for the gateway's clients */
    loom_server_destroy(&g_server);
    return rc;
}
