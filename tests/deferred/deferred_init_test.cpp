// tdist::deferred_init and materialize_*: a model built deferred holds no
// memory, and once materialized equals the same model built eagerly with
// the same seed, bit for bit, whatever order its tensors are made real in;
// the tensors stay the objects the module and an optimizer hold; what
// cannot be deferred is refused by name.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "deferred/record.h"  // deferred_record_count
#include "tdist/deferred_init.h"
#include "tdist/errors.h"

namespace {

// LibTorch's layers, a parameter and a buffer of the module's own, and an
// init the constructor does itself.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr};
  torch::nn::Embedding e{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Conv2d c{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::MultiheadAttention mha{nullptr};
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Bilinear bil{nullptr};
  torch::Tensor own, mask, head;
  explicit NetImpl(int64_t width = 8) {
    a = register_module("a", torch::nn::Linear(width, 4));
    e = register_module("e", torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).padding_idx(0)));
    ln = register_module("ln", torch::nn::LayerNorm(std::vector<int64_t>{4}));
    c = register_module("c", torch::nn::Conv2d(3, 2, 3));
    bn = register_module("bn", torch::nn::BatchNorm1d(4));
    mha = register_module("mha", torch::nn::MultiheadAttention(4, 2));
    lstm = register_module("lstm", torch::nn::LSTM(4, 4));
    bil = register_module("bil", torch::nn::Bilinear(3, 3, 2));
    own = register_parameter("own", torch::randn({3, 5}));
    mask = register_buffer("mask", torch::tril(torch::ones({4, 4})));
    // Tied to the embedding, as a language model's head; then the
    // constructor's own init of a layer (GPT-2's normal(0, 0.02)).
    head = register_parameter("head", e->weight);
    torch::NoGradGuard no_grad;
    a->weight.normal_(0.0, 0.02);
    own.slice(1, 1, 3).mul_(2.0).add_(1.0);
  }
  torch::Tensor forward(const torch::Tensor& x) { return ln(a(x)); }
};
TORCH_MODULE(Net);

void expect_same(torch::nn::Module& got, torch::nn::Module& want) {
  auto g = got.named_parameters(true);
  auto w = want.named_parameters(true);
  ASSERT_EQ(g.size(), w.size());
  for (const auto& p : w) {
    const at::Tensor& mine = g[p.key()];
    ASSERT_FALSE(mine.is_meta()) << p.key();
    EXPECT_EQ(mine.scalar_type(), p.value().scalar_type()) << p.key();
    EXPECT_EQ(mine.sizes(), p.value().sizes()) << p.key();
    EXPECT_TRUE(torch::equal(mine, p.value())) << p.key();
  }
  auto gb = got.named_buffers(true);
  for (const auto& b : want.named_buffers(true)) {
    ASSERT_FALSE(gb[b.key()].is_meta()) << b.key();
    EXPECT_TRUE(torch::equal(gb[b.key()], b.value())) << b.key();
  }
}

TEST(DeferredInit, BuildsEveryTensorOnTheMetaDevice) {
  Net net = tdist::deferred_init([] { return Net(); });
  for (const auto& p : net->named_parameters(true)) {
    EXPECT_TRUE(p.value().is_meta()) << p.key();
    EXPECT_TRUE(tdist::is_deferred(p.value())) << p.key();
    EXPECT_TRUE(p.value().requires_grad()) << p.key();
  }
  for (const auto& b : net->named_buffers(true)) EXPECT_TRUE(b.value().is_meta()) << b.key();
  EXPECT_TRUE(tdist::is_deferred(*net));
  EXPECT_EQ(net->c->weight.sizes(), (std::vector<int64_t>{2, 3, 3, 3}));
  EXPECT_EQ(net->head.unsafeGetTensorImpl(), net->e->weight.unsafeGetTensorImpl());
}

