// The file readers under hostile input: memory bounded while parsing (the
// unpickler, the safetensors header parser) and time linear in the input.
// Memory is measured in a forked child: its peak RSS (VmHWM, reset through
// /proc/self/clear_refs) over its RSS before the parse, under an address
// space limit so that an unbounded reader fails there rather than on the
// machine.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>

#include "formats/pt_file.h"
#include "formats/safetensors_header.h"
#include "tdist/safetensors.h"
#include "tdist/errors.h"
#include "tests/util/process.h"

namespace {

using tdist::CheckpointError;
using tdist::checkpoint::PtValue;
using tdist::checkpoint::unpickle_value;
namespace st = tdist::safetensors;
namespace test = tdist::test;

constexpr size_t kMiB = size_t{1} << 20;

// ASan gives every allocation a redzone and shadows it (1 byte per 8): a
// million small nodes take about twice their RSS. The bound is measured,
// not skipped, under it: scaled by that factor.
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kAllocatorFactor = 2;
#else
constexpr size_t kAllocatorFactor = 1;
#endif

// The target: 64 MiB + a small multiple of the input.
size_t bound(size_t input) { return kAllocatorFactor * (64 * kMiB + 24 * input); }

long status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stol(line.substr(std::strlen(field)));
  }
  return -1;
}

struct Measured {
  enum Outcome { Ok, Refused, Other } outcome = Other;  // Refused: a CheckpointError or FormatError
  size_t peak = 0;  // bytes over the RSS before the call
  std::string message;
};

// fn in a forked child: what it ended with and the RSS it added at peak.
Measured measure(const std::function<void()>& fn) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe");
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    alarm(120);  // a reader that is not linear dies here
    std::string report;
    {
      std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current RSS
      const long before = status_kib("VmRSS:");
      rlimit lim{};
      const size_t vm = static_cast<size_t>(status_kib("VmSize:")) * 1024;
      lim.rlim_cur = lim.rlim_max = vm + 3 * (size_t{1} << 30);
      setrlimit(RLIMIT_AS, &lim);
      char outcome = 'x';
      std::string message;
      try {
        fn();
        outcome = 'o';
      } catch (const CheckpointError& e) {
        outcome = 'r';
        message = e.what();
      } catch (const st::FormatError& e) {
        outcome = 'r';
        message = e.what();
      } catch (const std::exception& e) {
        message = e.what();
      }
      const long peak = status_kib("VmHWM:") - before;
      report = std::string(1, outcome) + std::to_string(peak) + " " + message.substr(0, 300);
    }
    const ssize_t w = write(fds[1], report.data(), report.size());
    (void)w;
    _exit(0);
  }
  close(fds[1]);
  std::string report;
  char buf[512];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) report.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  Measured r;
  if (report.empty()) {
    r.message = "the child died (status " + std::to_string(status) + ")";
    return r;
  }
  r.outcome = report[0] == 'o' ? Measured::Ok : report[0] == 'r' ? Measured::Refused : Measured::Other;
  const size_t sp = report.find(' ');
  r.peak = static_cast<size_t>(std::max(0L, std::stol(report.substr(1, sp - 1)))) * 1024;
  r.message = report.substr(sp + 1);
  return r;
}

// ---- pickles ------------------------------------------------------------------------

std::string u32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
  return s;
}
std::string str(const std::string& s) { return "X" + u32(static_cast<uint32_t>(s.size())) + s; }
std::string put(uint32_t k) { return "r" + u32(k); }
std::string get(uint32_t k) { return "j" + u32(k); }
const std::string kProto = "\x80\x02";

// A pickle as Python's pickler writes a list of `units` dicts of nine
// fields each (a rank's shard metadata): every key and value string
// memoized, the keys after the first unit memo references, batches of 1000.
std::string metadata_pickle(size_t units) {
  static const char* keys[] = {"name", "original_name", "shape", "shard_shape", "numel",
                               "first_row", "rows_per_rank", "padding_rows", "requires_grad"};
  std::string p = kProto + "]" + put(0);
  uint32_t memo = 1;
  uint32_t key_memo[9] = {};
  for (size_t u = 0; u < units; ++u) {
    if (u % 1000 == 0) p += "(";
    p += "}" + put(memo++) + "(";
    for (int k = 0; k < 9; ++k) {
      if (u == 0) {
        p += str(keys[k]) + put(memo);
        key_memo[k] = memo++;
      } else {
        p += get(key_memo[k]);
      }
      const std::string name = "layers." + std::to_string(u) + ".mlp.weight";
      switch (k) {
        case 0:
        case 1: p += str(name) + put(memo++); break;
        case 2:
        case 3: p += std::string("M\x00\x10M\x00\x04\x86", 7) + put(memo++); break;
        case 8: p += "\x88"; break;
        default: p += "J" + u32(static_cast<uint32_t>(u)); break;
      }
    }
    p += "u";
    if (u % 1000 == 999 || u + 1 == units) p += "e";
  }
  return p + ".";
}

