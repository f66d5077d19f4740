// ProcessGroup: checks tensors on the caller's thread, queues the op, and
// runs it on the group's worker thread through its comm::Backend.
#include "tdist/process_group.h"

#include <ATen/ATen.h>
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>

#include "comm/backend.h"
#include "comm/reduce.h"
#include "process_group/tensor_util.h"
#include "tdist/rendezvous.h"
#include "util/bytes.h"
#include "util/env.h"

namespace tdist {

namespace {

using Body = std::function<std::vector<at::Tensor>(comm::Deadline)>;

// The group whose tasks this thread runs right now: its worker thread, or a
// thread that runs a task inline while waiting for it (null elsewhere).
thread_local const void* current_worker = nullptr;

struct Task {
  std::shared_ptr<Work> work;
  Milliseconds timeout;
  Body body;
};

comm::ReduceOp to_comm(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return comm::ReduceOp::kSum;
    case ReduceOp::AVG: return comm::ReduceOp::kAvg;
    case ReduceOp::PRODUCT: return comm::ReduceOp::kProduct;
    case ReduceOp::MIN: return comm::ReduceOp::kMin;
    case ReduceOp::MAX: return comm::ReduceOp::kMax;
    case ReduceOp::BAND: return comm::ReduceOp::kBand;
    case ReduceOp::BOR: return comm::ReduceOp::kBor;
    case ReduceOp::BXOR: return comm::ReduceOp::kBxor;
  }
  throw UsageError("unknown ReduceOp " + std::to_string(static_cast<int>(op)));
}

std::string shape_of(const at::Tensor& t) {
  std::string s = std::string(c10::toString(t.scalar_type())) + "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

const char* reduce_name(ReduceOp op) { return comm::reduce_op_name(to_comm(op)); }

// After finishing an op, the worker polls for the next one this long before
// sleeping: back-to-back collectives then need no wake-up.
constexpr auto kWorkerSpin = std::chrono::microseconds(30);

}  // namespace

struct ProcessGroup::Impl {
  std::unique_ptr<comm::Backend> backend;
  std::shared_ptr<Store> store;  // private to this group
  int rank = 0;
  int size = 1;
  std::vector<int> ranks;
  std::string backend_name;
  std::string group_name;
  Milliseconds timeout = kDefaultCollectiveTimeout;
  std::string master_addr;     // handed to network backends
  uint64_t next_seq = 0;       // under mu
  uint64_t run_seq = 0;        // worker thread only (TDIST_DEBUG=detail)
  int next_subgroup = 0;       // caller thread only

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;
  // A task is running (on the worker, or inline on a thread waiting for
  // it): tasks run one at a time, in queue order.
  bool running = false;
  // How Work::wait reaches the group: a thread that waits for the task at
  // the front of an idle queue runs it itself, saving two thread hand-offs
  // (waking the worker, and the worker waking it). stop() closes the gate.
  struct Gate {
    std::mutex mu;  // held while a task runs inline
    Impl* impl = nullptr;
  };
  std::shared_ptr<Gate> gate = std::make_shared<Gate>();
  // Tasks queued from a callback on this group's worker thread go ahead of
  // everything else, in the order queued (see enqueue).
  size_t continuations = 0;
  std::atomic<size_t> queued{0};
  bool stopping = false;
  std::thread worker;

