# Chat template detection and rendering (common/chat_template.c).
if(TARGET loom_chat_template)
  loom_add_test(test_chat_template SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_chat_template.c
                LIBS loom_chat_template LABELS unit TIMEOUT 30)
endif()
