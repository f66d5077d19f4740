// The mpi backend: MPI's collectives, for jobs launched by mpirun (built
// when TDIST_WITH_MPI is on).
//
// MPI calls block without a timeout, so every op is issued non-blocking
// (MPI_Iallreduce, ...) and its request is polled against the op's
// deadline. MPI cannot cancel a collective: after a timeout the backend is
// aborted and later ops fail at once. MPI's built-in ops serve the standard
// types; float16/bfloat16 reduce through user-defined ops that accumulate
// pairwise in float32. AVG is a SUM followed by a local division.
#include "comm/mpi/mpi_backend.h"

// Only MPI's C API: keep OpenMPI's and MPICH's C++ bindings out.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <immintrin.h>
#include <mpi.h>

#include <climits>
#include <deque>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "comm/heartbeat.h"
#include "comm/op_label.h"
#include "comm/reduce.h"
#include "util/bytes.h"

namespace tdist::comm::mpi_backend {

namespace {

// MPI is initialised once per process. With less than MPI_THREAD_MULTIPLE,
// every MPI call (including the polling MPI_Test) takes this lock, so groups
// on several worker threads stay safe.
std::mutex g_mpi_mu;
bool g_multiple = false;

void ensure_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    int inited = 0;
    MPI_Initialized(&inited);
    int provided = MPI_THREAD_SINGLE;
    if (!inited) {
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      std::atexit([] {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Finalize();
      });
    } else {
      MPI_Query_thread(&provided);
    }
    g_multiple = provided >= MPI_THREAD_MULTIPLE;
    if (provided < MPI_THREAD_SERIALIZED) {
      throw Error("mpi backend: the MPI library offers only thread level " + std::to_string(provided) +
                  "; tdist calls MPI from its worker threads and needs MPI_THREAD_SERIALIZED or more");
    }
  });
}

class MpiLock {
 public:
  MpiLock() {
    if (!g_multiple) lock_ = std::unique_lock<std::mutex>(g_mpi_mu);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

// ---- datatypes and ops ------------------------------------------------------

MPI_Datatype g_half = MPI_DATATYPE_NULL, g_bf16 = MPI_DATATYPE_NULL;

template <DataType T, ReduceOp Op>
void user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const void* inputs[] = {inout, in};
  reduce_many(inout, inputs, 2, static_cast<size_t>(*len), T, Op, 1);
}

template <DataType T>
MPI_Op make_user_op(ReduceOp op) {
  MPI_Op out;
  switch (op) {
    case ReduceOp::kProduct: MPI_Op_create(&user_reduce<T, ReduceOp::kProduct>, 1, &out); break;
    case ReduceOp::kMin: MPI_Op_create(&user_reduce<T, ReduceOp::kMin>, 1, &out); break;
    case ReduceOp::kMax: MPI_Op_create(&user_reduce<T, ReduceOp::kMax>, 1, &out); break;
    default: MPI_Op_create(&user_reduce<T, ReduceOp::kSum>, 1, &out); break;
  }
  return out;
}

MPI_Datatype mpi_type(DataType t) {
  switch (t) {
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
    case DataType::kFloat16: return g_half;
    case DataType::kBFloat16: return g_bf16;
    case DataType::kInt8: return MPI_INT8_T;
    case DataType::kUInt8: return MPI_UINT8_T;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kBool: return MPI_C_BOOL;
  }
  return MPI_BYTE;
}

class MpiBackend final : public Backend {
 public:
  explicit MpiBackend(const BackendContext& ctx) : Backend(ctx.rank, ctx.size), ctx_(ctx) {
    ensure_initialized();
    MpiLock lock;
    static std::once_flag types_once;
    std::call_once(types_once, [] {
      MPI_Type_contiguous(2, MPI_BYTE, &g_half);
      MPI_Type_commit(&g_half);
      MPI_Type_contiguous(2, MPI_BYTE, &g_bf16);
      MPI_Type_commit(&g_bf16);
    });
    int world_rank = -1, world_size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    const int me = ctx.global_ranks.empty() ? ctx.rank : ctx.global_ranks[ctx.rank];
    if (me != world_rank) {
      throw UsageError("mpi backend: this process is rank " + std::to_string(me) + " to tdist but rank " +
                       std::to_string(world_rank) + " to MPI; launch with mpirun and let env:// read "
                       "OMPI_COMM_WORLD_RANK (do not set RANK)");
    }
    for (int r : ctx.global_ranks) {
      if (r < 0 || r >= world_size) {
        throw UsageError("mpi backend: group member " + std::to_string(r) + " is not in MPI_COMM_WORLD (size " +
                         std::to_string(world_size) + ")");
      }
    }
    MPI_Group world_group, group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, ctx.size, ctx.global_ranks.data(), &group);
    // Only members call this (MPI-3), matching tdist's new_group.
    MPI_Comm_create_group(MPI_COMM_WORLD, group, /*tag=*/0, &comm_);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    for (int i = 0; i < 8; ++i) {
      half_ops_[i] = make_user_op<DataType::kFloat16>(static_cast<ReduceOp>(i));
      bf16_ops_[i] = make_user_op<DataType::kBFloat16>(static_cast<ReduceOp>(i));
    }
    // MPI cannot say who is missing when an op times out: the store can.
    hb_ = std::make_unique<Heartbeat>(ctx.store, ctx.rank, ctx.size, ctx.global_ranks);
  }

