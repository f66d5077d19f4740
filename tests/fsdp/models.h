// The small models the FSDP tests train: a stack of residual blocks
// between an input and an output layer, built either plain (the one-process
// reference) or with every block in an FSDP wrapper of its own (nested).
// The shapes are chosen so that worlds of 2-4 pad some parameters and
// leave some ranks with empty shards (5 rows over 4 ranks; a 0-d scale).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "tdist/fsdp.h"

namespace tdist::test {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width = 7, int64_t hidden = 5) {
    fc1 = register_module("fc1", torch::nn::Linear(width, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, width));
    // A frozen parameter inside the unit: its backward reads it but reports
    // no gradient.
    gate = register_parameter("gate", torch::linspace(0.5, 1.5, width), /*requires_grad=*/false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2->forward(torch::tanh(fc1->forward(x))) * gate; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor gate;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  // wrap_blocks: each block in FSDP<Block> with these options; hidden:
  // the blocks' hidden width.
  explicit NetImpl(const FullyShardedDataParallelOptions* wrap_blocks = nullptr, int blocks = 3, int64_t hidden = 5) {
    in = register_module("in", torch::nn::Linear(6, 7));
    for (int i = 0; i < blocks; ++i) {
      const std::string name = "block" + std::to_string(i);
      if (wrap_blocks) {
        auto b = register_module(name, FSDP<Block>(Block(7, hidden), *wrap_blocks));
        calls.push_back([b](const torch::Tensor& x) { return b->forward(x); });
      } else {
        auto b = register_module(name, Block(7, hidden));
        calls.push_back([b](const torch::Tensor& x) { return b->forward(x); });
      }
    }
    scale = register_parameter("scale", torch::ones({}));
    head = register_module("head", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in->forward(x);
    for (size_t i = 0; i < calls.size(); ++i) {
      if (before_block) before_block(i, h);
      h = calls[i](h);
      if (after_block) after_block(i, h);
    }
    return head->forward(h * scale);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::Tensor scale;
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> calls;
  // Probes for tests that watch what happens around each block: called
  // with block i's input just before it runs, and with its output just
  // after (outside the block's wrapper, if it has one).
  std::function<void(size_t, const torch::Tensor&)> before_block, after_block;
};
TORCH_MODULE(Net);

// A name in a wrapped model without the wrappers' "module" steps.
inline std::string strip_wrappers(const std::string& name) {
  std::string out;
  size_t start = 0;
  while (start <= name.size()) {
    size_t dot = name.find('.', start);
    if (dot == std::string::npos) dot = name.size();
    const std::string part = name.substr(start, dot - start);
    if (part != "module") out += (out.empty() ? "" : ".") + part;
    start = dot + 1;
  }
  return out;
}

}  // namespace tdist::test
