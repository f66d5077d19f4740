// tdist-bench MODE [options]: benchmarks that print tables (and JSON on
// request). Modes: store.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <algorithm>

#include "bench/bench_common.h"
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

}  // namespace tdist::bench

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0) {
    std::fprintf(stderr,
                 "usage: tdist-bench MODE [options]\n"
                 "  store [--store tcp|file|hash] [--clients 1,4,16] [--seconds S] [--value-bytes N] [--json FILE]\n"
                 "  collectives [--backend shm] [--world-size 2] [--op all_reduce|broadcast|reduce|all_gather|\n"
                 "              reduce_scatter|all_to_all|all] [--min-bytes 4] [--max-bytes 256M] [--step-factor 4]\n"
                 "              [--dtype float32] [--seconds 0.25] [--json FILE]\n");
    return 2;
  }
  try {
    if (std::strcmp(argv[1], "collectives") == 0) return tdist::bench::collectives_bench(argc - 2, argv + 2);
    tdist::bench::Args args(argc - 2, argv + 2);
    if (std::strcmp(argv[1], "store") == 0) return tdist::bench::store_bench(args);
    std::fprintf(stderr, "tdist-bench: unknown mode '%s' (known: store, collectives)\n", argv[1]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-bench: %s\n", e.what());
    return 1;
  }
}
