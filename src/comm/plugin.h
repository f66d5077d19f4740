// Backends built as plugins: shared objects installed next to libtdist and
// loaded the first time a group asks for them.
//
// Why not link them into libtdist: a backend library that another library
// in the process also carries, in another version, cannot be linked safely.
// LibTorch 2.x's libtorch_cpu exports ~300 of Gloo's symbols from its own
// copy of Gloo; with Debian's libgloo linked beside it, the dynamic linker
// binds half of libgloo's own calls to the other copy (different class
// layouts), and every gloo collective crashes or hangs. A plugin can get a
// symbol scope of its own: when such a foreign copy is in the process, it
// is loaded with RTLD_DEEPBIND, so that it and its libraries look up their
// own symbols first. After loading, the plugin says where its library's
// functions resolved; a plugin whose library is still not its own (e.g. in
// a sanitizer build, where RTLD_DEEPBIND is not available) is refused with
// an error that says so, never run into a crash.
#pragma once

#include <memory>
#include <string>

#include "comm/backend.h"

namespace tdist::comm {

// What a plugin exports, under the C name in kBackendPluginEntry.
struct BackendPlugin {
  int abi_version;  // kBackendPluginAbi of the tdist it was built with
  const char* name;
  std::unique_ptr<Backend> (*create)(const BackendContext& ctx);
  // The file that defines a function of the plugin's backend library, as
  // the plugin's own calls resolve it (dladdr).
  const char* (*bound_library)();
};

inline constexpr int kBackendPluginAbi = 1;
inline constexpr const char* kBackendPluginEntry = "tdist_backend_plugin";

// How to find and check one plugin.
struct PluginSpec {
  std::string backend;  // "gloo"
  std::string file;     // "libtdist_gloo.so", looked for next to libtdist
  // A symbol of the backend library (mangled), probed in the process's
  // global scope before loading to see whether a foreign copy is there.
  std::string probe_symbol;
  // The backend library's file name starts with this ("libgloo"); a
  // bound_library() that is neither such a file nor the plugin itself
  // means a foreign copy won.
  std::string library_prefix;
  // Who else may carry the library, for the error when a copy wins.
  std::string foreign_hint;
};

// A factory that loads the plugin on first use (once per process, thread
// safe) and creates its backend. Loading errors (file missing, wrong ABI,
// a foreign copy of the library that cannot be kept apart) are raised as
// tdist::Error from the factory, each time it is called.
BackendFactory plugin_backend_factory(PluginSpec spec);

// The directory of libtdist.so itself.
std::string libtdist_directory();
// dlopen(file) next to libtdist first, then by the loader's search; on
// failure nullptr, with a line per path tried appended to *tried.
void* open_beside_libtdist(const std::string& file, int flags, std::string* tried);

}  // namespace tdist::comm