  void start() {
    gate->impl = this;
    worker = std::thread([this] { run(); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> g(gate->mu);  // waits for an inline task
      gate->impl = nullptr;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
  }

  // With TDIST_DEBUG=detail every collective first publishes a fingerprint
  // (op, dtype, shape, root, reduce op) in the store and compares it with
  // every other rank's, so that mismatches are caught on any backend.
  bool debug_detail = false;

  void check_fingerprint(uint64_t seq, const std::string& mine, comm::Deadline d) {
    const std::string prefix = "fingerprint/" + std::to_string(seq) + "/";
    store->set(prefix + std::to_string(rank), mine);
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
    const auto left = std::chrono::duration_cast<Milliseconds>(d - comm::Clock::now());
    std::vector<Bytes> all;
    try {
      all = store->multi_get(keys, std::max(left, Milliseconds(1)));
    } catch (const TimeoutError&) {
      std::string missing;
      for (int r = 0; r < size; ++r) {
        if (!store->check({keys[r]})) missing += (missing.empty() ? "" : ", ") + std::to_string(ranks[r]);
      }
      throw TimeoutError("TDIST_DEBUG=detail: " + mine + " #" + std::to_string(seq) + " in group '" + group_name +
                         "' timed out; rank(s) " + missing + " never arrived");
    }
    if (seq > 0) store->delete_key("fingerprint/" + std::to_string(seq - 1) + "/" + std::to_string(rank));
    for (const auto& fp : all) {
      if (to_string(fp) == mine) continue;
      std::string msg = "ranks called different collectives at step #" + std::to_string(seq) + " of group '" +
                        group_name + "' (TDIST_DEBUG=detail):";
      for (int r = 0; r < size; ++r) msg += "\n  rank " + std::to_string(ranks[r]) + ": " + to_string(all[r]);
      throw CollectiveMismatchError(msg);
    }
  }

  std::shared_ptr<Work> enqueue(const char* name, const std::optional<Milliseconds>& t, Body body,
                                std::string fingerprint = "") {
    auto work = std::make_shared<Work>();
    if (debug_detail && !fingerprint.empty()) {
      // Fingerprints are matched by the order ops run in, the same on every
      // rank (chained ops included), not by enqueue order, which is not.
      body = [this, fp = std::move(fingerprint), inner = std::move(body)](comm::Deadline d) {
        check_fingerprint(run_seq++, fp, d);
        return inner(d);
      };
    }
    const Milliseconds to = t.value_or(timeout);
    if (to.count() <= 0) throw UsageError(std::string(name) + ": the timeout must be positive");
    work->set_runner([g = gate, w = work.get()] { return run_inline(g, w); });
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) throw UsageError(std::string(name) + ": the process group '" + group_name + "' is shut down");
      work->set_info(next_seq++, name);  // under the lock: chains enqueue from the worker too
      // A continuation (queued by a callback that the worker runs as an op
      // completes, e.g. the next step of a hook's chain) runs next, before
      // anything other threads queued meanwhile: so chained collectives are
      // issued in the same order on every rank, however threads interleave.
      if (current_worker == this) {
        queue.insert(queue.begin() + static_cast<std::ptrdiff_t>(continuations++), Task{work, to, std::move(body)});
      } else {
        queue.push_back(Task{work, to, std::move(body)});
      }
      queued.fetch_add(1, std::memory_order_release);
    }
    cv.notify_one();
    return work;
  }

  // Work::wait's way in: runs w's task on this thread if it is next, nothing
  // runs, and no other thread is running one inline; false otherwise.
  static bool run_inline(const std::shared_ptr<Gate>& gate, const Work* w) {
    std::unique_lock<std::mutex> g(gate->mu, std::try_to_lock);
    if (!g.owns_lock() || !gate->impl) return false;
    Impl& self = *gate->impl;
    Task task;
    {
      std::lock_guard<std::mutex> lock(self.mu);
      if (self.running || self.queue.empty() || self.queue.front().work.get() != w) return false;
      task = std::move(self.queue.front());
      self.queue.pop_front();
      self.continuations = 0;
      self.queued.fetch_sub(1, std::memory_order_relaxed);
      self.running = true;
    }
    // Callbacks of the task run here too: what they queue goes first, as on
    // the worker.
    const void* outer = current_worker;
    current_worker = &self;
    execute(task);
    current_worker = outer;
    {
      std::lock_guard<std::mutex> lock(self.mu);
      self.running = false;
    }
    self.cv.notify_all();
    return true;
  }

  static void execute(Task& task) {
    try {
      auto result = task.body(comm::Clock::now() + task.timeout);
      task.work->mark_completed(std::move(result));
    } catch (...) {
      task.work->mark_failed(std::current_exception());
    }
  }

