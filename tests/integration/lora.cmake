# LoRA adapters (test_lora.py): loom run with an adapter against the merged
# weights, and lora_grid, an in-process TP x PP grid of one model whose
# all-reduce is a barrier and a sum, to check the adapter's shard layout.
add_executable(lora_grid ${CMAKE_CURRENT_LIST_DIR}/lora_grid.c)
target_link_libraries(lora_grid PRIVATE loom_worker_core Threads::Threads)
set_target_properties(lora_grid PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
loom_add_it(it_lora test_lora.py)
# the exactness hangs on the optimised kernels too: scripts/test.sh's Release pass runs it again
set_property(TEST it_lora APPEND PROPERTY LABELS release)
loom_add_it(it_lora_serving test_lora_serving.py)
