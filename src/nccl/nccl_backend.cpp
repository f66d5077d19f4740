// NcclBackend: set-up, the collectives, host staging and the watchdog. The
// contract is in nccl_backend.h.
#include "nccl/nccl_backend.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <mutex>
#include <deque>
#include <thread>

#include "comm/op_label.h"
#include "cuda/cuda_check.h"
#include "nccl/nccl_types.h"
#include "process_group/device_runtime.h"
#include "tdist/errors.h"
#include "util/launch_env.h"
#include "util/torch_cuda_loader.h"

namespace tdist::nccl {

namespace {

using comm::DataType;
using comm::Deadline;
using comm::OpKind;
using comm::Piece;
using comm::ReduceOp;
using Clock = comm::Clock;

std::string ms_text(Clock::duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
}

class NcclBackend final : public comm::Backend {
 public:
  explicit NcclBackend(const comm::BackendContext& ctx)
      : Backend(ctx.rank, ctx.size),
        group_(ctx.group_name),
        global_rank_(ctx.global_ranks.empty() ? ctx.rank : ctx.global_ranks.at(ctx.rank)),
        errors_(std::make_shared<comm::AsyncErrors>()) {
    int count = 0;
    const cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
      cudaGetLastError();
      throw UsageError("nccl: rank " + std::to_string(global_rank_) + " sees no CUDA device (" +
                       (ce != cudaSuccess ? std::string(cudaGetErrorName(ce)) + ": " + cudaGetErrorString(ce)
                                          : std::string("0 devices")) +
                       "); the nccl backend needs one GPU per rank. Use gloo or shm for CPU tensors.");
    }
    // c10's streams need LibTorch's CUDA part; a program that makes CUDA
    // tensors has it loaded, one that has not made any yet may not.
    detail::load_torch_cuda();
    try {
      device_ = pick_device(count);
      c10::cuda::CUDAGuard guard(device_);
      own_stream_ = c10::cuda::getStreamFromPool(false, device_).stream();
    } catch (const c10::Error& e) {
      throw UsageError("nccl: rank " + std::to_string(global_rank_) + " cannot use its CUDA device: " +
                       e.what_without_backtrace());
    }
    c10::cuda::CUDAGuard guard(device_);
    const ncclUniqueId id = exchange_unique_id(*ctx.store, "nccl_unique_id", rank(), ctx.timeout);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, size(), id, rank(), &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      throw NetworkError("nccl: rank " + std::to_string(global_rank_) + " could not create the communicator of group '" +
                         group_ + "' on cuda:" + std::to_string(device_) + ": " + describe(r));
    }
    const Deadline d = Clock::now() + ctx.timeout;
    try {
      settle("creating the communicator", d);
    } catch (...) {
      if (!aborted_) ncclCommAbort(comm_);  // settle's failure aborted it already
      comm_ = nullptr;
      throw;
    }
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (aborted_) {  // the communicator is gone already
      for (auto& p : pending_) cudaEventDestroy(p.event);
      free_scratch();
      return;
    }
    if (comm_ == nullptr) return;
    // Ops still pending when the group goes: wait for them, within reason,
    // before freeing; else abort.
    bool clean = !errors_->failed();
    for (auto& p : pending_) {
      const auto until = Clock::now() + std::chrono::seconds(10);
      cudaError_t e;
      while ((e = cudaEventQuery(p.event)) == cudaErrorNotReady && Clock::now() < until) std::this_thread::yield();
      clean = clean && e == cudaSuccess;
      cudaEventDestroy(p.event);
    }
    if (clean) ncclCommDestroy(comm_); else ncclCommAbort(comm_);
    free_scratch();
  }

  std::string name() const override { return "nccl"; }
  bool supports_cuda() const override { return true; }
  std::shared_ptr<comm::AsyncErrors> async_errors() const override { return errors_; }

