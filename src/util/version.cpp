#include "tdist/version.h"

#include "tdist/config.h"
#include "util/torch_compat.h"

namespace tdist {

std::string version() { return TDIST_VERSION_STRING; }

std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

}  // namespace tdist
