// GPT-2 as Hugging Face computes it. The contract is in gpt_model.h.
#include "examples/gpt_model.h"

#include <torch/version.h>

#include <limits>

namespace examples {

namespace {

// A positive integer field within [1, max] (null or absent: `fallback`).
int64_t size_field(const nlohmann::ordered_json& j, const char* key, int64_t fallback, int64_t max) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  const auto& v = j[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > max) {
    throw std::runtime_error(std::string("config.json: '") + key + "' must be an integer in [1, " +
                             std::to_string(max) + "], not " + v.dump());
  }
  return v.get<int64_t>();
}

double real_field(const nlohmann::ordered_json& j, const char* key, double fallback, double lo, double hi) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  const auto& v = j[key];
  if (!v.is_number() || !(v.get<double>() >= lo && v.get<double>() <= hi)) {
    throw std::runtime_error(std::string("config.json: '") + key + "' must be a number in [" + std::to_string(lo) +
                             ", " + std::to_string(hi) + "], not " + v.dump());
  }
  return v.get<double>();
}

bool bool_field(const nlohmann::ordered_json& j, const char* key, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) throw std::runtime_error(std::string("config.json: '") + key + "' must be true or false");
  return j[key].get<bool>();
}

bool known_activation(const std::string& a) {
  return a == "gelu_new" || a == "gelu_pytorch_tanh" || a == "gelu" || a == "relu" || a == "silu" || a == "swish";
}

}  // namespace

GptConfig gpt_config_from_json(const nlohmann::ordered_json& j) {
  if (!j.is_object()) throw std::runtime_error("config.json: not a JSON object");
  if (j.contains("model_type") && j["model_type"] != "gpt2") {
    throw std::runtime_error("config.json: model_type is " + j["model_type"].dump() + ", not \"gpt2\"");
  }
  GptConfig c;
  c.vocab_size = size_field(j, "vocab_size", 50257, int64_t{1} << 24);
  if (c.vocab_size < 256) throw std::runtime_error("config.json: vocab_size must be at least 256 (a byte is a token)");
  c.n_positions = size_field(j, "n_positions", 1024, int64_t{1} << 20);
  c.n_embd = size_field(j, "n_embd", 768, int64_t{1} << 16);
  c.n_layer = size_field(j, "n_layer", 12, 4096);
  c.n_head = size_field(j, "n_head", 12, 4096);
  c.n_inner = size_field(j, "n_inner", 0, int64_t{1} << 18);
  if (c.n_embd % c.n_head != 0) {
    throw std::runtime_error("config.json: n_embd (" + std::to_string(c.n_embd) + ") is not a multiple of n_head (" +
                             std::to_string(c.n_head) + ")");
  }
  if (j.contains("activation_function")) {
    if (!j["activation_function"].is_string() || !known_activation(j["activation_function"].get<std::string>())) {
      throw std::runtime_error("config.json: activation_function " + j["activation_function"].dump() +
                               " is not one of gelu_new, gelu_pytorch_tanh, gelu, relu, silu");
    }
    c.activation_function = j["activation_function"].get<std::string>();
  }
  c.layer_norm_epsilon = real_field(j, "layer_norm_epsilon", 1e-5, 0, 1);
  c.initializer_range = real_field(j, "initializer_range", 0.02, 0, 10);
  c.embd_pdrop = real_field(j, "embd_pdrop", 0.1, 0, 1);
  c.attn_pdrop = real_field(j, "attn_pdrop", 0.1, 0, 1);
  c.resid_pdrop = real_field(j, "resid_pdrop", 0.1, 0, 1);
  c.scale_attn_weights = bool_field(j, "scale_attn_weights", true);
  c.scale_attn_by_inverse_layer_idx = bool_field(j, "scale_attn_by_inverse_layer_idx", false);
  c.tie_word_embeddings = bool_field(j, "tie_word_embeddings", true);
  return c;
}

int64_t GptConfig::parameter_count() const {
  const int64_t e = n_embd, block = 2 * e + (e * 3 * e + 3 * e) + (e * e + e) + 2 * e + (e * inner() + inner()) +
                                    (inner() * e + e);
  return vocab_size * e + n_positions * e + n_layer * block + 2 * e + (tie_word_embeddings ? 0 : vocab_size * e);
}

nlohmann::ordered_json gpt_config_parse(const std::string& text) {
  constexpr int kMaxDepth = 32;  // GPT-2's config is 2 deep (task_specific_params)
  return nlohmann::ordered_json::parse(text, [](int depth, nlohmann::ordered_json::parse_event_t, nlohmann::ordered_json&) {
    if (depth > kMaxDepth) throw std::runtime_error("config.json: nested deeper than " + std::to_string(kMaxDepth));
    return true;
  });
}

