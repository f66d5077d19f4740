// RecyclingAllocator: an allocator for std::allocate_shared that keeps up
// to kKeep freed blocks per thread and size class and hands them out
// again, so that an object made and dropped at every call (a synchronous
// op's Work) costs no malloc or free once warm.
//
// Threading: each thread has its own lists (thread_local, no atomics); a
// block freed on another thread than the one that allocated it joins the
// freeing thread's list (or goes back to the heap when that list is full).
// A thread's lists are freed when it exits.
// Under AddressSanitizer nothing is kept, so that a use after free of a
// recycled block is still caught.
#pragma once

#include <cstddef>
#include <new>

namespace tdist::detail {

class BlockCache {
 public:
  static constexpr int kKeep = 8;
  // A block of `bytes` (a multiple of kAlign, at most kMaxBytes).
  static constexpr size_t kAlign = 64;
  static constexpr size_t kMaxBytes = 512;

  static void* take(size_t bytes) {
    Lists& l = lists();
    List& list = l.of(bytes);
    if (list.count > 0) return list.blocks[--list.count];
    return ::operator new(round(bytes), std::align_val_t{kAlign});
  }
  static void give(void* p, [[maybe_unused]] size_t bytes) noexcept {
#if !defined(__SANITIZE_ADDRESS__)
    Lists& l = lists();
    if (!l.dead) {
      List& list = l.of(bytes);
      if (list.count < kKeep) {
        list.blocks[list.count++] = p;
        return;
      }
    }
#endif
    ::operator delete(p, std::align_val_t{kAlign});
  }
  static constexpr size_t round(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

 private:
  struct List {
    void* blocks[kKeep];
    int count = 0;
  };
  struct Lists {
    List classes[kMaxBytes / kAlign];
    bool dead = false;  // this thread's lists are gone: blocks freed later go to the heap
    List& of(size_t bytes) { return classes[round(bytes) / kAlign - 1]; }
    ~Lists() {
      dead = true;
      for (List& list : classes) {
        while (list.count > 0) ::operator delete(list.blocks[--list.count], std::align_val_t{kAlign});
      }
    }
  };
  static Lists& lists() {
    thread_local Lists l;
    return l;
  }
};

template <typename T>
struct RecyclingAllocator {
  using value_type = T;
  RecyclingAllocator() = default;
  template <typename U>
  RecyclingAllocator(const RecyclingAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor)

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    static_assert(alignof(T) <= BlockCache::kAlign, "RecyclingAllocator: over-aligned type");
    if (bytes > BlockCache::kMaxBytes) return static_cast<T*>(::operator new(bytes, std::align_val_t{BlockCache::kAlign}));
    return static_cast<T*>(BlockCache::take(bytes));
  }
  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (bytes > BlockCache::kMaxBytes) {
      ::operator delete(p, std::align_val_t{BlockCache::kAlign});
      return;
    }
    BlockCache::give(p, bytes);
  }
  template <typename U>
  bool operator==(const RecyclingAllocator<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const RecyclingAllocator<U>&) const noexcept { return false; }
};

}  // namespace tdist::detail
