# `loom bench` as a peer of `vllm bench serve` (test_bench.py): against an
# independent OpenAI-compatible stub server and against Loom; vLLM's result
# keys; ShareGPT, random and prefix_repetition datasets; burstiness; bad
# input. Registered like loom_add_it in integration.cmake, which is
# included after this file.
add_test(NAME it_bench COMMAND ${LOOM_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_bench.py)
set_tests_properties(it_bench PROPERTIES TIMEOUT 600 LABELS integration RESOURCE_LOCK cluster
  ENVIRONMENT "LOOM_BIN=${CMAKE_BINARY_DIR}/bin;LOOM_MODELS_DIR=${LOOM_MODELS_DIR};LOOM_TEST_WORK=${CMAKE_BINARY_DIR}/tests/it_work;LOOM_PYTHON=${LOOM_PYTHON}")
