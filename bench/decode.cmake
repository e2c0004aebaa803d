loom_add_bench(bench_decode SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_decode.c ${CMAKE_CURRENT_LIST_DIR}/membw.c
               LIBS loom_worker_core)
