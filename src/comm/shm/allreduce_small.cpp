// The one-round all_reduce, for inputs that fit one staging buffer.
#include <algorithm>
#include <vector>

#include "comm/reduce.h"
#include "comm/shm/algorithms.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

void all_reduce_small(Rounds& rounds, const PieceWalker& walk, DataType t, DataType wire, ReduceOp op,
                      const OpDesc& desc, Deadline d) {
  const int n = rounds.size();
  const size_t es = dtype_size(t), ws = dtype_size(wire);
  const size_t count = walk.count();
  const size_t posted = count * ws;  // a rank's round: in the box when it fits
  uint8_t* post = rounds.mine(posted);
  walk.for_each(0, count, [&](uint8_t* p, size_t off, size_t k) { convert(post + off * ws, wire, p, t, k); });
  rounds.first_barrier(desc, d);
  RankPointers inputs(n);
  alignas(64) uint16_t scratch[kScratchElems];  // wire values (16-bit when narrower)
  walk.for_each(0, count, [&](uint8_t* p, size_t off, size_t k) {
    if (wire == t) {
      for (int r = 0; r < n; ++r) inputs[r] = rounds.theirs(r, posted) + off * ws;
      reduce_many(p, inputs.data(), n, k, t, op, n);
      return;
    }
    for (size_t b = 0; b < k; b += kScratchElems) {
      const size_t m = std::min(kScratchElems, k - b);
      for (int r = 0; r < n; ++r) inputs[r] = rounds.theirs(r, posted) + (off + b) * ws;
      reduce_many(scratch, inputs.data(), n, m, wire, op, n);
      convert(p + b * es, t, scratch, wire, m);
    }
  });
}

void reduce_small(Rounds& rounds, void* buf, size_t count, DataType t, ReduceOp op, int root, const OpDesc& desc,
                  Deadline d) {
  const int n = rounds.size();
  const size_t es = dtype_size(t);
  detail::copy_bytes(rounds.mine(count * es), buf, count * es);
  rounds.arrive(desc);
  if (rounds.rank() != root) return;
  for (int r = 0; r < n; ++r) {
    if (r != root) rounds.wait_for(r, desc, d);
  }
  RankPointers inputs(n);
  for (int r = 0; r < n; ++r) inputs[r] = rounds.theirs(r, count * es);
  reduce_many(buf, inputs.data(), n, count, t, op, n);
}

}  // namespace tdist::comm::shm::algo
