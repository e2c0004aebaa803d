# Integration tests: real coordinator and worker processes on 127.0.0.1,
# started through deploy/local/launch.sh, driven by the `loom` tool.
add_executable(garbage ${CMAKE_CURRENT_LIST_DIR}/garbage.c)
target_link_libraries(garbage PRIVATE loom_proto Loom::ZeroMQ)
set_target_properties(garbage PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
add_executable(hijack ${CMAKE_CURRENT_LIST_DIR}/hijack.c)
target_link_libraries(hijack PRIVATE loom_proto loom_keys Loom::ZeroMQ)
set_target_properties(hijack PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)

loom_add_it(it_grid test_grid.py)
# test_models.py in six entries: the MoE families, their float64 references,
# their quantized variants, Gemma, the other dense families, and the rest
# (refusals, the NaN cluster, quantization KL, and any test added later).
loom_add_it(it_models_moe test_models.py test_moe_refusals test_moe_grids)
loom_add_it(it_models_moe_ref test_models.py test_moe_reference_grids)
loom_add_it(it_models_moe_int8 test_models.py test_moe_int8_grids test_moe_quantized_checkpoints)
loom_add_it(it_models_gemma test_models.py test_gemma)
loom_add_it(it_models_dense test_models.py test_new_family_grids test_partial_rotary)
loom_add_it(it_models_rest test_models.py --except test_moe_ test_gemma test_new_family_grids test_partial_rotary)
loom_add_it(it_gpt_oss test_gpt_oss.py)
loom_add_it(it_cluster test_cluster.py)
loom_add_it(it_security test_security.py)
loom_add_it(it_etcd_secure test_etcd_secure.py)
set_tests_properties(it_security PROPERTIES SKIP_RETURN_CODE 77)
loom_add_it(it_serving test_serving.py)
loom_add_it(it_kv_offload test_kv_offload.py --except test_host_)
loom_add_it(it_kv_offload_host test_kv_offload.py test_host_) # the host-memory tier
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
# test_router.py in four entries: the basics (flags, one pair, the cache,
# CURVE), failover and probing, streams resumed elsewhere (seeded, without
# --model), and the rest (tenants, etcd, replicas that misbehave or differ,
# the probe listener, and any test added later).
loom_add_it(it_router_basic test_router.py test_cli test_stories_pair test_response_cache test_curve)
loom_add_it(it_router_failover test_router.py test_failover_and_disconnect test_probe_back)
loom_add_it(it_router_resume test_router.py test_seeded_failover test_failover_without_model)
loom_add_it(it_router_replicas test_router.py --except test_cli test_stories_pair test_response_cache test_curve
            test_failover_and_disconnect test_seeded_failover test_failover_without_model test_probe_back)
loom_add_it(it_spec test_spec.py)
loom_add_it(it_pd_transfer test_pd_transfer.py) # prefill/decode over transport tcp
