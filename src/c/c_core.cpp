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
