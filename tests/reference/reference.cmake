# Golden tests against the independent reference implementation (torch).
add_executable(check_ref ${CMAKE_CURRENT_LIST_DIR}/check_ref.c)
target_link_libraries(check_ref PRIVATE loom_worker_core)
set_target_properties(check_ref PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)

set(_ref ${CMAKE_CURRENT_LIST_DIR})
add_test(NAME reference_selftest COMMAND ${LOOM_PYTHON} ${_ref}/llama_ref.py --self-test)
add_test(NAME reference_stories260k
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_stories stories ${LOOM_MODELS_DIR})
# GQA (8 heads over 2 KV heads), untied embeddings, intermediate size 100 (not a power of two).
add_test(NAME reference_random_gqa
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_gqa random
                 --dim 64 --hidden-dim 100 --layers 3 --heads 8 --kv-heads 2 --vocab 512 --seed 11)
# llama3 RoPE scaling with head_dim 16 (reaches the smoothed band), bf16 weights in 2 shards.
add_test(NAME reference_llama3_rope
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_llama3 random
                 --dim 64 --hidden-dim 96 --layers 2 --heads 4 --kv-heads 2 --head-dim 16 --vocab 512
                 --rope-scaling llama3 --rope-theta 500000 --dtype bf16 --shards 2 --seed 5)
# Qwen2 layout: q/k/v biases implied by model_type, GQA, tied embeddings, rope_theta 1e6.
add_test(NAME reference_qwen2_bias
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_qwen2 random
                 --qwen2 --dim 64 --hidden-dim 96 --layers 3 --heads 8 --kv-heads 2 --vocab 512 --tie
                 --rope-theta 1000000 --seed 13)
# Qwen3: per-head q/k RMSNorm before RoPE, head_dim 16 set apart from hidden/heads, yarn RoPE (factor 4 over
# 256 positions: interpolated, ramped and kept frequencies), GQA, tied embeddings.
add_test(NAME reference_qwen3
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_qwen3 random
                 --arch qwen3 --dim 64 --hidden-dim 96 --layers 3 --heads 8 --kv-heads 2 --head-dim 16 --vocab 512
                 --tie --rope-theta 1000000 --rope-scaling yarn --rope-factor 4 --rope-original-max-pos 256 --seed 17)
# Mistral: a sliding window of 24 positions (the 88-token runs and 7-token prefill chunks cross it and the
# 16-token blocks), GeGLU with the tanh gelu.
add_test(NAME reference_mistral_window
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_mistral random
                 --arch mistral --sliding-window 24 --hidden-act gelu_pytorch_tanh --dim 64 --hidden-dim 100
                 --layers 3 --heads 8 --kv-heads 2 --vocab 512 --seed 19)
# Phi-3: fused qkv_proj and gate_up_proj, longrope (short factors; the context is cut to the original 128
# positions), a sliding window of 32.
add_test(NAME reference_phi3
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_phi3 random
                 --arch phi3 --sliding-window 32 --rope-scaling longrope --rope-original-max-pos 128 --max-pos 1024
                 --dim 64 --hidden-dim 96 --layers 3 --heads 4 --vocab 512 --seed 29)
# Phi-4-mini's partial rotary: RoPE turns 12 of each head's 16 dims (partial_rotary_factor 0.75), with
# longrope's short factors (6 per head) and its attention factor (1.19 here) on the rotary dims only.
add_test(NAME reference_phi3_partial_rotary
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_phi3_partial random
                 --arch phi3 --partial-rotary 0.75 --rope-scaling longrope --rope-original-max-pos 128 --max-pos 1024
                 --dim 64 --hidden-dim 96 --layers 3 --heads 4 --kv-heads 2 --vocab 512 --seed 31)
# Gemma 3 text: (1+w) norms around both blocks, q/k norms, embeddings times sqrt(hidden), query_pre_attn_scalar
# 24, layers alternating sliding (window 24, rope_local_base_freq) and global (rope_theta 1e6, linear scaling 2),
# 4 heads of 32 over hidden 64, GeGLU (tanh), tied embeddings.
add_test(NAME reference_gemma3
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_gemma3 random
                 --arch gemma3 --sliding-window 24 --sliding-pattern 2 --query-pre-attn-scalar 24 --rope-scaling linear
                 --rope-factor 2 --rope-theta 1000000 --dim 64 --hidden-dim 96 --layers 4 --heads 4 --kv-heads 2
                 --head-dim 32 --vocab 512 --tie --seed 31)
