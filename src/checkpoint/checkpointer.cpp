// Checkpointer: when to save, the step folders and the latest marker, the
// writer thread, and restore. The contract is in include/tdist/checkpointer.h;
// one rank's model file is rank_file.h's, its training state
// training_state.h's.
#include "tdist/checkpointer.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "autograd/weight_fence.h"
#include "checkpoint/dcp_save.h"
#include "checkpoint/latest_marker.h"
#include "checkpoint/rank_file.h"
#include "checkpoint/sharded_files.h"
#include "checkpoint/training_state.h"
#include "checkpoint/writer_pause.h"
#include "comm/idle_work.h"
#include "fsdp/fsdp_model.h"
#include "process_group/agree.h"
#include "tdist/ddp.h"
#include "tdist/fsdp.h"
#include "trace/flight_recorder.h"
#include "trace/timeline.h"
#include "util/open_file.h"
#include "util/write_aside.h"

namespace tdist {

namespace {

using checkpoint::kLatestMarker;
using checkpoint::parse_step_folder;
using checkpoint::read_latest_marker;
using checkpoint::step_folder_name;
using checkpoint::StepFolder;

using Clock = std::chrono::steady_clock;

constexpr const char* kModel = "model";
constexpr const char* kTrain = "train";
constexpr const char* kSuffix = "_rank-*-of-*.pt";

// One save's folder (latest_marker.h). Every save gets a folder of its
// own, so no save ever writes into a folder that a marker names (a resumed
// run saving a step number again, a crash's leftovers).
using Folder = StepFolder;

void make_dir(const std::string& dir) {
  std::string at;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || (dir[i] == '/' && i > 0)) {
      at = dir.substr(0, i);
      if (::mkdir(at.c_str(), 0755) != 0 && errno != EEXIST) {
        throw CheckpointError("Checkpointer: cannot make " + at + ": " + std::strerror(errno));
      }
    }
  }
}

std::vector<Folder> read_latest(const std::string& dir) { return read_latest_marker(dir, "Checkpointer"); }

void write_latest(const std::string& dir, const std::vector<Folder>& folders) {
  std::string text, error;
  for (const auto& f : folders) text += f.name + "\n";
  if (!detail::write_aside(dir + "/" + kLatestMarker, text, error, /*durable=*/true)) {
    throw CheckpointError("Checkpointer: cannot replace the latest marker: " + error);
  }
}

// Removes a step folder and the files in it, never following a symbolic
// link (a link named like a folder is removed itself, not its target).
void remove_folder(const std::string& dir, const std::string& name, int depth = 0) {
  const int parent = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (parent < 0) return;
  struct stat st {};
  if (::fstatat(parent, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      ::unlinkat(parent, name.c_str(), 0);
    } else {
      const int fd = ::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd >= 0) {
        if (DIR* d = ::fdopendir(fd)) {  // owns fd now
          while (dirent* e = ::readdir(d)) {
            const std::string entry = e->d_name;
            if (entry == "." || entry == "..") continue;
            struct stat es {};
            if (depth < 1 && ::fstatat(::dirfd(d), entry.c_str(), &es, AT_SYMLINK_NOFOLLOW) == 0 &&
                S_ISDIR(es.st_mode)) {  // a DCP model folder inside a step folder
              remove_folder(dir + "/" + name, entry, depth + 1);
              continue;
            }
            ::unlinkat(::dirfd(d), entry.c_str(), 0);
          }
          ::closedir(d);
        } else {
          ::close(fd);
        }
      }
      ::unlinkat(parent, name.c_str(), AT_REMOVEDIR);
    }
  }
  ::close(parent);
}

// Removes every step folder the marker does not list: older checkpoints
// past keep_last, and what crashed or failed saves left.
void prune(const std::string& dir, const std::vector<Folder>& kept) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (parse_step_folder(e->d_name)) names.push_back(e->d_name);
    }
    ::closedir(d);
  }
  for (const auto& name : names) {
    const bool listed = std::any_of(kept.begin(), kept.end(), [&](const Folder& f) { return f.name == name; });
    if (!listed) remove_folder(dir, name);
  }
}

using detail::all_ok;

std::atomic<int64_t> g_writer_pause_ms{0};  // writer_pause.h

