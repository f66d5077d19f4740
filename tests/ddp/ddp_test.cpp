// DistributedDataParallel on real processes: N ranks on N shards of a batch
// end with the same parameters as one process on the whole batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "ddp/bucket_assignment.h"
#include "tdist/ddp.h"
#include "tests/util/two_devices.h"
#include "tests/util/world.h"

using tdist::ProcessGroup;
using tdist::test::run_world;

namespace {

using tdist::test::TwoDevices;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(20, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc3->forward(torch::relu(fc2->forward(torch::relu(fc1->forward(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

// A model with a parameter that never reaches the loss.
struct SpareImpl : torch::nn::Module {
  SpareImpl() {
    used = register_module("used", torch::nn::Linear(4, 2));
    unused = register_module("unused", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return used->forward(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};
TORCH_MODULE(Spare);

// A module whose output shows its buffer: out = fc(x) + offset.
struct OffsetImpl : torch::nn::Module {
  OffsetImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 3));
    offset = register_buffer("offset", torch::zeros({3}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc->forward(x) + offset; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor offset;
};
TORCH_MODULE(Offset);

// A model with a branch that each rank may or may not take.
struct BranchImpl : torch::nn::Module {
  BranchImpl() {
    trunk = register_module("trunk", torch::nn::Linear(4, 4));
    branch = register_module("branch", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(torch::Tensor x, bool take_branch) {
    auto h = trunk->forward(x);
    return take_branch ? branch->forward(h) : h;
  }
  torch::nn::Linear trunk{nullptr}, branch{nullptr};
};
TORCH_MODULE(Branch);

// Two heads; the caller may leave one out of the loss.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    a = register_module("a", torch::nn::Linear(4, 2));
    b = register_module("b", torch::nn::Linear(4, 2));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) { return {a->forward(x), b->forward(x)}; }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoHeads);

// Layers registered in one order and used in the other: gradients arrive
// first for `outer` (the last layer applied), which reverse registration
// order puts last.
struct ReorderedImpl : torch::nn::Module {
  ReorderedImpl() {
    outer = register_module("outer", torch::nn::Linear(6, 6));
    inner = register_module("inner", torch::nn::Linear(6, 6));
  }
  torch::Tensor forward(torch::Tensor x) { return outer->forward(torch::tanh(inner->forward(x))); }
  torch::nn::Linear outer{nullptr}, inner{nullptr};
};
TORCH_MODULE(Reordered);

// Deterministic data: the same full batch on every rank.
std::pair<torch::Tensor, torch::Tensor> batch(int step, int64_t n) {
  torch::manual_seed(1000 + step);
  return {torch::randn({n, 20}), torch::randint(0, 5, {n}, torch::kLong)};
}

double max_rel_diff(Net& a, Net& b) {
  double worst = 0;
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const double denom = std::max(1e-6, pb[i].abs().max().item<double>());
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>() / denom);
  }
  return worst;
}

enum class Opt { kSgd, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_opt(Opt o, std::vector<torch::Tensor> params) {
  if (o == Opt::kSgd) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

// N ranks train on N shards of each batch; each rank also trains a local
// copy on the whole batch; both must end equal.
void parity(ProcessGroup& pg, Opt opt_kind, tdist::DistributedDataParallelOptions options, int steps = 5) {
  const int n = pg.size(), r = pg.rank();
  const int64_t per_rank = 8, total = per_rank * n;
  torch::manual_seed(42 + r);  // different on purpose: DDP must broadcast rank 0's
  Net net;
  (void)pg;  // DDP uses the default group, which run_world made
  tdist::DistributedDataParallel<Net> ddp(net, options);
  torch::manual_seed(42);  // rank 0's initial weights, for the reference
  Net reference;
  auto opt = make_opt(opt_kind, ddp->parameters());
  auto ref_opt = make_opt(opt_kind, reference->parameters());
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step, total);
    opt->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(ddp->forward(x.narrow(0, r * per_rank, per_rank)),
                                                     y.narrow(0, r * per_rank, per_rank));
    loss.backward();
    opt->step();
    ref_opt->zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
    ref_opt->step();
  }
  const double diff = max_rel_diff(net, reference);
  WORLD_CHECK(diff <= 1e-5, "relative difference " << diff << " after " << steps << " steps");
}


TEST(BucketAssignment, ReverseOrderFirstBucketSmallAndDtypesApart) {
  using tdist::detail::ParamInfo;
  const size_t MiB = 1 << 20;
  // Registration order: a (3 MiB), b (1 MiB), c (1 MiB, float64), d (2 MiB), e (4 KiB)
  std::vector<ParamInfo> ps = {{3 * MiB, 0}, {MiB, 0}, {MiB, 1}, {2 * MiB, 0}, {4096, 0}};
  auto b = tdist::detail::assign_buckets(ps, MiB, 4 * MiB);
  // e+d close the first bucket (>= 1 MiB); b+a fill the next; c (float64) alone.
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::vector<size_t>{4, 3}));
  EXPECT_EQ(b[1], (std::vector<size_t>{1, 0}));
  EXPECT_EQ(b[2], (std::vector<size_t>{2}));
  // Every parameter lands in exactly one bucket.
  auto all = tdist::detail::assign_buckets(std::vector<ParamInfo>(100, {1000, 0}), 5000, 20000);
  std::vector<int> seen(100, 0);
  for (const auto& bucket : all)
    for (size_t i : bucket) seen[i]++;
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 100);
  EXPECT_EQ(all.front().front(), 99u);
}

class Ddp : public ::testing::TestWithParam<int> {};

TEST_P(Ddp, MatchesOneProcessWithSgd) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) { parity(pg, Opt::kSgd, {}); }), "");
}

TEST_P(Ddp, MatchesOneProcessWithAdamAndSmallBuckets) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    tdist::DistributedDataParallelOptions o;
    o.bucket_cap_mb = 0.01;  // many buckets: exercises in-order launches
    o.first_bucket_cap_mb = 0.001;
    parity(pg, Opt::kAdam, o);
  }), "");
}

