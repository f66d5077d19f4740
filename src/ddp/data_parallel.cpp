// DataParallel: the coordinator behind DistributedDataParallel<M>. At
// construction it checks the model across ranks, broadcasts rank 0's
// parameters and buffers, lays out the buckets and hooks the gradients;
// per iteration it routes each gradient arrival to the bucket reducer
// (applying find_unused_parameters and static_graph), and at the end of
// backward waits for the reductions, writes them back and decides what the
// next forward must report or rebuild.
//
// Owns (in State): the options, the parameters and buffers, the reducer
// (src/ddp/bucket_reducer.h), the ready tracker (src/autograd/grad_ready.h),
// the rebuild (src/ddp/bucket_rebuild.h), and the per-iteration state of
// unused parameters and errors.
// Threading: one mutex (State::mu) guards all of it and the parts above;
// gradient hooks and the end-of-backward callback run on the backward
// thread, the rest on the training thread. The end of backward waits for
// the buckets with the mutex released; before_forward's rebuild waits for
// its broadcast (and the new buckets' symmetric memory) holding it, which
// is safe because no backward of this model runs then.
// Lifetime: State is shared; the hooks and the queued callback hold it
// weakly, so a DataParallel may die with hooks still on the accumulators.
#include <ATen/ATen.h>

#include <mutex>
#include <optional>
#include <unordered_set>

#include "autograd/grad_ready.h"
#include "autograd/weight_fence.h"
#include "ddp/bucket_assignment.h"
#include "ddp/bucket_rebuild.h"
#include "ddp/bucket_reducer.h"
#include "ddp/model_check.h"
#include "process_group/group_or_default.h"
#include "trace/flight_recorder.h"
#include "tdist/ddp.h"

namespace tdist::detail {

namespace {

size_t mib(double mb) { return static_cast<size_t>(mb * 1024 * 1024); }

}  // namespace

struct DataParallel::State : GradReadyListener {
  State(std::shared_ptr<ProcessGroup> group, DistributedDataParallelOptions o)
      : pg(std::move(group)),
        options(std::move(o)),
        rebuild(mib(options.first_bucket_cap_mb), mib(options.bucket_cap_mb)) {}

  std::shared_ptr<ProcessGroup> pg;
  DistributedDataParallelOptions options;
  std::vector<at::Tensor> params;  // that require grad, in registration order
  std::vector<std::string> names;
  std::vector<at::Tensor> buffers;

  std::optional<BucketReducer> reducer;    // once the bucket memory is chosen
  std::optional<GradReadyTracker> tracker; // once State is shared (its hooks hold it weakly)
  BucketRebuild rebuild;                   // once, after the first synchronised iteration

  std::mutex mu;
  bool require_sync = true;
  // Whether the last forward's backward synchronises: require_sync and
  // grad mode when forward ran (PyTorch's rule: no_sync is decided at
  // forward time, so a forward inside the guard and its backward after it
  // only accumulate, and the other way round).
  bool forward_sync = true;
  // Per synchronised iteration.
  std::vector<size_t> unused_now;    // find_unused_parameters: unreachable from the last forward's outputs
  bool unused_marked = false;
  std::string pending_error;
  // Join (tdist/join.h) with divide_by_initial_world_size off: the number
  // of ranks that synchronise this iteration, when fewer than the world
  // (the averages are then rescaled to them); 0 otherwise.
  int join_divisor = 0;
  // static_graph: the first iteration records which parameters the graph
  // leaves without gradient on every rank; later ones reuse it.
  bool static_recorded = false;
  std::vector<char> static_unused;

  bool recording_static() const { return options.static_graph && !static_recorded; }

  void reset_iteration() {
    reducer->reset();
    tracker->reset();
    rebuild.forget_arrivals();
    unused_now.clear();
    unused_marked = false;
    join_divisor = 0;
  }

