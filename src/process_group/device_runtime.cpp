// Loading libtdist_cuda.so on first use. The contract is in
// device_runtime.h.
#include "process_group/device_runtime.h"

#include <dlfcn.h>

#include <mutex>

#include "comm/plugin.h"
#include "tdist/config.h"
#include "tdist/errors.h"

namespace tdist::detail {

bool cuda_support_built() { return TDIST_WITH_CUDA != 0; }

namespace {
thread_local int op_device = -1;
}  // namespace

int current_op_device() { return op_device; }
OpDeviceScope::OpDeviceScope(int device) : outer_(op_device) { op_device = device; }
OpDeviceScope::~OpDeviceScope() { op_device = outer_; }

DeviceRuntime& cuda_runtime(const char* op) {
  static std::once_flag once;
  static DeviceRuntime* runtime = nullptr;
  static std::string error;
  std::call_once(once, [] {
    if (!cuda_support_built()) {
      error = "this build of tdist has no CUDA support (it was built against a LibTorch without CUDA, or without "
              "the CUDA toolkit); rebuild it against a CUDA LibTorch";
      return;
    }
    std::string tried;
    void* handle = comm::open_beside_libtdist(kTdistCudaPluginFile, RTLD_NOW | RTLD_GLOBAL, &tried);
    if (handle == nullptr) {
      error = std::string("CUDA tensors need the plugin ") + kTdistCudaPluginFile + ", which could not be loaded:" +
              tried;
      return;
    }
    auto entry = reinterpret_cast<tdist_cuda_runtime_fn>(dlsym(handle, kTdistCudaRuntimeEntry));
    runtime = entry ? entry() : nullptr;
    if (runtime == nullptr) error = std::string(kTdistCudaPluginFile) + " is not tdist's CUDA plugin; reinstall tdist";
  });
  if (runtime == nullptr) throw UsageError(std::string(op) + ": " + error);
  return *runtime;
}

}  // namespace tdist::detail
