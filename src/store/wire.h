// The TCPStore wire format.
//
// Every message, request or reply, is one frame:
//   frame := body_len:u32le body
//   body  := kind:u8 number:i64le n_keys:u32le (len:u32le bytes){n_keys}
//                                 n_values:u32le (len:u32le bytes){n_values}
// A request's kind is an Op; a reply's kind is a Status. `number` carries a
// delta (add), a timeout in ms (get/wait) or a count (num_keys, add's result).
// One layout for every message keeps the parser -- the only code that sees
// untrusted bytes -- small enough to fuzz exhaustively (fuzz/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tdist/store.h"

namespace tdist::wire {

inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr size_t kNonceBytes = 32;

enum class Op : uint8_t {
  kSet = 1,         // keys[0], values[0]
  kGet = 2,         // keys (1..n), number = timeout ms -> values
  kAdd = 3,         // keys[0], number = delta -> number
  kCompareSet = 4,  // keys[0], values = {expected, desired} -> values[0]
  kWait = 5,        // keys, number = timeout ms
  kCheck = 6,       // keys -> number (0/1)
  kDelete = 7,      // keys[0] -> number (0/1)
  kNumKeys = 8,     // -> number
  kMultiSet = 9,    // keys, values (same count)
  kPing = 10,       // -> number = kProtocolVersion
  kAuth = 11,       // values = {client_nonce, client_mac[, who]} -> values = {server_mac}
};

enum class Status : uint8_t {
  kOk = 0,
  kTimeout = 1,  // values = the keys still missing
  kError = 2,    // values[0] = message
  kHello = 3,    // first frame from the server: number = version | auth flag,
                 // values[0] = server nonce when auth is required
};

inline constexpr int64_t kHelloAuthRequired = int64_t(1) << 32;

// How the server's refusal of a connection over its limit begins; a client
// that reads it tries again later.
inline constexpr const char* kBusyReply = "TCPStore server: too many connections";

struct Message {
  uint8_t kind = 0;
  int64_t number = 0;
  std::vector<std::string> keys;
  std::vector<Bytes> values;
};

enum class ParseStatus { kNeedMore, kOk, kBad };

struct ParseResult {
  ParseStatus status = ParseStatus::kNeedMore;
  size_t consumed = 0;  // bytes of the frame, when kOk
  std::string error;    // why, when kBad
};

// Parses one frame from the front of [data, data+size). Never reads past
// size; rejects frames and fields over limits as soon as their length is
// known, before any of their payload arrives. For requests (is_request) it
// also checks that the Op exists and the field counts fit it.
ParseResult parse_frame(const uint8_t* data, size_t size, const TCPStoreLimits& limits,
                        bool is_request, Message* out);

// Appends the frame of m to out.
void encode_frame(const Message& m, std::string* out);

const char* op_name(uint8_t op);

}  // namespace tdist::wire
