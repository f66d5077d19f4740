// broadcast: root posts a round_bytes chunk per round, the others copy it
// out after the barrier; one round is eager (rounds.h).
#include <algorithm>

#include "comm/shm/algorithms.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

void broadcast(Rounds& rounds, void* buf, size_t bytes, int root, const OpDesc& desc, Deadline d) {
  const size_t chunk = rounds.round_bytes();
  const size_t n_rounds = Rounds::count_for(bytes, chunk);
  auto* p = static_cast<uint8_t*>(buf);
  if (n_rounds == 1) {
    if (rounds.rank() == root) {
      detail::copy_bytes(rounds.mine(bytes), p, bytes);
      rounds.arrive(desc);
    } else {
      rounds.arrive(desc);
      rounds.wait_for(root, desc, d);
      detail::copy_bytes(p, rounds.theirs(root, bytes), bytes);
    }
    return;
  }
  for (size_t j = 0; j < n_rounds; ++j) {
    const size_t off = j * chunk, len = std::min(chunk, bytes - std::min(bytes, off));
    if (rounds.rank() == root) detail::copy_bytes(rounds.mine(), p + off, len);
    rounds.barrier(j, desc, d);
    if (rounds.rank() != root) detail::copy_bytes(p + off, rounds.theirs(root), len);
  }
}

}  // namespace tdist::comm::shm::algo
