// tdist-trace merge and summary: the timelines ranks write with
// TDIST_TRACE (src/trace/timeline.h; Chrome trace event JSON,
// docs/observability.md has the event names). No LibTorch.
//
// Reading is streamed and bounded: a file is opened without following a
// link, must be a regular file of at most kMaxTraceBytes, and is parsed
// by the one bounded JSON reader (util/json_reader.h), one element of
// "traceEvents" at a time (nesting deeper than kMaxTraceDepth, a string longer than
// kMaxTraceString or an event larger than kMaxEventBytes stops it), so
// memory is one event plus what the caller keeps of it (summary keeps a
// few numbers per event, at most kMaxSummaryEvents).
//
// Errors: TraceError, the file's path first.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tdist::trace {

class TraceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr uint64_t kMaxTraceBytes = uint64_t{4} << 30;
inline constexpr int kMaxTraceDepth = 16;
inline constexpr size_t kMaxTraceString = 1 << 16;
inline constexpr size_t kMaxEventBytes = 1 << 20;
inline constexpr size_t kMaxSummaryEvents = 50'000'000;
inline constexpr size_t kMaxTraceFiles = 65536;

// Calls fn on each element of the file's "traceEvents" (an object; other
// elements are an error), in order.
void for_each_trace_event(const std::string& path, const std::function<void(nlohmann::json&)>& fn);

// The trace files named by `inputs`: a file is itself; a directory gives
// its "*.json" files whose name has ".rank-" in it (sorted). TraceError
// when none is found.
std::vector<std::string> trace_files(const std::vector<std::string>& inputs);

// Writes every event of `files` into one trace at `out` (written aside,
// then renamed); returns how many events.
size_t merge_traces(const std::vector<std::string>& files, const std::string& out);

// One step of one rank, in ms.
struct StepSummary {
  int rank = 0;
  int64_t step = 0;        // the "step N" instant's N
  double step_ms = 0;      // to the next step's start (the last: to the rank's last event)
  bool last = false;       // the rank's last step: nothing marks its end (left out of the report's table)
  double exposed_ms = 0;   // the training thread's waits and inline ops (their union)
  double comm_ms = 0;      // every comm/p2p span of the rank (their union)
  double compute_ms = 0;   // step - exposed
  double overlap = -1;     // 1 - exposed / comm, in [0, 1]; -1: no communication
};

struct Summary {
  std::vector<StepSummary> steps;  // by step, then rank
  std::string report;              // a table
};

Summary summarize(const std::vector<std::string>& files);
std::string summary_json(const Summary& s);

}  // namespace tdist::trace
