// tdist-bench fsdp: what sharding, activation checkpointing and mixed
// precision save in memory and cost in step time.
//
//   tdist-bench fsdp [--model mlp|vit|gpt] [--backend shm|gloo] [--world-size 2] [--blocks B] [--width W]
//       [--hidden H] [--heads N] [--batch N] [--steps 6] [--rounds 3] [--forward-prefetch]
//       [--variants V,V,...] [--json FILE]
//
// A variant's name + "_nofr" (full_shard_nofr): the same with the flight
// recorder paused; + "_trace": with the timeline on (written to
// /tmp/tdist-bench-fsdp.rank-R.json); to measure what they cost
// (docs/benchmarks.md).
// The models and variants are in bench/fsdp_models.h. Adam (fp32: 16 bytes
// per parameter of model state); one thread per rank; shm (or --backend). Each variant
// runs as a fresh job (so that VmHWM is its own), the variants taking turns
// for `rounds` rounds; each number is its median over the rounds. Per
// variant:
// - ms/step: the slowest rank's mean over `steps` steps after two warm-up
//   steps;
// - act kept: the bytes a forward keeps for backward, measured in the job:
//   what LibTorch's CPU allocator holds after the forward minus before it
//   (a counting allocator), not counting FSDP's per-unit buffers (full
//   parameters and gradients, reduce-scatter outputs: the block pool's
//   bytes);
// - act peak: the peak of the same bytes during forward and backward over
//   their level at the step's start: activations, their gradients,
//   autograd's temporary gradient of a weight before it accumulates, with
//   checkpointing the recomputed block's (also NO_SHARD's .grad, which
//   autograd allocates);
// - peak: the peak of the allocator's bytes during the timed steps plus
//   the rank's symmetric memory (tdist::symmetric_memory_bytes(): DDP's
//   buckets, FSDP's shards);
// - state: at that peak, all but what act peak counts (the unit buffers
//   then, what the step started with, symmetric memory): parameters,
//   gradients, optimizer state, the units gathered, against the ZeRO bound
//   of the variant for fp32 Adam with Psi parameters over N ranks: DDP and
//   NO_SHARD 16 Psi,
//   SHARD_GRAD_OP (ZeRO-2) 4 Psi + 12 Psi / N, FULL_SHARD (ZeRO-3)
//   16 Psi / N + the largest unit's full parameters and gradients (8 bytes
//   a parameter; 4 in bf16);
// - VmHWM: the process's peak RSS over its RSS before the model;
// - communication per step: the bytes FSDP all-gathers (the output: the
//   gathered parameters) and the gradient bytes it reduces (reduce-scatter
//   or all-reduce input), and how many of those collectives a step makes,
//   from ProcessGroup::collective_counts().
// All memory per rank, the largest rank's.
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "bench/tcp_bytes.h"
#include "bench/fsdp_models.h"
#include "bench/memory_meter.h"
#include "fsdp/block_pool.h"
#include "tdist/tdist.h"
#include "util/cli.h"

