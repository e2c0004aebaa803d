# Shared helper for Loom's find modules: try pkg-config first, then plain
# find_path/find_library, and expose an imported target Loom::<name>.
include(FindPackageHandleStandardArgs)
find_package(PkgConfig QUIET)

# loom_find_pkg(<Name> PKG <pkg-config module> HEADER <header> LIBS <lib names...>
#               [PATH_SUFFIXES <suffixes...>])
function(loom_find_pkg name)
  cmake_parse_arguments(A "" "PKG;HEADER" "LIBS;PATH_SUFFIXES" ${ARGN})
  if(PKG_CONFIG_FOUND AND A_PKG)
    pkg_check_modules(PC_${name} QUIET ${A_PKG})
  endif()
  find_path(${name}_INCLUDE_DIR ${A_HEADER}
    HINTS ${PC_${name}_INCLUDE_DIRS} ${${name}_ROOT}/include
    PATH_SUFFIXES ${A_PATH_SUFFIXES})
  find_library(${name}_LIBRARY NAMES ${A_LIBS}
    HINTS ${PC_${name}_LIBRARY_DIRS} ${${name}_ROOT}/lib ${${name}_ROOT}/lib/x86_64-linux-gnu)
  find_package_handle_standard_args(${name} REQUIRED_VARS ${name}_LIBRARY ${name}_INCLUDE_DIR)
  if(${name}_FOUND AND NOT TARGET Loom::${name})
    add_library(Loom::${name} UNKNOWN IMPORTED)
    set_target_properties(Loom::${name} PROPERTIES
      IMPORTED_LOCATION "${${name}_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${${name}_INCLUDE_DIR}")
  endif()
  set(${name}_FOUND ${${name}_FOUND} PARENT_SCOPE)
endfunction()
