# Finds what the kvtier headers need. Used by our own build and, installed next to
# kvtierConfig.cmake, by consumers of an installed kvtier, so the two can never disagree.
#
# kvtier::kvtier (and kvtier::server) need only these, REQUIRED so that a missing package
# stops with its name:
find_package(Threads REQUIRED)
find_package(Boost 1.81 REQUIRED CONFIG)          # Boost::headers (Asio, Beast, System)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(PkgConfig REQUIRED)

# Each of these is needed by one target only, whose headers use it; a consumer that does not
# link that target never needs the package (tests/consumer: consumer.*.minimal):
#   OpenSSL's libcrypto  kvtier::engine  SHA-256 in core/token_hasher.hpp (engine/ includes it)
#   liburing             kvtier::uring   io/, l2/disk/
#   hiredis              kvtier::redis   l2/redis/
#   libzmq and cppzmq    kvtier::kv_events  kv_events/publisher.hpp (the KV event publisher)
# Where one is missing its target is not defined (our build: kvtier_optional_target in
# CMakeLists.txt) or its component is not found (an installed kvtier: find_package(kvtier
# COMPONENTS engine uring redis) names the package).
# KVTIER_REQUIRE_ENGINE_AND_URING (our build, when it builds its own programs, which link
# kvtier::engine and kvtier::uring) makes the first two REQUIRED; hiredis and libzmq stay
# optional.
if(KVTIER_REQUIRE_ENGINE_AND_URING)
  set(_kvtier_optional REQUIRED)
else()
  set(_kvtier_optional QUIET)
endif()
find_package(OpenSSL ${_kvtier_optional} COMPONENTS Crypto)
# liburing and hiredis ship no CMake config (Debian's hiredis one is broken): pkg-config.
if(NOT TARGET PkgConfig::URING)
  pkg_check_modules(URING ${_kvtier_optional} IMPORTED_TARGET GLOBAL liburing)
endif()
if(NOT TARGET PkgConfig::HIREDIS)
  pkg_check_modules(HIREDIS QUIET IMPORTED_TARGET GLOBAL hiredis)
endif()
# cppzmq (zmq.hpp, header-only; its .pc requires libzmq's): one target for both.
if(NOT TARGET PkgConfig::ZMQ)
  pkg_check_modules(ZMQ QUIET IMPORTED_TARGET GLOBAL libzmq cppzmq)
  # Debian's libzmq.pc has "-isystem /usr/include/mit-krb5" in its Cflags. CMake 3.25 makes it
  # an include directory at a build directory's first configure and a compile option at every
  # later one, so the compile commands of everything linking the target change between the
  # two, and the second configure (the test command after the demo) rebuilt kvtier-server's
  # main.cpp. Moved to the include directories here, it is one thing every time.
  if(TARGET PkgConfig::ZMQ)
    get_target_property(_kvtier_zmq_options PkgConfig::ZMQ INTERFACE_COMPILE_OPTIONS)
    if(_kvtier_zmq_options)
      set(_kvtier_kept "")
      set(_kvtier_next_is_dir OFF)
      foreach(_o IN LISTS _kvtier_zmq_options)
        if(_kvtier_next_is_dir)
          set_property(TARGET PkgConfig::ZMQ APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${_o}")
          set(_kvtier_next_is_dir OFF)
        elseif(_o STREQUAL "-isystem")
          set(_kvtier_next_is_dir ON)
        else()
          list(APPEND _kvtier_kept "${_o}")
        endif()
      endforeach()
      set_property(TARGET PkgConfig::ZMQ PROPERTY INTERFACE_COMPILE_OPTIONS "${_kvtier_kept}")
    endif()
  endif()
endif()

# xxHash is used header-only (XXH_INLINE_ALL), so only its header has to be present.
find_path(KVTIER_XXHASH_INCLUDE_DIR xxhash.h)
if(NOT KVTIER_XXHASH_INCLUDE_DIR)
  message(FATAL_ERROR "kvtier needs xxhash.h: install Debian's libxxhash-dev")
endif()