namespace tdist::bench {

namespace {

using Clock = std::chrono::steady_clock;

// What one job measured (maxima over its ranks).
struct Result {
  double ms = 0;
  double peak = 0;         // allocator peak + symmetric memory
  double state = 0;        // at the peak, all but the activations
  double hwm = 0;          // VmHWM - VmRSS before the model
  double activations = 0;      // kept by a forward for backward
  double activation_peak = 0;  // the peak of forward and backward above the step's start
  double gathered = 0;         // all-gather output bytes per step
  double reduced = 0;          // gradient reduction input bytes per step
  double collectives = 0;      // FSDP's gathers and reductions per step (calls)
  double wire = 0;        // TCP bytes this rank sent per step (gloo; bench/tcp_bytes.h)
  double wire_bound = 0;  // what ring collectives must send for those: (N-1)/N of each gather's output and
                          // reduce-scatter's input, 2(N-1)/N of each all-reduce's
  static constexpr int kFields = 11;
  std::vector<double> fields() const {
    return {ms, peak, state, hwm, activations, activation_peak, gathered, reduced, collectives, wire, wire_bound};
  }
  static Result from(const std::vector<double>& f) {
    return {f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10]};
  }
};

int64_t block_bytes() { return static_cast<int64_t>(detail::block_bytes()); }

// One rank of one variant's job: builds, trains, reports (rank 0 writes the
// job's result, maxima over ranks, to `result`).
int run_rank(const FsdpBenchOptions& o) {
  CountingAllocator& mem = CountingAllocator::install();
  mem.set_excluded(&block_bytes);  // live_rest(): the allocator's bytes but FSDP's unit buffers
  at::set_num_threads(1);
  const int64_t rss0 = proc_status_bytes("VmRSS");
  InitOptions init;
  init.backend = o.backend;
  auto pg = init_process_group(init);
  torch::manual_seed(0);
  // <variant>_nofr: the same with the flight recorder paused (its cost).
  std::string variant = o.run_variant;
  if (variant.size() > 5 && variant.compare(variant.size() - 5, 5, "_nofr") == 0) {
    variant.resize(variant.size() - 5);
    trace::set_flight_recorder_enabled(false);
  } else if (variant.size() > 6 && variant.compare(variant.size() - 6, 6, "_trace") == 0) {
    variant.resize(variant.size() - 6);
    trace::start_timeline("/tmp/tdist-bench-fsdp.json");
  }
  BenchModel model = build_bench_model(o, variant);
  torch::optim::Adam opt(model.params, torch::optim::AdamOptions(1e-4));
  torch::manual_seed(100 + pg->rank());
  const auto [x, y] = bench_batch(o);
  // Per step: the bytes (not FSDP's unit buffers) at its start, kept by
  // its forward, and at its peak over the start.
  int64_t at_start = 0, kept = 0, above_start = 0;
  const auto step = [&] {
    for (auto& p : model.params) p.mutable_grad().reset();
    const int64_t before = mem.live_rest();
    at_start = std::max(at_start, before);
    mem.reset_peak_rest();
    torch::Tensor out = model.forward(x);
    kept = std::max(kept, mem.live_rest() - before);
    torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}).to(torch::kFloat), y.reshape({-1})).backward();
    above_start = std::max(above_start, mem.peak_rest() - before);
    opt.step();
  };
  for (int i = 0; i < 2; ++i) step();
  at_start = kept = above_start = 0;
  pg->barrier()->wait();
  pg->reset_collective_counts();
  mem.reset_peak();
  const uint64_t sent0 = tcp_bytes_sent();
  const auto t0 = Clock::now();
  for (int i = 0; i < o.steps; ++i) step();
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / o.steps;
  Result r;
  r.ms = ms;
  r.wire = static_cast<double>(tcp_bytes_sent() - sent0) / o.steps;
  // Symmetric memory (shm: DDP's buckets, FSDP's shards) is mapped, not
  // allocated through LibTorch; its blocks live for the whole run.
  r.peak = static_cast<double>(mem.peak() + symmetric_memory_bytes());
  // At the peak: the unit buffers, and what the step started with.
  r.state = static_cast<double>(mem.excluded_at_peak() + at_start + symmetric_memory_bytes());
  r.hwm = static_cast<double>(proc_status_bytes("VmHWM") - rss0);
  r.activations = static_cast<double>(kept);
  r.activation_peak = static_cast<double>(above_start);
  for (const auto& [op, c] : pg->collective_counts()) {
    const double calls = static_cast<double>(c.calls) / o.steps;
    const double share = static_cast<double>(pg->size() - 1) / pg->size();
    if (op == "all_gather_into_tensor" || op == "all_gather_into_tensor_coalesced") {
      r.gathered += static_cast<double>(c.output_bytes) / o.steps;
      r.wire_bound += share * static_cast<double>(c.output_bytes) / o.steps;
      r.collectives += calls;
    }
    if (op == "reduce_scatter_tensor" || op == "reduce_scatter_tensor_coalesced" || op == "all_reduce" ||
        op == "all_reduce_coalesced") {
      r.reduced += static_cast<double>(c.input_bytes) / o.steps;
      r.wire_bound += (op.rfind("all_reduce", 0) == 0 ? 2 : 1) * share * static_cast<double>(c.input_bytes) / o.steps;
      r.collectives += calls;
    }
  }
  const std::vector<double> f = r.fields();
  at::Tensor all = at::tensor(f, at::kDouble);
  pg->all_reduce(all, {ReduceOp::MAX})->wait();
  if (pg->rank() == 0) {
    std::ofstream out(o.result);
    for (int i = 0; i < Result::kFields; ++i) out << all[i].item<double>() << (i + 1 < Result::kFields ? " " : "\n");
  }
  pg->barrier()->wait();
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Every field the median of the rounds.
Result median_result(const std::vector<Result>& rounds) {
  std::vector<double> f(Result::kFields);
  for (int i = 0; i < Result::kFields; ++i) {
    std::vector<double> v;
    for (const auto& r : rounds) v.push_back(r.fields()[i]);
    f[i] = median(v);
  }
  return Result::from(f);
}

