/* loom-coordinator: plans the grid, waits for its workers, then serves the
 * client API (and, when asked, the HTTP gateway). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/chat_template.h"
#include "common/reasoning.h"
#include "gateway/tool_calls.h"
#include "common/cli.h"
#include "common/cpu_check.h"
#include "common/endpoint.h"
#include "common/gen_defaults.h"
#include "common/etcd.h"
#include "common/log.h"
#include "common/model_config_deepseek.h"
#include "common/util.h"
#include "coordinator/gateway.h"
#include "coordinator/lora_serve.h"
#include "coordinator/server.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/quant.h"

static loom_server_t *g_server;

static void on_signal(int sig) {
    (void)sig;
    if (g_server) loom_server_stop(g_server);
}

/* vLLM's spellings (--tensor-parallel-size, --host/--port, ...) next to
 * Loom's own; see docs/operations.md for the table. */
typedef struct {
    int prefix_on, prefix_off, port, seed_seen;
    const char *host, *log_level, *generation_config;
} vllm_opts_t;

static int vllm_apply(vllm_opts_t *v, loom_server_config_t *c, int *no_prefix, const char **http_bind, char *bind_buf,
                      size_t bind_n,
                      loom_gen_defaults_t *gen, int *has_gen) {
    if (v->prefix_on && v->prefix_off) {
        fprintf(stderr, "error: --enable-prefix-caching and --no-enable-prefix-caching contradict each other\n");
        return -1;
    }
    if (v->prefix_off) *no_prefix = 1;
    if (v->prefix_on) *no_prefix = 0;
    c->has_seed = v->seed_seen;
    if (v->log_level) {
        static const struct { const char *name; loom_log_level_t level; } k_levels[] = {
            {"trace", LOOM_LOG_DEBUG}, {"debug", LOOM_LOG_DEBUG},  {"info", LOOM_LOG_INFO},   {"warning", LOOM_LOG_WARN},
            {"warn", LOOM_LOG_WARN},   {"error", LOOM_LOG_ERROR}, {"critical", LOOM_LOG_ERROR}, {"off", LOOM_LOG_OFF}};
        int found = 0;
        for (size_t i = 0; i < LOOM_ARRAY_LEN(k_levels); i++)
            if (!strcmp(v->log_level, k_levels[i].name)) loom_log_set_level(k_levels[i].level), found = 1;
        if (!found) {
            fprintf(stderr, "error: --log-level must be debug, info, warning, error, critical or off, got '%s'\n",
                    v->log_level);
            return -1;
        }
    }
    if (v->host || v->port >= 0) {
        if (*http_bind) {
            fprintf(stderr, "error: give --http HOST:PORT or --host/--port, not both\n");
            return -1;
        }
        const char *h = v->host ? v->host : "127.0.0.1";
        snprintf(bind_buf, bind_n, strchr(h, ':') && h[0] != '[' ? "[%s]:%d" : "%s:%d", h, v->port >= 0 ? v->port : 8000);
        *http_bind = bind_buf;
    }
    /* --generation-config auto (the model's generation_config.json), vllm (built-in defaults) or DIR */
    const char *gc = v->generation_config ? v->generation_config : "auto";
    *has_gen = 0;
    if (strcmp(gc, "vllm") != 0) {
        loom_err_t e = {0};
        if (loom_gen_defaults_load(!strcmp(gc, "auto") ? c->model_dir : gc, gen, &e) < 0) {
            fprintf(stderr, "error: --generation-config: %s\n", e.msg);
            return -1;
        }
        *has_gen = 1;
        if (gen->ignored[0]) LOOM_WARN("generation_config.json: %s not applied (Loom has no such sampling option)", gen->ignored);
    }
    return 0;
}

