// Checkpointer: training that saves itself every N steps or T seconds and
// resumes by itself after a restart.
//
//   tdist::CheckpointerOptions o;
//   o.dir = "ckpt";
//   o.every_steps = 100;
//   tdist::Checkpointer ckpt(pg, *model, &opt, o);
//   int64_t step = 0;
//   if (auto resumed = ckpt.restore()) {     // the latest complete checkpoint in ckpt/, if any
//     step = resumed->step;                  // model, optimizer, RNG and hook state are back
//     sampler_position = resumed->extras.at("samples_seen").item<int64_t>();
//   }
//   for (; step < steps; ) {
//     train_one_step();
//     ++step;
//     ckpt.maybe_save(step, {{"samples_seen", at::tensor(samples_seen)}});
//   }
//   ckpt.wait();                             // the last save written
//
// What a checkpoint holds: the model and optimizer as a sharded checkpoint
// (sharded_checkpoint.h: torch_xla's per-rank files, which Python reads
// and which load at any world size), the PowerSGD hook's state when given,
// and per rank a training-state file: the step, the CPU RNG's state (and
// every CUDA device's), and the user's extras (tensors by name: the data
// position, the LR scheduler's step, ...).
//
// Layout: each save has a folder of its own,
// dir/step-00000100-<save id>/{model_rank-R-of-W.pt, train_rank-R-of-W.pt},
// and dir/latest lists the complete ones, newest first, one a line (the
// last keep_last). The marker is replaced atomically (written aside, then
// renamed) once every rank's files of a save are in place; rank 0 then
// removes every step folder the marker does not list (older ones, and what
// a crashed or failed save left). A crash at any point leaves the previous
// latest checkpoint whole, and no save ever writes into a folder the
// marker names.
//
// Asynchronous saves (async, the default): the call copies this rank's
// shards, optimizer state and training state to host memory (pinned for
// CUDA tensors) and returns; a writer thread writes and commits them while
// training goes on, its collectives on a group of its own (made at
// construction, in the same order as the rank's other groups). One save is
// in flight at most, and committed within every_steps / 10 steps (at least
// 1): maybe_save of that step waits for it, on every rank, so a failure
// loses at most every_steps + every_steps / 10 steps (the save in flight).
// A failed background save is raised by the next save (a due maybe_save,
// or save) or wait, on every rank.
//
// Resuming at another world size: the model and optimizer are resharded
// (load_sharded_checkpoint); the step and extras come from rank 0's
// training state; the RNG state is left as it is (a rank of the new world
// has no own rank of the old one), and restore() says so in its result.
//
// Collective: the constructor, restore, maybe_save, save and wait, over
// `pg`'s ranks, called in the same order on every rank. Every wait has the
// files' timeout (ShardedCheckpointOptions::timeout).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "tdist/process_group.h"
#include "tdist/sharded_checkpoint.h"

namespace tdist {

struct CheckpointerOptions {
  std::string dir;           // required; made if missing
  int64_t every_steps = 0;   // save at every step divisible by it (0: never by steps)
  // Also save when this long has passed since the last save (0: never by
  // time). Rank 0's clock decides, so every rank agrees: maybe_save then
  // costs one small broadcast per call.
  std::chrono::milliseconds every = std::chrono::milliseconds(0);
  int keep_last = 2;         // complete checkpoints kept, at least 1
  bool async = true;         // copy now, write on the writer thread
  // Async: the writer's file writing runs at SCHED_IDLE (only on CPU time
  // no other thread wants), its collectives at nice 19. false: all of it
  // at nice 19 (for a machine so busy that idle time never comes).
  bool idle_writes = true;
  // Async, for a DDP or FSDP model: the copy of the weights and optimizer
  // state is made after save() returns, on the writer thread, or at the
  // latest as the next backward ends (before the optimizer's step
  // changes them); buffers, extras and RNG states are copied in save().
  // Anything else that changes the weights or optimizer state between
  // save() and the end of the next backward must not (false: every copy
  // in save()).
  bool overlap_copy = true;
  ShardedCheckpointOptions files;  // comm_hook_state, timeout (suffix: fixed by the layout)
};

// A restored checkpoint: the step it was saved at and the user's extras.
struct RestoredCheckpoint {
  int64_t step = 0;
  std::string path;        // its step folder
  int saved_world_size = 0;
  bool rng_restored = false;  // false when the world size changed
  std::map<std::string, at::Tensor> extras;
};

class Checkpointer {
 public:
  // `optimizer` may be null. UsageError for options that make no sense.
  Checkpointer(std::shared_ptr<ProcessGroup> pg, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
               CheckpointerOptions options);
  // Waits for the save in flight; an error it had is printed, not thrown.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Loads the latest complete checkpoint of dir into the model, optimizer,
  // hook state and RNGs; nullopt when there is none (a fresh start).
  // CheckpointError when the latest one is unreadable.
  std::optional<RestoredCheckpoint> restore();

  // Saves when `step` is due (every_steps, every); whether it started one.
  bool maybe_save(int64_t step, const std::map<std::string, at::Tensor>& extras = {});
  // Saves now as `step` (waits for the save in flight first). UsageError
  // for a negative step.
  void save(int64_t step, const std::map<std::string, at::Tensor>& extras = {});
  // Waits until the save in flight (if any) is written; rethrows its error.
  void wait();

  // Whether an asynchronous save is still being written (not collective).
  bool saving() const;

  // The step of the newest complete checkpoint in dir (nullopt: none).
  // Reads dir/latest on this rank; not collective.
  std::optional<int64_t> latest_step() const;

  // How long the last save held the caller: the copy (async) or the whole
  // write (sync), in seconds; and how long its writing took.
  double last_stall_seconds() const;
  double last_write_seconds() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tdist