  void run() {
    current_worker = this;
    for (;;) {
      Task task;
      {
        const auto spin_end = std::chrono::steady_clock::now() + kWorkerSpin;
        for (int i = 0; queued.load(std::memory_order_acquire) == 0; ++i) {
          if ((i & 63) == 0 && std::chrono::steady_clock::now() >= spin_end) break;
          _mm_pause();
        }
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !running && (!queue.empty() || stopping); });
        if (queue.empty()) return;  // stopping, and everything queued has run
        task = std::move(queue.front());
        queue.pop_front();
        continuations = 0;
        queued.fetch_sub(1, std::memory_order_relaxed);
        running = true;
      }
      execute(task);
      std::lock_guard<std::mutex> lock(mu);
      running = false;
    }
  }

  comm::DataType check(const at::Tensor& t, const char* op, const char* what = "tensor") const {
    return detail::check_tensor(t, op, what, backend->supports_cuda());
  }

  // Point-to-point and root arguments are group ranks.
  void check_rank(int r, const char* op, const char* what) const {
    if (r < 0 || r >= size) {
      throw UsageError(std::string(op) + ": " + what + " " + std::to_string(r) + " is not a rank of group '" +
                       group_name + "' (size " + std::to_string(size) + ")");
    }
  }
};

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) { impl_->start(); }

ProcessGroup::~ProcessGroup() { impl_->stop(); }

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
const std::vector<int>& ProcessGroup::ranks() const { return impl_->ranks; }
const std::string& ProcessGroup::backend_name() const { return impl_->backend_name; }
const std::string& ProcessGroup::group_name() const { return impl_->group_name; }
Milliseconds ProcessGroup::timeout() const { return impl_->timeout; }

// ---- collectives --------------------------------------------------------------

namespace {

// The wire type of an all-reduce: the tensors' own, or a narrower float
// for float32 tensors (AllreduceOptions::wire_dtype).
comm::DataType wire_type(const AllreduceOptions& o, comm::DataType dt, const char* op) {
  if (!o.wire_dtype) return dt;
  const auto wire = detail::to_comm_dtype(*o.wire_dtype, op, "wire_dtype");
  if (wire == dt) return dt;
  if (dt != comm::DataType::kFloat32 || !comm::can_convert(wire, dt)) {
    throw UsageError(std::string(op) + ": wire_dtype " + c10::toString(*o.wire_dtype) +
                     " needs float32 tensors and a float16 or bfloat16 wire type (tensors are " +
                     comm::dtype_name(dt) + ")");
  }
  return wire;
}

std::string wire_note(comm::DataType dt, comm::DataType wire) {
  return wire == dt ? "" : std::string(" as ") + comm::dtype_name(wire);
}

}  // namespace

std::shared_ptr<Work> ProcessGroup::all_reduce(const at::Tensor& tensor, const AllreduceOptions& o) {
  const auto dt = impl_->check(tensor, "all_reduce");
  const auto op = to_comm(o.op);
  const auto wire = wire_type(o, dt, "all_reduce");
  comm::check_reduction(wire, op);
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("all_reduce", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    if (wire == dt) {
      b->all_reduce(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), dt, op, d);
    } else {
      b->all_reduce_coalesced_as({comm::Piece{tensor.data_ptr(), static_cast<size_t>(tensor.numel())}}, dt, wire,
                                 op, d);
    }
    return {tensor};
  }, "all_reduce " + shape_of(tensor) + wire_note(dt, wire) + " " + reduce_name(o.op));
}

