#include "run/health_watch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <cstdlib>
#include <sstream>

#include "util/open_file.h"

namespace tdist_run {

namespace {

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool to_int(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 20) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}

constexpr int64_t kNsPerS = 1'000'000'000;
constexpr double kMaxAutoStallS = 300;
constexpr double kDumpWaitS = 10;

}  // namespace

bool parse_heartbeat(const std::string& line, Heartbeat& out) {
  std::istringstream in(line);
  std::string magic, version;
  if (!(in >> magic >> version) || magic != "tdist-heartbeat" || version != "1") return false;
  Heartbeat h;
  std::string field;
  int seen = 0;
  while (in >> field) {
    const size_t eq = field.find('=');
    if (eq == std::string::npos) return false;
    const std::string key = field.substr(0, eq), value = field.substr(eq + 1);
    int64_t v = 0;
    auto num = [&](int64_t& into) {
      if (!to_int(value, v)) return false;
      into = v;
      ++seen;
      return true;
    };
    bool ok = true;
    if (key == "rank") {
      int64_t r = 0;
      ok = num(r) && r >= 0 && r < (1 << 24);
      h.rank = static_cast<int>(r);
    } else if (key == "pid") {
      int64_t p = 0;
      ok = num(p) && p > 0 && p < (int64_t{1} << 31);
      h.pid = static_cast<pid_t>(p);
    } else if (key == "now_ns") {
      ok = num(h.now_ns);
    } else if (key == "steps") {
      ok = num(h.steps);
    } else if (key == "completed") {
      ok = num(h.completed);
    } else if (key == "last_completed_ns") {
      ok = num(h.last_completed_ns);
    } else if (key == "dumps") {
      ok = num(h.dumps);
    } else if (key == "last_op") {
      h.last_op = value;
    } else if (key == "pending_op") {
      h.pending_op = value;
    } else if (key == "pending_state") {
      h.pending_state = value;
    } else if (key == "pending_since_ns") {
      ok = num(h.pending_since_ns);
    } else if (key == "pending_timeout_ms") {
      ok = num(h.pending_timeout_ms);
    }  // unknown keys: a newer rank's; ignored
    if (!ok) return false;
  }
  if (seen < 9) return false;  // a line cut short
  out = std::move(h);
  return true;
}

std::string describe_op(const std::string& tag) {
  if (tag.empty() || tag == "-") return "none";
  const size_t hash = tag.find('#'), at = tag.find('@');
  if (hash == std::string::npos || at == std::string::npos || at < hash) return tag;
  const std::string number = tag.substr(hash + 1, at - hash - 1);  // "0": queued, not numbered until it starts
  return tag.substr(0, hash) + (number == "0" ? std::string(" (queued, not started)") : " #" + number) + " of group '" +
         tag.substr(at + 1) + "'";
}

JobFiles::JobFiles(const std::string& rdzv_id) {
  if (const char* d = std::getenv("TDIST_DUMP_DIR"); d && *d) {
    dump_dir_ = d;
  } else {
    std::string job = rdzv_id;
    if (job.empty() || job == "none") {
      char stamp[32];
      const std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
      job = std::string(stamp) + "-" + std::to_string(getpid());
    }
    std::error_code ec;
    const auto cwd = std::filesystem::current_path(ec);
    dump_dir_ = (ec ? std::string(".") : cwd.string()) + "/tdist-dumps/" + job;
    setenv("TDIST_DUMP_DIR", dump_dir_.c_str(), 1);  // the ranks inherit it
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/tdist-run-health-XXXXXX";
  if (mkdtemp(pattern.data())) {
    heartbeat_dir_ = pattern;
  } else {
    std::fprintf(stderr, "tdist-run: cannot make a directory for the ranks' heartbeats (%s): no stall detection\n",
                 std::strerror(errno));
  }
}

JobFiles::~JobFiles() {
  if (heartbeat_dir_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(heartbeat_dir_, ec);  // does not follow links inside
}

std::string trace_program() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto beside = self.parent_path() / "tdist-trace";
    if (std::filesystem::exists(beside, ec)) return beside.string();
  }
  return "tdist-trace";
}

