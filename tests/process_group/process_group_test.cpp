// Process groups beyond the conformance suite: what happens when things go
// wrong (timeouts, a killed rank, mismatched collectives, stale segments,
// misuse), subgroups, and Work chaining.
#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "comm/backend.h"
#include "tdist/config.h"
#include "tdist/tdist.h"
#include "tests/util/world.h"
#include "tests/util/process.h"

using namespace std::chrono_literals;
using tdist::ProcessGroup;
using tdist::ReduceOp;
using tdist::test::run_world;
using tdist::test::WorldOptions;

namespace {

using Clock = std::chrono::steady_clock;

// Runs fn expecting it to throw E; returns the message (throws otherwise).
template <typename E, typename Fn>
std::string expect_throw(Fn&& fn, const char* what) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(what) + ": threw the wrong error: " + e.what());
  }
  throw std::runtime_error(std::string(what) + ": did not throw");
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::vector<std::string> our_segments() {
  std::vector<std::string> out;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (std::string(e->d_name).rfind("tdist-shm-", 0) == 0) out.push_back(e->d_name);
    }
    closedir(d);
  }
  return out;
}

class Failures : public ::testing::TestWithParam<std::string> {};

TEST_P(Failures, ATimeoutNamesTheOpItsSequenceNumberAndTheMissingRank) {
  WorldOptions o;
  o.backend = GetParam();
  o.final_barrier = false;
  const std::string failures = run_world(2, [](ProcessGroup& pg) {
    at::Tensor t = at::ones({10});
    auto first = pg.all_reduce(t);  // #1 succeeds
    first->wait();
    WORLD_CHECK(first->seq() == 1, "the first collective is #" + std::to_string(first->seq()));
    if (pg.rank() == 0) {
      const auto t0 = Clock::now();
      auto late = pg.all_reduce(t, {ReduceOp::SUM, 300ms});
      const std::string msg = expect_throw<tdist::TimeoutError>([&] { late->wait(); }, "timed-out all_reduce");
      WORLD_CHECK(late->seq() == 2, "the second collective is #" + std::to_string(late->seq()));
      WORLD_CHECK(Clock::now() - t0 < 5s, "took too long");
      WORLD_CHECK(contains(msg, "all_reduce") && contains(msg, "#2") && !contains(msg, "#1"), msg);
      WORLD_CHECK(contains(msg, "rank(s) 1 never arrived"), msg);
      // Later ops fail at once with the first error.
      const auto t1 = Clock::now();
      const std::string again = expect_throw<tdist::TimeoutError>([&] { pg.barrier()->wait(); }, "after timeout");
      WORLD_CHECK(Clock::now() - t1 < 1s, "the op after a failure did not fail fast");
      if (pg.backend_name() == "shm") WORLD_CHECK(contains(again, "aborted by rank 0"), again);
    } else {
      std::this_thread::sleep_for(1500ms);  // miss the deadline
      if (pg.backend_name() == "shm") {  // the shm segment tells the late rank at once
        const std::string msg = expect_throw<tdist::TimeoutError>([&] { pg.all_reduce(t)->wait(); }, "late rank");
        WORLD_CHECK(contains(msg, "aborted by rank 0"), msg);
      }
    }
  }, o);
  EXPECT_EQ(failures, "");
}

// async_op=false: the op's error is thrown from the call itself.
TEST_P(Failures, ASynchronousCallThrowsItsErrorFromTheCall) {
  WorldOptions o;
  o.backend = GetParam();
  o.final_barrier = false;
  const std::string failures = run_world(2, [](ProcessGroup& pg) {
    at::Tensor t = at::ones({10});
    tdist::AllreduceOptions sync;
    sync.async_op = false;
    pg.all_reduce(t, sync);  // #1 succeeds
    if (pg.rank() == 0) {
      sync.timeout = 300ms;
      const std::string msg = expect_throw<tdist::TimeoutError>([&] { pg.all_reduce(t, sync); }, "synchronous call");
      WORLD_CHECK(contains(msg, "all_reduce") && contains(msg, "#2") && !contains(msg, "#1"), msg);
      WORLD_CHECK(contains(msg, "rank(s) 1 never arrived"), msg);
    } else {
      std::this_thread::sleep_for(1500ms);  // miss the deadline
    }
  }, o);
  EXPECT_EQ(failures, "");
}

