// "Do all ranks agree?": the small collectives the checkpoint protocols,
// DDP's model check and the Checkpointer use to hear every rank before
// any acts, in one place. Each is collective over `pg` (every rank calls
// it, in the same order) and waits at most `timeout` (nullopt: the
// group's default; a rank that never answers is that collective's timeout
// error, naming it).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tdist/process_group.h"

namespace tdist::detail {

// Every rank's bytes, to every rank, in rank order (two all_gathers: the
// lengths, then the bytes padded to the longest).
std::vector<std::string> all_gather_bytes(ProcessGroup& pg, const std::string& mine,
                                          std::optional<std::chrono::milliseconds> timeout);

// Every rank says how its part went ("" when well): the first failing
// rank's words as "rank R: ..." (at most 4 KiB of them; every rank gets
// the same), or "" when all went well.
std::string first_failure(ProcessGroup& pg, const std::string& mine, std::optional<std::chrono::milliseconds> timeout);

// Whether `ok` holds on every rank (the same answer on every rank).
bool all_ok(ProcessGroup& pg, bool ok, std::optional<std::chrono::milliseconds> timeout);

// Rank 0's `value`, on every rank.
int64_t rank0_value(ProcessGroup& pg, int64_t value, std::optional<std::chrono::milliseconds> timeout);

}  // namespace tdist::detail
