#include "run/etcd_client.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <thread>

#include "store/socket.h"
#include "tdist/errors.h"
#include "util/env.h"
#include "util/json_reader.h"

namespace tdist_run {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxAnswer = size_t{1} << 20;

// etcd said no, with one of its (gRPC's) codes: 5 is NotFound.
class EtcdRefused : public tdist::StoreError {
 public:
  EtcdRefused(const std::string& what, int64_t code) : tdist::StoreError(what), code(code) {}
  int64_t code;
};

// etcd's error codes (gRPC's) that another member may not have: Unavailable,
// DeadlineExceeded, and Unknown (which 3.4 gives for "leader changed").
bool retryable_code(int64_t code) { return code == 14 || code == 4 || code == 2; }

// The gateway writes int64 as strings ("revision":"2"); either form.
int64_t int_field(const nlohmann::json& o, const char* name) {
  const auto it = o.find(name);
  if (it == o.end()) return 0;  // proto3 leaves out zeros
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    if (const auto v = tdist::detail::parse_int(it->get<std::string>())) return *v;
  }
  throw tdist::StoreError(std::string("etcd answered with a bad '") + name + "'");
}

std::string bytes_field(const nlohmann::json& o, const char* name) {
  const auto it = o.find(name);
  if (it == o.end()) return "";
  if (!it->is_string()) throw tdist::StoreError(std::string("etcd answered with a bad '") + name + "'");
  auto v = base64_decode(it->get<std::string>());
  if (!v) throw tdist::StoreError(std::string("etcd answered with '") + name + "' that is not base64");
  return *v;
}

std::optional<EtcdValue> first_kv(const nlohmann::json& range) {
  const auto kvs = range.find("kvs");
  if (kvs == range.end()) return std::nullopt;
  if (!kvs->is_array()) throw tdist::StoreError("etcd answered with a bad 'kvs'");
  if (kvs->empty()) return std::nullopt;
  if (!(*kvs)[0].is_object()) throw tdist::StoreError("etcd answered with a bad 'kvs'");
  return EtcdValue{bytes_field((*kvs)[0], "value"), int_field((*kvs)[0], "mod_revision")};
}

// A lease's ID as the gateway wants it (a string), or nothing.
void with_lease(nlohmann::json& put, int64_t lease) {
  if (lease != 0) put["lease"] = std::to_string(lease);
}

// An answer that came whole: "HTTP/1.1 200 ...", headers, body (by length
// or chunked). The status and the body.
struct Answer {
  int status = 0;
  std::string body;
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string unchunk(const std::string& raw) {
  std::string out;
  for (size_t at = 0;;) {
    const size_t eol = raw.find("\r\n", at);
    if (eol == std::string::npos || eol - at > 16) throw tdist::StoreError("etcd's answer has a bad chunk");
    size_t n = 0;
    for (size_t i = at; i < eol && raw[i] != ';'; ++i) {
      const char c = raw[i];
      const int d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                    : (c >= 'a' && c <= 'f')                    ? c - 'a' + 10
                    : (c >= 'A' && c <= 'F')                    ? c - 'A' + 10
                                                                : -1;
      if (d < 0) throw tdist::StoreError("etcd's answer has a bad chunk size");
      n = n * 16 + static_cast<size_t>(d);
      if (n > kMaxAnswer) throw tdist::StoreError("etcd's answer has a chunk over 1 MiB");
    }
    if (n == 0) return out;  // trailers, if any, are not read
    if (raw.size() < eol + 2 + n + 2) throw tdist::StoreError("etcd's answer ends inside a chunk");
    out.append(raw, eol + 2, n);
    at = eol + 2 + n + 2;
  }
}

Answer parse_answer(const std::string& raw) {
  const size_t head_end = raw.find("\r\n\r\n");
  if (raw.compare(0, 9, "HTTP/1.1 ") != 0 && raw.compare(0, 9, "HTTP/1.0 ") != 0) {
    throw tdist::StoreError("the answer is not HTTP (is this an etcd client URL?)");
  }
  if (head_end == std::string::npos) throw tdist::StoreError("etcd's answer ended in its headers");
  Answer a;
  const auto status = tdist::detail::parse_int(raw.substr(9, 3));
  if (!status) throw tdist::StoreError("etcd's answer has a bad status line");
  a.status = static_cast<int>(*status);
  bool chunked = false;
  std::optional<int64_t> length;
  for (size_t at = raw.find("\r\n") + 2; at < head_end;) {
    const size_t eol = raw.find("\r\n", at);
    const std::string line = lower(raw.substr(at, eol - at));
    at = eol + 2;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string value = line.substr(colon + 1);
    value.erase(0, value.find_first_not_of(' '));
    if (line.compare(0, colon, "transfer-encoding") == 0 && value.find("chunked") != std::string::npos) chunked = true;
    if (line.compare(0, colon, "content-length") == 0) length = tdist::detail::parse_int(value);
  }
  const std::string rest = raw.substr(head_end + 4);
  if (chunked) {
    a.body = unchunk(rest);
  } else if (length) {
    if (*length < 0 || static_cast<size_t>(*length) > rest.size()) throw tdist::StoreError("etcd's answer is cut short");
    a.body = rest.substr(0, static_cast<size_t>(*length));
  } else {
    a.body = rest;
  }
  return a;
}

std::string where(const EtcdEndpoint& e) {
  return (e.host.find(':') != std::string::npos ? "[" + e.host + "]" : e.host) + ":" + std::to_string(e.port);
}

}  // namespace

