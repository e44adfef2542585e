# Imported targets for the C libraries strata links, shared by the build
# (StrataDeps.cmake) and the installed package (strataConfig.cmake), so that a
# project using find_package(strata) finds them the same way.

# strata_import_library(<name> <include dir> <libraries...>): strata::<name>, once.
function(strata_import_library name include_dir)
  if(TARGET strata::${name})
    return()
  endif()
  add_library(strata::${name} INTERFACE IMPORTED GLOBAL)
  target_include_directories(strata::${name} SYSTEM INTERFACE ${include_dir})
  target_link_libraries(strata::${name} INTERFACE ${ARGN})
endfunction()

# strata_find_c_library(<name> <header> <package> <library> [<more libraries>...])
# Defines the imported target strata::<name> or fails with the Debian package to install.
function(strata_find_c_library name header package)
  set(found_libs)
  foreach(lib IN LISTS ARGN)
    find_library(STRATA_${name}_${lib}_LIBRARY ${lib})
    if(NOT STRATA_${name}_${lib}_LIBRARY)
      message(FATAL_ERROR "strata: library ${lib} not found; install the Debian package ${package} "
                          "(scripts/setup.sh does) or add its prefix to CMAKE_PREFIX_PATH")
    endif()
    list(APPEND found_libs ${STRATA_${name}_${lib}_LIBRARY})
  endforeach()
  find_path(STRATA_${name}_INCLUDE_DIR ${header})
  if(NOT STRATA_${name}_INCLUDE_DIR)
    message(FATAL_ERROR "strata: header ${header} not found; install the Debian package ${package}")
  endif()
  strata_import_library(${name} ${STRATA_${name}_INCLUDE_DIR} ${found_libs})
endfunction()

# strata_find_optional_library(<NAME> <header> <library> [HINTS <include hint> <library hint>])
# strata::<name> (lower case) and STRATA_HAVE_<NAME> ON when both are found, else OFF.
macro(strata_find_optional_library NAME header library)
  cmake_parse_arguments(_strata_opt "" "" "HINTS" ${ARGN})
  set(_strata_include_hint "")
  set(_strata_library_hint "")
  if(_strata_opt_HINTS)
    list(GET _strata_opt_HINTS 0 _strata_include_hint)
    list(GET _strata_opt_HINTS 1 _strata_library_hint)
  endif()
  find_path(STRATA_${NAME}_INCLUDE_DIR ${header} HINTS ${_strata_include_hint})
  find_library(STRATA_${NAME}_LIBRARY ${library} HINTS ${_strata_library_hint})
  set(STRATA_HAVE_${NAME} OFF)
  if(STRATA_${NAME}_INCLUDE_DIR AND STRATA_${NAME}_LIBRARY)
    set(STRATA_HAVE_${NAME} ON)
    string(TOLOWER ${NAME} _strata_name)
    strata_import_library(${_strata_name} ${STRATA_${NAME}_INCLUDE_DIR} ${STRATA_${NAME}_LIBRARY})
  endif()
endmacro()

# strata::gloo and STRATA_HAVE_GLOO (libgloo-dev).
macro(strata_find_gloo)
  strata_find_optional_library(GLOO gloo/config.h gloo)
endmacro()

# strata::nccl and STRATA_HAVE_NCCL, looked for beside the CUDA toolkit.
macro(strata_find_nccl include_hints library_hints)
  strata_find_optional_library(NCCL nccl.h nccl HINTS "${include_hints}" "${library_hints}")
endmacro()