bool catches_sigusr1(pid_t pid) {
  std::string text, error;
  if (!tdist::detail::read_regular_file("/proc/" + std::to_string(pid) + "/status", 1 << 16, text, error)) return false;
  const size_t at = text.find("\nSigCgt:");
  if (at == std::string::npos) return false;
  const unsigned long long mask = std::strtoull(text.c_str() + at + 8, nullptr, 16);
  return (mask >> (SIGUSR1 - 1)) & 1;
}

HealthWatch::~HealthWatch() { poll_analysis(/*finish=*/true); }

void HealthWatch::start_analysis() {
  if (analyzer_ != 0 || o_.analyze_program.empty()) return;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    std::fprintf(stderr, "tdist-run: cannot run tdist-trace: %s\n", std::strerror(errno));
    return;
  }
  const pid_t pid = fork();
  if (pid < 0) {
    std::fprintf(stderr, "tdist-run: cannot run tdist-trace: %s\n", std::strerror(errno));
    close(fds[0]);
    close(fds[1]);
    return;
  }
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    execlp(o_.analyze_program.c_str(), o_.analyze_program.c_str(), "analyze", o_.dump_dir.c_str(),
           static_cast<char*>(nullptr));
    std::fprintf(stderr, "cannot run %s: %s\n", o_.analyze_program.c_str(), std::strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
  analyzer_ = pid;
  analyzer_fd_ = fds[0];
  analyzer_out_.clear();
  analyzer_until_ = std::chrono::steady_clock::now() + std::chrono::seconds(60);
}

// Reads what the analysis printed; once it is done (or past its time, or
// `finish`), prints it under tdist-run's name.
void HealthWatch::poll_analysis(bool finish) {
  if (analyzer_ == 0) return;
  bool done = false;
  for (;;) {
    char buf[4096];
    const ssize_t n = read(analyzer_fd_, buf, sizeof buf);
    if (n > 0) {
      if (analyzer_out_.size() < (1 << 20)) analyzer_out_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) done = true;  // EOF: it exited
    if (n < 0 && errno == EINTR) continue;
    break;  // EAGAIN: more to come
  }
  const bool late = std::chrono::steady_clock::now() > analyzer_until_;
  if (!done && !late && !finish) return;
  close(analyzer_fd_);
  analyzer_fd_ = -1;
  kill(analyzer_, SIGKILL);  // exited already, or given up on
  int status = 0;
  waitpid(analyzer_, &status, 0);
  analyzer_ = 0;
  if (late && !done) analyzer_out_ += "(tdist-trace analyze did not finish within 60 s)\n";
  std::string out;
  std::istringstream lines(analyzer_out_);
  for (std::string line; std::getline(lines, line);) out += "tdist-run: " + line + "\n";
  std::fprintf(stderr, "%s", out.c_str());
}

void HealthWatch::reset() {
  // The last start's heartbeats must not pass for this one's (a pid may be
  // reused): removed, and anything older than now ignored.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(o_.heartbeat_dir, ec)) {
    std::error_code ignored;
    std::filesystem::remove(entry.path(), ignored);  // a link itself, never what it names
  }
  started_ns_ = wall_ns();
  beats_.clear();
  stalled_ = false;
  waiting_for_dumps_ = false;
  dumps_before_.clear();
  last_status_ns_ = 0;
  steps_at_status_.clear();
  completed_at_status_.clear();
}

void HealthWatch::read_heartbeats(const std::vector<Rank>& ranks) {
  for (const Rank& r : ranks) {
    if (r.pid == 0) {
      beats_.erase(r.rank);
      continue;
    }
    std::string text, error;
    const std::string path = o_.heartbeat_dir + "/rank-" + std::to_string(r.rank);
    if (!tdist::detail::read_regular_file(path, 4096, text, error, O_NOFOLLOW)) continue;
    Heartbeat h;
    // Only this start's rank: the pid must be the one launched.
    if (parse_heartbeat(text, h) && h.rank == r.rank && h.pid == r.pid && h.now_ns >= started_ns_) {
      beats_[r.rank] = std::move(h);
    }
  }
}