TEST_P(Ddp, GradientsAsBucketViews) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    tdist::DistributedDataParallelOptions o;
    o.gradient_as_bucket_view = true;
    o.bucket_cap_mb = 0.01;
    parity(pg, Opt::kSgd, o);
    // The gradients share storage with the buckets: no copies.
    Net net;
    tdist::DistributedDataParallel<Net> ddp(net, o);
    auto [x, y] = batch(0, 4);
    torch::nn::functional::cross_entropy(ddp->forward(x), y).backward();
    for (const auto& p : ddp->parameters()) {
      WORLD_CHECK(p.grad().defined() && !p.grad().storage().is_alias_of(p.storage()), "grad storage");
    }
    const auto idx = ddp->bucket_indices();
    auto params = net->parameters();
    for (const auto& bucket : idx) {
      for (size_t i : bucket) {
        WORLD_CHECK(params[i].grad().storage().is_alias_of(params[bucket[0]].grad().storage()),
                    "parameter " << i << " is not a view of its bucket");
      }
    }
  }), "");
}

// Without gradient_as_bucket_view, on a group with symmetric memory (shm),
// the gradients live in the buckets' shared memory, each a tensor of its own
// (no views, no shared storage), and stay there when zero_grad sets them to
// undefined (LibTorch 2's default): the results match one process all along.
TEST_P(Ddp, GradientsAreTensorsOfTheirOwnInSymmetricBucketMemory) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    torch::manual_seed(5);
    Net net;
    tdist::DistributedDataParallel<Net> ddp(net);
    torch::manual_seed(5);
    Net reference;
    torch::optim::SGD opt(ddp->parameters(), 0.1), ref_opt(reference->parameters(), 0.1);
    for (int step = 0; step < 4; ++step) {
      auto [x, y] = batch(step, 8 * n);
      for (auto& p : net->parameters()) {
        if (step % 2) p.mutable_grad().reset();  // zero_grad(set_to_none)
      }
      if (step % 2 == 0) opt.zero_grad();
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(ddp->forward(x.narrow(0, 8 * r, 8)), y.narrow(0, 8 * r, 8)).backward();
      torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
      auto pa = net->parameters(), pb = reference->parameters();
      for (size_t i = 0; i < pa.size(); ++i) {
        const at::Tensor& g = pa[i].grad();
        WORLD_CHECK(torch::allclose(g, pb[i].grad(), 1e-5, 1e-6), "step " << step << " grad " << i);
        WORLD_CHECK(pg.is_symmetric(g) == pg.has_symmetric_memory(), "step " << step << " grad " << i << " is "
                                                                              << (pg.is_symmetric(g) ? "" : "not ")
                                                                              << "in symmetric memory");
        WORLD_CHECK(!g.is_view(), "grad " << i << " is a view");
        for (size_t j = 0; j < i; ++j) {
          WORLD_CHECK(!g.storage().is_alias_of(pa[j].grad().storage()), "grads " << j << " and " << i << " share storage");
        }
      }
      opt.step();
      ref_opt.step();
    }
  }), "");
}

