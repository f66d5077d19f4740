// Fashion-MNIST with FullyShardedDataParallel: the C++ counterpart of
// torch_xla's test_train_mp_mnist_fsdp_with_ckpt.py.
//
//   build/bin/tdist-run --nproc-per-node 2 build/bin/fsdp_mnist --use-nested-fsdp --use-gradient-checkpointing
//   build/bin/tdist-run --nproc-per-node 2 build/bin/fsdp_mnist --auto-wrap-policy type --sharding grad_op
//       [--epochs 2] [--max-steps N] [--batch-size 64] [--backend auto] [--lr 0.002] [--seed 0]
//       [--data-dir ...] [--json FILE] [--quiet] [--all-ranks]
//       [--checkpoint-dir DIR --checkpoint-every N]  (resumes from the latest checkpoint in DIR by itself)
//
// The network is one torch::nn::Sequential (two convolution stages with
// BatchNorm, two linear layers). --use-nested-fsdp wraps each convolution
// and linear layer in a unit while the network is built (tdist::wrap);
// --auto-wrap-policy size|type lets the outer wrapper pick them (size:
// layers of at least 1000 parameters, which leaves the first convolution
// to the root); --use-gradient-checkpointing puts each inner unit's layer
// in tdist::checkpoint_module (through auto_wrapper_callable; the first
// layer's input needs no gradient, so its checkpoint is skipped). The rest
// is the outer (root) unit's. Adam, the learning rate decayed to 0 on a cosine
// over the run.
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "examples/cli_checks.h"
#include "examples/example_main.h"
#include "examples/fashion_mnist_data.h"
#include "examples/progress.h"
#include "tdist/tdist.h"

namespace {

struct Args {
  int epochs = 2;
  int64_t batch_size = 64;
  int64_t max_steps = 0;  // stop after this many steps (0: all epochs)
  double lr = 2e-3;
  uint64_t seed = 0;
  std::string backend = "auto";
  bool nested = false;
  bool checkpointing = false;
  std::string auto_wrap = "none";
  std::string sharding = "full";
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string json;
  double timeout_s = 120;  // the group's timeout
  examples::ProgressOptions progress;
  examples::CheckpointFlags checkpoint;
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"Fashion-MNIST with FullyShardedDataParallel (torch_xla's MNIST FSDP example in C++).", "fsdp_mnist"};
  app.add_option("--epochs", a.epochs, "passes over the training set")->check(examples::positive())->capture_default_str();
  app.add_option("--batch-size", a.batch_size, "samples per rank per step")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--lr", a.lr, "Adam's peak learning rate (cosine decay over the run)")->check(examples::positive())->capture_default_str();
  app.add_option("--seed", a.seed, "initial weights and shuffles")->capture_default_str();
  app.add_option("--max-steps", a.max_steps, "stop after this many steps (0: all epochs)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  examples::add_backend_flag(app, a.backend);
  examples::add_timeout_flag(app, a.timeout_s);
  app.add_flag("--use-nested-fsdp", a.nested, "wrap every stage in a unit of its own while building");
  app.add_flag("--use-gradient-checkpointing", a.checkpointing, "checkpoint_module inside every inner unit");
  app.add_option("--auto-wrap-policy", a.auto_wrap, "let the outer wrapper pick the units")
      ->check(CLI::IsMember({"none", "size", "type"}))->capture_default_str();
  app.add_option("--sharding", a.sharding)->check(CLI::IsMember({"full", "grad_op", "no"}))->capture_default_str();
  app.add_option("--data-dir", a.data_dir, "Fashion-MNIST's gzipped IDX files (Debian's dataset-fashion-mnist)")->capture_default_str();
  app.add_option("--json", a.json, "rank 0 writes the results here")->type_name("FILE");
  examples::add_progress_flags(app, a.progress);
  examples::add_checkpoint_flags(app, a.checkpoint);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);  // --help: 0; a usage error: 2
  }
  if (a.checkpointing && !a.nested && a.auto_wrap == "none") {
    std::fprintf(stderr, "fsdp_mnist: --use-gradient-checkpointing needs --use-nested-fsdp or --auto-wrap-policy\n");
    std::exit(2);
  }
  if (a.nested && a.auto_wrap != "none") {
    std::fprintf(stderr, "fsdp_mnist: give --use-nested-fsdp or --auto-wrap-policy, not both\n");
    std::exit(2);
  }
  return a;
}

// The network as a new user writes it: one torch::nn::Sequential. With
// wrap_layers, the convolutions and linear layers are built through
// tdist::wrap (nested FSDP, as torch_xla's example wraps conv1, conv2, fc1,
// fc2); BatchNorm and the rest stay with the root unit.
torch::nn::Sequential build(const tdist::FullyShardedDataParallelOptions* wrap_layers) {
  torch::nn::Sequential net;
  auto layer = [&](auto m) {
    if (wrap_layers) {
      net->push_back(tdist::wrap(m, *wrap_layers));
    } else {
      net->push_back(m);
    }
  };
  for (auto [in, out] : {std::pair<int64_t, int64_t>{1, 32}, {32, 64}}) {  // 28x28 -> 14x14 -> 7x7
    layer(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)));
    net->push_back(torch::nn::BatchNorm2d(out));
    net->push_back(torch::nn::ReLU());
    net->push_back(torch::nn::MaxPool2d(2));
  }
  net->push_back(torch::nn::Flatten());
  layer(torch::nn::Linear(64 * 7 * 7, 128));
  net->push_back(torch::nn::ReLU());
  layer(torch::nn::Linear(128, 10));
  return net;
}