TEST_P(Failures, AKilledRankIsNamedWithinSeconds) {
  WorldOptions o;
  o.backend = GetParam();
  o.final_barrier = false;
  const std::string failures = run_world(3, [](ProcessGroup& pg) {
    at::Tensor t = at::ones({1 << 20});
    pg.all_reduce(t)->wait();
    if (pg.rank() == 2) {
      std::this_thread::sleep_for(200ms);  // the others are inside the next all_reduce
      raise(SIGKILL);
    }
    const auto t0 = Clock::now();
    try {
      pg.all_reduce(t, {ReduceOp::SUM, 120s})->wait();
      throw std::runtime_error("all_reduce with a dead peer succeeded");
    } catch (const tdist::PeerFailureError& e) {
      WORLD_CHECK(e.rank() == 2, e.what());
      WORLD_CHECK(contains(e.what(), "rank 2"), e.what());
      WORLD_CHECK(Clock::now() - t0 < 10s, "noticed only after " << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count() << " ms");
    }
  }, o);
  EXPECT_EQ(failures, "rank 2: signal 9\n");
}

INSTANTIATE_TEST_SUITE_P(Backends, Failures, ::testing::Values("shm", "gloo"),
                         [](const auto& info) { return info.param; });

TEST(ShmFailures, MismatchedCollectivesRaiseOnEveryRank) {
  struct Case {
    const char* name;
    std::function<void(ProcessGroup&)> call;
    const char* on_rank0;
    const char* on_rank1;
  };
  const std::vector<Case> cases = {
      {"size", [](ProcessGroup& pg) { pg.all_reduce(at::ones({10 + pg.rank()}))->wait(); },
       "all_reduce(float32 x 10, SUM)", "all_reduce(float32 x 11, SUM)"},
      {"dtype", [](ProcessGroup& pg) { pg.all_reduce(pg.rank() ? at::ones({4}, at::kDouble) : at::ones({4}))->wait(); },
       "all_reduce(float32 x 4, SUM)", "all_reduce(float64 x 4, SUM)"},
      {"op", [](ProcessGroup& pg) { pg.all_reduce(at::ones({4}), {pg.rank() ? ReduceOp::MAX : ReduceOp::SUM})->wait(); },
       "SUM", "MAX"},
      {"kind", [](ProcessGroup& pg) {
         at::Tensor t = at::ones({4});
         if (pg.rank() == 0) pg.all_reduce(t)->wait(); else pg.broadcast(t)->wait();
       }, "all_reduce", "broadcast"},
      // Each rank the root of a small broadcast: eager roots compare
      // nothing, so the next op raises it, naming the ops before it.
      {"root", [](ProcessGroup& pg) {
         pg.broadcast(at::ones({4}), {pg.rank()})->wait();
         pg.all_reduce(at::ones({4}))->wait();
       }, "root 0", "root 1"},
      // The same with a large broadcast (many rounds, none eager): raised
      // by the broadcast itself.
      {"root, large", [](ProcessGroup& pg) {
         pg.broadcast(at::ones({1 << 22}), {pg.rank()})->wait();
       }, "root 0", "root 1"},
      // Sizes on both sides of the 2 KiB below which all_gather and
      // reduce_scatter take the staging path without agreeing on one
      // (kStagedBytes, comm/shm/path.h): one rank stages at once, the
      // other agrees (and may offer single copy); the first barrier still
      // compares.
      {"all_gather size across kStagedBytes", [](ProcessGroup& pg) {
         const int64_t n = pg.rank() ? 400 : 200;  // 3200 and 1600 bytes in all
         pg.all_gather_into_tensor(at::empty({2 * n}), at::ones({n}))->wait();
       }, "all_gather(800 bytes)", "all_gather(1600 bytes)"},
      {"reduce_scatter size across kStagedBytes", [](ProcessGroup& pg) {
         const int64_t n = pg.rank() ? 512 : 128;  // 4096 and 1024 bytes in all
         pg.reduce_scatter_tensor(at::empty({n}), at::ones({2 * n}))->wait();
       }, "reduce_scatter(float32 x 128, SUM)", "reduce_scatter(float32 x 512, SUM)"},
      // A small reduce's non-roots do not wait either: its mismatch too is
      // raised by the op after it on them.
      {"reduce root", [](ProcessGroup& pg) {
         at::Tensor t = at::ones({4});
         pg.reduce(t, {1 - pg.rank()})->wait();
         pg.barrier()->wait();
       }, "root 1", "root 0"},
  };
  for (const auto& c : cases) {
    WorldOptions o;
    o.final_barrier = false;
    const std::string failures = run_world(2, [&](ProcessGroup& pg) {
      const std::string msg = expect_throw<tdist::CollectiveMismatchError>([&] { c.call(pg); }, c.name);
      WORLD_CHECK(contains(msg, c.on_rank0) && contains(msg, c.on_rank1), c.name << ": " << msg);
    }, o);
    EXPECT_EQ(failures, "") << c.name;
  }
}

// With TDIST_DEBUG=detail, every backend catches mismatches through the store.
class DebugDetail : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { setenv("TDIST_DEBUG", "detail", 1); }
  void TearDown() override { unsetenv("TDIST_DEBUG"); }
};

