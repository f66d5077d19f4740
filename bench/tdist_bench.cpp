// tdist-bench MODE [options]: benchmarks that print tables (and JSON on
// request). Modes: store, collectives, ddp, fsdp, checkpoint.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/bench_common.h"
#include "store/socket.h"
#include "tdist/errors.h"
#include "util/cli.h"
#include "util/env.h"
#include "util/open_file.h"

namespace tdist::bench {

const char* source_dir() { return TDIST_SOURCE_DIR; }

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(std::min<double>(v.size() - 1, std::floor(p / 100.0 * v.size())));
  return v[i];
}

void JsonRows::field(const std::string& k, double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    rows_.back()[k] = static_cast<int64_t>(v);
  } else if (std::isfinite(v)) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    rows_.back()[k] = std::strtod(buf, nullptr);
  } else {
    rows_.back()[k] = nullptr;  // JSON has no NaN or infinity
  }
}

int JsonRows::finish(const std::string& path) const {
  std::fflush(stdout);
  if (path.empty()) return 0;
  // A regular file only: a FIFO or device there is an error, never a hang.
  std::string error;
  const int fd = detail::open_regular(path, O_WRONLY | O_CREAT | O_TRUNC, error, 0644);
  if (fd < 0) {
    std::fprintf(stderr, "tdist-bench: --json %s\n", error.c_str());
    return 1;
  }
  const std::string text = rows_.dump(2) + "\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const bool closed = ::close(fd) == 0;
  const bool ok = done == text.size() && closed;
  if (ok) return 0;
  std::fprintf(stderr, "tdist-bench: cannot write %s\n", path.c_str());
  return 1;
}

int spawn_ranks(const std::string& mode, int world, const std::vector<std::string>& args,
                const std::vector<std::string>& extra) {
  const uint16_t port = detail::find_free_port();
  std::vector<pid_t> kids;
  for (int r = 0; r < world; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("tdist-bench: fork failed");
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);  // every rank on this host, as tdist-run
      setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (!std::getenv("OMP_NUM_THREADS")) setenv("OMP_NUM_THREADS", "1", 1);
      std::vector<std::string> a = {"/proc/self/exe", mode};
      a.insert(a.end(), args.begin(), args.end());
      a.insert(a.end(), extra.begin(), extra.end());
      std::vector<char*> cargs;
      for (auto& s : a) cargs.push_back(s.data());
      cargs.push_back(nullptr);
      execv("/proc/self/exe", cargs.data());
      _exit(127);
    }
    kids.push_back(pid);
  }
  // Wait for all; the first failure takes the others down, so that a rank
  // that died cannot leave the rest waiting out their timeouts.
  int rc = 0;
  size_t left = kids.size();
  while (left > 0) {
    int st = 0;
    const pid_t k = waitpid(-1, &st, 0);
    if (k < 0) break;
    if (std::find(kids.begin(), kids.end(), k) == kids.end()) continue;
    --left;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      if (rc == 0) {
        const int rank = static_cast<int>(std::find(kids.begin(), kids.end(), k) - kids.begin());
        std::fprintf(stderr, "tdist-bench: rank %d %s %d\n", rank, WIFEXITED(st) ? "exited with" : "was killed by signal",
                     WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
      }
      rc = 1;
      for (pid_t other : kids) kill(other, SIGTERM);
    }
  }
  return rc;
}

}  // namespace tdist::bench

int main(int argc, char** argv) {
  using namespace tdist::bench;
  CLI::App app{"Benchmarks that print tables (and JSON on request).", "tdist-bench"};
  app.require_subcommand(1);
  StoreBenchOptions store;
  CollectivesBenchOptions collectives;
  DdpBenchOptions ddp;
  FsdpBenchOptions fsdp;
  CheckpointBenchOptions checkpoint;
  store.add_to(*app.add_subcommand("store", "set/get/add per second and latency, 1..N clients"));
  collectives.add_to(*app.add_subcommand("collectives", "the nccl-tests table for each collective, against memcpy"));
  ddp.add_to(*app.add_subcommand("ddp", "DistributedDataParallel step time against one process alone"));
  fsdp.add_to(*app.add_subcommand("fsdp", "FSDP's memory per rank against the ZeRO bounds, and its step time against DDP's"));
  checkpoint.add_to(*app.add_subcommand("checkpoint", "sharded checkpoint save, load, consolidate and reshard against a plain copy"));
  tdist::cli::parse_or_exit(app, argc, argv);
  // The mode's own arguments, for the ranks it starts.
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (app.got_subcommand("store")) return store_bench(store);
    if (app.got_subcommand("collectives")) return collectives_bench(collectives, args);
    if (app.got_subcommand("fsdp")) return fsdp_bench(fsdp, args);
    if (app.got_subcommand("checkpoint")) return checkpoint_bench(checkpoint, args);
    return ddp_bench(ddp, args);
  } catch (const tdist::UsageError& e) {  // a bad command line found past parsing
    tdist::cli::usage_error("tdist-bench", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-bench: %s\n", e.what());
    return 1;
  }
}
