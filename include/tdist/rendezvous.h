// Rendezvous: turn an init_method URL (or an explicit store) into a Store,
// this process's rank and the world size, as torch.distributed does.
//
//   env://                       MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
//                                (torchrun, tdist-run, Slurm-style scripts);
//                                under mpirun OMPI_COMM_WORLD_RANK/_SIZE
//                                stand in for RANK/WORLD_SIZE; under srun
//                                (a task per rank) SLURM_PROCID and
//                                SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), and
//                                when unset MASTER_ADDR is the first host of
//                                SLURM_STEP_NODELIST (or _JOB_NODELIST) and
//                                MASTER_PORT 20000 + SLURM_JOB_ID mod 10000.
//   tcp://host:port?rank=R&world_size=N
//   file:///path?rank=R&world_size=N
//
// Rank 0 of tcp:// and env:// hosts the TCPStore server. rendezvous() returns
// once every rank of the world has joined (a barrier through the store).
#pragma once

#include <map>
#include <memory>
#include <string>

#include "tdist/store.h"

namespace tdist {

struct RendezvousOptions {
  std::string init_method;        // empty with a store: use the store
  std::shared_ptr<Store> store;   // exclusive with init_method
  int rank = -1;                  // -1: from the URL or the environment
  int world_size = -1;            // -1: from the URL or the environment
  Milliseconds timeout = kDefaultStoreTimeout;
  // Environment lookups go through this function, so tests need not touch
  // the real environment. nullptr: getenv.
  const char* (*getenv)(const char*) = nullptr;
};

struct RendezvousResult {
  std::shared_ptr<Store> store;
  int rank = -1;
  int world_size = -1;
};

// A parsed init_method URL, before any connection is made.
struct InitMethod {
  std::string scheme;  // "env", "tcp" or "file"
  std::string host;    // tcp/env
  int port = -1;       // tcp/env
  std::string path;    // file
  int rank = -1;
  int world_size = -1;
};

// Parses options.init_method (and, for env://, the environment) and fills in
// rank and world size. Every missing or malformed piece raises UsageError
// naming the variable or URL part and what was expected.
InitMethod parse_init_method(const RendezvousOptions& options);

// Connects to (or creates) the store and waits until all ranks have joined.
RendezvousResult rendezvous(const RendezvousOptions& options);

}  // namespace tdist
