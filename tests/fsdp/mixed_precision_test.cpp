// FSDP mixed precision: units compute in bf16 from fp32 shards and track
// fp32 training within bf16 precision on every strategy and on one rank;
// shards and their gradients stay fp32; BatchNorm's buffers keep fp32
// (and its weights compute in fp32) unless buffer_dtype says otherwise;
// torch_xla's names give the same training as PyTorch's; summon gives fp32;
// a bf16 backward's gradients reach the unit's buffer unconverted.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "bench/memory_meter.h"
#include "fsdp/block_pool.h"
#include "tdist/tdist.h"
#include "tests/util/world.h"

namespace {

using tdist::ProcessGroup;
using tdist::ShardingStrategy;
using tdist::test::run_world;

struct MpBlockImpl : torch::nn::Module {
  MpBlockImpl() : fc1(register_module("fc1", torch::nn::Linear(16, 32))), fc2(register_module("fc2", torch::nn::Linear(32, 16))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MpBlock);

struct MpNetImpl : torch::nn::Module {
  MpNetImpl() {
    in = register_module("in", torch::nn::Linear(6, 16));
    blocks = register_module("blocks", torch::nn::Sequential(MpBlock(), MpBlock()));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    seen = in->weight.scalar_type();
    seen_bn = bn->weight.scalar_type();
    return head(bn(blocks->forward(in(x))));
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  at::ScalarType seen = at::kFloat;
  at::ScalarType seen_bn = at::kFloat;
};
TORCH_MODULE(MpNet);

struct Trained {
  std::vector<torch::Tensor> params;  // whole, fp32
  torch::Tensor running_mean;
  at::ScalarType seen, seen_bn, out;
};

// How train() runs: the blocks in checkpoint_module; each step's batch as
// two micro-batches, the first under no_sync.
struct Extras {
  bool checkpoint = false;
  bool no_sync = false;
};

Trained train(ProcessGroup& pg, tdist::FullyShardedDataParallelOptions o, Extras extras = {}) {
  torch::manual_seed(3);
  o.auto_wrap_policy = tdist::transformer_auto_wrap_policy<MpBlock>();
  if (extras.checkpoint) {
    o.auto_wrapper_callable = [](torch::nn::AnyModule m, const tdist::FullyShardedDataParallelOptions& c) {
      return torch::nn::AnyModule(tdist::FullyShardedDataParallel(tdist::checkpoint_module(std::move(m)), c));
    };
  }
  MpNet net;
  tdist::FSDP<MpNet> model(net, o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  Trained t;
  for (int step = 0; step < 6; ++step) {
    torch::manual_seed(50 + step);
    auto x = torch::randn({8 * pg.size(), 6}).narrow(0, 8 * pg.rank(), 8);
    auto y = torch::randn({8 * pg.size(), 3}).narrow(0, 8 * pg.rank(), 8);
    opt.zero_grad();
    if (extras.no_sync) {
      auto guard = model->no_sync();
      torch::mse_loss(model(x.narrow(0, 0, 4)).to(torch::kFloat), y.narrow(0, 0, 4)).backward();
      // The full gradients kept for the next backward, the outermost
      // unit's too, accumulate in one dtype (the reduction's).
      std::set<at::ScalarType> kept;
      for (const auto& p : model->parameters()) {
        if (p.grad().defined()) kept.insert(p.grad().scalar_type());
      }
      WORLD_CHECK(kept.size() == 1, "gradients kept under no_sync in " << kept.size() << " dtypes");
      x = x.narrow(0, 4, 4);
      y = y.narrow(0, 4, 4);
    }
    auto out = model(x);
    t.out = out.scalar_type();
    torch::mse_loss(out.to(torch::kFloat), y).backward();
    for (const auto& p : model->parameters()) {
      WORLD_CHECK(p.scalar_type() == at::kFloat && (!p.grad().defined() || p.grad().scalar_type() == at::kFloat),
                  "a shard or its gradient left fp32: " << p.scalar_type());
    }
    opt.step();
  }
  t.seen = net->seen;
  t.seen_bn = net->seen_bn;
  t.running_mean = net->bn->running_mean.detach().clone();
  auto full = model->summon_full_params(/*writeback=*/false);
  for (const auto& p : model->parameters()) t.params.push_back(p.detach().clone());
  return t;
}

double max_relative_difference(const Trained& a, const Trained& b) {
  double worst = 0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    worst = std::max(worst, ((a.params[i] - b.params[i]).norm() / a.params[i].norm()).item<double>());
  }
  return worst;
}

void bf16_tracks_fp32(ProcessGroup& pg, ShardingStrategy strategy) {
  tdist::FullyShardedDataParallelOptions fp32;
  fp32.sharding_strategy = strategy;
  tdist::FullyShardedDataParallelOptions bf16 = fp32;
  bf16.mixed_precision.param_dtype = at::kBFloat16;
  const Trained a = train(pg, fp32);
  const Trained b = train(pg, bf16);
  WORLD_CHECK(a.seen == at::kFloat && b.seen == at::kBFloat16, "compute dtype " << b.seen);
  WORLD_CHECK(b.out == at::kBFloat16, "output " << b.out);
  WORLD_CHECK(b.seen_bn == at::kFloat, "BatchNorm's weight computed in " << b.seen_bn);
  WORLD_CHECK(b.running_mean.scalar_type() == at::kFloat && b.running_mean.abs().sum().item<double>() > 0,
              "running statistics " << b.running_mean.scalar_type());
  WORLD_CHECK(b.params.size() == a.params.size() && b.params[0].scalar_type() == at::kFloat, "summoned dtype");
  const double diff = max_relative_difference(a, b);
  // bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.002): after
  // six steps the weights differ, by about that.
  WORLD_CHECK(diff > 1e-5 && diff < 3e-2, "bf16 vs fp32: relative difference " << diff);
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<int, ShardingStrategy>>& info) {
  static const char* const kNames[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
  return "world" + std::to_string(std::get<0>(info.param)) + "_" + kNames[static_cast<int>(std::get<1>(info.param))];
}

class MixedPrecision : public ::testing::TestWithParam<std::tuple<int, ShardingStrategy>> {};

TEST_P(MixedPrecision, Bf16TracksFp32) {
  const auto [world, strategy] = GetParam();
  EXPECT_EQ(run_world(world, [s = strategy](ProcessGroup& pg) { bf16_tracks_fp32(pg, s); }), "");
}

INSTANTIATE_TEST_SUITE_P(Strategies, MixedPrecision,
                         ::testing::Values(std::make_tuple(2, ShardingStrategy::FULL_SHARD),
                                           std::make_tuple(3, ShardingStrategy::FULL_SHARD),
                                           std::make_tuple(2, ShardingStrategy::SHARD_GRAD_OP),
                                           std::make_tuple(2, ShardingStrategy::NO_SHARD),
                                           std::make_tuple(1, ShardingStrategy::FULL_SHARD)),
                         case_name);

// Gradients of checkpointed units reach the compute-dtype accumulators as
// the plain units' do: the same training, bit for bit.
TEST(MixedPrecisionWith, CheckpointedUnitsTrainBitForBitAsPlainOnes) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup& pg) {
                        tdist::FullyShardedDataParallelOptions bf16;
                        bf16.mixed_precision.param_dtype = at::kBFloat16;
                        const Trained plain = train(pg, bf16);
                        const Trained ckpt = train(pg, bf16, {/*checkpoint=*/true, /*no_sync=*/false});
                        WORLD_CHECK(max_relative_difference(plain, ckpt) == 0,
                                    "checkpointed bf16 differs by " << max_relative_difference(plain, ckpt));
                      }),
            "");
}

