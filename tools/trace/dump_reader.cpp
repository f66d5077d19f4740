// Parsing a flight recorder dump: a bounded SAX parse into RankDump.
// The contract is in dump_reader.h.
#include "trace/dump_reader.h"

#include <cstring>
#include <utility>

#include <nlohmann/json.hpp>

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

using Json = nlohmann::json;
using detail::printable;

// Bytes a string's text takes beyond the string object (small ones fit inside).
size_t heap(size_t n) { return n > 15 ? n + 1 : 0; }

// One JSON value delivered as a scalar.
struct Scalar {
  enum Type { Null, Bool, Int, Float, String } type;
  bool b = false;
  int64_t i = 0;         // Int
  bool too_big = false;  // Int: above INT64_MAX
  double f = 0;
  const std::string* s = nullptr;
};

const char* type_name(Scalar::Type t) {
  switch (t) {
    case Scalar::Null: return "null";
    case Scalar::Bool: return "a bool";
    case Scalar::Int: return "an integer";
    case Scalar::Float: return "a number";
    case Scalar::String: return "a string";
  }
  return "?";
}

// The dump, event by event. Frames on a stack say where a value sits; a
// value under a key the schema does not know is skipped (its depth still
// counted). Everything kept is charged against kMaxParsedBytes.
class DumpSax : public nlohmann::json_sax<Json> {
 public:
  explicit DumpSax(const std::string& name) : name_(name) { d.path = name; }
  RankDump d;
  std::map<std::string, std::string> ranks_text;  // pg_config group -> its "ranks", parsed at the end
  bool has_rank = false, has_world = false;

  bool null() override { return scalar({Scalar::Null}); }
  bool boolean(bool v) override { return scalar({Scalar::Bool, v}); }
  bool number_integer(number_integer_t v) override { return scalar({Scalar::Int, false, v}); }
  bool number_unsigned(number_unsigned_t v) override {
    const bool big = v > static_cast<uint64_t>(INT64_MAX);
    return scalar({Scalar::Int, false, big ? INT64_MAX : static_cast<int64_t>(v), big});
  }
  bool number_float(number_float_t v, const string_t&) override { return scalar({Scalar::Float, false, 0, false, v}); }
  bool string(string_t& v) override {
    const size_t cap = where() == Ctx::PgGroup && key_ == "ranks" ? kMaxRanksString
                       : where() == Ctx::Entry && key_ == "error" ? kMaxErrorString
                                                                  : kMaxString;
    if (v.size() > cap) {
      fail(field() + "a string of " + std::to_string(v.size()) + " bytes (at most " + std::to_string(cap) + ")");
    }
    return scalar({Scalar::String, false, 0, false, 0, &v});
  }
  bool binary(binary_t&) override { fail(field() + "binary data"); }

  bool key(string_t& k) override {
    if (k.size() > kMaxString) fail("a key of " + std::to_string(k.size()) + " bytes");
    key_ = k;
    return true;
  }
  bool start_object(std::size_t) override { return open(true); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(false); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    std::string what = e.what();  // "[json.exception.parse_error.101] parse error at line 1, column 7: ..."
    if (what.compare(0, 16, "[json.exception.") == 0 && what.find("] ") != std::string::npos) {
      what.erase(0, what.find("] ") + 2);
    }
    fail("not valid JSON (" + printable(what, 200) + ")");
  }

  [[noreturn]] void fail(const std::string& what) const { throw DumpError(name_ + ": " + what); }

 private:
  enum class Ctx {
    Skip,
    Root,
    PgConfig,
    PgGroup,
    PgStatus,
    PgStatusGroup,
    Entries,
    Entry,
    ProcessGroup,
    SizesOuter,
    SizesInner,
    Dtypes
  };
  struct Frame {
    Ctx ctx;
    bool object;
    std::string key;   // the key this container sits under in its parent ("" in an array)
    size_t count = 0;  // elements so far (arrays)
  };
  std::string name_;
  std::vector<Frame> stack_;
  std::string key_;
  FrEntry entry_;
  unsigned seen_ = 0;  // required entry fields seen
  size_t sizes_ = 0;   // lists and numbers in the entry's sizes so far
  std::string group_;  // the pg_config / pg_status group open now
  size_t used_ = 0;

