// The C ABI's work handles (c_core.h: reserve_work, publish_work,
// unreserve_work, work_of, free_work): slots in slabs that are never
// freed, handles that name a slot and its generation.
#include <atomic>
#include <mutex>

#include "c/c_core.h"

namespace tdist::c {

namespace {

// Work slots: slabs of kSlab, made on demand and never freed. A handle is
// (slot number + 1) | generation << 32, not an address: a slot's
// generation is odd while its work is live and moves on when it is freed,
// so a freed handle never names a later work in the same slot, and a
// foreign pointer names no slot. Each thread keeps the slots it freed;
// a thread that ends gives them back to the shared pool.
static_assert(sizeof(void*) == 8, "work handles need 64-bit pointers");
struct Slot {
  std::atomic<uint32_t> generation{0};  // odd: live
  std::shared_ptr<Work> work;
  uint32_t next_free = 0;  // a slot number + 1; 0: none
};
constexpr uint32_t kSlab = 256;
constexpr uint32_t kMaxSlabs = uint32_t{1} << 14;  // 4 Mi works alive at once
std::atomic<Slot*> slabs[kMaxSlabs];
std::atomic<uint32_t> slab_count{0};
std::mutex pool_mu;
uint32_t pool_free = 0;  // REQUIRES pool_mu: the shared pool's list

Slot& slot(uint32_t number) { return slabs[number / kSlab].load(std::memory_order_acquire)[number % kSlab]; }

struct ThreadSlots {
  uint32_t free = 0;
  ~ThreadSlots() {  // the thread ends: its free slots go back to the pool
    std::lock_guard<std::mutex> lock(pool_mu);
    while (free) {
      const uint32_t n = free - 1;
      free = slot(n).next_free;
      slot(n).next_free = pool_free;
      pool_free = n + 1;
    }
  }
};
thread_local ThreadSlots thread_slots;

uint32_t grab_slot() {
  if (uint32_t f = thread_slots.free) {
    thread_slots.free = slot(f - 1).next_free;
    return f - 1;
  }
  std::lock_guard<std::mutex> lock(pool_mu);
  if (uint32_t f = pool_free) {
    pool_free = slot(f - 1).next_free;
    return f - 1;
  }
  const uint32_t k = slab_count.load(std::memory_order_relaxed);
  if (k == kMaxSlabs) throw CFailure{TDIST_ERR_INTERNAL, "over 4 Mi works alive: free them (tdist_work_free)"};
  slabs[k].store(new Slot[kSlab], std::memory_order_release);
  slab_count.store(k + 1, std::memory_order_release);
  for (uint32_t i = kSlab - 1; i > 0; --i) {
    slot(k * kSlab + i).next_free = thread_slots.free;
    thread_slots.free = k * kSlab + i + 1;
  }
  return k * kSlab;
}

void put_back(uint32_t number) {
  slot(number).next_free = thread_slots.free;
  thread_slots.free = number + 1;
}

tdist_work* handle_of(uint32_t number, uint32_t generation) {
  return reinterpret_cast<tdist_work*>((uint64_t{generation} << 32) | (uint64_t{number} + 1));
}

// The slot a handle names, with the handle's generation; a usage error
// for what names none.
Slot& named(tdist_work* h, uint32_t* generation) {
  if (!h) usage("the work is NULL");
  const auto v = reinterpret_cast<uint64_t>(h);
  const uint64_t number = (v & 0xffffffffu) - 1;
  *generation = static_cast<uint32_t>(v >> 32);
  if ((v & 0xffffffffu) == 0 || number >= uint64_t{slab_count.load(std::memory_order_acquire)} * kSlab ||
      (*generation & 1) == 0) {
    usage("the work is not a handle tdist made");
  }
  return slot(static_cast<uint32_t>(number));
}

}  // namespace

tdist_work* reserve_work() {
  const uint32_t n = grab_slot();
  Slot& s = slot(n);
  const uint32_t g = s.generation.load(std::memory_order_relaxed) + 1;  // odd: live
  s.generation.store(g, std::memory_order_release);
  return handle_of(n, g);
}

void publish_work(tdist_work* h, std::shared_ptr<Work> w) {
  uint32_t g = 0;
  named(h, &g).work = std::move(w);
}

void unreserve_work(tdist_work* h) noexcept {
  const auto v = reinterpret_cast<uint64_t>(h);
  const auto n = static_cast<uint32_t>((v & 0xffffffffu) - 1);
  Slot& s = slot(n);
  s.work.reset();
  s.generation.fetch_add(1, std::memory_order_acq_rel);  // even: free
  put_back(n);
}

Work& work_of(tdist_work* h) {
  uint32_t g = 0;
  Slot& s = named(h, &g);
  if (s.generation.load(std::memory_order_acquire) != g) usage("the work is freed");
  return *s.work;
}

void free_work(tdist_work* h) {
  uint32_t g = 0;
  Slot& s = named(h, &g);
  uint32_t expected = g;
  if (!s.generation.compare_exchange_strong(expected, g + 1, std::memory_order_acq_rel)) {
    usage("the work is freed already (freed twice?)");
  }
  s.work.reset();
  const auto v = reinterpret_cast<uint64_t>(h);
  put_back(static_cast<uint32_t>((v & 0xffffffffu) - 1));
}

}  // namespace tdist::c
