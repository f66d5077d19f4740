// The flight recorder in real processes: what a dump holds (every group's
// ops in order, numbered per group, collectives apart from send/recv,
// sizes, dtypes, states, the calling site), when it is written (a
// timeout before the error reaches the caller, SIGUSR1, on request), that
// a program's own SIGUSR1 handler is left alone, the ring's size, and
// ops from several threads on several groups at once (run under TSan).
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tdist/tdist.h"
#include "tests/util/process.h"
#include "tests/util/world.h"

namespace {

using nlohmann::json;
using tdist::ProcessGroup;
using tdist::test::run_world;
using tdist::test::TempDir;

json read_dump(const std::string& path) {
  const std::string text = tdist::test::read_all(path);
  WORLD_CHECK(!text.empty(), "no dump at " << path);
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    WORLD_CHECK(false, path << " is not JSON (" << e.what() << "):\n" << text);
  }
  return {};
}

std::string dump_path(const std::string& dir, int rank) { return dir + "/rank-" + std::to_string(rank) + ".json"; }

// The entries of group `name`, oldest first.
std::vector<json> entries_of(const json& dump, const std::string& name) {
  std::vector<json> out;
  for (const auto& e : dump["entries"]) {
    if (e["process_group"][0] == name) out.push_back(e);
  }
  return out;
}

