// Parsing a flight recorder dump: a bounded streaming parse into RankDump.
// The contract is in dump_reader.h.
#include "trace/dump_reader.h"

#include <cstring>
#include <utility>

#include "util/json_reader.h"
#include "util/printable.h"

namespace tdist::trace {

const char* state_name(FrState s) {
  switch (s) {
    case FrState::scheduled: return "scheduled";
    case FrState::started: return "started";
    case FrState::completed: return "completed";
    case FrState::failed: return "failed";
  }
  return "?";
}

namespace {

using detail::printable;
using json::Scalar;
using json::type_name;

// The dump, event by event (util/json_reader.h). Each frame's tag says
// what the schema has there; a value under a key the schema does not know
// is skipped (its depth still counted). Everything kept is charged against
// kMaxParsedBytes.
class DumpReader : public json::JsonReader {
 public:
  DumpReader() : JsonReader(limits()) {}
  RankDump d;
  std::map<std::string, std::string> ranks_text;  // pg_config group -> its "ranks", parsed at the end
  bool has_rank = false, has_world = false;

 private:
  enum Ctx : int { Skip = kSkip, Root, PgConfig, PgGroup, PgStatus, PgStatusGroup, Entries, Entry, ProcessGroup, SizesOuter, SizesInner, Dtypes };
  FrEntry entry_;
  unsigned seen_ = 0;  // required entry fields seen
  size_t sizes_ = 0;   // lists and numbers in the entry's sizes so far
  std::string group_;  // the pg_config / pg_status group open now

  static json::Limits limits() {
    json::Limits l;
    l.max_depth = kMaxDepth;
    l.max_string = kMaxString;  // string_cap() allows more where the schema does
    l.max_token = 6 * kMaxRanksString + 4096;  // the longest string, each byte escaped
    l.max_key = kMaxString;
    l.max_kept = kMaxParsedBytes;
    return l;
  }
  Ctx where() const { return at_root() ? Root : static_cast<Ctx>(top().tag); }
  std::string who() const {
    if (depth() >= 3 && frame(1).tag == Ctx::Entries) return "entry " + std::to_string(frame(1).count - 1) + ": ";
    if (!group_.empty() && depth() >= 3) return "group '" + printable(group_, 64) + "': ";
    return "";
  }
  std::string field() const {
    const std::string& k = key();
    return who() + (k.empty() ? std::string("the document is ") : printable(k, 64) + " is ");
  }
  void count_size() {
    if (++sizes_ > kMaxSizes) fail(field() + "more than " + std::to_string(kMaxSizes) + " lists and numbers");
  }
  // A string's cap, by where it is: a group's ranks, an entry's error, any other.
  size_t string_cap() const override {
    return where() == Ctx::PgGroup && key() == "ranks"   ? kMaxRanksString
           : where() == Ctx::Entry && key() == "error" ? kMaxErrorString
                                                       : kMaxString;
  }
  [[noreturn]] void wrong(const Scalar& v, const char* want) { fail(field() + type_name(v.type) + ", not " + want); }

  int64_t integer(const Scalar& v, int64_t max = INT64_MAX) {
    if (v.type != Scalar::Int) wrong(v, "an integer");
    if (v.negative()) fail(field() + "negative (" + std::to_string(v.i) + ")");
    if (v.too_big || v.i > max) fail(field() + "too large (at most " + std::to_string(max) + ")");
    return v.i;
  }
  // An optional integer: null leaves `out` as it is.
  void opt_integer(const Scalar& v, int64_t& out, int64_t max = INT64_MAX) {
    if (v.type != Scalar::Null) out = integer(v, max);
  }
  void opt_string(const Scalar& v, std::string& out) {
    if (v.type == Scalar::Null) return;
    if (v.type != Scalar::String) wrong(v, "a string");
    out = *v.s;
  }

