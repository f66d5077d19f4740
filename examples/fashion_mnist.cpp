// Fashion-MNIST with DistributedDataParallel: the main demo.
//
//   build/bin/tdist-run --nproc-per-node 2 build/bin/fashion_mnist [--model mlp|cnn] [--epochs 3]
//       [--batch-size 64] [--lr 0.001] [--seed 0]
//       [--hook allreduce|fp16|bf16|noop|powersgd|batched_powersgd] [--powersgd-rank 1] [--powersgd-start-iter 10]
//       [--backend auto] [--data-dir /usr/share/datasets/fashion-mnist] [--json FILE] [--quiet] [--all-ranks]
//       [--checkpoint-dir DIR --checkpoint-every N]
//
// Reads Debian's dataset-fashion-mnist (gzipped IDX files), shards the
// training set over the ranks with tdist::DistributedSampler (PyTorch's: a
// shuffle shared by all ranks, then every world_size-th sample), and reports
// the test accuracy measured on all ranks' shards of the test set. Adam, with
// the learning rate halved after every epoch. With --checkpoint-dir it saves
// every --checkpoint-every steps and, started again (by tdist-run
// --max-restarts, say), resumes from the latest checkpoint there: at the
// same world size it continues bit for bit as a run that never stopped; at
// another one it continues from the same sample of the same epoch.
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include "examples/cli_checks.h"
#include "examples/example_main.h"
#include "examples/fashion_mnist_data.h"
#include "examples/progress.h"
#include "tdist/tdist.h"

namespace {

struct Args {
  std::string model = "mlp";
  int epochs = 4;
  int64_t batch_size = 64;
  double lr = 1e-3;
  uint64_t seed = 0;
  std::string hook = "allreduce";
  std::string backend = "auto";
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string json;
  int64_t powersgd_rank = 1;
  int64_t powersgd_start_iter = 10;
  int64_t max_steps = 0;     // stop after this many steps (0: all epochs)
  int64_t warmup_steps = 0;  // steps left out of ms_per_step
  double timeout_s = 120;  // the group's timeout
  examples::ProgressOptions progress;
  examples::CheckpointFlags checkpoint;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "fashion_mnist: %s\nRun with --help for the options.\n", why.c_str());
  std::exit(2);
}