void HealthWatch::tick(const std::vector<Rank>& ranks) {
  if (o_.heartbeat_dir.empty()) return;
  poll_analysis(/*finish=*/false);
  const auto now = std::chrono::steady_clock::now();
  if (now < next_read_) return;
  next_read_ = now + std::chrono::milliseconds(500);
  read_heartbeats(ranks);
  const int64_t now_ns = wall_ns();
  if (o_.stall_s != 0) check_stall(ranks, now_ns);
  if (o_.status_interval_s > 0) {
    if (last_status_ns_ == 0) {
      last_status_ns_ = now_ns;
      for (const auto& [r, h] : beats_) {
        steps_at_status_[r] = h.steps;
        completed_at_status_[r] = h.completed;
      }
    } else if (now_ns - last_status_ns_ >= static_cast<int64_t>(o_.status_interval_s * kNsPerS)) {
      print_status(now_ns);
    }
  }
}

void HealthWatch::check_stall(const std::vector<Rank>& ranks, int64_t now_ns) {
  if (beats_.empty()) return;
  int64_t last_completion = 0;
  const Heartbeat* oldest = nullptr;
  for (const auto& [r, h] : beats_) {
    last_completion = std::max(last_completion, h.last_completed_ns);
    if (h.pending_op != "-" && h.pending_since_ns > 0 && (!oldest || h.pending_since_ns < oldest->pending_since_ns)) {
      oldest = &h;
    }
  }
  if (waiting_for_dumps_) {
    bool all = true;
    for (const auto& [r, before] : dumps_before_) {
      auto it = beats_.find(r);
      if (it != beats_.end() && it->second.dumps <= before) all = false;
    }
    const bool timed_out = now_ns - signalled_ns_ > static_cast<int64_t>(kDumpWaitS * kNsPerS);
    if (all || timed_out) finish_dumps(timed_out && !all);
    return;
  }
  if (stalled_) {
    // Re-armed once an op completes after the stall was reported.
    if (last_completion > signalled_ns_) stalled_ = false;
    return;
  }
  if (!oldest) return;
  double limit = o_.stall_s;
  if (limit < 0) limit = std::min(kMaxAutoStallS, static_cast<double>(oldest->pending_timeout_ms) / 2000.0);
  if (limit <= 0) return;
  const int64_t since = std::max(last_completion, oldest->pending_since_ns);
  const double quiet = static_cast<double>(now_ns - since) / kNsPerS;
  if (quiet < limit) return;
  std::string idle;  // ranks in no op: what the others wait for, likely
  for (const auto& [r, h] : beats_) {
    if (h.pending_op == "-") idle += (idle.empty() ? "" : ", ") + std::to_string(r);
  }
  std::fprintf(stderr,
               "tdist-run: the job looks stalled: no rank completed an op for %.1f s (rank %d has waited in %s "
               "since then%s%s%s); asking every rank for its flight recorder (SIGUSR1)\n",
               quiet, oldest->rank, describe_op(oldest->pending_op).c_str(),
               idle.empty() ? "" : "; in no op: rank", idle.find(',') == std::string::npos ? " " : "s ", idle.c_str());
  stalled_ = true;
  waiting_for_dumps_ = true;
  signalled_ns_ = now_ns;
  dumps_before_.clear();
  for (const Rank& r : ranks) {
    auto it = beats_.find(r.rank);
    // No fresh heartbeat, or /proc says it does not catch SIGUSR1: the
    // signal could kill it. Not sent.
    if (r.pid == 0 || it == beats_.end() || now_ns - it->second.now_ns > 3 * kNsPerS || !catches_sigusr1(r.pid)) {
      continue;
    }
    if (kill(r.pid, SIGUSR1) == 0) dumps_before_[r.rank] = it->second.dumps;
  }
}

