// tdist-trace analyze over synthetic flight recorder dumps (written here
// with nlohmann-json in the schema of src/trace/dump_json.cpp): all ranks
// agreeing, a skipped all_reduce, a mismatch, a missing dump, a failed op,
// rings that dropped different amounts, subgroups, a pending send; and
// hostile files (truncated, deep, huge, ill-typed, a link, a FIFO, binary,
// a ranks string of 10^7 entries), each a clean error naming the file, and
// the tool's exit code 2 for them.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/util/process.h"
#include "trace/analyze.h"
#include "trace/dump_reader.h"
#include "trace/timeline_tools.h"
#include "tests/util/paths.h"

namespace {

namespace test = tdist::test;
namespace tr = tdist::trace;
using Json = nlohmann::json;

const std::string kBin = tdist::test::bin_dir();
constexpr int64_t kT0 = 1'790'000'000'000'000'000;  // CLOCK_REALTIME ns
constexpr int64_t kSec = 1'000'000'000;

// One rank's dump, built op by op; pg_status follows the entries unless set.
struct Dump {
  int rank = 0, world = 1;
  std::map<std::string, std::vector<int>> groups;
  std::vector<Json> entries;
  std::map<std::string, std::pair<int64_t, int64_t>> status;  // group -> (enqueued, completed) overrides
  int64_t dump_ns = kT0 + 100 * kSec;
  int64_t steps = 0;

