# CUDA and NCCL for tdist's plugins. Sets TDIST_WITH_CUDA / TDIST_WITH_NCCL
# to ON or OFF, NCCL_INCLUDE_DIR and NCCL_LIBRARY, and defines
# tdist_cuda_plugin(target).
#
# CUDA comes with a CUDA LibTorch: its c10_cuda target links the toolkit's
# cudart. NCCL is looked for beside the torch package (the nvidia-nccl-cu*
# wheel that a pip-installed torch depends on), then in the system.

# An ON/OFF/AUTO option resolved to ON or OFF: AUTO follows `available`;
# ON without it stops with "tdist: <var>=ON <why_not>".
function(tdist_resolve_option var available why_not)
  set(value ${${var}})
  if(value STREQUAL "AUTO")
    set(value ${available})
  elseif(value AND NOT available)
    message(FATAL_ERROR "tdist: ${var}=ON ${why_not}")
  endif()
  if(value)
    set(${var} ON PARENT_SCOPE)
  else()
    set(${var} OFF PARENT_SCOPE)
  endif()
endfunction()

set(_tdist_cuda_found FALSE)
if(TARGET c10_cuda AND Torch_VERSION VERSION_GREATER_EQUAL 2.0)
  set(_tdist_cuda_found TRUE)
endif()
tdist_resolve_option(TDIST_WITH_CUDA ${_tdist_cuda_found}
                     "needs a CUDA build of LibTorch 2.x (no c10_cuda target in ${Torch_DIR})")
if(TDIST_WITH_CUDA)
  message(STATUS "tdist: building the CUDA plugin (libtdist_cuda.so)")
  # site-packages/torch/share/cmake/Torch -> site-packages
  get_filename_component(_tdist_site "${Torch_DIR}/../../../.." ABSOLUTE)
  # The wheel beside torch first (the NCCL torch itself loads), then
  # NCCL_ROOT, then the system and the CUDA toolkit.
  find_path(NCCL_INCLUDE_DIR nccl.h PATHS "${_tdist_site}/nvidia/nccl/include" NO_DEFAULT_PATH)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 PATHS "${_tdist_site}/nvidia/nccl/lib" NO_DEFAULT_PATH)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ENV NCCL_ROOT ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ENV NCCL_ROOT PATH_SUFFIXES lib lib64)
  set(_tdist_nccl_found FALSE)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(_tdist_nccl_found TRUE)
  endif()
  set(_tdist_nccl_asked ${TDIST_WITH_NCCL})
  tdist_resolve_option(TDIST_WITH_NCCL ${_tdist_nccl_found}
                       "but nccl.h/libnccl were not found (set NCCL_ROOT, or install the nvidia-nccl-cu* wheel beside torch)")
  # AUTO with a CUDA LibTorch and no NCCL: said loudly, since the build then
  # lacks the backend CUDA users want and the suite lacks nccl_test.
  if(_tdist_nccl_asked STREQUAL "AUTO" AND NOT TDIST_WITH_NCCL)
    message(WARNING "tdist: TDIST_WITH_NCCL=AUTO: a CUDA LibTorch but no nccl.h/libnccl (looked in "
                    "${_tdist_site}/nvidia/nccl, NCCL_ROOT, the system): building WITHOUT the nccl backend "
                    "and nccl_test. Install the nvidia-nccl-cu* wheel beside torch (scripts/torch2.sh install "
                    "does) or set NCCL_ROOT; -DTDIST_WITH_NCCL=ON makes this an error, OFF silences it.")
  endif()
else()
  tdist_resolve_option(TDIST_WITH_NCCL FALSE "needs CUDA (TDIST_WITH_CUDA)")
endif()
if(TDIST_WITH_NCCL)
  message(STATUS "tdist: building the nccl backend (${NCCL_LIBRARY})")
endif()

# A plugin of CUDA code: tdist's sources and the comm layer (from libtdist's
# file, as the gloo plugin), c10_cuda and the CUDA runtime.
function(tdist_cuda_plugin target)
  target_include_directories(${target} PRIVATE ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/include
                                               ${CMAKE_BINARY_DIR}/generated)
  foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
    target_include_directories(${target} SYSTEM PRIVATE ${dir})
  endforeach()
  add_dependencies(${target} tdist)
  target_link_libraries(${target} PRIVATE $<TARGET_FILE:tdist> c10_cuda c10 Threads::Threads)
  set_target_properties(${target} PROPERTIES INSTALL_RPATH "\$ORIGIN;${TDIST_TORCH_RPATH}")
  install(TARGETS ${target} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endfunction()
