// What a backward holds for a model whose outermost unit owns a large tied
// embedding (GPT-2's wte, used at both ends of the forward): that unit stays
// gathered through the backward, and its gradient buffer must not be held
// beside it all that time (it is taken at its reduction, reusing the
// gathered block); and once no unit will gather again, the block pool gives
// its free blocks back. Its gradients taken late may be sparse (an untied
// sparse embedding). Real processes, world 2, the CPU allocator counted.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "bench/memory_meter.h"
#include "fsdp/block_pool.h"
#include "tdist/tdist.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::test::run_world;

constexpr int64_t kVocab = 4096;
constexpr int64_t kWidth = 64;  // the embedding: 1 MiB in fp32, the blocks 16 KiB each

struct SmallBlockImpl : torch::nn::Module {
  SmallBlockImpl() : fc(register_module("fc", torch::nn::Linear(kWidth, kWidth))) {}
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(SmallBlock);

struct BigTiedImpl : torch::nn::Module {
  BigTiedImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kWidth));
    h = register_module("h", torch::nn::Sequential(SmallBlock(), SmallBlock()));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
  }
  torch::Tensor forward(torch::Tensor idx) {
    torch::Tensor e = wte(idx);
    if (on_embedding_grad) e.register_hook([this](const torch::Tensor&) { on_embedding_grad(); });
    return torch::matmul(ln_f(h->forward(e)), wte->weight.t());  // the tied head
  }
  torch::nn::Embedding wte{nullptr};
  torch::nn::Sequential h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};  // the outermost unit's gradient that comes first
  // Runs in the backward once every block's backward is over (before the
  // embedding's).
  std::function<void()> on_embedding_grad;
};
TORCH_MODULE(BigTied);

TEST(TiedMemory, TheOutermostUnitsGradientBufferIsNotHeldThroughTheBackward) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup&) {
                        auto& mem = tdist::bench::CountingAllocator::install();
                        torch::manual_seed(1);
                        tdist::FullyShardedDataParallelOptions o;
                        o.auto_wrap_policy = tdist::transformer_auto_wrap_policy<SmallBlock>();
                        BigTied net;
                        tdist::FSDP<BigTied> model(net, o);
                        int64_t pooled_after_blocks = -1;
                        net->on_embedding_grad = [&] {
                          pooled_after_blocks = static_cast<int64_t>(tdist::detail::pooled_bytes());
                        };
                        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
                        const auto idx = torch::randint(kVocab, {4, 8}, torch::kLong);
                        const int64_t embedding = kVocab * kWidth * 4;
                        int64_t worst = 0;
                        for (int i = 0; i < 3; ++i) {
                          for (auto& p : model->parameters()) p.mutable_grad().reset();
                          auto loss = model(idx).logsumexp(-1).mean();
                          const int64_t before = mem.live();
                          mem.reset_peak();
                          loss.backward();
                          worst = std::max(worst, mem.peak() - before);
                          opt.step();
                          WORLD_CHECK(pooled_after_blocks == 0,
                                      "the pool held " << pooled_after_blocks << " bytes after the last gather");
                        }
                        // The head's gradient waits for the embedding's,
                        // which autograd adds to it (and copies into the
                        // weight's layout): two embeddings at once, plus
                        // small ones. Held beside them all backward, the
                        // gradient buffer made it three.
                        WORLD_CHECK(worst < 2.5 * embedding,
                                    "the backward held " << worst << " bytes above its start; the embedding is "
                                                         << embedding);
                        WORLD_CHECK(worst >= 2 * embedding, "the backward held only " << worst << " bytes");
                      }),
            "");
}

// The outermost unit owns an untied sparse embedding, with units inside:
// its gradient, taken late, is autograd's sparse tensor.
struct SparseRootImpl : torch::nn::Module {
  explicit SparseRootImpl(bool sparse) {
    wte = register_module("wte", torch::nn::Embedding(torch::nn::EmbeddingOptions(kVocab, kWidth).sparse(sparse)));
    h = register_module("h", torch::nn::Sequential(SmallBlock(), SmallBlock()));
    head = register_module("head", torch::nn::Linear(kWidth, 16));
  }
  torch::Tensor forward(torch::Tensor idx) { return head(h->forward(wte(idx))); }
  torch::nn::Embedding wte{nullptr};
  torch::nn::Sequential h{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(SparseRoot);

std::vector<torch::Tensor> train_sparse_root(bool sparse) {
  torch::manual_seed(1);
  tdist::FullyShardedDataParallelOptions o;
  o.auto_wrap_policy = tdist::transformer_auto_wrap_policy<SmallBlock>();
  tdist::FSDP<SparseRoot> model(SparseRoot(sparse), o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  const auto idx = torch::randint(kVocab, {4, 8}, torch::kLong);
  for (int i = 0; i < 2; ++i) {
    for (auto& p : model->parameters()) p.mutable_grad().reset();
    model(idx).square().mean().backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(TiedMemory, ASparseEmbeddingInTheOutermostUnitTrainsAsADenseOne) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup&) {
                        const auto dense = train_sparse_root(false);
                        const auto sparse = train_sparse_root(true);
                        WORLD_CHECK(dense.size() == sparse.size(), dense.size() << " vs " << sparse.size());
                        for (size_t i = 0; i < dense.size(); ++i) {
                          WORLD_CHECK(torch::allclose(dense[i], sparse[i], 1e-5, 1e-7),
                                      "shard " << i << " differs by "
                                               << (dense[i] - sparse[i]).abs().max().item<float>());
                        }
                      }),
            "");
}

}  // namespace
