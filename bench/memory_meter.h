// What a benchmark rank's tensors and process use: a counting CPU
// allocator (bytes live now and at their peak, through LibTorch's CPU
// allocator: parameters, gradients, optimizer state, activations) and the
// kernel's VmRSS / VmHWM of this process (everything, shared memory
// included).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <new>
#include <string>

#include "util/torch_compat.h"

namespace tdist::bench {

// Its memory comes from posix_memalign with the block's size in a header
// just before the data, so that each data pointer is its own context and
// raw_allocate (which LibTorch's kernels use, e.g. gelu's and oneDNN's)
// works through it: no table; a lock only for the peaks.
class CountingAllocator final : public c10::Allocator {
 public:
  // Installs the one counting allocator as LibTorch's CPU allocator. Call
  // it before LibTorch computes anything: memory that the previous
  // allocator's raw_allocate gave out must not come back through this
  // one's raw_deleter (it has no header).
  static CountingAllocator& install() {
    static CountingAllocator* a = [] {
      auto* c = new CountingAllocator;
      c10::SetCPUAllocator(c, /*priority=*/100);
      return c;
    }();
    return *a;
  }

  c10::DataPtr allocate(size_t n) TDIST_ALLOCATOR_CONST override {
    // Nothing for 0 bytes, as LibTorch's own allocator (a pointer one past
    // a header block would also look leaked to LeakSanitizer).
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &release, c10::Device(c10::kCPU));
    void* base = nullptr;
    if (posix_memalign(&base, kHeader, n + kHeader) != 0) {
      throw std::bad_alloc();
    }
    *static_cast<size_t*>(base) = n;
    void* data = static_cast<char*>(base) + kHeader;
    counts().add(static_cast<int64_t>(n));
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
#if TDIST_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }
#endif

  int64_t live() const { return counts().live.load(); }
  int64_t peak() const { return counts().get(&Counts::peak); }
  void reset_peak() { counts().reset(true); }

  // The bytes that `excluded` says are not to count as "rest" (e.g. those
  // of FSDP's block pool); it must be cheap and thread-safe, and count a
  // block from before the block is allocated until after it is freed. With
  // it, each allocation also updates the peak of live - excluded
  // (peak_rest) and, at a new peak of live, what `excluded` said then
  // (excluded_at_peak). live - excluded is read as a snapshot in which
  // `excluded` did not change (another thread may be making or freeing an
  // excluded block meanwhile), so the rest is never overstated.
  void set_excluded(int64_t (*excluded)()) { counts().excluded.store(excluded); }
  int64_t live_rest() const { return counts().snapshot().rest(); }
  int64_t peak_rest() const { return counts().get(&Counts::peak_rest); }
  int64_t excluded_at_peak() const { return counts().get(&Counts::excluded_at_peak); }
  void reset_peak_rest() { counts().reset(false); }

 private:
  // The header before the data: the size; LibTorch's alignment (64), so
  // the data stays aligned as the default allocator's is.
  static constexpr size_t kHeader = 64;
  struct Counts {
    std::atomic<int64_t> live{0};
    std::atomic<int64_t (*)()> excluded{nullptr};
    std::mutex mu;  // the peaks
    int64_t peak = 0, excluded_at_peak = 0, peak_rest = 0;

    int64_t excluded_now() const {
      auto* ex = excluded.load();
      return ex ? ex() : 0;
    }
    struct Snapshot {
      int64_t live, excluded;
      int64_t rest() const { return live - excluded; }
    };
    Snapshot snapshot() const {
      int64_t before = excluded_now();
      for (int tries = 0;; ++tries) {
        const int64_t l = live.load();
        const int64_t after = excluded_now();
        if (after == before || tries == 100) return {l, std::max(before, after)};  // never overstate the rest
        before = after;
      }
    }
    void add(int64_t n) {
      const int64_t now = live.fetch_add(n) + n;
      if (n <= 0) return;
      const Snapshot s = snapshot();
      std::lock_guard<std::mutex> lock(mu);
      if (now > peak) {
        peak = now;
        excluded_at_peak = s.excluded;
      }
      peak_rest = std::max(peak_rest, s.rest());
    }
    int64_t get(int64_t Counts::*field) {
      std::lock_guard<std::mutex> lock(mu);
      return this->*field;
    }
    void reset(bool both) {
      const Snapshot s = snapshot();
      std::lock_guard<std::mutex> lock(mu);
      if (both) {
        peak = s.live;
        excluded_at_peak = s.excluded;
      }
      peak_rest = s.rest();
    }
  };
  static Counts& counts() {
    static Counts* c = new Counts;  // blocks may be freed during static destruction
    return *c;
  }
  CountingAllocator() = default;
  static void release(void* data) {
    if (data == nullptr) return;
    void* base = static_cast<char*>(data) - kHeader;
    counts().add(-static_cast<int64_t>(*static_cast<size_t*>(base)));
    std::free(base);
  }
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
