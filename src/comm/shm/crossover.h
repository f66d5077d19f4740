// Where the single-copy path beats the staging path, found by timing both
// on this machine.
//
// Single-copy (cma.h) moves each byte once but pays a system call and page
// pinning per transfer; the staging path (rounds.h) copies twice, through
// segment rounds that stay in cache. Which is faster at a size is the
// machine's: on a 2-vCPU AMD VM a staged all_reduce beat single-copy up to
// 16 MiB and lost by 1.75x at 64 MiB, while all_gather and reduce_scatter
// went faster single-copy from 256 KiB; on an Intel Xeon VM all three
// were faster single-copy from 16 KiB (staged below). A constant threshold
// is wrong somewhere, so a group measures: per op kind and power-of-two
// bucket of sizes (from ShmOptions::cma_bytes up, and no lower than where
// an op starts to agree on its path: path.h), some of the bucket's ops
// are timed, and its other ops take the path whose best time is lower.
// The first two ops go single-copy untimed (they pay the group's probe and
// the first page faults); then come blocks of four ops: two staged, two
// single-copy, the second of each timed (the first may pay the other
// path's tail, as the staged path's last rank copies out after the final
// barrier). A bucket's first ops on fresh buffers can be several times
// slower than its later ones, and one op's time is noisy, so blocks start
// at ops 2 and 6 and then at 16, 32, 64, ... for as long as the bucket is
// used: a choice made on cold ops is revisited once both paths are warm,
// at a cost that shrinks as 1/ops. A path's best time never ages: a
// choice changes only toward a path that beat the other's best. The timed
// ops are the user's own, done by either correct path; both paths reduce
// in rank order, so the results are the same bits either way.
//
// Rank 0 alone times and decides: an op goes single-copy only when every
// rank offers (path.h). The others follow: they offer what rank 0 will
// (its blocks fall on the same ops of a bucket on every rank, and between
// blocks it offers what it offered at the bucket's last op outside one,
// which every rank read with that op's descriptor), so a staged op pays no
// extra round for offers made in vain; a wrong guess (right after rank 0
// changed its choice) costs one round and may stage that op, never a
// wrong path. The ranks must agree on TDIST_SHM_CMA_BYTES and
// TDIST_SHM_CMA_CALIBRATE: where they differ, the ranks count a bucket's
// ops or place its blocks differently, and the guesses, and with them
// rank 0's timings, go wrong for good (still on a correct path).
//
// Rank 0 times an op from before its first barrier to its end, which for
// a timed staged op is one more barrier (rank 0's descriptor tells the
// others): both paths' times include the slowest rank, the others' late
// arrival too, and an op that follows another bucket's staged op may pay
// that op's tail.
//
// Contract: one per backend, used by its collective thread only; not
// thread-safe. LibTorch-free.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace tdist::comm::shm {

class Crossover {
 public:
  enum class Op : uint8_t { kAllReduce, kReduceScatter, kAllGather, kBroadcast };

  // decides: this rank times and chooses (rank 0); else it follows.
  explicit Crossover(bool decides = true) : decides_(decides) {}

  // For the next op of `bytes` (its largest buffer) that may go
  // single-copy: whether this rank offers single-copy, whether the op's
  // time is wanted, and whether it is in a timing block.
  struct Plan {
    bool single_copy;
    bool timed;
    bool in_block;
  };
  Plan next(Op op, size_t bytes);

  // A timed op's path and time.
  void record(Op op, size_t bytes, bool single_copy, double seconds);
  // A follower's op outside a block: what rank 0 offered.
  void follow(Op op, size_t bytes, bool leader_offered) {
    if (!decides_) bucket(op, bytes).leader_single_copy = leader_offered;
  }

  // The path the bucket's untimed ops take now (single-copy until both
  // paths were timed).
  bool prefers_single_copy(Op op, size_t bytes) const { return bucket(op, bytes).single_copy; }

 private:
  struct Bucket {
    uint64_t ops = 0;  // ops planned so far
    bool single_copy = true;
    bool leader_single_copy = true;      // a follower's guess of rank 0's choice
    std::array<double, 2> best{-1, -1};  // [staged, single-copy]; < 0: none yet
  };
  Bucket& bucket(Op op, size_t bytes);
  const Bucket& bucket(Op op, size_t bytes) const;

  bool decides_;
  std::array<std::array<Bucket, 64>, 4> buckets_{};
};

// One op's offer: made before the op's path is agreed, told what was
// agreed (agree_on_path), and on leaving, when the op was timed and
// returned normally, records its time.
class CrossoverTrial {
 public:
  CrossoverTrial() = default;
  // may_offer: the op is large enough for single-copy and the group may
  // use it (the same on every rank; only such ops count in a bucket).
  // eligible: this rank's buffers can go single-copy (one contiguous
  // piece); an op that is not still counts, offers nothing, is not timed.
  // c null: no calibration, the rank offers whenever it may.
  CrossoverTrial(Crossover* c, Crossover::Op op, size_t bytes, bool may_offer, bool eligible = true);
  ~CrossoverTrial();
  CrossoverTrial(const CrossoverTrial&) = delete;
  CrossoverTrial& operator=(const CrossoverTrial&) = delete;

  bool offers() const { return offers_; }
  // Whether this rank times the op (rank 0 says so with its descriptor).
  bool timed() const { return timed_; }
  // What the group agreed on: in place over symmetric memory (not timed),
  // single-copy or staged; whether rank 0 offered single-copy and whether
  // it times the op.
  void agreed(bool symmetric, bool single_copy, bool leader_offered, bool leader_timed);
  // Whether the op, staged, ends with one more barrier (on every rank):
  // rank 0 times it. A staged op otherwise ends on each rank as its own
  // part does, a single-copy one with a barrier, so without it rank 0's
  // time of a staged op would leave out the slowest rank's last part (on
  // oversubscribed cores, most of the op) and favour staging.
  bool ends_with_barrier() const { return closing_barrier_; }

 private:
  Crossover* crossover_ = nullptr;
  bool timed_ = false;
  bool closing_barrier_ = false;
  bool in_block_ = false;
  Crossover::Op op_ = Crossover::Op::kAllReduce;
  size_t bytes_ = 0;
  bool offers_ = false;
  bool single_copy_ = false;
  int exceptions_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace tdist::comm::shm
