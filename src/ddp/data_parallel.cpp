// The DDP reducer: gradient-ready tracking through autograd post-hooks,
// in-order bucket launches, and the end-of-backward callback that waits for
// every bucket and writes the averaged gradients back.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <sstream>
#include <unordered_set>

#include "ddp/bucket_assignment.h"
#include "process_group/group_or_default.h"
#include "util/bytes.h"
#include "util/torch_compat.h"
#include "tdist/ddp.h"

namespace tdist::detail {

namespace {

std::string describe_param(const std::string& name, const at::Tensor& p) {
  std::ostringstream os;
  os << name << " " << p.sizes() << " " << c10::toString(p.scalar_type());
  return os.str();
}

// Every rank's string, through two all_gathers (lengths, then padded bytes).
std::vector<std::string> all_gather_strings(ProcessGroup& pg, const std::string& mine) {
  at::Tensor len = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  at::Tensor lens = at::empty({pg.size()}, at::kLong);
  pg.all_gather_into_tensor(lens, len)->wait();
  const int64_t longest = lens.max().item<int64_t>();
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  copy_bytes(bytes.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({longest * pg.size()}, at::kByte);
  pg.all_gather_into_tensor(all, bytes)->wait();
  std::vector<std::string> out;
  const auto* p = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < pg.size(); ++r) out.emplace_back(p + r * longest, static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

// A tensor over flat's storage at `offset` elements, shaped `sizes`. Not an
// autograd view: optimizers may detach_() and zero_() it (LibTorch's
// zero_grad does), which autograd refuses on views.
at::Tensor alias_of(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, strides);
  return t;
}

// A tensor of its own (its own storage object, not a view) over flat's
// memory at `offset` elements, keeping flat alive: a gradient that lives in
// bucket memory without gradient_as_bucket_view.
at::Tensor own_tensor_in(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  void* data = static_cast<uint8_t*>(flat.data_ptr()) + offset * flat.element_size();
  return at::from_blob(data, sizes, [keep = flat](void*) mutable { keep.reset(); }, flat.options());
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

}  // namespace

struct DataParallel::State : std::enable_shared_from_this<DataParallel::State> {
  std::shared_ptr<ProcessGroup> pg;
  DistributedDataParallelOptions options;
  std::vector<at::Tensor> params;  // that require grad, in registration order
  std::vector<std::string> names;
  std::vector<at::Tensor> buffers;

  struct Bucket {
    std::vector<size_t> members;
    at::Tensor flat;
    std::vector<at::Tensor> views;  // per member, shaped like the parameter, aliasing flat
    size_t pending = 0;
    std::shared_ptr<Work> work;
    // Built-in reductions without gradient_as_bucket_view (direct_mode())
    // work on the gradients where they are: per member, its .grad, or its
    // view in flat when there is no usable .grad (none, or not contiguous).
    std::vector<at::Tensor> pieces;
  };
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of, slot_in_bucket;
  std::vector<compat::GradAccumulatorPtr> accumulators;  // hooks fire only while held

  // Whether the gradients live in bucket memory: with
  // gradient_as_bucket_view (as views), and on a group with symmetric
  // memory (as tensors of their own), so that the shm backend reduces them
  // where they are, straight between the ranks' copies.
  bool grads_in_buckets = false;
  bool symmetric_buckets = false;

  CommHook hook;  // empty: all-reduce, averaged
  // What the registered hook is, when it is one of the built-ins that the
  // reducer runs itself (no copy of the gradients into the bucket and back).
  Builtin builtin = Builtin::kAllreduce;
  std::shared_ptr<ProcessGroup> builtin_group;  // its state: the group it reduces over

  std::mutex mu;
  bool require_sync = true;
  // Per synchronised iteration.
  bool callback_queued = false;
  size_t next_launch = 0;
  std::vector<bool> ready;           // the parameter's slot in its bucket is final
  std::vector<char> locally_used;    // its gradient arrived in this backward
  std::vector<size_t> arrival;       // until the rebuild: parameters in the order their gradients arrived
  std::vector<size_t> unused_now;    // find_unused_parameters: unreachable from the last forward's outputs
  bool unused_marked = false;
  std::string pending_error;
  // Bucket rebuild: once, after the first synchronised iteration.
  bool rebuild_due = false, rebuilt = false;
  std::vector<size_t> arrival_for_rebuild;
  // static_graph: the first iteration records which parameters the graph
  // leaves without gradient on every rank; later ones reuse it.
  bool static_recorded = false;
  std::vector<char> static_unused;

  bool recording_static() const { return options.static_graph && !static_recorded; }

  void reset_iteration() {
    for (auto& b : buckets) {
      b.pending = b.members.size();
      b.work.reset();
      for (auto& piece : b.pieces) piece.reset();
    }
    std::fill(ready.begin(), ready.end(), false);
    std::fill(locally_used.begin(), locally_used.end(), 0);
    arrival.clear();
    unused_now.clear();
    unused_marked = false;
    next_launch = 0;
    callback_queued = false;
  }

  // (Re)creates the buckets for `assignment`; gradients that are bucket
  // views move to the new buckets with their values.
  void build_buckets(const std::vector<std::vector<size_t>>& assignment) {
    std::vector<Bucket> fresh;
    bucket_of.assign(params.size(), 0);
    slot_in_bucket.assign(params.size(), 0);
    for (const auto& members : assignment) {
      Bucket b;
      b.members = members;
      b.pending = members.size();
      int64_t total = 0;
      for (size_t m : members) total += params[m].numel();
      const at::Tensor& first = params[members[0]];
      b.flat = symmetric_buckets ? pg->empty_symmetric({total}, first.scalar_type())
                                 : at::zeros({total}, first.options().requires_grad(false));
      int64_t offset = 0;
      for (size_t k = 0; k < members.size(); ++k) {
        const at::Tensor& p = params[members[k]];
        b.views.push_back(options.gradient_as_bucket_view ? alias_of(b.flat, offset, p.sizes())
                                                          : own_tensor_in(b.flat, offset, p.sizes()));
        offset += p.numel();
        bucket_of[members[k]] = fresh.size();
        slot_in_bucket[members[k]] = k;
      }
      b.pieces.resize(members.size());
      fresh.push_back(std::move(b));
    }
    buckets = std::move(fresh);
    if (options.gradient_as_bucket_view) {
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor& view = buckets[bucket_of[i]].views[slot_in_bucket[i]];
        at::Tensor& grad = params[i].mutable_grad();
        if (grad.defined()) view.copy_(grad);
        grad = view;
      }
    } else if (grads_in_buckets) {
      // Gradients that exist move into the new buckets when nothing else
      // holds them (those in the old buckets do: those are gone by now);
      // the others stay undefined until backward makes them.
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor& view = buckets[bucket_of[i]].views[slot_in_bucket[i]];
        at::Tensor& grad = params[i].mutable_grad();
        if (!grad.defined() || grad.use_count() != 1 || grad.layout() != at::kStrided ||
            grad.scalar_type() != view.scalar_type() || grad.device() != view.device() ||
            grad.sizes() != view.sizes()) {
          continue;
        }
        view.copy_(grad);
        grad = view;
      }
    }
  }

