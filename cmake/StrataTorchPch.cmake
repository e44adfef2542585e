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

# Note [Unity builds of the LibTorch targets]
#
# The PCH saves the parse of <torch/torch.h>, not what comes after it: g++
# spends most of a LibTorch translation unit instantiating the same
# templates (c10::IValue, at::Tensor's operators, torch::nn holders, gtest)
# and generating their code, again in every file. tests/parallel's
# engine_test, optimizer_test and checkpoint_test took 22 + 18 + 23 s alone
# at -O2 -g1 and 31 s as one file. So every LibTorch target of more than
# one file compiles as unity batches of STRATA_UNITY_BATCH files (CMake's
# UNITY_BUILD; docs/building.md has the whole build's figures). It comes
# with the PCH (STRATA_TORCH_PCH=OFF turns both off).
#
# What a batch costs: a file-local name (an anonymous namespace, a static
# function) must be unique within its target, since it now shares a
# translation unit with its batch; a clash is a compile error, but a
# same-named function with another signature would silently join an
# overload set, so tools/check_unity_names.py refuses those and CI runs it.
# Editing one file recompiles its batch. STRATA_UNITY_BUILD=OFF builds file
# by file (what compile errors then name is the file itself).
option(STRATA_UNITY_BUILD "Compile the LibTorch targets in unity batches" ON)
set(STRATA_UNITY_BATCH 6 CACHE STRING "Files per unity batch of a LibTorch target")

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
    if(STRATA_UNITY_BUILD)
      # A file that skips the PCH sees no LibTorch: it would gain nothing in a
      # batch. A target of one LibTorch file stays as it is (its object then
      # shares ccache hits between clones; a batch names its files' absolute paths).
      get_target_property(sources ${t} SOURCES)
      get_target_property(source_dir ${t} SOURCE_DIR)
      set(batched 0)
      foreach(src IN LISTS sources)
        # A relative name is looked up from the calling directory, not the target's.
        cmake_path(ABSOLUTE_PATH src BASE_DIRECTORY ${source_dir} OUTPUT_VARIABLE src_path)
        get_source_file_property(skip ${src_path} DIRECTORY ${source_dir} SKIP_PRECOMPILE_HEADERS)
        if(skip)
          set_source_files_properties(${src_path} DIRECTORY ${source_dir} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
        elseif(src MATCHES "\\.(cpp|cc|cxx)$")
          math(EXPR batched "${batched} + 1")
        endif()
      endforeach()
      if(batched GREATER 1)
        set_target_properties(${t} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${STRATA_UNITY_BATCH})
        # g++ takes a .cpp included by the batch for a header, and warns of its
        # classes that hold anonymous-namespace types, as it would in a header.
        target_compile_options(${t} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-subobject-linkage>)
      endif()
    endif()
  endforeach()
endfunction()
