// The bounded JSON reader. The contract is in json_reader.h.
#include "util/json_reader.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "util/printable.h"

namespace tdist::json {

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

// The text, byte by byte, from memory or a FILE (read 64 KiB at a time).
// It ends early, `cut`, when the lexer has read more than max_token bytes
// since the last event: nlohmann buffers a token whole before the reader
// sees it, so the bound is kept here, while it reads.
class JsonReader::Input {
 public:
  Input(const char* data, size_t n, size_t max_token) : data_(data), end_(n), max_token_(max_token) {}
  Input(std::FILE* f, size_t max_token) : f_(f), max_token_(max_token), buf_(size_t{64} << 10) {}

  bool done() {
    if (at_ - mark_ > max_token_) {
      cut = true;
      return true;
    }
    if (pos_ < end_) return false;
    if (!f_) return true;
    end_ = std::fread(buf_.data(), 1, buf_.size(), f_);
    data_ = buf_.data();
    pos_ = 0;
    return end_ == 0;
  }
  const char& current() const { return data_[pos_]; }
  void advance() {
    ++pos_;
    ++at_;
  }
  void mark() { mark_ = at_; }
  size_t bytes() const { return at_; }
  size_t max_token() const { return max_token_; }
  bool cut = false;

 private:
  const char* data_ = nullptr;
  size_t pos_ = 0, end_ = 0;  // in data_
  std::FILE* f_ = nullptr;
  size_t at_ = 0, mark_ = 0;  // bytes read; at the last event
  size_t max_token_;
  std::vector<char> buf_;
};

// An input iterator over Input for nlohmann's iterator adapter; a default
// one is the end.
class JsonReader::InputIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  InputIterator() = default;
  explicit InputIterator(Input* in) : in_(in) {}
  reference operator*() const { return in_->current(); }
  InputIterator& operator++() {
    in_->advance();
    return *this;
  }
  bool operator==(const InputIterator& o) const { return at_end() == o.at_end(); }
  bool operator!=(const InputIterator& o) const { return !(*this == o); }

 private:
  bool at_end() const { return !in_ || in_->done(); }
  Input* in_ = nullptr;
};

JsonReader::JsonReader(Limits limits) : limits_(limits) {
  if (limits_.max_token == 0) {
    const size_t longest = std::max(limits_.max_string, limits_.max_key);
    limits_.max_token = longest > (SIZE_MAX - 4096) / 6 ? SIZE_MAX : 6 * longest + 4096;
  }
}

std::string JsonReader::run(Input& in) {
  stack_.clear();
  key_.clear();
  problem_.clear();
  kept_ = 0;
  in_ = &in;
  try {
    nlohmann::json::sax_parse(InputIterator(&in), InputIterator(), static_cast<nlohmann::json_sax<nlohmann::json>*>(this));
  } catch (const Stop&) {
  }
  in_ = nullptr;
  return problem_;
}

std::string JsonReader::parse(const char* data, size_t n) {
  Input in(data, n, limits_.max_token);
  return run(in);
}

std::string JsonReader::parse(std::FILE* f) {
  Input in(f, limits_.max_token);
  return run(in);
}

const std::string& JsonReader::key() const {
  if (stack_.empty() || stack_.back().object) return key_;
  for (size_t i = stack_.size(); i-- > 0;) {
    if (!stack_[i].in_array) return stack_[i].key;
  }
  return key_;
}

void JsonReader::event() {
  if (in_) in_->mark();
}

void JsonReader::fail(std::string why) {
  problem_ = std::move(why);  // it replaces a deferred one
  throw Stop{};
}

void JsonReader::defer(std::string why) {
  if (problem_.empty()) problem_ = std::move(why);
}

namespace {
std::string size_text(size_t bytes) {
  return bytes >= (size_t{1} << 20) ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes) + " bytes";
}
}  // namespace

void JsonReader::charge(size_t bytes) {
  kept_ += bytes;
  if (kept_ > limits_.max_kept) {
    fail("more than " + size_text(limits_.max_kept) + " to hold (after " + std::to_string(in_ ? in_->bytes() : 0) +
         " bytes of JSON)");
  }
}

bool JsonReader::scalar(const Scalar& v) {
  event();
  if (stack_.empty() && !limits_.any_root) fail(std::string("the document is ") + type_name(v.type) + ", not an object");
  if (skipping()) return true;
  if (!stack_.empty() && !stack_.back().object) ++stack_.back().count;
  on_scalar(v);
  return true;
}

bool JsonReader::open(bool object) {
  event();
  if (stack_.size() >= limits_.max_depth) fail("nested deeper than " + std::to_string(limits_.max_depth) + " levels");
  if (stack_.empty() && !object && !limits_.any_root) fail("the document is an array, not an object");
  Frame f;
  f.object = object;
  f.in_array = !stack_.empty() && !stack_.back().object;
  if (skipping()) {
    f.tag = kSkip;  // its key is never asked for
  } else {
    if (!f.in_array) f.key = key_;  // a key written once in the text, copied once
    if (f.in_array) ++stack_.back().count;
    f.tag = on_open(object);
  }
  stack_.push_back(std::move(f));
  return true;
}

bool JsonReader::close() {
  event();
  Frame f = std::move(stack_.back());
  stack_.pop_back();
  if (f.tag != kSkip) on_close(f);
  return true;
}