  std::vector<ParamInfo> param_infos() const {
    std::vector<ParamInfo> infos;
    for (const auto& p : params) {
      infos.push_back({static_cast<size_t>(p.numel()) * p.element_size(), static_cast<int>(p.scalar_type())});
    }
    return infos;
  }

  static size_t mib(double mb) { return static_cast<size_t>(mb * 1024 * 1024); }

  // Before a forward, on every rank alike: adopt rank 0's gradient arrival
  // order from the first iteration as the bucket order.
  void maybe_rebuild() {
    if (!rebuild_due) return;
    rebuild_due = false;
    rebuilt = true;
    const int64_t n = static_cast<int64_t>(params.size());
    at::Tensor order = at::empty({n}, at::kLong);
    auto* o = order.data_ptr<int64_t>();
    for (int64_t k = 0; k < n; ++k) o[k] = static_cast<int64_t>(arrival_for_rebuild[k]);
    pg->broadcast(order, {0})->wait();
    std::vector<size_t> perm(n);
    std::vector<bool> seen(n, false);
    for (int64_t k = 0; k < n; ++k) {
      if (o[k] < 0 || o[k] >= n || seen[o[k]]) {
        throw CollectiveMismatchError("DistributedDataParallel: rank 0's gradient order is not a permutation");
      }
      seen[o[k]] = true;
      perm[k] = static_cast<size_t>(o[k]);
    }
    auto assignment = assign_buckets_in_order(param_infos(), perm, mib(options.first_bucket_cap_mb),
                                              mib(options.bucket_cap_mb));
    std::vector<std::vector<size_t>> current;
    for (const auto& b : buckets) current.push_back(b.members);
    if (assignment != current) build_buckets(assignment);
  }