TEST_P(DebugDetail, MismatchesAreCaughtOnEveryRank) {
  WorldOptions o;
  o.backend = GetParam();
  o.final_barrier = false;
  o.timeout = 20s;
  const auto t0 = Clock::now();
  const std::string failures = run_world(2, [](ProcessGroup& pg) {
    at::Tensor t = at::ones({4});
    pg.all_reduce(t)->wait();  // a matching op first: #1
    const std::string msg = expect_throw<tdist::CollectiveMismatchError>([&] {
      if (pg.rank() == 0) pg.all_reduce(at::ones({10}))->wait(); else pg.broadcast(at::ones({10, 1}))->wait();
    }, "mismatch");
    WORLD_CHECK(contains(msg, "TDIST_DEBUG=detail") && contains(msg, "#2") && !contains(msg, "#1"), msg);
    WORLD_CHECK(contains(msg, "rank 0: all_reduce Float[10] SUM") && contains(msg, "rank 1: broadcast Float[10,1] root 0"), msg);
  }, o);
  EXPECT_EQ(failures, "");
  EXPECT_LT(Clock::now() - t0, 15s) << "caught only by the timeout";
}

TEST_P(DebugDetail, MatchingCollectivesPass) {
  WorldOptions o;
  o.backend = GetParam();
  EXPECT_EQ(run_world(3, [](ProcessGroup& pg) {
    for (int i = 0; i < 20; ++i) {
      at::Tensor t = at::full({5}, static_cast<float>(pg.rank()));
      pg.all_reduce(t)->wait();
      WORLD_CHECK(t.eq(3).all().item<bool>(), "sum");
    }
  }, o), "");
}

INSTANTIATE_TEST_SUITE_P(Backends, DebugDetail, ::testing::Values("shm", "gloo"),
                         [](const auto& info) { return info.param; });

TEST(ShmFailures, AllToAllSizesThatDisagreeAreAMismatch) {
  WorldOptions o;
  o.final_barrier = false;
  const std::string failures = run_world(2, [](ProcessGroup& pg) {
    at::Tensor in = at::ones({4});
    at::Tensor out = at::ones({pg.rank() == 0 ? 5 : 4});  // rank 0 expects one element too many
    std::vector<int64_t> recv = pg.rank() == 0 ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{2, 2};
    const std::string msg = expect_throw<tdist::CollectiveMismatchError>(
        [&] { pg.all_to_all_single(out, in, recv, {2, 2})->wait(); }, "all_to_all");
    WORLD_CHECK(contains(msg, "rank 1 sends 8 bytes to rank 0, which expects 12"), msg);
  }, o);
  EXPECT_EQ(failures, "");
}

TEST(ShmFailures, EmptySymmetricSizesThatDisagreeAreAMismatch) {
  WorldOptions o;
  o.final_barrier = false;
  const std::string failures = run_world(2, [](ProcessGroup& pg) {
    const std::string msg = expect_throw<tdist::CollectiveMismatchError>(
        [&] { pg.empty_symmetric({1000 + pg.rank()}); }, "empty_symmetric");
    WORLD_CHECK(contains(msg, "empty_symmetric(4000 bytes)") && contains(msg, "empty_symmetric(4004 bytes)"), msg);
  }, o);
  EXPECT_EQ(failures, "");
}

