// examples/gpt.cpp against Hugging Face's own GPT2LMHeadModel (transformers
// in .venv, through gpt_hf_check.py): a model made and saved by Python
// loads into build/bin/gpt under tdist-run at worlds 2 and 3 and gives
// Python's validation loss; training lowers it; what gpt saves loads back
// into GPT2LMHeadModel with no missing or unexpected key, bit for bit, and
// gives the loss gpt printed; a hostile config.json is refused by name.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "tests/util/process.h"
#include "tests/util/resume_check.h"
#include "tests/util/paths.h"

using namespace std::chrono_literals;
namespace test = tdist::test;

namespace {

const std::string kRun = tdist::test::bin_dir() + "/tdist-run";
const std::string kGpt = tdist::test::bin_dir() + "/gpt";
const std::string kPython = tdist::test::source_dir() + "/.venv/bin/python";
const std::string kCheck = tdist::test::source_dir() + "/tests/examples/gpt_hf_check.py";

// The numbers after "key=" on the last line that has them.
double value_of(const std::string& output, const std::string& key) {
  const std::regex re(key + "=([-+0-9.eE]+)");
  double v = -1;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re); it != std::sregex_iterator(); ++it) {
    v = std::stod((*it)[1].str());
  }
  if (v < 0) ADD_FAILURE() << "no " << key << "= in:\n" << output;
  return v;
}

test::CommandResult python(const std::string& args) {
  return test::run_command(kPython + " " + kCheck + " " + args + " 2>&1", 300s);
}

// One Hugging Face model and one text for the whole suite (Python takes
// seconds to start).
class GptExample : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir;
    // English text that changes with the repository: its docs.
    data_ = dir_->path() + "/text.txt";
    auto r = test::run_command("cat " + tdist::test::source_dir() + "/README.md " + tdist::test::source_dir() + "/docs/*.md > " + data_, 30s);
    ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
    hf_ = dir_->path() + "/hf";
    r = python("make " + hf_ + " --n-layer 2 --n-head 2 --n-embd 32 --n-positions 64 --seed 3 --max-shard-size 60KB");
    ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
    ready_ = true;
  }
  // gtest skips the tests of a suite whose SetUpTestSuite failed: fail them.
  void SetUp() override {
    if (!ready_) FAIL() << "the suite's setup failed (its message is above)";
  }
  static void TearDownTestSuite() {
    ready_ = false;
    delete dir_;
    dir_ = nullptr;
  }
  static std::string gpt(int world, const std::string& args) {
    return kRun + " --nproc-per-node " + std::to_string(world) + " " + kGpt + " --data " + data_ +
           " --block-size 32 --sample-bytes 0 --quiet " + args + " 2>&1";
  }
  test::TempDir own_;  // this test's outputs
  static test::TempDir* dir_;
  static std::string data_, hf_;
  static bool ready_;
};
test::TempDir* GptExample::dir_ = nullptr;
bool GptExample::ready_ = false;
std::string GptExample::data_, GptExample::hf_;

TEST_F(GptExample, GivesHuggingFacesValidationLossAtWorldsTwoAndThree) {
  auto py = python("val " + hf_ + " " + data_ + " 32");
  ASSERT_TRUE(test::exited_ok(py.status)) << py.output;
  const double expected = value_of(py.output, "val_loss");
  for (const auto& [world, mode] : {std::pair{2, "--fsdp full"}, std::pair{3, "--fsdp grad_op"}, std::pair{2, "--ddp"}}) {
    auto r = test::run_command(gpt(world, "--from-pretrained " + hf_ + " --eval-only " + mode), 180s);
    ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
    EXPECT_NEAR(value_of(r.output, "val_loss"), expected, 1e-4 * expected) << "world " << world << " " << mode;
  }
}

TEST_F(GptExample, TrainsAndSavesWhatFromPretrainedLoadsBitForBit) {
  const std::string out = own_.path() + "/trained";
  auto r = test::run_command(gpt(3, "--from-pretrained " + hf_ + " --steps 40 --batch-size 4 --lr 3e-3 --warmup 5 "
                                    "--eval-interval 40 --save-pretrained " + out + " --max-shard-size 50KB"),
                             300s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("step 0: val_loss ([0-9.]+)"))) << r.output;
  const double before = std::stod(m[1].str());
  const double after = value_of(r.output, "val_loss");
  EXPECT_LT(after, before - 0.3) << r.output;

  auto load = python("load " + out);
  ASSERT_TRUE(test::exited_ok(load.status)) << load.output;
  std::ifstream index(out + "/model.safetensors.index.json");
  EXPECT_TRUE(index.good()) << "50KB shards: an index expected";
  auto py = python("val " + out + " " + data_ + " 32");
  ASSERT_TRUE(test::exited_ok(py.status)) << py.output;
  EXPECT_NEAR(value_of(py.output, "val_loss"), after, 1e-4 * after);
}

