#include "trace/timeline_tools.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "util/json_reader.h"
#include "util/open_file.h"
#include "util/write_aside.h"

namespace tdist::trace {

namespace {

using nlohmann::json;

// Builds each element of the top level's "traceEvents" array and hands it
// over; skips every other key's value. Bounded as the header says, through
// the one JSON reader (util/json_reader.h).
class EventReader : public tdist::json::JsonReader {
 public:
  explicit EventReader(const std::function<void(json&)>& fn) : JsonReader(limits()), fn_(fn) {}
  bool saw_events() const { return saw_events_; }

 private:
  enum Tag { kTop, kEvents, kEvent };
  static tdist::json::Limits limits() {
    tdist::json::Limits l;
    l.max_depth = kMaxTraceDepth;
    l.max_string = kMaxTraceString;
    l.max_key = kMaxTraceString;
    return l;
  }
  int on_open(bool object) override {
    if (at_root()) return kTop;
    if (top().tag == kTop) {
      if (object || key() != "traceEvents") return kSkip;
      saw_events_ = true;
      return kEvents;
    }
    if (top().tag == kEvents) {
      if (!object) fail("an element of traceEvents is not an object");
      builder_.reset_bytes();
    }
    builder_.open(object, key());
    count();
    return kEvent;
  }
  void on_scalar(const tdist::json::Scalar& v) override {
    if (top().tag == kTop) return;  // a top-level key's plain value
    if (top().tag == kEvents) fail("an element of traceEvents is not an object");
    builder_.scalar(v, key());
    count();
  }
  void on_close(const tdist::json::Frame& f) override {
    if (f.tag != kEvent) return;
    json done;
    if (builder_.close(done)) fn_(done);  // an event
  }
  void count() {
    if (builder_.bytes() > kMaxEventBytes) fail("an event larger than " + std::to_string(kMaxEventBytes) + " bytes");
  }

