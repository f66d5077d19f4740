// The process's count of idle-priority work; the contract is in idle_work.h.
#include "comm/idle_work.h"

namespace tdist::comm {

std::atomic<int>& idle_work_count() {
  static std::atomic<int> count{0};
  return count;
}

}  // namespace tdist::comm
