// FlatBuffer: the layout arithmetic (offsets, alignment, padding), the two
// kinds of entry tensors, and allocation in a group's symmetric memory.
#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include "flat/flat_buffer.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::detail::FlatBuffer;
using tdist::detail::FlatBufferOptions;
using tdist::detail::FlatView;
using tdist::detail::flat_layout;

TEST(FlatLayout, BackToBackWithoutAlignment) {
  const auto l = flat_layout({6, 4, 1});
  EXPECT_EQ(l.offsets, (std::vector<int64_t>{0, 6, 10}));
  EXPECT_EQ(l.total, 11);
}

TEST(FlatLayout, AlignmentPadsEachOffsetAndPadToTheTotal) {
  const auto aligned = flat_layout({6, 4, 1}, /*align=*/4);
  EXPECT_EQ(aligned.offsets, (std::vector<int64_t>{0, 8, 12}));
  EXPECT_EQ(aligned.total, 13);
  const auto padded = flat_layout({6, 4, 1}, /*align=*/4, /*pad_to=*/8);
  EXPECT_EQ(padded.offsets, aligned.offsets);
  EXPECT_EQ(padded.total, 16);
  // An entry already on the boundary, an empty one, and a total that divides.
  const auto edge = flat_layout({4, 0, 5}, /*align=*/4, /*pad_to=*/3);
  EXPECT_EQ(edge.offsets, (std::vector<int64_t>{0, 4, 4}));
  EXPECT_EQ(edge.total, 9);
  EXPECT_EQ(flat_layout({}).total, 0);
  EXPECT_THROW(flat_layout({1}, 0), std::logic_error);
  EXPECT_THROW(flat_layout({1}, 1, 0), std::logic_error);
}

// Entries [2, 3], [5] and a scalar, aligned to 4, padded to 16: offsets
// 0, 8, 16, total 32.
FlatBuffer three_entries(FlatView view) {
  FlatBufferOptions o;
  o.align = 4;
  o.pad_to = 16;
  o.view = view;
  const std::vector<int64_t> a{2, 3}, b{5}, scalar{};
  return FlatBuffer({a, b, scalar}, at::TensorOptions().dtype(at::kDouble), o);
}

void expect_layout(const FlatBuffer& buf) {
  ASSERT_EQ(buf.size(), 3u);
  EXPECT_EQ(buf.flat().dim(), 1);
  EXPECT_EQ(buf.flat().numel(), 32);
  EXPECT_EQ(buf.flat().scalar_type(), at::kDouble);
  EXPECT_TRUE(buf.flat().is_contiguous());
  EXPECT_TRUE(buf.flat().eq(0).all().item<bool>());  // zero-filled, padding too
  EXPECT_FALSE(buf.in_symmetric_memory());
  EXPECT_EQ(buf.offset(0), 0);
  EXPECT_EQ(buf.offset(1), 8);
  EXPECT_EQ(buf.offset(2), 16);
  EXPECT_EQ(buf.view(0).sizes(), at::IntArrayRef({2, 3}));
  EXPECT_EQ(buf.view(1).sizes(), at::IntArrayRef({5}));
  EXPECT_EQ(buf.view(2).dim(), 0);
  const auto* base = buf.flat().data_ptr<double>();
  for (size_t k = 0; k < buf.size(); ++k) {
    EXPECT_EQ(buf.view(k).data_ptr<double>(), base + buf.offset(k)) << "entry " << k;
    EXPECT_TRUE(buf.view(k).is_contiguous());
    EXPECT_FALSE(buf.view(k).is_view());  // optimizers may detach_() and zero_() it
    EXPECT_EQ(buf.view(k).scalar_type(), at::kDouble);
  }
  // Writes through an entry land in the flat buffer, and back.
  buf.view(0).fill_(1);
  buf.view(1).fill_(2);
  buf.view(2).fill_(3);
  const auto flat = buf.flat();
  EXPECT_TRUE(flat.slice(0, 0, 6).eq(1).all().item<bool>());
  EXPECT_TRUE(flat.slice(0, 6, 8).eq(0).all().item<bool>());  // padding untouched
  EXPECT_TRUE(flat.slice(0, 8, 13).eq(2).all().item<bool>());
  EXPECT_EQ(flat[16].item<double>(), 3);
  EXPECT_TRUE(flat.slice(0, 17, 32).eq(0).all().item<bool>());
  flat.slice(0, 8, 13).fill_(5);
  EXPECT_TRUE(buf.view(1).eq(5).all().item<bool>());
}