  // Whether the reducer runs the reduction itself on the gradients where
  // they are. With gradient_as_bucket_view they already live in the bucket.
  bool direct_mode() const { return builtin != Builtin::kNone && !options.gradient_as_bucket_view; }

  // Slot i of its bucket is final: copy the gradient in (zeros for a
  // parameter without one) and launch every bucket that is now complete,
  // in index order, so that every rank issues the same sequence.
  void make_ready(size_t i, bool has_grad) {
    ready[i] = true;
    Bucket& b = buckets[bucket_of[i]];
    const size_t slot = slot_in_bucket[i];
    at::Tensor& view = b.views[slot];
    at::Tensor& grad = params[i].mutable_grad();
    if (!has_grad && !options.gradient_as_bucket_view && grad.defined() && grad.data_ptr() == view.data_ptr()) {
      // The slot takes part as zeros, but without gradient_as_bucket_view a
      // .grad that got nothing keeps its values: move it out of the bucket.
      grad = grad.clone();
    }
    if (has_grad && grads_in_buckets && grad.defined() && grad.data_ptr() != view.data_ptr() &&
        grad.layout() == at::kStrided && grad.scalar_type() == view.scalar_type() &&
        grad.device() == view.device() && grad.sizes() == view.sizes() &&
        (options.gradient_as_bucket_view || grad.use_count() == 1)) {
      // A .grad outside its slot moves in, to be reduced in place: with
      // gradient_as_bucket_view always; otherwise when nothing else holds
      // it (autograd's fresh one after zero_grad(set_to_none) or in the
      // first backward), so that a tensor the user set as .grad keeps
      // receiving the result.
      view.copy_(grad);
      grad = view;
    }
    if (direct_mode()) {
      // Reduced in place when it can be; else through its slot in flat.
      const bool usable = has_grad && grad.defined() && grad.layout() == at::kStrided && grad.is_contiguous() &&
                          grad.scalar_type() == view.scalar_type() && grad.device() == view.device() &&
                          grad.numel() == view.numel();
      if (usable) {
        b.pieces[slot] = grad;
      } else {
        if (has_grad && grad.defined()) view.copy_(grad); else view.zero_();
        b.pieces[slot] = view;
      }
    } else if (!has_grad || !grad.defined()) {
      view.zero_();
    } else if (grad.data_ptr() != view.data_ptr()) {
      view.copy_(grad);
    }
    if (--b.pending > 0) return;
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(next_launch++);
  }

  void launch(size_t index) {
    Bucket& b = buckets[index];
    if (direct_mode()) {
      b.work = launch_direct(b);
      return;
    }
    if (hook) {
      std::vector<at::Tensor> members;
      for (size_t m : b.members) members.push_back(params[m]);
      GradBucket gb(index, index + 1 == buckets.size(), b.flat, b.views, std::move(members));
      b.work = hook(gb);
      if (!b.work) throw UsageError("DistributedDataParallel: the communication hook returned no Work");
    } else {
      b.work = pg->all_reduce(b.flat, {ReduceOp::AVG});
    }
  }

  // The built-in hooks on the bucket's pieces: the same arithmetic as the
  // hooks on a flat buffer (so the same bits), without building it.
  std::shared_ptr<Work> launch_direct(Bucket& b) {
    const auto& group = builtin_group ? builtin_group : pg;
    // When every gradient is in its slot (bucket memory), the bucket is one
    // flat tensor: reduce that.
    bool in_slots = true;
    for (size_t s = 0; s < b.pieces.size() && in_slots; ++s) in_slots = b.pieces[s].is_same(b.views[s]);
    auto reduce = [&](const AllreduceOptions& o) {
      return in_slots ? group->all_reduce(b.flat, o) : group->all_reduce_coalesced(b.pieces, o);
    };
    switch (builtin) {
      case Builtin::kNoop:
        return Work::completed({});
      case Builtin::kAllreduce:
        return reduce({ReduceOp::AVG});
      case Builtin::kFp16:
      case Builtin::kBf16: {
        // One collective that narrows, reduces and widens in place: the
        // bits of the hook's cast, all-reduce and cast back.
        AllreduceOptions o;
        o.op = ReduceOp::AVG;
        o.wire_dtype = builtin == Builtin::kFp16 ? at::kHalf : at::kBFloat16;
        return reduce(o);
      }
      case Builtin::kNone:
        break;
    }
    throw Error("DistributedDataParallel: no built-in reduction to run");
  }

