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
  # g++ 12 reports false -Wmaybe-uninitialized inside libstdc++ (std::regex, std::function)
  # and false -Wmismatched-new-delete on coroutine frames once sanitizer instrumentation
  # changes inlining; real bugs are what the sanitizers find.
  add_compile_options(-Wno-maybe-uninitialized -Wno-mismatched-new-delete)
  # Asio uses std::atomic_thread_fence, which TSan does not model; g++ 12 warns about every use.
  if(KVTIER_SANITIZE STREQUAL "thread")
    add_compile_options(-Wno-tsan)
  endif()
  add_link_options(-fsanitize=${KVTIER_SANITIZE})
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
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow=local
                              -Wcast-align -Wimplicit-fallthrough -Wformat=2
                              -Wno-missing-field-initializers>)
endfunction()