  ~MpiBackend() override {
    try {
      reap_sends(/*block=*/true);
    } catch (const std::exception&) {
      // Undeliverable sends at shutdown have nobody left to tell.
    }
    while (!sends_.empty()) abandon_front_send();
    if (!abandoned_.empty()) {
      // MPI may still write into these until MPI_Finalize: never free them.
      static auto* keep = new std::vector<std::shared_ptr<Staging>>();
      keep->insert(keep->end(), abandoned_.begin(), abandoned_.end());
    }
    MpiLock lock;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& op : half_ops_) MPI_Op_free(&op);
    for (auto& op : bf16_ops_) MPI_Op_free(&op);
    if (!aborted_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  std::string name() const override { return "mpi"; }

  // MPI cannot cancel an operation, so it never gets a user buffer: every op
  // runs on buffers this backend owns, copied in before and out after. If an
  // op times out, its buffers are kept alive for good (MPI may still write
  // into them when the late rank turns up), and the user's tensor is safe.
  struct Staging {
    std::vector<uint8_t> in, out;
  };

  void all_reduce(void* buf, size_t count, DataType t, ReduceOp op, Deadline d) override {
    check_reduction(t, op);
    const size_t es = dtype_size(t);
    auto s = stage(buf, count * es, 0);
    for_chunks(count, [&](size_t off, int n) {
      uint8_t* p = s->in.data() + off * es;
      run("all_reduce", d, s, [&](MPI_Request* r) { return MPI_Iallreduce(MPI_IN_PLACE, p, n, mpi_type(t), mpi_op(t, op), comm_, r); });
    });
    detail::copy_bytes(buf, s->in.data(), count * es);
    if (op == ReduceOp::kAvg) scale(buf, count, t);
  }

  void broadcast(void* buf, size_t bytes, int root, Deadline d) override {
    auto s = stage(rank() == root ? buf : nullptr, bytes, 0);
    for_chunks(bytes, [&](size_t off, int n) {
      run("broadcast", d, s, [&](MPI_Request* r) { return MPI_Ibcast(s->in.data() + off, n, MPI_BYTE, root, comm_, r); });
    });
    if (rank() != root) detail::copy_bytes(buf, s->in.data(), bytes);
  }

  void reduce(void* buf, size_t count, DataType t, ReduceOp op, int root, Deadline d) override {
    check_reduction(t, op);
    const size_t es = dtype_size(t);
    auto s = stage(buf, count * es, rank() == root ? 0 : count * es);
    for_chunks(count, [&](size_t off, int n) {
      uint8_t* p = s->in.data() + off * es;
      run("reduce", d, s, [&](MPI_Request* r) {
        return rank() == root ? MPI_Ireduce(MPI_IN_PLACE, p, n, mpi_type(t), mpi_op(t, op), root, comm_, r)
                              : MPI_Ireduce(p, s->out.data() + off * es, n, mpi_type(t), mpi_op(t, op), root, comm_, r);
      });
    });
    if (rank() == root) {
      detail::copy_bytes(buf, s->in.data(), count * es);
      if (op == ReduceOp::kAvg) scale(buf, count, t);
    }
  }

  void all_gather(const void* in, void* out, size_t bytes, Deadline d) override {
    const int n = checked_int(bytes, "all_gather");
    auto s = stage(in, bytes, bytes * size());
    run("all_gather", d, s, [&](MPI_Request* r) {
      return MPI_Iallgather(s->in.data(), n, MPI_BYTE, s->out.data(), n, MPI_BYTE, comm_, r);
    });
    detail::copy_bytes(out, s->out.data(), bytes * size());
  }

  void reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op, Deadline d) override {
    check_reduction(t, op);
    const int n = checked_int(count, "reduce_scatter");
    const size_t es = dtype_size(t);
    auto s = stage(in, count * es * size(), count * es);
    run("reduce_scatter", d, s, [&](MPI_Request* r) {
      return MPI_Ireduce_scatter_block(s->in.data(), s->out.data(), n, mpi_type(t), mpi_op(t, op), comm_, r);
    });
    detail::copy_bytes(out, s->out.data(), count * es);
    if (op == ReduceOp::kAvg) scale(out, count, t);
  }

