// DeferredRecord: the operations deferred_init saw, and their replay.
//
// Each recorded operation keeps its arguments as they were called (meta
// tensors, the device asked for, the generator as it stood) and its
// outputs (meta tensors). Tensors are told apart by their meta storage (a
// view shares its base's): an operation "writes" the storages of its
// outputs and of its arguments the schema marks as written (Tensor(a!)),
// and "reads" those of all its tensor arguments.
//
// Materializing a set of tensors replays, in the recorded order, every
// operation that wrote their storages and, before it, what wrote what
// those read, and so on: the recorded outputs become real in place
// (TensorImpl::shallow_copy_from, the step of Tensor::set_data without its
// device check, since a meta tensor is turned into a CPU or CUDA one).
// Afterwards the targets are final; every other tensor made real on the
// way (a temporary, a view of a target) is made meta again, so that no
// full copy outlives the call, and is replayed again if another target
// needs it (a random operation replays with a copy of its generator, so
// its values are the same every time).
//
// Threading: record() on the thread of the scope; materialize() from any
// thread, serialised by the owner (mode.cpp) under the record's mutex.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Generator.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace tdist::detail {

class DeferredRecord {
 public:
  struct Target {
    std::string name;  // for errors ("" if unknown)
    at::Tensor tensor;
  };

  // The operation `op` was called with `args` (before the device was
  // rewritten to meta) and returned `outputs`. `generator` is a copy of
  // the generator it drew from, as it stood before (unset: not random),
  // passed as its argument `generator_arg` (-1: it has none and draws from
  // the device's default generator); `device` where its values are made.
  // `before`: the arguments as the operation saw them (each meta tensor's
  // meta form from before the call: an in-place shape op such as t_()
  // changes the tensor object itself).
  void record(const c10::OperatorHandle& op, std::vector<c10::IValue> args, std::vector<c10::IValue> before,
              std::vector<c10::IValue> outputs, std::optional<at::Generator> generator, int generator_arg,
              c10::Device device);
  // The scope ended: each recorded tensor's meta form to go back to is
  // the one it has now.
  void seal();

  // The device a recorded tensor's values are made on (CPU if unknown).
  c10::Device device_of(const at::Tensor& meta) const;

  // Makes every target real (those already real are skipped), then moves
  // each to `device` when set. A target is any tensor of a recorded
  // storage: the recorded tensor itself, or another over the same storage
  // (torch:: factories hand out a copy of the one the operation made).
  // UsageError naming the tensor when its construction reads a tensor that
  // was materialized before.
  void materialize(const std::vector<Target>& targets, std::optional<c10::Device> device);

  // Every target becomes real on `device`, uninitialized, and final.
  void make_empty(const std::vector<Target>& targets, c10::Device device);

  // Whether any storage not yet materialized is held from outside.
  bool in_use() const;
  // The meta storages it recorded (the registry's keys).
  std::vector<const c10::StorageImpl*> storages() const;

  std::mutex mu;  // taken by the owner around materialize() and in_use()

 private:
  struct Op {
    c10::OperatorHandle op;
    std::vector<c10::IValue> args;
    std::vector<c10::IValue> before;  // args' meta forms as the call saw them
    std::vector<c10::IValue> outputs;
    std::vector<c10::IValue> outputs_seen;  // the outputs' meta forms as the call left them
    std::optional<at::Generator> generator;  // random: a copy of the generator from before
    int generator_arg = -1;                 // where it goes; -1: the device's default generator
    std::vector<const c10::StorageImpl*> reads, writes;
  };
  struct StorageNode {
    c10::Storage meta;  // keeps the identity alive
    c10::Device device{c10::kCPU};
    std::vector<size_t> writers;  // op indices, ascending
    bool final = false;
    std::string name;  // of the target that made it final
  };
  // A recorded tensor's meta form (to go back to after a replay).
  struct Held {
    at::Tensor meta_snapshot;
  };

  std::vector<size_t> closure(const std::vector<const c10::StorageImpl*>& storages, const std::vector<Target>& targets);
  using RealStorages = std::unordered_map<const c10::StorageImpl*, c10::Storage>;
  void replay(Op& op, RealStorages& real);
  void restore_meta(const std::vector<size_t>& ops, const std::unordered_set<c10::TensorImpl*>& keep);
  void retire(const std::unordered_set<c10::TensorImpl*>& impls);
  void hold(const c10::IValue& v);

  std::vector<Op> ops_;
  std::unordered_map<const c10::StorageImpl*, StorageNode> storages_;
  std::unordered_map<c10::TensorImpl*, Held> held_;
  std::vector<at::Tensor> retired_;  // the meta forms of materialized targets the ops hold now
};

// Calls fn(tensor) for every defined tensor in v (a tensor, a list of
// tensors, or of optional tensors as index_put_'s indices).
template <typename Fn>
void for_each_tensor(const c10::IValue& v, Fn&& fn) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) fn(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) {
      if (t.defined()) fn(t);
    }
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor() && e.toTensor().defined()) fn(e.toTensor());
    }
  }
}

// v with each meta tensor (alone or in a list) replaced by its meta_snapshot.
c10::IValue meta_form(const c10::IValue& v);

// How many records are alive (mode.cpp; for tests).
size_t deferred_record_count();

// A meta tensor with t's storage, sizes, strides and offset (t itself may
// later become real).
at::Tensor meta_snapshot(const at::Tensor& t);

}  // namespace tdist::detail
