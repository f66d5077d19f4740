// The shm backend's single-copy path (src/comm/shm/cma.h) with real
// processes: large ops give the staging path's bits; a group where one rank
// turns it off, or where one rank's process may not use cross-memory
// attach (a seccomp filter, as containers install), stages together and
// stays correct. (The conformance suite in collectives_test runs every op
// and size both ways.)
#include <gtest/gtest.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>

#include <ATen/ATen.h>

#include "tests/util/seccomp.h"
#include "tests/util/world.h"

using tdist::ProcessGroup;
using tdist::test::run_world;

namespace {

// Runs all_reduce (SUM and AVG), reduce_scatter_tensor, broadcast and
// all_gather_into_tensor of 1-4 MB on g (broadcast also 6 KB) and checks them against the sums
// computed here from every rank's inputs (random floats: the same bits
// whatever path reduces them in rank order).
void large_ops_are_exact(ProcessGroup& g) {
  const int n = g.size(), r = g.rank();
  auto input = [](int rank, int64_t numel) {
    return at::randn({numel}, at::TensorOptions().dtype(at::kFloat)).mul_(1 + rank) +
           at::arange(numel, at::kFloat).remainder_(7).mul_(rank);
  };
  const int64_t numel = 300'007;
  std::vector<at::Tensor> inputs;
  for (int q = 0; q < n; ++q) {
    at::manual_seed(100 + q);
    inputs.push_back(input(q, numel * n));
  }
  at::Tensor want = inputs[0].clone();
  for (int q = 1; q < n; ++q) want.add_(inputs[q]);

  at::Tensor sum = inputs[r].clone();
  g.all_reduce(sum)->wait();
  WORLD_CHECK(at::equal(sum, want), "all_reduce SUM");
  at::Tensor avg = inputs[r].clone();
  g.all_reduce(avg, {tdist::ReduceOp::AVG})->wait();
  WORLD_CHECK(at::allclose(avg, want / n), "all_reduce AVG");

  at::Tensor shard = at::empty({numel});
  g.reduce_scatter_tensor(shard, inputs[r])->wait();
  WORLD_CHECK(at::equal(shard, want.slice(0, r * numel, (r + 1) * numel)), "reduce_scatter_tensor");

  // Broadcasts of several staging rounds and of one (of at least 4 KiB,
  // which agree on their path first), from the last rank and from 0.
  for (const int64_t len : {numel * n, int64_t(1500)}) {
    for (const int root : {n - 1, 0}) {
      at::Tensor b = r == root ? inputs[root].slice(0, 0, len).clone() : at::full({len}, -1.0f);
      g.broadcast(b, {root})->wait();
      WORLD_CHECK(at::equal(b, inputs[root].slice(0, 0, len)), "broadcast of " << len << " floats from " << root);
    }
  }

  at::Tensor gathered = at::empty({numel * n});
  g.all_gather_into_tensor(gathered, inputs[r].slice(0, 0, numel))->wait();
  for (int q = 0; q < n; ++q) {
    WORLD_CHECK(at::equal(gathered.slice(0, q * numel, (q + 1) * numel), inputs[q].slice(0, 0, numel)),
                "all_gather_into_tensor, slot " << q);
  }
}

TEST(SingleCopy, LargeOpsGiveTheExactResultsAtEveryWorldSize) {
  // Six rounds: each op's size passes its trials of both paths
  // (crossover.h) and then takes the one rank 0 chose.
  for (int world : {2, 3, 4}) {
    EXPECT_EQ(run_world(world, [](ProcessGroup& pg) {
      for (int i = 0; i < 6; ++i) large_ops_are_exact(pg);
    }), "") << "world " << world;
  }
}

TEST(SingleCopy, AGroupWhereOneRankTurnsItOffStagesTogether) {
  EXPECT_EQ(run_world(3, [](ProcessGroup& pg) {
    if (pg.rank() == 1) setenv("TDIST_SHM_CMA_BYTES", "0", 1);
    auto g = pg.new_group({0, 1, 2});  // its backend reads the variable
    for (int i = 0; i < 2; ++i) large_ops_are_exact(*g);
  }), "");
}

TEST(SingleCopy, WhereOneRankMayNotUseCrossMemoryAttachTheGroupStagesTogether) {
  EXPECT_EQ(run_world(3, [](ProcessGroup& pg) {
    if (pg.rank() == 2) tdist::test::refuse_cross_memory_attach(/*every_thread=*/true);
    auto g = pg.new_group({0, 1, 2});
    for (int i = 0; i < 2; ++i) large_ops_are_exact(*g);
  }), "");
}

}  // namespace
