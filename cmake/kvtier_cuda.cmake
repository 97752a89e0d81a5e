# KVTIER_WITH_CUDA (cmake/kvtier_auto_option.cmake): AUTO (the default) is on when nvcc is
# found, never in sanitizer builds; resolved at every configure, so a CUDA toolkit installed
# after the first configure is used at the next. The build works without.
include(CheckLanguage)

kvtier_auto_option(KVTIER_WITH_CUDA "build the CUDA path, include/kvtier/cuda, and its tests: AUTO where nvcc is found"
                   "Build the CUDA path (include/kvtier/cuda) and its tests")

set(_kvtier_cuda_available OFF)
set(_kvtier_cuda_missing "")
if(KVTIER_SANITIZE)
  set(_kvtier_cuda_missing "this is a sanitizer build (KVTIER_SANITIZE=${KVTIER_SANITIZE}): CUDA is left out of those")
elseif(NOT _KVTIER_REQUESTED_KVTIER_WITH_CUDA STREQUAL "OFF")
  # check_language caches NOTFOUND and never looks again: look again while it is not found.
  if(DEFINED CACHE{CMAKE_CUDA_COMPILER} AND NOT CMAKE_CUDA_COMPILER)
    unset(CMAKE_CUDA_COMPILER CACHE)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(_kvtier_cuda_available ON)
  else()
    set(_kvtier_cuda_missing "no CUDA compiler (nvcc) was found on PATH or in CUDACXX")
  endif()
endif()
kvtier_resolve_auto_option(KVTIER_WITH_CUDA ${_kvtier_cuda_available} "the CUDA path cannot be built: ${_kvtier_cuda_missing}")

if(KVTIER_WITH_CUDA)
  # CMake 3.25 knows no C++20 flag for nvcc ("requires the language dialect CUDA20").
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    # Hopper (H100/H200) and Ampere, plus PTX so newer devices JIT.
    set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()
