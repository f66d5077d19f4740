// ProcessGroup::Impl: what a group is made of. The group's identity (its
// ranks, name, backend, timeout, private store), its comm::Backend, the
// TaskQueue its ops run on, and, with TDIST_DEBUG=detail, the collective
// check. process_group.cpp maps tensor ops onto it; init.cpp builds it.
//
// Threading: the identity is immutable after construction; enqueue may be
// called from any thread (TaskQueue's contract); next_subgroup is the
// caller's thread only (new_group is collective and so called in order).
// Lifetime: stop() (ProcessGroup's destructor) drains the queue before the
// backend goes: queued ops use the backend.
#pragma once

#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/backend.h"
#include "comm/op_label.h"
#include "process_group/device_runtime.h"
#include "process_group/collective_check.h"
#include "process_group/op_counts.h"
#include "process_group/task_queue.h"
#include "process_group/tensor_util.h"
#include "tdist/process_group.h"
#include "trace/flight_recorder.h"
#include "util/recycling_alloc.h"

namespace tdist {

struct ProcessGroup::Impl {
  std::unique_ptr<comm::Backend> backend;
  std::shared_ptr<Store> store;  // private to this group
  int rank = 0;
  int size = 1;
  std::vector<int> ranks;
  std::string backend_name;
  std::string group_name;
  Milliseconds timeout = kDefaultCollectiveTimeout;
  std::string master_addr;  // handed to network backends
  int next_subgroup = 0;
  std::optional<detail::CollectiveCheck> collective_check;  // TDIST_DEBUG=detail
  detail::OpCounts counts;  // enqueue may run on any thread: atomics, no lock
  detail::FrGroup* recorder = nullptr;  // the flight recorder's record of the group; null: off
  // CUDA ops (device_runtime.h), made at the group's first one: the group's
  // stream on its device and, when the backend moves host memory only, the
  // staging backend over it (destroyed before `backend`).
  std::mutex device_mu;
  std::unique_ptr<detail::DeviceQueue> device_queue;
  // Backend "auto" where tdist has its nccl plugin: CUDA tensors go to a
  // backend of their own, `cuda_backend_name` ("nccl"), made with
  // `cuda_backend_ctx` at the group's first CUDA op (every rank calls its
  // ops in the same order, so every rank makes it at the same op), as
  // PyTorch's default "cpu:gloo,cuda:nccl". Empty: CUDA tensors go to
  // `backend`, itself or staged through host memory.
  std::string cuda_backend_name;
  comm::BackendContext cuda_backend_ctx;
  std::unique_ptr<comm::Backend> cuda_backend;  // under device_mu
  std::exception_ptr cuda_backend_error;  // its making failed: every later CUDA op raises it; under device_mu
  std::unique_ptr<comm::Backend> staged;
  std::unique_ptr<detail::TaskQueue> queue;  // last: started once the rest is set

  void start() { queue = std::make_unique<detail::TaskQueue>(group_name); }
  void stop() {
    if (queue) queue->stop();
  }

  // Queues an op and counts it (collective_counts) with the bytes of this
  // rank's input and output. With TDIST_DEBUG=detail, describe() (a
  // callable returning the op's signature, e.g. "all_reduce float[4]
  // SUM") is called and checked across ranks just before the op runs;
  // otherwise it is never called, so an op costs no string.
  // With the op's dtype (a comm::DataType; -1: none, a barrier) and, for
  // send/recv, the peer: what the flight recorder keeps of it.
  struct Traffic {
    int64_t input_bytes = 0;
    int64_t output_bytes = 0;
    int dtype = -1;
    int peer = -1;
  };
  // `body(deadline)` runs the op and returns Work's result; it is called
  // at most once, so it may move what it captured into that result (a
  // synchronous op's tensor then takes one reference, not two). `async_op`
  // false: the op has run when this returns (on this thread when the queue
  // is idle: TaskQueue::run_now), its error thrown from here. `device`:
  // where the op's tensors live (op_device); for a CUDA device the body
  // runs in the group's DeviceQueue scope, ordered after what the caller
  // queued on its current stream.
  template <typename Body, typename Describe>
  std::shared_ptr<Work> enqueue(detail::GroupOp op, Traffic traffic, const std::optional<Milliseconds>& t,
                                bool async_op, Body&& body, Describe&& describe,
                                const std::optional<c10::Device>& device = std::nullopt) {
    const char* name = detail::group_op_name(op);
    std::string sig;  // empty: unchecked (debug off, or an op with no signature: send, recv)
    if (collective_check) sig = describe();
    const Milliseconds to = t.value_or(timeout);
    if (to.count() <= 0) throw UsageError(std::string(name) + ": the timeout must be positive");
    if (!async_op && !device) {
      if (auto work = run_now(op, name, traffic, to, body, sig)) return work;
    }
    if (!async_op) queue->refuse_own_thread(name);
    const detail::FrHandle rec = record(op, traffic, to);
    try {
      return enqueue_recorded(op, name, traffic, to, async_op, std::forward<Body>(body), std::move(sig), device, rec);
    } catch (const std::exception& e) {
      rec.failed(e);  // no-op when the op's task already failed with it
      throw;
    }
  }

