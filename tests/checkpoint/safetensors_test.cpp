// safetensors files: every dtype round-trips bit for bit; the bytes are the
// format's (length, space-padded JSON, data in order); a tensor is read
// alone; a crashed or unfinished save leaves the old file; every kind of
// damaged or forbidden file is a CheckpointError naming the file; and
// Python's safetensors package (0.8, in .venv: scripts/python-ref.sh)
// reads tdist's files, and tdist reads the package's.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "formats/file_io.h"
#include "formats/safetensors_header.h"
#include "tdist/safetensors.h"
#include "tests/util/damage.h"
#include "tests/util/process.h"
#include "tests/util/paths.h"

namespace {

using tdist::CheckpointError;
namespace test = tdist::test;

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

// A file of exactly these header JSON and data bytes.
std::string raw_file(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out[static_cast<size_t>(i)] = static_cast<char>(n & 0xff);
  return out + json + data;
}

torch::OrderedDict<std::string, at::Tensor> every_dtype() {
  torch::manual_seed(7);
  torch::OrderedDict<std::string, at::Tensor> d;
  d.insert("f32", torch::randn({3, 4}));
  d.insert("f64", torch::randn({5}, torch::kDouble));
  d.insert("f16", torch::randn({2, 3}).to(torch::kHalf));
  d.insert("bf16", torch::randn({4, 2}).to(torch::kBFloat16));
  d.insert("i64", torch::randint(-1000, 1000, {6}, torch::kLong));
  d.insert("i32", torch::randint(-1000, 1000, {2, 2}, torch::kInt));
  d.insert("i16", torch::randint(-1000, 1000, {3}, torch::kShort));
  d.insert("i8", torch::randint(-100, 100, {7}, torch::kChar));
  d.insert("u8", torch::randint(0, 255, {1, 1, 3}, torch::kByte));
  d.insert("bool", torch::rand({5}) > 0.5);
  d.insert("scalar", torch::tensor(3.5));
  d.insert("empty", torch::zeros({0, 4}));
  d.insert("transposed", torch::arange(12, torch::kFloat).view({3, 4}).t());  // not contiguous
  return d;
}

TEST(Safetensors, EveryDtypeRoundTripsBitForBit) {
  test::TempDir dir;
  const std::string path = dir.path() + "/a.safetensors";
  const auto saved = every_dtype();
  tdist::save_safetensors(path, saved, {{"format", "pt"}});
  const auto loaded = tdist::load_safetensors(path);
  ASSERT_EQ(loaded.size(), saved.size());
  for (const auto& item : saved) {
    const at::Tensor& got = loaded[item.key()];
    EXPECT_EQ(got.scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_EQ(got.sizes(), item.value().sizes()) << item.key();
    EXPECT_TRUE(torch::equal(got, item.value())) << item.key();
  }
  tdist::SafetensorsReader r(path);
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"format", "pt"}})) << "checksums are not shown";
  EXPECT_EQ(r.tensors()[0].name, "f32") << "data in the order written";
}

