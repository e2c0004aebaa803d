loom_add_bench(bench_route SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_route.c LIBS loom_router_core)
# The bare ZeroMQ hop under bench_router.sh's router figures.
loom_add_bench(null_proxy SOURCES ${CMAKE_CURRENT_LIST_DIR}/null_proxy.c LIBS loom_base Loom::ZeroMQ)
