// The C ABI's core (src/c/): the handles' C++ side, the registry of live
// handles, the thread-local last error, and guarded(), through which every
// entry point runs so that no exception crosses into C. Internal to
// libtdist_c; the public face is include/tdist/c/tdist.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tdist/c/tdist.h"
#include "tdist/process_group.h"
#include "tdist/store.h"

namespace torch::nn {
class Module;
}
struct tdist_join;
struct tdist_tensor_list;
struct tdist_checkpointer;

namespace tdist::c {

struct Model;  // src/c/c_model.h

// A failure to report: the status and its message.
struct CFailure {
  tdist_status status;
  std::string what;
};

[[noreturn]] void usage(const std::string& what);
// This thread's last error message ("" after a call that succeeded).
const char* last_error_text();

// What a handle is: a live handle of another kind is refused like a
// foreign one (a binding's two void* mixed up).
enum class Kind : uint8_t { kStore, kPg, kModule, kDdp, kFsdp, kJoin, kList, kCheckpointer, kTensor };
template <typename T>
struct KindOf;
template <>
struct KindOf<tdist_store> { static constexpr Kind value = Kind::kStore; };
template <>
struct KindOf<tdist_pg> { static constexpr Kind value = Kind::kPg; };
template <>
struct KindOf<tdist_module> { static constexpr Kind value = Kind::kModule; };
template <>
struct KindOf<tdist_ddp> { static constexpr Kind value = Kind::kDdp; };
template <>
struct KindOf<tdist_fsdp> { static constexpr Kind value = Kind::kFsdp; };
template <>
struct KindOf<tdist_join> { static constexpr Kind value = Kind::kJoin; };
template <>
struct KindOf<tdist_tensor_list> { static constexpr Kind value = Kind::kList; };
template <>
struct KindOf<tdist_checkpointer> { static constexpr Kind value = Kind::kCheckpointer; };
template <>
struct KindOf<at::Tensor> { static constexpr Kind value = Kind::kTensor; };

// Live handles and their kinds (tensors tdist made too; works have slots
// of their own, below): a null, freed, foreign or other-kind pointer is
// an error, not a dereference. A map under a mutex; each thread remembers
// the few handles it found live last, valid while no handle has been
// removed since (a removal count), so that the calls of a training loop,
// on the same few handles, take no lock (tdist-bench collectives --api c
// measures what a call adds).
class Registry {
 public:
  void add(const void* p, Kind kind);
  bool remove(const void* p, Kind kind);  // false: not live as this kind
  bool has(const void* p, Kind kind) const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<const void*, Kind> live_;
  std::atomic<uint64_t> removals_{0};  // bumped under mu_ by every remove
};
Registry& registry();

template <typename T>
T* live(T* h, const char* what) {
  if (!h) usage(std::string("the ") + what + " is NULL");
  if (!registry().has(h, KindOf<T>::value)) {
    usage(std::string("the ") + what + " is not a live handle of its kind (freed, another kind of handle, or not made by tdist)");
  }
  return h;
}
template <typename T>
const T* live(const T* h, const char* what) {
  return live(const_cast<T*>(h), what);
}
// A handle made by `new`, registered; freed by release() (a second
// release is a usage error).
template <typename T>
T* handle(T* h) {
  registry().add(h, KindOf<T>::value);
  return h;
}
template <typename T>
void release(T* h, const char* what) {
  if (!h) usage(std::string("the ") + what + " is NULL");
  if (!registry().remove(h, KindOf<T>::value)) {
    usage(std::string("the ") + what + " is not a live handle of its kind (freed twice? another kind of handle?)");
  }
  delete h;
}

// The binding's tensor (borrowed): defined, or a usage error.
at::Tensor& tensor(tdist_tensor t, const char* what);
// n tensors of an array (NULL only when n == 0).
std::vector<at::Tensor> tensors(const tdist_tensor* ts, size_t n, const char* what);
// n names (none NULL).
std::vector<std::string> names(const char* const* ns, size_t n, const char* what);
std::optional<Milliseconds> timeout_of(int64_t ms);
ReduceOp op_of(int op);
at::ScalarType dtype_of(int d);
// A new tensor, the caller's to free with tdist_tensor_free.
tdist_tensor new_tensor(at::Tensor t);
// Works live in slots (c_works.cpp): a tdist_work* is not an address but a
// slot's number and generation, so a freed work stays freed when its
// slot is reused, and a foreign pointer names no slot. reserve_work
// before the op starts (so that no op runs without its handle), then
// publish_work, or unreserve_work when the launch failed.
tdist_work* reserve_work();
void publish_work(tdist_work* h, std::shared_ptr<Work> w);
void unreserve_work(tdist_work* h) noexcept;
Work& work_of(tdist_work* w);
void free_work(tdist_work* w);
template <typename T>
void out_check(T** out) {
  if (!out) usage("the output pointer is NULL");
  *out = nullptr;
}

// The thread's string returned to C (flight recorder dumps): valid until
// the thread's next call.
std::string& thread_string();

tdist_status guarded_impl(const char* call, void (*body)(void*), void* ctx);
template <typename Fn>
tdist_status guarded(const char* call, Fn&& fn) {
  return guarded_impl(call, [](void* f) { (*static_cast<Fn*>(f))(); }, &fn);
}

}  // namespace tdist::c

struct tdist_pg {
  std::shared_ptr<tdist::ProcessGroup> pg;
};
struct tdist_store {
  std::shared_ptr<tdist::Store> store;
};
struct tdist_module {
  std::shared_ptr<tdist::c::Model> model;
};