  int on_open(bool object) override {
    const Ctx parent = where();
    const std::string& k = key();
    Ctx ctx = Ctx::Skip;
    const char* want = nullptr;  // what the schema has here, when not this container
    if (at_root()) {
      ctx = Ctx::Root;
    } else if (parent == Ctx::Root) {
      if (k == "pg_config" || k == "pg_status") {
        ctx = object ? (k == "pg_config" ? Ctx::PgConfig : Ctx::PgStatus) : Ctx::Skip;
        want = object ? nullptr : "an object";
      } else if (k == "entries") {
        ctx = object ? Ctx::Skip : Ctx::Entries;
        want = object ? "an array" : nullptr;
      } else if (known_root_scalar(k)) {
        want = "a scalar";
      }
    } else if (parent == Ctx::PgConfig || parent == Ctx::PgStatus) {
      if (!object) want = "an object";
      ctx = parent == Ctx::PgConfig ? Ctx::PgGroup : Ctx::PgStatusGroup;
      group_ = k;
      if (parent == Ctx::PgConfig) {
        charge(sizeof(FrGroupConfig) + 64 + 2 * heap(k.size()));
        d.groups[k].name = k;
      } else {
        charge(sizeof(FrGroupStatus) + 64 + heap(k.size()));
        d.pg_status[k] = FrGroupStatus();
      }
    } else if (parent == Ctx::Entries) {
      if (!object) want = "an object";
      if (d.entries.size() >= kMaxEntries) fail("more than " + std::to_string(kMaxEntries) + " entries");
      ctx = Ctx::Entry;
      charge(sizeof(FrEntry));
      entry_ = FrEntry();
      seen_ = 0;
      sizes_ = 0;
    } else if (parent == Ctx::Entry) {
      if (k == "process_group" || k == "input_sizes" || k == "output_sizes" || k == "input_dtypes" ||
          k == "output_dtypes") {
        if (object) want = "an array";
        ctx = k == "process_group"                        ? Ctx::ProcessGroup
              : k == "input_sizes" || k == "output_sizes" ? Ctx::SizesOuter
                                                          : Ctx::Dtypes;
        if (k == "process_group") seen_ |= 1;
      } else if (known_entry_scalar(k)) {
        want = "a scalar";
      }
    } else if (parent == Ctx::SizesOuter) {
      if (object) want = "an array";
      ctx = Ctx::SizesInner;
      count_size();
      (k[0] == 'i' ? entry_.input_sizes : entry_.output_sizes).emplace_back();
      charge(sizeof(std::vector<int64_t>));
    } else if (parent == Ctx::PgGroup) {
      if (k == "name" || k == "desc" || k == "ranks" || k == "backend") want = "a string";
    } else if (parent == Ctx::PgStatusGroup) {
      if (k.compare(0, 5, "last_") == 0) want = "an integer";
    } else if (parent == Ctx::ProcessGroup || parent == Ctx::SizesInner || parent == Ctx::Dtypes) {
      want = parent == Ctx::SizesInner ? "an integer" : "a string";
    }
    if (want) fail(field() + (object ? "an object" : "an array") + ", not " + want);
    return ctx;
  }

  void on_close(const json::Frame& f) override {
    if (f.tag == Ctx::Entry) {
      for (const auto& [bit, what] :
           {std::pair{1u, "process_group"}, {2u, "profiling_name"}, {4u, "state"}, {8u, "collective_seq_id"}}) {
        if (!(seen_ & bit)) fail("entry " + std::to_string(d.entries.size()) + ": no " + what);
      }
      d.entries.push_back(std::move(entry_));
    } else if (f.tag == Ctx::PgGroup || f.tag == Ctx::PgStatusGroup) {
      group_.clear();
    } else if (f.tag == Ctx::Root) {
      d.parsed_bytes = kept();
    }
  }

  static bool known_root_scalar(const std::string& k) {
    return k == "version" || k == "producer" || k == "rank" || k == "world_size" || k == "pid" || k == "hostname" ||
           k == "reason" || k == "dump_time_ns" || k == "buffer_size" || k == "steps";
  }
  static bool known_entry_scalar(const std::string& k) {
    return k == "record_id" || k == "pg_id" || k == "collective_seq_id" || k == "p2p_seq_id" || k == "op_id" ||
           k == "profiling_name" || k == "state" || k == "time_created_ns" || k == "time_discovered_started_ns" ||
           k == "time_discovered_completed_ns" || k == "duration_ms" || k == "timeout_ms" || k == "is_p2p" ||
           k == "peer" || k == "retired" || k == "site" || k == "error";
  }

