// Process identity from /proc: start times that tell a live peer from a
// dead one whose pid was reused. The contract is in process_info.h.
#include "comm/shm/process_info.h"

#include <signal.h>

#include <cerrno>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace tdist::comm::shm {

uint64_t process_start_time(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(s.substr(close + 2));
  std::string state;
  rest >> state;
  if (state == "Z" || state == "X") return 0;
  std::string field;
  for (int i = 4; i <= 21; ++i) rest >> field;  // fields 4..21
  uint64_t start = 0;
  rest >> start;
  return start;
}

bool pid_alive(int pid) { return !(kill(pid, 0) != 0 && errno == ESRCH); }

}  // namespace tdist::comm::shm