std::vector<std::string> parse_variants(const std::string& list) {
  std::vector<std::string> variants;
  std::istringstream is(list);
  for (std::string v; std::getline(is, v, ',');) {
    if (v.empty()) continue;
    const auto& known = fsdp_variants();
    std::string base = v;
    for (const std::string suffix : {"_nofr", "_trace"}) {
      if (base.size() > suffix.size() && base.compare(base.size() - suffix.size(), suffix.size(), suffix) == 0) {
        base.resize(base.size() - suffix.size());
      }
    }
    if (std::find(known.begin(), known.end(), base) == known.end()) {
      std::string names;
      for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
      throw UsageError("tdist-bench fsdp: unknown variant '" + v + "' (" + names + ")");
    }
    variants.push_back(v);
  }
  return variants.empty() ? fsdp_variants() : variants;
}

// The ZeRO bound of a variant's model state (fp32 Adam; see the top).
double zero_bound(const std::string& v, const ModelSize& s, double n) {
  if (v.rfind("shard_grad_op", 0) == 0) return 4 * s.psi + 12 * s.psi / n;
  if (v.rfind("full_shard", 0) == 0) return 16 * s.psi / n + (variant_bf16(v) ? 4 : 8) * s.largest_unit;
  return 16 * s.psi;
}

