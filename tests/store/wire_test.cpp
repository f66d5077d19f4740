// The TCPStore frame parser: round trips, every way a frame can be short,
// and limits enforced before the payload arrives.
#include <gtest/gtest.h>

#include "store/wire.h"

namespace wire = tdist::wire;
using tdist::Bytes;

namespace {

wire::Message sample() {
  wire::Message m;
  m.kind = static_cast<uint8_t>(wire::Op::kMultiSet);
  m.number = -1234567890123LL;
  m.keys = {"a", "key/with/slashes", std::string("nul\0inside", 10)};
  m.values = {Bytes{}, Bytes{1, 2, 3}, Bytes(1000, 7)};
  return m;
}

TEST(Wire, RoundTrip) {
  std::string f;
  wire::encode_frame(sample(), &f);
  wire::Message out;
  auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size(), {}, true, &out);
  ASSERT_EQ(r.status, wire::ParseStatus::kOk) << r.error;
  EXPECT_EQ(r.consumed, f.size());
  EXPECT_EQ(out.kind, sample().kind);
  EXPECT_EQ(out.number, sample().number);
  EXPECT_EQ(out.keys, sample().keys);
  EXPECT_EQ(out.values, sample().values);
}

TEST(Wire, EveryPrefixNeedsMoreAndNeverMisparses) {
  std::string f;
  wire::encode_frame(sample(), &f);
  for (size_t n = 0; n < f.size(); ++n) {
    wire::Message out;
    auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), n, {}, true, &out);
    EXPECT_EQ(r.status, wire::ParseStatus::kNeedMore) << "prefix of " << n << " bytes";
  }
}

TEST(Wire, TwoFramesBackToBack) {
  std::string f;
  wire::encode_frame(sample(), &f);
  const size_t first = f.size();
  wire::Message ping;
  ping.kind = static_cast<uint8_t>(wire::Op::kPing);
  wire::encode_frame(ping, &f);
  wire::Message out;
  auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size(), {}, true, &out);
  ASSERT_EQ(r.status, wire::ParseStatus::kOk);
  EXPECT_EQ(r.consumed, first);
  r = wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()) + first, f.size() - first, {}, true, &out);
  ASSERT_EQ(r.status, wire::ParseStatus::kOk);
  EXPECT_EQ(out.kind, ping.kind);
}

TEST(Wire, OversizedFrameIsRejectedFromItsHeaderAlone) {
  const uint8_t header[4] = {0xff, 0xff, 0xff, 0x7f};
  wire::Message out;
  auto r = wire::parse_frame(header, 4, {}, true, &out);
  EXPECT_EQ(r.status, wire::ParseStatus::kBad);
  EXPECT_NE(r.error.find("over the limit"), std::string::npos);
}

TEST(Wire, LimitsOnKeysAndValues) {
  tdist::TCPStoreLimits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  wire::Message m;
  m.kind = static_cast<uint8_t>(wire::Op::kSet);
  m.keys = {"123456789"};
  m.values = {Bytes(4)};
  std::string f;
  wire::encode_frame(m, &f);
  wire::Message out;
  auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size(), limits, true, &out);
  EXPECT_EQ(r.status, wire::ParseStatus::kBad);
  EXPECT_NE(r.error.find("key of 9 bytes"), std::string::npos) << r.error;
  m.keys = {"short"};
  m.values = {Bytes(17)};
  f.clear();
  wire::encode_frame(m, &f);
  r = wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size(), limits, true, &out);
  EXPECT_EQ(r.status, wire::ParseStatus::kBad);
  EXPECT_NE(r.error.find("over the limit of 16"), std::string::npos) << r.error;
}

TEST(Wire, RequestsMustHaveTheFieldsTheirOpNeeds) {
  struct Case {
    wire::Op op;
    size_t keys, values;
    bool ok;
  };
  const Case cases[] = {
      {wire::Op::kSet, 1, 1, true},       {wire::Op::kSet, 1, 0, false},  {wire::Op::kSet, 2, 2, false},
      {wire::Op::kGet, 3, 0, true},       {wire::Op::kGet, 0, 0, false},  {wire::Op::kCompareSet, 1, 2, true},
      {wire::Op::kCompareSet, 1, 1, false}, {wire::Op::kMultiSet, 2, 2, true}, {wire::Op::kMultiSet, 2, 1, false},
      {wire::Op::kNumKeys, 0, 0, true},   {wire::Op::kNumKeys, 1, 0, false}, {wire::Op::kAuth, 0, 2, true},
  };
  for (const auto& c : cases) {
    wire::Message m;
    m.kind = static_cast<uint8_t>(c.op);
    for (size_t i = 0; i < c.keys; ++i) m.keys.push_back("k" + std::to_string(i));
    for (size_t i = 0; i < c.values; ++i) m.values.push_back(Bytes{1});
    std::string f;
    wire::encode_frame(m, &f);
    wire::Message out;
    auto r = wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size(), {}, true, &out);
    EXPECT_EQ(r.status == wire::ParseStatus::kOk, c.ok)
        << wire::op_name(m.kind) << " with " << c.keys << " keys, " << c.values << " values: " << r.error;
  }
}

TEST(Wire, UnknownOpAndEmptyKeyAreBadRequests) {
  wire::Message m;
  m.kind = 0;
  std::string f;
  wire::encode_frame(m, &f);
  wire::Message out;
  EXPECT_EQ(wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size(), {}, true, &out).status,
            wire::ParseStatus::kBad);
  // Replies have no op to check.
  EXPECT_EQ(wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size(), {}, false, &out).status,
            wire::ParseStatus::kOk);
  m.kind = static_cast<uint8_t>(wire::Op::kDelete);
  m.keys = {""};
  f.clear();
  wire::encode_frame(m, &f);
  EXPECT_EQ(wire::parse_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size(), {}, true, &out).status,
            wire::ParseStatus::kBad);
}

}  // namespace
