# Finds the installed torch for the extension build and decides whether the CUDA sources build.
#
# Sets: TORCH_LIBRARIES, TORCH_INCLUDE_DIRS, TORCH_INSTALL_PREFIX (as TorchConfig.cmake does) and
#   SMP_WITH_CUDA       ON when torch has CUDA and a matching nvcc was found: the CUDA language is
#                       enabled (by torch's own CMake config) and csrc/cuda/*.cu build into _C
#   SMP_CUDA_FLAGS      nvcc flags for smp's .cu sources beyond those torch adds to CMAKE_CUDA_FLAGS
#
# Cache option SMP_CUDA = AUTO (default) | ON (fail if CUDA cannot be built) | OFF (CPU only).
# Architectures: TORCH_CUDA_ARCH_LIST from the environment, else the ones torch was built for.
# A CUDA torch without nvcc still builds CPU-only: torch's CMake config insists on a toolkit, so
# then smp links torch's CPU libraries directly (nothing in a CPU-only _C needs libtorch_cuda).

set(SMP_CUDA "AUTO" CACHE STRING "Build the CUDA sources: AUTO, ON or OFF")
set_property(CACHE SMP_CUDA PROPERTY STRINGS AUTO ON OFF)

execute_process(
  COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/cmake/torch_info.py
  OUTPUT_VARIABLE _smp_torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _smp_torch_rc)
if(NOT _smp_torch_rc EQUAL 0)
  message(FATAL_ERROR "SMP_BUILD_TORCH=ON but ${Python3_EXECUTABLE} cannot import torch. "
                      "Install torch or configure with -DSMP_BUILD_TORCH=OFF for the core only.")
endif()
string(REPLACE "\n" ";" _smp_torch_info "${_smp_torch_info}")
foreach(_line IN LISTS _smp_torch_info)
  if(_line MATCHES "^([A-Z]+)=(.*)$")
    set(SMP_TORCH_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}")
  endif()
endforeach()
string(REPLACE "," ";" SMP_TORCH_ARCHS "${SMP_TORCH_ARCHS}")

