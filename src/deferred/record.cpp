#include "deferred/record.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <limits>
#include <set>
#include <unordered_set>
#include <utility>

#include "tdist/errors.h"
#include "util/torch_compat.h"

namespace tdist::detail {
namespace {

// The outputs recorded as `recorded` take the values of `result` (the
// same operation, run for real): same object, so every holder sees them.
void adopt(const c10::IValue& recorded, const c10::IValue& result) {
  if (recorded.isTensor() && result.isTensor()) {
    const at::Tensor& m = recorded.toTensor();
    const at::Tensor& r = result.toTensor();
    if (m.defined() && r.defined() && m.unsafeGetTensorImpl() != r.unsafeGetTensorImpl()) {
      m.unsafeGetTensorImpl()->shallow_copy_from(r.getIntrusivePtr());
    }
    return;
  }
  if (recorded.isTensorList() && result.isTensorList()) {
    const std::vector<at::Tensor> ms = recorded.toTensorVector();
    const std::vector<at::Tensor> rs = result.toTensorVector();
    for (size_t i = 0; i < ms.size() && i < rs.size(); ++i) adopt(c10::IValue(ms[i]), c10::IValue(rs[i]));
  }
}

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

void adopt_storage(const at::Tensor& t, const c10::Storage& real, const at::Tensor& like);

}  // namespace

at::Tensor meta_snapshot(const at::Tensor& t) {
  at::Tensor m = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  m.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides());
  m.unsafeGetTensorImpl()->set_storage_offset(t.storage_offset());
  return m;
}

c10::IValue meta_form(const c10::IValue& v) {
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_meta()) return c10::IValue(meta_snapshot(v.toTensor()));
  if (!v.isTensorList()) return v;
  std::vector<at::Tensor> list;
  for (const at::Tensor& t : v.toTensorVector()) list.push_back(t.defined() && t.is_meta() ? meta_snapshot(t) : t);
  return c10::IValue(list);
}

void DeferredRecord::hold(const c10::IValue& v) {
  for_each_tensor(v, [&](const at::Tensor& t) {
    if (!t.is_meta()) return;
    Held& h = held_[t.unsafeGetTensorImpl()];
    if (!h.meta_snapshot.defined()) h.meta_snapshot = meta_snapshot(t);
  });
}

void DeferredRecord::record(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
                            std::vector<c10::IValue> before, std::vector<c10::IValue> outputs,
                            std::optional<at::Generator> generator, int generator_arg, c10::Device device) {
  Op rec{op, std::move(args), std::move(before), std::move(outputs), {}, std::move(generator), generator_arg, {}, {}};
  for (const c10::IValue& v : rec.outputs) rec.outputs_seen.push_back(meta_form(v));
  const auto& schema = op.schema().arguments();
  for (size_t i = 0; i < rec.before.size() && i < schema.size(); ++i) {
    const c10::AliasInfo* alias = schema[i].alias_info();
    const bool written = alias != nullptr && alias->isWrite();
    for_each_tensor(rec.before[i], [&](const at::Tensor& t) {
      if (!t.is_meta()) return;
      rec.reads.push_back(storage_of(t));
      if (written) rec.writes.push_back(storage_of(t));
    });
  }
  for (const c10::IValue& out : rec.outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      if (t.is_meta()) rec.writes.push_back(storage_of(t));
    });
  }
  const size_t index = ops_.size();
  std::set<const c10::StorageImpl*> seen;
  auto node_of = [&](const at::Tensor& t) {
    auto [it, made] = storages_.try_emplace(storage_of(t));
    if (made) {
      it->second.meta = t.storage();
      it->second.device = device;
    }
    return it;
  };
  for (const c10::IValue& v : rec.before) for_each_tensor(v, [&](const at::Tensor& t) { if (t.is_meta()) node_of(t); });
  for (const c10::IValue& v : rec.outputs) for_each_tensor(v, [&](const at::Tensor& t) { if (t.is_meta()) node_of(t); });
  for (const c10::StorageImpl* s : rec.writes) {
    if (seen.insert(s).second) storages_[s].writers.push_back(index);
  }
  for (const c10::IValue& v : rec.args) hold(v);
  for (const c10::IValue& v : rec.outputs) hold(v);
  ops_.push_back(std::move(rec));
}

void DeferredRecord::seal() {
  for (auto& [impl, h] : held_) {
    if (impl->device().type() != c10::kMeta) continue;
    h.meta_snapshot = meta_snapshot(at::Tensor(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(impl)));
  }
}

c10::Device DeferredRecord::device_of(const at::Tensor& meta) const {
  auto it = storages_.find(storage_of(meta));
  return it == storages_.end() ? c10::Device(c10::kCPU) : it->second.device;
}

