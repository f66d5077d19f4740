// SymSpan: finding the block, hashing the key. The contract is in
// symmetric_span.h.
#include "comm/shm/symmetric_span.h"

namespace tdist::comm::shm {

SymSpan SymSpan::find(const SymRegistry& registry, const void* p, size_t bytes, int rank) {
  SymSpan s;
  if (bytes == 0 || registry.empty()) return s;
  const SymBlock* b = registry.find(p, bytes);
  if (!b) return s;
  s.block = b;
  s.offset = static_cast<size_t>(static_cast<const uint8_t*>(p) - b->copies[rank]);
  uint64_t h0 = 0x452821e638d01377ull, h1 = 0xbe5466cf34e90c6cull;
  for (uint64_t v : {b->id, static_cast<uint64_t>(s.offset), static_cast<uint64_t>(bytes)}) {
    h0 = sym_key_mix(h0, v);
    h1 = sym_key_mix(h1, ~v);
  }
  s.key[0] = h0;
  s.key[1] = h1 | 1;  // never {0, 0}
  return s;
}

}  // namespace tdist::comm::shm
