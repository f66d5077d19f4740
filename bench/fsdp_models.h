// The models of tdist-bench fsdp, and how each variant wraps them.
//
// Two models, both with their blocks as the entries of a
// torch::nn::Sequential, so every FSDP variant makes one unit per block by
// auto wrapping (transformer_auto_wrap_policy), the rest in the root unit:
// - mlp: Linear(256 -> W), B residual blocks h + fc2(relu(fc1(h))) with
//   fc1 W -> H and fc2 H -> W, Linear(W -> 10);
// - vit: examples/vit_model.h (the fsdp_vit example's model) with depth
//   B, width W, MLP hidden H and `heads` heads, on 28x28 inputs;
// - gpt: examples/gpt_model.h (GPT-2 as Hugging Face computes it, lm_head
//   tied to the token embedding) with B blocks, width W, MLP width H,
//   `heads` heads, a vocabulary of 256 bytes, on kGptSequence tokens per row.
// Variants: ddp (DistributedDataParallel), no_shard, shard_grad_op,
// full_shard, and full_shard with activation checkpointing of every block
// (checkpoint_module through auto_wrapper_callable, as the example does)
// and/or bf16 mixed precision (param_dtype; gradients reduced in bf16).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "examples/gpt_model.h"
#include "examples/vit_model.h"
#include "tdist/tdist.h"

namespace tdist::bench {

inline const std::vector<std::string>& fsdp_variants() {
  static const std::vector<std::string> v = {"ddp",             "no_shard",        "shard_grad_op",
                                             "full_shard",      "full_shard_ckpt", "full_shard_bf16",
                                             "full_shard_ckpt_bf16"};
  return v;
}
inline bool variant_checkpoints(const std::string& v) { return v.find("_ckpt") != std::string::npos; }
inline bool variant_bf16(const std::string& v) { return v.find("_bf16") != std::string::npos; }

struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t w, int64_t h)
      : fc1(register_module("fc1", torch::nn::Linear(w, h))), fc2(register_module("fc2", torch::nn::Linear(h, w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MlpBlock);

struct MlpNetImpl : torch::nn::Module {
  explicit MlpNetImpl(const FsdpBenchOptions& o)
      : in(register_module("in", torch::nn::Linear(256, o.width))),
        blocks(register_module("blocks", torch::nn::Sequential())),
        head(register_module("head", torch::nn::Linear(o.width, 10))) {
    for (int i = 0; i < o.blocks; ++i) blocks->push_back(MlpBlock(o.width, o.hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(blocks->forward(in(x))); }
  torch::nn::Linear in;
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(MlpNet);

inline examples::VitConfig vit_config(const FsdpBenchOptions& o) {
  return examples::VitConfig{o.blocks, o.width, o.heads, o.hidden};
}

inline constexpr int64_t kGptSequence = 128;

inline examples::GptConfig gpt_config(const FsdpBenchOptions& o) {
  examples::GptConfig c;
  c.n_layer = o.blocks;
  c.n_embd = o.width;
  c.n_inner = o.hidden;
  c.n_head = o.heads;
  c.n_positions = kGptSequence;
  return c;
}

// One rank's inputs and targets (the same every step): mlp and vit rows of
// numbers and a class each; gpt rows of tokens and the next token of each.
inline std::pair<torch::Tensor, torch::Tensor> bench_batch(const FsdpBenchOptions& o) {
  if (o.model == "gpt") {
    const auto t = torch::randint(0, 256, {o.batch, kGptSequence + 1}, torch::kLong);
    return {t.narrow(1, 0, kGptSequence).contiguous(), t.narrow(1, 1, kGptSequence).contiguous()};
  }
  return {torch::randn({o.batch, o.model == "vit" ? 784 : 256}), torch::randint(0, 10, {o.batch}, torch::kLong)};
}

// One rank's model as a variant wraps it.
struct BenchModel {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> params;  // what the optimizer steps
  std::shared_ptr<void> keep;         // the model
};

template <typename Net, typename Block>
BenchModel wrap_for_variant(Net net, const std::string& variant, bool forward_prefetch) {
  BenchModel b;
  if (variant == "ddp") {
    DistributedDataParallelOptions d;
    d.gradient_as_bucket_view = true;
    auto m = std::make_shared<DistributedDataParallel<Net>>(std::move(net), d);
    b.forward = [m](const torch::Tensor& x) { return (*m)(x); };
    b.params = unique_parameters(**m);  // a tied parameter once
    b.keep = m;
    return b;
  }
  FullyShardedDataParallelOptions f;
  f.sharding_strategy = variant == "no_shard"        ? ShardingStrategy::NO_SHARD
                        : variant == "shard_grad_op" ? ShardingStrategy::SHARD_GRAD_OP
                                                     : ShardingStrategy::FULL_SHARD;
  if (variant_bf16(variant)) f.mixed_precision.param_dtype = at::kBFloat16;
  if (variant_checkpoints(variant)) {
    f.auto_wrapper_callable = [](torch::nn::AnyModule m, const FullyShardedDataParallelOptions& c) {
      return torch::nn::AnyModule(FullyShardedDataParallel(checkpoint_module(std::move(m)), c));
    };
  }
  f.auto_wrap_policy = transformer_auto_wrap_policy<Block>();
  f.forward_prefetch = forward_prefetch;
  auto m = std::make_shared<FSDP<Net>>(std::move(net), f);
  b.forward = [m](const torch::Tensor& x) { return (*m)(x); };
  b.params = unique_parameters(**m);
  b.keep = m;
  return b;
}

inline BenchModel build_bench_model(const FsdpBenchOptions& o, const std::string& variant) {
  if (o.model == "vit") {
    return wrap_for_variant<examples::Vit, examples::VitBlock>(examples::Vit(vit_config(o)), variant,
                                                              o.forward_prefetch);
  }
  if (o.model == "gpt") {
    return wrap_for_variant<examples::GptLMHeadModel, examples::GptBlock>(examples::GptLMHeadModel(gpt_config(o)),
                                                                          variant, o.forward_prefetch);
  }
  return wrap_for_variant<MlpNet, MlpBlock>(MlpNet(o), variant, o.forward_prefetch);
}

// Psi and the largest unit's parameters (a block, or the root's rest).
struct ModelSize {
  double psi = 0, largest_unit = 0;
};
inline ModelSize measure_size(const FsdpBenchOptions& o) {
  ModelSize s;
  torch::nn::Sequential blocks;
  std::shared_ptr<torch::nn::Module> net;
  if (o.model == "vit") {
    examples::Vit v(vit_config(o));
    net = v.ptr();
    blocks = v->blocks;
  } else if (o.model == "gpt") {
    examples::GptLMHeadModel g(gpt_config(o));
    net = g.ptr();
    blocks = g->transformer->h;
  } else {
    MlpNet m(o);
    net = m.ptr();
    blocks = m->blocks;
  }
  for (const auto& p : unique_parameters(*net)) s.psi += static_cast<double>(p.numel());
  double block = 0;
  for (const auto& p : blocks->ptr(0)->parameters()) block += static_cast<double>(p.numel());
  s.largest_unit = std::max(block, s.psi - block * static_cast<double>(blocks->size()));
  return s;
}

}  // namespace tdist::bench
