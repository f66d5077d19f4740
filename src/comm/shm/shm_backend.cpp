// The shm backend.
//
// One segment per group, created by rank 0, attached by every rank and then
// unlinked at once: it lives exactly as long as the processes that map it,
// so nothing stays in /dev/shm, even after a crash. (A rank 0 that dies
// between create and unlink leaves a file named after its pid; the next
// job's rank 0 sweeps such files.)
//
// Segment layout:
//   Header | Slot[size] | per-rank staging buffers [size][2][round_bytes]
//          | send/recv rings [size][size][ring_bytes]
//
// Every collective is a sequence of rounds. In a round each rank writes its
// own staging buffer of parity (g % 2), where g counts the barriers it has
// passed, then arrives at barrier g+1; after the barrier it may read every
// rank's buffer of that parity until it arrives at barrier g+2. A rank only
// rewrites a buffer after barrier g+2, by which time everyone has finished
// reading it. This rule holds across op boundaries, so ops need no closing
// barrier. The first round of every op carries the op's descriptor, which
// every rank compares after the first barrier: ranks that called different
// collectives, dtypes, sizes or roots all raise CollectiveMismatchError.
//
// Waiting polls with sched_yield() (ranks on their own cores answer within
// microseconds; a rank that shares its core hands it over), optionally
// after a pause loop (TDIST_SHM_SPIN_US), then sleeps on one futex word in
// the header that every arrival bumps. A sleeping waiter wakes every 100 ms
// to check that the ranks it waits for are alive (/proc/<pid>/stat, with the
// process start time against pid reuse), and to honour its deadline.
//
// Symmetric memory (allocate_symmetric): each rank makes a segment of its
// own, the ranks swap names through an all_gather, map every rank's segment
// and unlink their own once all have mapped it. An all_reduce of buffers
// that lie at the same place of one such block on every rank (compared
// through a key published with the op's descriptor) skips the staging
// buffers: rank r reduces the r-th part straight from every rank's copy
// and writes the result into all of them, then one closing barrier. Ranks
// that disagree (one passes an ordinary tensor) all take the staging path.
#include "comm/shm/shm_backend.h"

#include <dirent.h>
#include <sched.h>
#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "comm/reduce.h"
#include "util/bytes.h"
#include "util/env.h"

namespace tdist::comm::shm {

namespace {

constexpr uint64_t kMagic = 0x316d737473696474ull;  // "tdistsm1"
constexpr uint32_t kVersion = 2;
constexpr size_t kAlign = 64;
// Elements narrowed at a time into a stack buffer (reduce passes with a
// narrower wire type, the small all-reduce path).
constexpr size_t kScratchElems = 1024;
constexpr const char* kSegmentPrefix = "tdist-shm-";

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

enum class AbortKind : uint32_t { kNone = 0, kTimeout = 1, kPeerFailure = 2, kMismatch = 3, kOther = 4 };

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t round_bytes;
  uint64_t ring_bytes;
  uint64_t total_bytes;
  alignas(kAlign) std::atomic<uint32_t> wake;      // futex word: bumped by every arrival
  std::atomic<uint32_t> sleepers;                  // waiters inside futex_wait
  alignas(kAlign) std::atomic<uint32_t> abort_claimed;  // the first aborter wins
  std::atomic<uint32_t> aborted;   // AbortKind, stored last: reason/from/peer are valid once set
  std::atomic<int32_t> abort_from;                 // rank that aborted
  std::atomic<int32_t> abort_peer;                 // for kPeerFailure: the dead rank
  char abort_reason[1024];
};

struct alignas(kAlign) Slot {
  std::atomic<uint64_t> round;  // barriers passed
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> start_time;
  OpDesc desc[2];  // by round parity
  // With desc: the key of the symmetric buffers an all_reduce was given
  // (0: none), by round parity.
  uint64_t sym_key[2][2];
};

struct alignas(kAlign) Ring {
  std::atomic<uint64_t> head;  // bytes written by the sender
  alignas(kAlign) std::atomic<uint64_t> tail;  // bytes consumed by the receiver
};

struct MsgHeader {
  int64_t tag;
  uint64_t bytes;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

// Process start time (clock ticks since boot), field 22 of /proc/<pid>/stat;
// 0 if the process does not exist or is a zombie.
uint64_t process_start_time(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(s.substr(close + 2));
  std::string state;
  rest >> state;
  if (state == "Z" || state == "X") return 0;
  std::string field;
  for (int i = 4; i <= 21; ++i) rest >> field;  // fields 4..21
  uint64_t start = 0;
  rest >> start;
  return start;
}

bool pid_alive(int pid) { return !(kill(pid, 0) != 0 && errno == ESRCH); }

// ---- symmetric blocks ---------------------------------------------------------

struct SymBlock {
  uint64_t id = 0;      // the allocation's op number: the same block on every rank
  size_t bytes = 0;     // as asked for
  size_t mapped = 0;    // each mapping's length
  std::vector<uint8_t*> copies;  // copies[r]: rank r's block, as mapped in this process
};

// This backend's blocks by their address here. Shared with the blocks'
// deleters, which may run on any thread and after the backend is gone.
struct SymRegistry {
  mutable std::mutex mu;
  std::map<uintptr_t, SymBlock> blocks;

  // The block holding [p, p + bytes), or nullptr. Entries stay put while
  // their block is alive, so the pointer outlives the lock.
  const SymBlock* find(const void* p, size_t bytes) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu);
    auto it = blocks.upper_bound(a);
    if (it == blocks.begin()) return nullptr;
    --it;
    if (a + bytes > it->first + it->second.bytes) return nullptr;
    return &it->second;
  }
};

// One stretch of a symmetric all_reduce: count elements at `offset` bytes
// into every rank's copy of block.
struct SymPart {
  const SymBlock* block;
  size_t offset;
  size_t count;
};

uint64_t mix64(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}

// A fresh segment name: the creator's pid (for sweep_stale_segments), a
// random part, and `tag`.
std::string new_segment_name(const std::string& tag = "") {
  std::random_device rd;
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "%08x%08x", rd(), rd());
  return "/" + std::string(kSegmentPrefix) + std::to_string(getpid()) + "-" + suffix + tag;
}

// Maps bytes of the segment open as fd (shared, pre-faulted) and closes fd.
// MAP_FAILED on failure, with errno as mmap left it.
void* map_and_close(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  close(fd);
  errno = err;
  return p;
}

