// The flight recorder: the last N ops of every process group of this
// process, kept in one ring so that a hang can be explained afterwards
// (docs/observability.md). ProcessGroup::Impl::enqueue records each op
// (record), its worker marks it started and completed or failed; a dump
// writes the ring as JSON (dump_json.cpp; the keys of PyTorch's Flight
// Recorder dump) to <dir>/rank-<R>.json.
//
// On by default; TDIST_FR_BUFFER_SIZE=N sets the ring's size (default
// 2000, at most 100000), 0 turns it off (add_group then returns nullptr
// and groups record nothing).
//
// Cost: an op claims a slot (one atomic increment), takes the slot's own
// spin lock (uncontended: only the op's threads and a dump touch it) to
// record it and again to mark it ended, and reads the clock twice (a
// synchronous op run on its caller's thread; a queued one three times);
// the clock is the coarse one (fr_op_now_ns) unless the timeline is on.
// A group's progress counters (FrProgress) are plain stores: a group runs
// one op at a time (TaskQueue's run token), so one thread at a time writes
// them. Three locked instructions a synchronous op in all (a queued one:
// five, with its count and its start); no string is built: a
// record holds enums and counts, and the calling site is copied into a
// fixed array.
//
// Threading: every member may be called from any thread. A record's slot
// is reused N records later; an update through a stale handle (its slot
// reused) is dropped.
// Lifetime: the recorder is made on first use and never destroyed (a
// dumper thread and signal handlers may run during exit).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/types.h"

namespace tdist::detail {

// Why a dump was written (the dump's "reason").
enum class DumpReason : uint8_t { kTimeout, kPeerFailure, kMismatch, kSignal, kStall, kRequest };
const char* dump_reason_name(DumpReason r);

// One numbering's progress on a group (its collectives, or its send/recv
// ops: send/recv are not symmetric across ranks, so they cannot share the
// numbers ranks line up by), by the group's own numbers (given as each op
// starts, in the order ops run: comm/op_label.h); 0: none yet.
// Threading: everything but `queued` is written only by the op that runs,
// and a group runs one op at a time (TaskQueue's run token orders one op's
// writes before the next op's), so those are relaxed loads and stores, no
// locked instruction; any thread may read them. `queued` is bumped by
// whichever thread queues an op.
struct FrProgress {
  std::atomic<uint64_t> queued{0};      // ops queued while recording (not run at once on the caller's thread)
  std::atomic<uint64_t> ran_at_once{0};  // ops recorded as they started on the caller's thread
  std::atomic<uint64_t> started{0};     // the highest number started
  std::atomic<uint64_t> completed{0};   // the highest number completed
  std::atomic<uint64_t> completed_ops{0};  // how many completed while recording
  // How many ops were recorded: the highest number the ops queued so far
  // will have (while recording ran throughout).
  uint64_t enqueued() const {
    return queued.load(std::memory_order_relaxed) + ran_at_once.load(std::memory_order_relaxed);
  }
};

// A group as the recorder knows it.
struct FrGroup {
  int id = 0;  // creation order in this process
  std::string name;
  std::string desc;  // "default_pg" for the world group
  std::string backend;
  std::vector<int> ranks;  // global ranks
  FrProgress collective, p2p;
  FrProgress& progress(bool is_p2p) { return is_p2p ? p2p : collective; }
};

enum class FrState : uint8_t { kScheduled, kStarted, kCompleted, kFailed };

// One op, as queued. `name`: the op's name as collective_counts() gives
// it ("all_reduce"), a string that lives as long as the process. Sizes
// are element counts of this rank's input and output; dtype -1: the op
// moves no typed data (barrier).
struct FrOp {
  const char* name = "barrier";
  bool p2p = false;  // send or recv: numbered apart
  int dtype = -1;  // a comm::DataType, or -1
  int64_t input_numel = 0;
  int64_t output_numel = 0;
  int64_t timeout_ms = 0;
  int peer = -1;  // send/recv: the group rank of the other side
};

// A snapshot of one record (what a dump or a heartbeat reads).
struct FrRecord {
  uint64_t id = 0;
  const FrGroup* group = nullptr;
  uint64_t seq = 0;
  bool p2p = false;
  FrOp op;
  FrState state = FrState::kScheduled;
  int64_t created_ns = 0, started_ns = 0, completed_ns = 0;  // CLOCK_REALTIME; 0: not yet
  std::string site;
  std::string error;  // kFailed: the error's first line
};

class FlightRecorder;

// What enqueue keeps of a record to mark its progress; empty (slot null)
// when the recorder is off.
class FrHandle {
 public:
  FrHandle() = default;
  // On the thread that runs the op, inside its OpLabelScope: takes the
  // op's number from it (a record is unnumbered, seq 0, until then).
  void started() const;
  void completed() const;
  // Marks the op failed with the exception's message; a timeout, a peer's
  // failure or a mismatch also dumps the ring (before the error reaches
  // the caller).
  void failed(const std::exception& e) const;
  explicit operator bool() const { return slot_ != nullptr; }

