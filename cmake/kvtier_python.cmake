# The `kvtier` Python package (python/, docs/python.md): the pybind11 extension kvtier._kvtier
# and the pure-Python modules, assembled in ${PROJECT_BINARY_DIR}/python/kvtier (what the tests
# put on sys.path) and installed with `cmake --install <build> --component python` into the
# interpreter's site-packages.
#
# KVTIER_BUILD_PYTHON (cmake/kvtier_auto_option.cmake): AUTO (the default) builds the package
# when Python (interpreter + development headers) and pybind11's CMake config are found, kvtier
# is the top-level project and kvtier::engine is built (the extension binds the connector and
# the hasher: OpenSSL), and never in sanitizer builds (a sanitized extension needs a sanitized
# interpreter, or the runtime preloaded into it). Resolved at every configure: a build
# directory configured before python3-dev and pybind11-dev were installed builds the package
# once they are. ON requires it (scripts/test.sh: its Python stage needs it), OFF leaves it out.
#
# Which Python: Debian's python3-torch, python3-numpy and python3-pytest install for
# /usr/bin/python3, and a different python3 earlier on PATH (a pyenv build, a venv) does not
# see them. So unless Python_EXECUTABLE is given, /usr/bin/python3 is used where it exists.

kvtier_auto_option(KVTIER_BUILD_PYTHON "build the kvtier Python package, python/: AUTO where Python's headers and pybind11 are found"
                   "Build the kvtier Python package (pybind11 bindings, python/)")

if(NOT DEFINED Python_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "The Python interpreter the kvtier package is built for")
endif()

set(_kvtier_python_available OFF)
set(_kvtier_python_missing "")
if(KVTIER_SANITIZE)
  set(_kvtier_python_missing "this is a sanitizer build (KVTIER_SANITIZE=${KVTIER_SANITIZE}): a sanitized extension needs a sanitized interpreter")
elseif(NOT PROJECT_IS_TOP_LEVEL)
  set(_kvtier_python_missing "kvtier is not the top-level project")
elseif(NOT TARGET kvtier_engine)
  set(_kvtier_python_missing "it needs kvtier::engine, i.e. OpenSSL (Debian: libssl-dev)")
elseif(NOT _KVTIER_REQUESTED_KVTIER_BUILD_PYTHON STREQUAL "OFF")
  find_package(Python 3.8 QUIET COMPONENTS Interpreter Development.Module)
  if(NOT Python_FOUND)
    set(_kvtier_python_missing "no Python 3 interpreter with its development headers was found for "
                               "'${Python_EXECUTABLE}' (Debian: python3-dev, or another interpreter with -DPython_EXECUTABLE=...)")
  else()
    find_package(pybind11 2.6 CONFIG QUIET)  # Debian: pybind11-dev (2.10)
    if(NOT pybind11_FOUND)
      set(_kvtier_python_missing "pybind11's CMake config was not found (Debian: pybind11-dev)")
    else()
      set(_kvtier_python_available ON)
    endif()
  endif()
endif()
string(JOIN "" _kvtier_python_missing ${_kvtier_python_missing})
kvtier_resolve_auto_option(KVTIER_BUILD_PYTHON ${_kvtier_python_available} "the Python package cannot be built: ${_kvtier_python_missing}")
if(NOT KVTIER_BUILD_PYTHON)
  return()
endif()

if(NOT Python_FOUND)
  find_package(Python 3.8 REQUIRED COMPONENTS Interpreter Development.Module)
endif()
if(NOT pybind11_FOUND)
  find_package(pybind11 2.6 CONFIG REQUIRED)
endif()

# Where `cmake --install --component python` puts the package: the interpreter's platlib
# (Debian: /usr/local/lib/python3.X/dist-packages, on sys.path of /usr/bin/python3).
if(NOT DEFINED KVTIER_PYTHON_INSTALL_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import sysconfig; print(sysconfig.get_path('platlib'))"
    OUTPUT_VARIABLE _kvtier_platlib OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _kvtier_platlib_rc)
  if(NOT _kvtier_platlib_rc EQUAL 0 OR _kvtier_platlib STREQUAL "")
    set(_kvtier_platlib "${Python_SITEARCH}")
  endif()
  set(KVTIER_PYTHON_INSTALL_DIR "${_kvtier_platlib}" CACHE PATH
      "Where the kvtier Python package is installed (component python)")
endif()

set(KVTIER_PYTHON_BUILD_DIR "${PROJECT_BINARY_DIR}/python")

# NO_EXTRAS: no LTO (it would redo the Asio code at link time) and no stripping; the hidden
# visibility pybind11 wants is set below.
pybind11_add_module(kvtier_python_ext MODULE NO_EXTRAS python/src/kvtier_module.cpp)
target_link_libraries(kvtier_python_ext PRIVATE kvtier::engine)
kvtier_target_defaults(kvtier_python_ext)
set_target_properties(kvtier_python_ext PROPERTIES
  OUTPUT_NAME _kvtier
  CXX_VISIBILITY_PRESET hidden
  VISIBILITY_INLINES_HIDDEN ON
  LIBRARY_OUTPUT_DIRECTORY "${KVTIER_PYTHON_BUILD_DIR}/kvtier")

# The pure-Python files, linked next to the extension: the build tree is importable as is,
# and an edit of a .py file needs no rebuild (the installed package gets copies).
file(GLOB_RECURSE _kvtier_py_sources CONFIGURE_DEPENDS RELATIVE "${PROJECT_SOURCE_DIR}/python"
     "${PROJECT_SOURCE_DIR}/python/kvtier/*.py" "${PROJECT_SOURCE_DIR}/python/kvtier/*.pyi"
     "${PROJECT_SOURCE_DIR}/python/kvtier/py.typed")
set(_kvtier_py_outputs "")
foreach(_f IN LISTS _kvtier_py_sources)
  get_filename_component(_dir "${KVTIER_PYTHON_BUILD_DIR}/${_f}" DIRECTORY)
  add_custom_command(
    OUTPUT "${KVTIER_PYTHON_BUILD_DIR}/${_f}"
    COMMAND ${CMAKE_COMMAND} -E make_directory "${_dir}"
    COMMAND ${CMAKE_COMMAND} -E create_symlink "${PROJECT_SOURCE_DIR}/python/${_f}" "${KVTIER_PYTHON_BUILD_DIR}/${_f}"
    COMMENT "kvtier python: ${_f}" VERBATIM)
  list(APPEND _kvtier_py_outputs "${KVTIER_PYTHON_BUILD_DIR}/${_f}")
endforeach()
# `kvtier_python`: the whole importable package in ${KVTIER_PYTHON_BUILD_DIR}.
add_custom_target(kvtier_python ALL DEPENDS ${_kvtier_py_outputs})
add_dependencies(kvtier_python kvtier_python_ext)

install(TARGETS kvtier_python_ext LIBRARY DESTINATION "${KVTIER_PYTHON_INSTALL_DIR}/kvtier" COMPONENT python)
install(DIRECTORY python/kvtier DESTINATION "${KVTIER_PYTHON_INSTALL_DIR}" COMPONENT python
        FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi" PATTERN "py.typed" PATTERN "__pycache__" EXCLUDE)
message(STATUS "kvtier: Python package for ${Python_EXECUTABLE} (${Python_VERSION}); "
               "cmake --install <build> --component python puts it in ${KVTIER_PYTHON_INSTALL_DIR}")
