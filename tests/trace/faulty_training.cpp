// A small training loop as a new user writes one (a model, DDP, an
// optimizer, a data loader, the loss averaged for the log), with faults to
// inject, for the flight recorder's end-to-end tests:
//
//   tdist-run --nproc-per-node 3 faulty_training [--steps 40] [--timeout-s 60]
//       [--skip-rank R --skip-step K]    rank R skips the loss all_reduce at step K
//                                        (its loss "looked wrong": a data-dependent branch)
//       [--sleep-rank R --sleep-step K --sleep-s S]   rank R's data loader hangs S s at step K
//       [--default-sigusr1-rank R]       rank R sets SIGUSR1 back to its default after init
//
// Not a tdist example: it does what the tests need, the way a user would.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "tdist/tdist.h"

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() : fc1(register_module("fc1", torch::nn::Linear(32, 64))), fc2(register_module("fc2", torch::nn::Linear(64, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

// A "data loader": random batches; a fault may make it hang.
struct Loader {
  int rank = 0, sleep_rank = -1, sleep_step = -1;
  double sleep_s = 0;
  std::pair<torch::Tensor, torch::Tensor> next(int step) {
    if (rank == sleep_rank && step == sleep_step) {
      std::fprintf(stderr, "rank %d: data loader stuck at step %d\n", rank, step);
      std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
    }
    auto x = torch::randn({16, 32});
    return {x, x.sum(1, true) * 0.1};
  }
};

}  // namespace

int main(int argc, char** argv) {
  int steps = 40, skip_rank = -1, skip_step = -1, default_sigusr1_rank = -1;
  double timeout_s = 60;
  Loader loader;
  CLI::App app{"A training loop with faults to inject.", "faulty_training"};
  app.add_option("--steps", steps);
  app.add_option("--timeout-s", timeout_s);
  app.add_option("--skip-rank", skip_rank);
  app.add_option("--skip-step", skip_step);
  app.add_option("--sleep-rank", loader.sleep_rank);
  app.add_option("--sleep-step", loader.sleep_step);
  app.add_option("--sleep-s", loader.sleep_s);
  app.add_option("--default-sigusr1-rank", default_sigusr1_rank);
  CLI11_PARSE(app, argc, argv);

  tdist::InitOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  auto pg = tdist::init_process_group(o);
  const int rank = pg->rank();
  loader.rank = rank;
  if (rank == default_sigusr1_rank) signal(SIGUSR1, SIG_DFL);  // as a library might
  torch::manual_seed(rank);

  Net net;
  tdist::DistributedDataParallel<Net> model(net);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = loader.next(step);
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    opt.step();
    // Average the loss for the log, unless this rank thinks it is bad.
    const bool looks_bad = rank == skip_rank && step == skip_step;
    if (!looks_bad) {
      auto l = loss.detach().clone();
      pg->all_reduce(l, {tdist::ReduceOp::AVG})->wait();
      if (rank == 0 && step % 10 == 0) std::printf("step %d loss %.4f\n", step, l.item<float>());
    }
  }
  pg->barrier()->wait();
  if (rank == 0) std::printf("done\n");
  return 0;
}
