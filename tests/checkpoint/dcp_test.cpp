// PyTorch's Distributed Checkpoint (DCP) folders read by tdist: PyTorch
// 2.x (the venv's) trains an FSDP2 model with AdamW at world 2 and saves it
// with dcp.save; tdist loads it at worlds 1 (a plain model) and 3 (FSDP,
// each rank reading only the chunks over its rows) and holds exactly
// PyTorch's full state, model and optimizer; the safetensors variant too;
// a .metadata made to run code on load is refused by name and runs nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "formats/dcp_metadata.h"
#include "tdist/pretrained.h"
#include "tdist/tdist.h"
#include "tests/util/process.h"
#include "tests/util/world.h"
#include "tests/util/paths.h"

namespace {

namespace fs = std::filesystem;
using tdist::CheckpointError;
using tdist::FSDP;
using tdist::ProcessGroup;
using tdist::StateDict;
using tdist::test::run_world;
using tdist::test::TempDir;

const std::string kCheck = tdist::test::source_dir() + "/tests/checkpoint/dcp_check.py";
const std::string kVenvPython = tdist::test::source_dir() + "/.venv/bin/python";

// PyTorch's side of a check. Its gloo group (the reference, not what is
// under test) once failed to start under a loaded clean room: one retry,
// and both outputs in the error when the second fails too.
void python(const std::string& args) {
  std::string failures;
  for (int attempt = 1; attempt <= 2; ++attempt) {
    const auto r = tdist::test::run_command(kVenvPython + " " + kCheck + " " + args + " 2>&1", std::chrono::seconds(300));
    if (tdist::test::exited_ok(r.status)) {
      if (!failures.empty()) std::fprintf(stderr, "dcp_check.py %s passed on retry after:\n%s\n", args.c_str(), failures.c_str());
      return;
    }
    failures += "attempt " + std::to_string(attempt) + ":\n" + r.output + "\n";
  }
  throw std::runtime_error("dcp_check.py " + args + " failed:\n" + failures);
}

// dcp_check.py's Net, in C++.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(7, 5));
    fc2 = register_module("fc2", torch::nn::Linear(5, 7));
    gate = register_parameter("gate", torch::linspace(0.5, 1.5, 7), /*requires_grad=*/false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2->forward(torch::tanh(fc1->forward(x))) * gate; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor gate;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(const tdist::FullyShardedDataParallelOptions* wrap = nullptr) {
    in = register_module("in", torch::nn::Linear(6, 7));
    for (int i = 0; i < 3; ++i) {
      const std::string name = "block" + std::to_string(i);
      if (wrap) {
        auto b = register_module(name, FSDP<Block>(Block(), *wrap));
        calls.push_back([b](const torch::Tensor& x) { return b->forward(x); });
      } else {
        auto b = register_module(name, Block());
        calls.push_back([b](const torch::Tensor& x) { return b->forward(x); });
      }
    }
    scale = register_parameter("scale", torch::ones({1}));
    head = register_module("head", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in->forward(x);
    for (auto& c : calls) h = c(h);
    return head->forward(h * scale);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::Tensor scale;
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> calls;
};
TORCH_MODULE(Net);

class Dcp : public ::testing::Test {
 protected:
  // A failure here must fail the tests, not skip them (gtest skips a
  // suite whose SetUpTestSuite failed): it is kept and raised by SetUp.
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    try {
      python("save " + ckpt() + " 2 " + ref());
    } catch (const std::exception& e) {
      setup_error_ = new std::string(e.what());
    }
  }
  void SetUp() override {
    if (setup_error_) FAIL() << "PyTorch's reference checkpoint: " << *setup_error_;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
    delete setup_error_;
    setup_error_ = nullptr;
  }
  static std::string ckpt() { return dir_->path() + "/dcp"; }
  static std::string ref() { return dir_->path() + "/ref.safetensors"; }
  static TempDir* dir_;
  static std::string* setup_error_;
};
TempDir* Dcp::dir_ = nullptr;
std::string* Dcp::setup_error_ = nullptr;

// The model's and optimizer's full state equal PyTorch's, bit for bit
// (the step, a float in PyTorch and an int in tdist, by value).
void expect_pytorch_state(torch::nn::Module& model, torch::optim::Optimizer& opt, const std::string& ref,
                          const std::string& what) {
  const StateDict want = tdist::load_safetensors(ref);
  const StateDict full = tdist::full_state_dict(model, false);
  const auto optim = tdist::full_optimizer_state_dict(model, opt, false);
  size_t n = 0;
  for (const auto& item : full) {
    WORLD_CHECK(want.contains(item.key()) && torch::equal(want[item.key()], item.value()),
                what << ": '" << item.key() << "' differs from PyTorch's");
    ++n;
  }
  for (const auto& p : optim.state) {
    for (const auto& f : p.value()) {
      const std::string name = "optim/" + p.key() + "/" + f.key();
      WORLD_CHECK(want.contains(name), what << ": PyTorch has no '" << name << "'");
      const bool same = f.key() == "step" ? want[name].item<double>() == f.value().item<double>()
                                          : torch::equal(want[name], f.value());
      WORLD_CHECK(same, what << ": '" << name << "' differs from PyTorch's");
      ++n;
    }
  }
  WORLD_CHECK(n == want.size(), what << ": " << n << " tensors against PyTorch's " << want.size());
}

TEST_F(Dcp, LoadsIntoAPlainModelAtWorldOne) {
  ASSERT_EQ(run_world(1, [&](ProcessGroup& pg) {
    torch::manual_seed(5);
    Net model;
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
    tdist::load_sharded_checkpoint(ckpt(), pg, *model, &opt);
    expect_pytorch_state(*model, opt, ref(), "world 1");
    WORLD_CHECK(static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options()).lr() == 0.01,
                "the lr is PyTorch's");
  }), "");
}

TEST_F(Dcp, LoadsIntoFsdpAtWorldThree) {
  ASSERT_EQ(run_world(3, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(5);
    FSDP<Net> model(Net(&o), o);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
    tdist::load_sharded_checkpoint(ckpt(), pg, *model, &opt);
    expect_pytorch_state(*model, opt, ref(), "world 3");
  }), "");
}