bool JsonReader::null() { return scalar(Scalar{}); }

bool JsonReader::boolean(bool v) {
  Scalar s;
  s.type = Scalar::Bool;
  s.b = v;
  return scalar(s);
}

bool JsonReader::number_integer(number_integer_t v) {
  Scalar s;
  s.type = Scalar::Int;
  s.i = v;
  s.minus = true;  // nlohmann reports as signed only what has a '-'
  if (v >= 0) s.u = static_cast<uint64_t>(v);
  return scalar(s);
}

bool JsonReader::number_unsigned(number_unsigned_t v) {
  Scalar s;
  s.type = Scalar::Int;
  s.u = v;
  s.too_big = v > static_cast<uint64_t>(INT64_MAX);
  s.i = s.too_big ? INT64_MAX : static_cast<int64_t>(v);
  return scalar(s);
}

bool JsonReader::number_float(number_float_t v, const string_t&) {
  Scalar s;
  s.type = Scalar::Float;
  s.f = v;
  return scalar(s);
}

bool JsonReader::string(string_t& v) {
  event();
  const size_t cap = skipping() || stack_.empty() ? limits_.max_string : string_cap();
  if (v.size() > cap) fail("a string of " + std::to_string(v.size()) + " bytes (at most " + std::to_string(cap) + ")");
  Scalar s;
  s.type = Scalar::String;
  s.s = &v;
  return scalar(s);
}

bool JsonReader::binary(binary_t&) { fail("binary data"); }

bool JsonReader::start_object(std::size_t) { return open(true); }
bool JsonReader::end_object() { return close(); }
bool JsonReader::start_array(std::size_t) { return open(false); }
bool JsonReader::end_array() { return close(); }

bool JsonReader::key(string_t& k) {
  event();
  if (k.size() > limits_.max_key) {
    fail("a key of " + std::to_string(k.size()) + " bytes (at most " + std::to_string(limits_.max_key) + ")");
  }
  if (skipping()) return true;
  key_ = k;
  on_key();
  return true;
}

bool JsonReader::parse_error(std::size_t at, const std::string&, const nlohmann::detail::exception& e) {
  if (in_ && in_->cut) {
    problem_ = "a token longer than " + std::to_string(in_->max_token()) + " bytes at byte " + std::to_string(at);
    return false;
  }
  std::string what = e.what();  // "[json.exception.parse_error.101] parse error at line 1, column 7: ..."
  if (what.compare(0, 16, "[json.exception.") == 0 && what.find("] ") != std::string::npos) {
    what.erase(0, what.find("] ") + 2);
  }
  problem_ = "not valid JSON at byte " + std::to_string(at) + " (" + detail::printable(what, 200) + ")";
  return false;
}

void JsonBuilder::add(nlohmann::json v, const std::string& key) {
  nlohmann::json& top = stack_.back();
  if (top.is_object()) {
    bytes_ += key.size() + 8;
    top[key] = std::move(v);
  } else {
    top.push_back(std::move(v));
  }
}

void JsonBuilder::open(bool object, const std::string& key) {
  bytes_ += 64;  // a container costs memory of its own, however small its text ("{}")
  stack_.push_back(object ? nlohmann::json::object() : nlohmann::json::array());
  keys_.push_back(key);
}

nlohmann::json JsonBuilder::value_of(const Scalar& v) {
  nlohmann::json j;
  switch (v.type) {
    case Scalar::Null: break;
    case Scalar::Bool: j = v.b; break;
    case Scalar::Int:
      if (v.negative()) {
        j = v.i;
      } else {
        j = v.u;
      }
      break;
    case Scalar::Float: j = v.f; break;
    case Scalar::String: j = *v.s; break;
  }
  return j;
}

void JsonBuilder::scalar(const Scalar& v, const std::string& key) {
  bytes_ += 16 + (v.type == Scalar::String ? v.s->size() : 0);
  add(value_of(v), key);
}

bool JsonBuilder::close(nlohmann::json& done) {
  nlohmann::json v = std::move(stack_.back());
  std::string key = std::move(keys_.back());
  stack_.pop_back();
  keys_.pop_back();
  if (stack_.empty()) {
    done = std::move(v);
    return true;
  }
  add(std::move(v), key);
  return false;
}

namespace {

// The whole document, built.
class ValueReader : public JsonReader {
 public:
  explicit ValueReader(const Limits& limits) : JsonReader(limits) {}
  nlohmann::json value;

 private:
  void on_scalar(const Scalar& v) override {
    if (at_root()) {
      value = JsonBuilder::value_of(v);
    } else {
      builder_.scalar(v, key());
    }
    charge_builder();
  }
  int on_open(bool object) override {
    builder_.open(object, key());
    charge_builder();
    return 0;
  }
  void on_close(const Frame&) override { builder_.close(value); }
  void charge_builder() {
    charge(builder_.bytes());
    builder_.reset_bytes();
  }
  JsonBuilder builder_;
};

}  // namespace

nlohmann::json parse_value(const std::string& text, const Limits& limits, std::string& error) {
  ValueReader r(limits);
  error = r.parse(text);
  return error.empty() ? std::move(r.value) : nlohmann::json();
}

}  // namespace tdist::json
