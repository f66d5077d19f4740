// Single-copy collectives (cma.h, cma_collectives.cpp, broadcast.cpp) and the agreement on
// an op's path (path.h), with ranks as threads: process_vm_readv/writev on
// the process's own pid move bytes as they do between processes. Results
// against sums computed here, for every dtype width, uneven shares and
// 1-4 ranks; ranks that do not all offer, or cannot all reach each other,
// take the staging path together; a failed transfer names the peer.
#include <gtest/gtest.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/shm/algorithms.h"
#include "comm/shm/cma.h"
#include "comm/shm/path.h"
#include "tdist/errors.h"
#include "tests/comm/shm/threads.h"
#include "tests/util/process.h"
#include "tests/util/seccomp.h"

using namespace tdist::comm;
using namespace tdist::comm::shm;
using namespace tdist::test::shm;

namespace {

// The value rank r holds at element i: small integers, so that sums are
// exact in every type and the expected result is easy to state.
template <typename T>
T value(int r, size_t i) {
  return static_cast<T>((i * 7 + static_cast<size_t>(r) * 3) % 11);
}

template <typename T>
void all_three_ops(int size, size_t count, DataType t) {
  GroupOptions o;
  o.size = size;
  auto errors = run_group(o, [&](Member& m) {
    Rounds& rounds = m.rounds;
    CmaChannel cma(1);  // every op offers
    const int me = rounds.rank(), n = rounds.size();
    // all_reduce, in place
    std::vector<T> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = value<T>(me, i);
    OpDesc desc = rounds.make_desc(OpKind::kAllReduce, t, ReduceOp::kSum, -1, count);
    Path path = agree_on_path(rounds, PathOffer{nullptr, &cma, true, buf.data(), buf.data()}, desc, in(10s),
                              [] { FAIL() << "an offering rank posts no round 0"; });
    ASSERT_EQ(path, Path::kSingleCopy);
    algo::cma_all_reduce(rounds, cma, buf.data(), count, t, ReduceOp::kSum, desc, in(10s));
    for (size_t i = 0; i < count; ++i) {
      T want = 0;
      for (int r = 0; r < n; ++r) want += value<T>(r, i);
      ASSERT_EQ(buf[i], want) << "all_reduce element " << i << " of " << count << " on rank " << me;
    }
    // reduce_scatter: n * count in, count out
    std::vector<T> rin(count * n), rout(count, T(99));
    for (size_t i = 0; i < rin.size(); ++i) rin[i] = value<T>(me, i);
    desc = rounds.make_desc(OpKind::kReduceScatter, t, ReduceOp::kSum, -1, count);
    path = agree_on_path(rounds, PathOffer{nullptr, &cma, true, rin.data(), rout.data()}, desc, in(10s), [] {});
    ASSERT_EQ(path, Path::kSingleCopy);
    algo::cma_reduce_scatter(rounds, cma, rin.data(), rout.data(), count, t, ReduceOp::kSum, desc, in(10s));
    for (size_t i = 0; i < count; ++i) {
      T want = 0;
      for (int r = 0; r < n; ++r) want += value<T>(r, me * count + i);
      ASSERT_EQ(rout[i], want) << "reduce_scatter element " << i << " on rank " << me;
    }
    // all_gather: count in, n * count out
    std::vector<T> gin(count), gout(count * n, T(99));
    for (size_t i = 0; i < count; ++i) gin[i] = value<T>(me, i);
    desc = rounds.make_desc(OpKind::kAllGather, DataType::kUInt8, ReduceOp::kSum, -1, count * sizeof(T));
    path = agree_on_path(rounds, PathOffer{nullptr, &cma, true, gin.data(), gout.data()}, desc, in(10s), [] {});
    ASSERT_EQ(path, Path::kSingleCopy);
    algo::cma_all_gather(rounds, cma, gin.data(), gout.data(), count * sizeof(T), desc, in(10s));
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(gout[r * count + i], value<T>(r, i)) << "all_gather slot " << r << " element " << i;
      }
    }
    // broadcast from every root, through its entry point: from 4 KiB it
    // agrees on its path and goes single-copy (two barriers: the first and
    // the one that frees the root's buffer); below, one eager round.
    const size_t bytes = count * sizeof(T);
    for (int root = 0; root < n; ++root) {
      std::vector<T> b(count, T(99));
      if (me == root) b = gin;
      desc = rounds.begin_op(OpKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, root, bytes, in(10s));
      const uint64_t before = m.segment.slot(me)->arrived();
      algo::broadcast(rounds, b.data(), bytes, root, desc, in(10s), &cma);
      if (n > 1) {
        ASSERT_EQ(m.segment.slot(me)->arrived() - before, bytes >= 4096 ? 2u : 1u)
            << "broadcast of " << bytes << " bytes from " << root;
      }
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(b[i], value<T>(root, i)) << "broadcast from " << root << " element " << i << " on rank " << me;
      }
    }
  });
  for (int r = 0; r < size; ++r) EXPECT_EQ(message(errors[r]), "") << "size " << size << ", rank " << r;
}