TEST(SharedMemory, NoSegmentIsLeftBehind) {
  // Segments are named after the rank that made them; look for ours only
  // (other tests may run at the same time).
  std::vector<pid_t> pids;
  WorldOptions o;
  o.pids = &pids;
  EXPECT_EQ(run_world(3, [](ProcessGroup& pg) {
    at::Tensor t = at::ones({100});
    pg.all_reduce(t)->wait();
    auto sub = pg.new_group({1, 2});  // rank 1 makes this one
    if (sub) sub->all_reduce(t)->wait();
    // Symmetric blocks: every rank's own segment, unlinked once all have
    // mapped it.
    at::Tensor block = pg.empty_symmetric({100'000});
    WORLD_CHECK(pg.is_symmetric(block), "not symmetric");
    for (const auto& name : our_segments()) {
      WORLD_CHECK(name.rfind("tdist-shm-" + std::to_string(getpid()) + "-", 0) != 0, "not unlinked: " << name);
    }
  }, o), "");
  ASSERT_EQ(pids.size(), 3u);
  for (const auto& name : our_segments()) {
    for (pid_t p : pids) {
      EXPECT_NE(name.rfind("tdist-shm-" + std::to_string(p) + "-", 0), 0u) << "left behind: " << name;
    }
  }
}

// A rank that cannot get symmetric memory (here a file size limit, which
// tmpfs enforces as a full /dev/shm would) makes every rank fall back to
// ordinary memory, and the group goes on.
TEST(SharedMemory, WhenOneRankCannotGetSymmetricMemoryEveryRankFallsBack) {
  EXPECT_EQ(run_world(3, [](ProcessGroup& pg) {
    if (pg.rank() == 1) {
      signal(SIGXFSZ, SIG_IGN);
      rlimit limit{1 << 20, 1 << 20};
      WORLD_CHECK(setrlimit(RLIMIT_FSIZE, &limit) == 0, "setrlimit");
    }
    at::Tensor big = pg.empty_symmetric({1 << 20});  // 4 MiB: over rank 1's limit
    WORLD_CHECK(!pg.is_symmetric(big) && big.numel() == (1 << 20) && big.eq(0).all().item<bool>(),
                "a block that rank 1 could not get");
    big.fill_(pg.rank());
    pg.all_reduce(big)->wait();
    WORLD_CHECK(big.eq(3.0f).all().item<bool>(), "all_reduce on the fallback");
    at::Tensor small = pg.empty_symmetric({1000});  // within it
    WORLD_CHECK(pg.is_symmetric(small), "a block every rank could get");
  }), "");
}

// TDIST_SHM_SYMMETRIC=0 turns symmetric memory off.
TEST(SharedMemory, SymmetricMemoryCanBeTurnedOff) {
  setenv("TDIST_SHM_SYMMETRIC", "0", 1);
  const std::string failures = run_world(2, [](ProcessGroup& pg) {
    WORLD_CHECK(!pg.has_symmetric_memory(), "has_symmetric_memory");
    at::Tensor t = pg.empty_symmetric({1000});
    WORLD_CHECK(!pg.is_symmetric(t) && t.eq(0).all().item<bool>(), "an ordinary zero-filled tensor");
  });
  unsetenv("TDIST_SHM_SYMMETRIC");
  EXPECT_EQ(failures, "");
}

TEST(SharedMemory, StaleSegmentsOfDeadJobsAreSwept) {
  // A segment named after a process that no longer exists, as a crashed
  // rank 0 would leave it.
  pid_t dead = tdist::test::fork_child([] { return 0; });
  tdist::test::wait_child(dead, 10s);
  const std::string name = "/tdist-shm-" + std::to_string(dead) + "-deadbeefdeadbeef";
  int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 1 << 20), 0);
  close(fd);
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) { pg.barrier()->wait(); }), "");
  EXPECT_NE(shm_unlink(name.c_str()), 0) << "the stale segment was still there";
}

TEST(Groups, SubgroupsAndTheWorldRunSideBySide) {
  EXPECT_EQ(run_world(4, [](ProcessGroup& pg) {
    const int r = pg.rank();
    auto evens = pg.new_group({2, 0});  // order given does not matter
    auto odds_and_two = pg.new_group({1, 2, 3});
    WORLD_CHECK((evens != nullptr) == (r % 2 == 0), "membership of evens");
    WORLD_CHECK((odds_and_two != nullptr) == (r != 0), "membership of odds_and_two");
    if (evens) {
      WORLD_CHECK(evens->size() == 2 && evens->rank() == r / 2, "evens rank");
      WORLD_CHECK(evens->ranks() == std::vector<int>({0, 2}), "evens world ranks");
    }
    // Interleave collectives on all three groups.
    std::vector<std::shared_ptr<tdist::Work>> works;
    at::Tensor w = at::full({1000}, static_cast<float>(r));
    at::Tensor e = at::full({1000}, static_cast<float>(r));
    at::Tensor o = at::full({1000}, static_cast<float>(r));
    for (int i = 0; i < 10; ++i) {
      works.push_back(pg.all_reduce(w, {ReduceOp::MAX}));
      if (evens) works.push_back(evens->all_reduce(e, {ReduceOp::MAX}));
      if (odds_and_two) works.push_back(odds_and_two->all_reduce(o, {ReduceOp::MIN}));
    }
    for (auto& x : works) x->wait();
    WORLD_CHECK(w.eq(3).all().item<bool>(), "world");
    if (evens) WORLD_CHECK(e.eq(2).all().item<bool>(), "evens");
    if (odds_and_two) WORLD_CHECK(o.eq(1).all().item<bool>(), "odds_and_two");
  }), "");
}

// collective_counts: calls and this rank's input/output bytes per op.
tdist::CollectiveCount get_count(const std::map<std::string, tdist::CollectiveCount>& c, const std::string& op) {
  const auto it = c.find(op);
  return it == c.end() ? tdist::CollectiveCount{} : it->second;
}

class Accounting : public ::testing::TestWithParam<std::string> {};

