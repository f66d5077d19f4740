// SymmetricAllReduce: which pieces are symmetric on every rank (the key
// check) and the in-place reduction over them. The contract is in
// symmetric_allreduce.h.
#include "comm/shm/symmetric_allreduce.h"

#include <algorithm>

#include "comm/reduce.h"
#include "comm/shm/algorithms.h"
#include "util/bytes.h"

namespace tdist::comm::shm {

SymmetricAllReduce::SymmetricAllReduce(std::shared_ptr<const SymRegistry> registry)
    : registry_(std::move(registry)) {}

void SymmetricAllReduce::plan(const std::vector<Piece>& pieces, size_t es, int rank) {
  key_[0] = key_[1] = 0;
  parts_.clear();
  if (registry_->empty()) return;
  for (const Piece& p : pieces) {
    if (p.count == 0) continue;
    const SymBlock* b = registry_->find(p.data, p.count * es);
    if (!b) {
      parts_.clear();
      return;
    }
    const size_t offset = static_cast<size_t>(static_cast<uint8_t*>(p.data) - b->copies[rank]);
    if (!parts_.empty() && parts_.back().block == b && parts_.back().offset + parts_.back().count * es == offset) {
      parts_.back().count += p.count;
    } else {
      parts_.push_back({b, offset, p.count});
    }
  }
  if (parts_.empty()) return;
  uint64_t h0 = 0x243f6a8885a308d3ull, h1 = 0x13198a2e03707344ull;
  for (const SymPart& part : parts_) {
    for (uint64_t v : {part.block->id, static_cast<uint64_t>(part.offset), static_cast<uint64_t>(part.count)}) {
      h0 = sym_key_mix(h0, v);
      h1 = sym_key_mix(h1, ~v);
    }
  }
  key_[0] = h0;
  key_[1] = h1 | 1;  // never {0, 0}
}

void SymmetricAllReduce::run(Rounds& rounds, size_t count, DataType t, DataType wire, ReduceOp op,
                             const OpDesc& desc, Deadline d) {
  const int n = rounds.size(), me = rounds.rank();
  const size_t es = dtype_size(t);
  const size_t line = std::max<size_t>(1, kAlign / es);
  const size_t per = ((count + n - 1) / n + line - 1) / line * line;
  const size_t begin = std::min(count, me * per), end = std::min(count, begin + per);
  RankPointers inputs(n);
  if (wire != t) scratch_.resize((size_t(n) + 1) * kScratchElems);
  // The elements [begin, end) of the concatenation, part by part, in
  // blocks small enough that the copies to the other ranks read from cache.
  constexpr size_t kBlockBytes = 16 << 10;
  const size_t block = wire == t ? kBlockBytes / es : kScratchElems;
  size_t at = 0;  // first element of the current part
  for (const SymPart& part : parts_) {
    const size_t lo = std::max(begin, at), hi = std::min(end, at + part.count);
    for (size_t e = lo; e < hi; e += block) {
      const size_t m = std::min(block, hi - e);
      const size_t off = part.offset + (e - at) * es;
      auto copy_of = [&](int q) { return part.block->copies[q] + off; };
      uint8_t* own = copy_of(me);
      uint8_t* next = n > 1 ? copy_of((me + 1) % n) : nullptr;
      if (wire == t) {
        for (int q = 0; q < n; ++q) inputs[q] = copy_of(q);
        reduce_many(own, inputs.data(), n, m, t, op, n, next);
      } else {
        // Narrow every rank's values, reduce as wire, widen the result.
        uint16_t* result = scratch_.data() + size_t(n) * kScratchElems;
        for (int q = 0; q < n; ++q) {
          uint16_t* narrowed = scratch_.data() + size_t(q) * kScratchElems;
          convert(narrowed, wire, copy_of(q), t, m);
          inputs[q] = narrowed;
        }
        reduce_many(result, inputs.data(), n, m, wire, op, n);
        convert(own, t, result, wire, m);
        if (next) detail::copy_bytes(next, own, m * es);
      }
      for (int k = 2; k < n; ++k) detail::copy_bytes(copy_of((me + k) % n), own, m * es);
    }
    at += part.count;
  }
  rounds.barrier_round(desc, d);
}

}  // namespace tdist::comm::shm
