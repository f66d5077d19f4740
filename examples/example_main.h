// What every example program's main() does: join the group of a tdist-run
// job (alone: a world of one) and report errors by name; and write rank
// 0's JSON results.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include <torch/nn/module.h>
#include <CLI/CLI.hpp>

#include "tdist/checkpointer.h"
#include "tdist/process_group.h"
#include "tdist/sampler.h"
#include "tdist/store.h"

namespace examples {

// main() of an example: joins the group of a tdist-run job (alone, without
// RANK set: a world of one), runs train(group), reports an error by name.
// `timeout_s`: the group's (and its rendezvous') timeout (--timeout).
template <typename Train>
int run_example(const char* name, const std::string& backend, Train train, double timeout_s = 120) {
  try {
    tdist::InitOptions o;
    o.backend = backend;
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    if (!std::getenv("RANK")) {
      o.store = std::make_shared<tdist::HashStore>();
      o.rank = 0;
      o.world_size = 1;
    }
    auto pg = tdist::init_process_group(o);
    return train(*pg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

// A "Name:  N kB" field of a /proc file in bytes; 0 if absent.
inline int64_t proc_field_bytes(const char* file, const char* field) {
  std::ifstream f(file);
  const std::string key = std::string(field) + ":";
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;
  }
  return 0;
}

// A field of /proc/self/status ("VmRSS", "VmHWM") in bytes; 0 if absent.
inline int64_t proc_status_bytes(const char* field) { return proc_field_bytes("/proc/self/status", field); }

// Writes j to path; false (after saying so on stderr) when it cannot.
inline bool write_json(const char* name, const std::string& path, const nlohmann::ordered_json& j) {
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f) std::fprintf(stderr, "%s: cannot write %s\n", name, path.c_str());
  return static_cast<bool>(f);
}

// --backend NAME: the process group's backend (InitOptions::backend).
inline void add_backend_flag(CLI::App& app, std::string& backend) {
  app.add_option("--backend", backend,
                 "auto (shm on one host, gloo across hosts; CUDA tensors on nccl where tdist has it), shm, gloo, mpi "
                 "(under mpirun), nccl")
      ->capture_default_str();
}

// --timeout S: how long the rendezvous, each collective and a checkpoint's
// commit may wait for the other ranks before failing (a peer cut off or
// frozen for less is ridden out).
inline void add_timeout_flag(CLI::App& app, double& seconds) {
  app.add_option("--timeout", seconds, "seconds the rendezvous, a collective or a checkpoint's commit waits for the other ranks")
      ->type_name("S")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
}

// --checkpoint-dir DIR --checkpoint-every N: an example that saves itself
// (tdist::Checkpointer) and, started again with the same flags (by
// tdist-run --max-restarts, say), resumes from the latest checkpoint.
struct CheckpointFlags {
  std::string dir;
  int64_t every = 0;
};
inline void add_checkpoint_flags(CLI::App& app, CheckpointFlags& f) {
  app.add_option("--checkpoint-dir", f.dir, "save here, and resume from the latest checkpoint found here")
      ->type_name("DIR");
  app.add_option("--checkpoint-every", f.every, "save every N steps (with --checkpoint-dir)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

// PyTorch's DistributedSampler with drop_last over a data set of n
// samples: each epoch a new shuffle (seeded seed + epoch), the same on
// every rank, every world-size-th sample for this rank.
inline tdist::DistributedSampler drop_last_sampler(int64_t n, int rank, int world, uint64_t seed) {
  tdist::DistributedSamplerOptions o;
  o.num_replicas = world;
  o.rank = rank;
  o.seed = seed;
  o.drop_last = true;
  return tdist::DistributedSampler(n, o);
}

// Where a run resumed from `r` continues: the sampler takes the data
// position saved in the checkpoint's extras (its state_dict, kept in
// samples, so it holds at any world size: see tdist/sampler.h), and the
// step count goes on from the saved step at the saved world size, or, at
// another, from the batches of the epoch this world size has done. A
// checkpoint without the position resumes only at its own world size
// (the position follows from the step). Rank 0 says where it continues.
inline int64_t resume_data(const tdist::RestoredCheckpoint& r, tdist::DistributedSampler& sampler, int64_t batch,
                           int rank, int world) {
  const bool has_position = r.extras.count("epoch") && r.extras.count("epoch_samples");
  const int64_t per_epoch = sampler.batches_per_epoch(batch);
  if (per_epoch == 0) throw std::runtime_error("the data set holds no batch for " + std::to_string(world) + " ranks");
  int64_t steps = r.step;
  if (has_position) {
    sampler.load_state_dict(r.extras);
    if (r.saved_world_size != world) {
      if (sampler.epoch() > (INT64_MAX - per_epoch) / per_epoch) {
        throw std::runtime_error("the checkpoint " + r.path + " says epoch " + std::to_string(sampler.epoch()));
      }
      steps = sampler.epoch() * per_epoch + (per_epoch - std::min(per_epoch, sampler.batches_left(batch)));
    }
  } else if (r.saved_world_size == world) {
    // Every step a whole global batch (drop_last, as these examples sample).
    sampler.load_state_dict({{"epoch", at::tensor({r.step / per_epoch}, at::kLong)},
                             {"epoch_samples", at::tensor({r.step % per_epoch * batch * world}, at::kLong)}});
  } else {
    throw std::runtime_error("the checkpoint " + r.path + " was saved at world size " +
                             std::to_string(r.saved_world_size) +
                             " without its data position (the sampler's state in its extras): it resumes only at "
                             "that world size, not at " + std::to_string(world));
  }
  if (rank == 0) {
    std::printf("resumed from %s (step %lld at world size %d): continuing at step %lld", r.path.c_str(),
                static_cast<long long>(r.step), r.saved_world_size, static_cast<long long>(steps));
    if (r.saved_world_size != world) std::printf(" at world size %d, from the same sample", world);
    std::printf("\n");
    std::fflush(stdout);  // a log (a pipe) sees it now: resuming is timed by it
  }
  return steps;
}

// A 64-bit FNV-1a hash of `tensors`' bytes, in hex: equal exactly when
// the values are equal bit for bit (short of a collision).
template <typename Tensors>
std::string fingerprint(const Tensors& tensors) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& t : tensors) {
    const auto c = t.detach().contiguous().cpu();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

}  // namespace examples
