#pragma once

#include <string>

namespace tdist {

// tdist's own version, e.g. "0.1.0".
std::string version();
// The LibTorch version tdist was built against, e.g. "1.13.0".
std::string torch_version();

}  // namespace tdist