TEST(Safetensors, TheBytesAreTheFormats) {
  test::TempDir dir;
  const std::string path = dir.path() + "/b.safetensors";
  torch::OrderedDict<std::string, at::Tensor> d;
  d.insert("w", torch::tensor({1.0f, 2.0f}));
  d.insert("b", torch::tensor({int16_t{-1}}));
  tdist::save_safetensors(path, d);
  const std::string bytes = slurp(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  ASSERT_EQ(n % 8, 0u) << "the header is padded to a multiple of 8";
  ASSERT_EQ(bytes.size(), 8 + n + 10);
  const std::string json = bytes.substr(8, n);
  EXPECT_EQ(json[0], '{');
  EXPECT_NE(json.find(R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("b":{"dtype":"I16","shape":[1],"data_offsets":[8,10]})"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("tdist.crc32:w":")"), std::string::npos) << json;
  float w[2];
  std::memcpy(w, bytes.data() + 8 + n, 8);
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[1], 2.0f);
  EXPECT_EQ(bytes.substr(8 + n + 8), std::string("\xff\xff", 2));
}

TEST(Safetensors, OneTensorIsReadAlone) {
  test::TempDir dir;
  const std::string path = dir.path() + "/c.safetensors";
  torch::OrderedDict<std::string, at::Tensor> d;
  d.insert("a", torch::ones({4}));
  d.insert("b", torch::full({4}, 2.0));
  tdist::save_safetensors(path, d);
  // Damage a's bytes: b still reads, a is named as corrupt.
  std::string bytes = slurp(path);
  ASSERT_NO_FATAL_FAILURE(test::flip_byte(bytes, bytes.size() - 20, 0x40));
  spit(path, bytes);
  tdist::SafetensorsReader r(path);
  EXPECT_TRUE(torch::equal(r.read("b"), torch::full({4}, 2.0)));
  try {
    r.read("a");
    FAIL() << "a corrupt tensor was read";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'a' is corrupt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_THROW(r.read("c"), CheckpointError);
}

TEST(Safetensors, AnUnfinishedSaveLeavesTheOldFile) {
  test::TempDir dir;
  const std::string path = dir.path() + "/d.safetensors";
  torch::OrderedDict<std::string, at::Tensor> old;
  old.insert("x", torch::ones({3}));
  tdist::save_safetensors(path, old);
  {
    tdist::SafetensorsWriter w(path, {{"x", at::kFloat, {3}}, {"y", at::kFloat, {3}}});
    w.write("x", torch::zeros({3}));
    EXPECT_THROW(w.write("z", torch::zeros({3})), tdist::UsageError) << "not the next declared";
    EXPECT_THROW(w.finish(), tdist::UsageError) << "y was never written";
  }  // dropped unfinished
  EXPECT_TRUE(torch::equal(tdist::load_safetensors(path)["x"], torch::ones({3})));
  // A process killed in the middle of a save: the same.
  const pid_t pid = fork();
  if (pid == 0) {
    try {
      tdist::SafetensorsWriter w(path, {{"x", at::kFloat, {1 << 20}}});
      w.write("x", torch::zeros({1 << 20}));
      raise(SIGKILL);
    } catch (...) {
    }
    _exit(3);  // never the test's own code after a fork
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_TRUE(torch::equal(tdist::load_safetensors(path)["x"], torch::ones({3})));
}

// Each damaged or forbidden file, and the words its error must have.
struct Bad {
  const char* what;
  std::string bytes;
  const char* says;
};

std::vector<Bad> bad_files() {
  const std::string f32x2 = std::string(8, '\0');
  const auto ok_json = [](const std::string& extra) {
    return R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})" + extra + "}";
  };
  std::vector<Bad> v;
  v.push_back({"empty file", "", "shorter than the header length"});
  v.push_back({"huge header length", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "100,000,000"});
  v.push_back({"header past the end", std::string("\x40\0\0\0\0\0\0\0", 8) + "{}", "truncated"});
  v.push_back({"not JSON", raw_file("{not json}", ""), "not valid JSON"});
  v.push_back({"not an object", raw_file("[1,2]   ", ""), "start with '{'"});
  v.push_back({"leading space", raw_file(" {}", ""), "start with '{'"});
  v.push_back({"duplicate key", raw_file(ok_json(R"(,"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), f32x2),
               "twice"});
  v.push_back({"unknown dtype", raw_file(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", f32x2),
               "unknown dtype 'F33'"});
  v.push_back({"odd sub-byte data", raw_file(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", "  "),
               "not a whole number of bytes"});
  v.push_back({"negative shape", raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2),
               "non-negative"});
  v.push_back({"minus zero shape", raw_file(R"({"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}})", ""),
               "non-negative"});
  v.push_back({"minus zero offset", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}})", f32x2),
               "non-negative"});
  v.push_back({"float shape", raw_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", f32x2),
               "non-negative integer"});
  v.push_back({"wrong byte count", raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
               "span 8 bytes"});
  v.push_back({"overflowing shape",
               raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", f32x2),
               "overflows"});
  v.push_back({"extra field", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", f32x2),
               "unknown field"});
  v.push_back({"missing field", raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", f32x2), "no 'data_offsets'"});
  v.push_back({"hole", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", std::string(12, '\0')),
               "a hole"});
  v.push_back({"overlap", raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                   f32x2),
               "an overlap"});
  v.push_back({"truncated data", raw_file(ok_json(""), std::string(5, '\0')), "truncated"});
  v.push_back({"trailing bytes", raw_file(ok_json(""), std::string(9, '\0')), "trailing bytes"});
  v.push_back({"metadata not strings", raw_file(ok_json(R"(,"__metadata__":{"k":1})"), f32x2), "not a string"});
  v.push_back({"deep nesting", raw_file("{\"a\":" + std::string(64, '[') + std::string(64, ']') + "}", ""),
               "nested deeper"});
  v.push_back({"bad UTF-8", raw_file("{\"\xff\":{}}", ""), "not valid JSON"});
  v.push_back({"BOOL not 0/1", raw_file(R"({"a":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "\x01\x07"),
               "other than 0 or 1"});
  v.push_back({"dtype tdist cannot hold", raw_file(R"({"a":{"dtype":"U16","shape":[1],"data_offsets":[0,2]}})", "ab"),
               "no LibTorch type"});
  return v;
}

TEST(Safetensors, EveryDamagedOrForbiddenFileIsNamed) {
  test::TempDir dir;
  for (const Bad& b : bad_files()) {
    const std::string path = dir.path() + "/bad.safetensors";
    spit(path, b.bytes);
    try {
      tdist::load_safetensors(path);
      ADD_FAILURE() << b.what << ": loaded";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << b.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << b.what << ": " << e.what();
    }
  }
  EXPECT_THROW(tdist::load_safetensors(dir.path() + "/missing.safetensors"), CheckpointError);
}

// The format's dtypes tdist has no tensor for (F8_E4M3, F4, C64, ...) and a
// null __metadata__: the file opens and lists them; reading one is refused.
TEST(Safetensors, OtherDtypesOpenAndAreRefusedWhenRead) {
  test::TempDir dir;
  const std::string path = dir.path() + "/f8.safetensors";
  spit(path, raw_file(R"({"__metadata__":null,"e":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},)"
                      R"("f":{"dtype":"F4","shape":[2,2],"data_offsets":[4,6]},)"
                      R"("x":{"dtype":"F32","shape":[1],"data_offsets":[6,10]}})",
                      std::string(10, '\0')));
  tdist::SafetensorsReader r(path);
  ASSERT_EQ(r.tensors().size(), 3u);
  EXPECT_EQ(r.tensors()[0].format_dtype, "F8_E4M3");
  EXPECT_EQ(r.tensors()[0].dtype, at::ScalarType::Undefined);
  EXPECT_EQ(r.tensors()[1].format_dtype, "F4");
  EXPECT_TRUE(r.metadata().empty());
  EXPECT_TRUE(torch::equal(r.read("x"), torch::zeros({1})));
  try {
    r.read("e");
    ADD_FAILURE() << "an F8_E4M3 tensor was read";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("F8_E4M3"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, AnEmptyFileOfNoTensorsIsValid) {
  test::TempDir dir;
  const std::string path = dir.path() + "/e.safetensors";
  tdist::save_safetensors(path, torch::OrderedDict<std::string, at::Tensor>());
  EXPECT_EQ(tdist::load_safetensors(path).size(), 0u);
  spit(path, raw_file("{}      ", ""));
  EXPECT_EQ(tdist::load_safetensors(path).size(), 0u);
}

const std::string kPython = tdist::test::source_dir() + "/.venv/bin/python";
const std::string kCheck = tdist::test::source_dir() + "/tests/checkpoint/safetensors_check.py";

std::string python(const std::string& args) {
  auto r = test::run_command(kPython + " " + kCheck + " " + args + " 2>&1", std::chrono::seconds(60));
  if (!test::exited_ok(r.status)) {
    throw std::runtime_error("python " + args + " failed (run scripts/python-ref.sh install):\n" + r.output);
  }
  return r.output;
}

TEST(SafetensorsPython, ThePackageReadsOurFilesWithTheSameTensors) {
  test::TempDir dir;
  const std::string path = dir.path() + "/ours.safetensors";
  const auto saved = every_dtype();
  tdist::save_safetensors(path, saved, {{"format", "pt"}});
  const auto seen = nlohmann::json::parse(python("read " + path));
  const auto& tensors = seen.at("tensors");
  ASSERT_EQ(tensors.size(), saved.size()) << seen.dump();
  const std::map<at::ScalarType, std::string> names = {
      {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kLong, "I64"},
      {at::kInt, "I32"},   {at::kShort, "I16"},  {at::kChar, "I8"},  {at::kByte, "U8"},      {at::kBool, "BOOL"}};
  for (const auto& item : saved) {
    const at::Tensor t = item.value().contiguous();
    const auto& got = tensors.at(item.key());
    EXPECT_EQ(got[0].get<std::string>(), names.at(t.scalar_type())) << item.key();
    EXPECT_EQ(got[1].get<std::vector<int64_t>>(), t.sizes().vec()) << item.key();
    EXPECT_EQ(got[2].get<uint32_t>(), tdist::checkpoint::crc32(0, t.data_ptr(), t.nbytes())) << item.key();
  }
  EXPECT_EQ(seen.at("metadata").at("format"), "pt");
}

TEST(SafetensorsPython, WeReadThePackagesFiles) {
  test::TempDir dir;
  const std::string path = dir.path() + "/theirs.safetensors";
  python("write " + path);
  tdist::SafetensorsReader r(path);
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"written_by", "python"}}));
  EXPECT_TRUE(torch::equal(r.read("py_f32"), torch::arange(6, torch::kFloat).mul(0.5).view({2, 3})));
  EXPECT_TRUE(torch::equal(r.read("py_i64"), torch::arange(4, torch::kLong).mul(-1000)));
  EXPECT_TRUE(torch::equal(r.read("py_bf16"), torch::tensor({1.0f, -2.0f, 0.25f}).to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(r.read("py_u8"), torch::arange(8, torch::kByte).view({2, 2, 2})));
  EXPECT_EQ(r.tensors().size(), 4u);
}

}  // namespace
