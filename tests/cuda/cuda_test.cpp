// CUDA tensors on every backend, the nccl backend, and DDP on a GPU. Needs
// a GPU: it is built with the CUDA plugin but registered with ctest only
// under -DTDIST_GPU_TESTS=ON (CI has no GPU); docs/cuda.md says where it
// ran. Ranks are forked processes sharing GPU 0 (shm, gloo); nccl runs at
// world size 1, since NCCL refuses two ranks on one GPU (that refusal is
// tested too).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "comm/backend.h"
#include "tdist/ddp.h"
#include "tdist/fsdp.h"
#include "tdist/fsdp_wrap.h"
#include "tdist/powersgd.h"
#include "tdist/checkpointer.h"
#include "tdist/join.h"
#include "tdist/sharded_checkpoint.h"
#include "tests/process_group/conformance.h"
#include "tests/util/process.h"
#include "tests/util/world.h"
#include "util/torch_cuda_loader.h"

namespace {

using tdist::ProcessGroup;
using tdist::ReduceOp;
using tdist::test::run_world;
using tdist::test::WorldOptions;
namespace conf = tdist::test::conformance;

const c10::Device kGpu(c10::kCUDA, 0);

at::Tensor gpu(const at::Tensor& t) { return t.to(kGpu); }

#define GPU_EQUAL(got, want, what) EQUAL_OR_THROW((got).cpu(), (want).cpu(), what)

// Every op on CUDA tensors, checked against the CPU conformance values.
void every_op_on_cuda(ProcessGroup& pg) {
  tdist::detail::load_torch_cuda();
  const int n = pg.size(), r = pg.rank();
  for (auto t : conf::kAllTypes) {
    for (auto op : {ReduceOp::SUM, ReduceOp::MAX}) {
      for (int64_t size : {int64_t(0), int64_t(1), int64_t(1001), int64_t(300'007)}) {
        at::Tensor x = gpu(conf::input_for(r, n, size, t, op));
        pg.all_reduce(x, {op})->wait();
        GPU_EQUAL(x, conf::expected_for(n, size, t, op), "all_reduce " << conf::name(t) << " x " << size);
      }
    }
  }
  {  // coalesced, and float32 carried as bfloat16
    std::vector<at::Tensor> ts = {gpu(conf::input(r, 5, at::kFloat, ReduceOp::SUM)),
                                  gpu(conf::input(r, 70'001, at::kFloat, ReduceOp::SUM))};
    pg.all_reduce_coalesced(ts, {ReduceOp::SUM})->wait();
    GPU_EQUAL(ts[1], conf::expected(n, 70'001, at::kFloat, ReduceOp::SUM), "all_reduce_coalesced");
    at::Tensor w = gpu(conf::input(r, 4097, at::kFloat, ReduceOp::SUM));
    tdist::AllreduceOptions o;
    o.wire_dtype = at::kBFloat16;
    pg.all_reduce(w, o)->wait();
    GPU_EQUAL(w, conf::expected(n, 4097, at::kFloat, ReduceOp::SUM), "all_reduce as bfloat16");
  }
  for (int root = 0; root < n; ++root) {
    at::Tensor b = gpu(conf::input(r, 99'999, at::kHalf, ReduceOp::SUM));
    pg.broadcast(b, {root})->wait();
    GPU_EQUAL(b, conf::input(root, 99'999, at::kHalf, ReduceOp::SUM), "broadcast root " << root);
    at::Tensor x = gpu(conf::input(r, 1234, at::kLong, ReduceOp::SUM));
    pg.reduce(x, {root, ReduceOp::SUM})->wait();
    if (r == root) GPU_EQUAL(x, conf::expected(n, 1234, at::kLong, ReduceOp::SUM), "reduce root " << root);
    // gather / scatter
    at::Tensor in = gpu(conf::input(r, 777, at::kFloat, ReduceOp::SUM));
    std::vector<at::Tensor> outs;
    if (r == root) for (int i = 0; i < n; ++i) outs.push_back(at::full({777}, -1.0f, at::TensorOptions(kGpu)));
    pg.gather(outs, in, {root})->wait();
    if (r == root) {
      for (int i = 0; i < n; ++i) GPU_EQUAL(outs[i], conf::input(i, 777, at::kFloat, ReduceOp::SUM), "gather " << i);
    }
    std::vector<at::Tensor> ins;
    if (r == root) for (int i = 0; i < n; ++i) ins.push_back(gpu(conf::input(50 + i, 333, at::kFloat, ReduceOp::SUM)));
    at::Tensor got = at::zeros({333}, at::TensorOptions(kGpu));
    pg.scatter(got, ins, {root})->wait();
    GPU_EQUAL(got, conf::input(50 + r, 333, at::kFloat, ReduceOp::SUM), "scatter to " << r);
  }
  {  // all_gather, both forms
    at::Tensor x = gpu(conf::input(r, 20'003, at::kFloat, ReduceOp::SUM));
    std::vector<at::Tensor> outs;
    for (int i = 0; i < n; ++i) outs.push_back(at::empty({20'003}, x.options()));
    pg.all_gather(outs, x)->wait();
    at::Tensor flat = at::empty({20'003 * n}, x.options());
    pg.all_gather_into_tensor(flat, x)->wait();
    for (int i = 0; i < n; ++i) {
      GPU_EQUAL(outs[i], conf::input(i, 20'003, at::kFloat, ReduceOp::SUM), "all_gather " << i);
      GPU_EQUAL(flat.slice(0, i * 20'003, (i + 1) * 20'003), conf::input(i, 20'003, at::kFloat, ReduceOp::SUM),
                "all_gather_into_tensor " << i);
    }
  }
  {  // reduce_scatter, both forms
    std::vector<at::Tensor> blocks;
    for (int b = 0; b < n; ++b) blocks.push_back(gpu(conf::input(r + 10 * b, 5001, at::kBFloat16, ReduceOp::SUM)));
    at::Tensor out1 = at::empty({5001}, blocks[0].options());
    pg.reduce_scatter(out1, blocks, {ReduceOp::SUM})->wait();
    at::Tensor out2 = at::empty({5001}, blocks[0].options());
    pg.reduce_scatter_tensor(out2, at::cat(blocks), {ReduceOp::SUM})->wait();
    at::Tensor want = conf::input(10 * r, 5001, at::kBFloat16, ReduceOp::SUM).to(at::kDouble);
    for (int q = 1; q < n; ++q) want = want + conf::input(q + 10 * r, 5001, at::kBFloat16, ReduceOp::SUM).to(at::kDouble);
    GPU_EQUAL(out1, want.to(at::kBFloat16), "reduce_scatter");
    GPU_EQUAL(out2, want.to(at::kBFloat16), "reduce_scatter_tensor");
  }
  {  // all_to_all, single and list forms
    at::Tensor in = at::empty({3 * n, 5}, at::kLong);
    for (int d = 0; d < n; ++d) in.slice(0, 3 * d, 3 * d + 3).fill_(r * 100 + d);
    at::Tensor out = at::empty({3 * n, 5}, at::TensorOptions(kGpu).dtype(at::kLong));
    pg.all_to_all_single(out, gpu(in))->wait();
    at::Tensor outc = out.cpu();
    for (int s = 0; s < n; ++s) {
      WORLD_CHECK(outc.slice(0, 3 * s, 3 * s + 3).eq(s * 100 + r).all().item<bool>(), "all_to_all_single from " << s);
    }
    std::vector<at::Tensor> ins, outs;
    for (int d = 0; d < n; ++d) {
      ins.push_back(at::full({d + 1}, r * 10 + d, at::TensorOptions(kGpu).dtype(at::kInt)));
      outs.push_back(at::zeros({r + 1}, at::TensorOptions(kGpu).dtype(at::kInt)));
    }
    pg.all_to_all(outs, ins)->wait();
    for (int s = 0; s < n; ++s) {
      WORLD_CHECK(outs[s].cpu().eq(s * 10 + r).all().item<bool>(), "all_to_all list from " << s);
    }
  }
  if (n >= 2) {  // send / recv in a ring
    at::Tensor mine = gpu(conf::input(r, 4096, at::kFloat, ReduceOp::SUM));
    at::Tensor got = at::zeros({4096}, mine.options());
    auto s = pg.send(mine, (r + 1) % n, 7);
    pg.recv(got, (r + n - 1) % n, 7)->wait();
    s->wait();
    GPU_EQUAL(got, conf::input((r + n - 1) % n, 4096, at::kFloat, ReduceOp::SUM), "recv");
  }
  pg.barrier()->wait();
}

// The collective waits for its producer on another stream, and its
// consumer on that stream sees the result, with no host synchronisation
// in between: a long kernel (matmuls) precedes the write of the input.
void stream_ordering(ProcessGroup& pg) {
  tdist::detail::load_torch_cuda();
  const int n = pg.size(), r = pg.rank();
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, 0);
  c10::cuda::CUDAStreamGuard guard(side);
  at::Tensor big = at::randn({4096, 4096}, at::TensorOptions(kGpu));
  for (int round = 0; round < 5; ++round) {
    at::Tensor x = at::zeros({1 << 20}, at::TensorOptions(kGpu));
    at::Tensor slow = big;
    for (int k = 0; k < 8; ++k) slow = at::mm(slow, big).tanh_();  // tens of ms on the side stream
    x.add_(slow.sum().mul(0)).fill_(static_cast<float>(r + 1 + round));  // written after the matmuls
    auto w = pg.all_reduce(x);
    w->wait();  // the side stream waits for the op's end; the host need not
    at::Tensor y = x * 2;  // the consumer, queued on the side stream
    const float want = 2.0f * static_cast<float>(n * (n + 1) / 2 + n * round);
    WORLD_CHECK(y.eq(want).all().item<bool>(), "round " << round << ": got " << y[0].item<float>() << " want " << want);
  }
}

// Rank 0 passes CPU tensors, the others CUDA tensors: staging is invisible
// to the other ranks.
void mixed_cpu_and_cuda(ProcessGroup& pg) {
  tdist::detail::load_torch_cuda();
  const int n = pg.size(), r = pg.rank();
  at::Tensor x = conf::input(r, 100'003, at::kFloat, ReduceOp::SUM);
  if (r != 0) x = gpu(x);
  pg.all_reduce(x)->wait();
  GPU_EQUAL(x, conf::expected(n, 100'003, at::kFloat, ReduceOp::SUM), "mixed all_reduce");
}

class CudaCollectives : public ::testing::TestWithParam<std::string> {
 protected:
  void run(int world, void (*fn)(ProcessGroup&)) {
    WorldOptions o;
    o.backend = GetParam();
    o.limit = std::chrono::milliseconds(240'000);
    EXPECT_EQ(run_world(world, fn, o), "");
  }
};

TEST_P(CudaCollectives, EveryOpWorld2) { run(2, every_op_on_cuda); }
TEST_P(CudaCollectives, EveryOpWorld3) { run(3, every_op_on_cuda); }
TEST_P(CudaCollectives, StreamOrdering) { run(2, stream_ordering); }
TEST_P(CudaCollectives, MixedCpuAndCudaRanks) { run(2, mixed_cpu_and_cuda); }
INSTANTIATE_TEST_SUITE_P(HostBackends, CudaCollectives, ::testing::Values("shm", "gloo"));

// ---- nccl ---------------------------------------------------------------------

TEST(Nccl, EveryOpAtWorldSize1) {
  WorldOptions o;
  o.backend = "nccl";
  EXPECT_EQ(run_world(1, every_op_on_cuda, o), "");
  EXPECT_EQ(run_world(1, stream_ordering, o), "");
}

TEST(Nccl, CpuTensorsGoThroughDeviceMemory) {
  WorldOptions o;
  o.backend = "nccl";
  EXPECT_EQ(run_world(1, [](ProcessGroup& pg) {
    tdist::detail::load_torch_cuda();
    at::Tensor x = at::arange(1000, at::kFloat);
    pg.all_reduce(x, {ReduceOp::MAX})->wait();
    WORLD_CHECK(at::equal(x, at::arange(1000, at::kFloat)), "cpu all_reduce through nccl");
    std::vector<at::Tensor> outs = {at::zeros({3}, at::kLong)};
    pg.all_gather(outs, at::full({3}, 7, at::kLong))->wait();
    WORLD_CHECK(outs[0].eq(7).all().item<bool>(), "cpu all_gather through nccl");
  }, o), "");
}

TEST(Nccl, RefusesWhatNcclLacksByName) {
  WorldOptions o;
  o.backend = "nccl";
  EXPECT_EQ(run_world(1, [](ProcessGroup& pg) {
    tdist::detail::load_torch_cuda();
    at::Tensor x = at::ones({4}, at::TensorOptions(kGpu).dtype(at::kInt));
    try {
      pg.all_reduce(x, {ReduceOp::BXOR})->wait();
      WORLD_CHECK(false, "BXOR on nccl did not raise");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(std::string(e.what()).find("no BXOR") != std::string::npos, e.what());
    }
  }, o), "");
}

// NCCL refuses two ranks on one GPU; each rank's error names it and the
// communicator instead of hanging.
TEST(Nccl, TwoRanksOnOneGpuFailWithANamedError) {
  tdist::test::TempDir dir;
  const std::string path = dir.path() + "/store";
  tdist::FileStore keep(path);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    pids.push_back(tdist::test::fork_child([&, rank] {
      std::string msg = "no error";
      try {
        tdist::comm::BackendContext ctx;
        ctx.store = std::make_shared<tdist::FileStore>(path);
        ctx.rank = rank;
        ctx.size = 2;
        ctx.group_name = "two_on_one";
        ctx.timeout = std::chrono::milliseconds(20'000);
        auto b = tdist::comm::create_backend("nccl", ctx);
      } catch (const std::exception& e) {
        msg = e.what();
      }
      std::ofstream(dir.path() + "/msg" + std::to_string(rank)) << msg;
      return 0;
    }));
  }
  for (pid_t p : pids) {
    const int st = tdist::test::wait_child(p, std::chrono::seconds(60));
    ASSERT_TRUE(tdist::test::exited_ok(st)) << tdist::test::describe_status(st);
  }
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream f(dir.path() + "/msg" + std::to_string(rank));
    const std::string m((std::istreambuf_iterator<char>(f)), {});
    std::fprintf(stderr, "[ rank %d ] %s\n", rank, m.c_str());
    EXPECT_NE(m.find("communicator"), std::string::npos) << m;
    EXPECT_NE(m.find("rank " + std::to_string(rank)), std::string::npos) << m;
  }
}

// An op that cannot finish by its deadline (here: stuck behind seconds of
// matmuls on its stream) is caught by the watchdog, which aborts the
// communicator; the next op raises a TimeoutError naming the op and the
// rank, and nothing hangs.
TEST(Nccl, WatchdogTimesOutAnOpAndAbortsTheCommunicator) {
  WorldOptions o;
  o.backend = "nccl";
  o.final_barrier = false;  // the group is aborted: its barrier raises the same TimeoutError
  EXPECT_EQ(run_world(1, [](ProcessGroup& pg) {
    tdist::detail::load_torch_cuda();
    at::Tensor big = at::randn({8192, 8192}, at::TensorOptions(kGpu));
    at::Tensor acc = at::mm(big, big);
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(0);
    pg.all_reduce(acc)->wait();  // the group's first CUDA op makes its stream: not in the timed part
    stream.synchronize();
    auto m0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 10; ++k) acc = at::mm(big, big);
    stream.synchronize();
    const double mm_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - m0).count() / 10;
    at::Tensor x = at::ones({16}, at::TensorOptions(kGpu));
    // About 1.5 s of work on the current stream (a few dozen launches: far
    // more can fill the launch queue and block the host in the launches).
    const int count = static_cast<int>(1.5 / mm_s) + 1;
    const auto q0 = std::chrono::steady_clock::now();
    for (int k = 0; k < count; ++k) acc = at::mm(big, big);
    tdist::AllreduceOptions ao;
    ao.timeout = std::chrono::milliseconds(300);
    const auto t0 = std::chrono::steady_clock::now();
    pg.all_reduce(x, ao)->wait();  // queued on the GPU: no error yet
    const auto t1 = std::chrono::steady_clock::now();
    const bool busy = !stream.query();
    std::fprintf(stderr, "[ watchdog ] %d matmuls of %.1f ms queued in %.1f ms; the op queued in %.2f ms; stream busy: %d\n",
                 count, mm_s * 1e3, std::chrono::duration<double, std::milli>(t0 - q0).count(),
                 std::chrono::duration<double, std::milli>(t1 - t0).count(), busy);
    WORLD_CHECK(busy, "the matmuls finished before the op was queued; the test proves nothing");
    std::string m;
    while (m.empty() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      try {
        pg.all_reduce(at::ones({1}, at::TensorOptions(kGpu)))->wait();
      } catch (const tdist::TimeoutError& e) {
        m = e.what();
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "[ watchdog after %.2f s ] %s\n", s, m.c_str());
    WORLD_CHECK(!m.empty(), "no TimeoutError after " << s << " s");
    WORLD_CHECK(s > 0.25 && s < 10, "raised after " << s << " s, timeout 0.3 s");
    WORLD_CHECK(m.find("all_reduce") != std::string::npos && m.find("rank 0") != std::string::npos, m);
    stream.synchronize();  // the stream drains: nothing waits on the aborted op
  }, o), "");
}

// ---- DDP on the GPU against DDP on the CPU -----------------------------------

struct NetImpl : torch::nn::Module {
  NetImpl() : a(register_module("a", torch::nn::Linear(64, 128))), b(register_module("b", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(torch::Tensor x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Net);

enum class Hook { kNone, kFp16, kPowerSgd };

// Trains the same model with DDP on the CPU and on cuda:0 for a few steps;
// the parameters must agree to float32 rounding.
void ddp_parity(ProcessGroup& pg, Hook hook) {
  tdist::detail::load_torch_cuda();
  auto pgs = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
  std::vector<std::vector<at::Tensor>> finals;
  for (c10::Device dev : {c10::Device(c10::kCPU), kGpu}) {
    torch::manual_seed(0);
    Net net;
    tdist::DistributedDataParallelOptions o;
    o.process_group = pgs;
    o.bucket_cap_mb = 0.02;  // several buckets
    o.first_bucket_cap_mb = 0.01;
    if (dev.is_cuda()) o.device_id = dev;
    tdist::DistributedDataParallel<Net> ddp(net, o);
    if (hook == Hook::kFp16) ddp->register_comm_hook(pgs, tdist::fp16_compress_hook);
    std::shared_ptr<tdist::PowerSGDState> psgd;
    if (hook == Hook::kPowerSgd) {
      tdist::PowerSGDOptions po;
      po.matrix_approximation_rank = 2;
      po.start_powerSGD_iter = 2;
      psgd = std::make_shared<tdist::PowerSGDState>(pgs, po);
      ddp->register_comm_hook(psgd, tdist::powerSGD_hook);
    }
    torch::optim::SGD opt(ddp->parameters(), 0.05);
    for (int step = 0; step < 6; ++step) {
      torch::manual_seed(100 + 10 * pg.rank() + step);
      at::Tensor x = torch::randn({32, 64}).to(dev);
      at::Tensor y = torch::randint(0, 10, {32}, at::kLong).to(dev);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(ddp(x), y).backward();
      opt.step();
    }
    std::vector<at::Tensor> ps;
    for (const auto& p : ddp->parameters()) {
      WORLD_CHECK(p.device() == dev, "parameter on " << p.device() << ", not " << dev);
      ps.push_back(p.detach().cpu());
    }
    finals.push_back(ps);
  }
  const double tol = hook == Hook::kNone ? 1e-5 : 2e-3;
  for (size_t i = 0; i < finals[0].size(); ++i) {
    const double diff = (finals[0][i] - finals[1][i]).abs().max().item<double>();
    WORLD_CHECK(diff < tol, "parameter " << i << " differs by " << diff << " between CPU and CUDA");
  }
}

class CudaDdp : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  void run(Hook hook) {
    WorldOptions o;
    o.backend = std::get<0>(GetParam());
    o.limit = std::chrono::milliseconds(240'000);
    static Hook h;
    h = hook;
    EXPECT_EQ(run_world(std::get<1>(GetParam()), [](ProcessGroup& pg) { ddp_parity(pg, h); }, o), "");
  }
};

TEST_P(CudaDdp, MatchesCpu) { run(Hook::kNone); }
TEST_P(CudaDdp, Fp16HookMatchesCpu) { run(Hook::kFp16); }
TEST_P(CudaDdp, PowerSgdMatchesCpu) { run(Hook::kPowerSgd); }
INSTANTIATE_TEST_SUITE_P(Backends, CudaDdp,
                         ::testing::Values(std::make_tuple("shm", 2), std::make_tuple("gloo", 2),
                                           std::make_tuple("nccl", 1)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

// ---- FSDP on the GPU against FSDP on the CPU ----------------------------------

struct FsdpCase {
  tdist::ShardingStrategy strategy;
  std::optional<at::ScalarType> param_dtype;  // mixed precision
};

// A Sequential whose Linear layers the policy wraps in units of their own;
// trained with FSDP on the CPU and on cuda:0 (device_id), the shards must
// agree to float32 rounding (or to bfloat16's, with mixed precision).
void fsdp_parity(ProcessGroup& pg, const FsdpCase& c) {
  tdist::detail::load_torch_cuda();
  auto pgs = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
  std::vector<std::vector<at::Tensor>> finals;
  for (c10::Device dev : {c10::Device(c10::kCPU), kGpu}) {
    torch::manual_seed(0);
    torch::nn::Sequential seq(torch::nn::Linear(6, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                              torch::nn::Tanh(), torch::nn::Linear(17, 3));
    tdist::FullyShardedDataParallelOptions o;
    o.process_group = pgs;
    o.sharding_strategy = c.strategy;
    o.mixed_precision.param_dtype = c.param_dtype;
    o.auto_wrap_policy = tdist::lambda_auto_wrap_policy(
        [](torch::nn::Module& m) { return dynamic_cast<torch::nn::LinearImpl*>(&m) != nullptr; });
    if (dev.is_cuda()) o.device_id = dev;
    tdist::FSDP<torch::nn::Sequential> model(seq, o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    for (int step = 0; step < 5; ++step) {
      torch::manual_seed(200 + 10 * pg.rank() + step);
      at::Tensor x = torch::randn({16, 6}).to(dev);
      at::Tensor y = torch::randint(0, 3, {16}, at::kLong).to(dev);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model(x), y).backward();
      opt.step();
    }
    std::vector<at::Tensor> ps;
    for (const auto& p : model->parameters()) {
      WORLD_CHECK(p.device() == dev, "shard on " << p.device() << ", not " << dev);
      ps.push_back(p.detach().cpu());
    }
    finals.push_back(ps);
  }
  const double tol = c.param_dtype ? 3e-2 : 1e-5;
  WORLD_CHECK(finals[0].size() == finals[1].size(), "different parameter counts");
  for (size_t i = 0; i < finals[0].size(); ++i) {
    const double diff = finals[0][i].numel() == 0 ? 0 : (finals[0][i] - finals[1][i]).abs().max().item<double>();
    WORLD_CHECK(diff < tol, "shard " << i << " differs by " << diff << " between CPU and CUDA");
  }
}

class CudaFsdp : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  void run(FsdpCase c) {
    WorldOptions o;
    o.backend = std::get<0>(GetParam());
    o.limit = std::chrono::milliseconds(240'000);
    static FsdpCase cc;
    cc = c;
    EXPECT_EQ(run_world(std::get<1>(GetParam()), [](ProcessGroup& pg) { fsdp_parity(pg, cc); }, o), "");
  }
};

TEST_P(CudaFsdp, FullShardMatchesCpu) { run({tdist::ShardingStrategy::FULL_SHARD, std::nullopt}); }
TEST_P(CudaFsdp, ShardGradOpMatchesCpu) { run({tdist::ShardingStrategy::SHARD_GRAD_OP, std::nullopt}); }
TEST_P(CudaFsdp, Bf16MixedPrecisionMatchesCpu) { run({tdist::ShardingStrategy::FULL_SHARD, at::kBFloat16}); }
INSTANTIATE_TEST_SUITE_P(Backends, CudaFsdp,
                         ::testing::Values(std::make_tuple("shm", 2), std::make_tuple("gloo", 3),
                                           std::make_tuple("nccl", 1)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

// ---- sharded checkpoints of a CUDA FSDP model ---------------------------------

// A model with its shards on cuda:0 saves its sharded checkpoint (model and
// Adam state); a fresh model on the GPU and one on the CPU load it back bit
// for bit, and the three then take the same next steps (the optimizer's
// state came back too).
std::string g_ckpt_dir;

void fsdp_checkpoint_round_trip(ProcessGroup& pg) {
  tdist::detail::load_torch_cuda();
  auto pgs = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
  struct Run {
    std::unique_ptr<tdist::FSDP<torch::nn::Sequential>> model;
    std::unique_ptr<torch::optim::Adam> opt;
    c10::Device dev;
  };
  auto make = [&](c10::Device dev, uint64_t seed) {
    torch::manual_seed(seed);
    torch::nn::Sequential seq(torch::nn::Linear(6, 33), torch::nn::Tanh(), torch::nn::Linear(33, 17),
                              torch::nn::Tanh(), torch::nn::Linear(17, 3));
    tdist::FullyShardedDataParallelOptions o;
    o.process_group = pgs;
    o.auto_wrap_policy = tdist::lambda_auto_wrap_policy(
        [](torch::nn::Module& m) { return dynamic_cast<torch::nn::LinearImpl*>(&m) != nullptr; });
    if (dev.is_cuda()) o.device_id = dev;
    Run r{std::make_unique<tdist::FSDP<torch::nn::Sequential>>(seq, o), nullptr, dev};
    r.opt = std::make_unique<torch::optim::Adam>((*r.model)->parameters(), 0.01);
    return r;
  };
  auto train = [&](Run& r, int from, int to) {
    for (int step = from; step < to; ++step) {
      torch::manual_seed(200 + 10 * pg.rank() + step);
      at::Tensor x = torch::randn({16, 6}).to(r.dev);
      at::Tensor y = torch::randint(0, 3, {16}, at::kLong).to(r.dev);
      r.opt->zero_grad();
      torch::nn::functional::cross_entropy((*r.model)(x), y).backward();
      r.opt->step();
    }
  };
  auto shards = [](Run& r) {
    std::vector<at::Tensor> ps;
    for (const auto& p : (*r.model)->parameters()) {
      WORLD_CHECK(p.device() == r.dev, "shard on " << p.device() << ", not " << r.dev);
      ps.push_back(p.detach().cpu().clone());
    }
    return ps;
  };
  const std::string prefix = g_ckpt_dir + "/ckpt";
  Run saved = make(kGpu, 0);
  train(saved, 0, 3);
  tdist::save_sharded_checkpoint(prefix, pg, **saved.model, saved.opt.get());
  const auto at_save = shards(saved);
  Run on_gpu = make(kGpu, 7), on_cpu = make(c10::Device(c10::kCPU), 8);  // other initial weights
  tdist::load_sharded_checkpoint(prefix, pg, **on_gpu.model, on_gpu.opt.get());
  tdist::load_sharded_checkpoint(prefix, pg, **on_cpu.model, on_cpu.opt.get());
  for (Run* r : {&on_gpu, &on_cpu}) {
    const auto got = shards(*r);
    WORLD_CHECK(got.size() == at_save.size(), "different parameter counts");
    for (size_t i = 0; i < got.size(); ++i) {
      WORLD_CHECK(at::equal(got[i], at_save[i]), "shard " << i << " on " << r->dev << " not loaded bit for bit");
    }
  }
  train(saved, 3, 6);
  train(on_gpu, 3, 6);
  train(on_cpu, 3, 6);
  const auto want = shards(saved), gpu_after = shards(on_gpu), cpu_after = shards(on_cpu);
  for (size_t i = 0; i < want.size(); ++i) {
    WORLD_CHECK(at::equal(gpu_after[i], want[i]), "shard " << i << ": the GPU resume took another step");
    const double diff = want[i].numel() == 0 ? 0 : (cpu_after[i] - want[i]).abs().max().item<double>();
    WORLD_CHECK(diff < 1e-5, "shard " << i << ": the CPU resume differs by " << diff);
  }
}

class CudaFsdpCheckpoint : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CudaFsdpCheckpoint, SavesAndLoadsOnGpuAndCpu) {
  tdist::test::TempDir dir;
  g_ckpt_dir = dir.path();
  WorldOptions o;
  o.backend = std::get<0>(GetParam());
  o.limit = std::chrono::milliseconds(240'000);
  EXPECT_EQ(run_world(std::get<1>(GetParam()), fsdp_checkpoint_round_trip, o), "");
}
INSTANTIATE_TEST_SUITE_P(Backends, CudaFsdpCheckpoint,
                         ::testing::Values(std::make_tuple("shm", 2), std::make_tuple("gloo", 3),
                                           std::make_tuple("nccl", 1)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

// ---- the Checkpointer on the GPU: CUDA RNG and pinned snapshots -------------------

// An FSDP model on cuda:0 whose batches and dropout draw from the CUDA
// generator: stopped after step 5 (saved at 4, asynchronously, from pinned
// snapshots) and restarted with other weights and another seed, it ends bit
// for bit as the run that never stopped. Without the CUDA RNG state in the
// checkpoint the resumed batches would differ.
void checkpointer_resume(ProcessGroup& pg) {
  tdist::detail::load_torch_cuda();
  auto pgs = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
  auto make = [&](uint64_t seed) {
    torch::manual_seed(seed);
    torch::nn::Sequential seq(torch::nn::Linear(6, 33), torch::nn::Tanh(), torch::nn::Linear(33, 3));
    tdist::FullyShardedDataParallelOptions o;
    o.process_group = pgs;
    o.device_id = kGpu;
    return tdist::FSDP<torch::nn::Sequential>(seq, o);
  };
  auto options = [&](const std::string& dir) {
    tdist::CheckpointerOptions o;
    o.dir = dir;
    o.every_steps = 2;
    return o;
  };
  auto run = [&](tdist::FSDP<torch::nn::Sequential>& model, torch::optim::Adam& opt, tdist::Checkpointer& ckpt,
                 int from, int to) {
    for (int step = from + 1; step <= to; ++step) {
      at::Tensor x = torch::randn({16, 6}, at::TensorOptions().device(kGpu)) + pg.rank();
      opt.zero_grad();
      torch::dropout(model(x), 0.3, true).pow(2).mean().backward();
      opt.step();
      ckpt.maybe_save(step);
    }
    ckpt.wait();
  };
  auto shards = [](tdist::FSDP<torch::nn::Sequential>& model) {
    std::vector<at::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(p.detach().cpu().clone());
    return out;
  };
  const std::string straight = g_ckpt_dir + "/straight", stopped = g_ckpt_dir + "/stopped";
  auto a = make(1);
  torch::optim::Adam opt_a(a->parameters(), 0.01);
  tdist::Checkpointer ckpt_a(pgs, *a, &opt_a, options(straight));
  run(a, opt_a, ckpt_a, 0, 8);
  const auto want = shards(a);
  {
    auto b = make(1);
    torch::optim::Adam opt_b(b->parameters(), 0.01);
    tdist::Checkpointer ckpt_b(pgs, *b, &opt_b, options(stopped));
    run(b, opt_b, ckpt_b, 0, 5);
  }
  auto c = make(99);
  torch::optim::Adam opt_c(c->parameters(), 0.3);
  tdist::Checkpointer ckpt_c(pgs, *c, &opt_c, options(stopped));
  const auto resumed = ckpt_c.restore();
  WORLD_CHECK(resumed && resumed->step == 4 && resumed->rng_restored, "restored step " << (resumed ? resumed->step : -1));
  for (const auto& p : c->parameters()) WORLD_CHECK(p.device() == kGpu, "a shard restored on " << p.device());
  run(c, opt_c, ckpt_c, 4, 8);
  const auto got = shards(c);
  WORLD_CHECK(got.size() == want.size(), "parameter counts differ");
  for (size_t i = 0; i < got.size(); ++i) {
    WORLD_CHECK(at::equal(got[i], want[i]), "shard " << i << " differs after the resume");
  }
}

// Join with a DDP model on the GPU: rank 1 runs out first; every rank ends
// with the same weights, and the model trains on after the Join.
void ddp_join(ProcessGroup& pg) {
  tdist::detail::load_torch_cuda();
  tdist::DistributedDataParallelOptions o;
  o.process_group = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
  o.device_id = kGpu;
  torch::manual_seed(3);
  tdist::DistributedDataParallel<torch::nn::Linear> model(torch::nn::Linear(6, 3), o);
  torch::optim::SGD opt(model->parameters(), 0.1);
  auto step = [&] {
    opt.zero_grad();
    model(torch::randn({8, 6}, at::TensorOptions().device(kGpu))).pow(2).mean().backward();
    opt.step();
  };
  {
    tdist::Join join({model.get()});
    for (int k = 0; k < (pg.rank() == 1 ? 2 : 5); ++k) step();
  }
  at::Tensor w = model->module()->weight.detach().clone();
  at::Tensor all = torch::empty({pg.size() * w.numel()}, w.options());
  pg.all_gather_into_tensor(all, w.reshape({-1}))->wait();
  for (int r = 0; r < pg.size(); ++r) {
    WORLD_CHECK(at::equal(all.narrow(0, r * w.numel(), w.numel()), w.reshape({-1})), "rank " << r << " differs");
  }
  step();
}

class CudaTraining : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CudaTraining, CheckpointerResumesBitForBitWithTheCudaRng) {
  tdist::test::TempDir dir;
  g_ckpt_dir = dir.path();
  WorldOptions o;
  o.backend = std::get<0>(GetParam());
  o.limit = std::chrono::milliseconds(240'000);
  EXPECT_EQ(run_world(std::get<1>(GetParam()), checkpointer_resume, o), "");
}

TEST_P(CudaTraining, DdpJoinOnUnevenInputs) {
  WorldOptions o;
  o.backend = std::get<0>(GetParam());
  o.limit = std::chrono::milliseconds(120'000);
  EXPECT_EQ(run_world(std::get<1>(GetParam()), ddp_join, o), "");
}
INSTANTIATE_TEST_SUITE_P(Backends, CudaTraining,
                         ::testing::Values(std::make_tuple("shm", 2), std::make_tuple("gloo", 2),
                                           std::make_tuple("nccl", 1)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
