// OpCounts: ProcessGroup::collective_counts() kept without a lock or a
// string lookup. Every op a group queues has a slot (GroupOp), and each
// call adds to its slot's relaxed atomics; collective_counts() reads the
// slots into a map by name.
//
// Threading: add() and read() may run on any thread at once; a read while
// ops are queued sees each counter at some recent value (the three of a
// slot are not read as one).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
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
    Slot& s = slots_[static_cast<size_t>(op)];
    s.calls.fetch_add(1, std::memory_order_relaxed);
    s.input_bytes.fetch_add(input_bytes, std::memory_order_relaxed);
    s.output_bytes.fetch_add(output_bytes, std::memory_order_relaxed);
  }
  // The ops called at least once, by name.
  std::map<std::string, CollectiveCount> read() const;
  void reset();

 private:
  struct Slot {
    std::atomic<int64_t> calls{0};
    std::atomic<int64_t> input_bytes{0};
    std::atomic<int64_t> output_bytes{0};
  };
  std::array<Slot, static_cast<size_t>(GroupOp::kCount)> slots_;
};

}  // namespace tdist::detail
