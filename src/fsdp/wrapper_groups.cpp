// The groups an FSDP wrapper works over. The contract is in
// wrapper_groups.h.
#include "fsdp/wrapper_groups.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

#include "tdist/errors.h"
#include "util/launch_env.h"

namespace tdist::detail {

namespace {

// What make() returns for (over, key), made once and shared while anybody
// holds it. Every rank makes its wrappers in the same order, so the first
// wrapper asking makes it (collectively) on every rank and the others find
// it. `over` is held weakly: a group that is gone matches nothing.
template <typename T, typename Key, typename Make>
std::shared_ptr<T> made_once(const std::shared_ptr<ProcessGroup>& over, const Key& key, Make make) {
  struct Made {
    std::weak_ptr<ProcessGroup> over;
    Key key;
    std::weak_ptr<T> value;
  };
  static std::mutex mu;
  static std::vector<Made>* made = new std::vector<Made>;  // outlives static destruction
  std::lock_guard<std::mutex> lock(mu);
  made->erase(std::remove_if(made->begin(), made->end(), [](const Made& m) { return m.value.expired(); }),
              made->end());
  for (const Made& m : *made) {
    if (m.over.lock() == over && m.key == key) return m.value.lock();
  }
  std::shared_ptr<T> value = make();
  made->push_back({over, key, value});
  return value;
}

// The (replicate, shard) mesh of `rows` over base: wrappers built one by
// one (each with options naming only sharding_groups or LOCAL_WORLD_SIZE)
// share its groups, as clip_grad_norm_ and the checkpoints need.
std::shared_ptr<DeviceMesh> shared_mesh(const std::string& device, const std::vector<std::vector<int>>& rows,
                                        const std::shared_ptr<ProcessGroup>& base) {
  return made_once<DeviceMesh>(base, std::make_pair(device, rows), [&] {
    return DeviceMesh::from_rows(device, rows, {"replicate", "shard"}, base);
  });
}

}  // namespace

bool hybrid(ShardingStrategy s) {
  return s == ShardingStrategy::HYBRID_SHARD || s == ShardingStrategy::HYBRID_SHARD_ZERO2;
}

WrapperGroups resolve_groups(FullyShardedDataParallelOptions& o) {
  const char* who = "FullyShardedDataParallel";
  if (o.device_mesh && (o.process_group || !o.sharding_groups.empty())) {
    throw UsageError(std::string(who) + ": give device_mesh, or process_group (with sharding_groups), not both");
  }
  const std::string device = o.device_id && o.device_id->is_cuda() ? "cuda" : "cpu";
  if (!o.device_mesh) {
    auto base = o.process_group ? o.process_group : default_group();
    if (!base) throw UsageError(std::string(who) + ": call init_process_group first, or pass a process_group");
    if (!o.sharding_groups.empty()) {
      o.device_mesh = shared_mesh(device, o.sharding_groups, base);
    } else if (hybrid(o.sharding_strategy)) {
      // One shard group per node, as tdist-run (and srun, mpirun) number
      // the ranks: the local world size, util/launch_env.h.
      const auto local = detail::local_world_size_from_env();
      const char* env = std::getenv("LOCAL_WORLD_SIZE");
      if (!local || base->size() % local->value != 0) {
        throw UsageError(std::string(who) + ": HYBRID_SHARD needs a 2-D device_mesh, sharding_groups, or "
                         "LOCAL_WORLD_SIZE (tdist-run sets it) dividing the group's " +
                         std::to_string(base->size()) + " ranks" +
                         (local   ? std::string(" (") + local->name + " is '" + std::to_string(local->value) + "')"
                          : env ? std::string(" (LOCAL_WORLD_SIZE is '") + env + "')"
                                : std::string()));
      }
      const int per_node = static_cast<int>(local->value);
      std::vector<std::vector<int>> rows(static_cast<size_t>(base->size() / per_node));
      for (int r = 0; r < base->size(); ++r) rows[static_cast<size_t>(r / per_node)].push_back(r);
      o.device_mesh = shared_mesh(device, rows, base);
    } else {
      return {base, base, nullptr};
    }
    o.process_group.reset();
    o.sharding_groups.clear();
  }
  const DeviceMesh& mesh = *o.device_mesh;
  if (mesh.ndim() == 1) {
    if (hybrid(o.sharding_strategy)) {
      throw UsageError(std::string(who) + ": hybrid sharding needs a 2-D device_mesh (replicate, shard), got 1-D");
    }
    return {mesh.group(), mesh.get_group(0), nullptr};
  }
  if (mesh.ndim() != 2) {
    throw UsageError(std::string(who) + ": device_mesh must be 1-D or 2-D (replicate, shard), got " +
                     std::to_string(mesh.ndim()) + "-D");
  }
  if (o.sharding_strategy == ShardingStrategy::NO_SHARD) {
    throw UsageError(std::string(who) + ": NO_SHARD with a 2-D device_mesh; replicate over the whole group "
                     "(a 1-D mesh or a process_group) or shard with HYBRID_SHARD");
  }
  if (o.sharding_strategy == ShardingStrategy::FULL_SHARD) o.sharding_strategy = ShardingStrategy::HYBRID_SHARD;
  if (o.sharding_strategy == ShardingStrategy::SHARD_GRAD_OP) {
    o.sharding_strategy = ShardingStrategy::HYBRID_SHARD_ZERO2;
  }
  return {mesh.group(), mesh.get_group(1), mesh.get_group(0)};
}

std::shared_ptr<ProcessGroup> post_forward_group(const std::shared_ptr<ProcessGroup>& shard, int k) {
  const int n = shard->size();
  if (k < 0 || k > n || (k > 0 && n % k != 0)) {
    throw UsageError("FullyShardedDataParallel: reshard_after_forward=" + std::to_string(k) +
                     " must divide the shard group's " + std::to_string(n) +
                     " ranks (the ranks each unit is resharded to after forward)");
  }
  if (k <= 1 || k == n) return nullptr;
  return made_once<ProcessGroup>(shard, k, [&] {
    std::shared_ptr<ProcessGroup> mine;
    for (int first = 0; first < n; first += k) {
      std::vector<int> block;
      for (int r = first; r < first + k; ++r) block.push_back(r);
      if (auto g = shard->new_group(block)) mine = std::move(g);
    }
    return mine;
  });
}

}  // namespace tdist::detail
