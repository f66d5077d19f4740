// A small Vision Transformer on Fashion-MNIST with FullyShardedDataParallel:
// every transformer block auto-wrapped by type, auto_wrapper_callable adding
// activation checkpointing, bf16 mixed precision.
//
//   build/bin/tdist-run --nproc-per-node 2 build/bin/fsdp_vit [--epochs 2] [--depth 4] [--dim 64]
//       [--precision bf16|fp32] [--no-checkpointing] [--build-wrapped] [--max-steps N] [--json FILE] [--quiet] [--all-ranks]
//
// --build-wrapped builds each block already wrapped (tdist::wrap) while the
// model is constructed, as seed 004's 10 B ViT does so that the whole model
// never exists unsharded; without it the outer wrapper's
// transformer_auto_wrap_policy<VitBlock> picks the blocks. The output shows
// each unit, a progress bar, the test accuracy, and per rank the peak bytes
// of the process (VmHWM) and its ms per step.
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
#include "examples/vit_model.h"
#include "tdist/tdist.h"

namespace {

struct Args {
  int epochs = 2;
  int64_t batch_size = 64;
  double lr = 1e-3;
  uint64_t seed = 0;
  std::string backend = "auto";
  int64_t depth = 4;
  int64_t dim = 64;
  int64_t heads = 4;
  std::string precision = "bf16";
  bool no_checkpointing = false;
  bool build_wrapped = false;
  int64_t max_steps = 0;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string json;
  examples::ProgressOptions progress;
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"A small ViT on Fashion-MNIST with FSDP auto wrapping, checkpointing and bf16.", "fsdp_vit"};
  app.add_option("--epochs", a.epochs, "passes over the training set")->check(examples::positive())->capture_default_str();
  app.add_option("--batch-size", a.batch_size, "samples per rank per step")->check(examples::positive())->capture_default_str();
  app.add_option("--lr", a.lr, "AdamW's peak learning rate (cosine decay over the run)")->check(examples::positive())->capture_default_str();
  app.add_option("--seed", a.seed, "initial weights and shuffles")->capture_default_str();
  examples::add_backend_flag(app, a.backend);
  app.add_option("--depth", a.depth, "transformer blocks")->check(examples::positive())->capture_default_str();
  app.add_option("--dim", a.dim, "embedding width")->check(examples::positive())->capture_default_str();
  app.add_option("--heads", a.heads, "attention heads")->check(examples::positive())->capture_default_str();
  app.add_option("--precision", a.precision)->check(CLI::IsMember({"bf16", "fp32"}))->capture_default_str();
  app.add_flag("--no-checkpointing", a.no_checkpointing, "keep the blocks' activations");
  app.add_flag("--build-wrapped", a.build_wrapped, "wrap each block while the model is built");
  app.add_option("--max-steps", a.max_steps, "stop after this many steps (0: all epochs)")->capture_default_str();
  app.add_option("--data-dir", a.data_dir, "Fashion-MNIST's gzipped IDX files (Debian's dataset-fashion-mnist)")->capture_default_str();
  app.add_option("--json", a.json, "rank 0 writes the results here")->type_name("FILE");
  examples::add_progress_flags(app, a.progress);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);  // --help: 0; a usage error: 2
  }
  if (a.dim % a.heads != 0) {
    std::fprintf(stderr, "fsdp_vit: --dim must be a multiple of --heads\n");
    std::exit(2);
  }
  return a;
}