TEST_P(Accounting, CollectiveCountsTallyEachOpsBytes) {
  WorldOptions wo;
  wo.backend = GetParam();
  EXPECT_EQ(run_world(3, [](ProcessGroup& pg) {
    const int r = pg.rank();
    pg.reset_collective_counts();  // run_world's set-up may have used the group
    WORLD_CHECK(pg.collective_counts().empty(), "reset");
    at::Tensor x = at::ones({10});                       // 40 bytes
    pg.all_reduce(x)->wait();
    pg.all_reduce(x, {ReduceOp::SUM, std::nullopt, at::kBFloat16})->wait();  // carried as 20 bytes
    at::Tensor full = at::empty({12}, at::kDouble);     // 96 bytes
    pg.all_gather_into_tensor(full, at::ones({4}, at::kDouble))->wait();
    at::Tensor shard = at::empty({5}, at::kHalf);       // 10 bytes
    pg.reduce_scatter_tensor(shard, at::ones({15}, at::kHalf))->wait();
    pg.reduce(at::ones({2}), {0})->wait();
    pg.all_reduce_coalesced({at::ones({3}), at::ones({5})}, {ReduceOp::AVG, std::nullopt, at::kHalf})->wait();
    // Coalesced: one call, every piece's bytes.
    pg.all_gather_into_tensor_coalesced({at::empty({6}), at::empty({3 * 5})}, {at::ones({2}), at::ones({5})})->wait();
    pg.reduce_scatter_tensor_coalesced({at::empty({1}), at::empty({2})}, {at::ones({3}), at::ones({6})})->wait();
    pg.barrier()->wait();
    const auto c = pg.collective_counts();
    WORLD_CHECK(get_count(c, "all_gather_into_tensor_coalesced").calls == 1 &&
                    get_count(c, "all_gather_into_tensor_coalesced").input_bytes == 28 &&
                    get_count(c, "all_gather_into_tensor_coalesced").output_bytes == 84,
                "all_gather_into_tensor_coalesced count");
    WORLD_CHECK(get_count(c, "reduce_scatter_tensor_coalesced").calls == 1 &&
                    get_count(c, "reduce_scatter_tensor_coalesced").input_bytes == 36 &&
                    get_count(c, "reduce_scatter_tensor_coalesced").output_bytes == 12,
                "reduce_scatter_tensor_coalesced count");
    auto get = [&](const std::string& op) {
      WORLD_CHECK(c.count(op) == 1, "no count for " << op);
      return c.at(op);
    };
    WORLD_CHECK(get("all_reduce").calls == 2, "all_reduce calls " << get("all_reduce").calls);
    WORLD_CHECK(get("all_reduce").input_bytes == 60 && get("all_reduce").output_bytes == 60,
                "all_reduce bytes " << get("all_reduce").input_bytes);
    WORLD_CHECK(get("all_gather_into_tensor").input_bytes == 32 && get("all_gather_into_tensor").output_bytes == 96,
                "all_gather bytes");
    WORLD_CHECK(get("reduce_scatter_tensor").input_bytes == 30 && get("reduce_scatter_tensor").output_bytes == 10,
                "reduce_scatter bytes");
    WORLD_CHECK(get("reduce").input_bytes == 8 && get("reduce").output_bytes == (r == 0 ? 8 : 0), "reduce bytes");
    WORLD_CHECK(get("all_reduce_coalesced").calls == 1 && get("all_reduce_coalesced").input_bytes == 16 &&
                    get("all_reduce_coalesced").output_bytes == 16,
                "all_reduce_coalesced bytes " << get("all_reduce_coalesced").input_bytes);
    WORLD_CHECK(get("barrier").calls == 1 && get("barrier").input_bytes == 0, "barrier");
    WORLD_CHECK(c.size() == 8, "ops counted: " << c.size());
    // A refused call is not counted.
    try {
      pg.all_gather_into_tensor(at::empty({5}), at::ones({4}));
    } catch (const tdist::UsageError&) {
    }
    WORLD_CHECK(pg.collective_counts().count("all_gather_into_tensor") == 1 &&
                    pg.collective_counts().at("all_gather_into_tensor").calls == 1,
                "the refused all_gather was counted");
    pg.reset_collective_counts();
    WORLD_CHECK(pg.collective_counts().empty(), "reset after use");
    // Synchronous calls (run at once on this thread, counted as they
    // start) count with the queued ones, and from zero after a reset.
    tdist::AllreduceOptions now;
    now.async_op = false;
    for (int i = 0; i < 3; ++i) pg.all_reduce(x, now);
    pg.all_reduce(x)->wait();
    WORLD_CHECK(get_count(pg.collective_counts(), "all_reduce").calls == 4 &&
                    get_count(pg.collective_counts(), "all_reduce").input_bytes == 160,
                "synchronous all_reduce calls " << get_count(pg.collective_counts(), "all_reduce").calls);
    pg.reset_collective_counts();
    pg.all_reduce(x, now);
    WORLD_CHECK(get_count(pg.collective_counts(), "all_reduce").calls == 1 &&
                    get_count(pg.collective_counts(), "all_reduce").output_bytes == 40 &&
                    pg.collective_counts().size() == 1,
                "after a reset: " << get_count(pg.collective_counts(), "all_reduce").calls);
  }, wo), "");
}
INSTANTIATE_TEST_SUITE_P(Backends, Accounting, ::testing::Values("shm", "gloo"),
                         [](const auto& info) { return info.param; });

