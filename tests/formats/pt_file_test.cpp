// .pt files: every dtype round-trips bit for bit; nested values round-trip
// through the pickle; the zip is the format's (64-byte aligned data, the
// records torch.save writes, zip64 past 4 GiB or when forced); Python's
// torch.load (1.13 in /usr/bin/python3, 2.x in .venv) reads our files, and
// we read torch.save's (state dicts, parameters, bf16, views sharing a
// storage); damaged, truncated or forbidden files are CheckpointErrors
// naming the file and the problem; an unfinished save leaves the old file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_tree.h"
#include "formats/file_io.h"
#include "formats/pt_file.h"
#include "formats/zip_format.h"
#include "tdist/errors.h"
#include "tdist/sharded_checkpoint.h"
#include "tests/util/damage.h"
#include "tests/util/process.h"
#include "tests/util/paths.h"

namespace {

using tdist::CheckpointError;
using tdist::checkpoint::PtReader;
using tdist::checkpoint::PtTensorRef;
using tdist::checkpoint::PtValue;
using tdist::checkpoint::PtWriter;
namespace zip = tdist::checkpoint::zip;
namespace test = tdist::test;
using Json = nlohmann::json;

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

PtTensorRef ref_of(const std::string& key, const at::Tensor& t, bool parameter = false, bool requires_grad = false) {
  PtTensorRef r;
  r.storage_key = key;
  r.dtype = t.scalar_type();
  r.storage_numel = t.numel();
  r.sizes = t.sizes().vec();
  r.strides = at::empty(t.sizes()).strides().vec();  // contiguous
  r.parameter = parameter;
  r.requires_grad = requires_grad;
  return r;
}

std::vector<std::pair<std::string, at::Tensor>> every_dtype() {
  torch::manual_seed(11);
  at::Tensor f32 = torch::randn({3, 4});
  f32[0][0] = std::numeric_limits<float>::quiet_NaN();
  f32[0][1] = -0.0f;
  return {{"f32", f32},
          {"f64", torch::randn({5}, torch::kDouble)},
          {"f16", torch::randn({2, 3}).to(torch::kHalf)},
          {"bf16", torch::randn({4, 2}).to(torch::kBFloat16)},
          {"i64", torch::randint(-1000000, 1000000, {6}, torch::kLong) * 1000000},
          {"i32", torch::randint(-1000, 1000, {2, 2}, torch::kInt)},
          {"i16", torch::randint(-1000, 1000, {3}, torch::kShort)},
          {"i8", torch::randint(-100, 100, {7}, torch::kChar)},
          {"u8", torch::randint(0, 255, {1, 1, 3}, torch::kByte)},
          {"bool", torch::rand({5}) > 0.5},
          {"scalar", torch::tensor(3.5)},
          {"empty", torch::zeros({0, 4})},
          {"transposed", torch::arange(12, torch::kFloat).view({3, 4}).t()}};
}

// Writes name -> tensor as a dict, storages "0", "1", ...
void save_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  std::vector<std::pair<std::string, PtValue>> extra = {}) {
  std::vector<std::pair<std::string, PtValue>> entries;
  for (size_t i = 0; i < tensors.size(); ++i) {
    entries.emplace_back(tensors[i].first, PtValue::tensor(ref_of(std::to_string(i), tensors[i].second)));
  }
  for (auto& e : extra) entries.push_back(std::move(e));
  PtWriter w(path);
  w.begin(PtValue::dict(std::move(entries)));
  for (size_t i = 0; i < tensors.size(); ++i) w.write_storage(std::to_string(i), tensors[i].second);
  w.finish();
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() &&
         (x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0);
}

TEST(PtFile, EveryDtypeRoundTripsBitForBit) {
  test::TempDir dir;
  const std::string path = dir.path() + "/a.pt";
  const auto saved = every_dtype();
  save_tensors(path, saved);
  PtReader r(path);
  const auto& entries = r.root().entries();
  ASSERT_EQ(entries.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_EQ(entries[i].first, saved[i].first);
    const PtTensorRef& ref = entries[i].second.as_tensor();
    EXPECT_EQ(ref.storage_key, std::to_string(i));
    const at::Tensor got = r.read_tensor(ref);
    EXPECT_TRUE(same_bytes(got, saved[i].second)) << saved[i].first;
    EXPECT_FALSE(got.requires_grad());
    EXPECT_EQ(r.storage_bytes(ref.storage_key), saved[i].second.nbytes());
  }
  // The first bytes of a storage alone.
  float first[2];
  r.read_storage_into("0", first, sizeof first);
  EXPECT_EQ(std::memcmp(first, saved[0].second.data_ptr(), sizeof first), 0);
}

