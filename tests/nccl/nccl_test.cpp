// The nccl backend's GPU-free parts, run in CI (no GPU): dtype and reduce-op
// mapping with its refusals, the unique id's trip through a store between
// real processes, the plugin's registration, and a clear error naming the
// rank when a group asks for nccl where no GPU is visible (on a GPU machine
// the same test checks that the group works instead).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstring>
#include <fstream>

#include "comm/backend.h"
#include "nccl/nccl_types.h"
#include "tdist/errors.h"
#include "tests/util/process.h"
#include "tests/util/world.h"

namespace {

using tdist::comm::DataType;
using tdist::comm::ReduceOp;
namespace nccl = tdist::nccl;

TEST(NcclTypes, EveryDtypeMaps) {
  EXPECT_EQ(nccl::to_nccl(DataType::kFloat32), ncclFloat32);
  EXPECT_EQ(nccl::to_nccl(DataType::kFloat64), ncclFloat64);
  EXPECT_EQ(nccl::to_nccl(DataType::kFloat16), ncclFloat16);
  EXPECT_EQ(nccl::to_nccl(DataType::kBFloat16), ncclBfloat16);
  EXPECT_EQ(nccl::to_nccl(DataType::kInt8), ncclInt8);
  EXPECT_EQ(nccl::to_nccl(DataType::kUInt8), ncclUint8);
  EXPECT_EQ(nccl::to_nccl(DataType::kInt32), ncclInt32);
  EXPECT_EQ(nccl::to_nccl(DataType::kInt64), ncclInt64);
  EXPECT_EQ(nccl::to_nccl(DataType::kBool), ncclUint8);
}

TEST(NcclTypes, ReduceOpsMapAndBoolIsLogical) {
  EXPECT_EQ(nccl::to_nccl(ReduceOp::kSum, DataType::kFloat32, "x"), ncclSum);
  EXPECT_EQ(nccl::to_nccl(ReduceOp::kProduct, DataType::kInt32, "x"), ncclProd);
  EXPECT_EQ(nccl::to_nccl(ReduceOp::kMin, DataType::kInt64, "x"), ncclMin);
  EXPECT_EQ(nccl::to_nccl(ReduceOp::kMax, DataType::kFloat16, "x"), ncclMax);
  EXPECT_EQ(nccl::to_nccl(ReduceOp::kAvg, DataType::kBFloat16, "x"), ncclAvg);
  // bool: SUM is logical or (MAX), PRODUCT logical and (MIN); uint8 sums
  // would overflow into non-boolean bytes.
  EXPECT_EQ(nccl::to_nccl(ReduceOp::kSum, DataType::kBool, "x"), ncclMax);
  EXPECT_EQ(nccl::to_nccl(ReduceOp::kProduct, DataType::kBool, "x"), ncclMin);
}

TEST(NcclTypes, RefusesWhatNcclLacksNamingTheOp) {
  for (ReduceOp op : {ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
    try {
      nccl::to_nccl(op, DataType::kInt32, "all_reduce");
      ADD_FAILURE() << "no error for " << tdist::comm::reduce_op_name(op);
    } catch (const tdist::UsageError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("all_reduce"), std::string::npos) << m;
      EXPECT_NE(m.find(tdist::comm::reduce_op_name(op)), std::string::npos) << m;
      EXPECT_NE(m.find("gloo"), std::string::npos) << m;
    }
  }
  EXPECT_THROW(nccl::to_nccl(ReduceOp::kAvg, DataType::kInt64, "reduce"), tdist::UsageError);
}

TEST(NcclTypes, LibraryVersionIsReadable) {
  const std::string v = nccl::library_version();
  EXPECT_EQ(v.rfind("2.", 0), 0u) << v;
}

// Three processes share a FileStore; every one ends up with rank 0's id.
TEST(NcclUniqueId, TravelsThroughTheStoreBetweenProcesses) {
  tdist::test::TempDir dir;
  const std::string store_path = dir.path() + "/store";
  tdist::FileStore keep(store_path);  // the file lives until the last user goes: this one
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 3; ++rank) {
    pids.push_back(tdist::test::fork_child([&, rank] {
      tdist::FileStore store(store_path);
      const ncclUniqueId id = nccl::exchange_unique_id(store, "nccl_unique_id", rank, std::chrono::seconds(30));
      std::ofstream(dir.path() + "/id" + std::to_string(rank), std::ios::binary)
          .write(id.internal, sizeof id.internal);
      return 0;
    }));
  }
  for (pid_t p : pids) {
    const int st = tdist::test::wait_child(p, std::chrono::seconds(60));
    ASSERT_TRUE(tdist::test::exited_ok(st)) << tdist::test::describe_status(st);
  }
  auto read = [&](int r) {
    std::ifstream f(dir.path() + "/id" + std::to_string(r), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string id0 = read(0);
  ASSERT_EQ(id0.size(), sizeof(ncclUniqueId::internal));
  EXPECT_NE(id0, std::string(id0.size(), '\0'));
  EXPECT_EQ(read(1), id0);
  EXPECT_EQ(read(2), id0);
}

TEST(NcclUniqueId, AMissingRankZeroIsATimeoutNamingTheRank) {
  tdist::HashStore store;
  try {
    nccl::exchange_unique_id(store, "nccl_unique_id", 2, std::chrono::milliseconds(200));
    FAIL() << "no error";
  } catch (const tdist::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
  }
}

TEST(NcclUniqueId, AForeignValueIsRefused) {
  tdist::HashStore store;
  store.set("nccl_unique_id", std::string_view("not an id"));
  EXPECT_THROW(nccl::exchange_unique_id(store, "nccl_unique_id", 1, std::chrono::seconds(1)), tdist::NetworkError);
}

TEST(NcclPlugin, IsRegistered) {
  const auto names = tdist::comm::backend_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "nccl"), names.end());
}

