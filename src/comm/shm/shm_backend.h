// The shm backend: collectives between processes on one host through POSIX
// shared memory. shm_backend.cpp lists the pieces it is built from (the
// segment, the round protocol, the algorithms, symmetric memory, rings).
#pragma once

#include <memory>

#include "comm/backend.h"

namespace tdist::comm::shm {

struct ShmOptions {
  // Bytes of each rank's staging buffer per round (two are kept, for double
  // buffering). Larger rounds mean fewer barriers; smaller ones stay in cache.
  size_t round_bytes = 1024 * 1024;
  // all_reduce of at most this many bytes takes the one-round path.
  size_t small_bytes = 32 * 1024;
  // Bytes of each ordered pair's send/recv ring.
  size_t ring_bytes = 256 * 1024;
  // How long a waiting rank spins (pause loop) before it starts yielding.
  // None by default: sched_yield() returns at once when nothing else wants
  // the core, so polling with it answers as fast, and when the core is
  // shared (DDP's backward on the same rank, or ranks outnumbering cores)
  // spinning only takes time from the thread the others wait for.
  std::chrono::microseconds spin{0};
  // How long it then keeps polling with sched_yield() before it sleeps on
  // the futex. Yielding hands the core to any other runnable thread (ranks
  // may outnumber cores), and a rank that never sleeps needs no wake-up: on
  // a VM, waking a sleeping vCPU can cost hundreds of microseconds per round.
  std::chrono::microseconds yield{2000};
  // Whether allocate_symmetric gives symmetric memory (else the group has
  // none, and DDP keeps its buckets in ordinary memory). Every rank of a
  // group must agree.
  bool symmetric = true;
  // all_reduce, reduce_scatter, all_gather and broadcast of ordinary
  // tensors whose largest buffer has at least this many bytes go
  // single-copy through process_vm_readv/writev when every rank can reach
  // every other (cma.h) and, when calibrating, where it was the faster
  // (crossover.h); 0: never. On the Intel Xeon VM single copy wins from
  // 16 KiB in the first three (the calibration stages them below) and
  // from 4 KiB in a broadcast timed after a barrier. Below 2 KiB in all an
  // all_gather or reduce_scatter never goes single copy, below 4 KiB a
  // broadcast (kStagedBytes, kAgreeBytes: path.h), nor does an all_reduce
  // of up to small_bytes: a setting below those changes nothing for them.
  size_t cma_bytes = 4 * 1024;
  // Whether the group times both paths for such ops and keeps, per op kind
  // and size, the faster (crossover.h); else every op of at least
  // cma_bytes goes single-copy. Every rank should have the same setting
  // (and the same cma_bytes): where they differ, ops stay correct but
  // some pay an extra round and the timings mislead (crossover.h).
  bool cma_calibrate = true;
  // Read from TDIST_SHM_ROUND_BYTES, TDIST_SHM_SMALL_BYTES, TDIST_SHM_SPIN_US,
  // TDIST_SHM_YIELD_US, TDIST_SHM_SYMMETRIC (0 or 1), TDIST_SHM_CMA_BYTES,
  // TDIST_SHM_CMA_CALIBRATE (0 or 1).
  static ShmOptions from_env();
};

std::unique_ptr<Backend> make_shm_backend(const BackendContext& ctx, const ShmOptions& options);

// Removes /dev/shm segments left by tdist processes that no longer exist.
// Returns how many were removed.
int sweep_stale_segments();

}  // namespace tdist::comm::shm
