// NcclBackend: collectives on CUDA memory through one NCCL communicator per
// group (docs/cuda.md).
//
// - Set-up: rank 0's unique id goes through the group's store; the
//   communicator is created non-blocking on the calling thread's current
//   device and polled until ready or the group's timeout.
// - A call on device memory queues its NCCL kernel on the current stream
//   (inside ProcessGroup's DeviceQueue scope: after the producer) and
//   returns without waiting; an event after it goes to the watchdog.
// - A call on host memory (DDP's and FSDP's bookkeeping tensors) is copied
//   to device scratch memory on the backend's own stream and waited for,
//   within the call's deadline.
// - The watchdog thread polls the communicator's async error and the
//   pending events. An error, or an op still running past its deadline,
//   aborts the communicator (ncclCommAbort); the error, naming the op, its
//   number and this rank, goes to async_errors(): every later call and
//   every Work waited on raises it.
// Threading: one call at a time (Backend's contract); the watchdog is its
// own thread; abort() from any thread.
#pragma once

#include <memory>

#include "comm/backend.h"

namespace tdist::nccl {

std::unique_ptr<comm::Backend> make_nccl_backend(const comm::BackendContext& ctx);

}  // namespace tdist::nccl
