// The collective conformance suite on the mpi backend, run under mpirun:
//   mpirun -np N mpi_collectives_test
// Every rank runs every case; the program prints "N passed, M failed" (for
// rank 0's view of the cases) and exits non-zero if any rank saw a failure.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdio>

#include "tests/dist/conformance.h"

int main() {
  // The store for the rendezvous: rank 0 hosts it on this port.
  setenv("MASTER_ADDR", "127.0.0.1", 0);
  if (!std::getenv("MASTER_PORT")) {
    std::fprintf(stderr, "mpi_collectives_test: set MASTER_PORT (mpirun -x MASTER_PORT=...)\n");
    return 2;
  }
  int failed = 0, passed = 0, rank = -1;
  try {
    tdist::InitOptions o;
    o.backend = "mpi";
    o.timeout = std::chrono::seconds(60);
    auto pg = tdist::init_process_group(o);
    rank = pg->rank();
    for (const auto& [name, fn] : tdist::test::conformance::all_cases()) {
      bool ok = true;
      try {
        fn(*pg);
      } catch (const std::exception& e) {
        ok = false;
        std::fprintf(stderr, "rank %d: %s: %s\n", rank, name, e.what());
      }
      // Agree on the outcome before moving on.
      at::Tensor bad = at::full({1}, ok ? 0 : 1, at::kInt);
      pg->all_reduce(bad)->wait();
      if (bad.item<int>() == 0) {
        ++passed;
      } else {
        ++failed;
      }
      if (rank == 0) std::printf("[%s] %s (world %d, mpi)\n", bad.item<int>() ? "FAILED" : "    OK", name, pg->size());
    }
    pg->barrier()->wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
  if (rank == 0) std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
