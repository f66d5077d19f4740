// load_pretrained and save_pretrained against Python: a state dict that
// torch.save wrote (torch 2.x and 1.13: a tied weight, two views of one
// storage, a transposed weight, fp16, bf16) and GPT-2 directories that
// transformers wrote (one file, shards and index, a base model) load into
// LibTorch modules with the same names, plain and FSDP at worlds 2 and 3,
// bit for bit; what save_pretrained writes (plain, FSDP, sharded)
// GPT2LMHeadModel.from_pretrained loads with nothing missing or unexpected,
// bit for bit; bad files are refused by name and change nothing.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "tdist/tdist.h"
#include "tests/util/damage.h"
#include "tests/util/process.h"
#include "tests/util/world.h"
#include "tests/util/paths.h"

namespace {

namespace fs = std::filesystem;
using tdist::CheckpointError;
using tdist::LoadPretrainedOptions;
using tdist::ProcessGroup;
using tdist::test::run_world;

const std::string kCheck = tdist::test::source_dir() + "/tests/checkpoint/pretrained_check.py";
const std::string kVenvPython = tdist::test::source_dir() + "/.venv/bin/python";

std::string python(const std::string& interpreter, const std::string& args) {
  const auto r = tdist::test::run_command(interpreter + " " + kCheck + " " + args + " 2>&1", std::chrono::seconds(300));
  if (!tdist::test::exited_ok(r.status)) throw std::runtime_error("pretrained_check.py " + args + " failed:\n" + r.output);
  return r.output;
}

// ---- modules with any names -----------------------------------------------------------

// A module that only holds tensors (and children), with the names given.
struct TreeImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Tree);
// The same class under another name, for FSDP units (transformer_auto_wrap_policy).
struct BlockImpl : TreeImpl {};
TORCH_MODULE(Block);

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  bool parameter = true;
  std::string tied_to = {};  // registers that entry's tensor again under this name
};

bool is_block(const std::string& path) {
  static const std::regex block("(.*\\.)?h\\.[0-9]+|f16|b16");
  return std::regex_match(path, block);
}

// The module on the way to `name` (made when missing: a Block for GPT-2's
// "h.<i>" and the small model's f16/b16, else a Tree); the last step in
// `leaf`.
torch::nn::Module& parent_of(torch::nn::Module& root, const std::string& name, std::string& leaf) {
  torch::nn::Module* m = &root;
  size_t begin = 0;
  for (size_t dot; (dot = name.find('.', begin)) != std::string::npos; begin = dot + 1) {
    const std::string step = name.substr(begin, dot - begin);
    auto children = m->named_children();
    if (const auto* c = children.find(step)) {
      m = c->get();
    } else if (is_block(name.substr(0, dot))) {
      m = m->register_module(step, Block()).get();
    } else {
      m = m->register_module(step, Tree()).get();
    }
  }
  leaf = name.substr(begin);
  return *m;
}

// The blocks of root's tree each in FSDP<Block> (by hand: auto_wrap takes
// only the entries of a Sequential).
void wrap_blocks(torch::nn::Module& m, const std::string& path, const tdist::FullyShardedDataParallelOptions& o) {
  for (const auto& c : m.named_children()) {
    const std::string p = path.empty() ? c.key() : path + "." + c.key();
    if (is_block(p)) {
      auto block = std::dynamic_pointer_cast<BlockImpl>(c.value());
      m.replace_module(c.key(), tdist::FSDP<Block>(Block(block), o));
    } else {
      wrap_blocks(*c.value(), p, o);
    }
  }
}

Tree build(const std::vector<Spec>& specs, uint64_t seed, bool fsdp = false) {
  torch::manual_seed(static_cast<int64_t>(seed));
  Tree root;
  std::map<std::string, torch::Tensor> made;
  for (const auto& s : specs) {
    std::string leaf;
    torch::nn::Module& m = parent_of(*root, s.name, leaf);
    torch::Tensor t = s.tied_to.empty() ? torch::randn(s.shape).to(s.dtype) : made.at(s.tied_to);
    made[s.name] = t;
    if (s.parameter) {
      m.register_parameter(leaf, t);
    } else {
      m.register_buffer(leaf, t);
    }
  }
  if (fsdp) wrap_blocks(*root, "", tdist::FullyShardedDataParallelOptions());
  return root;
}