  // A synchronous CPU op run on this thread when the queue is idle
  // (TaskQueue::run_now): recorded as started (one record, numbered
  // already), and its Work made completed from a recycled block (no heap,
  // no lock, no clock read of its own). nullptr when the queue is busy.
  template <typename Body>
  std::shared_ptr<Work> run_now(detail::GroupOp op, const char* name, const Traffic& traffic, Milliseconds to,
                                Body& body, const std::string& sig) {
    detail::FrHandle rec;
    detail::OpResult result;
    std::optional<uint64_t> label;
    try {
      label = queue->run_now(name, to, [&](comm::Deadline d) {
        counts.add_running(op, traffic.input_bytes, traffic.output_bytes);
        rec = record(op, traffic, to, comm::current_op_label());
        if (!sig.empty()) collective_check->check(sig, d);
        result = body(d);
        rec.completed();
      }, is_p2p(op) ? detail::OpCount::kP2p : detail::OpCount::kCollective, backend->lazy_deadline());
    } catch (const std::exception& e) {
      rec.failed(e);  // here, once the queue is free again (a timeout dumps the ring)
      throw;
    }
    if (!label) return nullptr;
    return std::allocate_shared<Work>(detail::RecyclingAllocator<Work>{}, Work::CompletedTag{}, *label,
                                      &detail::group_op_string(op), std::move(result.one), std::move(result.many));
  }

  static bool is_p2p(detail::GroupOp op) { return op == detail::GroupOp::kSend || op == detail::GroupOp::kRecv; }

  // The flight recorder's record of an op as queued (numbered when it
  // starts: FrHandle::started).
  detail::FrHandle record(detail::GroupOp op, const Traffic& traffic, Milliseconds to, uint64_t started = 0) {
    if (!recorder) return {};
    detail::FrOp o;
    o.name = detail::group_op_name(op);
    o.p2p = is_p2p(op);
    o.dtype = traffic.dtype;
    if (traffic.dtype >= 0) {
      const auto elem = static_cast<int64_t>(comm::dtype_size(static_cast<comm::DataType>(traffic.dtype)));
      o.input_numel = traffic.input_bytes / elem;
      o.output_numel = traffic.output_bytes / elem;
    }
    o.timeout_ms = to.count();
    o.peer = traffic.peer;
    return detail::FlightRecorder::get().record(recorder, o, started);
  }

  template <typename Body>
  std::shared_ptr<Work> enqueue_recorded(detail::GroupOp op, const char* name, const Traffic& traffic, Milliseconds to,
                                         bool async_op, Body&& body, std::string sig,
                                         const std::optional<c10::Device>& device, const detail::FrHandle& rec) {
    const detail::OpCount count = is_p2p(op) ? detail::OpCount::kP2p : detail::OpCount::kCollective;
    detail::TaskBody task = std::forward<Body>(body);
    if (!sig.empty()) {
      task = [this, sig = std::move(sig), inner = std::move(task)](comm::Deadline d) {
        collective_check->check(sig, d);
        return inner(d);
      };
    }
    if (rec) {
      task = [rec, inner = std::move(task)](comm::Deadline d) {
        rec.started();
        try {
          auto result = inner(d);
          rec.completed();
          return result;
        } catch (const std::exception& e) {
          rec.failed(e);
          throw;
        }
      };
    }
    std::shared_ptr<detail::DeviceEvent> ready;
    detail::DeviceQueue* dq = nullptr;
    std::shared_ptr<std::shared_ptr<detail::DeviceEvent>> end;  // CUDA ops only: no allocation for CPU ones
    if (device) {
      end = std::make_shared<std::shared_ptr<detail::DeviceEvent>>();
      dq = device_queue_for(*device, name);
      ready = detail::cuda_runtime(name).record_current(*device);
      // A backend on host memory has the data in place when the body ends;
      // one that queues GPU work leaves the wait to the consumer's stream.
      comm::Backend& owner = device_backend(*device, name);
      const bool host_wait = !owner.supports_cuda();
      task = [dq, ready, end, host_wait, index = device->index(), inner = std::move(task)](comm::Deadline d) {
        detail::OpDeviceScope on_device(index);
        auto scope = dq->enter(*ready);
        auto result = inner(d);
        *end = scope->finish(host_wait);
        return result;
      };
    }
    auto work = queue->enqueue(name, to, std::move(task), count);
    if (device) {
      work->set_device_wait([end, errors = device_backend(*device, name).async_errors()] {
        if (*end) (*end)->block_current();
        if (errors) errors->rethrow_if_failed();
      });
    }
    counts.add(op, traffic.input_bytes, traffic.output_bytes);
    if (!async_op) work->wait();
    return work;
  }

