// tdist-bench store: operations per second and p50/p99 latency of set, get
// and add with 1, 4 and 16 concurrent clients, each a thread with its own
// connection (for tcp) or its own store object (for file).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>
#include <thread>

#include "bench/bench_common.h"
#include "tdist/store.h"
#include "util/cli.h"
#include "util/env.h"

namespace tdist::bench {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto v = detail::parse_int(item);
    if (!v || *v < 1 || *v > 1024) throw UsageError("tdist-bench store: bad --clients entry '" + item + "'");
    out.push_back(static_cast<int>(*v));
  }
  return out;
}

struct Result {
  double ops_per_s = 0;
  double p50_us = 0;
  double p99_us = 0;
  size_t ops = 0;
};

}  // namespace

void StoreBenchOptions::add_to(CLI::App& mode) {
  using cli::both_spellings;
  mode.add_option("--store", store, "which store")->check(CLI::IsMember({"tcp", "file", "hash"}))->capture_default_str();
  mode.add_option("--clients", clients, "concurrent clients, one run per entry")->type_name("N,N,...")
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            try {
              parse_list(s);
              return {};
            } catch (const UsageError& e) {
              return e.what();
            }
          },
          "N,N,..."))
      ->capture_default_str();
  mode.add_option("--seconds", seconds, "per op and client count")->check(cli::in_range(0.001, 3600))
      ->capture_default_str();
  mode.add_option(both_spellings("value-bytes"), value_bytes, "size of each value")
      ->check(cli::in_range(0, 1 << 24))
      ->capture_default_str();
  mode.add_option("--json", json, "also write the rows here")->type_name("FILE");
}

int store_bench(const StoreBenchOptions& o) {
  const std::string& kind = o.store;
  const std::vector<int> client_counts = parse_list(o.clients);
  const double seconds = o.seconds;
  const size_t value_bytes = o.value_bytes;
  if (kind != "tcp" && kind != "file" && kind != "hash") {
    throw UsageError("tdist-bench store: --store must be tcp, file or hash");
  }

  std::unique_ptr<TCPStoreServer> server;
  std::shared_ptr<HashStore> hash;
  const std::string file_path = "/tmp/tdist-bench-store-" + std::to_string(getpid());
  std::shared_ptr<FileStore> file_keepalive;
  if (kind == "tcp") server = std::make_unique<TCPStoreServer>(TCPStoreServerOptions{"127.0.0.1", 0, {}, {}});
  if (kind == "hash") hash = std::make_shared<HashStore>();
  if (kind == "file") file_keepalive = std::make_shared<FileStore>(file_path);
  auto connect = [&]() -> std::shared_ptr<Store> {
    if (kind == "tcp") {
      TCPStoreOptions o;
      o.port = server->port();
      return std::make_shared<TCPStore>("127.0.0.1", o);
    }
    if (kind == "file") return std::make_shared<FileStore>(file_path);
    return hash;
  };

  std::printf("# tdist-bench store: %s store, %zu-byte values, %.1f s per cell, %ld cores\n", kind.c_str(),
              value_bytes, seconds, sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("%-6s %8s %-5s %12s %10s %10s\n", "store", "clients", "op", "ops/s", "p50 us", "p99 us");
  JsonRows json;
  const Bytes value(value_bytes, 0x5a);
  for (const char* op : {"set", "get", "add"}) {
    for (int clients : client_counts) {
      std::vector<std::shared_ptr<Store>> stores;
      for (int c = 0; c < clients; ++c) stores.push_back(connect());
      for (int c = 0; c < clients; ++c) stores[c]->set("bench/key/" + std::to_string(c), value);
      std::atomic<bool> go{false};
      std::vector<std::vector<double>> lat(clients);
      std::vector<std::thread> threads;
      const auto run_for = std::chrono::duration<double>(seconds);
      for (int c = 0; c < clients; ++c) {
        threads.emplace_back([&, c] {
          Store& s = *stores[c];
          const std::string key = "bench/key/" + std::to_string(c);
          while (!go.load()) std::this_thread::yield();
          const auto start = Clock::now();
          auto& l = lat[c];
          l.reserve(1 << 16);
          while (Clock::now() - start < run_for) {
            const auto t0 = Clock::now();
            if (op[0] == 's') s.set(key, value);
            else if (op[0] == 'g') s.get(key);
            else s.add("bench/counter", 1);
            l.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          }
        });
      }
      const auto t0 = Clock::now();
      go = true;
      for (auto& t : threads) t.join();
      const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
      std::vector<double> all;
      for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
      Result r;
      r.ops = all.size();
      r.ops_per_s = static_cast<double>(all.size()) / elapsed;
      r.p50_us = percentile(all, 50);
      r.p99_us = percentile(all, 99);
      std::printf("%-6s %8d %-5s %12.0f %10.1f %10.1f\n", kind.c_str(), clients, op, r.ops_per_s, r.p50_us,
                  r.p99_us);
      std::fflush(stdout);
      json.begin_row();
      json.field("store", kind);
      json.field("clients", clients);
      json.field("op", std::string(op));
      json.field("value_bytes", static_cast<double>(value_bytes));
      json.field("ops_per_s", r.ops_per_s);
      json.field("p50_us", r.p50_us);
      json.field("p99_us", r.p99_us);
    }
  }
  return json.finish(o.json);
}

}  // namespace tdist::bench