std::vector<EtcdEndpoint> parse_etcd_endpoints(const std::string& text) {
  std::vector<EtcdEndpoint> out;
  for (size_t at = 0; at <= text.size();) {
    size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(at, end - at);
    at = end + 1;
    if (item.rfind("https://", 0) == 0) {
      throw tdist::UsageError("etcd endpoint '" + item + "': tdist-run speaks plain HTTP to etcd, not TLS");
    }
    if (item.rfind("http://", 0) == 0) item.erase(0, 7);
    if (!item.empty() && item.back() == '/') item.pop_back();
    const size_t colon = item.rfind(':');
    EtcdEndpoint e;
    e.host = colon == std::string::npos ? item : item.substr(0, colon);
    if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']') e.host = e.host.substr(1, e.host.size() - 2);
    if (colon != std::string::npos) {
      const auto port = tdist::detail::parse_int(item.substr(colon + 1));
      if (!port || *port < 1 || *port > 65535) {
        throw tdist::UsageError("etcd endpoint '" + item + "' needs a port in [1, 65535]");
      }
      e.port = static_cast<int>(*port);
    }
    if (e.host.empty() || e.host.size() > 253) throw tdist::UsageError("etcd endpoint '" + item + "' has no host");
    out.push_back(e);
    if (out.size() > 64) throw tdist::UsageError("more than 64 etcd endpoints");
  }
  return out;
}

std::string base64_encode(const std::string& bytes) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t v = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) v |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) v |= static_cast<uint8_t>(bytes[i + 2]);
    out += k[(v >> 18) & 63];
    out += k[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? k[(v >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? k[v & 63] : '=';
  }
  return out;
}

std::optional<std::string> base64_decode(const std::string& text) {
  if (text.size() % 4 != 0) return std::nullopt;
  auto digit = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    const int pad = last ? (text[i + 3] == '=') + (text[i + 2] == '=') : 0;
    if (pad == 1 && text[i + 2] == '=') return std::nullopt;  // "x=y=" and the like
    uint32_t v = 0;
    for (int j = 0; j < 4; ++j) {
      const int d = j >= 4 - pad ? 0 : digit(text[i + j]);
      if (d < 0) return std::nullopt;
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out += static_cast<char>((v >> 16) & 255);
    if (pad < 2) out += static_cast<char>((v >> 8) & 255);
    if (pad < 1) out += static_cast<char>(v & 255);
  }
  return out;
}

EtcdClient::EtcdClient(std::vector<EtcdEndpoint> endpoints, EtcdTimeouts timeouts)
    : endpoints_(std::move(endpoints)), timeouts_(timeouts) {
  if (endpoints_.empty()) throw tdist::UsageError("no etcd endpoint given");
}

std::string EtcdClient::describe() const {
  std::string s = "etcd at ";
  for (size_t i = 0; i < endpoints_.size(); ++i) s += (i ? "," : "") + where(endpoints_[i]);
  return s;
}

nlohmann::json EtcdClient::call_one(const EtcdEndpoint& e, const std::string& path, const std::string& body,
                                    Clock::time_point deadline) {
  using namespace tdist::detail;
  Fd s = connect_tcp_once(e.host, static_cast<uint16_t>(e.port), deadline);
  const std::string request = "POST " + path + " HTTP/1.1\r\nHost: " + where(e) +
                              "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                              "\r\nConnection: close\r\n\r\n" + body;
  send_all(s.get(), request.data(), request.size(), deadline);
  std::string raw;
  char buf[16384];
  for (;;) {
    const size_t n = recv_some(s.get(), buf, sizeof buf, deadline);
    if (n == 0) break;
    raw.append(buf, n);
    if (raw.size() > kMaxAnswer + 4096) throw tdist::StoreError("etcd's answer is over 1 MiB");
  }
  const Answer a = parse_answer(raw);
  tdist::json::Limits limits;
  limits.max_depth = 16;
  limits.max_kept = 4 * kMaxAnswer;
  std::string error;
  nlohmann::json j = tdist::json::parse_value(a.body, limits, error);
  if (!error.empty()) throw tdist::StoreError("etcd's answer is not JSON: " + error);
  const int64_t code = int_field(j, "code");
  if (a.status != 200 || code != 0) {
    const auto m = j.find("message");
    std::string what = m != j.end() && m->is_string() ? m->get<std::string>() : "HTTP " + std::to_string(a.status);
    if (what.size() > 200) what.resize(200);
    if (a.status >= 500 || retryable_code(code)) throw tdist::NetworkError(what);
    throw EtcdRefused("etcd refused " + path + ": " + what, code);
  }
  return j;
}

nlohmann::json EtcdClient::call(const std::string& path, const nlohmann::json& body) {
  const std::string text = body.dump();
  const auto op_deadline = Clock::now() + timeouts_.op;
  std::vector<std::string> last(endpoints_.size());
  for (size_t tries = 0;; ++tries) {
    const size_t i = current_;
    const auto deadline = std::min(op_deadline, Clock::now() + timeouts_.request);
    try {
      return call_one(endpoints_[i], path, text, deadline);
    } catch (const tdist::NetworkError& e) {
      last[i] = e.what();
    } catch (const tdist::TimeoutError& e) {
      last[i] = e.what();
    }
    current_ = (current_ + 1) % endpoints_.size();
    if (Clock::now() >= op_deadline) {
      std::string all;
      for (size_t j = 0; j < endpoints_.size(); ++j) {
        if (!last[j].empty()) all += "; " + where(endpoints_[j]) + ": " + last[j];
      }
      throw tdist::NetworkError("etcd: no member answered " + path + " within " +
                                std::to_string(timeouts_.op.count() / 1000) + " s" + all);
    }
    // Round the whole list without answer: a pause before the next round.
    if ((tries + 1) % endpoints_.size() == 0) {
      std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(200), op_deadline - Clock::now()));
    }
  }
}

