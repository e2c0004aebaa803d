# GPU tests (need the CUDA backend). Without a GPU they print "skipped: no
# GPU" and exit 77, which ctest reports as skipped (SKIP_RETURN_CODE).
#   test_cublas_dl  cuBLAS loads by dlopen with every symbol (no GPU needed)
#   test_cuda_ops   every op against the CPU backend
#   test_cuda_e2e   stories260K through model.c on cuda:0 against the CPU
#   test_nccl_comm  the NCCL data plane between two GPU processes (needs 2 GPUs)
#   gpu_run_sh      tests/gpu/run.sh: standalone build, the two above on every
#                   family's tiny model, the 8B-shape benchmark (<= 7 minutes
#                   after the build); exits 77 here without a GPU
#   gpu_standalone_build  compiles and links run.sh's standalone build (the
#                   CUDA toolkit alone, sm_90) here, GPU or not, so that a GPU
#                   machine never meets a build broken since it was last used;
#                   then runs test_model_config built against its cJSON shim
if(LOOM_HAVE_CUDA)
  # runs without a GPU: cuBLAS is dlopen()ed, and every symbol must resolve
  loom_add_test(test_cublas_dl SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cublas_dl.c
                LIBS loom_kernels LABELS unit)
  loom_add_test(test_cuda_ops SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.c ${PROJECT_SOURCE_DIR}/worker/moe_ds.c
                LIBS loom_kernels LABELS gpu TIMEOUT 300)
  loom_add_test(test_cuda_e2e SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_e2e.c ${PROJECT_SOURCE_DIR}/worker/kv_offload.c
                LIBS loom_worker_core LABELS gpu TIMEOUT 300
                ARGS --model ${LOOM_MODELS_DIR}/stories260K --dtype bf16)
  add_test(NAME test_cuda_e2e_f32 COMMAND test_cuda_e2e --model ${LOOM_MODELS_DIR}/stories260K --dtype f32)
  add_test(NAME test_cuda_e2e_kv_host COMMAND test_cuda_e2e --model ${LOOM_MODELS_DIR}/stories260K --dtype f32
           --kv-host)
  add_test(NAME test_cuda_e2e_kv_dir COMMAND test_cuda_e2e --model ${LOOM_MODELS_DIR}/stories260K --dtype f32
           --kv-dir)
  if(TARGET Loom::NCCL)
    loom_add_test(test_nccl_comm SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_nccl_comm.c
                  LIBS loom_comm loom_kernels Threads::Threads LABELS gpu TIMEOUT 300)
    set_tests_properties(test_nccl_comm PROPERTIES SKIP_RETURN_CODE 77)
  endif()
  add_test(NAME gpu_standalone_build COMMAND bash -c
           "cmake -S '${CMAKE_CURRENT_LIST_DIR}' -B '${CMAKE_BINARY_DIR}/tests/gpu-standalone' \
            -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release >/dev/null && \
            cmake --build '${CMAKE_BINARY_DIR}/tests/gpu-standalone' -j 2 && \
            '${CMAKE_BINARY_DIR}/tests/gpu-standalone/bin/test_model_config_shim'")
  set_tests_properties(gpu_standalone_build PROPERTIES TIMEOUT 600 LABELS build
                       ENVIRONMENT "LOOM_MODELS_DIR=${LOOM_MODELS_DIR}")
  add_test(NAME gpu_run_sh COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/run.sh ${CMAKE_BINARY_DIR}/tests/gpu-run)
  set_tests_properties(test_cuda_ops test_cuda_e2e test_cuda_e2e_f32 test_cuda_e2e_kv_host test_cuda_e2e_kv_dir
                       gpu_run_sh PROPERTIES SKIP_RETURN_CODE 77)
  set_tests_properties(test_cuda_e2e_f32 test_cuda_e2e_kv_host test_cuda_e2e_kv_dir PROPERTIES TIMEOUT 300 LABELS gpu)
  set_tests_properties(gpu_run_sh PROPERTIES TIMEOUT 900 LABELS gpu
                       ENVIRONMENT "LOOM_MODELS_DIR=${LOOM_MODELS_DIR};LOOM_RUN_NO_GPU_RC=77")
endif()
