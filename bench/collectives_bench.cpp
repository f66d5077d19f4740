// tdist-bench collectives: the nccl-tests table for tdist's collectives.
//
//   tdist-bench collectives --backend shm --world-size 2 [--op all_reduce|all|...]
//       [--min-bytes 4] [--max-bytes 256M] [--step-factor 4] [--dtype float32]
//       [--seconds 0.25] [--json FILE]
//
// Spawns its own ranks on this host (or runs as one rank under tdist-run,
// when RANK and WORLD_SIZE are set). First it measures this machine's memcpy
// bandwidth, on one core and on all cores at once, so the figures read as a
// fraction of what memory can do (the model is in collective_model.h); then,
// per op (one, a comma-separated list, or all) and size: bytes, count,
// dtype, redop, the median and 99th-percentile time of one op (µs; each op
// timed alone, the slowest rank's time), algbw and busbw of the median (as
// nccl-tests defines them), the busbw the memory model allows, the fraction
// of it reached, and #wrong (elements that differ from the expected result in
// a checked run). --symmetric puts the buffers in symmetric memory
// (ProcessGroup::empty_symmetric). Each timed op is a synchronous call
// (async_op=false, as MPI's blocking calls), or with --async queued and its
// Work waited for. First of all it prints the per-op overhead of the
// process group, both ways (op_overhead_ns below). With --api c every op
// goes through the C ABI (bench/collectives_c_api.h) and the overhead line
// says what the C ABI adds to the C++ call, both measured taking turns.
#include <ATen/ATen.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "bench/bench_common.h"
#include "bench/collective_model.h"
#include "bench/collectives_c_api.h"
#include "tdist/tdist.h"
#include "util/cli.h"
#include "util/env.h"

namespace tdist::bench {

namespace {

using Clock = std::chrono::steady_clock;

size_t parse_bytes(const std::string& s) {
  if (s.empty()) throw UsageError("tdist-bench: empty size");
  size_t mult = 1;
  std::string digits = s;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? 1024 : last == 'M' ? 1024 * 1024 : size_t(1) << 30;
    digits = s.substr(0, s.size() - 1);
  }
  auto v = detail::parse_int(digits);
  constexpr int64_t kMax = int64_t{1} << 40;  // 1 TiB: no buffer of the benchmark is larger
  if (!v || *v < 0 || *v > kMax / static_cast<int64_t>(mult)) {
    throw UsageError("tdist-bench: bad size '" + s + "' (e.g. 4, 64K, 256M; at most 1024G)");
  }
  return static_cast<size_t>(*v) * mult;
}

// Bytes copied per second by memcpy over 64 MiB buffers, best of a few.
double memcpy_gbps_one() {
  const size_t n = 64u << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, n / s / 1e9);
    std::swap(a, b);
  }
  return best;
}

double memcpy_gbps_all(int threads) {
  std::vector<double> rates(threads);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { rates[t] = memcpy_gbps_one(); });
  for (auto& t : ts) t.join();
  double sum = 0;
  for (double r : rates) sum += r;
  return sum;
}

const std::vector<std::string> kOps = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all"};

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "float") return at::kFloat;
  if (s == "float64" || s == "double") return at::kDouble;
  if (s == "float16" || s == "half") return at::kHalf;
  if (s == "bfloat16") return at::kBFloat16;
  if (s == "int32") return at::kInt;
  if (s == "int64") return at::kLong;
  throw UsageError("tdist-bench: unknown --dtype " + s);
}

// Runs `op` once on tensors sized for `bytes` (the per-rank buffer nccl-tests
// reports: the all_reduce buffer, all_gather's output, ...).
struct Buffers {
  at::Tensor in, out;
};

Buffers make_buffers(ProcessGroup& pg, const std::string& op, int64_t count, at::ScalarType t, bool symmetric) {
  const int n = pg.size();
  auto make = [&](int64_t len) { return symmetric ? pg.empty_symmetric({len}, t) : at::empty({len}, t); };
  Buffers b;
  if (op == "all_gather") {
    b.in = make(count / n);
    b.out = make(count / n * n);
  } else if (op == "reduce_scatter") {
    b.in = make(count / n * n);
    b.out = make(count / n);
  } else if (op == "all_to_all") {
    b.in = make(count / n * n);
    b.out = make(count / n * n);
  } else {
    b.in = make(count);
  }
  return b;
}

