// The CUDA plugin's runtime (process_group/device_runtime.h): events on
// streams, the group's stream and the scope its ops run in, and staging.
// libtdist loads this file's library (libtdist_cuda.so) at the first op on
// a CUDA tensor.
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

#include "cuda/cuda_check.h"
#include "cuda/staging_backend.h"
#include "process_group/device_runtime.h"

namespace tdist::cuda {

namespace {

using detail::DeviceEvent;
using detail::DeviceQueue;

class CudaEvent final : public DeviceEvent {
 public:
  CudaEvent(c10::Device device, cudaStream_t stream) : device_(device) {
    c10::cuda::CUDAGuard guard(device.index());
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "creating an event");
    check(cudaEventRecord(event_, stream), "recording an event");
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void block_current() override { block(c10::cuda::getCurrentCUDAStream(device_.index()).stream()); }
  void block(cudaStream_t stream) {
    check(cudaStreamWaitEvent(stream, event_, 0), "making a stream wait for an event");
  }
  void synchronize() override { check(cudaEventSynchronize(event_), "waiting for an event"); }

 private:
  c10::Device device_;
  cudaEvent_t event_ = nullptr;
};

class CudaQueue final : public DeviceQueue {
 public:
  explicit CudaQueue(c10::Device device)
      : device_(device), stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}

  c10::Device device() const override { return device_; }

  std::unique_ptr<Scope> enter(DeviceEvent& ready) override {
    static_cast<CudaEvent&>(ready).block(stream_.stream());
    return std::make_unique<CudaScope>(device_, stream_);
  }

 private:
  class CudaScope final : public Scope {
   public:
    CudaScope(c10::Device device, c10::cuda::CUDAStream stream) : device_(device), stream_(stream), guard_(stream) {}
    std::shared_ptr<DeviceEvent> finish(bool host_wait) override {
      auto end = std::make_shared<CudaEvent>(device_, stream_.stream());
      if (host_wait) end->synchronize();
      return end;
    }

   private:
    c10::Device device_;
    c10::cuda::CUDAStream stream_;
    c10::cuda::CUDAStreamGuard guard_;  // the current stream (and device) while the op runs
  };

  c10::Device device_;
  c10::cuda::CUDAStream stream_;
};

class CudaRuntime final : public detail::DeviceRuntime {
 public:
  std::shared_ptr<DeviceEvent> record_current(c10::Device device) override {
    return std::make_shared<CudaEvent>(device, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  }
  std::unique_ptr<DeviceQueue> make_queue(c10::Device device) override {
    return std::make_unique<CudaQueue>(device);
  }
  std::unique_ptr<comm::Backend> stage(comm::Backend& inner) override { return make_staging_backend(inner); }
};

}  // namespace

}  // namespace tdist::cuda

extern "C" __attribute__((visibility("default"))) tdist::detail::DeviceRuntime* tdist_cuda_runtime() {
  static tdist::cuda::CudaRuntime runtime;
  return &runtime;
}
