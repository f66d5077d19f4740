// A test that cannot run on this machine (no second uid, no private mount
// namespace, ...) skips, and says why. Under CI (the environment variable CI
// is "true": .ci/run sets it) it fails instead, naming the same reason: CI
// runs as root, where every such test can run, so there a skip would be a
// test that silently stopped testing anything.
// tests/process_group/gloo_netns_test.sh does the same in shell (exit 1
// instead of ctest's skip code 77), and scripts/test-suites.sh fails a suite
// that reports a skip under CI=true.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace tdist::test {

inline bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::strcmp(ci, "true") == 0;
}

}  // namespace tdist::test

// In a TEST body: returns from it, skipped, or failed under CI=true. `why`
// is anything that can be streamed into a gtest message.
#define TDIST_SKIP_OR_FAIL_IN_CI(why)                                                    \
  do {                                                                                   \
    if (::tdist::test::in_ci()) {                                                        \
      GTEST_FAIL() << "this test would skip, but CI=true, where it must run: " << why; \
    } else {                                                                             \
      GTEST_SKIP() << why;                                                               \
    }                                                                                    \
  } while (0)