// torch.save's small module (pretrained_check.py's Small).
std::vector<Spec> small_specs() {
  return {{"a", {3, 4}},
          {"b", {6, 3}, at::kFloat, false},
          {"emb.weight", {10, 4}},
          {"head.weight", {10, 4}, at::kFloat, true, "emb.weight"},
          {"proj.weight", {6, 4}},
          {"proj.bias", {6}},
          {"f16.weight", {5, 3}, at::kHalf},
          {"b16.weight", {7, 2}, at::kBFloat16}};
}

// GPT-2's names and shapes (GPT2LMHeadModel; `prefix` "" for GPT2Model's).
std::vector<Spec> gpt2_specs(const std::string& prefix = "transformer.", at::ScalarType dtype = at::kFloat,
                             bool head = true) {
  const int64_t V = 256, P = 64, E = 32, L = 2;
  std::vector<Spec> out{{prefix + "wte.weight", {V, E}, dtype}, {prefix + "wpe.weight", {P, E}, dtype}};
  for (int64_t i = 0; i < L; ++i) {
    const std::string h = prefix + "h." + std::to_string(i) + ".";
    for (const auto& [n, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"ln_1.weight", {E}}, {"ln_1.bias", {E}}, {"attn.c_attn.weight", {E, 3 * E}}, {"attn.c_attn.bias", {3 * E}},
             {"attn.c_proj.weight", {E, E}}, {"attn.c_proj.bias", {E}}, {"ln_2.weight", {E}}, {"ln_2.bias", {E}},
             {"mlp.c_fc.weight", {E, 4 * E}}, {"mlp.c_fc.bias", {4 * E}}, {"mlp.c_proj.weight", {4 * E, E}},
             {"mlp.c_proj.bias", {E}}}) {
      out.push_back({h + n, shape, dtype});
    }
  }
  out.push_back({prefix + "ln_f.weight", {E}, dtype});
  out.push_back({prefix + "ln_f.bias", {E}, dtype});
  if (head) out.push_back({"lm_head.weight", {V, E}, dtype, true, prefix + "wte.weight"});
  return out;
}

// An FSDP model: a unit per block, the rest in the root's (the tied head
// with its embedding).
tdist::FSDP<Tree> fsdp_model(std::vector<Spec> specs, uint64_t seed) {
  return tdist::FSDP<Tree>(build(specs, seed, /*fsdp=*/true), tdist::FullyShardedDataParallelOptions());
}

// Every tensor by every name (tied ones under each), cloned.
std::map<std::string, torch::Tensor> plain_state(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().detach().clone();
  return out;
}

// What `state` (names of the model) must equal: the reference file's
// tensors, in the model's dtypes. "" when equal, else the first difference.
std::string differs(const std::map<std::string, torch::Tensor>& state, const std::string& ref,
                    const std::string& prefix_in_ref = "") {
  const auto want = tdist::load_safetensors(ref);
  for (const auto& [name, t] : state) {
    const at::Tensor* w = want.find(prefix_in_ref + name);
    if (!w) return "no '" + prefix_in_ref + name + "' in " + ref;
    if (!torch::equal(t, w->to(t.scalar_type()))) return "'" + name + "' differs from " + ref;
  }
  return "";
}

std::map<std::string, torch::Tensor> full_state(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : tdist::full_state_dict(m, /*rank0_only=*/false)) out[item.key()] = item.value();
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// ---- the files Python wrote, once for the suite ------------------------------------------

class Pretrained : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new tdist::test::TempDir();
    python("/usr/bin/python3", "small " + in("small13.pt"));
    python(kVenvPython, "make " + dir_->path());
    ready_ = true;
  }
  // gtest skips the tests of a suite whose SetUpTestSuite failed: fail them.
  void SetUp() override {
    if (!ready_) FAIL() << "the suite's setup failed (its message is above)";
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string in(const std::string& name) { return dir_->path() + "/" + name; }
  static tdist::test::TempDir* dir_;
  static bool ready_;
};
tdist::test::TempDir* Pretrained::dir_ = nullptr;
bool Pretrained::ready_ = false;

