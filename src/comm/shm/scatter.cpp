// scatter: per round root posts one piece for each rank (round_bytes split
// size() ways, in whole cache lines); each rank copies out its own.
#include <algorithm>

#include "comm/shm/algorithms.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

void scatter(Rounds& rounds, const void* in, void* out, size_t bytes, int root, const OpDesc& desc, Deadline d) {
  const size_t piece = std::max<size_t>(1, rounds.round_bytes() / rounds.size() / kAlign * kAlign);
  const size_t n_rounds = Rounds::count_for(bytes, piece);
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  for (size_t j = 0; j < n_rounds; ++j) {
    const size_t off = j * piece, len = std::min(piece, bytes - std::min(bytes, off));
    if (rounds.rank() == root) {
      for (int r = 0; r < rounds.size(); ++r) detail::copy_bytes(rounds.mine() + r * piece, src + r * bytes + off, len);
    }
    rounds.barrier(j, desc, d);
    detail::copy_bytes(dst + off, rounds.theirs(root) + rounds.rank() * piece, len);
  }
}

}  // namespace tdist::comm::shm::algo