// How many steps after its own an asynchronous save must be committed by:
// a tenth of the interval, at least one; none without an interval (the
// next save waits for it, whenever it comes). A save in flight at a
// failure is lost with the steps after it, so a run loses at most
// every_steps + this many steps (docs/checkpoints.md).
int64_t commit_within_steps(int64_t every_steps) {
  return every_steps > 0 ? std::max<int64_t>(1, every_steps / 10) : 0;
}

int64_t broadcast_int(ProcessGroup& pg, int64_t v, Milliseconds timeout) { return detail::rank0_value(pg, v, timeout); }

}  // namespace

struct Checkpointer::Impl {
  std::shared_ptr<ProcessGroup> pg;       // training's
  std::shared_ptr<ProcessGroup> own;      // the writer's collectives
  torch::nn::Module& model;
  torch::optim::Optimizer* optimizer;
  CheckpointerOptions o;
  std::thread writer;
  std::atomic<bool> writing{false};  // the writer thread has not finished
  std::exception_ptr failed;  // the last background save's error, until raised
  checkpoint::CopyPool copies;  // an asynchronous save's host copies, reused by the next
  Clock::time_point last_save = Clock::now();
  std::optional<int64_t> in_flight_step;  // the step of the asynchronous save being written
  double stall_s = 0, write_s = 0;
  std::mutex times_mu;  // write_s is set on the writer thread
  // Asynchronous saves of a DDP or FSDP model copy the weights and
  // optimizer state after save() returns: on the writer, or at the latest
  // as the next backward ends, through this fence (weight_fence.h); 0: no
  // fence, every copy is made in save().
  uint64_t fence = 0;

  Impl(std::shared_ptr<ProcessGroup> g, torch::nn::Module& m, torch::optim::Optimizer* opt, CheckpointerOptions opts)
      : pg(std::move(g)), model(m), optimizer(opt), o(std::move(opts)) {
    o.files.suffix = kSuffix;  // the layout's, whatever the caller set
    const bool wrapped = dynamic_cast<detail::DataParallelModule*>(&model) != nullptr || detail::FsdpModel::of(model);
    if (o.async && o.overlap_copy && wrapped) fence = detail::add_weight_fence([this] { copies.finish(); });
  }
  ~Impl() {
    if (fence) detail::remove_weight_fence(fence);
  }

  // The storages of the model's buffers, which the next forward may change
  // (BatchNorm's running statistics): copied in save(), never deferred.
  std::vector<const void*> buffer_storages() {
    std::vector<const void*> out;
    for (const auto& b : model.buffers(true)) {
      if (b.defined() && b.has_storage()) out.push_back(b.storage().data());
    }
    return out;
  }

  Milliseconds timeout() const { return o.files.timeout; }

  void join() {
    if (writer.joinable()) writer.join();
  }

  void raise_failure() {
    join();
    in_flight_step.reset();
    if (failed) {
      auto e = failed;
      failed = nullptr;
      std::rethrow_exception(e);
    }
  }

  // Writes this rank's files of `step` and, once every rank's are in
  // place, moves dir/latest to them. Collective over `own`.
  // The files' writing (no collective): on the background writer, in a
  // thread of its own at SCHED_IDLE and the idle I/O class, which runs only
  // on time no other thread of the machine wants, so training loses as
  // little as it can;
  // the writer's collectives stay at its nice 19, so they progress even
  // while training keeps every core busy. A synchronous save writes here.
  void run_write(const std::function<void()>& work) {
    if (!o.async || !o.idle_writes) {
      work();
      return;
    }
    std::exception_ptr raised;
    comm::IdleWorkScope idle_work;  // the ranks' waits stop yielding to it (comm/idle_work.h)
    std::thread idle([&] {
      sched_param none{};
      (void)::pthread_setschedparam(::pthread_self(), SCHED_IDLE, &none);
      // Its I/O in the idle class too (what the disk does for nobody
      // else; the fsync's writeback is submitted from this thread).
      // Refused (no such syscall, a policy): written at the default class.
      constexpr int kWhoThread = 1, kIdleClass = 3, kClassShift = 13;  // IOPRIO_WHO_PROCESS, IOPRIO_CLASS_IDLE
      (void)::syscall(SYS_ioprio_set, kWhoThread, 0, kIdleClass << kClassShift);
      try {
        work();
      } catch (...) {
        raised = std::current_exception();
      }
    });
    idle.join();
    if (raised) std::rethrow_exception(raised);
  }