  // A parameter's gradient has been accumulated (autograd thread).
  void on_gradient(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    if (!require_sync) return;
    if (!callback_queued) {
      callback_queued = true;
      std::weak_ptr<State> weak = shared_from_this();
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto s = weak.lock()) s->finish_backward();
      });
    }
    if (locally_used[i]) {
      if (pending_error.empty()) {
        pending_error = "DistributedDataParallel: parameter " + names[i] +
                        " received its gradient twice in one backward (reentrant backward, e.g. activation "
                        "checkpointing, is not supported)";
      }
      return;
    }
    locally_used[i] = 1;
    if (!rebuilt && !rebuild_due) arrival.push_back(i);
    // The first iteration of a static graph is reduced after backward,
    // once it is known which parameters take part.
    if (recording_static()) return;
    if (!unused_marked) {
      unused_marked = true;
      if (options.static_graph) {
        for (size_t k = 0; k < params.size(); ++k) {
          if (static_unused[k]) make_ready(k, false);
        }
      } else {
        for (size_t k : unused_now) make_ready(k, false);
      }
    }
    if (ready[i]) {
      if (pending_error.empty()) {
        pending_error = "DistributedDataParallel: parameter " + names[i] +
                        " received a gradient although the forward's outputs do not depend on it (it was "
                        "reduced as unused); compute the loss from the outputs of forward only";
      }
      return;
    }
    make_ready(i, true);
  }

  // find_unused_parameters: which parameters the outputs cannot reach.
  void after_forward(const std::vector<at::Tensor>& outputs) {
    std::lock_guard<std::mutex> lock(mu);
    if (!require_sync || !options.find_unused_parameters || options.static_graph || !at::GradMode::is_enabled()) {
      return;
    }
    std::unordered_set<const torch::autograd::Node*> seen;
    std::vector<torch::autograd::Node*> stack;
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      const auto edge = torch::autograd::impl::gradient_edge(t);
      if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
    }
    while (!stack.empty()) {
      torch::autograd::Node* node = stack.back();
      stack.pop_back();
      for (const auto& e : node->next_edges()) {
        if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
      }
    }
    unused_now.clear();
    for (size_t k = 0; k < params.size(); ++k) {
      if (!seen.count(accumulators[k].get())) unused_now.push_back(k);
    }
  }

  // Runs once at the end of a synchronised backward, before backward()
  // returns: waits for every bucket and writes the averages back.
  void finish_backward() {
    std::unique_lock<std::mutex> lock(mu);
    const bool first_static = recording_static();
    const bool tolerate_unused = options.find_unused_parameters || options.static_graph;
    std::vector<std::string> missing, changed;
    for (size_t i = 0; i < params.size(); ++i) {
      if (ready[i]) continue;
      if (first_static || tolerate_unused) {
        if (options.static_graph && !first_static && !locally_used[i]) changed.push_back(names[i]);
        make_ready(i, locally_used[i] != 0);
      } else {
        missing.push_back(names[i]);
      }
    }
    std::vector<std::shared_ptr<Work>> works;
    for (auto& b : buckets) {
      if (b.work) works.push_back(b.work);
    }
    // Which parameters got a gradient on any rank: those that got none
    // anywhere keep their .grad as it was.
    at::Tensor used;
    if ((options.find_unused_parameters && !options.static_graph) || first_static) {
      used = at::empty({static_cast<int64_t>(params.size())}, at::kInt);
      for (size_t i = 0; i < params.size(); ++i) used.data_ptr<int32_t>()[i] = locally_used[i];
      works.push_back(pg->all_reduce(used, {ReduceOp::SUM}));
    }
    lock.unlock();
    try {
      for (auto& w : works) w->wait();
    } catch (...) {
      // A failed reduction (timeout, dead peer, broken hook) fails this
      // backward; the next iteration starts clean.
      lock.lock();
      reset_iteration();
      throw;
    }
    lock.lock();
    std::vector<char> globally_used(params.size(), 1);
    if (used.defined()) {
      for (size_t i = 0; i < params.size(); ++i) globally_used[i] = used.data_ptr<int32_t>()[i] > 0;
    } else if (options.static_graph) {
      for (size_t i = 0; i < params.size(); ++i) globally_used[i] = !static_unused[i];
    }
    const bool direct = direct_mode();
    for (size_t k = 0; k < next_launch; ++k) {
      Bucket& b = buckets[k];
      // A hook may return its result in a tensor of its own.
      const auto result = b.work && !direct ? b.work->result() : std::vector<at::Tensor>{};
      if (!result.empty() && result[0].defined() && result[0].data_ptr() != b.flat.data_ptr()) {
        if (result[0].numel() != b.flat.numel()) {
          pending_error = "DistributedDataParallel: the communication hook returned " +
                          std::to_string(result[0].numel()) + " elements for bucket " + std::to_string(k) +
                          " of " + std::to_string(b.flat.numel());
          continue;
        }
        b.flat.copy_(result[0].reshape({-1}));
      }
      for (size_t s = 0; s < b.members.size(); ++s) {
        const size_t m = b.members[s];
        if (!globally_used[m]) continue;
        if (direct && !b.pieces[s].is_same(b.views[s])) continue;  // reduced in its .grad
        at::Tensor& grad = params[m].mutable_grad();
        if (!grad.defined()) {
          grad = grads_in_buckets ? b.views[s] : b.views[s].clone();
        } else if (grad.data_ptr() != b.views[s].data_ptr()) {
          grad.copy_(b.views[s]);
        }
      }
    }
    if (first_static) {
      static_unused.assign(params.size(), 0);
      for (size_t i = 0; i < params.size(); ++i) static_unused[i] = !globally_used[i];
      static_recorded = true;
    }
    if (!missing.empty()) {
      std::string list;
      for (size_t k = 0; k < missing.size() && k < 10; ++k) list += (k ? ", " : "") + missing[k];
      if (missing.size() > 10) list += " and " + std::to_string(missing.size() - 10) + " more";
      pending_error = "DistributedDataParallel: " + std::to_string(missing.size()) +
                      " parameter(s) received no gradient in the last backward, so their buckets were never "
                      "reduced: " + list +
                      ". Make every parameter take part in the loss, leave them out of the wrapped module, or "
                      "construct DistributedDataParallel with find_unused_parameters = true";
    } else if (!changed.empty()) {
      pending_error = "DistributedDataParallel: static_graph is set, but parameter " + changed[0] +
                      " received no gradient in this backward although it did in the first one; the graph "
                      "changed, so construct DistributedDataParallel without static_graph";
    } else if (!rebuilt && pending_error.empty() &&
               (options.static_graph || !options.find_unused_parameters)) {
      // The arrival order, then whatever never arrived, last registered first.
      arrival_for_rebuild = std::move(arrival);
      for (size_t k = params.size(); k-- > 0;) {
        if (!locally_used[k]) arrival_for_rebuild.push_back(k);
      }
      rebuild_due = true;
    }
    reset_iteration();
  }
};

