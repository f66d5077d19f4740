// Where this build's programs (build/bin) and the project's sources are.
// They are compiled into paths.cpp alone, not into every test: a path on a
// compile line differs from clone to clone, so each test that carried one
// missed ccache in every fresh clone (CI) and was compiled again.
#pragma once

#include <string>

namespace tdist::test {

// This build's bin directory; TDIST_TEST_BIN_DIR overrides it (a test run
// against another build's programs).
const std::string& bin_dir();
// The source tree this build was configured from.
const std::string& source_dir();

}  // namespace tdist::test
