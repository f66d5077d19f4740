#include "trace/flight_recorder.h"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include "comm/op_label.h"
#include "tdist/errors.h"
#include "trace/timeline.h"
#include "util/spin_lock.h"
#include "util/write_aside.h"

namespace tdist::detail {

namespace {

constexpr size_t kDefaultCapacity = 2000;
constexpr size_t kMaxCapacity = 100000;
constexpr size_t kSiteBytes = 48;
constexpr size_t kErrorBytes = 240;

thread_local const char* t_site = nullptr;
thread_local int t_site_index = -1;

size_t capacity_from_env() {
  const char* v = std::getenv("TDIST_FR_BUFFER_SIZE");
  if (!v || !*v) return kDefaultCapacity;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v, &end, 10);
  if (errno != 0 || *end != '\0' || n < 0) {
    std::fprintf(stderr, "tdist: TDIST_FR_BUFFER_SIZE=%s is not a count; the flight recorder keeps %zu ops\n", v,
                 kDefaultCapacity);
    return kDefaultCapacity;
  }
  return std::min(static_cast<size_t>(n), kMaxCapacity);
}

// counter = max(counter, seq), written by one thread at a time (the op
// that runs: FrProgress): no locked instruction.
void advance(std::atomic<uint64_t>& counter, uint64_t seq) {
  if (counter.load(std::memory_order_relaxed) < seq) counter.store(seq, std::memory_order_relaxed);
}

// ++counter, likewise by one thread at a time.
void bump(std::atomic<uint64_t>& counter) {
  counter.store(counter.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

// The first line of an error message, at most kErrorBytes.
std::string first_line(const char* what) {
  const char* nl = std::strchr(what, '\n');
  size_t n = nl ? static_cast<size_t>(nl - what) : std::strlen(what);
  return std::string(what, std::min(n, kErrorBytes));
}

}  // namespace

// A ring slot: one record, guarded by its own lock (the op's threads and a
// dump are all that ever touch it, each for a few stores or a copy).
struct Slot {
  mutable SpinLock mu;
  bool used = false;
  uint64_t id = 0;
  FrGroup* group = nullptr;
  uint64_t seq = 0;
  bool p2p = false;
  FrOp op;
  FrState state = FrState::kScheduled;
  int64_t created_ns = 0, started_ns = 0, completed_ns = 0;
  char site[kSiteBytes] = {};
  std::string error;
};

int64_t fr_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t fr_op_now_ns() {
  if (Timeline::active()) return fr_now_ns();  // the timeline's spans need the precise clock
  timespec ts{};
  clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

const char* dump_reason_name(DumpReason r) {
  switch (r) {
    case DumpReason::kTimeout: return "timeout";
    case DumpReason::kPeerFailure: return "peer failure";
    case DumpReason::kMismatch: return "mismatch";
    case DumpReason::kSignal: return "signal";
    case DumpReason::kStall: return "stall";
    case DumpReason::kRequest: return "request";
  }
  return "request";
}

FrSiteScope::FrSiteScope(const char* what, int index) : prev_what_(t_site), prev_index_(t_site_index) {
  t_site = what;
  t_site_index = index;
}

FrSiteScope::~FrSiteScope() {
  t_site = prev_what_;
  t_site_index = prev_index_;
}

FlightRecorder::FlightRecorder() : capacity_(capacity_from_env()) {
  if (capacity_ > 0) slots_.reset(new Slot[capacity_]);
}

FlightRecorder& FlightRecorder::get() {
  static FlightRecorder* fr = new FlightRecorder();  // never destroyed: see the header
  return *fr;
}

FrGroup* FlightRecorder::add_group(const std::string& name, const std::string& desc, const std::string& backend,
                                   const std::vector<int>& global_ranks) {
  Timeline::start_from_env();
  if (!enabled()) return nullptr;
  FrGroup* g = nullptr;
  {
    std::lock_guard<std::mutex> lock(groups_mu_);
    auto owned = std::make_unique<FrGroup>();
    owned->id = static_cast<int>(groups_.size());
    // A name made again (init_process_group after destroy_process_group,
    // new_group's names after that) is a new group: "world~1".
    const int made = names_[name]++;
    owned->name = made == 0 ? name : name + "~" + std::to_string(made);
    owned->desc = desc;
    owned->backend = backend;
    owned->ranks = global_ranks;
    g = owned.get();
    groups_.push_back(std::move(owned));
  }
  start_dumper(*this);
  return g;
}

void FlightRecorder::note_step() {
  const int64_t n = steps_.fetch_add(1, std::memory_order_relaxed) + 1;
  if (Timeline* tl = Timeline::active()) tl->instant("step", "step " + std::to_string(n), fr_now_ns());
}

void FlightRecorder::set_identity(int rank, int world_size) {
  rank_.store(rank, std::memory_order_relaxed);
  world_size_.store(world_size, std::memory_order_relaxed);
}

FrHandle FlightRecorder::record(FrGroup* group, const FrOp& op, uint64_t started) {
  FrHandle h;
  if (!enabled() || !recording_.load(std::memory_order_relaxed)) return h;
  const bool p2p = op.p2p;
  FrProgress& progress = group->progress(p2p);
  // Numbered when it starts (FrHandle::started); until then the count of
  // ops recorded is the highest number they will have. An op started
  // already runs under the group's run token; a queued one may be queued
  // by any thread.
  if (started != 0) {
    bump(progress.ran_at_once);
  } else {
    progress.queued.fetch_add(1, std::memory_order_relaxed);
  }
  const uint64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);
  Slot& s = slots_[id % capacity_];
  const int64_t now = fr_op_now_ns();
  {
    std::lock_guard<SpinLock> lock(s.mu);
    s.used = true;
    s.id = id;
    s.group = group;
    s.seq = started;
    s.p2p = p2p;
    s.op = op;
    s.state = started != 0 ? FrState::kStarted : FrState::kScheduled;
    s.created_ns = now;
    s.started_ns = started != 0 ? now : 0;
    s.completed_ns = 0;
    if (t_site) {
      if (t_site_index >= 0) {
        std::snprintf(s.site, kSiteBytes, "%s %d", t_site, t_site_index);
      } else {
        std::snprintf(s.site, kSiteBytes, "%s", t_site);
      }
    } else {
      s.site[0] = '\0';
    }
    s.error.clear();
  }
  if (Timeline* tl = Timeline::active(); tl && t_site) {
    // A bucket or unit handed its op over: when it was ready. (The site
    // again from the thread's scope: the slot may be reused already.)
    char site[kSiteBytes];
    if (t_site_index >= 0) {
      std::snprintf(site, kSiteBytes, "%s %d", t_site, t_site_index);
    } else {
      std::snprintf(site, kSiteBytes, "%s", t_site);
    }
    tl->instant("ready", std::string(site) + " ready", now, "\"op\":\"" + std::string(op.name) + "\"");
  }
  h.slot_ = &s;
  h.id_ = id;
  if (started != 0) {
    h.seq_ = started;
    advance(progress.started, started);
  }
  h.group_ = group;
  h.p2p_ = p2p;
  return h;
}

void FrHandle::started() const {
  if (!slot_) return;
  const int64_t now = fr_op_now_ns();
  seq_ = comm::current_op_label();  // the number the queue gave the op as it started it
  {
    std::lock_guard<SpinLock> lock(slot_->mu);
    if (slot_->id == id_ && slot_->state == FrState::kScheduled) {
      slot_->state = FrState::kStarted;
      slot_->started_ns = now;
      slot_->seq = seq_;
    }
  }
  advance(group_->progress(p2p_).started, seq_);
}

namespace {

// The op's span on the thread that ran it, made under the slot's lock and
// added to the timeline after it (Timeline takes a mutex of its own, held
// through a flush: never under a slot's spin lock).
struct Span {
  bool p2p = false;
  std::string name, args;
  int64_t start_ns = 0, end_ns = 0;
  void add_to(Timeline& tl) { tl.complete(p2p ? "p2p" : "comm", std::move(name), start_ns, end_ns, std::move(args)); }
};

// REQUIRES the slot's lock.
Span timeline_span(const Slot& s, int64_t end_ns) {
  Span span;
  span.args = "\"group\":" + json_quote(s.group->name) + ",\"seq\":" + std::to_string(s.seq) +
              ",\"numel\":" + std::to_string(s.op.input_numel) +
              ",\"queued_us\":" + std::to_string((s.started_ns - s.created_ns) / 1000) +
              ",\"inline\":" + (on_worker_thread() ? "false" : "true");
  if (s.site[0]) span.args += ",\"site\":" + json_quote(s.site);
  if (s.state == FrState::kFailed) span.args += ",\"failed\":true";
  span.p2p = s.p2p;
  span.name = std::string(s.op.name) + " #" + std::to_string(s.seq);
  span.start_ns = s.started_ns;
  span.end_ns = end_ns;
  return span;
}

}  // namespace

void FrHandle::completed() const {
  if (!slot_) return;
  int64_t now = fr_op_now_ns();
  Timeline* tl = Timeline::active();
  std::optional<Span> span;
  {
    std::lock_guard<SpinLock> lock(slot_->mu);
    if (slot_->id == id_) {
      if (slot_->started_ns == 0) slot_->started_ns = now;
      now = std::max(now, slot_->started_ns);  // the timeline began meanwhile: its clock is ahead of the coarse one
      slot_->state = FrState::kCompleted;
      slot_->completed_ns = now;
      if (tl) span = timeline_span(*slot_, now);
    }
  }
  if (span) span->add_to(*tl);
  FrProgress& progress = group_->progress(p2p_);
  advance(progress.completed, seq_);
  bump(progress.completed_ops);
  FlightRecorder::get().completed_one(now);
}

void FrHandle::failed(const std::exception& e) const {
  if (!slot_) return;
  const int64_t now = fr_op_now_ns();
  Timeline* tl = Timeline::active();
  std::optional<Span> span;
  {
    std::lock_guard<SpinLock> lock(slot_->mu);
    // Once only: a synchronous op's error passes here from its task and
    // again from the wait that rethrows it.
    if (slot_->id != id_ || slot_->state == FrState::kFailed || slot_->state == FrState::kCompleted) return;
    if (slot_->started_ns == 0) slot_->started_ns = now;
    slot_->state = FrState::kFailed;
    slot_->completed_ns = now;
    slot_->error = first_line(e.what());
    if (tl) span = timeline_span(*slot_, now);
  }
  if (span) span->add_to(*tl);
  DumpReason why;
  if (dynamic_cast<const TimeoutError*>(&e)) {
    why = DumpReason::kTimeout;
  } else if (dynamic_cast<const PeerFailureError*>(&e)) {
    why = DumpReason::kPeerFailure;
  } else if (dynamic_cast<const CollectiveMismatchError*>(&e)) {
    why = DumpReason::kMismatch;
  } else {
    return;
  }
  FlightRecorder::get().dump(why);
}

std::vector<FrRecord> FlightRecorder::snapshot() const {
  std::vector<FrRecord> out;
  if (!enabled()) return out;
  const uint64_t end = next_id_.load(std::memory_order_relaxed);
  const uint64_t begin = end > capacity_ ? end - capacity_ : 0;
  out.reserve(static_cast<size_t>(end - begin));
  for (uint64_t id = begin; id < end; ++id) {
    const Slot& s = slots_[id % capacity_];
    std::lock_guard<SpinLock> lock(s.mu);
    if (!s.used || s.id != id) continue;  // not written yet, or already reused by a newer op
    FrRecord r;
    r.id = s.id;
    r.group = s.group;
    r.seq = s.seq;
    r.p2p = s.p2p;
    r.op = s.op;
    r.state = s.state;
    r.created_ns = s.created_ns;
    r.started_ns = s.started_ns;
    r.completed_ns = s.completed_ns;
    r.site = s.site;
    r.error = s.error;
    out.push_back(std::move(r));
  }
  return out;
}

int64_t FlightRecorder::completed_ops() const {
  std::lock_guard<std::mutex> lock(groups_mu_);
  uint64_t n = 0;
  for (const auto& g : groups_) {
    n += g->collective.completed_ops.load(std::memory_order_relaxed) + g->p2p.completed_ops.load(std::memory_order_relaxed);
  }
  return static_cast<int64_t>(n);
}

std::vector<const FrGroup*> FlightRecorder::groups() const {
  std::lock_guard<std::mutex> lock(groups_mu_);
  std::vector<const FrGroup*> out;
  for (const auto& g : groups_) out.push_back(g.get());
  return out;
}

std::string FlightRecorder::dump_dir() {
  if (const char* d = std::getenv("TDIST_DUMP_DIR"); d && *d) return d;
  std::string job = "local";
  if (const char* id = std::getenv("TORCHELASTIC_RUN_ID"); id && *id) {
    job = id;
  } else if (const char* port = std::getenv("MASTER_PORT"); port && *port) {
    const char* addr = std::getenv("MASTER_ADDR");
    job = std::string(addr && *addr ? addr : "localhost") + "-" + port;
  }
  for (auto& c : job) {
    if (c == '/' || c == '\0') c = '_';
  }
  if (job == "." || job == "..") job = "_";
  return "tdist-dumps/" + job;
}

std::string FlightRecorder::dump(DumpReason why) {
  std::lock_guard<std::mutex> lock(dump_mu_);
  int r = rank();
  if (r < 0) {
    const char* env = std::getenv("RANK");
    r = env && *env ? std::atoi(env) : static_cast<int>(getpid());
  }
  const std::string dir = dump_dir();
  const std::string path = dir + "/rank-" + std::to_string(r) + ".json";
  auto fail = [&](const std::string& why_not) {
    std::fprintf(stderr, "tdist: rank %d: could not write the flight recorder's dump to %s: %s\n", r, path.c_str(),
                 why_not.c_str());
    return std::string();
  };
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return fail(ec.message());
  std::string error;
  if (!write_aside(path, dump_json(*this, why), error)) return fail(error);
  if (why != DumpReason::kRequest) {  // the caller of dump_flight_recorder has the path
    std::fprintf(stderr, "tdist: rank %d: flight recorder dump (%s) in %s\n", r, dump_reason_name(why), path.c_str());
  }
  dumps_.fetch_add(1, std::memory_order_relaxed);
  return path;
}

}  // namespace tdist::detail
