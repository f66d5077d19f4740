// ShardLayout: the dim-0 split and the chunk offsets. The contract is in
// shard_layout.h.
#include "fsdp/shard_layout.h"

#include <algorithm>
#include <string>

#include "flat/flat_buffer.h"
#include "tdist/errors.h"

namespace tdist::detail {

int64_t ParamShardLayout::rows_on(int rank) const {
  return std::clamp<int64_t>(rows - first_row_on(rank), 0, rows_per_rank);
}

std::vector<int64_t> ParamShardLayout::shard_shape(int rank) const {
  if (shape.empty()) return rows_on(rank) ? std::vector<int64_t>{} : std::vector<int64_t>{0};
  std::vector<int64_t> s = shape;
  s[0] = rows_on(rank);
  return s;
}

ShardLayout::ShardLayout(const std::vector<std::vector<int64_t>>& shapes, int world_size, int64_t align)
    : world_size_(world_size) {
  if (world_size < 1) throw UsageError("FSDP shard layout: the world size must be at least 1");
  if (align < 1) throw UsageError("FSDP shard layout: the alignment must be at least 1 element");
  params_.reserve(shapes.size());
  for (size_t k = 0; k < shapes.size(); ++k) {
    ParamShardLayout p;
    p.shape = shapes[k];
    for (int64_t d : p.shape) {
      if (d < 0) throw UsageError("FSDP shard layout: parameter " + std::to_string(k) + " has a negative dimension");
    }
    p.rows = p.shape.empty() ? 1 : p.shape[0];
    for (size_t i = 1; i < p.shape.size(); ++i) p.row_numel *= p.shape[i];
    p.rows_per_rank = (p.rows + world_size - 1) / world_size;
    params_.push_back(std::move(p));
  }
  // A chunk is the shards back to back: a flat layout of their sizes.
  std::vector<int64_t> shard_numels;
  for (const auto& p : params_) shard_numels.push_back(p.shard_numel());
  const FlatLayout chunk = flat_layout(shard_numels, align);
  for (size_t k = 0; k < params_.size(); ++k) params_[k].offset_in_chunk = chunk.offsets[k];
  chunk_numel_ = chunk.total;
  std::vector<int64_t> padded_numels;
  for (const auto& p : params_) padded_numels.push_back(p.shard_numel() * world_size);
  const FlatLayout full = flat_layout(padded_numels, align);
  for (size_t k = 0; k < params_.size(); ++k) params_[k].offset_in_full = full.offsets[k];
  full_numel_ = full.total;
}

int64_t ShardLayout::unpadded_numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.numel();
  return n;
}

}  // namespace tdist::detail
