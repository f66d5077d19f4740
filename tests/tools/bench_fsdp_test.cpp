// tdist-bench fsdp end to end on a tiny ViT at world size 2: every variant
// runs, and what the rows measure holds together. Sizes only, never times:
// bf16 halves the bytes gathered and reduced and the activations kept,
// checkpointing keeps far fewer activations, the state at the peak lies
// within the peak, DDP gathers nothing.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <string>

#include "tests/util/process.h"
#include "tests/util/paths.h"

using namespace std::chrono_literals;
namespace test = tdist::test;

namespace {

const std::string kBench = tdist::test::bin_dir() + "/tdist-bench";

TEST(BenchFsdp, EveryVariantRunsAndItsRowsHoldTogether) {
  test::TempDir dir;
  const std::string json = dir.path() + "/fsdp.json";
  auto r = test::run_command(kBench + " fsdp --model vit --blocks 2 --width 64 --hidden 128 --heads 4 --batch 32"
                                      " --rounds 1 --steps 2 --json " + json,
                             100s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("act kept"), std::string::npos) << r.output;
  std::ifstream f(json);
  ASSERT_TRUE(f.good()) << "no JSON written";
  const auto rows = nlohmann::json::parse(f);
  std::map<std::string, nlohmann::json> by;
  for (const auto& row : rows) by[row.at("variant").get<std::string>()] = row;
  for (const char* v : {"ddp", "no_shard", "shard_grad_op", "full_shard", "full_shard_ckpt", "full_shard_bf16",
                        "full_shard_ckpt_bf16"}) {
    ASSERT_TRUE(by.count(v)) << "no row for " << v;
    const auto& row = by[v];
    EXPECT_GT(row.at("ms_per_step").get<double>(), 0) << v;
    EXPECT_GT(row.at("state_bytes").get<double>(), 0) << v;
    EXPECT_LE(row.at("state_bytes").get<double>(), row.at("peak_bytes").get<double>()) << v;
    EXPECT_GT(row.at("activation_bytes").get<double>(), 0) << v;
    EXPECT_GE(row.at("activation_peak_bytes").get<double>(), row.at("activation_bytes").get<double>()) << v;
    EXPECT_GT(row.at("reduced_bytes_per_step").get<double>(), 0) << v;
  }
  auto get = [&](const char* v, const char* field) { return by[v].at(field).get<double>(); };
  EXPECT_EQ(get("ddp", "gathered_bytes_per_step"), 0);
  EXPECT_GT(get("full_shard", "gathered_bytes_per_step"), get("shard_grad_op", "gathered_bytes_per_step"))
      << "FULL_SHARD gathers again in backward";
  EXPECT_NEAR(get("full_shard_bf16", "gathered_bytes_per_step") / get("full_shard", "gathered_bytes_per_step"), 0.5,
              0.01);
  EXPECT_NEAR(get("full_shard_bf16", "reduced_bytes_per_step") / get("full_shard", "reduced_bytes_per_step"), 0.5,
              0.01);
  EXPECT_NEAR(get("full_shard_bf16", "activation_bytes") / get("full_shard", "activation_bytes"), 0.5, 0.1);
  EXPECT_LT(get("full_shard_ckpt", "activation_bytes"), 0.3 * get("full_shard", "activation_bytes"));
  EXPECT_LT(get("full_shard_ckpt", "activation_peak_bytes"), get("full_shard", "activation_peak_bytes"));
  EXPECT_EQ(get("full_shard_ckpt", "gathered_bytes_per_step"), get("full_shard", "gathered_bytes_per_step"));
}

TEST(BenchFsdp, AnUnknownVariantIsNamed) {
  auto r = test::run_command(kBench + " fsdp --variants full_shard,zero4 --rounds 1 --steps 1", 60s);
  EXPECT_FALSE(test::exited_ok(r.status));
  EXPECT_NE(r.output.find("unknown variant 'zero4'"), std::string::npos) << r.output;
}

}  // namespace
