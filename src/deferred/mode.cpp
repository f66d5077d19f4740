// deferred_init's mode: a boxed fallback on the DispatchKey::DeferredInit
// (the key LibTorch keeps, in 1.13 and 2.x alike, for an out-of-core
// deferred initialization such as torchdistx's), switched on for the
// scope's thread through the thread-local include set. Above autograd and
// every backend, it sees each operation first: an operation with a device
// argument (a factory: empty, zeros, randn, ...) is sent to the meta device,
// one on meta tensors runs its meta kernel; both are recorded. A random
// one first runs for real on scratch tensors of the same shape and
// strides, so that the generator advances as it would have, and the record
// keeps a copy of the generator from before. An operation on real tensors
// only runs as it is.
//
// The registry maps each recorded tensor to its record, so that
// materialize_* find it; records nobody holds a tensor of are dropped at
// the next deferred_init or materialize.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/library.h>

#include <malloc.h>
#include <sys/mman.h>

#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "deferred/deferred.h"
#include "deferred/record.h"
#include "tdist/deferred_init.h"
#include "tdist/errors.h"
#include "util/torch_compat.h"
#include "util/mapped_tensor.h"

namespace tdist {
namespace detail {
namespace {

struct Recording {
  std::shared_ptr<DeferredRecord> record;
  int depth = 0;
  bool grad_before = true;  // the grad mode outside the outermost scope
};
thread_local Recording t_recording;

struct Registry {
  std::mutex mu;
  // By meta storage: the record's own tensors and the copies torch::
  // factories hand out share it.
  std::unordered_map<const c10::StorageImpl*, std::shared_ptr<DeferredRecord>> of;
  std::unordered_set<DeferredRecord*> recording;  // scopes still open: never dropped
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: tensors may outlive static destruction
  return *r;
}

// Drops the records no one outside holds a tensor of. Under registry().mu.
void sweep_locked(Registry& reg) {
  std::unordered_map<DeferredRecord*, bool> used;
  for (auto& [impl, rec] : reg.of) {
    auto [it, fresh] = used.try_emplace(rec.get(), false);
    if (fresh) {
      std::lock_guard<std::mutex> lock(rec->mu);
      it->second = reg.recording.count(rec.get()) != 0 || rec->in_use();
    }
  }
  for (auto it = reg.of.begin(); it != reg.of.end();) {
    it = used[it->second.get()] ? std::next(it) : reg.of.erase(it);
  }
}

const c10::StorageImpl* meta_storage(const at::Tensor& t) {
  return t.defined() && t.is_meta() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

std::shared_ptr<DeferredRecord> record_of(const at::Tensor& t) {
  const c10::StorageImpl* s = meta_storage(t);
  if (s == nullptr) return nullptr;
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.of.find(s);
  return it == reg.of.end() ? nullptr : it->second;
}

bool is_type(const c10::Argument& a, c10::TypeKind kind) {
  c10::TypePtr t = a.type();
  if (t->kind() == c10::TypeKind::OptionalType) t = t->castRaw<c10::OptionalType>()->getElementType();
  return t->kind() == kind;
}

// What the fallback needs to know of one call.
struct Call {
  int device_arg = -1;
  int pin_memory_arg = -1;
  int generator_arg = -1;
  const at::Tensor* first_meta = nullptr;
};

Call inspect(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  Call c;
  for (size_t i = 0; i < args.size() && i < schema.arguments().size(); ++i) {
    const c10::Argument& a = schema.arguments()[i];
    if (is_type(a, c10::TypeKind::DeviceObjType)) c.device_arg = static_cast<int>(i);
    if (is_type(a, c10::TypeKind::GeneratorType)) c.generator_arg = static_cast<int>(i);
    if (a.name() == "pin_memory") c.pin_memory_arg = static_cast<int>(i);
    if (c.first_meta == nullptr && args[i].isTensor() && args[i].toTensor().defined() && args[i].toTensor().is_meta()) {
      c.first_meta = &args[i].toTensor();
    }
  }
  return c;
}

// Random operations without a generator argument: they draw from the
// default generator of their device.
bool draws_without_generator_argument(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  return name.rfind("aten::rand", 0) == 0 || name.find("dropout") != std::string::npos ||
         name.rfind("aten::rrelu", 0) == 0;
}

// The overload of a random operation that takes a generator (randn ->
// randn.generator, randint.low -> randint.low_generator, randn.names ->
// randn.generator_with_names), if LibTorch has one.
std::optional<c10::OperatorHandle> generator_overload(const c10::FunctionSchema& schema) {
  const std::string& ov = schema.overload_name();
  const std::vector<std::string> names =
      ov.empty() ? std::vector<std::string>{"generator"} : std::vector<std::string>{ov + "_generator", "generator_with_" + ov};
  for (const std::string& o : names) {
    auto h = c10::Dispatcher::singleton().findSchema({schema.name(), o});
    if (h.has_value()) return *h;
  }
  return std::nullopt;
}

// `values` (one per argument of `from`) as the arguments of `to`, matched
// by name (defaults where `from` has none), its generator slot empty at
// *generator_arg. Unset when an argument of `to` has no value.
std::optional<std::vector<c10::IValue>> by_name(const c10::FunctionSchema& from, const std::vector<c10::IValue>& values,
                                                const c10::FunctionSchema& to, int* generator_arg) {
  std::vector<c10::IValue> out;
  for (size_t i = 0; i < to.arguments().size(); ++i) {
    const c10::Argument& a = to.arguments()[i];
    if (is_type(a, c10::TypeKind::GeneratorType)) {
      *generator_arg = static_cast<int>(i);
      out.emplace_back();
      continue;
    }
    const auto k = from.argumentIndexWithName(a.name());
    if (k.has_value() && static_cast<size_t>(*k) < values.size()) {
      out.push_back(values[*k]);
    } else if (a.default_value().has_value()) {
      out.push_back(*a.default_value());
    } else {
      return std::nullopt;
    }
  }
  return out;
}

bool touches_meta(const std::vector<c10::IValue>& args) {
  bool any = false;
  for (const c10::IValue& v : args) for_each_tensor(v, [&](const at::Tensor& t) { any = any || t.is_meta(); });
  return any;
}

// A zeroed tensor of m's sizes and strides on `device`. On the CPU its
// memory is mapped for it alone (util/mapped_tensor.h): freed through
// malloc, blocks of this size stay in the process, and deferred_init's
// peak would grow with every scratch tensor instead of being the largest
// one.
at::Tensor scratch_like(const at::Tensor& m, c10::Device device) {
  if (!device.is_cpu() || m.numel() == 0) {
    return at::empty_strided(m.sizes(), m.strides(), m.options().device(device)).zero_();
  }
  return detail::mapped_cpu_tensor(m.sizes(), m.strides(), m.options());
}

// Runs op for real on scratch tensors of the meta arguments' shapes, on
// `device`, with `gen`: what the construction would have drawn from it.
void advance_generator(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, int generator_arg,
                       const at::Generator& gen, const DeferredRecord& record) {
  std::vector<c10::IValue> stack;
  stack.reserve(args.size());
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_meta()) {
      const at::Tensor& m = v.toTensor();
      stack.emplace_back(scratch_like(m, record.device_of(m)));
    } else if (v.isTensorList() && touches_meta({v})) {
      std::vector<at::Tensor> list;
      for (const at::Tensor& m : v.toTensorVector()) {
        list.push_back(m.is_meta() ? scratch_like(m, record.device_of(m)) : m);
      }
      stack.emplace_back(list);
    } else {
      stack.push_back(v);
    }
  }
  if (generator_arg >= 0) stack[generator_arg] = c10::IValue(gen);
  op.callBoxed(&stack);
}

void deferred_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::DispatchKeySet below(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::DeferredInit);
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  const Call call = inspect(schema, args);
  DeferredRecord* record = t_recording.record.get();
  if (record == nullptr || (call.device_arg < 0 && !touches_meta(args))) {
    c10::impl::ExcludeDispatchKeyGuard no_record(c10::DispatchKey::DeferredInit);
    op.redispatchBoxed(keys & below, stack);  // real tensors only: as it is
    return;
  }
  c10::Device device(c10::kCPU);
  if (call.device_arg >= 0 && args[call.device_arg].isDevice()) {
    device = args[call.device_arg].toDevice();
  } else if (call.first_meta != nullptr) {
    device = record->device_of(*call.first_meta);
  }
  if (device.is_meta()) {
    // A deferred tensor's options() name meta (zeros({n}, w.options())):
    // eagerly they named the device its values are made on.
    device = call.first_meta != nullptr ? record->device_of(*call.first_meta) : c10::Device(c10::kCPU);
    if (call.device_arg >= 0) args[call.device_arg] = c10::IValue(device);
  }
  std::optional<at::Generator> before;
  if (call.generator_arg >= 0 || draws_without_generator_argument(schema)) {
    c10::impl::ExcludeDispatchKeyGuard no_record(c10::DispatchKey::DeferredInit);
    at::NoGradGuard no_grad;
    const bool given = call.generator_arg >= 0 && !args[call.generator_arg].isNone();
    at::Generator gen = given ? args[call.generator_arg].toGenerator() : at::globalContext().defaultGenerator(device);
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      before = compat::clone_generator(gen);
    }
    advance_generator(op, args, call.generator_arg, gen, *record);
  }
  std::vector<c10::IValue> seen;  // the arguments' meta forms as this call sees them
  seen.reserve(args.size());
  for (const c10::IValue& v : args) seen.push_back(meta_form(v));
  const size_t base = stack->size() - n;
  if (call.device_arg >= 0) (*stack)[base + call.device_arg] = c10::IValue(c10::Device(c10::kMeta));
  if (call.pin_memory_arg >= 0) (*stack)[base + call.pin_memory_arg] = c10::IValue();
  try {
    // What the kernel calls in turn (a composite's parts) runs unrecorded:
    // replaying this operation replays them.
    c10::impl::ExcludeDispatchKeyGuard no_record(c10::DispatchKey::DeferredInit);
    op.redispatchBoxed(keys & below, stack);
  } catch (const c10::NotImplementedError& e) {
    const std::string what = e.what_without_backtrace();
    throw UsageError("deferred_init: " + schema.name() +
                     " cannot run on a deferred tensor: inside deferred_init tensors have shapes but no values, "
                     "so code that reads a value (item(), a branch on a tensor's contents) must run after "
                     "materializing (" + what.substr(0, what.find('\n')) + ")");
  }
  const size_t returns = schema.returns().size();
  std::vector<c10::IValue> outputs(stack->end() - static_cast<std::ptrdiff_t>(returns), stack->end());
  // A random operation without a generator argument is recorded as its
  // overload with one, so that replay passes a copy of the generator and
  // never sets the process's default one (another thread may be drawing).
  c10::OperatorHandle recorded = op;
  int generator_arg = call.generator_arg;
  if (generator_arg < 0 && before.has_value()) {
    if (const auto with = generator_overload(schema)) {
      int at_arg = -1;
      auto a = by_name(schema, args, with->schema(), &at_arg);
      auto b = by_name(schema, seen, with->schema(), &at_arg);
      if (a && b && at_arg >= 0) {
        recorded = *with;
        args = std::move(*a);
        seen = std::move(*b);
        generator_arg = at_arg;
      }
    }
  }
  record->record(recorded, std::move(args), std::move(seen), outputs, std::move(before), generator_arg, device);
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  for (const c10::IValue& v : outputs) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (const c10::StorageImpl* s = meta_storage(t)) reg.of[s] = t_recording.record;
    });
  }
}

}  // namespace

