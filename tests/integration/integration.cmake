# Integration tests: real coordinator and worker processes on 127.0.0.1,
# started through deploy/local/launch.sh, driven by the `loom` tool.
add_executable(garbage ${CMAKE_CURRENT_LIST_DIR}/garbage.c)
target_link_libraries(garbage PRIVATE loom_proto Loom::ZeroMQ)
set_target_properties(garbage PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
add_executable(hijack ${CMAKE_CURRENT_LIST_DIR}/hijack.c)
target_link_libraries(hijack PRIVATE loom_proto loom_keys Loom::ZeroMQ)
set_target_properties(hijack PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)

loom_add_it(it_grid test_grid.py)
loom_add_it(it_models test_models.py)
loom_add_it(it_gpt_oss test_gpt_oss.py)
loom_add_it(it_cluster test_cluster.py)
loom_add_it(it_security test_security.py)
loom_add_it(it_etcd_secure test_etcd_secure.py)
set_tests_properties(it_security PROPERTIES SKIP_RETURN_CODE 77)
loom_add_it(it_serving test_serving.py)
loom_add_it(it_cli test_cli.py)
loom_add_it(it_serve test_serve.py)
loom_add_it(it_membership test_membership.py)
loom_add_it(it_deploy test_deploy.py)
loom_add_it(it_drain test_drain.py)
loom_add_it(it_liveness test_liveness.py) # a paused coordinator, a stalled reactor, a step past its deadline
loom_add_it(it_grammar_load test_grammar_load.py) # a 2 MB JSON schema compiles off the reactor while streams run
loom_add_it(it_netns test_netns.py) # hosts as network namespaces: needs root, else skipped (77)
set_tests_properties(it_netns PROPERTIES SKIP_RETURN_CODE 77)
loom_add_it(it_quant test_quant.py)
loom_add_it(it_perplexity test_perplexity.py)

# The router (test_router.py): real replicas behind loom-router, and fake ones.
add_executable(fake_replica ${CMAKE_CURRENT_LIST_DIR}/fake_replica.c)
target_link_libraries(fake_replica PRIVATE loom_proto loom_base Loom::ZeroMQ)
set_target_properties(fake_replica PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
loom_add_it(it_router test_router.py)
loom_add_it(it_spec test_spec.py)
