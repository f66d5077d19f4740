// The one bounded JSON reader (src/util/json_reader.h): places and tags,
// skipping, the bounds (depth, strings, keys, what is kept, the root), and
// which problem wins; parse_value's whole-document build.
#include "util/json_reader.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using tdist::json::Frame;
using tdist::json::JsonReader;
using tdist::json::Limits;
using tdist::json::Scalar;

// Records every event it is shown as "path=value" lines; a key "skip"
// skips its value; a string "defer" defers, "fail" fails; each kept
// string is charged its size.
class Recorder : public JsonReader {
 public:
  explicit Recorder(Limits l = Limits()) : JsonReader(l) {}
  std::vector<std::string> events;

 private:
  std::string place() const {
    std::string p;
    for (size_t i = 0; i < depth(); ++i) p += "/" + frame(i).key + "#" + std::to_string(frame(i).count);
    return p + ":" + key();
  }
  int on_open(bool object) override {
    if (!at_root() && top().tag == kSkip) events.push_back("shown inside a skipped value");
    if (!at_root() && key() == "skip") return kSkip;
    events.push_back(place() + (object ? "={" : "=["));
    return static_cast<int>(depth());
  }
  void on_close(const Frame& f) override { events.push_back("close tag " + std::to_string(f.tag)); }
  void on_scalar(const Scalar& v) override {
    if (!at_root() && top().tag == kSkip) events.push_back("shown inside a skipped value");
    std::string text = tdist::json::type_name(v.type);
    if (v.type == Scalar::String) {
      if (*v.s == "defer") defer("deferred at " + place());
      if (*v.s == "fail") fail("failed at " + place());
      charge(v.s->size());
      text = *v.s;
    }
    if (v.type == Scalar::Int) text = v.negative() ? std::to_string(v.i) : std::to_string(v.u) + (v.too_big ? "!" : "");
    events.push_back(place() + "=" + text);
  }
};

TEST(JsonReader, EventsCarryTheirPlace) {
  Recorder r;
  ASSERT_EQ(r.parse(R"({"a": [1, -2, [true, "x"]], "b": {"c": null}, "n": 18446744073709551615})"), "");
  const std::vector<std::string> want = {
      ":={",                          // the root: no key
      "/#0:a=[",                      // under "a"
      "/#0/a#1:a=1",                  // in an array: its key, the element's number
      "/#0/a#2:a=-2",
      "/#0/a#3:a=[",                  // an array in an array: key() is still a's
      "/#0/a#3/#1:a=a bool",          // its own key is "", key() says a's
      "/#0/a#3/#2:a=x",
      "close tag 2",
      "close tag 1",
      "/#0:b={",
      "/#0/b#0:c=null",
      "close tag 1",
      "/#0:n=18446744073709551615!",  // above INT64_MAX: u holds it
      "close tag 0",
  };
  EXPECT_EQ(r.events, want);
}

TEST(JsonReader, ASkippedValueIsNotShownButStillBounded) {
  Recorder r;
  ASSERT_EQ(r.parse(R"({"skip": {"x": [1, {"fail": "fail"}]}, "y": 2})"), "");
  EXPECT_EQ(r.events, (std::vector<std::string>{":={", "/#0:y=2", "close tag 0"}));
  Limits l;
  l.max_depth = 3;
  Recorder deep(l);
  EXPECT_EQ(deep.parse(R"({"skip": [[[1]]]})"), "nested deeper than 3 levels");
  EXPECT_EQ(deep.parse(R"({"skip": [[1]]})"), "");
  l.max_string = 4;
  Recorder strings(l);
  EXPECT_EQ(strings.parse(R"({"skip": ["12345"]})"), "a string of 5 bytes (at most 4)");
}

TEST(JsonReader, BoundsAndTheRoot) {
  Limits l;
  l.max_key = 3;
  EXPECT_EQ(Recorder(l).parse(R"({"abcd": 1})"), "a key of 4 bytes (at most 3)");
  l = Limits();
  l.max_kept = 5;
  EXPECT_NE(Recorder(l).parse(R"({"a": "abc", "b": "abc"})").find("more than"), std::string::npos);
  EXPECT_EQ(Recorder(l).parse(R"({"a": "abc", "b": "ab"})"), "");
  EXPECT_EQ(Recorder().parse("[1]"), "the document is an array, not an object");
  EXPECT_EQ(Recorder().parse("7"), "the document is an integer, not an object");
  l = Limits();
  l.any_root = true;
  EXPECT_EQ(Recorder(l).parse("[1]"), "");
  EXPECT_EQ(Recorder(l).parse("\"s\""), "");
}