TEST_F(Pretrained, TorchSaveStateDictLoadsIntoAPlainModule) {
  for (const std::string name : {"small", "small13"}) {
    SCOPED_TRACE(name);
    Tree model = build(small_specs(), 1);
    const auto report = tdist::load_pretrained(*model, in(name + ".pt"));
    EXPECT_EQ(report.loaded.size(), 7u);  // head.weight is emb.weight
    EXPECT_TRUE(report.ignored.empty());
    EXPECT_EQ(differs(plain_state(*model), in(name + ".ref.safetensors")), "");
    EXPECT_EQ(model->named_parameters()["head.weight"].data_ptr(), model->named_parameters()["emb.weight"].data_ptr());
  }
  // {"model": state_dict}, and a pytorch_model.bin.index.json naming .bin shards.
  {
    Tree model = build(small_specs(), 1);
    const auto report = tdist::load_pretrained(*model, in("small-wrapped.pt"));
    EXPECT_TRUE(report.ignored.empty());
    EXPECT_EQ(differs(plain_state(*model), in("small.ref.safetensors")), "");
  }
  {
    tdist::test::TempDir dir;
    fs::copy(in("small.pt"), dir.path() + "/pytorch_model-00001-of-00001.bin");
    nlohmann::json index;
    index["metadata"]["total_size"] = 1;
    for (const auto& s : small_specs()) index["weight_map"][s.name] = "pytorch_model-00001-of-00001.bin";
    std::ofstream(dir.path() + "/pytorch_model.bin.index.json") << index.dump();
    Tree model = build(small_specs(), 1);
    const auto report = tdist::load_pretrained(*model, dir.path());
    EXPECT_EQ(report.files, std::vector<std::string>{dir.path() + "/pytorch_model-00001-of-00001.bin"});
    EXPECT_EQ(differs(plain_state(*model), in("small.ref.safetensors")), "");
  }
  // fp16 and bf16 into an fp32 module, fp32 into bf16: converted.
  auto specs = small_specs();
  for (auto& s : specs) s.dtype = s.dtype == at::kFloat ? at::kBFloat16 : at::kFloat;
  Tree converted = build(specs, 1);
  tdist::load_pretrained(*converted, in("small.pt"));
  EXPECT_EQ(differs(plain_state(*converted), in("small.ref.safetensors")), "");
}

TEST_F(Pretrained, TorchSaveStateDictLoadsIntoFsdpAtWorlds2And3) {
  for (const int world : {2, 3}) {
    EXPECT_EQ(run_world(world, [](ProcessGroup&) {
      tdist::FSDP<Tree> model = fsdp_model(small_specs(), 2);
      LoadPretrainedOptions o;
      tdist::load_pretrained(*model, in("small.pt"), o);
      const std::string d = differs(full_state(*model), in("small.ref.safetensors"));
      WORLD_CHECK(d.empty(), d);
    }), "") << "world " << world;
  }
}

TEST_F(Pretrained, HuggingFaceDirectoriesLoadPlain) {
  for (const std::string name : {"gpt2", "gpt2-sharded"}) {
    SCOPED_TRACE(name);
    Tree model = build(gpt2_specs(), 3);
    const auto report = tdist::load_pretrained(*model, in(name));
    EXPECT_EQ(report.files.size(), name == "gpt2" ? 1u : 5u);
    EXPECT_EQ(report.loaded.size(), gpt2_specs().size() - 1);
    EXPECT_EQ(differs(plain_state(*model), in("gpt2.ref.safetensors")), "");
  }
  // Into bf16: converted.
  Tree bf16 = build(gpt2_specs("transformer.", at::kBFloat16), 3);
  tdist::load_pretrained(*bf16, in("gpt2-sharded"));
  EXPECT_EQ(differs(plain_state(*bf16), in("gpt2.ref.safetensors")), "");
  // The base model's file into the model with the head, and the head's
  // directory into the base model, by base_model_prefix.
  LoadPretrainedOptions o;
  o.base_model_prefix = "transformer";
  Tree with_head = build(gpt2_specs(), 4);
  tdist::load_pretrained(*with_head, in("gpt2-base.safetensors"), o);
  EXPECT_EQ(differs(plain_state(*with_head), in("gpt2.ref.safetensors")), "");
  Tree base = build(gpt2_specs("", at::kFloat, /*head=*/false), 4);
  const auto report = tdist::load_pretrained(*base, in("gpt2"), o);  // (transformers writes lm_head.weight not)
  EXPECT_TRUE(report.ignored.empty());
  EXPECT_EQ(differs(plain_state(*base), in("gpt2.ref.safetensors"), "transformer."), "");
  // Without the prefix option the names do not meet.
  Tree again = build(gpt2_specs(), 4);
  EXPECT_THROW(tdist::load_pretrained(*again, in("gpt2-base.safetensors")), CheckpointError);
}

