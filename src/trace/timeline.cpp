#include "trace/timeline.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tdist/config.h"
#include "trace/flight_recorder.h"
#include "util/write_aside.h"

namespace tdist::detail {

namespace {

std::atomic<Timeline*> g_timeline{nullptr};  // null while off or paused
Timeline* g_started = nullptr;                // under g_start_mu
std::mutex g_start_mu;

thread_local int t_tid = -1;  // this thread's track in the timeline
thread_local std::string t_track;
thread_local bool t_worker = false;

void flush_at_exit() {
  Timeline* tl;
  {
    std::lock_guard<std::mutex> lock(g_start_mu);
    tl = g_started;
  }
  if (tl) tl->flush();
}

// PATH.json -> PATH.rank-R.json; PATH -> PATH.rank-R.json; "{rank}" replaced.
std::string path_for_rank(const std::string& pattern, int rank) {
  const std::string r = std::to_string(rank);
  if (const size_t at = pattern.find("{rank}"); at != std::string::npos) {
    return pattern.substr(0, at) + r + pattern.substr(at + 6);
  }
  std::string base = pattern;
  if (base.size() > 5 && base.compare(base.size() - 5, 5, ".json") == 0) base.resize(base.size() - 5);
  return base + ".rank-" + r + ".json";
}

void put_us(std::string& out, int64_t ns) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%" PRId64 ".%03d", ns / 1000, static_cast<int>(ns % 1000));
  out += buf;
}

}  // namespace

Timeline* Timeline::active() { return g_timeline.load(std::memory_order_relaxed); }

Timeline* Timeline::started() {
  std::lock_guard<std::mutex> lock(g_start_mu);
  return g_started;
}

Timeline* Timeline::start(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_start_mu);
  if (!g_started) {
    g_started = new Timeline(path);  // never destroyed: the exit handler writes it
    g_timeline.store(g_started);
    std::atexit(flush_at_exit);
  }
  return g_started;
}

void Timeline::set_paused(bool paused) {
  std::lock_guard<std::mutex> lock(g_start_mu);
  g_timeline.store(paused ? nullptr : g_started);
}

void Timeline::start_from_env() {
  const char* path = std::getenv("TDIST_TRACE");
  if (path && *path) start(path);
}

void set_timeline_track(std::string name, bool worker) {
  t_track = std::move(name);
  t_worker = worker;
}

bool on_worker_thread() { return t_worker; }

int Timeline::track_of_this_thread() {
  if (t_tid >= 0) return t_tid;
  std::string name = t_track;
  if (name.empty()) {
    if (!main_named_) {
      name = "main";  // the first thread without a name of its own: the training thread, as a rule
      main_named_ = true;
    } else {
      char buf[32] = {};
      pthread_getname_np(pthread_self(), buf, sizeof buf);
      name = std::string(buf[0] ? buf : "thread") + " " + std::to_string(tracks_.size());
    }
  }
  t_tid = static_cast<int>(tracks_.size());
  tracks_.push_back(std::move(name));
  return t_tid;
}

const char* Timeline::keep(const std::string& s) {
  const size_t n = std::min(s.size(), kMaxText);
  if (text_used_ + n + 1 > kTextBlock) {
    void* block = ::mmap(nullptr, kTextBlock, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) return nullptr;
    text_blocks_.push_back(static_cast<char*>(block));
    text_used_ = 0;
  }
  char* at = text_blocks_.back() + text_used_;
  std::memcpy(at, s.data(), n);
  at[n] = '\0';
  text_used_ += n + 1;
  return at;
}

Timeline::Event* Timeline::next_event() {
  if (events_ == event_blocks_.size() * kEventsPerBlock) {
    void* block =
        ::mmap(nullptr, kEventsPerBlock * sizeof(Event), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) return nullptr;
    event_blocks_.push_back(static_cast<Event*>(block));
  }
  Event* e = event_blocks_[events_ / kEventsPerBlock] + events_ % kEventsPerBlock;
  ++events_;
  return e;
}

void Timeline::add(char ph, const char* cat, const std::string& name, int64_t ts_ns, int64_t dur_ns,
                   const std::string& args) {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_ >= kMaxEvents) {
    ++dropped_;
    return;
  }
  const char* n = keep(name);
  const char* a = args.empty() || args.size() > kMaxText ? nullptr : keep(args);
  Event* e = n ? next_event() : nullptr;
  if (!e) {
    ++dropped_;
    return;
  }
  *e = Event{ph, cat, n, a, ts_ns, dur_ns, track_of_this_thread()};
}

void Timeline::complete(const char* cat, std::string name, int64_t begin_ns, int64_t end_ns, std::string args) {
  add('X', cat, name, begin_ns, end_ns > begin_ns ? end_ns - begin_ns : 0, args);
}

void Timeline::instant(const char* cat, std::string name, int64_t at_ns, std::string args) {
  add('i', cat, name, at_ns, 0, args);
}

std::string Timeline::flush() {
  const FlightRecorder& fr = FlightRecorder::get();
  int rank = fr.rank();
  if (rank < 0) {
    const char* env = std::getenv("RANK");
    rank = env && *env ? std::atoi(env) : 0;
  }
  const std::string path = path_for_rank(path_, rank);
  std::string out = "{\"traceEvents\":[\n";
  const std::string pid = std::to_string(rank);
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.reserve(256 + events_ * 160);
    out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":0,\"args\":{\"name\":\"rank " + pid +
           "\"}},\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":0,\"args\":{\"sort_index\":" +
           pid + "}}";
    for (size_t t = 0; t < tracks_.size(); ++t) {
      out += ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + std::to_string(t) +
             ",\"args\":{\"name\":" + json_quote(tracks_[t]) + "}}";
    }
    for (size_t k = 0; k < events_; ++k) {
      const Event& e = event_blocks_[k / kEventsPerBlock][k % kEventsPerBlock];
      out += ",\n{\"name\":" + json_quote(e.name) + ",\"cat\":\"" + e.cat + "\",\"ph\":\"";
      out += e.ph;
      out += "\",\"ts\":";
      put_us(out, e.ts_ns);
      if (e.ph == 'X') {
        out += ",\"dur\":";
        put_us(out, e.dur_ns);
      } else {
        out += ",\"s\":\"t\"";
      }
      out += ",\"pid\":" + pid + ",\"tid\":" + std::to_string(e.tid);
      if (e.args) out += ",\"args\":{" + std::string(e.args) + "}";
      out += '}';
    }
    out += "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"tdist " TDIST_VERSION_STRING "\",\"rank\":" +
           pid + ",\"world_size\":" + std::to_string(fr.world_size()) + ",\"dropped_events\":" +
           std::to_string(dropped_) + "}}\n";
  }
  std::string error;
  if (!write_aside(path, out, error)) {
    std::fprintf(stderr, "tdist: rank %d: could not write the timeline to %s: %s\n", rank, path.c_str(), error.c_str());
    return "";
  }
  return path;
}

TimelineSpan::TimelineSpan(const char* cat, const char* what, const std::string& detail)
    : tl_(Timeline::active()), cat_(cat) {
  if (!tl_) return;
  name_ = detail.empty() ? std::string(what) : std::string(what) + " " + detail;
  begin_ns_ = fr_now_ns();
}

TimelineSpan::~TimelineSpan() {
  if (tl_) tl_->complete(cat_, std::move(name_), begin_ns_, fr_now_ns());
}

}  // namespace tdist::detail
