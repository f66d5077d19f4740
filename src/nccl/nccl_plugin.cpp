// The entry point of libtdist_nccl.so, the nccl backend as a plugin: libtdist
// keeps loading where no CUDA or NCCL library is installed (comm/plugin.h).
#include <dlfcn.h>
#include <nccl.h>

#include "comm/plugin.h"
#include "nccl/nccl_backend.h"

namespace {

// Where this plugin's calls into NCCL land.
const char* bound_library() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

const tdist::comm::BackendPlugin kPlugin{tdist::comm::kBackendPluginAbi, "nccl", &tdist::nccl::make_nccl_backend,
                                         &bound_library};

}  // namespace

extern "C" __attribute__((visibility("default"))) const tdist::comm::BackendPlugin* tdist_backend_plugin() {
  return &kPlugin;
}
