// DeviceMesh: the layout checks and the groups along each dimension. The
// contract is in include/tdist/device_mesh.h.
#include "tdist/device_mesh.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "process_group/group_or_default.h"
#include "tdist/errors.h"

namespace tdist {

namespace {

std::string shape_text(const std::vector<int>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

}  // namespace

DeviceMesh::DeviceMesh(std::string device_type, std::vector<int> shape, std::vector<int> ranks,
                       std::vector<std::string> names, std::shared_ptr<ProcessGroup> group)
    : device_type_(std::move(device_type)),
      shape_(std::move(shape)),
      ranks_(std::move(ranks)),
      names_(std::move(names)),
      group_(std::move(group)) {
  const std::string what = "DeviceMesh " + shape_text(shape_);
  if (device_type_ != "cpu" && device_type_ != "cuda") {
    throw UsageError(what + ": device_type must be \"cpu\" or \"cuda\", got \"" + device_type_ + "\"");
  }
  if (shape_.empty()) throw UsageError(what + ": the mesh needs at least one dimension");
  int64_t product = 1;
  for (int s : shape_) {
    if (s < 1) throw UsageError(what + ": every dimension needs at least one rank");
    product *= s;
  }
  if (product != group_->size()) {
    throw UsageError(what + " holds " + std::to_string(product) + " ranks but group '" + group_->group_name() +
                     "' has " + std::to_string(group_->size()));
  }
  if (!names_.empty()) {
    if (names_.size() != shape_.size()) {
      throw UsageError(what + ": " + std::to_string(names_.size()) + " mesh_dim_names for " +
                       std::to_string(shape_.size()) + " dimensions");
    }
    if (std::set<std::string>(names_.begin(), names_.end()).size() != names_.size()) {
      throw UsageError(what + ": mesh_dim_names must differ");
    }
  }
  std::vector<int> seen(ranks_.size(), 0);
  for (int r : ranks_) {
    if (r < 0 || r >= group_->size() || seen[r]++) {
      throw UsageError(what + ": the mesh must hold every rank of the group once (rank " + std::to_string(r) + ")");
    }
  }
  // Strides of the row-major layout; this rank's place.
  const int n = ndim();
  std::vector<int> stride(n, 1);
  for (int d = n - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape_[d + 1];
  const int place = static_cast<int>(std::find(ranks_.begin(), ranks_.end(), group_->rank()) - ranks_.begin());
  coordinate_.resize(n);
  for (int d = 0; d < n; ++d) coordinate_[d] = place / stride[d] % shape_[d];
  // Along each dimension: one group per line of the mesh, made by every
  // rank in the same order (new_group is collective); this rank keeps its
  // own line's.
  dim_groups_.resize(n);
  for (int d = 0; d < n; ++d) {
    for (int start = 0; start < static_cast<int>(ranks_.size()); ++start) {
      if (start / stride[d] % shape_[d] != 0) continue;  // not the first place of a line along d
      std::vector<int> line;
      for (int i = 0; i < shape_[d]; ++i) line.push_back(ranks_[start + i * stride[d]]);
      auto g = group_->new_group(line);
      if (g) dim_groups_[d] = std::move(g);
    }
  }
}

std::shared_ptr<DeviceMesh> DeviceMesh::create(const std::string& device_type, std::vector<int> mesh_shape,
                                               std::vector<std::string> mesh_dim_names,
                                               std::shared_ptr<ProcessGroup> group) {
  auto g = detail::group_or_default(group, "init_device_mesh");
  std::vector<int> ranks(static_cast<size_t>(g->size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  int64_t product = 1;
  for (int s : mesh_shape) product *= std::max(s, 0);
  if (product != g->size()) ranks.resize(static_cast<size_t>(std::max<int64_t>(product, 0)), 0);  // refused below
  return std::make_shared<DeviceMesh>(device_type, std::move(mesh_shape), std::move(ranks), std::move(mesh_dim_names),
                                      std::move(g));
}

std::shared_ptr<DeviceMesh> DeviceMesh::from_rows(const std::string& device_type, std::vector<std::vector<int>> rows,
                                                  std::vector<std::string> mesh_dim_names,
                                                  std::shared_ptr<ProcessGroup> group) {
  auto g = detail::group_or_default(group, "DeviceMesh::from_rows");
  if (rows.empty()) throw UsageError("DeviceMesh::from_rows: no rows given");
  std::vector<int> ranks;
  for (const auto& row : rows) {
    if (row.size() != rows[0].size()) {
      throw UsageError("DeviceMesh::from_rows: rows of " + std::to_string(rows[0].size()) + " and " +
                       std::to_string(row.size()) + " ranks; every row (sharding group) needs the same size");
    }
    ranks.insert(ranks.end(), row.begin(), row.end());
  }
  const std::vector<int> shape{static_cast<int>(rows.size()), static_cast<int>(rows[0].size())};
  return std::make_shared<DeviceMesh>(device_type, shape, std::move(ranks), std::move(mesh_dim_names), std::move(g));
}

int DeviceMesh::size() const { return static_cast<int>(ranks_.size()); }

int DeviceMesh::size(int mesh_dim) const {
  if (mesh_dim < 0 || mesh_dim >= ndim()) {
    throw UsageError("DeviceMesh: dimension " + std::to_string(mesh_dim) + " of a " + std::to_string(ndim()) +
                     "-d mesh");
  }
  return shape_[mesh_dim];
}

int DeviceMesh::dim(const std::string& name) const {
  const auto it = std::find(names_.begin(), names_.end(), name);
  if (it != names_.end()) return static_cast<int>(it - names_.begin());
  std::string known;
  for (const auto& n : names_) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("DeviceMesh: no dimension named '" + name + "' (" +
                   (known.empty() ? std::string("the mesh has no dimension names") : "it has " + known) + ")");
}

const std::shared_ptr<ProcessGroup>& DeviceMesh::get_group(int mesh_dim) const {
  size(mesh_dim);  // checks it
  return dim_groups_[mesh_dim];
}

int DeviceMesh::get_local_rank(int mesh_dim) const {
  size(mesh_dim);
  return coordinate_[mesh_dim];
}

}  // namespace tdist
