// Reading the flight recorder's per-rank dumps (<dir>/rank-<R>.json,
// written by src/trace/dump_json.cpp; the schema is PyTorch's Flight
// Recorder JSON dump, docs/observability.md) into plain structs. No
// LibTorch: tdist-trace and its tests link this alone.
//
// The files may come from ranks killed mid-write or from anyone who could
// write the directory, so the reader is bounded while it parses
// (util/json_reader.h: nothing is built but the structs below):
//   - a file is opened without following a link and must be a regular
//     file (util/open_file.h) of at most kMaxDumpBytes, checked before it
//     is read;
//   - nesting deeper than kMaxDepth, more than kMaxEntries entries, a
//     string longer than kMaxString (an entry's "error" kMaxErrorString, a
//     group's "ranks" kMaxRanksString) or more than kMaxSizes lists and
//     numbers in an entry's sizes stop the parse at once;
//   - what is kept is charged to a budget (kMaxParsedBytes per file,
//     kMaxDirParsedBytes per directory), so memory stays bounded whatever
//     the text's shape.
// Unknown keys are skipped (forward compatible); optional keys may be
// missing or null. Required: the top level's "rank" and "world_size"; an
// entry's "process_group", "profiling_name", "state" and
// "collective_seq_id". A value of the wrong type, a negative count or
// time, a rank outside [0, world_size), world_size above kMaxWorldSize, an
// unknown state, invalid UTF-8 or a "ranks" string that is not "[r, ...]"
// of distinct ranks is an error.
//
// Errors: DumpError, its message the file's path, then what is wrong
// ("DIR/rank-1.json: entry 3: collective_seq_id is a string, not an
// integer"). Never a crash, a hang or an allocation the limits do not
// cover.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace tdist::trace {

class DumpError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr size_t kMaxDumpBytes = size_t{64} << 20;
inline constexpr int kMaxDepth = 8;  // the schema nests 5 deep
inline constexpr size_t kMaxEntries = 1'000'000;
inline constexpr size_t kMaxString = 4096;
inline constexpr size_t kMaxErrorString = 65536;
inline constexpr size_t kMaxRanksString = size_t{1} << 20;
inline constexpr int kMaxWorldSize = 65536;
inline constexpr size_t kMaxSizes = 4096;  // lists and numbers in one entry's input and output sizes
inline constexpr size_t kMaxParsedBytes = size_t{512} << 20;
inline constexpr size_t kMaxDirParsedBytes = size_t{4} << 30;
inline constexpr size_t kMaxDumpFiles = 65536;

enum class FrState { scheduled, started, completed, failed };
const char* state_name(FrState s);

// One op (an element of "entries"). Times: CLOCK_REALTIME ns, 0 when null.
struct FrEntry {
  int64_t record_id = -1;  // -1: missing
  int64_t pg_id = -1;
  std::string group;       // process_group[0]
  std::string group_desc;  // process_group[1]
  int64_t collective_seq_id = 0;
  int64_t p2p_seq_id = 0;
  int64_t op_id = 0;
  std::string op;  // profiling_name without its "tdist:" prefix: "all_reduce", "send", ...
  std::vector<std::vector<int64_t>> input_sizes, output_sizes;
  std::vector<std::string> input_dtypes, output_dtypes;
  FrState state = FrState::scheduled;
  int64_t time_created_ns = 0;
  int64_t time_started_ns = 0;
  int64_t time_completed_ns = 0;
  double duration_ms = -1;  // -1: null
  int64_t timeout_ms = 0;
  bool is_p2p = false;
  int64_t peer = -1;  // p2p: the other side's group rank; -1: null
  bool retired = false;
  std::string site;
  std::string error;  // state failed: the error's first line
};

// A group as the dump's "pg_config" names it.
struct FrGroupConfig {
  std::string name;
  std::string desc;
  std::string backend;
  std::vector<int> ranks;  // global ranks, in the order given
};

// "pg_status": a group's sequence numbers on this rank (0: none yet).
struct FrGroupStatus {
  int64_t last_enqueued_collective = 0, last_started_collective = 0, last_completed_collective = 0;
  int64_t last_enqueued_p2p = 0, last_started_p2p = 0, last_completed_p2p = 0;
};

struct RankDump {
  std::string path;  // where it was read from
  std::string version, producer, hostname, reason;
  int rank = -1;
  int world_size = 0;
  int64_t pid = 0;
  int64_t dump_time_ns = 0;
  int64_t buffer_size = 0;
  int64_t steps = 0;
  std::map<std::string, FrGroupConfig> groups;     // pg_config, by name
  std::map<std::string, FrGroupStatus> pg_status;  // by group name
  std::vector<FrEntry> entries;                    // oldest first, as written
  size_t parsed_bytes = 0;                         // what it was charged
};

// Parses a dump's text; `name` starts the error messages (a path).
RankDump parse_dump(const std::string& text, const std::string& name);

// Reads and parses one file (as described above).
RankDump read_dump(const std::string& path);

// Every rank-<R>.json in `dir` (R decimal, no leading zero; other names
// are ignored), sorted by rank. A file whose "rank" is not the R of its
// name is an error; so are a directory that cannot be listed and more than
// kMaxDumpFiles dumps. An empty result is not an error here.
std::vector<RankDump> read_dump_dir(const std::string& dir);

// "[0, 1, 2]" -> {0, 1, 2}: decimal ranks, each in [0, world_size),
// distinct, separated by commas (spaces allowed around them), at most
// kMaxWorldSize of them. "[]" is an empty group. DumpError(what) otherwise.
std::vector<int> parse_ranks(const std::string& text, int world_size);
// (read_dump, read_dump_dir and parse_ranks are in dump_files.cpp.)

}  // namespace tdist::trace
