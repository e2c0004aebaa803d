loom_add_bench(bench_spec SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_spec.c LIBS loom_worker_core)
