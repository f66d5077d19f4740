// The entry point of libtdist_gloo.so, the gloo backend as a plugin (why:
// comm/plugin.h).
#include <dlfcn.h>
#include <gloo/allgatherv.h>

#include "comm/gloo/gloo_backend.h"
#include "comm/plugin.h"

namespace {

std::unique_ptr<tdist::comm::Backend> create(const tdist::comm::BackendContext& ctx) {
  using namespace tdist::comm::gloo_backend;
  return make_gloo_backend(ctx, GlooOptions::from_env());
}

// Where this plugin's calls into Gloo land: the address of a Gloo function
// as the plugin's relocations resolved it.
const char* bound_library() {
  Dl_info info{};
  void (*fn)(::gloo::AllgathervOptions&) = &::gloo::allgatherv;
  if (dladdr(reinterpret_cast<void*>(fn), &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

const tdist::comm::BackendPlugin kPlugin{tdist::comm::kBackendPluginAbi, "gloo", &create, &bound_library};

}  // namespace

extern "C" __attribute__((visibility("default"))) const tdist::comm::BackendPlugin* tdist_backend_plugin() {
  return &kPlugin;
}
