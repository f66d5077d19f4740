// tdist-bench MODE [options]: benchmarks that print tables (and JSON on
// request). Modes: store, collectives, ddp.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <algorithm>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/bench_common.h"
#include "store/socket.h"
#include "tdist/errors.h"
#include "util/env.h"

namespace tdist::bench {

Args::Args(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) throw UsageError("tdist-bench: unexpected argument '" + a + "'");
    std::string name = a.substr(2), value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0) {
      value = argv[++i];
    } else {
      value = "1";
    }
    for (auto& ch : name) if (ch == '_') ch = '-';
    values_[name] = value;
  }
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

double Args::number(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  double v = std::strtod(it->second.c_str(), &end);
  if (end == it->second.c_str() || *end != '\0' || !std::isfinite(v)) {
    throw UsageError("tdist-bench: --" + name + " needs a number, got '" + it->second + "'");
  }
  return v;
}

void Args::reject_unknown(const std::vector<std::string>& known) const {
  for (const auto& [k, v] : values_) {
    if (std::find(known.begin(), known.end(), k) == known.end()) {
      throw UsageError("tdist-bench: unknown option --" + k);
    }
  }
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(std::min<double>(v.size() - 1, std::floor(p / 100.0 * v.size())));
  return v[i];
}

void JsonRows::field(const std::string& k, const std::string& v) {
  std::string esc;
  for (char c : v) {
    if (c == '"' || c == '\\') esc += '\\';
    esc += c;
  }
  rows_.back().emplace_back(k, "\"" + esc + "\"");
}

void JsonRows::field(const std::string& k, double v) {
  char buf[64];
  // Whole numbers (bytes, counts) exactly; measurements to 6 digits.
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.6g", v);
  }
  rows_.back().emplace_back(k, buf);
}

bool JsonRows::write(const std::string& path) const {
  std::ofstream f(path);
  f << "[\n";
  for (size_t r = 0; r < rows_.size(); ++r) {
    f << "  {";
    for (size_t i = 0; i < rows_[r].size(); ++i) {
      f << (i ? ", " : "") << "\"" << rows_[r][i].first << "\": " << rows_[r][i].second;
    }
    f << "}" << (r + 1 < rows_.size() ? "," : "") << "\n";
  }
  f << "]\n";
  return static_cast<bool>(f);
}

int spawn_ranks(const std::string& mode, int world, const std::vector<std::string>& extra, int argc, char** argv) {
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
      a.insert(a.end(), extra.begin(), extra.end());
      for (int i = 0; i < argc; ++i) a.push_back(argv[i]);
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
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0) {
    std::fprintf(stderr,
                 "usage: tdist-bench MODE [options]\n"
                 "  store [--store tcp|file|hash] [--clients 1,4,16] [--seconds S] [--value-bytes N] [--json FILE]\n"
                 "  collectives [--backend shm] [--world-size 2] [--op all_reduce|broadcast|reduce|all_gather|\n"
                 "              reduce_scatter|all_to_all|all] [--min-bytes 4] [--max-bytes 256M] [--step-factor 4]\n"
                 "              [--dtype float32] [--seconds 0.25] [--json FILE]\n"
                 "  ddp [--backend shm] [--world-size 2] [--steps 10] [--rounds 10]\n"
                 "      [--variants local,ddp_allreduce,ddp_fp16,...,status_quo,after_coalesced] [--bucket-cap-mb 25]\n"
                 "      [--first-bucket-cap-mb 1] [--json FILE]\n");
    return 2;
  }
  try {
    if (std::strcmp(argv[1], "collectives") == 0) return tdist::bench::collectives_bench(argc - 2, argv + 2);
    if (std::strcmp(argv[1], "ddp") == 0) return tdist::bench::ddp_bench(argc - 2, argv + 2);
    tdist::bench::Args args(argc - 2, argv + 2);
    if (std::strcmp(argv[1], "store") == 0) return tdist::bench::store_bench(args);
    std::fprintf(stderr, "tdist-bench: unknown mode '%s' (known: store, collectives, ddp)\n", argv[1]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-bench: %s\n", e.what());
    return 1;
  }
}
