# The C client and the `loom generate|health|stats|bench` commands against a
# fake coordinator (a ROUTER thread speaking loom.v1) on loopback.
if(TARGET loom_client_cmds)
  loom_add_test(test_client SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_client.c
                LIBS loom_client_cmds loom_client LABELS unit TIMEOUT 120)
endif()

# `loom bench`'s statistics, arrivals and datasets (client/bench/), no server.
if(TARGET loom_bench)
  loom_add_test(test_bench SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_bench.c LIBS loom_bench LABELS unit)
endif()
