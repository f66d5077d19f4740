// PowerSGD and batched PowerSGD hooks on real processes: exact recovery of
// low-rank sums, error feedback, statistics, the warm-up phase, checkpoint
// resume, odd bucket sizes and non-finite gradients.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "tdist/tdist.h"
#include "tests/util/world.h"

using tdist::ProcessGroup;
using tdist::test::run_world;

namespace {

// A bucket of [bias (8), weight (16 x 12)], like a Linear layer's.
struct Bucket {
  at::Tensor flat;
  std::vector<at::Tensor> grads;
  tdist::GradBucket view(size_t index = 0, bool last = true) {
    return tdist::GradBucket(index, last, flat, grads, {});
  }
};

Bucket make_bucket(const at::Tensor& bias, const at::Tensor& weight) {
  Bucket b;
  b.flat = at::cat({bias.reshape({-1}), weight.reshape({-1})});
  b.grads = {b.flat.narrow(0, 0, bias.numel()).view(bias.sizes()),
             b.flat.narrow(0, bias.numel(), weight.numel()).view(weight.sizes())};
  return b;
}

at::Tensor run_hook(const std::shared_ptr<tdist::PowerSGDState>& s, Bucket& b, bool batched = false) {
  auto gb = b.view();
  auto w = batched ? tdist::batched_powerSGD_hook(s, gb) : tdist::powerSGD_hook(s, gb);
  w->wait();
  return w->result().at(0);
}

tdist::PowerSGDOptions compress_at_once(int64_t rank) {
  tdist::PowerSGDOptions o;
  o.matrix_approximation_rank = rank;
  o.start_powerSGD_iter = 0;
  o.use_error_feedback = false;
  o.warm_start = false;
  return o;
}

TEST(PowerSGD, ALowRankSumIsRecoveredInOneStep) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf}) {
      // Every rank's weight gradient is u_r v^T + u'_r w^T: the sum has rank 2.
      torch::manual_seed(100);
      const at::Tensor v = torch::randn({12, 1}), w = torch::randn({12, 1});
      std::vector<at::Tensor> weights, biases;
      for (int k = 0; k < n; ++k) {
        weights.push_back(torch::randn({16, 1}).mm(v.t()) + torch::randn({16, 1}).mm(w.t()));
        biases.push_back(torch::randn({8}));
      }
      at::Tensor avg_w = at::stack(weights).mean(0), avg_b = at::stack(biases).mean(0);
      auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), compress_at_once(2));
      Bucket b = make_bucket(biases[r].to(dtype), weights[r].to(dtype));
      at::Tensor out = run_hook(state, b).to(at::kDouble);
      const double tol = dtype == at::kHalf ? 2e-2 : 1e-4;
      WORLD_CHECK(at::allclose(out.narrow(0, 0, 8), avg_b.to(at::kDouble), tol, tol), "bias " << dtype);
      WORLD_CHECK(at::allclose(out.narrow(0, 8, 192).view({16, 12}), avg_w.to(at::kDouble), tol, tol),
                  "weight " << dtype << ": off by " << (out.narrow(0, 8, 192).view({16, 12}) - avg_w).abs().max());
    }
  }), "");
}