  // Join: one all_reduce over the group, element r: 0 when rank r has
  // joined, 1 when it trains without synchronising (no_sync, no grad), 3
  // when its backward synchronises. Returns the highest rank that trains
  // (whose buffers everyone takes, as PyTorch's DDP does in a Join) and
  // how many synchronise.
  struct JoinRound {
    int root = 0;
    int syncing = 0;
  };
  JoinRound join_round(bool training, bool sync) {
    const int world = pg->size();
    at::Tensor f = at::zeros({world}, at::kInt);
    if (training) f[pg->rank()] = sync ? 3 : 1;
    const c10::Device dev = params.empty() ? c10::Device(c10::kCPU) : params[0].device();
    at::Tensor on_device = dev.is_cpu() ? f : f.to(dev);
    AllreduceOptions o;
    o.async_op = false;
    pg->all_reduce(on_device, o)->wait();
    if (!dev.is_cpu()) f = on_device.cpu();
    JoinRound r;
    r.root = -1;
    for (int k = 0; k < world; ++k) {
      const int32_t v = f.data_ptr<int32_t>()[k];
      if (v != 0 && v != 1 && v != 3) {
        throw CollectiveMismatchError("DistributedDataParallel: rank " + std::to_string(pg->rank()) +
                                      " got a Join round that no DDP made: the ranks' collectives are out of step "
                                      "(is every rank's model in the Join?)");
      }
      if (v != 0) r.root = k;
      r.syncing += v == 3;
    }
    if (r.root < 0) r.root = 0;
    return r;
  }

  // REQUIRES mu (held through `lock`, released while waiting). The end of
  // an iteration's reductions: when the iteration needs to know which
  // parameters got a gradient on any rank, all-reduces this rank's
  // counts (`locally`; zeros for a joined rank's shadow, nullptr), then
  // waits for that and every launched bucket. Returns the summed counts
  // (undefined when none were needed). A failed reduction (timeout, dead
  // peer, broken hook) fails the iteration: the next one starts clean.
  at::Tensor reduce_used_and_wait(std::unique_lock<std::mutex>& lock, bool first_static,
                                  const std::vector<char>* locally) {
    std::vector<std::shared_ptr<Work>> works = reducer->launched_work();
    at::Tensor used;
    if ((options.find_unused_parameters && !options.static_graph) || first_static) {
      used = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
      if (locally) {
        for (size_t i = 0; i < params.size(); ++i) used.data_ptr<int32_t>()[i] = (*locally)[i];
      }
      works.push_back(pg->all_reduce(used, {ReduceOp::SUM}));
    }
    lock.unlock();
    try {
      for (auto& w : works) w->wait();
    } catch (...) {
      lock.lock();
      reset_iteration();
      throw;
    }
    lock.lock();
    return used;
  }

  // REQUIRES mu.
  void set_hook(CommHook hook) {
    if (reducer->has_hook()) {
      throw UsageError("DistributedDataParallel::register_comm_hook may be called only once per instance");
    }
    reducer->set_hook(std::move(hook));
  }

  // Before a forward, on every rank alike: adopt rank 0's gradient arrival
  // order from the first iteration as the bucket order.
  void maybe_rebuild() {
    auto assignment = rebuild.take_due(*pg, params);
    if (assignment && *assignment != reducer->assignment()) reducer->build(*assignment);
  }

  // The last synchronised backward failed part-way (a hook or the model's
  // own backward threw), so its end never ran and the user already has its
  // exception: let the buckets it launched finish (they write into bucket
  // memory, and every rank launched the same ones), then start clean. Their
  // errors are that backward's and are not raised again.
  void drop_failed_backward(std::unique_lock<std::mutex>& lock) {
    std::vector<std::shared_ptr<Work>> works = reducer->launched_work();
    lock.unlock();
    for (auto& w : works) {
      try {
        w->wait();
      } catch (...) {
      }
    }
    lock.lock();
    reset_iteration();
  }

