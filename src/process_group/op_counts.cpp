// OpCounts: the op names and reading the counters. The contract is in
// op_counts.h.
#include "process_group/op_counts.h"

#include <algorithm>

namespace tdist::detail {

const char* group_op_name(GroupOp op) {
  switch (op) {
    case GroupOp::kAllReduce: return "all_reduce";
    case GroupOp::kAllReduceCoalesced: return "all_reduce_coalesced";
    case GroupOp::kBroadcast: return "broadcast";
    case GroupOp::kReduce: return "reduce";
    case GroupOp::kAllGather: return "all_gather";
    case GroupOp::kAllGatherIntoTensor: return "all_gather_into_tensor";
    case GroupOp::kAllGatherIntoTensorCoalesced: return "all_gather_into_tensor_coalesced";
    case GroupOp::kReduceScatter: return "reduce_scatter";
    case GroupOp::kReduceScatterTensor: return "reduce_scatter_tensor";
    case GroupOp::kReduceScatterTensorCoalesced: return "reduce_scatter_tensor_coalesced";
    case GroupOp::kGather: return "gather";
    case GroupOp::kScatter: return "scatter";
    case GroupOp::kAllToAllSingle: return "all_to_all_single";
    case GroupOp::kAllToAll: return "all_to_all";
    case GroupOp::kBarrier: return "barrier";
    case GroupOp::kSend: return "send";
    case GroupOp::kRecv: return "recv";
    case GroupOp::kEmptySymmetric: return "empty_symmetric";
    case GroupOp::kCount: break;
  }
  return "unknown op";
}

const std::string& group_op_string(GroupOp op) {
  static const auto* names = [] {
    auto* v = new std::array<std::string, static_cast<size_t>(GroupOp::kCount) + 1>;  // never freed: Works outlive statics
    for (size_t i = 0; i < v->size(); ++i) (*v)[i] = group_op_name(static_cast<GroupOp>(i));
    return v;
  }();
  return (*names)[std::min(static_cast<size_t>(op), names->size() - 1)];
}

OpCounts::Totals OpCounts::totals() const {
  Totals out{};
  for (size_t i = 0; i < out.size(); ++i) {
    for (const Slots* slots : {&queued_, &running_}) {
      const Slot& s = (*slots)[i];
      out[i].calls += s.calls.load(std::memory_order_relaxed);
      out[i].input_bytes += s.input_bytes.load(std::memory_order_relaxed);
      out[i].output_bytes += s.output_bytes.load(std::memory_order_relaxed);
    }
  }
  return out;
}

std::map<std::string, CollectiveCount> OpCounts::read() const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = totals();
  std::map<std::string, CollectiveCount> out;
  for (size_t i = 0; i < now.size(); ++i) {
    const CollectiveCount& z = zero_[i];
    const int64_t calls = now[i].calls - z.calls;
    if (calls <= 0) continue;
    out[group_op_name(static_cast<GroupOp>(i))] =
        CollectiveCount{calls, now[i].input_bytes - z.input_bytes, now[i].output_bytes - z.output_bytes};
  }
  return out;
}

void OpCounts::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  zero_ = totals();
}

}  // namespace tdist::detail