TEST(FlightRecorder, ADumpHoldsEveryGroupsOpsInOrderNumberedPerGroup) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    const int r = pg.rank();
    auto sub = pg.new_group({0, 1});
    at::Tensor t = at::ones({6});
    tdist::CollectiveOptions at_once;  // run on this thread as it is called: recorded as it starts
    at_once.async_op = false;
    pg.all_gather_into_tensor(at::empty({12}), t, at_once);
    pg.all_reduce(t)->wait();
    at::Tensor d = at::zeros({3}, at::kDouble);
    pg.broadcast(d, {0})->wait();
    if (r == 0) {
      pg.send(at::ones({5}), 1)->wait();
    } else {
      at::Tensor in = at::empty({5});
      pg.recv(in, 0)->wait();
    }
    sub->all_reduce(t)->wait();
    at::Tensor out = at::empty({12});
    pg.all_gather_into_tensor(out, t)->wait();
    const std::string path = tdist::trace::dump_flight_recorder();
    WORLD_CHECK(path == dump_path(dir.path(), r), path);
    const json dump = read_dump(path);
    WORLD_CHECK(dump["rank"] == r && dump["world_size"] == 2 && dump["reason"] == "request", dump["reason"]);
    WORLD_CHECK(dump["pg_config"]["world"]["ranks"] == "[0, 1]", dump["pg_config"].dump());
    WORLD_CHECK(dump["pg_config"]["world"]["desc"] == "default_pg", dump["pg_config"].dump());
    // The backend of each device, as PyTorch writes it when they differ ("cpu:shm,cuda:nccl").
    const std::string cpu = pg.backend_name(), cuda = pg.backend_name(c10::kCUDA);
    const std::string backends = cuda == cpu ? cpu : "cpu:" + cpu + ",cuda:" + cuda;
    WORLD_CHECK(dump["pg_config"]["world"]["backend"] == backends, dump["pg_config"].dump());
    WORLD_CHECK(dump["pg_config"].contains("world/0"), dump["pg_config"].dump());
    // The world's ops after init's own: all_reduce, broadcast, then send or recv apart, all_gather;
    // every op with the time it was queued.
    std::vector<json> world = entries_of(dump, "world");
    WORLD_CHECK(world.size() >= 4, world.size());
    std::vector<std::string> mine;
    for (size_t k = world.size() - 4; k < world.size(); ++k) mine.push_back(world[k]["profiling_name"]);
    const std::vector<std::string> want_mine = {"tdist:all_reduce", "tdist:broadcast", r == 0 ? "tdist:send" : "tdist:recv",
                                                "tdist:all_gather_into_tensor"};
    WORLD_CHECK(mine == want_mine, "the last four ops: " << json(mine).dump());
    for (const auto& e : world) WORLD_CHECK(e["time_created_ns"].get<int64_t>() > 0, e.dump());
    const json& last = world.back();
    WORLD_CHECK(last["profiling_name"] == "tdist:all_gather_into_tensor", last.dump());
    WORLD_CHECK(last["input_sizes"] == json::parse("[[6]]") && last["output_sizes"] == json::parse("[[12]]"), last.dump());
    WORLD_CHECK(last["state"] == "completed" && last["retired"] == true, last.dump());
    WORLD_CHECK(last["time_discovered_completed_ns"].get<int64_t>() >= last["time_discovered_started_ns"].get<int64_t>(),
                last.dump());
    // Collectives numbered 1, 2, ... without gaps; the p2p op on its own count.
    int64_t want = 1;
    int p2p = 0;
    for (const auto& e : world) {
      if (e["is_p2p"] == true) {
        ++p2p;
        WORLD_CHECK(e["p2p_seq_id"] == 1 && e["collective_seq_id"] == 0, e.dump());
        WORLD_CHECK(e["profiling_name"] == (r == 0 ? "tdist:send" : "tdist:recv") && e["peer"] == 1 - r, e.dump());
        continue;
      }
      WORLD_CHECK(e["collective_seq_id"] == want, e.dump() << " wanted #" << want);
      ++want;
    }
    WORLD_CHECK(p2p == 1, p2p);
    const auto& status = dump["pg_status"]["world"];
    WORLD_CHECK(status["last_completed_collective"] == want - 1 && status["last_enqueued_p2p"] == 1, status.dump());
    WORLD_CHECK(status["last_enqueued_collective"] == want - 1 && status["last_started_collective"] == want - 1 &&
                    status["last_started_p2p"] == 1 && status["last_completed_p2p"] == 1,
                status.dump());
    // all_reduce then broadcast (float 6, double 3), in that order.
    size_t i = 0;
    while (i < world.size() && !(world[i]["profiling_name"] == "tdist:all_reduce")) ++i;
    WORLD_CHECK(i + 1 < world.size(), "no all_reduce");
    WORLD_CHECK(world[i]["input_dtypes"] == json::parse("[\"Float\"]") && world[i]["input_sizes"] == json::parse("[[6]]"),
                world[i].dump());
    WORLD_CHECK(world[i + 1]["profiling_name"] == "tdist:broadcast" && world[i + 1]["input_dtypes"][0] == "Double",
                world[i + 1].dump());
    // The subgroup's own count.
    std::vector<json> s = entries_of(dump, "world/0");
    WORLD_CHECK(!s.empty() && s.back()["profiling_name"] == "tdist:all_reduce", s.size());
    WORLD_CHECK(s.back()["collective_seq_id"].get<int64_t>() == static_cast<int64_t>(s.size()), s.back().dump());
  }), "");
}

TEST(FlightRecorder, ATimeoutDumpsEveryRankThatWaitsBeforeTheErrorReachesIt) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    at::Tensor t = at::ones({4});
    pg.all_reduce(t)->wait();
    if (pg.rank() == 0) {
      // Rank 1 "skips" this one: rank 0 times out in it.
      tdist::AllreduceOptions o;
      o.timeout = std::chrono::milliseconds(1500);
      bool timed_out = false;
      try {
        pg.all_reduce(t, o)->wait();
      } catch (const tdist::TimeoutError&) {
        timed_out = true;
        // The dump is there as the error arrives.
        const json dump = read_dump(dump_path(dir.path(), 0));
        WORLD_CHECK(dump["reason"] == "timeout", dump["reason"]);
        const json last = entries_of(dump, "world").back();
        WORLD_CHECK(last["state"] == "failed" && last["profiling_name"] == "tdist:all_reduce", last.dump());
        WORLD_CHECK(last["error"].get<std::string>().find("all_reduce") != std::string::npos, last.dump());
        WORLD_CHECK(last["timeout_ms"] == 1500, last.dump());
      }
      WORLD_CHECK(timed_out, "no timeout");
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(4));  // alive, elsewhere
    }
  }, [] {
    tdist::test::WorldOptions o;
    o.final_barrier = false;
    return o;
  }()), "");
}