// Misuse is caught on the caller's thread, before anything is queued.
class Misuse : public ::testing::Test {
 protected:
  void SetUp() override {
    tdist::InitOptions o;
    o.store = std::make_shared<tdist::HashStore>();
    o.rank = 0;
    o.world_size = 1;
    o.backend = "shm";
    pg_ = tdist::init_process_group(o);
  }
  void TearDown() override { tdist::destroy_process_group(); }
  std::shared_ptr<ProcessGroup> pg_;
};

TEST_F(Misuse, BadTensorsAreNamed) {
  at::Tensor t = at::ones({4, 4});
  auto msg = expect_throw<tdist::UsageError>([&] { pg_->all_reduce(t.t()); }, "non-contiguous");
  EXPECT_TRUE(contains(msg, "not contiguous")) << msg;
  msg = expect_throw<tdist::UsageError>([&] { pg_->all_reduce(at::ones({2}, at::kShort)); }, "int16");
  EXPECT_TRUE(contains(msg, "Short")) << msg;
  msg = expect_throw<tdist::UsageError>([&] { pg_->all_reduce(at::Tensor()); }, "undefined");
  EXPECT_TRUE(contains(msg, "undefined")) << msg;
  msg = expect_throw<tdist::UsageError>([&] { pg_->all_reduce(at::empty({2}, at::device(at::kMeta))); }, "device");
  EXPECT_TRUE(contains(msg, "meta")) << msg;
  msg = expect_throw<tdist::UsageError>([&] { pg_->all_reduce(at::ones({2}), {ReduceOp::BXOR}); }, "bxor float");
  EXPECT_TRUE(contains(msg, "BXOR")) << msg;
  msg = expect_throw<tdist::UsageError>([&] { pg_->all_reduce(at::ones({2}, at::kInt), {ReduceOp::AVG}); }, "avg int");
  EXPECT_TRUE(contains(msg, "AVG")) << msg;
}

TEST_F(Misuse, BadArgumentsAreNamed) {
  at::Tensor t = at::ones({4});
  EXPECT_TRUE(contains(expect_throw<tdist::UsageError>([&] { pg_->broadcast(t, {1}); }, "root"), "root 1"));
  EXPECT_TRUE(contains(expect_throw<tdist::UsageError>([&] { pg_->send(t, 0); }, "self"), "itself"));
  EXPECT_TRUE(contains(expect_throw<tdist::UsageError>([&] { pg_->all_gather({t, t}, t); }, "list"), "must hold 1"));
  EXPECT_TRUE(contains(expect_throw<tdist::UsageError>([&] { pg_->all_gather_into_tensor(at::ones({3}), t); }, "numel"),
                       "must have 4 elements"));
  EXPECT_TRUE(contains(expect_throw<tdist::UsageError>([&] { pg_->all_to_all_single(t, t, {3}, {4}); }, "splits"),
                       "add up to 3"));
  EXPECT_TRUE(contains(expect_throw<tdist::UsageError>([&] { pg_->new_group({0, 0}); }, "dup"), "twice"));
  EXPECT_TRUE(contains(expect_throw<tdist::UsageError>([&] { pg_->new_group({5}); }, "range"), "rank 5"));
  EXPECT_TRUE(contains(expect_throw<tdist::UsageError>([&] { pg_->all_reduce(t, {ReduceOp::SUM, 0ms}); }, "timeout"),
                       "positive"));
  // Nothing of the above reached the backend: the group still works.
  pg_->all_reduce(t)->wait();
  EXPECT_TRUE(t.eq(1).all().item<bool>());
}