TEST_P(Ddp, NoSyncAccumulatesLocally) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    torch::manual_seed(7);
    Net net;
    tdist::DistributedDataParallel<Net> ddp(net);
    torch::manual_seed(7);
    Net reference;
    auto [x, y] = batch(3, 16 * n);
    // Two micro-batches per rank: the first under no_sync, the second synced.
    for (int micro = 0; micro < 2; ++micro) {
      auto xs = x.narrow(0, (2 * r + micro) * 8, 8), ys = y.narrow(0, (2 * r + micro) * 8, 8);
      auto loss = torch::nn::functional::cross_entropy(ddp->forward(xs), ys) / 2;
      if (micro == 0) {
        auto guard = ddp->no_sync();
        loss.backward();
        // Nothing was communicated: the gradient is this rank's alone.
      } else {
        loss.backward();
      }
    }
    torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
    auto pa = net->parameters(), pb = reference->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      WORLD_CHECK(torch::allclose(pa[i].grad(), pb[i].grad(), 1e-5, 1e-6), "accumulated grad " << i);
    }
  }), "");
}

// Trains with a hook and returns the max relative difference to a local
// reference on the whole batch.
double parity_with_hook(ProcessGroup& pg, const std::function<void(tdist::DistributedDataParallel<Net>&)>& install) {
  const int n = pg.size(), r = pg.rank();
  torch::manual_seed(5);
  Net net;
  tdist::DistributedDataParallelOptions o;
  o.bucket_cap_mb = 0.01;
  tdist::DistributedDataParallel<Net> ddp(net, o);
  install(ddp);
  torch::manual_seed(5);
  Net reference;
  torch::optim::SGD opt(ddp->parameters(), 0.05), ref_opt(reference->parameters(), 0.05);
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = batch(step, 8 * n);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(ddp->forward(x.narrow(0, 8 * r, 8)), y.narrow(0, 8 * r, 8)).backward();
    opt.step();
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
    ref_opt.step();
  }
  return max_rel_diff(net, reference);
}

TEST_P(Ddp, BuiltInHooks) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup&) {
    auto world = tdist::default_group();
    double d = parity_with_hook(*world, [&](auto& ddp) { ddp->register_comm_hook(world, tdist::allreduce_hook); });
    WORLD_CHECK(d <= 1e-5, "allreduce_hook: " << d);
    d = parity_with_hook(*world, [&](auto& ddp) { ddp->register_comm_hook(world, tdist::fp16_compress_hook); });
    WORLD_CHECK(d <= 5e-3, "fp16_compress_hook: " << d);
    d = parity_with_hook(*world, [&](auto& ddp) { ddp->register_comm_hook(world, tdist::bf16_compress_hook); });
    WORLD_CHECK(d <= 3e-2, "bf16_compress_hook: " << d);
    d = parity_with_hook(*world, [&](auto& ddp) {
      ddp->register_comm_hook(world, tdist::fp16_compress_wrapper(tdist::allreduce_hook));
    });
    WORLD_CHECK(d <= 5e-3, "fp16_compress_wrapper(allreduce_hook): " << d);
  }), "");
}

// Parameters after three SGD steps of DDP on this rank's shard, with the
// hook `install` registers.
std::vector<torch::Tensor> trained(int n, int r, const std::function<void(tdist::DistributedDataParallel<Net>&)>& install) {
  torch::manual_seed(11);
  Net net;
  tdist::DistributedDataParallelOptions o;
  o.bucket_cap_mb = 0.01;
  tdist::DistributedDataParallel<Net> ddp(net, o);
  install(ddp);
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step, 8 * n);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(ddp->forward(x.narrow(0, 8 * r, 8)), y.narrow(0, 8 * r, 8)).backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

