// What a benchmark rank's tensors and process use: a counting CPU
// allocator (bytes live now and at their peak, through LibTorch's CPU
// allocator: parameters, gradients, optimizer state, activations) and the
// kernel's VmRSS / VmHWM of this process (everything, shared memory
// included).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "util/torch_compat.h"

namespace tdist::bench {

class CountingAllocator final : public c10::Allocator {
 public:
  // Wraps the CPU allocator in use now and installs itself in its place.
  static CountingAllocator& install() {
    static CountingAllocator* a = [] {
      auto* c = new CountingAllocator(c10::GetCPUAllocator());
      c10::SetCPUAllocator(c, /*priority=*/100);
      return c;
    }();
    return *a;
  }

  c10::DataPtr allocate(size_t n) TDIST_ALLOCATOR_CONST override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    auto* ctx = new Context{std::move(inner), n, this};
    add(static_cast<int64_t>(n));
    return c10::DataPtr(data, ctx, &release, c10::Device(c10::kCPU));
  }
#if TDIST_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }
#endif

  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;
    size_t bytes;
    const CountingAllocator* owner;
  };
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  void add(int64_t n) const {
    const int64_t now = live_.fetch_add(n) + n;
    int64_t p = peak_.load();
    while (now > p && !peak_.compare_exchange_weak(p, now)) {
    }
  }
  static void release(void* p) {
    auto* ctx = static_cast<Context*>(p);
    ctx->owner->add(-static_cast<int64_t>(ctx->bytes));
    delete ctx;
  }

  c10::Allocator* inner_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); 0 if absent.
inline int64_t proc_status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return 0;
}

}  // namespace tdist::bench