namespace {

struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::weak_ptr<DataParallel::State> s, size_t i) : state(std::move(s)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto s = state.lock()) s->on_gradient(index);
    return outputs;
  }
  std::weak_ptr<DataParallel::State> state;
  size_t index;
};

}  // namespace

DataParallel::DataParallel(torch::nn::Module& module, DistributedDataParallelOptions options)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  if (options.bucket_cap_mb <= 0 || options.first_bucket_cap_mb <= 0) {
    throw UsageError("DistributedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be positive");
  }
  s.pg = options.process_group ? options.process_group : default_group();
  if (!s.pg) throw UsageError("DistributedDataParallel: call init_process_group first, or pass a process_group");
  s.options = std::move(options);
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    s.names.push_back(item.key());
    s.params.push_back(item.value());
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) s.buffers.push_back(b);

  // Every rank must hold the same parameters, in the same order.
  std::string mine;
  for (size_t i = 0; i < s.params.size(); ++i) mine += describe_param(s.names[i], s.params[i]) + "\n";
  const auto all = all_gather_strings(*s.pg, mine);
  const auto ref = split_lines(all[0]);
  for (int r = 1; r < s.pg->size(); ++r) {
    if (all[r] == all[0]) continue;
    const auto theirs = split_lines(all[r]);
    size_t k = 0;
    while (k < ref.size() && k < theirs.size() && ref[k] == theirs[k]) ++k;
    const std::string a = k < ref.size() ? "'" + ref[k] + "'" : "nothing";
    const std::string b = k < theirs.size() ? "'" + theirs[k] + "'" : "nothing";
    throw UsageError("DistributedDataParallel: rank " + std::to_string(s.pg->ranks()[r]) +
                     "'s model differs from rank " + std::to_string(s.pg->ranks()[0]) + "'s at parameter #" +
                     std::to_string(k) + ": rank " + std::to_string(s.pg->ranks()[0]) + " has " + a + ", rank " +
                     std::to_string(s.pg->ranks()[r]) + " has " + b + ". Build the same model on every rank");
  }

  // Start from rank 0's parameters and buffers.
  {
    at::NoGradGuard no_grad;
    std::vector<std::shared_ptr<Work>> works;
    for (auto& p : s.params) works.push_back(s.pg->broadcast(p.detach(), {0}));
    for (auto& b : s.buffers) works.push_back(s.pg->broadcast(b.detach(), {0}));
    for (auto& w : works) w->wait();
  }

  // Gradients in symmetric bucket memory where the group has it (shm) and
  // every parameter is on the CPU.
  bool all_cpu = true;
  for (const auto& p : s.params) all_cpu = all_cpu && p.device().is_cpu();
  s.symmetric_buckets = all_cpu && s.pg->has_symmetric_memory();
  s.grads_in_buckets = s.options.gradient_as_bucket_view || s.symmetric_buckets;
  s.build_buckets(assign_buckets(s.param_infos(), State::mib(s.options.first_bucket_cap_mb),
                                 State::mib(s.options.bucket_cap_mb)));
  s.ready.assign(s.params.size(), false);
  s.locally_used.assign(s.params.size(), 0);
  s.reset_iteration();

  // Hooks after each parameter's gradient accumulation. Autograd holds its
  // accumulators weakly: keep them, or the hooks never fire.
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(s.params[i]);
    acc->add_post_hook(std::make_unique<ReadyHook>(state_, i));
    s.accumulators.push_back(std::move(acc));
  }
}