// One op on the buffers; done when this returns (a synchronous call, or
// queued and waited for when `async`).
// With --api c: the world's C handle, through which run_op goes.
tdist_pg* c_world = nullptr;

// Options of type O with async_op as given.
template <typename O>
O async_as(bool async) {
  O o;
  o.async_op = async;
  return o;
}

void run_op(ProcessGroup& pg, c_api::BenchOp op, Buffers& b, bool async = false) {
  if (c_world) return c_api::run_op(c_world, op, b.in, b.out, async);
  std::shared_ptr<Work> w;
  switch (op) {
    case c_api::BenchOp::kAllReduce: w = pg.all_reduce(b.in, async_as<AllreduceOptions>(async)); break;
    case c_api::BenchOp::kBroadcast: w = pg.broadcast(b.in, async_as<BroadcastOptions>(async)); break;
    case c_api::BenchOp::kReduce: w = pg.reduce(b.in, async_as<ReduceOptions>(async)); break;
    case c_api::BenchOp::kReduceScatter:
      w = pg.reduce_scatter_tensor(b.out, b.in, async_as<ReduceScatterOptions>(async));
      break;
    case c_api::BenchOp::kAllGather:
      w = pg.all_gather_into_tensor(b.out, b.in, async_as<CollectiveOptions>(async));
      break;
    case c_api::BenchOp::kAllToAll:
      w = pg.all_to_all_single(b.out, b.in, {}, {}, async_as<CollectiveOptions>(async));
      break;
  }
  w->wait();  // a no-op for a synchronous call: it is done
}

// Fills inputs with rank-dependent small integers and counts the elements of
// the result that differ from the exact answer.
int64_t check(ProcessGroup& pg, const std::string& op, Buffers& b) {
  const int n = pg.size(), r = pg.rank();
  const auto t = b.in.scalar_type();
  auto pattern = [&](int64_t len, int rank) { return ((at::arange(len, at::kLong) + rank * 3) % 7).to(t); };
  b.in.copy_(pattern(b.in.numel(), r));
  run_op(pg, c_api::bench_op(op), b);
  at::Tensor got, want;
  if (op == "all_reduce" || (op == "reduce" && r == 0)) {
    got = b.in;
    want = pattern(b.in.numel(), 0).to(at::kDouble);
    for (int q = 1; q < n; ++q) want += pattern(b.in.numel(), q).to(at::kDouble);
    want = want.to(t);
  } else if (op == "broadcast") {
    got = b.in;
    want = pattern(b.in.numel(), 0);
  } else if (op == "all_gather") {
    got = b.out;
    std::vector<at::Tensor> parts;
    for (int q = 0; q < n; ++q) parts.push_back(pattern(b.in.numel(), q));
    want = at::cat(parts);
  } else if (op == "reduce_scatter") {
    got = b.out;
    const int64_t len = b.out.numel();
    want = at::zeros({len}, at::kDouble);
    for (int q = 0; q < n; ++q) want += pattern(b.in.numel(), q).slice(0, r * len, (r + 1) * len).to(at::kDouble);
    want = want.to(t);
  } else if (op == "all_to_all") {
    got = b.out;
    const int64_t len = b.out.numel() / n;
    std::vector<at::Tensor> parts;
    for (int q = 0; q < n; ++q) parts.push_back(pattern(b.in.numel(), q).slice(0, r * len, (r + 1) * len));
    want = at::cat(parts);
  } else {
    return 0;  // reduce on a non-root: nothing to check
  }
  return got.ne(want).sum().item<int64_t>();
}

std::vector<std::string> parse_ops(const std::string& arg) {
  if (arg == "all") return kOps;
  std::vector<std::string> ops;
  size_t at = 0;
  while (at <= arg.size()) {
    const size_t comma = std::min(arg.find(',', at), arg.size());
    const std::string op = arg.substr(at, comma - at);
    if (std::find(kOps.begin(), kOps.end(), op) == kOps.end()) throw UsageError("tdist-bench: unknown --op '" + op + "'");
    ops.push_back(op);
    at = comma + 1;
  }
  return ops;
}

