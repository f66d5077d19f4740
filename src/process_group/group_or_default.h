// The group an operation runs on: the one given, or the default group
// (what hooks, DDP and PowerSGD do with a null group).
#pragma once

#include <memory>

#include "tdist/process_group.h"

namespace tdist::detail {

// UsageError naming `who` when neither exists.
std::shared_ptr<ProcessGroup> group_or_default(const std::shared_ptr<ProcessGroup>& group, const char* who);

}  // namespace tdist::detail
