# The etcd client against a real etcd: tests/etcd_fixture.sh starts a private
# one (loopback, free ports, temp data) before the test and removes it after,
# as a ctest fixture. The test finds it through LOOM_ETCD_DIR/url, and restarts
# it through the same script, so this etcd is its own (not shared with others).
set(LOOM_ETCD_FIXTURE_SH ${CMAKE_CURRENT_LIST_DIR}/../etcd_fixture.sh)

# loom_etcd_fixture(<fixture name> <state dir>): ctest setup/cleanup tests that
# start and remove an etcd for the tests that name it in FIXTURES_REQUIRED.
function(loom_etcd_fixture name dir)
  add_test(NAME ${name}_start COMMAND bash ${LOOM_ETCD_FIXTURE_SH} start ${dir})
  add_test(NAME ${name}_clean COMMAND bash ${LOOM_ETCD_FIXTURE_SH} clean ${dir})
  set_tests_properties(${name}_start PROPERTIES FIXTURES_SETUP ${name} TIMEOUT 60 LABELS unit)
  set_tests_properties(${name}_clean PROPERTIES FIXTURES_CLEANUP ${name} TIMEOUT 60 LABELS unit)
endfunction()

if(TARGET loom_etcd)
  set(dir ${CMAKE_BINARY_DIR}/tests/etcd_unit)
  loom_etcd_fixture(etcd_unit ${dir})
  loom_add_test(test_etcd SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_etcd.c
                LIBS loom_etcd LABELS unit TIMEOUT 120)
  set_tests_properties(test_etcd PROPERTIES FIXTURES_REQUIRED etcd_unit
    ENVIRONMENT "LOOM_ETCD_DIR=${dir};LOOM_ETCD_FIXTURE=${LOOM_ETCD_FIXTURE_SH}")
endif()

if(TARGET loom_etcd)
  loom_add_test(test_cert SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cert.c LIBS loom_etcd LABELS unit)
endif()
