# bench_gpu: decode MBU and prefill rate of the CUDA backend on a random
# Llama-3-8B-shaped model built in device memory (only with CUDA).
if(LOOM_HAVE_CUDA)
  loom_add_bench(bench_gpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_gpu.c
                 LIBS loom_kernels CUDA::cublas CUDA::cudart)
endif()
