// Bucket assignment: which parameters share a gradient bucket. Pure
// functions of the sizes and caps (no state, thread-safe).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tdist::detail {

struct ParamInfo {
  size_t bytes = 0;
  int dtype = 0;  // parameters of different dtypes never share a bucket
};

// Buckets in reverse registration order (gradients of the last layers are
// ready first in backward). A bucket closes once it holds at least
// first_cap_bytes (the first bucket, so that communication starts early) or
// cap_bytes (every later one); a parameter larger than the cap gets a bucket
// of its own. Returns the parameter indices of each bucket, in launch order.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<ParamInfo>& params, size_t first_cap_bytes,
                                                size_t cap_bytes);

// The same, with the parameters taken in `order` (a permutation of their
// indices: the order in which their gradients arrived) instead of reverse
// registration order. Used to rebuild the buckets after the first iteration.
std::vector<std::vector<size_t>> assign_buckets_in_order(const std::vector<ParamInfo>& params,
                                                         const std::vector<size_t>& order, size_t first_cap_bytes,
                                                         size_t cap_bytes);

}  // namespace tdist::detail