 private:
  friend class FlightRecorder;
  struct Slot* slot_ = nullptr;
  uint64_t id_ = 0;
  FrGroup* group_ = nullptr;
  mutable uint64_t seq_ = 0;  // set by started()
  bool p2p_ = false;
};

// The calling site of the ops queued on this thread while the scope lives
// ("ddp bucket", index 3 → "ddp bucket 3"). `what` must outlive the scope;
// it is copied (at most 47 bytes) into each record.
class FrSiteScope {
 public:
  explicit FrSiteScope(const char* what, int index = -1);
  FrSiteScope(const std::string& what, int index = -1) : FrSiteScope(what.c_str(), index) {}
  ~FrSiteScope();
  FrSiteScope(const FrSiteScope&) = delete;
  FrSiteScope& operator=(const FrSiteScope&) = delete;

 private:
  const char* prev_what_;
  int prev_index_;
};

class FlightRecorder {
 public:
  static FlightRecorder& get();

  bool enabled() const { return capacity_ > 0; }
  size_t capacity() const { return capacity_; }

  // Registers a group (made by init_process_group or new_group); nullptr
  // when the recorder is off. The first group also starts the dumper
  // (dumper.cpp: SIGUSR1, tdist-run's heartbeat). The FrGroup lives as
  // long as the process.
  FrGroup* add_group(const std::string& name, const std::string& desc, const std::string& backend,
                     const std::vector<int>& global_ranks);
  // This process's global rank and world size, for the dump's name.
  void set_identity(int rank, int world_size);

  // Pauses or resumes recording (tdist::trace::set_flight_recorder_enabled).
  // Paused, ops are not numbered either: pause every rank alike.
  void set_recording(bool on) { recording_.store(on, std::memory_order_relaxed); }

  // Records an op queued on `group` (not null) and numbers it; an empty
  // handle while recording is paused.
  // `started`: nonzero for an op that starts as it is recorded (a
  // synchronous op on the caller's thread, numbered already): the record
  // is born started with that number, and FrHandle::started is not called.
  FrHandle record(FrGroup* group, const FrOp& op, uint64_t started = 0);

  // A training step began (DDP's and FSDP's forwards; tdist-run's status).
  void note_step();
  int64_t steps() const { return steps_.load(std::memory_order_relaxed); }

  // The records in the ring, oldest first.
  std::vector<FrRecord> snapshot() const;
  std::vector<const FrGroup*> groups() const;

  // Writes the dump (dump_json.cpp) to dump_dir()/rank-<R>.json, aside
  // and renamed into place; returns its path, or "" with a line on stderr
  // when it could not be written. Thread-safe; dumps are serialised.
  std::string dump(DumpReason why);
  // $TDIST_DUMP_DIR, else ./tdist-dumps/<job>/ (job: $TORCHELASTIC_RUN_ID,
  // else MASTER_ADDR-MASTER_PORT, else "local").
  static std::string dump_dir();

  int rank() const { return rank_.load(std::memory_order_relaxed); }
  int world_size() const { return world_size_.load(std::memory_order_relaxed); }
  // Ops completed while recording, over all groups.
  int64_t completed_ops() const;
  int64_t last_completed_ns() const { return last_completed_ns_.load(std::memory_order_relaxed); }
  int64_t dumps() const { return dumps_.load(std::memory_order_relaxed); }  // written so far

 private:
  friend class FrHandle;
  FlightRecorder();
  void completed_one(int64_t now_ns) { last_completed_ns_.store(now_ns, std::memory_order_relaxed); }

  size_t capacity_ = 0;
  std::unique_ptr<struct Slot[]> slots_;
  std::atomic<uint64_t> next_id_{0};
  std::atomic<bool> recording_{true};
  mutable std::mutex groups_mu_;
  std::vector<std::unique_ptr<FrGroup>> groups_;  // under groups_mu_
  std::map<std::string, int> names_;              // groups made under each name; under groups_mu_
  std::atomic<int> rank_{-1};
  std::atomic<int> world_size_{0};
  std::atomic<int64_t> steps_{0};
  std::atomic<int64_t> last_completed_ns_{0};
  std::atomic<int64_t> dumps_{0};
  std::mutex dump_mu_;
};

// The wall clock in ns (CLOCK_REALTIME, so that ranks on several hosts
// line up as well as their clocks do).
int64_t fr_now_ns();
// The clock of the ops' records: CLOCK_REALTIME_COARSE (a few ms of
// resolution, a third of the cost) unless the timeline is active, whose
// spans need fr_now_ns's precision. A record's times never go backwards.
int64_t fr_op_now_ns();

// dumper.cpp: starts, once, the thread that writes a dump on SIGUSR1 (the
// handler only writes a byte to a pipe; installed only where SIGUSR1 has
// its default action) and, under tdist-run ($TDIST_HEARTBEAT_DIR), this
// rank's heartbeat file every second.
void start_dumper(FlightRecorder& fr);

// dump_json.cpp: the dump's JSON text.
std::string dump_json(const FlightRecorder& fr, DumpReason why);

}  // namespace tdist::detail