  // A parameter's gradient has been accumulated (autograd thread).
  void on_grad_ready(size_t i) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!forward_sync) return;
    tracker->arm_end_of_backward();
    if (!tracker->mark_arrived(i)) {
      if (pending_error.empty()) {
        pending_error = "DistributedDataParallel: parameter " + names[i] +
                        " received its gradient twice in one backward (reentrant backward, e.g. activation "
                        "checkpointing, is not supported)";
      }
      return;
    }
    rebuild.record_arrival(i);
    // The first iteration of a static graph is reduced after backward,
    // once it is known which parameters take part.
    if (recording_static()) return;
    if (!unused_marked) {
      unused_marked = true;
      if (options.static_graph) {
        for (size_t k = 0; k < params.size(); ++k) {
          if (static_unused[k]) reducer->mark_ready(k, false);
        }
      } else {
        for (size_t k : unused_now) reducer->mark_ready(k, false);
      }
    }
    if (reducer->ready(i)) {
      if (pending_error.empty()) {
        pending_error = "DistributedDataParallel: parameter " + names[i] +
                        " received a gradient although the forward's outputs do not depend on it (it was "
                        "reduced as unused); compute the loss from the outputs of forward only";
      }
      return;
    }
    reducer->mark_ready(i, true);
  }

  // find_unused_parameters: which parameters the outputs cannot reach.
  void after_forward(const std::vector<at::Tensor>& outputs) {
    std::lock_guard<std::mutex> lock(mu);
    if (!forward_sync || !options.find_unused_parameters || options.static_graph) {
      return;
    }
    unused_now = tracker->unreachable_from(outputs);
  }

  // Runs once at the end of a synchronised backward, before backward()
  // returns: waits for every bucket and writes the averages back.
  void on_backward_end() override {
    // A checkpoint's pending copy of the weights, while the buckets
    // travel: the optimizer's step comes next (autograd/weight_fence.h).
    detail::wait_weight_fences();
    std::unique_lock<std::mutex> lock(mu);
    const bool first_static = recording_static();
    const bool tolerate_unused = options.find_unused_parameters || options.static_graph;
    const std::vector<char> locally_used = tracker->arrived();  // its gradient arrived in this backward
    std::vector<std::string> missing, changed;
    for (size_t i = 0; i < params.size(); ++i) {
      if (reducer->ready(i)) continue;
      if (first_static || tolerate_unused) {
        if (options.static_graph && !first_static && !locally_used[i]) changed.push_back(names[i]);
        reducer->mark_ready(i, locally_used[i] != 0);
      } else {
        missing.push_back(names[i]);
      }
    }
    // Which parameters got a gradient on any rank: those that got none
    // anywhere keep their .grad as it was.
    const at::Tensor used = reduce_used_and_wait(lock, first_static, &locally_used);
    std::vector<char> globally_used(params.size(), 1);
    if (used.defined()) {
      for (size_t i = 0; i < params.size(); ++i) globally_used[i] = used.data_ptr<int32_t>()[i] > 0;
    } else if (options.static_graph) {
      for (size_t i = 0; i < params.size(); ++i) globally_used[i] = !static_unused[i];
    }
    std::string hook_error = reducer->write_back(globally_used);
    if (!hook_error.empty()) pending_error = std::move(hook_error);
    if (join_divisor > 0) {
      // Averaged over the world, joined ranks' zeros included: over the
      // ranks that synchronised instead.
      at::NoGradGuard no_grad;
      const double scale = static_cast<double>(pg->size()) / join_divisor;
      for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor& g = params[i].mutable_grad();
        if (globally_used[i] && g.defined()) g.mul_(scale);
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
    } else if (!rebuild.done() && pending_error.empty() &&
               (options.static_graph || !options.find_unused_parameters)) {
      rebuild.schedule(locally_used);
    }
    reset_iteration();
  }

  // On a rank that has joined (tdist/join.h), one iteration of the ranks
  // that still train: the same collectives as before_forward and a
  // synchronised backward, with zeros as this rank's gradients. Its own
  // .grad is not written back.
  void shadow_iteration() {
    const JoinRound r = join_round(/*training=*/false, /*sync=*/false);
    {
      std::unique_lock<std::mutex> lock(mu);
      if (tracker->armed()) drop_failed_backward(lock);
      maybe_rebuild();
    }
    if (options.broadcast_buffers) broadcast_from(*pg, buffers, r.root);
    if (r.syncing == 0) return;
    std::unique_lock<std::mutex> lock(mu);
    const bool first_static = recording_static();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!reducer->ready(i)) reducer->mark_ready(i, false);  // launches every bucket, in index order
    }
    const at::Tensor used = reduce_used_and_wait(lock, first_static, nullptr);
    if (first_static) {
      static_unused.assign(params.size(), 0);
      for (size_t i = 0; i < params.size(); ++i) static_unused[i] = used.data_ptr<int32_t>()[i] == 0;
      static_recorded = true;
    }
    if (!rebuild.done() && (options.static_graph || !options.find_unused_parameters)) {
      rebuild.schedule(std::vector<char>(params.size(), 0));
    }
    reset_iteration();
  }

  // Once every rank has joined: everyone takes the parameters and buffers
  // of the highest rank among the last to join (PyTorch's choice).
  void sync_final_model(bool is_last_joiner) {
    at::Tensor t = at::tensor({static_cast<int64_t>(is_last_joiner ? pg->rank() : -1)}, at::kLong);
    AllreduceOptions o;
    o.op = ReduceOp::MAX;
    o.async_op = false;
    pg->all_reduce(t, o)->wait();
    const int root = static_cast<int>(t.item<int64_t>());
    if (root < 0 || root >= pg->size()) {
      throw CollectiveMismatchError("DistributedDataParallel: Join's final round named no last rank to join");
    }
    broadcast_from(*pg, params, root);
    broadcast_from(*pg, buffers, root);
  }
};

