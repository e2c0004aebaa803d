# The grid lifecycle against in-process fake workers (real control protocol over loopback ZeroMQ).
loom_add_test(test_grid_lifecycle SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_grid_lifecycle.c
              ${CMAKE_CURRENT_LIST_DIR}/fake_worker.c LIBS loom_server LABELS unit TIMEOUT 120)
