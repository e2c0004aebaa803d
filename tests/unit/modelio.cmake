# Model loading: safetensors reader and config.json parser (loom_modelio).
loom_add_test(test_safetensors SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_safetensors.c
              LIBS loom_modelio LABELS unit)
loom_add_test(test_model_config SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_model_config.c
              LIBS loom_modelio LABELS unit)
loom_add_test(test_json SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_json.c
              LIBS loom_modelio LABELS unit)
loom_add_test(test_weights_check SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_weights_check.c
              LIBS loom_modelio LABELS unit)