// Hostile pickles: each small, each once needing far more memory than the
// bound (measured on main at ea998c9: 630 MB for 2 MB of empty dicts, 650
// MB for 90 KB of memo-referenced keys, bad_alloc at ~26 GB for 1 MB).
struct Hostile {
  const char* what;
  std::string bytes;
};

std::vector<Hostile> hostile_pickles() {
  std::vector<Hostile> v;
  {  // 2 MB of empty dicts, each appended to one list
    std::string p = kProto + "]";
    for (int i = 0; i < 1 << 20; ++i) p += "}a";
    v.push_back({"a list of a million empty dicts", p + "."});
  }
  {  // 2 MB of empty dicts left on the stack
    v.push_back({"two million empty dicts on the stack", kProto + std::string(2 << 20, '}') + "."});
  }
  {  // one 60 KB key, memoized, set 8000 times in a dict (90 KB)
    std::string p = kProto + "}(" + str(std::string(60000, 'k')) + put(0) + "K\x01";
    for (int i = 1; i < 8000; ++i) p += get(0) + "K\x01";
    v.push_back({"a memoized 60 KB key set 8000 times", p + "u."});
  }
  {  // a dict of 4000 entries, then a list of 250k references to it (1.3 MB)
    std::string p = kProto + "]}(";
    for (int i = 0; i < 4000; ++i) p += str("key" + std::to_string(i)) + "K\x01";
    p += "u" + put(0) + "a";
    for (int i = 0; i < 250000; ++i) p += get(0) + "a";
    v.push_back({"a list of 250k references to a dict of 4000", p + "."});
  }
  {  // a list of 200k references to a 4 KB string (1 MB)
    std::string p = kProto + "]" + str(std::string(4096, 's')) + put(0) + "a(";
    for (int i = 0; i < 200000; ++i) p += get(0);
    v.push_back({"a list of 200k references to a 4 KB string", p + "e."});
  }
  {  // a string that claims 2^60 bytes
    v.push_back({"a string claiming 2^60 bytes", kProto + "\x8d" + std::string("\0\0\0\0\0\0\0\x10", 8) + "abc."});
  }
  {  // memo keys far apart
    std::string p = kProto + "]";
    for (uint32_t i = 0; i < 100000; ++i) p += "}" + put(0x7fffffffu - i * 4096) + "a";
    v.push_back({"100k dicts under sparse memo keys", p + "."});
  }
  return v;
}

TEST(ReaderLimits, HostilePicklesStayWithinTheMemoryBound) {
  for (const Hostile& h : hostile_pickles()) {
    const Measured r = measure([&] { unpickle_value(h.bytes); });
    EXPECT_NE(r.outcome, Measured::Other) << h.what << ": " << r.message;
    std::printf("%s (%zu bytes): peak %zu MiB\n", h.what, h.bytes.size(), r.peak / kMiB);
    EXPECT_LE(r.peak, bound(h.bytes.size())) << h.what << " (" << h.bytes.size() << " bytes): peak " << r.peak / kMiB
                                            << " MiB; " << r.message;
  }
}

// Every hostile pickle is refused, and says why: memory or the values a
// walk would visit; except sparse memo keys, which cost nothing once the
// memo is not an array indexed by key (it loads, in bounded memory: above).
TEST(ReaderLimits, HostilePicklesAreRefusedByName) {
  for (const Hostile& h : hostile_pickles()) {
    if (std::string(h.what).find("claiming") != std::string::npos) {
      EXPECT_THROW(unpickle_value(h.bytes), CheckpointError);
      continue;
    }
    const bool may_load = std::string(h.what) == "100k dicts under sparse memo keys";
    try {
      unpickle_value(h.bytes);
      EXPECT_TRUE(may_load) << h.what << ": loaded";
    } catch (const CheckpointError& e) {
      const std::string m = e.what();
      EXPECT_TRUE(m.find("MiB") != std::string::npos || m.find("values") != std::string::npos) << h.what << ": " << m;
    }
  }
}

// Plausible metadata (200k units, ~14 MB, as Python pickles it) loads, in
// memory within the bound (it took 755 MB on main at ea998c9).
TEST(ReaderLimits, LargeLegitimateMetadataLoadsInBoundedMemory) {
  const std::string p = metadata_pickle(200000);
  const Measured r = measure([&] {
    const PtValue v = unpickle_value(p);
    if (v.items().size() != 200000 || v.items()[199999].at("numel").as_int() != 199999 ||
        v.items()[5].at("name").as_string() != "layers.5.mlp.weight") {
      throw std::runtime_error("wrong value");
    }
  });
  EXPECT_EQ(r.outcome, Measured::Ok) << r.message;
  EXPECT_LE(r.peak, bound(p.size())) << p.size() << " bytes: peak " << r.peak / kMiB << " MiB";
  std::printf("200000 units of metadata, a %zu-byte pickle: peak %zu MiB\n", p.size(), r.peak / kMiB);
}

