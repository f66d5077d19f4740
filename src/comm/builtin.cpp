// The backends built into this copy of tdist, registered by name. Optional
// ones (gloo, mpi, nccl) add their line under their config.h switch.
#include <map>

#include "comm/backend.h"
#include "comm/plugin.h"
#include "comm/shm/shm_backend.h"
#include "tdist/config.h"

#if TDIST_WITH_MPI
#include "comm/mpi/mpi_backend.h"
#endif

namespace tdist::comm {

void add_builtin_backends(std::map<std::string, BackendFactory>& factories) {
  factories["shm"] = [](const BackendContext& ctx) {
    return shm::make_shm_backend(ctx, shm::ShmOptions::from_env());
  };
#if TDIST_WITH_GLOO
  // A plugin: Debian's libgloo must not meet the Gloo inside LibTorch 2.x.
  // The probe is gloo::allgatherv(gloo::AllgathervOptions&).
  factories["gloo"] = plugin_backend_factory(
      {"gloo", "libtdist_gloo.so", "_ZN4gloo10allgathervERNS_17AllgathervOptionsE", "libgloo",
       "LibTorch 2.x's libtorch_cpu carries its own Gloo"});
#endif
#if TDIST_WITH_NCCL
  // A plugin: libtdist must load where no CUDA library is installed.
  factories["nccl"] = plugin_backend_factory(
      {"nccl", "libtdist_nccl.so", "ncclGetVersion", "libnccl", "a LibTorch that links NCCL statically"});
#endif
#if TDIST_WITH_MPI
  factories["mpi"] = [](const BackendContext& ctx) { return mpi_backend::make_mpi_backend(ctx); };
#endif
}

}  // namespace tdist::comm
