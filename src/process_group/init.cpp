// How process groups are made: the world group from a rendezvous
// (init_process_group), subgroups from it (new_group), the backend chosen
// by name or by where the ranks are ("auto"), and the default-group
// registry. ProcessGroup's constructor and destructor (start and drain the
// group's queue) live here with them.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "process_group/group_impl.h"
#include "tdist/process_group.h"
#include "tdist/rendezvous.h"
#include "util/open_file.h"

namespace tdist {

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) { impl_->start(); }

ProcessGroup::~ProcessGroup() { impl_->stop(); }

namespace {

// "host/boot-id": equal for two processes exactly when they share a kernel,
// and so can share memory.
std::string host_identity() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::string boot, error;
  tdist::detail::read_regular_file("/proc/sys/kernel/random/boot_id", 64, boot, error);
  boot = boot.substr(0, boot.find('\n'));
  return std::string(host) + "/" + boot;
}

std::shared_ptr<ProcessGroup> make_group(std::shared_ptr<Store> store, int rank, std::vector<int> ranks,
                                         std::string backend, std::string name, Milliseconds timeout,
                                         const std::string& master_addr, const char* desc = "",
                                         const std::string& inherited_cuda_backend = "") {
  const int size = static_cast<int>(ranks.size());
  const bool automatic = backend == "auto";
  if (automatic) {
    store->set("host/" + std::to_string(rank), host_identity());
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back("host/" + std::to_string(r));
    const auto hosts = store->multi_get(keys, timeout);
    const bool one_host = std::all_of(hosts.begin(), hosts.end(), [&](const Bytes& h) { return h == hosts[0]; });
    backend = one_host || !comm::has_backend("gloo") ? "shm" : "gloo";
    if (!one_host && backend == "shm") {
      throw UsageError("process group '" + name + "' spans several hosts, but this build of tdist has no gloo backend");
    }
  }
  comm::BackendContext ctx;
  ctx.store = std::make_shared<PrefixStore>("backend", store);
  ctx.rank = rank;
  ctx.size = size;
  ctx.global_ranks = ranks;
  ctx.group_name = name;
  ctx.timeout = timeout;
  ctx.master_addr = master_addr;
  auto impl = std::make_unique<ProcessGroup::Impl>();
  impl->backend = comm::create_backend(backend, ctx);
  impl->store = std::move(store);
  impl->rank = rank;
  impl->size = size;
  impl->ranks = std::move(ranks);
  impl->backend_name = backend;
  impl->group_name = std::move(name);
  impl->timeout = timeout;
  impl->master_addr = master_addr;
  // CUDA tensors to nccl under "auto" (group_impl.h); a subgroup asked for
  // no backend of its own keeps its parent's choice.
  const std::string cuda_backend = automatic && comm::has_backend("nccl") ? "nccl" : inherited_cuda_backend;
  if (!cuda_backend.empty()) {
    impl->cuda_backend_name = cuda_backend;
    impl->cuda_backend_ctx = ctx;
    impl->cuda_backend_ctx.store = std::make_shared<PrefixStore>("backend-cuda", impl->store);
  }
  // The dump names both when CUDA tensors go elsewhere, as PyTorch writes
  // a backend per device ("cpu:gloo,cuda:nccl").
  const std::string recorded = cuda_backend.empty() ? backend : "cpu:" + backend + ",cuda:" + cuda_backend;
  impl->recorder = detail::FlightRecorder::get().add_group(impl->group_name, desc, recorded, impl->ranks);
  const char* debug = std::getenv("TDIST_DEBUG");
  if (debug && std::string(debug) == "detail") {
    impl->collective_check.emplace(impl->store, impl->rank, impl->ranks, impl->group_name);
  }
  return std::make_shared<ProcessGroup>(std::move(impl));
}

std::mutex g_default_mu;
std::shared_ptr<ProcessGroup> g_default;

}  // namespace

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(std::vector<int> ranks, const NewGroupOptions& options) {
  if (ranks.empty()) throw UsageError("new_group: the list of ranks is empty");
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    impl_->check_rank(ranks[i], "new_group", "rank");
    if (i > 0 && ranks[i] == ranks[i - 1]) {
      throw UsageError("new_group: rank " + std::to_string(ranks[i]) + " is listed twice");
    }
  }
  const int id = impl_->next_subgroup++;
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  std::vector<int> world_ranks;
  for (int r : ranks) world_ranks.push_back(impl_->ranks[r]);
  const std::string name = impl_->group_name + "/" + std::to_string(id);
  auto store = std::make_shared<PrefixStore>("group" + std::to_string(id), impl_->store);
  return make_group(store, static_cast<int>(it - ranks.begin()), std::move(world_ranks),
                    options.backend.empty() ? impl_->backend_name : options.backend, name,
                    options.timeout.value_or(impl_->timeout), impl_->master_addr, "",
                    options.backend.empty() ? impl_->cuda_backend_name : "");
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  if (options.timeout.count() <= 0) throw UsageError("init_process_group: the timeout must be positive");
  RendezvousOptions ro;
  ro.init_method = options.init_method;
  ro.store = options.store;
  ro.rank = options.rank;
  ro.world_size = options.world_size;
  ro.timeout = options.timeout;
  std::string master_addr;
  if (!ro.store) {
    const InitMethod m = parse_init_method(ro);
    if (m.scheme != "file") master_addr = m.host;
  }
  RendezvousResult world = rendezvous(ro);
  std::vector<int> ranks(world.world_size);
  for (int r = 0; r < world.world_size; ++r) ranks[r] = r;
  auto store = std::make_shared<PrefixStore>("tdist/pg/" + options.group_name, world.store);
  detail::FlightRecorder::get().set_identity(world.rank, world.world_size);
  auto group = make_group(store, world.rank, std::move(ranks), options.backend, options.group_name, options.timeout,
                          master_addr, "default_pg");
  std::lock_guard<std::mutex> lock(g_default_mu);
  g_default = group;
  return group;
}

std::shared_ptr<ProcessGroup> default_group() {
  std::lock_guard<std::mutex> lock(g_default_mu);
  return g_default;
}

bool is_initialized() { return default_group() != nullptr; }

std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const NewGroupOptions& options) {
  auto world = default_group();
  if (!world) throw UsageError("new_group: call init_process_group first");
  return world->new_group(std::move(ranks), options);
}

void destroy_process_group(const std::shared_ptr<ProcessGroup>& group) {
  std::shared_ptr<ProcessGroup> dropped;
  {
    std::lock_guard<std::mutex> lock(g_default_mu);
    if (!group || group == g_default) dropped = std::move(g_default);
  }
}

}  // namespace tdist