TEST(PtFile, StoragesAreWrittenInPieces) {
  test::TempDir dir;
  const std::string path = dir.path() + "/pieces.pt";
  const at::Tensor t = torch::arange(1000, torch::kLong);
  PtWriter w(path, "pieces");
  w.begin(PtValue::list({PtValue::tensor(ref_of("s0", t, true, true))}));
  const char* p = static_cast<const char*>(t.data_ptr());
  w.begin_storage("s0");
  w.append(p, 3);
  w.append(p + 3, 4000);
  EXPECT_THROW(w.end_storage(), tdist::UsageError) << "short";
  w.append(p + 4003, 3997);
  EXPECT_THROW(w.append(p, 1), tdist::UsageError) << "past its size";
  w.end_storage();
  w.finish();
  PtReader r(path);
  const PtTensorRef& ref = r.root().items().at(0).as_tensor();
  EXPECT_TRUE(ref.parameter);
  EXPECT_TRUE(ref.requires_grad);
  EXPECT_TRUE(torch::equal(r.read_tensor(ref), t));
}

PtValue nested_values() {
  return PtValue::dict(
      {{"ints", PtValue::list({PtValue::integer(0), PtValue::integer(255), PtValue::integer(256),
                               PtValue::integer(65535), PtValue::integer(65536), PtValue::integer(-1),
                               PtValue::integer(INT32_MAX), PtValue::integer(int64_t{INT32_MAX} + 1),
                               PtValue::integer(INT32_MIN), PtValue::integer(int64_t{INT32_MIN} - 1),
                               PtValue::integer(-128), PtValue::integer(-129), PtValue::integer(INT64_MAX),
                               PtValue::integer(INT64_MIN), PtValue::integer(int64_t{1} << 40)})},
       {"floats", PtValue::tuple({PtValue::floating(0.001), PtValue::floating(-0.0), PtValue::floating(1e300),
                                  PtValue::floating(std::numeric_limits<double>::infinity()),
                                  PtValue::floating(std::numeric_limits<double>::quiet_NaN()),
                                  PtValue::floating(std::numeric_limits<double>::denorm_min())})},
       {"strings", PtValue::list({PtValue::string(""), PtValue::string("tdist \xe2\x9c\x93"),
                                  PtValue::string(std::string(300, 'x'))})},
       {"tuples", PtValue::tuple({PtValue::tuple({}), PtValue::tuple({PtValue::none()}),
                                  PtValue::tuple({PtValue::boolean(true), PtValue::boolean(false)}),
                                  PtValue::tuple({PtValue::integer(1), PtValue::integer(2), PtValue::integer(3)}),
                                  PtValue::tuple({PtValue::integer(1), PtValue::integer(2), PtValue::integer(3),
                                                  PtValue::integer(4)})})},
       {"empty", PtValue::dict({})},
       {"deep", PtValue::dict({{"a", PtValue::list({PtValue::dict({{"b", PtValue::list({})}})})}})},
       {"none", PtValue::none()}});
}

TEST(PtFile, NestedValuesRoundTrip) {
  const PtValue v = nested_values();
  EXPECT_EQ(tdist::checkpoint::unpickle_value(tdist::checkpoint::pickle_value(v)), v);
  // Past 1000 items the pickler batches.
  std::vector<PtValue> many;
  std::vector<std::pair<std::string, PtValue>> keys;
  for (int i = 0; i < 2500; ++i) {
    many.push_back(PtValue::integer(i * 7919));
    keys.emplace_back("k" + std::to_string(i), PtValue::integer(i));
  }
  const PtValue big = PtValue::tuple({PtValue::list(many), PtValue::dict(keys)});
  EXPECT_EQ(tdist::checkpoint::unpickle_value(tdist::checkpoint::pickle_value(big)), big);
  test::TempDir dir;
  const std::string path = dir.path() + "/v.pt";
  PtWriter w(path);
  w.begin(v);
  w.finish();
  EXPECT_EQ(PtReader(path).root(), v);
  EXPECT_NE(v, PtValue::dict({}));
  EXPECT_EQ(v.at("ints").items().at(13).as_int(), INT64_MIN);
  EXPECT_THROW(v.at("nope"), CheckpointError);
  EXPECT_THROW(v.at("ints").as_string(), CheckpointError);
}

TEST(PtFile, TheZipIsTheFormats) {
  test::TempDir dir;
  const std::string path = dir.path() + "/layout.pt";
  save_tensors(path, {{"a", torch::ones({3})}, {"b", torch::arange(5, torch::kShort)}});
  const std::string bytes = slurp(path);
  ASSERT_EQ(bytes.substr(0, 4), std::string("PK\x03\x04", 4));
  const auto entries = zip::read_directory(
      [&](uint64_t off, void* out, size_t n) { std::memcpy(out, bytes.data() + off, n); }, bytes.size());
  std::vector<std::string> names;
  for (const auto& e : entries) {
    names.push_back(e.name);
    EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
    EXPECT_EQ(e.crc, tdist::checkpoint::crc32(0, bytes.data() + e.data_offset, e.size)) << e.name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"archive/data.pkl", "archive/byteorder", "archive/data/0",
                                             "archive/data/1", "archive/version"}));
  EXPECT_EQ(bytes.substr(entries[1].data_offset, entries[1].size), "little");
  EXPECT_EQ(bytes.substr(entries[4].data_offset, entries[4].size), "3\n");
  int16_t b[5];
  std::memcpy(b, bytes.data() + entries[3].data_offset, sizeof b);
  EXPECT_EQ(b[4], 4);
  EXPECT_EQ(bytes.find(std::string("PK\x06\x06", 4)), std::string::npos) << "no zip64 for a small file";
}

