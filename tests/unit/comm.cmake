# Data plane: shm and tcp comm backends, with real processes (fork).
loom_add_test(test_comm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_comm.c
              LIBS loom_comm LABELS unit TIMEOUT 120)
