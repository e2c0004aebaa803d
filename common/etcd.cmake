# loom_etcd: an etcd v3 client over the JSON gateway (libcurl + cJSON), used
# for membership (docs/membership.md), and the certificate date check its TLS
# options use (cert.c). Included from common/CMakeLists.txt.
find_package(CURL REQUIRED)
add_library(loom_etcd STATIC ${CMAKE_CURRENT_LIST_DIR}/etcd.c ${CMAKE_CURRENT_LIST_DIR}/cert.c)
target_link_libraries(loom_etcd PUBLIC loom_base CURL::libcurl Loom::CJSON)
