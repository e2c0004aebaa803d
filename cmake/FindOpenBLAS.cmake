# Find OpenBLAS (cblas.h, libopenblas); defines OpenBLAS_FOUND and the target Loom::OpenBLAS.
include(${CMAKE_CURRENT_LIST_DIR}/LoomFindPkg.cmake)
loom_find_pkg(OpenBLAS PKG openblas HEADER cblas.h LIBS openblas PATH_SUFFIXES openblas-pthread openblas)
