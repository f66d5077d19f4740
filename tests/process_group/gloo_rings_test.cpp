// The gloo backend's ring collectives over Gloo's pairs
// (src/comm/gloo/ring_collectives.h). The reduce-scatter: its results
// against a plain sum at odd sizes and world sizes 2 to 4, an output that
// is the input's own slice, AVG and bfloat16, and what it puts on the
// wire: each rank sends (N-1)/N of its input (an all-reduce would send
// twice that; TCP's retransmits, which a busy machine's loopback sees
// now and then, not counted). The all-gather: every rank's chunk in its place at odd sizes
// and world sizes 2 to 4, with the input apart from the output or its own
// slice, and (N-1)/N of the output on the wire. And SIGPIPE: a gloo group
// ignores it while its action is the default (Gloo's writes to a dead
// peer's socket would otherwise end the rank), and keeps a handler.
#include <gtest/gtest.h>
#include <signal.h>

#include <ATen/ATen.h>

#include "bench/tcp_bytes.h"
#include "tests/util/world.h"

using namespace tdist;
using namespace tdist::test;

namespace {

WorldOptions gloo() {
  WorldOptions o;
  o.backend = "gloo";
  return o;
}

// Rank r's input: element i of chunk c is r * 1000 + c * 10 + (i % 7), so
// the expected sum is known exactly in float32.
at::Tensor input_of(int rank, int world, int64_t count) {
  at::Tensor t = at::empty({world * count});
  float* p = t.data_ptr<float>();
  for (int c = 0; c < world; ++c) {
    for (int64_t i = 0; i < count; ++i) p[c * count + i] = float(rank * 1000 + c * 10 + i % 7);
  }
  return t;
}
at::Tensor expected_of(int rank, int world, int64_t count) {
  at::Tensor sum = at::zeros({count});
  for (int r = 0; r < world; ++r) sum += input_of(r, world, count).narrow(0, rank * count, count);
  return sum;
}

}  // namespace

TEST(GlooReduceScatter, MatchesASumAtOddSizesAndWorldSizes) {
  for (int world : {2, 3, 4}) {
    const std::string failures = run_world(world, [&](ProcessGroup& pg) {
      // 1, 9 and a size of several 1 MiB segments that does not divide.
      for (int64_t count : {int64_t{1}, int64_t{9}, int64_t{(3 << 18) + 5}}) {
        at::Tensor in = input_of(pg.rank(), world, count);
        at::Tensor out = at::full({count}, -1.0f);
        pg.reduce_scatter_tensor(out, in)->wait();
        WORLD_CHECK(at::equal(out, expected_of(pg.rank(), world, count)), "world " << world << ", count " << count);
      }
    }, gloo());
    EXPECT_EQ(failures, "") << "world " << world;
  }
}

TEST(GlooReduceScatter, IntoTheInputsOwnSliceWithAvgAndBfloat16) {
  const std::string failures = run_world(3, [&](ProcessGroup& pg) {
    const int64_t count = (1 << 18) + 3;
    at::Tensor in = input_of(pg.rank(), 3, count);
    const at::Tensor expected = expected_of(pg.rank(), 3, count);
    at::Tensor own = in.narrow(0, pg.rank() * count, count);
    pg.reduce_scatter_tensor(own, in)->wait();  // output aliases the input
    WORLD_CHECK(at::equal(own, expected), "aliased output");

    at::Tensor in2 = input_of(pg.rank(), 3, count);
    at::Tensor avg = at::empty({count});
    ReduceScatterOptions o;
    o.op = ReduceOp::AVG;
    pg.reduce_scatter_tensor(avg, in2, o)->wait();
    WORLD_CHECK(at::allclose(avg, expected / 3), "AVG");

    at::Tensor small = (input_of(pg.rank(), 3, 16) / 100).to(at::kBFloat16);
    at::Tensor out16 = at::empty({16}, at::kBFloat16);
    pg.reduce_scatter_tensor(out16, small)->wait();
    WORLD_CHECK(at::allclose(out16.to(at::kFloat), expected_of(pg.rank(), 3, 16) / 100, 0.02, 0.05), "bfloat16");
  }, gloo());
  EXPECT_EQ(failures, "");
}

