// The ranks' agreement collectives (agree.h).
#include "process_group/agree.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

namespace tdist::detail {

std::vector<std::string> all_gather_bytes(ProcessGroup& pg, const std::string& mine,
                                          std::optional<std::chrono::milliseconds> timeout) {
  CollectiveOptions o;
  o.timeout = timeout;
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({pg.size()}, at::kLong);
  pg.all_gather_into_tensor(lens, len, o)->wait();
  const int64_t longest = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor own = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(own.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({pg.size() * longest}, at::kByte);
  pg.all_gather_into_tensor(all, own, o)->wait();
  std::vector<std::string> out;
  const char* p = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < pg.size(); ++r) out.emplace_back(p + r * longest, static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

std::string first_failure(ProcessGroup& pg, const std::string& mine, std::optional<std::chrono::milliseconds> timeout) {
  const auto all = all_gather_bytes(pg, mine.substr(0, 4096), timeout);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) return "rank " + std::to_string(r) + ": " + all[r];
  }
  return "";
}

bool all_ok(ProcessGroup& pg, bool ok, std::optional<std::chrono::milliseconds> timeout) {
  at::Tensor flag = at::tensor({ok ? int64_t{1} : int64_t{0}}, at::kLong);
  AllreduceOptions o;
  o.op = ReduceOp::MIN;
  o.timeout = timeout;
  pg.all_reduce(flag, o)->wait();
  return flag.item<int64_t>() == 1;
}

int64_t rank0_value(ProcessGroup& pg, int64_t value, std::optional<std::chrono::milliseconds> timeout) {
  at::Tensor t = at::tensor({value}, at::kLong);
  BroadcastOptions o;
  o.timeout = timeout;
  pg.broadcast(t, o)->wait();
  return t.item<int64_t>();
}

}  // namespace tdist::detail
