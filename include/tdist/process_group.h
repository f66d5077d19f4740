// Process groups and collectives on at::Tensor, with torch.distributed's names.
//
//   auto world = tdist::init_process_group();   // env://, backend "auto"
//   at::Tensor t = at::ones({1024});
//   world->all_reduce(t)->wait();                                    // t = sum over ranks
//
// Every collective returns a Work at once; the group's worker thread runs the
// collectives in the order they were called, and the same order must hold on
// every rank. Work::wait() blocks until the op is done and rethrows its error.
//
// Errors (tdist/errors.h): a collective that runs past its timeout raises
// TimeoutError naming the op, its sequence number and the ranks that never
// arrived; a dead peer raises PeerFailureError naming it; ranks that call
// different collectives at the same step raise CollectiveMismatchError on
// every rank. After such an error the group is unusable: later collectives
// fail at once with the first error. Bad arguments raise UsageError when the
// collective is called, before anything is queued.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tdist/store.h"

namespace tdist {

// Collectives default to 10 minutes, as torch.distributed does.
inline constexpr Milliseconds kDefaultCollectiveTimeout{600'000};

enum class ReduceOp { SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR };

// ---------------------------------------------------------------------------
// Work: the handle of one queued collective (a future).
class Work : public std::enable_shared_from_this<Work> {
 public:
  Work();
  ~Work();
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Blocks until the op is done; rethrows its error, if any.
  void wait();
  // As wait(), but raises TimeoutError if the op is still running after
  // `timeout` (the op itself goes on, bounded by its own timeout).
  void wait(Milliseconds timeout);
  bool is_completed() const;
  // True when completed without error.
  bool is_success() const;
  // The op's error, or nullptr.
  std::exception_ptr exception() const;
  // The op's output tensors (for all_reduce, the reduced tensor). Valid once
  // completed successfully.
  std::vector<at::Tensor> result() const;
  // The op's sequence number in its group, and its name ("all_reduce").
  // Collectives are numbered 1, 2, 3, ... in the order they run (the order
  // they were called, but that a chain()'s collectives go ahead of ops
  // other threads queued meanwhile), send/recv apart; the same on every
  // rank. The same number names the op in its errors ("all_reduce #13
  // timed out"), the flight recorder's dumps (collective_seq_id /
  // p2p_seq_id), tdist-trace and tdist-run's stall report. 0 until the op
  // starts.
  uint64_t seq() const;
  const std::string& op_name() const;

  // Chains fn after this work: fn runs (on the thread that completes this
  // work, usually the group's worker) once it succeeds, and its return value
  // becomes the result of the returned Work. If this work fails, or fn
  // throws, the returned Work fails with that error. fn may queue more
  // collectives, but must not wait on work of the same group (it runs on
  // that group's worker thread).
  std::shared_ptr<Work> then(std::function<std::vector<at::Tensor>(Work&)> fn);
  // As then(), for a step that is itself asynchronous: fn returns a Work
  // (typically the next collective), and the returned Work completes with
  // that Work's result or error. Collectives that fn queues on the group
  // whose worker runs it go ahead of anything queued later by other
  // threads, so a chain issues its collectives in the same order on every
  // rank.
  std::shared_ptr<Work> chain(std::function<std::shared_ptr<Work>(Work&)> fn);

  // For backends and hooks that complete work themselves.
  void mark_completed(std::vector<at::Tensor> result);
  void mark_failed(std::exception_ptr error);
  // A Work that is already complete, e.g. a hook's pass-through result.
  static std::shared_ptr<Work> completed(std::vector<at::Tensor> result);
  void set_info(uint64_t seq, std::string op_name);  // before the work is handed out
  void set_seq(uint64_t seq);  // any time (a queued op is numbered when it starts)
  // For process groups: how wait() may run the op on the waiting thread
  // (called with this work; returns whether it ran it). Set before the
  // work is handed out.
  void set_runner(std::function<bool(const Work&)> run_here);
  // For ops on CUDA tensors: run by wait() once the op has completed, and
  // before then()/chain() run their function, on that thread. It makes the
  // thread's current stream wait for the op's end on the GPU, and raises an
  // error the backend found after the op was queued. Set before the work is
  // handed out.
  void set_device_wait(std::function<void()> device_wait);

  // Internal (process groups): a Work completed, successfully, as it is
  // made: what a synchronous op returns. It holds no State (no mutex, no
  // callbacks): then()/chain() run at once, mark_* are ignored. `name`
  // must outlive the Work (a static string); `one`, when defined, is the
  // result, else `many`.
  struct CompletedTag {};
  Work(CompletedTag, uint64_t seq, const std::string* name, at::Tensor one, std::vector<at::Tensor> many);

  struct State;  // private to work.cpp

 private:
  // Runs cb once this work is done: at once if it already is, else on the
  // thread that completes it.
  void when_done(std::function<void()> cb);
  std::unique_ptr<State> state_;  // null: completed at creation (the fields below)
  uint64_t seq_ = 0;
  const std::string* name_ = nullptr;
  at::Tensor one_;
  std::vector<at::Tensor> many_;
};

// ---------------------------------------------------------------------------
// Per-collective options. A timeout left empty uses the group's timeout.
// async_op = false (PyTorch's async_op=False) makes the call synchronous:
// the op has run when it returns (its error is thrown from the call) and
// the Work it returns is completed. It runs on the calling thread, with no
// Work queued, when the group has nothing else queued or running (the
// cheapest way to make a small op); else it waits its turn behind them. Not
// from a then()/chain() function of the same group (UsageError: it would
// wait for itself).
struct AllreduceOptions {
  ReduceOp op = ReduceOp::SUM;
  std::optional<Milliseconds> timeout = std::nullopt;
  // Carry float32 tensors as this narrower type (at::kHalf or
  // at::kBFloat16): the result has the bits of casting to it, all-reducing
  // in it and casting back, with half the bytes moved and no temporary
  // tensors (shm narrows and widens inside its own passes). What
  // fp16_compress_hook / bf16_compress_hook compute, as one collective.
  std::optional<at::ScalarType> wire_dtype = std::nullopt;
  bool async_op = true;
};
struct BroadcastOptions {
  int root = 0;  // rank in the group
  std::optional<Milliseconds> timeout = std::nullopt;
  bool async_op = true;
};
struct ReduceOptions {
  int root = 0;
  ReduceOp op = ReduceOp::SUM;
  std::optional<Milliseconds> timeout = std::nullopt;
  bool async_op = true;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::SUM;
  std::optional<Milliseconds> timeout = std::nullopt;
  bool async_op = true;
};
struct RootOptions {  // gather, scatter
  int root = 0;
  std::optional<Milliseconds> timeout = std::nullopt;
  bool async_op = true;
};
struct CollectiveOptions {  // all_gather, all_to_all, barrier, send, recv
  std::optional<Milliseconds> timeout = std::nullopt;
  bool async_op = true;
};

// ProcessGroup::collective_counts(): one op's tally on this rank.
struct CollectiveCount {
  int64_t calls = 0;
  int64_t input_bytes = 0;   // what this rank gave the op (on root only, for scatter)
  int64_t output_bytes = 0;  // what the op wrote here (on root only, for reduce and gather)
};

struct NewGroupOptions {
  // Backend of the subgroup; empty: the parent's.
  std::string backend;
  std::optional<Milliseconds> timeout = std::nullopt;  // empty: the parent's
};

class ProcessGroup {
 public:
  // Use init_process_group() and new_group(); this constructor is internal.
  struct Impl;
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  ~ProcessGroup();  // runs queued work to completion, then stops the worker
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;  // this process's rank in the group
  int size() const;
  // World ranks of the members, in group-rank order.
  const std::vector<int>& ranks() const;
  const std::string& backend_name() const;  // the resolved backend, e.g. "shm"
  // The backend of ops on tensors of `device`: backend_name() but for CUDA
  // tensors in a group of backend "auto" where tdist has its nccl plugin,
  // "nccl" (InitOptions::backend).
  std::string backend_name(c10::DeviceType device) const;
  const std::string& group_name() const;
  Milliseconds timeout() const;

  // tensor = op(tensor over all ranks), in place.
  std::shared_ptr<Work> all_reduce(const at::Tensor& tensor, const AllreduceOptions& options = {});
  // Each tensor = op(that tensor over all ranks), in place, as one op: the
  // same result as all_reduce of their concatenation, without building it
  // (shm reads and writes the tensors where they are). One dtype for all;
  // every rank passes the same total number of elements.
  std::shared_ptr<Work> all_reduce_coalesced(const std::vector<at::Tensor>& tensors,
                                             const AllreduceOptions& options = {});
  // tensor = root's tensor.
  std::shared_ptr<Work> broadcast(const at::Tensor& tensor, const BroadcastOptions& options = {});
  // root's tensor = op(tensor over all ranks); the others' are unchanged.
  std::shared_ptr<Work> reduce(const at::Tensor& tensor, const ReduceOptions& options = {});
  // outputs[r] = rank r's input; size() outputs shaped like input.
  std::shared_ptr<Work> all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                   const CollectiveOptions& options = {});
  // output (size() * input.numel() elements) = inputs of all ranks, concatenated.
  std::shared_ptr<Work> all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input,
                                               const CollectiveOptions& options = {});
  // all_gather_into_tensor of every pair (outputs[k], inputs[k]) as one op
  // (one queue entry, one Work, one call of the backend): gloo and mpi
  // pack the inputs and make one call, nccl one grouped call, shm takes
  // large tensors on their in-place and single-copy paths and packs the
  // rest. One dtype for all; every rank passes the same sizes in the same
  // order. An input may be its own rank's slice of its output.
  std::shared_ptr<Work> all_gather_into_tensor_coalesced(const std::vector<at::Tensor>& outputs,
                                                         const std::vector<at::Tensor>& inputs,
                                                         const CollectiveOptions& options = {});
  // output = op over ranks of their inputs[rank()].
  std::shared_ptr<Work> reduce_scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                       const ReduceScatterOptions& options = {});
  // output = op over ranks of their input's rank()-th slice.
  std::shared_ptr<Work> reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                                              const ReduceScatterOptions& options = {});
  // reduce_scatter_tensor of every pair (outputs[k], inputs[k]) as one op,
  // as all_gather_into_tensor_coalesced. No output may overlap an input.
  std::shared_ptr<Work> reduce_scatter_tensor_coalesced(const std::vector<at::Tensor>& outputs,
                                                        const std::vector<at::Tensor>& inputs,
                                                        const ReduceScatterOptions& options = {});
  // On root, outputs[r] = rank r's input; elsewhere outputs must be empty.
  std::shared_ptr<Work> gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                               const RootOptions& options = {});
  // output = root's inputs[rank()]; inputs must be empty off root.
  std::shared_ptr<Work> scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                const RootOptions& options = {});
  // Splits input along dim 0 (input_split_sizes rows to each rank, or equal
  // splits when empty) and receives output_split_sizes rows from each rank.
  std::shared_ptr<Work> all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                          const std::vector<int64_t>& output_split_sizes = {},
                                          const std::vector<int64_t>& input_split_sizes = {},
                                          const CollectiveOptions& options = {});
  // outputs[r] = rank r's inputs[rank()].
  std::shared_ptr<Work> all_to_all(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                   const CollectiveOptions& options = {});
  std::shared_ptr<Work> barrier(const CollectiveOptions& options = {});
  // Point to point. Messages between a pair are matched by tag; the sizes of
  // a send and its recv must agree.
  std::shared_ptr<Work> send(const at::Tensor& tensor, int dst, int tag = 0, const CollectiveOptions& options = {});
  std::shared_ptr<Work> recv(const at::Tensor& tensor, int src, int tag = 0, const CollectiveOptions& options = {});

  // ---- symmetric memory --------------------------------------------------
  // A zero-filled CPU tensor in symmetric memory: memory of this rank that
  // the backend's collectives reach from every rank directly (shm maps each
  // rank's block into every process of the group). all_reduce and
  // all_reduce_coalesced of the same symmetric tensors on every rank (the
  // same allocation, offsets and sizes) then run in place on the ranks'
  // copies, with no staging copies. Collective: every rank calls it with
  // the same sizes and dtype, in the same order as its other collectives.
  // Where the backend has none (gloo, mpi), or some rank cannot get it
  // (e.g. /dev/shm is full; one line on stderr says why), every rank gets
  // an ordinary zero-filled tensor instead: is_symmetric() tells. Freed with
  // its last reference, on any thread, also after the group is gone.
  at::Tensor empty_symmetric(at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat,
                             const CollectiveOptions& options = {});
  bool has_symmetric_memory() const;
  // Whether t is contiguous and lies in one of this group's symmetric blocks.
  bool is_symmetric(const at::Tensor& t) const;

  // ---- accounting --------------------------------------------------------
  // What this rank has queued on the group since it was made (or since the
  // last reset), per op name ("all_gather_into_tensor", "reduce_scatter_tensor",
  // ...): the calls, and the bytes of this rank's input and output tensors
  // (an all_reduce with wire_dtype counts the narrower type's bytes, what
  // it carries). E.g. the bytes FSDP gathers and reduce-scatters per step.
  std::map<std::string, CollectiveCount> collective_counts() const;
  void reset_collective_counts();

  // Makes a subgroup of `ranks` (ranks of this group). Every member of this
  // group must call it, in the same order relative to other new_group
  // calls; members get the subgroup, the others nullptr.
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const NewGroupOptions& options = {});

 private:
  std::unique_ptr<Impl> impl_;
};