  void on_scalar(const Scalar& v) override {
    const json::Frame& at = top();
    switch (where()) {
      case Ctx::Skip: return;
      case Ctx::Root: return root_field(v);
      case Ctx::PgConfig:
      case Ctx::PgStatus:
      case Ctx::Entries: wrong(v, "an object");
      case Ctx::PgGroup: {
        FrGroupConfig& g = d.groups[group_];
        std::string* out = key() == "desc" ? &g.desc : key() == "backend" ? &g.backend : nullptr;
        if (key() == "ranks") {
          if (v.type == Scalar::Null) return;
          if (v.type != Scalar::String) wrong(v, "a string");
          charge(heap(v.s->size()));
          ranks_text[group_] = *v.s;
        } else if (out) {
          opt_string(v, *out);
          charge(heap(out->size()));
        } else if (key() == "name" && v.type != Scalar::Null && v.type != Scalar::String) {
          wrong(v, "a string");
        }
        return;
      }
      case Ctx::PgStatusGroup: {
        FrGroupStatus& s = d.pg_status[group_];
        int64_t* out = key() == "last_enqueued_collective"    ? &s.last_enqueued_collective
                       : key() == "last_started_collective"   ? &s.last_started_collective
                       : key() == "last_completed_collective" ? &s.last_completed_collective
                       : key() == "last_enqueued_p2p"         ? &s.last_enqueued_p2p
                       : key() == "last_started_p2p"          ? &s.last_started_p2p
                       : key() == "last_completed_p2p"        ? &s.last_completed_p2p
                                                             : nullptr;
        if (out) opt_integer(v, *out);
        return;
      }
      case Ctx::Entry: return entry_field(v);
      case Ctx::ProcessGroup: {
        if (v.type != Scalar::String) wrong(v, "a string");
        if (at.count == 1) entry_.group = *v.s;
        if (at.count == 2) entry_.group_desc = *v.s;
        charge(heap(v.s->size()));
        return;
      }
      case Ctx::SizesInner: {
        auto& lists = key()[0] == 'i' ? entry_.input_sizes : entry_.output_sizes;
        count_size();
        lists.back().push_back(integer(v));
        charge(sizeof(int64_t));
        return;
      }
      case Ctx::SizesOuter: wrong(v, "an array");
      case Ctx::Dtypes: {
        if (v.type != Scalar::String) wrong(v, "a string");
        auto& list = key()[0] == 'i' ? entry_.input_dtypes : entry_.output_dtypes;
        if (list.size() >= kMaxSizes) fail(field() + "more than " + std::to_string(kMaxSizes) + " dtypes");
        list.push_back(*v.s);
        charge(sizeof(std::string) + heap(v.s->size()));
        return;
      }
    }
    return;
  }

  void root_field(const Scalar& v) {
    const std::string& k = key();
    if (k == "rank") {
      d.rank = static_cast<int>(integer(v, kMaxWorldSize - 1));
      has_rank = true;
    } else if (k == "world_size") {
      d.world_size = static_cast<int>(integer(v, kMaxWorldSize));
      if (d.world_size == 0) fail("world_size is 0");
      has_world = true;
    } else if (k == "pid") {
      opt_integer(v, d.pid);
    } else if (k == "dump_time_ns") {
      opt_integer(v, d.dump_time_ns);
    } else if (k == "buffer_size") {
      opt_integer(v, d.buffer_size);
    } else if (k == "steps") {
      opt_integer(v, d.steps);
    } else if (k == "version" || k == "producer" || k == "hostname" || k == "reason") {
      opt_string(v, k == "version"    ? d.version
                    : k == "producer" ? d.producer
                    : k == "hostname" ? d.hostname
                                      : d.reason);
    } else if (k == "pg_config" || k == "pg_status") {
      if (v.type != Scalar::Null) wrong(v, "an object");
    } else if (k == "entries") {
      if (v.type != Scalar::Null) wrong(v, "an array");
    }
    return;
  }

