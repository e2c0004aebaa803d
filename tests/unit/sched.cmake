loom_add_test(test_sched SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sched.c LIBS loom_coord_core LABELS unit)
loom_add_test(test_stop SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_stop.c LIBS loom_coord_core LABELS unit)
loom_add_test(test_sampling_params SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sampling_params.c LIBS loom_server LABELS unit)
loom_add_test(test_prepare SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_prepare.c LIBS loom_server LABELS unit)
loom_add_test(test_kv_connector SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kv_connector.c LIBS loom_coord_core LABELS unit)
loom_add_test(test_coord_draft SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_coord_draft.c LIBS loom_server LABELS unit)
loom_add_test(test_kv_tier SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kv_tier.c LIBS loom_coord_core LABELS unit)
loom_add_test(test_kv_tier_host SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kv_tier_host.c LIBS loom_coord_core LABELS unit)
# The host KV tier's worker half: saves into host slots and loads back, both pool layouts; spills to the directory.
loom_add_test(test_kv_host SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kv_host.c ${PROJECT_SOURCE_DIR}/worker/kv_host.c
              ${PROJECT_SOURCE_DIR}/worker/kv_offload.c
              LIBS loom_worker_core LABELS unit TIMEOUT 60)
