# Chat templates: sources, variables, errors, plain special tokens (common/chat_template.c).
if(TARGET loom_chat_template)
  loom_add_test(test_chat_template SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_chat_template.c
                LIBS loom_chat_template LABELS unit TIMEOUT 30)
endif()
# Tool calling: tools / tool_choice, the parsers' names and detection, the
# forced call's grammar in each syntax, output parsing (gateway/tool_calls.c).
if(TARGET loom_http)
  loom_add_test(test_tool_calls SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_tool_calls.c
                LIBS loom_http loom_grammar LABELS unit TIMEOUT 30)
endif()
# Streaming tool calls (gateway/tool_stream.c): every syntax and mode fed
# in every split gives the unstreamed parse's content, names and arguments.
if(TARGET loom_http)
  loom_add_test(test_tool_stream SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_tool_stream.c
                LIBS loom_http LABELS unit TIMEOUT 60)
endif()
# Reasoning parsers (common/reasoning.c): each format whole and streamed in every split.
if(TARGET loom_chat_template)
  loom_add_test(test_reasoning SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_reasoning.c
                LIBS loom_chat_template LABELS unit TIMEOUT 30)
endif()
