// A small Vision Transformer for 28x28 images (Fashion-MNIST): 16 patches
// of 7x7, a class token, learned positions, a stack of pre-norm attention +
// MLP blocks in a torch::nn::Sequential (so that FSDP's auto wrapping can
// put each block in a unit of its own), a LayerNorm and a linear head.
// Used by examples/fsdp_vit.cpp and by tdist-bench fsdp --model vit.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <functional>

namespace examples {

struct VitConfig {
  int64_t depth = 4;       // blocks
  int64_t dim = 64;        // embedding width
  int64_t heads = 4;       // attention heads (dim must be a multiple)
  int64_t mlp_hidden = 0;  // the MLP's hidden width; 0: 2 * dim
  int64_t hidden() const { return mlp_hidden > 0 ? mlp_hidden : 2 * dim; }
};

// Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)).
struct VitBlockImpl : torch::nn::Module {
  explicit VitBlockImpl(const VitConfig& c)
      : heads(c.heads),
        norm1(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))),
        qkv(register_module("qkv", torch::nn::Linear(c.dim, 3 * c.dim))),
        proj(register_module("proj", torch::nn::Linear(c.dim, c.dim))),
        norm2(register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))),
        fc1(register_module("fc1", torch::nn::Linear(c.dim, c.hidden()))),
        fc2(register_module("fc2", torch::nn::Linear(c.hidden(), c.dim))) {}
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    auto q_k_v = qkv(norm1(x)).view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
    auto att = torch::softmax(torch::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(double(d / heads)), -1);
    x = x + proj(torch::matmul(att, q_k_v[2]).transpose(1, 2).reshape({b, t, d}));
    return x + fc2(torch::gelu(fc1(norm2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm norm1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm norm2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(VitBlock);

// make_block, when given, builds each entry of `blocks` (e.g. already
// wrapped with tdist::wrap, so that the whole model never exists
// unsharded); otherwise the entries are plain VitBlocks.
struct VitImpl : torch::nn::Module {
  using MakeBlock = std::function<torch::nn::AnyModule(const VitConfig&)>;
  explicit VitImpl(const VitConfig& c, const MakeBlock& make_block = nullptr)
      : patch(register_module("patch", torch::nn::Linear(49, c.dim))),
        cls(register_parameter("cls", torch::randn({1, 1, c.dim}) * 0.02)),
        pos(register_parameter("pos", torch::randn({1, 17, c.dim}) * 0.02)),
        blocks(register_module("blocks", torch::nn::Sequential())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))),
        head(register_module("head", torch::nn::Linear(c.dim, 10))) {
    for (int64_t i = 0; i < c.depth; ++i) {
      if (make_block) {
        blocks->push_back(make_block(c));
      } else {
        blocks->push_back(VitBlock(c));
      }
    }
  }
  // x: [batch, 784] or [batch, 1, 28, 28].
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0);
    x = x.view({b, 4, 7, 4, 7}).permute({0, 1, 3, 2, 4}).reshape({b, 16, 49});
    x = torch::cat({cls.expand({b, 1, cls.size(2)}).to(x.scalar_type()), patch(x)}, 1) + pos;
    x = blocks->forward(x);
    return head(norm(x.select(1, 0)));
  }
  torch::nn::Linear patch;
  torch::Tensor cls, pos;
  torch::nn::Sequential blocks;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
};
TORCH_MODULE(Vit);

}  // namespace examples
