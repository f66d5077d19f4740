// tdist-bench fsdp: what sharding saves in memory and costs in step time.
//
//   tdist-bench fsdp [--world-size 2] [--blocks 8] [--width 1024] [--hidden 4096]
//       [--batch 8] [--steps 6] [--rounds 3] [--variants ddp,no_shard,shard_grad_op,full_shard]
//       [--json FILE]
//
// The model: Linear(256 -> W), B residual blocks h + fc2(relu(fc1(h))) with
// fc1 W -> H and fc2 H -> W, Linear(W -> 10); cross-entropy; Adam (fp32:
// 16 bytes per parameter of model state); one thread per rank; shm. The
// FSDP variants wrap every block in a unit of its own and the rest in the
// root unit. Each variant runs as a fresh job (so that VmHWM is its own),
// the variants taking turns for `rounds` rounds. Per variant: ms/step (the
// median round; a round: the slowest rank's mean over `steps` steps after
// two warm-up steps), and per rank (the largest): the peak of bytes live
// in LibTorch's CPU allocator during training (a counting allocator) plus
// the rank's blocks of symmetric memory (tdist::symmetric_memory_bytes()),
// minus the activations (measured alone: the bytes a forward of the plain
// model keeps for backward), next to the ZeRO bound of the variant for
// fp32 Adam with Psi parameters over N ranks: DDP and NO_SHARD 16 Psi,
// SHARD_GRAD_OP (ZeRO-2) 4 Psi + 12 Psi / N, FULL_SHARD (ZeRO-3)
// 16 Psi / N + 8 bytes x the largest unit (its full parameters and
// gradients); and the process's VmHWM (everything: LibTorch itself,
// shared memory) over its VmRSS before the model was built.
#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "bench/bench_common.h"
#include "bench/memory_meter.h"
#include "tdist/tdist.h"
#include "util/cli.h"

