// check_same_model (describe, all_gather, compare) and broadcast_from_rank0.
// The contract is in model_check.h.
#include "ddp/model_check.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <sstream>

#include "util/bytes.h"
#include "process_group/agree.h"

namespace tdist::detail {

namespace {

std::string describe_param(const std::string& name, const at::Tensor& p) {
  std::ostringstream os;
  os << name << " " << p.sizes() << " " << c10::toString(p.scalar_type());
  return os.str();
}

// Every rank's string (no timeout of its own: the group's default).
std::vector<std::string> all_gather_strings(ProcessGroup& pg, const std::string& mine) {
  return all_gather_bytes(pg, mine, std::nullopt);
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

}  // namespace

void check_same_model(ProcessGroup& pg, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                      const std::string& who) {
  std::string mine;
  for (size_t i = 0; i < params.size(); ++i) mine += describe_param(names[i], params[i]) + "\n";
  const auto all = all_gather_strings(pg, mine);
  const auto ref = split_lines(all[0]);
  for (int r = 1; r < pg.size(); ++r) {
    if (all[r] == all[0]) continue;
    const auto theirs = split_lines(all[r]);
    size_t k = 0;
    while (k < ref.size() && k < theirs.size() && ref[k] == theirs[k]) ++k;
    const std::string a = k < ref.size() ? "'" + ref[k] + "'" : "nothing";
    const std::string b = k < theirs.size() ? "'" + theirs[k] + "'" : "nothing";
    throw UsageError(who + ": rank " + std::to_string(pg.ranks()[r]) +
                     "'s model differs from rank " + std::to_string(pg.ranks()[0]) + "'s at parameter #" +
                     std::to_string(k) + ": rank " + std::to_string(pg.ranks()[0]) + " has " + a + ", rank " +
                     std::to_string(pg.ranks()[r]) + " has " + b + ". Build the same model on every rank");
  }
}

void broadcast_from_rank0(ProcessGroup& pg, const std::vector<at::Tensor>& tensors) { broadcast_from(pg, tensors, 0); }

void broadcast_from(ProcessGroup& pg, const std::vector<at::Tensor>& tensors, int root) {
  at::NoGradGuard no_grad;
  std::vector<std::shared_ptr<Work>> works;
  for (const auto& t : tensors) {
    if (t.numel() > 0) works.push_back(pg.broadcast(t.detach(), {root}));
  }
  for (auto& w : works) w->wait();
}

}  // namespace tdist::detail
