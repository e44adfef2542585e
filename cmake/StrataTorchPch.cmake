# Note [One precompiled LibTorch header]
#
# Parsing <torch/torch.h> costs about 10 s of g++'s time per translation unit
# on a 2-core machine, and 16 s with -O2 -g: a 47-line file that includes the
# engine's context header took 16 s, as long as an empty file that includes
# <torch/torch.h>. Every target
# that links LibTorch (directly, or through strata_parallel or the GPT model)
# therefore compiles with one precompiled <torch/torch.h>, built once by the
# target strata_torch_pch and reused (REUSE_FROM) by every LibTorch target:
# about 30 s once, then 4 s for an empty translation unit instead of 16.
#
# A PCH is only valid for compilations with the flags it was built with; g++
# ignores it (and -Winvalid-pch says so) otherwise:
#   - the code model: CMake compiles executables with -fPIE and libraries
#     with -fPIC. LibTorch executables compile with -fPIC too
#     (position-independent code links into a PIE), so one PCH serves both;
#   - every macro defined when the PCH was made must be defined alike where
#     it is used. strata_torch_pch therefore has only LibTorch's own
#     definitions and strata's warnings; a target may define more (STRATA_*)
#     as long as LibTorch's headers do not read them, which they do not.
#
# A translation unit that includes no LibTorch header compiles at half the
# speed with the PCH loaded (tools/info.cpp: 9.6 s without, 19 s with); such
# files in LibTorch targets set SKIP_PRECOMPILE_HEADERS (tools/CMakeLists.txt).
#
# ccache caches both the PCH and its users when told that the PCH's macros and
# timestamps are no part of the result (sloppiness pch_defines,time_macros;
# the root CMakeLists.txt sets it on the launcher).
#
# STRATA_TORCH_PCH=OFF builds without it (for measuring, or a compiler whose
# PCH misbehaves); the code never depends on it: every file includes what it
# uses.
option(STRATA_TORCH_PCH "Compile LibTorch translation units with one precompiled <torch/torch.h>" ON)

# True when target `t` links LibTorch: directly, or through a strata library that does.
function(strata_links_torch t out)
  set(result OFF)
  get_target_property(libs ${t} LINK_LIBRARIES)
  if(libs)
    foreach(lib IN LISTS libs)
      if(lib MATCHES "^(torch|torch_library|strata_parallel|strata_gpt_model)$" OR lib MATCHES "libtorch")
        set(result ON)
      endif()
    endforeach()
  endif()
  set(${out} ${result} PARENT_SCOPE)
endfunction()

# Every target defined under `dir` (recursively).
function(strata_targets_under dir out)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    strata_targets_under(${sub} more)
    list(APPEND targets ${more})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

# Called once, after every target is defined (the root CMakeLists.txt).
function(strata_apply_torch_pch)
  if(NOT STRATA_TORCH_PCH OR NOT STRATA_HAVE_TORCH)
    return()
  endif()
  file(WRITE ${PROJECT_BINARY_DIR}/strata_torch_pch.cpp "// The translation unit that makes the precompiled <torch/torch.h>.\n")
  add_library(strata_torch_pch OBJECT ${PROJECT_BINARY_DIR}/strata_torch_pch.cpp)
  target_link_libraries(strata_torch_pch PRIVATE ${TORCH_LIBRARIES} strata_warnings)
  target_precompile_headers(strata_torch_pch PRIVATE <torch/torch.h>)
  strata_targets_under(${PROJECT_SOURCE_DIR} targets)
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    if(NOT type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY)$")
      continue()
    endif()
    strata_links_torch(${t} uses_torch)
    if(NOT uses_torch)
      continue()
    endif()
    if(type STREQUAL EXECUTABLE)
      set_property(TARGET ${t} PROPERTY POSITION_INDEPENDENT_CODE OFF)
      target_compile_options(${t} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC>)
    endif()
    target_precompile_headers(${t} REUSE_FROM strata_torch_pch)
  endforeach()
endfunction()