  // The model's part of a save: tdist's rank file, or a DCP folder's rank
  // part (options.files.format), whichever the options ask for.
  struct ModelPart {
    std::optional<detail::RankFileContents> tdist;
    std::optional<checkpoint::DcpRankContents> dcp;
  };

  void commit(int64_t step, int64_t save_id, ModelPart* model_part, std::string error,
              detail::TrainingStateFile* train) {
    const auto t0 = Clock::now();
    const detail::TimelineSpan span("checkpoint", "checkpoint write", "step " + std::to_string(step));
    const detail::FrSiteScope site("checkpoint save");
    const Folder made{step, step_folder_name(step, static_cast<uint64_t>(save_id))};
    const std::string folder = o.dir + "/" + made.name;
    if (error.empty()) {
      try {
        if (::mkdir(folder.c_str(), 0755) != 0 && errno != EEXIST) {
          throw CheckpointError("Checkpointer: cannot make " + folder + ": " + std::strerror(errno));
        }
        run_write([&] {
          detail::write_training_state(
              checkpoint::rank_file_path(folder + "/" + kTrain, kSuffix, own->rank(), own->size()), *train);
        });
      } catch (const std::exception& e) {
        error = *e.what() ? e.what() : "an error without words";
      }
    }
    try {
      const auto runner = [this](const std::function<void()>& work) { run_write(work); };
      if (o.files.format == ShardedFormat::dcp) {
        checkpoint::commit_dcp(folder + "/" + kModel, *own, model_part && model_part->dcp ? &*model_part->dcp : nullptr,
                               error, timeout(), runner);
      } else {
        detail::commit_rank_files(folder + "/" + kModel, *own,
                                  model_part && model_part->tdist ? &*model_part->tdist : nullptr, error, o.files, runner);
      }
    } catch (...) {
      if (own->rank() == 0) remove_folder(o.dir, made.name);  // a failed save leaves nothing
      throw;
    }
    // Every rank's files are in place: rank 0 puts the folder first in the
    // marker and removes what it no longer lists; every rank returns only
    // once it has (a marker it cannot write fails all).
    std::string marker_error;
    if (own->rank() == 0) {
      try {
        std::vector<Folder> kept{made};
        try {
          for (const auto& f : read_latest(o.dir)) {
            if (static_cast<int>(kept.size()) < o.keep_last && f.name != made.name) kept.push_back(f);
          }
        } catch (const CheckpointError&) {
          // An unreadable marker: this checkpoint starts a new one.
        }
        write_latest(o.dir, kept);
        prune(o.dir, kept);
      } catch (const std::exception& e) {
        marker_error = e.what();
      }
    }
    if (!all_ok(*own, marker_error.empty(), timeout())) {
      throw CheckpointError(own->rank() == 0 ? marker_error
                                             : "Checkpointer: rank 0 could not name " + made.name + " in " + o.dir +
                                                   "/latest (the previous checkpoint stays the latest)");
    }
    std::lock_guard<std::mutex> lock(times_mu);
    write_s = std::chrono::duration<double>(Clock::now() - t0).count();
  }

