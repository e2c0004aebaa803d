# Log lines (text and JSON) and the constant-time API key compare (common/).
loom_add_test(test_log SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_log.c LIBS loom_base Loom::CJSON LABELS unit TIMEOUT 30)
# Option parsing with vLLM's forms, host:port addresses, generation_config.json defaults, the CPU check.
loom_add_test(test_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cli.c LIBS loom_base loom_modelio LABELS unit TIMEOUT 30)
