// ShardLayout: every element of every parameter lands in exactly one
// rank's shard, at the place the gathered buffer says, for worlds of 1 to 5
// and parameters smaller than the world; padding is where the layout says.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "fsdp/shard_layout.h"
#include "tdist/errors.h"

namespace {

using tdist::detail::ShardLayout;

using Shapes = std::vector<std::vector<int64_t>>;

// Row-major index of every element, shard by shard, as each rank would copy
// its rows into its chunk; then the gathered buffer rank-major. Elements
// are numbered 1.. per parameter (0 is padding).
std::vector<std::vector<int64_t>> gather(const ShardLayout& l) {
  std::vector<int64_t> buffer(static_cast<size_t>(l.gathered_numel()), -1);
  for (int r = 0; r < l.world_size(); ++r) {
    for (size_t k = 0; k < l.size(); ++k) {
      const auto& p = l.param(k);
      const int64_t at = l.gathered_offset(k, r);
      for (int64_t i = 0; i < p.shard_numel(); ++i) {
        const int64_t row = p.first_row_on(r) + i / p.row_numel;
        const bool real = i / p.row_numel < p.rows_on(r);
        buffer[static_cast<size_t>(at + i)] = real ? row * p.row_numel + i % p.row_numel + 1 : 0;
      }
    }
  }
  // Each parameter read back from the gathered buffer.
  std::vector<std::vector<int64_t>> full(l.size());
  for (size_t k = 0; k < l.size(); ++k) {
    const auto& p = l.param(k);
    for (int r = 0; r < l.world_size(); ++r) {
      const int64_t at = l.gathered_offset(k, r);
      for (int64_t i = 0; i < p.rows_on(r) * p.row_numel; ++i) full[k].push_back(buffer[static_cast<size_t>(at + i)]);
    }
  }
  return full;
}

TEST(ShardLayout, EveryElementComesBackInPlaceForWorldsOneToFive) {
  const Shapes shapes{{7, 3}, {5}, {}, {1, 4}, {0, 6}, {16, 2, 2}, {3}};
  for (int world = 1; world <= 5; ++world) {
    for (int64_t align : {1, 4}) {
      ShardLayout l(shapes, world, align);
      ASSERT_EQ(l.size(), shapes.size());
      const auto full = gather(l);
      for (size_t k = 0; k < shapes.size(); ++k) {
        const auto& p = l.param(k);
        ASSERT_EQ(static_cast<int64_t>(full[k].size()), p.numel()) << "world " << world << " param " << k;
        for (int64_t i = 0; i < p.numel(); ++i) {
          ASSERT_EQ(full[k][static_cast<size_t>(i)], i + 1) << "world " << world << " param " << k << " element " << i;
        }
        EXPECT_EQ(p.offset_in_chunk % align, 0);
        EXPECT_GE(p.rows_per_rank * world, p.rows);
        EXPECT_LT((p.rows_per_rank - 1) * world, std::max<int64_t>(p.rows, 1)) << "more padding than needed";
      }
      EXPECT_EQ(l.gathered_numel(), l.chunk_numel() * world);
    }
  }
}

TEST(ShardLayout, ShapesRowsAndPadding) {
  ShardLayout l({{7, 3}, {}, {2}}, 3);
  EXPECT_EQ(l.param(0).rows, 7);
  EXPECT_EQ(l.param(0).row_numel, 3);
  EXPECT_EQ(l.param(0).rows_per_rank, 3);
  EXPECT_EQ(l.param(0).rows_on(0), 3);
  EXPECT_EQ(l.param(0).rows_on(2), 1);
  EXPECT_EQ(l.param(1).rows, 1);  // 0-d: one row of one element
  EXPECT_EQ(l.param(1).numel(), 1);
  EXPECT_EQ(l.param(1).rows_on(0), 1);
  EXPECT_EQ(l.param(1).rows_on(1), 0);  // ranks 1 and 2 hold only padding
  EXPECT_EQ(l.param(2).rows_on(2), 0);
  EXPECT_EQ(l.param(2).offset_in_chunk, 9 + 1);
  EXPECT_EQ(l.chunk_numel(), 9 + 1 + 1);
  EXPECT_EQ(l.unpadded_numel(), 21 + 1 + 2);
}

TEST(ShardLayout, AnEmptyUnitAndBadArguments) {
  ShardLayout empty({}, 4);
  EXPECT_EQ(empty.chunk_numel(), 0);
  EXPECT_EQ(empty.gathered_numel(), 0);
  EXPECT_THROW(ShardLayout({{2}}, 0), tdist::UsageError);
  EXPECT_THROW(ShardLayout({{2}}, 2, 0), tdist::UsageError);
  EXPECT_THROW(ShardLayout({{2, -1}}, 2), tdist::UsageError);
}


// The full layout: parameter k's padded rows are the all-gather of every
// rank's shard of k, so rank r's rows sit at offset_in_full + r * shard.
TEST(ShardLayout, TheFullLayoutHoldsEachParameterPaddedToWholeShards) {
  for (int world = 1; world <= 5; ++world) {
    ShardLayout l({{7, 3}, {}, {2}, {0, 4}, {10}}, world, 4);
    int64_t end = 0;
    for (size_t k = 0; k < l.size(); ++k) {
      const auto& p = l.param(k);
      EXPECT_EQ(p.offset_in_full % 4, 0) << "world " << world << " param " << k;
      EXPECT_GE(p.offset_in_full, end) << "overlaps the previous parameter";
      end = p.offset_in_full + p.shard_numel() * world;
      EXPECT_GE(p.shard_numel() * world, p.numel());
    }
    EXPECT_GE(l.full_numel(), end);
    EXPECT_LT(l.full_numel(), end + 4);
  }
  ShardLayout l({{7, 3}, {5}}, 2);
  EXPECT_EQ(l.param(0).offset_in_full, 0);
  EXPECT_EQ(l.param(1).offset_in_full, 8 * 3);  // 7 rows padded to 8
  EXPECT_EQ(l.full_numel(), 24 + 6);
}

}  // namespace
