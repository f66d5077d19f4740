// gather and all_gather: every rank posts a round_bytes chunk of its input
// per round; after the barrier root (or everyone) copies all of them out.
// An all_gather whose inputs are symmetric on every rank (from 2 KiB in
// all: kStagedBytes, path.h) reads them straight from the ranks' copies
// instead (symmetric_span.h); a large one on ordinary tensors may go
// single-copy (cma.h).
#include <algorithm>

#include "comm/shm/algorithms.h"
#include "comm/shm/path.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

void gather(Rounds& rounds, const void* in, void* out, size_t bytes, int root, const OpDesc& desc, Deadline d,
            const SymSpan& sym_in, CmaChannel* cma) {
  const size_t chunk = rounds.round_bytes();
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  const bool want = root < 0 || root == rounds.rank();
  auto post = [&](size_t j) {
    const size_t off = j * chunk, len = std::min(chunk, bytes - std::min(bytes, off));
    detail::copy_bytes(rounds.mine(bytes), src + off, len);
  };
  // Round 0 posted and its barrier passed: the rest of the staged rounds,
  // each copied out where wanted.
  auto staged = [&] {
    rounds.staged_rounds(chunk, bytes, desc, d, post, [&](size_t off, size_t len) {
      if (!want) return;
      for (int r = 0; r < rounds.size(); ++r) {
        uint8_t* to = dst + r * bytes + off;
        if (r == rounds.rank()) {
          if (to != src + off) detail::move_bytes(to, src + off, len);
        } else {
          detail::copy_bytes(to, rounds.theirs(r, bytes), len);
        }
      }
    });
  };
  if (root >= 0 || Rounds::fits_box(bytes) || bytes * rounds.size() < kStagedBytes) {
    // No other path to agree on, the same on every rank: a gather has
    // none, nor has a small all_gather (path.h).
    post(0);
    rounds.first_barrier(desc, d);
    staged();
    return;
  }
  CrossoverTrial trial = CmaChannel::trial(cma, Crossover::Op::kAllGather, bytes * rounds.size());
  PathOffer offer{sym_in ? sym_in.key : nullptr, cma, trial.offers(), in, out, &trial};
  const Path path = agree_on_path(rounds, offer, desc, d, [&] { post(0); });
  if (path == Path::kSingleCopy) {
    cma_all_gather(rounds, *cma, in, out, bytes, desc, d);
    return;
  }
  if (path == Path::kSymmetric) {
    // Every rank's input, straight from its copy; then nobody may change
    // an input until all have read it.
    for (int r = 0; r < rounds.size(); ++r) {
      uint8_t* to = dst + r * bytes;
      if (to != sym_in.on(r)) detail::copy_bytes(to, sym_in.on(r), bytes);
    }
    rounds.barrier_round(desc, d);
    return;
  }
  staged();
  if (trial.ends_with_barrier()) rounds.barrier_round(desc, d);
}

}  // namespace tdist::comm::shm::algo