TEST_F(Misuse, BadCoalescedListsAreNamed) {
  at::Tensor a = at::ones({4}), b = at::ones({3});
  const auto gather = [&](std::vector<at::Tensor> outs, std::vector<at::Tensor> ins) {
    return expect_throw<tdist::UsageError>([&] { pg_->all_gather_into_tensor_coalesced(outs, ins); }, "gather");
  };
  const auto scatter = [&](std::vector<at::Tensor> outs, std::vector<at::Tensor> ins) {
    return expect_throw<tdist::UsageError>([&] { pg_->reduce_scatter_tensor_coalesced(outs, ins); }, "scatter");
  };
  EXPECT_TRUE(contains(gather({}, {}), "no tensors")) << gather({}, {});
  EXPECT_TRUE(contains(gather({a}, {a, b}), "1 outputs for 2 inputs"));
  EXPECT_TRUE(contains(gather({a, at::ones({2})}, {a, b}), "outputs[1] must have 3 elements"));
  EXPECT_TRUE(contains(gather({a, at::ones({3}, at::kDouble)}, {a, b}), "Double"));
  EXPECT_TRUE(contains(scatter({a, b}, {at::ones({4}), at::ones({5})}), "inputs[1] must have 3 elements"));
  // An output over an input: a reduce-scatter taking pieces one by one
  // would read what it already wrote.
  at::Tensor big = at::arange(8, at::kFloat);
  const std::string overlap = scatter({big.slice(0, 2, 5), b}, {big.slice(0, 4, 7), at::ones({3})});
  EXPECT_TRUE(contains(overlap, "outputs[0] overlaps inputs[0]")) << overlap;
  // An all-gather input inside another piece's output; its own slot is fine.
  at::Tensor outs = at::zeros({10});
  const std::string inside = gather({outs.slice(0, 0, 4), outs.slice(0, 4, 7)}, {outs.slice(0, 5, 9), b});
  EXPECT_TRUE(contains(inside, "inputs[0] overlaps outputs[1]")) << inside;
  pg_->all_gather_into_tensor_coalesced({outs.slice(0, 0, 4)}, {outs.slice(0, 0, 4)})->wait();
  // Neighbours are no overlap; nothing above was queued.
  pg_->reduce_scatter_tensor_coalesced({big.slice(0, 0, 4), b}, {big.slice(0, 4, 8), at::full({3}, 2.0f)})->wait();
  EXPECT_TRUE(at::equal(big.slice(0, 0, 4), at::arange(4, 8, at::kFloat)));
  EXPECT_TRUE(b.eq(2).all().item<bool>());
}

TEST_F(Misuse, UnknownBackendListsTheKnownOnes) {
  tdist::InitOptions o;
  o.store = std::make_shared<tdist::HashStore>();
  o.rank = 0;
  o.world_size = 1;
  o.backend = "carrier-pigeon";
  auto msg = expect_throw<tdist::UsageError>([&] { tdist::init_process_group(o); }, "backend");
  EXPECT_TRUE(contains(msg, "carrier-pigeon") && contains(msg, "shm")) << msg;
}

TEST_F(Misuse, AutoPicksSharedMemoryOnOneHost) {
  tdist::InitOptions o;
  o.store = std::make_shared<tdist::HashStore>();
  o.rank = 0;
  o.world_size = 1;
  auto pg = tdist::init_process_group(o);
  EXPECT_EQ(pg->backend_name(), "shm");
  EXPECT_EQ(pg->backend_name(c10::DeviceType::CPU), "shm");
  EXPECT_EQ(tdist::default_group(), pg);
}

// PyTorch's default, "cpu:gloo,cuda:nccl": "auto" sends CUDA tensors to
// nccl wherever this tdist has its nccl plugin (the CUDA LibTorch build),
// else to the CPU tensors' backend (staged through host memory). A group
// asked for by name keeps every tensor on that backend.
TEST_F(Misuse, AutoSendsCudaTensorsToNcclWhereTdistHasIt) {
  const auto names = tdist::comm::backend_names();
  const bool has_nccl = std::find(names.begin(), names.end(), "nccl") != names.end();
  EXPECT_EQ(has_nccl, TDIST_WITH_NCCL == 1) << "the nccl plugin is built but not registered, or the reverse";
  for (const std::string backend : {"auto", "shm", "gloo"}) {
    tdist::InitOptions o;
    o.store = std::make_shared<tdist::HashStore>();
    o.rank = 0;
    o.world_size = 1;
    o.backend = backend;
    auto pg = tdist::init_process_group(o);
    const std::string cpu = backend == "auto" ? "shm" : backend;
    EXPECT_EQ(pg->backend_name(c10::DeviceType::CUDA), backend == "auto" && has_nccl ? "nccl" : cpu) << backend;
    // A subgroup that names no backend keeps its parent's, for both kinds
    // of tensor (FSDP's hybrid groups, DeviceMesh).
    auto sub = pg->new_group({0});
    ASSERT_TRUE(sub);
    EXPECT_EQ(sub->backend_name(), cpu) << backend;
    EXPECT_EQ(sub->backend_name(c10::DeviceType::CUDA), pg->backend_name(c10::DeviceType::CUDA)) << backend;
    // CPU tensors stay where they were, and no nccl communicator is made
    // for them (there is no GPU here to make one on).
    at::Tensor t = at::ones({3});
    pg->all_reduce(t)->wait();
    EXPECT_TRUE(at::equal(t, at::ones({3})));
    tdist::destroy_process_group();
  }
}