// A storage not yet materialized is held from outside when a tensor the
// record holds is held by more than the record's operations (a module's
// parameter the constructor worked on), or when the storage has more
// owners than the record's own: its node, its recorded tensors still meta
// and the meta forms kept (a copy a torch:: factory handed out).
bool DeferredRecord::in_use() const {
  std::unordered_map<const c10::TensorImpl*, size_t> refs;
  for (const Op& op : ops_) {
    for (const c10::IValue& v : op.args) for_each_tensor(v, [&](const at::Tensor& t) { ++refs[t.unsafeGetTensorImpl()]; });
    for (const c10::IValue& v : op.outputs) for_each_tensor(v, [&](const at::Tensor& t) { ++refs[t.unsafeGetTensorImpl()]; });
  }
  // A view holds its base (autograd's view record) as well.
  std::unordered_set<const c10::TensorImpl*> views;
  for (const Op& op : ops_) {
    for (const auto* values : {&op.args, &op.outputs}) {
      for (const c10::IValue& v : *values) {
        for_each_tensor(v, [&](const at::Tensor& t) {
          if (t.is_view() && views.insert(t.unsafeGetTensorImpl()).second) ++refs[t._base().unsafeGetTensorImpl()];
        });
      }
    }
  }
  std::unordered_map<const c10::StorageImpl*, size_t> own;
  for (const auto& [s, node] : storages_) own[s] = 1;
  for (const auto& [impl, h] : held_) {
    const c10::StorageImpl* s = storage_of(h.meta_snapshot);
    ++own[s];
    if (impl->device().type() != c10::kMeta || !impl->has_storage()) continue;
    ++own[impl->storage().unsafeGetStorageImpl()];
    auto node = storages_.find(s);
    if (node != storages_.end() && !node->second.final && c10::raw::intrusive_ptr::use_count(impl) > refs[impl]) {
      return true;
    }
  }
  for (const at::Tensor& t : retired_) ++own[storage_of(t)];
  for (const Op& op : ops_) {
    for (const auto* values : {&op.before, &op.outputs_seen}) {
      for (const c10::IValue& v : *values) {
        for_each_tensor(v, [&](const at::Tensor& t) {
          if (t.is_meta()) ++own[storage_of(t)];
        });
      }
    }
  }
  for (const auto& [s, node] : storages_) {
    if (node.final) continue;
    if (c10::raw::intrusive_ptr::use_count(const_cast<c10::StorageImpl*>(s)) > own[s]) return true;
  }
  return false;
}

std::vector<const c10::StorageImpl*> DeferredRecord::storages() const {
  std::vector<const c10::StorageImpl*> out;
  for (const auto& [s, node] : storages_) out.push_back(s);
  return out;
}

// The operations that make the targets' storages, in recorded order: for
// each storage, every operation that wrote it before the bound, and for
// each such operation what wrote its inputs before it.
std::vector<size_t> DeferredRecord::closure(const std::vector<const c10::StorageImpl*>& storages,
                                            const std::vector<Target>& targets) {
  std::set<size_t> needed;
  std::unordered_map<const c10::StorageImpl*, size_t> done;  // storage -> the bound it was visited with
  std::vector<std::pair<const c10::StorageImpl*, size_t>> work;
  for (const c10::StorageImpl* s : storages) work.emplace_back(s, std::numeric_limits<size_t>::max());
  const std::unordered_set<const c10::StorageImpl*> wanted(storages.begin(), storages.end());
  while (!work.empty()) {
    auto [s, bound] = work.back();
    work.pop_back();
    auto seen = done.find(s);
    if (seen != done.end() && seen->second >= bound) continue;
    done[s] = bound;
    auto node = storages_.find(s);
    if (node == storages_.end()) continue;  // a real tensor from outside: used as it is
    if (node->second.final && wanted.count(s) == 0) {
      throw UsageError("materialize: the construction of " +
                       (targets.size() == 1 && !targets[0].name.empty() ? "'" + targets[0].name + "'" : "these tensors") +
                       " reads '" + node->second.name +
                       "', which was materialized before (and may have changed since): materialize them together");
    }
    for (size_t j : node->second.writers) {
      if (j >= bound) break;
      if (!needed.insert(j).second) continue;
      for (const c10::StorageImpl* r : ops_[j].reads) work.emplace_back(r, j);
    }
  }
  return {needed.begin(), needed.end()};
}

