# LoRA adapters: PEFT directories read and checked (loom_lora) and the
# mixed-adapter CPU delta (kernels/cpu/lora.c) against its reference.
loom_add_test(test_lora SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lora.c
              LIBS loom_lora loom_kernels LABELS unit TIMEOUT 60)
# The coordinator's adapter registry and engine slots (pure logic).
loom_add_test(test_lora_slots SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lora_slots.c
              LIBS loom_coord_core LABELS unit TIMEOUT 60)
# The scheduler's admission through the slots and the adapter-seeded prefix hash.
loom_add_test(test_sched_lora SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sched_lora.c
              LIBS loom_coord_core LABELS unit TIMEOUT 60)
