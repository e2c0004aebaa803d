# libFuzzer targets (docs/fuzzing.md): configured with -DLOOM_FUZZ=ON and
# clang, which also turns on ASan + UBSan for every target of that build.
# Each target has a committed seed corpus in corpus/<name>/; ctest runs
# every target for LOOM_FUZZ_SECONDS on a scratch copy of it (label fuzz).
if(NOT LOOM_FUZZ)
  return()
endif()
set(LOOM_FUZZ_SECONDS 20 CACHE STRING "seconds each fuzz target runs under ctest")
set(LOOM_FUZZ_MAX_LEN 8192 CACHE STRING "largest input (bytes) a target's ctest run generates; MAX_LEN raises it per target")
set(LOOM_FUZZ_DIR ${CMAKE_CURRENT_LIST_DIR})

# loom_add_fuzz(<name> [MAX_LEN <bytes>] LIBS <libs...>): tests/fuzz/<name>.c as a libFuzzer binary and its
# bounded run. MAX_LEN (at least LOOM_FUZZ_MAX_LEN) also keeps the target's larger seeds whole: libFuzzer
# truncates a corpus input to -max_len when it reads it.
function(loom_add_fuzz name)
  cmake_parse_arguments(A "" "MAX_LEN" "LIBS" ${ARGN})
  set(max_len ${LOOM_FUZZ_MAX_LEN})
  if(A_MAX_LEN AND A_MAX_LEN GREATER max_len)
    set(max_len ${A_MAX_LEN})
  endif()
  add_executable(${name} ${LOOM_FUZZ_DIR}/${name}.c)
  target_link_libraries(${name} PRIVATE ${A_LIBS})
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
  target_compile_definitions(${name} PRIVATE LOOM_FUZZ_MODEL_DIR="${LOOM_MODELS_DIR}/stories260K")
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/fuzz)
  add_test(NAME ${name} COMMAND ${LOOM_FUZZ_DIR}/run.sh $<TARGET_FILE:${name}> ${LOOM_FUZZ_DIR}/corpus/${name}
                                ${CMAKE_BINARY_DIR}/fuzz/work ${LOOM_FUZZ_SECONDS} ${max_len})
  math(EXPR timeout "${LOOM_FUZZ_SECONDS} + 280")
  set_tests_properties(${name} PROPERTIES LABELS fuzz TIMEOUT ${timeout})
  set_property(GLOBAL APPEND PROPERTY LOOM_FUZZ_TARGETS ${name})
endfunction()

loom_add_fuzz(fuzz_safetensors LIBS loom_modelio)
loom_add_fuzz(fuzz_config LIBS loom_modelio)
loom_add_fuzz(fuzz_tokenizer LIBS loom_tokenizer)
loom_add_fuzz(fuzz_chat_template LIBS loom_chat_template loom_tokenizer)
loom_add_fuzz(fuzz_http_request LIBS loom_http)
loom_add_fuzz(fuzz_api_proto LIBS loom_proto)
loom_add_fuzz(fuzz_control_proto LIBS loom_proto)
# 256 KiB specs: the chained-rule grammars and deep schemas of the regression seeds, and longer
loom_add_fuzz(fuzz_grammar MAX_LEN 262144 LIBS loom_grammar loom_tokenizer)
loom_add_fuzz(fuzz_tool_stream LIBS loom_http)
loom_add_fuzz(fuzz_jinja LIBS loom_jinja loom_base)

get_property(_fuzz_targets GLOBAL PROPERTY LOOM_FUZZ_TARGETS)
add_custom_target(fuzz_all DEPENDS ${_fuzz_targets})