// Per-op times on this rank, then element-wise the slowest rank's.
std::vector<double> timed_samples(ProcessGroup& pg, c_api::BenchOp op, Buffers& b, int iters, bool async,
                                  bool barrier_each) {
  at::Tensor t = at::empty({iters}, at::kDouble);
  double* s = t.data_ptr<double>();
  pg.barrier()->wait();
  CollectiveOptions at_once;
  at_once.async_op = false;
  for (int i = 0; i < iters; ++i) {
    if (barrier_each) pg.barrier(at_once);
    const auto t0 = Clock::now();
    run_op(pg, op, b, async);
    s[i] = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  pg.all_reduce(t, {ReduceOp::MAX})->wait();
  return std::vector<double>(s, s + iters);
}

// What the process group adds to every op (checks, the queue or the
// synchronous call, Work, accounting, the wait): an all_reduce of one
// float32 on a group of this rank alone, where the backend has almost
// nothing to move; the median of 15 batches of 2000, in ns, made as `async`
// says.
double op_overhead_ns(ProcessGroup& solo, bool async) {
  at::Tensor x = at::ones({1});
  AllreduceOptions o;
  o.async_op = async;
  for (int i = 0; i < 1000; ++i) solo.all_reduce(x, o)->wait();
  std::vector<double> per_op;
  for (int batch = 0; batch < 15; ++batch) {
    constexpr int kOps = 2000;
    const auto t0 = Clock::now();
    for (int i = 0; i < kOps; ++i) solo.all_reduce(x, o)->wait();
    per_op.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kOps);
  }
  return percentile(per_op, 50);
}

struct Overheads {
  double sync_ns = 0, async_ns = 0;
};
Overheads op_overheads(ProcessGroup& pg) {
  std::shared_ptr<ProcessGroup> solo;
  for (int r = 0; r < pg.size(); ++r) {
    if (auto g = pg.new_group({r})) solo = std::move(g);
  }
  return {op_overhead_ns(*solo, false), op_overhead_ns(*solo, true)};
}

