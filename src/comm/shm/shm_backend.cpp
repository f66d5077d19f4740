// The shm backend: the Backend interface over the pieces in this folder.
//
//   segment.h              the group segment (made by rank 0, mapped by
//                          all, unlinked at once), naming, stale sweep
//   process_info.h         whether a pid is alive, and since when
//   waiter.h               waiting (pause, sched_yield, futex), liveness,
//                          the group's abort record
//   rounds.h               the round/barrier protocol over staging buffers
//   algorithms.h           one function per collective algorithm
//   symmetric.h            symmetric blocks and their registry
//   symmetric_allreduce.h  the in-place all_reduce over them
//   rings.h                send/recv through a ring per pair of ranks
//   cma.h                  single-copy transfers between the ranks' memory
//   path.h                 which path an op takes (symmetric, single-copy,
//                          staged), agreed with its first round
//
// ShmBackend checks arguments, gives each op its descriptor (and so its
// sequence number), picks the algorithm and delegates; it holds no protocol
// state of its own.
#include "comm/shm/shm_backend.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>

#include "comm/reduce.h"
#include "comm/shm/algorithms.h"
#include "comm/shm/cma.h"
#include "comm/shm/rings.h"
#include "comm/shm/rounds.h"
#include "comm/shm/segment.h"
#include "comm/shm/symmetric.h"
#include "comm/shm/symmetric_allreduce.h"
#include "comm/shm/waiter.h"
#include "util/env.h"

namespace tdist::comm::shm {

namespace {

// The options as the backend uses them: buffers of at least a page, in
// whole cache lines.
ShmOptions settled(ShmOptions o) {
  o.round_bytes = align_up(std::max<size_t>(o.round_bytes, 4096), kAlign);
  o.ring_bytes = align_up(std::max<size_t>(o.ring_bytes, 4096), kAlign);
  return o;
}

class ShmBackend final : public Backend {
 public:
  ShmBackend(const BackendContext& ctx, const ShmOptions& options)
      : Backend(ctx.rank, ctx.size),
        ctx_(ctx),
        opt_(settled(options)),
        segment_(ctx_, opt_.round_bytes, opt_.ring_bytes),
        waiter_(segment_, ctx_.rank, ctx_.global_ranks, opt_.spin, opt_.yield),
        rounds_(segment_, waiter_),
        p2p_(segment_, waiter_) {}

  std::string name() const override { return "shm"; }
  bool lazy_deadline() const override { return true; }  // every wait goes through Waiter::wait_until

  // ---- collectives ------------------------------------------------------

  void all_reduce(void* buf, size_t count, DataType t, ReduceOp op, Deadline d) override {
    const Piece piece{buf, count};
    all_reduce_pieces(&piece, 1, t, t, op, d);
  }

  // Reads and writes the pieces in place: no packing.
  void all_reduce_coalesced(const std::vector<Piece>& pieces, DataType t, ReduceOp op, Deadline d) override {
    all_reduce_pieces(pieces.data(), pieces.size(), t, t, op, d);
  }

  // Narrows while it copies out and reduces, widens while it copies back.
  void all_reduce_coalesced_as(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op,
                               Deadline d) override {
    if (!can_convert(wire, t)) {
      throw UsageError(std::string("shm backend: cannot carry ") + dtype_name(t) + " as " + dtype_name(wire));
    }
    all_reduce_pieces(pieces.data(), pieces.size(), t, wire, op, d);
  }

  void reduce(void* buf, size_t count, DataType t, ReduceOp op, int root, Deadline d) override {
    check_reduction(t, op);
    check_root(root);
    const OpDesc desc = rounds_.begin_op(OpKind::kReduce, t, op, root, count, d);
    if (count * dtype_size(t) <= std::min(opt_.small_bytes, opt_.round_bytes)) {
      algo::reduce_small(rounds_, buf, count, t, op, root, desc, d);
      return;
    }
    const Piece piece{buf, count};
    algo::reduce_scatter_gather(rounds_, PieceWalker(&piece, 1, dtype_size(t)), t, t, op, desc, root, d);
  }