// Memo references share: the same dict twice is one body, and a reference
// to a container inside itself (a cycle) is refused.
TEST(ReaderLimits, MemoReferencesShareAndCyclesAreRefused) {
  const std::string shared = kProto + "](}(" + str("a") + "K\x01u" + put(0) + get(0) + "e.";
  const PtValue v = unpickle_value(shared);
  ASSERT_EQ(v.items().size(), 2u);
  EXPECT_EQ(&v.items()[0].entries(), &v.items()[1].entries());
  const std::string cycle = kProto + "]" + put(0) + get(0) + "a.";
  EXPECT_THROW(unpickle_value(cycle), CheckpointError);
  // A list changed after it went into another (what a cycle needs).
  const std::string late = kProto + "]" + put(0) + "]" + get(0) + "a" + get(0) + "K\x01" + "a.";
  EXPECT_THROW(unpickle_value(late), CheckpointError);
  // A key set twice: its first position, its last value (as Python).
  const PtValue d = unpickle_value(kProto + "}(" + str("a") + "K\x01" + str("b") + "K\x02" + str("a") + "K\x03u.");
  ASSERT_EQ(d.entries().size(), 2u);
  EXPECT_EQ(d.entries()[0].first, "a");
  EXPECT_EQ(d.entries()[0].second.as_int(), 3);
}

// ---- safetensors headers ------------------------------------------------------------

std::string zero_size_header(size_t n) {
  std::string json = "{";
  for (size_t i = 0; i < n; ++i) {
    json += (i ? "," : "") + std::string("\"t") + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}";
  }
  return json + "}";
}

// 50k zero-size entries: 36 s on main at ea998c9 (quadratic), well under a
// second when linear; the bound is loose on purpose (sanitizers, a busy machine).
TEST(ReaderLimits, SafetensorsHeaderOf50kEntriesParsesInLinearTime) {
  const std::string json = zero_size_header(50000);
  const auto t0 = std::chrono::steady_clock::now();
  const st::Header h = st::parse_header(json.data(), json.size(), 0);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(h.tensors.size(), 50000u);
  EXPECT_LT(s, 3.0) << "50k entries took " << s << " s";
  // Through the reader, from a file.
  test::TempDir dir;
  const std::string path = dir.path() + "/many.safetensors";
  {
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[static_cast<size_t>(i)] = static_cast<char>(json.size() >> (8 * i));
    std::ofstream(path, std::ios::binary) << len << json;
  }
  const auto t1 = std::chrono::steady_clock::now();
  tdist::SafetensorsReader r(path);
  EXPECT_EQ(r.tensors().size(), 50000u);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 3.0);
}

// Big headers (legal up to 100,000,000 bytes): memory within the bound
// whether accepted or refused.
TEST(ReaderLimits, BigSafetensorsHeadersStayWithinTheMemoryBound) {
  std::vector<Hostile> v;
  v.push_back({"400k zero-size entries", zero_size_header(400000)});
  {
    std::string json = R"({"__metadata__":{)";
    for (int i = 0; i < 1000000; ++i) json += (i ? "," : "") + std::string("\"") + std::to_string(i) + "\":\"\"";
    v.push_back({"a million metadata entries", json + "}}"});
  }
  {
    std::string json = R"({"a":{"dtype":"F32","shape":[)";
    for (int i = 0; i < 4000000; ++i) json += (i ? ",1" : "1");
    v.push_back({"a shape of four million dimensions", json + R"(],"data_offsets":[0,4]}})"});
  }
  {
    std::string json = R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4],"x":[)";
    for (int i = 0; i < 4000000; ++i) json += (i ? ",{}" : "{}");
    v.push_back({"an unknown field of four million objects", json + "]}}"});
  }
  for (const Hostile& h : v) {
    const Measured r = measure([&] { st::parse_header(h.bytes.data(), h.bytes.size(), 0); });
    EXPECT_NE(r.outcome, Measured::Other) << h.what << ": " << r.message;
    std::printf("%s (%zu bytes): peak %zu MiB\n", h.what, h.bytes.size(), r.peak / kMiB);
    EXPECT_LE(r.peak, bound(h.bytes.size())) << h.what << " (" << h.bytes.size() << " bytes): peak "
                                            << r.peak / kMiB << " MiB; " << r.message;
  }
}

}  // namespace
