# The scale-out simulator's invariants (tools/sim/loomsim.py; Python with numpy).
add_test(NAME test_loomsim COMMAND ${LOOM_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/test_loomsim.py)
set_tests_properties(test_loomsim PROPERTIES TIMEOUT 180 LABELS "unit;sim")
