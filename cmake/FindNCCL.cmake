# Find NCCL (no CMake config ships with it): nccl.h and libnccl next to the
# CUDA toolkit, or under NCCL_ROOT. Defines NCCL_FOUND and Loom::NCCL.
include(FindPackageHandleStandardArgs)
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT}/include ${CUDAToolkit_INCLUDE_DIRS})
find_library(NCCL_LIBRARY nccl HINTS ${NCCL_ROOT}/lib ${CUDAToolkit_LIBRARY_DIR})
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR)
if(NCCL_FOUND AND NOT TARGET Loom::NCCL)
  add_library(Loom::NCCL UNKNOWN IMPORTED)
  set_target_properties(Loom::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}" INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
