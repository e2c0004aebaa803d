# The Jinja engine (common/jinja.h): loom-jinja-render renders batches of
# cases; the conformance tests compare it byte for byte with python's jinja2
# set up as transformers sets it up (tests/reference/jinja_ref.py).
if(TARGET loom_jinja)
  add_executable(loom-jinja-render ${CMAKE_CURRENT_SOURCE_DIR}/unit/jinja_render.c)
  target_link_libraries(loom-jinja-render PRIVATE loom_jinja)
  set_target_properties(loom-jinja-render PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  set(_jref ${CMAKE_CURRENT_SOURCE_DIR}/reference/jinja_ref.py)
  add_test(NAME jinja_conformance
           COMMAND ${LOOM_PYTHON} ${_jref} conformance $<TARGET_FILE:loom-jinja-render>
                   ${CMAKE_CURRENT_SOURCE_DIR}/data/jinja/cases.json)
  add_test(NAME jinja_chat_templates
           COMMAND ${LOOM_PYTHON} ${_jref} templates $<TARGET_FILE:loom-jinja-render>
                   ${LOOM_MODELS_DIR}/../chat_templates)
  # 6000 random templates (whitespace control; expressions; statements and scoping) against jinja2, a fixed seed
  add_test(NAME jinja_random COMMAND ${LOOM_PYTHON} ${_jref} random $<TARGET_FILE:loom-jinja-render> 2 6000)
  set_tests_properties(jinja_conformance jinja_chat_templates jinja_random PROPERTIES LABELS unit TIMEOUT 120 SKIP_RETURN_CODE 77)
  loom_add_test(test_jinja SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_jinja.c LIBS loom_jinja LABELS unit TIMEOUT 60)
endif()