  void all_reduce(void* buf, size_t count, DataType t, ReduceOp op, Deadline d) override {
    const ncclRedOp_t rop = to_nccl(op, t, "all_reduce");
    const size_t bytes = count * comm::dtype_size(t);
    run({{buf, bytes, true, true}}, "all_reduce(" + std::string(comm::dtype_name(t)) + " x " + std::to_string(count) +
        ", " + comm::reduce_op_name(op) + ")", d, [&](void** p, cudaStream_t s) {
      return ncclAllReduce(p[0], p[0], count, to_nccl(t), rop, comm_, s);
    });
  }

  void all_reduce_coalesced(const std::vector<Piece>& pieces, DataType t, ReduceOp op, Deadline d) override {
    const ncclRedOp_t rop = to_nccl(op, t, "all_reduce_coalesced");
    std::vector<Buf> bufs;
    size_t total = 0;
    for (const auto& p : pieces) {
      bufs.push_back({p.data, p.count * comm::dtype_size(t), true, true});
      total += p.count;
    }
    // One NCCL group: each piece reduced in place, launched together.
    run(bufs, "all_reduce_coalesced(" + std::string(comm::dtype_name(t)) + " x " + std::to_string(total) + ")", d,
        [&](void** p, cudaStream_t s) {
          ncclResult_t r = ncclGroupStart();
          for (size_t i = 0; i < pieces.size() && r == ncclSuccess; ++i) {
            if (pieces[i].count > 0) r = ncclAllReduce(p[i], p[i], pieces[i].count, to_nccl(t), rop, comm_, s);
          }
          const ncclResult_t e = ncclGroupEnd();
          return r != ncclSuccess ? r : e;
        });
  }