void print_tables(const FsdpBenchOptions& o, const ModelSize& size, const std::vector<std::string>& variants,
                  const std::map<std::string, Result>& res) {
  const double mb = 1024.0 * 1024.0;
  const auto ratio = [&](const std::string& ref, double Result::*field, const Result& r) {
    const auto it = res.find(ref);
    return it != res.end() && it->second.*field > 0 ? r.*field / (it->second.*field) : 0.0;
  };
  std::printf("\n# FSDP, model %s: %d blocks, W %lld, H %lld%s (Psi = %.1f M parameters, largest unit %.1f M), "
              "batch %lld per rank, Adam fp32, 1 thread per rank, %s, world size %d\n# %d rounds of %d steps, "
              "each number its median over the rounds; x fs: over full_shard. Memory per rank (the largest rank), MiB: act kept = kept "
              "by the forward for backward;\n# act peak = the step's peak above its start, FSDP's unit buffers "
              "not counted; peak = allocator peak + symmetric memory; state = at that peak, all but the\n# "
              "activations, against the variant's ZeRO bound; VmHWM = peak RSS over RSS before the model\n",
              o.model.c_str(), o.blocks, static_cast<long long>(o.width), static_cast<long long>(o.hidden),
              o.model != "mlp" ? (", " + std::to_string(o.heads) + " heads").c_str() : "", size.psi / 1e6,
              size.largest_unit / 1e6, static_cast<long long>(o.batch), o.backend.c_str(), o.world_size, o.rounds, o.steps);
  std::printf("%-20s %8s %6s %6s %8s %6s %8s %6s %8s %8s %8s %7s %8s\n", "variant", "ms/step", "x ddp", "x fs",
              "act kept", "x fs", "act peak", "x fs", "peak", "state", "bound", "x bound", "VmHWM");
  for (const auto& v : variants) {
    const Result& r = res.at(v);
    const double b = zero_bound(v, size, o.world_size);
    std::printf("%-20s %8.1f %6.2f %6.2f %8.1f %6.3f %8.1f %6.3f %8.1f %8.1f %8.1f %7.3f %8.1f\n", v.c_str(), r.ms,
                ratio("ddp", &Result::ms, r), ratio("full_shard", &Result::ms, r), r.activations / mb,
                ratio("full_shard", &Result::activations, r), r.activation_peak / mb,
                ratio("full_shard", &Result::activation_peak, r), r.peak / mb, r.state / mb, b / mb, r.state / b,
                r.hwm / mb);
  }
  if (res.count("no_shard")) {
    std::printf("# no_shard: autograd allocates its .grad in backward, so its gradients (4 Psi) count as activations "
                "here, not as state\n");
  }
  std::printf("\n# communication per step and rank, MiB: gathered = all-gather output (parameters), reduced = "
              "gradient bytes into reduce-scatter / all-reduce; calls = those collectives per step\n");
  std::printf("# on gloo also: wire = TCP bytes a rank sent per step (the most of any rank), bound = what ring "
              "collectives must send for them ((N-1)/N of gathers and reduce-scatters, 2(N-1)/N of all-reduces)\n");
  std::printf("%-21s %10s %6s %10s %6s %8s %10s %10s %7s\n", "variant", "gathered", "x fs", "reduced", "x fs", "calls",
              "wire", "bound", "x bound");
  for (const auto& v : variants) {
    const Result& r = res.at(v);
    std::printf("%-21s %10.1f %6.3f %10.1f %6.3f %8.1f %10.1f %10.1f %7.3f\n", v.c_str(), r.gathered / mb,
                ratio("full_shard", &Result::gathered, r), r.reduced / mb, ratio("full_shard", &Result::reduced, r),
                r.collectives, r.wire / mb, r.wire_bound / mb, r.wire_bound > 0 ? r.wire / r.wire_bound : 0.0);
  }
}

int run_parent(const FsdpBenchOptions& o, const std::vector<std::string>& args) {
  const std::vector<std::string> variants = parse_variants(o.variants);
  const ModelSize size = measure_size(o);
  // The ranks' result in a fresh directory of this user's (mkdtemp), never
  // a fixed name in /tmp that another user could plant a link or FIFO at.
  std::string dir = "/tmp/tdist-bench-fsdp-XXXXXX";
  if (!::mkdtemp(dir.data())) throw std::runtime_error(std::string("cannot make a directory in /tmp: ") + std::strerror(errno));
  const std::string result = dir + "/result";
  std::map<std::string, std::vector<Result>> rounds;
  for (int round = 0; round < o.rounds; ++round) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const std::string& v = variants[(round + k) % variants.size()];
      if (spawn_ranks("fsdp", o.world_size, args, {"--run-variant", v, "--result", result}) != 0) {
        throw std::runtime_error("the " + v + " job failed");
      }
      std::vector<double> f(Result::kFields);
      std::ifstream in(result);
      for (auto& x : f) {
        if (!(in >> x)) throw std::runtime_error("the " + v + " job wrote no result");
      }
      rounds[v].push_back(Result::from(f));
    }
  }
  std::remove(result.c_str());
  ::rmdir(dir.c_str());
  std::map<std::string, Result> res;
  for (const auto& v : variants) res[v] = median_result(rounds[v]);
  print_tables(o, size, variants, res);
  JsonRows json;
  for (const auto& v : variants) {
    const Result& r = res[v];
    const double b = zero_bound(v, size, o.world_size);
    json.begin_row();
    json.field("variant", v);
    json.field("model", o.model);
    json.field("world_size", o.world_size);
    json.field("psi", size.psi);
    json.field("ms_per_step", r.ms);
    json.field("activation_bytes", r.activations);
    json.field("activation_peak_bytes", r.activation_peak);
    json.field("peak_bytes", r.peak);
    json.field("state_bytes", r.state);
    json.field("bound_bytes", b);
    json.field("state_over_bound", r.state / b);
    json.field("peak_minus_kept_over_bound", (r.peak - r.activations) / b);  // issue 15's measure
    json.field("vmhwm_over_start_bytes", r.hwm);
    json.field("gathered_bytes_per_step", r.gathered);
    json.field("reduced_bytes_per_step", r.reduced);
    json.field("collectives_per_step", r.collectives);
    json.field("wire_bytes_per_step", r.wire);
    json.field("wire_bound_bytes_per_step", r.wire_bound);
    json.field("backend", o.backend);
  }
  return json.finish(o.json);
}