// Without a GPU: a named error at once, not a hang: from the backend (the
// message) and from a whole group (every rank fails). With one (world size
// 1, as NCCL allows one rank per GPU): a working group.
TEST(NcclGroup, NoVisibleGpuIsAClearErrorElseTheGroupWorks) {
  tdist::test::WorldOptions o;
  o.backend = "nccl";
  o.limit = std::chrono::milliseconds(60'000);
  // Asked in a child: CUDA initialised in this process would break the
  // children that run_world forks.
  const int probe = tdist::test::wait_child(
      tdist::test::fork_child([] { return c10::cuda::device_count() > 0 ? 3 : 0; }), std::chrono::seconds(60));
  ASSERT_TRUE(WIFEXITED(probe)) << tdist::test::describe_status(probe);
  if (WEXITSTATUS(probe) == 3) {
    EXPECT_EQ(tdist::test::run_world(1, [](tdist::ProcessGroup& pg) { pg.barrier()->wait(); }, o), "");
    // Backend "auto": CPU tensors on shm, CUDA tensors on nccl (made at the
    // first CUDA op).
    tdist::test::WorldOptions a;
    a.backend = "auto";
    a.limit = o.limit;
    EXPECT_EQ(tdist::test::run_world(1, [](tdist::ProcessGroup& pg) {
      WORLD_CHECK(pg.backend_name() == "shm" && pg.backend_name(c10::DeviceType::CUDA) == "nccl", pg.backend_name());
      at::Tensor t = at::ones({5}, at::kCUDA);
      pg.all_reduce(t)->wait();
      WORLD_CHECK(at::equal(t.cpu(), at::ones({5})), "the CUDA all_reduce of one rank changed its tensor");
      at::Tensor c = at::ones({5});
      pg.all_reduce(c)->wait();
    }, a), "");
    return;
  }
  tdist::comm::BackendContext ctx;
  ctx.store = std::make_shared<tdist::HashStore>();
  ctx.rank = 1;
  ctx.size = 2;
  ctx.global_ranks = {0, 3};
  try {
    tdist::comm::create_backend("nccl", ctx);
    ADD_FAILURE() << "no error without a GPU";
  } catch (const tdist::UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 3 sees no CUDA device"), std::string::npos) << m;
    EXPECT_NE(m.find("cuda"), std::string::npos) << m;  // the CUDA error's name
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string out = tdist::test::run_world(2, [](tdist::ProcessGroup& pg) { pg.barrier()->wait(); }, o);
  EXPECT_NE(out.find("rank 0: "), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1: "), std::string::npos) << out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

}  // namespace