  // float32 pieces carried as float16/bfloat16: narrowed and widened by
  // ATen on the current stream (libtorch_cuda, which every program with
  // CUDA tensors has loaded), all-reduced in the narrow type.
  void all_reduce_coalesced_as(const std::vector<Piece>& pieces, DataType t, DataType wire, ReduceOp op,
                               Deadline d) override {
    if (wire == t) return all_reduce_coalesced(pieces, t, op, d);
    const void* first = nullptr;
    for (const auto& p : pieces) {
      if (p.count > 0) first = p.data;
      if (first) break;
    }
    if (first == nullptr) return;
    if (detail::current_op_device() < 0) return Backend::all_reduce_coalesced_as(pieces, t, wire, op, d);  // host
    const auto device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_));
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    const at::ScalarType narrow = wire == DataType::kFloat16 ? at::kHalf : at::kBFloat16;
    std::vector<at::Tensor> views;
    for (const auto& p : pieces) views.push_back(at::from_blob(p.data, {static_cast<int64_t>(p.count)}, f32));
    at::Tensor packed = at::cat(views).to(narrow);
    all_reduce(packed.data_ptr(), static_cast<size_t>(packed.numel()), wire, op, d);
    int64_t off = 0;
    for (auto& v : views) {
      v.copy_(packed.narrow(0, off, v.numel()));
      off += v.numel();
    }
    // packed must live until the copies have run: the caching allocator
    // reuses its memory only after work queued on this stream.
  }

  void broadcast(void* buf, size_t bytes, int root, Deadline d) override {
    run({{buf, bytes, rank() == root, true}}, "broadcast(" + std::to_string(bytes) + " bytes, root " +
        std::to_string(root) + ")", d, [&](void** p, cudaStream_t s) {
      return ncclBroadcast(p[0], p[0], bytes, ncclUint8, root, comm_, s);
    });
  }

  void reduce(void* buf, size_t count, DataType t, ReduceOp op, int root, Deadline d) override {
    const ncclRedOp_t rop = to_nccl(op, t, "reduce");
    run({{buf, count * comm::dtype_size(t), true, rank() == root}}, "reduce(" + std::string(comm::dtype_name(t)) +
        " x " + std::to_string(count) + ", root " + std::to_string(root) + ")", d, [&](void** p, cudaStream_t s) {
      return ncclReduce(p[0], p[0], count, to_nccl(t), rop, root, comm_, s);
    });
  }

  void all_gather(const void* in, void* out, size_t bytes, Deadline d) override {
    const size_t n = static_cast<size_t>(size());
    run({{const_cast<void*>(in), bytes, true, false}, {out, bytes * n, false, true}},
        "all_gather(" + std::to_string(bytes) + " bytes)", d, [&](void** p, cudaStream_t s) {
          return ncclAllGather(p[0], p[1], bytes, ncclUint8, comm_, s);
        });
  }

  void reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op, Deadline d) override {
    const ncclRedOp_t rop = to_nccl(op, t, "reduce_scatter");
    const size_t bytes = count * comm::dtype_size(t);
    run({{const_cast<void*>(in), bytes * static_cast<size_t>(size()), true, false}, {out, bytes, false, true}},
        "reduce_scatter(" + std::string(comm::dtype_name(t)) + " x " + std::to_string(count) + ")", d,
        [&](void** p, cudaStream_t s) { return ncclReduceScatter(p[0], p[1], count, to_nccl(t), rop, comm_, s); });
  }

  // One NCCL group of an all-gather per piece, launched together.
  void all_gather_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                            Deadline d) override {
    check_pairs("all_gather_coalesced", in, out, /*out_is_larger=*/true);
    const size_t es = comm::dtype_size(t), n = static_cast<size_t>(size());
    std::vector<Buf> bufs;
    size_t total = 0;
    for (size_t k = 0; k < in.size(); ++k) {
      bufs.push_back({in[k].data, in[k].count * es, true, false});
      bufs.push_back({out[k].data, in[k].count * es * n, false, true});
      total += in[k].count;
    }
    run(bufs, "all_gather_coalesced(" + std::string(comm::dtype_name(t)) + " x " + std::to_string(total) + ")", d,
        [&](void** p, cudaStream_t s) {
          ncclResult_t r = ncclGroupStart();
          for (size_t k = 0; k < in.size() && r == ncclSuccess; ++k) {
            if (in[k].count > 0) r = ncclAllGather(p[2 * k], p[2 * k + 1], in[k].count * es, ncclUint8, comm_, s);
          }
          const ncclResult_t e = ncclGroupEnd();
          return r != ncclSuccess ? r : e;
        });
  }

  // One NCCL group of a reduce-scatter per piece, launched together.
  void reduce_scatter_coalesced(const std::vector<Piece>& in, const std::vector<Piece>& out, DataType t,
                                ReduceOp op, Deadline d) override {
    check_pairs("reduce_scatter_coalesced", in, out, /*out_is_larger=*/false);
    const ncclRedOp_t rop = to_nccl(op, t, "reduce_scatter_coalesced");
    const size_t es = comm::dtype_size(t);
    std::vector<Buf> bufs;
    size_t total = 0;
    for (size_t k = 0; k < in.size(); ++k) {
      bufs.push_back({in[k].data, in[k].count * es, true, false});
      bufs.push_back({out[k].data, out[k].count * es, false, true});
      total += out[k].count;
    }
    run(bufs, "reduce_scatter_coalesced(" + std::string(comm::dtype_name(t)) + " x " + std::to_string(total) + ")",
        d, [&](void** p, cudaStream_t s) {
          ncclResult_t r = ncclGroupStart();
          for (size_t k = 0; k < in.size() && r == ncclSuccess; ++k) {
            if (out[k].count > 0) {
              r = ncclReduceScatter(p[2 * k], p[2 * k + 1], out[k].count, to_nccl(t), rop, comm_, s);
            }
          }
          const ncclResult_t e = ncclGroupEnd();
          return r != ncclSuccess ? r : e;
        });
  }

  // Gather and scatter are exchanges in which only the root talks to
  // every rank.
  void gather(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    const size_t n = static_cast<size_t>(size());
    std::vector<size_t> send_bytes(n, 0), send_offsets(n, 0), recv_bytes(n, 0), recv_offsets(n, 0);
    send_bytes[root] = bytes;
    if (rank() == root) {
      for (size_t q = 0; q < n; ++q) {
        recv_bytes[q] = bytes;
        recv_offsets[q] = q * bytes;
      }
    }
    exchange(in, send_bytes, send_offsets, out, recv_bytes, recv_offsets,
             "gather(" + std::to_string(bytes) + " bytes, root " + std::to_string(root) + ")", d);
  }

  void scatter(const void* in, void* out, size_t bytes, int root, Deadline d) override {
    const size_t n = static_cast<size_t>(size());
    std::vector<size_t> send_bytes(n, 0), send_offsets(n, 0), recv_bytes(n, 0), recv_offsets(n, 0);
    recv_bytes[root] = bytes;
    if (rank() == root) {
      for (size_t q = 0; q < n; ++q) {
        send_bytes[q] = bytes;
        send_offsets[q] = q * bytes;
      }
    }
    exchange(in, send_bytes, send_offsets, out, recv_bytes, recv_offsets,
             "scatter(" + std::to_string(bytes) + " bytes, root " + std::to_string(root) + ")", d);
  }

  void all_to_all(const void* in, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                  void* out, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                  Deadline d) override {
    exchange(in, send_bytes, send_offsets, out, recv_bytes, recv_offsets, "all_to_all", d);
  }

  void barrier(Deadline d) override {
    // An all-reduce of one byte in scratch memory, waited for on the host.
    errors_->rethrow_if_failed();
    void* p = scratch(in_scratch_, in_cap_, 1);
    c10::cuda::CUDAGuard guard(device_);
    launch("barrier", d, own_stream_, [&](cudaStream_t s) { return ncclAllReduce(p, p, 1, ncclUint8, ncclSum, comm_, s); });
    wait_stream("barrier", d);
  }
  void send(const void* buf, size_t bytes, int dst, int /*tag*/, Deadline d) override {
    run({{const_cast<void*>(buf), bytes, true, false}}, "send(" + std::to_string(bytes) + " bytes to " +
        std::to_string(dst) + ")", d, [&](void** p, cudaStream_t s) {
      return ncclSend(p[0], bytes, ncclUint8, dst, comm_, s);
    });
  }

  void recv(void* buf, size_t bytes, int src, int /*tag*/, Deadline d) override {
    run({{buf, bytes, false, true}}, "recv(" + std::to_string(bytes) + " bytes from " + std::to_string(src) + ")", d,
        [&](void** p, cudaStream_t s) { return ncclRecv(p[0], bytes, ncclUint8, src, comm_, s); });
  }

  void abort(const std::string& reason) override { fail(std::make_exception_ptr(Error(reason))); }

 private:
  // One buffer of a call: whether the op reads it and writes it.
  struct Buf {
    void* data;
    size_t bytes;
    bool read;
    bool written;
  };
  struct Pending {
    cudaEvent_t event;
    Deadline deadline;
    std::string what;
    uint64_t seq;
  };

  // The device of the op that makes the backend, when one does (a group of
  // backend "auto" makes its nccl backend at its first CUDA op, inside that
  // op's OpDeviceScope). Else the calling thread's current device; where
  // it is still device 0 and the local rank is known (LOCAL_RANK from
  // tdist-run or torchrun; mpirun's or srun's, util/launch_env.h), the
  // local rank modulo the devices: one GPU per local rank unless the
  // program chose (c10::cuda::set_device).
  static int pick_device(int count) {
    if (const int op = detail::current_op_device(); op >= 0) return op;
    const int current = c10::cuda::current_device();
    const auto local = detail::local_rank_from_env();
    if (current != 0 || !local) return current;
    return static_cast<int>(local->value % count);
  }

  std::string where() const {
    return "rank " + std::to_string(global_rank_) + " (group '" + group_ + "', cuda:" + std::to_string(device_) + ")";
  }

  // Once nothing can still run on it (cudaFree waits for the device).
  void free_scratch() {
    if (in_scratch_ != nullptr) cudaFree(in_scratch_);  // at exit the driver may be gone: nothing to do then
    in_scratch_ = nullptr;
  }

  void* scratch(void*& buf, size_t& cap, size_t bytes) {
    if (bytes <= cap) return buf;
    c10::cuda::CUDAGuard guard(device_);
    if (buf != nullptr) {
      cuda::check(cudaStreamSynchronize(own_stream_), "waiting before growing nccl's scratch memory");
      cudaFree(buf);
      buf = nullptr;
      cap = 0;
    }
    size_t want = std::max<size_t>(bytes, 1 << 16);
    cuda::check(cudaMalloc(&buf, want), "allocating " + std::to_string(want) + " bytes of scratch memory for nccl");
    cap = want;
    return buf;
  }

  // Sends send_bytes[q] bytes at in + send_offsets[q] to every rank q and
  // receives recv_bytes[q] at out + recv_offsets[q] from it, as one NCCL
  // group (this rank's own part copied): all_to_all, gather and scatter.
  void exchange(const void* in, const std::vector<size_t>& send_bytes, const std::vector<size_t>& send_offsets,
                void* out, const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_offsets,
                const std::string& what, Deadline d) {
    size_t in_total = 0, out_total = 0;
    for (int q = 0; q < size(); ++q) {
      in_total = std::max(in_total, send_offsets[q] + send_bytes[q]);
      out_total = std::max(out_total, recv_offsets[q] + recv_bytes[q]);
    }
    run({{const_cast<void*>(in), in_total, true, false}, {out, out_total, false, true}}, what, d,
        [&](void** p, cudaStream_t s) {
          const auto* src = static_cast<const uint8_t*>(p[0]);
          auto* dst = static_cast<uint8_t*>(p[1]);
          ncclResult_t r = ncclGroupStart();
          for (int q = 0; q < size() && r == ncclSuccess; ++q) {
            if (q == rank()) {
              if (send_bytes[q] != recv_bytes[q]) {
                ncclGroupEnd();
                throw CollectiveMismatchError(what + ": rank " + std::to_string(global_rank_) + " sends itself " +
                                              std::to_string(send_bytes[q]) + " bytes but expects " +
                                              std::to_string(recv_bytes[q]));
              }
              if (send_bytes[q] > 0) {
                cuda::check(cudaMemcpyAsync(dst + recv_offsets[q], src + send_offsets[q], send_bytes[q],
                                            cudaMemcpyDeviceToDevice, s), what + "'s own part");
              }
              continue;
            }
            if (send_bytes[q] > 0) r = ncclSend(src + send_offsets[q], send_bytes[q], ncclUint8, q, comm_, s);
            if (r == ncclSuccess && recv_bytes[q] > 0) {
              r = ncclRecv(dst + recv_offsets[q], recv_bytes[q], ncclUint8, q, comm_, s);
            }
          }
          const ncclResult_t e = ncclGroupEnd();
          return r != ncclSuccess ? r : e;
        });
  }


  // Runs an op: on the current stream for device buffers (without waiting),
  // or through scratch memory on the backend's stream for host buffers
  // (waited for).
  // UsageError unless each output holds size() times its input
  // (all_gather) or each input size() times its output (reduce_scatter).
  void check_pairs(const char* op, const std::vector<Piece>& in, const std::vector<Piece>& out,
                   bool out_is_larger) const {
    const size_t n = static_cast<size_t>(size());
    bool ok = in.size() == out.size();
    for (size_t k = 0; ok && k < in.size(); ++k) {
      ok = out_is_larger ? out[k].count == in[k].count * n : in[k].count == out[k].count * n;
    }
    if (!ok) {
      throw UsageError(std::string("nccl: ") + op + ": each " + (out_is_larger ? "output" : "input") +
                       " must hold " + std::to_string(n) + " times its " + (out_is_larger ? "input" : "output"));
    }
  }

  template <typename Launch>
  void run(const std::vector<Buf>& bufs, const std::string& what, Deadline d, Launch&& fn) {
    errors_->rethrow_if_failed();
    size_t any = 0;
    for (const auto& b : bufs) any += b.bytes;
    if (any == 0) return;  // an empty op on every rank: nothing to move
    // ProcessGroup runs an op on CUDA tensors inside its device scope; any
    // other op's buffers are host memory.
    const int op_device = detail::current_op_device();
    const bool host = op_device < 0;
    if (!host && op_device != device_) {
      throw UsageError("nccl: " + what + " on " + where() + " got tensors on cuda:" + std::to_string(op_device) +
                       "; a group's communicator serves one device (set it before init_process_group: "
                       "c10::cuda::set_device(local_rank))");
    }
    std::vector<void*> p;
    if (!host) {
      for (const auto& b : bufs) p.push_back(b.data);
      const cudaStream_t s = c10::cuda::getCurrentCUDAStream(device_).stream();
      launch(what, d, s, [&](cudaStream_t st) { return fn(p.data(), st); });
      track(s, what, d);
      return;
    }
    c10::cuda::CUDAGuard guard(device_);
    std::vector<std::pair<void*, size_t>> place;  // device scratch offsets
    size_t total = 0;
    for (const auto& b : bufs) {
      total = (total + 255) / 256 * 256;
      place.push_back({nullptr, total});
      total += b.bytes;
    }
    auto* base = static_cast<uint8_t*>(scratch(in_scratch_, in_cap_, std::max<size_t>(total, 1)));
    for (size_t i = 0; i < bufs.size(); ++i) {
      p.push_back(base + place[i].second);
      if (bufs[i].read && bufs[i].data != nullptr && bufs[i].bytes > 0) {
        cuda::check(cudaMemcpyAsync(p[i], bufs[i].data, bufs[i].bytes, cudaMemcpyHostToDevice, own_stream_),
                    "staging a host buffer for nccl");
      }
    }
    launch(what, d, own_stream_, [&](cudaStream_t st) { return fn(p.data(), st); });
    for (size_t i = 0; i < bufs.size(); ++i) {
      if (bufs[i].written && bufs[i].data != nullptr && bufs[i].bytes > 0) {
        cuda::check(cudaMemcpyAsync(bufs[i].data, p[i], bufs[i].bytes, cudaMemcpyDeviceToHost, own_stream_),
                    "copying nccl's result to the host");
      }
    }
    wait_stream(what, d);
  }

  // Makes an NCCL call (or group) and waits until NCCL has queued it.
  template <typename Call>
  void launch(const std::string& what, Deadline d, cudaStream_t s, Call&& call) {
    std::lock_guard<std::recursive_mutex> in_nccl(nccl_mu_);
    errors_->rethrow_if_failed();
    ++seq_;
    label_ = comm::op_label_or(seq_);  // the group's number for the op (op_label.h)
    const ncclResult_t r = call(s);
    if (r != ncclSuccess && r != ncclInProgress) {
      auto e = std::make_exception_ptr(
          NetworkError("nccl: " + what + " #" + std::to_string(label_) + " failed on " + where() + ": " + describe(r)));
      fail(e);
      std::rethrow_exception(e);
    }
    settle(what, d);
  }

  // Polls a non-blocking communicator until its last call is done queuing.
  void settle(const std::string& what, Deadline d) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclSuccess) return;
      errors_->rethrow_if_failed();  // the watchdog's: it aborts once this call lets go of the communicator
      if (state != ncclInProgress) {
        auto e = std::make_exception_ptr(
            NetworkError("nccl: " + what + " failed on " + where() + ": " + describe(state)));
        fail(e);
        std::rethrow_exception(e);
      }
      if (Clock::now() > d) {
        auto e = std::make_exception_ptr(TimeoutError("nccl: " + what + " on " + where() +
                                                      " did not start before its deadline; the communicator was aborted"));
        fail(e);
        std::rethrow_exception(e);
      }
      std::this_thread::yield();
    }
  }

  // Waits on the host for the backend's own stream, within the deadline.
  void wait_stream(const std::string& what, Deadline d) {
    for (;;) {
      const cudaError_t e = cudaStreamQuery(own_stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cuda::check(e, "waiting for nccl's " + what);
      errors_->rethrow_if_failed();
      if (Clock::now() > d) {
        auto err = std::make_exception_ptr(TimeoutError(
            "nccl: " + what + " #" + std::to_string(label_) + " on " + where() +
            " did not complete before its deadline; the communicator was aborted"));
        fail(err);
        std::rethrow_exception(err);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Hands the op's end to the watchdog.
  void track(cudaStream_t s, const std::string& what, Deadline d) {
    cudaEvent_t ev = nullptr;
    cuda::check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "creating nccl's completion event");
    cuda::check(cudaEventRecord(ev, s), "recording nccl's completion event");
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({ev, d, what, label_});
    }
    cv_.notify_one();
  }

  void fail(std::exception_ptr e) {
    errors_->set(e);
    // Not while another thread is inside an NCCL call on the communicator
    // (abort frees it); such a call sees the error and returns first.
    std::lock_guard<std::recursive_mutex> no_call(nccl_mu_);
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (aborted_ || comm_ == nullptr) return;
    aborted_ = true;
    ncclCommAbort(comm_);  // wakes NCCL kernels stuck waiting for peers
  }

  void watch() {
    // The CUDA runtime's own call: c10's guard would restore the device when
    // the thread ends, which may be after LibTorch's CUDA part is gone.
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 100 : 1));
      if (aborted_) continue;
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress) {
        const std::string op = pending_.empty() ? "a collective" : pending_.front().what;
        lock.unlock();
        fail(std::make_exception_ptr(NetworkError("nccl: " + op + " failed on " + where() + ": " + describe(state) +
                                                  "; the communicator was aborted")));
        lock.lock();
        continue;
      }
      while (!pending_.empty()) {
        Pending& p = pending_.front();
        const cudaError_t e = cudaEventQuery(p.event);
        if (e == cudaSuccess) {
          cudaEventDestroy(p.event);
          pending_.pop_front();
          continue;
        }
        if (e == cudaErrorNotReady && Clock::now() <= p.deadline) break;
        const std::string msg =
            e == cudaErrorNotReady
                ? "nccl: " + p.what + " #" + std::to_string(p.seq) + " on " + where() +
                      " did not complete within its timeout (late by " + ms_text(Clock::now() - p.deadline) +
                      "); the communicator was aborted. A rank that never called the same op, or a dead or stuck "
                      "peer, is the usual cause."
                : "nccl: " + p.what + " #" + std::to_string(p.seq) + " on " + where() + " failed: " +
                      cudaGetErrorString(e);
        lock.unlock();
        fail(e == cudaErrorNotReady ? std::make_exception_ptr(TimeoutError(msg))
                                    : std::make_exception_ptr(NetworkError(msg)));
        lock.lock();
        break;
      }
    }
  }

  std::string group_;
  int global_rank_;
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t own_stream_ = nullptr;
  void* in_scratch_ = nullptr;
  size_t in_cap_ = 0;
  uint64_t seq_ = 0;
  uint64_t label_ = 0;  // the running op's number as its group gave it (op_label.h), for messages
  std::shared_ptr<comm::AsyncErrors> errors_;

  std::recursive_mutex nccl_mu_;  // held across an NCCL call and its settling; abort takes it
  std::mutex abort_mu_;  // one abort
  std::atomic<bool> aborted_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<comm::Backend> make_nccl_backend(const comm::BackendContext& ctx) {
  return std::make_unique<NcclBackend>(ctx);
}

}  // namespace tdist::nccl
