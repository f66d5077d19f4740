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
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "checkpoint/rank_file.h"
#include "checkpoint/sharded_files.h"
#include "checkpoint/training_state.h"
#include "tdist/fsdp.h"
#include "util/open_file.h"

namespace tdist {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kModel = "model";
constexpr const char* kTrain = "train";
constexpr const char* kSuffix = "_rank-*-of-*.pt";
constexpr const char* kLatest = "latest";

std::string step_folder(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

// The step a folder name says ("step-00000100" -> 100), or -1.
int64_t step_of(const std::string& name) {
  if (name.size() < 6 || name.size() > 24 || name.compare(0, 5, "step-") != 0) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

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

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)::fsync(fd);
    ::close(fd);
  }
}

// dir/latest's step, read with a bound (a marker is one short line), or
// nullopt when there is none. CheckpointError when it says nothing a
// Checkpointer writes.
std::optional<int64_t> read_latest(const std::string& dir) {
  const std::string path = dir + "/" + kLatest;
  std::string why;
  const int fd = detail::open_regular(path, O_RDONLY, why);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    throw CheckpointError("Checkpointer: the latest marker " + why);
  }
  char buf[64];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  ::close(fd);
  std::string text(buf, n > 0 ? static_cast<size_t>(n) : 0);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  const int64_t step = step_of(text);
  if (step < 0) {
    throw CheckpointError("Checkpointer: " + path + " does not name a step folder (\"step-NNNNNNNN\"); remove it " +
                          "to start afresh, or write the name of a complete one into it");
  }
  return step;
}

void write_latest(const std::string& dir, int64_t step) {
  const std::string path = dir + "/" + kLatest, tmp = path + ".tmp";
  const std::string line = step_folder(step) + "\n";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError("Checkpointer: cannot write " + tmp + ": " + std::strerror(errno));
  const bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    throw CheckpointError("Checkpointer: cannot replace " + path + ": " + std::strerror(errno));
  }
  fsync_dir(dir);
}

std::vector<int64_t> step_folders(const std::string& dir) {
  std::vector<int64_t> steps;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const int64_t s = step_of(e->d_name);
      if (s >= 0) steps.push_back(s);
    }
    ::closedir(d);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

void remove_folder(const std::string& path) {
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") ::unlink((path + "/" + name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(path.c_str());
}

// Keeps the newest keep_last step folders up to `latest` and removes the
// rest: older ones, and newer ones (what a crashed save left).
void prune(const std::string& dir, int64_t latest, int keep_last) {
  const std::vector<int64_t> steps = step_folders(dir);  // ascending
  std::vector<int64_t> up_to_latest;
  for (int64_t s : steps) {
    if (s <= latest) up_to_latest.push_back(s);
  }
  const size_t keep = std::min(static_cast<size_t>(keep_last), up_to_latest.size());
  const int64_t oldest_kept = keep == 0 ? latest : up_to_latest[up_to_latest.size() - keep];
  for (int64_t s : steps) {
    if (s < oldest_kept || s > latest) remove_folder(dir + "/" + step_folder(s));
  }
}

// Whether every rank's `ok` holds; the same answer on every rank.
bool all_ok(ProcessGroup& pg, bool ok, Milliseconds timeout) {
  at::Tensor flag = at::tensor({ok ? int64_t{1} : int64_t{0}}, at::kLong);
  AllreduceOptions o;
  o.op = ReduceOp::MIN;
  o.timeout = timeout;
  o.async_op = false;
  pg.all_reduce(flag, o);
  return flag.item<int64_t>() == 1;
}