TEST_F(Dcp, TorchtitansLayoutLoadsWithItsFlattenedOptimizer) {
  const std::string titan = dir_->path() + "/titan", titan_ref = dir_->path() + "/titan_ref.safetensors";
  python("save " + titan + " 2 " + titan_ref + " titan");
  for (int world : {1, 3}) {
    ASSERT_EQ(run_world(world, [&](ProcessGroup& pg) {
      tdist::FullyShardedDataParallelOptions o;
      std::shared_ptr<torch::nn::Module> model;
      if (pg.size() == 1) {
        model = Net().ptr();
      } else {
        model = FSDP<Net>(Net(&o), o).ptr();
      }
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
      tdist::load_sharded_checkpoint(titan, pg, *model, &opt);
      expect_pytorch_state(*model, opt, titan_ref, "torchtitan's layout at world " + std::to_string(pg.size()));
      WORLD_CHECK(static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options()).lr() == 0.01, "lr");
    }), "");
  }
}

TEST_F(Dcp, TheSafetensorsVariantLoadsToo) {
  const std::string st = dir_->path() + "/st", st_ref = dir_->path() + "/st_ref.safetensors";
  python("save " + st + " 2 " + st_ref + " safetensors");
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    FSDP<Net> model(Net(&o), o);
    torch::optim::AdamW opt(model->parameters());
    tdist::load_sharded_checkpoint(st, pg, *model, &opt);
    expect_pytorch_state(*model, opt, st_ref, "safetensors variant");
  }), "");
}

// ---- tdist's DCP saves, read by PyTorch ------------------------------------------

at::Tensor batch(int step, int world) {
  torch::manual_seed(70 + step);
  return torch::randn({4 * world, 6});
}

// The full state as dcp_check.py writes PyTorch's ("optim/<param>/<field>").
void save_full(torch::nn::Module& model, torch::optim::Optimizer& opt, const std::string& path, int rank) {
  const StateDict full = tdist::full_state_dict(model);
  const auto optim = tdist::full_optimizer_state_dict(model, opt);
  if (rank != 0) return;
  StateDict all = full;
  for (const auto& p : optim.state) {
    for (const auto& f : p.value()) all.insert("optim/" + p.key() + "/" + f.key(), f.value());
  }
  tdist::save_safetensors(path, all);
}

