// The backends built into this copy of tdist, registered by name. Optional
// ones (gloo, mpi, nccl) add their line under their config.h switch.
#include <map>

#include "comm/backend.h"
#include "comm/shm/shm_backend.h"
#include "tdist/config.h"

#if TDIST_WITH_GLOO
#include "comm/gloo/gloo_backend.h"
#endif
#if TDIST_WITH_MPI
#include "comm/mpi/mpi_backend.h"
#endif

namespace tdist::comm {

void add_builtin_backends(std::map<std::string, BackendFactory>& factories) {
  factories["shm"] = [](const BackendContext& ctx) {
    return shm::make_shm_backend(ctx, shm::ShmOptions::from_env());
  };
#if TDIST_WITH_GLOO
  factories["gloo"] = [](const BackendContext& ctx) {
    return gloo_backend::make_gloo_backend(ctx, gloo_backend::GlooOptions::from_env());
  };
#endif
#if TDIST_WITH_MPI
  factories["mpi"] = [](const BackendContext& ctx) { return mpi_backend::make_mpi_backend(ctx); };
#endif
}

}  // namespace tdist::comm