TEST(PtFile, Zip64WhenForced) {
  test::TempDir dir;
  const std::string path = dir.path() + "/z64.pt";
  zip::set_force_zip64_for_testing(true);
  save_tensors(path, every_dtype());
  zip::set_force_zip64_for_testing(false);
  const std::string bytes = slurp(path);
  EXPECT_NE(bytes.find(std::string("PK\x06\x06", 4)), std::string::npos);
  EXPECT_NE(bytes.find(std::string("PK\x06\x07", 4)), std::string::npos);
  PtReader r(path);
  const auto saved = every_dtype();
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_TRUE(same_bytes(r.read_tensor(r.root().at(saved[i].first).as_tensor()), saved[i].second));
  }
}

// A .pt file made of these records, each as given (the zip layer's bytes).
std::string make_zip(const std::vector<std::pair<std::string, std::string>>& records) {
  std::string out;
  std::vector<zip::Entry> entries;
  for (const auto& [name, data] : records) {
    zip::Entry e;
    e.name = name;
    e.header_offset = out.size();
    e.size = data.size();
    e.crc = tdist::checkpoint::crc32(0, data.data(), data.size());
    out += zip::local_header(name, out.size(), data.size(), e.crc, false);
    e.data_offset = out.size();
    out += data;
    entries.push_back(e);
  }
  return out + zip::central_directory(entries, out.size(), false);
}

// A record's data placed past 4 GiB in a sparse file: real zip64 offsets.
TEST(PtFile, Zip64PastFourGiB) {
  test::TempDir dir;
  const std::string path = dir.path() + "/sparse.pt";
  const at::Tensor t = torch::arange(6, torch::kInt).view({2, 3});
  const std::string pkl =
      tdist::checkpoint::pickle_value(PtValue::dict({{"t", PtValue::tensor(ref_of("0", t))}}));
  std::vector<zip::Entry> entries;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  const auto put = [&](const std::string& name, const std::string& data, uint64_t at) {
    zip::Entry e;
    e.name = name;
    e.header_offset = at;
    e.size = data.size();
    e.crc = tdist::checkpoint::crc32(0, data.data(), data.size());
    const std::string h = zip::local_header(name, at, data.size(), e.crc, false);
    ASSERT_EQ(::pwrite(fd, h.data(), h.size(), static_cast<off_t>(at)), static_cast<ssize_t>(h.size()));
    e.data_offset = at + h.size();
    ASSERT_EQ(::pwrite(fd, data.data(), data.size(), static_cast<off_t>(e.data_offset)),
              static_cast<ssize_t>(data.size()));
    entries.push_back(e);
  };
  put("sparse/data.pkl", pkl, 0);
  const uint64_t far = (uint64_t{5} << 30) + 7;
  put("sparse/data/0", std::string(static_cast<const char*>(t.data_ptr()), t.nbytes()), far);
  put("sparse/version", "3\n", far + 4096);
  const uint64_t cd_at = far + 8192;
  const std::string cd = zip::central_directory(entries, cd_at, false);
  ASSERT_EQ(::pwrite(fd, cd.data(), cd.size(), static_cast<off_t>(cd_at)), static_cast<ssize_t>(cd.size()));
  ::close(fd);
  PtReader r(path);
  EXPECT_TRUE(torch::equal(r.read_tensor(r.root().at("t").as_tensor()), t));
}

// ---- damaged and forbidden files ---------------------------------------------------

