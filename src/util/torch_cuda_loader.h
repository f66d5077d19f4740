// Loads LibTorch's CUDA kernels (libtorch_cuda.so, beside libtorch_cpu) into
// a program that links only libtorch_cpu, as tdist's own programs do so that
// they run where no CUDA library is installed. Call it before making a CUDA
// tensor; a program that links libtorch (or torch_cuda) needs none of this.
#pragma once

#include <ATen/Context.h>
#include <dlfcn.h>

#include <string>

#include "tdist/errors.h"

namespace tdist::detail {

inline void load_torch_cuda() {
  static const std::string error = [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&at::globalContext), &info) == 0 || info.dli_fname == nullptr) {
      return std::string("cannot find libtorch_cpu's directory");
    }
    std::string dir = info.dli_fname;
    dir = dir.substr(0, dir.rfind('/') + 1);
    if (dlopen((dir + "libtorch_cuda.so").c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) return std::string();
    const char* why = dlerror();
    return std::string("cannot load ") + dir + "libtorch_cuda.so: " + (why ? why : "unknown error");
  }();
  if (!error.empty()) throw UsageError("CUDA: " + error);
}

}  // namespace tdist::detail
