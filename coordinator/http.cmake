# The HTTP gateway (loom_http: OpenAI-compatible API, /health, /metrics) and
# the chat templates it renders (loom_chat_template, also unit-tested alone).
# Included by coordinator/CMakeLists.txt.
find_package(MicroHTTPD REQUIRED)
# GnuTLS (libmicrohttpd's TLS library) checks --tls-cert/--tls-key at start-up.
find_package(GnuTLS REQUIRED)

add_library(loom_chat_template STATIC ${PROJECT_SOURCE_DIR}/common/chat_template.c)
target_link_libraries(loom_chat_template PUBLIC loom_base Loom::CJSON)

add_library(loom_http STATIC ${CMAKE_CURRENT_LIST_DIR}/http.c ${CMAKE_CURRENT_LIST_DIR}/http_guard.c
            ${CMAKE_CURRENT_LIST_DIR}/tool_calls.c ${CMAKE_CURRENT_LIST_DIR}/tool_stream.c
            ${CMAKE_CURRENT_LIST_DIR}/http_tls.c)
target_link_libraries(loom_http PUBLIC loom_server loom_client loom_chat_template Loom::MicroHTTPD Loom::CJSON
                      GnuTLS::GnuTLS Threads::Threads)
# /version answers with the project's version.
target_compile_definitions(loom_http PRIVATE LOOM_VERSION="${PROJECT_VERSION}")
