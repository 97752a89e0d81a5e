# KVTIER_WITH_CUDA: on when nvcc is found, never in sanitizer builds; the build works without.
include(CheckLanguage)

set(_kvtier_cuda_default OFF)
if(NOT KVTIER_SANITIZE)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(_kvtier_cuda_default ON)
  endif()
endif()
option(KVTIER_WITH_CUDA "Build the CUDA path (include/kvtier/cuda) and its tests" ${_kvtier_cuda_default})

if(KVTIER_WITH_CUDA AND KVTIER_SANITIZE)
  message(STATUS "kvtier: KVTIER_WITH_CUDA is turned off in sanitizer builds")
  set(KVTIER_WITH_CUDA OFF CACHE BOOL "" FORCE)
endif()

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
message(STATUS "kvtier: KVTIER_WITH_CUDA=${KVTIER_WITH_CUDA}")