TEST(DeferredInit, MaterializedEqualsTheEagerBuildBitForBit) {
  torch::manual_seed(7);
  Net eager;
  const at::Tensor eager_next = torch::rand({4});
  torch::manual_seed(7);
  Net net = tdist::deferred_init([] { return Net(); });
  // The generator stands where the eager construction left it.
  EXPECT_TRUE(torch::equal(torch::rand({4}), eager_next));
  tdist::materialize_module(*net);
  expect_same(*net, *eager);
  EXPECT_FALSE(tdist::is_deferred(*net));
  EXPECT_EQ(net->head.unsafeGetTensorImpl(), net->e->weight.unsafeGetTensorImpl());
}

// More of LibTorch's layers, in a Sequential.
torch::nn::Sequential zoo() {
  using namespace torch::nn;
  return Sequential(GRU(GRUOptions(4, 6).num_layers(2).bidirectional(true)), RNN(4, 3), Conv1d(2, 3, 2),
                    ConvTranspose2d(2, 3, 3), Conv3d(1, 2, 2), GroupNorm(2, 4), InstanceNorm1d(InstanceNorm1dOptions(4).affine(true)),
                    PReLU(), EmbeddingBag(7, 3), TransformerEncoderLayer(TransformerEncoderLayerOptions(8, 2).dim_feedforward(16)),
                    Linear(LinearOptions(3, 2).bias(false)));
}

TEST(DeferredInit, LibTorchsLayersEqualTheirEagerBuild) {
  torch::manual_seed(11);
  torch::nn::Sequential eager = zoo();
  torch::manual_seed(11);
  torch::nn::Sequential net = tdist::deferred_init(zoo);
  for (const at::Tensor& p : net->parameters()) ASSERT_TRUE(p.is_meta());
  tdist::materialize_module(*net);
  expect_same(*net, *eager);
}

TEST(DeferredInit, AnyOrderGivesTheSameValues) {
  torch::manual_seed(3);
  Net eager;
  torch::manual_seed(3);
  Net net = tdist::deferred_init([] { return Net(); });
  torch::manual_seed(12345);  // draws between construction and materializing change nothing
  auto params = net->named_parameters(true);
  for (auto it = params.end(); it != params.begin();) {
    --it;
    tdist::materialize_tensor(it->value());
    EXPECT_FALSE(it->value().is_meta()) << it->key();
  }
  for (const auto& b : net->named_buffers(true)) tdist::materialize_tensor(b.value());
  expect_same(*net, *eager);
}

TEST(DeferredInit, TheModuleAndAnOptimizerKeepTheirTensors) {
  torch::manual_seed(1);
  Net eager;
  torch::manual_seed(1);
  Net net = tdist::deferred_init([] { return Net(); });
  at::Tensor held = net->a->weight;  // what an optimizer built now would hold
  torch::optim::SGD opt(net->parameters(), 0.1);
  tdist::materialize_module(*net);
  EXPECT_EQ(held.unsafeGetTensorImpl(), net->a->weight.unsafeGetTensorImpl());
  EXPECT_TRUE(torch::equal(held, eager->a->weight));
  const at::Tensor x = torch::randn({2, 8});
  net->forward(x).sum().backward();
  eager->forward(x).sum().backward();
  opt.step();
  torch::optim::SGD(eager->parameters(), 0.1).step();
  EXPECT_TRUE(torch::equal(net->a->weight, eager->a->weight));
}

TEST(DeferredInit, OneTensorAtATimeAllocatesOnlyThatTensor) {
  // 2^28 floats (1 GiB) in `a`: materializing the layer norm must not make it.
  Net net = tdist::deferred_init([] { return Net(1 << 26); });
  tdist::materialize_module(*net->ln);
  EXPECT_FALSE(net->ln->weight.is_meta());
  EXPECT_TRUE(net->a->weight.is_meta());
  EXPECT_EQ(net->a->weight.numel(), int64_t{4} << 26);
}

