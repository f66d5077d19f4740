// tdist-bench ddp: what data-parallel training costs per step.
//
//   tdist-bench ddp [--backend shm] [--world-size 2] [--steps 10] [--rounds 10]
//       [--variants local,ddp_allreduce,ddp_fp16,ddp_bf16,ddp_noop,status_quo,...]
//       [--bucket-cap-mb 25] [--first-bucket-cap-mb 1] [--device cpu|cuda] [--json FILE]
//
// The model is the MLP 784-1024-1024-10 with batch 64 per rank, SGD with
// momentum, one compute thread per rank; a step is zero_grad (zeroing, as
// LibTorch 1.13 and the Python references do; 2.x would drop), forward,
// cross-entropy, backward and the optimizer step. Variants:
//   local          one process alone (rank 0, while the other ranks wait)
//   ddp_<hook>     DistributedDataParallel with the built-in hook <hook>
//   status_quo     what C++ users write today (pytorch/examples cpp/distributed):
//                  after backward, all-reduce each gradient in turn, then divide
//   after_coalesced (only when asked for) after backward, one coalesced
//                  all-reduce of every gradient: what overlapping with
//                  backward buys over not overlapping at all
//   c_ddp_allreduce ddp_allreduce through the C ABI (include/tdist/c/tdist.h),
//                  as a language binding drives it: the model's own forward
//                  between tdist_ddp_pre_forward and _post_forward; its
//                  final weights are compared with ddp_allreduce's (same
//                  start, same steps: they must be equal bit for bit)
//   <variant>_nofr  the same with the flight recorder paused (what it costs)
//   <variant>_trace the same with the timeline on (TDIST_TRACE; written to
//                  /tmp/tdist-bench-ddp.rank-R.json at exit)
//   <variant>_view  with gradient_as_bucket_view; local_all: every rank alone at once
//   ddp_allreduce_staged  ddp_allreduce on a group without symmetric memory
//                  (TDIST_SHM_SYMMETRIC=0): its buckets in ordinary memory,
//                  reduced through shm's staging buffers
// Variants take turns, `rounds` times (round r starting at variant r); each
// reports its median round (a round: the slowest rank's mean step time) and
// its ratio to local, the median over rounds of the ratio within one turn.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>

#include "bench/bench_common.h"
#include "tdist/c/tdist.h"
#include "tdist/tdist.h"
#include "util/cli.h"
#include "util/torch_compat.h"
#include "util/torch_cuda_loader.h"

