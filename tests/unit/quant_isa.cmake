# test_quant again with the quantized kernels' path forced at backend
# creation (LOOM_CPU_ISA), so the backend-level cases (check_matmul, every
# path) also run on AVX2, AVX-VNNI and the scalar reference on an AVX-512
# VNNI machine; a path the CPU lacks is refused with a warning and the test
# runs the detected one. (test_qgemm and check_isas call every path
# directly.) The test_quant target is defined in kernels.cmake.
foreach(isa avx2 avxvnni generic)
  add_test(NAME test_quant_${isa} COMMAND test_quant)
  set_tests_properties(test_quant_${isa} PROPERTIES TIMEOUT 120 LABELS "unit;kernels"
                       ENVIRONMENT "LOOM_CPU_ISA=${isa}")
endforeach()
