// Single-copy transfers between the ranks' own memory: Linux cross-memory
// attach (process_vm_readv / process_vm_writev), as tensorpipe's CMA channel
// and OpenMPI's shared-memory transport use it.
//
// The staging path copies every byte twice (into the segment, out of it);
// with CMA a rank reads a peer's input, or writes into a peer's output,
// directly: the kernel copies once. The large all_reduce, reduce_scatter
// and all_gather on ordinary tensors use it (cma_collectives.cpp).
//
// Whether an op goes single-copy is decided by every rank together, with
// the op's first round (agree_on_path, path.h): each rank offers (the op
// is large enough, the group has not found CMA refused, and in a group
// that calibrates, rank 0 chose or tries single-copy at the op's size, or
// the other ranks expect it to: crossover.h) and publishes its buffers'
// addresses. The first time every rank offers, each one probes
// every peer with a one-byte read and one more round tells everyone whether
// all probes passed (CMA can be refused: another user's process, Yama's
// ptrace_scope, a seccomp filter such as Docker's default one). The answer
// holds for the group's lifetime; a group that was refused takes the
// staging path from then on and never offers again.
//
// Contract: one per backend, used by its collective thread only (it keeps
// the peers' addresses for the op at hand and a scratch buffer); not
// thread-safe. read/write raise through the group's Waiter (aborting the
// group) when a transfer fails: PeerFailureError when the peer is gone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/backend.h"
#include "comm/shm/crossover.h"
#include "comm/shm/rounds.h"

namespace tdist::comm::shm {

class CmaChannel {
 public:
  // How a rank chooses its offers: whenever it may (no calibration), or
  // by timing both paths (rank 0 of a calibrating group), or by following
  // what rank 0 will offer (its other ranks; crossover.h).
  enum class Role { kOffersWheneverItMay, kDecides, kFollows };

  // min_bytes: the smallest op (in bytes of its largest buffer) that may
  // go single-copy; 0 turns CMA off.
  explicit CmaChannel(size_t min_bytes, Role role = Role::kOffersWheneverItMay);

  // Whether this rank may offer single-copy for an op whose largest buffer
  // has `bytes`.
  bool offers(size_t bytes) const { return min_bytes_ > 0 && bytes >= min_bytes_ && state_ != State::kRefused; }
  // Whether the group found single-copy refused (the same answer on every
  // rank from the op that probed on: confirm).
  bool refused() const { return state_ == State::kRefused; }

  // The offer of an op of kind op whose largest buffer has `bytes`, by
  // this rank's role; eligible: this rank's buffers can go single-copy
  // (crossover.h). cma null: no offer.
  static CrossoverTrial trial(CmaChannel* cma, Crossover::Op op, size_t bytes, bool eligible = true) {
    if (!cma) return CrossoverTrial();
    Crossover* c = cma->role_ == Role::kOffersWheneverItMay ? nullptr : &cma->crossover_;
    return CrossoverTrial(c, op, bytes, cma->offers(bytes), eligible);
  }

  // Publishes this rank's offer for the op in the current round (before
  // its first barrier, whose descriptor says that it offers: path.cpp).
  void publish(Rounds& rounds, const void* in, const void* out) const;
  // After the first barrier, when every rank offered: records every rank's
  // addresses.
  void take_offers(const Rounds& rounds);
  // Collective, when every rank offered: probes the peers the first time
  // (one more barrier round) and returns whether the group may go
  // single-copy (the same answer on every rank).
  bool confirm(Rounds& rounds, const OpDesc& desc, Deadline d);

  // Rank r's buffers for the op, as it published them.
  uint64_t in_of(int r) const { return in_[r]; }
  uint64_t out_of(int r) const { return out_[r]; }

  // Copies bytes from rank r's remote address into local / from local to
  // rank r's remote address. The error names the op by desc (described
  // only then: a transfer that succeeds builds no string).
  void read(Rounds& rounds, int r, void* local, uint64_t remote, size_t bytes, const OpDesc& desc);
  void write(Rounds& rounds, int r, const void* local, uint64_t remote, size_t bytes, const OpDesc& desc);

  // A scratch buffer of at least `bytes`, 64-byte aligned, kept between
  // calls.
  uint8_t* scratch(size_t bytes);

  // Bytes moved per call: large enough to amortise the system call and the
  // page pinning, small enough that what a rank just read is still in its
  // cache when it reduces or forwards it.
  static constexpr size_t kChunkBytes = 256 * 1024;

 private:
  enum class State { kUnknown, kWorks, kRefused };
  [[noreturn]] void fail(Rounds& rounds, int r, const char* call, int err, const OpDesc& desc);

  size_t min_bytes_;
  Role role_;
  Crossover crossover_{role_ == Role::kDecides};
  State state_ = State::kUnknown;
  std::vector<uint64_t> in_, out_;
  std::vector<uint8_t> scratch_;
};

}  // namespace tdist::comm::shm
