# Log lines (text and JSON) and the constant-time API key compare (common/).
loom_add_test(test_log SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_log.c LIBS loom_base Loom::CJSON LABELS unit TIMEOUT 30)
