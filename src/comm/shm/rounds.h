// The round protocol: how the ranks take turns with the staging buffers of
// the group segment. Every shm collective is a sequence of rounds.
//
// In a round each rank writes its own staging buffer of parity (g % 2),
// where g counts the barriers it has passed, then arrives at barrier g+1;
// after the barrier it may read every rank's buffer of that parity until it
// arrives at barrier g+2. A rank only rewrites a buffer after barrier g+2,
// by which time everyone has finished reading it. This rule holds across op
// boundaries, so ops need no closing barrier.
//
// Eager rounds: a small broadcast's root arrives at its barrier and goes on
// without waiting (arrive()); the others wait for the root alone
// (wait_for()). A rank may so pass barrier g+1 while others have not yet
// arrived at it, and its next op would rewrite buffers of parity g%2 that
// they may still read. Hence the rule: before an op's first write
// (begin_op -> reserve) a rank makes sure every rank has arrived at the
// barrier it last passed; after a real barrier that is known, and
// reserve costs nothing. A rank arrives at a barrier only after it has
// read what it reads of the round before, so the reserved buffers are
// free. The first round of every op
// carries the op's descriptor (and, for all_reduce, the key of its
// symmetric buffers), which every rank compares after the first barrier:
// ranks that called different collectives, dtypes, sizes or roots all raise
// CollectiveMismatchError. An eager root compares nothing: each desc
// carries a hash of the rank's earlier descs (OpDesc::history), so a
// mismatch at an eager op (two ranks each the root) is raised at the next
// op that compares, one op later.
//
// Where a round goes: rank r arrives at barrier b by storing b in its
// slot's line of parity (b - 1) % 2 (segment.h), after the descriptor in
// that line and the round's data. A round whose data fits the line's box
// (kBoxBytes, 32) carries it there (mine(bytes)), so that a peer waiting
// at the barrier gets barrier, descriptor and data in one cache-line
// transfer; larger data goes in the staging buffer of that parity. No rank
// gets two barriers ahead of another (a rank arrives at b + 2 only after
// everyone arrived at b + 1), so the line a waiter for b reads holds b or
// b - 2, never b + 2.
//
// Contract:
// - One Rounds per rank and segment, used by one thread at a time (the
//   backend's collective thread); it is not thread-safe.
// - barrier_round and first_barrier block through the Waiter (waiter.h):
//   they return when every rank has arrived, or abort the group and raise
//   (TimeoutError past the deadline, PeerFailureError, the first abort's
//   error; first_barrier also CollectiveMismatchError).
// - mine() is the buffer this rank fills in the current round; right after
//   a barrier that is already the next round's buffer, free to write.
//   theirs(r) is rank r's buffer from the round that just completed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "comm/backend.h"
#include "comm/shm/segment.h"
#include "comm/shm/waiter.h"

namespace tdist::comm::shm {

class Rounds {
 public:
  Rounds(const GroupSegment& segment, Waiter& waiter);

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t round_bytes() const { return seg_.round_bytes(); }
  Waiter& waiter() const { return waiter_; }

  // The descriptor of the next op, which takes the next sequence number.
  OpDesc make_desc(OpKind k, DataType t, ReduceOp op, int root, size_t count);
  // make_desc, then reserve: what every op does before its first write.
  OpDesc begin_op(OpKind k, DataType t, ReduceOp op, int root, size_t count, Deadline deadline) {
    OpDesc desc = make_desc(k, t, op, root, count);
    reserve(desc, deadline);
    return desc;
  }
  // Waits until every rank has arrived at the barrier this rank last
  // passed (see "Eager rounds"); at once after a real barrier.
  void reserve(const OpDesc& desc, Deadline deadline);
  // An eager round: publishes desc with what this rank wrote to mine()
  // and arrives at the next barrier without waiting for anyone.
  void arrive(const OpDesc& desc);
  // After arrive(): waits until rank r has arrived at that barrier too and
  // checks r's desc against ours; theirs(r) then reads r's round.
  void wait_for(int r, const OpDesc& desc, Deadline deadline);
  // The sequence number make_desc gives next.
  uint32_t next_seq() const { return seq_; }

