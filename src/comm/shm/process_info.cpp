// Process identity from /proc: start times that tell a live peer from a
// dead one whose pid was reused. The contract is in process_info.h.
#include "comm/shm/process_info.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <sstream>
#include <string>

#include "util/open_file.h"

namespace tdist::comm::shm {

uint64_t process_start_time(int pid) {
  // Plain reads: a process that exits between the open and the read makes
  // read() fail with ESRCH, which std::ifstream would raise as an exception.
  std::string error;
  const int fd = tdist::detail::open_regular("/proc/" + std::to_string(pid) + "/stat", O_RDONLY, error);
  if (fd < 0) return 0;
  std::string s;
  char buf[1024];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    s.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
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
