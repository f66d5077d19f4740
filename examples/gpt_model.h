// GPT-2 as Hugging Face's GPT2LMHeadModel computes it, with its parameter
// names and layouts, so that its weights move to and from Python unchanged:
//
//   transformer.wte.weight          [vocab, n_embd]   token embedding (lm_head.weight is this tensor)
//   transformer.wpe.weight          [n_positions, n_embd]
//   transformer.h.{i}.ln_1.{weight,bias}
//   transformer.h.{i}.attn.c_attn.{weight [n_embd, 3 n_embd], bias}   Conv1D: [in, out], y = x W + b
//   transformer.h.{i}.attn.c_proj.{weight [n_embd, n_embd], bias}
//   transformer.h.{i}.ln_2.{weight,bias}
//   transformer.h.{i}.mlp.c_fc.{weight [n_embd, n_inner], bias}
//   transformer.h.{i}.mlp.c_proj.{weight [n_inner, n_embd], bias}
//   transformer.ln_f.{weight,bias}
//   lm_head.weight                  tied to transformer.wte.weight (unless tie_word_embeddings is false)
//
// Each block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); causal multi-head
// attention from the fused c_attn projection; the MLP's activation is
// "gelu_new" (GELU, tanh approximation). The blocks are the entries of a
// torch::nn::Sequential ("h"), so that FSDP's auto wrapping can give each
// a unit of its own.
//
// Used by examples/gpt.cpp and the benchmarks.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

namespace examples {

struct GptConfig {
  int64_t vocab_size = 256;  // byte-level: a byte is its token id
  int64_t n_positions = 128;
  int64_t n_embd = 128;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_inner = 0;  // the MLP's width; 0: 4 * n_embd
  std::string activation_function = "gelu_new";
  double layer_norm_epsilon = 1e-5;
  double initializer_range = 0.02;
  double embd_pdrop = 0, attn_pdrop = 0, resid_pdrop = 0;
  bool scale_attn_weights = true;
  bool scale_attn_by_inverse_layer_idx = false;
  bool tie_word_embeddings = true;
  int64_t inner() const { return n_inner > 0 ? n_inner : 4 * n_embd; }
  // GPT2LMHeadModel's parameter count (lm_head counted once when tied).
  // Exact in int64 for every config gpt_config_from_json accepts.
  int64_t parameter_count() const;
};

// A Hugging Face config.json's GPT-2 fields (others are ignored), checked:
// a config that is not GPT-2's, or sizes no machine could hold, is an
// error naming the field. Parse the file with gpt_config_parse (bounded
// depth: a deeply nested value would overflow the stack of anything that
// walks the tree recursively, dump() included).
nlohmann::ordered_json gpt_config_parse(const std::string& text);
GptConfig gpt_config_from_json(const nlohmann::ordered_json& j);
// config.json for Python: what GPT2Config.from_pretrained reads. `base`
// (a loaded model's own config.json, or null) keeps its other fields.
nlohmann::ordered_json gpt_config_to_json(const GptConfig& c, const nlohmann::ordered_json& base = nullptr);

// Hugging Face's Conv1D: weight [in, out], y = x W + b.
struct Conv1DImpl : torch::nn::Module {
  Conv1DImpl(int64_t in, int64_t out)
      : weight(register_parameter("weight", torch::empty({in, out}))),
        bias(register_parameter("bias", torch::zeros({out}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(1);
    return torch::addmm(bias, x.reshape({-1, x.size(-1)}), weight).view(sizes);
  }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Conv1D);

torch::Tensor gpt_activation(const std::string& name, const torch::Tensor& x);

struct GptAttentionImpl : torch::nn::Module {
  GptAttentionImpl(const GptConfig& c, int64_t layer_idx);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t n_head;
  double scale;
  double attn_pdrop;
  Conv1D c_attn, c_proj;
  torch::nn::Dropout resid_dropout;
};
TORCH_MODULE(GptAttention);

struct GptMlpImpl : torch::nn::Module {
  explicit GptMlpImpl(const GptConfig& c)
      : activation(c.activation_function),
        c_fc(register_module("c_fc", Conv1D(c.n_embd, c.inner()))),
        c_proj(register_module("c_proj", Conv1D(c.inner(), c.n_embd))),
        dropout(register_module("dropout", torch::nn::Dropout(c.resid_pdrop))) {}
  torch::Tensor forward(const torch::Tensor& x) { return dropout(c_proj(gpt_activation(activation, c_fc(x)))); }
  std::string activation;
  Conv1D c_fc, c_proj;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(GptMlp);

struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const GptConfig& c, int64_t layer_idx);
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }
  torch::nn::LayerNorm ln_1;
  GptAttention attn;
  torch::nn::LayerNorm ln_2;
  GptMlp mlp;
};
TORCH_MODULE(GptBlock);

// Hugging Face's GPT2Model: "transformer" in the model with the head.
struct GptModelImpl : torch::nn::Module {
  // make_block, when given, builds each entry of `h` (e.g. wrapped in
  // checkpoint_module); otherwise the entries are plain GptBlocks.
  using MakeBlock = std::function<torch::nn::AnyModule(const GptConfig&, int64_t layer_idx)>;
  GptModelImpl(const GptConfig& c, const MakeBlock& make_block);
  // idx: [batch, time] token ids -> [batch, time, n_embd]
  torch::Tensor forward(const torch::Tensor& idx);
  torch::nn::Embedding wte, wpe;
  torch::nn::Dropout drop;
  torch::nn::Sequential h;
  torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(GptModel);

// The language-model head: logits = x Wᵀ. Tied, it registers the token
// embedding's own tensor as its "weight" (one tensor, two names).
struct GptHeadImpl : torch::nn::Module {
  explicit GptHeadImpl(torch::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.to(x.scalar_type()).t()); }
  torch::Tensor weight;
};
TORCH_MODULE(GptHead);

struct GptLMHeadModelImpl : torch::nn::Module {
  explicit GptLMHeadModelImpl(const GptConfig& c, const GptModelImpl::MakeBlock& make_block = nullptr);
  // idx: [batch, time] -> logits [batch, time, vocab]
  torch::Tensor forward(const torch::Tensor& idx) { return lm_head(transformer(idx)); }
  GptConfig config;
  GptModel transformer;
  GptHead lm_head;
};
TORCH_MODULE(GptLMHeadModel);

// Hugging Face's initialisation (GPT2PreTrainedModel._init_weights): every
// weight matrix and embedding N(0, initializer_range), the residual
// projections (attn.c_proj, mlp.c_proj) N(0, initializer_range /
// sqrt(2 n_layer)), biases 0, LayerNorms 1 and 0. From torch's global
// generator (torch::manual_seed).
void init_gpt_weights(GptLMHeadModelImpl& m);

}  // namespace examples