int main(int argc, char **argv) {
    loom_cpu_check_or_exit("loom-coordinator");
    for (int i = 1; i < argc; i++) /* a draft model runs here (coordinator/draft.h): the BLAS core matters */
        if (strcmp(argv[i], "draft") == 0 || strcmp(argv[i], "--speculative-method=draft") == 0) {
            loom_cpu_blas_check(argv); /* it may re-execute */
            break;
        }
    loom_log_init("coordinator");
    loom_server_config_t c = {.tp = 1, .pp = 1, .listen = "tcp://127.0.0.1:5555", .control = "tcp://127.0.0.1:5556",
                              .comm = "auto", .weight_dtype = "f32", .quantization = "none", .max_num_seqs = 64, .max_batched_tokens = 512,
                              .max_queue = 1024, .block_size = 16, .kv_fraction = 0.25f, .prefix_cache = 1,
                              .heartbeat_timeout_ms = 1500, .step_timeout_ms = 30000, .step_token_us = 100000,
                              .liveness_timeout_ms = 10000, .prepare_threads = 2, .kv_offload_prefetch_timeout_ms = 50,
                              .grammar_compile_timeout_ms = 30000, .grammar_max_bytes = 256ull << 20,
                              .grammar_cache_bytes = 1ull << 30, .recovery_timeout_ms = 10000, .cluster = "default",
                              .etcd_ttl = 5};
    int shutdown_timeout_s = 30;
    c.kv_cache_dtype = "auto";
    c.mla_disable = loom_mla_disable_env(); /* vLLM's VLLM_MLA_DISABLE; --disable-mla sets it too */
    int no_prefix = 0;
    int async_flag = 0, async_steps = 0;
    const char *kv_mem = NULL;
    float offload_gb = 10;
    float host_gib = 0;
    const char *offload_backend = NULL;
    const char *kv_transfer = NULL;
    const char *env_key = getenv("LOOM_API_KEY");
    const char *http_bind = NULL, *chat_template = NULL, *tool_parser = NULL, *reasoning_parser = NULL;
    int trust_request_template = 0, auto_tool_choice = 0;
    const char *log_format = NULL;
    int max_body = 2 << 20, http_conns = 256, http_timeout = 60;
    int responses_store = 1024, responses_store_mb = 64;
    vllm_opts_t vo = {.port = -1};
    const char *probe_bind = NULL, *tls_cert = NULL, *tls_key = NULL, *ssl_ciphers = NULL;
    const char *pooling = NULL;
    int header_timeout = 10, body_timeout = 60, conns_per_ip = 0, special_in_content = 0;
    loom_etcd_security_t etcd_sec = {0};
    const char *spec_method = "none";
    int spec_k = 0, ngram_min = 1, ngram_max = 4, spec_fixed = 0; /* spec_k 0: not given (4) */
    loom_opt_t opts[] = {
        {"speculative-method", LOOM_OPT_STR, &spec_method, "METHOD",
         "speculative decoding: none (default), ngram (prompt lookup), draft "
         "(--speculative-model / --speculative-quantization, run in this process) or mtp (a DeepSeek "
         "checkpoint's MTP module, run on the last stage's workers); same output "
         "either way (docs/speculative.md)",
         1, 0, NULL},
        {"speculative-model", LOOM_OPT_STR, &c.spec_model, "DIR",
         "method draft: a smaller model with the same vocabulary (default: the target itself)", 1,
         0, NULL},
        {"speculative-quantization", LOOM_OPT_STR, &c.spec_quantization, "SCHEME",
         "method draft: quantize the draft on load (int8, q4, ...): with no --speculative-model, a "
         "quantized self-draft",
         1, 0, NULL},
        {"speculative-max-seqs", LOOM_OPT_INT, &c.spec_max_seqs, "N",
         "method draft: sequences drafted for at once, each with its own draft KV (default 8)", 1,
         256, NULL},
        {"speculative-threads", LOOM_OPT_INT, &c.spec_threads, "N",
         "method draft: CPU threads of the draft's forwards (default 1)", 1, 256, NULL},
        {"speculative-device", LOOM_OPT_STR, &c.spec_device, "DEVICE",
         "method draft: where the draft runs in this process, cpu (default) or cuda:N", 1, 0, NULL},
        {"num-speculative-tokens", LOOM_OPT_INT, &spec_k, "K",
         "most drafted tokens verified per sequence per step, 1..16 (default 4; adapted to the "
         "acceptance)",
         1, LOOM_SPEC_MAX_K, NULL},
        {"speculative-fixed-k", LOOM_OPT_FLAG, &spec_fixed, NULL,
         "always draft K tokens: no adaptive K, no wall-time gate (for measurements and tests)", 1,
         0, NULL},
        {"ngram-min", LOOM_OPT_INT, &ngram_min, "N",
         "shortest suffix the ngram drafter looks up (default 1)", 1, 64, NULL},
        {"ngram-max", LOOM_OPT_INT, &ngram_max, "N",
         "longest suffix the ngram drafter looks up (default 4)", 1, 64, NULL},
        {"model", LOOM_OPT_STR, &c.model_dir, "DIR",
         "Hugging Face model directory (every worker reads it at this path)", 1, 0, NULL},
        {"tp", LOOM_OPT_INT, &c.tp, "N", "tensor-parallel ranks per pipeline stage (default 1)", 1,
         64, NULL},
        {"pp", LOOM_OPT_INT, &c.pp, "M", "pipeline stages (default 1)", 1, 64, NULL},
        {"listen", LOOM_OPT_STR, &c.listen, "ADDR",
         "client API address (default tcp://127.0.0.1:5555)", 1, 0, NULL},
        {"control", LOOM_OPT_STR, &c.control, "ADDR",
         "address workers register at (default tcp://127.0.0.1:5556)", 1, 0, NULL},
        {"served-model-name", LOOM_OPT_STR, &c.model_name, "NAME",
         "model id clients use (default: the directory name)", 1, 0, NULL},
        {"comm", LOOM_OPT_STR, &c.comm, "KIND",
         "data plane: auto (shm on one host, else tcp), shm, tcp", 1, 0, NULL},
        {"dtype", LOOM_OPT_STR, &c.weight_dtype, "TYPE",
         "weight storage on workers: f32, bf16, f16, or vLLM's float32, bfloat16, float16/half, "
         "auto (= f32) (default f32)",
         1, 0, NULL},
        {"expert-parallel", LOOM_OPT_FLAG, &c.expert_parallel, NULL,
         "Mixture-of-Experts layers: each TP rank of a stage holds whole experts (num_experts / tp "
         "of them) instead of a slice of every expert; attention stays sliced",
         1, 0, NULL},
        {"enable-expert-parallel", LOOM_OPT_FLAG, &c.expert_parallel, NULL,
         "vLLM's name for --expert-parallel", 1, 0, NULL},
        {"enable-dp-attention", LOOM_OPT_FLAG, &c.dp_attention, NULL,
         "DeepSeek (MLA): each TP rank of a stage holds the whole attention block and runs it for its own "
         "sequences only, its KV pool holding only their latent blocks (tp times the sequences of a "
         "replicated latent); implies --expert-parallel. Not with --tp 1 (ignored), the KV offload tiers, "
         "MTP speculation or LoRA",
         1, 0, NULL},
        {"disable-mla", LOOM_OPT_FLAG, &c.mla_disable, NULL,
         "DeepSeek: the workers cache decompressed keys (nope + rope) and values (v_head_dim) per head, their "
         "heads split across TP ranks, and run ordinary attention instead of the latent (vLLM's "
         "VLLM_MLA_DISABLE; env LOOM_MLA_DISABLE=1). CPU workers; not with --enable-dp-attention or MTP "
         "speculation",
         1, 0, NULL},
        {"quantization", LOOM_OPT_STR, &c.quantization, "SCHEME",
         "quantize matmul weights on load: none, int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:128 "
         "(default none)",
         1, 0, NULL},
        {"kv-cache-dtype", LOOM_OPT_STR, &c.kv_cache_dtype, "TYPE",
         "KV cache elements: auto (f32 on CPU, bf16 on CUDA), f32, bf16, int8 (CPU), fp8 (CUDA; "
         "vLLM's fp8_e4m3 too) (default auto)",
         1, 0, NULL},
        {"max-num-seqs", LOOM_OPT_INT, &c.max_num_seqs, "N", "most running sequences (default 64)",
         1, 4096, NULL},
        {"max-num-batched-tokens", LOOM_OPT_INT, &c.max_batched_tokens, "N",
         "most tokens per step (default 512)", 1, 1 << 20, NULL},
        {"max-queue", LOOM_OPT_INT, &c.max_queue, "N",
         "most waiting requests; beyond: RESOURCE_EXHAUSTED (default 1024)", 0, 1 << 24, NULL},
        {"max-model-len", LOOM_OPT_INT, &c.max_model_len, "N",
         "context length (default: the model's)", 0, 1 << 24, NULL},
        {"block-size", LOOM_OPT_INT, &c.block_size, "N",
         "KV cache block size in tokens (default 16)", 1, 1024, NULL},
        {"num-kv-blocks", LOOM_OPT_INT, &c.num_kv_blocks, "N",
         "KV blocks per worker (default: from memory)", 0, 1 << 28, NULL},
        {"kv-cache-memory", LOOM_OPT_STR, &kv_mem, "BYTES",
         "KV pool bytes per worker, e.g. 2G, 512M (default: --kv-fraction)", 1, 0, NULL},
        {"kv-fraction", LOOM_OPT_FLOAT, &c.kv_fraction, "F",
         "fraction of the memory left after weights for KV, shared by a host's workers (default "
         "0.25)",
         0.0001, 1, NULL},
        {"no-prefix-cache", LOOM_OPT_FLAG, &no_prefix, NULL, "disable automatic prefix caching", 1,
         0, NULL},
        {"async-scheduling", LOOM_OPT_FLAG, &async_flag, NULL,
         "overlapped scheduling: plan and send each decode step while the previous one runs, its tokens the ones "
         "that step samples on the worker (one pipeline stage: a TP group shares them; rows whose next plan depends on "
         "the token, "
         "a grammar, penalties, speculation, wait for it as without the flag)",
         1, 0, NULL},
        {"async-scheduling-steps", LOOM_OPT_INT, &async_steps, "N",
         "with --async-scheduling (implied): steps planned ahead beyond the one running, enough to cover the "
         "round trip to the worker when a step is shorter than it (default 3)",
         1, 8, NULL},
        {"step-timeout-ms", LOOM_OPT_INT, &c.step_timeout_ms, "MS",
         "a step in flight longer than this plus --step-timeout-per-token-us per token fails the epoch as a lost "
         "worker does, and its requests are re-planned; 0: no bound (default 30000)", 0, 3600000, NULL},
        {"step-timeout-per-token-us", LOOM_OPT_INT, &c.step_token_us, "US",
         "a step's deadline grows by this much per token it carries (default 100000)", 0, 10000000, NULL},
        {"liveness-timeout-ms", LOOM_OPT_INT, &c.liveness_timeout_ms, "MS",
         "Health (and HTTP /health) reports not ready when the reactor has not turned, or no step has completed "
         "while requests wait, for this long; 0: off (default 10000)", 0, 3600000, NULL},
        {"prepare-threads", LOOM_OPT_INT, &c.prepare_threads, "N",
         "threads that compile grammars and tokenize long prompts off the reactor (default 2)", 1, 64, NULL},
        {"grammar-compile-timeout-ms", LOOM_OPT_INT, &c.grammar_compile_timeout_ms, "MS",
         "a request's grammar (JSON schema, regex, choice, EBNF) must compile within this, else 400 (default 30000)",
         1, 3600000, NULL},
        {"grammar-max-bytes", LOOM_OPT_U64, &c.grammar_max_bytes, "BYTES",
         "a request's compiled grammar may hold this much memory, else 400 (default 268435456)", 4096, 1e15, NULL},
        {"grammar-cache-bytes", LOOM_OPT_U64, &c.grammar_cache_bytes, "BYTES",
         "compiled grammars kept for reuse, least recently used dropped first; 0: only the 64-entry bound "
         "(default 1073741824)", 0, 1e15, NULL},
        {"heartbeat-timeout-ms", LOOM_OPT_INT, &c.heartbeat_timeout_ms, "MS",
         "declare a silent worker lost after this long (default 1500)", 200, 600000, NULL},
        {"recovery-timeout-ms", LOOM_OPT_INT, &c.recovery_timeout_ms, "MS",
         "requests wait this long for a failed grid to be restored, then end with UNAVAILABLE; 0: "
         "at once (default 10000: longer than a lost worker's detection plus a spare's "
         "registration and load)",
         0, 86400000, NULL},
        {"shutdown-timeout", LOOM_OPT_INT, &shutdown_timeout_s, "S",
         "on SIGTERM/SIGINT: refuse new requests and let those in flight run this long; then their "
         "streams end (finish_reason length) and the coordinator exits; a second signal exits at "
         "once (default 30)",
         0, 86400, NULL},
        {"api-key", LOOM_OPT_STR, &c.api_key, "KEY",
         "require this key in every request (or set LOOM_API_KEY)", 1, 0, NULL},
        {"ready-file", LOOM_OPT_STR, &c.ready_file, "FILE",
         "write the API address here once the grid is ready", 1, 0, NULL},
        {"etcd", LOOM_OPT_STR, &c.etcd_url, "URL",
         "publish membership in etcd, e.g. http://127.0.0.1:2379 (workers can then find this "
         "coordinator)",
         1, 0, NULL},
        {"cluster", LOOM_OPT_STR, &c.cluster, "NAME",
         "cluster name in etcd: keys under /loom/NAME/ (default 'default')", 1, 0, NULL},
        {"etcd-ttl", LOOM_OPT_INT, &c.etcd_ttl, "S", "etcd lease TTL in seconds (default 5)", 1,
         3600, NULL},
        {"advertise-host", LOOM_OPT_STR, &c.advertise_host, "HOST",
         "host name others dial, published in etcd when --listen/--control bind 0.0.0.0", 1, 0,
         NULL},
        {"kv-offloading-dir", LOOM_OPT_STR, &c.kv_offload_dir, "PATH",
         "the directory tier below the KV pool: full blocks leaving the pool are written here (one "
         "file per block and shard, named by content, model and grid) and a prompt whose prefix is "
         "here loads it instead of computing it; replicas of one model may share it (default off)",
         1, 0, NULL},
        {"kv-offloading-disk-size", LOOM_OPT_FLOAT, &offload_gb, "GB",
         "the directory tier's bytes at most, least recently used blocks deleted beyond (default 10)",
         0.000001, 1e6, NULL},
        {"kv-offloading-prefetch-timeout-ms", LOOM_OPT_INT, &c.kv_offload_prefetch_timeout_ms, "MS",
         "a prompt whose blocks in the directory tier are being checked (each file read through once, off "
         "the scheduler's thread) waits for them at most this long before it is scheduled with those already "
         "checked, the rest computed; 0: never waits (default 50)",
         0, 600000, NULL},
        {"kv-offloading-write-through", LOOM_OPT_FLAG, &c.kv_offload_write_through, NULL,
         "write each block to the directory tier as soon as it is computed, not when it leaves the "
         "pool",
         1, 0, NULL},
        {"kv-offloading-size", LOOM_OPT_FLOAT, &host_gib, "GiB",
         "the host-memory tier below the KV pool (vLLM's flag): GiB of host memory each worker keeps for "
         "full blocks leaving the pool (pinned on CUDA); a prompt whose prefix is there loads it instead of "
         "computing it; with --kv-offloading-dir it is tier 1 and the directory tier 2 (default off)",
         0.000001, 1e6, NULL},
        {"kv-offloading-backend", LOOM_OPT_STR, &offload_backend, "native",
         "the host tier's implementation (vLLM's flag): native, the only one (lmcache is not available)", 1, 0,
         NULL},
        {"kv-transfer-config", LOOM_OPT_STR, &kv_transfer, "JSON",
         "prefill/decode disaggregation, vLLM's form: '{\"kv_connector\":\"LoomConnector\",\"kv_role\":"
         "\"kv_both\"}' (kv_producer, kv_consumer, kv_both; \"kv_load_failure_policy\": recompute or fail); "
         "requests then take kv_transfer_params; the blocks move through --kv-offloading-dir, shared by both sides, "
         "or with \"kv_connector_extra_config\":{\"transport\":\"tcp\",\"secret_file\":F} worker to worker "
         "(lease_ms: how long a prefill holds them, default 30000; docs/disaggregation.md)",
         1, 0, NULL},
        {"kv-events", LOOM_OPT_STR, &c.kv_events, "ADDR",
         "publish prefix-cache events (blocks cached and evicted) and load for loom-router on a "
         "ZeroMQ PUB socket here, e.g. tcp://127.0.0.1:5557 (port 0: any free port; routers learn "
         "it from Stats; CURVE-keyed like the client API when --client-keys is given) (default "
         "off)",
         1, 0, NULL},
        {"http", LOOM_OPT_STR, &http_bind, "HOST:PORT",
         "also serve the OpenAI-compatible HTTP API, /health and /metrics here, e.g. "
         "127.0.0.1:8000 (port 0: any free port; default off)",
         1, 0, NULL},
        {"chat-template", LOOM_OPT_STR, &chat_template, "FILE|NAME",
         "Jinja chat template for /v1/chat/completions: a file, the template text, or a template "
         "Loom ships (" LOOM_CHAT_SHIPPED_NAMES ") (default: the model's)",
         1, 0, NULL},
        {"trust-request-chat-template", LOOM_OPT_FLAG, &trust_request_template, NULL,
         "render a request's own chat_template (default: refused with 400)", 1, 0, NULL},
        {"tool-call-parser", LOOM_OPT_STR, &tool_parser, "NAME",
         "the model's tool-call syntax: " LOOM_TOOL_PARSER_NAMES " (default: detected from the chat template)",
         1, 0, NULL},
        {"enable-auto-tool-choice", LOOM_OPT_FLAG, &auto_tool_choice, NULL,
         "accepted for vLLM compatibility: tool_choice auto is always on", 1, 0, NULL},
        {"reasoning-parser", LOOM_OPT_STR, &reasoning_parser, "NAME",
         "split the reasoning off chat answers (message.reasoning_content): " LOOM_REASONING_PARSER_NAMES
         " (default: none)",
         1, 0, NULL},
        {"max-body-bytes", LOOM_OPT_INT, &max_body, "N",
         "largest HTTP request body; larger gets 413 (default 2097152)", 1024, 1 << 30, NULL},
        {"responses-store", LOOM_OPT_INT, &responses_store, "N",
         "/v1/responses: stored responses kept for previous_response_id and GET /v1/responses/{id}, least "
         "recently used dropped first (default 1024; 0: none stored)",
         0, 1 << 20, NULL},
        {"responses-store-mb", LOOM_OPT_INT, &responses_store_mb, "MB",
         "and at most this many MiB of them (default 64)", 1, 1 << 20, NULL},
        {"http-max-connections", LOOM_OPT_INT, &http_conns, "N",
         "most simultaneous HTTP connections, one thread each (default 256)", 1, 65536, NULL},
        {"log-format", LOOM_OPT_STR, &log_format, "FMT",
         "log lines as text or json (one object per line: ts, level, component, msg, request_id) "
         "(default text, or LOOM_LOG_FORMAT)",
         1, 0, NULL},
        LOOM_ETCD_SECURITY_OPTS(etcd_sec),
        {"curve-secret", LOOM_OPT_STR, &c.security.curve_secret, "FILE",
         "the coordinator's CURVE secret key (from 'loom keygen'; or LOOM_CURVE_SECRET: a file or "
         "the Z85 key); needs --worker-keys and/or --client-keys",
         1, 0, NULL},
        {"worker-keys", LOOM_OPT_STR, &c.security.worker_keys, "FILE",
         "allow-list of worker public keys ('NAME KEY' lines, NAME = the worker's --id): only "
         "these workers may connect, each under its own id (or LOOM_WORKER_KEYS)",
         1, 0, NULL},
        {"client-keys", LOOM_OPT_STR, &c.security.client_keys, "FILE",
         "allow-list of client public keys: the client API then takes only these clients, "
         "encrypted (or LOOM_CLIENT_KEYS); required when --listen is not a loopback address",
         1, 0, NULL},
        {"encrypt-data-plane", LOOM_OPT_FLAG, &c.security.encrypt_data, NULL,
         "tcp data plane: encrypt every frame (ChaCha20-Poly1305, keys from the epoch's secret); "
         "costs CPU per MB, see docs/benchmarks.md (shm and nccl are not affected)",
         1, 0, NULL},
        {"insecure", LOOM_OPT_FLAG, &c.security.insecure, NULL,
         "run the control plane without worker keys (refused without it, on loopback too: any local process "
         "could register as a worker; deploy/local/launch.sh and 'loom serve' make keys)",
         1, 0, NULL},
        {"insecure-api", LOOM_OPT_FLAG, &c.security.insecure_api, NULL,
         "serve a client API bound to a non-loopback address without client keys (anyone who "
         "reaches it may use it)",
         1, 0, NULL},
        {"http-timeout-s", LOOM_OPT_INT, &http_timeout, "S",
         "close an HTTP connection idle this long, e.g. a client that stops sending (default 60)",
         1, 86400, NULL},
        /* vLLM's spellings */
        {"tensor-parallel-size", LOOM_OPT_INT, &c.tp, "N", "vLLM's name for --tp (also -tp)", 1, 64,
         NULL},
        {"pipeline-parallel-size", LOOM_OPT_INT, &c.pp, "M", "vLLM's name for --pp (also -pp)", 1,
         64, NULL},
        {"q", LOOM_OPT_STR, &c.quantization, "SCHEME", "vLLM's short name for --quantization", 1, 0,
         NULL},
        {"enable-prefix-caching", LOOM_OPT_FLAG, &vo.prefix_on, NULL,
         "automatic prefix caching on (the default)", 1, 0, NULL},
        {"no-enable-prefix-caching", LOOM_OPT_FLAG, &vo.prefix_off, NULL,
         "vLLM's name for --no-prefix-cache", 1, 0, NULL},
        {"host", LOOM_OPT_STR, &vo.host, "HOST",
         "serve HTTP on HOST (with --port; default 127.0.0.1, vLLM's is 0.0.0.0)", 1, 0, NULL},
        {"port", LOOM_OPT_INT, &vo.port, "PORT",
         "serve HTTP on this port (with --host; vLLM's default 8000)", 0, 65535, NULL},
        {"seed", LOOM_OPT_U64, &c.seed, "N",
         "requests without a seed get seeds drawn from this one: the same requests in the same "
         "order give the same text (default: random)",
         1, 0, &vo.seed_seen},
        {"generation-config", LOOM_OPT_STR, &vo.generation_config, "auto|vllm|DIR",
         "default temperature, top_p, top_k and max_tokens for requests that leave them out: auto "
         "from the model's generation_config.json, vllm the built-in ones, or "
         "DIR/generation_config.json (default auto)",
         1, 0, NULL},
        {"log-level", LOOM_OPT_STR, &vo.log_level, "LEVEL",
         "debug, info, warning, error, critical or off (default info, or LOOM_LOG_LEVEL)", 1, 0,
         NULL},
        {"uvicorn-log-level", LOOM_OPT_STR, &vo.log_level, "LEVEL", "vLLM's name for --log-level",
         1, 0, NULL},
        {"probe-listen", LOOM_OPT_STR, &probe_bind, "HOST:PORT",
         "serve /health, /metrics and /version also here, on connection slots of their own (for "
         "liveness/readiness probes and scrapes; port 0: any free port; default off)",
         1, 0, NULL},
        {"tls-cert", LOOM_OPT_STR, &tls_cert, "FILE",
         "serve --http over TLS (HTTPS) with this PEM certificate chain (with --tls-key)", 1, 0,
         NULL},
        {"ssl-ciphers", LOOM_OPT_STR, &ssl_ciphers, "PRIORITIES",
         "HTTPS protocol versions and cipher suites, as a GnuTLS priority string (default: TLS 1.2 and 1.3, "
         "forward-secret key exchanges, AEAD ciphers only; 'NORMAL' is GnuTLS's own default)",
         1, 0, NULL},
        {"tls-key", LOOM_OPT_STR, &tls_key, "FILE", "the PEM private key of --tls-cert", 1, 0,
         NULL},
        {"http-header-timeout-s", LOOM_OPT_INT, &header_timeout, "S",
         "close an HTTP connection whose request headers are not complete this long after it "
         "opened or its last response ended (slow clients; default 10)",
         1, 86400, NULL},
        {"http-body-timeout-s", LOOM_OPT_INT, &body_timeout, "S",
         "close an HTTP connection whose request body is not complete this long after its headers "
         "(default 60)",
         1, 86400, NULL},
        {"http-max-connections-per-ip", LOOM_OPT_INT, &conns_per_ip, "N",
         "most simultaneous HTTP connections from one client address; more are closed at once "
         "(default 0: only --http-max-connections)",
         0, 65536, NULL},
        {"embedding-pooling", LOOM_OPT_STR, &pooling, "last|mean",
         "/v1/embeddings and Embed: pool the final hidden states of the last token (vLLM's default "
         "for decoder models) or the mean over all tokens, L2-normalised (default last)",
         1, 0, NULL},
        {"chat-special-tokens-in-content", LOOM_OPT_FLAG, &special_in_content, NULL,
         "parse special-token text in chat message content (e.g. <|im_start|>) as control tokens; "
         "by default it is plain text",
         1, 0, NULL},
    };
    loom_lora_serve_opts_t lora;
    loom_lora_serve_opts_init(&lora);
    {
        loom_err_t e = {0};
        if (loom_lora_serve_take_args(&argc, argv, &lora, &e) != LOOM_OK) {
            fprintf(stderr, "error: %s\n", e.msg);
            return 2;
        }
    }
    int r = loom_cli_parse_vllm(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "loom-coordinator --model DIR --tp N --pp M [options]",
                           "The Loom coordinator: waits for tp x pp workers to register, plans the grid (layer ranges\n"
                           "per stage, heads per rank), assigns shards, and serves the client API with continuous\n"
                           "batching over a paged KV cache.\n\n"
                           "LoRA, vLLM's flags (docs/lora.md): --enable-lora, --lora-modules NAME=PATH|JSON...,\n"
                           "--max-loras N (default 1), --max-lora-rank N (default 16), --max-cpu-loras N,\n"
                           "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: POST\n"
                           "/v1/load_lora_adapter and /v1/unload_lora_adapter). Every adapter is checked against the\n"
                           "model at start-up; a request's \"model\" names its adapter.");
    if (r) return r < 0 ? 2 : 0;
    if (log_format && loom_log_set_format_name(log_format) < 0) {
        fprintf(stderr, "error: --log-format must be text or json, got '%s'\n", log_format);
        return 2;
    }
    if (!c.model_dir) {
        fprintf(stderr, "error: --model is required (see --help)\n");
        return 2;
    }
    {
        loom_err_t e = {0};
        if (loom_lora_serve_startup(&lora, c.model_dir, &e) != LOOM_OK) {
            fprintf(stderr, "error: %s\n", e.msg);
            return 2;
        }
        if (lora.enable) c.lora = &lora;
    }
    if (pooling && strcmp(pooling, "last") && strcmp(pooling, "mean")) {
        fprintf(stderr, "error: --embedding-pooling must be last or mean, got '%s'\n", pooling);
        return 2;
    }
    c.embedding_pooling = pooling && !strcmp(pooling, "mean") ? 2 : 1;
    char listen_ep[512], control_ep[512], bind_buf[300];
    if (loom_endpoint_normalize(c.listen, listen_ep, sizeof listen_ep) < 0 ||
        loom_endpoint_normalize(c.control, control_ep, sizeof control_ep) < 0) {
        fprintf(stderr, "error: --listen and --control take an address like 127.0.0.1:5555 or tcp://127.0.0.1:5555\n");
        return 2;
    }
    c.listen = listen_ep;
    c.control = control_ep;
    loom_gen_defaults_t gen;
    int has_gen = 0;
    if (vllm_apply(&vo, &c, &no_prefix, &http_bind, bind_buf, sizeof bind_buf, &gen, &has_gen) < 0)
        return 2;
    if (strcmp(c.comm, "auto") && strcmp(c.comm, "shm") && strcmp(c.comm, "tcp") && strcmp(c.comm, "nccl")) {
        fprintf(stderr, "error: --comm must be auto, shm, tcp or nccl, got '%s'\n", c.comm);
        return 2;
    }
    /* vLLM's dtype names */
    if (!strcmp(c.weight_dtype, "float32") || !strcmp(c.weight_dtype, "float")) c.weight_dtype = "f32";
    if (!strcmp(c.weight_dtype, "bfloat16")) c.weight_dtype = "bf16";
    if (!strcmp(c.weight_dtype, "float16") || !strcmp(c.weight_dtype, "half")) c.weight_dtype = "f16";
    if (!strcmp(c.weight_dtype, "auto")) c.weight_dtype = "f32";
    if (strcmp(c.weight_dtype, "f32") && strcmp(c.weight_dtype, "bf16") && strcmp(c.weight_dtype, "f16")) {
        fprintf(stderr, "error: --dtype must be f32, bf16 or f16, got '%s'\n", c.weight_dtype);
        return 2;
    }
    loom_quant_spec_t quant;
    if (!loom_quant_spec_parse(c.quantization, &quant)) {
        fprintf(stderr, "error: --quantization must be none, int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:64 or q4_min:128, got '%s'\n", c.quantization);
        return 2;
    }
    if (!strcmp(c.kv_cache_dtype, "fp8_e4m3")) c.kv_cache_dtype = "fp8";
    if (!strcmp(c.kv_cache_dtype, "bfloat16")) c.kv_cache_dtype = "bf16";
    if (!strcmp(c.kv_cache_dtype, "float32")) c.kv_cache_dtype = "f32";
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
    c.async_scheduling = async_steps ? async_steps : async_flag ? 3 : 0;
    c.kv_offload_max_bytes = (uint64_t)((double)offload_gb * 1e9);
    if (kv_transfer) {
        loom_err_t kerr = {0};
        if (loom_kv_transfer_config_parse(kv_transfer, &c.kv_transfer, &kerr) < 0) {
            fprintf(stderr, "error: %s\n", kerr.msg);
            return 2;
        }
        if (loom_kv_transfer_read_secret(&c.kv_transfer, &kerr) < 0) {
            fprintf(stderr, "error: --kv-transfer-config: %s\n", kerr.msg);
            return 2;
        }
        if (c.kv_transfer.transport == LOOM_KV_TRANSPORT_TCP && c.security.encrypt_data && !c.kv_transfer.secret_len) {
            fprintf(stderr, "error: --kv-transfer-config: --encrypt-data-plane encrypts transport tcp too, whose keys "
                            "come from kv_connector_extra_config.secret_file (not insecure: true)\n");
            return 2;
        }
        if (c.kv_transfer.transport == LOOM_KV_TRANSPORT_TCP && c.pp > 1) {
            fprintf(stderr, "error: --kv-transfer-config: transport tcp is built for one pipeline stage (--pp 1), "
                            "not --pp %d\n", c.pp);
            return 2;
        }
        if (c.kv_transfer.transport == LOOM_KV_TRANSPORT_DIR && !c.kv_offload_dir) {
            fprintf(stderr, "error: --kv-transfer-config: transport dir (the default) moves blocks through the "
                            "directory tier both sides share: give --kv-offloading-dir, or "
                            "kv_connector_extra_config.transport \"tcp\" (worker to worker)\n");
            return 2;
        }
    }
    if (offload_backend && strcmp(offload_backend, "native")) {
        fprintf(stderr, "error: --kv-offloading-backend %s is not available (accepted: native)%s\n", offload_backend,
                !strcmp(offload_backend, "lmcache") ? "; LMCache is not part of Loom" : "");
        return 2;
    }
    if (offload_backend && host_gib <= 0) {
        fprintf(stderr, "error: --kv-offloading-backend needs --kv-offloading-size GiB (the host tier's size)\n");
        return 2;
    }
    c.kv_offload_host_bytes = (uint64_t)((double)host_gib * 1073741824.0);
    if (c.kv_offload_host_bytes && !c.prefix_cache) {
        fprintf(stderr, "error: --kv-offloading-size needs the prefix cache (its blocks are named by it)\n");
        return 2;
    }
    if (c.kv_offload_dir && !c.prefix_cache) {
        fprintf(stderr, "error: --kv-offloading-dir needs the prefix cache (its blocks are named by it)\n");
        return 2;
    }
    loom_spec_config_defaults(&c.spec);
    if (!loom_spec_method_parse(spec_method, &c.spec.method)) {
        fprintf(stderr, "error: --speculative-method must be none, ngram, draft or mtp, got '%s'\n", spec_method);
        return 2;
    }
    if ((c.spec_model || c.spec_quantization || c.spec_device) &&
        c.spec.method != LOOM_SPEC_DRAFT) {
        fprintf(
            stderr,
            "error: --speculative-model, --speculative-quantization and --speculative-device need "
            "--speculative-method draft\n");
        return 2;
    }
    if (c.spec.method == LOOM_SPEC_DRAFT && !c.spec_model && !c.spec_quantization) {
        fprintf(stderr, "error: --speculative-method draft needs --speculative-model DIR or --speculative-quantization "
                        "SCHEME (a quantized self-draft)\n");
        return 2;
    }
    {
        loom_quant_spec_t dq;
        if (c.spec_quantization && !loom_quant_spec_parse(c.spec_quantization, &dq)) {
            fprintf(stderr, "error: --speculative-quantization: unknown scheme '%s' (none, int8, fp8, q4, q4:64, "
                            "q4_min, ...)\n",
                    c.spec_quantization);
            return 2;
        }
    }
    if (c.spec_threads <= 0) c.spec_threads = 1;
    if (c.spec.method == LOOM_SPEC_MTP && c.kv_transfer.transport == LOOM_KV_TRANSPORT_TCP) {
        fprintf(stderr, "error: --kv-transfer-config: transport tcp does not move the MTP module's latent cache "
                        "(--speculative-method mtp)\n");
        return 2;
    }
    /* the workers' MTP module drafts one token a step (its trained depth) */
    if (c.spec.method == LOOM_SPEC_MTP && spec_k > 1)
        LOOM_WARN("--num-speculative-tokens %d: the MTP module drafts one token a step on the grid", spec_k);
    c.spec.k = c.spec.method == LOOM_SPEC_MTP ? 1 : spec_k > 0 ? spec_k : 4;
    c.spec.fixed_k = spec_fixed;
    c.spec.ngram_min = ngram_min;
    c.spec.ngram_max = ngram_max;
    {
        loom_err_t serr = {0};
        if (loom_spec_config_check(&c.spec, &serr) < 0) {
            fprintf(stderr, "error: %s\n", serr.msg);
            return 2;
        }
    }
    c.shutdown_timeout_ms = shutdown_timeout_s * 1000;
    if (!c.api_key && env_key && env_key[0]) c.api_key = env_key;
    if (c.max_batched_tokens < c.max_num_seqs) c.max_batched_tokens = c.max_num_seqs;

    if ((chat_template || tool_parser || reasoning_parser) && !http_bind) {
        fprintf(stderr, "error: --chat-template, --tool-call-parser and --reasoning-parser only matter with --http\n");
        return 2;
    }
    if (ssl_ciphers && !tls_cert) {
        fprintf(stderr, "error: --ssl-ciphers needs --tls-cert and --tls-key\n");
        return 2;
    }
    if ((probe_bind || tls_cert || tls_key) && !http_bind) {
        fprintf(stderr, "error: --probe-listen, --tls-cert and --tls-key need --http\n");
        return 2;
    }

    loom_etcd_security_env(&etcd_sec);
    loom_err_t err = {0};
    /* the keys' rules before the model is read: a refusal is at once */
    if (loom_coord_security_check(&c.security, c.listen, c.control, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    if (loom_server_create(&c, &g_server, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    loom_http_t *http = NULL;
    if (http_bind) {
        loom_http_config_t hc = {.bind = http_bind, .api_key = c.api_key, .model_dir = c.model_dir,
                                 .chat_template = chat_template, .max_body_bytes = (size_t)max_body,
                                 .max_connections = http_conns, .idle_timeout_s = http_timeout,
                                 .gen_defaults = has_gen ? &gen : NULL,
                                 .probe_bind = probe_bind, .tls_cert = tls_cert, .tls_key = tls_key,
                                 .tls_priorities = ssl_ciphers,
                                 .header_timeout_s = header_timeout, .body_timeout_s = body_timeout,
                                 .max_connections_per_ip = conns_per_ip,
                                 .chat_special_in_content = special_in_content,
                                 .trust_request_chat_template = trust_request_template,
                                 .tool_call_parser = tool_parser, .reasoning_parser = reasoning_parser,
                                 .responses_store_max = responses_store ? responses_store : -1,
                                 .responses_store_bytes = (size_t)responses_store_mb << 20};
        (void)auto_tool_choice;
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