void unmap_all(const std::vector<uint8_t*>& copies, size_t mapped) {
  for (uint8_t* c : copies) {
    if (c) munmap(c, mapped);
  }
}

class ShmBackend final : public Backend {
 public:
  ShmBackend(const BackendContext& ctx, const ShmOptions& options)
      : Backend(ctx.rank, ctx.size), ctx_(ctx), opt_(options) {
    opt_.round_bytes = align_up(std::max<size_t>(opt_.round_bytes, 4096), kAlign);
    opt_.ring_bytes = align_up(std::max<size_t>(opt_.ring_bytes, 4096), kAlign);
    attach();
  }

  ~ShmBackend() override {
    if (base_) munmap(base_, total_);
  }

  std::string name() const override { return "shm"; }

  // ---- collectives ------------------------------------------------------

  void all_reduce(void* buf, size_t count, DataType t, ReduceOp op, Deadline d) override {
    all_reduce_coalesced({Piece{buf, count}}, t, op, d);
  }

  // Reads and writes the pieces in place: no packing.
  void all_reduce_coalesced(const std::vector<Piece>& pieces, DataType t, ReduceOp op, Deadline d) override {
    all_reduce_pieces(pieces, t, t, op, d);
  }

  // Narrows while it copies out and reduces, widens while it copies back.
  void all_reduce_coalesced_as(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op,
                               Deadline d) override {
    if (!can_convert(wire, t)) {
      throw UsageError(std::string("shm backend: cannot carry ") + dtype_name(t) + " as " + dtype_name(wire));
    }
    all_reduce_pieces(pieces, t, wire, op, d);
  }

  void reduce(void* buf, size_t count, DataType t, ReduceOp op, int root, Deadline d) override {
    check_reduction(t, op);
    check_root(root);
    const std::vector<Piece> pieces{Piece{buf, count}};
    reduce_scatter_gather(PieceWalker(pieces, dtype_size(t)), t, t, op,
                          make_desc(OpKind::kReduce, t, op, root, count), root, d);
  }

  void broadcast(void* buf, size_t bytes, int root, Deadline d) override {
    check_root(root);
    const OpDesc desc = make_desc(OpKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, root, bytes);
    const size_t chunk = opt_.round_bytes;
    const size_t rounds = std::max<size_t>(1, (bytes + chunk - 1) / chunk);
    auto* p = static_cast<uint8_t*>(buf);
    for (size_t j = 0; j < rounds; ++j) {
      const size_t off = j * chunk, len = std::min(chunk, bytes - std::min(bytes, off));
      if (rank() == root) detail::copy_bytes(mine(), p + off, len);
      if (j == 0) first_barrier(desc, d); else barrier_round(desc, d);
      if (rank() != root) detail::copy_bytes(p + off, theirs(root), len);
    }
  }

  void all_gather(const void* in, void* out, size_t bytes, Deadline d) override {
    gather_impl(in, out, bytes, -1, make_desc(OpKind::kAllGather, DataType::kUInt8, ReduceOp::kSum, -1, bytes), d);
  }

  void gather(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    check_root(root);
    gather_impl(in, out, bytes, root, make_desc(OpKind::kGather, DataType::kUInt8, ReduceOp::kSum, root, bytes), d);
  }

  void scatter(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    check_root(root);
    const OpDesc desc = make_desc(OpKind::kScatter, DataType::kUInt8, ReduceOp::kSum, root, bytes);
    const size_t piece = std::max<size_t>(1, opt_.round_bytes / size() / kAlign * kAlign);
    const size_t rounds = std::max<size_t>(1, (bytes + piece - 1) / piece);
    const auto* src = static_cast<const uint8_t*>(in);
    auto* dst = static_cast<uint8_t*>(out);
    for (size_t j = 0; j < rounds; ++j) {
      const size_t off = j * piece, len = std::min(piece, bytes - std::min(bytes, off));
      if (rank() == root) {
        for (int r = 0; r < size(); ++r) detail::copy_bytes(mine() + r * piece, src + r * bytes + off, len);
      }
      if (j == 0) first_barrier(desc, d); else barrier_round(desc, d);
      detail::copy_bytes(dst + off, theirs(root) + rank() * piece, len);
    }
  }

