// DeviceRuntime: what libtdist needs of CUDA, implemented in the plugin
// libtdist_cuda.so (src/cuda/) so that libtdist itself never links a CUDA
// library and keeps loading on machines without one.
//
// How a collective on CUDA tensors is ordered (docs/cuda.md):
// - On the caller's thread, when the op is queued, record_current() records
//   an event on the tensors' current stream: the op will wait for what the
//   caller queued before it (the producer).
// - The op's body runs inside a DeviceQueue::Scope: the group's own stream
//   waits for that event (on the GPU, not the host) and is the current
//   stream while the body runs, so every copy and kernel of the body is
//   ordered after the producer and before the end event.
// - Scope::finish() records the end event. For a backend that works on host
//   memory (shm, gloo, mpi, through staging) the host waits for it there: the
//   data is in place when the Work completes. For a backend that queues GPU
//   work (nccl) it does not: Work::wait() makes the caller's current stream
//   wait for the end event instead, with no host synchronisation.
//
// Threading: record_current on any thread; a DeviceQueue is used by one op
// at a time (the group's TaskQueue runs one op at a time).
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "comm/backend.h"

namespace tdist::detail {

// An event recorded on a CUDA stream.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // Makes the calling thread's current stream (of the event's device) wait
  // for the event, on the GPU.
  virtual void block_current() = 0;
  // Blocks the host until the event has passed.
  virtual void synchronize() = 0;
};

// One group's stream on one device, with the scope its ops run in.
class DeviceQueue {
 public:
  class Scope {
   public:
    virtual ~Scope() = default;  // restores the thread's current stream
    // Records the end event on the group's stream; with host_wait, the host
    // waits for it before returning.
    virtual std::shared_ptr<DeviceEvent> finish(bool host_wait) = 0;
  };
  virtual ~DeviceQueue() = default;
  virtual c10::Device device() const = 0;
  // The group's stream waits for `ready` and becomes the current stream of
  // this thread until the scope ends.
  virtual std::unique_ptr<Scope> enter(DeviceEvent& ready) = 0;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  // An event on the calling thread's current stream of `device`.
  virtual std::shared_ptr<DeviceEvent> record_current(c10::Device device) = 0;
  virtual std::unique_ptr<DeviceQueue> make_queue(c10::Device device) = 0;
  // A backend over `inner` (which moves host memory) for buffers in device
  // memory: each call copies its inputs into pinned host memory, runs the
  // inner call, and copies the outputs back, on the current stream (the
  // DeviceQueue's, inside a Scope). `inner` must outlive it.
  virtual std::unique_ptr<comm::Backend> stage(comm::Backend& inner) = 0;
};

// The CUDA device index of the op whose body runs on this thread now (set
// by ProcessGroup around a body on CUDA tensors), or -1: a backend that
// serves both (nccl) so knows where an op's buffers are without asking the
// driver about pointers.
int current_op_device();
class OpDeviceScope {
 public:
  explicit OpDeviceScope(int device);
  ~OpDeviceScope();
  OpDeviceScope(const OpDeviceScope&) = delete;
  OpDeviceScope& operator=(const OpDeviceScope&) = delete;

 private:
  int outer_;
};

// The CUDA runtime, loading libtdist_cuda.so on first use (once per
// process). UsageError naming `op` when this build has no CUDA support or
// the plugin cannot be loaded.
DeviceRuntime& cuda_runtime(const char* op);
// Whether this build of tdist was built with its CUDA plugin.
bool cuda_support_built();

}  // namespace tdist::detail

// The plugin's entry point (C name), returning its runtime.
extern "C" {
using tdist_cuda_runtime_fn = tdist::detail::DeviceRuntime* (*)();
}
inline constexpr const char* kTdistCudaRuntimeEntry = "tdist_cuda_runtime";
inline constexpr const char* kTdistCudaPluginFile = "libtdist_cuda.so";
