# Third-party dependencies. Debian packages on developer and CI machines; on GPU
# machines the same packages are unpacked into a prefix (tools/gpu_check.sh) and
# found through CMAKE_PREFIX_PATH, so every lookup here goes through find_path /
# find_library / find_package and never through hard-coded /usr paths.

include(CheckLanguage)

include(StrataFindLibrary)

strata_find_c_library(hwloc hwloc.h libhwloc-dev hwloc)
strata_find_c_library(uring liburing.h liburing-dev uring)
strata_find_c_library(jemalloc jemalloc/jemalloc.h libjemalloc-dev jemalloc)
strata_find_c_library(xxhash xxhash.h libxxhash-dev xxhash)

find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)

# Gloo: the CPU collectives of the communicator (parallel/comm/gloo_communicator.cpp).
strata_find_gloo()

# CUDA and NCCL: used when found. A CUDA build adds code; it never changes the CPU path.
set(STRATA_HAVE_CUDA OFF)
set(STRATA_HAVE_NCCL OFF)
if(STRATA_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Ampere and Hopper (the H200 machines); CUDA 13 no longer targets older than sm_75.
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(STRATA_HAVE_CUDA ON)
    strata_find_nccl("${CUDAToolkit_INCLUDE_DIRS}" "${CUDAToolkit_LIBRARY_DIR}")
  endif()
endif()

# LibTorch: Debian's 1.13 or a pip 2.x through CMAKE_PREFIX_PATH. Only adapters link it.
set(STRATA_HAVE_TORCH OFF)
if(STRATA_WITH_TORCH)
  find_package(Torch REQUIRED)
  set(STRATA_HAVE_TORCH ON)
  # TorchConfig forces CXX_STANDARD 14 on its target; strata's adapters need 17 (2.x does too).
  set_property(TARGET torch PROPERTY CXX_STANDARD 17)
endif()

if(STRATA_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