int train(const Args& a, tdist::ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  const auto t_start = std::chrono::steady_clock::now();
  const examples::FashionMnist data = examples::load_fashion_mnist(a.data_dir);

  tdist::FullyShardedDataParallelOptions o;
  if (a.precision == "bf16") o.mixed_precision.param_dtype = at::kBFloat16;
  if (!a.no_checkpointing) {
    o.auto_wrapper_callable = [](torch::nn::AnyModule m, const tdist::FullyShardedDataParallelOptions& c) {
      return torch::nn::AnyModule(tdist::FullyShardedDataParallel(tdist::checkpoint_module(std::move(m)), c));
    };
  }
  tdist::FullyShardedDataParallelOptions root = o;
  if (!a.build_wrapped) root.auto_wrap_policy = tdist::transformer_auto_wrap_policy<examples::VitBlock>();
  examples::VitImpl::MakeBlock make_block;
  if (a.build_wrapped) {
    make_block = [&o](const examples::VitConfig& c) { return tdist::wrap(examples::VitBlock(c), o); };
  }
  torch::manual_seed(a.seed);
  const int64_t rss0 = examples::proc_status_bytes("VmRSS");
  tdist::FSDP<examples::Vit> model(examples::Vit(examples::VitConfig{a.depth, a.dim, a.heads}, make_block), root);
  if (rank == 0) std::cout << *model << "\n";
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(a.lr).weight_decay(0.01));

  // PyTorch's DistributedSampler with drop_last (fashion_mnist.cpp's).
  tdist::DistributedSampler sampler = examples::drop_last_sampler(data.train_x.size(0), rank, world, a.seed + 1000);
  const int64_t steps_per_epoch = sampler.batches_per_epoch(a.batch_size);
  int64_t steps = 0;
  double train_seconds = 0;
  examples::ProgressOptions po = a.progress;
  po.rank = rank;
  examples::Progress bar(po);
  bar.start(a.max_steps > 0 ? std::min(a.max_steps, steps_per_epoch * a.epochs) : steps_per_epoch * a.epochs);
  for (int epoch = 0; epoch < a.epochs && (a.max_steps == 0 || steps < a.max_steps); ++epoch) {
    model->train();
    sampler.set_epoch(epoch);
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    bar.set_label("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(a.epochs));
    int64_t s = 0;
    for (; a.max_steps == 0 || steps < a.max_steps; ++s) {
      const std::optional<torch::Tensor> idx = sampler.next(a.batch_size);
      if (!idx) break;
      // Cosine decay over the whole run.
      const double progress = static_cast<double>(steps) / (steps_per_epoch * a.epochs);
      for (auto& g : opt.param_groups()) {
        static_cast<torch::optim::AdamWOptions&>(g.options()).lr(a.lr * 0.5 * (1 + std::cos(M_PI * progress)));
      }
      opt.zero_grad();
      torch::Tensor loss = torch::nn::functional::cross_entropy(
          model(data.train_x.index_select(0, *idx)).to(torch::kFloat), data.train_y.index_select(0, *idx));
      loss.backward();
      opt.step();
      const double step_loss = loss.item<double>();
      loss_sum += step_loss;
      ++steps;
      bar.step(idx->size(0) * world, step_loss);
    }
    bar.finish();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    train_seconds += secs;
    if (rank == 0) {
      std::printf("epoch %d/%d: %lld steps, %.1f s, mean loss %.4f\n", epoch + 1, a.epochs,
                  static_cast<long long>(s), secs, loss_sum / std::max<int64_t>(s, 1));
    }
  }
  model->eval();
  torch::NoGradGuard no_grad;
  const double accuracy = examples::test_accuracy(data, pg, [&](const torch::Tensor& x) { return model(x); });
  // Per rank: peak bytes of the process over its size before the model.
  torch::Tensor mem = torch::zeros({world}, torch::kDouble);
  mem[rank] = static_cast<double>(examples::proc_status_bytes("VmHWM") - rss0);
  pg.all_reduce(mem)->wait();
  const double ms_per_step = 1000 * train_seconds / std::max<int64_t>(steps, 1);
  if (rank == 0) {
    std::printf("test accuracy %.2f%% after %lld steps (%d ranks, %s, %s) in %.1f s, %.1f ms/step\n", 100 * accuracy,
                static_cast<long long>(steps), world, a.precision.c_str(),
                a.no_checkpointing ? "no checkpointing" : "activation checkpointing",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(), ms_per_step);
    for (int r = 0; r < world; ++r) std::printf("rank %d: peak %.1f MiB above the start\n", r, mem[r].item<double>() / (1 << 20));
    if (!a.json.empty()) {
      nlohmann::ordered_json j;
      j["test_accuracy"] = accuracy;
      j["steps"] = steps;
      j["ms_per_step"] = ms_per_step;
      j["precision"] = a.precision;
      j["checkpointing"] = !a.no_checkpointing;
      j["units"] = model->get_shard_metadata().units.size();
      j["peak_bytes"] = std::vector<double>(mem.data_ptr<double>(), mem.data_ptr<double>() + world);
      if (!examples::write_json("fsdp_vit", a.json, j)) return 1;
    }
  }
  pg.barrier()->wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  return examples::run_example("fsdp_vit", a.backend, [&](tdist::ProcessGroup& pg) { return train(a, pg); });
}
