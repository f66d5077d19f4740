// reduce_scatter: per round every rank posts, for each other rank, the
// next piece of that rank's share; after the barrier each reduces its own
// share from every rank's piece (its own straight from its input). With
// inputs symmetric on every rank, each rank reduces its share straight
// from the ranks' copies (symmetric_span.h); a large one on ordinary
// tensors may go single-copy (cma.h).
#include <algorithm>
#include <vector>

#include "comm/reduce.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/path.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

void reduce_scatter(Rounds& rounds, const void* in, void* out, size_t count, DataType t, ReduceOp op,
                    const OpDesc& desc, Deadline d, const SymSpan& sym_in, CmaChannel* cma) {
  const int n = rounds.size(), me = rounds.rank();
  const size_t es = dtype_size(t);
  const size_t piece = std::max<size_t>(1, rounds.round_bytes() / n / kAlign * kAlign / es);  // elements
  // A round's posts: in the box when the other ranks' shares fit it (then
  // in one round), rank q's at slot(q, me) = q, less one past the poster's
  // own (which it never posts); else rank q's piece at q * stride.
  const bool boxed = Rounds::fits_box((n - 1) * count * es);
  const size_t posted = boxed ? (n - 1) * count * es : n * count * es;  // mine/theirs pick the box by it
  const size_t stride = (boxed ? count : piece) * es;
  auto slot = [boxed](int q, int poster) { return static_cast<size_t>(boxed && q > poster ? q - 1 : q); };
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  RankPointers inputs(n);
  auto post = [&](size_t j) {
    const size_t off = j * piece, len = std::min(piece, count - std::min(count, off));
    for (int r = 0; r < n; ++r) {
      if (r != me) detail::copy_bytes(rounds.mine(posted) + slot(r, me) * stride, src + (r * count + off) * es, len * es);
    }
  };
  // Round 0 posted and its barrier passed: each round reduced, the next
  // posted and passed.
  auto staged = [&] {
    rounds.staged_rounds(piece, count, desc, d, post, [&](size_t off, size_t len) {
      for (int r = 0; r < n; ++r) {
        inputs[r] = r == me ? src + (me * count + off) * es : rounds.theirs(r, posted) + slot(me, r) * stride;
      }
      reduce_many(dst + off * es, inputs.data(), n, len, t, op, n);
    });
  };
  if (boxed) {
    // One line a rank: no symmetric or single-copy path to agree on (the
    // same on every rank, as the counts are), so the box goes at once.
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