std::optional<EtcdValue> EtcdClient::get(const std::string& key) {
  return first_kv(call("/v3/kv/range", {{"key", base64_encode(key)}}));
}

void EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  nlohmann::json put = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  with_lease(put, lease);
  call("/v3/kv/put", put);
}

bool EtcdClient::put_if_revision(const std::string& key, const std::string& value, int64_t revision, int64_t lease) {
  nlohmann::json put = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  with_lease(put, lease);
  nlohmann::json compare = {{"key", base64_encode(key)}, {"result", "EQUAL"}, {"target", "MOD"},
                            {"mod_revision", std::to_string(revision)}};
  const nlohmann::json r = call("/v3/kv/txn", {{"compare", {compare}}, {"success", {{{"request_put", put}}}}});
  const auto ok = r.find("succeeded");
  return ok != r.end() && ok->is_boolean() && ok->get<bool>();
}

std::optional<std::string> EtcdClient::put_if_value(const std::string& key, const std::optional<std::string>& expected,
                                                    const std::string& desired, int64_t lease) {
  nlohmann::json put = {{"key", base64_encode(key)}, {"value", base64_encode(desired)}};
  with_lease(put, lease);
  nlohmann::json compare = expected ? nlohmann::json{{"key", base64_encode(key)}, {"result", "EQUAL"},
                                                     {"target", "VALUE"}, {"value", base64_encode(*expected)}}
                                    : nlohmann::json{{"key", base64_encode(key)}, {"result", "EQUAL"},
                                                     {"target", "VERSION"}, {"version", "0"}};
  const nlohmann::json r = call("/v3/kv/txn", {{"compare", {compare}},
                                               {"success", {{{"request_put", put}}}},
                                               {"failure", {{{"request_range", {{"key", base64_encode(key)}}}}}}});
  const auto ok = r.find("succeeded");
  if (ok != r.end() && ok->is_boolean() && ok->get<bool>()) return desired;
  const auto responses = r.find("responses");
  if (responses == r.end() || !responses->is_array() || responses->size() != 1 || !(*responses)[0].is_object()) {
    throw tdist::StoreError("etcd answered a transaction without its range");
  }
  const auto range = (*responses)[0].find("response_range");
  if (range == (*responses)[0].end() || !range->is_object()) throw tdist::StoreError("etcd answered a bad range");
  const auto kv = first_kv(*range);
  if (!kv) return std::nullopt;
  return kv->value;
}

int64_t EtcdClient::grant_lease(int64_t ttl_s) {
  const nlohmann::json r = call("/v3/lease/grant", {{"TTL", std::to_string(ttl_s)}});
  const int64_t id = int_field(r, "ID");
  if (id == 0) throw tdist::StoreError("etcd granted no lease");
  return id;
}

bool EtcdClient::keep_alive(int64_t lease) {
  nlohmann::json r;
  try {
    r = call("/v3/lease/keepalive", {{"ID", std::to_string(lease)}});
  } catch (const EtcdRefused& e) {
    if (e.code == 5) return false;
    throw;
  }
  const auto result = r.find("result");
  if (result == r.end() || !result->is_object()) throw tdist::StoreError("etcd answered a keep-alive without result");
  return int_field(*result, "TTL") > 0;
}

}  // namespace tdist_run