// 16 MiB per rank at world size 4: each rank sends 3/4 of it (plus Gloo's
// headers), never the 6/4 an all-reduce of the buffer sends.
TEST(GlooReduceScatter, EachRankSendsTheRingBound) {
  const int world = 4;
  const std::string failures = run_world(world, [&](ProcessGroup& pg) {
    const int64_t count = int64_t{1} << 20;  // 4 MiB out, 16 MiB in
    at::Tensor in = input_of(pg.rank(), world, count);
    at::Tensor out = at::empty({count});
    pg.reduce_scatter_tensor(out, in)->wait();  // connections made, buffers warm
    pg.barrier()->wait();
    const bench::TcpSent before = bench::tcp_sent();
    pg.reduce_scatter_tensor(out, in)->wait();
    pg.barrier()->wait();  // its last segment may still be in the socket's buffer (see below)
    const bench::TcpSent after = bench::tcp_sent();
    const uint64_t resent = after.retransmitted - before.retransmitted;
    const uint64_t sent = after.sent - before.sent - resent;  // what the op sent, not what TCP sent again
    const double bound = double(world - 1) / world * double(in.nbytes());
    WORLD_CHECK(sent >= 0.99 * bound && sent <= 1.05 * bound,
                "sent " << sent << " bytes (and " << resent << " again); the ring bound is " << bound);
    WORLD_CHECK(at::equal(out, expected_of(pg.rank(), world, count)), "result");
  }, gloo());
  EXPECT_EQ(failures, "");
}

namespace {

// Rank r's all-gather input: element i is r * 1000 + i % 13.
at::Tensor chunk_of(int rank, int64_t count) {
  return at::arange(count, at::kLong).remainder(13).to(at::kFloat) + float(rank * 1000);
}

}  // namespace

TEST(GlooAllGather, EveryChunkInItsPlaceInPlaceOrApart) {
  for (int world : {2, 3, 4}) {
    const std::string failures = run_world(world, [&](ProcessGroup& pg) {
      for (int64_t count : {int64_t{1}, int64_t{9}, int64_t{(3 << 18) + 5}}) {
        at::Tensor expected = at::empty({world * count});
        for (int r = 0; r < world; ++r) expected.narrow(0, r * count, count).copy_(chunk_of(r, count));
        at::Tensor out = at::full({world * count}, -1.0f);
        pg.all_gather_into_tensor(out, chunk_of(pg.rank(), count))->wait();
        WORLD_CHECK(at::equal(out, expected), "apart: world " << world << ", count " << count);
        at::Tensor in_place = at::full({world * count}, -1.0f);
        at::Tensor own = in_place.narrow(0, pg.rank() * count, count);
        own.copy_(chunk_of(pg.rank(), count));
        pg.all_gather_into_tensor(in_place, own)->wait();
        WORLD_CHECK(at::equal(in_place, expected), "in place: world " << world << ", count " << count);
      }
    }, gloo());
    EXPECT_EQ(failures, "") << "world " << world;
  }
}

// 4 MiB per rank at world size 4: each rank sends 3/4 of the 16 MiB
// output (plus Gloo's headers).
TEST(GlooAllGather, EachRankSendsTheRingBound) {
  const int world = 4;
  const std::string failures = run_world(world, [&](ProcessGroup& pg) {
    const int64_t count = int64_t{1} << 20;
    at::Tensor in = chunk_of(pg.rank(), count);
    at::Tensor out = at::empty({world * count});
    pg.all_gather_into_tensor(out, in)->wait();  // connections made, buffers warm
    pg.barrier()->wait();
    const bench::TcpSent before = bench::tcp_sent();
    pg.all_gather_into_tensor(out, in)->wait();
    // The op ends on a rank once its last chunk is in its socket's buffer:
    // counted once the others have it (a barrier's few bytes besides).
    pg.barrier()->wait();
    const bench::TcpSent after = bench::tcp_sent();
    const uint64_t resent = after.retransmitted - before.retransmitted;
    const uint64_t sent = after.sent - before.sent - resent;  // what the op sent, not what TCP sent again
    const double bound = double(world - 1) / world * double(out.nbytes());
    WORLD_CHECK(sent >= 0.99 * bound && sent <= 1.05 * bound,
                "sent " << sent << " bytes (and " << resent << " again); the ring bound is " << bound);
    for (int r = 0; r < world; ++r) WORLD_CHECK(at::equal(out.narrow(0, r * count, count), chunk_of(r, count)), "chunk " << r);
  }, gloo());
  EXPECT_EQ(failures, "");
}

namespace {
void on_sigpipe(int) {}
}  // namespace

TEST(GlooSigpipe, AGroupIgnoresTheDefaultActionAndKeepsAHandler) {
  struct sigaction before {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &before), 0);
  // The ranks are forked from here: they start with what is set here.
  signal(SIGPIPE, SIG_DFL);
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    struct sigaction now {};
    WORLD_CHECK(sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == SIG_IGN,
                "SIGPIPE's action after the gloo group was made is not SIG_IGN: a write to a dead peer ends the rank");
  }, gloo()), "");
  signal(SIGPIPE, on_sigpipe);
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    struct sigaction now {};
    WORLD_CHECK(sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == on_sigpipe,
                "the program's SIGPIPE handler was replaced");
  }, gloo()), "");
  ASSERT_EQ(sigaction(SIGPIPE, &before, nullptr), 0);
}
