// libFuzzer target for the TCPStore frame parser, the code that reads
// untrusted bytes off the network. For every input it parses as many frames
// as it can, both as requests and as replies, under the limits the server
// and the client really use and under small ones; any frame it accepts must
// re-encode to exactly the bytes it consumed.
//
// Memory: the parser may allocate no more than the input's size (times a
// small factor, for the vectors of a message) plus 64 KiB, whatever counts
// and lengths the frame claims. Every operator new below is counted, and an
// input that makes one parse's peak exceed that bound aborts. Run it also
// under libFuzzer's own limits (scripts/fuzz.sh passes -rss_limit_mb and
// -malloc_limit_mb), which catch what the count cannot (malloc from C code).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include "store/wire.h"

namespace {

// Bytes this thread allocated through operator new and not yet freed, and
// the peak since the last reset (per thread: libFuzzer's own threads do not
// count). Each block carries its size in a header.
thread_local size_t g_live = 0;
thread_local size_t g_peak = 0;
constexpr size_t kHeader = alignof(std::max_align_t);

void* counted_alloc(size_t n) {
  auto* p = static_cast<unsigned char*>(std::malloc(n + kHeader));
  if (!p) throw std::bad_alloc();
  *reinterpret_cast<size_t*>(p) = n;
  g_live += n;
  if (g_live > g_peak) g_peak = g_live;
  return p + kHeader;
}

void counted_free(void* q) {
  if (!q) return;
  auto* p = static_cast<unsigned char*>(q) - kHeader;
  g_live -= *reinterpret_cast<size_t*>(p);
  std::free(p);
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
    const size_t base = g_live;
    g_peak = g_live;
    tdist::wire::Message m;
    auto r = tdist::wire::parse_frame(data + pos, size - pos, limits, is_request, &m);
    // A message holds its bytes once, and a vector entry (24 or 32 bytes)
    // per 4 bytes of length fields at most; then error text.
    const size_t bound = (size - pos) * 16 + (64 << 10);
    if (g_peak - base > bound) {
      std::fprintf(stderr, "store_frame_fuzzer: a %zu-byte input made the parser allocate %zu bytes (bound %zu)\n",
                   size - pos, g_peak - base, bound);
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

void* operator new(size_t n) { return counted_alloc(n); }
void* operator new[](size_t n) { return counted_alloc(n); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, size_t) noexcept { counted_free(p); }
void operator delete[](void* p, size_t) noexcept { counted_free(p); }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const tdist::TCPStoreLimits kLimits[] = {small_limits(), tdist::TCPStoreLimits{}, client_reply_limits()};
  for (const auto& limits : kLimits) {
    for (bool is_request : {true, false}) parse_all(data, size, limits, is_request);
  }
  return 0;
}