std::shared_ptr<Work> ProcessGroup::all_reduce_coalesced(const std::vector<at::Tensor>& tensors,
                                                         const AllreduceOptions& o) {
  if (tensors.empty()) throw UsageError("all_reduce_coalesced: no tensors given");
  const auto dt = impl_->check(tensors[0], "all_reduce_coalesced", "tensors[0]");
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string what = "tensors[" + std::to_string(i) + "]";
    impl_->check(tensors[i], "all_reduce_coalesced", what.c_str());
    detail::check_same_dtype(tensors[0], tensors[i], "all_reduce_coalesced");
    total += tensors[i].numel();
  }
  const auto op = to_comm(o.op);
  const auto wire = wire_type(o, dt, "all_reduce_coalesced");
  comm::check_reduction(wire, op);
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("all_reduce_coalesced", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    std::vector<comm::Piece> pieces;
    pieces.reserve(tensors.size());
    for (const auto& t : tensors) pieces.push_back({t.data_ptr(), static_cast<size_t>(t.numel())});
    b->all_reduce_coalesced_as(pieces, dt, wire, op, d);  // wire == dt: a plain all_reduce_coalesced
    return tensors;
  }, "all_reduce_coalesced " + std::string(c10::toString(tensors[0].scalar_type())) + " x " +
         std::to_string(total) + wire_note(dt, wire) + " " + reduce_name(o.op));
}

// ---- symmetric memory ------------------------------------------------------------

bool ProcessGroup::has_symmetric_memory() const { return impl_->backend->has_symmetric_memory(); }

bool ProcessGroup::is_symmetric(const at::Tensor& t) const {
  return t.defined() && t.device().is_cpu() && t.is_contiguous() && t.numel() > 0 &&
         impl_->backend->is_symmetric(t.data_ptr(), t.nbytes());
}

at::Tensor ProcessGroup::empty_symmetric(at::IntArrayRef sizes, at::ScalarType dtype, const CollectiveOptions& o) {
  for (int64_t s : sizes) {
    if (s < 0) throw UsageError("empty_symmetric: negative size " + std::to_string(s));
  }
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  if (!has_symmetric_memory()) return at::zeros(sizes, options);
  const std::vector<int64_t> shape(sizes.begin(), sizes.end());
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  comm::Backend* b = impl_->backend.get();
  const std::string group = impl_->group_name;
  auto work = impl_->enqueue("empty_symmetric", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    std::string why_not;
    std::shared_ptr<void> block = b->allocate_symmetric(bytes, d, &why_not);
    if (!block) {
      std::fprintf(stderr, "tdist: empty_symmetric in group '%s': no symmetric memory (%s); using ordinary memory\n",
                   group.c_str(), why_not.c_str());
      return {at::zeros(shape, options)};
    }
    void* data = block.get();
    return {at::from_blob(data, shape, [block = std::move(block)](void*) mutable { block.reset(); }, options)};
  }, "empty_symmetric " + std::to_string(bytes) + " bytes");
  work->wait();
  return work->result().at(0);
}

std::shared_ptr<Work> ProcessGroup::broadcast(const at::Tensor& tensor, const BroadcastOptions& o) {
  impl_->check(tensor, "broadcast");
  impl_->check_rank(o.root, "broadcast", "root");
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("broadcast", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    b->broadcast(tensor.data_ptr(), tensor.nbytes(), o.root, d);
    return {tensor};
  }, "broadcast " + shape_of(tensor) + " root " + std::to_string(o.root));
}

std::shared_ptr<Work> ProcessGroup::reduce(const at::Tensor& tensor, const ReduceOptions& o) {
  const auto dt = impl_->check(tensor, "reduce");
  impl_->check_rank(o.root, "reduce", "root");
  const auto op = to_comm(o.op);
  comm::check_reduction(dt, op);
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("reduce", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    b->reduce(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), dt, op, o.root, d);
    return {tensor};
  }, "reduce " + shape_of(tensor) + " " + reduce_name(o.op) + " root " + std::to_string(o.root));
}

std::shared_ptr<Work> ProcessGroup::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input,
                                                           const CollectiveOptions& o) {
  impl_->check(input, "all_gather_into_tensor", "input");
  impl_->check(output, "all_gather_into_tensor", "output");
  detail::check_same_dtype(output, input, "all_gather_into_tensor");
  detail::check_numel(output, input.numel() * size(), "all_gather_into_tensor", "output");
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("all_gather_into_tensor", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    b->all_gather(input.data_ptr(), output.data_ptr(), input.nbytes(), d);
    return {output};
  }, "all_gather " + shape_of(input));
}

