// tdist's C ABI (include/tdist/c/tdist.h): versions, process groups,
// works. Tensors for C programs: c_tensors.cpp. Collectives: c_collectives.cpp; DDP,
// FSDP and Join: c_parallel.cpp; state dicts and files: c_files.cpp. Every
// entry point runs its body through guarded() (c_core.h), so no exception
// crosses into C.
#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "c/c_core.h"
#include "tdist/process_group.h"
#include "tdist/version.h"

using namespace tdist::c;

extern "C" {

const char* tdist_last_error(void) { return last_error_text(); }
int tdist_abi_version(void) { return TDIST_C_ABI_VERSION; }

const char* tdist_version(void) {
  static const std::string v = tdist::version();
  return v.c_str();
}

const char* tdist_torch_version(void) {
  static const std::string v = tdist::torch_version();
  return v.c_str();
}

tdist_status tdist_check_abi(int abi_version, const char* torch_version) {
  return guarded("tdist_check_abi", [&] {
    if (abi_version != TDIST_C_ABI_VERSION) {
      usage("the binding was built for tdist's C ABI " + std::to_string(abi_version) + "; this libtdist_c is ABI " +
            std::to_string(TDIST_C_ABI_VERSION) + " (tdist " + tdist::version() + "): rebuild it");
    }
    if (!torch_version) return;
    const auto major_minor = [](const std::string& v) {
      const size_t dot = v.find('.');
      return dot == std::string::npos ? v : v.substr(0, v.find('.', dot + 1));
    };
    const std::string mine = tdist::torch_version();
    if (major_minor(torch_version) != major_minor(mine)) {
      usage(std::string("the binding runs on LibTorch ") + torch_version + "; tdist was built against " + mine +
            " (at::Tensor's layout may differ): use a tdist built for it");
    }
  });
}

namespace {
// The world group: from the environment, or over `store`.
tdist_pg* init_world(const char* backend, int64_t timeout_ms, std::shared_ptr<tdist::Store> store, int rank,
                     int world_size) {
  if (tdist::default_group()) {
    usage("a process group is initialised already in this process (tdist_pg_free it first, or use "
          "tdist_new_group)");
  }
  tdist::InitOptions o;
  if (backend) o.backend = backend;
  if (const auto t = timeout_of(timeout_ms)) o.timeout = *t;
  if (store) {
    if (world_size < 1 || rank < 0 || rank >= world_size) {
      usage("rank " + std::to_string(rank) + " of world size " + std::to_string(world_size) + " is not a rank");
    }
    o.store = std::move(store);
    o.rank = rank;
    o.world_size = world_size;
  }
  return handle(new tdist_pg{tdist::init_process_group(o)});
}
}  // namespace

tdist_status tdist_init_process_group(const char* backend, int64_t timeout_ms, tdist_pg** out) {
  return guarded("tdist_init_process_group", [&] {
    out_check(out);
    *out = init_world(backend, timeout_ms, nullptr, -1, -1);
  });
}

tdist_status tdist_init_process_group_with_store(tdist_store* s, int rank, int world_size, const char* backend,
                                                 int64_t timeout_ms, tdist_pg** out) {
  return guarded("tdist_init_process_group_with_store", [&] {
    out_check(out);
    *out = init_world(backend, timeout_ms, live(s, "store")->store, rank, world_size);
  });
}

tdist_status tdist_new_group(tdist_pg* pg, const int* ranks, size_t n, tdist_pg** out) {
  return guarded("tdist_new_group", [&] {
    out_check(out);
    live(pg, "process group");
    if (!ranks && n > 0) usage("ranks is NULL");
    auto g = pg->pg->new_group(std::vector<int>(ranks, ranks + n));
    if (!g) return;  // not a member
    *out = handle(new tdist_pg{std::move(g)});
  });
}

tdist_status tdist_pg_free(tdist_pg* pg) {
  return guarded("tdist_pg_free", [&] {
    live(pg, "process group");
    if (tdist::default_group() == pg->pg) tdist::destroy_process_group();
    release(pg, "process group");
  });
}

tdist_status tdist_pg_rank(tdist_pg* pg, int* out) {
  return guarded("tdist_pg_rank", [&] {
    if (!out) usage("the output pointer is NULL");
    *out = live(pg, "process group")->pg->rank();
  });
}

tdist_status tdist_pg_size(tdist_pg* pg, int* out) {
  return guarded("tdist_pg_size", [&] {
    if (!out) usage("the output pointer is NULL");
    *out = live(pg, "process group")->pg->size();
  });
}

tdist_status tdist_work_wait(tdist_work* w, int64_t timeout_ms) {
  return guarded("tdist_work_wait", [&] {
    const auto t = timeout_of(timeout_ms);
    auto& work = work_of(w);
    if (t) {
      work.wait(*t);
    } else {
      work.wait();
    }
  });
}

tdist_status tdist_work_is_completed(tdist_work* w, int* done) {
  return guarded("tdist_work_is_completed", [&] {
    if (!done) usage("the output pointer is NULL");
    *done = work_of(w).is_completed() ? 1 : 0;
  });
}

tdist_status tdist_work_free(tdist_work* w) {
  return guarded("tdist_work_free", [&] {
    free_work(w);
  });
}

}  // extern "C"
