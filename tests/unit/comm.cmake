# Data plane: shm and tcp comm backends, with real processes (fork).
loom_add_test(test_comm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_comm.c
              LIBS loom_comm LABELS unit TIMEOUT 120)
# The step watchdog of stream-ordered comms: states and budget, fake probe.
loom_add_test(test_comm_watchdog SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_comm_watchdog.c
              LIBS loom_comm LABELS unit TIMEOUT 30)
# Worker-to-worker KV transfer: head slices, the handshake, the service on loopback.
loom_add_test(test_kv_xfer SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_kv_xfer.c
              LIBS loom_comm LABELS unit TIMEOUT 60)
