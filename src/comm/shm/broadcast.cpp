// broadcast: root posts a round_bytes chunk per round, the others copy it
// out after the barrier; one round is eager (rounds.h). A broadcast of at
// least kAgreeBytes in a group with single-copy (cma.h) agrees on its path
// first, as all_gather does: single-copy, every other rank reads the
// root's buffer straight into its own, then one barrier frees the root's
// buffer; staged, the rounds as above, none eager. The threshold is a
// constant, not TDIST_SHM_CMA_BYTES: the ranks must take the same
// protocol even where that setting differs between them (a rank that
// does not offer single-copy makes the op staged, never a mismatch). A
// group that found single-copy refused (the same answer on every rank)
// stays eager.
#include <algorithm>

#include "comm/shm/algorithms.h"
#include "comm/shm/path.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

void broadcast(Rounds& rounds, void* buf, size_t bytes, int root, const OpDesc& desc, Deadline d, CmaChannel* cma) {
  const size_t chunk = rounds.round_bytes();
  const size_t n_rounds = Rounds::count_for(bytes, chunk);
  auto* p = static_cast<uint8_t*>(buf);
  const bool is_root = rounds.rank() == root;
  const bool agree_first = cma != nullptr && !cma->refused() && bytes >= kAgreeBytes;  // the same on every rank
  if (n_rounds == 1 && !agree_first) {
    if (is_root) {
      detail::copy_bytes(rounds.mine(bytes), p, bytes);
      rounds.arrive(desc);
    } else {
      rounds.arrive(desc);
      rounds.wait_for(root, desc, d);
      detail::copy_bytes(p, rounds.theirs(root, bytes), bytes);
    }
    return;
  }
  auto post = [&](size_t j) {
    const size_t off = j * chunk, len = std::min(chunk, bytes - std::min(bytes, off));
    if (is_root) detail::copy_bytes(rounds.mine(), p + off, len);
  };
  // Round 0 posted and its barrier passed: each round copied out, the
  // next posted and passed.
  auto staged = [&] {
    rounds.staged_rounds(chunk, bytes, desc, d, post, [&](size_t off, size_t len) {
      if (!is_root) detail::copy_bytes(p + off, rounds.theirs(root), len);
    });
  };
  if (!agree_first) {
    post(0);
    rounds.first_barrier(desc, d);
    staged();
    return;
  }
  CrossoverTrial trial = CmaChannel::trial(cma, Crossover::Op::kBroadcast, bytes);
  const PathOffer offer{nullptr, cma, trial.offers(), buf, buf, &trial};
  if (agree_on_path(rounds, offer, desc, d, [&] { post(0); }) == Path::kSingleCopy) {
    cma_broadcast(rounds, *cma, buf, bytes, root, desc, d);
    return;
  }
  staged();
  if (trial.ends_with_barrier()) rounds.barrier_round(desc, d);
}

}  // namespace tdist::comm::shm::algo
