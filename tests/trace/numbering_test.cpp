// One numbering: the op a rank's error names ("all_reduce #5 timed out",
// a mismatch, a dead peer) is the op the flight recorder's dump, and so
// tdist-trace analyze and tdist-run's stall report, call by the same
// number, and the number Work::seq() gives: collectives 1, 2, 3, ... in
// call order, send/recv numbered apart. Real processes, on every backend
// that numbers its errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <unistd.h>

#include "tdist/tdist.h"
#include "tests/util/process.h"
#include "tests/util/world.h"

namespace {

using nlohmann::json;
using tdist::ProcessGroup;
using tdist::test::run_world;
using tdist::test::TempDir;

// Every "#N" in an error message.
std::set<uint64_t> numbers_in(const std::string& msg) {
  std::set<uint64_t> out;
  static const std::regex hash("#([0-9]+)");
  for (std::sregex_iterator it(msg.begin(), msg.end(), hash), end; it != end; ++it) out.insert(std::stoull((*it)[1]));
  return out;
}

// The last op of group "world" in this rank's dump.
json last_world_entry(const std::string& dir, int rank) {
  const std::string text = tdist::test::read_all(dir + "/rank-" + std::to_string(rank) + ".json");
  WORLD_CHECK(!text.empty(), "no dump in " << dir);
  const json dump = json::parse(text);
  json last;
  for (const auto& e : dump["entries"]) {
    if (e["process_group"][0] == "world") last = e;
  }
  return last;
}

// Ops before the one that fails: send/recv (numbered apart), a barrier, and
// collectives the shm backend runs as several ops of its own (a coalesced
// all_reduce of large pieces). Returns the number of collectives called.
uint64_t ops_before(ProcessGroup& pg) {
  at::Tensor small = at::ones({4});
  if (pg.rank() == 0) {
    pg.send(small, 1)->wait();
  } else {
    pg.recv(small, 0)->wait();
  }
  pg.barrier()->wait();
  std::vector<at::Tensor> big = {at::ones({40000}), at::ones({40000}), at::ones({3})};
  pg.all_reduce_coalesced(big)->wait();
  auto last = pg.all_reduce(small);
  last->wait();
  WORLD_CHECK(last->seq() == 3, "the third collective is #" << last->seq());
  return 3;
}

// `msg` names only op `n`, and so does the dump's entry for the failed op.
void check_one_number(const std::string& msg, const json& entry, uint64_t n) {
  const auto nums = numbers_in(msg);
  WORLD_CHECK(nums == std::set<uint64_t>{n}, "the error names #" << (nums.empty() ? 0 : *nums.begin()) << " (of "
                                                                 << nums.size() << "), the op is #" << n << ": " << msg);
  WORLD_CHECK(entry["state"] == "failed", entry.dump());
  WORLD_CHECK(entry["collective_seq_id"] == n, "the dump calls the failed op #" << entry["collective_seq_id"]
                                                                                 << ", the error #" << n);
}

tdist::test::WorldOptions no_final_barrier(const std::string& backend) {
  tdist::test::WorldOptions o;
  o.backend = backend;
  o.final_barrier = false;
  return o;
}

class Numbering : public ::testing::TestWithParam<std::string> {};

TEST_P(Numbering, ATimeoutNamesTheOpAsTheDumpAndWorkDo) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    const uint64_t n = ops_before(pg) + 1;
    if (pg.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(3));  // skips #n
      return;
    }
    tdist::AllreduceOptions o;
    o.timeout = std::chrono::milliseconds(800);
    at::Tensor t = at::ones({4});
    auto w = pg.all_reduce(t, o);
    try {
      w->wait();
      WORLD_CHECK(false, "no TimeoutError");
    } catch (const tdist::TimeoutError& e) {
      WORLD_CHECK(w->seq() == n, "Work::seq() " << w->seq() << ", expected " << n);
      check_one_number(e.what(), last_world_entry(dir.path(), 0), n);
    }
  }, no_final_barrier(GetParam())), "");
}

