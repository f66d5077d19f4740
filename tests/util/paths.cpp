#include "tests/util/paths.h"

#include <cstdlib>

namespace tdist::test {

const std::string& bin_dir() {
  static const std::string dir = [] {
    const char* env = std::getenv("TDIST_TEST_BIN_DIR");
    return std::string(env != nullptr && *env != '\0' ? env : TDIST_PATHS_BIN_DIR);
  }();
  return dir;
}

const std::string& source_dir() {
  static const std::string dir = TDIST_PATHS_SOURCE_DIR;
  return dir;
}

}  // namespace tdist::test
