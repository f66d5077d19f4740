// FileStore beyond the conformance suite: processes sharing one file, the
// last user removing it, and damaged files.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "tdist/store.h"
#include "tests/util/process.h"

using namespace std::chrono_literals;
namespace test = tdist::test;

namespace {

bool exists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

TEST(FileStore, ProcessesSharingOneFileCountExactly) {
  test::TempDir dir;
  const std::string path = dir.path() + "/store";
  tdist::FileStore keep(path, 10s);
  constexpr int kProcs = 6, kAdds = 150;
  std::vector<pid_t> kids;
  for (int p = 0; p < kProcs; ++p) {
    kids.push_back(test::fork_child([&] {
      tdist::FileStore s(path, 30s);
      for (int i = 0; i < kAdds; ++i) s.add("counter", 1);
      s.set("done/" + std::to_string(p), "1");
      return 0;
    }));
  }
  for (pid_t k : kids) EXPECT_TRUE(test::exited_ok(test::wait_child(k, 60s)));
  EXPECT_EQ(keep.get_string("counter"), std::to_string(kProcs * kAdds));
  EXPECT_EQ(keep.num_keys(), kProcs + 1);
}

TEST(FileStore, BlockingGetSeesAnotherProcessWrite) {
  test::TempDir dir;
  const std::string path = dir.path() + "/store";
  tdist::FileStore s(path, 10s);
  pid_t kid = test::fork_child([&] {
    tdist::FileStore other(path, 10s);
    std::this_thread::sleep_for(100ms);
    other.set("from-child", "hi");
    other.wait({"ack"});
    return 0;
  });
  EXPECT_EQ(s.get_string("from-child"), "hi");
  s.set("ack", "1");
  EXPECT_TRUE(test::exited_ok(test::wait_child(kid, 20s)));
}

TEST(FileStore, TheLastUserRemovesTheFile) {
  test::TempDir dir;
  const std::string path = dir.path() + "/store";
  {
    auto a = std::make_unique<tdist::FileStore>(path);
    {
      tdist::FileStore b(path);
      b.set("k", "v");
    }
    EXPECT_TRUE(exists(path)) << "removed while a user was left";
    EXPECT_EQ(a->get_string("k"), "v");
  }
  EXPECT_FALSE(exists(path));
  // A fresh store on the same path starts empty.
  tdist::FileStore c(path);
  EXPECT_EQ(c.num_keys(), 0);
}

TEST(FileStore, NotAStoreFileIsRefused) {
  test::TempDir dir;
  const std::string path = dir.path() + "/notes.txt";
  std::ofstream(path) << "shopping list: eggs, milk\n";
  try {
    tdist::FileStore s(path);
    FAIL() << "opened a file that is not a store";
  } catch (const tdist::StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("not a tdist FileStore file"), std::string::npos) << e.what();
  }
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "shopping list: eggs, milk");  // left untouched
}

TEST(FileStore, ATruncatedRecordIsReportedWithItsOffset) {
  test::TempDir dir;
  const std::string path = dir.path() + "/store";
  tdist::FileStore s(path);
  s.set("good", "value");
  // A writer that died mid-record leaves a partial record behind.
  {
    int fd = open(path.c_str(), O_WRONLY | O_APPEND);
    const char partial[] = {1, 100, 0, 0, 0, 'a', 'b'};
    ASSERT_EQ(write(fd, partial, sizeof partial), (ssize_t)sizeof partial);
    close(fd);
  }
  try {
    s.get("good");
    FAIL() << "corruption went unnoticed";
  } catch (const tdist::StoreError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("corrupt record at offset"), std::string::npos) << m;
    EXPECT_NE(m.find(path), std::string::npos) << m;
  }
}

TEST(FileStore, AFileTruncatedUnderneathIsReported) {
  test::TempDir dir;
  const std::string path = dir.path() + "/store";
  tdist::FileStore s(path);
  s.set("k", std::string(100, 'x'));
  ASSERT_EQ(truncate(path.c_str(), 20), 0);
  EXPECT_THROW(s.check({"k"}), tdist::StoreError);
}

TEST(FileStore, UnopenablePathNamesIt) {
  try {
    tdist::FileStore s("/nonexistent-dir-tdist/store");
    FAIL();
  } catch (const tdist::StoreError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir-tdist/store"), std::string::npos);
  }
}

}  // namespace