  void gather(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    const int n = checked_int(bytes, "gather");
    auto s = stage(in, bytes, rank() == root ? bytes * size() : 0);
    run("gather", d, s, [&](MPI_Request* r) {
      return MPI_Igather(s->in.data(), n, MPI_BYTE, s->out.data(), n, MPI_BYTE, root, comm_, r);
    });
    if (rank() == root) detail::copy_bytes(out, s->out.data(), bytes * size());
  }

  void scatter(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    const int n = checked_int(bytes, "scatter");
    auto s = stage(rank() == root ? in : nullptr, rank() == root ? bytes * size() : 0, bytes);
    run("scatter", d, s, [&](MPI_Request* r) {
      return MPI_Iscatter(s->in.data(), n, MPI_BYTE, s->out.data(), n, MPI_BYTE, root, comm_, r);
    });
    detail::copy_bytes(out, s->out.data(), bytes);
  }

  void all_to_all(const void* in, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  void* out, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Deadline d) override {
    std::vector<int> sc, so, rc, ro;
    size_t in_total = 0, out_total = 0;
    for (int r = 0; r < size(); ++r) {
      sc.push_back(checked_int(send_bytes[r], "all_to_all"));
      so.push_back(checked_int(send_offsets[r], "all_to_all"));
      rc.push_back(checked_int(recv_bytes[r], "all_to_all"));
      ro.push_back(checked_int(recv_offsets[r], "all_to_all"));
      in_total = std::max(in_total, send_offsets[r] + send_bytes[r]);
      out_total = std::max(out_total, recv_offsets[r] + recv_bytes[r]);
    }
    auto s = stage(in, in_total, out_total);
    run("all_to_all", d, s, [&](MPI_Request* r) {
      return MPI_Ialltoallv(s->in.data(), sc.data(), so.data(), MPI_BYTE, s->out.data(), rc.data(), ro.data(),
                            MPI_BYTE, comm_, r);
    });
    detail::copy_bytes(out, s->out.data(), out_total);
  }

  void barrier(Deadline d) override {
    run("barrier", d, nullptr, [&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
  }

  // A large send completes only once its receiver posts the recv; waiting for
  // it here would stall this group's queue (and deadlock a ring of sends).
  // Sends are buffered instead: the payload is copied and the request reaped
  // by later calls; a failed delivery surfaces at the next op.
  void send(const void* buf, size_t bytes, int dst, int tag, Deadline d) override {
    const int n = checked_int(bytes, "send");
    check_first_error();
    reap_sends(/*block=*/false);
    PendingSend s;
    s.data.assign(static_cast<const uint8_t*>(buf), static_cast<const uint8_t*>(buf) + bytes);
    s.deadline = d;
    const uint64_t seq = seq_++;
    s.what = "send #" + std::to_string(op_label_or(seq + 1)) + " to rank " + std::to_string(dst) + " (tag " +
             std::to_string(tag) + ")";
    {
      MpiLock lock;
      if (MPI_Isend(s.data.data(), n, MPI_BYTE, dst, tag, comm_, &s.req) != MPI_SUCCESS) {
        fail(Error("mpi backend: " + s.what + " could not be started"));
      }
    }
    sends_.push_back(std::move(s));
  }

  void recv(void* buf, size_t bytes, int src, int tag, Deadline d) override {
    const int n = checked_int(bytes, "recv");
    auto s = stage(nullptr, bytes, 0);
    run("recv", d, s, [&](MPI_Request* r) { return MPI_Irecv(s->in.data(), n, MPI_BYTE, src, tag, comm_, r); });
    detail::copy_bytes(buf, s->in.data(), bytes);
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_error_) first_error_ = std::make_exception_ptr(Error("mpi backend aborted: " + reason));
  }

 private:
  static int checked_int(size_t n, const char* op) {
    if (n > static_cast<size_t>(INT_MAX)) {
      throw UsageError(std::string("mpi backend: ") + op + " of " + std::to_string(n) +
                       " elements is over MPI's int count limit; split it");
    }
    return static_cast<int>(n);
  }

  // Splits count into MPI-sized (int) chunks.
  template <typename Fn>
  static void for_chunks(size_t count, Fn&& fn) {
    constexpr size_t kMax = size_t(1) << 30;
    if (count == 0) fn(0, 0);
    for (size_t off = 0; off < count; off += kMax) fn(off, static_cast<int>(std::min(kMax, count - off)));
  }

  MPI_Op mpi_op(DataType t, ReduceOp op) {
    if (t == DataType::kFloat16) return half_ops_[static_cast<int>(op)];
    if (t == DataType::kBFloat16) return bf16_ops_[static_cast<int>(op)];
    if (t == DataType::kBool) {
      switch (op) {
        case ReduceOp::kProduct:
        case ReduceOp::kMin:
        case ReduceOp::kBand: return MPI_LAND;
        case ReduceOp::kBxor: return MPI_LXOR;
        default: return MPI_LOR;
      }
    }
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: return MPI_SUM;
      case ReduceOp::kProduct: return MPI_PROD;
      case ReduceOp::kMin: return MPI_MIN;
      case ReduceOp::kMax: return MPI_MAX;
      case ReduceOp::kBand: return MPI_BAND;
      case ReduceOp::kBor: return MPI_BOR;
      case ReduceOp::kBxor: return MPI_BXOR;
    }
    return MPI_SUM;
  }

