// The group a hook reduces over: the one given, or the default group.
#pragma once

#include <memory>

#include "tdist/process_group.h"

namespace tdist::detail {

// UsageError naming `who` when neither exists.
std::shared_ptr<ProcessGroup> hook_group(const std::shared_ptr<ProcessGroup>& group, const char* who);

}  // namespace tdist::detail
