// The C ABI's core: registry, conversions, guarded() (src/c/c_core.h).
#include "c/c_core.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <c10/util/Exception.h>

#include "tdist/errors.h"

namespace tdist::c {

namespace {
thread_local std::string last_error;

tdist_status fail(tdist_status s, const char* call, const std::string& what) {
  last_error = std::string(call) + ": " + what;
  return s;
}
}  // namespace

const char* last_error_text() { return last_error.c_str(); }

void usage(const std::string& what) { throw CFailure{TDIST_ERR_USAGE, what}; }

void Registry::add(const void* p, Kind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  live_[p] = kind;
}

bool Registry::remove(const void* p, Kind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find(p);
  if (it == live_.end() || it->second != kind) return false;
  live_.erase(it);
  removals_.fetch_add(1, std::memory_order_release);
  return true;
}

namespace {
// This thread's handles found live while the removal count was `removals`.
struct SeenLive {
  static constexpr int kSlots = 4;
  const void* handles[kSlots] = {};
  Kind kinds[kSlots] = {};
  uint64_t removals = ~uint64_t{0};
  int next = 0;
};
thread_local SeenLive seen;
}  // namespace

bool Registry::has(const void* p, Kind kind) const {
  // A handle freed before this call began bumped the count first, so an
  // answer from the cache is never older than the call.
  const uint64_t now = removals_.load(std::memory_order_acquire);
  if (seen.removals == now) {
    for (int i = 0; i < SeenLive::kSlots; ++i) {
      if (seen.handles[i] == p && seen.kinds[i] == kind) return true;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find(p);
  if (it == live_.end() || it->second != kind) return false;
  const uint64_t at = removals_.load(std::memory_order_relaxed);  // stable under mu_
  if (seen.removals != at) {
    seen = SeenLive();
    seen.removals = at;
  }
  seen.handles[seen.next] = p;
  seen.kinds[seen.next] = kind;
  seen.next = (seen.next + 1) % SeenLive::kSlots;
  return true;
}

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: handles may outlive static destruction
  return *r;
}

at::Tensor& tensor(tdist_tensor t, const char* what) {
  if (!t) usage(std::string("the ") + what + " tensor is NULL");
  auto* p = static_cast<at::Tensor*>(t);
  if (!p->defined()) usage(std::string("the ") + what + " tensor is undefined");
  return *p;
}

std::vector<at::Tensor> tensors(const tdist_tensor* ts, size_t n, const char* what) {
  if (!ts && n > 0) usage(std::string("the ") + what + " array is NULL");
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(tensor(ts[i], what));
  return out;
}

std::vector<std::string> names(const char* const* ns, size_t n, const char* what) {
  if (!ns && n > 0) usage(std::string("the ") + what + " array is NULL");
  std::vector<std::string> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!ns[i]) usage(std::string(what) + "[" + std::to_string(i) + "] is NULL");
    out.emplace_back(ns[i]);
  }
  return out;
}

std::optional<Milliseconds> timeout_of(int64_t ms) {
  if (ms < 0) usage("the timeout is negative (" + std::to_string(ms) + " ms)");
  if (ms == 0) return std::nullopt;
  // Longer is as good as forever (INT64_MAX, a binding's "no limit"), and
  // a deadline in nanoseconds past it would overflow.
  constexpr int64_t kLongest = int64_t{1000} * 1000 * 1000 * 1000;  // 10^12 ms: 31 years
  return Milliseconds(std::min(ms, kLongest));
}

ReduceOp op_of(int op) {
  switch (op) {
    case TDIST_SUM: return ReduceOp::SUM;
    case TDIST_AVG: return ReduceOp::AVG;
    case TDIST_PRODUCT: return ReduceOp::PRODUCT;
    case TDIST_MIN: return ReduceOp::MIN;
    case TDIST_MAX: return ReduceOp::MAX;
  }
  usage("unknown reduce op " + std::to_string(op));
}

at::ScalarType dtype_of(int d) {
  switch (d) {
    case TDIST_FLOAT32: return at::kFloat;
    case TDIST_FLOAT64: return at::kDouble;
    case TDIST_INT64: return at::kLong;
    case TDIST_INT32: return at::kInt;
    case TDIST_BFLOAT16: return at::kBFloat16;
    case TDIST_FLOAT16: return at::kHalf;
  }
  usage("unknown dtype " + std::to_string(d));
}

