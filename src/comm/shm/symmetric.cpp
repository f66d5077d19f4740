// Symmetric blocks: allocation as a collective, mapping every rank's copy,
// the registry of live blocks. The contract is in symmetric.h.
#include "comm/shm/symmetric.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>

#include "comm/shm/algorithms.h"
#include "comm/shm/segment.h"
#include "util/env.h"
#include "util/private_file.h"

namespace tdist::comm::shm {

namespace {

void unmap_all(const std::vector<uint8_t*>& copies, size_t mapped) {
  for (uint8_t* c : copies) {
    if (c) munmap(c, mapped);
  }
}

}  // namespace

std::shared_ptr<void> allocate_symmetric_block(Rounds& rounds, const std::shared_ptr<SymRegistry>& registry,
                                               size_t bytes, Deadline d, std::string* why_not) {
  const int n = rounds.size();
  const int me = rounds.rank();
  const Waiter& waiter = rounds.waiter();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t mapped = align_up(std::max<size_t>(bytes, 1), page);
  // Round 1 swaps segment names (or why there is none), round 2 reports
  // whether every rank mapped every segment.
  struct Record {
    uint32_t ok;
    char text[252];
  };
  static_assert(sizeof(Record) == 256, "records are exchanged as raw bytes");
  auto put = [](Record& r, bool ok, const std::string& text) {
    r.ok = ok ? 1 : 0;
    std::snprintf(r.text, sizeof r.text, "%s", text.c_str());
  };
  std::vector<uint8_t*> copies(n, nullptr);
  std::string name;
  Record mine{};
  {
    name = new_segment_name("-b" + std::to_string(rounds.next_seq()));
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
      put(mine, false, "cannot create " + name + ": " + detail::errno_string(errno));
    } else {
      const std::string why = reserve_shm(fd, mapped);
      if (!why.empty()) close(fd);
      void* p = why.empty() ? map_and_close(fd, mapped) : MAP_FAILED;
      const int map_errno = errno;
      if (!why.empty() || p == MAP_FAILED) shm_unlink(name.c_str());  // created, not kept: leave nothing in /dev/shm
      if (!why.empty()) {
        put(mine, false, why);
      } else if (p == MAP_FAILED) {
        put(mine, false, "cannot map " + name + ": " + detail::errno_string(map_errno));
      } else {
        copies[me] = static_cast<uint8_t*>(p);
        put(mine, true, name);
      }
    }
  }
  const OpDesc first = rounds.begin_op(OpKind::kSymmetricAlloc, DataType::kUInt8, ReduceOp::kSum, -1, bytes, d);
  std::vector<Record> all(n);
  auto release = [&] {
    unmap_all(copies, mapped);
    if (mine.ok) shm_unlink(name.c_str());
    mine.ok = 0;
  };
  // The first failure among the records, as "rank R: why".
  auto first_failure = [&](const std::vector<Record>& recs) {
    for (int r = 0; r < n; ++r) {
      if (!recs[r].ok) return "rank " + std::to_string(waiter.global(r)) + ": " + std::string(recs[r].text);
    }
    return std::string();
  };
  try {
    algo::gather(rounds, &mine, all.data(), sizeof(Record), -1, first, d);
    std::string failed = first_failure(all);
    Record mapped_all{};
    if (failed.empty()) {
      std::string err;
      for (int r = 0; r < n && err.empty(); ++r) {
        if (r == me) continue;
        const std::string peer_name(all[r].text);
        const int fd = shm_open(peer_name.c_str(), O_RDWR | O_CLOEXEC, 0600);
        const std::string not_private = fd < 0 ? std::string() : detail::why_not_private(fd);
        if (!not_private.empty()) {
          close(fd);
          err = "rank " + std::to_string(waiter.global(r)) + "'s " + peer_name + " " + not_private +
                "; refusing to map it";
          break;
        }
        void* p = fd < 0 ? MAP_FAILED : map_and_close(fd, mapped);
        if (p == MAP_FAILED) {
          err = "cannot map rank " + std::to_string(waiter.global(r)) + "'s " + peer_name + ": " +
                detail::errno_string(errno);
        } else {
          copies[r] = static_cast<uint8_t*>(p);
        }
      }
      put(mapped_all, err.empty(), err);
    } else {
      put(mapped_all, false, "");
    }
    // Everyone has mapped every segment (or given up) after this round.
    algo::gather(rounds, &mapped_all, all.data(), sizeof(Record), -1,
                 rounds.begin_op(OpKind::kSymmetricAlloc, DataType::kUInt8, ReduceOp::kSum, -1, bytes, d), d);
    if (mine.ok) shm_unlink(name.c_str());
    if (failed.empty()) failed = first_failure(all);
    if (!failed.empty()) {
      unmap_all(copies, mapped);
      if (why_not) *why_not = failed;
      return nullptr;
    }
  } catch (...) {
    release();
    throw;
  }
  SymBlock block;
  block.id = first.seq;
  block.bytes = bytes;
  block.mapped = mapped;
  block.copies = copies;
  uint8_t* own = copies[me];
  registry->add(own, std::move(block));
  return std::shared_ptr<void>(own, [registry, copies, mapped](void* p) {
    registry->erase(p);
    unmap_all(copies, mapped);
  });
}

}  // namespace tdist::comm::shm
