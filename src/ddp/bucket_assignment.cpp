// assign_buckets: greedy packing under the size caps, in reverse
// registration order or a given order. The contract is in bucket_assignment.h.
#include "ddp/bucket_assignment.h"

#include <algorithm>
#include <map>

namespace tdist::detail {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<ParamInfo>& params, size_t first_cap_bytes,
                                                size_t cap_bytes) {
  std::vector<size_t> order(params.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = order.size() - 1 - k;
  return assign_buckets_in_order(params, order, first_cap_bytes, cap_bytes);
}

std::vector<std::vector<size_t>> assign_buckets_in_order(const std::vector<ParamInfo>& params,
                                                         const std::vector<size_t>& order, size_t first_cap_bytes,
                                                         size_t cap_bytes) {
  std::vector<std::vector<size_t>> out;
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
  };
  std::map<int, Open> open;  // one open bucket per dtype
  auto cap = [&] { return out.empty() ? first_cap_bytes : cap_bytes; };
  std::vector<size_t> position(params.size());
  for (size_t pos = 0; pos < order.size(); ++pos) {
    const size_t k = order[pos];
    position[k] = pos;
    Open& b = open[params[k].dtype];
    b.members.push_back(k);
    b.bytes += params[k].bytes;
    if (b.bytes >= cap()) {
      out.push_back(std::move(b.members));
      b = Open{};
    }
  }
  // What is left, in the order of each bucket's last member.
  std::vector<std::pair<size_t, std::vector<size_t>>> rest;
  for (auto& [dtype, b] : open) {
    if (!b.members.empty()) rest.emplace_back(position[b.members.back()], std::move(b.members));
  }
  std::sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [last, members] : rest) out.push_back(std::move(members));
  return out;
}

}  // namespace tdist::detail
