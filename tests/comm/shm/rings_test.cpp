// shm point to point, with ranks as threads: messages larger than the ring,
// tags out of order, a size mismatch, a bad peer.
#include <gtest/gtest.h>

#include <numeric>

#include "comm/shm/rings.h"
#include "tdist/errors.h"
#include "tests/comm/shm/threads.h"

using namespace tdist::comm;
using namespace tdist::comm::shm;
using namespace tdist::test::shm;

namespace {

std::vector<uint8_t> pattern(size_t bytes, int seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed);
  return v;
}

// run_group, each rank with its PointToPoint.
std::vector<std::exception_ptr> run_p2p(const GroupOptions& o, const std::function<void(Member&, PointToPoint&)>& fn) {
  return run_group(o, [&](Member& m) {
    PointToPoint p2p(m.segment, m.waiter);
    fn(m, p2p);
  });
}

TEST(Rings, MessagesLargerThanTheRingArriveWhole) {
  GroupOptions o;
  o.size = 2;
  o.ring_bytes = 4096;
  auto errors = run_p2p(o, [&](Member& m, PointToPoint& p2p) {
    // Sizes around the ring's capacity and its wrap-around, both ways.
    for (size_t bytes : {size_t(0), size_t(1), size_t(4080), size_t(4096), size_t(4097), size_t(100'003)}) {
      for (int from : {0, 1}) {
        const auto sent = pattern(bytes, int(bytes) + from);
        if (m.rounds.rank() == from) {
          p2p.send(sent.data(), bytes, 1 - from, 7, in(10s));
        } else {
          std::vector<uint8_t> got(bytes, 0xee);
          p2p.recv(got.data(), bytes, from, 7, in(10s));
          ASSERT_EQ(got, sent) << bytes << " bytes from rank " << from;
        }
      }
    }
  });
  for (int r = 0; r < o.size; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
}

TEST(Rings, ARecvForALaterTagKeepsTheEarlierMessages) {
  GroupOptions o;
  o.size = 3;
  auto errors = run_p2p(o, [&](Member& m, PointToPoint& p2p) {
    const int me = m.rounds.rank();
    if (me != 0) {
      for (int tag = 1; tag <= 4; ++tag) {
        const auto v = pattern(100 * tag, tag + 10 * me);
        p2p.send(v.data(), v.size(), 0, tag, in(10s));
      }
      return;
    }
    for (int src : {2, 1}) {
      for (int tag : {4, 2, 3, 1}) {
        std::vector<uint8_t> got(100 * tag);
        p2p.recv(got.data(), got.size(), src, tag, in(10s));
        ASSERT_EQ(got, pattern(100 * tag, tag + 10 * src)) << "tag " << tag << " from rank " << src;
      }
    }
  });
  for (int r = 0; r < o.size; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
}

TEST(Rings, AMessageOfAnotherSizeIsAMismatch) {
  GroupOptions o;
  o.size = 2;
  o.global_ranks = {8, 9};
  auto errors = run_p2p(o, [&](Member& m, PointToPoint& p2p) {
    if (m.rounds.rank() == 1) {
      const auto v = pattern(64, 1);
      p2p.send(v.data(), v.size(), 0, 3, in(10s));
      return;
    }
    std::vector<uint8_t> got(32);
    p2p.recv(got.data(), got.size(), 1, 3, in(10s));
  });
  EXPECT_EQ(message(errors[1]), "");
  ASSERT_TRUE(raised<tdist::CollectiveMismatchError>(errors[0])) << message(errors[0]);
  EXPECT_TRUE(contains(message(errors[0]), "recv from rank 9 with tag 3 expected 32 bytes but the message has 64"))
      << message(errors[0]);
}

TEST(Rings, ASendThatFindsTheRingFullTimesOut) {
  GroupOptions o;
  o.size = 2;
  o.ring_bytes = 4096;
  auto errors = run_p2p(o, [&](Member& m, PointToPoint& p2p) {
    if (m.rounds.rank() == 0) {
      const auto v = pattern(10'000, 0);
      p2p.send(v.data(), v.size(), 1, 5, in(300ms));  // nobody receives
      return;
    }
    // Rank 1 never receives; it learns of the abort from the segment.
    const auto give_up = Clock::now() + 10s;
    while (Clock::now() < give_up) {
      std::this_thread::sleep_for(5ms);
      m.waiter.check_alive_state();
    }
  });
  ASSERT_TRUE(raised<tdist::TimeoutError>(errors[0])) << message(errors[0]);
  EXPECT_TRUE(contains(message(errors[0]), "send to rank 1 (tag 5) timed out")) << message(errors[0]);
  EXPECT_TRUE(raised<tdist::TimeoutError>(errors[1])) << message(errors[1]);
}

TEST(Rings, PeersMustBeOtherRanksOfTheGroup) {
  GroupOptions o;
  o.size = 2;
  auto errors = run_p2p(o, [&](Member& m, PointToPoint& p2p) {
    uint8_t b = 0;
    const int me = m.rounds.rank();
    for (int peer : {me, -1, 2}) {
      EXPECT_THROW(p2p.send(&b, 1, peer, 0, in(1s)), tdist::UsageError) << peer;
      EXPECT_THROW(p2p.recv(&b, 1, peer, 0, in(1s)), tdist::UsageError) << peer;
    }
  });
  for (int r = 0; r < o.size; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
}

}  // namespace
