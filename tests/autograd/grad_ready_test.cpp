// GradReadyTracker: its hooks fire once per parameter per backward (also
// after the graph that made the accumulators is gone), the end-of-backward
// callback runs once, after every hook and before backward() returns, and
// the graph walk finds the parameters a forward's outputs cannot reach.
#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "autograd/grad_ready.h"

namespace {

using tdist::detail::GradReadyListener;
using tdist::detail::GradReadyTracker;

// Records the calls as "g<i>" and "end"; arms the end-of-backward callback
// on every gradient, as DDP does.
struct Recorder : GradReadyListener {
  void on_grad_ready(size_t index) override {
    events.push_back("g" + std::to_string(index));
    if (arm) tracker->arm_end_of_backward();
    if (!tracker->mark_arrived(index)) events.push_back("twice");
  }
  void on_backward_end() override {
    events.push_back("end");
    arrived_at_end = tracker->arrived();
    tracker->reset();
  }
  GradReadyTracker* tracker = nullptr;
  bool arm = true;
  std::vector<std::string> events;
  std::vector<char> arrived_at_end;
};

at::Tensor leaf(std::vector<int64_t> sizes) { return at::randn(sizes).set_requires_grad(true); }

struct Fixture {
  // w1 and w2 feed the loss through two layers; spare feeds nothing.
  std::vector<at::Tensor> params{leaf({4, 3}), leaf({3}), leaf({2})};
  std::shared_ptr<Recorder> recorder = std::make_shared<Recorder>();
  GradReadyTracker tracker{params, recorder};
  Fixture() { recorder->tracker = &tracker; }
  at::Tensor forward() { return at::matmul(at::ones({2, 4}), params[0]).tanh().matmul(params[1]); }
};

size_t count(const std::vector<std::string>& events, const std::string& e) {
  return static_cast<size_t>(std::count(events.begin(), events.end(), e));
}

TEST(GradReady, HooksFireOncePerBackwardAndTheEndComesLastBeforeBackwardReturns) {
  Fixture f;
  for (int step = 0; step < 3; ++step) {  // later steps: the first graph (and its hold on the accumulators) is gone
    f.recorder->events.clear();
    f.forward().sum().backward();
    const auto& ev = f.recorder->events;
    ASSERT_EQ(ev.size(), 3u) << "step " << step;
    EXPECT_EQ(count(ev, "g0"), 1u);
    EXPECT_EQ(count(ev, "g1"), 1u);
    EXPECT_EQ(ev.back(), "end");
    EXPECT_EQ(f.recorder->arrived_at_end, (std::vector<char>{1, 1, 0}));
    EXPECT_TRUE(f.params[0].grad().defined());  // the hook runs after accumulation
  }
}

TEST(GradReady, WithoutArmingThereIsNoEndCallback) {
  Fixture f;
  f.recorder->arm = false;
  f.forward().sum().backward();
  EXPECT_EQ(f.recorder->events.size(), 2u);
  EXPECT_EQ(count(f.recorder->events, "end"), 0u);
  EXPECT_EQ(f.tracker.arrived(), (std::vector<char>{1, 1, 0}));
  // A second backward without reset(): the arrivals are seen again.
  f.forward().sum().backward();
  EXPECT_EQ(count(f.recorder->events, "twice"), 2u);
  f.tracker.reset();
  EXPECT_EQ(f.tracker.arrived(), (std::vector<char>{0, 0, 0}));
}

TEST(GradReady, MarkArrivedSaysWhenAGradientComesTwice) {
  Fixture f;
  EXPECT_TRUE(f.tracker.mark_arrived(2));
  EXPECT_FALSE(f.tracker.mark_arrived(2));
  EXPECT_EQ(f.tracker.arrived(), (std::vector<char>{0, 0, 1}));
  f.tracker.reset();
  EXPECT_TRUE(f.tracker.mark_arrived(2));
}

TEST(GradReady, ArmingTwiceInOneBackwardQueuesOneCallback) {
  Fixture f;
  f.forward().sum().backward();  // both hooks arm
  EXPECT_EQ(count(f.recorder->events, "end"), 1u);
  // The callback reset the tracker: the next backward arms again.
  f.forward().sum().backward();
  EXPECT_EQ(count(f.recorder->events, "end"), 2u);
}

// What DDP's recovery from a failed backward rests on: when the backward
// throws after a hook armed the end-of-backward callback, the engine drops
// the callback, so the tracker stays armed until someone resets it.
TEST(GradReady, ABackwardThatThrowsLeavesTheTrackerArmedWithoutAnEnd) {
  Fixture f;
  // The hook on w2's gradient runs after w2's accumulator (w2 is nearer the
  // loss) and throws before w1's gradient is computed.
  auto h = at::matmul(at::ones({2, 4}), f.params[0]).tanh();
  h.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("boom"); });
  EXPECT_THROW(h.matmul(f.params[1]).sum().backward(), std::exception);
  EXPECT_EQ(f.recorder->events, (std::vector<std::string>{"g1"}));
  EXPECT_TRUE(f.tracker.armed());
  f.tracker.reset();
  EXPECT_FALSE(f.tracker.armed());
  f.forward().sum().backward();  // the next backward arms and ends as usual
  EXPECT_EQ(count(f.recorder->events, "end"), 1u);
  EXPECT_FALSE(f.tracker.armed());
}

TEST(GradReady, UnreachableParametersAreFoundFromTheOutputs) {
  Fixture f;
  EXPECT_EQ(f.tracker.unreachable_from({f.forward()}), (std::vector<size_t>{2}));
  // Through several outputs, undefined ones and ones without grad skipped.
  const auto only_spare = f.params[2] * 2;
  EXPECT_EQ(f.tracker.unreachable_from({at::Tensor(), at::ones({2}), only_spare}), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(f.tracker.unreachable_from({f.forward(), only_spare}), (std::vector<size_t>{}));
  // A parameter itself as an output reaches its own accumulator.
  EXPECT_EQ(f.tracker.unreachable_from({f.params[1]}), (std::vector<size_t>{0, 2}));
  EXPECT_EQ(f.tracker.unreachable_from({}), (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(f.tracker.size(), 3u);
}

TEST(GradReady, AGoneListenerIsNotCalled) {
  std::vector<at::Tensor> params{leaf({3})};
  auto recorder = std::make_shared<Recorder>();
  GradReadyTracker tracker(params, recorder);
  recorder->tracker = &tracker;
  (params[0] * 2).sum().backward();
  EXPECT_EQ(recorder->events, (std::vector<std::string>{"g0", "end"}));
  recorder.reset();
  (params[0] * 2).sum().backward();  // the hook is still there, the listener is not
  EXPECT_TRUE(params[0].grad().defined());
}

TEST(GradReady, HooksEndWithTheTracker) {
  std::vector<at::Tensor> params{leaf({3})};
  auto recorder = std::make_shared<Recorder>();
  {
    GradReadyTracker tracker(params, recorder);
    recorder->tracker = &tracker;
    (params[0] * 2).sum().backward();
  }
  EXPECT_EQ(recorder->events.size(), 2u);
  // The accumulator (and its hook) went with the tracker's hold.
  (params[0] * 2).sum().backward();
  EXPECT_EQ(recorder->events.size(), 2u);
}

}  // namespace