// Bytes of this process's own symmetric-memory blocks alive now, over all
// groups (what empty_symmetric handed out and is still referenced; the
// other ranks' copies mapped here are theirs). For memory accounting.
int64_t symmetric_memory_bytes();

// ---------------------------------------------------------------------------
struct InitOptions {
  // "auto": shm when every rank is on this host, gloo otherwise, and CUDA
  // tensors on nccl where this tdist has its nccl plugin (PyTorch's
  // default "cpu:gloo,cuda:nccl"; the nccl communicator is made at the
  // group's first op on CUDA tensors); "shm", "gloo", "mpi", "nccl" (every
  // tensor on that one backend; shm, gloo and mpi move CUDA tensors
  // through host memory), or any backend registered at run time.
  // backend_name() names the backend of CPU tensors, backend_name(kCUDA)
  // that of CUDA tensors.
  std::string backend = "auto";
  // env:// (default), tcp://host:port?rank=R&world_size=N, file:///path?...
  std::string init_method;
  std::shared_ptr<Store> store;  // exclusive with init_method
  int world_size = -1;
  int rank = -1;
  Milliseconds timeout = kDefaultCollectiveTimeout;
  std::string group_name = "world";
};

// Joins the job (blocks until every rank has) and returns the world group,
// which also becomes the default group.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});
// The group made by init_process_group, or nullptr.
std::shared_ptr<ProcessGroup> default_group();
bool is_initialized();
// new_group over the default group.
std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const NewGroupOptions& options = {});
// Drops the default group (with no argument) or forgets `group` if it is
// the default. The group shuts down when its last reference goes.
void destroy_process_group(const std::shared_ptr<ProcessGroup>& group = nullptr);

}  // namespace tdist
