# Find ZeroMQ (zmq.h, libzmq); defines ZeroMQ_FOUND and the target Loom::ZeroMQ.
include(${CMAKE_CURRENT_LIST_DIR}/LoomFindPkg.cmake)
loom_find_pkg(ZeroMQ PKG libzmq HEADER zmq.h LIBS zmq )
