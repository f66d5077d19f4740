// Backend: the engine under a process group, on raw buffers.
//
// Contract:
// - One Backend serves one group. Its collectives are called from one thread
//   at a time (the group's worker thread, or a thread that runs an op
//   inline while waiting for it), in the same order on every rank.
// - Every call blocks until done or until `deadline`; past it, TimeoutError
//   naming the op, its sequence number and the ranks that never arrived.
//   A dead peer raises PeerFailureError naming it; ranks calling different
//   ops raise CollectiveMismatchError. After any error the backend is
//   unusable ("aborted"): later calls fail fast with the first error.
// - Buffers are contiguous and stay valid for the call; `in` and `out` may be
//   the same pointer where a call says so.
// - abort() may be called from any thread; it wakes blocked calls, which
//   then raise.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/types.h"
#include "tdist/store.h"

namespace tdist::comm {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// A deadline not yet read from the clock: a synchronous op on a backend
// whose lazy_deadline() is true gets this, and the op's
// LazyDeadlineScope's timeout counts from its first wait (the first
// resolve_deadline), so that an op that never waits reads no clock. It is
// the clock's epoch: a site that compared it without resolving it would
// time out at once, loudly.
inline constexpr Deadline kLazyDeadline{};

// Set by the thread that runs a synchronous op for its length (scopes
// nest; defined in op_label.cpp, beside the op's number).
class LazyDeadlineScope {
 public:
  explicit LazyDeadlineScope(std::chrono::milliseconds timeout);
  ~LazyDeadlineScope();
  LazyDeadlineScope(const LazyDeadlineScope&) = delete;
  LazyDeadlineScope& operator=(const LazyDeadlineScope&) = delete;
  // now + timeout, read at the first call and the same ever after.
  Deadline resolve();

 private:
  std::chrono::milliseconds timeout_;
  Deadline at_{};
  bool resolved_ = false;
  LazyDeadlineScope* saved_;
};

// d itself, or for kLazyDeadline the running op's deadline (resolved now
// if this is its first wait; with no scope, kLazyDeadline: expired).
Deadline resolve_deadline(Deadline d);

// count elements of some dtype at data: one part of a buffer that lives in
// several places (all_reduce_coalesced).
struct Piece {
  void* data = nullptr;
  size_t count = 0;
};

// The elements [begin, begin + len) of a buffer made of pieces, walked
// piece by piece: fn(pointer, offset from begin, elements) for each stretch
// that lies in one piece. It points at the caller's pieces (they must
// outlive it) and allocates nothing for up to kInline of them: a small
// op's walk costs no heap.
class PieceWalker {
 public:
  PieceWalker(const Piece* pieces, size_t n, size_t element_size);
  PieceWalker(const std::vector<Piece>& pieces, size_t element_size)
      : PieceWalker(pieces.data(), pieces.size(), element_size) {}
  PieceWalker(const PieceWalker&) = delete;
  PieceWalker& operator=(const PieceWalker&) = delete;
  size_t count() const { return starts_[n_]; }
  template <typename Fn>
  void for_each(size_t begin, size_t len, Fn&& fn) const {
    if (len == 0) return;
    size_t k = locate(begin);
    size_t done = 0;
    while (done < len) {
      const size_t at = begin + done - starts_[k];
      const size_t n = std::min(len - done, pieces_[k].count - at);
      if (n > 0) fn(static_cast<uint8_t*>(pieces_[k].data) + at * es_, done, n);
      done += n;
      ++k;
    }
  }