// The reducer runs the built-in hooks itself, on the gradients in place; it
// must give the very bits the hooks give on a flat bucket (a hook wrapped in
// a lambda is opaque to it, so it takes the GradBucket path).
TEST_P(Ddp, BuiltInHooksInPlaceGiveTheHooksBits) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    auto world = tdist::default_group();
    using Fn = std::shared_ptr<tdist::Work> (*)(const std::shared_ptr<ProcessGroup>&, tdist::GradBucket&);
    // The third of each: what the hook means, spelled out (for the
    // compression hooks: cast a copy, all-reduce it, cast back).
    const std::vector<std::tuple<const char*, Fn, tdist::StatefulHook>> hooks = {
        {"allreduce_hook", tdist::allreduce_hook, tdist::allreduce_hook},
        {"fp16_compress_hook", tdist::fp16_compress_hook, tdist::fp16_compress_wrapper(tdist::allreduce_hook)},
        {"bf16_compress_hook", tdist::bf16_compress_hook, tdist::bf16_compress_wrapper(tdist::allreduce_hook)}};
    for (const auto& [name, fn, meaning] : hooks) {
      auto direct = trained(pg.size(), pg.rank(), [&, fn = fn](auto& ddp) { ddp->register_comm_hook(world, fn); });
      auto through_bucket = trained(pg.size(), pg.rank(), [&, fn = fn](auto& ddp) {
        ddp->register_comm_hook([world, fn](tdist::GradBucket& b) { return fn(world, b); });
      });
      auto spelled_out = trained(pg.size(), pg.rank(), [&, meaning = meaning](auto& ddp) {
        ddp->register_comm_hook([world, meaning](tdist::GradBucket& b) { return meaning(world, b); });
      });
      for (size_t i = 0; i < direct.size(); ++i) {
        WORLD_CHECK(torch::equal(direct[i], through_bucket[i]), name << ": parameter " << i << " differs");
        WORLD_CHECK(torch::equal(direct[i], spelled_out[i]),
                    name << ": parameter " << i << " differs from the cast-reduce-cast result");
      }
    }
    // No hook at all is allreduce_hook.
    auto plain = trained(pg.size(), pg.rank(), [](auto&) {});
    auto hooked = trained(pg.size(), pg.rank(), [&](auto& ddp) { ddp->register_comm_hook(world, tdist::allreduce_hook); });
    for (size_t i = 0; i < plain.size(); ++i) WORLD_CHECK(torch::equal(plain[i], hooked[i]), "no hook: " << i);
  }), "");
}

// A .grad that cannot be reduced in place (not contiguous) goes through its
// bucket slot and still ends up averaged, in the same tensor.
TEST_P(Ddp, NonContiguousGradientsAreAveragedToo) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    const int n = pg.size(), r = pg.rank();
    torch::manual_seed(13);
    Net net;
    tdist::DistributedDataParallel<Net> ddp(net);
    torch::manual_seed(13);
    Net reference;
    at::Tensor& g = net->fc2->weight.mutable_grad();
    g = torch::zeros({64, 64}).t();  // autograd accumulates into it in place
    const at::Tensor before = g;
    auto [x, y] = batch(4, 8 * n);
    torch::nn::functional::cross_entropy(ddp->forward(x.narrow(0, 8 * r, 8)), y.narrow(0, 8 * r, 8)).backward();
    torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
    WORLD_CHECK(net->fc2->weight.grad().is_same(before) && !before.is_contiguous(), "the .grad tensor was replaced");
    auto pa = net->parameters(), pb = reference->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      WORLD_CHECK(torch::allclose(pa[i].grad(), pb[i].grad(), 1e-5, 1e-6), "grad " << i);
    }
  }), "");
}

