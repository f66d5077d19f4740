// shm symmetric memory, with ranks as threads: allocation (every rank maps
// every rank's block), the registry, the plan's keys, and the all_reduce
// that runs in place when every rank's keys agree and staged when not.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "comm/reduce.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/symmetric.h"
#include "comm/shm/symmetric_allreduce.h"
#include "tdist/errors.h"
#include "tests/comm/shm/threads.h"

using namespace tdist::comm;
using namespace tdist::comm::shm;
using namespace tdist::test::shm;

namespace {

TEST(SymmetricBlocks, EveryRankMapsEveryCopyAndTheLastOwnerUnmaps) {
  GroupOptions o;
  o.size = 3;
  constexpr size_t kBytes = 10'000;
  auto errors = run_group(o, [&](Member& m) {
    auto registry = std::make_shared<SymRegistry>();
    std::string why;
    std::shared_ptr<void> block = allocate_symmetric_block(m.rounds, registry, kBytes, in(10s), &why);
    ASSERT_TRUE(block) << why;
    auto* own = static_cast<uint8_t*>(block.get());
    EXPECT_EQ(own[0], 0);
    EXPECT_EQ(own[kBytes - 1], 0) << "not zero-filled";
    const SymBlock* b = registry->find(own + 100, 200);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->copies[m.rounds.rank()], own);
    EXPECT_EQ(b->bytes, kBytes);
    EXPECT_EQ(registry->find(own + kBytes - 1, 2), nullptr) << "past the end";
    EXPECT_EQ(registry->find(own - 1, 1), nullptr);
    // Each rank stamps its own copy; every rank reads every stamp in its
    // mapping of the others' copies.
    std::memset(own, 0x40 + m.rounds.rank(), kBytes);
    m.rounds.first_barrier(m.rounds.make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0), in(10s));
    for (int r = 0; r < m.rounds.size(); ++r) {
      EXPECT_EQ(b->copies[r][0], 0x40 + r);
      EXPECT_EQ(b->copies[r][kBytes - 1], 0x40 + r);
    }
    m.rounds.first_barrier(m.rounds.make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0), in(10s));
    block.reset();
    EXPECT_TRUE(registry->empty()) << "the deleter left the block registered";
  });
  for (int r = 0; r < o.size; ++r) EXPECT_EQ(message(errors[r]), "") << "rank " << r;
}

TEST(SymmetricAllReduce, KeysAgreeOnlyForTheSamePartsOfTheSameBlocks) {
  GroupOptions o;
  o.size = 2;
  std::vector<std::vector<uint64_t>> keys(o.size);
  auto errors = run_group(o, [&](Member& m) {
    auto registry = std::make_shared<SymRegistry>();
    SymmetricAllReduce sym(registry);
    float ordinary[16];
    sym.plan({Piece{ordinary, 16}}, 4, m.rounds.rank());
    EXPECT_EQ(sym.key()[0] | sym.key()[1], 0u) << "no blocks yet";
    auto block = allocate_symmetric_block(m.rounds, registry, 4096, in(10s), nullptr);
    ASSERT_TRUE(block);
    auto* f = static_cast<float*>(block.get());
    auto take = [&](const std::vector<Piece>& pieces) {
      sym.plan(pieces, 4, m.rounds.rank());
      keys[m.rounds.rank()].push_back(sym.key()[0]);
      keys[m.rounds.rank()].push_back(sym.key()[1]);
    };
    take({Piece{f, 100}});
    take({Piece{f, 40}, Piece{f + 40, 60}});  // touching pieces merge: the same key
    take({Piece{f + 1, 100}});
    take({Piece{f, 100}, Piece{ordinary, 16}});  // one ordinary piece: no key
  });
  for (int r = 0; r < o.size; ++r) ASSERT_EQ(message(errors[r]), "") << "rank " << r;
  ASSERT_EQ(keys[0].size(), 8u);
  EXPECT_EQ(keys[0], keys[1]) << "ranks disagree on the same parts";
  EXPECT_NE(keys[0][0] | keys[0][1], 0u);
  EXPECT_EQ(keys[0][0], keys[0][2]);
  EXPECT_EQ(keys[0][1], keys[0][3]);
  EXPECT_NE(keys[0][0], keys[0][4]) << "another offset, the same key";
  EXPECT_EQ(keys[0][6] | keys[0][7], 0u);
}

// all_reduce (sum) through reduce_scatter_gather with a symmetric plan:
// in place when every rank's buffer is in the block, staged when one rank's
// is not; the same result either way, float32 and float16 on the wire.
TEST(SymmetricAllReduce, InPlaceOrStagedTheSameSum) {
  for (int size : {2, 3}) {
    for (bool everyone : {true, false}) {
      for (DataType wire : {DataType::kFloat32, DataType::kFloat16}) {
        GroupOptions o;
        o.size = size;
        o.round_bytes = 4096;  // many staged rounds
        constexpr size_t kCount = 5000;
        auto errors = run_group(o, [&](Member& m) {
          const int me = m.rounds.rank();
          auto registry = std::make_shared<SymRegistry>();
          SymmetricAllReduce sym(registry);
          auto block = allocate_symmetric_block(m.rounds, registry, (kCount + 16) * 4, in(10s), nullptr);
          ASSERT_TRUE(block);
          std::vector<float> ordinary(kCount);
          float* buf = everyone || me != size - 1 ? static_cast<float*>(block.get()) + 16 : ordinary.data();
          for (size_t i = 0; i < kCount; ++i) buf[i] = float((i % 97) + me);
          const std::vector<Piece> pieces{Piece{buf, 1000}, Piece{buf + 1000, kCount - 1000}};
          const PieceWalker walk(pieces, 4);
          sym.plan(pieces, 4, me);
          const OpDesc desc = m.rounds.make_desc(OpKind::kAllReduce, wire, ReduceOp::kSum, -1, kCount);
          algo::reduce_scatter_gather(m.rounds, walk, DataType::kFloat32, wire, ReduceOp::kSum, desc, -1, in(10s),
                                      &sym);
          for (size_t i = 0; i < kCount; ++i) {
            const float want = float(size * (i % 97) + size * (size - 1) / 2);
            ASSERT_EQ(buf[i], want) << "element " << i << " on rank " << me;
          }
        });
        for (int r = 0; r < size; ++r) {
          EXPECT_EQ(message(errors[r]), "") << "size " << size << (everyone ? " in place" : " staged") << " wire "
                                            << dtype_name(wire) << ", rank " << r;
        }
      }
    }
  }
}

}  // namespace
