# Compile checks that generate no code: -fsyntax-only parses and instantiates templates (what
# catches a compile error) but skips code generation and optimisation. Measured with g++ 12 on
# the dev VM (CPU seconds): bench/server_bench.cpp 129 at -O3, 77 at -O0, 31 -fsyntax-only;
# the header check's server/server.hpp 41 at -O0 -g0, 18.5 -fsyntax-only.

# kvtier_syntax_only(<target>): compiles <target>'s sources with -fsyntax-only. <target> is an
# OBJECT library: its "objects" are empty files (cmake/kvtier_syntax_only.sh), nothing may link
# them.
function(kvtier_syntax_only target)
  target_compile_options(${target} PRIVATE -fsyntax-only)
  set_target_properties(${target} PROPERTIES
    CXX_COMPILER_LAUNCHER "sh;${PROJECT_SOURCE_DIR}/cmake/kvtier_syntax_only.sh")
endfunction()

# kvtier_syntax_check(<executable>...): for each executable, an OBJECT library
# <executable>_syntax in `all` that compiles the executable's C++ sources with -fsyntax-only,
# with its include directories, definitions, options, features and libraries. For programs
# the tests never run (the benchmarks, KVTIER_BENCH_IN_ALL=OFF): what breaks their build is
# found at a quarter of the cost of building them, their link excepted.
function(kvtier_syntax_check)
  foreach(exe IN LISTS ARGN)
    get_target_property(_sources ${exe} SOURCES)
    get_target_property(_dir ${exe} SOURCE_DIR)
    set(_cxx "")
    foreach(src IN LISTS _sources)
      if(src MATCHES "\\.(cpp|cc|cxx)$")
        if(NOT IS_ABSOLUTE "${src}")
          set(src ${_dir}/${src})
        endif()
        list(APPEND _cxx ${src})
      endif()
    endforeach()
    if(NOT _cxx)
      continue()  # e.g. a CUDA program
    endif()
    add_library(${exe}_syntax OBJECT ${_cxx})
    foreach(p LINK_LIBRARIES INCLUDE_DIRECTORIES COMPILE_DEFINITIONS COMPILE_OPTIONS COMPILE_FEATURES)
      get_target_property(_v ${exe} ${p})
      if(_v)
        set_property(TARGET ${exe}_syntax PROPERTY ${p} "${_v}")
      endif()
    endforeach()
    kvtier_syntax_only(${exe}_syntax)
  endforeach()
endfunction()
