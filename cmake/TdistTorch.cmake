# Finds LibTorch for tdist. Sets Torch_VERSION and TORCH_INCLUDE_DIRS (from
# TorchConfig) and TDIST_TORCH_LIBS, the libraries tdist links.
#
# tdist runs on the CPU: it links libtorch_cpu and libc10 only, never
# libtorch.so, which on a CUDA build (the PyPI wheel, pytorch.org's cu*
# zips) would pull in libtorch_cuda and every CUDA library at load time.
#
# A CUDA build's TorchConfig probes the machine's GPUs at configure time
# (a try_run that fails without a GPU, and with CMake 3.25 and nvcc 13)
# unless TORCH_CUDA_ARCH_LIST names the architectures. tdist compiles no
# CUDA code, so the list only silences the probe. A CUDA build also needs a
# CUDA toolkit at configure time (its Caffe2Config looks for one).
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "9.0")
endif()
# TorchConfig finds its Caffe2Config (which defines the library targets)
# with PATHS, searched after the system prefixes: with Debian's
# libtorch-dev installed, a LibTorch given only by Torch_DIR would get
# Debian's Caffe2, 1.13's libraries under 2.x's headers.
if(DEFINED Torch_DIR AND NOT DEFINED Caffe2_DIR AND EXISTS "${Torch_DIR}/../Caffe2/Caffe2Config.cmake")
  get_filename_component(Caffe2_DIR "${Torch_DIR}/../Caffe2" ABSOLUTE)
endif()
find_package(Torch REQUIRED)
get_filename_component(_tdist_torch_home "${Torch_DIR}/.." REALPATH)
get_filename_component(_tdist_caffe2_home "${Caffe2_DIR}/.." REALPATH)
if(NOT _tdist_torch_home STREQUAL _tdist_caffe2_home)
  message(FATAL_ERROR "tdist: LibTorch's TorchConfig (${Torch_DIR}) and Caffe2Config (${Caffe2_DIR}) come from "
                      "two installations. Point at one LibTorch with -DCMAKE_PREFIX_PATH=<libtorch>, or set "
                      "-DCaffe2_DIR=<libtorch>/share/cmake/Caffe2 too.")
endif()
if(NOT TARGET torch_cpu OR NOT TARGET c10)
  message(FATAL_ERROR "tdist: the LibTorch at ${Torch_DIR} defines no torch_cpu/c10 targets")
endif()
set(TDIST_TORCH_LIBS torch_cpu c10)
# An old-ABI LibTorch (-D_GLIBCXX_USE_CXX11_ABI=0) needs every translation
# unit that shares std::string with it built the same way.
if(TORCH_CXX_FLAGS)
  separate_arguments(_tdist_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  add_compile_options(${_tdist_torch_flags})
endif()
# The directory of libtorch_cpu, for the RPATH of installed binaries; empty
# when it is a system directory the loader searches anyway.
get_target_property(_tdist_torch_cpu torch_cpu LOCATION)
get_filename_component(_tdist_torch_lib_dir "${_tdist_torch_cpu}" DIRECTORY)
set(TDIST_TORCH_RPATH "${_tdist_torch_lib_dir}")
if(_tdist_torch_lib_dir IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES OR
   _tdist_torch_lib_dir MATCHES "^/(usr/)?lib(64|/${CMAKE_LIBRARY_ARCHITECTURE})?$")
  set(TDIST_TORCH_RPATH "")
endif()