std::shared_ptr<Work> ProcessGroup::all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                               const CollectiveOptions& o) {
  impl_->check(input, "all_gather", "input");
  detail::check_list(outputs, size(), input, "all_gather", "outputs", impl_->backend->supports_cuda());
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("all_gather", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    at::Tensor flat = at::empty({input.numel() * static_cast<int64_t>(outputs.size())}, input.options());
    b->all_gather(input.data_ptr(), flat.data_ptr(), input.nbytes(), d);
    detail::unflatten_into(flat, outputs);
    return outputs;
  }, "all_gather " + shape_of(input));
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                                                          const ReduceScatterOptions& o) {
  const auto dt = impl_->check(output, "reduce_scatter_tensor", "output");
  impl_->check(input, "reduce_scatter_tensor", "input");
  detail::check_same_dtype(output, input, "reduce_scatter_tensor");
  detail::check_numel(input, output.numel() * size(), "reduce_scatter_tensor", "input");
  const auto op = to_comm(o.op);
  comm::check_reduction(dt, op);
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("reduce_scatter_tensor", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    b->reduce_scatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()), dt, op, d);
    return {output};
  }, "reduce_scatter " + shape_of(output) + " " + reduce_name(o.op));
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                                   const ReduceScatterOptions& o) {
  const auto dt = impl_->check(output, "reduce_scatter", "output");
  detail::check_list(inputs, size(), output, "reduce_scatter", "inputs", impl_->backend->supports_cuda());
  const auto op = to_comm(o.op);
  comm::check_reduction(dt, op);
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("reduce_scatter", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    at::Tensor flat = detail::flatten(inputs);
    b->reduce_scatter(flat.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()), dt, op, d);
    return {output};
  }, "reduce_scatter " + shape_of(output) + " " + reduce_name(o.op));
}

std::shared_ptr<Work> ProcessGroup::gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                           const RootOptions& o) {
  impl_->check(input, "gather", "input");
  impl_->check_rank(o.root, "gather", "root");
  const bool is_root = rank() == o.root;
  if (is_root) {
    detail::check_list(outputs, size(), input, "gather", "outputs", impl_->backend->supports_cuda());
  } else if (!outputs.empty()) {
    throw UsageError("gather: outputs must be empty on non-root rank " + std::to_string(rank()));
  }
  comm::Backend* b = impl_->backend.get();
  const int world = size();
  return impl_->enqueue("gather", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    at::Tensor flat = is_root ? at::empty({input.numel() * world}, input.options()) : at::Tensor();
    b->gather(input.data_ptr(), is_root ? flat.data_ptr() : nullptr, input.nbytes(), o.root, d);
    if (is_root) detail::unflatten_into(flat, outputs);
    return outputs;
  }, "gather " + shape_of(input) + " root " + std::to_string(o.root));
}

std::shared_ptr<Work> ProcessGroup::scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                            const RootOptions& o) {
  impl_->check(output, "scatter", "output");
  impl_->check_rank(o.root, "scatter", "root");
  const bool is_root = rank() == o.root;
  if (is_root) {
    detail::check_list(inputs, size(), output, "scatter", "inputs", impl_->backend->supports_cuda());
  } else if (!inputs.empty()) {
    throw UsageError("scatter: inputs must be empty on non-root rank " + std::to_string(rank()));
  }
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("scatter", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    at::Tensor flat = is_root ? detail::flatten(inputs) : at::Tensor();
    b->scatter(is_root ? flat.data_ptr() : nullptr, output.data_ptr(), output.nbytes(), o.root, d);
    return {output};
  }, "scatter " + shape_of(output) + " root " + std::to_string(o.root));
}

std::shared_ptr<Work> ProcessGroup::all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                                      const std::vector<int64_t>& output_split_sizes,
                                                      const std::vector<int64_t>& input_split_sizes,
                                                      const CollectiveOptions& o) {
  impl_->check(input, "all_to_all_single", "input");
  impl_->check(output, "all_to_all_single", "output");
  detail::check_same_dtype(output, input, "all_to_all_single");
  auto send = detail::split_bytes(input, input_split_sizes, size(), "all_to_all_single", "input");
  auto recv = detail::split_bytes(output, output_split_sizes, size(), "all_to_all_single", "output");
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("all_to_all_single", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    b->all_to_all(input.data_ptr(), send.bytes, send.offsets, output.data_ptr(), recv.bytes, recv.offsets, d);
    return {output};
  }, std::string("all_to_all ") + c10::toString(input.scalar_type()));
}

