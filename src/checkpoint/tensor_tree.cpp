// tdist's checkpoint trees with LibTorch tensors in them: tensor_tree.h.
#include "checkpoint/tensor_tree.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "util/mapped_tensor.h"

namespace tdist::checkpoint {

PtValue TensorSink::add(at::ScalarType dtype, std::vector<int64_t> shape, Make make) {
  PtValue v = keys_.add(dtype, std::move(shape));
  pending_.emplace_back(v.as_tensor().storage_key, std::move(make));
  return v;
}

at::Tensor CopyPool::copy(const at::Tensor& t) {
  const bool pinned = t.is_cuda();
  if (next_ == buffers_.size()) buffers_.emplace_back();
  at::Tensor& b = buffers_[next_++];
  if (!b.defined() || b.scalar_type() != t.scalar_type() || b.sizes() != t.sizes() || b.is_pinned() != pinned) {
    // Pinned for a GPU's tensors; else, from kMappedBytes up, mapped
    // outside malloc's heap, so that the copies, kept from save to save,
    // leave its free space to training's large temporaries
    // (util/mapped_tensor.h). Smaller ones (biases, Adam's step counts)
    // would each cost a page and a system call, and malloc never maps
    // blocks below 128 KiB anyway.
    constexpr size_t kMappedBytes = size_t{256} << 10;
    b = pinned || t.nbytes() < kMappedBytes
            ? at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(pinned))
            : detail::mapped_cpu_tensor(t.sizes(), {}, t.options());
  }
  const bool now = !deferred_ || !t.is_cpu() || !t.is_contiguous() || t.nbytes() == 0 ||
                   std::find(now_.begin(), now_.end(), t.storage().data()) != now_.end();
  if (now) {
    b.copy_(t);
    return b;
  }
  constexpr size_t kChunk = size_t{8} << 20;
  const auto* src = static_cast<const uint8_t*>(t.data_ptr());
  auto* dst = static_cast<uint8_t*>(b.data_ptr());
  for (size_t at = 0; at < t.nbytes(); at += kChunk) chunks_.push_back({src + at, dst + at, std::min(kChunk, t.nbytes() - at)});
  sources_.push_back(t);
  return b;
}

void CopyPool::restart() {
  next_ = 0;
  sources_.clear();
  chunks_.clear();
  cursor_.store(0);
  done_.store(0);
}

void CopyPool::run() {
  size_t made = 0;
  for (size_t i = cursor_.fetch_add(1); i < chunks_.size(); i = cursor_.fetch_add(1)) {
    std::memcpy(chunks_[i].dst, chunks_[i].src, chunks_[i].bytes);
    ++made;
  }
  if (made == 0) return;
  if (done_.fetch_add(made, std::memory_order_acq_rel) + made == chunks_.size()) {
    std::lock_guard<std::mutex> lock(mu_);  // a finish() between its check and its wait sees the notify
    all_done_.notify_all();
  }
}

void CopyPool::finish() {
  if (!pending()) return;
  run();
  std::unique_lock<std::mutex> lock(mu_);
  all_done_.wait(lock, [&] { return !pending(); });
}

PtValue TensorSink::add(const at::Tensor& t) {
  if (!pool_) return add(t.scalar_type(), t.sizes().vec(), [t] { return t; });
  at::Tensor c = pool_->copy(t);
  return add(c.scalar_type(), c.sizes().vec(), [c] { return c; });
}

void TensorSink::write(PtWriter& writer, const PtValue& root) {
  std::unordered_map<std::string, Make*> by_key;
  for (auto& [key, make] : pending_) by_key[key] = &make;
  const std::vector<std::string> order = tensor_keys(root);
  writer.begin(root);
  for (const auto& key : order) {
    const auto it = by_key.find(key);
    if (it == by_key.end()) throw std::logic_error("TensorSink: a tensor of another sink in the tree");
    at::Tensor t = (*it->second)();
    *it->second = nullptr;  // written: let go of what it holds
    writer.write_storage(key, t);
  }
}

PtValue optimizer_value(const OptimizerStateDict& s, TensorSink& sink) {
  std::vector<std::pair<std::string, PtValue>> state;
  for (const auto& p : s.state) {
    std::vector<std::pair<std::string, PtValue>> fields;
    for (const auto& f : p.value()) fields.emplace_back(f.key(), sink.add(f.value()));
    state.emplace_back(p.key(), PtValue::dict(std::move(fields)));
  }
  PtValue like = PtValue::dict({{"optimizer", PtValue::string(s.optimizer)}});
  std::vector<PtValue> groups;
  for (const auto& g : s.param_groups) {
    std::vector<std::pair<std::string, PtValue>> entries;
    for (const auto& [name, value] : g.options) entries.emplace_back(name, PtValue::floating(value));
    std::vector<PtValue> names;
    for (const auto& n : g.params) names.push_back(PtValue::string(n));
    entries.emplace_back("params", PtValue::list(std::move(names)));
    groups.push_back(PtValue::dict(std::move(entries)));
  }
  like.mutable_entries().emplace_back("param_groups", PtValue::list(std::move(groups)));
  return optimizer_tree(like, PtValue::dict(std::move(state)), s.world_size, s.rank);
}

OptimizerStateDict optimizer_from(const PtValue& v, const std::function<at::Tensor(const PtTensorRef&)>& read) {
  OptimizerStateDict s;
  s.optimizer = v.at("optimizer").as_string();
  s.world_size = static_cast<int>(v.at("world_size").as_int());
  s.rank = static_cast<int>(v.at("rank").as_int());
  for (const auto& [param, fields] : v.at("state").entries()) {
    StateDict d;
    for (const auto& [name, t] : fields.entries()) d.insert(name, read(t.as_tensor()));
    s.state.insert(param, std::move(d));
  }
  for (const auto& g : v.at("param_groups").items()) {
    OptimizerParamGroupState group;
    for (const auto& [name, value] : g.entries()) {
      if (name == "params") {
        for (const auto& n : value.items()) group.params.push_back(n.as_string());
      } else {
        group.options[name] = value.as_float();
      }
    }
    s.param_groups.push_back(std::move(group));
  }
  return s;
}

}  // namespace tdist::checkpoint