TEST(PowerSGD, CompressionStatisticsFollowTheFormula) {
  EXPECT_EQ(run_world(1, [](ProcessGroup&) {
    auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), compress_at_once(1));
    Bucket b = make_bucket(torch::randn({8}), torch::randn({16, 12}));
    run_hook(state, b);
    const auto s = state->compression_stats();
    // Before: 8 + 192. After: the bias as it is, the weight as (16 + 12) * 1.
    WORLD_CHECK(s.numel_before == 200 && s.numel_after == 8 + 28, s.numel_before << " " << s.numel_after);
    WORLD_CHECK(std::abs(s.compression_rate - 200.0 / 36.0) < 1e-12, s.compression_rate);
    WORLD_CHECK(s.bytes_before == 800 && s.bytes_after == 4 * (36 + 1), s.bytes_before << " " << s.bytes_after);
    // A matrix that would not shrink by min_compression_rate travels as it is.
    tdist::PowerSGDOptions o = compress_at_once(4);
    auto state2 = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), o);
    Bucket small = make_bucket(torch::randn({2}), torch::randn({6, 6}));  // (6 + 6) * 4 * 2 > 36
    at::Tensor before = small.flat.clone();
    at::Tensor out = run_hook(state2, small);
    WORLD_CHECK(at::equal(out, before), "an uncompressed bucket changed");
    WORLD_CHECK(state2->compression_stats().compression_rate == 1.0, state2->compression_stats().compression_rate);
  }), "");
}

// Error feedback: over several steps, everything applied plus what is left
// in the error memory adds up to everything this rank fed in.
TEST(PowerSGD, ErrorFeedbackKeepsAppliedPlusResidualEqualToTheGradient) {
  EXPECT_EQ(run_world(1, [](ProcessGroup&) {
    tdist::PowerSGDOptions o;
    o.matrix_approximation_rank = 1;
    o.start_powerSGD_iter = 2;
    auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), o);
    at::Tensor fed = at::zeros({200}, at::kDouble), applied = at::zeros({200}, at::kDouble);
    torch::manual_seed(7);
    for (int step = 0; step < 6; ++step) {
      Bucket b = make_bucket(torch::randn({8}), torch::randn({16, 12}));  // full rank: lossy
      fed += b.flat.to(at::kDouble);
      applied += run_hook(state, b).to(at::kDouble);
    }
    at::Tensor residual = state->error_feedback(0).to(at::kDouble);
    WORLD_CHECK(residual.defined() && residual.abs().max().item<double>() > 1e-3, "no residual: not lossy?");
    WORLD_CHECK(at::allclose(applied + residual, fed, 1e-5, 1e-5),
                "applied + residual is off by " << (applied + residual - fed).abs().max());
  }), "");
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(20, 48));
    fc2 = register_module("fc2", torch::nn::Linear(48, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

std::pair<torch::Tensor, torch::Tensor> batch(int step, int64_t n) {
  torch::manual_seed(500 + step);
  return {torch::randn({n, 20}), torch::randint(0, 5, {n}, torch::kLong)};
}

using Install = std::function<void(tdist::DistributedDataParallel<Net>&)>;

// DDP training steps [from, to) on this rank's shard.
void train(tdist::DistributedDataParallel<Net>& ddp, torch::optim::SGD& opt, int rank, int from, int to) {
  for (int step = from; step < to; ++step) {
    auto [x, y] = batch(step, 16);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(ddp->forward(x.narrow(0, 8 * rank, 8)), y.narrow(0, 8 * rank, 8))
        .backward();
    opt.step();
  }
}

std::vector<at::Tensor> params_after(int rank, int steps, const Install& install) {
  torch::manual_seed(3);
  Net net;
  tdist::DistributedDataParallelOptions o;
  o.bucket_cap_mb = 0.002;  // a few buckets
  o.first_bucket_cap_mb = 0.001;
  tdist::DistributedDataParallel<Net> ddp(net, o);
  install(ddp);
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train(ddp, opt, rank, 0, steps);
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(PowerSGD, TheWarmUpStepsArePlainAllReduceBitForBit) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    auto world = tdist::default_group();
    tdist::PowerSGDOptions o;
    o.start_powerSGD_iter = 5;
    for (bool batched : {false, true}) {
      auto state = std::make_shared<tdist::PowerSGDState>(world, o);
      auto a = params_after(pg.rank(), 5, [&](auto& ddp) {
        ddp->register_comm_hook(state, batched ? tdist::batched_powerSGD_hook : tdist::powerSGD_hook);
      });
      auto b = params_after(pg.rank(), 5, [&](auto& ddp) { ddp->register_comm_hook(world, tdist::allreduce_hook); });
      for (size_t i = 0; i < a.size(); ++i) WORLD_CHECK(at::equal(a[i], b[i]), "parameter " << i);
      WORLD_CHECK(state->iter() == 5 && state->compression_stats().numel_before == 0, "iter " << state->iter());
    }
  }), "");
}

