# Find libsodium (sodium.h, libsodium); defines Sodium_FOUND and the target Loom::Sodium.
# The data plane's HMAC-SHA256 link authentication uses it (worker/comm_tcp.c).
include(${CMAKE_CURRENT_LIST_DIR}/LoomFindPkg.cmake)
loom_find_pkg(Sodium PKG libsodium HEADER sodium.h LIBS sodium)