TEST_F(GptExample, DdpAndFsdpTrainToTheSameWeights) {
  const std::string fsdp = own_.path() + "/fsdp", ddp = own_.path() + "/ddp";
  const std::string common = "--from-pretrained " + hf_ + " --steps 6 --batch-size 2 --eval-batch 64 --save-pretrained ";
  auto r = test::run_command(gpt(2, common + fsdp + " --skip-eval"), 180s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_EQ(r.output.find("val_loss="), std::string::npos) << "--skip-eval evaluated:\n" << r.output;
  r = test::run_command(gpt(2, common + ddp + " --ddp --activation-checkpointing"), 180s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  auto same = python("same " + fsdp + " " + ddp);
  ASSERT_TRUE(test::exited_ok(same.status)) << same.output;
  EXPECT_LT(value_of(same.output, "max_rel_diff"), 1e-5) << same.output;
}

// --checkpoint-dir/--checkpoint-every: a rank killed under tdist-run
// --max-restarts; the ranks resume by themselves and end with the weights
// of a run that never stopped (AdamW's state, the learning-rate schedule,
// the batches and the RNGs all continue).
TEST_F(GptExample, AKilledRankRestartsAndResumesBitForBit) {
  test::expect_a_killed_rank_to_resume_bit_for_bit(
      kRun + " --nproc-per-node 2", kGpt, "gpt",
      "--data " + data_ + " --n-layer 2 --n-head 2 --n-embd 32 --block-size 32 --batch-size 4 --steps 200 "
      "--warmup 4 --skip-eval --sample-bytes 0 --quiet",
      3, 9, 200);
}

// A conversion (no training, no evaluation, no sample) of a model whose
// n_positions (64) is below the default block size (128) reads no data and
// is not refused; a run that evaluates takes the model's n_positions as its
// block size, as Hugging Face's scripts do; a --block-size longer than
// n_positions is refused where windows are used.
TEST_F(GptExample, TheBlockSizeFollowsTheModelAndAConversionNeedsNoData) {
  const std::string out = own_.path() + "/converted";
  auto r = test::run_command(kRun + " --nproc-per-node 2 " + kGpt + " --from-pretrained " + hf_ +
                                 " --steps 0 --skip-eval --sample-bytes 0 --save-pretrained " + out +
                                 " --data /nonexistent/text 2>&1",
                             180s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  auto same = python("same " + hf_ + " " + out);
  ASSERT_TRUE(test::exited_ok(same.status)) << same.output;
  EXPECT_EQ(value_of(same.output, "max_rel_diff"), 0) << same.output;

  r = test::run_command(kRun + " --nproc-per-node 2 " + kGpt + " --from-pretrained " + hf_ + " --data " + data_ +
                            " --eval-only --sample-bytes 0 --quiet 2>&1",
                        180s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  const auto want = python("val " + hf_ + " " + data_ + " 64");
  ASSERT_TRUE(test::exited_ok(want.status)) << want.output;
  EXPECT_NEAR(value_of(r.output, "val_loss"), value_of(want.output, "val_loss"), 1e-4) << r.output << want.output;

  r = test::run_command(kRun + " --nproc-per-node 2 " + kGpt + " --from-pretrained " + hf_ + " --data " + data_ +
                            " --eval-only --block-size 65 --quiet 2>&1",
                        180s);
  EXPECT_FALSE(test::exited_ok(r.status)) << r.output;
  EXPECT_NE(r.output.find("--block-size 65 is longer than the model's n_positions (64)"), std::string::npos) << r.output;
}

TEST_F(GptExample, AFreshBf16ModelTrains) {
  auto r = test::run_command(gpt(2, "--n-layer 1 --n-head 2 --n-embd 32 --steps 8 --batch-size 2 --precision bf16 "
                                    "--activation-checkpointing --sample-bytes 20 --prompt Hello"),
                             180s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  const double v = value_of(r.output, "val_loss");
  EXPECT_GT(v, 0);
  EXPECT_LT(v, 10);
}

// gpt holds glibc's mmap threshold at 4 MiB unless told (docs/gpt.md):
// the flag sets another, 0 leaves glibc's own, and the environment's
// MALLOC_MMAP_THRESHOLD_ stays when the flag is not given.
TEST_F(GptExample, TheMallocThresholdIsFourMiBUnlessTold) {
  const auto threshold = [&](const std::string& env, const std::string& flag) {
    const std::string json = own_.path() + "/t.json";
    auto r = test::run_command(env + " " + gpt(1, "--steps 0 --skip-eval --json " + json + " " + flag), 60s);
    EXPECT_TRUE(test::exited_ok(r.status)) << r.output;
    std::ifstream in(json);
    return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false).value("malloc_mmap_threshold", -7);
  };
  EXPECT_EQ(threshold("", ""), 4 << 20);
  EXPECT_EQ(threshold("", "--malloc-mmap-threshold 0"), 0);
  EXPECT_EQ(threshold("", "--malloc-mmap-threshold 1048576"), 1 << 20);
  EXPECT_EQ(threshold("MALLOC_MMAP_THRESHOLD_=2097152", ""), 2 << 20);
  EXPECT_EQ(threshold("MALLOC_MMAP_THRESHOLD_=2097152", "--malloc-mmap-threshold 65536"), 65536);
}

// Older GPT-2 checkpoints (the hub's "gpt2" among them) also carry each
// block's causal mask as h.N.attn.bias and h.N.attn.masked_bias: gpt skips
// them and gives transformers' loss.
TEST_F(GptExample, OldCheckpointsWithTheirAttentionMasksLoad) {
  const std::string hf = own_.path() + "/old";
  auto r = python("make " + hf + " --n-layer 2 --n-head 2 --n-embd 32 --n-positions 64 --seed 3 --old-masks");
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  auto py = python("val " + hf_ + " " + data_ + " 32");  // the same weights without the masks
  ASSERT_TRUE(test::exited_ok(py.status)) << py.output;
  r = test::run_command(kGpt + " --from-pretrained " + hf + " --data " + data_ + " --block-size 32 --eval-only 2>&1", 120s);
  ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
  EXPECT_NEAR(value_of(r.output, "val_loss"), value_of(py.output, "val_loss"), 1e-4 * value_of(py.output, "val_loss"));
}

TEST_F(GptExample, AHostileConfigIsRefusedByName) {
  const std::string hf = own_.path() + "/hf";
  for (const auto& [field, value] : {std::pair{"n_embd", "33"}, std::pair{"n_layer", "1e12"},
                                     std::pair{"vocab_size", "12"}, std::pair{"model_type", "\"llama\""}}) {
    auto r = test::run_command("rm -rf " + hf + " && cp -r " + hf_ + " " + hf, 30s);
    ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
    r = python("set " + hf + "/config.json " + field + " '" + value + "'");
    ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
    r = test::run_command(kGpt + " --from-pretrained " + hf + " --data " + data_ + " --eval-only 2>&1", 60s);
    EXPECT_FALSE(test::exited_ok(r.status)) << field << ": " << r.output;
    EXPECT_NE(r.output.find("config.json"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(field), std::string::npos) << r.output;
  }
  // A model too big for any machine of today (2 blocks 65536 wide: 10^11
  // parameters), from a tiny file: refused before any of it is allocated,
  // naming the file and the sizes. (Without the check the first block's
  // 51 GB c_attn weight fails to allocate at once, with LibTorch's message.)
  {
    auto r = test::run_command("rm -rf " + hf + " && cp -r " + hf_ + " " + hf, 30s);
    ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
    r = python("set " + hf + "/config.json n_embd 65536");
    ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
    r = test::run_command(kGpt + " --from-pretrained " + hf + " --data " + data_ + " --eval-only 2>&1", 60s);
    EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 1) << r.output;
    EXPECT_NE(r.output.find("config.json (n_layer, n_embd"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("GiB available"), std::string::npos) << r.output;
  }
  // Nested 300000 deep in a 600 KB file (anything that walked that tree
  // recursively would overflow its stack): refused as it is parsed.
  {
    auto r = test::run_command("rm -rf " + hf + " && cp -r " + hf_ + " " + hf, 30s);
    ASSERT_TRUE(test::exited_ok(r.status)) << r.output;
    std::stringstream text;
    text << std::ifstream(hf + "/config.json").rdbuf();
    std::string json = text.str();
    ASSERT_EQ(json.at(0), '{');
    json.insert(1, "\"extra\": " + std::string(300000, '[') + std::string(300000, ']') + ", ");
    std::ofstream(hf + "/config.json", std::ios::trunc) << json;
    r = test::run_command(kGpt + " --from-pretrained " + hf + " --data " + data_ + " --eval-only 2>&1", 60s);
    EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 1) << r.output;
    EXPECT_NE(r.output.find("config.json: nested deeper than"), std::string::npos) << r.output;
  }
  const auto r = test::run_command(kGpt + " --from-pretrained " + hf_ + " --data " + data_ + " --eval-only --skip-eval 2>&1", 60s);
  EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 2) << r.output;
  EXPECT_NE(r.output.find("--skip-eval"), std::string::npos) << r.output;
}

}  // namespace