  const std::function<void(json&)>& fn_;
  bool saw_events_ = false;
  tdist::json::JsonBuilder builder_;
};

// A sorted list of [begin, end) intervals' union length within [lo, hi).
double union_within(std::vector<std::pair<double, double>> spans, double lo, double hi) {
  std::sort(spans.begin(), spans.end());
  double total = 0, cur_b = 0, cur_e = -1;
  bool open = false;
  for (auto [b, e] : spans) {
    b = std::max(b, lo);
    e = std::min(e, hi);
    if (e <= b) continue;
    if (open && b <= cur_e) {
      cur_e = std::max(cur_e, e);
    } else {
      if (open) total += cur_e - cur_b;
      cur_b = b;
      cur_e = e;
      open = true;
    }
  }
  if (open) total += cur_e - cur_b;
  return total;
}

struct Ev {
  double ts = 0, end = 0;  // us
  int tid = 0;
  enum Kind : uint8_t { kStep, kComm, kWait, kInlineComm, kOther } kind = kOther;
  int64_t step = 0;
};

}  // namespace

void for_each_trace_event(const std::string& path, const std::function<void(json&)>& fn) {
  std::string error;
  struct stat st {};
  const int fd = tdist::detail::open_regular(path, O_RDONLY | O_NOFOLLOW, error, 0, &st);
  if (fd < 0) throw TraceError(error);
  if (static_cast<uint64_t>(st.st_size) > kMaxTraceBytes) {
    ::close(fd);
    throw TraceError(path + ": " + std::to_string(st.st_size) + " bytes, more than a trace may have (" +
                     std::to_string(kMaxTraceBytes) + ")");
  }
  std::FILE* f = ::fdopen(fd, "rb");
  if (!f) {
    ::close(fd);
    throw TraceError(path + ": cannot read (" + std::strerror(errno) + ")");
  }
  EventReader reader(fn);
  std::string problem;
  try {
    problem = reader.parse(f);
  } catch (const std::exception& e) {
    std::fclose(f);
    throw TraceError(path + ": " + e.what());
  }
  std::fclose(f);
  if (!problem.empty()) throw TraceError(path + ": " + problem);
  if (!reader.saw_events()) throw TraceError(path + ": no \"traceEvents\" array (not a Chrome trace)");
}

std::vector<std::string> trace_files(const std::vector<std::string>& inputs) {
  std::vector<std::string> out;
  for (const auto& in : inputs) {
    std::error_code ec;
    if (std::filesystem::is_directory(in, ec)) {
      std::vector<std::string> found;
      for (const auto& entry : std::filesystem::directory_iterator(in, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0 &&
            name.find(".rank-") != std::string::npos) {
          found.push_back(entry.path().string());
          if (found.size() > kMaxTraceFiles) throw TraceError(in + ": more than " + std::to_string(kMaxTraceFiles) + " traces");
        }
      }
      if (ec) throw TraceError(in + ": cannot list (" + ec.message() + ")");
      std::sort(found.begin(), found.end());
      out.insert(out.end(), found.begin(), found.end());
    } else {
      out.push_back(in);
    }
  }
  if (out.empty()) throw TraceError("no trace files (*.rank-<R>.json) in what was given");
  return out;
}

size_t merge_traces(const std::vector<std::string>& files, const std::string& out) {
  // Written aside and renamed (util/write_aside.h): a reader never sees half.
  tdist::detail::AsideFile f(out);
  std::string buf;
  const auto flush = [&](bool all) {
    if (buf.size() < (size_t{1} << 20) && !all) return;
    if (!f.write(buf.data(), buf.size())) throw TraceError(f.error());
    buf.clear();
  };
  size_t n = 0;
  buf += "{\"traceEvents\":[";
  for (const auto& path : files) {
    for_each_trace_event(path, [&](json& e) {
      buf += n++ ? ",\n" : "\n";
      buf += e.dump(-1, ' ', false, json::error_handler_t::replace);
      flush(false);
    });
  }
  buf += "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"tdist-trace merge\"}}\n";
  flush(true);
  if (!f.commit(/*durable=*/false)) throw TraceError(f.error());
  return n;
}

Summary summarize(const std::vector<std::string>& files) {
  std::map<int, std::vector<Ev>> by_rank;
  size_t kept = 0;
  for (const auto& path : files) {
    for_each_trace_event(path, [&](json& e) {
      const auto ph = e.find("ph");
      if (ph == e.end() || !ph->is_string()) return;
      const std::string p = *ph;
      if (p != "X" && p != "i") return;
      const auto cat = e.find("cat"), ts = e.find("ts"), pid = e.find("pid"), tid = e.find("tid");
      if (cat == e.end() || !cat->is_string() || ts == e.end() || !ts->is_number() || pid == e.end() ||
          !pid->is_number_integer() || tid == e.end() || !tid->is_number_integer()) {
        return;  // not one of tdist's events
      }
      Ev ev;
      ev.ts = ts->get<double>();
      const auto dur = e.find("dur");
      ev.end = ev.ts + (dur != e.end() && dur->is_number() ? std::max(0.0, dur->get<double>()) : 0.0);
      ev.tid = tid->get<int>();
      const std::string c = *cat;
      if (c == "step" && p == "i") {
        ev.kind = Ev::kStep;
        const auto name = e.find("name");
        if (name != e.end() && name->is_string()) {
          const std::string& s = name->get_ref<const std::string&>();
          if (s.rfind("step ", 0) == 0) ev.step = std::strtoll(s.c_str() + 5, nullptr, 10);
        }
      } else if ((c == "comm" || c == "p2p") && p == "X") {
        const auto args = e.find("args");
        const bool in = args != e.end() && args->is_object() && args->value("inline", false);
        ev.kind = in ? Ev::kInlineComm : Ev::kComm;
      } else if (c == "wait" && p == "X") {
        ev.kind = Ev::kWait;
      } else {
        return;
      }
      if (!std::isfinite(ev.ts) || !std::isfinite(ev.end)) return;
      if (++kept > kMaxSummaryEvents) throw TraceError(path + ": more events than summary holds");
      by_rank[pid->get<int>()].push_back(ev);
    });
  }
  Summary s;
  for (auto& [rank, evs] : by_rank) {
    std::vector<const Ev*> steps;
    std::map<int, int> step_tids;
    double last = 0;
    for (const auto& ev : evs) {
      last = std::max(last, ev.end);
      if (ev.kind == Ev::kStep) {
        steps.push_back(&ev);
        ++step_tids[ev.tid];
      }
    }
    if (steps.empty()) continue;
    // The training thread: the one that marks the steps.
    int train = steps.front()->tid;
    for (const auto& [tid, count] : step_tids) {
      if (count > step_tids[train]) train = tid;
    }
    std::sort(steps.begin(), steps.end(), [](const Ev* a, const Ev* b) { return a->ts < b->ts; });
    std::vector<std::pair<double, double>> exposed, comm;
    for (const auto& ev : evs) {
      if (ev.kind == Ev::kComm || ev.kind == Ev::kInlineComm) comm.emplace_back(ev.ts, ev.end);
      if (ev.tid == train && (ev.kind == Ev::kWait || ev.kind == Ev::kInlineComm)) exposed.emplace_back(ev.ts, ev.end);
    }
    for (size_t i = 0; i < steps.size(); ++i) {
      const double lo = steps[i]->ts, hi = i + 1 < steps.size() ? steps[i + 1]->ts : last;
      if (hi <= lo) continue;
      StepSummary st;
      st.rank = rank;
      st.step = steps[i]->step;
      st.step_ms = (hi - lo) / 1000;
      st.last = i + 1 == steps.size();
      st.exposed_ms = union_within(exposed, lo, hi) / 1000;
      st.comm_ms = union_within(comm, lo, hi) / 1000;
      st.compute_ms = st.step_ms - st.exposed_ms;
      if (st.comm_ms > 0) st.overlap = std::clamp(1 - st.exposed_ms / st.comm_ms, 0.0, 1.0);
      s.steps.push_back(st);
    }
  }
  std::stable_sort(s.steps.begin(), s.steps.end(),
                   [](const StepSummary& a, const StepSummary& b) { return a.step < b.step; });
  // The report: per step, the mean over ranks (and the slowest rank).
  char line[256];
  std::snprintf(line, sizeof line, "%6s %6s %10s %11s %11s %9s %8s  %s\n", "step", "ranks", "step ms", "compute ms",
                "exposed ms", "comm ms", "overlap", "slowest");
  s.report = line;
  double total_step = 0, total_exposed = 0, total_comm = 0, total_compute = 0;
  size_t counted = 0, left_out = 0;
  for (size_t i = 0; i < s.steps.size();) {
    size_t j = i, in_row = 0;
    double st = 0, ex = 0, co = 0, cp = 0, slowest_ms = -1;
    int slowest = -1;
    for (; j < s.steps.size() && s.steps[j].step == s.steps[i].step; ++j) {
      const auto& x = s.steps[j];
      if (x.last) {
        ++left_out;
        continue;
      }
      ++in_row;
      st += x.step_ms;
      ex += x.exposed_ms;
      co += x.comm_ms;
      cp += x.compute_ms;
      if (x.step_ms > slowest_ms) {
        slowest_ms = x.step_ms;
        slowest = x.rank;
      }
    }
    if (in_row == 0) {
      i = j;
      continue;
    }
    const double n = static_cast<double>(in_row);
    char overlap[16] = "-";
    if (co > 0) std::snprintf(overlap, sizeof overlap, "%.0f%%", 100 * std::clamp(1 - ex / co, 0.0, 1.0));
    std::snprintf(line, sizeof line, "%6lld %6zu %10.2f %11.2f %11.2f %9.2f %8s  rank %d\n",
                  static_cast<long long>(s.steps[i].step), in_row, st / n, cp / n, ex / n, co / n, overlap, slowest);
    s.report += line;
    total_step += st;
    total_exposed += ex;
    total_comm += co;
    total_compute += cp;
    counted += in_row;
    i = j;
  }
  if (counted == 0 && left_out > 0) {
    s.report = "one step per rank: no step after it marks where it ends (--json has it)\n";
  } else if (counted == 0) {
    s.report = "no steps: the traces hold no \"step N\" events (DDP's or FSDP's forwards, or tdist::trace::mark_step)\n";
  } else {
    const double n = static_cast<double>(counted);
    char overlap[16] = "-";
    if (total_comm > 0) {
      std::snprintf(overlap, sizeof overlap, "%.0f%%", 100 * std::clamp(1 - total_exposed / total_comm, 0.0, 1.0));
    }
    std::snprintf(line, sizeof line, "%6s %6s %10.2f %11.2f %11.2f %9.2f %8s\n", "mean", "", total_step / n,
                  total_compute / n, total_exposed / n, total_comm / n, overlap);
    s.report += line;
    s.report +=
        "exposed: the training thread waiting for communication (waits and ops it ran itself); comm: every op's run "
        "(union); overlap: 1 - exposed / comm\n";
    if (left_out > 0) {
      s.report += "(each rank's last step is left out: no step after it marks where it ends; --json has it)\n";
    }
  }
  return s;
}

std::string summary_json(const Summary& s) {
  json steps = json::array();
  for (const auto& x : s.steps) {
    json o = {{"rank", x.rank}, {"step", x.step}, {"step_ms", x.step_ms}, {"compute_ms", x.compute_ms},
              {"exposed_ms", x.exposed_ms}, {"comm_ms", x.comm_ms}, {"last", x.last}};
    o["overlap"] = x.overlap < 0 ? json(nullptr) : json(x.overlap);
    steps.push_back(std::move(o));
  }
  return json{{"steps", steps}}.dump(1) + "\n";
}

}  // namespace tdist::trace
