// StagingBackend: a backend of host memory (shm, gloo, mpi) serving
// buffers in CUDA memory. Each call copies what it reads from the device
// into pinned host memory on the current stream (inside the group's
// DeviceQueue scope: ordered after the producer), waits for that copy,
// runs the inner backend's call on the host copies, then copies what it
// wrote back on the same stream (the scope's end event covers it).
//
// Every pointer it is given is device memory (an op's tensors are on one
// device; ProcessGroup checks). The inner backend sees exactly the calls it
// would see for CPU tensors of the same sizes, so ranks with CPU tensors
// and ranks with CUDA tensors can meet in one collective.
// Threading: as any Backend (one call at a time); abort() from any thread.
#pragma once

#include <memory>

#include "comm/backend.h"
#include "cuda/pinned_buffer.h"

namespace tdist::cuda {

std::unique_ptr<comm::Backend> make_staging_backend(comm::Backend& inner);

}  // namespace tdist::cuda