TEST_P(Ddp, NoopHookLeavesGradientsLocal) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    torch::manual_seed(9);
    Net net;
    tdist::DistributedDataParallel<Net> ddp(net);
    ddp->register_comm_hook(tdist::default_group(), tdist::noop_hook);
    torch::manual_seed(9);
    Net local;
    auto [x, y] = batch(pg.rank(), 8);  // different data per rank
    torch::nn::functional::cross_entropy(ddp->forward(x), y).backward();
    torch::nn::functional::cross_entropy(local->forward(x), y).backward();
    auto pa = net->parameters(), pb = local->parameters();
    for (size_t i = 0; i < pa.size(); ++i) WORLD_CHECK(torch::equal(pa[i].grad(), pb[i].grad()), "grad " << i);
  }), "");
}

TEST_P(Ddp, AHookSeesEachBucketOnce) {
  EXPECT_EQ(run_world(GetParam(), [](ProcessGroup& pg) {
    torch::manual_seed(3);
    Net net;
    tdist::DistributedDataParallelOptions o;
    o.bucket_cap_mb = 0.001;  // about one layer per bucket: three buckets
    o.first_bucket_cap_mb = 0.001;
    tdist::DistributedDataParallel<Net> ddp(net, o);
    struct Seen {
      std::vector<size_t> indices;
      std::vector<bool> last;
      std::vector<int64_t> numel, grads_numel;
      std::vector<bool> views_match;
    };
    auto seen = std::make_shared<Seen>();
    auto group = tdist::default_group();
    ddp->register_comm_hook(seen, [group](const std::shared_ptr<Seen>& s, tdist::GradBucket& b) {
      s->indices.push_back(b.index());
      s->last.push_back(b.is_last());
      s->numel.push_back(b.buffer().numel());
      int64_t total = 0;
      bool match = b.gradients().size() == b.parameters().size();
      for (size_t k = 0; k < b.gradients().size(); ++k) {
        total += b.gradients()[k].numel();
        match = match && b.gradients()[k].sizes() == b.parameters()[k].sizes() &&
                torch::equal(b.gradients()[k], b.parameters()[k].grad());
      }
      s->grads_numel.push_back(total);
      s->views_match.push_back(match);
      return tdist::allreduce_hook(group, b);
    });
    // Registering a second hook is an error.
    bool refused = false;
    try {
      ddp->register_comm_hook([](tdist::GradBucket& b) { return tdist::Work::completed({b.buffer()}); });
    } catch (const tdist::UsageError&) {
      refused = true;
    }
    WORLD_CHECK(refused, "a second register_comm_hook was accepted");
    auto [x, y] = batch(pg.rank(), 8);
    torch::nn::functional::cross_entropy(ddp->forward(x), y).backward();
    const size_t buckets = ddp->bucket_indices().size();
    WORLD_CHECK(buckets > 2 && seen->indices.size() == buckets, seen->indices.size() << " hook calls, " << buckets << " buckets");
    for (size_t k = 0; k < buckets; ++k) {
      WORLD_CHECK(seen->indices[k] == k, "bucket order");
      WORLD_CHECK(seen->last[k] == (k + 1 == buckets), "is_last");
      WORLD_CHECK(seen->numel[k] == seen->grads_numel[k], "buffer size");
      WORLD_CHECK(seen->views_match[k], "gradients() views do not match the parameters' grads");
    }
  }), "");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Ddp, ::testing::Values(1, 2, 3));

TEST(Ddp, BuffersAreBroadcastFromRankZeroBeforeEachForward) {
  EXPECT_EQ(run_world(3, [](ProcessGroup& pg) {
    for (bool broadcast : {true, false}) {
      Offset net;
      tdist::DistributedDataParallelOptions o;
      o.broadcast_buffers = broadcast;
      tdist::DistributedDataParallel<Offset> ddp(net, o);
      // Each rank's buffer drifts apart (as running statistics would)...
      net->offset.fill_(static_cast<float>(10 * (pg.rank() + 1)));
      const auto x = torch::zeros({1, 3});
      const auto bias = net->fc->bias.detach();
      auto out = ddp->forward(x).detach();
      // ...and each forward starts from rank 0's again, unless told not to.
      const float want = broadcast ? 10.0f : static_cast<float>(10 * (pg.rank() + 1));
      WORLD_CHECK(torch::allclose(out - bias, torch::full({1, 3}, want)), "broadcast_buffers=" << broadcast);
      WORLD_CHECK(net->offset.eq(want).all().item<bool>(), "buffer after forward, broadcast_buffers=" << broadcast);
    }
  }), "");
}