// Both files hold the same tensors, bit for bit (a step by value).
void expect_same_files(const std::string& a, const std::string& b) {
  const StateDict x = tdist::load_safetensors(a), y = tdist::load_safetensors(b);
  EXPECT_EQ(x.size(), y.size());
  for (const auto& item : x) {
    ASSERT_TRUE(y.contains(item.key())) << item.key();
    const bool step = item.key().size() > 5 && item.key().substr(item.key().size() - 5) == "/step";
    EXPECT_TRUE(step ? item.value().item<double>() == y[item.key()].item<double>()
                     : item.value().scalar_type() == y[item.key()].scalar_type() && torch::equal(item.value(), y[item.key()]))
        << item.key();
  }
}

// tdist trains the FSDP Net 3 steps at world 2 with AdamW (lr 0.02) and
// saves it as DCP; `full` gets its full state.
void tdist_save(const std::string& dir, const std::string& full) {
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(1);
    FSDP<Net> model(Net(&o), o);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.02));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      model(batch(s, pg.size()).narrow(0, 4 * pg.rank(), 4)).pow(2).mean().backward();
      opt.step();
    }
    tdist::ShardedCheckpointOptions so;
    so.format = tdist::ShardedFormat::dcp;
    tdist::save_sharded_checkpoint(dir, pg, *model, &opt, so);
    save_full(*model, opt, full, pg.rank());
  }), "");
}

TEST_F(Dcp, TdistsSaveLoadsInPyTorchFsdp2AtWorldThree) {
  const std::string out = dir_->path() + "/ours", full = dir_->path() + "/ours_full.safetensors";
  tdist_save(out, full);
  const std::string back = dir_->path() + "/ours_in_pytorch.safetensors";
  python("load " + out + " 3 " + back + " 0.02");
  expect_same_files(full, back);
}

TEST_F(Dcp, TdistsSaveThroughDcpToTorchSaveIsBitForBit) {
  const std::string out = dir_->path() + "/ours2", full = dir_->path() + "/ours2_full.safetensors";
  tdist_save(out, full);
  const std::string back = dir_->path() + "/ours2_torch_save.safetensors";
  python("torch_save " + out + " " + back);
  expect_same_files(full, back);
}

TEST_F(Dcp, TdistsSaveLoadsBackInTdistAtWorldThree) {
  const std::string out = dir_->path() + "/ours3", full = dir_->path() + "/ours3_full.safetensors";
  tdist_save(out, full);
  ASSERT_EQ(run_world(3, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    FSDP<Net> model(Net(&o), o);
    torch::optim::AdamW opt(model->parameters());
    tdist::load_sharded_checkpoint(out, pg, *model, &opt);
    const std::string again = dir_->path() + "/ours3_again.safetensors";
    save_full(*model, opt, again, pg.rank());
    if (pg.rank() == 0) expect_same_files(full, again);
  }), "");
}

// ---- tdist-ckpt convert and inspect ------------------------------------------------

tdist::test::CommandResult ckpt_tool(const std::string& args) {
  return tdist::test::run_command(tdist::test::bin_dir() + "/tdist-ckpt " + args + " 2>&1", std::chrono::seconds(120));
}

