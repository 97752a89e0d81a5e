# Finds what the kvtier headers need, REQUIRED so that a missing package stops with its name.
# Used by our own build and, installed next to kvtierConfig.cmake, by consumers of an installed
# kvtier, so the two can never disagree.
find_package(Threads REQUIRED)
find_package(Boost 1.81 REQUIRED CONFIG)          # Boost::headers (Asio, Beast, System)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)    # SHA-256 in core/token_hasher.hpp
find_package(PkgConfig REQUIRED)

# liburing and hiredis ship no CMake config (Debian's hiredis one is broken): pkg-config.
if(NOT TARGET PkgConfig::URING)
  pkg_check_modules(URING REQUIRED IMPORTED_TARGET GLOBAL liburing)
endif()
# hiredis is optional: only kvtier::redis (l2/redis/redis_backend.hpp) needs it. Without it the
# kvtier::redis target is not defined (our build) or not usable (an installed kvtier), and
# everything else works; consumers that do not link kvtier::redis never need hiredis.
if(NOT TARGET PkgConfig::HIREDIS)
  pkg_check_modules(HIREDIS QUIET IMPORTED_TARGET GLOBAL hiredis)
endif()

# xxHash is used header-only (XXH_INLINE_ALL), so only its header has to be present.
find_path(KVTIER_XXHASH_INCLUDE_DIR xxhash.h)
if(NOT KVTIER_XXHASH_INCLUDE_DIR)
  message(FATAL_ERROR "kvtier needs xxhash.h: install Debian's libxxhash-dev")
endif()
