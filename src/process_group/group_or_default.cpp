// group_or_default: the group a hook or DDP part was given, else the
// default one. The contract is in group_or_default.h.
#include "process_group/group_or_default.h"

#include "tdist/errors.h"

namespace tdist::detail {

std::shared_ptr<ProcessGroup> group_or_default(const std::shared_ptr<ProcessGroup>& group, const char* who) {
  auto g = group ? group : default_group();
  if (!g) throw UsageError(std::string(who) + ": no process group given and no default group");
  return g;
}

}  // namespace tdist::detail
