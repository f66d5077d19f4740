// The C++ API's side of c_header_train.c: the same model, values, batches
// and steps with tdist::DistributedDataParallel and tdist::FSDP (a unit per
// layer and the root) and torch::optim::SGD; then the C program's weights
// (DIR/c-{ddp,fsdp}-rank-R.bin) must equal these bit for bit.
// Usage: tdist-run --nproc-per-node N c_header_reference DIR
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "tdist/tdist.h"

namespace {

int rank = -1;

struct NetImpl : torch::nn::Module {
  NetImpl(torch::nn::AnyModule a, torch::nn::AnyModule b) : fc1(std::move(a)), fc2(std::move(b)) {
    register_module("fc1", fc1.ptr());
    register_module("fc2", fc2.ptr());
  }
  at::Tensor forward(const at::Tensor& x) { return fc2.forward(torch::relu(fc1.forward(x))); }
  torch::nn::AnyModule fc1, fc2;
};
TORCH_MODULE(Net);

// The C program's formula, element by element.
at::Tensor formula(int i, at::IntArrayRef shape) {
  at::Tensor t = at::empty(shape, at::kFloat);
  float* v = t.data_ptr<float>();
  for (int64_t j = 0; j < t.numel(); ++j) v[j] = static_cast<float>(0.3 * std::sin(0.7 * static_cast<double>(j) + 1.3 * i + rank));
  return t;
}

torch::nn::Linear layer(int64_t in, int64_t out, int first) {
  torch::nn::Linear l(in, out);
  torch::NoGradGuard g;
  l->weight.copy_(formula(first, {out, in}));
  l->bias.copy_(formula(first + 1, {out}));
  return l;
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  at::Tensor x = at::empty({4, 6}, at::kFloat), y = at::empty({4, 3}, at::kFloat);
  for (int k = 0; k < 24; ++k) x.data_ptr<float>()[k] = static_cast<float>(std::cos(0.1 * k + step + 0.5 * rank));
  for (int k = 0; k < 12; ++k) y.data_ptr<float>()[k] = static_cast<float>(std::sin(0.2 * k - step + rank));
  return {x, y};
}

template <typename Model>
void train(Model& model) {
  torch::optim::SGD opt(model->parameters(), 0.1);
  for (int s = 0; s < 5; ++s) {
    auto [x, y] = batch(s);
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
    opt.zero_grad();
  }
}

bool same(const std::string& path, const std::vector<at::Tensor>& want, const char* kind) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "rank %d: cannot read %s\n", rank, path.c_str());
    return false;
  }
  const char* names[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  bool all = true;
  for (size_t i = 0; i < want.size(); ++i) {
    at::Tensor got = at::empty(want[i].sizes(), at::kFloat);
    f.read(reinterpret_cast<char*>(got.data_ptr<float>()), static_cast<std::streamsize>(got.nbytes()));
    if (!f || !at::equal(got, want[i].contiguous())) {
      std::fprintf(stderr, "rank %d: %s: %s differs from the C++ API's\n", rank, kind, names[i]);
      all = false;
    }
  }
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: c_header_reference DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  auto pg = tdist::init_process_group();
  rank = pg->rank();
  std::vector<at::Tensor> ddp_w, fsdp_w;
  {
    tdist::DistributedDataParallel<Net> ddp{Net(torch::nn::AnyModule(layer(6, 8, 0)), torch::nn::AnyModule(layer(8, 3, 2)))};
    train(ddp);
    for (const auto& p : ddp->module()->parameters()) ddp_w.push_back(p.detach().clone());
  }
  {
    tdist::FullyShardedDataParallelOptions o;
    tdist::FSDP<Net> model(Net(torch::nn::AnyModule(tdist::FSDP<torch::nn::Linear>(layer(6, 8, 0), o)),
                               torch::nn::AnyModule(tdist::FSDP<torch::nn::Linear>(layer(8, 3, 2), o))),
                           o);
    train(model);
    auto full = tdist::full_state_dict(*model, /*rank0_only=*/false);
    for (const char* n : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) fsdp_w.push_back(full[n]);
  }
  const std::string suffix = "-rank-" + std::to_string(rank) + ".bin";
  const bool ok = same(dir + "/c-ddp" + suffix, ddp_w, "ddp") & same(dir + "/c-fsdp" + suffix, fsdp_w, "fsdp");
  tdist::destroy_process_group();
  if (!ok) return 1;
  std::printf("rank %d: the C program's DDP and FSDP weights equal the C++ API's bit for bit\n", rank);
  return 0;
}
