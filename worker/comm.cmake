# loom_comm: the data plane (comm.h) - the dispatcher and the CPU backends
# shm (one host) and tcp (across hosts), and the KV transfer service over
# tcp (kv_xfer.c). Included from worker/CMakeLists.txt.
add_library(loom_comm STATIC
            ${CMAKE_CURRENT_LIST_DIR}/comm.c
            ${CMAKE_CURRENT_LIST_DIR}/comm_shm.c
            ${CMAKE_CURRENT_LIST_DIR}/comm_tcp.c
            ${CMAKE_CURRENT_LIST_DIR}/comm_util.c
            ${CMAKE_CURRENT_LIST_DIR}/comm_watchdog.c
            ${CMAKE_CURRENT_LIST_DIR}/kv_xfer.c)
target_link_libraries(loom_comm PUBLIC loom_base PRIVATE Loom::Sodium)