namespace tdist::bench {

namespace {

using Clock = std::chrono::steady_clock;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t w, int64_t h)
      : fc1(register_module("fc1", torch::nn::Linear(w, h))), fc2(register_module("fc2", torch::nn::Linear(h, w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(const FsdpBenchOptions& o, const FullyShardedDataParallelOptions* wrap)
      : in(register_module("in", torch::nn::Linear(256, o.width))),
        head(register_module("head", torch::nn::Linear(o.width, 10))) {
    for (int i = 0; i < o.blocks; ++i) {
      const std::string name = "block" + std::to_string(i);
      if (wrap) {
        auto b = register_module(name, FSDP<Block>(Block(o.width, o.hidden), *wrap));
        calls.push_back([b](const torch::Tensor& x) { return b->forward(x); });
      } else {
        auto b = register_module(name, Block(o.width, o.hidden));
        calls.push_back([b](const torch::Tensor& x) { return b->forward(x); });
      }
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in(x);
    for (auto& c : calls) h = c(h);
    return head(h);
  }
  torch::nn::Linear in, head;
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> calls;
};
TORCH_MODULE(Net);

const std::vector<std::string> kVariants = {"ddp", "no_shard", "shard_grad_op", "full_shard"};

struct Result {
  double ms = 0;
  double peak = 0;  // allocator bytes, largest rank
  double hwm = 0;   // VmHWM - VmRSS before the model, largest rank
};

// One rank of one variant's job: builds, trains, reports (rank 0 writes the
// job's result, maxima over ranks, to `result`).
int run_rank(const FsdpBenchOptions& o) {
  CountingAllocator& mem = CountingAllocator::install();
  at::set_num_threads(1);
  const int64_t rss0 = proc_status_bytes("VmRSS");
  auto pg = init_process_group({});
  torch::manual_seed(0);
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> params;
  std::shared_ptr<void> keep;  // the model
  if (o.run_variant == "ddp") {
    DistributedDataParallelOptions d;
    d.gradient_as_bucket_view = true;
    auto m = std::make_shared<DistributedDataParallel<Net>>(Net(o, nullptr), d);
    forward = [m](const torch::Tensor& x) { return (*m)(x); };
    params = (*m)->parameters();
    keep = m;
  } else {
    FullyShardedDataParallelOptions f;
    f.sharding_strategy = o.run_variant == "no_shard"        ? ShardingStrategy::NO_SHARD
                          : o.run_variant == "shard_grad_op" ? ShardingStrategy::SHARD_GRAD_OP
                                                             : ShardingStrategy::FULL_SHARD;
    auto m = std::make_shared<FSDP<Net>>(Net(o, &f), f);
    forward = [m](const torch::Tensor& x) { return (*m)(x); };
    params = (*m)->parameters();
    keep = m;
  }
  torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-4));
  torch::manual_seed(100 + pg->rank());
  const auto x = torch::randn({o.batch, 256});
  const auto y = torch::randint(0, 10, {o.batch}, torch::kLong);
  const auto step = [&] {
    for (auto& p : params) p.mutable_grad().reset();
    torch::nn::functional::cross_entropy(forward(x), y).backward();
    opt.step();
  };
  mem.reset_peak();
  for (int i = 0; i < 2; ++i) step();
  pg->barrier()->wait();
  const auto t0 = Clock::now();
  for (int i = 0; i < o.steps; ++i) step();
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / o.steps;
  // Symmetric memory (shm: DDP's buckets, FSDP's shards) is mapped, not
  // allocated through LibTorch; its blocks live for the whole run.
  const double peak = static_cast<double>(mem.peak() + symmetric_memory_bytes());
  at::Tensor r = at::tensor({ms, peak,
                             static_cast<double>(proc_status_bytes("VmHWM") - rss0)}, at::kDouble);
  pg->all_reduce(r, {ReduceOp::MAX})->wait();
  if (pg->rank() == 0) {
    std::ofstream f(o.result);
    f << r[0].item<double>() << " " << r[1].item<double>() << " " << r[2].item<double>() << "\n";
  }
  pg->barrier()->wait();
  return 0;
}

// Psi, the largest block's parameters, and the bytes a forward of the plain
// model keeps for backward.
struct ModelFacts {
  double psi = 0, largest_unit = 0, activations = 0;
};
ModelFacts measure_model(const FsdpBenchOptions& o) {
  CountingAllocator& mem = CountingAllocator::install();
  at::set_num_threads(1);
  ModelFacts f;
  torch::manual_seed(0);
  Net net(o, nullptr);
  for (const auto& p : net->parameters()) f.psi += static_cast<double>(p.numel());
  const Block b(o.width, o.hidden);
  double rest = f.psi;
  for (const auto& p : b->parameters()) f.largest_unit += static_cast<double>(p.numel());
  rest -= f.largest_unit * o.blocks;
  f.largest_unit = std::max(f.largest_unit, rest);
  const auto x = torch::randn({o.batch, 256});
  const int64_t before = mem.live();
  auto out = net(x);
  f.activations = static_cast<double>(mem.live() - before);
  return f;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int run_parent(const FsdpBenchOptions& o, const std::vector<std::string>& args) {
  std::vector<std::string> variants;
  std::istringstream is(o.variants);
  for (std::string v; std::getline(is, v, ',');) {
    if (v.empty()) continue;
    if (std::find(kVariants.begin(), kVariants.end(), v) == kVariants.end()) {
      throw UsageError("tdist-bench fsdp: unknown variant '" + v + "' (ddp, no_shard, shard_grad_op, full_shard)");
    }
    variants.push_back(v);
  }
  if (variants.empty()) variants = kVariants;
  const ModelFacts facts = measure_model(o);
  const std::string result = "/tmp/tdist-bench-fsdp-" + std::to_string(getpid());
  std::map<std::string, std::vector<Result>> results;
  for (int round = 0; round < o.rounds; ++round) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const std::string& v = variants[(round + k) % variants.size()];
      if (spawn_ranks("fsdp", o.world_size, args, {"--run-variant", v, "--result", result}) != 0) {
        throw std::runtime_error("the " + v + " job failed");
      }
      Result r;
      std::ifstream f(result);
      if (!(f >> r.ms >> r.peak >> r.hwm)) throw std::runtime_error("the " + v + " job wrote no result");
      results[v].push_back(r);
    }
  }
  std::remove(result.c_str());
  const double n = o.world_size, psi = facts.psi, mb = 1024.0 * 1024.0;
  auto bound = [&](const std::string& v) {
    if (v == "shard_grad_op") return 4 * psi + 12 * psi / n;
    if (v == "full_shard") return 16 * psi / n + 8 * facts.largest_unit;
    return 16 * psi;
  };
  std::printf("\n# FSDP: %d blocks of %lld-%lld (Psi = %.1f M parameters, largest unit %.1f M), batch %lld per rank, "
              "Adam fp32, 1 thread per rank, shm, world size %d\n# %d rounds of %d steps; ms/step: the median round "
              "(a round: the slowest rank's mean). Memory per rank (the largest rank), MiB:\n# model state = peak "
              "bytes live in the CPU allocator during training + symmetric memory - activations (%.1f MiB, measured alone);\n# bound = "
              "the ZeRO bound of the variant; VmHWM = the process's peak RSS over its RSS before the model\n",
              o.blocks, static_cast<long long>(o.width), static_cast<long long>(o.hidden), psi / 1e6,
              facts.largest_unit / 1e6, static_cast<long long>(o.batch), o.world_size, o.rounds, o.steps,
              facts.activations / mb);
  std::printf("%-14s %9s %8s %12s %10s %8s %10s\n", "variant", "ms/step", "x ddp", "model state", "bound",
              "x bound", "VmHWM");
  const double ddp_ms = results.count("ddp") ? median([&] {
    std::vector<double> t;
    for (const auto& r : results["ddp"]) t.push_back(r.ms);
    return t;
  }()) : 0;
  JsonRows json;
  for (const auto& v : variants) {
    std::vector<double> ms, peak, hwm;
    for (const auto& r : results[v]) {
      ms.push_back(r.ms);
      peak.push_back(r.peak);
      hwm.push_back(r.hwm);
    }
    const double state = median(peak) - facts.activations;
    const double b = bound(v);
    std::printf("%-14s %9.1f %8.2f %12.1f %10.1f %8.3f %10.1f\n", v.c_str(), median(ms),
                ddp_ms > 0 ? median(ms) / ddp_ms : 0.0, state / mb, b / mb, state / b, median(hwm) / mb);
    json.begin_row();
    json.field("variant", v);
    json.field("world_size", o.world_size);
    json.field("psi", psi);
    json.field("ms_per_step", median(ms));
    json.field("ratio_vs_ddp", ddp_ms > 0 ? median(ms) / ddp_ms : 0.0);
    json.field("model_state_bytes", state);
    json.field("bound_bytes", b);
    json.field("ratio_vs_bound", state / b);
    json.field("activation_bytes", facts.activations);
    json.field("vmhwm_over_start_bytes", median(hwm));
  }
  return json.finish(o.json);
}

}  // namespace