TEST_F(Pretrained, HuggingFaceDirectoriesLoadIntoFsdpAtWorlds2And3) {
  for (const int world : {2, 3}) {
    EXPECT_EQ(run_world(world, [](ProcessGroup&) {
      for (const std::string name : {"gpt2", "gpt2-sharded"}) {
        tdist::FSDP<Tree> model = fsdp_model(gpt2_specs(), 5);
        tdist::load_pretrained(*model, in(name));
        const std::string d = differs(full_state(*model), in("gpt2.ref.safetensors"));
        WORLD_CHECK(d.empty(), name << ": " << d);
      }
    }), "") << "world " << world;
  }
}

TEST_F(Pretrained, HuggingFaceDirectoryLoadsIntoDdp) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    tdist::DistributedDataParallel<Tree> model{build(gpt2_specs(), 6)};
    const auto report = tdist::load_pretrained(*model, in("gpt2-sharded"));
    WORLD_CHECK(report.loaded.size() == gpt2_specs().size() - 1, report.loaded.size());
    const std::string d = differs(full_state(*model), in("gpt2.ref.safetensors"));
    WORLD_CHECK(d.empty(), d);
  }), "");
}

// ---- save_pretrained ---------------------------------------------------------------------

TEST_F(Pretrained, SavedDirectoriesLoadInTransformersBitForBit) {
  tdist::test::TempDir out;
  const std::string config = read_text(in("gpt2/config.json"));
  const auto dir = [&](const std::string& n) { return out.path() + "/" + n; };
  Tree model = build(gpt2_specs(), 6);
  // The reference: every name (lm_head.weight too), as transformers' state_dict has them.
  {
    torch::OrderedDict<std::string, at::Tensor> ref;
    for (const auto& [k, v] : plain_state(*model)) ref.insert(k, v);
    tdist::save_safetensors(dir("ref.safetensors"), ref);
  }
  tdist::SavePretrainedOptions one;
  one.config_json = config;
  tdist::save_pretrained(*model, dir("plain"), one);
  tdist::SavePretrainedOptions sharded = one;
  sharded.max_shard_size = 20000;  // many shards first, then fewer: the stale ones go
  tdist::save_pretrained(*model, dir("plain-sharded"), sharded);
  const auto shards = [&](const std::string& d) {
    int n = 0;
    for (const auto& e : fs::directory_iterator(d)) n += e.path().filename().string().rfind("model-", 0) == 0;
    return n;
  };
  const int many = shards(dir("plain-sharded"));
  EXPECT_GT(many, 4);
  sharded.max_shard_size = 40000;
  tdist::save_pretrained(*model, dir("plain-sharded"), sharded);
  EXPECT_GT(shards(dir("plain-sharded")), 1);
  EXPECT_LT(shards(dir("plain-sharded")), many);
  // A single file after shards: the index goes too.
  tdist::save_pretrained(*model, dir("sharded-then-one"), sharded);
  tdist::save_pretrained(*model, dir("sharded-then-one"), one);
  EXPECT_FALSE(fs::exists(dir("sharded-then-one/model.safetensors.index.json")));
  EXPECT_EQ(shards(dir("sharded-then-one")), 0);
  {
    tdist::SafetensorsReader r(dir("plain/model.safetensors"));
    EXPECT_EQ(r.metadata().at("format"), "pt");
    EXPECT_FALSE(r.contains("lm_head.weight"));  // written once, under its first name
  }
  // FSDP at world 2: collective, rank 0 writes.
  EXPECT_EQ(run_world(2, [&](ProcessGroup&) {
    tdist::FSDP<Tree> fsdp = fsdp_model(gpt2_specs(), 7);
    tdist::load_pretrained(*fsdp, dir("plain"));
    tdist::save_pretrained(*fsdp, dir("fsdp"), one);
    tdist::save_pretrained(*fsdp, dir("fsdp-sharded"), sharded);
    // Rank 0 cannot write there (a file is on the way): every rank hears it.
    bool threw = false;
    try {
      tdist::save_pretrained(*fsdp, dir("ref.safetensors") + "/sub", one);
    } catch (const CheckpointError& e) {
      threw = std::string(e.what()).find("ref.safetensors/sub") != std::string::npos;
    }
    WORLD_CHECK(threw, "a save rank 0 could not write did not fail with its words");
  }), "");
  // Back into tdist, and into transformers.
  for (const std::string n : {"plain", "plain-sharded", "sharded-then-one", "fsdp", "fsdp-sharded"}) {
    Tree back = build(gpt2_specs(), 8);
    tdist::load_pretrained(*back, dir(n));
    EXPECT_EQ(differs(plain_state(*back), dir("ref.safetensors")), "") << n;
  }
  std::string args = "check";
  for (const std::string n : {"plain", "plain-sharded", "fsdp", "fsdp-sharded"}) {
    args += " " + dir(n) + " " + dir("ref.safetensors");
  }
  EXPECT_NO_THROW(python(kVenvPython, args));
}

