// SymSpan: a collective's buffer that lies in one symmetric block (every
// rank's copy mapped here, symmetric.h), and the agreement that lets an op
// read the other ranks' copies directly instead of going through the
// staging buffers.
//
// all_gather reads every rank's input straight from its copy (one copy per
// byte instead of two, and one barrier at each end instead of one per
// round); reduce_scatter reads this rank's share from every rank's input
// and reduces it into the output. Both need every rank's buffer at the same
// offset of the same block: agree_on_path (path.h) compares keys published
// with the op's first round; ranks that disagree (one passed an ordinary
// tensor) all take another path. Ops of less than 2 KiB in all take the
// staging path without agreeing (kStagedBytes, path.h).
//
// Contract: find() never blocks. The block must stay alive until the op
// returns (the caller's tensors hold it). Used by the collective thread
// only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/shm/rounds.h"
#include "comm/shm/symmetric.h"

namespace tdist::comm::shm {

struct SymSpan {
  const SymBlock* block = nullptr;
  size_t offset = 0;  // bytes into every rank's copy
  uint64_t key[2] = {0, 0};

  // The span of [p, p + bytes) on rank `rank`, or none (block == nullptr).
  static SymSpan find(const SymRegistry& registry, const void* p, size_t bytes, int rank);
  explicit operator bool() const { return block != nullptr; }
  const uint8_t* on(int r) const { return block->copies[r] + offset; }
};

}  // namespace tdist::comm::shm
