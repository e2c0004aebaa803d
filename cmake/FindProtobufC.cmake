# Find ProtobufC (protobuf-c/protobuf-c.h, libprotobuf-c); defines ProtobufC_FOUND and the target Loom::ProtobufC.
include(${CMAKE_CURRENT_LIST_DIR}/LoomFindPkg.cmake)
loom_find_pkg(ProtobufC PKG libprotobuf-c HEADER protobuf-c/protobuf-c.h LIBS protobuf-c )