int run_rank(const CollectivesBenchOptions& o, int rank, int world) {
  std::unique_ptr<c_api::Groups> c_groups;
  std::shared_ptr<ProcessGroup> pg;
  if (o.api == "c") {
    c_groups = c_api::init(o.backend, 120000);
    pg = c_groups->world_cpp();
    c_world = c_groups->world;
  } else {
    InitOptions io;
    io.backend = o.backend;
    io.rank = rank;
    io.world_size = world;
    io.timeout = std::chrono::seconds(120);
    pg = init_process_group(io);
  }
  const at::ScalarType dtype = parse_dtype(o.dtype);
  const size_t es = at::elementSize(dtype);
  const size_t min_bytes = std::max(parse_bytes(o.min_bytes), es);
  const size_t max_bytes = parse_bytes(o.max_bytes);
  const double step = o.step_factor;
  if (step < 2) throw UsageError("tdist-bench: --step-factor must be at least 2");
  const std::vector<std::string> ops = parse_ops(o.op);
  double mem_one = o.memcpy_one, mem_all = o.memcpy_all;
  const int cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  if (rank == 0 && mem_all == 0) {  // run by an outside launcher: measure here
    mem_one = memcpy_gbps_one();
    mem_all = memcpy_gbps_all(cores);
  }
  const double copy_rate = usable_copy_rate(world, cores, mem_one, mem_all);
  const bool symmetric = o.symmetric && pg->has_symmetric_memory();
  if (o.symmetric && !symmetric && rank == 0) {
    std::printf("# (backend %s has no symmetric memory: ordinary tensors)\n", pg->backend_name().c_str());
  }

  const Overheads overhead = op_overheads(*pg);
  if (rank == 0) {
    std::printf("# per-op overhead: %.0f ns synchronous (async_op=false), %.0f ns queued and waited for (all_reduce "
                "of one float32 on a group of one rank: what the process group adds to every op)\n",
                overhead.sync_ns, overhead.async_ns);
    std::printf("# timed calls: %s%s%s\n", o.async ? "queued, then waited for (async_op=true, then Work::wait)"
                                                   : "synchronous (async_op=false)",
                c_groups ? ", through the C ABI" : "", o.barrier_each ? ", each after an untimed barrier" : "");
  }
  c_api::Overhead c_overhead;
  if (c_groups) {
    c_overhead = c_api::overheads(*c_groups, o.async);
    if (rank == 0) {
      std::printf("# C ABI: %.0f ns per op, C++: %.0f ns (%s all_reduce of one float32, one rank, taking turns): "
                  "the C ABI adds %.0f ns (median of the rounds' differences)\n",
                  c_overhead.c_ns, c_overhead.cpp_ns, o.async ? "queued" : "synchronous",
                  c_overhead.extra_ns);
    }
  }
  JsonRows json;
  for (const auto& op : ops) {
    if (rank == 0) {
      std::printf("\n# %s, backend %s, world size %d, %s, %s tensors; ceiling: %.3g x S bytes of memory traffic at "
                  "%.2f GB/s copied\n",
                  op.c_str(), pg->backend_name().c_str(), world, c10::toString(dtype),
                  symmetric ? "symmetric" : "ordinary", traffic_per_byte(op, world), copy_rate);
      std::printf("%12s %12s %9s %7s %11s %11s %9s %9s %9s %8s %7s\n", "size(B)", "count", "type", "redop",
                  "time(us)", "p99(us)", "algbw", "busbw", "ceiling", "of ceil", "#wrong");
      std::fflush(stdout);
    }
    for (double bytes_d = static_cast<double>(min_bytes); bytes_d <= static_cast<double>(max_bytes) * 1.0001;
         bytes_d *= step) {
      // Counts divisible by the world size, for the sharded ops.
      int64_t count = static_cast<int64_t>(bytes_d / es);
      if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") count = count / world * world;
      if (count == 0) continue;
      const size_t bytes = static_cast<size_t>(count) * es;
      Buffers b = make_buffers(*pg, op, count, dtype, symmetric);
      const int64_t wrong = check(*pg, op, b);
      // Warm up, then agree on an iteration count that fills o.seconds.
      const c_api::BenchOp k = c_api::bench_op(op);
      for (int i = 0; i < 3; ++i) run_op(*pg, k, b, o.async);
      const std::vector<double> est = timed_samples(*pg, k, b, 3, o.async, o.barrier_each);
      const int iters =
          static_cast<int>(std::clamp(o.seconds / std::max(percentile(est, 50), 1e-7), 20.0, 20000.0));
      const std::vector<double> samples = timed_samples(*pg, k, b, iters, o.async, o.barrier_each);
      at::Tensor wrong_t = at::tensor({wrong}, at::kLong);
      pg->all_reduce(wrong_t)->wait();
      if (rank == 0) {
        const double med = percentile(samples, 50), p99 = percentile(samples, 99);
        const double algbw = bytes / med / 1e9;
        const double busbw = algbw * bus_factor(op, world);
        const double ceiling = ceiling_busbw(op, world, copy_rate);
        const double of_ceiling = ceiling > 0 ? busbw / ceiling : 0.0;
        const bool reduces = op == "all_reduce" || op == "reduce" || op == "reduce_scatter";
        std::printf("%12zu %12lld %9s %7s %11.2f %11.2f %9.2f %9.2f %9.2f %8.2f %7lld\n", bytes,
                    static_cast<long long>(count), c10::toString(dtype), reduces ? "sum" : "none", med * 1e6,
                    p99 * 1e6, algbw, busbw, ceiling, of_ceiling, static_cast<long long>(wrong_t.item<int64_t>()));
        std::fflush(stdout);
        json.begin_row();
        json.field("op", op);
        json.field("backend", pg->backend_name());
        json.field("world_size", world);
        json.field("dtype", std::string(c10::toString(dtype)));
        json.field("symmetric", symmetric ? 1.0 : 0.0);
        json.field("bytes", static_cast<double>(bytes));
        json.field("time_us", med * 1e6);
        json.field("p99_us", p99 * 1e6);
        json.field("iters", iters);
        json.field("algbw_GBps", algbw);
        json.field("busbw_GBps", busbw);
        json.field("ceiling_busbw_GBps", ceiling);
        json.field("of_ceiling", of_ceiling);
        json.field("memcpy_one_core_GBps", mem_one);
        json.field("memcpy_all_cores_GBps", mem_all);
        json.field("wrong", static_cast<double>(wrong_t.item<int64_t>()));
        json.field("async_op", o.async ? 1.0 : 0.0);
        json.field("barrier_each", o.barrier_each ? 1.0 : 0.0);
        json.field("op_overhead_ns", overhead.sync_ns);
        json.field("op_overhead_async_ns", overhead.async_ns);
        json.field("api", o.api);
        if (c_groups) {
          json.field("c_api_op_ns", c_overhead.c_ns);
          json.field("cpp_op_ns", c_overhead.cpp_ns);
          json.field("c_api_extra_ns", c_overhead.extra_ns);
        }
      }
    }
  }
  pg->barrier()->wait();
  c_world = nullptr;
  return rank == 0 ? json.finish(o.json) : 0;
}

}  // namespace

