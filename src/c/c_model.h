// The C ABI's model (src/c/): the binding's tensors as a torch::nn::Module
// tree, and the DDP and FSDP wrappers whose forward the binding runs
// itself, between their pre- and post-forward calls.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "c/c_core.h"
#include "tdist/ddp.h"
#include "tdist/fsdp.h"
#include "tdist/join.h"

namespace tdist::c {

// The binding's model. root is the tree the names describe; top is what
// state dicts, checkpoints and clipping see: root, or the wrapper made
// around it (DDP, the root's FSDP unit).
struct Model {
  std::shared_ptr<torch::nn::Module> root;
  std::shared_ptr<torch::nn::Module> top;
  torch::nn::Module& module() const { return *top; }
};

// DistributedDataParallel with the forward split in two (ddp.h's
// DistributedDataParallelImpl does the same around a typed forward).
class DdpWrapper : public torch::nn::Module,
                   public detail::WrapperModule,
                   public detail::DataParallelModule,
                   public Joinable {
 public:
  DdpWrapper(std::shared_ptr<torch::nn::Module> module, DistributedDataParallelOptions options);
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  detail::DataParallel& data_parallel() override { return core_; }
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override { return core_.join_hook(options); }
  std::shared_ptr<ProcessGroup> join_process_group() override { return core_.process_group(); }
  c10::Device join_device() override { return core_.device(); }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  detail::DataParallel core_;
};

// One FSDP unit over a submodule of the binding's tree (fsdp.h's
// FullyShardedBase, with the forward split in two).
class FsdpUnit : public torch::nn::Module, public detail::FullyShardedModule, public Joinable {
 public:
  FsdpUnit(std::shared_ptr<torch::nn::Module> module, FullyShardedDataParallelOptions options);
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  void abort_forward() noexcept {
    in_forward_ = false;
    core_.abort_forward();
  }
  detail::FullyShardedCore& fsdp_core() override { return core_; }
  void set_join_step(std::function<void()> step) { join_step_ = std::move(step); }
  std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) override;
  std::shared_ptr<ProcessGroup> join_process_group() override { return core_.world_process_group(); }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  detail::FullyShardedCore core_;
  std::function<void()> join_step_;
  bool in_forward_ = false;
};

// The binding's module tree (c_model.cpp).
using ModulePtr = std::shared_ptr<torch::nn::Module>;
// "a.b.c" as its steps; a usage error for an empty step.
std::vector<std::string> split_path(const std::string& path);
// The module a wrapper (DDP, an FSDP unit) stands for.
ModulePtr unwrap(ModulePtr m);
// The child `name` of node (through its wrapper), or null.
ModulePtr child_of(const ModulePtr& node, const std::string& name);
// Registers the binding's tensors under their dotted names.
void add_tensors(Model& model, const char* const* ns, const tdist_tensor* ts, size_t n, bool buffers);
Model& model_of(tdist_module* m);
void require_unwrapped(const Model& model, const char* what);

// The caller's options struct (checked to be this header's), or the
// defaults its init function sets.
template <typename O>
O given_or_default(const O* o, void (*init)(O*), const char* what) {
  if (!o) {
    O d;
    init(&d);
    return d;
  }
  if (o->struct_size != sizeof(O)) {
    usage(std::string(what) + ".struct_size is " + std::to_string(o->struct_size) + ", this tdist's is " +
          std::to_string(sizeof(O)) + " (call " + what + "_init; rebuild the binding against this header)");
  }
  return *o;
}

}  // namespace tdist::c

struct tdist_ddp {
  std::shared_ptr<tdist::c::Model> model;
  std::shared_ptr<tdist::c::DdpWrapper> ddp;
};
struct tdist_fsdp {
  std::shared_ptr<tdist::c::Model> model;
  std::shared_ptr<tdist::c::FsdpUnit> unit;
};