  void entry_field(const Scalar& v) {
    const std::string& k = key();
    FrEntry& e = entry_;
    if (k == "collective_seq_id") {
      e.collective_seq_id = integer(v);
      seen_ |= 8;
    } else if (k == "profiling_name") {
      if (v.type != Scalar::String) wrong(v, "a string");
      const size_t colon = v.s->find(':');
      e.op = colon == std::string::npos ? *v.s : v.s->substr(colon + 1);
      charge(heap(e.op.size()));
      seen_ |= 2;
    } else if (k == "state") {
      if (v.type != Scalar::String) wrong(v, "a string");
      const std::string& s = *v.s;
      if (s == "scheduled") {
        e.state = FrState::scheduled;
      } else if (s == "started") {
        e.state = FrState::started;
      } else if (s == "completed") {
        e.state = FrState::completed;
      } else if (s == "failed") {
        e.state = FrState::failed;
      } else {
        fail(field() + "'" + printable(s, 64) + "', not scheduled, started, completed or failed");
      }
      seen_ |= 4;
    } else if (k == "record_id") {
      opt_integer(v, e.record_id);
    } else if (k == "pg_id") {
      opt_integer(v, e.pg_id);
    } else if (k == "p2p_seq_id") {
      opt_integer(v, e.p2p_seq_id);
    } else if (k == "op_id") {
      opt_integer(v, e.op_id);
    } else if (k == "time_created_ns") {
      opt_integer(v, e.time_created_ns);
    } else if (k == "time_discovered_started_ns") {
      opt_integer(v, e.time_started_ns);
    } else if (k == "time_discovered_completed_ns") {
      opt_integer(v, e.time_completed_ns);
    } else if (k == "timeout_ms") {
      opt_integer(v, e.timeout_ms);
    } else if (k == "peer") {
      opt_integer(v, e.peer, kMaxWorldSize - 1);
    } else if (k == "duration_ms") {
      if (v.type == Scalar::Int) {
        e.duration_ms = static_cast<double>(integer(v));
      } else if (v.type == Scalar::Float) {
        if (!(v.f >= 0 && v.f < 1e300)) fail(field() + "not a duration");
        e.duration_ms = v.f;
      } else if (v.type != Scalar::Null) {
        wrong(v, "a number");
      }
    } else if (k == "is_p2p" || k == "retired") {
      if (v.type != Scalar::Null && v.type != Scalar::Bool) wrong(v, "a bool");
      (k == "is_p2p" ? e.is_p2p : e.retired) = v.b;
    } else if (k == "site" || k == "error") {
      opt_string(v, k == "site" ? e.site : e.error);
      charge(heap(v.type == Scalar::String ? v.s->size() : 0));
    } else if (k == "process_group" || k == "input_sizes" || k == "output_sizes" || k == "input_dtypes" ||
               k == "output_dtypes") {
      if (k == "process_group") wrong(v, "an array");
      if (v.type != Scalar::Null) wrong(v, "an array");
    }
    return;
  }
};

}  // namespace

RankDump parse_dump(const std::string& text, const std::string& name) {
  const auto fail = [&](const std::string& what) { throw DumpError(name + ": " + what); };
  DumpReader r;
  const std::string problem = r.parse(text);
  if (!problem.empty()) fail(problem);
  RankDump d = std::move(r.d);
  d.path = name;
  if (!r.has_rank) fail("no rank");
  if (!r.has_world) fail("no world_size");
  if (d.rank >= d.world_size) {
    fail("rank " + std::to_string(d.rank) + " is outside the world of " + std::to_string(d.world_size));
  }
  for (const auto& [group, ranks] : r.ranks_text) {
    try {
      d.groups[group].ranks = parse_ranks(ranks, d.world_size);
    } catch (const DumpError& e) {
      fail("group '" + printable(group, 64) + "': " + e.what());
    }
  }
  for (size_t i = 0; i < d.entries.size(); ++i) {
    const FrEntry& e = d.entries[i];
    if (e.is_p2p && e.peer >= d.world_size) fail("entry " + std::to_string(i) + ": peer outside the world");
  }
  return d;
}

}  // namespace tdist::trace
