// The group segment, and the naming, mapping and sweeping of tdist's
// segments in /dev/shm.
//
// Contract:
// - GroupSegment's constructor is collective over the group's store: rank 0
//   sweeps stale segments and creates a fresh one, every rank maps it and
//   records its pid and start time in its slot, and rank 0 unlinks the name
//   as soon as every rank has attached. The segment then lives exactly as
//   long as the processes that map it, so nothing stays in /dev/shm, even
//   after a crash. (A rank 0 that dies between create and unlink leaves a
//   file named after its pid; the next job's rank 0 sweeps such files.)
//   It blocks on the store for up to ctx.timeout, and throws Error (or the
//   store's error) when the segment cannot be made, opened or mapped, or was
//   made for another group size, version or buffer settings.
// - Afterwards the layout is fixed: the accessors are const, never block and
//   may be called from any thread. Who may touch what inside the segment is
//   the business of its users: the header's wake and abort words and the
//   slots (waiter.h, rounds.h), the staging buffers (rounds.h), the rings
//   (rings.h).
// - The destructor unmaps the segment; it owns nothing else.
//
// Layout:
//   Header | Slot[size] | per-rank staging buffers [size][2][round_bytes]
//          | send/recv rings [size][size][ring_bytes]
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "comm/backend.h"

namespace tdist::comm::shm {

constexpr size_t kAlign = 64;
constexpr const char* kSegmentPrefix = "tdist-shm-";

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

enum class AbortKind : uint32_t { kNone = 0, kTimeout = 1, kPeerFailure = 2, kMismatch = 3, kOther = 4 };

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t round_bytes;
  uint64_t ring_bytes;
  uint64_t total_bytes;
  alignas(kAlign) std::atomic<uint32_t> wake;      // futex word: bumped by an arrival while someone sleeps
  std::atomic<uint32_t> sleepers;                  // waiters in their sleeping phase (waiter.h)
  alignas(kAlign) std::atomic<uint32_t> abort_claimed;  // the first aborter wins
  std::atomic<uint32_t> aborted;   // AbortKind, stored last: reason/from/peer are valid once set
  std::atomic<int32_t> abort_from;                 // rank that aborted
  std::atomic<int32_t> abort_peer;                 // for kPeerFailure: the dead rank
  char abort_reason[1024];
};

// What a rank that offers single-copy transfers (cma.h) publishes with an
// op's first round: where its buffers lie in its own address space, and
// (in the probe round) whether it could reach every other rank.
struct CmaOffer {
  uint64_t in = 0;
  uint64_t out = 0;
  uint32_t probe = 0;  // 1: it reached everyone; 2: it could not
};

// A rank's line for the rounds of one parity (rounds.h): the last barrier
// it arrived at with a round of that parity, the descriptor published with
// it, and a small round's payload (the "box"). A peer waiting at the
// barrier reads all three with one transfer of one cache line.
struct alignas(kAlign) RoundLine {
  std::atomic<uint64_t> round;  // 0, or the last barrier arrived at with this parity
  OpDesc desc;
  uint8_t box[kAlign - sizeof(std::atomic<uint64_t>) - sizeof(OpDesc)];
};
static_assert(sizeof(RoundLine) == kAlign, "a round's line is one cache line");
// A round's payload that fits the box goes there (Rounds::mine(bytes)).
constexpr size_t kBoxBytes = sizeof(RoundLine::box);

// A rank's slot.
struct alignas(kAlign) Slot {
  RoundLine line[2];  // by round parity: barrier b is arrived at in line[(b - 1) % 2]
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> start_time;
  // With desc, when its path flags say so (path.cpp): the key of the
  // symmetric buffers an all_reduce was given, by round parity.
  uint64_t sym_key[2][2];
  // With desc, when its path flags say so: the rank's single-copy offer,
  // by round parity.
  CmaOffer cma[2];
  // With desc: the descriptor of the rank's op before it (for the message
  // when only the history differs), by round parity.
  OpDesc prev[2];

  // The last barrier this rank arrived at (0: none).
  uint64_t arrived() const {
    const uint64_t a = line[0].round.load(), b = line[1].round.load();
    return a > b ? a : b;
  }
};

// Where the slots start in a group segment: after the header, at the
// slots' alignment.
inline size_t slots_offset() { return align_up(sizeof(Header), alignof(Slot)); }

struct alignas(kAlign) Ring {
  std::atomic<uint64_t> head;  // bytes written by the sender
  alignas(kAlign) std::atomic<uint64_t> tail;  // bytes consumed by the receiver
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

// A fresh segment name: the creator's pid (for sweep_stale_segments), a
// random part, and `tag`.
std::string new_segment_name(const std::string& tag = "");

// Reserves bytes of /dev/shm for the segment open as fd (posix_fallocate,
// not ftruncate: a sparse segment on a too-small /dev/shm maps fine and then
// kills the process with SIGBUS at the first touch). Returns "" on success,
// else an error naming /dev/shm, the bytes needed and the bytes free there.
std::string reserve_shm(int fd, size_t bytes);

// Maps bytes of the segment open as fd (shared, pre-faulted) and closes fd.
// MAP_FAILED on failure, with errno as mmap left it.
void* map_and_close(int fd, size_t bytes);

// (sweep_stale_segments, which removes the segments of processes that no
// longer exist, is declared in shm_backend.h.)

class GroupSegment {
 public:
  // round_bytes and ring_bytes as the backend settled them (multiples of
  // kAlign); every rank must pass the same.
  GroupSegment(const BackendContext& ctx, size_t round_bytes, size_t ring_bytes);
  ~GroupSegment();
  GroupSegment(const GroupSegment&) = delete;
  GroupSegment& operator=(const GroupSegment&) = delete;

  int size() const { return size_; }
  size_t round_bytes() const { return round_bytes_; }
  size_t ring_bytes() const { return ring_bytes_; }

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  Slot* slot(int r) const { return reinterpret_cast<Slot*>(base_ + slots_off_) + r; }
  uint8_t* staging(int r, uint64_t parity) const {
    return base_ + staging_off_ + (size_t(r) * 2 + parity) * round_bytes_;
  }
  Ring* ring_of(int src, int dst) const {
    return reinterpret_cast<Ring*>(base_ + rings_off_ + (size_t(src) * size_ + dst) * ring_stride());
  }
  uint8_t* ring_data(int src, int dst) const {
    return reinterpret_cast<uint8_t*>(ring_of(src, dst)) + align_up(sizeof(Ring), kAlign);
  }

 private:
  void attach(const BackendContext& ctx);
  void map(int fd, const std::string& name);
  size_t ring_stride() const { return align_up(sizeof(Ring), kAlign) + ring_bytes_; }

  int rank_;
  int size_;
  size_t round_bytes_;
  size_t ring_bytes_;
  uint8_t* base_ = nullptr;
  size_t total_ = 0;
  size_t slots_off_ = 0, staging_off_ = 0, rings_off_ = 0;
};

}  // namespace tdist::comm::shm