# Gemma 3 text from a config.json without rope_theta, query_pre_attn_scalar and max_position_embeddings: both sides
# take Gemma3TextConfig's defaults (the global layers' base 1e6, scale 256^-1/2 rather than head_dim^-1/2, 131072
# positions); the rest as reference_gemma3, without scaling.
add_test(NAME reference_gemma3_defaults
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_gemma3_defaults random
                 --arch gemma3 --sliding-window 24 --sliding-pattern 2
                 --omit rope_theta,query_pre_attn_scalar,max_position_embeddings --dim 64 --hidden-dim 96 --layers 4
                 --heads 4 --kv-heads 2 --head-dim 32 --vocab 512 --tie --seed 43)
# Gemma 2: Gemma 3's layer without q/k norms, every norm a (1+w) gain, query_pre_attn_scalar 24, the even layers
# sliding (window 24: the 88-token runs cross it) and the odd ones global with one rope_theta, soft caps 50 on the
# attention scores and 30 on the logits (the released values), hidden_act and hidden_activation both given.
add_test(NAME reference_gemma2
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_gemma2 random
                 --arch gemma2 --sliding-window 24 --query-pre-attn-scalar 24 --dim 64 --hidden-dim 96 --layers 4
                 --heads 4 --kv-heads 2 --head-dim 32 --vocab 512 --seed 37)
# Gemma 2 where both caps bite: q/k gains of 6 put half the attention scores beyond 25 (up to ~190 before the
# cap of 50), and a final cap of 8 squeezes logit rows of std 4; 3 layers, so two slide.
add_test(NAME reference_gemma2_capped
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_gemma2_capped random
                 --arch gemma2 --sliding-window 24 --qk-gain 6 --final-softcap 8 --dim 64 --hidden-dim 96 --layers 3
                 --heads 4 --kv-heads 2 --head-dim 32 --vocab 512 --seed 41)
# Mixtral: every layer a Mixture of Experts (8 experts of intermediate size 96, top-2, the two weights
# renormalised), GQA, a hidden size of 64.
add_test(NAME reference_mixtral
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_mixtral random
                 --arch mixtral --experts 8 --top-k 2 --dim 64 --hidden-dim 96 --layers 3 --heads 8 --kv-heads 2
                 --vocab 512 --seed 47)
# Qwen3-MoE: Qwen3 attention (q/k norms, head_dim 16), layer 0 dense (mlp_only_layers, intermediate size 96),
# the others 6 experts of moe_intermediate_size 40, top-3 without renormalisation (norm_topk_prob false).
add_test(NAME reference_qwen3_moe
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_qwen3_moe random
                 --arch qwen3_moe --experts 6 --top-k 3 --moe-hidden-dim 40 --norm-topk-prob false
                 --mlp-only-layers 0 --dim 64 --hidden-dim 96 --layers 3 --heads 8 --kv-heads 2 --head-dim 16
                 --vocab 512 --tie --rope-theta 1000000 --seed 53)
# Qwen2-MoE: q/k/v biases, 4 experts of 40 (top-2, not renormalised) plus a shared expert of 64 scaled by
# sigmoid(shared_expert_gate . x), every second layer sparse (decoder_sparse_step 2), the others dense MLPs of 96.
add_test(NAME reference_qwen2_moe
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_qwen2_moe random
                 --arch qwen2_moe --experts 4 --top-k 2 --moe-hidden-dim 40 --shared-hidden-dim 64 --sparse-step 2
                 --dim 64 --hidden-dim 96 --layers 4 --heads 8 --kv-heads 2 --vocab 512 --seed 61)
# Llama with the erf gelu: a config Loom once loaded and ran as SiLU (linear RoPE scaling is reference_gemma3's).
add_test(NAME reference_gelu
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_gelu random
                 --hidden-act gelu --dim 64 --hidden-dim 96 --layers 2 --heads 4 --vocab 512 --seed 23)
# 4-bit checkpoints in the AWQ (GEMM, interleaved nibbles, zero point) and GPTQ layouts (v1 stores
# zero points minus one; v2 symmetric with a trivial g_idx), against the reference on their dequantized weights.
add_test(NAME reference_awq
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_awq awq ${LOOM_MODELS_DIR})
add_test(NAME reference_gptq
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_gptq gptq ${LOOM_MODELS_DIR})
add_test(NAME reference_gptq_v2
         COMMAND bash ${_ref}/run_ref.sh $<TARGET_FILE:check_ref> ${CMAKE_BINARY_DIR}/tests/ref_gptq_v2 gptq_v2
                 ${LOOM_MODELS_DIR} --sym --g-idx trivial)
set_tests_properties(reference_selftest reference_stories260k reference_random_gqa reference_llama3_rope
                     reference_qwen2_bias reference_qwen3 reference_mistral_window reference_phi3
                     reference_phi3_partial_rotary reference_gemma3 reference_gemma3_defaults
                     reference_gemma2 reference_gemma2_capped reference_gelu reference_mixtral reference_qwen3_moe
                     reference_qwen2_moe
                     reference_awq reference_gptq reference_gptq_v2
                     PROPERTIES TIMEOUT 300 LABELS reference)