void expect_error(const std::string& path, const std::string& says, bool on_read = false) {
  try {
    PtReader r(path);
    if (on_read) {
      for (const auto& [k, v] : r.root().entries()) {
        if (v.kind() == PtValue::Kind::Tensor) r.read_tensor(v.as_tensor());
      }
    }
    ADD_FAILURE() << says << ": no error";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(PtFile, DamagedFilesAreNamed) {
  test::TempDir dir;
  const std::string good = dir.path() + "/good.pt", path = dir.path() + "/bad.pt";
  save_tensors(good, {{"a", torch::arange(100, torch::kFloat)}, {"b", torch::ones({2}, torch::kDouble)}});
  const std::string bytes = slurp(good);
  const auto entries = zip::read_directory(
      [&](uint64_t off, void* out, size_t n) { std::memcpy(out, bytes.data() + off, n); }, bytes.size());
  const auto find = [&](const std::string& name) {
    for (const auto& e : entries) {
      if (e.name == name) return e;
    }
    throw std::runtime_error("no " + name);
  };
  for (size_t cut : {size_t{0}, size_t{10}, bytes.size() / 2, bytes.size() - 1}) {
    spit(path, bytes.substr(0, cut));
    expect_error(path, "zip: ");
  }
  std::string b = bytes;
  ASSERT_NO_FATAL_FAILURE(test::flip_byte(b, find("archive/data/0").data_offset + 399));  // the last byte of a's data
  spit(path, b);
  expect_error(path, "record 'archive/data/0' is corrupt", true);
  {
    PtReader r(path);  // b still reads, and a's first bytes do not hide the damage
    EXPECT_TRUE(torch::equal(r.read_tensor(r.root().at("b").as_tensor()), torch::ones({2}, torch::kDouble)));
    float first[4];
    EXPECT_THROW(r.read_storage_into("0", first, sizeof first), CheckpointError);
    EXPECT_THROW(r.read_storage_into("0", first, 401), CheckpointError) << "past its size";
    EXPECT_THROW(r.storage_bytes("7"), CheckpointError);
  }
  b = bytes;
  ASSERT_NO_FATAL_FAILURE(test::flip_byte(b, find("archive/data.pkl").data_offset + 20, 0x10));
  spit(path, b);
  expect_error(path, "record 'archive/data.pkl' is corrupt");
  b = bytes;
  ASSERT_NO_FATAL_FAILURE(test::flip_byte(b, bytes.rfind(std::string("PK\x01\x02", 4)) + 16));  // the CRC of version in the directory
  spit(path, b);
  expect_error(path, "record 'archive/version' is corrupt");
  // A record renamed in the directory and its local header: missing.
  b = bytes;
  for (size_t at = 0; (at = b.find("archive/data/1", at)) != std::string::npos;) b[at + 13] = '9';
  spit(path, b);
  expect_error(path, "no record 'archive/data/1'");
}

// An optimizer's state_dict keys its parameters by int: such a dict reads
// with its keys as decimal strings, knows they were ints, and pickles them
// as ints again (Python's load_state_dict looks them up by int).
TEST(PtFile, IntKeysReadAsStringsAndPickleAsInts) {
  using tdist::checkpoint::PtValue;
  const PtValue d = PtValue::int_keyed_dict({{0, PtValue::floating(1.5)}, {70000, PtValue::none()}});
  const std::string p = tdist::checkpoint::pickle_value(d);
  EXPECT_NE(p.find('K'), std::string::npos);           // BININT1 0
  EXPECT_EQ(p.find("70000"), std::string::npos);       // not as a string
  const PtValue back = tdist::checkpoint::unpickle_value(p);
  EXPECT_TRUE(back.int_keys());
  ASSERT_NE(back.find("70000"), nullptr);
  EXPECT_EQ(back, d);
  const PtValue mixed = tdist::checkpoint::unpickle_value(std::string("\x80\x02}(K\x01N\x58\x01\0\0\0aNu.", 16));
  EXPECT_FALSE(mixed.int_keys());
  EXPECT_NE(mixed.find("1"), nullptr);
}

TEST(PtFile, ForbiddenContentIsNamed) {
  test::TempDir dir;
  const std::string path = dir.path() + "/bad.pt";
  const std::string four(4, '\0');
  const std::string tensor_pkl = tdist::checkpoint::pickle_value(
      PtValue::dict({{"t", PtValue::tensor(ref_of("0", torch::zeros({1})))}}));
  struct Case {
    std::string what;
    std::vector<std::pair<std::string, std::string>> records;
    std::string says;
  };
  std::string too_long = tensor_pkl;  // numel 1 -> size (2,)
  too_long.replace(too_long.find("K\x01\x85"), 3, std::string("K\x02\x85", 3));
  std::string wrong_numel = tensor_pkl;  // the persistent id's numel 1 -> 2
  wrong_numel.replace(wrong_numel.find("cpuK\x01"), 5, std::string("cpuK\x02", 5));
  std::string complex = tensor_pkl;
  complex.replace(complex.find("FloatStorage"), 12, "ComplexFloatStorage");
  const std::vector<Case> cases = {
      {"os.system", {{"x/data.pkl", std::string("\x80\x02\x63os\nsystem\n.", 14)}}, "global 'os.system'"},
      {"text opcode", {{"x/data.pkl", "\x80\x02I1\n."}}, "opcode 0x49"},
      {"unknown dtype", {{"x/data.pkl", complex}, {"x/data/0", four}}, "global 'torch.ComplexFloatStorage'"},
      {"view past the storage", {{"x/data.pkl", too_long}, {"x/data/0", four}}, "view reaches element 1"},
      {"record shorter than its storage", {{"x/data.pkl", wrong_numel}, {"x/data/0", four}}, "needs 8"},
      {"storage missing", {{"x/data.pkl", tensor_pkl}}, "no record 'x/data/0'"},
      {"no data.pkl", {{"x/data/0", four}}, "no record 'x/data.pkl'"},
      {"two folders", {{"x/data.pkl", tensor_pkl}, {"y/data/0", four}}, "not in the folder 'x'"},
      {"two of a name", {{"x/data.pkl", tensor_pkl}, {"x/data.pkl", tensor_pkl}}, "two records are named"},
      {"bad version", {{"x/data.pkl", tensor_pkl}, {"x/data/0", four}, {"x/version", "99\n"}}, "version record"},
      {"big-endian", {{"x/data.pkl", tensor_pkl}, {"x/data/0", four}, {"x/byteorder", "big"}}, "little-endian"},
      {"pickle cut short", {{"x/data.pkl", tensor_pkl.substr(0, 30)}}, "truncated"},
      {"float key", {{"x/data.pkl", std::string("\x80\x02}G\x3f\xf0\0\0\0\0\0\0K\x02s.", 17)}}, "string or int keys"},
  };
  for (const Case& c : cases) {
    spit(path, make_zip(c.records));
    SCOPED_TRACE(c.what);
    expect_error(path, c.says);
  }
  std::string stored = make_zip({{"x/data.pkl", tensor_pkl}});
  // Method 8 (deflated) where the writer put 0 (stored), in the local header and the directory.
  const size_t local_method = 8, directory_method = stored.find(std::string("PK\x01\x02", 4)) + 10;
  ASSERT_EQ(stored[local_method], 0);
  ASSERT_EQ(stored[directory_method], 0);
  stored[local_method] = 8;
  stored[directory_method] = 8;
  spit(path, stored);
  expect_error(path, "is compressed");
  expect_error(dir.path() + "/missing.pt", "cannot open");
}

// Views that name an element twice (a stride of 0, overlapping strides)
// would turn a few bytes of file into a tensor of any size: refused,
// naming the file, before anything is allocated, by PtReader::read_tensor
// and so by load_consolidated_checkpoint. Views that name each element
// once (transposed, offset, a slice) still read.
TEST(PtFile, ViewsThatRepeatElementsAreRefusedBeforeAllocating) {
  test::TempDir dir;
  const std::string path = dir.path() + "/views.pt";
  struct Case {
    std::vector<int64_t> sizes, strides;
    int64_t storage_numel, offset;
    std::string says;  // "" when it reads
  };
  const std::vector<Case> cases = {
      {{32768, 32768}, {0, 0}, 1, 0, "stride 0"},             // 4 GiB from 4 bytes
      {{1 << 20, 1 << 18}, {1, 0}, 1 << 20, 0, "stride 0"},    // 1 TiB from 4 MiB
      {{3, 1 << 30}, {1, 0}, 3, 0, "stride 0"},
      {{4, 4}, {1, 1}, 7, 0, "overlap"},
      {{2, 3, 2}, {6, 1, 2}, 12, 0, "overlap"},
      {{4, 3}, {1, 4}, 12, 0, ""},   // transposed
      {{2, 2}, {3, 1}, 8, 2, ""},    // a slice at an offset
      {{5, 1}, {1, 0}, 5, 0, ""},    // stride 0 on a dimension of 1 repeats nothing
      {{0, 7}, {0, 0}, 0, 0, ""},    // empty
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(tdist::checkpoint::shape_string(c.sizes));
    PtTensorRef ref;
    ref.storage_key = "0";
    ref.dtype = at::kFloat;
    ref.storage_numel = c.storage_numel;
    ref.storage_offset = c.offset;
    ref.sizes = c.sizes;
    ref.strides = c.strides;
    const std::string pkl = tdist::checkpoint::pickle_value(
        PtValue::dict({{"model", PtValue::dict({{"w", PtValue::tensor(ref)}})}}));
    const at::Tensor storage = torch::arange(c.storage_numel, torch::kFloat);
    spit(path, make_zip({{"x/data.pkl", pkl},
                         {"x/data/0", std::string(static_cast<const char*>(storage.data_ptr()), storage.nbytes())}}));
    if (c.says.empty()) {
      const auto got = tdist::load_consolidated_checkpoint(path).model["w"];
      EXPECT_TRUE(torch::equal(got, storage.as_strided(c.sizes, c.strides, c.offset)));
      continue;
    }
    const PtReader r(path);  // the file opens (the view stays inside its storage)...
    const auto refused = [&](const std::function<void()>& read) {
      try {
        read();
        ADD_FAILURE() << "read";
      } catch (const CheckpointError& e) {
        EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      }
    };
    refused([&] { r.read_tensor(r.root().at("model").at("w").as_tensor()); });  // ...but its tensor is not read
    refused([&] { tdist::load_consolidated_checkpoint(path); });
  }
}

// A storage the pickle names many times (as its memo can, for free) is
// read once: the tensors share it, so a small file cannot fill memory
// with copies of one record.
TEST(PtFile, AStorageNamedManyTimesIsReadOnce) {
  test::TempDir dir;
  const std::string path = dir.path() + "/many.pt";
  const at::Tensor t = torch::arange(1 << 18, torch::kFloat);  // 1 MiB
  std::vector<std::pair<std::string, PtValue>> model;
  for (int i = 0; i < 64; ++i) model.emplace_back("w" + std::to_string(i), PtValue::tensor(ref_of("0", t)));
  const std::string pkl = tdist::checkpoint::pickle_value(PtValue::dict({{"model", PtValue::dict(std::move(model))}}));
  spit(path, make_zip({{"x/data.pkl", pkl}, {"x/data/0", std::string(static_cast<const char*>(t.data_ptr()), t.nbytes())}}));
  const auto got = tdist::load_consolidated_checkpoint(path).model;
  ASSERT_EQ(got.size(), 64u);
  for (const auto& item : got) {
    EXPECT_TRUE(torch::equal(item.value(), t)) << item.key();
    EXPECT_EQ(item.value().data_ptr(), got["w0"].data_ptr()) << item.key() << " is a copy of its own";
  }
}

TEST(PtFile, AnUnfinishedSaveLeavesTheOldFile) {
  test::TempDir dir;
  const std::string path = dir.path() + "/d.pt";
  save_tensors(path, {{"x", torch::ones({3})}});
  const auto check_old = [&] {
    PtReader r(path);
    EXPECT_TRUE(torch::equal(r.read_tensor(r.root().at("x").as_tensor()), torch::ones({3})));
  };
  {
    const at::Tensor z = torch::zeros({3});
    PtWriter w(path);
    EXPECT_THROW(w.write_storage("0", z), tdist::UsageError) << "before begin";
    w.begin(PtValue::dict({{"x", PtValue::tensor(ref_of("0", z))}, {"y", PtValue::tensor(ref_of("1", z))}}));
    EXPECT_THROW(w.write_storage("1", z), tdist::UsageError) << "not the next";
    EXPECT_THROW(w.write_storage("0", torch::zeros({3}, torch::kInt)), tdist::UsageError) << "wrong dtype";
    w.write_storage("0", z);
    EXPECT_THROW(w.finish(), tdist::UsageError) << "1 was never written";
  }
  check_old();
  {
    PtWriter w(path);
    const at::Tensor v = torch::zeros({4}).narrow(0, 1, 2);
    PtTensorRef view = ref_of("0", v);
    view.storage_offset = 1;
    view.storage_numel = 4;
    EXPECT_THROW(w.begin(PtValue::tensor(view)), tdist::UsageError) << "a view is not written";
    const PtValue twice = PtValue::list({PtValue::tensor(ref_of("0", v)), PtValue::tensor(ref_of("0", v))});
    EXPECT_THROW(w.begin(twice), tdist::UsageError) << "one storage, two tensors";
    EXPECT_THROW(w.begin(PtValue::tensor(ref_of("a/b", v))), tdist::UsageError) << "a key with a slash";
  }
  check_old();
  // Made before the fork: the child calls nothing of ATen (a fill in a
  // forked child can wait forever on the parent's OpenMP pool).
  const at::Tensor big = torch::zeros({1 << 20});
  const pid_t pid = fork();
  if (pid == 0) {
    PtWriter w(path);
    w.begin(PtValue::dict({{"x", PtValue::tensor(ref_of("0", big))}}));
    w.begin_storage("0");
    w.append(big.data_ptr(), big.nbytes() / 2);
    raise(SIGKILL);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status));
  check_old();
}

// ---- against Python's torch ---------------------------------------------------------

const std::string kCheck = tdist::test::source_dir() + "/tests/checkpoint/pt_check.py";

struct Python {
  std::string name, interpreter;
};

std::vector<Python> pythons() {
  // Debian's python3-torch (scripts/install-deps.sh installs it) and the
  // .venv's torch 2.x (scripts/python-ref.sh makes it importable).
  return {{"torch 1.13 (/usr/bin/python3)", "/usr/bin/python3"},
          {"torch 2.x (.venv)", tdist::test::source_dir() + "/.venv/bin/python"}};
}

// Why this Python cannot run the checks ("" when it can).
std::string unavailable(const Python& py) {
  const auto r = test::run_command(py.interpreter + " -c 'import torch' 2>&1", std::chrono::seconds(120));
  if (test::exited_ok(r.status)) return "";
  return py.name + " cannot import torch: " + r.output.substr(r.output.size() > 300 ? r.output.size() - 300 : 0);
}

std::string run_python(const Python& py, const std::string& args) {
  const auto r = test::run_command(py.interpreter + " " + kCheck + " " + args + " 2>&1", std::chrono::seconds(120));
  if (!test::exited_ok(r.status)) throw std::runtime_error(py.name + ": pt_check.py " + args + " failed:\n" + r.output);
  return r.output;
}

Json tagged(const std::string& tag, Json v) {
  Json j = Json::object();
  j[tag] = std::move(v);
  return j;
}

Json dict_of(const std::vector<std::pair<std::string, Json>>& entries) {
  Json a = Json::array();
  for (const auto& [k, v] : entries) a.push_back(Json::array({Json(k), v}));
  return tagged("dict", a);
}

// What pt_check.py prints for a tensor.
Json described(const at::Tensor& t, bool param = false, bool requires_grad = false) {
  static const std::map<at::ScalarType, std::string> names = {
      {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"}, {at::kBFloat16, "bfloat16"},
      {at::kLong, "int64"},    {at::kInt, "int32"},      {at::kShort, "int16"},  {at::kChar, "int8"},
      {at::kByte, "uint8"},    {at::kBool, "bool"}};
  const at::Tensor c = t.contiguous().reshape({-1});
  Json values = Json::array();
  for (int64_t i = 0; i < c.numel(); ++i) {
    const at::Tensor x = c[i];
    if (t.scalar_type() == at::kBool) {
      values.push_back(x.item<bool>());
    } else if (at::isFloatingType(t.scalar_type())) {
      values.push_back(x.item<double>());
    } else {
      values.push_back(x.item<int64_t>());
    }
  }
  return Json{{"tensor", names.at(t.scalar_type())}, {"shape", t.sizes().vec()}, {"values", values},
              {"param", param}, {"requires_grad", requires_grad}};
}

// Compares what Python saw with what was expected, on the fields given.
void expect_like(const Json& seen, const Json& want, const std::string& where) {
  if (want.is_object() && want.contains("tensor")) {
    for (const auto& [k, v] : want.items()) EXPECT_EQ(seen.value(k, Json()), v) << where << "." << k;
    return;
  }
  if (want.is_object() && (want.contains("dict") || want.contains("list") || want.contains("tuple"))) {
    const std::string tag = want.begin().key();
    ASSERT_TRUE(seen.is_object() && seen.contains(tag)) << where << ": " << seen.dump();
    ASSERT_EQ(seen[tag].size(), want[tag].size()) << where << ": " << seen.dump();
    for (size_t i = 0; i < want[tag].size(); ++i) {
      if (tag == "dict") {
        EXPECT_EQ(seen[tag][i][0], want[tag][i][0]) << where;
        expect_like(seen[tag][i][1], want[tag][i][1], where + "." + want[tag][i][0].get<std::string>());
      } else {
        expect_like(seen[tag][i], want[tag][i], where + "[" + std::to_string(i) + "]");
      }
    }
    return;
  }
  EXPECT_EQ(seen, want) << where;
}

TEST(PtFilePython, TorchLoadsOurFiles) {
  test::TempDir dir;
  const auto saved = every_dtype();
  // Float-free values: torch 1.13's weights_only unpickler has no BINFLOAT.
  const std::string plain = dir.path() + "/plain.pt", full = dir.path() + "/full.pt";
  const at::Tensor w = torch::arange(6, torch::kFloat).view({2, 3}), b = torch::tensor({1.0f, -1.0f});
  const PtValue plain_value = PtValue::dict(
      {{"model", PtValue::dict({{"w", PtValue::tensor(ref_of("w", w, true, true))},
                                {"b", PtValue::tensor(ref_of("b", b, true, false))}})},
       {"meta", PtValue::list({PtValue::integer(-3), PtValue::integer(int64_t{1} << 40), PtValue::string("x\xc3\xa9"),
                               PtValue::none(), PtValue::boolean(true),
                               PtValue::tuple({PtValue::integer(1), PtValue::tuple({})})})}});
  {
    PtWriter pw(plain, "plain");
    pw.begin(plain_value);
    pw.write_storage("w", w);
    pw.write_storage("b", b);
    pw.finish();
  }
  zip::set_force_zip64_for_testing(true);  // and all of its records in zip64 form
  save_tensors(full, saved, {{"lr", PtValue::floating(0.001)}, {"step", PtValue::integer(7)}});
  zip::set_force_zip64_for_testing(false);
  Json want_full = dict_of({});
  for (const auto& [name, t] : saved) want_full["dict"].push_back(Json::array({name, described(t)}));
  want_full["dict"].push_back(Json::array({"lr", tagged("float", "0x1.0624dd2f1a9fcp-10")}));
  want_full["dict"].push_back(Json::array({"step", tagged("int", 7)}));
  // NaN is not JSON: f32's values are checked below.
  want_full["dict"][0][1].erase("values");
  const Json want_plain = dict_of(
      {{"model", dict_of({{"w", described(w, true, true)}, {"b", described(b, true, false)}})},
       {"meta", tagged("list", Json::array({tagged("int", -3), tagged("int", int64_t{1} << 40),
                                            tagged("str", "x\xc3\xa9"), nullptr, tagged("bool", true),
                                            tagged("tuple", Json::array({tagged("int", 1),
                                                                         tagged("tuple", Json::array())}))}))}});
  int ran = 0;
  for (const Python& py : pythons()) {
    const std::string why = unavailable(py);
    if (!why.empty()) {
      ADD_FAILURE() << why;
      continue;
    }
    ++ran;
    SCOPED_TRACE(py.name);
    const Json p = Json::parse(run_python(py, "read " + plain));
    EXPECT_TRUE(p.at("weights_only").get<bool>()) << p.dump();
    expect_like(p.at("value"), want_plain, "plain");
    // Python's json writes NaN, which nlohmann reads only when told to; swap it first.
    std::string out = run_python(py, "read " + full);
    for (size_t at; (at = out.find("NaN")) != std::string::npos;) out.replace(at, 3, "null");
    const Json f = Json::parse(out);
    if (f.at("torch").get<std::string>().rfind("1.", 0) != 0) {
      EXPECT_TRUE(f.at("weights_only").get<bool>()) << "torch 2.x reads floats with weights_only";
    }
    expect_like(f.at("value"), want_full, "full");
    EXPECT_TRUE(f["value"]["dict"][0][1]["values"][0].is_null()) << "f32's NaN";
  }
  EXPECT_EQ(ran, static_cast<int>(pythons().size()));
}

TEST(PtFilePython, WeReadTorchSaveFiles) {
  int ran = 0;
  for (const Python& py : pythons()) {
    const std::string why = unavailable(py);
    if (!why.empty()) {
      ADD_FAILURE() << why;
      continue;
    }
    ++ran;
    SCOPED_TRACE(py.name);
    test::TempDir dir;
    const std::string path = dir.path() + "/theirs.pt";
    run_python(py, "write " + path);
    PtReader r(path);
    const PtValue& v = r.root();
    const auto read = [&](const PtValue& x) { return r.read_tensor(x.as_tensor()); };
    // The state dict of Sequential(Linear(3, 2), ReLU, Linear(2, 1)), parameter i = arange * 0.5 - i.
    const auto& model = v.at("model").entries();
    ASSERT_EQ(model.size(), 4u);
    const char* names[] = {"0.weight", "0.bias", "2.weight", "2.bias"};
    const std::vector<int64_t> shapes[] = {{2, 3}, {2}, {1, 2}, {1}};
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(model[static_cast<size_t>(i)].first, names[i]);
      int64_t n = 1;
      for (int64_t d : shapes[i]) n *= d;
      const at::Tensor want = torch::arange(n, torch::kFloat).reshape(shapes[i]) * 0.5 - i;
      EXPECT_TRUE(torch::equal(read(model[static_cast<size_t>(i)].second), want)) << names[i];
      EXPECT_FALSE(model[static_cast<size_t>(i)].second.as_tensor().parameter);
    }
    const PtTensorRef& param = v.at("param").as_tensor();
    EXPECT_TRUE(param.parameter);
    EXPECT_TRUE(param.requires_grad);
    EXPECT_TRUE(torch::equal(read(v.at("param")), torch::tensor({1.5f, -2.0f})));
    EXPECT_TRUE(v.at("frozen").as_tensor().parameter);
    EXPECT_FALSE(v.at("frozen").as_tensor().requires_grad);
    EXPECT_TRUE(torch::equal(read(v.at("bf16")), torch::tensor({1.0f, -2.0f, 0.25f}).to(torch::kBFloat16)));
    const at::Tensor base = torch::arange(12, torch::kFloat);
    EXPECT_TRUE(torch::equal(read(v.at("base")), base));
    const PtTensorRef& view = v.at("view").as_tensor();
    EXPECT_EQ(view.storage_key, v.at("base").as_tensor().storage_key) << "one storage, two tensors";
    EXPECT_EQ(view.storage_offset, 2);
    EXPECT_EQ(view.strides, (std::vector<int64_t>{1, 3}));
    EXPECT_TRUE(torch::equal(read(v.at("view")), base.slice(0, 2, 8).view({2, 3}).t()));
    EXPECT_TRUE(torch::equal(read(v.at("i64")), torch::tensor({-(int64_t{1} << 40), int64_t{7}})));
    EXPECT_TRUE(torch::equal(read(v.at("u8")), torch::arange(5, torch::kByte)));
    EXPECT_TRUE(torch::equal(read(v.at("bool")), torch::tensor({true, false, true})));
    const PtValue want_nested = PtValue::dict(
        {{"list", PtValue::list({PtValue::integer(1), PtValue::floating(2.5), PtValue::string("x"), PtValue::none(),
                                 PtValue::boolean(true),
                                 PtValue::tuple({PtValue::integer(3), PtValue::integer(-4),
                                                 PtValue::integer(int64_t{1} << 40)})})},
         {"tuple", PtValue::tuple({})},
         {"empty", PtValue::dict({})}});
    EXPECT_EQ(v.at("nested"), want_nested);
    EXPECT_EQ(v.at("step").as_int(), 7);
    EXPECT_EQ(v.at("lr").as_float(), 0.001);
    EXPECT_EQ(v.at("name").as_string(), "tdist \xe2\x9c\x93");
    // Their file damaged: a byte of data.pkl, then of base's storage.
    const std::string bytes = slurp(path);
    const auto entries = zip::read_directory(
        [&](uint64_t off, void* out, size_t n) { std::memcpy(out, bytes.data() + off, n); }, bytes.size());
    for (const auto& e : entries) {
      const bool pkl = e.name == "theirs/data.pkl";
      if (!pkl && e.name != "theirs/data/" + v.at("base").as_tensor().storage_key) continue;
      std::string b = bytes;
      ASSERT_NO_FATAL_FAILURE(test::flip_byte(b, e.data_offset + e.size / 2, 0x04));
      const std::string bad = dir.path() + "/bad.pt";
      spit(bad, b);
      expect_error(bad, "record '" + e.name + "' is corrupt", !pkl);
    }
  }
  EXPECT_EQ(ran, static_cast<int>(pythons().size()));
}

}  // namespace
