// tdist-bench collectives --api c (bench/collectives_c_api.h).
#include "bench/collectives_c_api.h"

#include <ATen/ATen.h>

#include <chrono>
#include <stdexcept>
#include <vector>

#include "bench/bench_common.h"
#include "c/c_core.h"  // tdist_pg's C++ side: the same group for the C++ turns

namespace tdist::bench::c_api {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kTimeoutMs = 120000;

void ok(tdist_status s, const char* what) {
  if (s != TDIST_OK) throw std::runtime_error(std::string(what) + ": " + tdist_last_error());
}

// The C ABI's call: sync, or _async then wait and free.
template <typename Sync, typename Async>
void call(bool async, const char* what, Sync&& sync, Async&& launch) {
  if (!async) return ok(sync(), what);
  tdist_work* w = nullptr;
  ok(launch(&w), what);
  ok(tdist_work_wait(w, kTimeoutMs), "tdist_work_wait");
  ok(tdist_work_free(w), "tdist_work_free");
}

template <typename Op>
double per_op_ns(Op&& op) {
  constexpr int kOps = 2000;
  const auto t0 = Clock::now();
  for (int i = 0; i < kOps; ++i) op();
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kOps;
}

}  // namespace

const std::shared_ptr<ProcessGroup>& Groups::world_cpp() const { return world->pg; }
const std::shared_ptr<ProcessGroup>& Groups::solo_cpp() const { return solo->pg; }

Groups::~Groups() {
  if (solo) tdist_pg_free(solo);
  if (world) tdist_pg_free(world);
}

std::unique_ptr<Groups> init(const std::string& backend, int64_t timeout_ms) {
  auto g = std::make_unique<Groups>();
  ok(tdist_check_abi(TDIST_C_ABI_VERSION, tdist_torch_version()), "tdist_check_abi");
  ok(tdist_init_process_group(backend.c_str(), timeout_ms, &g->world), "tdist_init_process_group");
  int size = 0;
  ok(tdist_pg_size(g->world, &size), "tdist_pg_size");
  for (int r = 0; r < size; ++r) {
    tdist_pg* h = nullptr;
    ok(tdist_new_group(g->world, &r, 1, &h), "tdist_new_group");
    if (h) g->solo = h;
  }
  return g;
}

BenchOp bench_op(const std::string& name) {
  static const std::pair<const char*, BenchOp> kNames[] = {
      {"all_reduce", BenchOp::kAllReduce}, {"broadcast", BenchOp::kBroadcast},
      {"reduce", BenchOp::kReduce},        {"all_gather", BenchOp::kAllGather},
      {"reduce_scatter", BenchOp::kReduceScatter}, {"all_to_all", BenchOp::kAllToAll}};
  for (const auto& [n, op] : kNames) {
    if (name == n) return op;
  }
  throw std::invalid_argument("tdist-bench: unknown op '" + name + "'");
}

void run_op(tdist_pg* pg, BenchOp op, at::Tensor& in, at::Tensor& out, bool async) {
  void* i = &in;
  void* o = &out;
  const int64_t ms = 0;  // the group's timeout, as the C++ calls here use
  switch (op) {
    case BenchOp::kAllReduce:
      return call(async, "tdist_all_reduce", [&] { return tdist_all_reduce(pg, i, TDIST_SUM, ms); },
                  [&](tdist_work** w) { return tdist_all_reduce_async(pg, i, TDIST_SUM, ms, w); });
    case BenchOp::kBroadcast:
      return call(async, "tdist_broadcast", [&] { return tdist_broadcast(pg, i, 0, ms); },
                  [&](tdist_work** w) { return tdist_broadcast_async(pg, i, 0, ms, w); });
    case BenchOp::kReduce:
      return call(async, "tdist_reduce", [&] { return tdist_reduce(pg, i, 0, TDIST_SUM, ms); },
                  [&](tdist_work** w) { return tdist_reduce_async(pg, i, 0, TDIST_SUM, ms, w); });
    case BenchOp::kAllGather:
      return call(async, "tdist_all_gather_into_tensor", [&] { return tdist_all_gather_into_tensor(pg, o, i, ms); },
                  [&](tdist_work** w) { return tdist_all_gather_into_tensor_async(pg, o, i, ms, w); });
    case BenchOp::kReduceScatter:
      return call(async, "tdist_reduce_scatter_tensor",
                  [&] { return tdist_reduce_scatter_tensor(pg, o, i, TDIST_SUM, ms); },
                  [&](tdist_work** w) { return tdist_reduce_scatter_tensor_async(pg, o, i, TDIST_SUM, ms, w); });
    case BenchOp::kAllToAll:
      return call(async, "tdist_all_to_all_single", [&] { return tdist_all_to_all_single(pg, o, i, ms); },
                  [&](tdist_work** w) { return tdist_all_to_all_single_async(pg, o, i, ms, w); });
  }
}

Overhead overheads(const Groups& g, bool async) {
  at::Tensor x = at::ones({1});
  AllreduceOptions o;
  o.async_op = async;
  ProcessGroup& solo = *g.solo_cpp();
  void* xc = &x;
  // The same call both ways: synchronous (done when it returns), or queued
  // and its work waited for (and, in C, freed).
  auto cpp = [&] {
    auto w = solo.all_reduce(x, o);
    if (async) w->wait();
  };
  auto c = [&] {
    if (!async) return ok(tdist_all_reduce(g.solo, xc, TDIST_SUM, 0), "tdist_all_reduce");
    tdist_work* w = nullptr;
    ok(tdist_all_reduce_async(g.solo, xc, TDIST_SUM, 0, &w), "tdist_all_reduce_async");
    ok(tdist_work_wait(w, 0), "tdist_work_wait");
    ok(tdist_work_free(w), "tdist_work_free");
  };
  for (int i = 0; i < 1000; ++i) {
    cpp();
    c();
  }
  // Taking turns, so that the VM's noise hits both alike; what C adds is
  // the median of the rounds' differences.
  std::vector<double> cpp_ns, c_ns, extra_ns;
  for (int round = 0; round < 31; ++round) {
    cpp_ns.push_back(per_op_ns(cpp));
    c_ns.push_back(per_op_ns(c));
    extra_ns.push_back(c_ns.back() - cpp_ns.back());
  }
  return {percentile(cpp_ns, 50), percentile(c_ns, 50), percentile(extra_ns, 50)};
}

}  // namespace tdist::bench::c_api