int64_t broadcast_int(ProcessGroup& pg, int64_t v, Milliseconds timeout) {
  at::Tensor t = at::tensor({v}, at::kLong);
  BroadcastOptions o;
  o.timeout = timeout;
  o.async_op = false;
  pg.broadcast(t, o);
  return t.item<int64_t>();
}

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
  double stall_s = 0, write_s = 0;
  std::mutex times_mu;  // write_s is set on the writer thread

  Impl(std::shared_ptr<ProcessGroup> g, torch::nn::Module& m, torch::optim::Optimizer* opt, CheckpointerOptions opts)
      : pg(std::move(g)), model(m), optimizer(opt), o(std::move(opts)) {}

  Milliseconds timeout() const { return o.files.timeout; }

  void join() {
    if (writer.joinable()) writer.join();
  }

  void raise_failure() {
    join();
    if (failed) {
      auto e = failed;
      failed = nullptr;
      std::rethrow_exception(e);
    }
  }

  // Writes this rank's files of `step` and, once every rank's are in
  // place, moves dir/latest to them. Collective over `own`.
  void commit(int64_t step, detail::RankFileContents* model_file, std::string error,
              detail::TrainingStateFile* train) {
    const auto t0 = Clock::now();
    const std::string folder = o.dir + "/" + step_folder(step);
    if (error.empty()) {
      try {
        make_dir(folder);
        detail::write_training_state(checkpoint::rank_file_path(folder + "/" + kTrain, kSuffix, own->rank(),
                                                                own->size()),
                                     *train);
      } catch (const std::exception& e) {
        error = *e.what() ? e.what() : "an error without words";
      }
    }
    ShardedCheckpointOptions files = o.files;
    files.suffix = kSuffix;
    detail::commit_rank_files(folder + "/" + kModel, *own, model_file, error, files);
    // Every rank's files are in place: rank 0 moves the marker, and every
    // rank returns only once it has (a marker it cannot write fails all).
    std::string marker_error;
    if (own->rank() == 0) {
      try {
        write_latest(o.dir, step);
        prune(o.dir, step, o.keep_last);
      } catch (const std::exception& e) {
        marker_error = e.what();
      }
    }
    if (!all_ok(*own, marker_error.empty(), timeout())) {
      throw CheckpointError(own->rank() == 0 ? marker_error
                                             : "Checkpointer: rank 0 could not move " + o.dir + "/latest to " +
                                                   step_folder(step) + " (the previous checkpoint stays the latest)");
    }
    std::lock_guard<std::mutex> lock(times_mu);
    write_s = std::chrono::duration<double>(Clock::now() - t0).count();
  }

  void save(int64_t step, const std::map<std::string, at::Tensor>& extras) {
    raise_failure();
    const auto t0 = Clock::now();
    last_save = t0;
    ShardedCheckpointOptions files = o.files;
    files.suffix = kSuffix;
    const int64_t save_id = detail::agree_on_save_id(*own, timeout());
    auto model_file = std::make_shared<std::optional<detail::RankFileContents>>();
    auto train = std::make_shared<std::optional<detail::TrainingStateFile>>();
    std::string error;
    copies.restart();  // the last save's writer is done with them (raise_failure joined it)
    checkpoint::CopyPool* pool = o.async ? &copies : nullptr;
    try {
      model_file->emplace(detail::build_rank_file(*own, model, optimizer, files, save_id, pool));
      train->emplace(detail::build_training_state(step, own->rank(), own->size(), extras, pool));
    } catch (const std::exception& e) {
      error = *e.what() ? e.what() : "an error without words";
    }
    auto run = [this, step, model_file, train, error] {
      commit(step, *model_file ? &**model_file : nullptr, error, *train ? &**train : nullptr);
    };
    if (!o.async) {
      run();
    } else {
      writing = true;
      writer = std::thread([this, run] {
        // Writing yields to training: the thread runs on cores that have
        // nothing else to run (and in the steps' waits).
        sched_param idle{};
        (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
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
  if (detail::units_replicate_group(model)) {
    throw UsageError("Checkpointer: the model is hybrid-sharded (HSDP); save it with save_sharded_checkpoint "
                     "over its device mesh's group (the Checkpointer takes models sharded or replicated over one "
                     "group)");
  }
  if (const auto units = detail::units_group(model)) {
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

std::optional<int64_t> Checkpointer::latest_step() const { return read_latest(impl_->o.dir); }

std::optional<RestoredCheckpoint> Checkpointer::restore() {
  Impl& s = *impl_;
  s.raise_failure();
  ProcessGroup& pg = *s.pg;
  int64_t step = -1;
  std::string error;
  if (pg.rank() == 0) {
    try {
      step = read_latest(s.o.dir).value_or(-1);
    } catch (const std::exception& e) {
      error = e.what();
      step = -2;
    }
  }
  step = broadcast_int(pg, step, s.timeout());
  if (step == -2) throw CheckpointError(pg.rank() == 0 ? error : "Checkpointer: rank 0 cannot read the latest marker");
  if (step < 0) return std::nullopt;
  RestoredCheckpoint out;
  out.step = step;
  out.path = s.o.dir + "/" + step_folder(step);
  ShardedCheckpointOptions files = s.o.files;
  files.suffix = kSuffix;
  load_sharded_checkpoint(out.path + "/" + kModel, pg, s.model, s.optimizer, files);
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