  Dump(int r, int w) : rank(r), world(w) {
    for (int i = 0; i < w; ++i) groups["world"].push_back(i);
  }
  // A collective #seq of `group`, created at kT0 + t seconds (started then too, unless scheduled).
  Dump& op(int64_t seq, const std::string& name = "all_reduce", const std::string& state = "completed",
           const std::string& group = "world", double t = 0, int64_t numel = 4096, bool p2p = false, int peer = -1) {
    const int64_t created = kT0 + static_cast<int64_t>((t ? t : static_cast<double>(seq) * 0.01) * kSec);
    Json e = {
        {"record_id", entries.size()},
        {"pg_id", 0},
        {"process_group", {group, ""}},
        {"collective_seq_id", p2p ? 0 : seq},
        {"p2p_seq_id", p2p ? seq : 0},
        {"op_id", seq},
        {"profiling_name", "tdist:" + name},
        {"input_sizes", Json::array({Json::array({numel})})},
        {"input_dtypes", {"Float"}},
        {"output_sizes", Json::array({Json::array({numel})})},
        {"output_dtypes", {"Float"}},
        {"state", state},
        {"time_created_ns", created},
        {"time_discovered_started_ns", state == "scheduled" ? Json() : Json(created)},
        {"time_discovered_completed_ns", state == "completed" || state == "failed" ? Json(created + 1000) : Json()},
        {"duration_ms", state == "completed" ? Json(0.001) : Json()},
        {"timeout_ms", 1800000},
        {"is_p2p", p2p},
        {"peer", peer >= 0 ? Json(peer) : Json()},
        {"retired", state == "completed" || state == "failed"},
        {"site", Json()},
        {"error", state == "failed" ? Json("boom: the peer went away") : Json()}};
    entries.push_back(std::move(e));
    return *this;
  }
  Dump& ops(int64_t from, int64_t to, const std::string& group = "world") {
    for (int64_t s = from; s <= to; ++s) op(s, "all_reduce", "completed", group);
    return *this;
  }
  Json json() const {
    Json pg_config = Json::object(), pg_status = Json::object();
    for (const auto& [name, ranks] : groups) {
      std::string text = "[";
      for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
      pg_config[name] = {{"name", name}, {"desc", ""}, {"ranks", text + "]"}, {"backend", "shm"}};
      int64_t enq = 0, done = 0;
      for (const Json& e : entries) {
        if (e["process_group"][0] != name || e["is_p2p"]) continue;
        enq = std::max(enq, e["collective_seq_id"].get<int64_t>());
        if (e["state"] == "completed") done = std::max(done, e["collective_seq_id"].get<int64_t>());
      }
      if (status.count(name)) std::tie(enq, done) = status.at(name);
      pg_status[name] = {
          {"last_enqueued_collective", enq}, {"last_started_collective", enq}, {"last_completed_collective", done},
          {"last_enqueued_p2p", 0},          {"last_started_p2p", 0},          {"last_completed_p2p", 0}};
    }
    return {{"version", "2.4"},
            {"producer", "tdist test"},
            {"rank", rank},
            {"world_size", world},
            {"pid", 1},
            {"hostname", "h"},
            {"reason", "timeout"},
            {"dump_time_ns", dump_ns},
            {"buffer_size", 2000},
            {"steps", steps},
            {"pg_config", pg_config},
            {"pg_status", pg_status},
            {"entries", entries},
            {"a_future_key", {{"nested", {1, 2, {{"x", nullptr}}}}}}};
  }
  void write(const std::string& dir) const {
    std::ofstream(dir + "/rank-" + std::to_string(rank) + ".json") << json().dump();
  }
};

tr::Analysis run(const std::vector<Dump>& dumps, const std::string& dir) {
  for (const Dump& d : dumps) d.write(dir);
  return tr::analyze(tr::read_dump_dir(dir));
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

struct Ran {
  int code = -1;
  std::string output;
};
Ran sh(const std::string& command) {
  const auto r = test::run_command(command + " 2>&1", std::chrono::seconds(60));
  return {r.status >= 0 && WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1, r.output};
}

TEST(TdistTrace, AllAgree) {
  test::TempDir dir;
  std::vector<Dump> d = {Dump(0, 3), Dump(1, 3), Dump(2, 3)};
  for (Dump& x : d) {
    x.groups["world/1"] = {0, 1};
    x.ops(1, 20);
    if (x.rank < 2) x.ops(1, 5, "world/1");
  }
  const tr::Analysis a = run(d, dir.path());
  EXPECT_EQ(a.exit_code, 0) << a.report;
  EXPECT_TRUE(a.findings.empty()) << a.report;
  EXPECT_EQ(a.report,
            "3 ranks, 2 groups: every collective enqueued was completed on every rank "
            "(group 'world' through #20, group 'world/1' through #5)\n");
}

// Rank 1 skipped an all_reduce: rank 0 waits in #5, rank 1 completed #4 and went on.
std::vector<Dump> skipped() {
  Dump r0(0, 2), r1(1, 2);
  r0.ops(1, 4).op(5, "all_reduce", "started", "world", 50);
  r0.dump_ns = kT0 + 62'300'000'000;
  r1.ops(1, 4);
  r1.steps = 4;
  r0.steps = 5;
  return {r0, r1};
}

TEST(TdistTrace, SkippedAllReduceNamesTheRank) {
  test::TempDir dir;
  const tr::Analysis a = run(skipped(), dir.path());
  EXPECT_EQ(a.exit_code, 1);
  ASSERT_EQ(a.findings.size(), 1u) << a.report;
  const tr::Finding& f = a.findings[0];
  EXPECT_EQ(f.kind, tr::FindingKind::never_called);
  EXPECT_EQ(f.ranks, std::vector<int>{1});
  EXPECT_EQ(f.waiting, std::vector<int>{0});
  EXPECT_EQ(f.seq, 5);
  EXPECT_EQ(f.op, "all_reduce");
  EXPECT_NEAR(f.waited_s, 12.3, 1e-6);
  EXPECT_EQ(first_line(a.report),
            "rank 1 never called all_reduce #5 of group 'world'; rank 0 has waited in it for 12.3 s");
  ASSERT_EQ(f.details.size(), 1u);
  EXPECT_NE(f.details[0].find("rank 1: last completed all_reduce #4 of group 'world'"), std::string::npos)
      << f.details[0];
  EXPECT_NE(f.details[0].find("nothing pending in any group"), std::string::npos) << f.details[0];
  EXPECT_NE(f.details[0].find("4 steps (others up to 5)"), std::string::npos) << f.details[0];
}

TEST(TdistTrace, MismatchNamesTheOddRank) {
  test::TempDir dir;
  std::vector<Dump> d = {Dump(0, 3), Dump(1, 3), Dump(2, 3)};
  for (Dump& x : d) x.ops(1, 2).op(3, x.rank == 1 ? "all_gather" : "all_reduce", "started");
  const tr::Analysis a = run(d, dir.path());
  EXPECT_EQ(a.exit_code, 1);
  ASSERT_GE(a.findings.size(), 1u);
  EXPECT_EQ(a.findings[0].kind, tr::FindingKind::mismatch);
  EXPECT_EQ(a.findings[0].seq, 3);
  EXPECT_EQ(a.findings[0].ranks, std::vector<int>{1});
  EXPECT_EQ(first_line(a.report),
            "mismatch at #3 of group 'world': rank 1 called all_gather Float[[4096]], "
            "ranks 0, 2 called all_reduce Float[[4096]]");
}

// Two ranks, one op each at the mismatch: no minority, but the steps
// before say which rank skipped (each step: a 4096-float all_reduce, then
// a 1-float one; the skipper skipped the third step's 4096-float one).
TEST(TdistTrace, TheStepsBeforeSayWhoSkipped) {
  for (const int skipper : {0, 1}) {
    test::TempDir dir;
    Dump r0(0, 2), r1(1, 2);
    for (Dump* d : {&r0, &r1}) {
      for (int64_t seq = 1; seq <= 4; ++seq) d->op(seq, "all_reduce", "completed", "world", 0, seq % 2 ? 4096 : 1);
      d->op(5, "all_reduce", "started", "world", 0, d->rank == skipper ? 1 : 4096);
    }
    const tr::Analysis a = run({r0, r1}, dir.path());
    ASSERT_GE(a.findings.size(), 1u) << a.report;
    EXPECT_EQ(a.findings[0].kind, tr::FindingKind::mismatch);
    EXPECT_EQ(a.findings[0].ranks, std::vector<int>{skipper}) << a.report;
    const std::string who = "rank " + std::to_string(skipper);
    EXPECT_NE(first_line(a.report).find("; " + who + " skipped all_reduce Float[[4096]]"), std::string::npos)
        << a.report;
  }
  // With no history that says it, no one is blamed for skipping.
  test::TempDir dir;
  Dump r0(0, 2), r1(1, 2);
  r0.op(1, "all_reduce", "started", "world", 0, 8);
  r1.op(1, "all_reduce", "started", "world", 0, 9);
  const tr::Analysis a = run({r0, r1}, dir.path());
  EXPECT_EQ(a.report.find("skipped"), std::string::npos) << a.report;
}

TEST(TdistTrace, SizesComparedOnlyWhereTheyMustMatch) {
  test::TempDir dir;
  Dump r0(0, 2), r1(1, 2);
  r0.op(1, "all_gather", "completed", "world", 0, 10).op(2, "all_reduce", "completed", "world", 0, 8);
  r1.op(1, "all_gather", "completed", "world", 0, 20).op(2, "all_reduce", "completed", "world", 0, 9);
  const tr::Analysis a = run({r0, r1}, dir.path());
  ASSERT_EQ(a.findings.size(), 1u) << a.report;
  EXPECT_EQ(a.findings[0].kind, tr::FindingKind::mismatch);
  EXPECT_EQ(a.findings[0].seq, 2);  // not #1: all_gather's inputs may differ
  EXPECT_NE(a.report.find("all_reduce Float[[8]]"), std::string::npos) << a.report;
}

TEST(TdistTrace, MissingDump) {
  test::TempDir dir;
  std::vector<Dump> d = {Dump(0, 3), Dump(1, 3)};
  for (Dump& x : d) x.ops(1, 6).op(7, "broadcast", "started", "world", 90);
  const tr::Analysis a = run(d, dir.path());
  EXPECT_EQ(a.exit_code, 1);
  ASSERT_GE(a.findings.size(), 1u);
  EXPECT_EQ(a.findings[0].kind, tr::FindingKind::never_called);
  EXPECT_EQ(a.findings[0].no_dump, std::vector<int>{2});
  EXPECT_EQ(first_line(a.report),
            "broadcast #7 of group 'world': ranks 0, 1 have waited in it for 10.0 s; rank 2 wrote no dump");
  EXPECT_EQ(a.report.find("rank 2 wrote no dump", a.report.find('\n')), std::string::npos) << a.report;  // said once
  bool missing = false;
  for (const auto& f : a.findings)
    missing = missing || (f.kind == tr::FindingKind::missing_dump && f.ranks == std::vector<int>{2});
  EXPECT_TRUE(missing);

  test::TempDir idle;  // nothing pending: the missing dump is the finding
  const tr::Analysis b = run({Dump(0, 3).ops(1, 3), Dump(1, 3).ops(1, 3)}, idle.path());
  EXPECT_EQ(b.exit_code, 1);
  EXPECT_EQ(first_line(b.report), "rank 2 wrote no dump (dead, or hung outside tdist?)");
}

TEST(TdistTrace, FailedEntry) {
  test::TempDir dir;
  const tr::Analysis a =
      run({Dump(0, 2).ops(1, 11).op(12, "all_reduce", "failed"), Dump(1, 2).ops(1, 11).op(12, "all_reduce", "failed")},
          dir.path());
  EXPECT_EQ(a.exit_code, 1);
  ASSERT_EQ(a.findings.size(), 2u) << a.report;
  EXPECT_EQ(a.findings[0].kind, tr::FindingKind::failed);
  EXPECT_EQ(first_line(a.report), "rank 0: all_reduce #12 of group 'world' failed: boom: the peer went away");
}

TEST(TdistTrace, RingTruncationMakesNoFalseFindings) {
  test::TempDir dir;
  Dump r0(0, 2), r1(1, 2);
  r0.ops(100, 150);
  r1.ops(50, 150);
  r1.op(151, "barrier", "completed", "other");  // a group rank 0 never made, ...
  r1.groups["other"] = {1};                     // ... of rank 1 alone
  const tr::Analysis a = run({r0, r1}, dir.path());
  EXPECT_EQ(a.exit_code, 0) << a.report;
  EXPECT_NE(a.report.find("group 'world' through #150"), std::string::npos) << a.report;
}

TEST(TdistTrace, StatusCountsWhatTheRingDropped) {
  test::TempDir dir;
  Dump r0(0, 2), r1(1, 2);
  r0.ops(140, 149).op(150, "all_reduce", "started", "world", 60);
  r1.op(1, "barrier", "completed", "solo");  // its ring holds nothing of 'world' any more
  r1.groups["solo"] = {1};
  r1.status["world"] = {149, 149};
  const tr::Analysis a = run({r0, r1}, dir.path());
  ASSERT_EQ(a.findings.size(), 1u) << a.report;
  EXPECT_EQ(a.findings[0].ranks, std::vector<int>{1});
  EXPECT_EQ(a.findings[0].seq, 150);
  ASSERT_EQ(a.findings[0].details.size(), 1u);
  EXPECT_NE(a.findings[0].details[0].find("last completed #149 of group 'world' (dropped from its ring)"),
            std::string::npos)
      << a.findings[0].details[0];
}

TEST(TdistTrace, SubgroupsAndAChainOfWaits) {
  test::TempDir dir;
  std::vector<Dump> d = {Dump(0, 4), Dump(1, 4), Dump(2, 4), Dump(3, 4)};
  for (Dump& x : d) {
    x.groups["sub"] = {1, 3};
    x.groups["pair"] = {2, 3};
    x.ops(1, 10);
  }
  d[1].op(1, "broadcast", "completed", "sub").op(2, "broadcast", "started", "sub", 20);
  d[3].op(1, "broadcast", "completed", "sub").op(1, "all_reduce", "started", "pair", 10);
  const tr::Analysis a = run(d, dir.path());
  ASSERT_EQ(a.findings.size(), 2u) << a.report;
  EXPECT_EQ(first_line(a.report),
            "rank 2 never called all_reduce #1 of group 'pair'; rank 3 has waited in it for 90.0 s");
  const tr::Finding& sub = a.findings[1];
  EXPECT_EQ(sub.group, "sub");
  EXPECT_EQ(sub.ranks, std::vector<int>{3});
  EXPECT_EQ(sub.message, "rank 3 never called broadcast #2 of group 'sub'; rank 1 has waited in it for 80.0 s");
  ASSERT_EQ(sub.details.size(), 1u);
  EXPECT_NE(sub.details[0].find("it waits in all_reduce #1 of group 'pair' (started, 90.0 s)"), std::string::npos)
      << sub.details[0];
}

TEST(TdistTrace, PendingSendIsReported) {
  test::TempDir dir;
  const tr::Analysis a =
      run({Dump(0, 2).ops(1, 3).op(1, "send", "started", "world", 95, 16, true, 1), Dump(1, 2).ops(1, 3)}, dir.path());
  EXPECT_EQ(a.exit_code, 1);
  ASSERT_EQ(a.findings.size(), 1u) << a.report;
  EXPECT_EQ(a.findings[0].kind, tr::FindingKind::p2p_pending);
  EXPECT_EQ(first_line(a.report), "rank 0: send #1 to rank 1 of group 'world' pending (started, 5.0 s)");
}

TEST(TdistTrace, ReaderKeepsWhatTheSchemaSays) {
  const tr::RankDump d = tr::parse_dump(skipped()[0].json().dump(), "x");
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.reason, "timeout");
  ASSERT_EQ(d.entries.size(), 5u);
  const tr::FrEntry& e = d.entries[4];
  EXPECT_EQ(e.op, "all_reduce");
  EXPECT_EQ(e.group, "world");
  EXPECT_EQ(e.collective_seq_id, 5);
  EXPECT_EQ(e.state, tr::FrState::started);
  EXPECT_EQ(e.input_sizes, std::vector<std::vector<int64_t>>{{4096}});
  EXPECT_EQ(e.input_dtypes, std::vector<std::string>{"Float"});
  EXPECT_EQ(e.time_completed_ns, 0);
  EXPECT_EQ(e.peer, -1);
  EXPECT_EQ(d.groups.at("world").ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(d.pg_status.at("world").last_enqueued_collective, 5);

  EXPECT_EQ(tr::parse_ranks(" [ 3,1 ,2 ] ", 4), (std::vector<int>{3, 1, 2}));
  EXPECT_TRUE(tr::parse_ranks("[]", 4).empty());
  for (const char* bad :
       {"[0, 0]", "[01]", "[4]", "[-1]", "[0,]", "[0", "0, 1", "[0] x", "[1 2]", "[99999999999999999999]"}) {
    EXPECT_THROW(tr::parse_ranks(bad, 4), tr::DumpError) << bad;
  }
}

// Hostile files: each a DumpError naming the file, and exit 2 from the tool.
void expect_refused(const std::string& dir, const std::string& what) {
  try {
    tr::read_dump_dir(dir);
    ADD_FAILURE() << "no error; expected one saying '" << what << "'";
  } catch (const tr::DumpError& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/rank-0.json: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
  const Ran r = sh(kBin + "/tdist-trace analyze " + dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("tdist-trace: error: " + dir + "/rank-0.json: "), std::string::npos) << r.output;
  EXPECT_LT(r.output.size(), 2000u) << r.output;
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

TEST(TdistTrace, HostileDumpsAreCleanErrors) {
  const std::string good = Dump(0, 1).ops(1, 3).json().dump();
  const auto with = [](const std::string& key, const Json& v) {
    Json j = Dump(0, 2).ops(1, 1).json();
    j[key] = v;
    return j.dump();
  };
  const auto entry_with = [](const std::string& key, const Json& v) {
    Json j = Dump(0, 1).ops(1, 2).json();
    j["entries"][1][key] = v;
    return j.dump();
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {good.substr(0, good.size() / 2), "not valid JSON"},
      {"{\"rank\": 0, \"world_size\": 1, \"x\": " + std::string(200, '[') + std::string(200, ']') + "}",
       "nested deeper than 8"},
      {with("rank", "0"), "rank is a string, not an integer"},
      {with("rank", -1), "rank is negative"},
      {with("rank", 5), "rank 5 is outside the world of 2"},
      {with("rank", 1e20), "rank is a number, not an integer"},
      {with("rank", 99999999999LL), "rank is too large"},
      {with("world_size", 18446744073709551615ULL), "world_size is too large"},
      {with("entries", "lots"), "entries is a string, not an array"},
      {with("pg_config", {{"world", {{"ranks", {0, 1}}}}}), "ranks is an array, not a string"},
      {entry_with("collective_seq_id", "5"), "entry 1: collective_seq_id is a string, not an integer"},
      {entry_with("state", "zombie"), "entry 1: state is 'zombie'"},
      {entry_with("input_sizes", {{-4}}), "entry 1: input_sizes is negative"},
      {entry_with("site", std::string(5000, 's')), "a string of 5000 bytes"},
      {with("a_future_key", Json::array({std::string(5000, 's')})), "a string of 5000 bytes"},
      {entry_with("input_sizes", Json(std::vector<Json>(5000, Json::array()))), "more than 4096 lists and numbers"},
      {entry_with("process_group", nullptr), "entry 1: process_group is null, not an array"},
      {[] {
         Json j = Dump(0, 1).json();
         j["entries"][0] = Json::object();
         return j.dump();
       }(),
       "entry 0: no process_group"},
      {std::string("\x7f"
                   "ELF\x02\x01\x01\0\0\xff\xfe garbage",
                   20),
       "not valid JSON"},
      {"{\"rank\":0,\"world_size\":1,\"site\":\"\xc3\x28\"}", "not valid JSON"},
      {"[]", "the document is an array"},
      {"", "empty"},
      {"{\"world_size\": 1}", "no rank"},
  };
  for (const auto& [text, what] : cases) {
    SCOPED_TRACE(what);
    test::TempDir dir;
    write_file(dir.path() + "/rank-0.json", text);
    expect_refused(dir.path(), what);
  }
}

TEST(TdistTrace, HugeLinkedAndSpecialFilesAreRefused) {
  {
    test::TempDir dir;  // 65 MiB, sparse: refused before it is read
    const int fd = ::open((dir.path() + "/rank-0.json").c_str(), O_WRONLY | O_CREAT, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, off_t{65} << 20), 0);
    ::close(fd);
    expect_refused(dir.path(), "larger than 64 MiB");
  }
  {
    test::TempDir dir, elsewhere;  // a link named rank-0.json, even to a good dump
    Dump(0, 1).ops(1, 2).write(elsewhere.path());
    ASSERT_EQ(::symlink((elsewhere.path() + "/rank-0.json").c_str(), (dir.path() + "/rank-0.json").c_str()), 0);
    expect_refused(dir.path(), "a symbolic link");
  }
  {
    test::TempDir dir;  // a FIFO: no hang
    ASSERT_EQ(::mkfifo((dir.path() + "/rank-0.json").c_str(), 0600), 0);
    expect_refused(dir.path(), "FIFO");
  }
  {
    test::TempDir dir;  // a ranks string of 10^7 ranks
    std::string ranks = "[0";
    for (int i = 1; i < 10'000'000; ++i) ranks += ", 0";
    Json j = Dump(0, 1).json();
    j["pg_config"]["world"]["ranks"] = ranks + "]";
    write_file(dir.path() + "/rank-0.json", j.dump());
    expect_refused(dir.path(), "a token longer than");  // cut while it is read
  }
  {
    test::TempDir dir;  // a dump of another rank under this name
    write_file(dir.path() + "/rank-0.json", Dump(1, 2).json().dump());
    expect_refused(dir.path(), "the dump is rank 1's, not rank 0's");
  }
}

TEST(TdistTrace, DirectoryListing) {
  test::TempDir dir;
  for (const Dump& d : skipped()) d.write(dir.path());
  write_file(dir.path() + "/rank-01.json", "not json");  // not a rank-<R>.json name
  write_file(dir.path() + "/.rank-1.json.123.tmp", "not json");
  write_file(dir.path() + "/rank-1", "heartbeat");
  write_file(dir.path() + "/notes.txt", "x");
  const auto dumps = tr::read_dump_dir(dir.path());
  ASSERT_EQ(dumps.size(), 2u);
  EXPECT_EQ(dumps[0].rank, 0);
  EXPECT_EQ(dumps[1].rank, 1);
  EXPECT_THROW(tr::read_dump_dir(dir.path() + "/nope"), tr::DumpError);
}

TEST(TdistTrace, CommandLine) {
  test::TempDir dir;
  for (const Dump& d : skipped()) d.write(dir.path());
  Ran r = sh(kBin + "/tdist-trace analyze " + dir.path());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_EQ(first_line(r.output),
            "rank 1 never called all_reduce #5 of group 'world'; rank 0 has waited in it for 12.3 s");
  EXPECT_NE(r.output.find("2 ranks, 1 group: 1 finding"), std::string::npos) << r.output;

  r = sh(kBin + "/tdist-trace analyze --json " + dir.path());
  EXPECT_EQ(r.code, 1) << r.output;
  const Json j = Json::parse(r.output);
  EXPECT_EQ(j["exit_code"], 1);
  EXPECT_EQ(j["findings"][0]["kind"], "never_called");
  EXPECT_EQ(j["findings"][0]["ranks"], Json({1}));
  EXPECT_EQ(j["findings"][0]["seq"], 5);

  test::TempDir agree;
  Dump(0, 1).ops(1, 3).write(agree.path());
  r = sh(kBin + "/tdist-trace analyze " + agree.path());
  EXPECT_EQ(r.code, 0) << r.output;

  test::TempDir empty;
  r = sh(kBin + "/tdist-trace analyze " + empty.path());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("no rank-<R>.json dumps"), std::string::npos) << r.output;
  for (const std::string args : {"", "analyze", "frobnicate x", "analyze a b", "analyze --bogus x"}) {
    r = sh(kBin + "/tdist-trace " + args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.output;
  }
  EXPECT_EQ(sh(kBin + "/tdist-trace --help").code, 0);
}

// ---- timelines: merge and summary ------------------------------------------

Json x_event(int pid, int tid, const std::string& cat, const std::string& name, double ts_us, double dur_us,
             Json args = nullptr) {
  Json e = {{"name", name}, {"cat", cat}, {"ph", "X"}, {"ts", ts_us}, {"dur", dur_us}, {"pid", pid}, {"tid", tid}};
  if (!args.is_null()) e["args"] = std::move(args);
  return e;
}

void write_trace(const std::string& path, int rank, double shift_us = 0) {
  const double t0 = 1.7e15 + shift_us;
  Json events = Json::array();
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0}, {"args", {{"name", "main"}}}});
  for (int k = 0; k < 3; ++k) {
    events.push_back({{"name", "step " + std::to_string(k + 1)}, {"cat", "step"}, {"ph", "i"}, {"s", "t"},
                      {"ts", t0 + 10000 * k}, {"pid", rank}, {"tid", 0}});
  }
  // Step 1: an op on the worker [2, 8] ms, waited for [6, 8]: 2 of 6 ms exposed.
  events.push_back(x_event(rank, 1, "comm", "all_reduce #1", t0 + 2000, 6000, {{"inline", false}}));
  events.push_back(x_event(rank, 0, "wait", "wait all_reduce", t0 + 6000, 2000));
  // Step 2: an op the training thread ran itself [12, 13]: all exposed.
  events.push_back(x_event(rank, 0, "comm", "all_reduce #2", t0 + 12000, 1000, {{"inline", true}}));
  // Step 3: [22, 30] on the worker, never waited for.
  events.push_back(x_event(rank, 1, "comm", "all_reduce #3", t0 + 22000, 8000, {{"inline", false}}));
  events.push_back(x_event(rank, 0, "compute", "forward layer", t0 + 20000, 500));
  std::ofstream(path) << Json{{"traceEvents", events}, {"otherData", {{"rank", rank}}}}.dump();
}

