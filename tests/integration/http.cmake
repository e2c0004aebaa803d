# The HTTP gateway end to end (test_http.py): the OpenAI Node SDK (npm ci
# --prefix tests/reference), curl-style error paths, /metrics, disconnects,
# 429 and shutdown on real processes. Registered like loom_add_it in
# integration.cmake, which is included after this file.
add_test(NAME it_http COMMAND ${LOOM_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_http.py)
set_tests_properties(it_http PROPERTIES TIMEOUT 600 LABELS integration RESOURCE_LOCK cluster
  ENVIRONMENT "LOOM_BIN=${CMAKE_BINARY_DIR}/bin;LOOM_MODELS_DIR=${LOOM_MODELS_DIR};LOOM_TEST_WORK=${CMAKE_BINARY_DIR}/tests/it_work;LOOM_PYTHON=${LOOM_PYTHON}")
