# Settings for kvtier's own targets (tests, examples, benchmarks); consumers are unaffected.

# Warnings are errors in our own targets; `cmake --compile-no-warning-as-error` turns it off.
set(CMAKE_COMPILE_WARNING_AS_ERROR ON)

if(PROJECT_IS_TOP_LEVEL AND NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)
endif()
set(CMAKE_EXPORT_COMPILE_COMMANDS ON)

find_program(KVTIER_CCACHE ccache)
if(KVTIER_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${KVTIER_CCACHE})
endif()

# Sanitizers apply to every target of ours (tests, the server they start, examples).
if(KVTIER_SANITIZE)
  if(NOT KVTIER_SANITIZE MATCHES "^(address,undefined|address|undefined|thread)$")
    message(FATAL_ERROR "KVTIER_SANITIZE='${KVTIER_SANITIZE}': use 'address,undefined' or 'thread'")
  endif()
  add_compile_options(-fsanitize=${KVTIER_SANITIZE} -fno-omit-frame-pointer -g1)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # g++ 12 reports false -Wmaybe-uninitialized inside libstdc++ (std::regex, std::function)
    # and false -Wmismatched-new-delete on coroutine frames once sanitizer instrumentation
    # changes inlining; real bugs are what the sanitizers find.
    add_compile_options(-Wno-maybe-uninitialized -Wno-mismatched-new-delete)
    # Asio uses std::atomic_thread_fence, which TSan does not model; g++ 12 warns about every use.
    if(KVTIER_SANITIZE STREQUAL "thread")
      add_compile_options(-Wno-tsan)
    endif()
  elseif(KVTIER_SANITIZE MATCHES "undefined")
    # clang 14 cannot emit -fsanitize=function's checks in coroutines ("Cannot represent a
    # difference across sections", llvm-project#49689); every other UBSan check stays.
    add_compile_options(-fno-sanitize=function)
  endif()
  add_link_options(-fsanitize=${KVTIER_SANITIZE})
  # Debug's -O0: the instrumentation is most of a sanitizer build's compile time, and it
  # costs least unoptimised (g++ 12, ASan+UBSan, CPU-s: server_instance.cpp 111 at -O0, 208
  # at -O1, 111 at -Og; the first unity batch of the server tests 116 / 141; cache/
  # tiered_cache_test.cpp 46 / 73; the mini engine 36 / ~60 / 45). The suites run longer
  # (the ASan suite 112 s at -O0, 65 s at -O1): far less than the compiles save. Not -Og either: g++ 12 at -Og cannot
  # inline xxHash 0.8.1's always_inline accumulators behind XXH3_128bits_withSecret
  # (docs/architecture.md "Build" says what an engine built with -Og defines).
  # scripts/test.sh builds its sanitizer stages with clang 14, which emits them in about a
  # third of g++ 12's CPU time (docs/architecture.md "Build"); either compiler works here.
  if(KVTIER_SANITIZE MATCHES "undefined")
    add_compile_options(-fno-sanitize-recover=undefined)
  endif()
endif()

# kvtier_target_defaults(<target>): C++20 and our warning set. -Wno-missing-field-initializers:
# every member of our aggregates (protocol messages, options) has a default initializer, so a
# brace list that names the leading fields leaves the rest at their documented defaults; the
# warning would force every call site to repeat the defaults whenever a field is appended.
function(kvtier_target_defaults target)
  target_compile_features(${target} PRIVATE cxx_std_20)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic
                              -Wcast-align -Wimplicit-fallthrough -Wformat=2
                              -Wno-missing-field-initializers>)
  # -Wshadow=local is g++'s spelling; clang's nearest is -Wshadow-uncaptured-local.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wshadow=local>)
  else()
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wshadow-uncaptured-local>)
  endif()
endfunction()

# The test binaries' optimization in an optimized build (Release, RelWithDebInfo, MinSizeRel):
# KVTIER_TEST_OPTIMIZATION, -O1 unless set (empty: the build type's, -O3 for Release). The
# tests run in-process code whose speed they do not measure, and g++ 12's -O3 is most of their
# compile time: tests/cache/tiered_cache_test.cpp took 52.7 CPU-s at -O3, 38.6 at -O2, 22.8
# at -O1 (and ~10 to parse). The programs the tests run as processes (kvtier-server, the mini
# engine, the harness) and the Python extension stay at the build type's level, so the
# process tests, the gates and the Python suite run the library at -O3; the sanitizer
# stages build everything at -O0 (above).
set(KVTIER_TEST_OPTIMIZATION "-O1" CACHE STRING
    "Optimization flag of the test binaries in optimized builds (empty: the build type's)")
function(kvtier_test_defaults target)
  kvtier_target_defaults(${target})
  if(KVTIER_TEST_OPTIMIZATION)
    # g++ 12 at -O1 inlines Asio's coroutine frames differently and reports a false
    # -Wmismatched-new-delete on them, as in the sanitizer builds (above).
    target_compile_options(${target} PRIVATE
      "$<$<CONFIG:Release,RelWithDebInfo,MinSizeRel>:${KVTIER_TEST_OPTIMIZATION};-Wno-mismatched-new-delete>")
  endif()
endfunction()