TEST(DeferredInit, ReadingAValueIsRefusedByName) {
  try {
    (void)tdist::deferred_init([] {
      at::Tensor t = torch::ones({2});
      return t.sum().item<float>();
    });
    FAIL() << "no error";
  } catch (const tdist::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("_local_scalar_dense"), std::string::npos) << e.what();
  }
  // The scope is closed: tensors are real again.
  EXPECT_FALSE(torch::ones({1}).is_meta());
}

struct CopyImpl : torch::nn::Module {
  torch::Tensor a, b;
  CopyImpl() {
    a = register_parameter("a", torch::randn({4}));
    b = register_parameter("b", a.detach() * 2);
  }
};
TORCH_MODULE(Copy);

TEST(DeferredInit, ATensorMadeFromAnotherIsMadeWithItOrRefused) {
  torch::manual_seed(5);
  Copy eager;
  torch::manual_seed(5);
  Copy together = tdist::deferred_init([] { return Copy(); });
  tdist::materialize_module(*together);
  expect_same(*together, *eager);

  torch::manual_seed(5);
  Copy apart = tdist::deferred_init([] { return Copy(); });
  tdist::materialize_tensor(apart->a);
  apart->a.detach().add_(100);  // it may have changed since: b cannot be made from it
  try {
    tdist::materialize_tensor(apart->b);
    FAIL() << "no error";
  } catch (const tdist::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("materialized before"), std::string::npos) << e.what();
  }
  // b alone, before a: a is made on the way but stays deferred.
  torch::manual_seed(5);
  Copy reverse = tdist::deferred_init([] { return Copy(); });
  tdist::materialize_tensor(reverse->b);
  EXPECT_TRUE(torch::equal(reverse->b, eager->b));
  EXPECT_TRUE(reverse->a.is_meta());
  tdist::materialize_tensor(reverse->a);
  EXPECT_TRUE(torch::equal(reverse->a, eager->a));
}

// Factories given a deferred tensor's options() (which name meta inside
// the scope) make what they made eagerly.
struct OptionsImpl : torch::nn::Module {
  torch::Tensor w, z, r;
  OptionsImpl() {
    w = register_parameter("w", torch::randn({4}));
    z = register_buffer("z", torch::zeros({4}, w.options()));
    r = register_parameter("r", torch::randn({4}, w.options()));
  }
};
TORCH_MODULE(Options);

TEST(DeferredInit, FactoriesGivenADeferredTensorsOptionsMakeWhatTheyMadeEagerly) {
  torch::manual_seed(9);
  Options eager;
  torch::manual_seed(9);
  Options net = tdist::deferred_init([] { return Options(); });
  tdist::materialize_module(*net);
  expect_same(*net, *eager);
  EXPECT_TRUE(net->z.device().is_cpu());
}

// In-place shape operations change the tensor object: each operation
// replays on the shape it saw. Module::to inside the scope (set_data) too.
struct ShapesImpl : torch::nn::Module {
  torch::Tensor t, u;
  torch::nn::Linear l{nullptr};
  ShapesImpl() {
    auto a = torch::randn({3, 5});
    a.t_();
    t = register_parameter("t", a.contiguous());
    auto b = torch::randn({3});
    b.unsqueeze_(0);
    b.mul_(2);
    u = register_parameter("u", b);
    l = register_module("l", torch::nn::Linear(4, 3));
    l->to(torch::kDouble);
  }
};
TORCH_MODULE(Shapes);

TEST(DeferredInit, InPlaceShapeOperationsReplayOnTheShapeTheySaw) {
  torch::manual_seed(13);
  Shapes eager;
  torch::manual_seed(13);
  Shapes net = tdist::deferred_init([] { return Shapes(); });
  EXPECT_EQ(net->t.sizes(), (std::vector<int64_t>{5, 3}));
  tdist::materialize_module(*net);
  expect_same(*net, *eager);
  EXPECT_EQ(net->l->weight.scalar_type(), torch::kDouble);
}

