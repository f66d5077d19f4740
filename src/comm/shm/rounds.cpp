// Rounds: the barrier arithmetic and the descriptor check of an op's
// first round. The contract is in rounds.h.
#include "comm/shm/rounds.h"

#include <string>
#include <vector>

namespace tdist::comm::shm {

Rounds::Rounds(const GroupSegment& segment, Waiter& waiter)
    : seg_(segment), waiter_(waiter), rank_(waiter.rank()), size_(segment.size()) {}

OpDesc Rounds::make_desc(OpKind k, DataType t, ReduceOp op, int root, size_t count) {
  OpDesc d;
  d.kind = static_cast<uint8_t>(k);
  d.dtype = static_cast<uint8_t>(t);
  d.reduce_op = static_cast<uint8_t>(op);
  d.root = root;
  d.count = count;
  d.seq = seq_++;
  return d;
}

void Rounds::barrier_round(const OpDesc& desc, Deadline deadline) {
  waiter_.check_alive_state();
  const uint64_t target = g_ + 1;
  seg_.slot(rank_)->round.store(target);  // seq_cst: see Waiter::notify
  waiter_.notify();
  const int n = size_;
  waiter_.wait_until(
      [&] {
        for (int r = 0; r < n; ++r) {
          if (seg_.slot(r)->round.load() < target) return false;  // seq_cst: see Waiter::notify
        }
        return true;
      },
      [&] {
        std::vector<int> missing;
        for (int r = 0; r < n; ++r) {
          if (seg_.slot(r)->round.load() < target) missing.push_back(r);
        }
        return missing;
      },
      [&] { return describe(desc); }, deadline);
  g_ = target;
}

void Rounds::first_barrier(const OpDesc& desc, Deadline deadline) {
  seg_.slot(rank_)->desc[g_ % 2] = desc;
  barrier_round(desc, deadline);
  const uint64_t parity = (g_ - 1) % 2;
  for (int r = 0; r < size_; ++r) {
    const OpDesc other = seg_.slot(r)->desc[parity];
    if (other != desc) {
      // Each rank's op by its kind and size; the number is this rank's
      // (the group's, op_label.h: other ranks' are not in the segment).
      // Backend steps that differ are shown: a rank ahead or behind.
      std::string all;
      for (int q = 0; q < size_; ++q) {
        const OpDesc& d = seg_.slot(q)->desc[parity];
        all += "\n  rank " + std::to_string(waiter_.global(q)) + ": " + describe_op(d);
        if (d.seq != desc.seq) all += " (its shm step " + std::to_string(d.seq + 1) + ")";
      }
      waiter_.fail(AbortKind::kMismatch, -1,
                   "ranks called different collectives at the same step, this rank's " + describe(desc) + ":" + all);
    }
  }
}

}  // namespace tdist::comm::shm
