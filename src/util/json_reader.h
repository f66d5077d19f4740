// One bounded JSON reader: the streaming parse every reader of JSON in
// tdist goes through (safetensors headers, Hugging Face indexes, the
// param groups in tdist's own files, flight recorder dumps, Chrome traces).
//
// nlohmann-json tokenizes; JsonReader holds what every reader must bound
// while it parses, not after:
//   - nesting: at most Limits::max_depth open containers;
//   - one string's bytes: at most Limits::max_string (a key's: max_key;
//     a subclass may allow more at a place: string_cap());
//   - one token's text, while it is read (nlohmann buffers a token whole
//     before it says a word): at most Limits::max_token bytes past the
//     last event, 6 x the larger of those two + 4 KiB unless given;
//   - what the reader keeps: charge() it, at most Limits::max_kept bytes;
//   - the root: an object, unless Limits::any_root.
// Time is linear in the text; nothing read is executed, and nothing is
// built but what a subclass keeps.
//
// A subclass sees the document as events at places. A place is the stack
// of open containers (frames): object or array, the key it sits under in
// an object (key() answers for arrays in arrays), the elements so far,
// and a tag the subclass gave it when it opened. A container tagged kSkip
// is skipped whole: nothing inside it reaches the subclass (its nesting
// and string sizes are still bounded).
//
// Problems: fail() stops the parse; defer() keeps the problem and goes on,
// so that text which is not JSON at all says so first. What stops the
// parse (fail(), a bound, a parse error) replaces a deferred problem;
// among deferred ones the first is kept. parse() returns the problem, ""
// when none; the caller puts it in its own error with the file's name.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace tdist::json {

struct Limits {
  size_t max_depth = 64;
  size_t max_string = size_t{1} << 20;
  size_t max_key = size_t{1} << 20;
  size_t max_token = 0;  // 0: 6 x max(max_string, max_key) + 4096
  size_t max_kept = SIZE_MAX;
  bool any_root = false;  // false: the root must be an object
};

// One scalar value as read.
struct Scalar {
  enum Type : uint8_t { Null, Bool, Int, Float, String } type = Null;
  bool b = false;         // Bool
  int64_t i = 0;          // Int: the value, INT64_MAX when too_big
  bool too_big = false;   // Int: above INT64_MAX (u holds it)
  bool minus = false;     // Int: written with a '-' ("-0" too)
  uint64_t u = 0;         // Int: the value when not negative
  double f = 0;           // Float
  const std::string* s = nullptr;  // String, valid during the event
  bool negative() const { return type == Int && minus; }
};
const char* type_name(Scalar::Type t);  // "null", "a bool", "an integer", "a number", "a string"

// An open container.
struct Frame {
  bool object = false;
  bool in_array = false;  // its parent is an array
  std::string key;   // the key it sits under in an object ("" at the root, in an array or skipped)
  size_t count = 0;  // arrays: elements so far (counted as each one starts)
  int tag = 0;
};

class JsonReader : private nlohmann::json_sax<nlohmann::json> {
 public:
  static constexpr int kSkip = -1;

  explicit JsonReader(Limits limits);
  ~JsonReader() override = default;
  JsonReader(const JsonReader&) = delete;
  JsonReader& operator=(const JsonReader&) = delete;

  // Parses the whole text; the first problem, "" when none.
  std::string parse(const char* data, size_t n);
  std::string parse(const std::string& text) { return parse(text.data(), text.size()); }
  std::string parse(std::FILE* f);  // read to its end, never held whole

  size_t kept() const { return kept_; }

 protected:
  // A scalar at the current place (an array's count already counts it).
  virtual void on_scalar(const Scalar& v) = 0;
  // A container opens at the current place (top() is its parent, key() the
  // key it sits under in an object); returns the tag its frame gets.
  virtual int on_open(bool object) = 0;
  // The container on top closes; `f` is its frame, already off the stack.
  virtual void on_close(const Frame& f) { (void)f; }
  // A key in an object that is not skipped; key() holds it.
  virtual void on_key() {}
  // The most bytes a string may have at the current place (not skipped).
  virtual size_t string_cap() const { return limits_.max_string; }

  size_t depth() const { return stack_.size(); }
  bool at_root() const { return stack_.empty(); }
  const Frame& top() const { return stack_.back(); }
  const Frame& frame(size_t i) const { return stack_[i]; }
  // The key of what is read now, in an object; in an array, the key of
  // the nearest container that sits under one (at most max_depth steps).
  const std::string& key() const;

  [[noreturn]] void fail(std::string why);
  void defer(std::string why);
  bool has_problem() const { return !problem_.empty(); }
  // Counts bytes kept against Limits::max_kept; fails past it.
  void charge(size_t bytes);
  // Bytes a string of n bytes takes beyond the string object (small ones fit inside).
  static size_t heap(size_t n) { return n > 15 ? (n + 1 + 8 + 15) & ~size_t{15} : 0; }

 private:
  struct Stop {};  // thrown by fail(), caught by parse()
  class Input;     // the text as nlohmann reads it, bounded per token
  class InputIterator;

  bool null() override;
  bool boolean(bool v) override;
  bool number_integer(number_integer_t v) override;
  bool number_unsigned(number_unsigned_t v) override;
  bool number_float(number_float_t v, const string_t&) override;
  bool string(string_t& v) override;
  bool binary(binary_t&) override;
  bool start_object(std::size_t) override;
  bool end_object() override;
  bool start_array(std::size_t) override;
  bool end_array() override;
  bool key(string_t& k) override;
  bool parse_error(std::size_t at, const std::string&, const nlohmann::detail::exception& e) override;

  bool scalar(const Scalar& v);
  bool open(bool object);
  bool close();
  bool skipping() const { return !stack_.empty() && stack_.back().tag == kSkip; }
  void event();  // a token ended: the next may take max_token bytes
  std::string run(Input& in);

  Limits limits_;
  std::vector<Frame> stack_;
  std::string key_;
  std::string problem_;
  size_t kept_ = 0;
  Input* in_ = nullptr;  // during parse()
};

// Builds values read as nlohmann::json, for a reader that keeps a part of
// its document whole (a trace's events, a small list of groups). Its cost
// (bytes()) counts what the values take: 16 bytes a scalar plus a string's
// text, 64 a container, a key's text plus 8.
class JsonBuilder {
 public:
  bool building() const { return !stack_.empty(); }
  // A container: the outermost one, or one inside what is being built
  // (under `key` when its parent is an object).
  void open(bool object, const std::string& key);
  void scalar(const Scalar& v, const std::string& key);
  // Closes the innermost container; true when that was the outermost,
  // which is then moved to `done`.
  bool close(nlohmann::json& done);
  size_t bytes() const { return bytes_; }
  void reset_bytes() { bytes_ = 0; }
  static nlohmann::json value_of(const Scalar& v);

 private:
  void add(nlohmann::json v, const std::string& key);
  std::vector<nlohmann::json> stack_;
  std::vector<std::string> keys_;  // the key each container sits under
  size_t bytes_ = 0;
};

// A whole small document as nlohmann::json, within `limits` (max_kept
// bounds what the value takes, as JsonBuilder counts it). Empty `error`:
// read; otherwise the first problem.
nlohmann::json parse_value(const std::string& text, const Limits& limits, std::string& error);

}  // namespace tdist::json