std::string temp_path(const std::string& name) {
  return "/tmp/tdist_powersgd_" + std::to_string(getpid()) + "_" + name;
}

// A run stopped after 4 steps and resumed from its checkpoint in new
// processes ends with the same bits as a run of 8 steps.
TEST(PowerSGD, ACheckpointResumesBitForBit) {
  for (bool batched : {false, true}) {
    const std::string ckpt = temp_path("ckpt"), expected = temp_path("expected");
    tdist::PowerSGDOptions o;
    o.matrix_approximation_rank = 2;
    o.start_powerSGD_iter = 2;
    auto hook = batched ? tdist::batched_powerSGD_hook : tdist::powerSGD_hook;
    EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), o);
      auto whole = params_after(r, 8, [&](auto& ddp) { ddp->register_comm_hook(state, hook); });
      if (r == 0) torch::save(whole, expected);
      // The same run, stopped after 4 steps.
      torch::manual_seed(3);
      Net net;
      tdist::DistributedDataParallelOptions d;
      d.bucket_cap_mb = 0.002;
      d.first_bucket_cap_mb = 0.001;
      tdist::DistributedDataParallel<Net> ddp(net, d);
      auto s2 = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), o);
      ddp->register_comm_hook(s2, hook);
      torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      train(ddp, opt, r, 0, 4);
      torch::serialize::OutputArchive archive, model, optim, hook_state;
      net->save(model);
      opt.save(optim);
      s2->save(hook_state);
      archive.write("model", model);
      archive.write("optimizer", optim);
      archive.write("powersgd", hook_state);
      archive.save_to(ckpt + "." + std::to_string(r));
    }), "");
    EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      torch::manual_seed(99);  // different weights: the checkpoint must set them
      Net net;
      torch::serialize::InputArchive archive, model, optim, hook_state;
      archive.load_from(ckpt + "." + std::to_string(r));
      archive.read("model", model);
      net->load(model);
      tdist::DistributedDataParallelOptions d;
      d.bucket_cap_mb = 0.002;
      d.first_bucket_cap_mb = 0.001;
      tdist::DistributedDataParallel<Net> ddp(net, d);
      torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      archive.read("optimizer", optim);
      opt.load(optim);
      auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), o);
      archive.read("powersgd", hook_state);
      state->load(hook_state);
      ddp->register_comm_hook(state, hook);
      train(ddp, opt, r, 4, 8);
      std::vector<at::Tensor> want;
      torch::load(want, expected);
      auto got = net->parameters();
      for (size_t i = 0; i < want.size(); ++i) {
        WORLD_CHECK(at::equal(got[i].detach(), want[i]),
                    "parameter " << i << " off by " << (got[i].detach() - want[i]).abs().max());
      }
      WORLD_CHECK(state->iter() == 8, state->iter());
    }), "");
    for (int r = 0; r < 2; ++r) std::remove((ckpt + "." + std::to_string(r)).c_str());
    std::remove(expected.c_str());
  }
}