TEST(DeferredInit, AGeneratorOfTheUsersIsReplayedAndAdvanced) {
  at::Generator gen = at::detail::createCPUGenerator(42);
  at::Generator eager_gen = at::detail::createCPUGenerator(42);
  const at::Tensor want = at::randn({6}, eager_gen);
  const at::Tensor want_next = at::randn({2}, eager_gen);
  at::Tensor t = tdist::deferred_init([&] { return at::randn({6}, gen); });
  EXPECT_TRUE(t.is_meta());
  EXPECT_TRUE(torch::equal(at::randn({2}, gen), want_next));
  tdist::materialize_tensor(t);
  EXPECT_TRUE(torch::equal(t, want));
}

// A CPU generator that counts its live instances, copies included.
std::atomic<int> live_generators{0};
struct CountedGenerator : at::CPUGeneratorImpl {
  explicit CountedGenerator(uint64_t seed) : at::CPUGeneratorImpl(seed) { ++live_generators; }
  ~CountedGenerator() override { --live_generators; }
  CountedGenerator* clone_impl() const override {
    auto* copy = new CountedGenerator(0);
    copy->set_state(*get_state());
    return copy;
  }
};

// The copies of a generator that recording and replay keep are freed with
// the record (LibTorch 1.x's Generator::clone() alone leaves them
// unfreeable: compat::clone_generator).
TEST(DeferredInit, TheGeneratorCopiesItKeepsAreFreed) {
  {
    at::Generator gen = at::make_generator<CountedGenerator>(42);
    at::Generator eager_gen = at::make_generator<CountedGenerator>(42);
    const at::Tensor want = at::randn({6}, eager_gen);
    at::Tensor t = tdist::deferred_init([&] { return at::randn({6}, gen); });
    EXPECT_GE(live_generators.load(), 3) << "the record keeps a copy";
    tdist::materialize_tensor(t);
    EXPECT_TRUE(torch::equal(t, want));
  }
  EXPECT_EQ(tdist::detail::deferred_record_count(), 0u);
  EXPECT_EQ(live_generators.load(), 0);
}

// Materializing draws nothing from the default generator, even for
// torch::randn(size), which has no generator argument: another thread's
// stream is undisturbed while it runs.
TEST(DeferredInit, MaterializingLeavesOtherThreadsRandomNumbersAlone) {
  std::vector<torch::Tensor> params;
  for (int i = 0; i < 300; ++i) params.push_back(tdist::deferred_init([] { return torch::randn({64}); }));
  torch::manual_seed(77);
  const at::Tensor want = torch::rand({20000});
  torch::manual_seed(77);
  std::thread other([&] {
    for (auto& p : params) tdist::materialize_tensor(p);
  });
  std::vector<float> got;
  for (int i = 0; i < 20000; ++i) got.push_back(torch::rand({1}).item<float>());
  other.join();
  int differ = 0;
  for (int i = 0; i < 20000; ++i) differ += got[i] != want[i].item<float>();
  EXPECT_EQ(differ, 0);
  for (auto& p : params) EXPECT_FALSE(p.is_meta());
}

TEST(DeferredInit, ForgetsWhatNobodyHolds) {
  for (int i = 0; i < 50; ++i) (void)tdist::deferred_init([] { return Net(); });
  Net kept = tdist::deferred_init([] { return Net(); });
  EXPECT_EQ(tdist::detail::deferred_record_count(), 1u);
  tdist::materialize_module(*kept);
  EXPECT_EQ(tdist::detail::deferred_record_count(), 0u);
}

struct ElsewhereImpl : torch::nn::Module {
  torch::Tensor weight = register_parameter("weight", torch::empty({2, 2}, torch::kMeta));
};
TORCH_MODULE(Elsewhere);

TEST(DeferredInit, AMetaTensorFromElsewhereIsNamed) {
  Elsewhere m;
  try {
    tdist::materialize_module(*m);
    FAIL() << "no error";
  } catch (const tdist::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'weight'"), std::string::npos) << e.what();
  }
}

}  // namespace
