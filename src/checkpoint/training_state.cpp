// A rank's training state file: the contract and layout are in
// training_state.h.
#include "checkpoint/training_state.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <mutex>

#include "formats/pt_file.h"
#include "tdist/errors.h"

namespace tdist::detail {

namespace {

using checkpoint::PtReader;
using checkpoint::PtValue;
using checkpoint::PtWriter;

int cuda_devices() { return at::hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0; }

at::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

}  // namespace

TrainingStateFile build_training_state(int64_t step, int rank, int world_size,
                                       const std::map<std::string, at::Tensor>& extras,
                                       checkpoint::CopyPool* copies) {
  TrainingStateFile file{checkpoint::TensorSink(copies), PtValue()};
  std::vector<PtValue> cuda;
  for (int d = 0; d < cuda_devices(); ++d) {
    cuda.push_back(file.sink.add(generator_state(at::globalContext().defaultGenerator(at::Device(at::kCUDA, d)))));
  }
  std::vector<std::pair<std::string, PtValue>> user;
  for (const auto& [name, t] : extras) {
    if (!t.defined()) throw UsageError("Checkpointer: extra '" + name + "' is an undefined tensor");
    user.emplace_back(name, file.sink.add(t.detach()));
  }
  file.root = PtValue::dict(
      {{"step", PtValue::integer(step)},
       {"world_size", PtValue::integer(world_size)},
       {"rank", PtValue::integer(rank)},
       {"rng_cpu", file.sink.add(generator_state(at::detail::getDefaultCPUGenerator()))},
       {"rng_cuda", PtValue::list(std::move(cuda))},
       {"extras", PtValue::dict(std::move(user))},
       {"tdist", PtValue::dict({{"format", PtValue::integer(checkpoint::kFormatVersion)},
                                {"kind", PtValue::string("train_state")}})}});
  return file;
}

void write_training_state(const std::string& path, TrainingStateFile& file) {
  PtWriter writer(path);
  file.sink.write(writer, file.root);
  writer.finish();
}

TrainingState read_training_state(const std::string& path, int64_t step) {
  PtReader reader(path);
  const PtValue& root = reader.root();
  auto bad = [&](const std::string& why) { return CheckpointError("Checkpointer: " + path + ": " + why); };
  const PtValue* tag = root.find("tdist");
  const PtValue* kind = tag ? tag->find("kind") : nullptr;
  if (!kind || kind->as_string() != "train_state") throw bad("not a tdist training state");
  TrainingState out;
  out.step = root.at("step").as_int();
  if (out.step != step) {
    throw bad("holds step " + std::to_string(out.step) + ", its folder says " + std::to_string(step));
  }
  // A generator state is checked here, on every rank before they agree,
  // against this build's own: set_state must not fail on one rank later.
  auto rng = [&](const PtValue& v, at::Generator current, const std::string& which) {
    at::Tensor t = reader.read_tensor(v.as_tensor());
    const at::Tensor now = generator_state(std::move(current));
    if (t.scalar_type() != at::kByte || t.dim() != 1 || t.numel() != now.numel()) {
      throw bad(which + " is a " + std::string(c10::toString(t.scalar_type())) + " tensor of " +
                std::to_string(t.numel()) + " elements, not this LibTorch's " + std::to_string(now.numel()) +
                "-byte generator state");
    }
    return t;
  };
  out.rng_cpu = rng(root.at("rng_cpu"), at::detail::getDefaultCPUGenerator(), "rng_cpu");
  const auto& cuda = root.at("rng_cuda").items();
  for (size_t d = 0; d < cuda.size() && static_cast<int>(d) < cuda_devices(); ++d) {
    out.rng_cuda.push_back(rng(cuda[d], at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<int>(d))),
                               "rng_cuda[" + std::to_string(d) + "]"));
  }
  for (const auto& [name, v] : root.at("extras").entries()) out.extras[name] = reader.read_tensor(v.as_tensor());
  return out;
}

void restore_rng(const TrainingState& state) {
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.rng_cpu);
  }
  const int devices = cuda_devices();
  for (int d = 0; d < devices && d < static_cast<int>(state.rng_cuda.size()); ++d) {
    at::Generator gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, d));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.rng_cuda[static_cast<size_t>(d)]);
  }
}

}  // namespace tdist::detail