TEST(FlatBuffer, AliasEntriesShareTheBuffersStorage) {
  const FlatBuffer buf = three_entries(FlatView::kAlias);
  expect_layout(buf);
  for (size_t k = 0; k < buf.size(); ++k) EXPECT_TRUE(buf.view(k).storage().is_alias_of(buf.flat().storage()));
  // detach_() and zero_() work on it, as LibTorch's zero_grad does.
  at::Tensor g = buf.view(1);
  g.detach_();
  g.zero_();
  EXPECT_TRUE(buf.flat().slice(0, 8, 13).eq(0).all().item<bool>());
}

TEST(FlatBuffer, OwnEntriesHaveAStorageOfTheirOwnAndKeepTheMemoryAlive) {
  at::Tensor survivor;
  {
    const FlatBuffer buf = three_entries(FlatView::kOwn);
    expect_layout(buf);
    for (size_t k = 0; k < buf.size(); ++k) EXPECT_FALSE(buf.view(k).storage().is_alias_of(buf.flat().storage()));
    survivor = buf.view(1);
  }
  // The buffer is gone; its memory is not (ASan would see a use after free).
  EXPECT_TRUE(survivor.eq(5).all().item<bool>());
  survivor.fill_(7);
  EXPECT_TRUE(survivor.eq(7).all().item<bool>());
}

TEST(FlatBuffer, TakesTheGivenDtypeAndEmptyBuffersWork) {
  FlatBuffer empty({}, at::TensorOptions().dtype(at::kFloat));
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.flat().numel(), 0);
  const std::vector<int64_t> s{3};
  FlatBuffer half({s, s}, at::TensorOptions().dtype(at::kHalf));
  EXPECT_EQ(half.flat().scalar_type(), at::kHalf);
  EXPECT_EQ(half.view(1).scalar_type(), at::kHalf);
  EXPECT_EQ(half.offset(1), 3);
}

// In a group's symmetric memory where it has some (shm), ordinary memory
// where not (gloo); either way an all-reduce of the flat buffer reduces
// every entry.
void symmetric_buffer(ProcessGroup& pg) {
  FlatBufferOptions o;
  o.symmetric_group = &pg;
  o.align = 16;
  o.pad_to = pg.size();
  const std::vector<int64_t> a{3, 7}, b{1000};
  for (FlatView view : {FlatView::kAlias, FlatView::kOwn}) {
    o.view = view;
    FlatBuffer buf({a, b}, at::TensorOptions().dtype(at::kFloat), o);
    WORLD_CHECK(buf.in_symmetric_memory() == pg.has_symmetric_memory(),
                "in symmetric memory: " << buf.in_symmetric_memory());
    WORLD_CHECK(pg.is_symmetric(buf.flat()) == pg.has_symmetric_memory(), "is_symmetric disagrees");
    WORLD_CHECK(buf.offset(1) == 32, "offset " << buf.offset(1));
    WORLD_CHECK(buf.flat().numel() % pg.size() == 0, "total " << buf.flat().numel());
    WORLD_CHECK(buf.flat().eq(0).all().item<bool>(), "not zero-filled");
    buf.view(0).fill_(pg.rank() + 1);
    buf.view(1).fill_(2 * (pg.rank() + 1));
    pg.all_reduce(buf.flat(), {tdist::ReduceOp::SUM})->wait();
    const float n = pg.size(), sum = n * (n + 1) / 2;
    WORLD_CHECK(buf.view(0).eq(sum).all().item<bool>(), "entry 0: " << buf.view(0).max().item<float>());
    WORLD_CHECK(buf.view(1).eq(2 * sum).all().item<bool>(), "entry 1: " << buf.view(1).max().item<float>());
    WORLD_CHECK(buf.flat().slice(0, 21, 32).eq(0).all().item<bool>(), "padding changed");
  }
}

class FlatBufferInGroup : public ::testing::TestWithParam<std::string> {};

TEST_P(FlatBufferInGroup, SymmetricWhereTheGroupHasIt) {
  tdist::test::WorldOptions o;
  o.backend = GetParam();
  EXPECT_EQ(tdist::test::run_world(2, symmetric_buffer, o), "");
}

INSTANTIATE_TEST_SUITE_P(Backends, FlatBufferInGroup, ::testing::Values("shm", "gloo"),
                         [](const auto& info) { return info.param; });

}  // namespace