TEST_P(Numbering, APeersDeathNamesTheOpAsTheDumpDoes) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    const uint64_t n = ops_before(pg) + 1;
    if (pg.rank() == 1) _exit(0);  // gone without a word
    try {
      at::Tensor t = at::ones({4});
      pg.all_reduce(t)->wait();
      WORLD_CHECK(false, "no PeerFailureError");
    } catch (const tdist::PeerFailureError& e) {
      check_one_number(e.what(), last_world_entry(dir.path(), 0), n);
    }
  }, no_final_barrier(GetParam())), "");
}

// Ops are numbered in the order they run, which is the same on every
// rank; the order they were queued in need not be: a chain()'s collective
// goes ahead of what another thread queued meanwhile. Rank 1 queues B while
// A runs, rank 0 after A's chain has queued C: both run A, C, B, and both
// must call C #2 and B #3, in Work::seq() and in their dumps.
TEST_P(Numbering, AChainedCollectiveIsNumberedAsItRunsOnEveryRank) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    at::Tensor a = at::ones({4}), b = at::ones({8}), c = at::ones({16});
    auto wa = pg.all_reduce(a);
    std::shared_ptr<tdist::Work> wc;
    auto chained = wa->chain([&](tdist::Work&) { return wc = pg.all_reduce(c); });
    if (pg.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto wb = pg.all_reduce(b);
    wb->wait();
    chained->wait();
    WORLD_CHECK(wa->seq() == 1 && wc->seq() == 2 && wb->seq() == 3,
                "A #" << wa->seq() << ", C (chained) #" << wc->seq() << ", B #" << wb->seq() << "; want 1, 2, 3");
    const std::string text = tdist::test::read_all(tdist::trace::dump_flight_recorder());
    const json dump = json::parse(text);
    std::map<uint64_t, int64_t> numel;  // collective_seq_id -> input elements
    for (const auto& e : dump["entries"]) {
      if (e["process_group"][0] == "world") numel[e["collective_seq_id"]] = e["input_sizes"][0][0];
    }
    WORLD_CHECK(numel[1] == 4 && numel[2] == 16 && numel[3] == 8,
                "the dump's #1, #2, #3 hold " << numel[1] << ", " << numel[2] << ", " << numel[3] << " elements");
  }, [this] {
    tdist::test::WorldOptions o;
    o.backend = GetParam();
    return o;
  }()), "");
}

INSTANTIATE_TEST_SUITE_P(Backends, Numbering, ::testing::Values("shm", "gloo"));

// shm finds a mismatch on every rank; each names the op by its own number.
TEST(Numbering, AMismatchNamesTheOpAsTheDumpDoes) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    const uint64_t n = ops_before(pg) + 1;
    try {
      if (pg.rank() == 0) {
        pg.all_reduce(at::ones({10}))->wait();
      } else {
        pg.broadcast(at::ones({10, 1}))->wait();
      }
      WORLD_CHECK(false, "no CollectiveMismatchError");
    } catch (const tdist::CollectiveMismatchError& e) {
      check_one_number(e.what(), last_world_entry(dir.path(), pg.rank()), n);
    }
  }, no_final_barrier("shm")), "");
}

// TDIST_DEBUG=detail checks every op's fingerprint before it runs (on any
// backend); its mismatch names the same number.
TEST(Numbering, ADebugDetailMismatchNamesTheOpAsTheDumpDoes) {
  TempDir dir;
  setenv("TDIST_DEBUG", "detail", 1);
  const std::string failures = run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    const uint64_t n = ops_before(pg) + 1;
    try {
      if (pg.rank() == 0) {
        pg.all_reduce(at::ones({10}))->wait();
      } else {
        pg.broadcast(at::ones({10, 1}))->wait();
      }
      WORLD_CHECK(false, "no CollectiveMismatchError");
    } catch (const tdist::CollectiveMismatchError& e) {
      check_one_number(e.what(), last_world_entry(dir.path(), pg.rank()), n);
    }
  }, no_final_barrier("gloo"));
  unsetenv("TDIST_DEBUG");
  EXPECT_EQ(failures, "");
}

}  // namespace
