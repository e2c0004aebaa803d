# Quantized weights on the host: TP column slices and q/k/v stacking (worker/qweights.c).
loom_add_test(test_qweights SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_qweights.c
              LIBS loom_worker_core LABELS unit)
# The model families' tables: names, needs, the capability refusal (worker/arch/, worker/engine/arch.h).
loom_add_test(test_arch SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_arch.c
              LIBS loom_worker_core LABELS unit)
