/* vLLM's `vllm serve` flags (vLLM 0.10/0.11 engine and OpenAI-server
 * arguments, plus older spellings still met in scripts). Only the names
 * matter: which of them Loom implements is decided by each option table. */
#include "common/vllm_flags.h"

#include <string.h>

static const char *const k_vllm_flags[] = {
    /* short forms */
    "tp", "pp", "dp", "q", "O",
    /* model and tokenizer */
    "model", "tokenizer", "tokenizer-mode", "skip-tokenizer-init", "trust-remote-code", "revision",
    "code-revision", "tokenizer-revision", "download-dir", "load-format", "config-format", "config",
    "dtype", "seed", "max-model-len", "served-model-name", "hf-config-path", "hf-token", "hf-overrides",
    "model-impl", "task", "runner", "convert", "rope-scaling", "rope-theta", "max-logprobs",
    "logprobs-mode", "generation-config", "override-generation-config", "enable-sleep-mode",
    "allowed-local-media-path", "logits-processor-pattern", "logits-processors", "override-pooler-config",
    "pooler-config", "quantization", "enforce-eager", "max-seq-len-to-capture", "disable-sliding-window",
    "disable-cascade-attn", "io-processor-plugin",
    /* parallelism */
    "tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size", "data-parallel-size-local",
    "data-parallel-address", "data-parallel-rpc-port", "data-parallel-backend", "data-parallel-rank",
    "data-parallel-start-rank", "data-parallel-hybrid-lb", "enable-expert-parallel", "enable-eplb",
    "eplb-config", "distributed-executor-backend", "max-parallel-loading-workers",
    "disable-custom-all-reduce", "ray-workers-use-nsight", "worker-cls", "worker-extension-cls",
    "decode-context-parallel-size", "headless", "api-server-count", "nnodes", "node-rank",
    "master-addr", "master-port",
    /* cache */
    "block-size", "gpu-memory-utilization", "kv-cache-memory-bytes", "swap-space", "kv-cache-dtype",
    "num-gpu-blocks-override", "enable-prefix-caching", "no-enable-prefix-caching",
    "prefix-caching-hash-algo", "cpu-offload-gb", "calculate-kv-scales", "kv-sharing-fast-prefill",
    "mamba-cache-dtype", "mamba-ssm-cache-dtype", "kv-offloading-size", "kv-offloading-backend",
    /* scheduler */
    "max-num-batched-tokens", "max-num-seqs", "max-num-partial-prefills", "max-long-partial-prefills",
    "long-prefill-token-threshold", "num-lookahead-slots", "scheduler-delay-factor", "preemption-mode",
    "num-scheduler-steps", "multi-step-stream-outputs", "scheduling-policy", "enable-chunked-prefill",
    "no-enable-chunked-prefill", "disable-chunked-mm-input", "scheduler-cls", "disable-hybrid-kv-cache-manager",
    "async-scheduling", "stream-interval",
    /* speculative decoding, LoRA, multimodal, structured output */
    "speculative-config", "enable-lora", "enable-lora-bias", "max-loras", "max-lora-rank", "lora-extra-vocab-size",
    "lora-dtype", "max-cpu-loras", "fully-sharded-loras", "lora-modules", "default-mm-loras",
    "limit-mm-per-prompt", "media-io-kwargs", "mm-processor-kwargs", "mm-processor-cache-gb",
    "disable-mm-preprocessor-cache", "mm-encoder-tp-mode", "interleave-mm-strings", "skip-mm-profiling",
    "guided-decoding-backend", "guided-decoding-disable-fallback", "structured-outputs-config", "reasoning-parser",
    "enable-reasoning",
    /* observability, compilation, devices */
    "disable-log-stats", "enable-log-requests", "disable-log-requests", "max-log-len", "enable-log-outputs",
    "show-hidden-metrics-for-version", "otlp-traces-endpoint", "collect-detailed-traces",
    "compilation-config", "cuda-graph-sizes", "max-cudagraph-capture-size", "kv-transfer-config",
    "kv-events-config", "additional-config", "device", "use-v2-block-manager", "ray-workers-use-nsight",
    /* the OpenAI server */
    "host", "port", "uds", "uvicorn-log-level", "disable-uvicorn-access-log", "allow-credentials",
    "allowed-origins", "allowed-methods", "allowed-headers", "api-key", "chat-template",
    "chat-template-content-format", "trust-request-chat-template", "response-role", "ssl-keyfile",
    "ssl-certfile", "ssl-ca-certs", "enable-ssl-refresh", "ssl-cert-reqs", "root-path", "middleware",
    "return-tokens-as-token-ids", "disable-frontend-multiprocessing", "enable-request-id-headers",
    "enable-auto-tool-choice", "exclude-tools-when-tool-choice-none", "tool-call-parser", "tool-parser-plugin",
    "tool-server", "log-config-file", "max-log-len", "disable-fastapi-docs", "enable-prompt-tokens-details",
    "enable-server-load-tracking", "enable-force-include-usage", "enable-tokenizer-info-endpoint",
    "h11-max-incomplete-event-size", "h11-max-header-count", "log-error-stack", "tokens-only",
};

int loom_vllm_flag_known(const char *name, size_t len) {
    for (size_t i = 0; i < sizeof k_vllm_flags / sizeof k_vllm_flags[0]; i++)
        if (strlen(k_vllm_flags[i]) == len && !strncmp(k_vllm_flags[i], name, len)) return 1;
    return 0;
}
