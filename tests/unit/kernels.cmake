# CPU backend op tests and the sampling reference tests.
# (~55 s under ASan on a loaded 2-core machine: the attention cases dominate)
loom_add_test(test_kernels_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_cpu.c
              LIBS loom_kernels LABELS unit kernels TIMEOUT 120)
loom_add_test(test_sampling SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sampling.c
              LIBS loom_kernels LABELS unit kernels TIMEOUT 60)
loom_add_test(test_quant SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quant.c
              LIBS loom_kernels LABELS unit kernels TIMEOUT 120)
# The CUDA quantized kernels' decoding and index math, on the CPU (no GPU,
# no CUDA toolkit needed).
loom_add_test(test_qformat SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_qformat.c
              LIBS loom_kernels LABELS unit kernels TIMEOUT 60)
# Speculative decoding helpers, the verification rule's distribution, the
# wall-time gate (and, on stories260K, loom run's loop with the gate).
loom_add_test(test_spec SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_spec.c
              LIBS loom_worker_core loom_kernels loom_base LABELS unit TIMEOUT 60)
# The CUDA kernels' per-element math (kernels/cuda/opmath.h) and their
# online-softmax tile loop, emulated on the CPU against the CPU backend.
loom_add_test(test_cuda_math SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_math.c ${PROJECT_SOURCE_DIR}/worker/moe_ds.c
              LIBS loom_kernels LABELS unit kernels TIMEOUT 60)
