// BlockPool: a freed block is handed to the next taker of its size; at most
// one free block of each size, at most four in all and at most twice the
// largest block asked for are kept; the rest go back to the allocator.
// The pool is one per process, so the steps run in one order in one test.
#include <gtest/gtest.h>

#include <cstddef>
#include <thread>
#include <vector>

#include "fsdp/block_pool.h"

namespace {

using tdist::detail::block_bytes;
using tdist::detail::pooled_bytes;
using tdist::detail::take_block;

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;

TEST(BlockPool, KeepsOneFreeBlockPerSizeWithinItsCaps) {
  ASSERT_EQ(pooled_bytes(), 0u);
  ASSERT_EQ(block_bytes(), 0u);
  c10::DataPtr a = take_block(kMiB);  // the largest asked for: the cap is 2 MiB
  c10::DataPtr b = take_block(kMiB);
  EXPECT_EQ(block_bytes(), 2 * kMiB) << "blocks in use count";
  void* a_memory = a.get();
  a.clear();
  EXPECT_EQ(pooled_bytes(), kMiB);
  EXPECT_EQ(block_bytes(), 2 * kMiB) << "a free block in the pool still counts";
  b.clear();  // a second free block of the same size is not kept
  EXPECT_EQ(pooled_bytes(), kMiB);
  EXPECT_EQ(block_bytes(), kMiB) << "a block given back to the allocator no longer counts";

  c10::DataPtr c = take_block(kMiB);
  EXPECT_EQ(c.get(), a_memory) << "the free block of that size is handed out again";
  EXPECT_EQ(pooled_bytes(), 0u);
  EXPECT_EQ(block_bytes(), kMiB);

  c10::DataPtr d = take_block(512 * kKiB);
  d.clear();
  c.clear();  // another size: kept beside it
  EXPECT_EQ(pooled_bytes(), kMiB + 512 * kKiB);
  c10::DataPtr e = take_block(768 * kKiB);
  e.clear();  // 2.25 MiB would pass twice the largest block
  EXPECT_EQ(pooled_bytes(), kMiB + 512 * kKiB);

  c10::DataPtr f = take_block(256 * kKiB);
  c10::DataPtr g = take_block(128 * kKiB);
  c10::DataPtr h = take_block(64 * kKiB);
  f.clear();
  g.clear();  // the fourth free block
  EXPECT_EQ(pooled_bytes(), kMiB + 896 * kKiB);
  h.clear();  // a fifth is not kept
  EXPECT_EQ(pooled_bytes(), kMiB + 896 * kKiB);

  // Blocks are writable over their whole size and go back from any thread.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        const size_t n = (1 + static_cast<size_t>((t + i) % 3)) * 64 * kKiB;
        c10::DataPtr block = take_block(n);
        static_cast<char*>(block.get())[n - 1] = static_cast<char>(i);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(pooled_bytes(), 2 * kMiB);
  EXPECT_EQ(block_bytes(), pooled_bytes()) << "with no block in use, every live block is a free one";
}

}  // namespace
