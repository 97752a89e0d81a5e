# kvtier_optional_target(<component> DEPENDENCY <imported target> PACKAGE <name> INSTALL <how>
#                        [ENABLED <bool>] [DEFINITIONS <compile definitions...>])
#
# A library target for the headers that need one package more than kvtier::kvtier (the
# package is looked up before: cmake/kvtier_dependencies.cmake, kvtier_cuda.cmake):
# kvtier_<component>, alias and export name kvtier::<component>, linking kvtier and
# <imported target>. It is defined where that target exists (and ENABLED, when given, is
# true); otherwise a note names the package and how to install it (none when ENABLED is
# false: the option that turned it off has said why).
#
# Recorded in global properties, for the install (CMakeLists.txt) and kvtierConfig.cmake:
#   KVTIER_EXPORT_TARGETS           the targets defined
#   KVTIER_COMPONENTS               every component, defined or not: find_package(kvtier
#   KVTIER_COMPONENT_DEPENDENCIES   COMPONENTS <component>) finds it where its dependency is
#   KVTIER_COMPONENT_PACKAGES       found, and otherwise says "<package> (<how>)"
# <how> holds no ';' (a list separator here).
function(kvtier_optional_target component)
  cmake_parse_arguments(O "" "DEPENDENCY;PACKAGE;INSTALL;ENABLED" "DEFINITIONS" ${ARGN})
  if(NOT O_DEPENDENCY OR NOT O_PACKAGE OR NOT O_INSTALL)
    message(FATAL_ERROR "kvtier_optional_target(${component}): DEPENDENCY, PACKAGE and INSTALL are required")
  endif()
  set_property(GLOBAL APPEND PROPERTY KVTIER_COMPONENTS ${component})
  set_property(GLOBAL APPEND PROPERTY KVTIER_COMPONENT_DEPENDENCIES ${O_DEPENDENCY})
  set_property(GLOBAL APPEND PROPERTY KVTIER_COMPONENT_PACKAGES "${O_PACKAGE} (${O_INSTALL})")
  if(DEFINED O_ENABLED AND NOT O_ENABLED)
    return()
  endif()
  if(NOT TARGET ${O_DEPENDENCY})
    message(STATUS "kvtier: ${O_PACKAGE} not found (${O_INSTALL}): kvtier::${component} is not built")
    return()
  endif()
  add_library(kvtier_${component} INTERFACE)
  add_library(kvtier::${component} ALIAS kvtier_${component})
  target_link_libraries(kvtier_${component} INTERFACE kvtier ${O_DEPENDENCY})
  if(O_DEFINITIONS)
    target_compile_definitions(kvtier_${component} INTERFACE ${O_DEFINITIONS})
  endif()
  set_target_properties(kvtier_${component} PROPERTIES EXPORT_NAME ${component})
  set_property(GLOBAL APPEND PROPERTY KVTIER_EXPORT_TARGETS kvtier_${component})
endfunction()
