// CollectiveCheck: TDIST_DEBUG=detail's cross-rank check. Before each
// collective runs, every rank publishes its signature (op, dtype, shape,
// root, reduce op: "all_reduce Float[4] SUM") in the group's store and
// compares it with every other rank's, so that ranks calling different
// collectives are named on any backend instead of hanging or reducing
// garbage.
//
// Owns: the count of checked ops (signatures are matched by the order ops
// run in, the same on every rank, chained ops included).
// Threading: check() runs on the thread that runs the group's ops, one at
// a time (TaskQueue guarantees it); nothing else is shared.
// Lifetime: holds the group's private store.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/backend.h"
#include "tdist/store.h"

namespace tdist::detail {

class CollectiveCheck {
 public:
  // ranks: the group's ranks in the world (for messages); rank: ours in it.
  CollectiveCheck(std::shared_ptr<Store> store, int rank, std::vector<int> ranks, std::string group_name);

  // Publishes `mine` as the next op's signature and waits (until d) for
  // every rank's. Throws CollectiveMismatchError naming each rank's op when
  // they differ, TimeoutError naming the ranks that never arrived.
  void check(const std::string& mine, comm::Deadline d);

 private:
  std::shared_ptr<Store> store_;
  int rank_;
  std::vector<int> ranks_;
  std::string group_name_;
  uint64_t seq_ = 0;
};

}  // namespace tdist::detail