TEST(FlightRecorder, APeersDeathDumpsTheRankThatSeesIt) {
  TempDir dir;
  const std::string failures = run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    at::Tensor t = at::ones({4});
    pg.all_reduce(t)->wait();
    if (pg.rank() == 1) _exit(0);  // gone without a word
    bool failed = false;
    try {
      pg.all_reduce(t)->wait();
    } catch (const tdist::PeerFailureError&) {
      failed = true;
      const json dump = read_dump(dump_path(dir.path(), 0));
      WORLD_CHECK(dump["reason"] == "peer failure", dump["reason"]);
      WORLD_CHECK(entries_of(dump, "world").back()["state"] == "failed", dump.dump());
    }
    WORLD_CHECK(failed, "no PeerFailureError");
  }, [] {
    tdist::test::WorldOptions o;
    o.final_barrier = false;
    return o;
  }());
  EXPECT_EQ(failures, "");
}

TEST(FlightRecorder, SigusrOneDumpsWhileTheRankGoesOn) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    at::Tensor t = at::ones({4});
    pg.all_reduce(t)->wait();
    const std::string path = dump_path(dir.path(), pg.rank());
    WORLD_CHECK(!std::filesystem::exists(path), path);
    raise(SIGUSR1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!std::filesystem::exists(path) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    const json dump = read_dump(path);
    WORLD_CHECK(dump["reason"] == "signal", dump["reason"]);
    pg.all_reduce(t)->wait();  // and the rank goes on
    WORLD_CHECK(t[0].item<float>() == 4, t[0].item<float>());
  }), "");
}

std::atomic<int> g_user_handler_calls{0};
void user_handler(int) { g_user_handler_calls.fetch_add(1); }

TEST(FlightRecorder, LeavesAProgramsOwnSigusrOneHandlerAlone) {
  TempDir dir;
  // A fresh process that installs its handler before its first group.
  const pid_t pid = tdist::test::fork_child([&] {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    struct sigaction sa {};
    sa.sa_handler = user_handler;
    sigaction(SIGUSR1, &sa, nullptr);
    tdist::InitOptions o;
    o.init_method = "file://" + dir.path() + "/store?rank=0&world_size=1";
    auto pg = tdist::init_process_group(o);
    at::Tensor t = at::ones({1});
    pg->all_reduce(t)->wait();
    raise(SIGUSR1);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    if (g_user_handler_calls.load() != 1) return 1;
    if (std::filesystem::exists(dump_path(dir.path(), 0))) return 2;  // dumped on the program's signal
    return 0;
  });
  const int status = tdist::test::wait_child(pid, std::chrono::seconds(60));
  EXPECT_TRUE(tdist::test::exited_ok(status)) << tdist::test::describe_status(status);
}

TEST(FlightRecorder, ADumpIsValidJsonWhateverTheNamesHold) {
  TempDir dir;
  const pid_t pid = tdist::test::fork_child([&] {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    tdist::InitOptions o;
    o.init_method = "file://" + dir.path() + "/store?rank=0&world_size=1";
    // A cut UTF-8 sequence, quotes, controls, bad lead bytes with continuations after them.
    o.group_name = std::string("caf\xc3\"q\\\n\x01\xff\xf5\x80\x80");
    auto pg = tdist::init_process_group(o);
    at::Tensor t = at::ones({1});
    pg->all_reduce(t)->wait();
    const json dump = json::parse(tdist::test::read_all(tdist::trace::dump_flight_recorder()));
    const std::string bad = "\xef\xbf\xbd";  // U+FFFD, for each byte that is not UTF-8
    const std::string want = "caf" + bad + "\"q\\\n\x01" + bad + bad + bad + bad;
    return dump["pg_config"].contains(want) && dump["entries"].back()["process_group"][0] == want ? 0 : 1;
  });
  const int status = tdist::test::wait_child(pid, std::chrono::seconds(60));
  EXPECT_TRUE(tdist::test::exited_ok(status)) << tdist::test::describe_status(status);
}