std::shared_ptr<Work> ProcessGroup::all_to_all(const std::vector<at::Tensor>& outputs,
                                               const std::vector<at::Tensor>& inputs, const CollectiveOptions& o) {
  if (static_cast<int>(inputs.size()) != size() || static_cast<int>(outputs.size()) != size()) {
    throw UsageError("all_to_all: needs " + std::to_string(size()) + " inputs and outputs, got " +
                     std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  }
  for (const auto& t : inputs) impl_->check(t, "all_to_all", "inputs[i]");
  for (const auto& t : outputs) {
    impl_->check(t, "all_to_all", "outputs[i]");
    detail::check_same_dtype(t, inputs[0], "all_to_all");
  }
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("all_to_all", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    at::Tensor in = detail::flatten(inputs);
    std::vector<size_t> send_bytes, send_off, recv_bytes, recv_off;
    size_t off = 0;
    for (const auto& t : inputs) {
      send_bytes.push_back(t.nbytes());
      send_off.push_back(off);
      off += t.nbytes();
    }
    off = 0;
    for (const auto& t : outputs) {
      recv_bytes.push_back(t.nbytes());
      recv_off.push_back(off);
      off += t.nbytes();
    }
    at::Tensor out = at::empty({static_cast<int64_t>(off)}, at::TensorOptions().dtype(at::kByte));
    b->all_to_all(in.data_ptr(), send_bytes, send_off, out.data_ptr(), recv_bytes, recv_off, d);
    for (size_t r = 0; r < outputs.size(); ++r) {
      detail::copy_bytes(outputs[r].data_ptr(), static_cast<uint8_t*>(out.data_ptr()) + recv_off[r], recv_bytes[r]);
    }
    return outputs;
  }, std::string("all_to_all ") + c10::toString(inputs[0].scalar_type()));
}

std::shared_ptr<Work> ProcessGroup::barrier(const CollectiveOptions& o) {
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("barrier", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    b->barrier(d);
    return {};
  }, "barrier");
}

std::shared_ptr<Work> ProcessGroup::send(const at::Tensor& tensor, int dst, int tag, const CollectiveOptions& o) {
  impl_->check(tensor, "send");
  impl_->check_rank(dst, "send", "destination");
  if (dst == rank()) throw UsageError("send: rank " + std::to_string(dst) + " cannot send to itself");
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("send", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    b->send(tensor.data_ptr(), tensor.nbytes(), dst, tag, d);
    return {tensor};
  });
}

std::shared_ptr<Work> ProcessGroup::recv(const at::Tensor& tensor, int src, int tag, const CollectiveOptions& o) {
  impl_->check(tensor, "recv");
  impl_->check_rank(src, "recv", "source");
  if (src == rank()) throw UsageError("recv: rank " + std::to_string(src) + " cannot receive from itself");
  comm::Backend* b = impl_->backend.get();
  return impl_->enqueue("recv", o.timeout, [=](comm::Deadline d) -> std::vector<at::Tensor> {
    b->recv(tensor.data_ptr(), tensor.nbytes(), src, tag, d);
    return {tensor};
  });
}

// ---- groups -------------------------------------------------------------------

namespace {

// "host/boot-id": equal for two processes exactly when they share a kernel,
// and so can share memory.
std::string host_identity() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(f, boot);
  return std::string(host) + "/" + boot;
}