  uint8_t* mine() const { return seg_.staging(rank_, g_ % 2); }
  const uint8_t* theirs(int r) const { return seg_.staging(r, (g_ - 1) % 2); }
  // The same for a round that carries `bytes` from each rank (every rank
  // must pass the same): the line's box when they fit it, else the staging
  // buffer.
  static bool fits_box(size_t bytes) { return bytes <= kBoxBytes; }
  uint8_t* mine(size_t bytes) const {
    return fits_box(bytes) ? seg_.slot(rank_)->line[g_ % 2].box : mine();
  }
  const uint8_t* theirs(int r, size_t bytes) const {
    return fits_box(bytes) ? seg_.slot(r)->line[(g_ - 1) % 2].box : theirs(r);
  }

  // Arrives at barrier g+1 and waits for everyone; afterwards theirs(r)
  // reads the buffers of the round just finished.
  void barrier_round(const OpDesc& desc, Deadline deadline);
  // The first barrier of an op: publishes desc with the round's data and
  // checks every rank's desc against ours afterwards.
  void first_barrier(const OpDesc& desc, Deadline deadline);
  // Round j's barrier of an op: first_barrier for j == 0, else barrier_round.
  void barrier(size_t j, const OpDesc& desc, Deadline deadline) {
    if (j == 0) first_barrier(desc, deadline); else barrier_round(desc, deadline);
  }
  // The staged rounds of an op whose round 0 is posted and past its first
  // barrier: round j (of count_for(total, per_round)) carries units
  // [off, off + len) of `total` at `per_round` a round; for j > 0 post(j)
  // writes it and a barrier passes, then take(off, len) reads it.
  template <typename Post, typename Take>
  void staged_rounds(size_t per_round, size_t total, const OpDesc& desc, Deadline deadline, Post&& post, Take&& take) {
    const size_t n_rounds = count_for(total, per_round);
    for (size_t j = 0; j < n_rounds; ++j) {
      const size_t off = j * per_round, len = std::min(per_round, total - std::min(total, off));
      if (j > 0) {
        post(j);
        barrier_round(desc, deadline);
      }
      take(off, len);
    }
  }
  // How many rounds carry `total` units at `per_round` a round: at least
  // one, so that even an empty op meets the others and checks its desc.
  static size_t count_for(size_t total, size_t per_round) {
    return total == 0 ? 1 : (total + per_round - 1) / per_round;
  }

  // Rank r's descriptor of the round that just completed (its flags say
  // what else it published with it: path.cpp).
  const OpDesc& desc_of(int r) const { return seg_.slot(r)->line[(g_ - 1) % 2].desc; }
  // Where this rank publishes the symmetric key that goes with the
  // descriptor of the op's first round (written before first_barrier), and
  // rank r's key as published for the round that just completed.
  uint64_t* sym_key_slot() const { return seg_.slot(rank_)->sym_key[g_ % 2]; }
  const uint64_t* sym_key_of(int r) const { return seg_.slot(r)->sym_key[(g_ - 1) % 2]; }
  // The same for the single-copy offer (cma.h).
  CmaOffer* cma_slot() const { return &seg_.slot(rank_)->cma[g_ % 2]; }
  const CmaOffer& cma_of(int r) const { return seg_.slot(r)->cma[(g_ - 1) % 2]; }
  // Rank r's pid, as it recorded it when it attached.
  int pid_of(int r) const { return seg_.slot(r)->pid.load(); }

 private:
  const GroupSegment& seg_;
  Waiter& waiter_;
  int rank_;
  int size_;
  // Whether rank r has arrived at barrier `target` (>= 1; it is never two
  // ahead, see "Where a round goes"). seq_cst: see Waiter::notify.
  bool arrived(int r, uint64_t target) const { return seg_.slot(r)->line[(target - 1) % 2].round.load() >= target; }
  // Waits until every rank has arrived at barrier `target`; `note` is
  // added to the op's name in a timeout's message.
  void wait_all(uint64_t target, const OpDesc& desc, Deadline deadline, const char* note);
  // Publishes desc (and the op before it) for the round of barrier g_+1.
  void publish(const OpDesc& desc);
  // Raises CollectiveMismatchError unless rank r's desc of the round just
  // passed is ours; `all`: every rank has arrived (show them all).
  void check_desc(int r, const OpDesc& desc, bool all);

  uint64_t g_ = 0;    // barriers passed (or, eagerly, arrived at) by this rank
  uint64_t settled_ = 0;  // every rank is known to have arrived at barrier settled_
  uint32_t seq_ = 0;  // collectives started by this rank
  uint32_t history_ = 0;  // OpDesc::history of the next op
  OpDesc prev_;  // the desc of this rank's last op
};

}  // namespace tdist::comm::shm
