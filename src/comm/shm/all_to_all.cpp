// all_to_all: round 0 swaps every rank's send and receive sizes (and checks
// that they agree); then per round each rank posts the next piece for each
// receiver and copies out the pieces meant for it.
#include <algorithm>
#include <string>

#include "comm/op_label.h"
#include "comm/shm/algorithms.h"
#include "util/bytes.h"

namespace tdist::comm::shm::algo {

void all_to_all(Rounds& rounds, const void* in, const std::vector<size_t>& send_bytes,
                const std::vector<size_t>& send_offsets, void* out, const std::vector<size_t>& recv_bytes,
                const std::vector<size_t>& recv_offsets, const OpDesc& desc, Deadline d) {
  const int n = rounds.size();
  Waiter& waiter = rounds.waiter();
  // Round 0: everyone posts its send and receive sizes.
  auto* meta = reinterpret_cast<uint64_t*>(rounds.mine());
  if (2 * n * sizeof(uint64_t) > rounds.round_bytes()) throw UsageError("shm all_to_all: group too large for its buffer");
  for (int r = 0; r < n; ++r) {
    meta[r] = send_bytes[r];
    meta[n + r] = recv_bytes[r];
  }
  rounds.first_barrier(desc, d);
  size_t longest = 0;
  std::string mismatch;
  for (int s = 0; s < n; ++s) {
    const auto* m = reinterpret_cast<const uint64_t*>(rounds.theirs(s));
    for (int r = 0; r < n; ++r) {
      const uint64_t sends = m[r];
      const uint64_t receives = reinterpret_cast<const uint64_t*>(rounds.theirs(r))[n + s];
      if (sends != receives && mismatch.empty()) {
        mismatch = "rank " + std::to_string(waiter.global(s)) + " sends " + std::to_string(sends) + " bytes to rank " +
                   std::to_string(waiter.global(r)) + ", which expects " + std::to_string(receives);
      }
      longest = std::max<size_t>(longest, sends);
    }
  }
  if (!mismatch.empty()) {
    waiter.fail(AbortKind::kMismatch, -1, "all_to_all #" + std::to_string(op_label_or(desc.seq + 1)) + ": " + mismatch);
  }
  const size_t piece = std::max<size_t>(1, rounds.round_bytes() / n / kAlign * kAlign);
  const size_t n_rounds = (longest + piece - 1) / piece;
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  for (size_t j = 0; j < n_rounds; ++j) {
    const size_t off = j * piece;
    for (int r = 0; r < n; ++r) {
      if (off < send_bytes[r]) detail::copy_bytes(rounds.mine() + r * piece, src + send_offsets[r] + off, std::min(piece, send_bytes[r] - off));
    }
    rounds.barrier_round(desc, d);
    for (int s = 0; s < n; ++s) {
      if (off < recv_bytes[s]) detail::copy_bytes(dst + recv_offsets[s] + off, rounds.theirs(s) + rounds.rank() * piece, std::min(piece, recv_bytes[s] - off));
    }
  }
}

}  // namespace tdist::comm::shm::algo
