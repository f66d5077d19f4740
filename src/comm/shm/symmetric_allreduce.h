// The in-place all_reduce over symmetric memory (symmetric.h).
//
// An all_reduce of buffers that lie at the same place of one symmetric block
// on every rank skips the staging buffers: rank r reduces the r-th share
// straight from every rank's copy and writes the result into all of them,
// then one closing barrier. Whether every rank's buffers are the same parts
// of the same blocks is decided by comparing keys that reduce_scatter_gather
// publishes with the op's descriptor; ranks that disagree (one passes an
// ordinary tensor) all take the staging path.
//
// Contract:
// - One per backend, used by its collective thread only (it keeps the plan
//   and a scratch buffer between calls); not thread-safe. The registry it
//   reads is.
// - plan() never blocks or communicates; run() is collective (it ends with a
//   barrier) and raises as Rounds::barrier_round does.
// - The blocks planned must stay alive until run() returns (the caller's
//   tensors hold them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/backend.h"
#include "comm/shm/rounds.h"
#include "comm/shm/symmetric.h"

namespace tdist::comm::shm {

class SymmetricAllReduce {
 public:
  explicit SymmetricAllReduce(std::shared_ptr<const SymRegistry> registry);

  // Plans for pieces (elements of es bytes) as given to this rank (rank):
  // when they all lie in symmetric blocks, their parts, merged where they
  // touch, and a non-zero key; else key() is {0, 0}. Equal keys on every
  // rank mean the same parts of the same blocks.
  void plan(const std::vector<Piece>& pieces, size_t es, int rank);
  const uint64_t* key() const { return key_; }

  // The symmetric all_reduce of the planned parts (count elements in all):
  // rank r reduces the r-th share straight from every rank's copy and
  // writes the result into every copy; the closing barrier keeps everyone
  // off the copies until all shares are done. Each element is reduced once,
  // by one rank, with the inputs in rank order (the staging path's bits).
  void run(Rounds& rounds, size_t count, DataType t, DataType wire, ReduceOp op, const OpDesc& desc, Deadline d);

 private:
  // One stretch of a symmetric all_reduce: count elements at `offset` bytes
  // into every rank's copy of block.
  struct SymPart {
    const SymBlock* block;
    size_t offset;
    size_t count;
  };

  std::shared_ptr<const SymRegistry> registry_;
  uint64_t key_[2] = {0, 0};
  std::vector<SymPart> parts_;     // the current all_reduce's, reused
  std::vector<uint16_t> scratch_;  // (size() + 1) * kScratchElems wire values
};

}  // namespace tdist::comm::shm
