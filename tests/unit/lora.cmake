# LoRA adapters: PEFT directories read and checked (loom_lora) and the
# mixed-adapter CPU delta (kernels/cpu/lora.c) against its reference.
loom_add_test(test_lora SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lora.c
              LIBS loom_lora loom_kernels LABELS unit TIMEOUT 60)
# The coordinator's adapter registry and engine slots (pure logic).
loom_add_test(test_lora_slots SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lora_slots.c
              LIBS loom_coord_core LABELS unit TIMEOUT 60)
# The scheduler's admission through the slots and the adapter-seeded prefix hash.
loom_add_test(test_sched_lora SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sched_lora.c
              LIBS loom_coord_core LABELS unit TIMEOUT 60)
# The adapters' Prometheus metrics (loom_lora_*, vllm:lora_requests_info).
loom_add_test(test_metrics_lora SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_metrics_lora.c
              LIBS loom_server LABELS unit TIMEOUT 60)
# The serving options: --lora-modules, start-up checks, validation, a request's model → adapter.
loom_add_test(test_lora_serve SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lora_serve.c
              LIBS loom_lora_serve LABELS unit TIMEOUT 60)
# A worker's host cache of prepared adapters (its preparation thread, LRU, failures).
loom_add_test(test_lora_cache SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lora_cache.c
              LIBS loom_worker_core LABELS unit TIMEOUT 60)
# The coordinator's tally of adapter loads over the grid's workers.
loom_add_test(test_lora_tally SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lora_tally.c
              LIBS loom_coord_core LABELS unit TIMEOUT 60)
# vLLM's runtime load: the reactor's checks, the adapter read on a preparation pool, two loads of one name.
loom_add_test(test_lora_reactor SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lora_reactor.c
              LIBS loom_server LABELS unit TIMEOUT 60)