set(SMP_WITH_CUDA OFF)
set(SMP_CUDA_FLAGS "")
set(_smp_nvcc "")
if(SMP_TORCH_CUDA AND NOT SMP_CUDA STREQUAL "OFF")
  if(CMAKE_CUDA_COMPILER)
    set(_smp_nvcc "${CMAKE_CUDA_COMPILER}")
  elseif(DEFINED ENV{CUDACXX})
    set(_smp_nvcc "$ENV{CUDACXX}")
  else()
    set(_smp_hints "")
    foreach(_var CUDA_HOME CUDA_PATH CUDAToolkit_ROOT)
      if(DEFINED ENV{${_var}})
        list(APPEND _smp_hints "$ENV{${_var}}/bin")
      endif()
    endforeach()
    find_program(_smp_nvcc_found nvcc HINTS ${_smp_hints} /usr/local/cuda/bin)
    if(_smp_nvcc_found)
      set(_smp_nvcc "${_smp_nvcc_found}")
    endif()
  endif()
  if(_smp_nvcc)
    execute_process(COMMAND ${_smp_nvcc} --version OUTPUT_VARIABLE _smp_nvcc_version)
    string(REGEX MATCH "release ([0-9]+\\.[0-9]+)" _ "${_smp_nvcc_version}")
    set(_smp_nvcc_cuda "${CMAKE_MATCH_1}")
    string(REGEX MATCH "^[0-9]+" _smp_nvcc_major "${_smp_nvcc_cuda}")
    string(REGEX MATCH "^[0-9]+" _smp_torch_cuda_major "${SMP_TORCH_CUDA}")
    if(NOT _smp_nvcc_major STREQUAL _smp_torch_cuda_major)
      message(WARNING "torch was built with CUDA ${SMP_TORCH_CUDA} but ${_smp_nvcc} is CUDA "
                      "'${_smp_nvcc_cuda}': building smp without its CUDA sources. "
                      "Point CUDACXX at an nvcc of CUDA ${_smp_torch_cuda_major}.")
      set(_smp_nvcc "")
    endif()
  endif()
  if(_smp_nvcc)
    set(SMP_WITH_CUDA ON)
  elseif(SMP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SMP_CUDA=ON but no nvcc of CUDA ${SMP_TORCH_CUDA} was found (looked at "
                        "CUDACXX, CUDA_HOME/bin, PATH and /usr/local/cuda/bin).")
  endif()
elseif(SMP_CUDA STREQUAL "ON")
  message(FATAL_ERROR "SMP_CUDA=ON but the torch at ${SMP_TORCH_ROOT} is a CPU build.")
endif()

if(SMP_WITH_CUDA)
  # The toolkit root as nvcc itself reports it: the nvcc on PATH may be a wrapper script.
  execute_process(COMMAND ${_smp_nvcc} --dryrun -c -x cu /dev/null -o /dev/null
                  ERROR_VARIABLE _smp_nvcc_dryrun OUTPUT_QUIET)
  if(_smp_nvcc_dryrun MATCHES "_HERE_=([^\n]*)")
    set(_smp_nvcc "${CMAKE_MATCH_1}/nvcc")
  endif()
  get_filename_component(_smp_cuda_root "${_smp_nvcc}" DIRECTORY)
  get_filename_component(_smp_cuda_root "${_smp_cuda_root}" DIRECTORY)
  set(CMAKE_CUDA_COMPILER "${_smp_nvcc}" CACHE FILEPATH "nvcc" FORCE)
  set(CUDA_TOOLKIT_ROOT_DIR "${_smp_cuda_root}" CACHE PATH "CUDA toolkit root")
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} OR "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
    set(ENV{TORCH_CUDA_ARCH_LIST} "${SMP_TORCH_ARCHS}")
  endif()
  message(STATUS "smp: CUDA ${SMP_TORCH_CUDA} with ${_smp_nvcc}, "
                 "architectures $ENV{TORCH_CUDA_ARCH_LIST}")
  # A toolkit assembled from pip wheels may lack libnvrtc; torch's CUDA wheels carry one.
  find_library(CUDA_nvrtc_LIBRARY nvrtc HINTS "${_smp_cuda_root}/lib64" "${_smp_cuda_root}/lib")
  if(NOT CUDA_nvrtc_LIBRARY AND SMP_TORCH_NVRTC)
    set(CUDA_nvrtc_LIBRARY "${SMP_TORCH_NVRTC}" CACHE FILEPATH "libnvrtc" FORCE)
  endif()
  list(APPEND CMAKE_PREFIX_PATH ${SMP_TORCH_PREFIX})
  find_package(Torch REQUIRED)
  # torch's headers need C++20, which CMake before 3.27 cannot ask nvcc for as a CUDA dialect
  # ("CUDA20 not supported"): pass the flag ourselves instead of a CUDA_STANDARD.
  unset(CMAKE_CUDA_STANDARD)
  set(CMAKE_CUDA_STANDARD_REQUIRED OFF)
  set(SMP_CUDA_FLAGS -std=c++${CMAKE_CXX_STANDARD})  # torch put its -gencode list in CMAKE_CUDA_FLAGS
elseif(SMP_TORCH_CUDA)
  # CPU-only against a CUDA torch: TorchConfig.cmake would demand the toolkit.
  message(STATUS "smp: torch has CUDA ${SMP_TORCH_CUDA} but no usable nvcc: CPU-only build")
  set(TORCH_INSTALL_PREFIX "${SMP_TORCH_ROOT}")
  set(TORCH_INCLUDE_DIRS "${SMP_TORCH_ROOT}/include"
                         "${SMP_TORCH_ROOT}/include/torch/csrc/api/include")
  set(TORCH_LIBRARIES "")
  foreach(_lib c10 torch_cpu torch)
    find_library(SMP_TORCH_LIB_${_lib} ${_lib} PATHS "${SMP_TORCH_ROOT}/lib" NO_DEFAULT_PATH
                 REQUIRED)
    list(APPEND TORCH_LIBRARIES ${SMP_TORCH_LIB_${_lib}})
  endforeach()
  add_library(smp_torch_headers INTERFACE)
  target_include_directories(smp_torch_headers SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
  list(APPEND TORCH_LIBRARIES smp_torch_headers)
  set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=${SMP_TORCH_ABI}")
else()
  list(APPEND CMAKE_PREFIX_PATH ${SMP_TORCH_PREFIX})
  find_package(Torch REQUIRED)
endif()
