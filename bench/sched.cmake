loom_add_bench(bench_sched SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_sched.c LIBS loom_coord_core)