namespace {

class DdpJoinHook : public JoinHook {
 public:
  explicit DdpJoinHook(std::shared_ptr<DataParallel::State> state) : state_(std::move(state)) {}
  void main_hook() override { state_->shadow_iteration(); }
  void post_hook(bool is_last_joiner) override { state_->sync_final_model(is_last_joiner); }

 private:
  std::shared_ptr<DataParallel::State> state_;
};

}  // namespace

DataParallel::DataParallel(torch::nn::Module& module, DistributedDataParallelOptions options) {
  if (options.bucket_cap_mb <= 0 || options.first_bucket_cap_mb <= 0) {
    throw UsageError("DistributedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be positive");
  }
  auto pg = options.process_group ? options.process_group : default_group();
  if (!pg) throw UsageError("DistributedDataParallel: call init_process_group first, or pass a process_group");
  if (options.device_id) module.to(*options.device_id);
  state_ = std::make_shared<State>(std::move(pg), std::move(options));
  State& s = *state_;
  std::optional<c10::Device> device;
  // Each tensor once, under its first name: a tied parameter (one tensor
  // registered under several names) is one bucket entry with one
  // accumulator, whose gradient (summed over its uses by autograd) is
  // reduced once.
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    if (!device) device = item.value().device();
    if (item.value().device() != *device) {
      throw UsageError("DistributedDataParallel: parameter '" + item.key() + "' is on " + item.value().device().str() +
                       " but '" + s.names.at(0) + "' is on " + device->str() +
                       "; a module trains on one device (pass device_id to move it there)");
    }
    s.names.push_back(item.key());
    s.params.push_back(item.value());
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) {
    if (seen.insert(b.unsafeGetTensorImpl()).second) s.buffers.push_back(b);
  }

  // Every rank must hold the same parameters, in the same order.
  check_same_model(*s.pg, s.names, s.params);

  // Start from rank 0's parameters and buffers.
  broadcast_from_rank0(*s.pg, s.params);
  broadcast_from_rank0(*s.pg, s.buffers);

  // Gradients in symmetric bucket memory where the group has it (shm) and
  // every parameter is on the CPU.
  bool all_cpu = true;
  for (const auto& p : s.params) all_cpu = all_cpu && p.device().is_cpu();
  s.reducer.emplace(s.pg, s.params, s.options.gradient_as_bucket_view, all_cpu && s.pg->has_symmetric_memory());
  s.reducer->build(
      assign_buckets(param_infos(s.params), mib(s.options.first_bucket_cap_mb), mib(s.options.bucket_cap_mb)));
  s.tracker.emplace(s.params, state_);
  s.reset_iteration();
}

DataParallel::~DataParallel() = default;

