// reduce_scatter: per round every rank posts, for each other rank, the
// next piece of that rank's share; after the barrier each reduces its own
// share from every rank's piece (its own straight from its input). With
// inputs symmetric on every rank (from 2 KiB in all: kStagedBytes,
// path.h), each rank reduces its share straight from the ranks' copies
// (symmetric_span.h); a large one on ordinary tensors may go single-copy
// (cma.h).
#include <algorithm>
#include <vector>

#include "comm/reduce.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/path.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

namespace {

// The others' shares fit the box (Rounds::fits_box): one round, in the
// barrier's line, with no path to agree on (the counts, and so this
// choice, are the same on every rank), and none of the staged rounds'
// arithmetic. Rank q's share goes at slot q of the poster's box, less one
// past the poster itself (it never posts its own).
void reduce_scatter_boxed(Rounds& rounds, const uint8_t* src, uint8_t* dst, size_t count, DataType t, ReduceOp op,
                          const OpDesc& desc, Deadline d) {
  const int n = rounds.size(), me = rounds.rank();
  const size_t share = count * dtype_size(t);
  const size_t posted = (n - 1) * share;
  uint8_t* box = rounds.mine(posted);
  for (int r = 0; r < n; ++r) {
    if (r != me) detail::copy_bytes(box + (r > me ? r - 1 : r) * share, src + r * share, share);
  }
  rounds.first_barrier(desc, d);
  RankPointers inputs(n);
  for (int r = 0; r < n; ++r) {
    inputs[r] = r == me ? src + me * share : rounds.theirs(r, posted) + (me > r ? me - 1 : me) * share;
  }
  reduce_many(dst, inputs.data(), n, count, t, op, n);
}

}  // namespace

void reduce_scatter(Rounds& rounds, const void* in, void* out, size_t count, DataType t, ReduceOp op,
                    const OpDesc& desc, Deadline d, const SymSpan& sym_in, CmaChannel* cma) {
  const int n = rounds.size(), me = rounds.rank();
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  const size_t es = dtype_size(t);
  if (Rounds::fits_box((n - 1) * count * es)) {
    reduce_scatter_boxed(rounds, src, dst, count, t, op, desc, d);
    return;
  }
  const size_t piece = std::max<size_t>(1, rounds.round_bytes() / n / kAlign * kAlign / es);  // elements
  // A round's posts, rank q's piece at q * stride of the staging buffer.
  const size_t posted = n * count * es;  // beyond the box: mine/theirs pick the staging buffer by it
  const size_t stride = piece * es;
  RankPointers inputs(n);
  auto post = [&](size_t j) {
    const size_t off = j * piece, len = std::min(piece, count - std::min(count, off));
    for (int r = 0; r < n; ++r) {
      if (r != me) detail::copy_bytes(rounds.mine(posted) + r * stride, src + (r * count + off) * es, len * es);
    }
  };
  // Round 0 posted and its barrier passed: each round reduced, the next
  // posted and passed.
  auto staged = [&] {
    rounds.staged_rounds(piece, count, desc, d, post, [&](size_t off, size_t len) {
      for (int r = 0; r < n; ++r) {
        inputs[r] = r == me ? src + (me * count + off) * es : rounds.theirs(r, posted) + me * stride;
      }
      reduce_many(dst + off * es, inputs.data(), n, len, t, op, n);
    });
  };
  if (n * count * es < kStagedBytes) {  // the same on every rank: no path to agree on
    post(0);
    rounds.first_barrier(desc, d);
    staged();
    return;
  }
  CrossoverTrial trial = CmaChannel::trial(cma, Crossover::Op::kReduceScatter, count * n * es);
  PathOffer offer{sym_in ? sym_in.key : nullptr, cma, trial.offers(), in, out, &trial};
  const Path path = agree_on_path(rounds, offer, desc, d, [&] { post(0); });
  if (path == Path::kSingleCopy) {
    cma_reduce_scatter(rounds, *cma, in, out, count, t, op, desc, d);
    return;
  }
  if (path == Path::kSymmetric) {
    // This rank's share of every rank's input, straight from its copy.
    for (int r = 0; r < n; ++r) inputs[r] = sym_in.on(r) + me * count * es;
    reduce_many(dst, inputs.data(), n, count, t, op, n);
    rounds.barrier_round(desc, d);
    return;
  }
  staged();
  if (trial.ends_with_barrier()) rounds.barrier_round(desc, d);
}

}  // namespace tdist::comm::shm::algo