// Under the caller's guards: no recording, no gradient. `real` maps each
// meta storage made real so far in this materialize to its real storage:
// every tensor of it (a copy a torch:: factory handed out, a view) is
// made real before the operation runs, and its outputs are added.
void DeferredRecord::replay(Op& op, RealStorages& real) {
  // Each argument as the call saw it: its storage's real values, its
  // sizes, strides and offset from then.
  auto make_real = [&](const at::Tensor& t, const at::Tensor& seen) {
    if (!seen.is_meta()) return;
    auto it = real.find(storage_of(seen));
    if (it != real.end()) adopt_storage(t, it->second, seen);
  };
  for (size_t i = 0; i < op.args.size() && i < op.before.size(); ++i) {
    const c10::IValue& v = op.args[i];
    const c10::IValue& b = op.before[i];
    if (v.isTensor() && b.isTensor()) {
      if (v.toTensor().defined() && b.toTensor().defined()) make_real(v.toTensor(), b.toTensor());
    } else if (v.isTensorList() && b.isTensorList()) {
      const std::vector<at::Tensor> ts = v.toTensorVector(), bs = b.toTensorVector();
      for (size_t k = 0; k < ts.size() && k < bs.size(); ++k) {
        if (ts[k].defined() && bs[k].defined()) make_real(ts[k], bs[k]);
      }
    }
  }
  std::vector<c10::IValue> stack = op.args;
  if (op.generator.has_value() && op.generator_arg >= 0) {
    stack[op.generator_arg] = c10::IValue(compat::clone_generator(*op.generator));
    op.op.callBoxed(&stack);
  } else if (op.generator.has_value()) {
    // A random operation without a generator argument (randn(size),
    // dropout) draws from the device's default generator: set to the
    // state recorded for the call, then back.
    at::Generator gen = at::globalContext().defaultGenerator(op.generator->device());
    at::Tensor saved;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      saved = gen.get_state();
      gen.set_state(op.generator->get_state());
    }
    try {
      op.op.callBoxed(&stack);
    } catch (...) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(saved);
      throw;
    }
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved);
  } else {
    op.op.callBoxed(&stack);
  }
  for (size_t i = 0; i < op.outputs.size() && i < stack.size(); ++i) adopt(op.outputs[i], stack[i]);
  // What became real, by the meta storage it had in the recording.
  auto note_tensor = [&](const at::Tensor& t, const at::Tensor& m) {
    if (t.defined() && m.defined() && m.is_meta() && !t.is_meta() && t.has_storage()) {
      real.emplace(storage_of(m), t.storage());
    }
  };
  auto note = [&](const c10::IValue& v, const c10::IValue& seen) {
    if (v.isTensor() && seen.isTensor()) {
      note_tensor(v.toTensor(), seen.toTensor());
    } else if (v.isTensorList() && seen.isTensorList()) {
      const std::vector<at::Tensor> ts = v.toTensorVector(), ms = seen.toTensorVector();
      for (size_t k = 0; k < ts.size() && k < ms.size(); ++k) note_tensor(ts[k], ms[k]);
    }
  };
  for (size_t i = 0; i < stack.size() && i < op.outputs_seen.size(); ++i) note(stack[i], op.outputs_seen[i]);
  for (size_t i = 0; i < op.args.size() && i < op.before.size(); ++i) note(op.args[i], op.before[i]);
}

// Every recorded tensor of `ops` made real, but the targets, goes back to
// its meta form.
void DeferredRecord::restore_meta(const std::vector<size_t>& ops, const std::unordered_set<c10::TensorImpl*>& keep) {
  auto restore = [&](const at::Tensor& t) {
    if (t.is_meta() || keep.count(t.unsafeGetTensorImpl()) != 0) return;
    auto h = held_.find(t.unsafeGetTensorImpl());
    if (h != held_.end()) t.unsafeGetTensorImpl()->shallow_copy_from(h->second.meta_snapshot.getIntrusivePtr());
  };
  for (size_t j : ops) {
    for (const c10::IValue& v : ops_[j].args) for_each_tensor(v, restore);
    for (const c10::IValue& v : ops_[j].outputs) for_each_tensor(v, restore);
  }
}

namespace {
// t becomes the view of `real` (the values of like's storage) with like's
// sizes, strides, offset and dtype.
void adopt_storage(const at::Tensor& t, const c10::Storage& real, const at::Tensor& like) {
  at::Tensor view = at::empty({0}, like.options().device(real.device()));
  view.set_(real, like.storage_offset(), like.sizes(), like.strides());
  t.unsafeGetTensorImpl()->shallow_copy_from(view.getIntrusivePtr());
}
}  // namespace

