// A backend plugin for plugin_test: its "backend library" is the C library
// (bound_library() names the file that defines gnu_get_libc_version, which
// no sanitizer intercepts), and create() raises
// a UsageError naming the rank it was given. Built twice: with this ABI
// (libtdist_fake_plugin.so) and with an old one (FAKE_PLUGIN_ABI=0).
#include <dlfcn.h>

#include <gnu/libc-version.h>

#include "comm/plugin.h"
#include "tdist/errors.h"

#ifndef FAKE_PLUGIN_ABI
#define FAKE_PLUGIN_ABI tdist::comm::kBackendPluginAbi
#endif

namespace {

std::unique_ptr<tdist::comm::Backend> create(const tdist::comm::BackendContext& ctx) {
  throw tdist::UsageError("fake backend created for rank " + std::to_string(ctx.rank));
}

const char* bound_library() {
  Dl_info info{};
  const char* (*fn)() = &gnu_get_libc_version;
  return dladdr(reinterpret_cast<void*>(fn), &info) && info.dli_fname ? info.dli_fname : "";
}

const tdist::comm::BackendPlugin kPlugin{FAKE_PLUGIN_ABI, "fake", &create, &bound_library};

}  // namespace

extern "C" __attribute__((visibility("default"))) const tdist::comm::BackendPlugin* tdist_backend_plugin() {
  return &kPlugin;
}
