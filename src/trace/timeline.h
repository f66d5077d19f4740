// The timeline: Chrome trace events (the JSON Perfetto and
// chrome://tracing load) of what each rank did when: every collective's
// run on the thread that ran it (its queue time and calling site in its
// args), waits for ops on the caller's thread, FSDP units' forward and
// backward, checkpoint snapshots and writes, and one instant per training
// step (docs/observability.md has the event names tdist-trace summary
// reads).
//
// On when TDIST_TRACE is set when the process makes its first group (or
// after tdist::trace::start_timeline): PATH.json becomes PATH.rank-<R>.json
// ("{rank}" in PATH is replaced instead, when there). Written at exit and
// by tdist::trace::flush_timeline (each write holds everything so far).
// At most kMaxEvents events are kept; the rest are counted as dropped.
//
// Cost: off, every hook is one relaxed atomic load (active() is null). On,
// an event is a clock read and an append under a mutex.
// Threading: any thread. Lifetime: never destroyed (atexit writes it).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tdist::detail {

class Timeline {
 public:
  static constexpr size_t kMaxEvents = 1'000'000;

  // The timeline, or nullptr when it is off or paused.
  static Timeline* active();
  // The timeline once started, paused or not.
  static Timeline* started();
  // Turns it on (once; later calls keep the first path); see above.
  static Timeline* start(const std::string& path);
  // Turns it on if TDIST_TRACE is set (the first group's creation calls it).
  static void start_from_env();
  // Pauses (nothing is recorded: active() is null, as when off) or resumes
  // a started timeline; what it holds stays.
  static void set_paused(bool paused);

  // A span [begin_ns, end_ns] (CLOCK_REALTIME ns, fr_now_ns) on the
  // current thread's track. `args`: a JSON object's members ("\"k\":1"),
  // or empty.
  void complete(const char* cat, std::string name, int64_t begin_ns, int64_t end_ns, std::string args = {});
  // An instant on the current thread's track.
  void instant(const char* cat, std::string name, int64_t at_ns, std::string args = {});

  // Writes the file (aside, then renamed); its path, or "" with a line on
  // stderr.
  std::string flush();

 private:
  // An event; its strings in text_blocks_ (args: JSON members, or null).
  struct Event {
    char ph;
    const char* cat;
    const char* name;
    const char* args;
    int64_t ts_ns;
    int64_t dur_ns;
    int tid;
  };
  static constexpr size_t kEventsPerBlock = 16384;
  static constexpr size_t kTextBlock = size_t{1} << 20;
  static constexpr size_t kMaxText = 16384;  // longer names are cut, longer args dropped
  explicit Timeline(std::string path) : path_(std::move(path)) {}
  int track_of_this_thread();  // REQUIRES mu_
  void add(char ph, const char* cat, const std::string& name, int64_t ts_ns, int64_t dur_ns, const std::string& args);
  // Storage off the malloc heap (blocks from mmap, kept for the process's
  // life): a timeline's many small long-lived strings among training's large
  // transient buffers kept glibc's heap from shrinking (tdist-bench fsdp's
  // peak RSS was 125-310 MiB higher with the timeline on). REQUIRE mu_;
  // nullptr when mmap fails.
  const char* keep(const std::string& s);
  Event* next_event();

  const std::string path_;
  std::mutex mu_;
  std::vector<Event*> event_blocks_;
  size_t events_ = 0;
  std::vector<char*> text_blocks_;
  size_t text_used_ = kTextBlock;  // in the last text block
  std::vector<std::string> tracks_;  // by tid
  bool main_named_ = false;          // a track is "main" already
  uint64_t dropped_ = 0;
};

// The name of the current thread's track ("tdist-worker world", "checkpoint
// writer"); of the threads that name none, the first to emit is "main",
// the others are named by their pthread names. `worker`: a group's worker thread (an op it
// runs is not waited for by the training thread).
void set_timeline_track(std::string name, bool worker = false);
bool on_worker_thread();

// A span named "<what> <detail>" (or "<what>") from construction to
// destruction on the current thread, when the timeline is on; nothing is
// built or copied when it is off.
class TimelineSpan {
 public:
  TimelineSpan(const char* cat, const char* what, const std::string& detail = {});
  ~TimelineSpan();
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  Timeline* tl_;
  const char* cat_;
  std::string name_;
  int64_t begin_ns_ = 0;
};

// A JSON string literal of s (escaped; bad UTF-8 bytes as U+FFFD): for
// event names and args. dump_json.cpp has the one implementation.
std::string json_quote(const std::string& s);

}  // namespace tdist::detail
