#include "fsdp/fsdp_model.h"

#include "fsdp/fsdp_state.h"
#include "fsdp/wrapper_tree.h"
#include "tdist/fsdp.h"

namespace tdist::detail {

std::optional<FsdpModel> FsdpModel::of(torch::nn::Module& root) {
  std::vector<WrapperVisit> all;
  walk_wrappers(root, "", "", all);
  if (all.empty()) return std::nullopt;
  FsdpModel m(root);
  m.group_ = all[0].state.pg;
  m.replicate_ = all[0].state.replicate_pg;
  m.world_ = all[0].state.world_pg;
  for (const auto& v : all) {
    const ShardedUnit& u = *v.state.unit;
    for (size_t k = 0; k < u.params().size(); ++k) {
      const FsdpParam& p = u.params()[k];
      const ParamShardLayout& pl = u.layout().param(k);
      FsdpParamRecord r;
      r.name = join_name(v.original_path, p.original_name);
      for (const auto& a : p.aliases) r.aliases.push_back(join_name(v.original_path, a));
      r.tensor = p.param;
      r.full_shape = pl.shape;
      r.first_row = pl.first_row_on(u.shard_rank());
      r.rows = pl.rows_on(u.shard_rank());
      r.rows_per_rank = pl.rows_per_rank;
      r.sharded = u.sharded();
      m.params_.push_back(std::move(r));
    }
    for (const auto& [impl, dtype] : v.state.converted_buffers) m.converted_.emplace(impl, dtype);
  }
  return m;
}

ShardMetadata FsdpModel::metadata() const { return shard_metadata(*root_); }

void FsdpModel::settle(const char* what) const { settled_wrappers(*root_, what); }

void FsdpModel::check_loaded() const {
  std::vector<WrapperVisit> all;
  walk_wrappers(*root_, "", "", all);
  for (const auto& v : all) v.state.unit->check_loaded();
}

void FsdpModel::visit_gathered(const std::function<void(const std::string&, const at::Tensor&)>& fn) const {
  for (const auto& v : settled_wrappers(*root_, "full_state_dict")) {
    ShardedUnit& u = *v.state.unit;
    u.unshard(/*exact=*/true);
    try {
      for (const FsdpParam& p : u.params()) fn(join_name(v.original_path, p.original_name), p.param);
    } catch (...) {
      u.reshard();
      throw;
    }
    u.reshard();
  }
}

}  // namespace tdist::detail
