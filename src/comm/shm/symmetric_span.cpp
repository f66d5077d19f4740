// SymSpan: finding the block, hashing the key, the agreement. The contract
// is in symmetric_span.h.
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

bool agree_on_symmetric(Rounds& rounds, const SymSpan& span, const OpDesc& desc, Deadline d,
                        const std::function<void()>& post_round0) {
  uint64_t* published = rounds.sym_key_slot();
  published[0] = span.key[0];
  published[1] = span.key[1];
  if (!span) post_round0();
  rounds.first_barrier(desc, d);
  bool all_same = static_cast<bool>(span), any_key = false;
  for (int r = 0; r < rounds.size(); ++r) {
    const uint64_t* k = rounds.sym_key_of(r);
    any_key = any_key || (k[0] | k[1]) != 0;
    all_same = all_same && k[0] == span.key[0] && k[1] == span.key[1];
  }
  if (all_same) return true;
  if (any_key) {
    // Some rank skipped round 0: everyone posts it (again, into this
    // round's buffer) and passes one more barrier.
    post_round0();
    rounds.barrier_round(desc, d);
  }
  return false;
}

}  // namespace tdist::comm::shm