size_t deferred_record_count() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  sweep_locked(reg);
  std::unordered_set<const DeferredRecord*> records;
  for (const auto& [impl, rec] : reg.of) records.insert(rec.get());
  return records.size();
}

DeferredInitScope::DeferredInitScope() : outermost_(t_recording.depth == 0) {
  if (outermost_) {
    t_recording.grad_before = grad_before_;
    auto record = std::make_shared<DeferredRecord>();
    Registry& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mu);
    sweep_locked(reg);
    reg.recording.insert(record.get());
    t_recording.record = std::move(record);
  }
  ++t_recording.depth;
  c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::DeferredInit, true);
}

DeferredInitScope::~DeferredInitScope() {
  if (--t_recording.depth > 0) return;
  c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::DeferredInit, false);
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.recording.erase(t_recording.record.get());
  t_recording.record->seal();
  t_recording.record.reset();
  ::malloc_trim(0);  // what random factories' scratch outputs left in the heap goes back
}

}  // namespace detail

bool is_deferred(const at::Tensor& t) {
  return t.defined() && t.is_meta() && detail::record_of(t) != nullptr;
}

bool is_deferred(const torch::nn::Module& m) {
  for (const at::Tensor& p : m.parameters(true)) {
    if (is_deferred(p)) return true;
  }
  for (const at::Tensor& b : m.buffers(true)) {
    if (is_deferred(b)) return true;
  }
  return false;
}