TEST(JsonReader, AStopReplacesADeferredProblemAndTheFirstDeferredStays) {
  Recorder r;
  EXPECT_EQ(r.parse(R"({"a": "defer", "b": "defer"})"), "deferred at /#0:a");
  EXPECT_EQ(r.parse(R"({"a": "defer", "b": "fail"})"), "failed at /#0:b");
  const std::string bad = r.parse(R"({"a": "defer", "b": )");
  EXPECT_EQ(bad.rfind("not valid JSON at byte", 0), 0u) << bad;
  EXPECT_EQ(r.parse(R"({"a": "fine"})"), "") << "a reader parses again from a clean state";
  EXPECT_NE(Recorder().parse("{\"a\": \"\xff\"}").find("not valid JSON"), std::string::npos);
  EXPECT_NE(Recorder().parse("").find("not valid JSON"), std::string::npos);
  EXPECT_NE(Recorder().parse("{} {}").find("not valid JSON"), std::string::npos);
}

TEST(JsonReader, DeepTextIsRefusedInTimeLinearInIt) {
  const std::string deep = "{\"a\":" + std::string(1 << 20, '[');
  Recorder r;
  EXPECT_EQ(r.parse(deep), "nested deeper than 64 levels");
}

// A long key is copied once however many containers sit under it: 100k
// arrays under a 1 MiB key parse in time linear in the text (copying the
// key into each would be 100 GB of copies).
TEST(JsonReader, ALongKeyIsNotCopiedPerContainer) {
  std::string text = "{\"" + std::string(1 << 20, 'k') + "\": [";
  for (int i = 0; i < 100000; ++i) text += i ? ",[]" : "[]";
  text += "]}";
  struct Counter : JsonReader {  // asks key() at every event, as readers do
    Counter() : JsonReader(Limits()) {}
    size_t events = 0, key_bytes = 0;
    int on_open(bool) override {
      ++events;
      key_bytes += key().size();
      return 0;
    }
    void on_scalar(const Scalar&) override { ++events; }
    void on_close(const Frame&) override { ++events; }
  } r;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(r.parse(text), "");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  EXPECT_EQ(r.events, 2u + 2 * 100000u + 2u);
  EXPECT_EQ(r.key_bytes, size_t{100001} << 20) << "key() inside the array is the array's key";
}

// A token is bounded while it is read, not after nlohmann has buffered it.
TEST(JsonReader, ATokenIsBoundedWhileItIsRead) {
  Limits l;
  l.max_string = 100;
  l.max_key = 100;
  const std::string number = "{\"a\": " + std::string(1 << 20, '7') + "}";
  EXPECT_EQ(Recorder(l).parse(number).rfind("a token longer than 4696 bytes", 0), 0u) << Recorder(l).parse(number);
  const std::string text = "{\"a\": \"" + std::string(1 << 20, 's') + "\"}";
  std::FILE* f = std::tmpfile();
  std::fwrite(text.data(), 1, text.size(), f);
  std::rewind(f);
  Recorder r(l);
  EXPECT_EQ(r.parse(f).rfind("a token longer than", 0), 0u);
  std::fclose(f);
  l.max_token = 200;
  EXPECT_EQ(Recorder(l).parse("{\"a\": \"" + std::string(100, 's') + "\"}"), "") << "an escaped string may be longer";
}

// "-0" is written with a minus: not a non-negative integer.
TEST(JsonReader, MinusZeroIsNegative) {
  Recorder r;
  ASSERT_EQ(r.parse("{\"a\": -0, \"b\": 0}"), "");
  EXPECT_EQ(r.events[1], "/#0:a=0");
  struct Sign : JsonReader {
    Sign() : JsonReader(Limits()) {}
    std::vector<bool> negative;
    int on_open(bool) override { return 0; }
    void on_scalar(const Scalar& v) override { negative.push_back(v.negative()); }
  } sign;
  ASSERT_EQ(sign.parse("{\"a\": -0, \"b\": 0, \"c\": -5}"), "");
  EXPECT_EQ(sign.negative, (std::vector<bool>{true, false, true}));
}

TEST(ParseValue, BuildsTheWholeDocumentWithinItsBounds) {
  Limits l;
  l.any_root = true;
  std::string error;
  const auto v = tdist::json::parse_value(R"([{"params": ["a", "b"], "lr": 0.5, "n": -3, "big": 18446744073709551615}])", l, error);
  ASSERT_EQ(error, "");
  EXPECT_EQ(v, nlohmann::json::parse(R"([{"params": ["a", "b"], "lr": 0.5, "n": -3, "big": 18446744073709551615}])"));
  EXPECT_EQ(tdist::json::parse_value("3", l, error), nlohmann::json(3));
  l.max_kept = 200;
  std::string many = "[";
  for (int i = 0; i < 100; ++i) many += i ? ",{}" : "{}";
  EXPECT_TRUE(tdist::json::parse_value(many + "]", l, error).is_null());
  EXPECT_NE(error.find("more than"), std::string::npos) << error;
  l.max_depth = 2;
  l.max_kept = SIZE_MAX;
  tdist::json::parse_value("[[[]]]", l, error);
  EXPECT_EQ(error, "nested deeper than 2 levels");
}

}  // namespace