TEST(ShmCma, AllReduceReduceScatterAllGatherAndBroadcastGiveTheExactResults) {
  // Counts below, at and past one chunk (256 KiB), shares that do not
  // divide evenly, and a share smaller than a cache line.
  for (int size : {1, 2, 3, 4}) {
    for (size_t count : {size_t(1), size_t(7), size_t(1001), size_t(65536), size_t(200'003)}) {
      all_three_ops<float>(size, count, DataType::kFloat32);
      all_three_ops<int64_t>(size, count, DataType::kInt64);
      all_three_ops<uint8_t>(size, count, DataType::kUInt8);
    }
  }
}

TEST(ShmCma, WhereRankZeroTimesBothPathsEveryOpIsExactAsThePathsChange) {
  // Rank 0 decides (crossover.h): a size's ops 2-9 take the staging path
  // and single copy by pairs, then the faster one, with more pairs at 16;
  // the others follow its offers. A staged op after offers made in vain
  // passes one more barrier (everyone posts round 0 again): the followers
  // guess wrong at most right after rank 0's choice changed. A staged op
  // rank 0 times ends with one more barrier.
  for (int size : {2, 3}) {
    GroupOptions o;
    o.size = size;
    auto errors = run_group(o, [&](Member& m) {
      Rounds& rounds = m.rounds;
      const int me = rounds.rank(), n = rounds.size();
      CmaChannel cma(1, me == 0 ? CmaChannel::Role::kDecides : CmaChannel::Role::kFollows);
      const size_t count = 20'003;
      std::vector<uint64_t> gather_barriers, broadcast_barriers;
      for (int k = 0; k < 20; ++k) {
        std::vector<float> buf(count);
        for (size_t i = 0; i < count; ++i) buf[i] = value<float>(me, i + k);
        const std::vector<Piece> pieces{Piece{buf.data(), count}};
        const PieceWalker walk(pieces, sizeof(float));
        OpDesc desc = rounds.make_desc(OpKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, -1, count);
        algo::reduce_scatter_gather(rounds, walk, DataType::kFloat32, DataType::kFloat32, ReduceOp::kSum, desc, -1,
                                    in(10s), nullptr, &cma);
        std::vector<float> rin(count * n), rout(count), gout(count * n);
        for (size_t i = 0; i < rin.size(); ++i) rin[i] = value<float>(me, i + k);
        desc = rounds.make_desc(OpKind::kReduceScatter, DataType::kFloat32, ReduceOp::kSum, -1, count);
        algo::reduce_scatter(rounds, rin.data(), rout.data(), count, DataType::kFloat32, ReduceOp::kSum, desc, in(10s),
                             SymSpan{}, &cma);
        desc = rounds.make_desc(OpKind::kAllGather, DataType::kUInt8, ReduceOp::kSum, -1, count * sizeof(float));
        const uint64_t before = m.segment.slot(me)->arrived();
        algo::gather(rounds, rout.data(), gout.data(), count * sizeof(float), -1, desc, in(10s), SymSpan{}, &cma);
        gather_barriers.push_back(m.segment.slot(me)->arrived() - before);
        // A broadcast from a different root each time, its size's own
        // schedule (Crossover::Op::kBroadcast).
        const int root = k % n;
        std::vector<float> bc(count, -1.0f);
        if (me == root) bc = rout;
        desc = rounds.begin_op(OpKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, root, count * sizeof(float),
                               in(10s));
        const uint64_t bc_before = m.segment.slot(me)->arrived();
        algo::broadcast(rounds, bc.data(), count * sizeof(float), root, desc, in(10s), &cma);
        broadcast_barriers.push_back(m.segment.slot(me)->arrived() - bc_before);
        std::vector<float> want_bc(count);
        for (size_t i = 0; i < count; ++i) {
          for (int r = 0; r < n; ++r) want_bc[i] += value<float>(r, root * count + i + k);
        }
        ASSERT_EQ(bc, want_bc) << "broadcast " << k << " from " << root << " on rank " << me;
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int r = 0; r < n; ++r) want += value<float>(r, i + k);
          ASSERT_EQ(buf[i], want) << "all_reduce " << k << " element " << i << " on rank " << me;
        }
        for (int q = 0; q < n; ++q) {
          for (size_t i = 0; i < count; ++i) {
            float want = 0;
            for (int r = 0; r < n; ++r) want += value<float>(r, q * count + i + k);
            ASSERT_EQ(gout[q * count + i], want) << "reduce_scatter, then all_gather " << k << " slot " << q;
          }
        }
      }
      // A staged all_gather passes one barrier a round (4 KiB rounds here),
      // and one more when rank 0 times it (the second of a block's staged
      // pair) or after offers made in vain; a single-copy one passes two.
      // Ops 0-9 and 16-19 follow the schedule (crossover.h); 10-15 take
      // rank 0's choice, op 10 possibly after a wrong guess.
      const uint64_t s = Rounds::count_for(count * sizeof(float), rounds.round_bytes());
      const std::vector<uint64_t> want{2, 2, s, s + 1, 2, 2, s, s + 1, 2, 2};
      EXPECT_EQ(std::vector<uint64_t>(gather_barriers.begin(), gather_barriers.begin() + 10), want);
      EXPECT_EQ(std::vector<uint64_t>(gather_barriers.begin() + 16, gather_barriers.end()),
                (std::vector<uint64_t>{s, s + 1, 2, 2}));
      for (int k = 10; k < 16; ++k) {
        const uint64_t b = gather_barriers[k];
        EXPECT_TRUE(b == 2 || b == s || (k == 10 && b == s + 1)) << "all_gather " << k << ": " << b << " barriers";
      }
      // A broadcast agrees on its path the same way: the same schedule.
      EXPECT_EQ(std::vector<uint64_t>(broadcast_barriers.begin(), broadcast_barriers.begin() + 10), want);
      EXPECT_EQ(std::vector<uint64_t>(broadcast_barriers.begin() + 16, broadcast_barriers.end()),
                (std::vector<uint64_t>{s, s + 1, 2, 2}));
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(message(errors[r]), "") << "size " << size << ", rank " << r;
  }
}

TEST(ShmCma, AGroupWhereOneRankDoesNotOfferStagesTogether) {
  GroupOptions o;
  o.size = 3;
  auto errors = run_group(o, [&](Member& m) {
    Rounds& rounds = m.rounds;
    CmaChannel cma(1);
    int posted = 0;
    std::vector<float> buf(100, 1.0f);
    for (int op = 0; op < 3; ++op) {
      const OpDesc desc = rounds.make_desc(OpKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, -1, 100);
      const bool offer = rounds.rank() != 1;
      const Path path = agree_on_path(rounds, PathOffer{nullptr, &cma, offer, buf.data(), buf.data()}, desc,
                                      in(10s), [&] { ++posted; });
      ASSERT_EQ(path, Path::kStaged);
      rounds.barrier_round(desc, in(10s));  // the rest of the op, as a staged one would
    }
    // Rank 1 posted round 0 before the first barrier, as a staging rank
    // does; then, since some rank skipped it, everyone posted it into the
    // next round's buffer.
    ASSERT_EQ(posted, rounds.rank() == 1 ? 6 : 3);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
}

TEST(ShmCma, WhenOneRankCannotReachTheOthersTheGroupStagesForGood) {
  GroupOptions o;
  o.size = 3;
  std::atomic<bool> root_returned{false};
  auto errors = run_group(o, [&](Member& m) {
    Rounds& rounds = m.rounds;
    if (rounds.rank() == 2) tdist::test::refuse_cross_memory_attach(/*every_thread=*/false);
    CmaChannel cma(1);
    std::vector<float> buf(100, 1.0f);
    for (int op = 0; op < 3; ++op) {
      ASSERT_TRUE(cma.offers(400) || op > 0) << "offers until the probe fails";
      const OpDesc desc = rounds.make_desc(OpKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, -1, 100);
      const Path path = agree_on_path(rounds, PathOffer{nullptr, &cma, cma.offers(400), buf.data(), buf.data()},
                                      desc, in(10s), [] {});
      ASSERT_EQ(path, Path::kStaged) << "op " << op;
      rounds.barrier_round(desc, in(10s));
      // Ranks 0 and 1 could reach rank 2, but the group agreed: nobody
      // offers again.
      ASSERT_FALSE(cma.offers(400)) << "op " << op;
    }
    // So a broadcast large enough for single copy stays eager: its root
    // returns before the others have called it (they wait until it has).
    std::vector<uint8_t> b(4096, rounds.rank() == 1 ? 7 : 0);  // one round (of 4 KiB here)
    if (rounds.rank() != 1) {
      const auto give_up = std::chrono::steady_clock::now() + 10s;
      while (!root_returned.load() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    }
    const OpDesc desc = rounds.begin_op(OpKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, 1, b.size(), in(10s));
    algo::broadcast(rounds, b.data(), b.size(), 1, desc, in(2s), &cma);
    if (rounds.rank() == 1) root_returned.store(true);
    ASSERT_EQ(std::count(b.begin(), b.end(), 7), 4096);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
}

TEST(ShmCma, ATransferThatFailsNamesThePeerAndAbortsTheGroup) {
  GroupOptions o;
  o.size = 2;
  const pid_t gone = tdist::test::fork_child([] { return 0; });
  ASSERT_TRUE(tdist::test::exited_ok(tdist::test::wait_child(gone, std::chrono::seconds(10))));  // reaped: no such process
  auto errors = run_group(o, [&](Member& m) {
    Rounds& rounds = m.rounds;
    CmaChannel cma(1);
    std::vector<float> buf(100, 1.0f);
    const OpDesc desc = rounds.make_desc(OpKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, -1, 100);
    ASSERT_EQ(agree_on_path(rounds, PathOffer{nullptr, &cma, true, buf.data(), buf.data()}, desc, in(10s), [] {}),
              Path::kSingleCopy);
    if (rounds.rank() == 0) {
      m.segment.slot(1)->pid.store(gone);  // as if rank 1 had died
      cma.read(rounds, 1, buf.data(), cma.in_of(1), 400, desc);
    }
    rounds.barrier_round(desc, in(10s));
  });
  EXPECT_TRUE(raised<tdist::PeerFailureError>(errors[0])) << message(errors[0]);
  EXPECT_TRUE(contains(message(errors[0]), "all_reduce(float32 x 100, SUM) #1: process_vm_readv with rank 1 failed"))
      << message(errors[0]);
  EXPECT_NE(message(errors[1]), "");  // the group was aborted under it
}

}  // namespace