// Full gradients kept across a no_sync micro-batch accumulate in the bf16
// buffer and still track the fp32 run.
TEST(MixedPrecisionWith, NoSyncAccumulationTracksFp32) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup& pg) {
                        tdist::FullyShardedDataParallelOptions fp32;
                        tdist::FullyShardedDataParallelOptions bf16;
                        bf16.mixed_precision.param_dtype = at::kBFloat16;
                        const Extras accumulate{/*checkpoint=*/false, /*no_sync=*/true};
                        const Trained a = train(pg, fp32, accumulate);
                        const Trained b = train(pg, bf16, accumulate);
                        const Trained once = train(pg, bf16);
                        const double diff = max_relative_difference(a, b);
                        WORLD_CHECK(diff > 1e-5 && diff < 3e-2, "bf16 vs fp32 with no_sync: " << diff);
                        WORLD_CHECK(max_relative_difference(b, once) > 1e-5, "no_sync changed nothing");
                      }),
            "");
}

TEST(MixedPrecisionOptions, BufferDtypeConvertsTheBuffers) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup& pg) {
                        tdist::FullyShardedDataParallelOptions o;
                        o.mixed_precision.param_dtype = at::kBFloat16;
                        o.mixed_precision.buffer_dtype = at::kBFloat16;
                        const Trained t = train(pg, o);
                        WORLD_CHECK(t.running_mean.scalar_type() == at::kBFloat16, t.running_mean.scalar_type());
                        WORLD_CHECK(t.seen_bn == at::kBFloat16, t.seen_bn);
                      }),
            "");
}

