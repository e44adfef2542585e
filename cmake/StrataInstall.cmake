# `cmake --install` puts strata's libraries, public headers and a package
# config under the prefix, so that another CMake project does
#
#   find_package(strata CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE strata::parallel)
#
# Targets: strata::core, strata::kernels, strata::offload, strata::memory,
# strata::checkpoint and, built with LibTorch, strata::parallel.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(strata_install_targets strata_core strata_kernels strata_offload strata_memory strata_checkpoint strata_warnings)
if(TARGET strata_kernels_cuda)
  list(APPEND strata_install_targets strata_kernels_cuda)
endif()
if(TARGET strata_parallel)
  list(APPEND strata_install_targets strata_parallel)
endif()
foreach(target IN LISTS strata_install_targets)
  string(REPLACE "strata_" "" export_name ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${export_name})
endforeach()

install(TARGETS ${strata_install_targets} EXPORT strataTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(layer core kernels offload memory checkpoint)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
if(TARGET strata_parallel)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/parallel/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()

set(strata_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${strata_cmake_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/strataConfig.cmake.in
  ${PROJECT_BINARY_DIR}/strataConfig.cmake INSTALL_DESTINATION ${strata_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/strataConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/strataConfig.cmake ${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/StrataFindLibrary.cmake DESTINATION ${strata_cmake_dir})
