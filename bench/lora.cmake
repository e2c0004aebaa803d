loom_add_bench(bench_lora SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_lora.c LIBS loom_worker_core)
