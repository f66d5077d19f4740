// DeviceMesh: the ranks of a group laid out as an n-dimensional array, with
// a process group along each dimension (PyTorch's DeviceMesh vocabulary).
// Hybrid sharding uses a 2-D mesh: dimension 0 replicates, dimension 1
// shards (a node's ranks in a row):
//
//   auto mesh = tdist::init_device_mesh("cpu", {2, 4}, {"replicate", "shard"});
//   mesh->get_group("shard");      // this rank's row: the 4 ranks it shards with
//   mesh->get_group("replicate");  // its column: the ranks holding its shards too
//
// Ranks are laid out row-major: with shape {2, 4}, group ranks 0-3 are row
// 0 and 4-7 row 1, so rows are consecutive ranks (one node each, as
// tdist-run numbers them). from_rows() takes any other layout.
//
// Threading: immutable after construction (the groups are thread-safe).
// Lifetime: holds its groups; shared by every wrapper that uses it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tdist/process_group.h"

namespace tdist {

class DeviceMesh {
 public:
  // Collective over `group` (null: the default group): every rank of it
  // calls it with the same arguments, in the same order relative to its
  // other new_group calls. mesh_shape's product must be the group's size;
  // mesh_dim_names, if given, one distinct name per dimension.
  // device_type ("cpu" or "cuda") is recorded, as PyTorch's first argument;
  // every backend serves both.
  static std::shared_ptr<DeviceMesh> create(const std::string& device_type, std::vector<int> mesh_shape,
                                            std::vector<std::string> mesh_dim_names = {},
                                            std::shared_ptr<ProcessGroup> group = nullptr);
  // A 2-D mesh whose rows are `rows` (group ranks; equal sizes, each rank
  // once): torch_xla's sharding_groups. Collective, as create().
  static std::shared_ptr<DeviceMesh> from_rows(const std::string& device_type, std::vector<std::vector<int>> rows,
                                               std::vector<std::string> mesh_dim_names = {},
                                               std::shared_ptr<ProcessGroup> group = nullptr);

  const std::string& device_type() const { return device_type_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int>& shape() const { return shape_; }
  int size() const;              // ranks in the mesh
  int size(int mesh_dim) const;  // along one dimension
  const std::vector<std::string>& mesh_dim_names() const { return names_; }
  // The dimension called name; UsageError naming the known ones.
  int dim(const std::string& name) const;
  // The group of the ranks that differ from this one in mesh_dim only.
  const std::shared_ptr<ProcessGroup>& get_group(int mesh_dim) const;
  const std::shared_ptr<ProcessGroup>& get_group(const std::string& mesh_dim) const {
    return get_group(dim(mesh_dim));
  }
  // This rank's index along mesh_dim, and its coordinates.
  int get_local_rank(int mesh_dim) const;
  int get_local_rank(const std::string& mesh_dim) const { return get_local_rank(dim(mesh_dim)); }
  const std::vector<int>& get_coordinate() const { return coordinate_; }
  // The group the mesh was made over, and this rank in it.
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  int get_rank() const { return group_->rank(); }
  // The group ranks of the mesh, row-major.
  const std::vector<int>& mesh() const { return ranks_; }

  DeviceMesh(std::string device_type, std::vector<int> shape, std::vector<int> ranks, std::vector<std::string> names,
             std::shared_ptr<ProcessGroup> group);  // use create() / from_rows()

 private:
  std::string device_type_;
  std::vector<int> shape_;
  std::vector<int> ranks_;  // row-major: the group rank at each place
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  std::vector<int> coordinate_;
  std::vector<std::shared_ptr<ProcessGroup>> dim_groups_;
};

// DeviceMesh::create, as PyTorch names it.
inline std::shared_ptr<DeviceMesh> init_device_mesh(const std::string& device_type, std::vector<int> mesh_shape,
                                                    std::vector<std::string> mesh_dim_names = {},
                                                    std::shared_ptr<ProcessGroup> group = nullptr) {
  return DeviceMesh::create(device_type, std::move(mesh_shape), std::move(mesh_dim_names), std::move(group));
}

}  // namespace tdist
