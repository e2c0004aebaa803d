/* DeepSeek-V2 and DeepSeek-V3 (model_type deepseek_v2, deepseek_v3): their
 * config.json keys, one defaults table per family (the config classes'),
 * the refusals, and the checkpoint checks a loader runs before it reads. */
#ifndef LOOM_MODEL_CONFIG_DEEPSEEK_H
#define LOOM_MODEL_CONFIG_DEEPSEEK_H

#include "common/model_config.h"
#include "common/safetensors.h"

/* Whether model_type is deepseek_v2 or deepseek_v3. */
int loom_model_config_is_deepseek(const char *model_type);

/* Reads the whole config.json of one (root: its cJSON object) into cfg. */
loom_status_t loom_model_config_parse_deepseek(const void *root, const char *path, loom_model_config_t *cfg,
                                               loom_err_t *err);

/* yarn's mscale: 1 for scale <= 1, else 0.1 x mscale x ln(scale) + 1 (DeepSeek's yarn_get_mscale). */
double loom_yarn_mscale(double scale, double mscale);

/* Bytes one token's latent KV cache takes over all layers: n_layers x (kv_lora_rank + qk_rope_head_dim)
 * values of elem_size bytes (DeepSeek-V3 in bf16: 61 x 576 x 2 = 70,272). */
size_t loom_deepseek_kv_bytes_per_token(const loom_model_config_t *cfg, size_t elem_size);
/* Bytes of the decompressed cache (--disable-mla) a token takes: per layer
 * n_heads x (nope + rope) K values and n_heads x v_head_dim V values (int8:
 * elem_size 1, plus a float scale per head for each), the whole model's
 * heads (TP ranks hold their share). */
size_t loom_deepseek_mha_kv_bytes_per_token(const loom_model_config_t *cfg, size_t elem_size, int int8_scales);
/* LOOM_MLA_DISABLE (vLLM's VLLM_MLA_DISABLE): a nonzero integer or "true"
 * turns on --disable-mla where the flag is not given; unset, "", 0, "false"
 * or anything else: off. */
int loom_mla_disable_env(void);

/* The checks a DeepSeek checkpoint passes before any weight is read: every MoE layer's router carries an
 * e_score_correction_bias of [n_routed_experts] under noaux_tc; every F8_E4M3 tensor has its
 * weight_scale_inv of the right grid (and fp8 weights appear only with an fp8 quantization_config). */
loom_status_t loom_deepseek_check_checkpoint(const loom_model_config_t *cfg, const loom_st_t *st,
                                             loom_err_t *err);

#endif