// The Sequential as a module with a plain forward (FSDP's holder).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(torch::nn::Sequential s) : stages(register_module("stages", std::move(s))) {}
  torch::Tensor forward(torch::Tensor x) { return stages->forward(x); }
  torch::nn::Sequential stages;
};
TORCH_MODULE(Net);

int train(const Args& a, tdist::ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  const auto t_start = std::chrono::steady_clock::now();
  const examples::FashionMnist data = examples::load_fashion_mnist(a.data_dir);

  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = a.sharding == "full"      ? tdist::ShardingStrategy::FULL_SHARD
                        : a.sharding == "grad_op" ? tdist::ShardingStrategy::SHARD_GRAD_OP
                                                  : tdist::ShardingStrategy::NO_SHARD;
  if (a.checkpointing) {
    o.auto_wrapper_callable = [](torch::nn::AnyModule m, const tdist::FullyShardedDataParallelOptions& c) {
      return torch::nn::AnyModule(tdist::FullyShardedDataParallel(tdist::checkpoint_module(std::move(m)), c));
    };
  }
  tdist::FullyShardedDataParallelOptions root = o;
  if (a.auto_wrap == "size") root.auto_wrap_policy = tdist::size_based_auto_wrap_policy(1000);
  if (a.auto_wrap == "type") {
    root.auto_wrap_policy = tdist::transformer_auto_wrap_policy<torch::nn::Conv2d, torch::nn::Linear>();
  }
  torch::manual_seed(a.seed);
  tdist::FSDP<Net> model(Net(build(a.nested ? &o : nullptr)), root);
  if (rank == 0) std::cout << *model << "\n";
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(a.lr));

  // PyTorch's DistributedSampler with drop_last (fashion_mnist.cpp's).
  tdist::DistributedSampler sampler = examples::drop_last_sampler(data.train_x.size(0), rank, world, a.seed + 1000);
  const int64_t steps_per_epoch = sampler.batches_per_epoch(a.batch_size);
  const int64_t total_steps = a.max_steps > 0 ? std::min(a.max_steps, steps_per_epoch * a.epochs)
                                              : steps_per_epoch * a.epochs;
  // --checkpoint-dir: resume from the latest checkpoint there (the data
  // position from the sampler's state, the learning rate a function of the
  // step), save every --checkpoint-every steps.
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
    ckpt = std::make_unique<tdist::Checkpointer>(tdist::default_group(), *model, &opt, co);
    if (auto r = ckpt->restore()) {
      steps = std::min(examples::resume_data(*r, sampler, a.batch_size, rank, world), total_steps);
    }
  }
  examples::ProgressOptions po = a.progress;
  po.rank = rank;
  examples::Progress bar(po);
  bar.start(total_steps - steps);
  for (int64_t epoch = sampler.epoch(); epoch < a.epochs && steps < total_steps; ++epoch) {
    model->train();
    sampler.set_epoch(epoch);  // keeps a restored position in its epoch
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    int64_t done = 0;
    bar.set_label("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(a.epochs));
    while (steps < total_steps) {
      const std::optional<torch::Tensor> idx = sampler.next(a.batch_size);
      if (!idx) break;
      // Cosine decay over the whole run.
      const double progress = static_cast<double>(steps) / static_cast<double>(steps_per_epoch * a.epochs);
      for (auto& g : opt.param_groups()) {
        static_cast<torch::optim::AdamOptions&>(g.options()).lr(a.lr * 0.5 * (1 + std::cos(M_PI * progress)));
      }
      opt.zero_grad();
      torch::Tensor loss = torch::nn::functional::cross_entropy(model(data.train_x.index_select(0, *idx)),
                                                                data.train_y.index_select(0, *idx));
      loss.backward();
      opt.step();
      const double step_loss = loss.item<double>();
      loss_sum += step_loss;
      ++steps;
      ++done;
      bar.step(idx->size(0) * world, step_loss);
      if (ckpt) ckpt->maybe_save(steps, sampler.state_dict());
    }
    bar.finish();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0 && done > 0) {
      std::printf("epoch %lld/%d: %lld steps, %.1f s, mean loss %.4f\n", static_cast<long long>(epoch + 1), a.epochs,
                  static_cast<long long>(done), secs, loss_sum / static_cast<double>(done));
    }
  }
  if (ckpt) ckpt->wait();
  model->eval();
  // The full weights' fingerprint (collective: every rank gathers).
  const tdist::StateDict full = tdist::full_state_dict(*model);
  std::vector<torch::Tensor> values;
  for (const auto& item : full) values.push_back(item.value());
  const std::string weights = examples::fingerprint(values);
  torch::NoGradGuard no_grad;
  const double accuracy = examples::test_accuracy(data, pg, [&](const torch::Tensor& x) { return model(x); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  if (rank == 0) {
    std::printf("test accuracy %.2f%% after %d epochs (%d ranks, sharding %s, %s%s) in %.1f s\n", 100 * accuracy,
                a.epochs, world, a.sharding.c_str(),
                a.nested ? "nested FSDP" : (a.auto_wrap == "none" ? "one unit" : ("auto wrap by " + a.auto_wrap).c_str()),
                a.checkpointing ? ", gradient checkpointing" : "", seconds);
    if (!a.json.empty()) {
      nlohmann::ordered_json j;
      j["test_accuracy"] = accuracy;
      j["epochs"] = a.epochs;
      j["steps"] = steps;
      j["seconds"] = seconds;
      j["world_size"] = world;
      j["units"] = model->get_shard_metadata().units.size();
      j["weights_fingerprint"] = weights;
      if (!examples::write_json("fsdp_mnist", a.json, j)) return 1;
    }
  }
  pg.barrier()->wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  return examples::run_example("fsdp_mnist", a.backend, [&](tdist::ProcessGroup& pg) { return train(a, pg); },
                               a.timeout_s);
}