  void broadcast(void* buf, size_t bytes, int root, Deadline d) override {
    check_root(root);
    algo::broadcast(rounds_, buf, bytes, root,
                    rounds_.begin_op(OpKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, root, bytes, d), d, cma());
  }

  void all_gather(const void* in, void* out, size_t bytes, Deadline d) override {
    algo::gather(rounds_, in, out, bytes, -1,
                 rounds_.begin_op(OpKind::kAllGather, DataType::kUInt8, ReduceOp::kSum, -1, bytes, d), d,
                 SymSpan::find(*sym_, in, bytes, rank()), cma());
  }

  // Pieces of at least small_bytes (per rank) go one by one, each on the
  // paths of all_gather (in place from symmetric memory, single-copy);
  // the rest are packed into one op. Counts decide, so every rank splits
  // the same way.
  void all_gather_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                            Deadline d) override {
    const size_t es = dtype_size(t);
    std::vector<Piece> small_in, small_out;
    std::vector<size_t> large;
    split_pieces(in, out, es, /*per_rank_in=*/true, small_in, small_out, large);
    if (!small_in.empty()) Backend::all_gather_coalesced(small_in, small_out, t, d);
    for (size_t k : large) all_gather(in[k].data, out[k].data, in[k].count * es, d);
  }

  void reduce_scatter_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                                ReduceOp op, Deadline d) override {
    const size_t es = dtype_size(t);
    std::vector<Piece> small_in, small_out;
    std::vector<size_t> large;
    split_pieces(in, out, es, /*per_rank_in=*/false, small_in, small_out, large);
    if (!small_in.empty()) Backend::reduce_scatter_coalesced(small_in, small_out, t, op, d);
    for (size_t k : large) reduce_scatter(in[k].data, out[k].data, out[k].count, t, op, d);
  }

  void gather(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    check_root(root);
    algo::gather(rounds_, in, out, bytes, root,
                 rounds_.begin_op(OpKind::kGather, DataType::kUInt8, ReduceOp::kSum, root, bytes, d), d);
  }

  void scatter(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    check_root(root);
    algo::scatter(rounds_, in, out, bytes, root,
                  rounds_.begin_op(OpKind::kScatter, DataType::kUInt8, ReduceOp::kSum, root, bytes, d), d);
  }