std::shared_ptr<ProcessGroup> make_group(std::shared_ptr<Store> store, int rank, std::vector<int> ranks,
                                         std::string backend, std::string name, Milliseconds timeout,
                                         const std::string& master_addr) {
  const int size = static_cast<int>(ranks.size());
  if (backend == "auto") {
    store->set("host/" + std::to_string(rank), host_identity());
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back("host/" + std::to_string(r));
    const auto hosts = store->multi_get(keys, timeout);
    const bool one_host = std::all_of(hosts.begin(), hosts.end(), [&](const Bytes& h) { return h == hosts[0]; });
    backend = one_host || !comm::has_backend("gloo") ? "shm" : "gloo";
    if (!one_host && backend == "shm") {
      throw UsageError("process group '" + name + "' spans several hosts, but this build of tdist has no gloo backend");
    }
  }
  comm::BackendContext ctx;
  ctx.store = std::make_shared<PrefixStore>("backend", store);
  ctx.rank = rank;
  ctx.size = size;
  ctx.global_ranks = ranks;
  ctx.group_name = name;
  ctx.timeout = timeout;
  ctx.master_addr = master_addr;
  auto impl = std::make_unique<ProcessGroup::Impl>();
  impl->backend = comm::create_backend(backend, ctx);
  impl->store = std::move(store);
  impl->rank = rank;
  impl->size = size;
  impl->ranks = std::move(ranks);
  impl->backend_name = backend;
  impl->group_name = std::move(name);
  impl->timeout = timeout;
  impl->master_addr = master_addr;
  const char* debug = std::getenv("TDIST_DEBUG");
  impl->debug_detail = debug && std::string(debug) == "detail";
  return std::make_shared<ProcessGroup>(std::move(impl));
}

std::mutex g_default_mu;
std::shared_ptr<ProcessGroup> g_default;

}  // namespace

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(std::vector<int> ranks, const NewGroupOptions& options) {
  if (ranks.empty()) throw UsageError("new_group: the list of ranks is empty");
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    impl_->check_rank(ranks[i], "new_group", "rank");
    if (i > 0 && ranks[i] == ranks[i - 1]) {
      throw UsageError("new_group: rank " + std::to_string(ranks[i]) + " is listed twice");
    }
  }
  const int id = impl_->next_subgroup++;
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  std::vector<int> world_ranks;
  for (int r : ranks) world_ranks.push_back(impl_->ranks[r]);
  const std::string name = impl_->group_name + "/" + std::to_string(id);
  auto store = std::make_shared<PrefixStore>("group" + std::to_string(id), impl_->store);
  return make_group(store, static_cast<int>(it - ranks.begin()), std::move(world_ranks),
                    options.backend.empty() ? impl_->backend_name : options.backend, name,
                    options.timeout.value_or(impl_->timeout), impl_->master_addr);
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  if (options.timeout.count() <= 0) throw UsageError("init_process_group: the timeout must be positive");
  RendezvousOptions ro;
  ro.init_method = options.init_method;
  ro.store = options.store;
  ro.rank = options.rank;
  ro.world_size = options.world_size;
  ro.timeout = options.timeout;
  std::string master_addr;
  if (!ro.store) {
    const InitMethod m = parse_init_method(ro);
    if (m.scheme != "file") master_addr = m.host;
  }
  RendezvousResult world = rendezvous(ro);
  std::vector<int> ranks(world.world_size);
  for (int r = 0; r < world.world_size; ++r) ranks[r] = r;
  auto store = std::make_shared<PrefixStore>("tdist/pg/" + options.group_name, world.store);
  auto group = make_group(store, world.rank, std::move(ranks), options.backend, options.group_name, options.timeout,
                          master_addr);
  std::lock_guard<std::mutex> lock(g_default_mu);
  g_default = group;
  return group;
}

std::shared_ptr<ProcessGroup> default_group() {
  std::lock_guard<std::mutex> lock(g_default_mu);
  return g_default;
}

bool is_initialized() { return default_group() != nullptr; }

std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const NewGroupOptions& options) {
  auto world = default_group();
  if (!world) throw UsageError("new_group: call init_process_group first");
  return world->new_group(std::move(ranks), options);
}

void destroy_process_group(const std::shared_ptr<ProcessGroup>& group) {
  std::shared_ptr<ProcessGroup> dropped;
  {
    std::lock_guard<std::mutex> lock(g_default_mu);
    if (!group || group == g_default) dropped = std::move(g_default);
  }
}

}  // namespace tdist
