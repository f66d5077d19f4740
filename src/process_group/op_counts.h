// OpCounts: ProcessGroup::collective_counts() kept without a lock or a
// string lookup on the ops' side (reading and resetting take one). Every
// op a group queues has a slot (GroupOp); an op counts as it is queued,
// or, a synchronous op run at once on its caller's thread, as it starts;
// collective_counts() reads the slots into a map by name.
//
// Threading: add() and read() may run on any thread at once; add_running()
// only under the group's run token (TaskQueue: one op at a time, so one
// writer at a time: plain stores, no locked instruction). A read while ops
// are queued sees each counter at some recent value (the three of a slot
// are not read as one). reset() never writes a counter (it keeps what they
// held as the zero), so an op counted meanwhile is never lost or undone
// (though a reset in the middle of a queued op's three adds may split
// that op's calls from its bytes).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "tdist/process_group.h"

namespace tdist::detail {

// The ops a group queues, each under the name collective_counts() and
// Work's messages use.
enum class GroupOp : uint8_t {
  kAllReduce,
  kAllReduceCoalesced,
  kBroadcast,
  kReduce,
  kAllGather,
  kAllGatherIntoTensor,
  kAllGatherIntoTensorCoalesced,
  kReduceScatter,
  kReduceScatterTensor,
  kReduceScatterTensorCoalesced,
  kGather,
  kScatter,
  kAllToAllSingle,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
  kEmptySymmetric,
  kCount  // not an op
};

const char* group_op_name(GroupOp op);
// The same as a string that lives as long as the process (Work::op_name).
const std::string& group_op_string(GroupOp op);

class OpCounts {
 public:
  void add(GroupOp op, int64_t input_bytes, int64_t output_bytes) {
    Slot& s = queued_[static_cast<size_t>(op)];
    s.calls.fetch_add(1, std::memory_order_relaxed);
    s.input_bytes.fetch_add(input_bytes, std::memory_order_relaxed);
    s.output_bytes.fetch_add(output_bytes, std::memory_order_relaxed);
  }
  // REQUIRES the group's run token (see above).
  void add_running(GroupOp op, int64_t input_bytes, int64_t output_bytes) {
    Slot& s = running_[static_cast<size_t>(op)];
    bump(s.calls, 1);
    bump(s.input_bytes, input_bytes);
    bump(s.output_bytes, output_bytes);
  }
  // The ops called at least once since the last reset, by name.
  std::map<std::string, CollectiveCount> read() const;
  void reset();

 private:
  struct Slot {
    std::atomic<int64_t> calls{0};
    std::atomic<int64_t> input_bytes{0};
    std::atomic<int64_t> output_bytes{0};
  };
  using Slots = std::array<Slot, static_cast<size_t>(GroupOp::kCount)>;
  using Totals = std::array<CollectiveCount, static_cast<size_t>(GroupOp::kCount)>;
  static void bump(std::atomic<int64_t>& c, int64_t by) {
    c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }
  // Both kinds of slot added up, since the process began.
  Totals totals() const;

  Slots queued_;
  Slots running_;
  mutable std::mutex mu_;  // guards zero_
  Totals zero_{};  // the totals at the last reset
};

}  // namespace tdist::detail
