# Find MicroHTTPD (microhttpd.h, libmicrohttpd); defines MicroHTTPD_FOUND and the target Loom::MicroHTTPD.
include(${CMAKE_CURRENT_LIST_DIR}/LoomFindPkg.cmake)
loom_find_pkg(MicroHTTPD PKG libmicrohttpd HEADER microhttpd.h LIBS microhttpd )
