// The mpi backend (built when TDIST_WITH_MPI is on): for jobs launched by
// mpirun, whose ranks tdist reads from OMPI_COMM_WORLD_RANK/_SIZE.
#pragma once

#include <memory>

#include "comm/backend.h"

namespace tdist::comm::mpi_backend {

std::unique_ptr<Backend> make_mpi_backend(const BackendContext& ctx);

}  // namespace tdist::comm::mpi_backend
