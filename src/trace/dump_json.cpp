// The flight recorder's dump as JSON, in the keys of PyTorch's Flight
// Recorder JSON dump (docs/observability.md has the schema), written by
// hand: a dump may be written while the process is failing, so it needs
// nothing but the ring and a string.
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <string>

#include "trace/flight_recorder.h"
#include "trace/timeline.h"
#include "tdist/config.h"

namespace tdist::detail {

namespace {

// The length of the valid UTF-8 sequence at s[i], or 0.
size_t utf8_length(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  const size_t n = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xc2 && c <= 0xdf ? 2 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
  }
  if (n == 3 && ((c == 0xe0 && b(i + 1) < 0xa0) || (c == 0xed && b(i + 1) >= 0xa0))) return 0;  // overlong; surrogate
  if (n == 4 && ((c == 0xf0 && b(i + 1) < 0x90) || (c == 0xf4 && b(i + 1) >= 0x90))) return 0;  // overlong; > U+10FFFF
  return n;
}

// A JSON string: escaped, and valid UTF-8 whatever `s` holds (an error
// message cut short, a name in another encoding: each bad byte becomes
// U+FFFD), so that every JSON reader takes the dump.
void put_string(std::string& out, const std::string& s) {
  out += '"';
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t n = utf8_length(s, i);
      if (n == 0) {
        out += "\\ufffd";
      } else {
        out.append(s, i, n);
        i += n - 1;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void put_int(std::string& out, int64_t v) { out += std::to_string(v); }

void put_ns_or_null(std::string& out, int64_t ns) {
  if (ns > 0) {
    put_int(out, ns);
  } else {
    out += "null";
  }
}

// c10's names (what PyTorch's dump writes for input_dtypes).
const char* dtype_name(int dt) {
  switch (static_cast<comm::DataType>(dt)) {
    case comm::DataType::kFloat32: return "Float";
    case comm::DataType::kFloat64: return "Double";
    case comm::DataType::kFloat16: return "Half";
    case comm::DataType::kBFloat16: return "BFloat16";
    case comm::DataType::kInt8: return "Char";
    case comm::DataType::kUInt8: return "Byte";
    case comm::DataType::kInt32: return "Int";
    case comm::DataType::kInt64: return "Long";
    case comm::DataType::kBool: return "Bool";
  }
  return "Undefined";
}

const char* state_name(FrState s) {
  switch (s) {
    case FrState::kScheduled: return "scheduled";
    case FrState::kStarted: return "started";
    case FrState::kCompleted: return "completed";
    case FrState::kFailed: return "failed";
  }
  return "scheduled";
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

void put_sizes(std::string& out, int dtype, int64_t numel) {
  if (dtype < 0) {
    out += "[]";
  } else {
    out += "[[" + std::to_string(numel) + "]]";
  }
}

void put_dtypes(std::string& out, int dtype) {
  if (dtype < 0) {
    out += "[]";
  } else {
    out += "[\"";
    out += dtype_name(dtype);
    out += "\"]";
  }
}

void put_entry(std::string& out, const FrRecord& r) {
  const FrGroup& g = *r.group;
  out += "{\"record_id\":";
  put_int(out, static_cast<int64_t>(r.id));
  out += ",\"pg_id\":";
  put_int(out, g.id);
  out += ",\"process_group\":[";
  put_string(out, g.name);
  out += ',';
  put_string(out, g.desc);
  out += "],\"collective_seq_id\":";
  put_int(out, r.p2p ? 0 : static_cast<int64_t>(r.seq));
  out += ",\"p2p_seq_id\":";
  put_int(out, r.p2p ? static_cast<int64_t>(r.seq) : 0);
  out += ",\"op_id\":";
  put_int(out, static_cast<int64_t>(r.seq));
  out += ",\"profiling_name\":";
  put_string(out, std::string("tdist:") + r.op.name);
  out += ",\"input_sizes\":";
  put_sizes(out, r.op.dtype, r.op.input_numel);
  out += ",\"input_dtypes\":";
  put_dtypes(out, r.op.dtype);
  out += ",\"output_sizes\":";
  put_sizes(out, r.op.dtype, r.op.output_numel);
  out += ",\"output_dtypes\":";
  put_dtypes(out, r.op.dtype);
  out += ",\"state\":\"";
  out += state_name(r.state);
  out += "\",\"time_created_ns\":";
  put_int(out, r.created_ns);
  out += ",\"time_discovered_started_ns\":";
  put_ns_or_null(out, r.started_ns);
  out += ",\"time_discovered_completed_ns\":";
  put_ns_or_null(out, r.completed_ns);
  out += ",\"duration_ms\":";
  if (r.started_ns > 0 && r.completed_ns >= r.started_ns) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6f", static_cast<double>(r.completed_ns - r.started_ns) / 1e6);
    out += buf;
  } else {
    out += "null";
  }
  out += ",\"timeout_ms\":";
  put_int(out, r.op.timeout_ms);
  out += ",\"is_p2p\":";
  out += r.p2p ? "true" : "false";
  out += ",\"peer\":";
  if (r.p2p && r.op.peer >= 0) {
    put_int(out, r.op.peer);
  } else {
    out += "null";
  }
  out += ",\"retired\":";
  out += r.state == FrState::kCompleted || r.state == FrState::kFailed ? "true" : "false";
  out += ",\"site\":";
  if (r.site.empty()) {
    out += "null";
  } else {
    put_string(out, r.site);
  }
  // PyTorch's "frames" are the Python stack of the call; tdist keeps no
  // stack, only the calling site's name (FrSiteScope): one frame with
  // that name and no file, or none.
  out += ",\"frames\":[";
  if (!r.site.empty()) {
    out += "{\"name\":";
    put_string(out, r.site);
    out += ",\"filename\":\"\",\"line\":0}";
  }
  out += ']';
  out += ",\"error\":";
  if (r.state == FrState::kFailed) {
    put_string(out, r.error);
  } else {
    out += "null";
  }
  out += '}';
}

// A group's pg_status object.
void put_progress(std::string& out, const FrProgress& collective, const FrProgress& p2p) {
  const auto put = [&out](const char* key, uint64_t v) {
    out += key;
    put_int(out, static_cast<int64_t>(v));
  };
  put("{\"last_enqueued_collective\":", collective.enqueued());
  put(",\"last_started_collective\":", collective.started.load());
  put(",\"last_completed_collective\":", collective.completed.load());
  put(",\"last_enqueued_p2p\":", p2p.enqueued());
  put(",\"last_started_p2p\":", p2p.started.load());
  put(",\"last_completed_p2p\":", p2p.completed.load());
  out += '}';
}

}  // namespace

std::string json_quote(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  put_string(out, s);
  return out;
}

std::string dump_json(const FlightRecorder& fr, DumpReason why) {
  const auto records = fr.snapshot();
  const auto groups = fr.groups();
  std::string out;
  out.reserve(1024 + records.size() * 600);
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  out += "{\"version\":\"2.4\",\"producer\":";
  put_string(out, std::string("tdist ") + TDIST_VERSION_STRING);
  out += ",\"rank\":";
  put_int(out, fr.rank());
  out += ",\"world_size\":";
  put_int(out, fr.world_size());
  out += ",\"pid\":";
  put_int(out, getpid());
  out += ",\"hostname\":";
  put_string(out, host);
  out += ",\"reason\":";
  put_string(out, dump_reason_name(why));
  out += ",\"dump_time_ns\":";
  put_int(out, fr_now_ns());
  out += ",\"buffer_size\":";
  put_int(out, static_cast<int64_t>(fr.capacity()));
  out += ",\"steps\":";
  put_int(out, fr.steps());
  out += ",\"pg_config\":{";
  for (size_t i = 0; i < groups.size(); ++i) {
    const FrGroup& g = *groups[i];
    if (i) out += ',';
    put_string(out, g.name);
    out += ":{\"name\":";
    put_string(out, g.name);
    out += ",\"desc\":";
    put_string(out, g.desc);
    out += ",\"ranks\":";
    put_string(out, ranks_text(g.ranks));
    out += ",\"backend\":";
    put_string(out, g.backend);
    out += '}';
  }
  out += "},\"pg_status\":{";
  for (size_t i = 0; i < groups.size(); ++i) {
    const FrGroup& g = *groups[i];
    if (i) out += ',';
    put_string(out, g.name);
    out += ':';
    put_progress(out, g.collective, g.p2p);
  }
  out += "},\"entries\":[";
  for (size_t i = 0; i < records.size(); ++i) {
    if (i) out += ",\n";
    put_entry(out, records[i]);
  }
  out += "]}\n";
  return out;
}

}  // namespace tdist::detail