namespace detail {

DeferredInitPause::DeferredInitPause()
    : grad_(t_recording.depth > 0 ? t_recording.grad_before : c10::GradMode::is_enabled()) {}

namespace {
// The named tensors that are meta, grouped by record.
std::vector<std::pair<std::shared_ptr<DeferredRecord>, std::vector<DeferredRecord::Target>>> by_record(
    const std::vector<NamedTensor>& tensors) {
  std::vector<std::pair<std::shared_ptr<DeferredRecord>, std::vector<DeferredRecord::Target>>> groups;
  for (const NamedTensor& t : tensors) {
    if (!t.tensor.defined() || !t.tensor.is_meta()) continue;
    std::shared_ptr<DeferredRecord> rec = record_of(t.tensor);
    if (rec == nullptr) {
      throw UsageError("materialize: '" + t.name + "' is a meta tensor that deferred_init did not make (" +
                       "or one materialized before); nothing records its values");
    }
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == rec; });
    if (g == groups.end()) g = groups.insert(groups.end(), {rec, {}});
    g->second.push_back({t.name, t.tensor});
  }
  return groups;
}
}  // namespace

// Runs fn(record, its targets) for each record of the named tensors under
// the record's lock, then drops the records nobody holds any more.
template <typename Fn>
void per_record(const std::vector<NamedTensor>& tensors, Fn&& fn) {
  for (auto& [rec, group] : by_record(tensors)) {
    {
      std::lock_guard<std::mutex> lock(rec->mu);
      fn(*rec, group);
    }
    Registry& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mu);
    sweep_locked(reg);
  }
}

