loom_add_bench(bench_route SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_route.c LIBS loom_router_core)
