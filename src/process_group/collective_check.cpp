// CollectiveCheck: publish, gather, compare. The contract is in
// collective_check.h.
#include "process_group/collective_check.h"

#include <algorithm>

#include "comm/op_label.h"
#include "tdist/errors.h"

namespace tdist::detail {

CollectiveCheck::CollectiveCheck(std::shared_ptr<Store> store, int rank, std::vector<int> ranks,
                                   std::string group_name)
    : store_(std::move(store)), rank_(rank), ranks_(std::move(ranks)), group_name_(std::move(group_name)) {}

void CollectiveCheck::check(const std::string& mine, comm::Deadline d) {
  const uint64_t seq = seq_++;  // the store's keys: checked ops only
  const uint64_t label = comm::op_label_or(seq + 1);  // messages: the group's number (op_label.h)
  const int size = static_cast<int>(ranks_.size());
  const std::string prefix = "collective_check/" + std::to_string(seq) + "/";
  store_->set(prefix + std::to_string(rank_), mine);
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
  const auto left = std::chrono::duration_cast<Milliseconds>(comm::resolve_deadline(d) - comm::Clock::now());
  std::vector<Bytes> all;
  try {
    all = store_->multi_get(keys, std::max(left, Milliseconds(1)));
  } catch (const TimeoutError&) {
    std::string missing;
    for (int r = 0; r < size; ++r) {
      if (!store_->check({keys[r]})) missing += (missing.empty() ? "" : ", ") + std::to_string(ranks_[r]);
    }
    throw TimeoutError("TDIST_DEBUG=detail: " + mine + " #" + std::to_string(label) + " in group '" + group_name_ +
                       "' timed out; rank(s) " + missing + " never arrived");
  }
  if (seq > 0) store_->delete_key("collective_check/" + std::to_string(seq - 1) + "/" + std::to_string(rank_));
  for (const auto& sig : all) {
    if (to_string(sig) == mine) continue;
    std::string msg = "ranks called different collectives at step #" + std::to_string(label) + " of group '" +
                      group_name_ + "' (TDIST_DEBUG=detail):";
    for (int r = 0; r < size; ++r) msg += "\n  rank " + std::to_string(ranks_[r]) + ": " + to_string(all[r]);
    throw CollectiveMismatchError(msg);
  }
}

}  // namespace tdist::detail
