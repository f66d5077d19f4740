#include "tests/util/world.h"

#include <unistd.h>

#include <cstdio>

#include "store/socket.h"
#include "tests/util/process.h"

namespace tdist::test {

std::string run_world(int world, const std::function<void(ProcessGroup&)>& fn, const WorldOptions& options) {
  const uint16_t port = tdist::detail::find_free_port();
  std::vector<pid_t> kids;
  for (int r = 0; r < world; ++r) {
    kids.push_back(fork_child([&, r] {
      try {
        InitOptions o;
        o.backend = options.backend;
        o.init_method = "tcp://127.0.0.1:" + std::to_string(port) + "?rank=" + std::to_string(r) +
                        "&world_size=" + std::to_string(world);
        o.timeout = options.timeout;
        auto pg = init_process_group(o);
        fn(*pg);
        if (options.final_barrier) pg->barrier()->wait();
        destroy_process_group();
        return 0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        std::fflush(stderr);
        return 1;
      }
    }));
  }
  if (options.pids) *options.pids = kids;
  std::string failures;
  for (int r = 0; r < world; ++r) {
    const int st = wait_child(kids[r], options.limit);
    if (!exited_ok(st)) failures += "rank " + std::to_string(r) + ": " + describe_status(st) + "\n";
  }
  return failures;
}

}  // namespace tdist::test
