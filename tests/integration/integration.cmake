# Integration tests: real coordinator and worker processes on 127.0.0.1,
# started through deploy/local/launch.sh, driven by the `loom` tool.
add_executable(garbage ${CMAKE_CURRENT_LIST_DIR}/garbage.c)
target_link_libraries(garbage PRIVATE loom_proto Loom::ZeroMQ)
set_target_properties(garbage PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)

function(loom_add_it name script)
  add_test(NAME ${name} COMMAND ${LOOM_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/${script})
  set_tests_properties(${name} PROPERTIES TIMEOUT 600 LABELS integration RESOURCE_LOCK cluster
    ENVIRONMENT "LOOM_BIN=${CMAKE_BINARY_DIR}/bin;LOOM_MODELS_DIR=${LOOM_MODELS_DIR};LOOM_TEST_WORK=${CMAKE_BINARY_DIR}/tests/it_work;LOOM_PYTHON=${LOOM_PYTHON}")
endfunction()
loom_add_it(it_grid test_grid.py)
loom_add_it(it_cluster test_cluster.py)
loom_add_it(it_serving test_serving.py)
loom_add_it(it_cli test_cli.py)
loom_add_it(it_serve test_serve.py)
loom_add_it(it_membership test_membership.py)
loom_add_it(it_deploy test_deploy.py)
loom_add_it(it_drain test_drain.py)
loom_add_it(it_netns test_netns.py) # hosts as network namespaces: needs root, else skipped (77)
set_tests_properties(it_netns PROPERTIES SKIP_RETURN_CODE 77)
loom_add_it(it_quant test_quant.py)
loom_add_it(it_perplexity test_perplexity.py)
loom_add_it(it_spec test_spec.py)