void DeferredRecord::materialize(const std::vector<Target>& targets, std::optional<c10::Device> device) {
  std::vector<Target> todo;
  std::unordered_set<c10::TensorImpl*> impls;
  std::vector<const c10::StorageImpl*> storages;
  for (const Target& t : targets) {
    if (!t.tensor.defined() || !t.tensor.is_meta() || !impls.insert(t.tensor.unsafeGetTensorImpl()).second) continue;
    auto node = storages_.find(storage_of(t.tensor));
    if (node == storages_.end() || node->second.writers.empty()) {
      throw UsageError("materialize: '" + t.name + "' is a meta tensor that deferred_init did not make");
    }
    todo.push_back(t);
    storages.push_back(storage_of(t.tensor));
  }
  if (todo.empty()) return;
  const std::vector<size_t> ops = closure(storages, todo);
  c10::impl::ExcludeDispatchKeyGuard no_record(c10::DispatchKey::DeferredInit);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> before;  // the targets' meta forms, should the replay fail
  for (const Target& t : todo) before.push_back(meta_snapshot(t.tensor));
  try {
    RealStorages real;
    for (size_t j : ops) replay(ops_[j], real);
    for (size_t k = 0; k < todo.size(); ++k) {
      auto it = real.find(storages[k]);  // by the storage it had before the replay
      if (it == real.end()) throw UsageError("materialize: nothing recorded makes '" + todo[k].name + "'");
      // As it stands at the end of the construction (the replay may have
      // made it real as an earlier operation saw it: before a set_data, a t_()).
      adopt_storage(todo[k].tensor, it->second, before[k]);
    }
  } catch (...) {
    restore_meta(ops, {});
    for (size_t k = 0; k < todo.size(); ++k) {
      if (!todo[k].tensor.is_meta()) todo[k].tensor.unsafeGetTensorImpl()->shallow_copy_from(before[k].getIntrusivePtr());
    }
    throw;
  }
  restore_meta(ops, impls);
  for (size_t k = 0; k < todo.size(); ++k) {
    StorageNode& node = storages_[storages[k]];
    node.final = true;
    node.name = todo[k].name;
  }
  retire(impls);
  if (device.has_value()) {
    for (const Target& t : todo) {
      if (t.tensor.device() != *device) {
        t.tensor.unsafeGetTensorImpl()->shallow_copy_from(t.tensor.to(*device).getIntrusivePtr());
      }
    }
  }
}

void DeferredRecord::make_empty(const std::vector<Target>& targets, c10::Device device) {
  std::unordered_set<c10::TensorImpl*> impls;
  std::unordered_map<const c10::StorageImpl*, c10::Storage> real;  // one storage per meta storage: ties stay tied
  c10::impl::ExcludeDispatchKeyGuard no_record(c10::DispatchKey::DeferredInit);
  at::NoGradGuard no_grad;
  for (const Target& t : targets) {
    if (!t.tensor.defined() || !t.tensor.is_meta() || !impls.insert(t.tensor.unsafeGetTensorImpl()).second) continue;
    const c10::StorageImpl* s = storage_of(t.tensor);
    auto it = real.find(s);
    if (it == real.end()) {
      const int64_t elements = static_cast<int64_t>(t.tensor.storage().nbytes() / t.tensor.element_size());
      it = real.emplace(s, at::empty({elements}, t.tensor.options().device(device)).storage()).first;
    }
    adopt_storage(t.tensor, it->second, t.tensor);
    StorageNode& node = storages_[s];
    node.final = true;
    node.name = t.name;
  }
  retire(impls);
}

// The record stops holding the targets (they are the module's now, with
// their values): each place that did holds their meta form instead.
void DeferredRecord::retire(const std::unordered_set<c10::TensorImpl*>& impls) {
  std::unordered_map<c10::TensorImpl*, at::Tensor> swap;
  for (c10::TensorImpl* impl : impls) {
    auto h = held_.find(impl);
    if (h == held_.end()) continue;
    swap.emplace(impl, h->second.meta_snapshot);
    retired_.push_back(h->second.meta_snapshot);
    held_.erase(h);
  }
  if (swap.empty()) return;
  auto unhold = [&](c10::IValue& v) {
    if (v.isTensor()) {
      auto it = swap.find(v.toTensor().unsafeGetTensorImpl());
      if (it != swap.end()) v = c10::IValue(it->second);
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> list = v.toTensorVector();
      bool any = false;
      for (at::Tensor& t : list) {
        auto it = t.defined() ? swap.find(t.unsafeGetTensorImpl()) : swap.end();
        if (it != swap.end()) {
          t = it->second;
          any = true;
        }
      }
      if (any) v = c10::IValue(list);
    }
  };
  for (Op& op : ops_) {
    for (c10::IValue& v : op.args) unhold(v);
    for (c10::IValue& v : op.outputs) unhold(v);
  }
}

}  // namespace tdist::detail
