// The collectives of one FSDP unit. The contract is in unit_comm.h.
#include "fsdp/unit_comm.h"

#include "process_group/async_ops.h"

namespace tdist::detail {

namespace {

// Waits for a work, if any, ignoring its error (the failure was reported
// where it happened). Every wait has the group's timeout, so this ends.
void wait_quietly(const std::shared_ptr<Work>& work) noexcept {
  if (!work) return;
  try {
    work->wait();
  } catch (...) {
  }
}

}  // namespace

void GatherRecord::drop_quietly() const noexcept { wait_quietly(work); }

GatherRecord launch_gather(ProcessGroup& pg, std::vector<at::Tensor> outs, std::vector<at::Tensor> ins,
                           at::Tensor source) {
  GatherRecord g;
  g.source = std::move(source);
  if (!ins.empty()) g.work = pg.all_gather_into_tensor_coalesced(outs, ins);
  return g;
}

void ReduceRecord::wait() const {
  if (work) work->wait();
  if (scatter) scatter->wait();
  if (across && *across) (*across)->wait();
}

void ReduceRecord::drop_quietly() const noexcept {
  wait_quietly(work);
  wait_quietly(scatter);
  if (across) wait_quietly(*across);
}

ReduceRecord launch_reduce_scatter(ProcessGroup& pg, const std::shared_ptr<ProcessGroup>& replicate,
                                   at::Tensor out, std::vector<at::Tensor> outs, std::vector<at::Tensor> ins) {
  ReduceRecord r;
  r.out = std::move(out);
  if (ins.empty()) return r;
  r.work = pg.reduce_scatter_tensor_coalesced(outs, ins, {ReduceOp::AVG});
  if (replicate) {
    r.scatter = r.work;
    r.across = std::make_shared<std::shared_ptr<Work>>();
    r.work = r.work->chain([replicate, outs, across = r.across](Work&) {
      const AsyncOpsScope async;  // nobody waits on it inline: the worker runs it at once
      *across = replicate->all_reduce_coalesced(outs, {ReduceOp::AVG});
      return *across;
    });
  }
  return r;
}

ReduceRecord launch_all_reduce(ProcessGroup& group, std::vector<at::Tensor> inputs, std::vector<FsdpParam*> targets) {
  ReduceRecord r;
  r.inputs = std::move(inputs);
  r.targets = std::move(targets);
  if (!r.inputs.empty()) r.work = group.all_reduce_coalesced(r.inputs, {ReduceOp::AVG});
  return r;
}

}  // namespace tdist::detail
