// The choice between the single-copy and the staging path by timing both
// (crossover.h): which ops of a size bucket are timed and on which path,
// the choice that follows the best times, its revision once both paths
// are warm, buckets per op kind and size, and CrossoverTrial's timing of
// an op that returns or throws.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <thread>

#include "comm/shm/crossover.h"

using tdist::comm::shm::Crossover;
using tdist::comm::shm::CrossoverTrial;
using Op = Crossover::Op;

namespace {

constexpr size_t kMiB = 1 << 20;

// Runs `ops` ops of a bucket, each taking the path offered and lasting
// time(k, single_copy) when timed. Returns the paths, one letter per op:
// 'C'/'S' timed single-copy/staged, 'c'/'s' untimed.
template <typename Time>
std::string run_ops(Crossover& c, Op op, size_t bytes, int ops, Time time) {
  std::string paths;
  for (int k = 0; k < ops; ++k) {
    const Crossover::Plan p = c.next(op, bytes);
    paths += p.timed ? (p.single_copy ? 'C' : 'S') : (p.single_copy ? 'c' : 's');
    if (p.timed) c.record(op, bytes, p.single_copy, time(k, p.single_copy));
  }
  return paths;
}

TEST(Crossover, TheFirstOpsAlternatePathsAndLaterOnesTakeTheFaster) {
  Crossover c;
  EXPECT_TRUE(c.prefers_single_copy(Op::kAllReduce, kMiB)) << "before any time";
  const std::string fast_single =
      run_ops(c, Op::kAllReduce, kMiB, 20, [](int, bool single) { return single ? 1e-4 : 2e-4; });
  // Two untimed warm-up ops, blocks of two staged and two single-copy ops
  // (the second of each timed) at 2 and 6, the chosen path, a block at 16.
  EXPECT_EQ(fast_single, "ccsScCsScCccccccsScC");
  EXPECT_TRUE(c.prefers_single_copy(Op::kAllReduce, kMiB));

  Crossover s;
  const std::string fast_staged =
      run_ops(s, Op::kAllGather, kMiB, 20, [](int, bool single) { return single ? 2e-4 : 1e-4; });
  EXPECT_EQ(fast_staged, "ccsScCsScCsssssssScC");
  EXPECT_FALSE(s.prefers_single_copy(Op::kAllGather, kMiB));
}

TEST(Crossover, BlocksStartAtPowersOfTwoForever) {
  Crossover c;
  std::string paths = run_ops(c, Op::kReduceScatter, kMiB, 1100, [](int, bool single) { return single ? 1.0 : 2.0; });
  std::string timed_at;
  for (size_t k = 10; k < paths.size(); ++k) {
    if (paths[k] == 'S' || paths[k] == 'C') timed_at += std::to_string(k) + " ";
  }
  EXPECT_EQ(timed_at, "17 19 33 35 65 67 129 131 257 259 513 515 1025 1027 ");
}

TEST(Crossover, AChoiceMadeOnColdOpsIsRevisedWhenBothPathsAreWarm) {
  // The first ops are slow on either path (fresh buffers), single-copy's
  // more so; warm, single-copy is twice as fast.
  Crossover c;
  auto time = [](int k, bool single) {
    const double warm = single ? 1.0 : 2.0;
    return k < 10 ? warm * (single ? 40 : 10) : warm;
  };
  run_ops(c, Op::kAllGather, 64 << 10, 10, time);
  EXPECT_FALSE(c.prefers_single_copy(Op::kAllGather, 64 << 10)) << "cold: staged looked faster";
  // Op 17 times staging warm (2.0), op 19 single-copy warm (1.0).
  run_ops(c, Op::kAllGather, 64 << 10, 10, [&](int k, bool single) { return time(k + 10, single); });
  EXPECT_TRUE(c.prefers_single_copy(Op::kAllGather, 64 << 10));
}

TEST(Crossover, TheBestTimeOfEachPathDecidesNotTheLast) {
  Crossover b;
  const size_t bytes = 8 * kMiB;
  // Op 3 staged 3.0, op 5 single-copy 4.0, op 7 staged 50.0, op 9
  // single-copy 4.0: staged's best is lower.
  auto time = [](int k, bool) { return k == 3 ? 3.0 : k == 7 ? 50.0 : 4.0; };
  run_ops(b, Op::kAllReduce, bytes, 10, time);
  EXPECT_FALSE(b.prefers_single_copy(Op::kAllReduce, bytes));
}

TEST(Crossover, BucketsArePerOpKindAndPowerOfTwoSize) {
  Crossover c;
  run_ops(c, Op::kAllReduce, kMiB, 10, [](int, bool single) { return single ? 2.0 : 1.0; });
  EXPECT_FALSE(c.prefers_single_copy(Op::kAllReduce, kMiB + 12345)) << "the same power-of-two bucket";
  EXPECT_FALSE(c.prefers_single_copy(Op::kAllReduce, 2 * kMiB - 1));
  EXPECT_TRUE(c.prefers_single_copy(Op::kAllReduce, 2 * kMiB));
  EXPECT_TRUE(c.prefers_single_copy(Op::kAllReduce, kMiB - 1));
  EXPECT_TRUE(c.prefers_single_copy(Op::kAllGather, kMiB));
  EXPECT_TRUE(c.prefers_single_copy(Op::kReduceScatter, kMiB));
  EXPECT_EQ(c.next(Op::kAllReduce, 2 * kMiB).timed, false) << "a fresh bucket starts with its warm-up ops";
  // The largest sizes have a bucket too.
  run_ops(c, Op::kAllGather, size_t(1) << 63, 10, [](int, bool single) { return single ? 2.0 : 1.0; });
  EXPECT_FALSE(c.prefers_single_copy(Op::kAllGather, ~size_t(0)));
}

TEST(Crossover, ABucketWhereSingleCopyNeverRanStages) {
  // The peers did not all offer: every op staged, whatever was offered.
  Crossover c;
  for (int k = 0; k < 20; ++k) {
    if (c.next(Op::kAllReduce, kMiB).timed) c.record(Op::kAllReduce, kMiB, false, 1e-4);
  }
  EXPECT_FALSE(c.prefers_single_copy(Op::kAllReduce, kMiB));
}

TEST(Crossover, AFollowerOffersWhatTheLeaderWillExceptRightAfterItsChoiceChanged) {
  // The leader (rank 0) finds staging faster from its first block, then
  // single-copy faster from the block at 16 on; the follower learns the
  // leader's offer from each op outside a block.
  Crossover leader, follower(/*decides=*/false);
  std::string missed;
  for (int k = 0; k < 40; ++k) {
    const Crossover::Plan l = leader.next(Op::kAllGather, kMiB);
    const Crossover::Plan f = follower.next(Op::kAllGather, kMiB);
    EXPECT_FALSE(f.timed) << "a follower times nothing";
    EXPECT_EQ(f.in_block, l.in_block) << "op " << k;
    if (f.single_copy != l.single_copy) missed += std::to_string(k) + " ";
    if (!f.in_block) follower.follow(Op::kAllGather, kMiB, l.single_copy);
    const double fast = k < 16 ? 1.0 : 0.5;  // staged before op 16, single-copy from it
    if (l.timed) leader.record(Op::kAllGather, kMiB, l.single_copy, l.single_copy == (k >= 16) ? fast : 2.0);
  }
  // Op 10: the first after the leader chose staging; op 20: the first
  // after it chose single-copy.
  EXPECT_EQ(missed, "10 20 ");
}

TEST(CrossoverTrial, OffersAsPlannedAndRecordsTheTimeOfAnOpThatReturned) {
  Crossover c;
  for (int k = 0; k < 10; ++k) {
    CrossoverTrial t(&c, Op::kAllGather, kMiB, /*may_offer=*/true);
    if (k >= 2) {
      EXPECT_EQ(t.offers(), (k >= 4 && k < 6) || k >= 8) << "op " << k << " of two blocks";
    }
    t.agreed(false, t.offers(), t.offers(), t.timed());
    if (!t.offers()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(c.prefers_single_copy(Op::kAllGather, kMiB)) << "the staged ops slept 10 ms";

  // An op that throws is not recorded; one in place over symmetric memory
  // is not timed.
  Crossover e;
  for (int k = 0; k < 3; ++k) CrossoverTrial(&e, Op::kAllReduce, kMiB, true);
  try {
    CrossoverTrial t(&e, Op::kAllReduce, kMiB, true);
    EXPECT_FALSE(t.offers());
    t.agreed(false, false, false, t.timed());
    throw std::runtime_error("peer died");
  } catch (const std::runtime_error&) {
  }
  {
    CrossoverTrial t(&e, Op::kAllReduce, kMiB, true);
    t.agreed(/*symmetric=*/true, false, false, t.timed());
  }
  EXPECT_TRUE(e.prefers_single_copy(Op::kAllReduce, kMiB)) << "no staged time was recorded";
}

TEST(CrossoverTrial, AnOpThisRankCannotGiveSingleCopyStillCountsInItsBucket) {
  // E.g. an all_reduce of several pieces on this rank: it offers nothing
  // and is not timed, but keeps the bucket's count in step with the
  // ranks that could.
  Crossover c;
  for (int k = 0; k < 6; ++k) {
    CrossoverTrial t(&c, Op::kAllReduce, kMiB, /*may_offer=*/true, /*eligible=*/k != 5);
    EXPECT_FALSE(k == 5 && t.offers()) << "op 5 would try single-copy, but this rank cannot";
    t.agreed(false, false, false, t.timed());
  }
  const Crossover::Plan p = c.next(Op::kAllReduce, kMiB);
  EXPECT_TRUE(p.in_block && !p.single_copy && !p.timed) << "op 6 starts the second block";
  EXPECT_FALSE(c.prefers_single_copy(Op::kAllReduce, kMiB)) << "only op 3's staged time was recorded";
}

TEST(CrossoverTrial, ARankThatDoesNotDecideOffersWheneverItMay) {
  Crossover c;
  EXPECT_TRUE(CrossoverTrial(nullptr, Op::kAllReduce, kMiB, true).offers());
  EXPECT_FALSE(CrossoverTrial(nullptr, Op::kAllReduce, kMiB, false).offers());
  // Nor does a deciding rank offer an op it may not, and such an op does
  // not count as one of the bucket's.
  for (int k = 0; k < 4; ++k) EXPECT_FALSE(CrossoverTrial(&c, Op::kAllReduce, kMiB, false).offers());
  EXPECT_FALSE(c.next(Op::kAllReduce, kMiB).timed) << "still the bucket's first op";
}

}  // namespace