TEST(DdpMisuse, AParameterWithoutGradientIsNamedAtTheNextForward) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    Spare net;
    tdist::DistributedDataParallel<Spare> ddp(net);
    auto x = torch::ones({3, 4});
    ddp->forward(x).sum().backward();
    try {
      ddp->forward(x);
      throw std::runtime_error("no error at the next forward");
    } catch (const tdist::UsageError& e) {
      const std::string m = e.what();
      WORLD_CHECK(m.find("unused.weight") != std::string::npos && m.find("unused.bias") != std::string::npos, m);
      WORLD_CHECK(m.find(" used.weight") == std::string::npos, m);  // the used layer is not named
    }
  }), "");
}

TEST(DdpMisuse, ModelsThatDifferAcrossRanksAreNamed) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    torch::nn::Sequential net(torch::nn::Linear(4, pg.rank() == 0 ? 3 : 5));
    try {
      tdist::DistributedDataParallel<torch::nn::Sequential> ddp(net);
      throw std::runtime_error("no error");
    } catch (const tdist::UsageError& e) {
      const std::string m = e.what();
      WORLD_CHECK(m.find("rank 1's model differs from rank 0's at parameter #0") != std::string::npos, m);
      WORLD_CHECK(m.find("[3, 4]") != std::string::npos && m.find("[5, 4]") != std::string::npos, m);
    }
  }), "");
}

TEST(DdpUnused, FindUnusedParametersReducesTheRestAndLeavesNeverUsedGradientsAlone) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    Spare net;
    tdist::DistributedDataParallelOptions o;
    o.find_unused_parameters = true;
    tdist::DistributedDataParallel<Spare> ddp(net, o);
    for (int step = 0; step < 3; ++step) {
      auto x = torch::full({2, 4}, static_cast<float>(pg.rank() + 1 + step));
      ddp->zero_grad();
      ddp(x).sum().backward();  // no error, no hang, at this or the next forward
      // d(sum)/d(weight) = column sums of x: 2 * (rank + 1 + step), averaged.
      const float want = 2.0f * (1.5f + step);
      WORLD_CHECK(net->used->weight.grad().eq(want).all().item<bool>(), "step " << step);
      WORLD_CHECK(!net->unused->weight.grad().defined() || net->unused->weight.grad().eq(0).all().item<bool>(),
                  "a parameter no rank used gets no gradient");
    }
  }), "");
}

// Without gradient_as_bucket_view a .grad that no rank's backward touched
// keeps its values, although it lives in bucket memory, which takes part in
// the reduction as zeros.
TEST(DdpUnused, AGradientNoRankProducedKeepsItsValues) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    Spare net;
    net->unused->weight.mutable_grad() = torch::full({2, 4}, 7.0f);
    tdist::DistributedDataParallelOptions o;
    o.find_unused_parameters = true;
    tdist::DistributedDataParallel<Spare> ddp(net, o);
    for (int step = 0; step < 2; ++step) {
      ddp(torch::full({2, 4}, static_cast<float>(pg.rank() + 1))).sum().backward();
      WORLD_CHECK(net->unused->weight.grad().eq(7.0f).all().item<bool>(),
                  "step " << step << ": " << net->unused->weight.grad());
      WORLD_CHECK(net->used->weight.grad().eq(3.0f * (step + 1)).all().item<bool>(), "step " << step);
    }
  }), "");
}

TEST(DdpUnused, AParameterUsedOnOneRankOnlyGetsTheAverageEverywhere) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    Branch net;
    tdist::DistributedDataParallelOptions o;
    o.find_unused_parameters = true;
    tdist::DistributedDataParallel<Branch> ddp(net, o);
    const auto x = torch::ones({1, 4});
    // Reference: rank 0's branch gradient, computed locally on a copy.
    Branch ref;
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < ref->parameters().size(); ++i) ref->parameters()[i].copy_(net->parameters()[i]);
    }
    ref->forward(x, true).sum().backward();
    for (int step = 0; step < 2; ++step) {
      ddp->zero_grad();
      ddp->forward(x, pg.rank() == 0).sum().backward();
      const auto g = net->branch->weight.grad();
      WORLD_CHECK(g.defined(), "the branch has a gradient on every rank, step " << step);
      WORLD_CHECK(torch::allclose(g, ref->branch->weight.grad() / 2), "branch gradient, step " << step);
    }
  }), "");
}

