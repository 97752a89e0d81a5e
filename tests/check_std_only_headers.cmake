# Fails when a core/ or core/detail/ header (token_hasher.hpp, model_id.hpp, kv_region.hpp and
# detail/xxhash.hpp excepted), a cuda/*.hpp header or config.hpp includes anything but
# standard headers and other std-only kvtier headers, or when a cuda/*.cuh header includes
# anything but those, CUDA's own headers and other cuda/ headers: the CUDA path must build
# with nvcc alone on a machine without Boost or fmt (bench/cuda/check.sh), and cuda/*.hpp
# (the descriptor parser) without CUDA.
file(GLOB _headers ${KVTIER_INCLUDE_DIR}/kvtier/core/*.hpp ${KVTIER_INCLUDE_DIR}/kvtier/core/detail/*.hpp
     ${KVTIER_INCLUDE_DIR}/kvtier/cuda/*.cuh ${KVTIER_INCLUDE_DIR}/kvtier/cuda/*.hpp)
list(APPEND _headers ${KVTIER_INCLUDE_DIR}/kvtier/config.hpp)
set(_bad "")
foreach(h IN LISTS _headers)
  get_filename_component(_name ${h} NAME)
  # token_hasher.hpp needs xxhash.h and OpenSSL, model_id.hpp and detail/xxhash.hpp xxhash.h;
  # kv_region.hpp (the CPU memfd region) needs POSIX and error.hpp (Boost.System). The CUDA
  # path uses none of them.
  if(_name MATCHES "^(token_hasher|model_id|kv_region|xxhash)\\.hpp$")
    continue()
  endif()
  file(STRINGS ${h} _includes REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS _includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]+)[>\"].*$" "\\1" _inc "${line}")
    if(_inc MATCHES "^[a-z_]+$")                       # <vector>, <cstdint>, ...
      continue()
    elseif(_inc STREQUAL "kvtier/config.hpp")
      continue()
    elseif(_inc MATCHES "^kvtier/core/(detail/)?[a-z_]+\\.hpp$"
           AND NOT _inc MATCHES "^kvtier/core/(token_hasher|model_id|kv_region|detail/xxhash)\\.hpp$")
      continue()
    elseif(_name MATCHES "\\.cuh$" AND _inc MATCHES "^(kvtier/cuda/[a-z_]+\\.(cuh|hpp)|cuda\\.h|cuda_runtime\\.h|cuda_runtime_api\\.h)$")
      continue()
    elseif(_inc MATCHES "^kvtier/cuda/[a-z_]+\\.hpp$")
      continue()
    endif()
    list(APPEND _bad "${_name}: ${_inc}")
  endforeach()
endforeach()
if(_bad)
  string(REPLACE ";" "\n  " _msg "${_bad}")
  message(FATAL_ERROR "core/ and cuda/*.hpp headers must need only the standard library (cuda/*.cuh: and CUDA), but include:\n  ${_msg}")
endif()
message(STATUS "core/ and cuda/*.hpp headers include only standard headers; cuda/*.cuh only those and CUDA")
