#include "store/wire.h"
#include "util/coding.h"

#include <algorithm>
#include <cstring>

namespace tdist::wire {

namespace {

void put_u32(std::string* out, uint32_t v) { coding::put_fixed32(*out, v); }

void put_i64(std::string* out, int64_t v) { coding::put_fixed64(*out, static_cast<uint64_t>(v)); }

// A bounds-checked reader over one frame body.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool u8(uint8_t* v) {
    if (n_ - pos_ < 1) return false;
    *v = p_[pos_++];
    return true;
  }
  bool u32(uint32_t* v) {
    if (n_ - pos_ < 4) return false;
    *v = coding::decode_fixed32(p_ + pos_);
    pos_ += 4;
    return true;
  }
  bool i64(int64_t* v) {
    if (n_ - pos_ < 8) return false;
    *v = static_cast<int64_t>(coding::decode_fixed64(p_ + pos_));
    pos_ += 8;
    return true;
  }
  bool bytes(uint32_t len, const uint8_t** at) {
    if (n_ - pos_ < len) return false;
    *at = p_ + pos_;
    pos_ += len;
    return true;
  }
  bool done() const { return pos_ == n_; }
  size_t left() const { return n_ - pos_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

// The largest body a frame may have under limits: every key at its limit
// would be absurd, so keys share one budget with the values.
size_t max_body(const TCPStoreLimits& l) {
  return 32 + l.max_value_bytes + 2 * l.max_key_bytes + 8 * l.max_keys_per_request +
         (size_t(1) << 20);
}

bool counts_fit(Op op, size_t keys, size_t values) {
  switch (op) {
    case Op::kSet: return keys == 1 && values == 1;
    case Op::kGet: return keys >= 1 && values == 0;
    case Op::kAdd: return keys == 1 && values == 0;
    case Op::kCompareSet: return keys == 1 && values == 2;
    case Op::kWait: return keys >= 1 && values == 0;
    case Op::kCheck: return keys >= 1 && values == 0;
    case Op::kDelete: return keys == 1 && values == 0;
    case Op::kNumKeys: return keys == 0 && values == 0;
    case Op::kMultiSet: return keys >= 1 && values == keys;
    case Op::kPing: return keys == 0 && values == 0;
    case Op::kAuth: return keys == 0 && (values == 2 || values == 3);
  }
  return false;
}

ParseResult bad(std::string why) {
  ParseResult r;
  r.status = ParseStatus::kBad;
  r.error = std::move(why);
  return r;
}

}  // namespace

const char* op_name(uint8_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kSet: return "set";
    case Op::kGet: return "get";
    case Op::kAdd: return "add";
    case Op::kCompareSet: return "compare_set";
    case Op::kWait: return "wait";
    case Op::kCheck: return "check";
    case Op::kDelete: return "delete_key";
    case Op::kNumKeys: return "num_keys";
    case Op::kMultiSet: return "multi_set";
    case Op::kPing: return "ping";
    case Op::kAuth: return "auth";
  }
  return "unknown";
}

ParseResult parse_frame(const uint8_t* data, size_t size, const TCPStoreLimits& limits,
                        bool is_request, Message* out) {
  if (size < 4) return {};
  const uint32_t body_len = coding::decode_fixed32(data);
  if (body_len > max_body(limits)) {
    return bad("frame of " + std::to_string(body_len) + " bytes is over the limit of " +
               std::to_string(max_body(limits)));
  }
  if (body_len < 1 + 8 + 4 + 4) return bad("frame of " + std::to_string(body_len) + " bytes is too short");
  if (size - 4 < body_len) return {};

  Reader r(data + 4, body_len);
  Message m;
  uint32_t n_keys = 0, n_values = 0;
  if (!r.u8(&m.kind) || !r.i64(&m.number) || !r.u32(&n_keys)) return bad("truncated header");
  if (is_request && !(m.kind >= 1 && m.kind <= static_cast<uint8_t>(Op::kAuth))) {
    return bad("unknown op " + std::to_string(m.kind));
  }
  if (n_keys > limits.max_keys_per_request) {
    return bad(std::to_string(n_keys) + " keys in one request, over the limit of " +
               std::to_string(limits.max_keys_per_request));
  }
  // Reserve no more than the bytes present can hold (each entry has a
  // 4-byte length): the count is the peer's word, the body is not.
  m.keys.reserve(std::min<size_t>(n_keys, r.left() / 4));
  for (uint32_t i = 0; i < n_keys; ++i) {
    uint32_t len = 0;
    const uint8_t* at = nullptr;
    if (!r.u32(&len)) return bad("truncated key length");
    if (len > limits.max_key_bytes) {
      return bad("key of " + std::to_string(len) + " bytes, over the limit of " +
                 std::to_string(limits.max_key_bytes));
    }
    if (is_request && len == 0) return bad("empty key");
    if (!r.bytes(len, &at)) return bad("truncated key");
    m.keys.emplace_back(reinterpret_cast<const char*>(at), len);
  }
  if (!r.u32(&n_values)) return bad("truncated value count");
  if (n_values > limits.max_keys_per_request) return bad("too many values in one request");
  size_t total_values = 0;
  m.values.reserve(std::min<size_t>(n_values, r.left() / 4));
  for (uint32_t i = 0; i < n_values; ++i) {
    uint32_t len = 0;
    const uint8_t* at = nullptr;
    if (!r.u32(&len)) return bad("truncated value length");
    total_values += len;
    if (total_values > limits.max_value_bytes) {
      return bad("values of " + std::to_string(total_values) + " bytes, over the limit of " +
                 std::to_string(limits.max_value_bytes));
    }
    if (!r.bytes(len, &at)) return bad("truncated value");
    m.values.emplace_back(at, at + len);
  }
  if (!r.done()) return bad("trailing bytes after the last value");
  if (is_request && !counts_fit(static_cast<Op>(m.kind), m.keys.size(), m.values.size())) {
    return bad(std::string("wrong number of keys or values for ") + op_name(m.kind));
  }
  *out = std::move(m);
  ParseResult ok;
  ok.status = ParseStatus::kOk;
  ok.consumed = 4 + body_len;
  return ok;
}

void encode_frame(const Message& m, std::string* out) {
  size_t body = 1 + 8 + 4 + 4;
  for (const auto& k : m.keys) body += 4 + k.size();
  for (const auto& v : m.values) body += 4 + v.size();
  if (body > UINT32_MAX) throw UsageError("TCPStore: a request over 4 GiB cannot be sent");
  out->reserve(out->size() + 4 + body);
  put_u32(out, static_cast<uint32_t>(body));
  out->push_back(static_cast<char>(m.kind));
  put_i64(out, m.number);
  put_u32(out, static_cast<uint32_t>(m.keys.size()));
  for (const auto& k : m.keys) {
    put_u32(out, static_cast<uint32_t>(k.size()));
    out->append(k);
  }
  put_u32(out, static_cast<uint32_t>(m.values.size()));
  for (const auto& v : m.values) {
    put_u32(out, static_cast<uint32_t>(v.size()));
    out->append(reinterpret_cast<const char*>(v.data()), v.size());
  }
}

}  // namespace tdist::wire
