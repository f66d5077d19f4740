// Rounds: the barrier arithmetic and the descriptor check of an op's
// first round. The contract is in rounds.h.
#include "comm/shm/rounds.h"

#include <string>
#include <vector>

namespace tdist::comm::shm {

namespace {

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

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
  d.history = history_;
  // The fields that say what the op is, in two words, each mixed in whole
  // (splitmix64's finalizer): four multiplies, where hashing them a byte
  // at a time (FNV-1a, segment version 6) took 40 dependent ones, ~20 ns
  // of every small op.
  const uint64_t what = uint64_t{d.kind} | uint64_t{d.dtype} << 8 | uint64_t{d.reduce_op} << 16 |
                        uint64_t{static_cast<uint32_t>(root)} << 32;
  uint64_t h = mix(mix(history_ ^ what) ^ count);
  history_ = static_cast<uint32_t>(h ^ (h >> 32));
  return d;
}

void Rounds::reserve(const OpDesc& desc, Deadline deadline) {
  if (settled_ >= g_) return;
  wait_all(g_, desc, deadline, " (waiting for the ranks still in the op before it)");
  settled_ = g_;
}

void Rounds::wait_all(uint64_t target, const OpDesc& desc, Deadline deadline, const char* note) {
  const int n = size_;
  waiter_.wait_until(
      [&] {
        for (int r = 0; r < n; ++r) {
          if (!arrived(r, target)) return false;
        }
        return true;
      },
      [&] {
        std::vector<int> missing;
        for (int r = 0; r < n; ++r) {
          if (!arrived(r, target)) missing.push_back(r);
        }
        return missing;
      },
      [&] { return describe(desc) + note; }, deadline);
}

void Rounds::publish(const OpDesc& desc) {
  Slot* mine = seg_.slot(rank_);
  mine->line[g_ % 2].desc = desc;
  mine->prev[g_ % 2] = prev_;
  prev_ = desc;
}

void Rounds::arrive(const OpDesc& desc) {
  waiter_.check_alive_state();
  publish(desc);
  seg_.slot(rank_)->line[g_ % 2].round.store(g_ + 1);  // seq_cst: see Waiter::notify
  waiter_.notify();
  ++g_;
}

void Rounds::wait_for(int r, const OpDesc& desc, Deadline deadline) {
  const uint64_t target = g_;
  waiter_.wait_until([&] { return arrived(r, target); },
                     [&] { return arrived(r, target) ? std::vector<int>{} : std::vector<int>{r}; },
                     [&] { return describe(desc); }, deadline);
  check_desc(r, desc, /*all=*/false);
}

void Rounds::barrier_round(const OpDesc& desc, Deadline deadline) {
  waiter_.check_alive_state();
  const uint64_t target = g_ + 1;
  seg_.slot(rank_)->line[g_ % 2].round.store(target);  // seq_cst: see Waiter::notify
  waiter_.notify();
  wait_all(target, desc, deadline, "");
  g_ = target;
  settled_ = target;
}

void Rounds::first_barrier(const OpDesc& desc, Deadline deadline) {
  publish(desc);
  barrier_round(desc, deadline);
  for (int r = 0; r < size_; ++r) check_desc(r, desc, /*all=*/true);
}

void Rounds::check_desc(int r, const OpDesc& desc, bool all) {
  const uint64_t parity = (g_ - 1) % 2;
  if (seg_.slot(r)->line[parity].desc == desc) return;
  // Each rank's op by its kind and size; the number is this rank's (the
  // group's, op_label.h: other ranks' are not in the segment). Backend
  // steps that differ are shown: a rank ahead or behind. When only the
  // history differs, an earlier op that compared nothing (an eager
  // root's) differed: the ops before this one are shown.
  const bool earlier = seg_.slot(r)->line[parity].desc.same_op(desc);
  std::string shown;
  for (int q = 0; q < size_; ++q) {
    if (!all && q != r && q != rank_) continue;  // the others may not have arrived: their slots are not ours to read
    const Slot* s = seg_.slot(q);
    const OpDesc& d = earlier ? s->prev[parity] : s->line[parity].desc;
    shown += "\n  rank " + std::to_string(waiter_.global(q)) + ": " + describe_op(d);
    if (d.seq != (earlier ? desc.seq - 1 : desc.seq)) shown += " (its shm step " + std::to_string(d.seq + 1ull) + ")";
  }
  waiter_.fail(AbortKind::kMismatch, -1,
               earlier ? "ranks called different collectives before this rank's " + describe(desc) +
                             " (an op that compares nothing, e.g. a small broadcast's root, is checked at the next)" +
                             "; the ops before it:" + shown
                       : "ranks called different collectives at the same step, this rank's " + describe(desc) + ":" +
                             shown);
}

}  // namespace tdist::comm::shm