void DataParallel::before_forward(const JoinOptions* join) {
  State& s = *state_;
  if (at::GradMode::is_enabled()) detail::FlightRecorder::get().note_step();  // tdist-run's steps/s
  int buffer_root = 0, join_divisor = 0;
  bool sync;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    sync = s.require_sync && at::GradMode::is_enabled();
    // A failed earlier backward is named before the Join round, so that
    // joined ranks are not left waiting in it.
    if (s.tracker->armed()) s.drop_failed_backward(lock);
    if (!s.pending_error.empty()) {
      std::string e = std::move(s.pending_error);
      s.pending_error.clear();
      throw UsageError(e);
    }
  }
  if (join) {
    const State::JoinRound r = s.join_round(/*training=*/true, sync);
    buffer_root = r.root;
    if (!join->divide_by_initial_world_size && sync && r.syncing < s.pg->size()) join_divisor = r.syncing;
  }
  {
    std::unique_lock<std::mutex> lock(s.mu);
    s.maybe_rebuild();
    s.join_divisor = join_divisor;
    s.forward_sync = sync;
  }
  if (s.options.broadcast_buffers) broadcast_from(*s.pg, s.buffers, buffer_root);
}

std::unique_ptr<JoinHook> DataParallel::join_hook(const JoinOptions& options) {
  (void)options;  // divide_by_initial_world_size is read per iteration, from the Join's options
  return std::make_unique<DdpJoinHook>(state_);
}

c10::Device DataParallel::device() const {
  return state_->params.empty() ? c10::Device(c10::kCPU) : state_->params[0].device();
}

bool DataParallel::wants_outputs() const {
  return state_->options.find_unused_parameters && !state_->options.static_graph;
}

void DataParallel::after_forward(const std::vector<at::Tensor>& outputs) { state_->after_forward(outputs); }

void DataParallel::register_comm_hook(CommHook hook) {
  if (!hook) throw UsageError("DistributedDataParallel::register_comm_hook: the hook is empty");
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->set_hook(std::move(hook));
}

void DataParallel::register_comm_hook(const std::shared_ptr<ProcessGroup>& group, BuiltinHookFn fn) {
  if (!fn) throw UsageError("DistributedDataParallel::register_comm_hook: the hook is empty");
  Builtin kind = Builtin::kNone;
  if (fn == &allreduce_hook) kind = Builtin::kAllreduce;
  if (fn == &fp16_compress_hook) kind = Builtin::kFp16;
  if (fn == &bf16_compress_hook) kind = Builtin::kBf16;
  if (fn == &noop_hook) kind = Builtin::kNoop;
  auto resolved = kind == Builtin::kNone ? group : group_or_default(group, "communication hook");
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->set_hook([group, fn](GradBucket& b) { return fn(group, b); });
  state_->reducer->set_builtin(kind, std::move(resolved));
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
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->reducer->assignment();
}

bool DataParallel::buckets_rebuilt() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->rebuild.done();
}

void DataParallel::check_bucket_indices(const std::vector<std::vector<size_t>>& assignment) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  check_layout(assignment);
}

void DataParallel::set_bucket_indices(const std::vector<std::vector<size_t>>& assignment) {
  std::lock_guard<std::mutex> lock(state_->mu);
  check_layout(assignment);
  if (assignment != state_->reducer->assignment()) state_->reducer->build(assignment);
  state_->rebuild.mark_done();
}

void DataParallel::check_layout(const std::vector<std::vector<size_t>>& assignment) const {
  std::vector<char> seen(state_->params.size(), 0);
  size_t count = 0;
  for (const auto& bucket : assignment) {
    for (const size_t k : bucket) {
      if (k >= seen.size() || seen[k]) {
        throw UsageError("DistributedDataParallel: a bucket layout that is not a permutation of the " +
                         std::to_string(seen.size()) + " parameters");
      }
      seen[k] = 1;
      ++count;
    }
  }
  if (count != seen.size()) {
    throw UsageError("DistributedDataParallel: a bucket layout of " + std::to_string(count) + " parameters for " +
                     std::to_string(seen.size()));
  }
}

}  // namespace tdist::detail
