loom_add_test(test_sched SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sched.c LIBS loom_coord_core LABELS unit)
loom_add_test(test_stop SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_stop.c LIBS loom_coord_core LABELS unit)
loom_add_test(test_sampling_params SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sampling_params.c LIBS loom_server LABELS unit)
loom_add_test(test_kv_connector SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kv_connector.c LIBS loom_coord_core LABELS unit)