TEST(MixedPrecisionOptions, TorchXlaNamesTrainAsPyTorchNames) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup& pg) {
                        for (bool fp32_reduce : {false, true}) {
                          tdist::FullyShardedDataParallelOptions xla;
                          xla.compute_dtype = at::kBFloat16;
                          xla.fp32_reduce_scatter = fp32_reduce;
                          tdist::FullyShardedDataParallelOptions torch_names;
                          torch_names.mixed_precision.param_dtype = at::kBFloat16;
                          torch_names.mixed_precision.reduce_dtype = fp32_reduce ? at::kFloat : at::kBFloat16;
                          const Trained a = train(pg, xla);
                          const Trained b = train(pg, torch_names);
                          WORLD_CHECK(max_relative_difference(a, b) == 0, fp32_reduce);
                        }
                        tdist::FullyShardedDataParallelOptions both;
                        both.compute_dtype = at::kBFloat16;
                        both.mixed_precision.param_dtype = at::kBFloat16;
                        try {
                          tdist::FSDP<MpNet> m(MpNet(), both);
                        } catch (const tdist::UsageError& e) {
                          WORLD_CHECK(std::string(e.what()).find("mixed precision given twice") != std::string::npos,
                                      e.what());
                          return;
                        }
                        WORLD_CHECK(false, "no error for both forms");
                      }),
            "");
}

// A unit of two wide layers: its weights' gradients dominate what a
// backward allocates (the batch is 4 rows).
struct WideImpl : torch::nn::Module {
  WideImpl()
      : fc1(register_module("fc1", torch::nn::Linear(256, 2048))),
        fc2(register_module("fc2", torch::nn::Linear(2048, 256))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Wide);

int64_t pool_bytes() { return static_cast<int64_t>(tdist::detail::block_bytes()); }

// The most bytes a backward had live at once above its start, not counting
// FSDP's unit buffers (the block pool), over 3 iterations.
int64_t backward_transient_bytes(std::optional<at::ScalarType> compute) {
  auto& mem = tdist::bench::CountingAllocator::install();
  mem.set_excluded(&pool_bytes);
  torch::manual_seed(1);
  tdist::FullyShardedDataParallelOptions o;
  o.mixed_precision.param_dtype = compute;
  tdist::FSDP<Wide> model(Wide(), o);
  const auto x = torch::randn({4, 256});
  int64_t worst = 0;
  for (int i = 0; i < 3; ++i) {
    for (auto& p : model->parameters()) p.mutable_grad().reset();
    auto loss = model(x).to(torch::kFloat).sum();
    const int64_t before = mem.live_rest();
    mem.reset_peak_rest();
    loss.backward();
    worst = std::max(worst, mem.peak_rest() - before);
    for (const auto& p : model->parameters()) {
      WORLD_CHECK(p.grad().defined() && p.grad().scalar_type() == at::kFloat, "shard gradient " << p.grad().dtype());
    }
  }
  return worst;
}

// The same, for the module alone in bf16 (no FSDP), its .grad there
// already, as a unit's gradient buffer is: what LibTorch's own bf16 kernels
// allocate in a backward on this CPU.
int64_t plain_bf16_backward_transient_bytes() {
  auto& mem = tdist::bench::CountingAllocator::install();
  torch::manual_seed(1);
  Wide plain;
  plain->to(at::kBFloat16);
  for (auto& p : plain->parameters()) p.mutable_grad() = torch::zeros_like(p);
  const auto x = torch::randn({4, 256}).to(at::kBFloat16);
  int64_t worst = 0;
  for (int i = 0; i < 3; ++i) {
    auto loss = plain(x).to(torch::kFloat).sum();
    const int64_t before = mem.live();
    mem.reset_peak();
    loss.backward();
    worst = std::max(worst, mem.peak() - before);
  }
  return worst;
}

// Autograd's accumulators of a sharded unit are made for the compute dtype:
// bf16 gradients land in the bf16 gradient buffer as they are, as in the
// module alone in bf16, instead of being converted to fp32 first (a
// full-size fp32 temporary per parameter and another conversion into the
// buffer: three times the bytes of the fp32 run's backward, six times the
// plain bf16 module's, before this was so).
TEST(MixedPrecisionMemory, Bf16BackwardAllocatesAsThePlainBf16Module) {
  EXPECT_EQ(run_world(2,
                      [](ProcessGroup&) {
                        const int64_t plain = plain_bf16_backward_transient_bytes();
                        const int64_t fp32 = backward_transient_bytes(std::nullopt);
                        const int64_t bf16 = backward_transient_bytes(at::kBFloat16);
                        const int64_t weight = 2048 * 256 * 4;
                        WORLD_CHECK(fp32 >= weight, "the fp32 backward's transient " << fp32 << " bytes");
                        WORLD_CHECK(bf16 <= 1.25 * static_cast<double>(plain) + 65536,
                                    "bf16 backward: " << bf16 << " bytes at once, the plain bf16 module's: " << plain
                                                      << ", fp32: " << fp32);
                        WORLD_CHECK(bf16 < fp32, "bf16 backward: " << bf16 << " bytes at once, fp32: " << fp32);
                      }),
            "");
}

}  // namespace