// The model's defaults for the sizes left at 0.
FsdpBenchOptions with_defaults(FsdpBenchOptions o) {
  const bool vit = o.model == "vit", gpt = o.model == "gpt";
  if (o.blocks == 0) o.blocks = gpt ? 4 : 8;  // gpt: examples/gpt.cpp's default size
  if (o.width == 0) o.width = vit ? 256 : gpt ? 128 : 1024;
  if (o.hidden == 0) o.hidden = vit ? 1024 : gpt ? 512 : 4096;
  if (o.heads == 0) o.heads = vit ? 8 : gpt ? 4 : 1;
  if (o.batch == 0) o.batch = vit ? 64 : 8;
  if ((vit || gpt) && o.width % o.heads != 0) throw UsageError("tdist-bench fsdp: --width must be a multiple of --heads");
  return o;
}

}  // namespace

void FsdpBenchOptions::add_to(CLI::App& mode) {
  using cli::both_spellings;
  mode.add_option(both_spellings("world-size"), world_size, "ranks, started here")->check(cli::in_range(1, 64))
      ->capture_default_str();
  mode.add_option("--backend", backend, "the process group's backend")->check(CLI::IsMember({"shm", "gloo"}))
      ->capture_default_str();
  mode.add_option("--model", model, "mlp: residual MLP blocks; vit: the fsdp_vit example's transformer; "
                                   "gpt: the gpt example's GPT-2 (tied lm_head), 128 tokens a row")
      ->check(CLI::IsMember({"mlp", "vit", "gpt"}))->capture_default_str();
  mode.add_option("--blocks", blocks, "blocks, one FSDP unit each (default: 8, gpt 4)")->check(cli::in_range(1, 1024));
  mode.add_option("--width", width, "W (default: mlp 1024, vit 256, gpt 128)")->check(cli::in_range(1, 65536));
  mode.add_option("--hidden", hidden, "H, the blocks' hidden width (default: mlp 4096, vit 1024, gpt 512)")
      ->check(cli::in_range(1, 262144));
  mode.add_option("--heads", heads, "attention heads of vit (default 8) and gpt (default 4)")->check(cli::in_range(1, 1024));
  mode.add_option("--batch", batch, "rows per rank (default: mlp 8, vit 64, gpt 8 rows of 128 tokens)")->check(cli::in_range(1, 65536));
  mode.add_option("--steps", steps, "timed steps per round")->check(cli::in_range(1, 1e6))->capture_default_str();
  mode.add_option("--rounds", rounds, "rounds, the variants taking turns")->check(cli::in_range(1, 1e6))
      ->capture_default_str();
  mode.add_flag("--forward-prefetch", forward_prefetch,
                "FSDP's forward_prefetch: each unit's forward starts gathering the next (a job bound by its link)");
  mode.add_option("--variants", variants,
                  "comma-separated (default: all): ddp, no_shard, shard_grad_op, full_shard, full_shard_ckpt, "
                  "full_shard_bf16, full_shard_ckpt_bf16")
      ->type_name("V,V,...");
  mode.add_option("--json", json, "also write the rows here")->type_name("FILE");
  // Set by the parent for the ranks of one variant's job.
  mode.add_option("--run-variant", run_variant)->group("");
  mode.add_option("--result", result)->group("");
}

int fsdp_bench(const FsdpBenchOptions& options, const std::vector<std::string>& args) {
  const FsdpBenchOptions o = with_defaults(options);
  if (!o.run_variant.empty()) return run_rank(o);
  return run_parent(o, args);
}

}  // namespace tdist::bench
