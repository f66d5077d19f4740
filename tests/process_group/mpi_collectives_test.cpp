// The collective conformance suite on the mpi backend, run under mpirun:
//   mpirun -np N mpi_collectives_test            every conformance case
//   mpirun -np 2 mpi_collectives_test timeout    a timeout names the late rank
// Every rank runs every case; the program prints "N passed, M failed" (for
// rank 0's view of the cases) and exits non-zero if any rank saw a failure.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "tests/process_group/conformance.h"

// Rank 0 gives up on an all_reduce that rank 1 joins only 1.5 s later; the
// TimeoutError must name the op, its sequence number and rank 1.
int timeout_case(tdist::ProcessGroup& pg) {
  at::Tensor t = at::ones({16});
  pg.all_reduce(t)->wait();  // #1
  if (pg.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    pg.all_reduce(t)->wait();  // matches rank 0's abandoned #2, so MPI can finish
    std::printf("1 passed, 0 failed\n");
    return 0;
  }
  try {
    pg.all_reduce(t, {tdist::ReduceOp::SUM, std::chrono::milliseconds(300)})->wait();
  } catch (const tdist::TimeoutError& e) {
    const std::string msg = e.what();
    const bool ok = msg.find("all_reduce #2") != std::string::npos && msg.find("rank(s) 1 never arrived") != std::string::npos;
    std::printf("%s: %s\n%d passed, %d failed\n", ok ? "OK" : "WRONG MESSAGE", msg.c_str(), ok ? 1 : 0, ok ? 0 : 1);
    return ok ? 0 : 1;
  }
  std::printf("no timeout\n0 passed, 1 failed\n");
  return 1;
}

int main(int argc, char** argv) {
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
    if (argc > 1 && std::strcmp(argv[1], "timeout") == 0) return timeout_case(*pg);
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