DataParallel::~DataParallel() = default;

void DataParallel::before_forward() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.pending_error.empty()) {
      std::string e = std::move(s.pending_error);
      s.pending_error.clear();
      throw UsageError(e);
    }
    s.maybe_rebuild();
  }
  if (s.options.broadcast_buffers && !s.buffers.empty()) {
    at::NoGradGuard no_grad;
    std::vector<std::shared_ptr<Work>> works;
    for (auto& b : s.buffers) works.push_back(s.pg->broadcast(b.detach(), {0}));
    for (auto& w : works) w->wait();
  }
}

bool DataParallel::wants_outputs() const {
  return state_->options.find_unused_parameters && !state_->options.static_graph;
}

void DataParallel::after_forward(const std::vector<at::Tensor>& outputs) { state_->after_forward(outputs); }

void DataParallel::register_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!hook) throw UsageError("DistributedDataParallel::register_comm_hook: the hook is empty");
  if (state_->hook) {
    throw UsageError("DistributedDataParallel::register_comm_hook may be called only once per instance");
  }
  state_->hook = std::move(hook);
  state_->builtin = Builtin::kNone;
}

void DataParallel::register_comm_hook(const std::shared_ptr<ProcessGroup>& group, BuiltinHookFn fn) {
  if (!fn) throw UsageError("DistributedDataParallel::register_comm_hook: the hook is empty");
  Builtin kind = Builtin::kNone;
  if (fn == &allreduce_hook) kind = Builtin::kAllreduce;
  if (fn == &fp16_compress_hook) kind = Builtin::kFp16;
  if (fn == &bf16_compress_hook) kind = Builtin::kBf16;
  if (fn == &noop_hook) kind = Builtin::kNoop;
  auto resolved = kind == Builtin::kNone ? group : group_or_default(group, "communication hook");
  register_comm_hook([group, fn](GradBucket& b) { return fn(group, b); });
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->builtin = kind;
  state_->builtin_group = std::move(resolved);
}

void DataParallel::set_require_sync(bool on) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->require_sync = on;
}

bool DataParallel::require_sync() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->require_sync;
}

const std::shared_ptr<ProcessGroup>& DataParallel::process_group() const { return state_->pg; }

std::vector<std::vector<size_t>> DataParallel::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : state_->buckets) out.push_back(b.members);
  return out;
}

}  // namespace tdist::detail