  void save(int64_t step, const std::map<std::string, at::Tensor>& extras) {
    if (step < 0) throw UsageError("Checkpointer: step " + std::to_string(step) + " is negative");
    raise_failure();
    const auto t0 = Clock::now();
    last_save = t0;
    const int64_t save_id = detail::agree_on_save_id(*own, timeout());
    auto model_part = std::make_shared<ModelPart>();
    auto train = std::make_shared<std::optional<detail::TrainingStateFile>>();
    std::string error;
    copies.restart();  // the last save's writer is done with them (raise_failure joined it)
    checkpoint::CopyPool* pool = o.async ? &copies : nullptr;
    try {
      const detail::TimelineSpan span("checkpoint", "checkpoint snapshot", "step " + std::to_string(step));
      if (fence) copies.set_deferred(true, buffer_storages());
      if (o.files.format == ShardedFormat::dcp) {
        model_part->dcp.emplace(checkpoint::build_dcp_rank(*own, model, optimizer, pool));
      } else {
        model_part->tdist.emplace(detail::build_rank_file(*own, model, optimizer, o.files, save_id, pool));
      }
      copies.set_deferred(false);  // the extras and RNG states: now
      train->emplace(detail::build_training_state(step, own->rank(), own->size(), extras, pool));
    } catch (const std::exception& e) {
      copies.set_deferred(false);
      error = *e.what() ? e.what() : "an error without words";
    }
    auto run = [this, step, save_id, model_part, train, error] {
      run_write([this] { copies.finish(); });  // the deferred copies first, at the writing's priority
      commit(step, save_id, model_part.get(), error, *train ? &**train : nullptr);
    };
    if (!o.async) {
      run();
    } else {
      writing = true;
      in_flight_step = step;
      writer = std::thread([this, run] {
        if (const int64_t ms = g_writer_pause_ms.load()) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
        // The writer yields to training: nice 19 for its collectives (a
        // small share of a busy core, so that they progress and never
        // time out while training keeps every core busy), SCHED_IDLE for
        // its writing (run_write).
        (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
        detail::set_timeline_track("checkpoint writer");
        try {
          run();
        } catch (...) {
          failed = std::current_exception();
        }
        writing = false;
      });
    }
    std::lock_guard<std::mutex> lock(times_mu);
    stall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  }
};

Checkpointer::Checkpointer(std::shared_ptr<ProcessGroup> pg, torch::nn::Module& model,
                           torch::optim::Optimizer* optimizer, CheckpointerOptions options) {
  if (!pg) throw UsageError("Checkpointer: no process group");
  if (options.dir.empty()) throw UsageError("Checkpointer: CheckpointerOptions::dir is empty");
  if (options.every_steps < 0) throw UsageError("Checkpointer: every_steps must not be negative");
  if (options.every.count() < 0) throw UsageError("Checkpointer: every must not be negative");
  if (options.keep_last < 1) throw UsageError("Checkpointer: keep_last must be at least 1");
  if (options.files.timeout.count() <= 0) throw UsageError("Checkpointer: the files' timeout must be positive");
  if (options.files.format == ShardedFormat::dcp && options.files.comm_hook_state) {
    throw UsageError("Checkpointer: a DCP checkpoint holds no comm hook state (use ShardedFormat::tdist)");
  }
  const auto fsdp = detail::FsdpModel::of(model);
  if (fsdp && fsdp->replicate_group()) {
    throw UsageError("Checkpointer: the model is hybrid-sharded (HSDP); save it with save_sharded_checkpoint "
                     "over its device mesh's group (the Checkpointer takes models sharded or replicated over one "
                     "group)");
  }
  if (fsdp) {
    const auto& units = fsdp->group();
    if (units->size() != pg->size() || units->rank() != pg->rank()) {
      throw UsageError("Checkpointer: the model's FSDP group is rank " + std::to_string(units->rank()) + " of " +
                       std::to_string(units->size()) + ", the group given rank " + std::to_string(pg->rank()) +
                       " of " + std::to_string(pg->size()) + ": pass the model's group");
    }
  }
  impl_ = std::make_unique<Impl>(pg, model, optimizer, std::move(options));
  std::vector<int> all(static_cast<size_t>(pg->size()));
  for (int r = 0; r < pg->size(); ++r) all[static_cast<size_t>(r)] = r;
  impl_->own = pg->new_group(all);
  std::string error;
  try {
    make_dir(impl_->o.dir);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!all_ok(*pg, error.empty(), impl_->timeout())) {
    throw CheckpointError(error.empty() ? "Checkpointer: another rank cannot make " + impl_->o.dir : error);
  }
}

Checkpointer::~Checkpointer() {
  if (!impl_) return;
  impl_->join();
  if (impl_->failed) {
    try {
      std::rethrow_exception(impl_->failed);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tdist: Checkpointer: the last save failed: %s\n", e.what());
    }
  }
}

std::optional<int64_t> Checkpointer::latest_step() const {
  const auto folders = read_latest(impl_->o.dir);
  if (folders.empty()) return std::nullopt;
  return folders.front().step;
}

std::optional<RestoredCheckpoint> Checkpointer::restore() {
  Impl& s = *impl_;
  s.raise_failure();
  ProcessGroup& pg = *s.pg;
  // Rank 0 reads the marker and sends its first line's length, then the
  // line (a folder name: at most 48 bytes).
  std::string error, name;
  int64_t length = -1;
  if (pg.rank() == 0) {
    try {
      const auto folders = read_latest(s.o.dir);
      if (!folders.empty()) name = folders.front().name;
      length = static_cast<int64_t>(name.size());
    } catch (const std::exception& e) {
      error = e.what();
      length = -2;
    }
  }
  length = broadcast_int(pg, length, s.timeout());
  if (length == -2) throw CheckpointError(pg.rank() == 0 ? error : "Checkpointer: rank 0 cannot read the latest marker");
  if (length <= 0) return std::nullopt;
  at::Tensor bytes = at::zeros({48}, at::kByte);
  std::memcpy(bytes.data_ptr(), name.data(), name.size());
  BroadcastOptions bo;
  bo.timeout = s.timeout();
  bo.async_op = false;
  pg.broadcast(bytes, bo);
  name.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(std::min<int64_t>(length, 48)));
  const auto folder = parse_step_folder(name);
  if (!folder) throw CheckpointError("Checkpointer: rank 0 sent a folder name that is none: '" + name + "'");
  const int64_t step = folder->step;
  RestoredCheckpoint out;
  out.step = step;
  out.path = s.o.dir + "/" + folder->name;
  load_sharded_checkpoint(out.path + "/" + kModel, pg, s.model, s.optimizer, s.o.files);
  // The training state: this rank's own at the saving world size, else
  // rank 0's (step and extras only).
  std::optional<detail::TrainingState> state;
  try {
    const auto found = checkpoint::find_rank_files(out.path + "/" + kTrain, kSuffix);
    int saved_world = -1;
    for (const auto& f : found) {
      if (f.rank == 0) saved_world = static_cast<int>(f.world_size);
    }
    if (saved_world <= 0) throw CheckpointError("Checkpointer: " + out.path + " holds no training state of rank 0");
    out.saved_world_size = saved_world;
    const int from = saved_world == pg.size() ? pg.rank() : 0;
    state = detail::read_training_state(
        checkpoint::rank_file_path(out.path + "/" + kTrain, kSuffix, from, saved_world), step);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!all_ok(pg, error.empty(), s.timeout())) {
    throw CheckpointError(error.empty() ? "Checkpointer: another rank could not read its training state of " +
                                              out.path + " (the model and optimizer are loaded)"
                                        : error);
  }
  out.rng_restored = out.saved_world_size == pg.size();
  if (out.rng_restored) detail::restore_rng(*state);
  out.extras = std::move(state->extras);
  s.last_save = Clock::now();
  return out;
}