TEST_F(Dcp, ConvertTurnsPyTorchsDcpIntoItsFullStateBitForBit) {
  const std::string model = dir_->path() + "/conv_model.safetensors", all = dir_->path() + "/conv_all.safetensors";
  auto r = ckpt_tool("convert --from dcp:" + ckpt() + " --to safetensors:" + model);
  ASSERT_TRUE(tdist::test::exited_ok(r.status)) << r.output;
  r = ckpt_tool("convert --from dcp:" + ckpt() + " --to safetensors:" + all + " --optimizer");
  ASSERT_TRUE(tdist::test::exited_ok(r.status)) << r.output;
  const StateDict want = tdist::load_safetensors(ref()), got = tdist::load_safetensors(model),
                  got_all = tdist::load_safetensors(all);
  size_t model_tensors = 0;
  for (const auto& item : want) {
    const std::string& k = item.key();
    if (k.rfind("optim/", 0) == 0) {  // PyTorch's optim/<param>/<field> is our optimizer/<param>/<field>
      const std::string ours = "optimizer/" + k.substr(6);
      ASSERT_TRUE(got_all.contains(ours)) << ours;
      EXPECT_TRUE(torch::equal(got_all[ours], item.value())) << ours;
      continue;
    }
    ++model_tensors;
    ASSERT_TRUE(got.contains(k)) << k;
    EXPECT_EQ(got[k].scalar_type(), item.value().scalar_type()) << k;
    EXPECT_TRUE(torch::equal(got[k], item.value())) << k;
  }
  EXPECT_EQ(got.size(), model_tensors) << "the model alone, under PyTorch's names";
  // Never over its input; and inspect sees the folder as Python wrote it.
  r = ckpt_tool("convert --from dcp:" + ckpt() + " --to dcp:" + ckpt());
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
  EXPECT_NE(r.output.find("never overwritten"), std::string::npos) << r.output;
  r = ckpt_tool("inspect " + ckpt() + " --json");
  ASSERT_TRUE(tdist::test::exited_ok(r.status)) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["model"].size(), model_tensors);
  EXPECT_EQ(j["model"][1]["name"], "in.weight");
  EXPECT_EQ(j["model"][1]["chunks"], 2);
}

TEST_F(Dcp, TdistsFilesConvertToDcpThatPyTorchReads) {
  const std::string prefix = dir_->path() + "/sharded", full = dir_->path() + "/sharded_full.safetensors";
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(4);
    FSDP<Net> model(Net(&o), o);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.02));
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      model(batch(s, pg.size()).narrow(0, 4 * pg.rank(), 4)).pow(2).mean().backward();
      opt.step();
    }
    tdist::save_sharded_checkpoint(prefix, pg, *model, &opt);
    save_full(*model, opt, full, pg.rank());
  }), "");
  const std::string out = dir_->path() + "/sharded_dcp";
  const auto r = ckpt_tool("convert --from tdist:" + prefix + " --to dcp:" + out + " --optimizer");
  ASSERT_TRUE(tdist::test::exited_ok(r.status)) << r.output;
  const std::string back = dir_->path() + "/sharded_dcp_in_pytorch.safetensors";
  python("load " + out + " 2 " + back + " 0.02");
  expect_same_files(full, back);
}

// PyTorch's DCP as tdist's own sharded files: they load at world 3 into
// FSDP and at world 1 into a plain model, equal to PyTorch's state; reshard
// takes them; a prefix that holds another world size's files is refused.
TEST_F(Dcp, ConvertToTdistFilesLoadsAtAnyWorldSize) {
  const std::string prefix = dir_->path() + "/as_tdist";
  auto r = ckpt_tool("convert --from dcp:" + ckpt() + " --to tdist:" + prefix + " --optimizer");
  ASSERT_TRUE(tdist::test::exited_ok(r.status)) << r.output;
  ASSERT_EQ(run_world(3, [&](ProcessGroup& pg) {
    tdist::FullyShardedDataParallelOptions o;
    torch::manual_seed(5);
    FSDP<Net> model(Net(&o), o);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
    tdist::load_sharded_checkpoint(prefix, pg, *model, &opt);
    expect_pytorch_state(*model, opt, ref(), "converted, world 3");
  }), "");
  r = ckpt_tool("reshard --ckpt-prefix " + prefix + " --world-size 2 --out-prefix " + prefix + "_w2");
  ASSERT_TRUE(tdist::test::exited_ok(r.status)) << r.output;
  ASSERT_EQ(run_world(1, [&](ProcessGroup& pg) {
    torch::manual_seed(5);
    Net model;
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
    tdist::load_sharded_checkpoint(prefix + "_w2", pg, *model, &opt);
    expect_pytorch_state(*model, opt, ref(), "converted, resharded to 2, world 1");
  }), "");
  r = ckpt_tool("convert --from dcp:" + ckpt() + " --to tdist:" + prefix + "_w2");
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
  EXPECT_NE(r.output.find("already holds another checkpoint"), std::string::npos) << r.output;
  r = ckpt_tool("convert --from tdist:" + prefix + " --to tdist:" + prefix);
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
  EXPECT_NE(r.output.find("never overwritten"), std::string::npos) << r.output;
}