// A group made again under its name (init after destroy) is a new group
// in the dump ("world~1"): its numbers start again, apart from the first.
TEST(FlightRecorder, AGroupMadeAgainUnderItsNameIsANewGroup) {
  TempDir dir;
  const pid_t pid = tdist::test::fork_child([&] {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    at::Tensor t = at::ones({1});
    for (int round = 0; round < 2; ++round) {
      tdist::InitOptions o;
      o.init_method = "file://" + dir.path() + "/store" + std::to_string(round) + "?rank=0&world_size=1";
      auto pg = tdist::init_process_group(o);
      for (int i = 0; i < 3 - round; ++i) pg->all_reduce(t)->wait();
      tdist::destroy_process_group();
    }
    const json dump = json::parse(tdist::test::read_all(tdist::trace::dump_flight_recorder()));
    if (!dump["pg_config"].contains("world") || !dump["pg_config"].contains("world~1")) return 1;
    if (dump["pg_status"]["world~1"]["last_completed_collective"].get<int64_t>() >=
        dump["pg_status"]["world"]["last_completed_collective"].get<int64_t>()) {
      return 2;  // numbered apart: the second made fewer ops
    }
    return dump["entries"].back()["process_group"][0] == "world~1" ? 0 : 3;
  });
  const int status = tdist::test::wait_child(pid, std::chrono::seconds(60));
  EXPECT_TRUE(tdist::test::exited_ok(status)) << tdist::test::describe_status(status);
}

TEST(FlightRecorder, KeepsTheLastOpsOfARingOfTheSizeAsked) {
  TempDir dir;
  setenv("TDIST_FR_BUFFER_SIZE", "10", 1);
  const std::string failures = run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    at::Tensor t = at::ones({1});
    for (int i = 0; i < 25; ++i) pg.all_reduce(t)->wait();
    const json dump = read_dump(tdist::trace::dump_flight_recorder());
    WORLD_CHECK(dump["buffer_size"] == 10 && dump["entries"].size() == 10, dump["entries"].size());
    const int64_t last = dump["pg_status"]["world"]["last_completed_collective"];
    int64_t want = last - 9;
    for (const auto& e : dump["entries"]) {
      WORLD_CHECK(e["collective_seq_id"] == want, e.dump() << " wanted #" << want);
      ++want;
    }
  });
  unsetenv("TDIST_FR_BUFFER_SIZE");
  EXPECT_EQ(failures, "");
}

TEST(FlightRecorder, SizeZeroRecordsNothing) {
  setenv("TDIST_FR_BUFFER_SIZE", "0", 1);
  const std::string failures = run_world(2, [&](ProcessGroup& pg) {
    at::Tensor t = at::ones({1});
    pg.all_reduce(t)->wait();
    WORLD_CHECK(tdist::trace::dump_flight_recorder().empty(), "a dump with the recorder off");
  });
  unsetenv("TDIST_FR_BUFFER_SIZE");
  EXPECT_EQ(failures, "");
}

TEST(FlightRecorder, NamesTheDdpBucketAndCountsSteps) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup&) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    torch::manual_seed(0);
    auto net = torch::nn::Linear(8, 4);
    tdist::DistributedDataParallelOptions o;
    tdist::DistributedDataParallel<torch::nn::Linear> ddp(net, o);
    for (int step = 0; step < 3; ++step) {
      ddp->forward(torch::randn({2, 8})).sum().backward();
    }
    const json dump = read_dump(tdist::trace::dump_flight_recorder());
    WORLD_CHECK(dump["steps"] == 3, dump["steps"]);
    int buckets = 0;
    for (const auto& e : dump["entries"]) {
      if (e["site"].is_string() && e["site"] == "ddp bucket 0") ++buckets;
    }
    WORLD_CHECK(buckets == 3, buckets);
  }), "");
}

