loom_add_test(test_wire SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_wire.c LIBS loom_proto LABELS unit)
