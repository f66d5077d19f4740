#include "comm/plugin.h"

#include <dlfcn.h>

#include <mutex>

#include "tdist/errors.h"

namespace tdist::comm {

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

std::string base_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// The file that defines `symbol` in the process's global scope; empty when
// none does.
std::string global_definer(const std::string& symbol) {
  void* p = dlsym(RTLD_DEFAULT, symbol.c_str());
  Dl_info info{};
  if (p == nullptr || dladdr(p, &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

class PluginLoader {
 public:
  explicit PluginLoader(PluginSpec spec) : spec_(std::move(spec)) {}

  const BackendPlugin& get() {
    std::call_once(once_, [this] {
      try {
        plugin_ = load();
      } catch (const Error& e) {
        error_ = e.what();
      }
    });
    if (plugin_ == nullptr) throw Error(error_);
    return *plugin_;
  }

 private:
  const BackendPlugin* load() {
    const std::string what = "the " + spec_.backend + " backend";
    const std::string foreign = global_definer(spec_.probe_symbol);
    const bool isolate = !foreign.empty() && base_name(foreign).rfind(spec_.library_prefix, 0) != 0;

    int flags = RTLD_NOW | RTLD_LOCAL;
#ifdef RTLD_DEEPBIND
    if (isolate && !kSanitized) flags |= RTLD_DEEPBIND;
#endif
    std::string tried;
    void* handle = open_beside_libtdist(spec_.file, flags, &tried);
    if (handle == nullptr) {
      throw Error(what + " is built as the plugin " + spec_.file + ", which could not be loaded:" + tried +
                  "\nInstall it next to libtdist (cmake --install does), or use another backend (shm, mpi).");
    }
    auto* entry = reinterpret_cast<const BackendPlugin* (*)()>(dlsym(handle, kBackendPluginEntry));
    const BackendPlugin* plugin = entry ? entry() : nullptr;
    if (plugin == nullptr || plugin->abi_version != kBackendPluginAbi || spec_.backend != plugin->name) {
      dlclose(handle);
      throw Error(what + ": " + spec_.file + " is not a tdist " + spec_.backend + " plugin of this version (ABI " +
                  std::to_string(kBackendPluginAbi) + "); reinstall tdist");
    }
    const std::string bound = plugin->bound_library ? plugin->bound_library() : "";
    Dl_info self{};
    const std::string plugin_file =
        dladdr(reinterpret_cast<const void*>(plugin), &self) && self.dli_fname ? self.dli_fname : "";
    const bool own = bound == plugin_file || base_name(bound).rfind(spec_.library_prefix, 0) == 0;
    if (!own) {
      dlclose(handle);
      throw Error(what + " cannot run in this process: its library's functions resolve to " + bound +
                  ", another copy of it" + (spec_.foreign_hint.empty() ? "" : " (" + spec_.foreign_hint + ")") +
                  ", not to " + spec_.library_prefix + ".so" +
                  (kSanitized ? "; sanitizer builds cannot load the plugin with a scope of its own (RTLD_DEEPBIND)"
                              : "") +
                  ". Use the shm or mpi backend here.");
    }
    return plugin;  // never unloaded: backends may live until exit
  }

  PluginSpec spec_;
  std::once_flag once_;
  const BackendPlugin* plugin_ = nullptr;
  std::string error_;
};

}  // namespace

std::string libtdist_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&plugin_backend_factory), &info) == 0 || info.dli_fname == nullptr) return "";
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

void* open_beside_libtdist(const std::string& file, int flags, std::string* tried) {
  // Next to libtdist first (build tree and installed tree alike), then the
  // loader's own search (RPATH, LD_LIBRARY_PATH).
  const std::string dir = libtdist_directory();
  for (const std::string& path : {dir.empty() ? std::string() : dir + "/" + file, file}) {
    if (path.empty()) continue;
    if (void* handle = dlopen(path.c_str(), flags)) return handle;
    const char* why = dlerror();
    if (tried) *tried += "\n  " + path + ": " + (why ? why : "not found");
  }
  return nullptr;
}

BackendFactory plugin_backend_factory(PluginSpec spec) {
  auto loader = std::make_shared<PluginLoader>(std::move(spec));
  return [loader](const BackendContext& ctx) { return loader->get().create(ctx); };
}

}  // namespace tdist::comm