tdist_tensor new_tensor(at::Tensor t) { return handle(new at::Tensor(std::move(t))); }
namespace {

// Work slots: slabs of kSlab, made on demand and never freed. A handle is
// (slot number + 1) | generation << 32, not an address: a slot's
// generation is odd while its work is live and moves on when it is freed,
// so a freed handle never names a later work in the same slot, and a
// foreign pointer names no slot. Each thread keeps the slots it freed;
// a thread that ends gives them back to the shared pool.
static_assert(sizeof(void*) == 8, "work handles need 64-bit pointers");
struct Slot {
  std::atomic<uint32_t> generation{0};  // odd: live
  std::shared_ptr<Work> work;
  uint32_t next_free = 0;  // a slot number + 1; 0: none
};
constexpr uint32_t kSlab = 256;
constexpr uint32_t kMaxSlabs = uint32_t{1} << 14;  // 4 Mi works alive at once
std::atomic<Slot*> slabs[kMaxSlabs];
std::atomic<uint32_t> slab_count{0};
std::mutex pool_mu;
uint32_t pool_free = 0;  // REQUIRES pool_mu: the shared pool's list

Slot& slot(uint32_t number) { return slabs[number / kSlab].load(std::memory_order_acquire)[number % kSlab]; }

struct ThreadSlots {
  uint32_t free = 0;
  ~ThreadSlots() {  // the thread ends: its free slots go back to the pool
    std::lock_guard<std::mutex> lock(pool_mu);
    while (free) {
      const uint32_t n = free - 1;
      free = slot(n).next_free;
      slot(n).next_free = pool_free;
      pool_free = n + 1;
    }
  }
};
thread_local ThreadSlots thread_slots;

uint32_t grab_slot() {
  if (uint32_t f = thread_slots.free) {
    thread_slots.free = slot(f - 1).next_free;
    return f - 1;
  }
  std::lock_guard<std::mutex> lock(pool_mu);
  if (uint32_t f = pool_free) {
    pool_free = slot(f - 1).next_free;
    return f - 1;
  }
  const uint32_t k = slab_count.load(std::memory_order_relaxed);
  if (k == kMaxSlabs) throw CFailure{TDIST_ERR_INTERNAL, "over 4 Mi works alive: free them (tdist_work_free)"};
  slabs[k].store(new Slot[kSlab], std::memory_order_release);
  slab_count.store(k + 1, std::memory_order_release);
  for (uint32_t i = kSlab - 1; i > 0; --i) {
    slot(k * kSlab + i).next_free = thread_slots.free;
    thread_slots.free = k * kSlab + i + 1;
  }
  return k * kSlab;
}

void put_back(uint32_t number) {
  slot(number).next_free = thread_slots.free;
  thread_slots.free = number + 1;
}

tdist_work* handle_of(uint32_t number, uint32_t generation) {
  return reinterpret_cast<tdist_work*>((uint64_t{generation} << 32) | (uint64_t{number} + 1));
}

// The slot a handle names, with the handle's generation; a usage error
// for what names none.
Slot& named(tdist_work* h, uint32_t* generation) {
  if (!h) usage("the work is NULL");
  const auto v = reinterpret_cast<uint64_t>(h);
  const uint64_t number = (v & 0xffffffffu) - 1;
  *generation = static_cast<uint32_t>(v >> 32);
  if ((v & 0xffffffffu) == 0 || number >= uint64_t{slab_count.load(std::memory_order_acquire)} * kSlab ||
      (*generation & 1) == 0) {
    usage("the work is not a handle tdist made");
  }
  return slot(static_cast<uint32_t>(number));
}

}  // namespace

tdist_work* reserve_work() {
  const uint32_t n = grab_slot();
  Slot& s = slot(n);
  const uint32_t g = s.generation.load(std::memory_order_relaxed) + 1;  // odd: live
  s.generation.store(g, std::memory_order_release);
  return handle_of(n, g);
}

void publish_work(tdist_work* h, std::shared_ptr<Work> w) {
  uint32_t g = 0;
  named(h, &g).work = std::move(w);
}

void unreserve_work(tdist_work* h) noexcept {
  const auto v = reinterpret_cast<uint64_t>(h);
  const auto n = static_cast<uint32_t>((v & 0xffffffffu) - 1);
  Slot& s = slot(n);
  s.work.reset();
  s.generation.fetch_add(1, std::memory_order_acq_rel);  // even: free
  put_back(n);
}

Work& work_of(tdist_work* h) {
  uint32_t g = 0;
  Slot& s = named(h, &g);
  if (s.generation.load(std::memory_order_acquire) != g) usage("the work is freed");
  return *s.work;
}

void free_work(tdist_work* h) {
  uint32_t g = 0;
  Slot& s = named(h, &g);
  uint32_t expected = g;
  if (!s.generation.compare_exchange_strong(expected, g + 1, std::memory_order_acq_rel)) {
    usage("the work is freed already (freed twice?)");
  }
  s.work.reset();
  const auto v = reinterpret_cast<uint64_t>(h);
  put_back(static_cast<uint32_t>((v & 0xffffffffu) - 1));
}

std::string& thread_string() {
  thread_local std::string s;
  return s;
}

tdist_status guarded_impl(const char* call, void (*body)(void*), void* ctx) {
  try {
    body(ctx);
    if (!last_error.empty()) last_error.clear();
    return TDIST_OK;
  } catch (const CFailure& f) {
    return fail(f.status, call, f.what);
  } catch (const TimeoutError& e) {
    return fail(TDIST_ERR_TIMEOUT, call, e.what());
  } catch (const UsageError& e) {
    return fail(TDIST_ERR_USAGE, call, e.what());
  } catch (const CheckpointError& e) {
    return fail(TDIST_ERR_CHECKPOINT, call, e.what());
  } catch (const Error& e) {  // peers, the network, the store, mismatched collectives
    return fail(TDIST_ERR_COMM, call, e.what());
  } catch (const c10::Error& e) {  // LibTorch refused the tensors (dtype, shape, device)
    return fail(TDIST_ERR_USAGE, call, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(TDIST_ERR_INTERNAL, call, e.what());
  } catch (...) {
    return fail(TDIST_ERR_INTERNAL, call, "an unknown exception");
  }
}

}  // namespace tdist::c