void HealthWatch::finish_dumps(bool timed_out) {
  waiting_for_dumps_ = false;
  if (timed_out) {
    std::string missing;
    for (const auto& [r, before] : dumps_before_) {
      auto it = beats_.find(r);
      if (it == beats_.end() || it->second.dumps <= before) missing += " " + std::to_string(r);
    }
    std::fprintf(stderr, "tdist-run: no dump within %.0f s from rank(s)%s\n", kDumpWaitS, missing.c_str());
  }
  std::fprintf(stderr, "tdist-run: flight recorder dumps in %s (tdist-trace analyze %s)%s\n", o_.dump_dir.c_str(),
               o_.dump_dir.c_str(), o_.analyze_program.empty() ? "" : ":");
  start_analysis();
}

void HealthWatch::print_status(int64_t now_ns) {
  const double dt = static_cast<double>(now_ns - last_status_ns_) / kNsPerS;
  int64_t max_steps = 0;
  for (const auto& [r, h] : beats_) max_steps = std::max(max_steps, h.steps);
  std::string rates, behind;
  int slowest = -1;
  double slowest_rate = 0;
  bool others_completed = false;
  int waiting = 0;  // ranks in an op that has lasted the whole interval
  for (const auto& [r, h] : beats_) {
    if (h.completed > completed_at_status_[r]) others_completed = true;
    if (h.pending_op != "-" && h.pending_since_ns > 0 && h.pending_since_ns <= last_status_ns_) ++waiting;
  }
  for (const auto& [r, h] : beats_) {
    const double rate = static_cast<double>(h.steps - steps_at_status_[r]) / dt;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%srank %d %.2f", rates.empty() ? "" : ", ", r, rate);
    rates += buf;
    if (slowest < 0 || rate < slowest_rate || (rate == slowest_rate && h.steps < beats_[slowest].steps)) {
      slowest = r;
      slowest_rate = rate;
    }
    const bool lagging = max_steps - h.steps >= 2;
    const bool silent = others_completed && h.completed == completed_at_status_[r];
    // The others wait in an op while this rank is in none: it holds them up.
    const bool outside = waiting > 0 && h.pending_op == "-" && h.completed == completed_at_status_[r];
    if (lagging || silent || outside) {
      if (!behind.empty()) behind += "; ";
      behind += "rank " + std::to_string(r);
      if (lagging) behind += " is " + std::to_string(max_steps - h.steps) + " steps behind";
      if (outside) {
        behind += std::string(lagging ? "," : "") + " is in no op while " + std::to_string(waiting) +
                  " rank(s) wait (stuck outside tdist: data loading, compute?)";
      } else if (silent) {
        behind += std::string(lagging ? "," : "") + " completed no op";
      }
      if (h.pending_op != "-") behind += ", waiting in " + describe_op(h.pending_op);
    }
  }
  if (beats_.empty()) {
    std::fprintf(stderr, "tdist-run: status: no rank reports yet\n");
  } else {
    const Heartbeat& s = beats_[slowest];
    const double ago = s.last_completed_ns > 0 ? static_cast<double>(now_ns - s.last_completed_ns) / kNsPerS : -1;
    char tail[96] = "";
    if (ago >= 0) std::snprintf(tail, sizeof tail, ", %.1f s ago", ago);
    std::fprintf(stderr, "tdist-run: status: steps/s %s; slowest rank %d (step %lld, last op %s%s)%s%s\n", rates.c_str(),
                 slowest, static_cast<long long>(s.steps), describe_op(s.last_op).c_str(), tail,
                 behind.empty() ? "" : "; BEHIND: ", behind.c_str());
  }
  last_status_ns_ = now_ns;
  for (const auto& [r, h] : beats_) {
    steps_at_status_[r] = h.steps;
    completed_at_status_[r] = h.completed;
  }
}

}  // namespace tdist_run