TEST(Work, ThenChainsAndPropagatesErrors) {
  tdist::InitOptions o;
  o.store = std::make_shared<tdist::HashStore>();
  o.rank = 0;
  o.world_size = 1;
  auto pg = tdist::init_process_group(o);
  at::Tensor t = at::full({3}, 2.0f);
  auto doubled = pg->all_reduce(t)->then([](tdist::Work& w) { return std::vector<at::Tensor>{w.result()[0] * 2}; });
  doubled->wait();
  EXPECT_TRUE(doubled->result()[0].eq(4).all().item<bool>());
  auto failing = pg->barrier()->then([](tdist::Work&) -> std::vector<at::Tensor> { throw std::runtime_error("hook broke"); });
  auto after = failing->then([](tdist::Work&) { return std::vector<at::Tensor>{}; });
  EXPECT_THROW(after->wait(), std::runtime_error);
  EXPECT_FALSE(after->is_success());
  // then() on finished work runs at once.
  auto done = tdist::Work::completed({t});
  EXPECT_TRUE(done->then([](tdist::Work& w) { return w.result(); })->is_completed());
  tdist::destroy_process_group();
}

// Chains of collectives issued from callbacks keep the same order on every
// rank, however the caller's thread and the worker interleave: rank 1 queues
// its next op at varying delays, so the chain's second collective is queued
// sometimes before, sometimes after it; shm would raise a mismatch.
TEST(Work, ChainedCollectivesKeepOneOrderOnEveryRank) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    const int n = pg.size();
    std::vector<std::shared_ptr<tdist::Work>> chains, plain;
    std::vector<at::Tensor> firsts, seconds, thirds;
    for (int k = 0; k < 40; ++k) {
      firsts.push_back(at::full({5 + k}, 1.0f));
      seconds.push_back(at::full({1000 + k}, 2.0f));
      thirds.push_back(at::full({3}, static_cast<float>(k)));
      at::Tensor second = seconds.back();
      chains.push_back(pg.all_reduce(firsts.back())->chain([&pg, second](tdist::Work&) {
        return pg.all_reduce(second)->chain([&pg, second](tdist::Work&) {
          return pg.all_reduce(second, {ReduceOp::MAX});
        });
      }));
      if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::microseconds((k * 37) % 300));
      plain.push_back(pg.all_reduce(thirds.back()));
    }
    for (int k = 0; k < 40; ++k) {
      chains[k]->wait();
      plain[k]->wait();
      WORLD_CHECK(firsts[k].eq(n).all().item<bool>(), "first op of chain " << k);
      WORLD_CHECK(seconds[k].eq(2.0f * n).all().item<bool>(), "chained ops of chain " << k);
      WORLD_CHECK(chains[k]->result()[0].is_same(seconds[k]), "chain " << k << " result");
      WORLD_CHECK(thirds[k].eq(static_cast<float>(k * n)).all().item<bool>(), "op after chain " << k);
    }
  }), "");
}

TEST(Work, ChainPropagatesErrorsFromEitherStep) {
  auto failed = std::make_shared<tdist::Work>();
  failed->mark_failed(std::make_exception_ptr(std::runtime_error("first step broke")));
  bool ran = false;
  auto a = failed->chain([&](tdist::Work&) { ran = true; return tdist::Work::completed({}); });
  EXPECT_THROW(a->wait(), std::runtime_error);
  EXPECT_FALSE(ran);
  auto b = tdist::Work::completed({})->chain([](tdist::Work&) -> std::shared_ptr<tdist::Work> {
    throw std::runtime_error("fn broke");
  });
  EXPECT_THROW(b->wait(), std::runtime_error);
  auto inner = std::make_shared<tdist::Work>();
  auto c = tdist::Work::completed({})->chain([&](tdist::Work&) { return inner; });
  EXPECT_FALSE(c->is_completed());
  inner->mark_failed(std::make_exception_ptr(tdist::PeerFailureError("rank 3 died", 3)));
  EXPECT_THROW(c->wait(), tdist::PeerFailureError);
  auto d = tdist::Work::completed({})->chain([](tdist::Work&) { return std::shared_ptr<tdist::Work>(); });
  EXPECT_THROW(d->wait(), tdist::UsageError);
}

TEST(Work, WaitWithATimeoutRaisesWhileTheOpRuns) {
  auto w = std::make_shared<tdist::Work>();
  w->set_info(7, "all_reduce");
  const std::string msg = expect_throw<tdist::TimeoutError>([&] { w->wait(50ms); }, "wait");
  EXPECT_TRUE(contains(msg, "all_reduce #7")) << msg;
  std::thread t([&] { w->mark_completed({}); });
  w->wait(5s);
  t.join();
  EXPECT_TRUE(w->is_success());
}

}  // namespace
