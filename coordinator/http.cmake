# The HTTP gateway (loom_http: OpenAI-compatible API, /health, /metrics) and
# the chat templates it renders (loom_chat_template, also unit-tested alone).
# Included by coordinator/CMakeLists.txt.
find_package(MicroHTTPD REQUIRED)
# GnuTLS (libmicrohttpd's TLS library) checks --tls-cert/--tls-key at start-up.
find_package(GnuTLS REQUIRED)

# The templates Loom ships (docs/templates/NAME.jinja, for --chat-template NAME)
# are embedded as C arrays.
set(_shipped_c ${CMAKE_CURRENT_BINARY_DIR}/chat_shipped.c)
set(_shipped_src "/* Generated from docs/templates by coordinator/http.cmake. */\n")
foreach(_name chatml)
  set(_f ${PROJECT_SOURCE_DIR}/docs/templates/${_name}.jinja)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_f})
  file(READ ${_f} _hex HEX)
  string(REGEX REPLACE "(..)" "0x\\1," _bytes "${_hex}")
  string(APPEND _shipped_src "const char loom_chat_shipped_${_name}[] = {${_bytes}0};\n")
endforeach()
file(CONFIGURE OUTPUT ${_shipped_c} CONTENT "${_shipped_src}")
add_library(loom_chat_template STATIC ${PROJECT_SOURCE_DIR}/common/chat_template.c
            ${PROJECT_SOURCE_DIR}/common/reasoning.c ${_shipped_c})
target_link_libraries(loom_chat_template PUBLIC loom_base loom_tokenizer loom_jinja Loom::CJSON)

add_library(loom_http STATIC ${CMAKE_CURRENT_LIST_DIR}/http.c ${CMAKE_CURRENT_LIST_DIR}/http_guard.c
            ${CMAKE_CURRENT_LIST_DIR}/tool_calls.c ${CMAKE_CURRENT_LIST_DIR}/tool_stream.c
            ${CMAKE_CURRENT_LIST_DIR}/http_tls.c)
target_link_libraries(loom_http PUBLIC loom_server loom_client loom_chat_template Loom::MicroHTTPD Loom::CJSON
                      GnuTLS::GnuTLS Threads::Threads)
# /version answers with the project's version.
target_compile_definitions(loom_http PRIVATE LOOM_VERSION="${PROJECT_VERSION}")