// ---- Python's optimizer.state_dict(), keyed by index ---------------------------------

TEST_F(Dcp, PythonsOptimizerStateDictLoadsByIndexAndTdistsLoadsInPython) {
  const std::string py = dir_->path() + "/plain";
  python("plain_save " + py);
  const std::string ours = dir_->path() + "/ours_optim.pt";
  for (int world : {1, 2}) {
    ASSERT_EQ(run_world(world, [&](ProcessGroup& pg) {
      tdist::FullyShardedDataParallelOptions o;
      auto make = [&]() -> std::shared_ptr<torch::nn::Module> {
        if (pg.size() == 1) return Net().ptr();
        return FSDP<Net>(Net(&o), o).ptr();
      };
      auto model = make();
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
      tdist::load_pretrained(*model, py + "/model.pt");
      tdist::load_optimizer_state_dict_file(py + "/optim.pt", *model, opt);
      expect_pytorch_state(*model, opt, py + "/ref.safetensors", "world " + std::to_string(pg.size()));
      const auto& g = static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options());
      WORLD_CHECK(g.lr() == 0.03 && std::get<0>(g.betas()) == 0.8 && g.amsgrad(), "the group's options are Python's");
      if (pg.size() == 2) tdist::save_optimizer_state_dict_file(ours, *model, opt);
    }), "");
  }
  const std::string back = dir_->path() + "/ours_optim_in_python.safetensors";
  python("plain_load " + ours + " " + py + "/model.pt " + back);
  expect_same_files(py + "/ref.safetensors", back);
}

// .metadata files an adversarial tester made (fuzz/corpus_dcp/hostile_*),
// each refused for what it is, in little memory and time.
TEST(DcpHostile, HostileMetadataIsRefusedByName) {
  const std::string dir = tdist::test::source_dir() + "/fuzz/corpus_dcp/";
  const std::pair<const char*, const char*> cases[] = {
      {"hostile_setitem_on_object.metadata", "SETITEM on an object"},
      {"hostile_dicts_posing_as_objects.metadata", "a dict key '__class__'"},
      {"hostile_chunk_bigger_than_its_bytes.metadata", "holds 268435456 elements but is stored in"},
      {"hostile_posix_system.metadata", "global 'posix.system' is not a class DCP's .metadata holds"},
      {"hostile_builtins_eval.metadata", "global 'builtins.eval' is not a class DCP's .metadata holds"},
      // A dict given itself under a non-string key (a shared-node cycle, a
      // leak found by dcp_metadata_fuzzer).
      {"hostile_dict_key_cycle.metadata", "a container put into itself (a cycle)"},
  };
  for (const auto& [file, want] : cases) {
    std::ifstream in(dir + file, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_FALSE(bytes.empty()) << file;
    try {
      tdist::checkpoint::dcp::parse_metadata(bytes, file);
      ADD_FAILURE() << file << " was read";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << file << ": " << e.what();
    }
  }
}

TEST_F(Dcp, AMetadataThatWouldRunCodeIsRefusedAndRunsNothing) {
  const std::string evil = dir_->path() + "/evil", marker = dir_->path() + "/ran";
  python("evil " + evil + " " + marker);
  ASSERT_FALSE(fs::exists(marker));
  try {
    tdist::checkpoint::dcp::read_metadata(evil);
    FAIL() << "an evil .metadata was read";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("global 'posix.system' is not a class DCP's .metadata holds"),
              std::string::npos) << e.what();
  }
  ASSERT_EQ(run_world(1, [&](ProcessGroup& pg) {
    Net model;
    const at::Tensor before = model->in->weight.clone();
    bool refused = false;
    try {
      tdist::load_sharded_checkpoint(evil, pg, *model);
    } catch (const CheckpointError&) {
      refused = true;
    }
    WORLD_CHECK(refused, "the load was refused");
    WORLD_CHECK(torch::equal(before, model->in->weight), "the model kept its weights");
  }), "");
  EXPECT_FALSE(fs::exists(marker)) << "the .metadata's code ran";
}

}  // namespace
