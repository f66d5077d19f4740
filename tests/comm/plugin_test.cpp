// Backend plugins (comm/plugin.h): how a plugin is found, checked and
// refused, and that the gloo plugin's calls land in its own Gloo in this
// build, whichever other Gloo the process holds.
#include <dlfcn.h>
#include <gnu/libc-version.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "comm/plugin.h"
#include "tdist/errors.h"
#include "tdist/store.h"
#include "tdist/config.h"

namespace {

using tdist::comm::BackendContext;
using tdist::comm::plugin_backend_factory;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string base_name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

// What the factory raises when called; fails the test when it does not.
std::string error_of(const tdist::comm::BackendFactory& factory, int rank = 0) {
  BackendContext ctx;
  ctx.rank = rank;
  try {
    factory(ctx);
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "the factory did not throw";
  return "";
}

// The file that defines `symbol` for a lookup in the global scope.
std::string global_definer(const char* symbol) {
  Dl_info info{};
  void* p = dlsym(RTLD_DEFAULT, symbol);
  return p && dladdr(p, &info) && info.dli_fname ? info.dli_fname : "";
}

std::string libc_file() {
  Dl_info info{};
  const char* (*fn)() = &gnu_get_libc_version;
  return dladdr(reinterpret_cast<void*>(fn), &info) ? info.dli_fname : "";
}

// A spec whose library is libc (gnu_get_libc_version) unless prefix says otherwise.
tdist::comm::PluginSpec fake_spec(std::string backend, std::string file, std::string prefix) {
  return {std::move(backend), std::move(file), "gnu_get_libc_version", std::move(prefix), "the test says so"};
}

TEST(BackendPlugins, AMissingPluginSaysWhereItWasLookedFor) {
  const std::string what = error_of(plugin_backend_factory(fake_spec("fake", "libtdist_no_such_plugin.so", "libc")));
  EXPECT_TRUE(contains(what, "the fake backend is built as the plugin libtdist_no_such_plugin.so")) << what;
  EXPECT_TRUE(contains(what, "/libtdist_no_such_plugin.so: ")) << what;  // next to libtdist
  EXPECT_TRUE(contains(what, "use another backend")) << what;
}

TEST(BackendPlugins, APluginOfAnotherVersionIsRefused) {
  const std::string what = error_of(plugin_backend_factory(fake_spec("fake", "libtdist_fake_plugin_old.so", "libc")));
  EXPECT_TRUE(contains(what, "is not a tdist fake plugin of this version")) << what;
}

TEST(BackendPlugins, APluginForAnotherBackendIsRefused) {
  const std::string what = error_of(plugin_backend_factory(fake_spec("other", "libtdist_fake_plugin.so", "libc")));
  EXPECT_TRUE(contains(what, "is not a tdist other plugin")) << what;
}

TEST(BackendPlugins, APluginWhoseLibraryResolvesToAnotherCopyIsRefused) {
  // The fake's library is libc; expecting "libfake" makes libc the foreign copy.
  const std::string what = error_of(plugin_backend_factory(fake_spec("fake", "libtdist_fake_plugin.so", "libfake")));
  EXPECT_TRUE(contains(what, "the fake backend cannot run in this process")) << what;
  EXPECT_TRUE(contains(what, "resolve to " + libc_file() + ", another copy of it (the test says so)")) << what;
}

TEST(BackendPlugins, AGoodPluginIsLoadedOnceAndCreatesItsBackend) {
  auto factory = plugin_backend_factory(fake_spec("fake", "libtdist_fake_plugin.so", "libc"));
  EXPECT_EQ(error_of(factory, 3), "fake backend created for rank 3");
  EXPECT_EQ(error_of(factory, 5), "fake backend created for rank 5");
}

TEST(BackendPlugins, ThreadsAskingAtOnceAllGetTheOnePlugin) {
  auto factory = plugin_backend_factory(fake_spec("fake", "libtdist_fake_plugin.so", "libc"));
  std::vector<std::string> said(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) threads.emplace_back([&, t] { said[t] = error_of(factory, t); });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(said[t], "fake backend created for rank " + std::to_string(t));
}

#if TDIST_WITH_GLOO
// LibTorch 2.x's libtorch_cpu exports its own Gloo (the reason the gloo
// backend is a plugin); 1.13 from Debian uses Debian's libgloo. Either way
// the plugin's calls must land in Debian's libgloo.
TEST(BackendPlugins, TheGlooPluginCallsItsOwnGloo) {
  const char* probe = "_ZN4gloo10allgathervERNS_17AllgathervOptionsE";  // gloo::allgatherv
  // Before: LibTorch 2.x's libtorch_cpu (the wheel), or Debian's libgloo
  // (which Debian's 1.13 links).
  const std::string before = base_name(global_definer(probe));
  EXPECT_TRUE(before == "libtorch_cpu.so" || before.rfind("libgloo.so", 0) == 0) << before;
  std::printf("gloo::allgatherv in the global scope: %s\n", before.c_str());

  BackendContext ctx;
  ctx.store = std::make_shared<tdist::HashStore>();
  auto backend = tdist::comm::create_backend("gloo", ctx);  // world of one: loads the plugin
  ASSERT_EQ(backend->name(), "gloo");
  float x = 2;
  backend->all_reduce(&x, 1, tdist::comm::DataType::kFloat32, tdist::comm::ReduceOp::kSum,
                      tdist::comm::Clock::now() + std::chrono::seconds(30));
  EXPECT_EQ(x, 2);

  void* handle = dlopen("libtdist_gloo.so", RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) {  // loaded by path: find it by the name dladdr reports
    Dl_info info{};
    ASSERT_TRUE(dladdr(reinterpret_cast<void*>(&plugin_backend_factory), &info));
    const std::string dir = std::string(info.dli_fname).substr(0, std::string(info.dli_fname).rfind('/'));
    handle = dlopen((dir + "/libtdist_gloo.so").c_str(), RTLD_NOW | RTLD_NOLOAD);
  }
  ASSERT_NE(handle, nullptr) << "the gloo plugin is not loaded";
  auto* entry = reinterpret_cast<const tdist::comm::BackendPlugin* (*)()>(dlsym(handle, "tdist_backend_plugin"));
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(base_name(entry()->bound_library()).rfind("libgloo.so", 0), 0u) << entry()->bound_library();
  dlclose(handle);  // the NOLOAD reference only
}
#endif

}  // namespace
