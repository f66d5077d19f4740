// BlockPool: the free lists and the returning deleter. The contract is in
// block_pool.h.
#include "fsdp/block_pool.h"

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <vector>

namespace tdist::detail {

namespace {

constexpr size_t kMaxFreeBlocks = 4;

struct Block {
  c10::DataPtr memory;
  size_t nbytes;
};

class BlockPool {
 public:
  c10::DataPtr take(size_t nbytes) {
    Block* b = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      largest_ = std::max(largest_, nbytes);
      auto it = free_.find(nbytes);
      if (it != free_.end() && !it->second.empty()) {
        b = it->second.back();
        it->second.pop_back();
        free_bytes_ -= nbytes;
        --free_blocks_;
      }
    }
    if (!b) {
      // Counted from before the memory exists until after it is gone
      // (give_back): read before and after a read of an allocator's live
      // bytes, an unchanged count covers every block those include.
      all_bytes_ += nbytes;
      try {
        b = new Block{c10::GetCPUAllocator()->allocate(nbytes), nbytes};
      } catch (...) {
        all_bytes_ -= nbytes;
        throw;
      }
    }
    return c10::DataPtr(b->memory.get(), b, &BlockPool::give_back, c10::Device(c10::kCPU));
  }

  void release_free() {
    std::vector<Block*> out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [size, blocks] : free_) out.insert(out.end(), blocks.begin(), blocks.end());
      free_.clear();
      free_bytes_ = 0;
      free_blocks_ = 0;
    }
    for (Block* b : out) {
      const size_t n = b->nbytes;
      delete b;
      all_bytes_ -= n;
    }
  }

  size_t free_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return free_bytes_;
  }
  size_t all_bytes() const { return all_bytes_.load(); }

 private:
  static void give_back(void* ctx);

  std::mutex mu_;
  std::map<size_t, std::vector<Block*>> free_;
  size_t free_bytes_ = 0;
  std::atomic<size_t> all_bytes_{0};  // every block alive, in use or free
  size_t free_blocks_ = 0;
  size_t largest_ = 0;
};

BlockPool& pool() {
  static BlockPool* p = new BlockPool;  // never destroyed: see block_pool.h
  return *p;
}

void BlockPool::give_back(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  BlockPool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mu_);
    auto& same = p.free_[b->nbytes];
    if (same.empty() && p.free_blocks_ < kMaxFreeBlocks && p.free_bytes_ + b->nbytes <= 2 * p.largest_) {
      same.push_back(b);
      p.free_bytes_ += b->nbytes;
      ++p.free_blocks_;
      return;
    }
  }
  const size_t n = b->nbytes;
  delete b;
  p.all_bytes_ -= n;
}

}  // namespace

c10::DataPtr take_block(size_t nbytes) { return pool().take(nbytes); }
void release_pooled_blocks() { pool().release_free(); }
size_t pooled_bytes() { return pool().free_bytes(); }
size_t block_bytes() { return pool().all_bytes(); }

}  // namespace tdist::detail
