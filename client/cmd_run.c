/* `loom run`: load a model in this process and stream one completion. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "client/commands.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/model_config_deepseek.h"
#include "common/util.h"
#include "worker/local.h"

typedef struct run_out {
    loom_detok_t detok;
    char *buf;
    size_t cap;
    int32_t *ids; /* generated ids, for --ids */
    int n_ids, cap_ids;
} run_out_t;

static int on_token(void *ctx, int32_t id) {
    run_out_t *o = ctx;
    if (o->n_ids == o->cap_ids) {
        o->cap_ids = o->cap_ids ? 2 * o->cap_ids : 256;
        o->ids = loom_xrealloc(o->ids, (size_t)o->cap_ids * sizeof *o->ids);
    }
    o->ids[o->n_ids++] = id;
    size_t n = loom_detok_push(&o->detok, id, o->buf, o->cap);
    if (n) {
        fwrite(o->buf, 1, n, stdout);
        fflush(stdout);
    }
    return 0;
}

/* vLLM's --speculative-config JSON on loom run: method (ngram, draft_model
 * or draft, deepseek_mtp or mtp; a "model" alone means draft_model), model,
 * quantization, num_speculative_tokens, prompt_lookup_min/max; any other key
 * is refused by name. */
typedef struct run_spec {
    const char **method, **model, **quant;
    int *k, *ngram_min, *ngram_max;
    char model_buf[4096], quant_buf[64]; /* where *model and *quant point when given */
} run_spec_t;

static int run_speculative_config_apply(cJSON *j, run_spec_t *o);

static int run_speculative_config(const char *json, run_spec_t *o) {
    cJSON *j = cJSON_Parse(json);
    int r = run_speculative_config_apply(j, o);
    cJSON_Delete(j);
    return r;
}

static int run_speculative_config_apply(cJSON *j, run_spec_t *o) {
    if (!cJSON_IsObject(j)) {
        fprintf(stderr, "error: --speculative-config must be a JSON object, like "
                        "'{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}'\n");
        return -1;
    }
    const char *method = NULL;
    for (cJSON *it = j->child; it; it = it->next) {
        int *num = !strcmp(it->string, "num_speculative_tokens") ? o->k
                   : !strcmp(it->string, "prompt_lookup_min")    ? o->ngram_min
                   : !strcmp(it->string, "prompt_lookup_max")    ? o->ngram_max
                                                                 : NULL;
        int is_method = !strcmp(it->string, "method"), is_model = !strcmp(it->string, "model");
        int is_quant = !strcmp(it->string, "quantization");
        if (num) {
            if (!cJSON_IsNumber(it) || it->valuedouble != (double)(int)it->valuedouble) {
                fprintf(stderr, "error: --speculative-config: %s must be an integer\n", it->string);
                return -1;
            }
            *num = (int)it->valuedouble;
        } else if (is_method || is_model || is_quant) {
            if (!cJSON_IsString(it)) {
                fprintf(stderr, "error: --speculative-config: %s must be a string\n", it->string);
                return -1;
            }
            if (is_method) method = it->valuestring;
            char *buf = is_model ? o->model_buf : o->quant_buf;
            size_t cap = is_model ? sizeof o->model_buf : sizeof o->quant_buf;
            if (!is_method && snprintf(buf, cap, "%s", it->valuestring) >= (int)cap) {
                fprintf(stderr, "error: --speculative-config: %s is too long\n", it->string);
                return -1;
            }
            if (is_model) *o->model = buf;
            if (is_quant) *o->quant = buf;
        } else {
            fprintf(stderr, "error: --speculative-config: '%s' is not supported (loom run takes method, model, "
                            "quantization, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)\n",
                    it->string);
            return -1;
        }
    }
    if (!method) method = *o->model ? "draft_model" : "";
    if (!strcmp(method, "ngram")) *o->method = "ngram";
    else if (!strcmp(method, "draft_model") || !strcmp(method, "draft")) *o->method = "draft";
    else if (!strcmp(method, "deepseek_mtp") || !strcmp(method, "mtp")) *o->method = "mtp";
    else {
        fprintf(stderr, "error: --speculative-config: method '%s' is not supported (ngram, draft_model, "
                        "deepseek_mtp)\n", method);
        return -1;
    }
    return 0;
}

