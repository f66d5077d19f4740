// The shm round protocol and its waiting, with ranks as threads: buffers
// handed over by barriers across op boundaries, descriptors compared, and
// the ways a wait ends badly (timeout, abort, a dead or replaced peer).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "comm/idle_work.h"
#include "comm/shm/process_info.h"
#include "tdist/errors.h"
#include "tests/comm/shm/threads.h"
#include "tests/util/process.h"

using namespace tdist::comm;
using namespace tdist::comm::shm;
using namespace tdist::test::shm;

namespace {

struct Stamp {
  uint64_t op, round;
  int rank;
};

// Every round each rank stamps its buffer; after the barrier it must read
// every rank's stamp of that round, while the next round's buffer is
// already being written. Ops of 1 to 4 rounds back to back, no closing
// barrier: the parity rule must carry across op boundaries.
TEST(Rounds, EachBarrierHandsOverTheRoundsBuffers) {
  for (int size : {1, 2, 3, 4}) {
    GroupOptions o;
    o.size = size;
    auto errors = run_group(o, [&](Member& m) {
      Rounds& rounds = m.rounds;
      for (uint64_t op = 0; op < 200; ++op) {
        const OpDesc desc = rounds.make_desc(OpKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, 0, op);
        ASSERT_EQ(desc.seq, op);
        ASSERT_EQ(rounds.next_seq(), op + 1);
        const uint64_t n_rounds = 1 + op % 4;
        for (uint64_t j = 0; j < n_rounds; ++j) {
          Stamp s{op, j, rounds.rank()};
          std::memcpy(rounds.mine(), &s, sizeof s);
          // Filling the whole buffer makes overwriting a buffer still
          // being read show as a wrong stamp.
          std::memset(rounds.mine() + sizeof s, int(op + j), rounds.round_bytes() - sizeof s);
          if (j == 0) rounds.first_barrier(desc, in(10s)); else rounds.barrier_round(desc, in(10s));
          for (int r = 0; r < rounds.size(); ++r) {
            Stamp got;
            std::memcpy(&got, rounds.theirs(r), sizeof got);
            ASSERT_EQ(got.op, op) << "rank " << rounds.rank() << " reading rank " << r;
            ASSERT_EQ(got.round, j);
            ASSERT_EQ(got.rank, r);
            ASSERT_EQ(rounds.theirs(r)[rounds.round_bytes() - 1], uint8_t(op + j));
          }
        }
      }
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(message(errors[r]), "") << "size " << size << ", rank " << r;
  }
}

// Eager rounds (a small broadcast's root and a small reduce's non-roots
// arrive and go on; the others wait for the ranks they read) mixed with
// ops of one and two real barriers, back to back, with ranks held up at
// random: reserve() must keep every rank from rewriting a buffer (or a
// descriptor) that another still reads. Every buffer is stamped whole, and
// so is the box (the small round's payload beside the barrier).
TEST(Rounds, EagerRoundsNeverOverwriteABufferStillBeingRead) {
  for (int size : {2, 3, 4}) {
    GroupOptions o;
    o.size = size;
    auto errors = run_group(o, [&](Member& m) {
      Rounds& rounds = m.rounds;
      const int me = rounds.rank();
      uint64_t rng = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(me + 1);
      static_assert(sizeof(Stamp) < kBoxBytes);
      auto stamp = [&](uint64_t op) {
        Stamp s{op, 0, me};
        std::memcpy(rounds.mine(), &s, sizeof s);
        std::memset(rounds.mine() + sizeof s, int(op), rounds.round_bytes() - sizeof s);
        EXPECT_NE(rounds.mine(kBoxBytes), rounds.mine());
        std::memcpy(rounds.mine(kBoxBytes), &s, sizeof s);
        std::memset(rounds.mine(kBoxBytes) + sizeof s, int(op), kBoxBytes - sizeof s);
      };
      auto check = [&](int r, uint64_t op) {
        for (size_t bytes : {kBoxBytes, kBoxBytes + 1}) {
          const uint8_t* theirs = rounds.theirs(r, bytes);
          const size_t len = bytes == kBoxBytes ? kBoxBytes : rounds.round_bytes();
          Stamp got;
          std::memcpy(&got, theirs, sizeof got);
          ASSERT_EQ(got.op, op) << "rank " << me << " reading rank " << r << (bytes == kBoxBytes ? "'s box" : "");
          ASSERT_EQ(got.rank, r);
          ASSERT_EQ(theirs[len - 1], uint8_t(op));
        }
      };
      for (uint64_t op = 0; op < 600; ++op) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        if ((rng >> 60) == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
        else if ((rng >> 60) < 4) std::this_thread::yield();
        const int root = static_cast<int>(op % static_cast<uint64_t>(size));
        switch (op % 3) {
          case 0: {  // an eager broadcast
            const OpDesc desc = rounds.begin_op(OpKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, root, op, in(10s));
            if (me == root) {
              stamp(op);
              rounds.arrive(desc);
            } else {
              rounds.arrive(desc);
              rounds.wait_for(root, desc, in(10s));
              check(root, op);
            }
            break;
          }
          case 1: {  // an eager reduce
            const OpDesc desc = rounds.begin_op(OpKind::kReduce, DataType::kFloat32, ReduceOp::kSum, root, op, in(10s));
            stamp(op);
            rounds.arrive(desc);
            if (me == root) {
              for (int r = 0; r < size; ++r) {
                if (r != root) rounds.wait_for(r, desc, in(10s));
              }
              for (int r = 0; r < size; ++r) check(r, op);
            }
            break;
          }
          default: {  // barriers: one round, or two
            const OpDesc desc = rounds.begin_op(OpKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, -1, op, in(10s));
            for (int j = 0; j < 1 + static_cast<int>(op % 2); ++j) {
              stamp(op);
              if (j == 0) rounds.first_barrier(desc, in(10s)); else rounds.barrier_round(desc, in(10s));
              for (int r = 0; r < size; ++r) check(r, op);
            }
          }
        }
      }
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(message(errors[r]), "") << "size " << size << ", rank " << r;
  }
}

// Two ranks each the root of an eager broadcast compare nothing; the op
// after it finds their histories differ and names the ops before it.
TEST(Rounds, AMismatchAtAnEagerRoundIsRaisedAtTheNextComparingOp) {
  GroupOptions o;
  o.size = 2;
  auto errors = run_group(o, [&](Member& m) {
    Rounds& rounds = m.rounds;
    const int me = rounds.rank();
    const OpDesc b = rounds.begin_op(OpKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, me, 4, in(10s));
    rounds.arrive(b);  // each its own root: no one waits, nothing is compared
    rounds.first_barrier(rounds.begin_op(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0, in(10s)),
                         in(10s));
  });
  for (int r = 0; r < o.size; ++r) {
    ASSERT_TRUE(raised<tdist::CollectiveMismatchError>(errors[r])) << "rank " << r << ": " << message(errors[r]);
    EXPECT_TRUE(contains(message(errors[r]), "broadcast(4 bytes, root 0)")) << message(errors[r]);
    EXPECT_TRUE(contains(message(errors[r]), "broadcast(4 bytes, root 1)")) << message(errors[r]);
  }
}

TEST(Rounds, SymmetricKeysTravelWithTheFirstRound) {
  GroupOptions o;
  o.size = 3;
  auto errors = run_group(o, [&](Member& m) {
    Rounds& rounds = m.rounds;
    for (uint64_t op = 0; op < 20; ++op) {
      const OpDesc desc = rounds.make_desc(OpKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, -1, 8);
      uint64_t* key = rounds.sym_key_slot();
      key[0] = op;
      key[1] = 100 + rounds.rank();
      rounds.first_barrier(desc, in(10s));
      for (int r = 0; r < rounds.size(); ++r) {
        ASSERT_EQ(rounds.sym_key_of(r)[0], op);
        ASSERT_EQ(rounds.sym_key_of(r)[1], 100u + r);
      }
      if (op % 2) rounds.barrier_round(desc, in(10s));  // ops of one and two rounds
    }
  });
  for (int r = 0; r < o.size; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
}

TEST(Rounds, DifferentCollectivesRaiseAMismatchOnEveryRank) {
  GroupOptions o;
  o.size = 3;
  o.global_ranks = {5, 6, 7};
  auto errors = run_group(o, [&](Member& m) {
    Rounds& rounds = m.rounds;
    rounds.first_barrier(rounds.make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0), in(10s));
    const size_t count = rounds.rank() == 2 ? 16 : 8;
    rounds.first_barrier(rounds.make_desc(OpKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, -1, count),
                         in(10s));
  });
  for (int r = 0; r < o.size; ++r) {
    ASSERT_TRUE(raised<tdist::CollectiveMismatchError>(errors[r])) << "rank " << r << ": " << message(errors[r]);
    EXPECT_TRUE(contains(message(errors[r]), "rank 7: ")) << message(errors[r]);
  }
}

TEST(Waiter, ATimeoutNamesTheMissingRankAndAbortsTheOthers) {
  GroupOptions o;
  o.size = 3;
  o.global_ranks = {10, 11, 12};
  std::atomic<int> timed_out{0};
  auto errors = run_group(o, [&](Member& m) {
    Rounds& rounds = m.rounds;
    const OpDesc desc = rounds.make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0);
    if (rounds.rank() == 2) {
      // Arrives only once the others have given up.
      while (timed_out.load() == 0) std::this_thread::sleep_for(1ms);
      rounds.first_barrier(desc, in(10s));
      return;
    }
    const auto start = Clock::now();
    try {
      rounds.first_barrier(desc, in(300ms));
    } catch (const tdist::TimeoutError&) {
      EXPECT_LT(Clock::now() - start, 5s);
      timed_out.fetch_add(1);
      throw;
    } catch (...) {
      timed_out.fetch_add(1);
      throw;
    }
  });
  // Whichever of ranks 0 and 1 times out first aborts the group; the other
  // raises that error or its own timeout.
  bool named = false;
  for (int r : {0, 1}) {
    ASSERT_NE(message(errors[r]), "") << "rank " << r;
    named = named || contains(message(errors[r]), "rank(s) 12 never arrived");
  }
  EXPECT_TRUE(named) << message(errors[0]) << "\n" << message(errors[1]);
  ASSERT_TRUE(raised<tdist::TimeoutError>(errors[2])) << message(errors[2]);
  EXPECT_TRUE(contains(message(errors[2]), "aborted by rank 10:") || contains(message(errors[2]), "aborted by rank 11:"))
      << message(errors[2]);
}

TEST(Waiter, AbortFromAnotherThreadWakesASleepingWaiter) {
  GroupOptions o;
  o.size = 2;
  o.yield = std::chrono::microseconds(0);  // straight to the futex
  std::atomic<Member*> waiting{nullptr};
  auto errors = run_group(o, [&](Member& m) {
    if (m.rounds.rank() == 1) {
      while (!waiting.load()) std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(200ms);  // let rank 0 fall asleep
      m.waiter.set_abort(AbortKind::kOther, -1, "stopped by the test");
      m.waiter.set_abort(AbortKind::kTimeout, -1, "a second abort loses");
      return;
    }
    waiting.store(&m);
    const auto start = Clock::now();
    try {
      m.rounds.first_barrier(m.rounds.make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0),
                             in(30s));
    } catch (...) {
      EXPECT_LT(Clock::now() - start, 5s) << "the abort did not wake the waiter";
      throw;
    }
  });
  EXPECT_EQ(message(errors[1]), "");
  ASSERT_TRUE(errors[0]);
  EXPECT_FALSE(raised<tdist::TimeoutError>(errors[0])) << "the first abort's kind should win";
  EXPECT_TRUE(contains(message(errors[0]), "aborted by rank 1: stopped by the test")) << message(errors[0]);
}

// A waiter that sleeps counts itself before its last look, and a rank that
// arrives reads that count after its store (waiter.h): each barrier must
// wake the sleepers. A lost wake-up costs a sleeper its 100 ms nap: no
// barrier may take 80 ms, and 300 of them (three ranks that always sleep)
// take well under a second.
TEST(Waiter, EveryArrivalWakesTheRanksAsleepAtTheBarrier) {
  GroupOptions o;
  o.size = 3;
  o.yield = std::chrono::microseconds(0);  // straight to the futex
  constexpr int kRounds = 300;
  auto errors = run_group(o, [&](Member& m) {
    const OpDesc desc = m.rounds.make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0);
    m.rounds.first_barrier(desc, in(30s));
    const auto start = Clock::now();
    Clock::duration slowest{0};
    for (int i = 0; i < kRounds; ++i) {
      const auto t0 = Clock::now();
      m.rounds.barrier_round(desc, in(30s));
      slowest = std::max(slowest, Clock::now() - t0);
    }
    EXPECT_LT(Clock::now() - start, 8s) << "rank " << m.rounds.rank() << ": sleepers were not woken";
    EXPECT_LT(slowest, 80ms) << "rank " << m.rounds.rank() << ": a barrier waited out a nap (a lost wake-up)";
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
}

// While idle-priority work runs in the process (a Checkpointer's writer),
// a wait never yield-polls, which would hand the core to that work for a
// slice (idle_work.h): it spins briefly and sleeps. With a yield window of
// 60 s a waiter would poll the whole time; beside an IdleWorkScope it is
// counted asleep at once, and the arrival still wakes it.
TEST(Waiter, BesideIdleWorkAWaitSleepsInsteadOfYielding) {
  GroupOptions o;
  o.size = 2;
  o.yield = std::chrono::microseconds(60'000'000);
  std::atomic<bool> asleep{false};
  auto errors = run_group(o, [&](Member& m) {
    const OpDesc desc = m.rounds.make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0);
    if (m.rounds.rank() == 1) {
      // Rank 0 waits at the barrier; it must be counted a sleeper soon.
      const auto until = Clock::now() + 10s;
      while (m.segment.header()->sleepers.load() == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
      asleep = m.segment.header()->sleepers.load() > 0;
      m.rounds.first_barrier(desc, in(30s));
      return;
    }
    tdist::comm::IdleWorkScope idle_work;
    const auto start = Clock::now();
    m.rounds.first_barrier(desc, in(30s));
    EXPECT_LT(Clock::now() - start, 9s) << "the arrival did not wake the sleeper";
  });
  EXPECT_TRUE(asleep.load()) << "the waiter yield-polled beside idle work";
  for (int r = 0; r < 2; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
  EXPECT_FALSE(tdist::comm::idle_work_running()) << "the scope outlived itself";
}

// Liveness is checked through the pid and start time each rank recorded in
// its slot. Ranks here are threads of one process, so a dead or replaced
// peer is staged by rewriting the late rank's slot.
TEST(Waiter, ADeadPeerOrAReusedPidRaisesPeerFailure) {
  const pid_t dead = [] {
    const pid_t pid = tdist::test::fork_child([] { return 0; });
    tdist::test::wait_child(pid, 10s);
    return pid;
  }();
  for (bool reused : {false, true}) {
    GroupOptions o;
    o.size = 2;
    o.global_ranks = {3, 4};
    std::atomic<bool> staged{false};
    std::atomic<bool> done{false};
    auto errors = run_group(o, [&](Member& m) {
      if (m.rounds.rank() == 1) {
        Slot* me = m.segment.slot(1);
        if (reused) {
          me->start_time.store(me->start_time.load() + 1);  // the pid now belongs to someone else
        } else {
          me->pid.store(dead);
        }
        staged.store(true);
        while (!done.load()) std::this_thread::sleep_for(1ms);  // never arrives
        return;
      }
      while (!staged.load()) std::this_thread::sleep_for(1ms);
      const auto start = Clock::now();
      try {
        m.rounds.first_barrier(m.rounds.make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0),
                               in(30s));
      } catch (...) {
        done.store(true);
        EXPECT_LT(Clock::now() - start, 5s);
        throw;
      }
      done.store(true);
    });
    ASSERT_TRUE(raised<tdist::PeerFailureError>(errors[0])) << "reused " << reused << ": " << message(errors[0]);
    try {
      std::rethrow_exception(errors[0]);
    } catch (const tdist::PeerFailureError& e) {
      EXPECT_EQ(e.rank(), 4);
      EXPECT_TRUE(contains(e.what(), "rank 4 (pid ")) << e.what();
    }
  }
}

}  // namespace
