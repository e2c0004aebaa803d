# DeepSeek-V2/V3's pieces (config, router, yarn with mscale, FP8 blocks, one MLA layer) against the float64
# reference's numbers (tests/reference/deepseek_ref.py --pieces, run by the test).
loom_add_test(test_deepseek SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_deepseek.c
              LIBS loom_worker_core LABELS unit
              ARGS --python ${LOOM_PYTHON} --ref ${PROJECT_SOURCE_DIR}/tests/reference/deepseek_ref.py
                   --work ${CMAKE_BINARY_DIR}/tests)
# The reference's own check: the absorbed per-token MLA against the decompressed batch, the router's bias case,
# FP8 blocks (generates tiny V3, V2-Lite and fp8 checkpoints with gen_deepseek.py).
add_test(NAME reference_deepseek_selftest COMMAND ${LOOM_PYTHON} ${PROJECT_SOURCE_DIR}/tests/reference/deepseek_ref.py --self-test)
set_tests_properties(reference_deepseek_selftest PROPERTIES LABELS unit TIMEOUT 120)
# The engine against deepseek_ref.py (check_ref: prompt logits prefilled in chunks, 48 greedy ids and their
# logits): transformers' DeepseekV3 test shape with yarn and the biased sigmoid router; in bf16; V2-Lite's shape.
add_test(NAME reference_deepseek_v3
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/reference/run_ref.sh $<TARGET_FILE:check_ref>
                 ${CMAKE_BINARY_DIR}/tests/ref_deepseek_v3 deepseek --shape v3 --seed 5)
add_test(NAME reference_deepseek_v3_bf16
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/reference/run_ref.sh $<TARGET_FILE:check_ref>
                 ${CMAKE_BINARY_DIR}/tests/ref_deepseek_v3_bf16 deepseek --shape v3 --seed 9 --dtype bf16)
add_test(NAME reference_deepseek_v2lite
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/reference/run_ref.sh $<TARGET_FILE:check_ref>
                 ${CMAKE_BINARY_DIR}/tests/ref_deepseek_v2lite deepseek --shape v2lite --seed 5)
# FP8 blocks: float8_e4m3fn weights with a weight_scale_inv per 16 x 16 block (partial at the edges),
# dequantized at load; the reference dequantizes the same codes.
add_test(NAME reference_deepseek_v3_fp8
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/reference/run_ref.sh $<TARGET_FILE:check_ref>
                 ${CMAKE_BINARY_DIR}/tests/ref_deepseek_v3_fp8 deepseek --shape v3 --seed 5 --fp8)
# An MTP module stored after the last layer (model.layers.5.*, num_nextn_predict_layers 1) is accepted and
# left out of the forward pass, as the reference leaves it.
add_test(NAME reference_deepseek_v3_mtp
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/reference/run_ref.sh $<TARGET_FILE:check_ref>
                 ${CMAKE_BINARY_DIR}/tests/ref_deepseek_v3_mtp deepseek --shape v3 --seed 5 --mtp 1)
# A shape where MLA's W_UV then o_proj holds fewer weights than the folded o' (the engine's split path).
add_test(NAME reference_deepseek_v3_split
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/reference/run_ref.sh $<TARGET_FILE:check_ref>
                 ${CMAKE_BINARY_DIR}/tests/ref_deepseek_v3_split deepseek --shape v3split --seed 3)
set_tests_properties(reference_deepseek_v3 reference_deepseek_v3_bf16 reference_deepseek_v2lite
                     reference_deepseek_v3_fp8 reference_deepseek_v3_mtp reference_deepseek_v3_split PROPERTIES
                     LABELS reference TIMEOUT 300 ENVIRONMENT "LOOM_PYTHON=${LOOM_PYTHON}")