 private:
  static constexpr size_t kInline = 4;
  size_t locate(size_t element) const;  // the piece holding element
  const Piece* pieces_;
  size_t n_;
  size_t es_;
  // starts_[k]: first element of piece k; starts_[n_]: the total. Points
  // into inline_ for up to kInline pieces, else into heap_.
  size_t inline_[kInline + 1];
  std::vector<size_t> heap_;
  size_t* starts_;
};

// What a rank is about to do, compared across ranks to catch mismatches.
struct OpDesc {
  uint8_t kind = 0;  // OpKind
  uint8_t dtype = 0;
  uint8_t reduce_op = 0;
  uint8_t flags = 0;  // the backend's own, never compared (shm: the path offers, comm/shm/path.h)
  int32_t root = -1;
  uint64_t count = 0;  // elements (or bytes for untyped ops)
  uint32_t seq = 0;    // the backend's own count of its ops in the group (its protocol's, from 0, modulo 2^32;
                       // errors name the group's number, op_label.h)
  // A hash of the rank's earlier ops' descriptors: ops that compare
  // nothing (an eager broadcast's root) are checked at the next op that does.
  uint32_t history = 0;
  bool operator==(const OpDesc& o) const {
    return kind == o.kind && dtype == o.dtype && reduce_op == o.reduce_op && root == o.root && count == o.count &&
           seq == o.seq && history == o.history;
  }
  // The same op, whatever came before it.
  bool same_op(const OpDesc& o) const {
    return kind == o.kind && dtype == o.dtype && reduce_op == o.reduce_op && root == o.root && count == o.count &&
           seq == o.seq;
  }
  bool operator!=(const OpDesc& o) const { return !(*this == o); }
};

enum class OpKind : uint8_t {
  kAllReduce = 1,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kGather,
  kScatter,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
  kSymmetricAlloc,  // allocate_symmetric
};

const char* op_kind_name(OpKind k);
// "all_reduce(float32 x 1024, SUM)" and the like, for error messages.
std::string describe_op(const OpDesc& d);
// The same with the op's number as its group gave it ("... #13";
// op_label.h), or, with no group op running on this thread, the
// backend's own count from 1.
std::string describe(const OpDesc& d);

// What a backend is built from.
struct BackendContext {
  std::shared_ptr<Store> store;   // private to this group (a PrefixStore)
  int rank = 0;                   // rank in the group
  int size = 1;                   // ranks in the group
  std::vector<int> global_ranks;  // group rank -> world rank, for messages
  std::string group_name;
  std::chrono::milliseconds timeout{600'000};  // for set-up steps
  // The master's address when known (tcp:// and env://): network backends
  // bind the local interface that routes there.
  std::string master_addr;
};

// Errors a backend finds after a call has returned: one that queues GPU
// work (nccl) learns of a failed or timed-out op in its watchdog. The first
// error is kept; every later call of the backend, and every Work waited on
// after it, raises it.
class AsyncErrors {
 public:
  void set(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_) return;
    first_ = std::move(e);
    failed_.store(true, std::memory_order_release);
  }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  void rethrow_if_failed() const {
    if (!failed()) return;
    std::lock_guard<std::mutex> lock(mu_);
    std::rethrow_exception(first_);
  }