  void reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op, Deadline d) override {
    check_reduction(t, op);
    algo::reduce_scatter(rounds_, in, out, count, t, op,
                         rounds_.begin_op(OpKind::kReduceScatter, t, op, -1, count, d), d,
                         SymSpan::find(*sym_, in, count * size() * dtype_size(t), rank()), cma());
  }

  void all_to_all(const void* in, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  void* out, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Deadline d) override {
    algo::all_to_all(rounds_, in, send_bytes, send_offsets, out, recv_bytes, recv_offsets,
                     rounds_.begin_op(OpKind::kAllToAll, DataType::kUInt8, ReduceOp::kSum, -1, 0, d), d);
  }

  void barrier(Deadline d) override {
    rounds_.first_barrier(rounds_.begin_op(OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0, d), d);
  }

  // ---- point to point ----------------------------------------------------

  void send(const void* buf, size_t bytes, int dst, int tag, Deadline d) override {
    p2p_.send(buf, bytes, dst, tag, d);
  }

  void recv(void* buf, size_t bytes, int src, int tag, Deadline d) override { p2p_.recv(buf, bytes, src, tag, d); }

  void abort(const std::string& reason) override { waiter_.set_abort(AbortKind::kOther, -1, reason); }

  // ---- symmetric memory --------------------------------------------------

  bool has_symmetric_memory() const override { return opt_.symmetric; }

  bool is_symmetric(const void* p, size_t bytes) const override { return sym_->find(p, bytes) != nullptr; }

  std::shared_ptr<void> allocate_symmetric(size_t bytes, Deadline d, std::string* why_not) override {
    if (!opt_.symmetric) {
      if (why_not) *why_not = "symmetric memory is off (TDIST_SHM_SYMMETRIC=0)";
      return nullptr;
    }
    return allocate_symmetric_block(rounds_, sym_, bytes, d, why_not);
  }

 private:
  // Single-copy transfers, for groups of more than one rank.
  CmaChannel* cma() { return size() > 1 ? &cma_ : nullptr; }

  void check_root(int root) const {
    if (root < 0 || root >= size()) {
      throw UsageError("root " + std::to_string(root) + " is not a rank of this group of " + std::to_string(size()));
    }
  }

  // The pieces of a coalesced op that go packed (small_in/small_out) and
  // the indices of those that go alone: a piece is large when its
  // per-rank part (in[k] for all_gather, out[k] for reduce_scatter) has at
  // least small_bytes. Mismatched counts go to the base class, which
  // refuses them.
  void split_pieces(const std::vector<Piece>& in, const std::vector<Piece>& out, size_t es, bool per_rank_in,
                    std::vector<Piece>& small_in, std::vector<Piece>& small_out, std::vector<size_t>& large) const {
    if (in.size() != out.size()) {
      small_in = in;
      small_out = out;
      return;
    }
    for (size_t k = 0; k < in.size(); ++k) {
      const size_t part = (per_rank_in ? in[k].count : out[k].count) * es;
      const size_t whole = (per_rank_in ? out[k].count : in[k].count) * es;
      if (part >= opt_.small_bytes && part > 0 && whole == part * static_cast<size_t>(size())) {
        large.push_back(k);
      } else {
        small_in.push_back(in[k]);
        small_out.push_back(out[k]);
      }
    }
  }

  // all_reduce of the pieces carried as wire (see algorithms.h): one round
  // when small, else in place when the pieces are symmetric on every rank,
  // else staged.
  void all_reduce_pieces(const Piece* pieces, size_t n, DataType t, DataType wire, ReduceOp op, Deadline d) {
    check_reduction(wire, op);
    if (size() == 1 && wire == t) return;  // the reduction of one rank's values is those values
    const size_t es = dtype_size(t), ws = dtype_size(wire);
    const PieceWalker walk(pieces, n, es);
    const size_t count = walk.count();
    const OpDesc desc = rounds_.begin_op(OpKind::kAllReduce, wire, op, -1, count, d);
    if (count * ws <= std::min(opt_.small_bytes, opt_.round_bytes)) {
      algo::all_reduce_small(rounds_, walk, t, wire, op, desc, d);
      return;
    }
    sym_reduce_.plan(std::vector<Piece>(pieces, pieces + n), es, rank());
    algo::reduce_scatter_gather(rounds_, walk, t, wire, op, desc, /*root=*/-1, d, &sym_reduce_, cma());
  }

  BackendContext ctx_;  // held for the group's lifetime (its store with it)
  ShmOptions opt_;
  GroupSegment segment_;
  Waiter waiter_;
  Rounds rounds_;
  PointToPoint p2p_;
  std::shared_ptr<SymRegistry> sym_ = std::make_shared<SymRegistry>();
  SymmetricAllReduce sym_reduce_{sym_};
  CmaChannel cma_{opt_.cma_bytes, !opt_.cma_calibrate ? CmaChannel::Role::kOffersWheneverItMay
                                  : rank() == 0      ? CmaChannel::Role::kDecides
                                                     : CmaChannel::Role::kFollows};
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
  o.cma_bytes = static_cast<size_t>(read("TDIST_SHM_CMA_BYTES", 0, int64_t(1) << 50, int64_t(o.cma_bytes)));
  o.cma_calibrate = read("TDIST_SHM_CMA_CALIBRATE", 0, 1, o.cma_calibrate ? 1 : 0) != 0;
  return o;
}

std::unique_ptr<Backend> make_shm_backend(const BackendContext& ctx, const ShmOptions& options) {
  return std::make_unique<ShmBackend>(ctx, options);
}

}  // namespace tdist::comm::shm