TEST(DdpUnused, AnOutputLeftOutOfTheLossDoesNotHang) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    TwoHeads net;
    tdist::DistributedDataParallelOptions o;
    o.find_unused_parameters = true;
    tdist::DistributedDataParallel<TwoHeads> ddp(net, o);
    for (int step = 0; step < 2; ++step) {
      ddp->zero_grad();
      auto [a, b] = ddp(torch::ones({1, 4}));
      a.sum().backward();  // b's parameters are reachable from the outputs but get no gradient
      WORLD_CHECK(net->a->weight.grad().eq(1).all().item<bool>(), "step " << step);
    }
    ddp(torch::ones({1, 4}));  // and no error is pending
  }), "");
}

TEST(DdpUnused, WithoutTheOptionTheFixIsNamed) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    Spare net;
    tdist::DistributedDataParallel<Spare> ddp(net);
    ddp(torch::ones({1, 4})).sum().backward();
    try {
      ddp(torch::ones({1, 4}));
      throw std::runtime_error("no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(std::string(e.what()).find("find_unused_parameters = true") != std::string::npos, e.what());
    }
  }), "");
}

TEST(DdpUnused, ALossThatUsesAParameterOutsideTheForwardIsNamed) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    Spare net;
    tdist::DistributedDataParallelOptions o;
    o.find_unused_parameters = true;
    tdist::DistributedDataParallel<Spare> ddp(net, o);
    // unused.weight is not reachable from the output, so DDP reduces it as
    // unused at the start of backward; then its gradient arrives.
    (ddp(torch::ones({1, 4})).sum() + net->unused->weight.sum()).backward();
    try {
      ddp(torch::ones({1, 4}));
      throw std::runtime_error("no error");
    } catch (const tdist::UsageError& e) {
      WORLD_CHECK(std::string(e.what()).find("unused.weight") != std::string::npos, e.what());
    }
  }), "");
}

TEST(DdpStaticGraph, UnusedParametersAreLearnedInTheFirstIteration) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    Spare net;
    tdist::DistributedDataParallelOptions o;
    o.static_graph = true;
    tdist::DistributedDataParallel<Spare> ddp(net, o);
    for (int step = 0; step < 4; ++step) {
      ddp->zero_grad();
      ddp(torch::full({2, 4}, static_cast<float>(pg.rank() + 1 + step))).sum().backward();
      WORLD_CHECK(net->used->weight.grad().eq(2.0f * (1.5f + step)).all().item<bool>(),
                  "step " << step << ": " << net->used->weight.grad());
      WORLD_CHECK(!net->unused->weight.grad().defined() || net->unused->weight.grad().eq(0).all().item<bool>(),
                  "step " << step);
    }
  }), "");
}

TEST(DdpStaticGraph, MatchesOneProcessAfterTheFirstIteration) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    tdist::DistributedDataParallelOptions o;
    o.static_graph = true;
    o.first_bucket_cap_mb = o.bucket_cap_mb = 1e-3;  // several buckets
    parity(pg, Opt::kAdam, o, 4);
  }), "");
}

TEST(DdpStaticGraph, AGraphThatChangesIsAnError) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    Branch net;
    tdist::DistributedDataParallelOptions o;
    o.static_graph = true;
    tdist::DistributedDataParallel<Branch> ddp(net, o);
    ddp->forward(torch::ones({1, 4}), true).sum().backward();
    ddp->forward(torch::ones({1, 4}), false).sum().backward();  // the branch is left out now
    try {
      ddp->forward(torch::ones({1, 4}), true);
      throw std::runtime_error("no error");
    } catch (const tdist::UsageError& e) {
      const std::string m = e.what();
      WORLD_CHECK(m.find("static_graph") != std::string::npos && m.find("branch.") != std::string::npos, m);
    }
  }), "");
}

