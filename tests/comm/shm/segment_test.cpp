// The shm group segment: names, the stale-segment sweep, what the kernel
// says about processes, and attaching ranks (as threads) to one segment.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <set>
#include <thread>

#include "comm/shm/process_info.h"
#include "comm/shm/segment.h"
#include "comm/shm/shm_backend.h"
#include "tdist/errors.h"
#include "tests/comm/shm/threads.h"
#include "tests/util/process.h"

using namespace tdist::comm::shm;
using namespace tdist::test::shm;

namespace {

// /dev/shm entries named after this process.
std::vector<std::string> segments_of(pid_t pid) {
  std::vector<std::string> out;
  const std::string prefix = std::string(kSegmentPrefix) + std::to_string(pid) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) out.push_back(e->d_name);
    }
    closedir(d);
  }
  return out;
}

pid_t dead_pid() {
  const pid_t pid = tdist::test::fork_child([] { return 0; });
  tdist::test::wait_child(pid, 10s);
  return pid;
}

void make_segment(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << name;
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
}

TEST(SegmentNames, CarryThePidARandomPartAndTheTag) {
  const std::string prefix = "/" + std::string(kSegmentPrefix) + std::to_string(getpid()) + "-";
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const std::string name = new_segment_name("-b7");
    ASSERT_EQ(name.rfind(prefix, 0), 0u) << name;
    const std::string rest = name.substr(prefix.size());
    ASSERT_EQ(rest.size(), 16u + 3u) << name;
    EXPECT_EQ(rest.substr(16), "-b7");
    EXPECT_EQ(rest.find_first_not_of("0123456789abcdef"), 16u) << name;
    seen.insert(name);
  }
  EXPECT_EQ(seen.size(), 100u) << "names repeat";
  EXPECT_EQ(new_segment_name().size(), prefix.size() + 16);
}

TEST(ProcessInfo, TellsTheLivingFromTheDead) {
  EXPECT_TRUE(pid_alive(getpid()));
  EXPECT_GT(process_start_time(getpid()), 0u);
  EXPECT_EQ(process_start_time(getpid()), process_start_time(getpid()));
  const pid_t dead = dead_pid();
  EXPECT_EQ(process_start_time(dead), 0u);
}

// A peer that is reaped while its /proc entry is being read (read() then
// fails with ESRCH) is "not there", never an exception.
TEST(ProcessInfo, NeverThrowsForAProcessReapedWhileItIsRead) {
  for (int i = 0; i < 200; ++i) {
    const pid_t child = fork();
    if (child == 0) _exit(0);
    std::atomic<bool> reaped{false};
    std::thread reaper([&] {
      waitpid(child, nullptr, 0);
      reaped = true;
    });
    bool threw = false;
    while (!reaped && !threw) {
      try {
        process_start_time(child);
      } catch (const std::exception& e) {
        threw = true;
        ADD_FAILURE() << "process_start_time threw: " << e.what();
      }
    }
    reaper.join();
    if (threw) return;
  }
}

TEST(Sweep, RemovesTheSegmentsOfDeadProcessesOnly) {
  const std::string stale = "/" + std::string(kSegmentPrefix) + std::to_string(dead_pid()) + "-deadbeefdeadbeef";
  const std::string live = new_segment_name("-sweep-test");
  const std::string foreign = "/not-tdist-" + std::to_string(dead_pid());
  make_segment(stale);
  make_segment(live);
  make_segment(foreign);
  EXPECT_GE(sweep_stale_segments(), 1);
  EXPECT_NE(shm_unlink(stale.c_str()), 0) << "the stale segment was still there";
  EXPECT_EQ(shm_unlink(live.c_str()), 0) << "a live process's segment was swept";
  EXPECT_EQ(shm_unlink(foreign.c_str()), 0) << "another program's segment was swept";
}

TEST(GroupSegment, EveryRankMapsTheSameMemoryAndNothingStaysInDevShm) {
  GroupOptions o;
  o.size = 3;
  o.round_bytes = 8192;
  o.ring_bytes = 4096;
  auto store = std::make_shared<tdist::HashStore>();
  std::vector<std::unique_ptr<GroupSegment>> segs(o.size);
  auto errors = run_ranks(o.size, [&](int r) {
    segs[r] = std::make_unique<GroupSegment>(context(store, o, r), o.round_bytes, o.ring_bytes);
  });
  for (int r = 0; r < o.size; ++r) ASSERT_EQ(message(errors[r]), "") << "rank " << r;
  EXPECT_TRUE(segments_of(getpid()).empty()) << "the group segment was not unlinked";
  for (int r = 0; r < o.size; ++r) {
    EXPECT_EQ(segs[r]->size(), o.size);
    EXPECT_EQ(segs[r]->round_bytes(), o.round_bytes);
    EXPECT_EQ(segs[r]->ring_bytes(), o.ring_bytes);
    EXPECT_EQ(segs[0]->slot(r)->pid.load(), getpid()) << "rank " << r << " did not record its pid";
    EXPECT_EQ(segs[0]->slot(r)->start_time.load(), process_start_time(getpid()));
    EXPECT_EQ(segs[0]->slot(r)->arrived(), 0u);
  }
  // What one rank writes anywhere, every other reads at the same place of
  // its own mapping.
  for (int w = 0; w < o.size; ++w) {
    for (int q = 0; q < o.size; ++q) {
      for (uint64_t parity : {0, 1}) {
        uint8_t* buf = segs[w]->staging(q, parity);
        std::memset(buf, 0x10 * w + 2 * q + int(parity), o.round_bytes);
      }
      std::memset(segs[w]->ring_data(w, q), 0x80 + w + q, o.ring_bytes);
    }
    for (int r = 0; r < o.size; ++r) {
      for (int q = 0; q < o.size; ++q) {
        for (uint64_t parity : {0, 1}) {
          const uint8_t* buf = segs[r]->staging(q, parity);
          ASSERT_EQ(buf[0], 0x10 * w + 2 * q + int(parity));
          ASSERT_EQ(buf[o.round_bytes - 1], 0x10 * w + 2 * q + int(parity)) << "staging buffers overlap";
        }
        ASSERT_EQ(segs[r]->ring_data(w, q)[0], 0x80 + w + q);
        ASSERT_EQ(segs[r]->ring_data(w, q)[o.ring_bytes - 1], 0x80 + w + q) << "rings overlap";
        ASSERT_EQ(segs[r]->ring_of(w, q)->head.load(), 0u) << "ring data overwrote its counters";
      }
    }
  }
}

TEST(GroupSegment, RanksWithOtherBufferSettingsAreRefusedAndNothingStays) {
  GroupOptions o;
  o.size = 2;
  o.timeout = 2000ms;
  auto store = std::make_shared<tdist::HashStore>();
  auto errors = run_ranks(o.size, [&](int r) {
    // Rank 1 comes once rank 0 has published the segment, so that only
    // rank 0 waits out the timeout.
    if (r == 1) store->wait({"shm/segment"}, 60s);
    GroupSegment seg(context(store, o, r), r == 0 ? 4096 : 8192, 4096);
  });
  EXPECT_TRUE(contains(message(errors[1]), "unexpected size")) << message(errors[1]) << "\nrank 0: " << message(errors[0]);
  EXPECT_TRUE(contains(message(errors[0]), "shm/all_attached")) << "rank 0 should time out waiting for rank 1: "
                                                                << message(errors[0]);
  EXPECT_TRUE(segments_of(getpid()).empty()) << "a refused segment stayed in /dev/shm";
}

}  // namespace