namespace tdist::bench {

namespace {

using Clock = std::chrono::steady_clock;

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 1024))),
        fc2(register_module("fc2", torch::nn::Linear(1024, 1024))),
        fc3(register_module("fc3", torch::nn::Linear(1024, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

const std::vector<std::string> kVariants = {"local",         "ddp_allreduce", "ddp_fp16",      "ddp_bf16",
                                            "ddp_noop",      "status_quo",    "ddp_allreduce_view", "ddp_fp16_view",
                                            "ddp_bf16_view", "local_all",     "ddp_allreduce_staged", "c_ddp_allreduce"};

Mlp make_model(c10::Device device) {
  torch::manual_seed(0);
  Mlp m;
  m->to(device);
  return m;
}

// One variant's training step, built once and run in every round.
struct Variant {
  std::string name;
  bool recorder = true;  // <name>_nofr: the flight recorder paused while it steps
  bool timeline = false;  // <name>_trace: the timeline on while it steps
  bool everyone = true;  // false: only rank 0 steps (local)
  std::function<void()> step;  // owns the model, optimizer and DDP it drives
  std::function<std::vector<at::Tensor>()> weights;  // the model's parameters (DDP variants)
  c10::Device device = c10::kCPU;
};

void c_ok(tdist_status s, const char* what) {
  if (s != TDIST_OK) throw std::runtime_error(std::string(what) + ": " + tdist_last_error());
}

// DDP through the C ABI over the model's parameters (the binding's tensors).
struct CDdp {
  Mlp model;
  std::vector<at::Tensor> params;  // what the binding holds; tdist borrows &params[i]
  tdist_module* module = nullptr;
  tdist_ddp* ddp = nullptr;
  ~CDdp() {
    if (ddp) tdist_ddp_free(ddp);
    if (module) tdist_module_free(module);
  }
};

std::shared_ptr<CDdp> make_c_ddp(c10::Device device, double bucket_cap_mb, double first_bucket_cap_mb) {
  auto c = std::make_shared<CDdp>();
  c->model = make_model(device);
  std::vector<std::string> names;
  for (const auto& p : c->model->named_parameters()) {
    names.push_back(p.key());
    c->params.push_back(p.value());
  }
  std::vector<const char*> cnames;
  std::vector<tdist_tensor> handles;
  for (size_t i = 0; i < names.size(); ++i) {
    cnames.push_back(names[i].c_str());
    handles.push_back(&c->params[i]);
  }
  c_ok(tdist_module_new(cnames.data(), handles.data(), handles.size(), &c->module), "tdist_module_new");
  tdist_ddp_options o;
  tdist_ddp_options_init(&o);
  o.bucket_cap_mb = bucket_cap_mb;
  o.first_bucket_cap_mb = first_bucket_cap_mb;
  c_ok(tdist_ddp_new(c->module, nullptr, &o, &c->ddp), "tdist_ddp_new");
  c_ok(tdist_ddp_register_comm_hook(c->ddp, "allreduce", nullptr), "tdist_ddp_register_comm_hook");
  return c;
}

Variant make_variant(ProcessGroup& pg, const std::string& name, const torch::Tensor& x, const torch::Tensor& y,
                     double bucket_cap_mb, double first_bucket_cap_mb) {
  const c10::Device device = x.device();
  Variant v;
  v.name = name;
  v.device = device;
  for (const char* suffix : {"_nofr", "_trace"}) {
    const size_t n = std::strlen(suffix);
    if (name.size() > n && name.compare(name.size() - n, n, suffix) == 0) {
      Variant base = make_variant(pg, name.substr(0, name.size() - n), x, y, bucket_cap_mb, first_bucket_cap_mb);
      base.name = name;
      if (n == 5) base.recorder = false;
      else base.timeline = true;
      return base;
    }
  }
  const auto sgd = [](std::vector<torch::Tensor> ps) {
    return std::make_shared<torch::optim::SGD>(std::move(ps), torch::optim::SGDOptions(0.01).momentum(0.9));
  };
  if (name == "local" || name == "local_all") {
    v.everyone = name == "local_all";
    auto model = std::make_shared<Mlp>(make_model(device));
    auto opt = sgd((*model)->parameters());
    v.step = [model, opt, x, y] {
      tdist::compat::zero_grad(*opt, /*set_to_none=*/false);
      torch::nn::functional::cross_entropy((*model)(x), y).backward();
      opt->step();
    };
  } else if (name == "c_ddp_allreduce") {
    if (device.is_cuda()) throw UsageError("tdist-bench ddp: c_ddp_allreduce runs on the CPU");
    auto c = make_c_ddp(device, bucket_cap_mb, first_bucket_cap_mb);
    auto opt = sgd(c->params);
    v.step = [c, opt, x, y] {
      tdist::compat::zero_grad(*opt, /*set_to_none=*/false);
      c_ok(tdist_ddp_pre_forward(c->ddp), "tdist_ddp_pre_forward");
      at::Tensor out = c->model(x);
      tdist_tensor handle = &out;
      c_ok(tdist_ddp_post_forward(c->ddp, &handle, 1), "tdist_ddp_post_forward");
      torch::nn::functional::cross_entropy(out, y).backward();
      opt->step();
    };
    v.weights = [c] { return c->params; };
  } else if (name == "status_quo") {
    auto model = std::make_shared<Mlp>(make_model(device));
    auto opt = sgd((*model)->parameters());
    v.step = [model, opt, x, y, &pg] {
      tdist::compat::zero_grad(*opt, /*set_to_none=*/false);
      torch::nn::functional::cross_entropy((*model)(x), y).backward();
      for (auto& p : (*model)->parameters()) {
        pg.all_reduce(p.mutable_grad())->wait();
        p.mutable_grad().div_(pg.size());
      }
      opt->step();
    };
  } else if (name == "after_coalesced") {
    auto model = std::make_shared<Mlp>(make_model(device));
    auto opt = sgd((*model)->parameters());
    v.step = [model, opt, x, y, &pg] {
      tdist::compat::zero_grad(*opt, /*set_to_none=*/false);
      torch::nn::functional::cross_entropy((*model)(x), y).backward();
      std::vector<at::Tensor> g;
      for (auto& p : (*model)->parameters()) g.push_back(p.mutable_grad());
      pg.all_reduce_coalesced(g, {ReduceOp::AVG})->wait();
      opt->step();
    };
  } else {
    // ddp_<hook>, ddp_<hook>_view for gradient_as_bucket_view, or
    // ddp_allreduce_staged.
    std::string hook = name.substr(4);
    DistributedDataParallelOptions o;
    std::shared_ptr<ProcessGroup> group;  // empty: the default
    if (hook == "allreduce_staged") {
      hook = "allreduce";
      ::setenv("TDIST_SHM_SYMMETRIC", "0", 1);  // read when the subgroup's backend starts
      std::vector<int> everyone(pg.size());
      for (int r = 0; r < pg.size(); ++r) everyone[r] = r;
      group = pg.new_group(everyone);
      ::unsetenv("TDIST_SHM_SYMMETRIC");
      o.process_group = group;
    }
    o.bucket_cap_mb = bucket_cap_mb;
    o.first_bucket_cap_mb = first_bucket_cap_mb;
    if (device.is_cuda()) o.device_id = device;
    if (hook.size() > 5 && hook.compare(hook.size() - 5, 5, "_view") == 0) {
      o.gradient_as_bucket_view = true;
      hook.resize(hook.size() - 5);
    }
    auto ddp = std::make_shared<DistributedDataParallel<Mlp>>(make_model(device), o);
    if (hook == "allreduce") (*ddp)->register_comm_hook(group, allreduce_hook);
    else if (hook == "fp16") (*ddp)->register_comm_hook(group, fp16_compress_hook);
    else if (hook == "bf16") (*ddp)->register_comm_hook(group, bf16_compress_hook);
    else if (hook == "noop") (*ddp)->register_comm_hook(group, noop_hook);
    else throw UsageError("tdist-bench ddp: unknown variant '" + name + "'");
    auto opt = sgd((*ddp)->parameters());
    v.step = [ddp, opt, x, y] {
      tdist::compat::zero_grad(*opt, /*set_to_none=*/false);
      torch::nn::functional::cross_entropy((*ddp)(x), y).backward();
      opt->step();
    };
    v.weights = [ddp] { return (*ddp)->module()->parameters(); };
  }
  if (v.everyone || pg.rank() == 0) {
    for (int i = 0; i < 3; ++i) v.step();  // warm up
  }
  return v;
}

// One round of `v`: the slowest rank's mean ms/step over `steps` steps,
// after two untimed ones (variants take turns, so a round starts with
// another model's data in the caches).
double run_round(ProcessGroup& pg, Variant& v, int steps) {
  pg.barrier()->wait();
  trace::set_flight_recorder_enabled(v.recorder);
  trace::set_timeline_enabled(v.timeline);
  if (v.everyone || pg.rank() == 0) {
    for (int i = 0; i < 2; ++i) v.step();
  }
  pg.barrier()->wait();
  double ms = 0;
  if (v.everyone || pg.rank() == 0) {
    const auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) v.step();
    // On a GPU the steps only queued their kernels: wait for them (a copy to
    // the host waits for the default stream, where they run).
    if (v.device.is_cuda()) (void)at::zeros({1}, at::TensorOptions(v.device)).item<float>();
    ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / steps;
  }
  trace::set_flight_recorder_enabled(true);
  trace::set_timeline_enabled(false);
  at::Tensor t = at::tensor({ms}, at::kDouble);
  pg.all_reduce(t, {ReduceOp::MAX})->wait();
  return t.item<double>();
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string item; std::getline(is, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int run_rank(const DdpBenchOptions& o, int rank, int world) {
  at::set_num_threads(1);
  InitOptions io;
  io.backend = o.backend;
  io.rank = rank;
  io.world_size = world;
  io.timeout = std::chrono::seconds(300);
  // Any *_trace variant: the timeline, paused but in its rounds.
  if (o.variants.find("_trace") != std::string::npos) {
    trace::start_timeline("/tmp/tdist-bench-ddp.json");
    trace::set_timeline_enabled(false);
  }
  auto pg = init_process_group(io);
  const int steps = o.steps;
  const int rounds = o.rounds;
  if (steps < 1 || rounds < 1) throw UsageError("tdist-bench ddp: --steps and --rounds must be positive");
  const double bucket_cap_mb = o.bucket_cap_mb;
  const double first_bucket_cap_mb = o.first_bucket_cap_mb.value_or(std::min(1.0, bucket_cap_mb));
  if (!(bucket_cap_mb > 0) || !(first_bucket_cap_mb > 0)) {
    throw UsageError("tdist-bench ddp: --bucket-cap-mb and --first-bucket-cap-mb must be positive");
  }
  std::vector<std::string> variants = split_commas(o.variants);
  if (variants.empty()) variants = kVariants;

  c10::Device device(o.device);
  if (device.is_cuda() && !device.has_index()) device = c10::Device(c10::kCUDA, 0);
  if (device.is_cuda()) detail::load_torch_cuda();
  torch::manual_seed(1000 + rank);
  const torch::Tensor x = torch::randn({64, 784}).to(device);
  const torch::Tensor y = torch::randint(0, 10, {64}, torch::kLong).to(device);

  std::vector<Variant> built;
  for (const auto& v : variants) built.push_back(make_variant(*pg, v, x, y, bucket_cap_mb, first_bucket_cap_mb));
  std::map<std::string, std::vector<double>> times;
  // Round r starts at variant r (mod their number), so that no variant
  // always follows the same one (after `local`, with the other ranks idle,
  // a variant measured up to ~0.05x worse).
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < built.size(); ++k) {
      Variant& v = built[(r + k) % built.size()];
      times[v.name].push_back(run_round(*pg, v, steps));
    }
  }
  pg->barrier()->wait();
  // The C ABI's DDP and the C++ API's, from the same start through the
  // same steps: the same weights, bit for bit.
  int c_equal = -1;  // -1: not both run
  {
    const Variant* a = nullptr;
    const Variant* b = nullptr;
    for (const auto& v : built) {
      if (v.name == "ddp_allreduce") a = &v;
      if (v.name == "c_ddp_allreduce") b = &v;
    }
    if (a && b) {
      const auto wa = a->weights(), wb = b->weights();
      c_equal = wa.size() == wb.size() ? 1 : 0;
      for (size_t i = 0; c_equal == 1 && i < wa.size(); ++i) c_equal = at::equal(wa[i], wb[i]) ? 1 : 0;
    }
  }
  if (rank != 0) return c_equal == 0 ? 1 : 0;

  // Each variant's median round, and its ratio to local as the median over
  // rounds of (this round / local's round): rounds of one turn run within a
  // second or two, so the pairing cancels this VM's slow and fast spells,
  // which last seconds.
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n == 0 ? 0.0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  };
  auto ratio = [&](const std::string& v) {
    if (!times.count("local")) return 0.0;
    std::vector<double> r;
    for (size_t k = 0; k < times[v].size(); ++k) r.push_back(times[v][k] / times["local"][k]);
    return median(r);
  };
  std::printf("\n# DDP step time: MLP 784-1024-1024-10, batch 64 per rank, SGD, 1 thread per rank, backend %s, "
              "world size %d, device %s\n# %d rounds of %d steps (each round: the slowest rank's mean); ms/step: the median "
              "round;\n# x local: the median over rounds of the round's ratio to local's round in the same turn\n",
              pg->backend_name().c_str(), world, device.str().c_str(), rounds, steps);
  std::printf("%-20s %10s %9s %9s   %s\n", "variant", "ms/step", "best", "x local", "rounds (ms/step)");
  JsonRows json;
  for (const auto& v : variants) {
    const double ms = median(times[v]);
    const double best = *std::min_element(times[v].begin(), times[v].end());
    std::string all;
    for (double t : times[v]) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%.2f", all.empty() ? "" : " ", t);
      all += buf;
    }
    std::printf("%-20s %10.2f %9.2f %9.2f   %s\n", v.c_str(), ms, best, ratio(v), all.c_str());
    json.begin_row();
    json.field("variant", v);
    json.field("world_size", world);
    json.field("backend", pg->backend_name());
    json.field("device", device.str());
    json.field("ms_per_step", ms);
    json.field("best_ms_per_step", best);
    json.field("ratio_vs_local", ratio(v));
    if (v == "c_ddp_allreduce" && c_equal >= 0) json.field("weights_equal_ddp_allreduce", c_equal);
  }
  if (c_equal >= 0) {
    std::printf("# c_ddp_allreduce's weights equal ddp_allreduce's bit for bit: %s\n", c_equal ? "yes" : "NO");
  }
  const int finished = json.finish(o.json);
  return c_equal == 0 ? 1 : finished;
}

}  // namespace

