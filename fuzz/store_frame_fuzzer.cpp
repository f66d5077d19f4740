// libFuzzer target for the TCPStore frame parser, the code that reads
// untrusted bytes off the network. For every input it parses as many frames
// as it can, both as requests and as replies, under the limits the server
// and the client really use and under small ones; any frame it accepts must
// re-encode to exactly the bytes it consumed.
//
// Memory: the parser may allocate no more than the input's size (times a
// small factor, for the vectors of a message) plus 64 KiB, whatever counts
// and lengths the frame claims. Every allocation is counted (the sanitizer's
// malloc hooks), and an input that makes one parse's peak exceed that bound
// aborts. Run it also
// under libFuzzer's own limits (scripts/fuzz.sh passes -rss_limit_mb and
// -malloc_limit_mb), which catch what the count cannot (malloc from C code).
#include <sanitizer/allocator_interface.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include "store/wire.h"

namespace {

// Bytes this thread allocated and not yet freed, and the peak since the
// last reset (per thread: libFuzzer's own threads do not count), kept by
// the sanitizer allocator's hooks: they see every malloc and operator new,
// whoever made the block, so nothing here replaces an allocator.
thread_local int64_t g_live = 0;
thread_local int64_t g_peak = 0;

void on_malloc(const volatile void*, size_t n) {
  g_live += static_cast<int64_t>(n);
  if (g_live > g_peak) g_peak = g_live;
}

void on_free(const volatile void* p) {
  if (p) g_live -= static_cast<int64_t>(__sanitizer_get_allocated_size(const_cast<const void*>(p)));
}

tdist::TCPStoreLimits small_limits() {
  tdist::TCPStoreLimits limits;
  limits.max_value_bytes = 1 << 16;
  limits.max_key_bytes = 1 << 10;
  limits.max_keys_per_request = 1 << 10;
  return limits;
}

// What a TCPStore client accepts in replies (src/store/tcp_store.cpp).
tdist::TCPStoreLimits client_reply_limits() {
  tdist::TCPStoreLimits limits;
  limits.max_value_bytes = size_t(4) << 30;
  limits.max_keys_per_request = size_t(1) << 24;
  return limits;
}

void parse_all(const uint8_t* data, size_t size, const tdist::TCPStoreLimits& limits, bool is_request) {
  size_t pos = 0;
  while (pos < size) {
    const int64_t base = g_live;
    g_peak = g_live;
    tdist::wire::Message m;
    auto r = tdist::wire::parse_frame(data + pos, size - pos, limits, is_request, &m);
    // A message holds its bytes once, and a vector entry (24 or 32 bytes)
    // per 4 bytes of length fields at most; then error text.
    const int64_t bound = static_cast<int64_t>(size - pos) * 16 + (64 << 10);
    if (g_peak - base > bound) {
      std::fprintf(stderr, "store_frame_fuzzer: a %zu-byte input made the parser allocate %lld bytes (bound %lld)\n",
                   size - pos, static_cast<long long>(g_peak - base), static_cast<long long>(bound));
      std::abort();
    }
    if (r.status != tdist::wire::ParseStatus::kOk) break;
    if (r.consumed == 0 || r.consumed > size - pos) std::abort();
    std::string again;
    tdist::wire::encode_frame(m, &again);
    if (again.size() != r.consumed ||
        again.compare(0, again.size(), reinterpret_cast<const char*>(data + pos), r.consumed) != 0) {
      std::abort();
    }
    pos += r.consumed;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool hooked = __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free) != 0;
  if (!hooked) std::abort();  // without the count this target would check nothing
  static const tdist::TCPStoreLimits kLimits[] = {small_limits(), tdist::TCPStoreLimits{}, client_reply_limits()};
  for (const auto& limits : kLimits) {
    for (bool is_request : {true, false}) parse_all(data, size, limits, is_request);
  }
  return 0;
}