nlohmann::ordered_json gpt_config_to_json(const GptConfig& c, const nlohmann::ordered_json& base) {
  nlohmann::ordered_json j = base.is_object() ? base : nlohmann::ordered_json::object();
  if (!base.is_object()) {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
  }
  j["vocab_size"] = c.vocab_size;
  j["n_positions"] = c.n_positions;
  j["n_embd"] = c.n_embd;
  j["n_layer"] = c.n_layer;
  j["n_head"] = c.n_head;
  j["n_inner"] = c.n_inner > 0 ? nlohmann::ordered_json(c.n_inner) : nlohmann::ordered_json(nullptr);
  j["activation_function"] = c.activation_function;
  j["layer_norm_epsilon"] = c.layer_norm_epsilon;
  j["initializer_range"] = c.initializer_range;
  j["embd_pdrop"] = c.embd_pdrop;
  j["attn_pdrop"] = c.attn_pdrop;
  j["resid_pdrop"] = c.resid_pdrop;
  j["scale_attn_weights"] = c.scale_attn_weights;
  j["scale_attn_by_inverse_layer_idx"] = c.scale_attn_by_inverse_layer_idx;
  j["reorder_and_upcast_attn"] = false;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (!base.is_object()) {
    // Byte-level text has no special tokens; the last id stands in for
    // them, as 50256 ("<|endoftext|>") does in GPT-2's own vocabulary.
    j["bos_token_id"] = c.vocab_size - 1;
    j["eos_token_id"] = c.vocab_size - 1;
    j["dtype"] = "float32";
  }
  return j;
}

torch::Tensor gpt_activation(const std::string& name, const torch::Tensor& x) {
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return torch::gelu(x, "tanh");
  if (name == "gelu") return torch::gelu(x);
  if (name == "relu") return torch::relu(x);
  return torch::silu(x);  // "silu", "swish"
}

GptAttentionImpl::GptAttentionImpl(const GptConfig& c, int64_t layer_idx)
    : n_head(c.n_head),
      scale((c.scale_attn_weights ? 1.0 / std::sqrt(static_cast<double>(c.n_embd / c.n_head)) : 1.0) /
            (c.scale_attn_by_inverse_layer_idx ? static_cast<double>(layer_idx + 1) : 1.0)),
      attn_pdrop(c.attn_pdrop),
      c_attn(register_module("c_attn", Conv1D(c.n_embd, 3 * c.n_embd))),
      c_proj(register_module("c_proj", Conv1D(c.n_embd, c.n_embd))),
      resid_dropout(register_module("resid_dropout", torch::nn::Dropout(c.resid_pdrop))) {}

torch::Tensor GptAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), e = x.size(2), d = e / n_head;
  // [b, t, 3, heads, d] -> three [b, heads, t, d]
  const auto qkv = c_attn(x).view({b, t, 3, n_head, d}).permute({2, 0, 3, 1, 4});
  const torch::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
  const double p = is_training() ? attn_pdrop : 0.0;
  torch::Tensor y;
#if TORCH_VERSION_MAJOR >= 2
  y = at::scaled_dot_product_attention(q, k, v, {}, p, /*is_causal=*/true, scale);
#else
  torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * scale;
  const auto future = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
  att = torch::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
  if (p > 0) att = torch::dropout(att, p, /*train=*/true);
  y = torch::matmul(att, v);
#endif
  return resid_dropout(c_proj(y.transpose(1, 2).reshape({b, t, e})));
}

GptBlockImpl::GptBlockImpl(const GptConfig& c, int64_t layer_idx)
    : ln_1(register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)))),
      attn(register_module("attn", GptAttention(c, layer_idx))),
      ln_2(register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)))),
      mlp(register_module("mlp", GptMlp(c))) {}

GptModelImpl::GptModelImpl(const GptConfig& c, const MakeBlock& make_block)
    : wte(register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd))),
      wpe(register_module("wpe", torch::nn::Embedding(c.n_positions, c.n_embd))),
      drop(register_module("drop", torch::nn::Dropout(c.embd_pdrop))),
      h(register_module("h", torch::nn::Sequential())),
      ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.layer_norm_epsilon)))) {
  for (int64_t i = 0; i < c.n_layer; ++i) {
    if (make_block) {
      h->push_back(make_block(c, i));
    } else {
      h->push_back(GptBlock(c, i));
    }
  }
}

torch::Tensor GptModelImpl::forward(const torch::Tensor& idx) {
  const int64_t t = idx.size(1);
  if (t > wpe->weight.size(0)) {
    throw std::runtime_error("GPT: a sequence of " + std::to_string(t) + " tokens is longer than n_positions (" +
                             std::to_string(wpe->weight.size(0)) + ")");
  }
  const torch::Tensor pos = torch::arange(t, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
  return ln_f(h->forward(drop(wte(idx) + wpe(pos))));
}

GptLMHeadModelImpl::GptLMHeadModelImpl(const GptConfig& c, const GptModelImpl::MakeBlock& make_block)
    : config(c),
      transformer(register_module("transformer", GptModel(c, make_block))),
      lm_head(register_module("lm_head", GptHead(c.tie_word_embeddings ? transformer->wte->weight
                                                                         : torch::empty({c.vocab_size, c.n_embd})))) {
  init_gpt_weights(*this);
}

void init_gpt_weights(GptLMHeadModelImpl& m) {
  torch::NoGradGuard no_grad;
  const double std = m.config.initializer_range;
  const double proj_std = std / std::sqrt(2.0 * static_cast<double>(m.config.n_layer));
  for (const auto& item : m.named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor p = item.value();
    const auto ends = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends("ln_1.weight") || ends("ln_2.weight") || ends("ln_f.weight")) {
      p.fill_(1);
    } else if (ends(".bias")) {
      p.zero_();
    } else if (ends("c_proj.weight")) {
      p.normal_(0, proj_std);
    } else if (name == "lm_head.weight" && m.config.tie_word_embeddings) {
      // the token embedding's own tensor, initialised under its first name
    } else {
      p.normal_(0, std);
    }
  }
}

}  // namespace examples
