// The collective conformance suite on real processes forked by the test,
// world sizes 1 to 4, for the shm and gloo backends. The bodies live in
// conformance.h; mpi_collectives_test.cpp runs them under mpirun.
#include <gtest/gtest.h>

#include "tests/process_group/conformance.h"

namespace {

namespace conformance = tdist::test::conformance;

class Collectives : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  void run(void (*fn)(tdist::ProcessGroup&)) {
    tdist::test::WorldOptions o;
    o.backend = std::get<0>(GetParam());
    EXPECT_EQ(tdist::test::run_world(std::get<1>(GetParam()), fn, o), "");
  }
};

TEST_P(Collectives, AllReduceEveryDtypeOpAndSize) { run(conformance::AllReduceEveryDtypeOpAndSize); }
TEST_P(Collectives, AllReduceCoalescedMatchesTheConcatenation) {
  run(conformance::AllReduceCoalescedMatchesTheConcatenation);
}
TEST_P(Collectives, AllReduceWireDtypeIsCastReduceCast) { run(conformance::AllReduceWireDtypeIsCastReduceCast); }
TEST_P(Collectives, AllReduceOnSymmetricMemory) { run(conformance::AllReduceOnSymmetricMemory); }
TEST_P(Collectives, ReduceToEveryRoot) { run(conformance::ReduceToEveryRoot); }
TEST_P(Collectives, BroadcastFromEveryRoot) { run(conformance::BroadcastFromEveryRoot); }
TEST_P(Collectives, AllGatherBothForms) { run(conformance::AllGatherBothForms); }
TEST_P(Collectives, ReduceScatterBothForms) { run(conformance::ReduceScatterBothForms); }
TEST_P(Collectives, AllGatherCoalescedMatchesEachAllGather) { run(conformance::AllGatherCoalescedMatchesEachAllGather); }
TEST_P(Collectives, ReduceScatterCoalescedMatchesEachReduceScatter) {
  run(conformance::ReduceScatterCoalescedMatchesEachReduceScatter);
}
TEST_P(Collectives, GatherAndReduceScatterOnSymmetricMemory) {
  run(conformance::GatherAndReduceScatterOnSymmetricMemory);
}
TEST_P(Collectives, GatherAndScatterAtEveryRoot) { run(conformance::GatherAndScatterAtEveryRoot); }
TEST_P(Collectives, AllToAllEqualAndUnevenSplits) { run(conformance::AllToAllEqualAndUnevenSplits); }
TEST_P(Collectives, SendRecvWithTagsAndBarrier) { run(conformance::SendRecvWithTagsAndBarrier); }
TEST_P(Collectives, ManyQueuedOpsCompleteInOrder) { run(conformance::ManyQueuedOpsCompleteInOrder); }
TEST_P(Collectives, WaitersOnSeveralThreadsKeepTheOrder) { run(conformance::WaitersOnSeveralThreadsKeepTheOrder); }
TEST_P(Collectives, SynchronousCallsAreDoneOnReturn) { run(conformance::SynchronousCallsAreDoneOnReturn); }

std::string param_name(const ::testing::TestParamInfo<std::tuple<std::string, int>>& info) {
  return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Backends, Collectives,
                         ::testing::Combine(::testing::Values("shm", "gloo"), ::testing::Values(1, 2, 3, 4)),
                         param_name);

}  // namespace