void CollectivesBenchOptions::add_to(CLI::App& mode) {
  using cli::both_spellings;
  mode.add_option("--backend", backend, "shm, gloo, mpi or another registered one")->capture_default_str();
  mode.add_option(both_spellings("world-size"), world_size, "ranks, started here")->check(cli::in_range(1, 256))
      ->capture_default_str();
  mode.add_option("--op", op,
                  "all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, a comma-separated list, or all")
      ->capture_default_str();
  mode.add_flag("--symmetric", symmetric, "buffers in symmetric memory (ProcessGroup::empty_symmetric)");
  mode.add_option("--api", api, "cpp: the C++ API; c: the C ABI, as a language binding calls it")
      ->check(CLI::IsMember({"cpp", "c"}))
      ->capture_default_str();
  mode.add_flag("--async", async,
                "queue each timed op and wait for its Work (async_op=true); default: synchronous calls");
  mode.add_flag("--barrier-each", barrier_each,
                "an untimed barrier before each timed op: no rank runs ahead (a small broadcast's root would)");
  const CLI::Validator size(
      [](std::string& s) -> std::string {
        try {
          parse_bytes(s);
          return {};
        } catch (const UsageError& e) {
          return e.what();
        }
      },
      "SIZE");
  mode.add_option(both_spellings("min-bytes"), min_bytes, "smallest size (K, M, G: powers of 1024)")
      ->check(size)
      ->capture_default_str();
  mode.add_option(both_spellings("max-bytes"), max_bytes, "largest size")->check(size)->capture_default_str();
  mode.add_option(both_spellings("step-factor"), step_factor, "size ratio between rows")
      ->check(cli::in_range(2, 1024))
      ->capture_default_str();
  mode.add_option("--dtype", dtype, "element type")->capture_default_str();
  mode.add_option("--seconds", seconds, "timed per row")->check(cli::in_range(0.001, 3600))->capture_default_str();
  mode.add_option("--json", json, "also write the rows here")->type_name("FILE");
  // Passed to the ranks by the parent, which measures them once.
  mode.add_option(both_spellings("memcpy-one"), memcpy_one)->check(cli::in_range(0, 1e9))->group("");
  mode.add_option(both_spellings("memcpy-all"), memcpy_all)->check(cli::in_range(0, 1e9))->group("");
}

int collectives_bench(const CollectivesBenchOptions& o, const std::vector<std::string>& args) {
  // Under a launcher: be one rank.
  if (std::getenv("RANK") && std::getenv("WORLD_SIZE") && std::getenv("MASTER_ADDR")) {
    return run_rank(o, std::atoi(std::getenv("RANK")), std::atoi(std::getenv("WORLD_SIZE")));
  }
  // The ranks' arguments checked here first: a bad one is a usage error
  // (exit 2), not a rank that fails.
  parse_dtype(o.dtype);
  parse_ops(o.op);
  if (parse_bytes(o.min_bytes) > parse_bytes(o.max_bytes)) {
    throw UsageError("tdist-bench collectives: --min-bytes " + o.min_bytes + " is over --max-bytes " + o.max_bytes);
  }
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const double one = memcpy_gbps_one();
  const double all = memcpy_gbps_all(static_cast<int>(cores));
  std::printf("# memcpy bandwidth: %.2f GB/s on one core, %.2f GB/s on all %ld cores at once\n", one, all, cores);
  std::fflush(stdout);
  return spawn_ranks("collectives", o.world_size, args,
                     {"--memcpy-one", std::to_string(one), "--memcpy-all", std::to_string(all)});
}

}  // namespace tdist::bench