void DdpBenchOptions::add_to(CLI::App& mode) {
  using cli::both_spellings;
  mode.add_option("--backend", backend, "shm, gloo, mpi or another registered one")->capture_default_str();
  mode.add_option(both_spellings("world-size"), world_size, "ranks, started here")->check(cli::in_range(1, 256))
      ->capture_default_str();
  mode.add_option("--steps", steps, "timed steps per round")->check(cli::in_range(1, 1e6))->capture_default_str();
  mode.add_option("--rounds", rounds, "rounds per variant, the variants taking turns")->check(cli::in_range(1, 1e6))
      ->capture_default_str();
  mode.add_option("--variants", variants, "comma-separated (default: all but after_coalesced)")
      ->type_name("V,V,...");
  mode.add_option(both_spellings("bucket-cap-mb"), bucket_cap_mb, "DDP's bucket_cap_mb")
      ->check(cli::in_range(1e-6, 1 << 16))
      ->capture_default_str();
  mode.add_option(both_spellings("first-bucket-cap-mb"), first_bucket_cap_mb,
                  "the first bucket's cap (default: min(1, bucket cap))")
      ->check(cli::in_range(1e-6, 1 << 16));
  mode.add_option("--device", device, "cpu, or cuda (every rank on cuda:0)")->capture_default_str();
  mode.add_option("--json", json, "also write the rows here")->type_name("FILE");
}

int ddp_bench(const DdpBenchOptions& o, const std::vector<std::string>& args) {
  if (std::getenv("RANK") && std::getenv("WORLD_SIZE") && std::getenv("MASTER_ADDR")) {
    return run_rank(o, std::atoi(std::getenv("RANK")), std::atoi(std::getenv("WORLD_SIZE")));
  }
  return spawn_ranks("ddp", o.world_size, args, {});
}

}  // namespace tdist::bench
