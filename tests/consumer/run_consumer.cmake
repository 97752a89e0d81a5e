# Builds and runs one consumer project (MODE = find_package | add_subdirectory) with one
# program (PROGRAM = full | minimal, see program.cmake); find_package uses the kvtier that
# MODE = install put in PREFIX (the fixture of the tests that need it). MODE = examples
# builds and runs the small examples a user copies (examples/custom_policy, custom_admission,
# in_process), each from its own folder against that installed kvtier.
#
# PROGRAM=minimal is built as on a machine without OpenSSL's, liburing's and hiredis's
# development packages: find_package(OpenSSL) is disabled, pkg-config finds nothing, and their
# headers are shadowed by ones that stop the compile. The binary's NEEDED entries must then
# name none of libcrypto, libssl, liburing and libhiredis.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE ${PREFIX})
  run(${CMAKE_COMMAND} --install ${KVTIER_BINARY_DIR} --prefix ${PREFIX} --component Unspecified)
  if(NOT EXISTS ${PREFIX}/include/kvtier/kvtier.hpp)
    message(FATAL_ERROR "the install did not put the headers under ${PREFIX}/include")
  endif()
  return()
endif()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

# The examples unoptimized (no build type): they check what they do, and their compiles are
# that test's time.
if(MODE STREQUAL "examples")
  set(_configure_args -G ${GENERATOR} -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
else()
  set(_configure_args -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
                      -DKVTIER_CONSUMER_PROGRAM=${PROGRAM})
endif()
if(CXX_LAUNCHER)
  list(APPEND _configure_args -DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER})
endif()

set(_env "")
if(PROGRAM STREQUAL "minimal")
  set(_poison ${WORK_DIR}/absent_include)
  foreach(h openssl/evp.h openssl/sha.h liburing.h hiredis/hiredis.h)
    file(WRITE ${_poison}/${h} "#error \"${h}: a program of kvtier::kvtier alone must not need it\"\n")
  endforeach()
  file(MAKE_DIRECTORY ${WORK_DIR}/no_pkgconfig)
  list(APPEND _configure_args -DCMAKE_DISABLE_FIND_PACKAGE_OpenSSL=ON "-DCMAKE_CXX_FLAGS=-I${_poison}")
  set(_env ${CMAKE_COMMAND} -E env PKG_CONFIG_LIBDIR=${WORK_DIR}/no_pkgconfig PKG_CONFIG_PATH=)
endif()

if(MODE STREQUAL "examples")
  foreach(example custom_policy custom_admission in_process)
    set(_dir ${WORK_DIR}/${example})
    run(${CMAKE_COMMAND} -S ${KVTIER_SOURCE_DIR}/examples/${example} -B ${_dir} ${_configure_args}
        -DCMAKE_PREFIX_PATH=${PREFIX})
    run(${CMAKE_COMMAND} --build ${_dir})
    run(${_dir}/kvtier_example_${example})
    message(STATUS "examples/${example} built against the installed kvtier and ran")
  endforeach()
  return()
endif()

if(MODE STREQUAL "find_package")
  list(APPEND _configure_args -DCMAKE_PREFIX_PATH=${PREFIX})
else()
  list(APPEND _configure_args -DKVTIER_SOURCE_DIR=${KVTIER_SOURCE_DIR})
endif()

run(${_env} ${CMAKE_COMMAND} -S ${KVTIER_SOURCE_DIR}/tests/consumer/${MODE} -B ${WORK_DIR}/build ${_configure_args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
set(_program ${WORK_DIR}/build/kvtier_consumer)

if(PROGRAM STREQUAL "minimal")
  find_program(_readelf NAMES readelf REQUIRED)
  run(${_readelf} -d --wide ${_program})
  string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*\\[([^]\n]+)\\]" _needed_lines "${last_output}")
  set(_needed "")
  foreach(l IN LISTS _needed_lines)
    string(REGEX REPLACE ".*\\[([^]]+)\\]$" "\\1" _lib "${l}")
    list(APPEND _needed ${_lib})
  endforeach()
  if(NOT _needed MATCHES "libc\\.so")
    message(FATAL_ERROR "could not read the NEEDED entries of ${_program} (no libc.so among '${_needed}'):\n${last_output}")
  endif()
  set(_bad ${_needed})
  list(FILTER _bad INCLUDE REGEX "^lib(crypto|ssl|uring|hiredis)[.-]")
  if(_bad)
    message(FATAL_ERROR "${_program} (kvtier::kvtier alone) needs ${_bad}: only kvtier::engine "
                        "(OpenSSL), kvtier::uring and kvtier::redis may link them. NEEDED: ${_needed}")
  endif()
  message(STATUS "minimal consumer NEEDED: ${_needed}")
endif()

run(${_program})
if(NOT last_output MATCHES "kvtier consumer ok")
  message(FATAL_ERROR "the consumer did not report success:\n${last_output}")
endif()
message(STATUS "${MODE} ${PROGRAM} consumer: ${last_output}")