void FsdpBenchOptions::add_to(CLI::App& mode) {
  using cli::both_spellings;
  mode.add_option(both_spellings("world-size"), world_size, "ranks, started here")->check(CLI::Range(1, 64))
      ->capture_default_str();
  mode.add_option("--blocks", blocks, "residual blocks, one FSDP unit each")->check(CLI::PositiveNumber)
      ->capture_default_str();
  mode.add_option("--width", width, "W")->check(CLI::PositiveNumber)->capture_default_str();
  mode.add_option("--hidden", hidden, "H")->check(CLI::PositiveNumber)->capture_default_str();
  mode.add_option("--batch", batch, "rows per rank")->check(CLI::PositiveNumber)->capture_default_str();
  mode.add_option("--steps", steps, "timed steps per round")->check(CLI::PositiveNumber)->capture_default_str();
  mode.add_option("--rounds", rounds, "rounds, the variants taking turns")->check(CLI::PositiveNumber)
      ->capture_default_str();
  mode.add_option("--variants", variants, "comma-separated (default: all)")->type_name("V,V,...");
  mode.add_option("--json", json, "also write the rows here")->type_name("FILE");
  // Set by the parent for the ranks of one variant's job.
  mode.add_option("--run-variant", run_variant)->group("");
  mode.add_option("--result", result)->group("");
}

int fsdp_bench(const FsdpBenchOptions& o, const std::vector<std::string>& args) {
  if (!o.run_variant.empty()) return run_rank(o);
  return run_parent(o, args);
}

}  // namespace tdist::bench
