// tdist-bench collectives --api c: the timed ops through the C ABI
// (include/tdist/c/tdist.h), as a language binding makes them, and what
// the C ABI adds per op over the C++ API.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

#include "tdist/c/tdist.h"
#include "tdist/process_group.h"

namespace tdist::bench::c_api {

// The world through tdist_init_process_group (the environment the bench's
// ranks have), and a group of this rank alone (made on every rank).
struct Groups {
  tdist_pg* world = nullptr;
  tdist_pg* solo = nullptr;
  // The same groups, for the C++ side.
  const std::shared_ptr<ProcessGroup>& world_cpp() const;
  const std::shared_ptr<ProcessGroup>& solo_cpp() const;
  ~Groups();
};
std::unique_ptr<Groups> init(const std::string& backend, int64_t timeout_ms);

// The ops the bench times, resolved from their names ("all_reduce", ...)
// before the timed loop, so that the loop runs the op and nothing else.
enum class BenchOp { kAllReduce, kBroadcast, kReduce, kAllGather, kReduceScatter, kAllToAll };
BenchOp bench_op(const std::string& name);  // std::invalid_argument for another name

// One op on in/out through the C ABI; done when this returns.
void run_op(tdist_pg* pg, BenchOp op, at::Tensor& in, at::Tensor& out, bool async);

// Per-op cost of an all_reduce of one float32 on the solo group, through
// C++ and through the C ABI, measured taking turns (medians, ns), and the
// median of the rounds' differences (what the C ABI adds).
struct Overhead {
  double cpp_ns = 0, c_ns = 0, extra_ns = 0;
};
Overhead overheads(const Groups& g, bool async);

}  // namespace tdist::bench::c_api
