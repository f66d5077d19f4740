// BucketRebuild: the arrival order and rank 0's broadcast of it. The
// contract is in bucket_rebuild.h.
#include "ddp/bucket_rebuild.h"

#include <ATen/ATen.h>

namespace tdist::detail {

std::vector<ParamInfo> param_infos(const std::vector<at::Tensor>& params) {
  std::vector<ParamInfo> infos;
  for (const auto& p : params) {
    infos.push_back({static_cast<size_t>(p.numel()) * p.element_size(), static_cast<int>(p.scalar_type())});
  }
  return infos;
}

void BucketRebuild::schedule(const std::vector<char>& arrived) {
  // The arrival order, then whatever never arrived, last registered first.
  arrival_for_rebuild_ = std::move(arrival_);
  for (size_t k = arrived.size(); k-- > 0;) {
    if (!arrived[k]) arrival_for_rebuild_.push_back(k);
  }
  due_ = true;
}

std::optional<std::vector<std::vector<size_t>>> BucketRebuild::take_due(ProcessGroup& pg,
                                                                        const std::vector<at::Tensor>& params) {
  if (!due_) return std::nullopt;
  due_ = false;
  rebuilt_ = true;
  const int64_t n = static_cast<int64_t>(params.size());
  at::Tensor order = at::empty({n}, at::kLong);
  auto* o = order.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) o[k] = static_cast<int64_t>(arrival_for_rebuild_[k]);
  pg.broadcast(order, {0})->wait();
  std::vector<size_t> perm(n);
  std::vector<bool> seen(n, false);
  for (int64_t k = 0; k < n; ++k) {
    if (o[k] < 0 || o[k] >= n || seen[o[k]]) {
      throw CollectiveMismatchError("DistributedDataParallel: rank 0's gradient order is not a permutation");
    }
    seen[o[k]] = true;
    perm[k] = static_cast<size_t>(o[k]);
  }
  return assign_buckets_in_order(param_infos(params), perm, first_cap_bytes_, cap_bytes_);
}

}  // namespace tdist::detail
