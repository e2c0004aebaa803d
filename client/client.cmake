# The C client library (loom_client) and the commands that use it
# (loom_client_cmds: `loom generate`, `loom health`, `loom stats`, `loom bench`).
# Included by client/CMakeLists.txt; the `loom` tool links loom_client_cmds.
add_library(loom_client STATIC ${CMAKE_CURRENT_LIST_DIR}/loom_client.c)
target_link_libraries(loom_client PUBLIC loom_proto Loom::ZeroMQ loom_base loom_keys)

# `loom bench` in parts (client/bench/bench.h): datasets, transports (ZeroMQ;
# OpenAI-compatible HTTP over libcurl), the run loop, statistics, reports.
find_package(CURL REQUIRED)
add_library(loom_bench STATIC ${CMAKE_CURRENT_LIST_DIR}/bench/dataset.c ${CMAKE_CURRENT_LIST_DIR}/bench/zmq.c
            ${CMAKE_CURRENT_LIST_DIR}/bench/http.c ${CMAKE_CURRENT_LIST_DIR}/bench/run.c
            ${CMAKE_CURRENT_LIST_DIR}/bench/stats.c ${CMAKE_CURRENT_LIST_DIR}/bench/report.c)
target_link_libraries(loom_bench PUBLIC loom_client CURL::libcurl Loom::CJSON m)

add_library(loom_client_cmds STATIC ${CMAKE_CURRENT_LIST_DIR}/cmd_generate.c
            ${CMAKE_CURRENT_LIST_DIR}/cmd_bench.c)
target_link_libraries(loom_client_cmds PUBLIC loom_client loom_bench m)

# The serving load generator on its own (`loom_bench_serve ...` = `loom bench ...`).
add_executable(loom_bench_serve ${CMAKE_CURRENT_LIST_DIR}/cmd_bench.c)
target_compile_definitions(loom_bench_serve PRIVATE LOOM_BENCH_SERVE_MAIN)
target_link_libraries(loom_bench_serve PRIVATE loom_client loom_bench m)
