# Data plane: all-reduce and send/recv latency and bandwidth (shm, tcp).
loom_add_bench(bench_comm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_comm.c LIBS loom_comm)
