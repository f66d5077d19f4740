// ShardLayout: how an FSDP unit's parameters are split over the ranks of a
// group (docs/fsdp.md). Each parameter is sharded on dim 0: its rows are
// padded to a multiple of the world size and rank r keeps rows
// [r * rows_per_rank, (r + 1) * rows_per_rank) (padding rows hold zeros). A
// 0-d parameter counts as one row. Rank r's chunk is its shards of every
// parameter back to back (each starting at a multiple of `align`
// elements); an all-gather of the chunks gives the gathered buffer, laid
// out rank-major: [rank 0's chunk][rank 1's chunk]...
//
// Pure arithmetic on shapes: no tensors, no groups. Immutable after
// construction, so thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tdist::detail {

struct ParamShardLayout {
  std::vector<int64_t> shape;    // the full parameter's
  int64_t rows = 1;              // dim 0's size (1 for a 0-d parameter)
  int64_t row_numel = 1;         // elements per row: the product of the other dims
  int64_t rows_per_rank = 0;     // ceil(rows / world size)
  int64_t offset_in_chunk = 0;   // elements: where this parameter's shard starts in a chunk
  int64_t offset_in_full = 0;    // elements: where the padded full parameter starts in the full layout

  int64_t numel() const { return rows * row_numel; }
  // Elements of every rank's shard, padding included.
  int64_t shard_numel() const { return rows_per_rank * row_numel; }
  // Rows of real data that rank r keeps (the rest of its shard is padding):
  // possibly none, when the parameter has fewer rows than the group ranks.
  int64_t rows_on(int rank) const;
  // The first of those rows in the full parameter.
  int64_t first_row_on(int rank) const { return rank * rows_per_rank; }
  // The shape of rank r's shard without padding: the full shape with
  // rows_on(r) rows (a 0-d parameter: [] on the rank holding it, [0] on
  // the others).
  std::vector<int64_t> shard_shape(int rank) const;
};

class ShardLayout {
 public:
  // One entry per parameter shape. REQUIRES: world_size >= 1, align >= 1,
  // no negative dimension (UsageError otherwise).
  ShardLayout(const std::vector<std::vector<int64_t>>& shapes, int world_size, int64_t align = 1);

  int world_size() const { return world_size_; }
  size_t size() const { return params_.size(); }
  const ParamShardLayout& param(size_t k) const { return params_[k]; }
  const std::vector<ParamShardLayout>& params() const { return params_; }

  // Elements of one rank's chunk (every rank's is the same size), and of
  // the gathered buffer (world_size chunks).
  int64_t chunk_numel() const { return chunk_numel_; }
  int64_t gathered_numel() const { return chunk_numel_ * world_size_; }
  // Where rank r's shard of parameter k starts in the gathered buffer.
  int64_t gathered_offset(size_t k, int rank) const { return rank * chunk_numel_ + params_[k].offset_in_chunk; }
  // Elements of the full layout: every parameter padded to world_size
  // shards.
  int64_t full_numel() const { return full_numel_; }
  // Elements of the unit's parameters without padding.
  int64_t unpadded_numel() const;

 private:
  int world_size_;
  std::vector<ParamShardLayout> params_;
  int64_t chunk_numel_ = 0;
  int64_t full_numel_ = 0;
};

}  // namespace tdist::detail
