// Symmetric memory: blocks that every rank of the group maps, each rank's
// copy in its own segment, and the registry that finds them by address.
//
// allocate_symmetric_block: each rank makes a segment of its own (reserved
// with posix_fallocate, so a full /dev/shm shows here and not as SIGBUS
// later), the ranks swap names through an all_gather, map every rank's
// segment and unlink their own once all have mapped it.
//
// Contract:
// - allocate_symmetric_block is a collective (two rounds on `rounds`, op
//   kSymmetricAlloc), called by the backend's collective thread on every
//   rank with the same bytes. It returns this rank's copy, or nullptr on
//   every rank when some rank could not make or map its segment (*why_not
//   then names the first such rank and why). Timeouts and peer failures
//   raise as in any collective, after releasing what this rank made.
// - The returned pointer owns the block: its deleter (which may run on any
//   thread, after the backend is gone) takes the block out of the registry
//   and unmaps every copy.
// - SymRegistry is shared by the backend and the deleters and guards its
//   map with a mutex: find, empty, add and erase are thread-safe. A block
//   found stays valid while its owner holds the pointer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/backend.h"
#include "comm/shm/rounds.h"

namespace tdist::comm::shm {

struct SymBlock {
  uint64_t id = 0;      // the allocation's op number: the same block on every rank
  size_t bytes = 0;     // as asked for
  size_t mapped = 0;    // each mapping's length
  std::vector<uint8_t*> copies;  // copies[r]: rank r's block, as mapped in this process
};

// This backend's blocks by their address here.
class SymRegistry {
 public:
  // The block holding [p, p + bytes), or nullptr. Entries stay put while
  // their block is alive, so the pointer outlives the lock.
  const SymBlock* find(const void* p, size_t bytes) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.upper_bound(a);
    if (it == blocks_.begin()) return nullptr;
    --it;
    if (a + bytes > it->first + it->second.bytes) return nullptr;
    return &it->second;
  }
  // No lock: every small op of a group without symmetric memory asks.
  bool empty() const { return count_.load(std::memory_order_acquire) == 0; }
  // block.copies[rank] is this process's own copy, the block's address here.
  void add(const void* own, SymBlock block) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_[reinterpret_cast<uintptr_t>(own)] = std::move(block);
    count_.store(blocks_.size(), std::memory_order_release);
  }
  void erase(const void* own) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.erase(reinterpret_cast<uintptr_t>(own));
    count_.store(blocks_.size(), std::memory_order_release);
  }

 private:
  mutable std::mutex mu_;
  std::map<uintptr_t, SymBlock> blocks_;
  std::atomic<size_t> count_{0};  // blocks_.size(), for empty()
};

// One step of the 64-bit mix the symmetric keys are hashed with.
inline uint64_t sym_key_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}

std::shared_ptr<void> allocate_symmetric_block(Rounds& rounds, const std::shared_ptr<SymRegistry>& registry,
                                               size_t bytes, Deadline d, std::string* why_not);

}  // namespace tdist::comm::shm