 private:
  mutable std::mutex mu_;
  std::exception_ptr first_;
  std::atomic<bool> failed_{false};
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Whether buffers may live in CUDA memory (a nccl backend would say yes);
  // otherwise the process group accepts CPU tensors only.
  virtual bool supports_cuda() const { return false; }
  // Whether every wait of this backend resolves its deadline
  // (resolve_deadline), so that a synchronous op may pass kLazyDeadline.
  virtual bool lazy_deadline() const { return false; }
  // Where errors found after a call returned are kept (nullptr: the backend
  // reports every error from the call itself).
  virtual std::shared_ptr<AsyncErrors> async_errors() const { return nullptr; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  virtual void all_reduce(void* buf, size_t count, DataType t, ReduceOp op, Deadline d) = 0;
  // all_reduce of the pieces as if laid end to end: the same result, element
  // for element, as all_reduce of their concatenation (and the same op to
  // the other ranks, who may pass it cut differently). This default packs
  // the pieces into one buffer and back; shm reads and writes them in place.
  virtual void all_reduce_coalesced(const std::vector<Piece>& pieces, DataType t, ReduceOp op, Deadline d);
  // all_reduce_coalesced of float32 pieces carried as `wire` (float16 or
  // bfloat16): the same bits as narrowing the pieces to wire, all-reducing
  // that in wire, and widening the result back into the pieces. The default
  // does exactly that through one packed wire buffer; shm narrows and
  // widens inside its own copy and reduce passes.
  virtual void all_reduce_coalesced_as(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op,
                                       Deadline d);
  // all_gather of several buffers as one op: for each k, out[k] (size() *
  // in[k].count elements of t) receives every rank's in[k], rank r's at
  // element r * in[k].count. Every rank passes the same counts, in the
  // same order: a different total is a CollectiveMismatchError, a
  // different split of the same total is not caught here (the process
  // group's TDIST_DEBUG=detail collective check's signature lists every piece's count).
  // in[k] may alias rank()'s slot of out[k], and overlap no other output. The default packs the inputs into one buffer, makes one
  // all_gather and copies each rank's part out (a network backend pays its
  // per-call latency once); shm takes large pieces one by one on their
  // in-place and single-copy paths and packs the rest.
  virtual void all_gather_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                                    Deadline d);
  // reduce_scatter of several buffers as one op: for each k, out[k]
  // (in[k].count / size() elements) = op over the ranks of their in[k]'s
  // rank()-th slice. The same counts on every rank; no piece of out may
  // overlap a piece of in. The default packs the inputs rank by rank into
  // one buffer and makes one reduce_scatter; shm as for all_gather.
  virtual void reduce_scatter_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                                        ReduceOp op, Deadline d);
  virtual void broadcast(void* buf, size_t bytes, int root, Deadline d) = 0;
  // Only root's buf receives the result; the others' bufs are unchanged.
  virtual void reduce(void* buf, size_t count, DataType t, ReduceOp op, int root, Deadline d) = 0;
  // out holds size() * bytes, rank r's contribution at r * bytes. in may
  // alias out + rank() * bytes.
  virtual void all_gather(const void* in, void* out, size_t bytes, Deadline d) = 0;
  // in holds size() * count elements; out receives this rank's count.
  virtual void reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op, Deadline d) = 0;
  // out (root only, else ignored) holds size() * bytes.
  virtual void gather(const void* in, void* out, size_t bytes, int root, Deadline d) = 0;
  // in (root only, else ignored) holds size() * bytes.
  virtual void scatter(const void* in, void* out, size_t bytes, int root, Deadline d) = 0;
  // Sends send_bytes[r] bytes from in + send_offsets[r] to rank r, which
  // receives them at out + recv_offsets[rank()]. Every rank's recv sizes must
  // match what the senders send (CollectiveMismatchError otherwise).
  virtual void all_to_all(const void* in, const std::vector<size_t>& send_bytes,
                          const std::vector<size_t>& send_offsets, void* out, const std::vector<size_t>& recv_bytes,
                          const std::vector<size_t>& recv_offsets, Deadline d) = 0;
  virtual void barrier(Deadline d) = 0;
  virtual void send(const void* buf, size_t bytes, int dst, int tag, Deadline d) = 0;
  virtual void recv(void* buf, size_t bytes, int src, int tag, Deadline d) = 0;

  // Marks the backend failed with `reason` and wakes blocked calls on this
  // rank and, where the backend can, on the others.
  virtual void abort(const std::string& reason) = 0;

  // ---- symmetric memory (optional) ------------------------------------------
  // A block of `bytes` zero-filled bytes on every rank that this backend's
  // collectives reach directly on every rank (shm: each rank's block is
  // mapped into every process of the group). An all_reduce whose buffers
  // are the same part of one block on every rank then reads and writes the
  // ranks' copies in place, without staging. Collective: every rank calls
  // it with the same bytes, in the same order as its other collectives.
  // The block is released when the last copy of the pointer goes (on any
  // thread; the backend may be gone by then). nullptr when the backend has
  // none (the default, without communicating) or when some rank could not
  // get it (every rank then gets nullptr; *why_not says what happened).
  virtual std::shared_ptr<void> allocate_symmetric(size_t bytes, Deadline d, std::string* why_not = nullptr);
  virtual bool has_symmetric_memory() const { return false; }
  // Whether [p, p + bytes) lies inside one block from allocate_symmetric.
  virtual bool is_symmetric(const void* p, size_t bytes) const;

 protected:
  Backend(int rank, int size) : rank_(rank), size_(size) {}

 private:
  // The defaults above: pack the pieces (narrowed to wire) into pack_,
  // all_reduce that, unpack (widened back).
  void packed_all_reduce(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op, Deadline d);

  int rank_;
  int size_;
  // The packed buffer of the default coalesced ops, kept between calls
  // (fresh megabytes every step cost page faults) up to 64 MiB. Collectives
  // of one backend run on one thread at a time.
  std::vector<uint8_t> pack_;
};

// ---- the registry -----------------------------------------------------------

using BackendFactory = std::function<std::unique_ptr<Backend>(const BackendContext&)>;

// Registers a backend under name (e.g. "shm", "gloo", "nccl"). Registering a
// name twice replaces the factory.
void register_backend(const std::string& name, BackendFactory factory);
bool has_backend(const std::string& name);
std::vector<std::string> backend_names();
// UsageError naming the known backends when name is unknown.
std::unique_ptr<Backend> create_backend(const std::string& name, const BackendContext& ctx);

}  // namespace tdist::comm
