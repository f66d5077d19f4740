#include "tests/util/world.h"

#include <unistd.h>

#include <cstdio>

#include <ATen/Parallel.h>

#include "store/socket.h"
#include "tests/util/process.h"

namespace tdist::test {

namespace {

// Without the final barrier (a test whose ranks disagree on purpose) rank 0
// still hosts the store: every rank marks itself done through it, and rank 0
// waits for the marks before its store goes, so that no rank loses the store
// while it is still reading its own result (CI saw "server closed the
// connection" in place of the error under test). Best effort: it never
// fails a rank.
void linger_for_the_store(uint16_t port, int rank, int world) {
  try {
    TCPStoreOptions so;
    so.port = port;
    so.timeout = std::chrono::seconds(5);
    TCPStore store("127.0.0.1", so);
    store.set("run_world/done/" + std::to_string(rank), "1");
    if (rank != 0) return;
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back("run_world/done/" + std::to_string(r));
    store.wait(keys);  // at most 5 s: a rank the test killed never marks
  } catch (const StoreError&) {
  } catch (const TimeoutError&) {
  }
}

}  // namespace

std::string run_world(int world, const std::function<void(ProcessGroup&)>& fn, const WorldOptions& options) {
  const uint16_t port = tdist::detail::find_free_port();
  std::vector<pid_t> kids;
  for (int r = 0; r < world; ++r) {
    kids.push_back(fork_child([&, r] {
      // One intra-op thread per rank, as tdist-run gives on a small machine.
      // It is also what makes the fork safe: a parent that already ran an
      // OpenMP region (a single-process reference computed before the ranks)
      // leaves its thread pool behind, and libgomp has no fork handler, so a
      // child's next parallel region would wait forever at that pool's
      // barrier (seen with the PyPI wheel's libgomp). With one thread ATen
      // runs every loop inline and never enters the pool.
      at::set_num_threads(1);
      std::shared_ptr<ProcessGroup> pg;
      bool finished = false;
      const auto finish = [&] {
        if (finished) return;
        finished = true;
        if (pg && !options.final_barrier) linger_for_the_store(port, r, world);
        pg.reset();
        destroy_process_group();
      };
      try {
        InitOptions o;
        o.backend = options.backend;
        o.init_method = "tcp://127.0.0.1:" + std::to_string(port) + "?rank=" + std::to_string(r) +
                        "&world_size=" + std::to_string(world);
        o.timeout = options.timeout;
        pg = init_process_group(o);
        fn(*pg);
        if (options.final_barrier) pg->barrier()->wait();
        finish();
        return 0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        std::fflush(stderr);
        finish();
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
