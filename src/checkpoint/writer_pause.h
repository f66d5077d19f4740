// Tests only: a pause at the start of every asynchronous save's writing
// (on the writer thread), so that a test can count on a save still being
// written some steps later. Zero (the default) in every other program.
#pragma once

#include <chrono>

namespace tdist::detail {

void set_checkpoint_writer_pause_for_testing(std::chrono::milliseconds pause);

}  // namespace tdist::detail