// SafetensorsReader::read_rows: the rows, and the checksum of the whole
// tensor checked though only rows are kept.
TEST(SafetensorsRows, ReadRowsChecksTheWholeTensor) {
  tdist::test::TempDir out;
  const std::string path = out.path() + "/t.safetensors";
  torch::manual_seed(5);
  torch::OrderedDict<std::string, at::Tensor> t;
  t.insert("w", torch::randn({5, 3}));
  t.insert("v", torch::randn({4}));
  tdist::save_safetensors(path, t);
  {
    tdist::SafetensorsReader r(path);
    EXPECT_TRUE(torch::equal(r.read_rows("w", 1, 3), t["w"].narrow(0, 1, 3)));
    EXPECT_EQ(r.read_rows("w", 5, 0).sizes(), (std::vector<int64_t>{0, 3}));
    EXPECT_THROW(r.read_rows("w", 4, 2), CheckpointError);
  }
  // One byte of w's last row changed (bits flipped: it always changes): reading its first row fails.
  const auto size = fs::file_size(path);
  ASSERT_NO_FATAL_FAILURE(tdist::test::flip_byte_in_file(path, size - 4 * 4 - 2, 0x55));
  tdist::SafetensorsReader r(path);
  try {
    r.read_rows("w", 0, 1);
    ADD_FAILURE() << "read";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(r.read("v"), t["v"]));
}

// ---- refused --------------------------------------------------------------------------

// load_pretrained(path) must throw a CheckpointError whose message holds
// each of `parts`, and leave the model as it was.
void expect_refused(const std::string& path, const std::vector<std::string>& parts, const LoadPretrainedOptions& o = {}) {
  Tree model = build(gpt2_specs(), 9);
  const auto before = plain_state(*model);
  try {
    tdist::load_pretrained(*model, path, o);
    ADD_FAILURE() << path << ": loaded";
  } catch (const CheckpointError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << "\nlacks: " << p;
  }
  for (const auto& [k, v] : plain_state(*model)) EXPECT_TRUE(torch::equal(v, before.at(k))) << path << ": " << k << " changed";
}

