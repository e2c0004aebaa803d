# loom_membw: the STREAM-style triad other benchmarks call to measure the
# machine's bandwidth in the same run. bench_kernels: the CPU kernels.
add_library(loom_membw STATIC ${CMAKE_CURRENT_LIST_DIR}/membw.c)
target_link_libraries(loom_membw PUBLIC loom_base Threads::Threads)
loom_add_bench(bench_kernels SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_kernels.c
               LIBS loom_kernels loom_membw)
