// The collectives of one FSDP unit, each launched as one call to its group
// and returned as a record of what is in flight: the unit (unit.h) decides
// what moves where, this file launches it and waits for it.
//
// - GatherRecord: ONE all-gather of the unit's shards into the full
//   storage (all_gather_into_tensor_coalesced), with the input it reads
//   (a converted copy or a post-forward chunk) kept alive until it ends.
// - ReduceRecord: ONE reduce-scatter (AVG) of the unit's full gradients
//   into a chunk of shard gradients, under hybrid sharding chained with
//   one all-reduce (AVG) of that chunk across the replicas; or, without
//   sharding, ONE all-reduce of the gradients themselves.
//
// Threading: launched and waited for on the training thread; the group's
// worker runs the collectives (the caller holds an AsyncOpsScope).
// Lifetime: a record keeps its tensors alive; the caller keeps the record
// until done() or wait() (drop_quietly() after a failure).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "tdist/process_group.h"

namespace tdist::detail {

struct FsdpParam;

struct GatherRecord {
  std::shared_ptr<Work> work;  // null: nothing was sent (every parameter empty, or no sharding)
  at::Tensor source;           // the all-gather input when not the chunk itself: kept until it ends

  // Waits for it (a failure raises: PeerFailureError, TimeoutError...).
  void wait() const {
    if (work) work->wait();
  }
  // Waits for it, dropping its error (reported where it happened).
  void drop_quietly() const noexcept;
};

// outs[i] (a parameter's padded region of the full storage) gathers ins[i]
// (this rank's piece of it) from every rank of pg. Nothing when empty.
GatherRecord launch_gather(ProcessGroup& pg, std::vector<at::Tensor> outs, std::vector<at::Tensor> ins,
                           at::Tensor source = {});

struct ReduceRecord {
  std::shared_ptr<Work> work;  // null: nothing to reduce (hybrid: the chain of the two below)
  // Hybrid sharding: the reduce-scatter and the all-reduce across the
  // replicas, each waited for too (a CUDA op's Work makes the caller's
  // stream wait for its end; the chain's Work alone does not).
  std::shared_ptr<Work> scatter;
  std::shared_ptr<std::shared_ptr<Work>> across;
  at::Tensor out;                   // sharded: the reduce-scatter output, a chunk
  std::vector<at::Tensor> inputs;   // not sharded: the all-reduced gradients (converted copies or .grads)
  std::vector<FsdpParam*> targets;  // not sharded: the parameter of each input

  // Whether it has ended (wait() will not block).
  bool done() const { return !work || work->is_completed(); }
  // Waits for every collective of it (a failure raises).
  void wait() const;
  void drop_quietly() const noexcept;
};

// ins[i] (a parameter's padded full gradient) reduce-scattered (AVG) over
// pg into outs[i] (its shard gradient: a view of `out`), then, with a
// replicate group, outs all-reduced (AVG) across it: queued by pg's worker
// once the reduce-scatter is done, so every rank queues them in the order
// of its reductions. Nothing sent when ins is empty.
ReduceRecord launch_reduce_scatter(ProcessGroup& pg, const std::shared_ptr<ProcessGroup>& replicate,
                                   at::Tensor out, std::vector<at::Tensor> outs, std::vector<at::Tensor> ins);

// Without sharding: inputs (in the reduce dtype) all-reduced (AVG) in
// place over group; targets[i] is the parameter whose .grad inputs[i]
// came from. Nothing sent when inputs is empty.
ReduceRecord launch_all_reduce(ProcessGroup& group, std::vector<at::Tensor> inputs, std::vector<FsdpParam*> targets);

}  // namespace tdist::detail
