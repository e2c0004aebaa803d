# CURVE keys: key files, allow-lists, the ZAP handler with real CURVE
# sockets on loopback (common/keys.h, common/zap.h).
if(TARGET loom_keys)
  loom_add_test(test_keys SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_keys.c
                LIBS loom_keys LABELS unit TIMEOUT 60)
endif()
