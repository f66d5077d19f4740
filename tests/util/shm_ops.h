// What the shm backend sends, below the process group: how many
// collectives this rank's shm backend has started in a group. One call of
// the process group can be several of these (a coalesced op whose large
// pieces go alone), and these are what the ranks exchange and wait for.
//
// Read from the group's segment, which this process maps: each op's first
// round writes its descriptor, numbered by the backend from 0 (OpDesc::seq,
// comm/shm/rounds.h), into this rank's slot (comm/shm/segment.h). White-box:
// the layout is the library's own, included from src/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>

#include "comm/shm/segment.h"

namespace tdist::test {

// The shm collectives this rank has started in the one group of `size`
// ranks whose segment this process maps; -1 when it maps none, or several
// (the count would be ambiguous).
inline int64_t shm_collectives_started(int size, int rank) {
  using comm::shm::Header;
  using comm::shm::Slot;
  constexpr uint64_t kGroupSegmentMagic = 0x316d737473696474ull;  // "tdistsm1", segment.cpp
  std::ifstream maps("/proc/self/maps");
  const Slot* found = nullptr;
  int matches = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/dev/shm/tdist-shm-") == std::string::npos) continue;
    const uintptr_t start = std::stoull(line.substr(0, line.find('-')), nullptr, 16);
    const auto* header = reinterpret_cast<const Header*>(start);
    // Symmetric blocks are segments too, without the header.
    if (header->magic != kGroupSegmentMagic || header->size != static_cast<uint32_t>(size)) continue;
    ++matches;
    found = reinterpret_cast<const Slot*>(start + comm::shm::slots_offset()) + rank;
  }
  if (matches != 1) return -1;
  if (found->arrived() == 0) return 0;  // no barrier passed: no op yet
  const uint64_t last = std::max(found->line[0].desc.seq, found->line[1].desc.seq);
  return static_cast<int64_t>(last) + 1;
}

}  // namespace tdist::test
