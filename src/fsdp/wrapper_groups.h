// The process groups of one FSDP wrapper: the group it shards over, the
// group replicating its shards under hybrid sharding (HSDP), and the two
// together, from the options' process_group, device_mesh, sharding_groups
// or LOCAL_WORLD_SIZE (docs/fsdp.md, "Hybrid sharding").
//
// Threading: resolve_groups may run on any thread (the meshes it makes are
// kept under a lock).
#pragma once

#include <memory>

#include "tdist/fsdp.h"

namespace tdist::detail {

bool hybrid(ShardingStrategy s);

struct WrapperGroups {
  std::shared_ptr<ProcessGroup> world;      // all of the wrapper's ranks
  std::shared_ptr<ProcessGroup> shard;      // the unit's gathers and reduce-scatters
  std::shared_ptr<ProcessGroup> replicate;  // hybrid sharding: the all-reduce across shard groups; else null
};

// The groups a wrapper works over (FsdpState::pg, replicate_pg, world_pg),
// from process_group, device_mesh, sharding_groups or LOCAL_WORLD_SIZE.
// A mesh made here is kept in o.device_mesh, so the wrappers auto-wrapping
// makes from these options share its groups; a 2-D mesh turns FULL_SHARD
// and SHARD_GRAD_OP into their hybrid forms.
WrapperGroups resolve_groups(FullyShardedDataParallelOptions& o);

// reshard_after_forward as an int k (hpZ): the block of k consecutive ranks
// of `shard` holding this rank, a subgroup made once per (shard, k) and
// shared by every wrapper over them (made collectively by the first, on
// every rank of `shard`). Null when k is 0, 1 or shard's size (nothing to
// make); UsageError unless k divides shard's size.
std::shared_ptr<ProcessGroup> post_forward_group(const std::shared_ptr<ProcessGroup>& shard, int k);

}  // namespace tdist::detail