TEST(DdpBuckets, RebuiltInTheOrderGradientsArrived) {
  EXPECT_EQ(run_world(2, [](ProcessGroup& pg) {
    torch::manual_seed(7);
    Reordered net;
    Reordered local;
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < net->parameters().size(); ++i) local->parameters()[i].copy_(net->parameters()[i]);
    }
    tdist::DistributedDataParallelOptions o;
    o.first_bucket_cap_mb = o.bucket_cap_mb = 1e-6;  // one parameter per bucket
    tdist::DistributedDataParallel<Reordered> ddp(net, o);
    // Registration: outer.weight 0, outer.bias 1, inner.weight 2, inner.bias 3.
    const auto before = ddp->bucket_indices();
    WORLD_CHECK(before.size() == 4 && before[0] == std::vector<size_t>{3} && before[3] == std::vector<size_t>{0},
                "reverse registration order at first");
    torch::optim::SGD opt(ddp->parameters(), 0.1);
    torch::optim::SGD local_opt(local->parameters(), 0.1);
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(100 + step);
      const auto x = torch::randn({4, 6});
      opt.zero_grad();
      ddp(x.slice(0, 2 * pg.rank(), 2 * pg.rank() + 2)).pow(2).mean().backward();
      opt.step();
      local_opt.zero_grad();
      local->forward(x).pow(2).mean().backward();
      local_opt.step();
      // The gradients live in the buckets' symmetric memory on shm, also
      // after the rebuild moved them.
      for (const auto& p : net->parameters()) {
        WORLD_CHECK(pg.is_symmetric(p.grad()) == pg.has_symmetric_memory(), "step " << step << ": a gradient outside its bucket");
      }
      if (step == 0) continue;
      // From the second forward on, `outer` (whose gradients arrive first) leads.
      const auto after = ddp->bucket_indices();
      WORLD_CHECK(after.size() == 4, "buckets " << after.size());
      std::vector<size_t> order;
      for (const auto& b : after) order.insert(order.end(), b.begin(), b.end());
      WORLD_CHECK(std::min(order[0], order[1]) == 0 && std::max(order[0], order[1]) == 1 &&
                      std::min(order[2], order[3]) == 2 && std::max(order[2], order[3]) == 3,
                  "rebuilt order " << order[0] << order[1] << order[2] << order[3]);
    }
    for (size_t i = 0; i < net->parameters().size(); ++i) {
      WORLD_CHECK(torch::allclose(net->parameters()[i], local->parameters()[i], 1e-5, 1e-6), "parameter " << i);
    }
  }), "");
}

TEST(DdpBuckets, RebuildKeepsGradientsAsBucketViews) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    Reordered net;
    tdist::DistributedDataParallelOptions o;
    o.first_bucket_cap_mb = o.bucket_cap_mb = 1e-6;
    o.gradient_as_bucket_view = true;
    tdist::DistributedDataParallel<Reordered> ddp(net, o);
    torch::optim::SGD opt(ddp->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      ddp(torch::ones({2, 6})).sum().backward();
      opt.step();
    }
    // Each gradient still aliases its (new) bucket: the four share no storage.
    std::set<const void*> storages;
    for (const auto& p : net->parameters()) storages.insert(p.grad().storage().data());
    WORLD_CHECK(storages.size() == 4, "one bucket per parameter, got " << storages.size());
  }), "");
}

// A module trains on one device: one on two is refused by name, with the
// way out (device_id); device_id = the CPU changes nothing.
TEST(DdpMisuse, ParametersOnTwoDevicesAreRefusedByName) {
  EXPECT_EQ(run_world(2, [](ProcessGroup&) {
    try {
      tdist::DistributedDataParallel<TwoDevices> ddp{TwoDevices()};
      WORLD_CHECK(false, "no error");
    } catch (const tdist::UsageError& e) {
      const std::string m = e.what();
      WORLD_CHECK(m.find("'b' is on meta") != std::string::npos && m.find("device_id") != std::string::npos, m);
    }
    tdist::DistributedDataParallelOptions o;
    o.device_id = c10::Device(c10::kCPU);
    tdist::DistributedDataParallel<torch::nn::Linear> lin(torch::nn::Linear(3, 2), o);
    lin(torch::ones({4, 3})).sum().backward();
    WORLD_CHECK(lin->module()->weight.grad().defined() && lin->module()->weight.device().is_cpu(), "cpu ddp");
  }), "");
}

}  // namespace