  // The device of an op's tensors (each argument a tensor or a list of
  // them): nullopt for the CPU. UsageError when they are on different
  // devices.
  template <typename... Parts>
  std::optional<c10::Device> op_device(const char* op, const Parts&... parts) const {
    std::optional<c10::Device> dev;
    (note_device(op, parts, dev), ...);
    if (dev && dev->is_cpu()) return std::nullopt;
    return dev;
  }
  static void note_device(const char* op, const at::Tensor& t, std::optional<c10::Device>& dev) {
    if (!t.defined()) return;
    if (!dev) {
      dev = t.device();
    } else if (*dev != t.device()) {
      throw UsageError(std::string(op) + ": tensors on " + dev->str() + " and " + t.device().str() +
                       "; one op's tensors must be on one device");
    }
  }
  static void note_device(const char* op, const std::vector<at::Tensor>& ts, std::optional<c10::Device>& dev) {
    for (const auto& t : ts) note_device(op, t, dev);
  }

  // The backend an op on `device` calls: the group's own; for CUDA tensors
  // the one device_backend names, or, where that moves host memory only,
  // the staging one over it.
  comm::Backend* backend_for(const std::optional<c10::Device>& device, const char* op) {
    if (!device) return backend.get();
    comm::Backend& owner = device_backend(*device, op);
    if (owner.supports_cuda()) return &owner;
    std::lock_guard<std::mutex> lock(device_mu);
    if (!staged) staged = detail::cuda_runtime(op).stage(owner);
    return staged.get();
  }

  // The backend that owns the group's CUDA ops: `backend`, or with "auto"
  // the cuda_backend, made here at the first CUDA op on that op's device.
  comm::Backend& device_backend(c10::Device device, const char* op) {
    if (cuda_backend_name.empty()) return *backend;
    std::lock_guard<std::mutex> lock(device_mu);
    if (cuda_backend_error) std::rethrow_exception(cuda_backend_error);  // not again: its store keys are spent
    if (!cuda_backend) {
      detail::OpDeviceScope on_device(device.index());
      try {
        cuda_backend = comm::create_backend(cuda_backend_name, cuda_backend_ctx);
      } catch (const TimeoutError&) {
        cuda_backend_error = std::current_exception();  // names the ranks that never came
        throw;
      } catch (const std::exception& e) {
        cuda_backend_error = std::make_exception_ptr(
            Error(std::string(op) + " on " + device.str() + " in group '" + group_name + "' (backend \"auto\": " +
                  cuda_backend_name + " for CUDA tensors): " + e.what() +
                  "\nTo move CUDA tensors through host memory instead, ask for backend \"shm\" or \"gloo\"."));
        std::rethrow_exception(cuda_backend_error);
      }
    }
    return *cuda_backend;
  }

  detail::DeviceQueue* device_queue_for(c10::Device device, const char* op) {
    std::lock_guard<std::mutex> lock(device_mu);
    if (!device_queue) device_queue = detail::cuda_runtime(op).make_queue(device);
    if (device_queue->device() != device) {
      throw UsageError(std::string(op) + ": group '" + group_name + "' runs its CUDA ops on " +
                       device_queue->device().str() + ", not " + device.str() +
                       "; use one device per process (c10::cuda::set_device(local_rank))");
    }
    return device_queue.get();
  }

  comm::DataType check(const at::Tensor& t, const char* op, const char* what = "tensor") const {
    return detail::check_tensor(t, op, what, allows_cuda());
  }
  // CUDA tensors: on the backend itself, or staged through host memory
  // when tdist was built with its CUDA plugin.
  bool allows_cuda() const {
    return backend->supports_cuda() || !cuda_backend_name.empty() || detail::cuda_support_built();
  }

  // Point-to-point and root arguments are group ranks.
  void check_rank(int r, const char* op, const char* what) const {
    if (r < 0 || r >= size) {
      throw UsageError(std::string(op) + ": " + what + " " + std::to_string(r) + " is not a rank of group '" +
                       group_name + "' (size " + std::to_string(size) + ")");
    }
  }
};

}  // namespace tdist
