// The C ABI's core: registry, conversions, guarded() (src/c/c_core.h).
#include "c/c_core.h"

#include <ATen/ATen.h>
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

void Registry::add(const void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.insert(p);
}
bool Registry::remove(const void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  if (live_.erase(p) != 1) return false;
  removals_.fetch_add(1, std::memory_order_release);
  return true;
}

namespace {
// This thread's handles found live while the removal count was `removals`.
struct SeenLive {
  static constexpr int kSlots = 4;
  const void* handles[kSlots] = {};
  uint64_t removals = ~uint64_t{0};
  int next = 0;
};
thread_local SeenLive seen;
}  // namespace

bool Registry::has(const void* p) const {
  // A handle freed before this call began bumped the count first, so an
  // answer from the cache is never older than the call.
  const uint64_t now = removals_.load(std::memory_order_acquire);
  if (seen.removals == now) {
    for (const void* h : seen.handles) {
      if (h == p) return true;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (live_.count(p) != 1) return false;
  const uint64_t at = removals_.load(std::memory_order_relaxed);  // stable under mu_
  if (seen.removals != at) {
    seen = SeenLive();
    seen.removals = at;
  }
  seen.handles[seen.next] = p;
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
  return Milliseconds(ms);
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
// Work slots: slabs of kSlab, made on demand and never freed (a freed
// work's pointer stays readable, so it can be told from a live one);
// each thread reuses the slots it freed.
constexpr size_t kSlab = 256;
constexpr size_t kMaxSlabs = size_t{1} << 14;  // 4 Mi works alive at once
std::atomic<tdist_work*> slabs[kMaxSlabs];
std::atomic<size_t> slab_count{0};
std::mutex slab_mu;
thread_local tdist_work* free_slots = nullptr;

tdist_work* grab_slot() {
  if (tdist_work* w = free_slots) {
    free_slots = w->next_free;
    return w;
  }
  std::lock_guard<std::mutex> lock(slab_mu);
  const size_t n = slab_count.load(std::memory_order_relaxed);
  if (n == kMaxSlabs) throw CFailure{TDIST_ERR_INTERNAL, "over 4 Mi works alive: free them (tdist_work_free)"};
  auto* slab = new tdist_work[kSlab];
  slabs[n].store(slab, std::memory_order_relaxed);
  slab_count.store(n + 1, std::memory_order_release);
  for (size_t i = kSlab - 1; i > 0; --i) {
    slab[i].next_free = free_slots;
    free_slots = &slab[i];
  }
  return &slab[0];
}

bool is_slot(const tdist_work* w) {
  const auto a = reinterpret_cast<uintptr_t>(w);
  for (size_t i = slab_count.load(std::memory_order_acquire); i-- > 0;) {
    const auto base = reinterpret_cast<uintptr_t>(slabs[i].load(std::memory_order_relaxed));
    if (a >= base && a < base + kSlab * sizeof(tdist_work)) return (a - base) % sizeof(tdist_work) == 0;
  }
  return false;
}

tdist_work* live_work(tdist_work* w) {
  if (!w) usage("the work is NULL");
  if (!is_slot(w)) usage("the work is not a handle tdist made");
  if (w->live.load(std::memory_order_acquire) != 1) usage("the work is freed");
  return w;
}
}  // namespace

tdist_work* new_work(std::shared_ptr<Work> w) {
  tdist_work* h = grab_slot();
  h->work = std::move(w);
  h->live.store(1, std::memory_order_release);
  return h;
}

Work& work_of(tdist_work* w) { return *live_work(w)->work; }

void free_work(tdist_work* w) {
  if (!w) usage("the work is NULL");
  if (!is_slot(w)) usage("the work is not a handle tdist made");
  uint32_t one = 1;
  if (!w->live.compare_exchange_strong(one, 0, std::memory_order_acq_rel)) usage("the work is freed already (freed twice?)");
  w->work.reset();
  w->next_free = free_slots;
  free_slots = w;
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
