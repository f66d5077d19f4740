// All-reduce in a loop on every rank of a tdist-run job, checking each
// result: a small end-to-end program for the launcher and the backends.
//
//   build/bin/tdist-run --nproc-per-node 4 build/bin/allreduce_demo [--iters 100] [--numel 1048576]
//       [--backend auto] [--die-rank R --die-at K]   (rank R kills itself at iteration K, for testing)
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include "tdist/tdist.h"

int main(int argc, char** argv) {
  int iters = 100, die_rank = -1, die_at = -1;
  int64_t numel = 1 << 20;
  std::string backend = "auto";
  CLI::App app{"All-reduce in a loop on every rank of a tdist-run job, checking each result.", "allreduce_demo"};
  app.add_option("--iters", iters, "all-reduces")->capture_default_str();
  app.add_option("--numel", numel, "float32 elements each")->capture_default_str();
  app.add_option("--backend", backend, "auto, shm, gloo, mpi")->capture_default_str();
  app.add_option("--die-rank", die_rank, "for testing: this rank kills itself ...");
  app.add_option("--die-at", die_at, "... at this iteration");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; a usage error: 2
  }
  // Until init_process_group returns, the rank tdist-run gave (errors name it).
  const char* env_rank = std::getenv("RANK");
  int rank = env_rank ? std::atoi(env_rank) : -1;
  try {
    tdist::InitOptions o;
    o.backend = backend;
    o.timeout = std::chrono::seconds(60);
    auto pg = tdist::init_process_group(o);
    rank = pg->rank();
    const int n = pg->size();
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor t = at::empty({numel});
    for (int i = 0; i < iters; ++i) {
      if (rank == die_rank && i == die_at) raise(SIGKILL);
      t.fill_(static_cast<float>(rank + i));
      pg->all_reduce(t)->wait();
      const float want = static_cast<float>(n * (n - 1) / 2 + n * i);
      if (!t.eq(want).all().item<bool>()) {
        std::fprintf(stderr, "rank %d: wrong result at iteration %d\n", rank, i);
        return 1;
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    pg->barrier()->wait();
    if (rank == 0) {
      std::printf("%d all_reduces of %lld floats on %d ranks (%s): all correct, %.1f us each\n", iters,
                  static_cast<long long>(numel), n, pg->backend_name().c_str(), s / iters * 1e6);
    }
    return 0;
  } catch (const tdist::PeerFailureError& e) {
    std::fprintf(stderr, "rank %d: peer rank %d failed: %s\n", rank, e.rank(), e.what());
    return 1;
  } catch (const tdist::Error& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}
