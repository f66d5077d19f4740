// Join: training on uneven inputs. A rank that runs out of inputs before
// the others "joins": instead of leaving them waiting in their next
// collective, it shadows the collectives of each of their iterations
// until every rank has run out; then every joinable settles (PyTorch's
// torch.distributed.algorithms.Join, with its names).
//
//   tdist::DistributedDataParallel<Net> model(Net(), {});
//   {
//     tdist::Join join({model.get()});
//     for (auto& [x, y] : my_batches) {          // as many as this rank has
//       opt.zero_grad();
//       loss_fn(model(x), y).backward();
//       opt.step();
//     }
//     join.join();  // shadows the others' remaining iterations (the
//   }               // destructor does it too when the scope ends normally)
//
// Each iteration, the first joinable's collective call (DDP: forward; FSDP:
// the wrapper's forward; a user's joinable: where it calls
// notify_join_context) tells the ranks that have joined to shadow one more
// iteration. What "shadow" means is each joinable's JoinHook:
// - DistributedDataParallel: the iteration's buffer broadcast and its
//   buckets' reductions, with zeros as this rank's gradients (so the
//   average is over all ranks, joined ones counting as zeros, unless
//   divide_by_initial_world_size is false: then over the ranks that still
//   train). Comm hooks run as usual. Inside a Join the buffers broadcast
//   each iteration come from the highest rank that still trains (as in
//   PyTorch). When all are done, every rank takes the parameters and
//   buffers of one of the last ranks to join (the optimizer state of a
//   rank that joined early stays as it was). no_sync is decided at forward
//   time, as PyTorch decides it.
// - FullyShardedDataParallel: each rank owns a shard, so a joined rank must
//   keep stepping its shard: it runs the step given to set_join_step (a
//   forward and backward on any batch, clipping, the optimizer's step)
//   while its gradients are replaced by zeros before they are reduced. So
//   inside a Join every forward of the FSDP model must be such a training
//   step on every rank: no evaluation forward, no no_sync accumulation
//   (they end in a CollectiveMismatchError naming both calls).
// - A user's Joinable: whatever its hook does.
// Several joinables: their hooks run in the order given, so each
// iteration must make their collectives in that order.
// The joinables must outlive the Join.
// Every blocking call has the group's timeout: a rank that dies or leaves
// the loop without joining makes the others fail, not hang.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <vector>

#include "tdist/errors.h"
#include "tdist/process_group.h"

namespace tdist {

struct JoinOptions {
  // false: the Join does nothing (every rank must have the same inputs).
  bool enable = true;
  // Instead of shadowing: as soon as one rank runs out, every rank raises
  // EarlyTerminationError (at its next iteration's notify, or in join()).
  bool throw_on_early_termination = false;
  // DistributedDataParallel: average the gradients over the initial world
  // size (a joined rank contributes zeros), as PyTorch does by default;
  // false: over the ranks that still train. FullyShardedDataParallel
  // supports only true.
  bool divide_by_initial_world_size = true;
};

// With throw_on_early_termination: some rank ran out of inputs. rank() is
// the lowest rank that had, as a global rank (the message names global
// ranks too). Once raised on a rank, its Join is over there: join() and
// the destructor do nothing more, even when the error was caught inside
// the Join's scope.
class EarlyTerminationError : public Error {
 public:
  EarlyTerminationError(const std::string& what, int rank) : Error(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

class JoinHook {
 public:
  virtual ~JoinHook() = default;
  // On a rank that has joined, once per iteration of the ranks that still
  // train: the same collectives, in the same order, as one of their
  // iterations makes through this joinable.
  virtual void main_hook() {}
  // Once every rank has joined. is_last_joiner: this rank ran out of
  // inputs last (with others, when several ran out at the same time).
  virtual void post_hook(bool is_last_joiner) { (void)is_last_joiner; }
};

namespace detail {
struct JoinState;  // src/join/join.cpp
}  // namespace detail

class Joinable {
 public:
  Joinable() = default;
  // A copy belongs to no Join.
  Joinable(const Joinable&) {}
  Joinable& operator=(const Joinable&) { return *this; }
  virtual ~Joinable();

  // The hook that shadows this joinable's collectives (above); made once,
  // when a Join takes the joinable.
  virtual std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) = 0;
  // The group and the device of the Join's own collectives; every joinable
  // of one Join must have the same group.
  virtual std::shared_ptr<ProcessGroup> join_process_group() = 0;
  virtual c10::Device join_device() { return c10::Device(c10::kCPU); }

 protected:
  // The options of the Join that holds this joinable while this rank still
  // trains; null outside a Join, once this rank has joined, or when the
  // Join is disabled.
  const JoinOptions* active_join() const;
  // Whether this rank has joined and its Join is running the hooks.
  bool join_shadowing() const;

 private:
  friend class Join;
  detail::JoinState* join_state_ = nullptr;
};

class Join {
 public:
  // The joinables, in the order their hooks run; the first one makes the
  // per-iteration notification (notify_join_context). Collective-free.
  explicit Join(std::vector<Joinable*> joinables, JoinOptions options = {});
  // Runs join() when the scope ends normally and it has not run; while an
  // exception unwinds, only lets go of the joinables.
  ~Join() noexcept(false);
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // This rank has no more inputs: shadow the others' iterations until every
  // rank has joined, then run the post hooks. Once; a second call does
  // nothing.
  void join();

  // Called by a joinable once per iteration, before its collectives: on a
  // rank that still trains inside a Join whose first joinable this is, one
  // small all_reduce tells the joined ranks to shadow this iteration (and,
  // with throw_on_early_termination, raises when one has joined);
  // otherwise nothing.
  static void notify_join_context(Joinable& joinable);

 private:
  std::unique_ptr<detail::JoinState> state_;
  std::vector<Joinable*> joinables_;
  std::vector<std::unique_ptr<JoinHook>> hooks_;
  int uncaught_at_start_ = 0;
  bool done_ = false;
  void release() noexcept;
};

}  // namespace tdist