  void reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op, Deadline d) override {
    check_reduction(t, op);
    const OpDesc desc = make_desc(OpKind::kReduceScatter, t, op, -1, count);
    const size_t es = dtype_size(t);
    const size_t piece = std::max<size_t>(1, opt_.round_bytes / size() / kAlign * kAlign / es);  // elements
    const size_t rounds = std::max<size_t>(1, (count + piece - 1) / piece);
    const auto* src = static_cast<const uint8_t*>(in);
    auto* dst = static_cast<uint8_t*>(out);
    std::vector<const void*> inputs(size());
    for (size_t j = 0; j < rounds; ++j) {
      const size_t off = j * piece, len = std::min(piece, count - std::min(count, off));
      for (int r = 0; r < size(); ++r) {
        if (r != rank()) detail::copy_bytes(mine() + r * piece * es, src + (r * count + off) * es, len * es);
      }
      if (j == 0) first_barrier(desc, d); else barrier_round(desc, d);
      for (int r = 0; r < size(); ++r) {
        inputs[r] = r == rank() ? src + (rank() * count + off) * es : theirs(r) + rank() * piece * es;
      }
      reduce_many(dst + off * es, inputs.data(), size(), len, t, op, size());
    }
  }

  void all_to_all(const void* in, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  void* out, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Deadline d) override {
    const int n = size();
    const OpDesc desc = make_desc(OpKind::kAllToAll, DataType::kUInt8, ReduceOp::kSum, -1, 0);
    // Round 0: everyone posts its send and receive sizes.
    auto* meta = reinterpret_cast<uint64_t*>(mine());
    if (2 * n * sizeof(uint64_t) > opt_.round_bytes) throw UsageError("shm all_to_all: group too large for its buffer");
    for (int r = 0; r < n; ++r) {
      meta[r] = send_bytes[r];
      meta[n + r] = recv_bytes[r];
    }
    first_barrier(desc, d);
    size_t longest = 0;
    std::string mismatch;
    for (int s = 0; s < n; ++s) {
      const auto* m = reinterpret_cast<const uint64_t*>(theirs(s));
      for (int r = 0; r < n; ++r) {
        const uint64_t sends = m[r];
        const uint64_t receives = reinterpret_cast<const uint64_t*>(theirs(r))[n + s];
        if (sends != receives && mismatch.empty()) {
          mismatch = "rank " + std::to_string(global(s)) + " sends " + std::to_string(sends) + " bytes to rank " +
                     std::to_string(global(r)) + ", which expects " + std::to_string(receives);
        }
        longest = std::max<size_t>(longest, sends);
      }
    }
    if (!mismatch.empty()) fail(AbortKind::kMismatch, -1, "all_to_all #" + std::to_string(desc.seq) + ": " + mismatch);
    const size_t piece = std::max<size_t>(1, opt_.round_bytes / n / kAlign * kAlign);
    const size_t rounds = (longest + piece - 1) / piece;
    const auto* src = static_cast<const uint8_t*>(in);
    auto* dst = static_cast<uint8_t*>(out);
    for (size_t j = 0; j < rounds; ++j) {
      const size_t off = j * piece;
      for (int r = 0; r < n; ++r) {
        if (off < send_bytes[r]) detail::copy_bytes(mine() + r * piece, src + send_offsets[r] + off, std::min(piece, send_bytes[r] - off));
      }
      barrier_round(desc, d);
      for (int s = 0; s < n; ++s) {
        if (off < recv_bytes[s]) detail::copy_bytes(dst + recv_offsets[s] + off, theirs(s) + rank() * piece, std::min(piece, recv_bytes[s] - off));
      }
    }
  }

  void barrier(Deadline d) override {
    first_barrier(make_desc(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0), d);
  }

  // ---- point to point ----------------------------------------------------

  void send(const void* buf, size_t bytes, int dst, int tag, Deadline d) override {
    check_alive_state();
    check_peer(dst, "send");
    Ring& ring = *ring_of(rank(), dst);
    uint8_t* data = ring_data(rank(), dst);
    MsgHeader h{tag, bytes};
    ring_write(ring, data, &h, sizeof h, dst, tag, d);
    ring_write(ring, data, buf, bytes, dst, tag, d);
  }

  void recv(void* buf, size_t bytes, int src, int tag, Deadline d) override {
    check_alive_state();
    check_peer(src, "recv");
    // A message that arrived earlier under another tag waits in `unexpected_`.
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      if (it->src == src && it->tag == tag) {
        check_recv_size(it->data.size(), bytes, src, tag);
        detail::copy_bytes(buf, it->data.data(), bytes);
        unexpected_.erase(it);
        return;
      }
    }
    Ring& ring = *ring_of(src, rank());
    const uint8_t* data = ring_data(src, rank());
    for (;;) {
      MsgHeader h{};
      ring_read(ring, data, &h, sizeof h, src, tag, d);
      if (h.tag == tag) {
        if (h.bytes != bytes) {
          // Drain it so the pair stays in step, then report.
          std::vector<uint8_t> sink(h.bytes);
          ring_read(ring, data, sink.data(), h.bytes, src, tag, d);
          check_recv_size(h.bytes, bytes, src, tag);
        }
        ring_read(ring, data, buf, bytes, src, tag, d);
        return;
      }
      Unexpected u{src, h.tag, std::vector<uint8_t>(h.bytes)};
      ring_read(ring, data, u.data.data(), h.bytes, src, tag, d);
      unexpected_.push_back(std::move(u));
    }
  }

  void abort(const std::string& reason) override { set_abort(AbortKind::kOther, -1, reason); }

  // ---- symmetric memory --------------------------------------------------

  bool has_symmetric_memory() const override { return opt_.symmetric; }

  bool is_symmetric(const void* p, size_t bytes) const override { return sym_->find(p, bytes) != nullptr; }

  std::shared_ptr<void> allocate_symmetric(size_t bytes, Deadline d, std::string* why_not) override {
    if (!opt_.symmetric) {
      if (why_not) *why_not = "symmetric memory is off (TDIST_SHM_SYMMETRIC=0)";
      return nullptr;
    }
    const int n = size();
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t mapped = align_up(std::max<size_t>(bytes, 1), page);
    // Round 1 swaps segment names (or why there is none), round 2 reports
    // whether every rank mapped every segment.
    struct Record {
      uint32_t ok;
      char text[252];
    };
    static_assert(sizeof(Record) == 256, "records are exchanged as raw bytes");
    auto put = [](Record& r, bool ok, const std::string& text) {
      r.ok = ok ? 1 : 0;
      std::snprintf(r.text, sizeof r.text, "%s", text.c_str());
    };
    std::vector<uint8_t*> copies(n, nullptr);
    std::string name;
    Record mine{};
    {
      name = new_segment_name("-b" + std::to_string(seq_));
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      if (fd < 0) {
        put(mine, false, "cannot create " + name + ": " + detail::errno_string(errno));
      } else {
        // fallocate, not ftruncate: a full /dev/shm fails here rather than
        // with SIGBUS at the first touch.
        const int err = posix_fallocate(fd, 0, static_cast<off_t>(mapped));
        if (err != 0) close(fd);
        void* p = err == 0 ? map_and_close(fd, mapped) : MAP_FAILED;
        if (err != 0) {
          put(mine, false, "cannot reserve " + std::to_string(mapped) + " bytes of /dev/shm: " +
                               detail::errno_string(err));
        } else if (p == MAP_FAILED) {
          put(mine, false, "cannot map " + name + ": " + detail::errno_string(errno));
        } else {
          copies[rank()] = static_cast<uint8_t*>(p);
          put(mine, true, name);
        }
      }
    }
    const OpDesc first = make_desc(OpKind::kSymmetricAlloc, DataType::kUInt8, ReduceOp::kSum, -1, bytes);
    std::vector<Record> all(n);
    auto release = [&] {
      unmap_all(copies, mapped);
      if (mine.ok) shm_unlink(name.c_str());
      mine.ok = 0;
    };
    // The first failure among the records, as "rank R: why".
    auto first_failure = [&](const std::vector<Record>& recs) {
      for (int r = 0; r < n; ++r) {
        if (!recs[r].ok) return "rank " + std::to_string(global(r)) + ": " + std::string(recs[r].text);
      }
      return std::string();
    };
    try {
      gather_impl(&mine, all.data(), sizeof(Record), -1, first, d);
      std::string failed = first_failure(all);
      Record mapped_all{};
      if (failed.empty()) {
        std::string err;
        for (int r = 0; r < n && err.empty(); ++r) {
          if (r == rank()) continue;
          const std::string peer_name(all[r].text);
          const int fd = shm_open(peer_name.c_str(), O_RDWR | O_CLOEXEC, 0600);
          void* p = fd < 0 ? MAP_FAILED : map_and_close(fd, mapped);
          if (p == MAP_FAILED) {
            err = "cannot map rank " + std::to_string(global(r)) + "'s " + peer_name + ": " +
                  detail::errno_string(errno);
          } else {
            copies[r] = static_cast<uint8_t*>(p);
          }
        }
        put(mapped_all, err.empty(), err);
      } else {
        put(mapped_all, false, "");
      }
      // Everyone has mapped every segment (or given up) after this round.
      gather_impl(&mapped_all, all.data(), sizeof(Record), -1,
                  make_desc(OpKind::kSymmetricAlloc, DataType::kUInt8, ReduceOp::kSum, -1, bytes), d);
      if (mine.ok) shm_unlink(name.c_str());
      if (failed.empty()) failed = first_failure(all);
      if (!failed.empty()) {
        unmap_all(copies, mapped);
        if (why_not) *why_not = failed;
        return nullptr;
      }
    } catch (...) {
      release();
      throw;
    }
    SymBlock block;
    block.id = first.seq;
    block.bytes = bytes;
    block.mapped = mapped;
    block.copies = copies;
    uint8_t* own = copies[rank()];
    {
      std::lock_guard<std::mutex> lock(sym_->mu);
      sym_->blocks[reinterpret_cast<uintptr_t>(own)] = std::move(block);
    }
    return std::shared_ptr<void>(own, [registry = sym_, copies, mapped](void* p) {
      {
        std::lock_guard<std::mutex> lock(registry->mu);
        registry->blocks.erase(reinterpret_cast<uintptr_t>(p));
      }
      unmap_all(copies, mapped);
    });
  }

 private:
  struct Unexpected {
    int src;
    int64_t tag;
    std::vector<uint8_t> data;
  };

  // ---- set-up --------------------------------------------------------------

  void attach() {
    const int n = size();
    const size_t header_bytes = align_up(sizeof(Header), kAlign);
    const size_t slots = align_up(sizeof(Slot) * n, kAlign);
    const size_t staging = size_t(n) * 2 * opt_.round_bytes;
    const size_t rings = size_t(n) * n * (align_up(sizeof(Ring), kAlign) + opt_.ring_bytes);
    total_ = header_bytes + slots + staging + rings;
    slots_off_ = header_bytes;
    staging_off_ = header_bytes + slots;
    rings_off_ = staging_off_ + staging;

    Store& store = *ctx_.store;
    std::string name;
    int fd = -1;
    if (rank() == 0) {
      sweep_stale_segments();
      name = new_segment_name();
      fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      if (fd < 0) throw Error("shm backend: cannot create shared memory " + name + ": " + detail::errno_string(errno));
      if (ftruncate(fd, static_cast<off_t>(total_)) != 0) {
        const int err = errno;
        close(fd);
        shm_unlink(name.c_str());
        throw Error("shm backend: cannot size shared memory " + name + " to " + std::to_string(total_) +
                    " bytes (is /dev/shm full?): " + detail::errno_string(err));
      }
    }
    try {
      if (rank() == 0) {
        map(fd, name);
        auto* h = new (base_) Header{};
        h->version = kVersion;
        h->size = static_cast<uint32_t>(n);
        h->round_bytes = opt_.round_bytes;
        h->ring_bytes = opt_.ring_bytes;
        h->total_bytes = total_;
        for (int r = 0; r < n; ++r) new (slot(r)) Slot{};
        for (int s = 0; s < n; ++s)
          for (int d = 0; d < n; ++d) new (ring_of(s, d)) Ring{};
        std::atomic_thread_fence(std::memory_order_release);
        h->magic = kMagic;
        store.set("shm/segment", name);
      } else {
        name = to_string(store.get("shm/segment", ctx_.timeout));
        fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
        if (fd < 0) {
          throw Error("shm backend: rank " + std::to_string(global(rank())) + " cannot open " + name + ": " +
                      detail::errno_string(errno) + ". Are all ranks of this group on one host? Use the gloo backend across hosts");
        }
        struct stat st;
        if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != total_) {
          close(fd);
          throw Error("shm backend: segment " + name + " has an unexpected size; ranks disagree on the group size or buffer settings (TDIST_SHM_*)");
        }
        map(fd, name);
        if (header()->magic != kMagic || header()->version != kVersion || header()->size != static_cast<uint32_t>(n)) {
          throw Error("shm backend: segment " + name + " was made by another version or group size");
        }
      }
      Slot* me = slot(rank());
      me->start_time.store(process_start_time(getpid()));
      me->pid.store(getpid());
      if (store.add("shm/attached", 1) == n) store.set("shm/all_attached", "1");
      store.wait({"shm/all_attached"}, ctx_.timeout);
      if (rank() == 0) shm_unlink(name.c_str());
    } catch (...) {
      if (rank() == 0) shm_unlink(name.c_str());
      throw;
    }
  }

  void map(int fd, const std::string& name) {
    void* p = map_and_close(fd, total_);
    if (p == MAP_FAILED) throw Error("shm backend: cannot map " + name + ": " + detail::errno_string(errno));
    base_ = static_cast<uint8_t*>(p);
  }

  // ---- segment access ------------------------------------------------------

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  Slot* slot(int r) const { return reinterpret_cast<Slot*>(base_ + slots_off_) + r; }
  uint8_t* staging(int r, uint64_t parity) const {
    return base_ + staging_off_ + (size_t(r) * 2 + parity) * opt_.round_bytes;
  }
  // The buffer this rank fills in the current round. Right after a barrier
  // that is already the next round's buffer, free to write (see the rule at
  // the top of this file).
  uint8_t* mine() const { return staging(rank(), g_ % 2); }
  // Rank r's buffer from the round that just completed.
  const uint8_t* theirs(int r) const { return staging(r, (g_ - 1) % 2); }
  size_t ring_stride() const { return align_up(sizeof(Ring), kAlign) + opt_.ring_bytes; }
  Ring* ring_of(int src, int dst) const {
    return reinterpret_cast<Ring*>(base_ + rings_off_ + (size_t(src) * size() + dst) * ring_stride());
  }
  uint8_t* ring_data(int src, int dst) const {
    return reinterpret_cast<uint8_t*>(ring_of(src, dst)) + align_up(sizeof(Ring), kAlign);
  }
  int global(int r) const {
    return r >= 0 && r < static_cast<int>(ctx_.global_ranks.size()) ? ctx_.global_ranks[r] : r;
  }

  OpDesc make_desc(OpKind k, DataType t, ReduceOp op, int root, size_t count) {
    OpDesc d;
    d.kind = static_cast<uint8_t>(k);
    d.dtype = static_cast<uint8_t>(t);
    d.reduce_op = static_cast<uint8_t>(op);
    d.root = root;
    d.count = count;
    d.seq = seq_++;
    return d;
  }

  void check_root(int root) const {
    if (root < 0 || root >= size()) {
      throw UsageError("root " + std::to_string(root) + " is not a rank of this group of " + std::to_string(size()));
    }
  }
  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= size() || peer == rank()) {
      throw UsageError(std::string(op) + ": peer " + std::to_string(peer) + " is not another rank of this group of " +
                       std::to_string(size()));
    }
  }
  void check_recv_size(size_t got, size_t want, int src, int tag) {
    if (got != want) {
      fail(AbortKind::kMismatch, -1,
           "recv from rank " + std::to_string(global(src)) + " with tag " + std::to_string(tag) + " expected " +
               std::to_string(want) + " bytes but the message has " + std::to_string(got));
    }
  }

  // ---- failure -------------------------------------------------------------

  [[noreturn]] void raise(AbortKind kind, int peer, const std::string& msg) const {
    switch (kind) {
      case AbortKind::kTimeout: throw TimeoutError(msg);
      case AbortKind::kPeerFailure: throw PeerFailureError(msg, global(peer));
      case AbortKind::kMismatch: throw CollectiveMismatchError(msg);
      default: throw Error(msg);
    }
  }

  void set_abort(AbortKind kind, int peer, const std::string& reason) {
    Header* h = header();
    uint32_t expected = 0;
    if (h->abort_claimed.compare_exchange_strong(expected, 1)) {
      std::snprintf(h->abort_reason, sizeof h->abort_reason, "%s", reason.empty() ? "aborted" : reason.c_str());
      h->abort_from.store(rank());
      h->abort_peer.store(peer);
      h->aborted.store(static_cast<uint32_t>(kind == AbortKind::kNone ? AbortKind::kOther : kind),
                       std::memory_order_release);
    }
    h->wake.fetch_add(1);
    futex(&h->wake, FUTEX_WAKE, INT32_MAX, nullptr);
  }

  // Aborts the group for everyone, then raises on this rank.
  [[noreturn]] void fail(AbortKind kind, int peer, const std::string& msg) {
    set_abort(kind, peer, msg);
    raise(kind, peer, "shm backend, rank " + std::to_string(global(rank())) + ": " + msg);
  }

  // Raises if the group was aborted, by this rank or another.
  void check_alive_state() const {
    Header* h = header();
    const auto kind = static_cast<AbortKind>(h->aborted.load(std::memory_order_acquire));
    if (kind == AbortKind::kNone) return;
    raise(kind, h->abort_peer.load(),
          "shm backend, rank " + std::to_string(global(rank())) + ": the group was aborted by rank " +
              std::to_string(global(h->abort_from.load())) + ": " + h->abort_reason);
  }

  // Checks that the ranks in `waiting_for` are alive; aborts if one is not.
  void check_liveness(const std::vector<int>& waiting_for, const std::string& what) {
    for (int r : waiting_for) {
      const Slot* s = slot(r);
      const int pid = s->pid.load();
      if (pid <= 0) continue;
      const uint64_t start = process_start_time(pid);
      if (start == 0 || start != s->start_time.load() || !pid_alive(pid)) {
        fail(AbortKind::kPeerFailure, r,
             "rank " + std::to_string(global(r)) + " (pid " + std::to_string(pid) + ") died during " + what);
      }
    }
  }

  // ---- waiting -------------------------------------------------------------

  // Blocks until ready() or deadline. ready() is re-evaluated after every
  // wake-up; waiting_for() names the ranks that hold us up (for liveness
  // checks and the timeout message).
  template <typename Ready, typename Missing>
  void wait_until(Ready&& ready, Missing&& waiting_for, const std::string& what, Deadline deadline) {
    Header* h = header();
    const auto start = Clock::now();
    const auto spin_end = start + opt_.spin;
    const auto yield_end = std::min<Clock::time_point>(spin_end + opt_.yield, deadline);
    int polls = 0;
    while (true) {
      if (ready()) return;
      check_alive_state();
      if ((++polls & 63) == 0 && Clock::now() >= spin_end) break;
      _mm_pause();
    }
    while (Clock::now() < yield_end) {
      if (ready()) return;
      check_alive_state();
      sched_yield();
    }
    auto next_liveness = Clock::now();
    for (;;) {
      const uint32_t w = h->wake.load();
      if (ready()) return;
      check_alive_state();
      const auto now = Clock::now();
      if (now >= next_liveness) {
        check_liveness(waiting_for(), what);
        next_liveness = now + std::chrono::milliseconds(100);
      }
      if (now >= deadline) {
        std::string ranks;
        for (int r : waiting_for()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(global(r));
        fail(AbortKind::kTimeout, -1,
             what + " timed out; rank(s) " + (ranks.empty() ? "?" : ranks) + " never arrived");
      }
      const auto slice = std::min<Clock::duration>(std::min(deadline, next_liveness) - now, std::chrono::milliseconds(100));
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
      timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(std::max<int64_t>(ns % 1'000'000'000, 1000))};
      h->sleepers.fetch_add(1);
      futex(&h->wake, FUTEX_WAIT, w, &ts);
      h->sleepers.fetch_sub(1);
    }
  }

  void notify() {
    Header* h = header();
    h->wake.fetch_add(1);
    if (h->sleepers.load() > 0) futex(&h->wake, FUTEX_WAKE, INT32_MAX, nullptr);
  }

  // Arrives at barrier g_+1 and waits for everyone; afterwards theirs(r)
  // reads the buffers of the round just finished.
  void barrier_round(const OpDesc& desc, Deadline deadline) {
    check_alive_state();
    const uint64_t target = g_ + 1;
    slot(rank())->round.store(target, std::memory_order_release);
    notify();
    const int n = size();
    wait_until(
        [&] {
          for (int r = 0; r < n; ++r) {
            if (slot(r)->round.load(std::memory_order_acquire) < target) return false;
          }
          return true;
        },
        [&] {
          std::vector<int> missing;
          for (int r = 0; r < n; ++r) {
            if (slot(r)->round.load() < target) missing.push_back(r);
          }
          return missing;
        },
        describe(desc), deadline);
    g_ = target;
  }

  // The first barrier of an op: publishes desc with the round's data and
  // checks every rank's desc against ours afterwards.
  void first_barrier(const OpDesc& desc, Deadline deadline) {
    slot(rank())->desc[g_ % 2] = desc;
    barrier_round(desc, deadline);
    const uint64_t parity = (g_ - 1) % 2;
    for (int r = 0; r < size(); ++r) {
      const OpDesc other = slot(r)->desc[parity];
      if (other != desc) {
        std::string all;
        for (int q = 0; q < size(); ++q) {
          all += "\n  rank " + std::to_string(global(q)) + ": " + describe(slot(q)->desc[parity]);
        }
        fail(AbortKind::kMismatch, -1, "ranks called different collectives at the same step:" + all);
      }
    }
  }

  // ---- all_reduce / reduce -----------------------------------------------
  //
  // The pieces hold elements of type t; the staging buffers hold them as
  // wire (the same type, or float16/bfloat16 for float32 pieces). With a
  // narrower wire every value is narrowed once (as this rank posts or
  // reduces it), the reduction runs on wire values exactly as it would on a
  // wire buffer, and the result is widened into the pieces.
  void all_reduce_pieces(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op, Deadline d) {
    check_reduction(wire, op);
    const size_t es = dtype_size(t), ws = dtype_size(wire);
    const PieceWalker walk(pieces, es);
    const size_t count = walk.count();
    const OpDesc desc = make_desc(OpKind::kAllReduce, wire, op, -1, count);
    if (count * ws <= std::min(opt_.small_bytes, opt_.round_bytes)) {
      // One round: everyone posts the whole input, everyone reduces all of it
      // in rank order (bit-identical results on every rank).
      walk.for_each(0, count, [&](uint8_t* p, size_t off, size_t n) {
        convert(mine() + off * ws, wire, p, t, n);
      });
      first_barrier(desc, d);
      std::vector<const void*> inputs(size());
      alignas(64) uint16_t scratch[kScratchElems];  // wire values (16-bit when narrower)
      walk.for_each(0, count, [&](uint8_t* p, size_t off, size_t n) {
        if (wire == t) {
          for (int r = 0; r < size(); ++r) inputs[r] = theirs(r) + off * ws;
          reduce_many(p, inputs.data(), size(), n, t, op, size());
          return;
        }
        for (size_t b = 0; b < n; b += kScratchElems) {
          const size_t m = std::min(kScratchElems, n - b);
          for (int r = 0; r < size(); ++r) inputs[r] = theirs(r) + (off + b) * ws;
          reduce_many(scratch, inputs.data(), size(), m, wire, op, size());
          convert(p + b * es, t, scratch, wire, m);
        }
      });
      return;
    }
    uint64_t key[2] = {0, 0};
    plan_symmetric(pieces, es, key);
    reduce_scatter_gather(walk, t, wire, op, desc, /*root=*/-1, d, key);
  }

  // sym_parts_ and key for pieces that all lie in symmetric blocks, merged
  // where they touch; key stays {0, 0} otherwise. Equal keys on every rank
  // mean the same parts of the same blocks.
  void plan_symmetric(const std::vector<Piece>& pieces, size_t es, uint64_t key[2]) {
    sym_parts_.clear();
    {
      std::lock_guard<std::mutex> lock(sym_->mu);
      if (sym_->blocks.empty()) return;
    }
    for (const Piece& p : pieces) {
      if (p.count == 0) continue;
      const SymBlock* b = sym_->find(p.data, p.count * es);
      if (!b) {
        sym_parts_.clear();
        return;
      }
      const size_t offset = static_cast<size_t>(static_cast<uint8_t*>(p.data) - b->copies[rank()]);
      if (!sym_parts_.empty() && sym_parts_.back().block == b &&
          sym_parts_.back().offset + sym_parts_.back().count * es == offset) {
        sym_parts_.back().count += p.count;
      } else {
        sym_parts_.push_back({b, offset, p.count});
      }
    }
    if (sym_parts_.empty()) return;
    uint64_t h0 = 0x243f6a8885a308d3ull, h1 = 0x13198a2e03707344ull;
    for (const SymPart& part : sym_parts_) {
      for (uint64_t v : {part.block->id, static_cast<uint64_t>(part.offset), static_cast<uint64_t>(part.count)}) {
        h0 = mix64(h0, v);
        h1 = mix64(h1, ~v);
      }
    }
    key[0] = h0;
    key[1] = h1 | 1;  // never {0, 0}
  }

  // The symmetric all_reduce of sym_parts_ (count elements in all): rank r
  // reduces the r-th share straight from every rank's copy and writes the
  // result into every copy; the closing barrier keeps everyone off the
  // copies until all shares are done. Each element is reduced once, by one
  // rank, with the inputs in rank order (the staging path's bits).
  void symmetric_all_reduce(size_t count, DataType t, DataType wire, ReduceOp op, const OpDesc& desc, Deadline d) {
    const int n = size(), me = rank();
    const size_t es = dtype_size(t);
    const size_t line = std::max<size_t>(1, kAlign / es);
    const size_t per = ((count + n - 1) / n + line - 1) / line * line;
    const size_t begin = std::min(count, me * per), end = std::min(count, begin + per);
    std::vector<const void*> inputs(n);
    if (wire != t) sym_scratch_.resize((size_t(n) + 1) * kScratchElems);
    // The elements [begin, end) of the concatenation, part by part, in
    // blocks small enough that the copies to the other ranks read from cache.
    constexpr size_t kBlockBytes = 16 << 10;
    const size_t block = wire == t ? kBlockBytes / es : kScratchElems;
    size_t at = 0;  // first element of the current part
    for (const SymPart& part : sym_parts_) {
      const size_t lo = std::max(begin, at), hi = std::min(end, at + part.count);
      for (size_t e = lo; e < hi; e += block) {
        const size_t m = std::min(block, hi - e);
        const size_t off = part.offset + (e - at) * es;
        auto copy_of = [&](int q) { return part.block->copies[q] + off; };
        uint8_t* own = copy_of(me);
        uint8_t* next = n > 1 ? copy_of((me + 1) % n) : nullptr;
        if (wire == t) {
          for (int q = 0; q < n; ++q) inputs[q] = copy_of(q);
          reduce_many(own, inputs.data(), n, m, t, op, n, next);
        } else {
          // Narrow every rank's values, reduce as wire, widen the result.
          uint16_t* result = sym_scratch_.data() + size_t(n) * kScratchElems;
          for (int q = 0; q < n; ++q) {
            uint16_t* narrowed = sym_scratch_.data() + size_t(q) * kScratchElems;
            convert(narrowed, wire, copy_of(q), t, m);
            inputs[q] = narrowed;
          }
          reduce_many(result, inputs.data(), n, m, wire, op, n);
          convert(own, t, result, wire, m);
          if (next) detail::copy_bytes(next, own, m * es);
        }
        for (int k = 2; k < n; ++k) detail::copy_bytes(copy_of((me + k) % n), own, m * es);
      }
      at += part.count;
    }
    barrier_round(desc, d);
  }

  // Large path. Each round handles one chunk of count elements, split into
  // size() segments; rank r reduces segment r. In round j every rank posts
  // the segments of chunk j the others reduce, plus its reduced segment of
  // chunk j-1; after the barrier it reduces its segment of chunk j (straight
  // into the next round's buffer) and copies the others' reduced segments of
  // chunk j-1 into its output. One barrier per chunk, plus one to drain.
  //
  // An all_reduce (root < 0) publishes sym_key with its descriptor: when
  // every rank's key is the same non-zero one, the op continues as
  // symmetric_all_reduce; when some rank has one and another not, everyone
  // posts chunk 0 again (the ranks with a key skipped it) and passes one
  // more barrier before the staging path.
  void reduce_scatter_gather(const PieceWalker& walk, DataType t, DataType wire, ReduceOp op, const OpDesc& desc,
                             int root, Deadline d, const uint64_t* sym_key = nullptr) {
    const int n = size();
    const size_t es = dtype_size(t), ws = dtype_size(wire);
    const size_t count = walk.count();
    // Buffer layout per round: [n segments of seg elements][reduced segment].
    const size_t seg = std::max<size_t>(1, opt_.round_bytes / (n + 1) / kAlign * kAlign / ws);
    const size_t chunk = seg * n;
    const size_t chunks = std::max<size_t>(1, (count + chunk - 1) / chunk);
    const size_t red_off = seg * n * ws;
    const bool want_output = root < 0 || root == rank();
    std::vector<const void*> inputs(n);
    alignas(64) uint16_t scratch[kScratchElems];  // wire values (16-bit when narrower)
    // Chunk j's elements split evenly over the ranks (in whole cache lines),
    // so a tensor smaller than a chunk still shares the work.
    const size_t line = std::max<size_t>(1, kAlign / ws);
    auto seg_range = [&](size_t j, int s) {
      const size_t chunk_begin = j * chunk;
      const size_t chunk_len = std::min(chunk, count - std::min(count, chunk_begin));
      const size_t per = (chunk_len + n - 1) / n;
      const size_t per_aligned = std::min(seg, (per + line - 1) / line * line);
      const size_t begin = std::min(chunk_len, s * per_aligned);
      const size_t end = std::min(chunk_len, begin + per_aligned);
      return std::make_pair(chunk_begin + begin, end - begin);
    };
    // Posts the segments of chunk j that the other ranks reduce.
    auto post = [&](size_t j) {
      for (int s = 0; s < n; ++s) {
        if (s == rank()) continue;
        auto [begin, len] = seg_range(j, s);
        uint8_t* to = mine() + s * seg * ws;
        walk.for_each(begin, len, [&](uint8_t* p, size_t off, size_t k) {
          convert(to + off * ws, wire, p, t, k);
        });
      }
    };
    const bool have_key = sym_key && (sym_key[0] | sym_key[1]) != 0;
    {
      uint64_t* published = slot(rank())->sym_key[g_ % 2];
      published[0] = have_key ? sym_key[0] : 0;
      published[1] = have_key ? sym_key[1] : 0;
    }
    if (!have_key) post(0);
    first_barrier(desc, d);
    {
      const uint64_t parity = (g_ - 1) % 2;
      bool all_same = true, any_key = false;
      for (int r = 0; r < n; ++r) {
        const uint64_t* k = slot(r)->sym_key[parity];
        any_key = any_key || (k[0] | k[1]) != 0;
        all_same = all_same && have_key && k[0] == sym_key[0] && k[1] == sym_key[1];
      }
      if (all_same) {
        symmetric_all_reduce(count, t, wire, op, desc, d);
        return;
      }
      if (any_key) {
        post(0);
        barrier_round(desc, d);
      }
    }
    for (size_t j = 0; j <= chunks; ++j) {
      if (j > 0) {
        if (j < chunks) post(j);
        // (The reduced segment of chunk j-1 was written into this buffer at
        // the end of the previous round.)
        barrier_round(desc, d);
      }
      if (j < chunks) {
        auto [begin, len] = seg_range(j, rank());
        uint8_t* reduced = mine() + red_off;  // the next round's buffer
        walk.for_each(begin, len, [&](uint8_t* p, size_t off, size_t k) {
          if (wire == t) {
            for (int r = 0; r < n; ++r) inputs[r] = r == rank() ? p : theirs(r) + rank() * seg * ws + off * ws;
            reduce_many(reduced + off * ws, inputs.data(), n, k, t, op, n, want_output ? p : nullptr);
            return;
          }
          // Narrow this rank's values a block at a time, reduce, widen back.
          for (size_t b = 0; b < k; b += kScratchElems) {
            const size_t m = std::min(kScratchElems, k - b);
            convert(scratch, wire, p + b * es, t, m);
            for (int r = 0; r < n; ++r) {
              inputs[r] = r == rank() ? static_cast<const void*>(scratch)
                                      : theirs(r) + rank() * seg * ws + (off + b) * ws;
            }
            uint8_t* out = reduced + (off + b) * ws;
            reduce_many(out, inputs.data(), n, m, wire, op, n);
            if (want_output) convert(p + b * es, t, out, wire, m);
          }
        });
      }
      if (j >= 1 && want_output) {
        for (int r = 0; r < n; ++r) {
          if (r == rank()) continue;
          auto [begin, len] = seg_range(j - 1, r);
          const uint8_t* from = theirs(r) + red_off;
          walk.for_each(begin, len, [&](uint8_t* p, size_t off, size_t k) {
            convert(p, t, from + off * ws, wire, k);
          });
        }
      }
    }
  }

  // ---- gathers ---------------------------------------------------------------

  void gather_impl(const void* in, void* out, size_t bytes, int root, const OpDesc& desc, Deadline d) {
    const size_t chunk = opt_.round_bytes;
    const size_t rounds = std::max<size_t>(1, (bytes + chunk - 1) / chunk);
    const auto* src = static_cast<const uint8_t*>(in);
    auto* dst = static_cast<uint8_t*>(out);
    const bool want = root < 0 || root == rank();
    for (size_t j = 0; j < rounds; ++j) {
      const size_t off = j * chunk, len = std::min(chunk, bytes - std::min(bytes, off));
      detail::copy_bytes(mine(), src + off, len);
      if (j == 0) first_barrier(desc, d); else barrier_round(desc, d);
      if (!want) continue;
      for (int r = 0; r < size(); ++r) {
        uint8_t* to = dst + r * bytes + off;
        if (r == rank()) {
          if (to != src + off) detail::move_bytes(to, src + off, len);
        } else {
          detail::copy_bytes(to, theirs(r), len);
        }
      }
    }
  }

  // ---- rings -------------------------------------------------------------------

  void ring_write(Ring& ring, uint8_t* data, const void* src, size_t bytes, int dst, int tag, Deadline d) {
    const auto* p = static_cast<const uint8_t*>(src);
    const size_t cap = opt_.ring_bytes;
    uint64_t head = ring.head.load(std::memory_order_relaxed);
    while (bytes > 0) {
      uint64_t tail = ring.tail.load(std::memory_order_acquire);
      if (head - tail == cap) {
        wait_until([&] { return head - ring.tail.load(std::memory_order_acquire) < cap; },
                   [&] { return std::vector<int>{dst}; },
                   "send to rank " + std::to_string(global(dst)) + " (tag " + std::to_string(tag) + ")", d);
        tail = ring.tail.load(std::memory_order_acquire);
      }
      const size_t pos = head % cap;
      const size_t len = std::min({bytes, cap - (head - tail), cap - pos});
      detail::copy_bytes(data + pos, p, len);
      head += len;
      p += len;
      bytes -= len;
      ring.head.store(head, std::memory_order_release);
      notify();
    }
  }

  void ring_read(Ring& ring, const uint8_t* data, void* dst_buf, size_t bytes, int src, int tag, Deadline d) {
    auto* p = static_cast<uint8_t*>(dst_buf);
    const size_t cap = opt_.ring_bytes;
    uint64_t tail = ring.tail.load(std::memory_order_relaxed);
    while (bytes > 0) {
      uint64_t head = ring.head.load(std::memory_order_acquire);
      if (head == tail) {
        wait_until([&] { return ring.head.load(std::memory_order_acquire) != tail; },
                   [&] { return std::vector<int>{src}; },
                   "recv from rank " + std::to_string(global(src)) + " (tag " + std::to_string(tag) + ")", d);
        head = ring.head.load(std::memory_order_acquire);
      }
      const size_t pos = tail % cap;
      const size_t len = std::min({bytes, static_cast<size_t>(head - tail), cap - pos});
      detail::copy_bytes(p, data + pos, len);
      tail += len;
      p += len;
      bytes -= len;
      ring.tail.store(tail, std::memory_order_release);
      notify();
    }
  }

  BackendContext ctx_;
  ShmOptions opt_;
  uint8_t* base_ = nullptr;
  size_t total_ = 0;
  size_t slots_off_ = 0, staging_off_ = 0, rings_off_ = 0;
  uint64_t g_ = 0;    // barriers passed by this rank
  uint64_t seq_ = 0;  // collectives started by this rank
  std::deque<Unexpected> unexpected_;
  std::shared_ptr<SymRegistry> sym_ = std::make_shared<SymRegistry>();
  std::vector<SymPart> sym_parts_;      // the current all_reduce's, reused
  std::vector<uint16_t> sym_scratch_;   // (size() + 1) * kScratchElems wire values
};

}  // namespace

ShmOptions ShmOptions::from_env() {
  ShmOptions o;
  auto read = [](const char* name, int64_t lo, int64_t hi, int64_t fallback) -> int64_t {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    auto parsed = detail::parse_int(v);
    if (!parsed || *parsed < lo || *parsed > hi) {
      throw UsageError(std::string(name) + " must be an integer in [" + std::to_string(lo) + ", " +
                       std::to_string(hi) + "], got '" + v + "'");
    }
    return *parsed;
  };
  o.round_bytes = static_cast<size_t>(read("TDIST_SHM_ROUND_BYTES", 4096, int64_t(1) << 30, int64_t(o.round_bytes)));
  o.small_bytes = static_cast<size_t>(read("TDIST_SHM_SMALL_BYTES", 0, int64_t(1) << 30, int64_t(o.small_bytes)));
  o.spin = std::chrono::microseconds(read("TDIST_SHM_SPIN_US", 0, 10'000'000, o.spin.count()));
  o.yield = std::chrono::microseconds(read("TDIST_SHM_YIELD_US", 0, 10'000'000, o.yield.count()));
  o.symmetric = read("TDIST_SHM_SYMMETRIC", 0, 1, o.symmetric ? 1 : 0) != 0;
  return o;
}

std::unique_ptr<Backend> make_shm_backend(const BackendContext& ctx, const ShmOptions& options) {
  return std::make_unique<ShmBackend>(ctx, options);
}

int sweep_stale_segments() {
  int removed = 0;
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  const std::string prefix = kSegmentPrefix;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    auto pid = detail::parse_int(name.substr(prefix.size(), name.find('-', prefix.size()) - prefix.size()));
    if (!pid || *pid <= 0) continue;
    if (!pid_alive(static_cast<int>(*pid)) || process_start_time(static_cast<int>(*pid)) == 0) {
      if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
    }
  }
  closedir(dir);
  return removed;
}

}  // namespace tdist::comm::shm