// Several threads, each with its own group, queue ops at once (sync and
// async): every op is recorded once, with its group's numbers in order.
TEST(FlightRecorder, OpsFromSeveralThreadsOnSeveralGroups) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    setenv("TDIST_DUMP_DIR", dir.path().c_str(), 1);
    constexpr int kThreads = 3, kOps = 200;
    std::vector<std::shared_ptr<ProcessGroup>> groups;
    for (int i = 0; i < kThreads; ++i) groups.push_back(pg.new_group({0, 1}));
    std::vector<std::thread> threads;
    std::atomic<bool> dumping{true};
    std::thread dumper([&] {
      while (dumping.load()) tdist::trace::dump_flight_recorder();
    });
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        at::Tensor t = at::ones({16});
        for (int k = 0; k < kOps; ++k) {
          tdist::AllreduceOptions o;
          o.async_op = k % 2 == 0;
          groups[i]->all_reduce(t, o)->wait();
        }
      });
    }
    for (auto& th : threads) th.join();
    dumping = false;
    dumper.join();
    const json dump = read_dump(tdist::trace::dump_flight_recorder());
    for (int i = 0; i < kThreads; ++i) {
      const std::string name = "world/" + std::to_string(i);
      std::vector<json> es = entries_of(dump, name);
      WORLD_CHECK(es.size() == kOps, name << ": " << es.size());
      for (size_t k = 0; k < es.size(); ++k) {
        WORLD_CHECK(es[k]["collective_seq_id"] == static_cast<int64_t>(k + 1) && es[k]["state"] == "completed",
                    es[k].dump());
      }
    }
  }), "");
}

// The timeline of a few FSDP steps and a DDP step: steps, each unit's
// forward and backward, the ops on the thread that ran them with their
// sites, waits, named tracks; valid Chrome trace JSON.
TEST(Timeline, HoldsStepsUnitsOpsAndWaitsOnNamedTracks) {
  TempDir dir;
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::trace::start_timeline(dir.path() + "/trace.json");
    torch::manual_seed(0);
    torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    tdist::FullyShardedDataParallel fsdp(seq, tdist::FullyShardedDataParallelOptions{});
    for (int step = 0; step < 3; ++step) fsdp->forward(torch::randn({4, 8})).sum().backward();
    const std::string path = tdist::trace::flush_timeline();
    WORLD_CHECK(path == dir.path() + "/trace.rank-" + std::to_string(pg.rank()) + ".json", path);
    const json t = json::parse(tdist::test::read_all(path));
    int steps = 0, forwards = 0, backwards = 0, gathers = 0, reduces = 0;
    std::map<int, std::string> tracks;
    std::set<int> step_tids;
    for (const auto& e : t["traceEvents"]) {
      WORLD_CHECK(e["pid"] == pg.rank(), e.dump());
      if (e["ph"] == "M" && e["name"] == "thread_name") tracks[e["tid"]] = e["args"]["name"];
      if (e["ph"] == "M") continue;
      const std::string name = e["name"], cat = e["cat"];
      if (cat == "step") {
        ++steps;
        step_tids.insert(e["tid"].get<int>());
      }
      if (cat == "compute" && name.rfind("forward ", 0) == 0) ++forwards;
      if (cat == "compute" && name.rfind("backward ", 0) == 0) ++backwards;
      if (cat == "comm" && name.rfind("all_gather_into_tensor_coalesced #", 0) == 0) ++gathers;
      if (cat == "comm" && name.rfind("reduce_scatter_tensor_coalesced #", 0) == 0) {
        ++reduces;
        WORLD_CHECK(e["args"]["group"] == "world" && e["args"]["site"].is_string(), e.dump());
      }
      if (e["ph"] == "X") WORLD_CHECK(e["dur"].get<double>() >= 0 && e["ts"].get<double>() > 1e15, e.dump());
    }
    WORLD_CHECK(steps == 3 && forwards == 3 && backwards == 3, steps << " " << forwards << " " << backwards);
    WORLD_CHECK(gathers >= 3 && reduces == 3, gathers << " " << reduces);
    WORLD_CHECK(step_tids.size() == 1 && tracks[*step_tids.begin()] == "main", tracks.size());
    WORLD_CHECK(t["otherData"]["dropped_events"] == 0 && t["otherData"]["world_size"] == 2, t["otherData"].dump());
  }), "");
}

}  // namespace
