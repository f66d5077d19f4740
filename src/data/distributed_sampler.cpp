// DistributedSampler: PyTorch's order, a position that survives a change
// of world size. The contract is in tdist/sampler.h.
#include "tdist/sampler.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <string>

#include "tdist/errors.h"
#include "tdist/process_group.h"

namespace tdist {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

int64_t scalar_of(const std::map<std::string, at::Tensor>& state, const char* key) {
  const auto it = state.find(key);
  if (it == state.end()) {
    throw UsageError(std::string("DistributedSampler::load_state_dict: no \"") + key +
                     "\" in the state (a sampler's state_dict has \"epoch\", \"epoch_samples\" and \"dataset_size\")");
  }
  const at::Tensor& t = it->second;
  if (!t.defined() || t.numel() != 1 || !at::isIntegralType(t.scalar_type(), /*includeBool=*/false) ||
      !t.device().is_cpu()) {
    throw UsageError(std::string("DistributedSampler::load_state_dict: \"") + key + "\" is not one integer on the CPU");
  }
  return t.item<int64_t>();
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, const DistributedSamplerOptions& o)
    : size_(dataset_size), replicas_(o.num_replicas), rank_(o.rank), shuffle_(o.shuffle), seed_(o.seed),
      drop_last_(o.drop_last) {
  if (size_ < 0) throw UsageError("DistributedSampler: dataset size " + std::to_string(size_) + " is negative");
  if (replicas_ < 0 || rank_ < 0) {
    const auto group = default_group();
    if (!group) {
      throw UsageError("DistributedSampler: num_replicas and rank default to the default group's, and there is none "
                       "(call init_process_group first, or give both)");
    }
    if (replicas_ < 0) replicas_ = group->size();
    if (rank_ < 0) rank_ = group->rank();
  }
  if (replicas_ < 1 || rank_ >= replicas_) {
    throw UsageError("DistributedSampler: rank " + std::to_string(rank_) + " of " + std::to_string(replicas_) +
                     " replicas is not a rank");
  }
}

void DistributedSampler::set_epoch(int64_t epoch) {
  if (resumed_ && epoch == epoch_) {  // the loop's call for the epoch a state was restored in
    resumed_ = false;
    return;
  }
  resumed_ = false;
  epoch_ = epoch;
  start_ = 0;
  taken_ = 0;
}

int64_t DistributedSampler::rank_share(int64_t from) const {
  const int64_t left = std::max<int64_t>(0, size_ - from);
  return drop_last_ ? left / replicas_ : ceil_div(left, replicas_);
}

int64_t DistributedSampler::num_samples() const { return rank_share(0); }

at::Tensor DistributedSampler::take(int64_t first, int64_t last) const {
  const auto options = at::TensorOptions().dtype(at::kLong);
  if (last <= first) return at::empty({0}, options);
  if (order_epoch_ != epoch_ || !order_.defined()) {
    if (shuffle_) {
      auto gen = at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch_));
      order_ = at::randperm(size_, gen, options);
    } else {
      order_ = at::arange(size_, options);
    }
    order_epoch_ = epoch_;
  }
  // Positions past the end pad with the permutation's head, as PyTorch's.
  at::Tensor pos = at::arange(first, last, options) * replicas_ + (start_ + rank_);
  pos = at::remainder(pos, std::max<int64_t>(size_, 1));
  return order_.index_select(0, pos);
}

std::optional<at::Tensor> DistributedSampler::next(int64_t batch_size) {
  if (batch_size < 1) throw UsageError("DistributedSampler::next: batch size " + std::to_string(batch_size) + " < 1");
  const int64_t share = rank_share(start_);
  resumed_ = false;
  if (taken_ >= share) return std::nullopt;
  const int64_t last = std::min(share, taken_ + batch_size);
  at::Tensor out = take(taken_, last);
  taken_ = last;
  return out;
}

int64_t DistributedSampler::batches_left(int64_t batch_size) const {
  if (batch_size < 1) throw UsageError("DistributedSampler::batches_left: batch size < 1");
  return ceil_div(std::max<int64_t>(0, rank_share(start_) - taken_), batch_size);
}

int64_t DistributedSampler::batches_per_epoch(int64_t batch_size) const {
  if (batch_size < 1) throw UsageError("DistributedSampler::batches_per_epoch: batch size < 1");
  return ceil_div(num_samples(), batch_size);
}

at::Tensor DistributedSampler::indices() const { return take(taken_, rank_share(start_)); }

std::map<std::string, at::Tensor> DistributedSampler::state_dict() const {
  const auto scalar = [](int64_t v) { return at::full({1}, v, at::TensorOptions().dtype(at::kLong)); };
  return {{"epoch", scalar(epoch_)}, {"epoch_samples", scalar(epoch_samples())}, {"dataset_size", scalar(size_)}};
}

void DistributedSampler::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  const int64_t epoch = scalar_of(state, "epoch");
  const int64_t position = scalar_of(state, "epoch_samples");
  if (state.count("dataset_size")) {
    const int64_t size = scalar_of(state, "dataset_size");
    if (size != size_) {
      throw UsageError("DistributedSampler::load_state_dict: the state is of a dataset of " + std::to_string(size) +
                       " samples, this sampler's has " + std::to_string(size_));
    }
  }
  if (epoch < 0 || position < 0) {
    throw UsageError("DistributedSampler::load_state_dict: epoch " + std::to_string(epoch) + ", epoch_samples " +
                     std::to_string(position) + ": negative");
  }
  epoch_ = epoch;
  start_ = position;
  taken_ = 0;
  resumed_ = true;
}

}  // namespace tdist
