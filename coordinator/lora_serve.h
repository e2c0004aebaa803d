/* The coordinator's LoRA serving options (vLLM's --enable-lora,
 * --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras): parsing,
 * start-up checks, validation of each adapter against the served model, and
 * which adapter a request's "model" names. Pure: no sockets, no threads.
 *
 * A request's model is the served model's name (the base model), an
 * adapter's name, or SGLang's "base:adapter"; anything else is NOT_FOUND
 * (the HTTP layer's 404 with OpenAI's body). */
#ifndef LOOM_LORA_SERVE_H
#define LOOM_LORA_SERVE_H

#include "common/lora.h"
#include "common/status.h"
#include "coordinator/lora_slots.h"
#include "coordinator/metrics.h"
#include "coordinator/sched.h"

#define LOOM_LORA_SERVE_MAX_MODULES 64

/* One --lora-modules entry. */
typedef struct loom_lora_module_spec {
    char name[128];
    char path[1024];
    char base[128]; /* base_model_name ("": the served model) */
} loom_lora_module_spec_t;

typedef struct loom_lora_serve_opts {
    int enable;        /* --enable-lora */
    int max_loras;     /* --max-loras (vLLM's default 1) */
    int max_lora_rank; /* --max-lora-rank (vLLM's default 16; loom_lora_rank_allowed) */
    int max_cpu_loras; /* --max-cpu-loras (0: = max_loras; smaller than max_loras is an error) */
    int allow_runtime_updating; /* --allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING
                                 */
    int n_modules;
    loom_lora_module_spec_t modules[LOOM_LORA_SERVE_MAX_MODULES];
} loom_lora_serve_opts_t;

/* vLLM's defaults, LoRA off. */
void loom_lora_serve_opts_init(loom_lora_serve_opts_t *o);

/* Appends one --lora-modules value: "name=path" or the JSON form
 * {"name": ..., "path": ..., "base_model_name": ...} (base_model_name
 * optional). INVALID_ARGUMENT naming the problem. */
loom_status_t loom_lora_serve_add_module(loom_lora_serve_opts_t *o, const char *arg,
                                         loom_err_t *err);

/* Takes the LoRA flags out of ARGV (compacting it, *argc updated) so the
 * command's own option table never sees them: --enable-lora,
 * --lora-modules V... (vLLM's nargs='+': every following argument up to the
 * next option; the flag may also repeat), --max-loras N, --max-lora-rank N,
 * --max-cpu-loras N, --allow-runtime-lora-updating; "--flag=value" too.
 * INVALID_ARGUMENT naming the flag (a missing or non-numeric value, a bad
 * module). */
loom_status_t loom_lora_serve_take_args(int *argc, char **argv, loom_lora_serve_opts_t *o,
                                        loom_err_t *err);

/* The start-up checks that need no files: adapters without --enable-lora,
 * --max-loras < 1 or > 32, a rank vLLM does not take, --max-cpu-loras below
 * --max-loras, a name given twice. Sets max_cpu_loras's default. */
loom_status_t loom_lora_serve_check(loom_lora_serve_opts_t *o, loom_err_t *err);

/* Reads and checks one adapter directory against the served model (as a
 * start-up --lora-modules entry or a runtime load); on success *digest and
 * *rank (its largest rank) identify it. The error names the adapter. */
loom_status_t loom_lora_serve_validate(const char *name, const char *path,
                                       const loom_model_config_t *cfg, int max_lora_rank,
                                       uint8_t digest[32], int *rank, loom_err_t *err);

/* Validates every --lora-modules entry and registers it in SLOTS (created
 * by the caller with max_loras slots). The first bad one ends it. */
loom_status_t loom_lora_serve_register(const loom_lora_serve_opts_t *o,
                                       const loom_model_config_t *cfg, loom_lora_slots_t *slots,
                                       loom_err_t *err);

/* The start-up of loom-coordinator and `loom serve` with LoRA flags (O as
 * taken from argv; VLLM_ALLOW_RUNTIME_LORA_UPDATING read here): the checks,
 * then every --lora-modules adapter read against the model in MODEL_DIR, a
 * bad one named. LOOM_OK when the options are good (or none was given). */
loom_status_t loom_lora_serve_startup(loom_lora_serve_opts_t *o, const char *model_dir,
                                      loom_err_t *err);

/* The adapter a request's MODEL names: *id = -1 for the served model
 * itself (SERVED, or any of ALIASES, NULL-terminated), an entry id of SLOTS
 * for an adapter ("name" or "base:name"); NOT_FOUND with OpenAI's message
 * ("The model `x` does not exist.") otherwise. An empty MODEL is the base. */
loom_status_t loom_lora_serve_select(const loom_lora_slots_t *slots, const char *served,
                                     const char *const *aliases, const char *model, int *id,
                                     loom_err_t *err);

/* The adapters' metrics (loom_metrics_set_lora) from the registry and the
 * scheduler (SCHED may be NULL: nothing waiting): per adapter, its requests
 * ever, the sequences running with it and those waiting for it, in BUF (CAP
 * entries; adapters past it are left out). */
void loom_lora_serve_metrics(const loom_lora_slots_t *slots, loom_sched_t *sched,
                             loom_metrics_lora_adapter_t *buf, int cap, loom_metrics_lora_t *out);

#endif
