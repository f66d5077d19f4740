// tdist-bench collectives end to end at world size 2: every op of issue 18
// has a checked row per size, on ordinary and on symmetric tensors, and the
// columns hold together with the memory model (bench/collective_model.h).
// Numbers are checked against each other, never against a speed.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <string>
#include <unistd.h>

#include "bench/collective_model.h"
#include "tests/util/process.h"
#include "tests/util/paths.h"

using namespace std::chrono_literals;
namespace test = tdist::test;
namespace bench = tdist::bench;

namespace {

const std::string kBench = tdist::test::bin_dir() + "/tdist-bench";

nlohmann::json run_bench(const std::string& extra, std::string* output) {
  test::TempDir dir;
  const std::string json = dir.path() + "/collectives.json";
  auto r = test::run_command(kBench + " collectives --world-size 2 --op all_reduce,reduce_scatter,all_gather,broadcast"
                                      " --min-bytes 4K --max-bytes 64K --step-factor 16 --seconds 0.01 --json " +
                                 json + extra,
                             100s);
  *output = r.output;
  EXPECT_TRUE(test::exited_ok(r.status)) << r.output;
  std::ifstream f(json);
  if (!f.good()) return nlohmann::json::array();
  return nlohmann::json::parse(f);
}

void check_rows(const nlohmann::json& rows, double symmetric) {
  std::map<std::string, int> per_op;
  const int cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  for (const auto& row : rows) {
    const std::string op = row.at("op");
    ++per_op[op];
    SCOPED_TRACE(op + " " + std::to_string(row.at("bytes").get<double>()));
    EXPECT_EQ(row.at("wrong").get<double>(), 0);
    EXPECT_EQ(row.at("symmetric").get<double>(), symmetric);
    const double t = row.at("time_us"), p99 = row.at("p99_us");
    EXPECT_GT(t, 0);
    EXPECT_GE(p99, t);
    EXPECT_GE(row.at("iters").get<double>(), 20);
    const double busbw = row.at("busbw_GBps"), algbw = row.at("algbw_GBps");
    EXPECT_NEAR(algbw, row.at("bytes").get<double>() / (t * 1e-6) / 1e9, algbw * 1e-3);
    EXPECT_NEAR(busbw, algbw * bench::bus_factor(op, 2), busbw * 1e-3);
    const double rate = bench::usable_copy_rate(2, cores, row.at("memcpy_one_core_GBps"),
                                                row.at("memcpy_all_cores_GBps"));
    const double ceiling = row.at("ceiling_busbw_GBps");
    EXPECT_GT(ceiling, 0);
    EXPECT_NEAR(ceiling, bench::ceiling_busbw(op, 2, rate), ceiling * 1e-3);
    EXPECT_NEAR(row.at("of_ceiling").get<double>(), busbw / ceiling, 1e-3 + busbw / ceiling * 1e-3);
  }
  for (const char* op : {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}) {
    EXPECT_EQ(per_op[op], 2) << op << ": one row per size (4 KiB, 64 KiB)";
  }
}

TEST(BenchCollectives, EveryOpHasCheckedRowsThatHoldTogether) {
  std::string out;
  const auto rows = run_bench("", &out);
  EXPECT_NE(out.find("of ceil"), std::string::npos) << out;
  check_rows(rows, 0);
}

TEST(BenchCollectives, SymmetricTensorsToo) {
  std::string out;
  check_rows(run_bench(" --symmetric", &out), 1);
}

// --api c: every op through the C ABI, checked as the C++ ones are, and
// the overhead line with what the C ABI adds (a number, not a speed).
TEST(BenchCollectives, TheCAbiToo) {
  std::string out;
  const auto rows = run_bench(" --api c", &out);
  EXPECT_NE(out.find("through the C ABI"), std::string::npos) << out;
  EXPECT_NE(out.find("the C ABI adds"), std::string::npos) << out;
  check_rows(rows, 0);
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("api"), "c");
    EXPECT_GT(row.at("c_api_op_ns").get<double>(), 0);
    EXPECT_GT(row.at("cpp_op_ns").get<double>(), 0);
    EXPECT_TRUE(row.contains("c_api_extra_ns"));
  }
}

// The model itself: the busbw a time at the ceiling shows is the ceiling.
TEST(CollectiveModel, CeilingTimeAndBusbwAgree) {
  for (const char* op : {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}) {
    for (int n : {2, 3, 4}) {
      const double s = 1 << 20, rate = 10e9;
      const double t = bench::ceiling_seconds(op, n, s, rate);
      EXPECT_NEAR(bench::bus_factor(op, n) * s / t, bench::ceiling_busbw(op, n, rate), 1.0) << op << " " << n;
    }
  }
  // World 2 all_reduce: half the copy rate (each rank copies S bytes' worth).
  EXPECT_DOUBLE_EQ(bench::ceiling_busbw("all_reduce", 2, 20e9), 10e9);
  EXPECT_DOUBLE_EQ(bench::usable_copy_rate(2, 2, 8, 15), 15);
  EXPECT_DOUBLE_EQ(bench::usable_copy_rate(1, 4, 8, 15), 8);
}

}  // namespace