void materialize_named(const std::vector<NamedTensor>& tensors, std::optional<c10::Device> device) {
  per_record(tensors, [&](DeferredRecord& rec, const auto& group) { rec.materialize(group, device); });
}

void empty_named(const std::vector<NamedTensor>& tensors, c10::Device device) {
  per_record(tensors, [&](DeferredRecord& rec, const auto& group) { rec.make_empty(group, device); });
}

}  // namespace detail

void materialize_tensor(const at::Tensor& t, std::optional<c10::Device> device) {
  if (!t.defined()) return;
  if (!t.is_meta()) {
    if (device.has_value() && t.device() != *device) {
      throw UsageError("materialize_tensor: the tensor is not deferred (it is on " + t.device().str() +
                       "); move it with to()");
    }
    return;
  }
  detail::materialize_named({{"the tensor", t}}, device);
}

void materialize_module(torch::nn::Module& m, std::optional<c10::Device> device) {
  std::vector<detail::NamedTensor> targets;
  for (const auto& p : m.named_parameters(true)) targets.push_back({p.key(), p.value()});
  for (const auto& b : m.named_buffers(true)) targets.push_back({b.key(), b.value()});
  detail::materialize_named(targets, device);
}

void to_empty(torch::nn::Module& m, c10::Device device) {
  std::vector<detail::NamedTensor> targets;
  for (const auto& p : m.named_parameters(true)) targets.push_back({p.key(), p.value()});
  for (const auto& b : m.named_buffers(true)) targets.push_back({b.key(), b.value()});
  detail::empty_named(targets, device);
}

}  // namespace tdist

TORCH_LIBRARY_IMPL(_, DeferredInit, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&tdist::detail::deferred_fallback>());
}
