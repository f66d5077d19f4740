// A module whose parameters are on two devices (the CPU and "meta", which
// every build has): what DDP and FSDP must refuse by name.
#pragma once

#include <torch/torch.h>

namespace tdist::test {

struct TwoDevicesImpl : torch::nn::Module {
  TwoDevicesImpl() {
    a = register_parameter("a", torch::ones({4}));
    b = register_parameter("b", torch::empty({4}, torch::TensorOptions().device(torch::kMeta)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * a; }
  torch::Tensor a, b;
};
TORCH_MODULE(TwoDevices);

}  // namespace tdist::test
