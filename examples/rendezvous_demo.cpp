// The rendezvous demo: every rank joins through env:// (the TCPStore hosted by
// rank 0), publishes what it is, and prints what it learned of the others.
//
//   build/bin/tdist-run --nproc-per-node 4 build/bin/rendezvous_demo
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "tdist/tdist.h"

int main() {
  try {
    const auto start = std::chrono::steady_clock::now();
    tdist::RendezvousOptions options;
    options.init_method = "env://";
    options.timeout = std::chrono::seconds(60);
    tdist::RendezvousResult world = tdist::rendezvous(options);
    const auto joined = std::chrono::steady_clock::now();
    auto& store = *world.store;

    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    store.set("demo/info/" + std::to_string(world.rank),
              std::string(host) + " pid " + std::to_string(getpid()));
    const int64_t ticket = store.add("demo/tickets", 1);  // an atomic counter all ranks share

    std::vector<std::string> keys;
    for (int r = 0; r < world.world_size; ++r) keys.push_back("demo/info/" + std::to_string(r));
    const auto infos = store.multi_get(keys);

    std::string line = "rank " + std::to_string(world.rank) + " of " + std::to_string(world.world_size) +
                       " (tdist " + tdist::version() + ", LibTorch " + tdist::torch_version() + ") joined in " +
                       std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(joined - start).count()) +
                       " ms, drew ticket " + std::to_string(ticket) + "; peers:";
    for (int r = 0; r < world.world_size; ++r) {
      line += " [" + std::to_string(r) + "] " + tdist::to_string(infos[r]) + (r + 1 < world.world_size ? ";" : "");
    }
    std::printf("%s\n", line.c_str());

    // Leave together: rank 0 owns the server and must outlive the others' requests.
    if (store.add("demo/done", 1) == world.world_size) store.set("demo/all_done", "1");
    if (world.rank == 0) {
      store.wait({"demo/all_done"});
      std::printf("all %d ranks rendezvoused through the TCPStore at %s:%s; %lld keys in the store\n",
                  world.world_size, std::getenv("MASTER_ADDR"), std::getenv("MASTER_PORT"),
                  static_cast<long long>(store.num_keys()));
    }
    return 0;
  } catch (const tdist::Error& e) {
    std::fprintf(stderr, "rendezvous_demo: %s\n", e.what());
    return 1;
  }
}
