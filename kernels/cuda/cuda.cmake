# The CUDA backend. Included from kernels/CMakeLists.txt when LOOM_HAVE_CUDA
# (after loom_kernels exists), and by the standalone GPU test project
# (tests/gpu/CMakeLists.txt), which defines its own loom_kernels.
#   loom_cuda     the device kernels (.cu), linked with cudart and cuBLAS
#   loom_kernels  gains backend_cuda.c (the vtable, in C) and LOOM_HAVE_CUDA
#   loom_comm     gains comm_nccl.c and LOOM_HAVE_NCCL when NCCL was found
#                 (Loom::NCCL); loom_comm is defined later (worker/), so this
#                 is deferred to the end of the top-level directory if needed.
set(LOOM_CUDA_DIR ${CMAKE_CURRENT_LIST_DIR})
get_filename_component(LOOM_CUDA_ROOT ${LOOM_CUDA_DIR}/../.. ABSOLUTE)

add_library(loom_cuda STATIC
            ${LOOM_CUDA_DIR}/elementwise.cu
            ${LOOM_CUDA_DIR}/gemv.cu
            ${LOOM_CUDA_DIR}/qgemv.cu
            ${LOOM_CUDA_DIR}/qmma.cu
            ${LOOM_CUDA_DIR}/fp8act.cu
            ${LOOM_CUDA_DIR}/attention.cu
            ${LOOM_CUDA_DIR}/flash.cu
            ${LOOM_CUDA_DIR}/sampling.cu
            ${LOOM_CUDA_DIR}/moe.cu
            ${LOOM_CUDA_DIR}/lora.cu
            ${LOOM_CUDA_DIR}/cublas_dl.c
            ${LOOM_CUDA_DIR}/cublaslt_dl.c)
target_include_directories(loom_cuda PRIVATE ${LOOM_CUDA_ROOT})
set_target_properties(loom_cuda PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
target_compile_options(loom_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo -Xptxas=-warn-spills>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${LOOM_WERROR}>>:-Werror=all-warnings>)
# cuBLAS is dlopen()ed by cublas_dl.c when a CUDA backend is created: linked,
# its static initializers cost every process ~0.4 s at start-up. Only its
# headers are needed here.
target_link_libraries(loom_cuda PUBLIC loom_base CUDA::cudart ${CMAKE_DL_LIBS})
target_include_directories(loom_cuda PUBLIC ${CUDAToolkit_INCLUDE_DIRS})

target_sources(loom_kernels PRIVATE ${LOOM_CUDA_DIR}/backend_cuda.c)
target_compile_definitions(loom_kernels PUBLIC LOOM_HAVE_CUDA=1)
target_link_libraries(loom_kernels PUBLIC loom_cuda)

function(loom_cuda_attach_nccl)
    if(TARGET loom_comm AND TARGET Loom::NCCL)
        get_filename_component(_root ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../.. ABSOLUTE)
        target_sources(loom_comm PRIVATE ${_root}/worker/comm_nccl.c)
        target_compile_definitions(loom_comm PUBLIC LOOM_HAVE_NCCL=1)
        target_link_libraries(loom_comm PUBLIC Loom::NCCL CUDA::cudart)
        message(STATUS "Loom: NCCL data plane enabled (${NCCL_LIBRARY})")
    endif()
endfunction()
if(TARGET loom_comm)
    loom_cuda_attach_nccl()
else()
    cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL loom_cuda_attach_nccl)
endif()
