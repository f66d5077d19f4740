// tdist-fsdp-compare: tdist's FSDP trained exactly as
// bench/torch_fsdp_reference.py trains PyTorch's, for bench/compare_fsdp.sh.
//
//   tdist-fsdp-compare --out DIR [--world-size 2] [--backend shm] [--width 64]
//       [--hidden 128] [--blocks 4] [--batch 16] [--steps 30] [--warmup 3]
//
// Forks --world-size ranks of itself (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT set; started under tdist-run it is a rank already). The model
// and data are formulas, no random numbers, the same on both sides:
// Linear(32 -> W) `in`; B residual blocks h = h + fc2(relu(fc1(h))), fc1:
// W -> H, fc2: H -> W; Linear(W -> 10) `head`. Parameter k (registration
// order) element i starts at 0.05 sin(0.7 i + 1.3 k); step s, global row j,
// column c: x = sin(0.01 (1000 s + 37 j + c)), label (7 s + j) % 10; rank r of
// N takes rows [r G / N, (r + 1) G / N). Each block is an FSDP<Block> unit,
// the whole Net an FSDP<Net> (FULL_SHARD). A step: gradients dropped,
// forward, cross-entropy, backward, clip_grad_norm_(1.0), Adam(lr 1e-3).
//
// Rank 0 writes DIR/weights.bin (the final full parameters, float32, in
// registration order, gathered with summon_full_params) and DIR/result.json:
// names, shapes and offsets; ms/step (the median of the steps after the
// warm-up ones, slowest rank), per-step times (slowest rank) and losses
// (mean over ranks), VmHWM (the
// largest rank's peak RSS, and its value before the model was built).
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "bench/memory_meter.h"
#include "store/socket.h"
#include "tdist/tdist.h"
#include "util/cli.h"
#include "util/torch_compat.h"

