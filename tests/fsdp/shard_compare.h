// Shards of two FSDP models compared by name, bit for bit (the deferred
// tests: a deferred or loaded model against an eager or saved one).
#pragma once

#include <torch/torch.h>

#include <cctype>
#include <string>
#include <utility>
#include <vector>

namespace tdist::test {

using Shards = std::vector<std::pair<std::string, at::Tensor>>;

// Every shard of the model, by name, as it is now (copies).
inline Shards shards(torch::nn::Module& m) {
  Shards out;
  for (const auto& p : m.named_parameters(true)) out.emplace_back(p.key(), p.value().detach().clone());
  for (const auto& b : m.named_buffers(true)) out.emplace_back(b.key(), b.value().detach().clone());
  return out;
}

// "" when equal; else the first difference.
inline std::string compare_shards(const Shards& got, const Shards& want) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k].first != want[k].first) return "names " + got[k].first + " vs " + want[k].first;
    if (got[k].second.is_meta()) return got[k].first + " is still meta";
    if (!torch::equal(got[k].second, want[k].second)) return got[k].first + " differs";
  }
  return "";
}

// A case's name as gtest takes it (letters and digits; the rest '_').
inline std::string param_test_name(std::string n) {
  for (char& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

}  // namespace tdist::test
