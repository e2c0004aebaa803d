# Data plane: shm and tcp comm backends, with real processes (fork).
loom_add_test(test_comm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_comm.c
              LIBS loom_comm LABELS unit TIMEOUT 120)
# The step watchdog of stream-ordered comms: states and budget, fake probe.
loom_add_test(test_comm_watchdog SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_comm_watchdog.c
              LIBS loom_comm LABELS unit TIMEOUT 30)
