// A job on a machine whose /dev/shm is too small for the group segment:
// every rank fails with an error naming /dev/shm, the bytes needed and the
// bytes free (not SIGBUS at the first touch of a sparse segment), and
// nothing stays in /dev/shm. Real processes under tdist-run, in a private
// mount namespace with its own small tmpfs on /dev/shm (root: unshare -m;
// otherwise a user namespace, unshare -rm).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "tests/util/process.h"
#include "tests/util/skip.h"
#include "tests/util/paths.h"

using namespace std::chrono_literals;
using tdist::test::run_command;

namespace {

// Runs a 2-rank allreduce_demo with a /dev/shm of `size`, then lists what
// is left there. Exit code 77, with what unshare or mount said: no mount
// namespace with its own /dev/shm here (tried first, on its own, so that
// unshare's failure is not taken for the job's).
tdist::test::CommandResult job_with_devshm(const std::string& size) {
  const std::string bin = tdist::test::bin_dir();
  const std::string unshare = geteuid() == 0 ? "unshare -m --propagation private" : "unshare -rm --propagation private";
  const std::string probe = "if ! out=$(" + unshare + " sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm' 2>&1); " +
                            "then echo \"$out\"; exit 77; fi; ";
  const std::string script = "mount -t tmpfs -o size=" + size + " tmpfs /dev/shm || exit 77; " + bin +
                             "/tdist-run --nproc-per-node 2 " + bin +
                             "/allreduce_demo; rc=$?; echo \"left in /dev/shm: [$(ls -A /dev/shm)]\"; exit $rc";
  return run_command(probe + unshare + " sh -c '" + script + "' 2>&1 || exit $?", 120s);
}

bool no_namespace(const tdist::test::CommandResult& r) {
  return WIFEXITED(r.status) && WEXITSTATUS(r.status) == 77;
}

TEST(SmallDevShm, AJobThatFitsRuns) {
  // The control: the same job in the same kind of namespace, with room.
  const auto r = job_with_devshm("256m");
  if (no_namespace(r)) TDIST_SKIP_OR_FAIL_IN_CI("no private mount namespace here: " << r.output);
  ASSERT_TRUE(tdist::test::exited_ok(r.status)) << tdist::test::describe_status(r.status) << "\n" << r.output;
  EXPECT_NE(r.output.find("left in /dev/shm: []"), std::string::npos) << r.output;
}

TEST(SmallDevShm, EveryRankNamesDevShmAndNothingStays) {
  const auto r = job_with_devshm("1m");
  if (no_namespace(r)) TDIST_SKIP_OR_FAIL_IN_CI("no private mount namespace here: " << r.output);
  ASSERT_NE(r.status, -1) << "the job hung:\n" << r.output;
  EXPECT_FALSE(tdist::test::exited_ok(r.status)) << r.output;
  EXPECT_EQ(r.output.find("Bus error"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("signal 7"), std::string::npos) << r.output;
  // Rank 0 makes the segment; rank 1 hears why from it (not "connection
  // reset" when rank 0, which may hold the store, exits).
  EXPECT_NE(r.output.find("bytes of /dev/shm ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bytes free of"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 has no group segment: rank 0 cannot reserve"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("left in /dev/shm: []"), std::string::npos) << r.output;
}

}  // namespace