namespace {

constexpr int64_t kInFeatures = 32;
constexpr int64_t kClasses = 10;

struct Config {
  int world_size = 2;
  std::string backend = "shm";
  int64_t width = 64, hidden = 128, blocks = 4, batch = 16;
  int steps = 30, warmup = 3;
  std::string out;
};

// Parameter k of the model (counting from `k` on) gets 0.05 sin(0.7 i + 1.3 k).
void fill(torch::nn::Module& m, int& k) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) {
    const auto i = torch::arange(p.numel(), torch::kDouble);
    p.copy_((0.05 * torch::sin(0.7 * i + 1.3 * k)).to(torch::kFloat).view_as(p));
    ++k;
  }
}

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(width, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, width))) {}
  torch::Tensor forward(const torch::Tensor& h) { return h + fc2(torch::relu(fc1(h))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

// Values are set before wrapping: FSDP shards what it is given.
struct NetImpl : torch::nn::Module {
  NetImpl(const Config& c, const tdist::FullyShardedDataParallelOptions& o) {
    int k = 0;
    in = register_module("in", torch::nn::Linear(kInFeatures, c.width));
    fill(*in, k);
    for (int64_t b = 0; b < c.blocks; ++b) {
      Block block(c.width, c.hidden);
      fill(*block, k);
      blocks.push_back(register_module("block" + std::to_string(b), tdist::FSDP<Block>(block, o)));
    }
    head = register_module("head", torch::nn::Linear(c.width, kClasses));
    fill(*head, k);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in(x);
    for (auto& b : blocks) h = b(h);
    return head(h);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  std::vector<tdist::FSDP<Block>> blocks;
};
TORCH_MODULE(Net);

std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int rank, int world, int64_t rows) {
  const int64_t lo = rank * rows / world, hi = (rank + 1) * rows / world;
  const auto j = torch::arange(lo, hi, torch::kDouble).unsqueeze(1);
  const auto c = torch::arange(kInFeatures, torch::kDouble).unsqueeze(0);
  auto x = torch::sin(0.01 * (step * 1000 + j * 37 + c)).to(torch::kFloat);
  auto y = torch::remainder(step * 7 + torch::arange(lo, hi, torch::kLong), kClasses);
  return {x, y};
}

// VmHWM and friends in KiB, as /proc/self/status gives them.
double vm_kib(const std::string& field) { return static_cast<double>(tdist::bench::proc_status_bytes(field)) / 1024; }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int run_rank(const Config& c, int rank, int world) {
  at::set_num_threads(1);
  tdist::InitOptions io;
  io.backend = c.backend;
  io.rank = rank;
  io.world_size = world;
  io.timeout = std::chrono::seconds(600);
  auto pg = tdist::init_process_group(io);
  const double baseline = vm_kib("VmHWM");

  tdist::FullyShardedDataParallelOptions o;  // FULL_SHARD
  tdist::FSDP<Net> model(Net(c, o), o);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  std::vector<double> times, losses;
  for (int s = 0; s < c.steps; ++s) {
    auto [x, y] = batch(s, rank, world, c.batch);
    const auto t0 = std::chrono::steady_clock::now();
    tdist::compat::zero_grad(opt, /*set_to_none=*/true);
    auto loss = torch::nn::functional::cross_entropy(model(x), y);
    loss.backward();
    model->clip_grad_norm_(1.0);
    opt.step();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    losses.push_back(loss.item<double>());  // after the clock: reading it is no part of a step
  }
  const std::vector<double> timed(times.begin() + std::min<size_t>(c.warmup, times.size()), times.end());
  auto stats = torch::tensor({median(timed.empty() ? times : timed), vm_kib("VmHWM"), baseline}, torch::kDouble);
  pg->all_reduce(stats, {tdist::ReduceOp::MAX})->wait();  // the slowest rank, the largest peak
  auto per_step = torch::tensor(times, torch::kDouble);
  auto step_loss = torch::tensor(losses, torch::kDouble);  // each step's loss, the mean over ranks
  if (per_step.numel() > 0) {
    pg->all_reduce(per_step, {tdist::ReduceOp::MAX})->wait();
    pg->all_reduce(step_loss, {tdist::ReduceOp::SUM})->wait();
    step_loss.div_(world);
  }
  const auto as_vector = [](const torch::Tensor& t) {
    return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  };
  const double final_loss = losses.empty() ? 0.0 : step_loss[-1].item<double>();

  {
    auto full = model->summon_full_params(/*writeback=*/false);  // collective
    if (rank == 0) {
      ::mkdir(c.out.c_str(), 0755);
      std::ofstream bin(c.out + "/weights.bin", std::ios::binary);
      nlohmann::ordered_json params = nlohmann::ordered_json::array();
      // The plain model's names: the metadata knows them for every wrapped one.
      std::map<std::string, std::string> original;
      for (const auto& u : model->get_shard_metadata().units) {
        for (const auto& q : u.params) original[q.name] = q.original_name;
      }
      int64_t offset = 0;
      for (const auto& p : model->named_parameters()) {
        const auto w = p.value().detach().to(torch::kFloat).contiguous();
        bin.write(reinterpret_cast<const char*>(w.data_ptr<float>()), w.numel() * sizeof(float));
        params.push_back({{"name", original.at(p.key())}, {"shape", w.sizes().vec()}, {"offset", offset},
                          {"numel", w.numel()}});
        offset += w.numel();
      }
      nlohmann::ordered_json r;
      r["impl"] = std::string("tdist FSDP (LibTorch ") + TORCH_VERSION + ", " + pg->backend_name() + ")";
      r["world_size"] = world;
      r["width"] = c.width;
      r["hidden"] = c.hidden;
      r["blocks"] = c.blocks;
      r["batch"] = c.batch;
      r["steps"] = c.steps;
      r["warmup"] = c.warmup;
      r["ms_per_step"] = stats[0].item<double>();
      r["step_ms"] = as_vector(per_step);
      r["step_loss"] = as_vector(step_loss);
      r["peak_rss_mib"] = stats[1].item<double>() / 1024;
      r["baseline_rss_mib"] = stats[2].item<double>() / 1024;
      r["final_loss"] = final_loss;
      r["params"] = params;
      std::ofstream(c.out + "/result.json") << r.dump(1) << "\n";
      if (!bin) throw std::runtime_error("cannot write " + c.out + "/weights.bin");
      std::printf("# %s, world %d, W=%ld H=%ld B=%ld batch %ld, %d steps: %.2f ms/step, peak RSS %.1f MiB, "
                  "final loss %.6f\n", r["impl"].get<std::string>().c_str(), world, static_cast<long>(c.width),
                  static_cast<long>(c.hidden), static_cast<long>(c.blocks), static_cast<long>(c.batch), c.steps,
                  stats[0].item<double>(), stats[1].item<double>() / 1024, final_loss);
    }
  }
  pg->barrier()->wait();
  return 0;
}

// Runs `world` copies of this program (same arguments) as the ranks of a
// local job and waits for them; a rank that fails takes the others down.
int spawn_ranks(int world, char** argv) {
  const uint16_t port = tdist::detail::find_free_port();
  std::vector<pid_t> kids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("tdist-fsdp-compare: fork failed");
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (!std::getenv("OMP_NUM_THREADS")) setenv("OMP_NUM_THREADS", "1", 1);
      execv("/proc/self/exe", argv);
      _exit(127);
    }
    kids.push_back(pid);
  }
  int rc = 0;
  for (size_t left = kids.size(); left > 0;) {
    int st = 0;
    const pid_t k = waitpid(-1, &st, 0);
    if (k < 0) break;
    const auto it = std::find(kids.begin(), kids.end(), k);
    if (it == kids.end()) continue;
    --left;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      if (rc == 0) {
        std::fprintf(stderr, "tdist-fsdp-compare: rank %d %s %d\n", static_cast<int>(it - kids.begin()),
                     WIFEXITED(st) ? "exited with" : "was killed by signal",
                     WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
      }
      rc = 1;
      for (pid_t other : kids) kill(other, SIGTERM);
    }
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  using tdist::cli::both_spellings;
  Config c;
  CLI::App app{"tdist's FSDP on the model and data of bench/torch_fsdp_reference.py", "tdist-fsdp-compare"};
  app.add_option(both_spellings("world-size"), c.world_size, "ranks, started here")->check(tdist::cli::in_range(1, 64))
      ->capture_default_str();
  app.add_option("--backend", c.backend, "shm, gloo, ...")->capture_default_str();
  app.add_option("--width", c.width, "W")->check(tdist::cli::in_range(1, 65536))->capture_default_str();
  app.add_option("--hidden", c.hidden, "H")->check(tdist::cli::in_range(1, 262144))->capture_default_str();
  app.add_option("--blocks", c.blocks, "B")->check(tdist::cli::in_range(0, 1024))->capture_default_str();
  app.add_option("--batch", c.batch, "global rows per step")->check(tdist::cli::in_range(1, 65536))->capture_default_str();
  app.add_option("--steps", c.steps, "training steps")->check(tdist::cli::in_range(0, 1e6))->capture_default_str();
  app.add_option("--warmup", c.warmup, "steps left out of the median")->check(tdist::cli::in_range(0, 1e6))
      ->capture_default_str();
  app.add_option("--out", c.out, "directory for weights.bin and result.json")->required()->type_name("DIR");
  tdist::cli::parse_or_exit(app, argc, argv);
  try {
    if (std::getenv("RANK") && std::getenv("WORLD_SIZE") && std::getenv("MASTER_ADDR")) {
      return run_rank(c, std::atoi(std::getenv("RANK")), std::atoi(std::getenv("WORLD_SIZE")));
    }
    return spawn_ranks(c.world_size, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-fsdp-compare: %s\n", e.what());
    return 1;
  }
}