TEST(TdistTrace, SummaryAccountsForEachStep) {
  test::TempDir dir;
  write_trace(dir.path() + "/t.rank-0.json", 0);
  write_trace(dir.path() + "/t.rank-1.json", 1, 100);
  const tr::Summary s = tr::summarize(tr::trace_files({dir.path()}));
  ASSERT_EQ(s.steps.size(), 6u) << s.report;
  for (const auto& st : s.steps) {
    EXPECT_NEAR(st.step_ms, 10, 1e-6) << st.step;
    if (st.step == 1) {
      EXPECT_NEAR(st.exposed_ms, 2, 1e-6);
      EXPECT_NEAR(st.comm_ms, 6, 1e-6);
      EXPECT_NEAR(st.compute_ms, 8, 1e-6);
      EXPECT_NEAR(st.overlap, 2.0 / 3, 1e-6);
    } else if (st.step == 2) {
      EXPECT_NEAR(st.exposed_ms, 1, 1e-6);
      EXPECT_NEAR(st.overlap, 0, 1e-6);
    } else {
      EXPECT_EQ(st.step, 3);
      EXPECT_NEAR(st.exposed_ms, 0, 1e-6);
      EXPECT_NEAR(st.comm_ms, 8, 1e-6);
      EXPECT_NEAR(st.overlap, 1, 1e-6);
    }
  }
  EXPECT_NE(s.report.find("67%"), std::string::npos) << s.report;
  // The CLI prints it; merged first, the same numbers.
  const auto m = test::run_command(kBin + "/tdist-trace merge " + dir.path() + " -o " + dir.path() + "/all.json 2>&1",
                                   std::chrono::seconds(60));
  ASSERT_TRUE(test::exited_ok(m.status)) << m.output;
  const Json merged = Json::parse(test::read_all(dir.path() + "/all.json"));
  EXPECT_EQ(merged["traceEvents"].size(), 2u * 9u);
  const auto out = test::run_command(kBin + "/tdist-trace summary --json " + dir.path() + "/all.json",
                                     std::chrono::seconds(60));
  ASSERT_TRUE(test::exited_ok(out.status)) << out.output;
  EXPECT_EQ(Json::parse(out.output)["steps"].size(), 6u) << out.output;
}