// The command line (CLI11): the same options on every rank.
Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"Fashion-MNIST with DistributedDataParallel, on every rank of a tdist-run job (alone: a world of one).",
               "fashion_mnist"};
  app.add_option("--model", a.model, "the network")->check(CLI::IsMember({"mlp", "cnn"}))->capture_default_str();
  app.add_option("--epochs", a.epochs, "passes over the training set")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--batch-size", a.batch_size, "samples per rank per step")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--lr", a.lr, "Adam's learning rate (halved after every epoch)")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--seed", a.seed, "initial weights and shuffles")->capture_default_str();
  app.add_option("--hook", a.hook, "DDP communication hook")
      ->check(CLI::IsMember({"allreduce", "fp16", "bf16", "noop", "powersgd", "batched_powersgd"}))
      ->capture_default_str();
  app.add_option("--powersgd-rank", a.powersgd_rank, "PowerSGD's matrix_approximation_rank")->capture_default_str();
  app.add_option("--powersgd-start-iter", a.powersgd_start_iter, "PowerSGD's start_powerSGD_iter")
      ->capture_default_str();
  app.add_option("--max-steps", a.max_steps, "stop after this many steps (0: all epochs)")->capture_default_str();
  app.add_option("--warmup-steps", a.warmup_steps, "steps left out of ms_per_step")->capture_default_str();
  examples::add_backend_flag(app, a.backend);
  examples::add_timeout_flag(app, a.timeout_s);
  app.add_option("--data-dir", a.data_dir, "the gzipped IDX files (Debian's dataset-fashion-mnist)")
      ->capture_default_str();
  app.add_option("--json", a.json, "rank 0 writes the results here")->type_name("FILE");
  examples::add_progress_flags(app, a.progress);
  examples::add_checkpoint_flags(app, a.checkpoint);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::CallForAllHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::ParseError& e) {
    usage(e.what());
  }
  if (a.checkpoint.every > 0 && a.checkpoint.dir.empty()) usage("--checkpoint-every needs --checkpoint-dir");
  return a;
}

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(784, 1024));
    fc2 = register_module("fc2", torch::nn::Linear(1024, 1024));
    fc3 = register_module("fc3", torch::nn::Linear(1024, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x.flatten(1);
    return fc3->forward(torch::relu(fc2->forward(torch::relu(fc1->forward(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

struct CnnImpl : torch::nn::Module {
  CnnImpl() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(c1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(c2->forward(x)), 2);
    return fc2->forward(torch::relu(fc1->forward(x.flatten(1))));
  }
  torch::nn::Conv2d c1{nullptr}, c2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Cnn);

template <typename Net>
int train(const Args& a, tdist::ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  const auto t_start = std::chrono::steady_clock::now();
  const examples::FashionMnist data = examples::load_fashion_mnist(a.data_dir);
  const torch::Tensor& train_x = data.train_x;
  const torch::Tensor& train_y = data.train_y;

  torch::manual_seed(a.seed);
  Net net;
  tdist::DistributedDataParallel<Net> ddp(net);
  auto group = tdist::default_group();
  if (a.hook == "fp16") ddp->register_comm_hook(group, tdist::fp16_compress_hook);
  else if (a.hook == "bf16") ddp->register_comm_hook(group, tdist::bf16_compress_hook);
  else if (a.hook == "noop") ddp->register_comm_hook(group, tdist::noop_hook);
  std::shared_ptr<tdist::PowerSGDState> powersgd;
  if (a.hook == "powersgd" || a.hook == "batched_powersgd") {
    tdist::PowerSGDOptions o;
    o.matrix_approximation_rank = a.powersgd_rank;
    o.start_powerSGD_iter = a.powersgd_start_iter;
    powersgd = std::make_shared<tdist::PowerSGDState>(group, o);
    ddp->register_comm_hook(powersgd, a.hook == "powersgd" ? tdist::powerSGD_hook : tdist::batched_powerSGD_hook);
  }  // --hook is one of the names checked in parse()
  torch::optim::Adam opt(ddp->parameters(), torch::optim::AdamOptions(a.lr));

  // PyTorch's DistributedSampler with drop_last: each epoch a new shuffle,
  // the same on every rank, every world-size-th sample for this rank.
  tdist::DistributedSampler sampler = examples::drop_last_sampler(train_x.size(0), rank, world, a.seed + 1000);
  const int64_t steps_per_epoch = sampler.batches_per_epoch(a.batch_size);
  const int64_t total_steps = a.max_steps > 0 ? std::min(a.max_steps, steps_per_epoch * a.epochs)
                                              : steps_per_epoch * a.epochs;
  // Where training stands: steps of this world size; the sampler keeps the
  // data position (in samples, what a resume at another world size goes by).
  int64_t steps = 0;
  std::unique_ptr<tdist::Checkpointer> ckpt;
  if (!a.checkpoint.dir.empty()) {
    tdist::CheckpointerOptions co;
    co.dir = a.checkpoint.dir;
    co.every_steps = a.checkpoint.every;
    // A save's collectives wait no longer than training's (--timeout): a
    // rank cut off while a save is in flight fails in time, not after the
    // files' own default of 5 minutes.
    co.files.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
    co.files.comm_hook_state = powersgd;
    ckpt = std::make_unique<tdist::Checkpointer>(group, *ddp, &opt, co);
    if (auto r = ckpt->restore()) steps = examples::resume_data(*r, sampler, a.batch_size, rank, world);
  }
  auto timed_from = std::chrono::steady_clock::now();
  examples::ProgressOptions po = a.progress;
  po.rank = rank;
  examples::Progress progress(po);
  progress.start(total_steps - std::min(steps, total_steps));
  for (int64_t epoch = sampler.epoch(); epoch < a.epochs && steps < total_steps; ++epoch) {
    ddp->train();
    sampler.set_epoch(epoch);  // keeps a restored position in its epoch
    // Halve the learning rate after every epoch (lr / 2^epoch, exactly).
    const double lr = std::ldexp(a.lr, -static_cast<int>(epoch));  // epoch < a.epochs, an int
    for (auto& group : opt.param_groups()) static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    int64_t done = 0;
    progress.set_label("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(a.epochs));
    while (steps < total_steps) {
      const std::optional<torch::Tensor> idx = sampler.next(a.batch_size);
      if (!idx) break;
      opt.zero_grad();
      torch::Tensor loss = torch::nn::functional::cross_entropy(ddp->forward(train_x.index_select(0, *idx)),
                                                       train_y.index_select(0, *idx));
      loss.backward();
      opt.step();
      const double step_loss = loss.item<double>();
      loss_sum += step_loss;
      ++steps;
      ++done;
      progress.step(idx->size(0) * world, step_loss);
      if (steps == a.warmup_steps) timed_from = std::chrono::steady_clock::now();
      if (ckpt) ckpt->maybe_save(steps, sampler.state_dict());
    }
    progress.finish();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0 && done > 0) {
      std::printf("epoch %lld/%d: %lld steps, %.1f s, %.0f samples/s, mean loss %.4f\n",
                  static_cast<long long>(epoch + 1), a.epochs, static_cast<long long>(done), secs,
                  done * a.batch_size * world / secs, loss_sum / done);
    }
  }
  if (ckpt) ckpt->wait();
  const double train_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - timed_from).count();
  const int64_t timed_steps = steps - std::min(steps, a.warmup_steps);

  // Test accuracy over every rank's shard of the test set.
  ddp->eval();
  torch::NoGradGuard no_grad;
  const double accuracy = examples::test_accuracy(data, pg, [&](const torch::Tensor& x) { return net->forward(x); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  if (rank == 0) {
    std::printf("test accuracy %.2f%% after %d epochs (%lld steps per rank, %d ranks, hook %s, %s backend) in %.1f s\n",
                100 * accuracy, a.epochs, static_cast<long long>(steps), world, a.hook.c_str(),
                pg.backend_name().c_str(), seconds);
    // What this rank handed to all-reduce for the gradients.
    int64_t grad_bytes = 0;
    for (const auto& p : net->parameters()) grad_bytes += p.numel() * static_cast<int64_t>(p.element_size());
    int64_t bytes = grad_bytes * steps;
    double rate = 1, step_bytes = static_cast<double>(grad_bytes);  // per step once compression runs
    if (powersgd) {
      const auto st = powersgd->compression_stats();
      bytes = st.bytes_communicated;
      rate = st.compression_rate;
      step_bytes = static_cast<double>(st.bytes_after) / std::max<int64_t>(1, steps - a.powersgd_start_iter);
    } else if (a.hook == "fp16" || a.hook == "bf16") {
      bytes /= 2;
      step_bytes /= 2;
      rate = 2;
    } else if (a.hook == "noop") {
      bytes = 0;
      step_bytes = 0;
      rate = 0;
    }
    if (powersgd) {
      std::printf("PowerSGD: compression rate %.1f, %.0f bytes per step once compressing (all-reduce: %lld)\n", rate,
                  step_bytes, static_cast<long long>(grad_bytes));
    }
    if (!a.json.empty()) {
      nlohmann::ordered_json j;
      j["test_accuracy"] = accuracy;
      j["epochs"] = a.epochs;
      j["steps"] = steps;
      j["seconds"] = seconds;
      j["ms_per_step"] = 1000 * train_seconds / std::max<int64_t>(1, timed_steps);
      j["world_size"] = world;
      j["hook"] = a.hook;
      j["bytes_communicated"] = bytes;
      j["bytes_per_step"] = step_bytes;
      j["compression_rate"] = rate;
      j["weights_fingerprint"] = examples::fingerprint(net->parameters());
      if (!examples::write_json("fashion_mnist", a.json, j)) return 1;
    }
  }
  pg.barrier()->wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  return examples::run_example("fashion_mnist", a.backend, [&](tdist::ProcessGroup& pg) { return a.model == "mlp" ? train<Mlp>(a, pg) : train<Cnn>(a, pg); },
                               a.timeout_s);
}