bool Checkpointer::maybe_save(int64_t step, const std::map<std::string, at::Tensor>& extras) {
  Impl& s = *impl_;
  const int64_t within = commit_within_steps(s.o.every_steps);
  if (s.in_flight_step && within > 0 && step - *s.in_flight_step >= within) {
    // The save in flight is due: this step waits for its commit (on every
    // rank at the same step), so that a failure loses at most one
    // interval and `within` steps.
    const detail::TimelineSpan span("checkpoint", "checkpoint commit wait",
                                    "step " + std::to_string(*s.in_flight_step));
    s.raise_failure();
  }
  bool due = s.o.every_steps > 0 && step % s.o.every_steps == 0;
  if (s.o.every.count() > 0) {
    const bool late = Clock::now() - s.last_save >= s.o.every;
    due = broadcast_int(*s.pg, (due || late) ? 1 : 0, s.timeout()) == 1;
  }
  if (!due) return false;
  s.save(step, extras);
  return true;
}

void Checkpointer::save(int64_t step, const std::map<std::string, at::Tensor>& extras) { impl_->save(step, extras); }

void Checkpointer::wait() { impl_->raise_failure(); }

void detail::set_checkpoint_writer_pause_for_testing(std::chrono::milliseconds pause) {
  g_writer_pause_ms = pause.count();
}

bool Checkpointer::saving() const { return impl_->writing.load(); }

double Checkpointer::last_stall_seconds() const {
  std::lock_guard<std::mutex> lock(impl_->times_mu);
  return impl_->stall_s;
}

double Checkpointer::last_write_seconds() const {
  std::lock_guard<std::mutex> lock(impl_->times_mu);
  return impl_->write_s;
}

}  // namespace tdist
