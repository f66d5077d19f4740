// tdist::DistributedSampler: PyTorch's DistributedSampler's indices (checked
// against Debian's python3-torch), equal shares on every rank, and a
// position that resumes without skipping or repeating a sample, at the
// same world size and at another one.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tdist/errors.h"
#include "tdist/sampler.h"
#include "tests/util/process.h"
#include "tests/util/paths.h"

namespace {

using tdist::DistributedSampler;
using tdist::DistributedSamplerOptions;

DistributedSamplerOptions options(int world, int rank, bool shuffle, uint64_t seed, bool drop_last) {
  DistributedSamplerOptions o;
  o.num_replicas = world;
  o.rank = rank;
  o.shuffle = shuffle;
  o.seed = seed;
  o.drop_last = drop_last;
  return o;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Everything this rank's sampler hands out in batches of `batch`.
std::vector<int64_t> drain(DistributedSampler& s, int64_t batch) {
  std::vector<int64_t> out;
  while (auto b = s.next(batch)) {
    const auto v = to_vector(*b);
    EXPECT_LE(static_cast<int64_t>(v.size()), batch);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

struct Case {
  int64_t n;
  int world;
  bool shuffle;
  uint64_t seed;
  bool drop_last;
  int64_t epoch;
};

// PyTorch's sampler (Debian's python3-torch) prints each case's ranks'
// indices, a line per rank.
TEST(DistributedSampler, IndicesAreThoseOfPyTorchsDistributedSampler) {
  const std::vector<Case> cases = {{10, 3, true, 0, false, 0},  {10, 3, true, 0, true, 0},  {11, 4, true, 7, false, 3},
                                   {11, 4, false, 0, false, 0}, {11, 4, false, 0, true, 0}, {1000, 2, true, 1000, true, 1},
                                   {5, 8, true, 3, false, 2},   {64, 1, true, 42, false, 5}};
  tdist::test::TempDir dir;
  const std::string result = dir.path() + "/indices.txt";
  std::ostringstream py;
  py << "import torch\nfrom torch.utils.data import DistributedSampler\nout = open('" << result << "', 'w')\n";
  for (const auto& c : cases) {
    for (int r = 0; r < c.world; ++r) {
      py << "s = DistributedSampler(range(" << c.n << "), num_replicas=" << c.world << ", rank=" << r
         << ", shuffle=" << (c.shuffle ? "True" : "False") << ", seed=" << c.seed
         << ", drop_last=" << (c.drop_last ? "True" : "False") << ")\ns.set_epoch(" << c.epoch
         << ")\nout.write(' '.join(str(i) for i in s) + '\\n')\n";
    }
  }
  py << "out.close()\n";
  const std::string script = dir.path() + "/sampler.py";
  std::ofstream(script) << py.str();
  // The PyTorch of the LibTorch under test: randperm's algorithm is its own.
#if TORCH_VERSION_MAJOR >= 2
  const std::string python = tdist::test::source_dir() + "/.venv/bin/python";
#else
  const std::string python = "/usr/bin/python3";
#endif
  const auto r = tdist::test::run_command(python + " " + script + " 2>&1", std::chrono::seconds(120));
  ASSERT_TRUE(tdist::test::exited_ok(r.status)) << r.output;
  std::istringstream lines(tdist::test::read_all(result));
  for (const auto& c : cases) {
    for (int rank = 0; rank < c.world; ++rank) {
      std::string line;
      ASSERT_TRUE(std::getline(lines, line)) << "too few lines from " << python;
      std::vector<int64_t> want;
      std::istringstream in(line);
      for (int64_t v; in >> v;) want.push_back(v);
      DistributedSampler s(c.n, options(c.world, rank, c.shuffle, c.seed, c.drop_last));
      s.set_epoch(c.epoch);
      EXPECT_EQ(s.num_samples(), static_cast<int64_t>(want.size()));
      EXPECT_EQ(to_vector(s.indices()), want) << "n " << c.n << " world " << c.world << " rank " << rank;
      EXPECT_EQ(drain(s, 3), want) << "n " << c.n << " world " << c.world << " rank " << rank;
    }
  }
}

// Every rank gets the same number of batches, each epoch a new order.
TEST(DistributedSampler, RanksGetEqualSharesAndEpochsDiffer) {
  for (bool drop_last : {false, true}) {
    std::vector<int64_t> sizes;
    for (int r = 0; r < 3; ++r) {
      DistributedSampler s(100, options(3, r, true, 5, drop_last));
      EXPECT_EQ(s.batches_left(8), s.batches_per_epoch(8));
      sizes.push_back(static_cast<int64_t>(drain(s, 8).size()));
    }
    EXPECT_EQ(sizes, std::vector<int64_t>(3, drop_last ? 33 : 34));
  }
  DistributedSampler a(100, options(1, 0, true, 5, false));
  const auto first = to_vector(a.indices());
  a.set_epoch(1);
  EXPECT_NE(to_vector(a.indices()), first);
}

// Stopped after k batches and resumed from its state_dict in a new
// sampler, each rank hands out exactly what an uninterrupted one would.
TEST(DistributedSampler, AResumeAtTheSameWorldSizeContinuesExactly) {
  for (int r = 0; r < 3; ++r) {
    DistributedSampler whole(1000, options(3, r, true, 9, true));
    whole.set_epoch(2);
    const auto all = drain(whole, 16);
    DistributedSampler first(1000, options(3, r, true, 9, true));
    first.set_epoch(2);
    std::vector<int64_t> got;
    for (int k = 0; k < 5; ++k) {
      const auto v = to_vector(*first.next(16));
      got.insert(got.end(), v.begin(), v.end());
    }
    EXPECT_EQ(first.epoch_samples(), 5 * 16 * 3);
    DistributedSampler second(1000, options(3, r, true, 9, true));
    second.load_state_dict(first.state_dict());
    second.set_epoch(2);  // the loop's call for the restored epoch keeps the position
    EXPECT_EQ(second.epoch(), 2);
    const auto rest = drain(second, 16);
    got.insert(got.end(), rest.begin(), rest.end());
    EXPECT_EQ(got, all) << "rank " << r;
  }
}

// Three ranks draw part of an epoch; two ranks resume from the state: the
// epoch's samples are each drawn once (but for the few the new world
// size's drop_last cuts from the end), whatever the checkpoint interval.
TEST(DistributedSampler, AResumeAtAnotherWorldSizeNeitherSkipsNorRepeats) {
  for (bool drop_last : {true, false}) {
    for (int before : {1, 2, 5}) {
      const int64_t n = 997;
      std::multiset<int64_t> seen;
      std::map<std::string, at::Tensor> state;
      for (int r = 0; r < 3; ++r) {
        DistributedSampler s(n, options(3, r, true, 4, drop_last));
        s.set_epoch(1);
        for (int k = 0; k < before; ++k) {
          for (int64_t i : to_vector(*s.next(32))) seen.insert(i);
        }
        if (r == 0) state = s.state_dict();
      }
      EXPECT_EQ(state.at("epoch_samples").item<int64_t>(), before * 32 * 3);
      std::vector<int64_t> shares;
      for (int r = 0; r < 2; ++r) {
        DistributedSampler s(n, options(2, r, true, 4, drop_last));
        s.load_state_dict(state);
        s.set_epoch(1);
        const auto mine = drain(s, 32);
        shares.push_back(static_cast<int64_t>(mine.size()));
        for (int64_t i : mine) seen.insert(i);
      }
      EXPECT_EQ(shares[0], shares[1]) << "unequal shares after the resume";
      const int64_t left = n - before * 32 * 3;
      std::set<int64_t> distinct(seen.begin(), seen.end());
      if (drop_last) {
        EXPECT_EQ(seen.size(), distinct.size()) << "a sample was drawn twice";
        EXPECT_EQ(static_cast<int64_t>(distinct.size()), n - left % 2) << "before " << before;
      } else {
        EXPECT_EQ(static_cast<int64_t>(distinct.size()), n) << "a sample was skipped";
        EXPECT_EQ(static_cast<int64_t>(seen.size()), n + left % 2) << "more than the padding repeated";
      }
    }
  }
}

// set_epoch starts a pass again, even for the same epoch (an evaluation
// sampler used every evaluation), except the one call right after a
// restore; a restored position at or past the end, or a hostile one, is
// an epoch with nothing left, not a loop or an allocation.
TEST(DistributedSampler, SetEpochStartsAPassAndHugePositionsAreEmpty) {
  DistributedSampler s(20, options(2, 1, true, 0, false));
  const auto first = drain(s, 4);
  EXPECT_EQ(first.size(), 10u);
  EXPECT_FALSE(s.next(4).has_value());
  s.set_epoch(0);
  EXPECT_EQ(drain(s, 4), first) << "set_epoch of the same epoch did not start the pass again";
  DistributedSampler r(20, options(2, 1, true, 0, false));
  const auto huge = at::tensor({INT64_MAX}, at::kLong);
  r.load_state_dict({{"epoch", huge}, {"epoch_samples", huge}, {"dataset_size", at::tensor({20}, at::kLong)}});
  r.set_epoch(INT64_MAX);
  EXPECT_EQ(r.batches_left(4), 0);
  EXPECT_FALSE(r.next(4).has_value());
  EXPECT_EQ(DistributedSampler(INT64_MAX, options(3, 0, false, 0, false)).batches_per_epoch(INT64_MAX), 1);
}

TEST(DistributedSampler, ABadStateOrMisuseIsNamed) {
  DistributedSampler s(100, options(2, 0, true, 0, false));
  auto expect_usage = [](auto&& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no UsageError (" << part << ")";
    } catch (const tdist::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  DistributedSampler other(101, options(2, 0, true, 0, false));
  expect_usage([&] { s.load_state_dict(other.state_dict()); }, "101");
  expect_usage([&] { s.load_state_dict({{"epoch", at::tensor({1}, at::kLong)}}); }, "epoch_samples");
  expect_usage([&] {
    s.load_state_dict({{"epoch", at::tensor({1.5})}, {"epoch_samples", at::tensor({0}, at::kLong)}});
  }, "epoch");
  expect_usage([&] { DistributedSampler(10, options(2, 2, true, 0, false)); }, "rank 2 of 2");
  expect_usage([&] { s.next(0); }, "batch size");
  // Without a default group, num_replicas and rank cannot default.
  expect_usage([&] { DistributedSampler(10); }, "default group");
}

}  // namespace