int loom_cmd_run(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *device = "cpu", *dtype = "f32", *quantization = "none";
    const char *kv_cache_dtype = "auto";
    int max_tokens = 128, top_k = 40, threads = 0, ctx = 0, chunk = 256, ignore_eos = 0, quiet = 0, print_ids = 0;
    float temperature = 0.8f, top_p = 0.95f;
    uint64_t seed = 0;
    int seed_given = 0;
    const char *spec_method = "none";
    int spec_k = 4, ngram_min = 1, ngram_max = 4, spec_fixed = 0;
    const char *spec_model = NULL, *spec_quant = NULL, *spec_config = NULL;
    const char *lora = NULL;
    int max_lora_rank = 16, mla_disable = loom_mla_disable_env();
    loom_opt_t opts[] = {
        {"model", LOOM_OPT_STR, &model, "DIR", "Hugging Face model directory (config.json, *.safetensors, tokenizer.json)", 1, 0, NULL},
        {"prompt", LOOM_OPT_STR, &prompt, "TEXT", "prompt text; the completion (only) is streamed to stdout", 1, 0, NULL},
        {"max-tokens", LOOM_OPT_INT, &max_tokens, "N", "most tokens to generate (default 128)", 1, 1e9, NULL},
        {"temperature", LOOM_OPT_FLOAT, &temperature, "T", "sampling temperature; 0 = greedy (default 0.8)", 0, 100, NULL},
        {"top-p", LOOM_OPT_FLOAT, &top_p, "P", "nucleus sampling mass, 1 = off (default 0.95)", 0, 1, NULL},
        {"top-k", LOOM_OPT_INT, &top_k, "K", "sample among the K most likely tokens, 0 = off (default 40)", 0, 1e9, NULL},
        {"seed", LOOM_OPT_U64, &seed, "S", "sampling seed (default: from the clock); same seed, same text", 1, 0, &seed_given},
        {"threads", LOOM_OPT_INT, &threads, "N", "CPU threads (default: all cores)", 0, 1024, NULL},
        {"device", LOOM_OPT_STR, &device, "DEV", "cpu or cuda:N (default cpu)", 1, 0, NULL},
        {"dtype", LOOM_OPT_STR, &dtype, "TYPE", "weight storage: f32, bf16 or f16 (default f32 on cpu)", 1, 0, NULL},
        {"quantization", LOOM_OPT_STR, &quantization, "SCHEME", "quantize matmul weights on load: none, int8, fp8, q4, q4:128, q4_min, ... (default none)", 1, 0, NULL},
        {"kv-cache-dtype", LOOM_OPT_STR, &kv_cache_dtype, "TYPE", "KV cache elements: auto (f32 on cpu, bf16 on cuda), f32, bf16, int8 (cpu), fp8 (cuda)", 1, 0, NULL},
        {"disable-mla", LOOM_OPT_FLAG, &mla_disable, NULL, "DeepSeek: decompressed keys and values per head in the cache and ordinary attention instead of the latent (vLLM's VLLM_MLA_DISABLE; env LOOM_MLA_DISABLE=1); cpu only", 1, 0, NULL},
        {"ctx", LOOM_OPT_INT, &ctx, "N", "context length to allocate (default: the model's maximum)", 0, 1e9, NULL},
        {"chunk", LOOM_OPT_INT, &chunk, "N", "prefill chunk size in tokens (default 256)", 1, 65536, NULL},
        {"ignore-eos", LOOM_OPT_FLAG, &ignore_eos, NULL, "keep generating past the end-of-sequence token", 1, 0, NULL},
        {"ids", LOOM_OPT_FLAG, &print_ids, NULL, "print the generated token ids to stderr", 1, 0, NULL},
        {"quiet", LOOM_OPT_FLAG, &quiet, NULL, "no log lines and no timing on stderr", 1, 0, NULL},
        {"lora", LOOM_OPT_STR, &lora, "DIR", "apply a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors) to every token", 1, 0, NULL},
        {"max-lora-rank", LOOM_OPT_INT, &max_lora_rank, "R", "largest adapter rank accepted: " LOOM_LORA_RANKS " (default 16)", 1, 512, NULL},
        {"speculative-method", LOOM_OPT_STR, &spec_method, "METHOD", "speculative decoding: none (default), ngram (prompt lookup), draft (--speculative-model / --speculative-quantization) or mtp (a DeepSeek checkpoint's MTP module); same output either way", 1, 0, NULL},
        {"num-speculative-tokens", LOOM_OPT_INT, &spec_k, "K", "most drafted tokens verified per target step, 1..16 (default 4; adapted to the acceptance)", 1, LOOM_SPEC_MAX_K, NULL},
        {"ngram-min", LOOM_OPT_INT, &ngram_min, "N", "shortest suffix the ngram drafter looks up (default 1)", 1, 64, NULL},
        {"ngram-max", LOOM_OPT_INT, &ngram_max, "N", "longest suffix the ngram drafter looks up (default 4)", 1, 64, NULL},
        {"speculative-model", LOOM_OPT_STR, &spec_model, "DIR", "method draft: a smaller model with the same vocabulary (default: the target itself)", 1, 0, NULL},
        {"speculative-quantization", LOOM_OPT_STR, &spec_quant, "SCHEME", "method draft: quantize the draft on load (int8, q4, ...): with no --speculative-model, a quantized self-draft", 1, 0, NULL},
        {"speculative-fixed-k", LOOM_OPT_FLAG, &spec_fixed, NULL, "always draft K tokens (no adaptation; for measurements)", 1, 0, NULL},
        {"speculative-config", LOOM_OPT_STR, &spec_config, "JSON", "vLLM's form, e.g. '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}' (instead of the flags above)", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts),
                           "loom run --model DIR --prompt TEXT [options]",
                           "Loads the model in this process and streams the completion of the prompt to "
                           "stdout.\nTiming (prompt tokens, time to first token, decode tokens/s) goes to stderr.");
    if (r) return r < 0 ? 2 : 0;
    if (!model || !prompt) {
        fprintf(stderr, "error: --model and --prompt are required (see loom run --help)\n");
        return 2;
    }
    loom_dtype_t wdt;
    if (!strcmp(dtype, "f32")) wdt = LOOM_DT_F32;
    else if (!strcmp(dtype, "bf16")) wdt = LOOM_DT_BF16;
    else if (!strcmp(dtype, "f16")) wdt = LOOM_DT_F16;
    else {
        fprintf(stderr, "error: --dtype must be f32, bf16 or f16, got '%s'\n", dtype);
        return 2;
    }
    loom_quant_spec_t quant;
    if (!loom_quant_spec_parse(quantization, &quant)) {
        fprintf(stderr, "error: --quantization must be none, int8, fp8, q4, q4:64, q4:128, q4_min, q4_min:64 or q4_min:128, got '%s'\n", quantization);
        return 2;
    }
    run_spec_t rs = {0}; /* --speculative-config's strings live here until the model is open */
    if (spec_config) {
        if (strcmp(spec_method, "none") || spec_model || spec_quant) {
            fprintf(stderr, "error: give --speculative-config or the --speculative-* flags, not both\n");
            return 2;
        }
        rs = (run_spec_t){.method = &spec_method, .model = &spec_model, .quant = &spec_quant, .k = &spec_k,
                          .ngram_min = &ngram_min, .ngram_max = &ngram_max};
        if (run_speculative_config(spec_config, &rs) < 0) return 2;
    }
    loom_spec_config_t spec;
    loom_spec_config_defaults(&spec);
    if (!loom_spec_method_parse(spec_method, &spec.method)) {
        fprintf(stderr, "error: --speculative-method must be none, ngram, draft or mtp, got '%s'\n", spec_method);
        return 2;
    }
    loom_quant_spec_t draft_quant = {0};
    if ((spec_model || spec_quant) && spec.method != LOOM_SPEC_DRAFT) {
        fprintf(stderr, "error: --speculative-model and --speculative-quantization need --speculative-method draft\n");
        return 2;
    }
    if (spec.method == LOOM_SPEC_DRAFT) {
        if (!spec_model && !spec_quant) {
            fprintf(stderr, "error: --speculative-method draft needs --speculative-model DIR or --speculative-quantization SCHEME\n");
            return 2;
        }
        if (spec_quant && !loom_quant_spec_parse(spec_quant, &draft_quant)) {
            fprintf(stderr, "error: --speculative-quantization must be int8, fp8, q4, q4:64, q4:128, q4_min, ..., got '%s'\n", spec_quant);
            return 2;
        }
    }
    if (!loom_lora_rank_allowed(max_lora_rank)) {
        fprintf(stderr, "error: --max-lora-rank must be one of " LOOM_LORA_RANKS ", got %d\n", max_lora_rank);
        return 2;
    }
    if (lora && spec.method == LOOM_SPEC_DRAFT) {
        fprintf(stderr, "error: --lora with --speculative-method draft is not supported (the draft has no adapter)\n");
        return 2;
    }
    spec.k = spec_k;
    spec.ngram_min = ngram_min;
    spec.ngram_max = ngram_max;
    spec.fixed_k = spec_fixed;
    loom_err_t serr = {0};
    if (loom_spec_config_check(&spec, &serr) < 0) {
        fprintf(stderr, "error: %s\n", serr.msg);
        return 2;
    }
    if (quiet) loom_log_set_level(LOOM_LOG_WARN);
    if (!seed_given) seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);

    loom_err_t err = {0};
    loom_local_options_t lo = {.model_dir = model, .device = device, .n_threads = threads,
                               .chunk = chunk, .ctx = ctx, .weight_dtype = wdt,
                               .quant = quant, .kv_cache_dtype = kv_cache_dtype, .spec = spec,
                               .draft_model_dir = spec_model, .draft_quant = draft_quant,
                               .lora_dir = lora, .max_lora_rank = max_lora_rank, .mla_disable = mla_disable};
    loom_local_t *l = NULL;
    if (loom_local_open(&lo, &l, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    const loom_tokenizer_t *tok = loom_local_tokenizer(l);
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0, rc = 0;
    if (loom_tokenizer_encode(tok, prompt, strlen(prompt), 1, 0, &ids, &n_ids, &cap, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        rc = 1;
        goto done;
    }
    run_out_t out = {.cap = loom_tokenizer_max_piece_len(tok) + 256};
    out.buf = loom_xmalloc(out.cap);
    loom_detok_init(&out.detok, tok, 1, 0);
    loom_sampling_t s = {.temperature = temperature, .top_k = top_k, .top_p = top_p, .seed = seed};
    loom_gen_stats_t st;
    if (loom_local_generate(l, ids, n_ids, max_tokens, &s, ignore_eos, on_token, &out, NULL, &st, &err) < 0) {
        fprintf(stderr, "\nerror: %s\n", err.msg);
        rc = 1;
    } else {
        size_t n = loom_detok_flush(&out.detok, out.buf, out.cap);
        fwrite(out.buf, 1, n, stdout);
        fputc('\n', stdout);
        fflush(stdout);
        if (print_ids) {
            fputs("ids:", stderr);
            for (int i = 0; i < out.n_ids; i++) fprintf(stderr, " %d", out.ids[i]);
            fputc('\n', stderr);
        }
        if (!quiet) {
            int dec = st.gen_tokens > 1 ? st.gen_tokens - 1 : 0;
            fprintf(stderr,
                    "prompt: %d tokens, time to first token %.1f ms (%.1f tokens/s prefill); "
                    "generated %d tokens, decode %.2f tokens/s (%.2f a CPU second)\n",
                    st.prompt_tokens, st.prefill_s * 1e3,
                    st.prefill_s > 0 ? st.prompt_tokens / st.prefill_s : 0.0, st.gen_tokens,
                    st.decode_s > 0 ? dec / st.decode_s : 0.0, st.decode_cpu_s > 0 ? dec / st.decode_cpu_s : 0.0);
            if (spec.method != LOOM_SPEC_OFF) {
                fprintf(stderr, "speculative %s: %lld drafts, %lld draft tokens, %lld accepted (acceptance rate %.1f%%)\n",
                        loom_spec_method_name(spec.method), (long long)st.spec.num_drafts,
                        (long long)st.spec.num_draft_tokens, (long long)st.spec.num_accepted_tokens,
                        100.0 * loom_spec_stats_acceptance(&st.spec));
                fprintf(stderr, "tokens per target step: %.2f\n", loom_spec_stats_tokens_per_step(&st.spec));
                if (!spec.fixed_k) {
                    char best[96] = "";
                    if (st.gate.best_case > 0)
                        snprintf(best, sizeof best, "; drafting %s at best %.2fx plain",
                                 st.gate.started_off ? "started off:" : "started on,", st.gate.best_case);
                    fprintf(stderr,
                            "speculation gate: %s (%.3f ms a token with drafts, %.3f plain%s; turned off %lld, "
                            "on %lld times%s)\n",
                            loom_spec_gate_state_name(st.gate.state),
                            (st.gate.state == LOOM_SPEC_GATE_S_OFF ? st.gate.decided_spec
                                                                    : loom_spec_gate_spec_rate(&st.gate)) * 1e3,
                            (st.gate.state == LOOM_SPEC_GATE_S_OFF ? st.gate.decided_plain
                                                                    : loom_spec_gate_plain_rate(&st.gate)) * 1e3,
                            st.gate.state == LOOM_SPEC_GATE_S_OFF ? " when it last decided" : "",
                            (long long)st.gate.turned_off, (long long)st.gate.turned_on, best);
                }
                if (spec.method == LOOM_SPEC_DRAFT)
                    fprintf(stderr, "draft model: %lld forwards, %lld tokens read (a probe's catch-up: %d at most)\n",
                            (long long)st.draft_forwards, (long long)st.draft_tokens, st.draft_probe_read);
            }
        }
    }
    free(out.buf);
    free(out.ids);
done:
    free(ids);
    loom_local_close(&l);
    return rc;
}