TEST_F(Pretrained, BadFilesAreRefusedByNameAndChangeNothing) {
  tdist::test::TempDir out;
  const auto p = [&](const std::string& n) { return out.path() + "/" + n; };
  const auto ref = tdist::load_safetensors(in("gpt2.ref.safetensors"));
  const auto write_without = [&](const std::string& path, const std::string& drop,
                                 const std::vector<std::pair<std::string, at::Tensor>>& add) {
    torch::OrderedDict<std::string, at::Tensor> t;
    for (const auto& item : ref) {
      if (item.key() != drop && item.key() != "lm_head.weight") t.insert(item.key(), item.value());
    }
    for (const auto& [k, v] : add) t.insert(k, v);
    tdist::save_safetensors(path, t);
  };
  // A name missing (lm_head.weight is tied: transformer.wte.weight stands for it).
  write_without(p("missing.safetensors"), "transformer.h.1.ln_2.bias", {});
  expect_refused(p("missing.safetensors"), {p("missing.safetensors"), "'transformer.h.1.ln_2.bias'"});
  LoadPretrainedOptions lax;
  lax.strict = false;
  {
    Tree model = build(gpt2_specs(), 9);
    const auto r = tdist::load_pretrained(*model, p("missing.safetensors"), lax);
    EXPECT_EQ(r.missing, std::vector<std::string>{"transformer.h.1.ln_2.bias"});
  }
  // A shape that differs: both shapes named.
  write_without(p("shape.safetensors"), "transformer.wpe.weight", {{"transformer.wpe.weight", torch::zeros({63, 32})}});
  expect_refused(p("shape.safetensors"), {p("shape.safetensors"), "'transformer.wpe.weight'", "[63, 32]", "[64, 32]"});
  // A dtype that does not convert.
  write_without(p("dtype.safetensors"), "transformer.ln_f.bias", {{"transformer.ln_f.bias", torch::zeros({32}, at::kLong)}});
  expect_refused(p("dtype.safetensors"), {p("dtype.safetensors"), "'transformer.ln_f.bias'"});
  // Unexpected under strict; skipped by ignore_unexpected or without strict.
  write_without(p("extra.safetensors"), "", {{"transformer.h.0.attn.masked_bias", torch::zeros({1})}});
  expect_refused(p("extra.safetensors"), {p("extra.safetensors"), "'transformer.h.0.attn.masked_bias'"});
  {
    Tree model = build(gpt2_specs(), 9);
    LoadPretrainedOptions o;
    o.ignore_unexpected = {".*\\.attn\\.masked_bias"};
    EXPECT_EQ(tdist::load_pretrained(*model, p("extra.safetensors"), o).ignored.size(), 1u);
    EXPECT_EQ(tdist::load_pretrained(*model, p("extra.safetensors"), lax).ignored.size(), 1u);
  }
  // Sharded directories gone wrong.
  const auto copy = [&](const std::string& name) {
    fs::copy(in("gpt2-sharded"), p(name), fs::copy_options::recursive);
    return p(name);
  };
  const std::string index_name = "model.safetensors.index.json";
  const auto rewrite_index = [&](const std::string& d, const std::string& from, const std::string& to) {
    std::string text = read_text(d + "/" + index_name);
    for (size_t at; (at = text.find(from)) != std::string::npos;) text.replace(at, from.size(), to);
    std::ofstream(d + "/" + index_name) << text;
  };
  const std::string shard2 = "model-00002-of-00005.safetensors";
  {
    const std::string d = copy("escape");
    fs::copy(d + "/" + shard2, out.path() + "/x.safetensors");  // there, outside the directory
    rewrite_index(d, shard2, "../x.safetensors");
    expect_refused(d, {d + "/" + index_name, "'../x.safetensors'"});
  }
  {
    const std::string d = copy("not-there");
    fs::remove(d + "/" + shard2);
    expect_refused(d, {d + "/" + shard2});
  }
  {
    const std::string d = copy("truncated");
    fs::resize_file(d + "/" + shard2, fs::file_size(d + "/" + shard2) - 7);
    expect_refused(d, {d + "/" + shard2});
  }
  {
    const std::string d = copy("wrong-file");  // the index puts a key in a file that lacks it
    auto index = nlohmann::json::parse(read_text(d + "/" + index_name));
    auto& file = index["weight_map"]["transformer.wpe.weight"];
    file = file == shard2 ? "model-00003-of-00005.safetensors" : shard2;
    std::ofstream(d + "/" + index_name) << index.dump();
    expect_refused(d, {d + "/" + index_name, "'transformer.wpe.weight'"});
  }
  {
    const std::string d = copy("not-json");
    std::ofstream(d + "/" + index_name) << "{\"weight_map\": {\"a\": 1}}";
    expect_refused(d, {d + "/" + index_name, "not a file name"});
  }
  {
    const std::string d = copy("two-maps");  // a second weight_map, even null, is refused
    auto text = read_text(d + "/" + index_name);
    text.insert(text.rfind('}'), ", \"weight_map\": null");
    std::ofstream(d + "/" + index_name) << text;
    expect_refused(d, {d + "/" + index_name, "two weight_map fields"});
  }
  {
    const std::string d = p("fifo");
    fs::create_directory(d);
    ASSERT_EQ(::mkfifo((d + "/model.safetensors").c_str(), 0600), 0);
    expect_refused(d, {d + "/model.safetensors", "FIFO"});
  }
  expect_refused(p("nothing-here"), {p("nothing-here")});
}

}  // namespace
