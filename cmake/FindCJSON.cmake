# Find CJSON (cjson/cJSON.h, libcjson); defines CJSON_FOUND and the target Loom::CJSON.
include(${CMAKE_CURRENT_LIST_DIR}/LoomFindPkg.cmake)
loom_find_pkg(CJSON PKG libcjson HEADER cjson/cJSON.h LIBS cjson )