  void scale(void* buf, size_t count, DataType t) {
    const void* in[] = {buf};
    reduce_many(buf, in, 1, count, t, ReduceOp::kAvg, size());
  }

  struct PendingSend {
    std::vector<uint8_t> data;
    MPI_Request req = MPI_REQUEST_NULL;
    Deadline deadline;
    std::string what;
  };

  // A send MPI may still read from: keep its payload alive for good.
  void abandon_front_send() {
    auto st = std::make_shared<Staging>();
    st->in = std::move(sends_.front().data);
    abandoned_.push_back(std::move(st));
    sends_.pop_front();
  }

  void check_first_error() {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_error_) std::rethrow_exception(first_error_);
  }

  // Frees the buffers of delivered sends; with block, waits for all of them
  // (each until its own deadline).
  void reap_sends(bool block) {
    while (!sends_.empty()) {
      PendingSend& s = sends_.front();
      int done = 0;
      {
        MpiLock lock;
        MPI_Test(&s.req, &done, MPI_STATUS_IGNORE);
      }
      if (!done) {
        if (Clock::now() >= s.deadline) {
          aborted_ = true;
          const std::string what = s.what;
          abandon_front_send();
          fail(TimeoutError("mpi backend: " + what + " was never received"));
        }
        if (!block) return;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      sends_.pop_front();
    }
  }

  // Backend-owned buffers: `in` holds a copy of src (in_bytes, or zeros when
  // src is null), `out` out_bytes; both at least one byte, so never null.
  std::shared_ptr<Staging> stage(const void* src, size_t in_bytes, size_t out_bytes) {
    auto s = std::make_shared<Staging>();
    s->in.resize(std::max<size_t>(in_bytes, 1));
    s->out.resize(std::max<size_t>(out_bytes, 1));
    if (src) detail::copy_bytes(s->in.data(), src, in_bytes);
    return s;
  }

  // Starts a non-blocking MPI op and polls it until done or the deadline. A
  // timed-out op's staging is kept alive for good: MPI may still use it.
  template <typename Start>
  void run(const char* what, Deadline d, const std::shared_ptr<Staging>& staging, Start&& start) {
    const uint64_t seq = seq_++;
    hb_->set_ops_started(seq_);
    check_first_error();
    reap_sends(/*block=*/false);
    const std::string who = "mpi backend, rank " + std::to_string(ctx_.global_ranks.empty() ? rank() : ctx_.global_ranks[rank()]) +
                            ": " + what + " #" + std::to_string(op_label_or(seq + 1));
    MPI_Request req;
    {
      MpiLock lock;
      if (start(&req) != MPI_SUCCESS) fail(Error(who + " could not be started"));
    }
    const auto spin_end = Clock::now() + std::chrono::microseconds(50);
    for (;;) {
      int done = 0;
      {
        MpiLock lock;
        if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) fail(Error(who + " failed in MPI"));
      }
      if (done) return;
      const auto now = Clock::now();
      if (now >= d) {
        aborted_ = true;
        if (staging) abandoned_.push_back(staging);
        fail(TimeoutError(who + " timed out; " + hb_->missing_ranks(seq) +
                          " (MPI cannot cancel the op: the group is now unusable)"));
      }
      if (now < spin_end) {
        _mm_pause();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  template <typename E>
  [[noreturn]] void fail(const E& e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_error_) first_error_ = std::make_exception_ptr(e);
    throw e;
  }

  BackendContext ctx_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op half_ops_[8] = {};
  MPI_Op bf16_ops_[8] = {};
  uint64_t seq_ = 0;
  bool aborted_ = false;
  std::deque<PendingSend> sends_;
  std::unique_ptr<Heartbeat> hb_;
  // Buffers of ops that timed out; see run(). Released only with the process.
  std::vector<std::shared_ptr<Staging>> abandoned_;
  std::mutex mu_;
  std::exception_ptr first_error_;
};

}  // namespace

std::unique_ptr<Backend> make_mpi_backend(const BackendContext& ctx) { return std::make_unique<MpiBackend>(ctx); }

}  // namespace tdist::comm::mpi_backend
