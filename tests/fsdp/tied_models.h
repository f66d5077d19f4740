// A small language model with a tied parameter, for the tied-parameter
// tests (FSDP, DDP, state dicts, checkpoints): an embedding E, two blocks
// in a torch::nn::Sequential (what auto_wrap_policy can pick), a final
// LayerNorm and an LM head that registers E's weight as its own "weight"
// (GPT-2's lm_head.weight is transformer.wte.weight). With block_uses_tied
// the second block registers E's weight too (as "emb"), so a tensor is used
// by a picked block and by modules outside it.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>

#include "tdist/parameters.h"

namespace tdist::test {

constexpr int64_t kTiedVocab = 11;  // rows: padded over 2 and 3 ranks
constexpr int64_t kTiedWidth = 8;

struct TiedBlockImpl : torch::nn::Module {
  explicit TiedBlockImpl(torch::Tensor shared = {}) {
    fc = register_module("fc", torch::nn::Linear(kTiedWidth, kTiedWidth));
    if (shared.defined()) emb = register_parameter("emb", shared);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = x + torch::tanh(fc(x));
    if (emb.defined()) h = h + 0.5 * torch::matmul(torch::softmax(torch::matmul(h, emb.t()), -1), emb);
    return h;
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor emb;
};
TORCH_MODULE(TiedBlock);

struct LmHeadImpl : torch::nn::Module {
  explicit LmHeadImpl(torch::Tensor tied) { weight = register_parameter("weight", std::move(tied)); }
  torch::Tensor forward(torch::Tensor h) { return torch::matmul(h, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(LmHead);

struct TiedLmImpl : torch::nn::Module {
  // block: builds the i-th block from the tied tensor (given only to the
  // second one with block_uses_tied); the default builds a plain TiedBlock.
  explicit TiedLmImpl(bool block_uses_tied,
                      const std::function<torch::nn::AnyModule(TiedBlock)>& wrap_block = nullptr) {
    wte = register_module("wte", torch::nn::Embedding(kTiedVocab, kTiedWidth));
    h = register_module("h", torch::nn::Sequential());
    for (int i = 0; i < 2; ++i) {
      TiedBlock b(i == 1 && block_uses_tied ? wte->weight : torch::Tensor());
      if (wrap_block) {
        h->push_back(wrap_block(b));
      } else {
        h->push_back(b);
      }
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kTiedWidth})));
    lm_head = register_module("lm_head", LmHead(wte->weight));
  }
  torch::Tensor forward(torch::Tensor ids) { return lm_head(ln_f(h->forward(wte(ids)))); }
  torch::nn::Embedding wte{nullptr};
  torch::nn::Sequential h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  LmHead lm_head{nullptr};
};
TORCH_MODULE(TiedLm);

constexpr int kTiedSteps = 5;
constexpr int64_t kTiedBatch = 6;  // rows: divides over 1, 2 and 3 ranks
constexpr int64_t kTiedTokens = 5;

// Step `step`'s token ids [kTiedBatch, kTiedTokens + 1] (inputs, then the
// targets one to the right).
inline torch::Tensor tied_batch(int step) {
  torch::manual_seed(500 + step);
  return torch::randint(kTiedVocab, {kTiedBatch, kTiedTokens + 1}, torch::kLong);
}

// This rank's rows of a batch.
inline torch::Tensor tied_rows(const torch::Tensor& ids, int rank, int world) {
  const int64_t rows = kTiedBatch / world;
  return ids.narrow(0, rank * rows, rows);
}

// The mean next-token cross-entropy of `model` on `ids`.
template <typename Model>
torch::Tensor tied_loss(Model& model, const torch::Tensor& ids) {
  auto in = ids.narrow(1, 0, kTiedTokens);
  auto target = ids.narrow(1, 1, kTiedTokens);
  auto logits = model(in);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kTiedVocab}), target.reshape({-1}));
}

inline torch::optim::AdamW tied_optimizer(std::vector<torch::Tensor> params) {
  return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(2e-2).weight_decay(0.01));
}

// One process on the whole batch: the weights (every name; the tied ones
// equal) after kTiedSteps steps of AdamW over unique_parameters, the
// gradients clipped to `clip` first unless it is 0.
inline std::map<std::string, torch::Tensor> tied_reference(bool block_uses_tied, double clip = 0) {
  torch::manual_seed(7);
  TiedLm net(block_uses_tied);
  auto opt = tied_optimizer(tdist::unique_parameters(*net));
  for (int step = 0; step < kTiedSteps; ++step) {
    opt.zero_grad();
    tied_loss(net, tied_batch(step)).backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(tdist::unique_parameters(*net), clip);
    opt.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

}  // namespace tdist::test