TEST(TdistTrace, HostileTracesAreCleanErrors) {
  test::TempDir dir;
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not JSON", "{\"traceEvents\": [{\"ph\": "},
      {"no traceEvents", "{\"events\": []}"},
      {"an element not an object", "{\"traceEvents\": [1, 2]}"},
      {"an array element", "{\"traceEvents\": [[]]}"},
      {"deep nesting", "{\"traceEvents\": [{\"args\": " + deep + "}]}"},
      {"a huge string", "{\"traceEvents\": [{\"name\": \"" + std::string(100000, 'a') + "\"}]}"},
      {"a top-level array", "[1, 2, 3]"},
      {"many empty containers", [] {
         std::string s = "{\"traceEvents\": [{\"args\": {\"a\": [";
         for (int i = 0; i < 100000; ++i) s += i ? ",{}" : "{}";
         return s + "]}}]}";
       }()},
      {"empty", ""},
  };
  for (const auto& [what, text] : cases) {
    const std::string path = dir.path() + "/bad.rank-0.json";
    std::ofstream(path, std::ios::trunc) << text;
    EXPECT_THROW(tr::summarize({path}), tr::TraceError) << what;
    const auto r = test::run_command(kBin + "/tdist-trace summary " + path + " 2>&1", std::chrono::seconds(60));
    EXPECT_EQ(WEXITSTATUS(r.status), 2) << what << ": " << r.output;
    EXPECT_NE(r.output.find(path), std::string::npos) << what << ": " << r.output;
  }
  // A link is not followed; a FIFO is refused without blocking.
  const std::string real = dir.path() + "/real.json";
  write_trace(real, 0);
  const std::string link = dir.path() + "/link.rank-0.json";
  ASSERT_EQ(symlink(real.c_str(), link.c_str()), 0);
  EXPECT_THROW(tr::summarize({link}), tr::TraceError);
  const std::string fifo = dir.path() + "/fifo.rank-0.json";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THROW(tr::summarize({fifo}), tr::TraceError);
  EXPECT_THROW(tr::summarize(tr::trace_files({dir.path() + "/nothing-here"})), tr::TraceError);
  test::TempDir empty;
  EXPECT_THROW(tr::trace_files({empty.path()}), tr::TraceError);
}

}  // namespace