TEST(PowerSGD, LoadingACheckpointWithOtherOptionsIsRefused) {
  tdist::PowerSGDOptions a;
  a.start_powerSGD_iter = 2;
  tdist::PowerSGDState s(nullptr, a);
  torch::serialize::OutputArchive out;
  s.save(out);
  const std::string path = temp_path("opts");
  out.save_to(path);
  torch::serialize::InputArchive in;
  in.load_from(path);
  tdist::PowerSGDOptions b = a;
  b.matrix_approximation_rank = 4;
  tdist::PowerSGDState other(nullptr, b);
  EXPECT_THROW(other.load(in), tdist::UsageError);
  torch::serialize::InputArchive empty_in;
  torch::serialize::OutputArchive empty;
  empty.save_to(path);
  empty_in.load_from(path);
  EXPECT_THROW(s.load(empty_in), tdist::UsageError);
  std::remove(path.c_str());
  // Error feedback needs the warm-up that DDP's bucket rebuild needs.
  tdist::PowerSGDOptions c;
  c.start_powerSGD_iter = 1;
  EXPECT_THROW(tdist::PowerSGDState(nullptr, c), tdist::UsageError);
}

// Batched PowerSGD pads any bucket to a square: with r = its rows that hold
// data (the rank of the padded sum), the average comes back exactly, for
// tiny and odd sizes too.
TEST(PowerSGD, BatchedHandlesOddAndTinyBuckets) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    const int r = pg.rank();
    for (int64_t size : {1, 2, 3, 7, 10, 1001}) {
      const int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(size))));
      const int64_t rows = (size + side - 1) / side;
      auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), compress_at_once(rows));
      torch::manual_seed(size);
      at::Tensor g0 = torch::randn({size}), g1 = torch::randn({size});
      Bucket b;
      b.flat = (r == 0 ? g0 : g1).clone();
      b.grads = {b.flat};
      at::Tensor out = run_hook(state, b, /*batched=*/true);
      WORLD_CHECK(at::allclose(out, (g0 + g1) / 2, 1e-4, 1e-4), "size " << size << ": off by "
                                                                        << (out - (g0 + g1) / 2).abs().max());
      // Rank 1 on a large bucket: lossy but finite, and the residual is kept.
      tdist::PowerSGDOptions o;
      o.start_powerSGD_iter = 2;
      auto lossy = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), o);
      for (int step = 0; step < 3; ++step) {
        Bucket c;
        c.flat = torch::randn({size});
        c.grads = {c.flat};
        WORLD_CHECK(at::isfinite(run_hook(lossy, c, true)).all().item<bool>(), "size " << size);
      }
      WORLD_CHECK(lossy->error_feedback(0).numel() == side * side, "error memory of size " << size);
    }
  }), "");
}

// A NaN on one rank: every rank falls back to plain all-reduce for that
// step, and the error-feedback memory is left as it was.
TEST(PowerSGD, ANonFiniteGradientFallsBackWithoutPoisoningTheMemory) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    for (bool batched : {false, true}) {
      tdist::PowerSGDOptions o;
      o.start_powerSGD_iter = 2;
      auto state = std::make_shared<tdist::PowerSGDState>(tdist::default_group(), o);
      torch::manual_seed(pg.rank());
      for (int step = 0; step < 3; ++step) {
        Bucket b = make_bucket(torch::randn({8}), torch::randn({16, 12}));
        run_hook(state, b, batched);
      }
      const at::Tensor error_before = state->error_feedback(0);
      Bucket bad = make_bucket(torch::randn({8}), torch::randn({16, 12}));
      if (pg.rank() == 1) bad.flat[20] = std::nan("");
      at::Tensor out = run_hook(state, bad, batched);
      WORLD_CHECK(state->compression_stats().nonfinite_fallbacks == 1, "no fallback counted");
      WORLD_CHECK(std::isnan(out[20].item<double>()), "the NaN did not travel");
      WORLD_CHECK(at::equal(state->error_feedback(0), error_before), "the error feedback changed");
      // The next finite step compresses again.
      Bucket good = make_bucket(torch::randn({8}), torch::randn({16, 12}));
      WORLD_CHECK(at::isfinite(run_hook(state, good, batched)).all().item<bool>(), "poisoned after the NaN");
      WORLD_CHECK(state->compression_stats().nonfinite_fallbacks == 1, "a second fallback");
    }
  }), "");
}

}  // namespace
