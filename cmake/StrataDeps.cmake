# Third-party dependencies. Debian packages on developer and CI machines; on GPU
# machines the same packages are unpacked into a prefix (tools/gpu_check.sh) and
# found through CMAKE_PREFIX_PATH, so every lookup here goes through find_path /
# find_library / find_package and never through hard-coded /usr paths.

include(CheckLanguage)

# strata_find_c_library(<name> <header> <library> [<more libraries>...])
# Defines the imported target strata::<name> or fails with the Debian package to install.
function(strata_find_c_library name header package)
  set(libs ${ARGN})
  find_path(STRATA_${name}_INCLUDE_DIR ${header})
  set(found_libs)
  foreach(lib IN LISTS libs)
    find_library(STRATA_${name}_${lib}_LIBRARY ${lib})
    if(NOT STRATA_${name}_${lib}_LIBRARY)
      message(FATAL_ERROR "strata: library ${lib} not found; install the Debian package ${package} "
                          "(scripts/setup.sh does) or add its prefix to CMAKE_PREFIX_PATH")
    endif()
    list(APPEND found_libs ${STRATA_${name}_${lib}_LIBRARY})
  endforeach()
  if(NOT STRATA_${name}_INCLUDE_DIR)
    message(FATAL_ERROR "strata: header ${header} not found; install the Debian package ${package}")
  endif()
  add_library(strata::${name} INTERFACE IMPORTED GLOBAL)
  target_include_directories(strata::${name} SYSTEM INTERFACE ${STRATA_${name}_INCLUDE_DIR})
  target_link_libraries(strata::${name} INTERFACE ${found_libs})
endfunction()

strata_find_c_library(hwloc hwloc.h libhwloc-dev hwloc)
strata_find_c_library(uring liburing.h liburing-dev uring)
strata_find_c_library(jemalloc jemalloc/jemalloc.h libjemalloc-dev jemalloc)
strata_find_c_library(xxhash xxhash.h libxxhash-dev xxhash)

find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)

# Gloo: the CPU collectives of the communicator (parallel/gloo_communicator.cpp).
find_path(STRATA_GLOO_INCLUDE_DIR gloo/config.h)
find_library(STRATA_GLOO_LIBRARY gloo)
set(STRATA_HAVE_GLOO OFF)
if(STRATA_GLOO_INCLUDE_DIR AND STRATA_GLOO_LIBRARY)
  set(STRATA_HAVE_GLOO ON)
  add_library(strata::gloo INTERFACE IMPORTED GLOBAL)
  target_include_directories(strata::gloo SYSTEM INTERFACE ${STRATA_GLOO_INCLUDE_DIR})
  target_link_libraries(strata::gloo INTERFACE ${STRATA_GLOO_LIBRARY})
endif()

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
    find_path(STRATA_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(STRATA_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(STRATA_NCCL_INCLUDE_DIR AND STRATA_NCCL_LIBRARY)
      set(STRATA_HAVE_NCCL ON)
      add_library(strata::nccl INTERFACE IMPORTED GLOBAL)
      target_include_directories(strata::nccl SYSTEM INTERFACE ${STRATA_NCCL_INCLUDE_DIR})
      target_link_libraries(strata::nccl INTERFACE ${STRATA_NCCL_LIBRARY})
    endif()
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
