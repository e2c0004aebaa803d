# Data plane: all-reduce and send/recv latency and bandwidth (shm, tcp).
loom_add_bench(bench_comm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_comm.c LIBS loom_comm)
# KV transfer over transport tcp against the raw TCP rate (worker/kv_xfer.c).
loom_add_bench(bench_kv_xfer SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_kv_xfer.c LIBS loom_comm)
