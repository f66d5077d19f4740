// A user's program against the installed tdist: a few DDP steps on every
// rank of the job (tdist-run --nproc-per-node 2 consumer [backend]), then
// a check that every rank ends with the same weights.
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include <cstdio>
#include <string>

#include "tdist/tdist.h"

int main(int argc, char** argv) {
  tdist::InitOptions init;
  if (argc > 1) init.backend = argv[1];
  auto world = tdist::init_process_group(init);

  torch::manual_seed(world->rank());  // different on every rank: DDP broadcasts rank 0's
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));
  tdist::DistributedDataParallel<torch::nn::Sequential> ddp(net);
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    torch::Tensor x = torch::randn({4, 8});  // each rank its own batch
    ddp->forward(x).pow(2).mean().backward();
    opt.step();
  }

  // Every rank's weights, summed into one number, then compared across ranks.
  torch::Tensor sum = torch::zeros({1}, torch::kDouble);
  for (const auto& p : ddp->parameters()) sum += p.detach().to(torch::kDouble).sum();
  torch::Tensor lo = sum.clone(), hi = sum.clone();
  world->all_reduce(lo, {tdist::ReduceOp::MIN})->wait();
  world->all_reduce(hi, {tdist::ReduceOp::MAX})->wait();
  const bool same = lo.item<double>() == hi.item<double>();
  std::printf("consumer %s: rank %d of %d, backend %s, tdist %s, LibTorch %s (headers %s), weights %.9g\n",
              same ? "ok" : "FAILED", world->rank(), world->size(), world->backend_name().c_str(),
              tdist::version().c_str(), tdist::torch_version().c_str(), TORCH_VERSION, sum.item<double>());
  tdist::destroy_process_group();
  return same ? 0 : 1;
}