  Ctx where() const { return stack_.empty() ? Ctx::Root : stack_.back().ctx; }
  std::string who() const {
    if (stack_.size() >= 3 && stack_[1].ctx == Ctx::Entries) {
      return "entry " + std::to_string(stack_[1].count - 1) + ": ";
    }
    if (!group_.empty() && stack_.size() >= 3) return "group '" + printable(group_, 64) + "': ";
    return "";
  }
  std::string field() const {
    std::string k = stack_.empty() || stack_.back().object ? key_ : std::string();
    for (size_t i = stack_.size(); k.empty() && i > 0 && !stack_[i - 1].object; --i) k = stack_[i - 1].key;
    return who() + (k.empty() ? std::string("the document is ") : printable(k, 64) + " is ");
  }
  void charge(size_t bytes) {
    used_ += bytes;
    if (used_ > kMaxParsedBytes) fail("more than " + std::to_string(kMaxParsedBytes >> 20) + " MiB of records");
  }
  void count_size() {
    if (++sizes_ > kMaxSizes) fail(field() + "more than " + std::to_string(kMaxSizes) + " lists and numbers");
  }
  [[noreturn]] void wrong(const Scalar& v, const char* want) { fail(field() + type_name(v.type) + ", not " + want); }

  int64_t integer(const Scalar& v, int64_t max = INT64_MAX) {
    if (v.type != Scalar::Int) wrong(v, "an integer");
    if (v.i < 0) fail(field() + "negative (" + std::to_string(v.i) + ")");
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

  bool open(bool object) {
    if (stack_.size() >= static_cast<size_t>(kMaxDepth))
      fail("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    const Ctx parent = where();
    const bool in_object = !stack_.empty() && stack_.back().object;
    if (!stack_.empty() && !in_object) ++stack_.back().count;
    const std::string& k = in_object ? key_ : (stack_.empty() ? key_ : stack_.back().key);
    Ctx ctx = Ctx::Skip;
    const char* want = nullptr;  // what the schema has here, when not this container
    if (stack_.empty()) {
      if (!object) fail("the document is an array, not an object");
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
      group_ = key_;
      if (parent == Ctx::PgConfig) {
        charge(sizeof(FrGroupConfig) + 64 + 2 * heap(key_.size()));
        d.groups[key_].name = key_;
      } else {
        charge(sizeof(FrGroupStatus) + 64 + heap(key_.size()));
        d.pg_status[key_] = FrGroupStatus();
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
      (stack_.back().key[0] == 'i' ? entry_.input_sizes : entry_.output_sizes).emplace_back();
      charge(sizeof(std::vector<int64_t>));
    } else if (parent == Ctx::PgGroup) {
      if (k == "name" || k == "desc" || k == "ranks" || k == "backend") want = "a string";
    } else if (parent == Ctx::PgStatusGroup) {
      if (k.compare(0, 5, "last_") == 0) want = "an integer";
    } else if (parent == Ctx::ProcessGroup || parent == Ctx::SizesInner || parent == Ctx::Dtypes) {
      want = parent == Ctx::SizesInner ? "an integer" : "a string";
    }
    if (want) fail(field() + (object ? "an object" : "an array") + ", not " + want);
    stack_.push_back(Frame{ctx, object, in_object ? key_ : std::string(), 0});
    return true;
  }

  bool close() {
    const Frame f = std::move(stack_.back());
    stack_.pop_back();
    if (f.ctx == Ctx::Entry) {
      for (const auto& [bit, what] :
           {std::pair{1u, "process_group"}, {2u, "profiling_name"}, {4u, "state"}, {8u, "collective_seq_id"}}) {
        if (!(seen_ & bit)) fail("entry " + std::to_string(d.entries.size()) + ": no " + what);
      }
      d.entries.push_back(std::move(entry_));
    } else if (f.ctx == Ctx::PgGroup || f.ctx == Ctx::PgStatusGroup) {
      group_.clear();
    } else if (f.ctx == Ctx::Root) {
      d.parsed_bytes = used_;
    }
    return true;
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

  bool scalar(const Scalar& v) {
    if (stack_.empty()) fail(std::string("the document is ") + type_name(v.type) + ", not an object");
    Frame& top = stack_.back();
    if (!top.object) ++top.count;
    switch (top.ctx) {
      case Ctx::Skip: return true;
      case Ctx::Root: return root_field(v);
      case Ctx::PgConfig:
      case Ctx::PgStatus:
      case Ctx::Entries: wrong(v, "an object");
      case Ctx::PgGroup: {
        FrGroupConfig& g = d.groups[group_];
        std::string* out = key_ == "desc" ? &g.desc : key_ == "backend" ? &g.backend : nullptr;
        if (key_ == "ranks") {
          if (v.type == Scalar::Null) return true;
          if (v.type != Scalar::String) wrong(v, "a string");
          charge(heap(v.s->size()));
          ranks_text[group_] = *v.s;
        } else if (out) {
          opt_string(v, *out);
          charge(heap(out->size()));
        } else if (key_ == "name" && v.type != Scalar::Null && v.type != Scalar::String) {
          wrong(v, "a string");
        }
        return true;
      }
      case Ctx::PgStatusGroup: {
        FrGroupStatus& s = d.pg_status[group_];
        int64_t* out = key_ == "last_enqueued_collective"    ? &s.last_enqueued_collective
                       : key_ == "last_started_collective"   ? &s.last_started_collective
                       : key_ == "last_completed_collective" ? &s.last_completed_collective
                       : key_ == "last_enqueued_p2p"         ? &s.last_enqueued_p2p
                       : key_ == "last_started_p2p"          ? &s.last_started_p2p
                       : key_ == "last_completed_p2p"        ? &s.last_completed_p2p
                                                             : nullptr;
        if (out) opt_integer(v, *out);
        return true;
      }
      case Ctx::Entry: return entry_field(v);
      case Ctx::ProcessGroup: {
        if (v.type != Scalar::String) wrong(v, "a string");
        if (top.count == 1) entry_.group = *v.s;
        if (top.count == 2) entry_.group_desc = *v.s;
        charge(heap(v.s->size()));
        return true;
      }
      case Ctx::SizesInner: {
        auto& lists = stack_[stack_.size() - 2].key[0] == 'i' ? entry_.input_sizes : entry_.output_sizes;
        count_size();
        lists.back().push_back(integer(v));
        charge(sizeof(int64_t));
        return true;
      }
      case Ctx::SizesOuter: wrong(v, "an array");
      case Ctx::Dtypes: {
        if (v.type != Scalar::String) wrong(v, "a string");
        auto& list = top.key[0] == 'i' ? entry_.input_dtypes : entry_.output_dtypes;
        if (list.size() >= kMaxSizes) fail(field() + "more than " + std::to_string(kMaxSizes) + " dtypes");
        list.push_back(*v.s);
        charge(sizeof(std::string) + heap(v.s->size()));
        return true;
      }
    }
    return true;
  }

  bool root_field(const Scalar& v) {
    const std::string& k = key_;
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
    return true;
  }

  bool entry_field(const Scalar& v) {
    const std::string& k = key_;
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
    return true;
  }
};

}  // namespace

RankDump parse_dump(const std::string& text, const std::string& name) {
  DumpSax sax(name);
  Json::sax_parse(text.data(), text.data() + text.size(), &sax);
  RankDump d = std::move(sax.d);
  if (!sax.has_rank) sax.fail("no rank");
  if (!sax.has_world) sax.fail("no world_size");
  if (d.rank >= d.world_size) {
    sax.fail("rank " + std::to_string(d.rank) + " is outside the world of " + std::to_string(d.world_size));
  }
  for (const auto& [group, ranks] : sax.ranks_text) {
    try {
      d.groups[group].ranks = parse_ranks(ranks, d.world_size);
    } catch (const DumpError& e) {
      sax.fail("group '" + printable(group, 64) + "': " + e.what());
    }
  }
  for (size_t i = 0; i < d.entries.size(); ++i) {
    const FrEntry& e = d.entries[i];
    if (e.is_p2p && e.peer >= d.world_size) sax.fail("entry " + std::to_string(i) + ": peer outside the world");
  }
  return d;
}

}  // namespace tdist::trace
